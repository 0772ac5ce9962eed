"""Acceptance-aware (total-variation) training losses for Megatron MTP draft heads."""

__version__ = '0.1.0'

import importlib.util

from .config import MTP_LOSS_TYPES, MTPLossConfig, validate_mtp_loss_config
from .linear_tv import TargetSegment, TVLossResult, linear_tv_loss
from .options import MTPLossOptions


def _is_native() -> bool:
    """Whether this is the copy a patch put into a Megatron tree (it has no plugin module)."""
    return importlib.util.find_spec(f'{__name__}.plugin') is None


def install() -> None:
    """Installs the plugin into this process's megatron-core; a no-op in a patched tree."""
    if _is_native():
        return
    from .plugin import install as _install

    _install()


def is_installed() -> bool:
    """Whether the MTP loss fields are live: :func:`install` has run, or the tree is patched."""
    if _is_native():
        return True
    from .plugin import is_installed as _is_installed

    return _is_installed()


__all__ = [
    'MTP_LOSS_TYPES', 'MTPLossConfig', 'MTPLossOptions', 'TVLossResult', 'TargetSegment',
    'install', 'is_installed', 'linear_tv_loss', 'validate_mtp_loss_config',
]
