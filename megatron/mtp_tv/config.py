"""The MTP loss settings that this package adds to Megatron's ``TransformerConfig``.

The fields below are the single source of truth for both ways of shipping the feature:

* plugin mode (:func:`megatron.mtp_tv.install`) adds them to the live ``TransformerConfig``
  dataclass (and every subclass) and calls :func:`validate_mtp_loss_config` from its
  ``__post_init__``;
* patch mode (``tools/make_patches.py``) copies the annotated assignments of
  :class:`MTPLossConfig`, docstrings included, into the ``TransformerConfig`` source of the patched
  tree, so that tree's ``ArgumentGroupFactory`` exposes ``--mtp-loss-type`` and friends natively.

This module must not import Megatron: it is imported before Megatron is patched (and by
``TransformerConfig`` itself in patch mode).
"""

import ast
import inspect
import math
from dataclasses import dataclass
from typing import Dict, Literal, get_args

from .losses import LOSSES

#: Names of Megatron's own cross-entropy MTP loss: ``'ce'`` here, ``'cross_entropy'`` in
#: upstream Megatron-LM's pull request for the same feature (NVIDIA/Megatron-LM #6473).
CROSS_ENTROPY_NAMES = ('ce', 'cross_entropy')

#: Every ``mtp_loss_type``: cross-entropy, then the registry of :mod:`.losses`. The ``Literal`` of
#: :attr:`MTPLossConfig.mtp_loss_type` spells them out (the patches copy its source into
#: ``TransformerConfig``, and Megatron's argument factory reads its choices from it);
#: ``tests/test_registry.py`` holds the two equal.
MTP_LOSS_TYPES: tuple = CROSS_ENTROPY_NAMES + tuple(LOSSES)


def is_cross_entropy(loss_type: str) -> bool:
    """Whether ``loss_type`` selects the cross-entropy MTP loss (Megatron's code, or chunked)."""
    return loss_type in CROSS_ENTROPY_NAMES


def runs_megatron_ce(config) -> bool:
    """Whether Megatron's own code computes this config's MTP loss: ``'ce'`` without
    ``mtp_ce_chunked``. Every other config goes to ``process_mtp_tv_loss``."""
    return is_cross_entropy(getattr(config, 'mtp_loss_type', 'ce')) and not getattr(
        config, 'mtp_ce_chunked', False
    )


# BEGIN MTP_TV FIELDS (copied verbatim into TransformerConfig by tools/make_patches.py)
@dataclass
class MTPLossConfig:
    """MTP loss settings (merged into ``TransformerConfig``)."""

    mtp_loss_type: Literal['ce', 'cross_entropy', 'tv', 'e2e_tv', 'kl', 'lk', 'nla'] = 'ce'
    """Training objective of the Multi-Token Prediction (MTP) heads.
    'ce' (alias 'cross_entropy'): cross-entropy against the data labels (Megatron's original loss;
    mtp_ce_chunked computes it at bounded memory).
    'tv': per-depth total variation 1 - sum_v min(p, q_k) between the main model's detached
    next-token distribution p and the depth-k draft distribution q_k; 1 - TV is the
    rejection-sampling acceptance rate, so this trains the heads for speculative decoding.
    'e2e_tv': end-to-end multi-depth objective 1 - (1/D) sum_j prod_{i<=j} alpha_i
    (expected accepted draft tokens per verify step over D), trained jointly over all depths.
    'kl': per-depth KL(p || q_k) against the same detached target (self-distillation); learns
    from a cold start, where the TV gradient vanishes.
    'lk': the LK hybrid lambda * KL(p || q_k) + (1 - lambda) * (1 - alpha_k) with
    lambda = exp(-mtp_lk_eta * alpha_k) held constant: KL while a head is cold, TV once warm.
    'nla': negative log-acceptance -log(max(alpha_k, 1e-5)) (the LK paper's LK^alpha) against the
    same target: optimises acceptance like 'tv' with no hyper-parameter, and learns from a cold
    start (at a one-hot target it is cross-entropy). Its gradient is -(1 / max(alpha_k, 1e-5))
    d alpha_k, kept alive below the 1e-5 floor (where the value is constant), not clamped to 0."""

    mtp_tv_chunk: int = 0
    """Tokens per chunk for the 'tv', 'e2e_tv', 'kl', 'lk' and 'nla' losses (and 'ce' with
    mtp_ce_chunked). Draft and target
    logits exist for one chunk at a time, so the extra memory of the MTP loss is
    O(chunk * vocab / tp) whatever the sequence length. 0 (default): automatic, the live fp32
    logits of a chunk are at most the larger of twice the [vocab / tp, hidden] fp32 weight
    gradient and 64 MiB, and at most half of what the cross-entropy path keeps for the same
    tokens. A chunk
    holds at least one sequence position (micro-batch size tokens)."""

    mtp_tv_temperature: float = 1.0
    """Temperature the drafts will be verified at (rejection sampling with target and draft both
    sampled at T): p and q are softmax(logits / T) in every loss but 'ce' and in the acceptance
    metrics. Must be > 0 and finite."""

    mtp_lk_eta: float = 3.0
    """eta of the 'lk' loss, lambda = exp(-eta * alpha): 0 is 'kl', large values approach 'tv'.
    Must be >= 0 and finite."""

    mtp_tv_kernels: Literal['auto', 'torch', 'triton'] = 'auto'
    """Row kernels of every loss but Megatron's own 'ce' (softmax, overlap, KL and logit gradient of each row over
    the vocabulary). 'auto' (default): the Triton kernels on CUDA fp32 logits, torch elsewhere;
    'torch': always torch; 'triton': require Triton (an error naming why it cannot run)."""

    mtp_log_acceptance: bool = False
    """Log the expected rejection-sampling acceptance (per-depth mean alpha, the expected
    accepted draft tokens per verify step, greedy agreement with the main model) with
    mtp_loss_type='ce' too. Always on for the other loss types. Costs one extra projection of
    the main hidden states per chunk, without gradients."""

    mtp_ce_chunked: bool = False
    """Compute mtp_loss_type='ce' in the chunked loss of the other types instead of Megatron's
    code: the same cross-entropy against the data labels (to fp32 rounding), with one chunk of
    logits live at a time (mtp_tv_chunk) and the gradients formed in the forward pass, where
    Megatron's path keeps the [s, b, vocab / tp] fp32 logits of every depth for backward. Needs
    mtp_num_layers >= 1 and mtp_tv_temperature=1 (cross-entropy is at temperature 1); with
    mtp_log_acceptance the metrics come from the same chunks."""
# END MTP_TV FIELDS


#: The choices of the ``Literal`` fields other than ``mtp_loss_type``, read from their annotations.
_CHOICES = {name: get_args(MTPLossConfig.__annotations__[name]) for name in ('mtp_tv_kernels',)}


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_mtp_loss_config(config) -> None:
    """Validate the MTP loss fields of a ``TransformerConfig``.

    Runs in ``TransformerConfig.__post_init__`` (a Megatron-Bridge provider runs that in
    ``finalize()``), where the training side carries Megatron's arguments onto a config
    (:mod:`.training_args`), and again at every MTP loss of this package (fields assigned after
    construction skip ``__post_init__``). Reads the config and changes nothing.

    Args:
        config: a ``TransformerConfig`` (or anything with the fields of :class:`MTPLossConfig`
            and ``mtp_num_layers``).

    Raises:
        ValueError: naming the bad value and what is allowed.
    """
    _check_values(config)
    _check_combination(config)


def _check_values(config) -> None:
    """Each field on its own: a known loss, a chunk, a temperature, the losses' own
    hyper-parameters, the choices and the flags."""
    loss_type = getattr(config, 'mtp_loss_type', 'ce')
    if loss_type not in MTP_LOSS_TYPES:
        raise ValueError(
            f"mtp_loss_type={loss_type!r} is not supported; choose one of {list(MTP_LOSS_TYPES)}."
        )
    chunk = getattr(config, 'mtp_tv_chunk', 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(
            f"mtp_tv_chunk={chunk!r} is invalid; it must be an int >= 0 (0 means automatic)."
        )
    temperature = getattr(config, 'mtp_tv_temperature', 1.0)
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(
            f"mtp_tv_temperature={temperature!r} is invalid; it must be a finite number > 0."
        )
    for loss in LOSSES.values():  # each loss checks its own hyper-parameters
        for arg, field in loss.config_fields.items():
            if not hasattr(config, field):
                continue
            value = getattr(config, field)
            try:
                loss(**{arg: value})
            except ValueError as error:
                raise ValueError(f"{field}={value!r} is invalid; {error}") from None
    for name in _CHOICES:
        value = getattr(config, name, _CHOICES[name][0])
        if value not in _CHOICES[name]:
            raise ValueError(f"{name}={value!r} is not supported; choose one of {list(_CHOICES[name])}.")
    for flag in ('mtp_log_acceptance', 'mtp_ce_chunked'):
        value = getattr(config, flag, False)
        if not isinstance(value, bool):
            raise ValueError(f"{flag}={value!r} must be True or False.")


def _check_combination(config) -> None:
    """The fields together: the chunked cross-entropy's conditions, and MTP layers for a loss
    that trains them."""
    loss_type = getattr(config, 'mtp_loss_type', 'ce')
    temperature = getattr(config, 'mtp_tv_temperature', 1.0)
    num_layers = getattr(config, 'mtp_num_layers', None)
    if getattr(config, 'mtp_ce_chunked', False):
        if not is_cross_entropy(loss_type):
            raise ValueError(
                f"mtp_ce_chunked=True computes mtp_loss_type='ce' in chunks, but mtp_loss_type="
                f"{loss_type!r} (always chunked); set mtp_loss_type='ce' or mtp_ce_chunked=False."
            )
        if temperature != 1.0:
            raise ValueError(
                f"mtp_ce_chunked=True with mtp_tv_temperature={temperature!r}: cross-entropy is at "
                "temperature 1 and the chunks are normalised once; set mtp_tv_temperature=1.0, or "
                "mtp_ce_chunked=False to log the acceptance metrics at another temperature."
            )
        if not num_layers:
            raise ValueError(
                f"mtp_ce_chunked=True trains MTP heads, but mtp_num_layers={num_layers!r}; set "
                "mtp_num_layers >= 1."
            )
    if not is_cross_entropy(loss_type) and not num_layers:
        raise ValueError(
            f"mtp_loss_type={loss_type!r} trains MTP heads, but mtp_num_layers={num_layers!r}; "
            "set mtp_num_layers >= 1 or use mtp_loss_type='ce'."
        )


def field_docstrings(cls: type) -> Dict[str, str]:
    """The string literal under each annotated field of ``cls`` (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs
