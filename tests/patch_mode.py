"""Run the test suite against a patched Megatron tree instead of the plugin.

With ``MTP_TV_MODE=patch`` and ``MTP_TV_TREE=<root of a tree patched with patches/*.patch>``
(``tools/run_patched_suite.py`` sets both), :func:`activate` (called by ``tests/conftest.py``
before any test module is imported):

* puts the tree first on ``sys.path`` and checks that ``megatron.core`` comes from it;
* makes ``megatron.mtp_tv`` and every ``megatron.mtp_tv.<module>`` the *tree's*
  ``megatron.core.transformer.mtp_tv`` modules (same objects in ``sys.modules``), so tests written
  against ``megatron.mtp_tv`` exercise the code the patch installed, never this checkout's
  copy of the package;
* leaves ``mtp_tv_dev`` (test and demo support, never shipped) as it is: this checkout's;
* turns ``install()`` into a no-op: the patched tree has the feature natively, nothing is
  monkey-patched into megatron-core.

Tests that only make sense for the plugin are marked ``@pytest.mark.plugin_only`` and skipped.
"""

import importlib
import os
import pkgutil
import sys
from pathlib import Path

MODE_ENV = 'MTP_TV_MODE'
TREE_ENV = 'MTP_TV_TREE'
NATIVE = 'megatron.core.transformer.mtp_tv'
ROOT = Path(__file__).resolve().parents[1]


def active() -> bool:
    """Whether the suite runs in patch mode."""
    return os.environ.get(MODE_ENV, 'plugin') == 'patch'


def _within(path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def activate() -> Path:
    """Switch this process to the patched tree in ``$MTP_TV_TREE``; returns the tree."""
    tree = Path(os.environ[TREE_ENV]).resolve()
    if not (tree / NATIVE.replace('.', '/') / '__init__.py').exists():
        raise RuntimeError(f'{TREE_ENV}={tree} is not a patched tree (no {NATIVE})')
    if any(name == 'megatron.mtp_tv' or name.startswith('megatron.mtp_tv.') for name in sys.modules):
        raise RuntimeError('megatron.mtp_tv was imported from the checkout before patch mode')
    sys.path.insert(0, str(tree))
    import megatron.core

    if not _within(megatron.core.__file__, tree):
        raise RuntimeError(f'megatron.core comes from {megatron.core.__file__}, not from {tree}')

    native = importlib.import_module(NATIVE)
    sys.modules['megatron.mtp_tv'] = native
    megatron.mtp_tv = native
    for info in pkgutil.iter_modules(native.__path__):
        try:
            module = importlib.import_module(f'{NATIVE}.{info.name}')
        except ImportError:  # an optional backend (e.g. triton) missing: tests skip it anyway
            continue
        sys.modules[f'megatron.mtp_tv.{info.name}'] = module

    def install() -> None:
        """No-op: the patched tree has the MTP TV losses natively."""

    native.install = install
    native.is_installed = lambda: False
    return tree


def implementation_file(module) -> Path:
    """Where a ``megatron.mtp_tv`` module was loaded from (for tests that assert the mode)."""
    return Path(module.__file__).resolve()


#: Tests in other files that only make sense with the plugin (they check the monkey-patching
#: itself); skipped in patch mode. New tests should use ``@pytest.mark.plugin_only`` instead.
PLUGIN_ONLY_TESTS = ()


#: Known differences between the modes, expected to fail in patch mode (strict: once fixed, the
#: XPASS fails the run so the entry gets removed).
PATCH_MODE_XFAIL: dict = {}


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'plugin_only: the test checks plugin mode itself; skipped with MTP_TV_MODE=patch'
    )


#: The losses a patch-mode run keeps of a test parametrised over every loss: one per-depth loss
#: and the per-chain one. The patched tree's loss modules are the checkout's, byte for byte
#: (tests/test_patches.py), and the plugin run covers every loss; patch mode tests the tree's
#: integration, which does not depend on the loss.
PATCH_MODE_LOSSES = ('tv', 'e2e_tv')


def pytest_collection_modifyitems(config, items):
    if not active():
        return
    import pytest

    kept, deselected = [], []
    for item in items:
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        loss = params.get('loss_type')
        (deselected if loss is not None and loss not in PATCH_MODE_LOSSES else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept

    skip = pytest.mark.skip(reason='plugin mode only (MTP_TV_MODE=patch)')
    for item in items:
        nodeid = item.nodeid.split('[')[0]
        if item.get_closest_marker('plugin_only') or nodeid in PLUGIN_ONLY_TESTS:
            item.add_marker(skip)
        elif nodeid in PATCH_MODE_XFAIL:
            item.add_marker(pytest.mark.xfail(reason=PATCH_MODE_XFAIL[nodeid], strict=True))
