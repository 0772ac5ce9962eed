"""Triton kernels for the per-row passes of the TV loss (see :mod:`.row_ops`).

One program per row, looping over vocabulary tiles; fp32 throughout. Imported only when the
Triton path is selected (CUDA, or ``TRITON_INTERPRET=1`` on CPU for tests).
"""

import torch
import triton
import triton.language as tl


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), 4096)


@triton.jit
def _row_stats_kernel(z_ptr, stride, out_ptr, V, BLOCK: tl.constexpr):
    # Online max and normaliser: s is kept relative to the running max m.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float('-inf'), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        z = tl.load(z_ptr + row * stride + idx, mask=idx < V, other=float('-inf'))
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(out_ptr + row * 2, m)
    tl.store(out_ptr + row * 2 + 1, tl.log(s))


@triton.jit
def _overlap_kernel(zt_ptr, st, lse_t_ptr, zq_ptr, sq, lse_q_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_t = tl.load(lse_t_ptr + row)
    lse_q = tl.load(lse_q_ptr + row)
    overlap = tl.zeros((), tl.float32)
    dot = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        p = tl.exp(tl.load(zt_ptr + row * st + idx, mask=valid, other=float('-inf')) - lse_t)
        q = tl.exp(tl.load(zq_ptr + row * sq + idx, mask=valid, other=float('-inf')) - lse_q)
        overlap += tl.sum(tl.minimum(p, q), 0)
        dot += tl.sum(tl.where(q < p, q, 0.0), 0)
    tl.store(out_ptr + row * 2, overlap)
    tl.store(out_ptr + row * 2 + 1, dot)


@triton.jit
def _grad_kernel(zt_ptr, st, lse_t_ptr, zq_ptr, sq, lse_q_ptr, dot_ptr, coef_ptr, V, BLOCK: tl.constexpr):
    # coef * q * (dot - 1[q < p]) written over the draft logits (strict <: ties pass no gradient).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_t = tl.load(lse_t_ptr + row)
    lse_q = tl.load(lse_q_ptr + row)
    dot = tl.load(dot_ptr + row)
    coef = tl.load(coef_ptr + row)
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        p = tl.exp(tl.load(zt_ptr + row * st + idx, mask=valid, other=float('-inf')) - lse_t)
        q = tl.exp(tl.load(zq_ptr + row * sq + idx, mask=valid, other=float('-inf')) - lse_q)
        below = tl.where(q < p, 1.0, 0.0)
        tl.store(zq_ptr + row * sq + idx, coef * q * (dot - below), mask=valid)


def row_stats(z: torch.Tensor):
    """``(row max [n], log sum exp(z - max) [n])`` of fp32 logits ``[n, V]``."""
    n, V = z.shape
    out = torch.empty(n, 2, dtype=torch.float32, device=z.device)
    if n:
        _row_stats_kernel[(n,)](z, z.stride(0), out, V, BLOCK=_block(V))
    return out[:, 0], out[:, 1]


def overlap(zt, lse_t, zq, lse_q):
    """``(sum_v min(p, q), sum_v q_v 1[q_v < p_v])`` per row, this shard only."""
    n, V = zq.shape
    out = torch.empty(n, 2, dtype=torch.float32, device=zq.device)
    if n:
        _overlap_kernel[(n,)](
            zt, zt.stride(0), lse_t.contiguous(), zq, zq.stride(0), lse_q.contiguous(), out, V,
            BLOCK=_block(V),
        )
    return out[:, 0], out[:, 1]


def grad_(zt, lse_t, zq, lse_q, dot, coef):
    """Overwrite ``zq`` with the logit gradient ``coef * q * (dot - 1[q < p])``; return it."""
    n, V = zq.shape
    if n:
        _grad_kernel[(n,)](
            zt, zt.stride(0), lse_t.contiguous(), zq, zq.stride(0), lse_q.contiguous(),
            dot.float().contiguous(), coef.float().contiguous(), V, BLOCK=_block(V),
        )
    return zq
