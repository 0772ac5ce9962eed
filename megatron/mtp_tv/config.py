# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The MTP loss settings (imports no Megatron): the validation of the fields of
``TransformerConfig``, and :class:`MTPLossOptions`, what one call of the loss computes.

The fields themselves are declared on ``TransformerConfig``; its ``__post_init__`` calls
:func:`validate_mtp_loss_config`.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

from torch import Tensor

from .losses import LOSSES, CrossEntropy, DraftLoss, loss_from_config, make_loss
from .row_ops import ROW_KERNELS, RowKernels

#: Names of Megatron's own cross-entropy MTP loss (``'cross_entropy'``: NVIDIA/Megatron-LM #6473).
CROSS_ENTROPY_NAMES = ('ce', 'cross_entropy')

#: Every ``mtp_loss_type``; the field's ``Literal`` must spell out the same (test_registry.py).
MTP_LOSS_TYPES: tuple = CROSS_ENTROPY_NAMES + tuple(LOSSES)


def is_cross_entropy(loss_type: str) -> bool:
    """Whether ``loss_type`` names Megatron's cross-entropy (``'ce'`` or ``'cross_entropy'``)."""
    return loss_type in CROSS_ENTROPY_NAMES


def runs_megatron_ce(config) -> bool:
    """Whether Megatron's own code computes the MTP loss: ``'ce'`` without ``mtp_ce_chunked``."""
    return is_cross_entropy(config.mtp_loss_type) and not config.mtp_ce_chunked


def extra_logit_projections(config, main_logits_passed: bool) -> int:
    """Forward-only ``[h x V]`` projections per token that an MTP loss training step adds to the
    ``1 + mtp_num_layers`` projections (with backward) Megatron's FLOP count already holds.

    Args:
        config: the model's config (or Megatron's arguments, which carry the same fields).
        main_logits_passed: whether the MTP loss takes its target from the main logits the model
            computes anyway (``GPTModel._postprocess`` without an output processor, a fused
            linear cross-entropy or a config logger); else it projects the target itself.

    Returns:
        0 where the target is the main logits or no target is needed; 1 for the loss's own,
        detached projection of the target; ``1 + mtp_num_layers`` for the acceptance metrics of
        Megatron's ``'ce'`` (target and drafts projected again, without gradient).
    """
    depth = config.mtp_num_layers or 0
    if not depth:
        return 0
    if runs_megatron_ce(config):
        return 1 + depth if config.mtp_log_acceptance else 0
    with_target = MTPLossOptions.from_config(config, metrics=True).with_target
    return int(with_target and not main_logits_passed)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Each kind of setting: whether a value is allowed, and what the error says is.
_KINDS = {
    'chunk': (
        lambda v: _is_real(v) and isinstance(v, int) and v >= 0,
        'an int >= 0 (0: automatic)',
    ),
    'temperature': (lambda v: _is_real(v) and math.isfinite(v) and v > 0, 'a finite number > 0'),
    'flag': (lambda v: isinstance(v, bool), 'True or False'),
}

_FIELD_KINDS = {
    'mtp_tv_chunk': 'chunk',
    'mtp_tv_temperature': 'temperature',
    'mtp_log_acceptance': 'flag',
    'mtp_ce_chunked': 'flag',
}

#: Every MTP loss field of ``TransformerConfig``, each checked below (the losses check their own).
MTP_LOSS_FIELDS = (
    'mtp_loss_type',
    'mtp_tv_kernels',
    *_FIELD_KINDS,
    *(field for loss in LOSSES.values() for field in loss.config_fields.values()),
)


def check_setting(name: str, value, kind: str) -> None:
    """ValueError naming ``name=value`` and what is allowed, unless it is a valid ``kind``."""
    allowed, what = _KINDS[kind]
    if not allowed(value):
        raise ValueError(f"{name}={value!r} is invalid; it must be {what}.")


def check_choice(name: str, value, choices) -> None:
    """ValueError naming ``name=value`` and the choices, unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}.")


def validate_mtp_loss_config(config) -> None:
    """Raises ValueError, naming the value and what is allowed, for bad MTP loss fields of
    ``config``; runs in ``TransformerConfig.__post_init__`` (a value assigned later is refused by
    :class:`MTPLossOptions`, built from the config at each MTP loss)."""
    check_choice('mtp_loss_type', config.mtp_loss_type, MTP_LOSS_TYPES)
    check_choice('mtp_tv_kernels', config.mtp_tv_kernels, ROW_KERNELS)
    for field, kind in _FIELD_KINDS.items():
        check_setting(field, getattr(config, field), kind)
    for loss in LOSSES.values():  # each loss checks its own hyper-parameters
        for arg, field in loss.config_fields.items():
            value = getattr(config, field)
            try:
                loss(**{arg: value})
            except ValueError as error:
                raise ValueError(f"{field}={value!r} is invalid; {error}") from None
    _check_combination(config)


def _check_combination(config) -> None:
    loss_type = config.mtp_loss_type
    temperature = config.mtp_tv_temperature
    num_layers = getattr(config, 'mtp_num_layers', None)
    chunked = config.mtp_ce_chunked
    if chunked and not is_cross_entropy(loss_type):
        raise ValueError(
            f"mtp_ce_chunked=True computes mtp_loss_type='ce' in chunks, but mtp_loss_type="
            f"{loss_type!r} (always chunked); set mtp_loss_type='ce' or mtp_ce_chunked=False."
        )
    if chunked and temperature != 1.0:
        raise ValueError(
            f"mtp_ce_chunked=True with mtp_tv_temperature={temperature!r}: cross-entropy is at "
            "temperature 1 and the chunks are normalised once; set mtp_tv_temperature=1.0, or "
            "mtp_ce_chunked=False to log the acceptance metrics at another temperature."
        )
    if (chunked or not is_cross_entropy(loss_type)) and not num_layers:
        raise ValueError(
            f"{'mtp_ce_chunked=True' if chunked else f'mtp_loss_type={loss_type!r}'} trains MTP "
            f"heads, but mtp_num_layers={num_layers!r}; set mtp_num_layers >= 1."
        )


@dataclass(frozen=True)
class MTPLossOptions:
    """What a call of :func:`~.linear_tv.linear_tv_loss` computes; ValueError for a bad value.

    Args:
        loss: a :class:`~.losses.DraftLoss`, or its name (one of :data:`MTP_LOSS_TYPES`).
        chunk_size: tokens per chunk (0: automatic).
        temperature: the verification temperature (1 for a loss against the labels).
        kernels: the row kernels, ``'auto'``, ``'torch'`` or ``'triton'``.
        metrics: also compute the greedy agreement of draft and target argmax.
        logits_fn: an elementwise function the logits go through before the softmax (MuP's
            scaling), not in place; None: the logits as projected.
    """

    loss: Union[DraftLoss, str]
    chunk_size: int = 0
    temperature: float = 1.0
    kernels: RowKernels = 'auto'
    metrics: bool = False
    logits_fn: Optional[Callable[[Tensor], Tensor]] = None

    def __post_init__(self):
        loss = self.loss
        if isinstance(loss, str) and loss in MTP_LOSS_TYPES:
            loss = CrossEntropy() if is_cross_entropy(loss) else make_loss(loss)
            object.__setattr__(self, 'loss', loss)
        elif not isinstance(loss, DraftLoss):
            raise ValueError(
                f"loss={loss!r}; expected a DraftLoss or one of {list(MTP_LOSS_TYPES)}."
            )
        check_setting('chunk_size', self.chunk_size, 'chunk')
        check_setting('temperature', self.temperature, 'temperature')
        object.__setattr__(self, 'temperature', float(self.temperature))
        if loss.needs_labels and self.temperature != 1.0:
            raise ValueError(
                f"temperature={self.temperature!r}: the {loss.name!r} loss is at temperature 1."
            )
        check_choice('kernels', self.kernels, ROW_KERNELS)
        check_setting('metrics', self.metrics, 'flag')

    @property
    def inv_temperature(self) -> float:
        """``1 / temperature``, what the logits are scaled by."""
        return 1.0 / self.temperature

    @property
    def with_target(self) -> bool:
        """Whether the loss or the metrics compare with the main model's distribution."""
        return self.loss.needs_target or self.metrics

    @classmethod
    def from_config(
        cls, config, metrics: bool, metrics_only: bool = False, logits_fn=None
    ) -> 'MTPLossOptions':
        """The options of a validated config's MTP loss in this pass (training: ``metrics``)."""
        loss = draft_objective(config, metrics_only)
        return cls(
            loss,
            chunk_size=config.mtp_tv_chunk,
            temperature=config.mtp_tv_temperature,
            kernels=config.mtp_tv_kernels,
            metrics=bool(metrics) and (loss.needs_target or bool(config.mtp_log_acceptance)),
            logits_fn=logits_fn,
        )


def draft_objective(config, metrics_only: bool = False) -> DraftLoss:
    """The config's loss; for ``'ce'``: cross-entropy if chunked, else ``'tv'`` (metrics pass)."""
    if not is_cross_entropy(config.mtp_loss_type):
        return loss_from_config(config)
    if config.mtp_ce_chunked and not metrics_only:
        return CrossEntropy()
    return loss_from_config(config, 'tv')
