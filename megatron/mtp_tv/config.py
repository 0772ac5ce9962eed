"""The MTP loss settings that this package adds to Megatron's ``TransformerConfig``.

The fields below are the single source of truth for both ways of shipping the feature:

* plugin mode (:func:`megatron.mtp_tv.install`) adds them to the live ``TransformerConfig``
  dataclass (and every subclass) and calls :func:`validate_mtp_loss_config` from its
  ``__post_init__``;
* patch mode (``tools/make_patches.py``) copies the annotated assignments of
  :class:`MTPLossConfig`, docstrings included, into the ``TransformerConfig`` source of the patched
  tree, so that tree's ``ArgumentGroupFactory`` exposes ``--mtp-loss-type`` and friends natively.

This module must not import Megatron: it is imported before Megatron is patched.
"""

from dataclasses import dataclass
from typing import Literal, get_args

MTPLossType = Literal['ce', 'tv', 'e2e_tv']

MTP_LOSS_TYPES: tuple = get_args(MTPLossType)


# BEGIN MTP_TV FIELDS (copied verbatim into TransformerConfig by tools/make_patches.py)
@dataclass
class MTPLossConfig:
    """MTP loss settings (merged into ``TransformerConfig``)."""

    mtp_loss_type: Literal['ce', 'tv', 'e2e_tv'] = 'ce'
    """Training objective of the Multi-Token Prediction (MTP) heads.
    'ce': cross-entropy against the data labels (Megatron's original loss).
    'tv': per-depth total variation 1 - sum_v min(p, q_k) between the main model's detached
    next-token distribution p and the depth-k draft distribution q_k; 1 - TV is the
    rejection-sampling acceptance rate, so this trains the heads for speculative decoding.
    'e2e_tv': end-to-end multi-depth objective 1 - (1/D) sum_j prod_{i<=j} alpha_i
    (expected accepted draft tokens per verify step over D), trained jointly over all depths."""

    mtp_tv_chunk: int = 0
    """Tokens per chunk for the 'tv' and 'e2e_tv' losses (0: one chunk). Draft and target logits
    exist for one chunk at a time, so the extra memory of the MTP loss is O(chunk * vocab / tp)
    whatever the sequence length. A chunk holds at least one sequence position (micro-batch
    size tokens)."""

    mtp_log_acceptance: bool = False
    """Log the expected rejection-sampling acceptance (per-depth mean alpha and the expected
    accepted draft tokens per verify step) with mtp_loss_type='ce' too. Always on for 'tv' and
    'e2e_tv'. Costs one extra projection of the main hidden states per MTP depth."""
# END MTP_TV FIELDS


def validate_mtp_loss_config(config) -> None:
    """Validate the MTP loss fields of a ``TransformerConfig``.

    Args:
        config: a ``TransformerConfig`` (or anything with the fields of :class:`MTPLossConfig`
            and ``mtp_num_layers``).

    Raises:
        ValueError: naming the bad value and what is allowed.
    """
    loss_type = getattr(config, 'mtp_loss_type', 'ce')
    if loss_type not in MTP_LOSS_TYPES:
        raise ValueError(
            f"mtp_loss_type={loss_type!r} is not supported; choose one of {list(MTP_LOSS_TYPES)}."
        )
    chunk = getattr(config, 'mtp_tv_chunk', 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(
            f"mtp_tv_chunk={chunk!r} is invalid; it must be an int >= 0 (0 means one chunk)."
        )
    log_acceptance = getattr(config, 'mtp_log_acceptance', False)
    if not isinstance(log_acceptance, bool):
        raise ValueError(f"mtp_log_acceptance={log_acceptance!r} must be True or False.")
    num_layers = getattr(config, 'mtp_num_layers', None)
    if loss_type != 'ce' and not num_layers:
        raise ValueError(
            f"mtp_loss_type={loss_type!r} trains MTP heads, but mtp_num_layers={num_layers!r}; "
            "set mtp_num_layers >= 1 or use mtp_loss_type='ce'."
        )
