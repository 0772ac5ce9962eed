"""Acceptance-aware (total-variation) training losses for Megatron MTP draft heads.

Plugin use::

    import megatron.mtp_tv
    megatron.mtp_tv.install()   # adds TransformerConfig.mtp_loss_type / mtp_tv_chunk / ...

The loss math (:mod:`.linear_tv`, :mod:`.alignment`, :mod:`.vocab_parallel`) imports only torch;
the Megatron glue is :mod:`.mtp_loss` and :mod:`.metrics`. :mod:`.training_args` is the training
side's: Megatron's parsed arguments onto the model configs (patches install it under
``megatron/training``). :mod:`.plugin` (plugin mode only) makes the same changes to a running
megatron-core that ``patches/`` make to a tree's source; the patches do not ship it.
"""

__version__ = '0.1.0'

import importlib.util

from .config import MTP_LOSS_TYPES, MTPLossConfig, validate_mtp_loss_config
from .linear_tv import TargetSegment, TVLossResult, linear_tv_loss
from .options import MTPLossOptions


def _is_native() -> bool:
    """Whether this package is the copy a patch put into a Megatron tree (no plugin module:
    the fields and the loss are in the tree's own source)."""
    return importlib.util.find_spec(f'{__name__}.plugin') is None


def install() -> None:
    """Install the plugin into this process's megatron-core (see :mod:`.plugin`); nothing to do
    in a tree patched with ``patches/``."""
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
