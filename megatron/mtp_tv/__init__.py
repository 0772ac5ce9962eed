"""Acceptance-aware (total-variation) training losses for Megatron MTP draft heads.

Plugin use::

    import megatron.mtp_tv
    megatron.mtp_tv.install()   # adds TransformerConfig.mtp_loss_type / mtp_tv_chunk / ...

The loss math (:mod:`.linear_tv`, :mod:`.alignment`, :mod:`.vocab_parallel`) imports only torch;
the Megatron glue is :mod:`.mtp_loss`, :mod:`.metrics` and :mod:`.plugin`; :mod:`.bridge` carries
Megatron's parsed arguments onto Megatron-Bridge providers and checks them when a model's MTP
block is built.
"""

__version__ = '0.1.0'

from .config import MTP_LOSS_TYPES, MTPLossConfig, validate_mtp_loss_config
from .linear_tv import TargetSegment, TVLossResult, linear_tv_loss


def install() -> None:
    """Install the plugin into this process's megatron-core (see :mod:`.plugin`)."""
    from .plugin import install as _install

    _install()


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    from .plugin import is_installed as _is_installed

    return _is_installed()


__all__ = [
    'MTP_LOSS_TYPES', 'MTPLossConfig', 'TVLossResult', 'TargetSegment', 'install',
    'is_installed', 'linear_tv_loss', 'validate_mtp_loss_config',
]
