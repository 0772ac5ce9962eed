# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Triton kernels of :mod:`.row_ops`: one program per row over vocabulary tiles, in fp32."""

from typing import Optional

import torch
import triton
import triton.language as tl


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), 4096)


@triton.jit
def _row_stats_kernel(z_ptr, stride, out_ptr, V, BLOCK: tl.constexpr):
    # Online max and normaliser; a later tile takes the argmax only with a strictly larger max.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float('-inf'), tl.float32)
    s = tl.zeros((), tl.float32)
    arg = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        z = tl.load(z_ptr + row * stride + idx, mask=idx < V, other=float('-inf'))
        tile_max = tl.max(z, 0)
        tile_arg = tl.argmax(z, 0).to(tl.int64) + start
        arg = tl.where(tile_max > m, tile_arg, arg)
        m_new = tl.maximum(m, tile_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(out_ptr + row * 3, m)
    tl.store(out_ptr + row * 3 + 1, tl.log(s))
    tl.store(out_ptr + row * 3 + 2, arg.to(tl.float32))


@triton.jit
def _pair_sums_kernel(
    zt_ptr, st, lse_t_ptr, zq_ptr, sq, lse_q_ptr, out_ptr, V, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_t = tl.load(lse_t_ptr + row)
    lse_q = tl.load(lse_q_ptr + row)
    overlap = tl.zeros((), tl.float32)
    dot = tl.zeros((), tl.float32)
    kl = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        log_p = tl.load(zt_ptr + row * st + idx, mask=valid, other=float('-inf')) - lse_t
        log_q = tl.load(zq_ptr + row * sq + idx, mask=valid, other=float('-inf')) - lse_q
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        overlap += tl.sum(tl.minimum(p, q), 0)
        dot += tl.sum(tl.where(q < p, q, 0.0), 0)
        kl += tl.sum(tl.where(p > 0, p * (log_p - log_q), 0.0), 0)
    tl.store(out_ptr + row * 3, overlap)
    tl.store(out_ptr + row * 3 + 1, dot)
    tl.store(out_ptr + row * 3 + 2, kl)


@triton.jit
def _grad_kernel(
    zt_ptr, st, lse_t_ptr, zq_ptr, sq, lse_q_ptr, dot_ptr, tv_ptr, kl_ptr, V, BLOCK: tl.constexpr
):
    # tv * q * (dot - 1[q < p]) + kl * (q - p) over the draft logits; a tie passes no TV gradient.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_t = tl.load(lse_t_ptr + row)
    lse_q = tl.load(lse_q_ptr + row)
    dot = tl.load(dot_ptr + row)
    tv = tl.load(tv_ptr + row)
    kl = tl.load(kl_ptr + row)
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        p = tl.exp(tl.load(zt_ptr + row * st + idx, mask=valid, other=float('-inf')) - lse_t)
        q = tl.exp(tl.load(zq_ptr + row * sq + idx, mask=valid, other=float('-inf')) - lse_q)
        below = tl.where(q < p, 1.0, 0.0)
        tl.store(zq_ptr + row * sq + idx, tv * q * (dot - below) + kl * (q - p), mask=valid)


def row_stats(z: torch.Tensor, with_argmax: bool = False):
    """``(row max [n], log sum exp(z - max) [n], argmax [n] int64 or None)`` of fp32 ``[n, V]``."""
    n, V = z.shape
    out = torch.empty(n, 3, dtype=torch.float32, device=z.device)
    if n:
        _row_stats_kernel[(n,)](z, z.stride(0), out, V, BLOCK=_block(V))
    argmax = out[:, 2].long() if with_argmax else None
    return out[:, 0], out[:, 1], argmax


def pair_sums(zt, lse_t, zq, lse_q):
    """``(sum_v min(p, q), sum_v q_v 1[q_v < p_v], sum_v p log(p / q))`` per row, this shard
    only."""
    n, V = zq.shape
    out = torch.empty(n, 3, dtype=torch.float32, device=zq.device)
    if n:
        _pair_sums_kernel[(n,)](
            zt,
            zt.stride(0),
            lse_t.contiguous(),
            zq,
            zq.stride(0),
            lse_q.contiguous(),
            out,
            V,
            BLOCK=_block(V),
        )
    return out[:, 0], out[:, 1], out[:, 2]


def grad_(
    zt,
    lse_t,
    zq,
    lse_q,
    dot: Optional[torch.Tensor],
    tv_coef: Optional[torch.Tensor],
    kl_coef: Optional[torch.Tensor],
):
    """Overwrite ``zq`` with ``tv * q * (dot - 1[q < p]) + kl * (q - p)``; return it."""
    n, V = zq.shape
    if n:
        zeros = torch.zeros(n, dtype=torch.float32, device=zq.device)

        def column(x):
            return zeros if x is None else x.float().contiguous()

        _grad_kernel[(n,)](
            zt,
            zt.stride(0),
            lse_t.contiguous(),
            zq,
            zq.stride(0),
            lse_q.contiguous(),
            column(dot),
            column(tv_coef),
            column(kl_coef),
            V,
            BLOCK=_block(V),
        )
    return zq
