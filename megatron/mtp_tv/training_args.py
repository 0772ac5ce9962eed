# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The training side: Megatron's parsed arguments onto the configs of the models it built.

A Megatron-Bridge provider is not built by ``core_transformer_config_from_args``: it takes the MTP
loss fields the arguments ask for here, and any other config that holds a different value stops
the run. Patches install this module as
``megatron/training/mtp_tv_args.py``.
"""

import sys
from typing import Dict, Iterable

from .config import (
    MTP_LOSS_FIELDS,
    extra_logit_projections,
    is_cross_entropy,
    validate_mtp_loss_config,
)


def _defaults() -> Dict[str, object]:
    """The MTP loss fields' defaults, as ``TransformerConfig`` declares them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__.values()
    return {f.name: f.default for f in fields if f.name in MTP_LOSS_FIELDS}


def apply_mtp_loss_args(model: Iterable, args) -> None:
    """Make each model chunk's config hold the MTP loss settings ``args`` ask for.

    Args:
        model: the model chunks ``get_model`` built (modules with a ``config``).
        args: Megatron's parsed arguments.

    Raises:
        ValueError: a config holds another value than the arguments ask for (a Bridge provider:
            another non-default value), naming both and how to fix it.
    """
    configs = {id(c): c for c in (getattr(m, 'config', None) for m in model) if c is not None}
    for config in configs.values():
        carry_to_bridge_provider(config, args)
        check_megatron_args(config, args)
        validate_mtp_loss_config(config)


def mtp_loss_flops(args, total_tokens: int, hybrid_model: bool) -> int:
    """The floating-point operations of one step's MTP loss that Megatron's
    ``num_floating_point_operations`` does not count: its forward-only logit projections
    (:func:`~.config.extra_logit_projections`), ``2 * h * V`` each per token. The halo rows two
    chunks share (``mtp_num_layers - 1`` per chunk) are left out, as is the weight-gradient GEMM
    that ``mtp_detach_heads`` skips.

    Args:
        args: Megatron's parsed arguments.
        total_tokens: tokens in the global batch, as Megatron's count takes them.
        hybrid_model: whether the model is a hybrid model (its heads project their own target).
    """
    fused_linear_ce = args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == 'linear'
    main_logits_passed = not (hybrid_model or fused_linear_ce or args.config_logger_dir)
    projections = extra_logit_projections(args, main_logits_passed)
    return 2 * total_tokens * args.hidden_size * args.padded_vocab_size * projections


def requested_fields(args) -> Dict[str, object]:
    """The MTP loss fields that ``args`` hold with a value other than the field's default."""
    return {
        name: getattr(args, name)
        for name, default in _defaults().items()
        if hasattr(args, name) and not _same(name, getattr(args, name), default)
    }


def is_bridge_provider(config) -> bool:
    """Whether ``config`` is a Megatron-Bridge model provider (without importing Bridge)."""
    module = sys.modules.get('megatron.bridge.models.model_provider')
    mixin = getattr(module, 'ModelProviderMixin', None)
    return mixin is not None and isinstance(config, mixin)


def carry_to_bridge_provider(config, args) -> None:
    """Copy the MTP loss fields ``args`` ask for onto ``config`` if it is a Megatron-Bridge
    provider. Arguments at their default ask for nothing, so a value set on the provider (a
    Bridge recipe's ``cfg.model.mtp_loss_type``) stays.

    Raises:
        ValueError: the provider holds a non-default value that differs from the arguments'.
    """
    if args is None or not is_bridge_provider(config):
        return
    defaults = _defaults()
    for name, value in requested_fields(args).items():
        held = getattr(config, name, defaults[name])
        if not _same(name, held, defaults[name]) and not _same(name, held, value):
            raise ValueError(
                f'{type(config).__name__}.{name}={held!r}, but Megatron\'s arguments ask for '
                f'{_flag(name)} {value!r}; set one of them, or both to the same value.'
            )
        setattr(config, name, value)


def check_megatron_args(config, args) -> None:
    """Raise if ``args`` ask for MTP loss settings that ``config`` does not hold.

    Raises:
        ValueError: naming each differing argument, the config's value and how to fix it.
    """
    if args is None:
        return
    defaults = _defaults()
    wrong = {
        name: (value, getattr(config, name, defaults[name]))
        for name, value in requested_fields(args).items()
        if not _same(name, getattr(config, name, defaults[name]), value)
    }
    if wrong:
        asked = ', '.join(f'{_flag(n)} {v!r}' for n, (v, _) in wrong.items())
        held = ', '.join(f'{n}={h!r}' for n, (_, h) in wrong.items())
        raise ValueError(
            f"Megatron's arguments ask for {asked}, but the model's config "
            f'({type(config).__name__}) holds {held}: it was not built from these arguments, or a '
            'field was assigned after construction. Set the same values where the config is built '
            "(e.g. provider.mtp_loss_type = 'tv' before provider.finalize()), or drop the flags."
        )


def _same(name: str, a, b) -> bool:
    if name == 'mtp_loss_type' and is_cross_entropy(a) and is_cross_entropy(b):
        return True  # 'ce' and 'cross_entropy' are one loss
    return a == b


def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')
