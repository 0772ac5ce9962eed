"""The per-row vocabulary passes of the TV loss, in torch and in Triton.

One chunk of the sweep in :mod:`.linear_tv` needs, for its target logits ``zt`` and each depth's
draft logits ``zq`` (fp32, ``[n, V/tp]``):

1. the log-normalisers of every row over the full vocabulary (``local_stats`` per shard, combined
   by the caller with one all-gather under tensor parallelism, then ``finish``);
2. this shard's overlap ``sum_v min(p, q)`` and dot product ``sum_v q_v 1[q_v < p_v]``
   (``overlap``; all-reduced by the caller);
3. the logit gradient ``coef * q * (dot - 1[q < p])``, written over the draft logits (``grad_``).

:class:`TorchRowOps` materialises the probabilities in place and is the CPU path and test oracle.
:class:`TritonRowOps` runs one program per row looping over vocabulary tiles (online max and
normaliser, then overlap and dot, then the gradient) and never materialises ``p`` or ``q``.
:func:`select_row_ops` picks one and can say why the kernel is not used.
"""

import os
from typing import Optional, Tuple

import torch


#: ``auto`` (default): Triton on CUDA fp32 logits; ``0``: always torch; ``1``: require Triton.
TRITON_ENV = 'MEGATRON_MTP_TV_TRITON'


class TorchRowOps:
    """Torch implementation: probabilities materialised in place of the logits."""

    name = 'torch'

    @staticmethod
    def local_stats(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """This shard's ``(row max, log sum exp(z - max))``; leaves ``exp(z - max)`` in ``z``."""
        local_max = z.amax(dim=-1)
        z.sub_(local_max.unsqueeze(-1)).exp_()
        return local_max, z.sum(dim=-1).log_()

    @staticmethod
    def finish(z: torch.Tensor, local_max: torch.Tensor, lse: torch.Tensor):
        """Probabilities from the shifted exponentials: one multiply, no second ``exp`` pass."""
        return [z.mul_((local_max - lse).exp_().unsqueeze(-1)), None]

    @staticmethod
    def overlap(target, offset: int, draft) -> Tuple[torch.Tensor, torch.Tensor]:
        q = draft[0]
        p = target[0][offset : offset + q.shape[0]]
        draft[1] = below = q < p  # kept for the gradient: at a tie min() is p, no gradient
        return torch.minimum(p, q).sum(-1), torch.where(below, q, 0.0).sum(-1)

    @staticmethod
    def grad_(target, offset: int, draft, dot: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        q, below = draft
        draft[1] = None
        return tv_logit_grad_(q, below, dot).mul_(coef.unsqueeze(-1))


def tv_logit_grad_(q: torch.Tensor, below: torch.Tensor, dot: torch.Tensor) -> torch.Tensor:
    """``d(1 - alpha)/dz = q * (dot - 1[q < p])``, written into ``q`` (its memory is reused).

    Args:
        q: ``[n, V/tp]`` draft probabilities (overwritten). below: ``[n, V/tp]`` ``q < p``.
        dot: ``[n]`` full-vocabulary ``sum_u q_u 1[q_u < p_u]`` (all-reduced over TP).
    """
    return q.mul_(below.to(q.dtype).neg_().add_(dot.unsqueeze(-1)))


class TritonRowOps:
    """Triton implementation: logits stay logits; probabilities are recomputed per tile."""

    name = 'triton'

    @staticmethod
    def local_stats(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return _triton().row_stats(z)

    @staticmethod
    def finish(z: torch.Tensor, local_max: torch.Tensor, lse: torch.Tensor):
        return z, lse

    @staticmethod
    def overlap(target, offset: int, draft):
        zt, lse_t = target
        zq, lse_q = draft
        n = zq.shape[0]
        return _triton().overlap(zt[offset : offset + n], lse_t[offset : offset + n], zq, lse_q)

    @staticmethod
    def grad_(target, offset: int, draft, dot, coef):
        zt, lse_t = target
        zq, lse_q = draft
        n = zq.shape[0]
        return _triton().grad_(zt[offset : offset + n], lse_t[offset : offset + n], zq, lse_q, dot, coef)


def triton_unavailable_reason(logits: torch.Tensor) -> Optional[str]:
    """Why the Triton kernel cannot run on ``logits`` (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return 'triton is not installed'
    interpreted = os.environ.get('TRITON_INTERPRET') == '1'
    if not logits.is_cuda and not interpreted:
        return f'logits are on {logits.device.type}, the kernel needs CUDA (or TRITON_INTERPRET=1)'
    if logits.dtype != torch.float32:
        return f'logits dtype is {logits.dtype}, the kernel takes float32'
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return 'logits are not row-major [n, V]'
    return None


def select_row_ops(logits: torch.Tensor):
    """``(ops, reason)``: the row implementation for ``logits`` and why Triton is not used."""
    mode = os.environ.get(TRITON_ENV, 'auto')
    if mode not in ('auto', '0', '1'):
        raise ValueError(f"{TRITON_ENV}={mode!r}; expected 'auto', '0' or '1'.")
    if mode == '0':
        return TorchRowOps, f'disabled by {TRITON_ENV}=0'
    reason = triton_unavailable_reason(logits)
    if reason is None:
        return TritonRowOps, None
    if mode == '1':
        raise RuntimeError(f'{TRITON_ENV}=1 but the Triton kernel cannot run: {reason}.')
    return TorchRowOps, reason


def _triton():
    from . import triton_kernels

    return triton_kernels
