"""The committed patches in ``patches/`` are what ``tools/make_patches.py`` makes of the current
package source, and they apply.

* megatron-core 0.19.2: regenerated here from the pristine files (the installed distribution
  when it is that release, verified by sha256, else the registry wheel) and compared byte for
  byte; applied with ``git apply`` to those files.
* radixark/Megatron-LM fork patches: without the fork, every package file in them must equal the
  package source and the lines they add to / remove from Megatron files must equal what the
  generator renders for that tree now. With a clone of the fork in ``MTP_TV_MEGATRON_LM`` they
  are regenerated and applied too.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_make_patches():
    spec = importlib.util.spec_from_file_location('make_patches', ROOT / 'tools' / 'make_patches.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules['make_patches'] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mp = _load_make_patches()
FORK = os.environ.get('MTP_TV_MEGATRON_LM')
needs_git = pytest.mark.skipif(shutil.which('git') is None, reason='git not installed')


@pytest.mark.parametrize('name', sorted(mp.TARGETS))
def test_committed_patch_matches_package_source(name):
    target = mp.TARGETS[name]
    assert target.patch_path.exists(), f'{target.patch_path} missing: run tools/make_patches.py'
    problems = mp.check_offline(target, target.patch_path.read_text())
    assert not problems, 'stale patch (run python tools/make_patches.py):\n' + '\n'.join(problems)


def test_0192_patch_regenerates_identically():
    target = mp.TARGETS['megatron-core-0.19.2']
    text = mp.render_patch(target, mp.files_0192())
    assert text == target.patch_path.read_text(), 'stale: run python tools/make_patches.py'


def _apply(tmp_path, files, patch):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for args in (['--check'], []):
        res = subprocess.run(
            ['git', 'apply', *args, str(patch)], cwd=tmp_path, capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr


@needs_git
def test_0192_patch_applies_and_gives_the_generated_tree(tmp_path):
    files = mp.files_0192()
    target = mp.TARGETS['megatron-core-0.19.2']
    _apply(tmp_path, files, target.patch_path)
    for rel, text in mp.patched_files(files).items():
        assert (tmp_path / rel).read_text() == text, rel


@needs_git
@pytest.mark.skipif(not FORK, reason='set MTP_TV_MEGATRON_LM to a clone of radixark/Megatron-LM')
@pytest.mark.parametrize('name', [n for n, t in sorted(mp.TARGETS.items()) if t.commit])
def test_fork_patch_regenerates_and_applies(name, tmp_path):
    target = mp.TARGETS[name]
    files = mp.pristine_files(target, Path(FORK))
    assert mp.render_patch(target, files) == target.patch_path.read_text()
    _apply(tmp_path, files, target.patch_path)


def test_stale_package_file_is_detected(monkeypatch):
    target = mp.TARGETS['miles-main-2e64d788b']
    text = target.patch_path.read_text()
    modules = mp.shipped_modules()
    monkeypatch.setattr(
        mp, 'shipped_modules', lambda: {**modules, 'config.py': modules['config.py'] + '# new\n'}
    )
    problems = mp.check_offline(target, text)
    assert any('mtp_tv/config.py: differs' in p for p in problems), problems


def test_stale_field_docstring_is_detected(monkeypatch):
    target = mp.TARGETS['miles-main-20260819-235952df6']
    text = target.patch_path.read_text()
    block = mp.fields_block()
    monkeypatch.setattr(mp, 'fields_block', lambda: block.replace('Training objective', 'Objective'))
    problems = mp.check_offline(target, text)
    assert any('transformer_config.py: added lines differ' in p for p in problems), problems


def test_shipped_modules_are_relocatable_and_plugin_only_ones_stay_out():
    shipped = mp.shipped_modules()
    assert {'__init__.py', 'config.py', 'mtp_loss.py', 'metrics.py'} <= set(shipped)
    assert not any(p.startswith('testing/') or p in mp.NOT_SHIPPED for p in shipped)
    with pytest.raises(mp.PatchError, match='relative imports'):
        mp._check_relocatable('x.py', 'from megatron.mtp_tv.config import MTP_LOSS_TYPES\n')


def test_fields_block_is_the_config_dataclass_body():
    from megatron.mtp_tv.config import MTPLossConfig
    import dataclasses

    block = mp.fields_block()
    for f in dataclasses.fields(MTPLossConfig):
        assert f'    {f.name}: ' in block
    assert 'class ' not in block and '@dataclass' not in block


def _change_the_package(monkeypatch):
    """A docstring edit in a field and a new module, as the package's owners make them."""
    block, modules = mp.fields_block(), mp.shipped_modules()
    monkeypatch.setattr(mp, 'fields_block', lambda: block.replace('Training objective', 'Objective'))
    monkeypatch.setattr(mp, 'shipped_modules', lambda: {**modules, 'zz_new.py': '"""New."""\n'})


def test_offline_regeneration_equals_full_regeneration(monkeypatch):
    """What `make patches` does for the fork patches without the fork gives the same bytes as a
    regeneration from the tree (shown on 0.19.2, whose pristine files are at hand)."""
    target = mp.TARGETS['megatron-core-0.19.2']
    committed = target.patch_path.read_text()
    files = mp.files_0192()
    _change_the_package(monkeypatch)
    assert mp.check_offline(target, committed)  # stale now
    assert mp.regenerate_offline(target, committed) == mp.render_patch(target, files)


@pytest.mark.skipif(not FORK, reason='set MTP_TV_MEGATRON_LM to a clone of radixark/Megatron-LM')
@pytest.mark.parametrize('name', [n for n, t in sorted(mp.TARGETS.items()) if t.commit])
def test_offline_regeneration_equals_full_regeneration_on_forks(name, monkeypatch):
    target = mp.TARGETS[name]
    files = mp.pristine_files(target, Path(FORK))
    committed = target.patch_path.read_text()
    _change_the_package(monkeypatch)
    assert mp.regenerate_offline(target, committed) == mp.render_patch(target, files)
