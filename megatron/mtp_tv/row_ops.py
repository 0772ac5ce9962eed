# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The per-row vocabulary passes of the draft losses, in torch and in Triton."""

import math
import os
from typing import Callable, Dict, Literal, NamedTuple, Optional, Tuple, get_args

import torch

from .vocab_parallel import ProcessGroup, combine_row_stats, group_size

RowKernels = Literal['auto', 'torch', 'triton']
ROW_KERNELS = get_args(RowKernels)

#: Smallest normal fp32: KL's logarithm clamps probabilities to it.
_TINY = torch.finfo(torch.float32).tiny


class Scratch:
    """Named buffers reused from one chunk (or row block) to the next."""

    def __init__(self):
        self._buffers: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape`` view of the buffer ``name``, reallocated only when it is too small."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


CoefficientFn = Callable[
    [slice, torch.Tensor], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
]


class RowStats(NamedTuple):
    """``[m]`` full-vocabulary row max, global argmax (or None) and ``log sum_v exp(z_v)``."""

    max: torch.Tensor
    argmax: Optional[torch.Tensor]
    lse: torch.Tensor


class PairSums(NamedTuple):
    """This shard's ``[n]`` ``sum_v min(p, q)``, ``sum_v q_v 1[q_v < p_v]`` and KL per row."""

    overlap: torch.Tensor
    dot: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]


ARGMAX_GROUP = 256


def row_max_argmax(z: torch.Tensor, out_max: torch.Tensor, out_argmax: torch.Tensor) -> None:
    """Row max and first maximal index of ``z [r, V]``, as ``torch.max(z, -1)``, through group
    maxima (faster on a CPU)."""
    r, V = z.shape
    body = V - V % ARGMAX_GROUP
    if body < 2 * ARGMAX_GROUP:
        torch.max(z, dim=-1, out=(out_max, out_argmax))
        return
    groups = z[:, :body].view(r, body // ARGMAX_GROUP, ARGMAX_GROUP)
    best, group = torch.max(torch.amax(groups, dim=-1), dim=-1)
    members = groups.gather(1, group.view(r, 1, 1).expand(r, 1, ARGMAX_GROUP)).squeeze(1)
    index = group * ARGMAX_GROUP + members.argmax(dim=-1)
    if body < V:
        tail_max, tail_index = torch.max(z[:, body:], dim=-1)
        from_tail = tail_max > best
        best = torch.where(from_tail, tail_max, best)
        index = torch.where(from_tail, tail_index + body, index)
    out_max.copy_(best)
    out_argmax.copy_(index)


class TorchRowOps:
    """Torch passes over row blocks, probabilities in place of the logits: the CPU path and the
    test oracle."""

    name = 'torch'

    #: Values per row block on a CPU (the fastest measured).
    BLOCK_ELEMENTS = 1 << 20

    MIN_BLOCKS = 8

    def __init__(self):
        self._scratch = Scratch()

    def normalise_(
        self,
        z: torch.Tensor,
        group: ProcessGroup,
        vocab_start: Optional[int] = None,
        source: Optional[torch.Tensor] = None,
    ):
        """``(z, RowStats)``, the ``[n, V/tp]`` fp32 logits ``z`` overwritten with their softmax
        (``vocab_start``: also the argmax; ``source``: ``z``'s first rows, read in place)."""
        single_shard = group_size(group) == 1
        n = z.shape[0]
        from_source = source.shape[0] if source is not None else 0
        local_max, local_logsum = z.new_empty(n), z.new_empty(n)
        local_argmax = (
            torch.empty(n, dtype=torch.long, device=z.device) if vocab_start is not None else None
        )
        for rows in self._blocks(z):
            zb, mb, sb = z[rows], local_max[rows], local_logsum[rows]
            xb = zb
            if rows.start < from_source:
                if rows.stop <= from_source:
                    xb = source[rows]
                else:  # a block across the end of the source rows: copy that part first
                    zb[: from_source - rows.start].copy_(source[rows.start :])
            if local_argmax is None:
                torch.amax(xb, dim=-1, out=mb)
            else:
                row_max_argmax(xb, mb, local_argmax[rows])
            torch.sub(xb, mb.unsqueeze(-1), out=zb).exp_()
            torch.sum(zb, dim=-1, out=sb)
            if single_shard:  # divide in cache; not torch.softmax
                zb.div_(sb.unsqueeze(-1))
        local_logsum.log_()
        if local_argmax is not None:
            local_argmax += vocab_start
        lse, global_max, argmax = combine_row_stats(local_max, local_logsum, group, local_argmax)
        if not single_shard:
            z.mul_((local_max - lse).exp_().unsqueeze(-1))
        return z, RowStats(global_max, argmax, lse)

    @staticmethod
    def rows(state: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start .. stop-1`` of a normalised chunk ``state``."""
        return state[start:stop]

    @staticmethod
    def written_grad(q: torch.Tensor) -> torch.Tensor:
        """The tensor a gradient pass wrote into (the probabilities, in place)."""
        return q

    def pair_sums(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        dot: bool = False,
        kl: bool = False,
        coefficients: Optional[CoefficientFn] = None,
    ) -> PairSums:
        """This shard's :class:`PairSums` of draft rows ``q`` against target rows ``p``; with
        ``coefficients`` (one shard: the sums are complete) also :meth:`grad_`, in the same pass."""
        n = q.shape[0]
        overlap = q.new_empty(n)
        dots = q.new_empty(n) if dot else None
        kls = q.new_empty(n) if kl else None
        for rows in self._blocks(q):
            qb, pb = q[rows], p[rows]
            work = self._buffer('work', qb)
            torch.sum(torch.minimum(pb, qb, out=work), dim=-1, out=overlap[rows])
            if kl:
                ratio = torch.clamp(pb, min=_TINY, out=work)
                ratio.div_(torch.clamp(qb, min=_TINY, out=self._buffer('work2', qb))).log_().mul_(
                    pb
                )
                torch.sum(ratio, dim=-1, out=kls[rows])
            q_below = None
            if dot:  # last, so that the gradient below finds q * 1[q < p] in work
                q_below = self._q_below(pb, qb, work)
                torch.sum(q_below, dim=-1, out=dots[rows])
            if coefficients is not None:
                tv_coef, kl_coef = coefficients(rows, overlap[rows])
                self._write_grad(pb, qb, q_below, dots[rows] if dot else None, tv_coef, kl_coef)
        return PairSums(overlap, dots, kls)

    def grad_(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        dot: Optional[torch.Tensor],
        tv_coef: Optional[torch.Tensor],
        kl_coef: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)`` written into ``q``."""
        for rows in self._blocks(q):
            self._write_grad(
                p[rows],
                q[rows],
                None,
                dot[rows] if dot is not None else None,
                tv_coef[rows] if tv_coef is not None else None,
                kl_coef[rows] if kl_coef is not None else None,
            )
        return q

    def label_grad_(self, q: torch.Tensor, label: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``coef * (q - e_y)`` written into ``q``; ``label``: index into this shard, or -1."""
        for rows in self._blocks(q):
            q[rows].mul_(coef[rows].unsqueeze(-1))
        return _subtract_at_labels_(q, label, coef)

    def _q_below(self, pb, qb, out):
        """``q * 1[q < p]`` into ``out``; strict: at a tie ``min()`` is ``p``, the detached side."""
        return torch.mul(qb, torch.lt(qb, pb, out=self._buffer('below', qb)), out=out)

    def _write_grad(self, pb, qb, q_below, dot, tv_coef, kl_coef):
        if tv_coef is not None:
            if q_below is None:
                q_below = self._q_below(pb, qb, self._buffer('work', qb))
            offset = tv_coef * dot if kl_coef is None else tv_coef * dot + kl_coef
            qb.mul_(offset.unsqueeze(-1)).addcmul_(q_below, tv_coef.unsqueeze(-1), value=-1.0)
        else:
            qb.mul_(kl_coef.unsqueeze(-1))
        if kl_coef is not None:
            qb.addcmul_(pb, kl_coef.unsqueeze(-1), value=-1.0)

    def _blocks(self, z: torch.Tensor):
        if z.device.type != 'cpu':  # one launch per pass; GPU caches do not hold a block anyway
            return [slice(0, z.shape[0])]
        # At most 1/MIN_BLOCKS of the rows: small scratch beside a small chunk (memory bound).
        by_values = self.BLOCK_ELEMENTS // max(1, z.shape[-1])
        step = max(1, min(by_values, z.shape[0] // self.MIN_BLOCKS))
        return [slice(start, start + step) for start in range(0, z.shape[0], step)]

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._scratch.take(name, like.shape, like.dtype, like.device)


class TritonRowOps:
    """Triton passes: the logits stay; probabilities are recomputed per tile."""

    name = 'triton'

    def normalise_(
        self,
        z: torch.Tensor,
        group: ProcessGroup,
        vocab_start: Optional[int] = None,
        source: Optional[torch.Tensor] = None,
    ):
        """``((z, lse), RowStats)``, the logits left in place (``source`` copied in)."""
        if source is not None:
            z[: source.shape[0]].copy_(source)
        local_max, local_logsum, local_argmax = _triton().row_stats(
            z, with_argmax=vocab_start is not None
        )
        if local_argmax is not None:
            local_argmax += vocab_start
        lse, global_max, argmax = combine_row_stats(local_max, local_logsum, group, local_argmax)
        return (z, lse), RowStats(global_max, argmax, lse)

    @staticmethod
    def rows(state, start: int, stop: int):
        """Rows ``start .. stop-1`` of a chunk ``state`` (its logits and log-normaliser)."""
        z, lse = state
        return z[start:stop], lse[start:stop]

    @staticmethod
    def written_grad(q):
        """The tensor a gradient pass wrote into (the logits, in place)."""
        return q[0]

    def pair_sums(self, p, q, dot=False, kl=False, coefficients=None):
        """Per-row overlap, dot and KL of ``p`` and ``q``; with ``coefficients``, the logit gradient
        written into ``q`` in the same pass."""
        overlap, dots, kls = _triton().pair_sums(*p, *q)
        sums = PairSums(overlap, dots if dot else None, kls if kl else None)
        if coefficients is not None:
            tv_coef, kl_coef = coefficients(slice(0, overlap.shape[0]), overlap)
            self.grad_(p, q, sums.dot, tv_coef, kl_coef)
        return sums

    def grad_(self, p, q, dot, tv_coef, kl_coef=None):
        """The logit gradient of the TV (and KL) terms, written into ``q``'s logits."""
        return _triton().grad_(*p, *q, dot, tv_coef, kl_coef)

    @staticmethod
    def label_grad_(q, label, coef):
        """Cross-entropy's logit gradient ``coef * (q - onehot(label))``, written into ``q``."""
        z, lse = q
        z.sub_(lse.unsqueeze(-1)).exp_().mul_(coef.unsqueeze(-1))
        _subtract_at_labels_(z, label, coef)
        return q


def _subtract_at_labels_(g: torch.Tensor, label: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``g[i, label[i]] -= coef[i]`` where ``label >= 0``: one write per row, no host sync."""
    inside = label >= 0
    column = torch.where(inside, label, torch.zeros_like(label)).unsqueeze(1)
    g.scatter_add_(
        1, column, torch.where(inside, -coef, torch.zeros_like(coef)).unsqueeze(1).to(g.dtype)
    )
    return g


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


def row_ops_for(logits: torch.Tensor, kernels: RowKernels):
    """Fresh row ops for ``logits``: Triton where it can run (RuntimeError for ``'triton'``
    where it cannot), else torch."""
    if kernels == 'torch':
        return TorchRowOps()
    reason = triton_unavailable_reason(logits)
    if reason is None:
        return TritonRowOps()
    if kernels == 'triton':
        raise RuntimeError(f"mtp_tv_kernels='triton' but the Triton kernel cannot run: {reason}.")
    return TorchRowOps()


def _triton():
    # Imported on first use: Triton is optional (the torch row ops need none).
    from . import triton_kernels

    return triton_kernels
