"""The MTP loss fields of ``TransformerConfig`` and their validation (imports no Megatron)."""

import ast
import inspect
import math
from dataclasses import dataclass
from typing import Dict, Literal

from .losses import LOSSES
from .row_ops import ROW_KERNELS

#: Names of Megatron's own cross-entropy MTP loss (``'cross_entropy'``: NVIDIA/Megatron-LM #6473).
CROSS_ENTROPY_NAMES = ('ce', 'cross_entropy')

#: Every ``mtp_loss_type``; the field's ``Literal`` must spell out the same (test_registry.py).
MTP_LOSS_TYPES: tuple = CROSS_ENTROPY_NAMES + tuple(LOSSES)


def is_cross_entropy(loss_type: str) -> bool:
    return loss_type in CROSS_ENTROPY_NAMES


def runs_megatron_ce(config) -> bool:
    """Whether Megatron's own code computes the MTP loss: ``'ce'`` without ``mtp_ce_chunked``."""
    return is_cross_entropy(getattr(config, 'mtp_loss_type', 'ce')) and not getattr(
        config, 'mtp_ce_chunked', False
    )


# BEGIN MTP_TV FIELDS (copied verbatim into TransformerConfig by tools/make_patches.py)
@dataclass
class MTPLossConfig:
    """MTP loss settings (merged into ``TransformerConfig``)."""

    mtp_loss_type: Literal['ce', 'cross_entropy', 'tv', 'e2e_tv', 'kl', 'lk', 'nla'] = 'ce'
    """Training objective of the Multi-Token Prediction (MTP) heads, with p the main model's
    detached next-token distribution, q_k depth k's draft and alpha_k = sum_v min(p, q_k) the
    speculative-decoding acceptance rate (1 - total variation). 'ce' (alias 'cross_entropy'):
    Megatron's cross-entropy against the labels; 'tv': 1 - alpha_k per depth; 'e2e_tv':
    1 - (1/D) sum_j prod_{i<=j} alpha_i (expected accepted drafts per verify step over D) for all
    depths jointly; 'kl': KL(p || q_k) (self-distillation; learns from a cold start, where TV's
    gradient vanishes); 'lk': lambda KL + (1 - lambda)(1 - alpha_k), lambda = exp(-mtp_lk_eta
    alpha_k) held constant; 'nla': -log(max(alpha_k, 1e-5)), no hyper-parameter, learns from a
    cold start (its gradient below the floor is kept, not clamped to 0)."""

    mtp_tv_chunk: int = 0
    """Tokens per chunk for every loss but Megatron's 'ce' (and 'ce' with mtp_ce_chunked), at
    least one sequence position (micro-batch size tokens): logits live one chunk at a time, so
    the extra memory is O(chunk * vocab / tp) at any sequence length. 0 (default): automatic,
    live fp32 logits at most the larger of twice the [vocab / tp, hidden] fp32 weight gradient
    and 64 MiB, and at most half of what the cross-entropy path keeps for the same tokens."""

    mtp_tv_temperature: float = 1.0
    """Temperature the drafts will be verified at: p and q are softmax(logits / T) in every loss
    but 'ce' and in the acceptance metrics. Finite, > 0."""

    mtp_lk_eta: float = 3.0
    """eta of the 'lk' loss, lambda = exp(-eta * alpha): 0 is 'kl', large values approach 'tv'.
    Finite, >= 0."""

    mtp_tv_kernels: Literal['auto', 'torch', 'triton'] = 'auto'
    """Row kernels of every loss but Megatron's own 'ce'. 'auto' (default): Triton on CUDA fp32
    logits, torch elsewhere; 'torch': always torch; 'triton': Triton, or an error saying why not."""

    mtp_log_acceptance: bool = False
    """Log the expected acceptance (per-depth mean alpha, expected accepted drafts per verify
    step, greedy agreement with the main model) with mtp_loss_type='ce' too (always on for the
    other types), at one more projection per chunk, without gradients."""

    mtp_ce_chunked: bool = False
    """Compute mtp_loss_type='ce' in the chunked loss instead of Megatron's code: the same
    cross-entropy (to fp32 rounding), one chunk of logits live at a time (mtp_tv_chunk), the
    gradients formed in forward, where Megatron keeps every depth's [s, b, vocab / tp] fp32
    logits for backward. Needs mtp_num_layers >= 1 and mtp_tv_temperature=1; with
    mtp_log_acceptance the metrics come from the same chunks."""
# END MTP_TV FIELDS


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Each kind of setting: whether a value is allowed, and what the error says is.
_KINDS = {
    'chunk': (lambda v: _is_real(v) and isinstance(v, int) and v >= 0, 'an int >= 0 (0: automatic)'),
    'temperature': (lambda v: _is_real(v) and math.isfinite(v) and v > 0, 'a finite number > 0'),
    'flag': (lambda v: isinstance(v, bool), 'True or False'),
}

_FIELD_KINDS = {'mtp_tv_chunk': 'chunk', 'mtp_tv_temperature': 'temperature',
                'mtp_log_acceptance': 'flag', 'mtp_ce_chunked': 'flag'}


def check_setting(name: str, value, kind: str) -> None:
    """ValueError naming ``name=value`` and what is allowed, unless it is a valid ``kind``."""
    allowed, what = _KINDS[kind]
    if not allowed(value):
        raise ValueError(f"{name}={value!r} is invalid; it must be {what}.")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}.")


def validate_mtp_loss_config(config) -> None:
    """Raises ValueError, naming the value and what is allowed, for bad MTP loss fields of
    ``config``; runs in ``TransformerConfig.__post_init__`` and again at every MTP loss."""
    check_choice('mtp_loss_type', getattr(config, 'mtp_loss_type', 'ce'), MTP_LOSS_TYPES)
    check_choice('mtp_tv_kernels', getattr(config, 'mtp_tv_kernels', 'auto'), ROW_KERNELS)
    for field, kind in _FIELD_KINDS.items():
        if hasattr(config, field):
            check_setting(field, getattr(config, field), kind)
    for loss in LOSSES.values():  # each loss checks its own hyper-parameters
        for arg, field in loss.config_fields.items():
            if hasattr(config, field):
                try:
                    loss(**{arg: getattr(config, field)})
                except ValueError as error:
                    raise ValueError(f"{field}={getattr(config, field)!r} is invalid; {error}") from None
    _check_combination(config)


def _check_combination(config) -> None:
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
