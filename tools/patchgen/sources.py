"""Pristine Megatron sources, always pinned: the megatron-core 0.19.2 wheel (or the installed
distribution when it is that release) by sha256, git targets by commit from any clone holding it,
and this project's cache folder that the wheel is downloaded into.
"""

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .layout import TOUCHED, PatchError
from .targets import TARGETS, Target

WHEEL_REQUIREMENT = 'megatron-core==0.19.2'
WHEEL_NAME = 'megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl'
WHEEL_SHA256 = '8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5'


def cache_dir() -> Path:
    """This project's cache folder (the wheel, the patched tree), created if it does not exist.

    ``$MTP_TV_CACHE`` if set and not empty, else ``~/.cache/megatron-mtp-tv``. Read at each call,
    not at import, so that a caller (CI, a test) can point it elsewhere after importing this
    module; created here because on a fresh machine nothing else creates it and every writer
    (``pip download -d``, ``tempfile.mkdtemp(dir=...)``) needs it to exist.
    """
    path = Path(os.environ.get('MTP_TV_CACHE') or Path.home() / '.cache' / 'megatron-mtp-tv')
    path.mkdir(parents=True, exist_ok=True)
    return path


def files_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def wheel_path(download: bool = True) -> Path:
    """The megatron-core 0.19.2 wheel (cached; downloaded from the registry with pip)."""
    cache = cache_dir()
    path = cache / WHEEL_NAME
    if not path.exists() and download:
        subprocess.run(
            [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary=:all:',
             '--platform', 'manylinux_2_28_x86_64', '--python-version', '3.12',
             '--implementation', 'cp', '-d', str(cache), WHEEL_REQUIREMENT],
            check=True,
        )
    if not path.exists():
        raise PatchError(f'{WHEEL_NAME} not found in {cache}')
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise PatchError(f'{path}: sha256 {digest} != pinned {WHEEL_SHA256}')
    return path


def files_from_wheel(paths: Sequence[str]) -> Dict[str, str]:
    with zipfile.ZipFile(wheel_path()) as zf:
        return {p: zf.read(p).decode() for p in paths}


def files_from_installed(paths: Sequence[str]) -> Optional[Dict[str, str]]:
    """The files of the installed megatron-core, if it is 0.19.2 (None otherwise)."""
    try:
        dist = importlib.metadata.distribution('megatron-core')
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != '0.19.2':
        return None
    out = {}
    for p in paths:
        located = Path(dist.locate_file(p))
        if not located.exists():
            return None
        out[p] = located.read_text()
    return out


def files_0192(paths: Sequence[str] = TOUCHED) -> Dict[str, str]:
    """Pristine 0.19.2 files, verified against the pinned sha256 (installed copy, else wheel)."""
    pins = TARGETS['megatron-core-0.19.2'].file_sha256
    files = files_from_installed(paths)
    if files is None or any(pins.get(p) and files_sha(files[p]) != pins[p] for p in paths):
        files = files_from_wheel(paths)
    for p in paths:
        if pins.get(p) and files_sha(files[p]) != pins[p]:
            raise PatchError(f'{p}: sha256 {files_sha(files[p])} != pinned {pins[p]}')
    return files


def files_from_git(git_dir: Path, commit: str, paths: Sequence[str]) -> Dict[str, str]:
    out = {}
    for p in paths:
        res = subprocess.run(
            ['git', f'--git-dir={git_dir}', 'show', f'{commit}:{p}'],
            capture_output=True, text=True,
        )
        if res.returncode:
            raise PatchError(f'git show {commit}:{p} in {git_dir}: {res.stderr.strip()}')
        out[p] = res.stdout
    return out


def git_dir_of(path: Path) -> Path:
    res = subprocess.run(
        ['git', '-C', str(path), 'rev-parse', '--absolute-git-dir'], capture_output=True, text=True
    )
    if res.returncode:  # a bare repository given as its directory
        res = subprocess.run(
            ['git', f'--git-dir={path}', 'rev-parse', '--absolute-git-dir'],
            capture_output=True, text=True,
        )
    if res.returncode:
        raise PatchError(f'{path} is not a git repository')
    return Path(res.stdout.strip())


def has_commit(git_dir: Path, commit: str) -> bool:
    res = subprocess.run(
        ['git', f'--git-dir={git_dir}', 'cat-file', '-e', f'{commit}^{{commit}}'],
        capture_output=True,
    )
    return res.returncode == 0


def clones(megatron_lm) -> List[Path]:
    """``--megatron-lm`` / ``MTP_TV_MEGATRON_LM`` as a list of clones (``os.pathsep``-joined)."""
    if megatron_lm is None:
        return []
    if isinstance(megatron_lm, (str, Path)):
        megatron_lm = [megatron_lm]
    out = []
    for item in megatron_lm:
        out += [Path(p) for p in str(item).split(os.pathsep) if p]
    return out


def pristine_files(target: Target, megatron_lm) -> Optional[Dict[str, str]]:
    """The target's pristine files, or None if its source is not available here.

    ``megatron_lm``: clones of Megatron-LM (a path, or several; bare or not): the first one
    that has the target's commit is read.
    """
    if target.commit is None:
        return files_0192()
    for clone in clones(megatron_lm):
        git_dir = git_dir_of(clone)
        if has_commit(git_dir, target.commit):
            return files_from_git(git_dir, target.commit, TOUCHED)
    return None

