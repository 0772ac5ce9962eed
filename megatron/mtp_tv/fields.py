# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The MTP loss fields of ``TransformerConfig``, in the plugin only.

:func:`~megatron.mtp_tv.install` adds them to ``TransformerConfig``; a patch writes the block below
into ``transformer_config.py`` instead (tools/make_patches.py), so a patched tree defines them
once, where Megatron's own fields are. Their validation is config.py's.
"""

import ast
import inspect
from dataclasses import dataclass
from typing import Dict, Literal


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
