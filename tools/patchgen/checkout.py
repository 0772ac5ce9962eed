"""``--tree``: a patch for any checkout (its HEAD; or the files on disk of a tree that is not a
git checkout), its facts derived from the tree and checked, the patch checked with
``git apply --check`` there.
"""

import subprocess
from pathlib import Path
from typing import Dict, Optional, Tuple

from .facts import check_facts, derive_facts
from .layout import TOUCHED, PatchError
from .render import render_patch
from .sources import files_from_git, files_sha, git_dir_of
from .targets import Target


def tree_files(tree: Path) -> Tuple[Dict[str, str], Optional[str]]:
    """The touched files of ``tree`` and its HEAD commit (None: not a git checkout).

    In a git checkout the files are read from HEAD (the patch is for that commit); otherwise
    (an unpacked or installed megatron-core) from disk.
    """
    res = subprocess.run(['git', '-C', str(tree), 'rev-parse', '--show-toplevel', 'HEAD'],
                         capture_output=True, text=True)
    lines = res.stdout.split()
    if res.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == tree.resolve():
        commit = lines[1]
        return files_from_git(git_dir_of(tree), commit, TOUCHED), commit
    missing = [p for p in TOUCHED if not (tree / p).is_file()]
    if missing:
        raise PatchError(f'{tree}: not the root of a Megatron tree (no {", ".join(missing)})')
    return {p: (tree / p).read_text() for p in TOUCHED}, None


def tree_target(tree: Path, files: Dict[str, str], commit: Optional[str], output: Path) -> Target:
    """A :class:`Target` for a checkout, its facts derived from the tree itself."""
    facts = derive_facts(files)
    check_facts(str(tree), facts)
    if commit:
        return Target(
            name=f'{tree.name}-{commit[:9]}', description=f'the checkout {tree} at {commit[:9]}',
            facts=facts, commit=commit, repo=str(tree), patch_file=output,
        )
    return Target(
        name=tree.name, description=f'the tree {tree}', facts=facts,
        file_sha256={p: files_sha(files[p]) for p in TOUCHED}, patch_file=output,
    )


def patch_tree(tree: Path, output: Optional[Path] = None) -> Path:
    """Write a patch for the checkout ``tree`` (its HEAD) and check it with ``git apply --check``.

    Raises :class:`PatchError` naming the fact the generator does not know, or why the patch
    does not apply; nothing is left behind then.
    """
    tree = tree.expanduser().resolve()
    if not tree.is_dir():
        raise PatchError(f'{tree}: no such directory')
    files, commit = tree_files(tree)
    if output is None:
        output = Path.cwd() / f'megatron-mtp-tv-{commit[:9] if commit else tree.name}.patch'
    target = tree_target(tree, files, commit, output.resolve())
    text = render_patch(target, files)
    output = target.patch_path
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    res = subprocess.run(['git', 'apply', '--check', str(output)], cwd=tree,
                         capture_output=True, text=True)
    if res.returncode:
        output.unlink()
        raise PatchError(
            f'{tree}: the patch for {"commit " + commit[:9] if commit else "this tree"} does not '
            f'apply to the files there (local changes, or already patched?):\n'
            f'{res.stderr.strip()}'
        )
    return output
