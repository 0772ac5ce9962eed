"""Patch mode: run this checkout's tests and tools against a patched Megatron tree instead of
the plugin.

With ``MTP_TV_MODE=patch`` and ``MTP_TV_TREE=<root of a tree patched with patches/*.patch>``
(``tools/run_patched_suite.py`` sets both), :func:`activate` (called by ``tests/conftest.py``
before any test module is imported, and by ``tools/verify_patched_tree.py``):

* puts the tree first on ``sys.path`` and checks that ``megatron.core`` comes from it;
* makes ``megatron.mtp_tv`` and every ``megatron.mtp_tv.<module>`` the *tree's*
  ``megatron.core.transformer.mtp_tv`` modules (same objects in ``sys.modules``), and
  ``megatron.mtp_tv.training_args`` the tree's ``megatron.training.mtp_tv_args``, so tests written
  against ``megatron.mtp_tv`` exercise the code the patch installed, never this checkout's
  copy of the package;
* makes ``megatron.mtp_tv.fields`` this checkout's (the plugin's field definitions, which the
  patch wrote into the tree's ``TransformerConfig``: what the tree is checked against);
* leaves ``mtp_tv_dev`` (test and demo support, never shipped) as it is: this checkout's.

The tree's package has no plugin module (nor ``install()``): here ``install()`` is a no-op and
``is_installed()`` true, nothing is monkey-patched into megatron-core.

Tests that only make sense for the plugin are marked ``@pytest.mark.plugin_only`` and skipped
(``tests/patch_mode.py``).
"""

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

MODE_ENV = 'MTP_TV_MODE'
TREE_ENV = 'MTP_TV_TREE'
NATIVE = 'megatron.core.transformer.mtp_tv'
TRAINING_MODULE = 'megatron.training.mtp_tv_args'
#: Package modules a patch installs elsewhere in the tree (tools/patchgen/package.py RELOCATED).
RELOCATED_MODULES = {'triton_kernels': 'megatron.core.fusions.fused_mtp_tv_rows'}


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
    # The plugin's install() has nothing to do in a patched tree (its copy has no plugin module).
    native.install, native.is_installed = (lambda: None), (lambda: True)
    sys.modules['megatron.mtp_tv'] = native
    megatron.mtp_tv = native
    for info in pkgutil.iter_modules(native.__path__):
        try:
            module = importlib.import_module(f'{NATIVE}.{info.name}')
        except ImportError:  # an optional backend (e.g. triton) missing: tests skip it anyway
            continue
        sys.modules[f'megatron.mtp_tv.{info.name}'] = module
    # Modules the patch installs outside the package (tools/patchgen/package.py RELOCATED).
    for name, tree_module in RELOCATED_MODULES.items():
        try:
            sys.modules[f'megatron.mtp_tv.{name}'] = importlib.import_module(tree_module)
        except ImportError:  # triton missing: its tests skip
            pass
    # The training side's module the patch installs under megatron/training.
    sys.modules['megatron.mtp_tv.training_args'] = importlib.import_module(TRAINING_MODULE)
    # The plugin's field definitions, which the patch wrote into the tree's TransformerConfig:
    # this checkout's, what the tree is checked against.
    spec = importlib.util.spec_from_file_location(
        'megatron.mtp_tv.fields', Path(__file__).resolve().parents[1] / 'megatron/mtp_tv/fields.py')
    fields = importlib.util.module_from_spec(spec)
    sys.modules['megatron.mtp_tv.fields'] = fields
    spec.loader.exec_module(fields)
    return tree


def implementation_file(module) -> Path:
    """Where a ``megatron.mtp_tv`` module was loaded from (for tests that assert the mode)."""
    return Path(module.__file__).resolve()
