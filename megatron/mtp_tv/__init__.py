# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Acceptance-aware (total-variation) training losses for Megatron MTP draft heads."""

__version__ = '0.1.0'

from .config import MTP_LOSS_TYPES, MTPLossOptions, validate_mtp_loss_config
from .linear_tv import TargetSegment, TVLossResult, linear_tv_loss

__all__ = [
    'MTP_LOSS_TYPES',
    'MTPLossOptions',
    'TVLossResult',
    'TargetSegment',
    'linear_tv_loss',
    'validate_mtp_loss_config',
]


# BEGIN PLUGIN ONLY: the patches leave this out (a patched tree has the feature in its source).
from .fields import MTPLossConfig  # noqa: E402


def install() -> None:
    """Installs the plugin into this process's megatron-core (idempotent)."""
    from .plugin import install as _install

    _install()


def is_installed() -> bool:
    """Whether the MTP loss fields are live in this process's megatron-core."""
    from .plugin import is_installed as _is_installed

    return _is_installed()


__all__ += ['MTPLossConfig', 'install', 'is_installed']
# END PLUGIN ONLY
