"""The per-row vocabulary passes of the draft losses, in torch and in Triton.

One chunk of the sweep in :mod:`.linear_tv` holds the fp32 logits (already divided by the
verification temperature) of the chunk's target rows and of every depth's draft rows in one
``[m, V/tp]`` buffer, and needs:

1. the normaliser of every row over the full vocabulary, and optionally its argmax
   (``normalise_``: per-shard statistics combined with one all-gather under tensor parallelism,
   see :func:`.combine_row_stats`);
2. for a block of draft rows ``q`` and the target rows ``p`` they are compared with (``rows``
   slices the normalised buffer), this shard's per-row sums (``pair_sums``; all-reduced by the
   caller): the overlap ``sum_v min(p, q)``, and when asked the TV gradient's dot product
   ``sum_v q_v 1[q_v < p_v]`` and ``KL(p || q) = sum_v p_v log(p_v / q_v)``;
3. the logit gradient ``tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)`` written over the
   draft rows (``grad_``; or ``pair_sums`` itself when the shard is the whole vocabulary and the
   loss can say a row's coefficients from the row's own overlap), or cross-entropy's
   ``coef * (q - e_y)`` (``label_grad_``).

:class:`TorchRowOps` materialises the probabilities in place and is the CPU path and test oracle.
:class:`TritonRowOps` runs one program per row looping over vocabulary tiles (online max and
normaliser, then the sums, then the gradient) and never materialises ``p`` or ``q``.
:func:`select_row_ops` picks one and can say why the kernel is not used.
"""

import os
from typing import Callable, Literal, NamedTuple, Optional, Tuple, get_args

import torch

from .scratch import Scratch
from .vocab_parallel import ProcessGroup, combine_row_stats, group_size

RowKernels = Literal['auto', 'torch', 'triton']
#: The row kernels a sweep may use (``mtp_tv_kernels``; see :func:`select_row_ops`).
ROW_KERNELS = get_args(RowKernels)

#: Smallest normal fp32: probabilities are clamped to it inside KL's logarithm, so a draft that
#: underflows where the target has mass adds at most ``p * 87.3`` per entry instead of infinity
#: (the KL gradient ``q - p`` does not use the logarithm and stays exact).
_TINY = torch.finfo(torch.float32).tiny

#: ``(rows, overlap of those rows) -> (tv_coef, kl_coef)`` for the one-pass gradient.
CoefficientFn = Callable[[slice, torch.Tensor], Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


class RowStats(NamedTuple):
    """Full-vocabulary statistics of every row of a chunk (after ``normalise_``)."""

    max: torch.Tensor
    """``[m]`` row max of the logits."""
    argmax: Optional[torch.Tensor]
    """``[m]`` int64 global vocabulary index of the max (lowest on ties), when asked for."""
    lse: torch.Tensor
    """``[m]`` ``log sum_v exp(z_v)`` over the full vocabulary."""


class PairSums(NamedTuple):
    """This shard's per-row sums of draft rows against their target rows."""

    overlap: torch.Tensor
    """``[n]`` ``sum_v min(p, q)``."""
    dot: Optional[torch.Tensor]
    """``[n]`` ``sum_v q_v 1[q_v < p_v]``, when asked for."""
    kl: Optional[torch.Tensor]
    """``[n]`` ``sum_v p_v log(p_v / q_v)``, when asked for."""


#: Width of the groups :func:`row_max_argmax` reduces first.
ARGMAX_GROUP = 256


def row_max_argmax(z: torch.Tensor, out_max: torch.Tensor, out_argmax: torch.Tensor) -> None:
    """Row max and first maximal index of ``z [r, V]``, as ``torch.max(z, -1)`` returns them.

    ``torch.max`` with indices runs about 4x slower than ``torch.amax`` on a CPU; this takes the
    vectorised max of groups of :data:`ARGMAX_GROUP` columns, the first maximal group, then the
    first maximal column inside it (the lowest index on ties, as ``torch.argmax``), with the
    columns past the last whole group compared at the end (the group's index wins a tie).
    """
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
    """Torch implementation: probabilities materialised in place of the logits.

    Why it is shaped this way (CPU, where this is the production path):

    * every pass writes into memory that already exists (the logits, or block-sized scratch
      buffers that live as long as this object, i.e. one sweep): a fresh ``[n, V]`` tensor per
      pass costs more in page faults than the arithmetic;
    * the indicator ``1[q < p]`` is kept as 0/1 floats: mixed bool/float products take a slow
      path;
    * on a CPU the passes of a phase run over blocks of about :data:`BLOCK_ELEMENTS` values
      (and at most an eighth of the operand's rows), so the second and later passes over a block
      find it in cache instead of streaming the chunk again. On CUDA (where the Triton kernels
      are the default, and this path runs with ``mtp_tv_kernels='torch'`` or bf16/fp16 logits)
      each pass is one kernel over the whole operand: cache blocking there would only multiply
      the launches (about 6 rows per block at a 152k vocabulary).
    """

    name = 'torch'

    #: Values per row block: small enough that a block of the 2-4 operands stays in cache,
    #: large enough that Python dispatch (a few microseconds per op) stays negligible and that
    #: the sweep opens few parallel regions: every op on a block is one, and each waits for its
    #: slowest thread, so on a CPU shared with other work (one core busy elsewhere) the step
    #: slows with their number (``tools/bench_row_ops.py`` times the candidates: on a 2-core
    #: EPYC 2^19 and 2^20 are the fastest, 2^21 falls out of cache; on a 2-core Xeon
    #: 2^18-2^21 are equally fast alone, and beside a busy loop on one core 2^20 took 0.82x
    #: and 0.97x the time of 2^19 in two runs).
    BLOCK_ELEMENTS = 1 << 20

    #: An operand with the rows for it is split into at least this many blocks (see ``_blocks``).
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
        """Overwrite ``z`` with its softmax over the full (possibly sharded) vocabulary.

        Args:
            z: ``[n, V/tp]`` fp32 logits.
            group: the group the vocabulary is sharded over.
            vocab_start: this shard's first vocabulary index; given, the argmax is computed too.
            source: optional ``[r, V/tp]`` logits of ``z``'s first ``r`` rows, not yet written
                there (e.g. the main head's logits, which must stay intact): the first pass over
                those rows reads them from ``source`` and writes ``z``, so no separate copy
                pass is made. Same dtype as ``z``.

        Returns:
            ``(probabilities [n, V/tp] (z itself), RowStats)``.
        """
        single_shard = group_size(group) == 1
        n = z.shape[0]
        from_source = _check_source(z, source)
        local_max, local_logsum = z.new_empty(n), z.new_empty(n)
        local_argmax = torch.empty(n, dtype=torch.long, device=z.device) if vocab_start is not None else None
        for rows in self._blocks(z):
            zb, mb, sb = z[rows], local_max[rows], local_logsum[rows]
            xb = zb  # where the block's logits are read from
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
            if single_shard:  # the normaliser is complete: divide while the block is in cache
                # (not ATen's fused torch.softmax(zb, out=zb): a third fewer passes, but its
                # lane-wise sum leaves rows summing to 1 +- 7e-6 at V 32k against 2e-6 here,
                # an error floor on 1 - TV; tests/test_linear_tv.py holds this to 4e-6)
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
        return state[start:stop]

    @staticmethod
    def written_grad(q: torch.Tensor) -> torch.Tensor:
        """The logit gradient ``pair_sums(..., coefficients=...)`` wrote over the draft rows."""
        return q

    def pair_sums(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        dot: bool = False,
        kl: bool = False,
        coefficients: Optional[CoefficientFn] = None,
    ) -> PairSums:
        """This shard's :class:`PairSums` of draft rows ``q`` against target rows ``p``.

        With ``coefficients`` (only when this shard holds the whole vocabulary, so a row's sums are
        complete within the pass) the logit gradient is also written into ``q`` in the same pass,
        while each block is in cache, as :meth:`grad_` would.
        """
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
                ratio.div_(torch.clamp(qb, min=_TINY, out=self._buffer('work2', qb))).log_().mul_(pb)
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
        """``tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)`` written into ``q``; the
        indicator is recomputed (one compare, in cache) rather than kept per depth."""
        for rows in self._blocks(q):
            self._write_grad(
                p[rows], q[rows], None, dot[rows] if dot is not None else None,
                tv_coef[rows] if tv_coef is not None else None,
                kl_coef[rows] if kl_coef is not None else None,
            )
        return q

    def label_grad_(self, q: torch.Tensor, label: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """Cross-entropy's ``coef * (q - e_y)`` written into the probabilities ``q`` ``[n, V/tp]``;
        ``label`` ``[n]`` is each row's label as an index into this shard (-1: on another shard,
        or no valid label: no ``e_y`` term here)."""
        for rows in self._blocks(q):
            q[rows].mul_(coef[rows].unsqueeze(-1))
        return _subtract_at_labels_(q, label, coef)

    def _q_below(self, pb, qb, out):
        """``q * 1[q < p]`` into ``out``; strict: at a tie ``min()`` is ``p``, the detached side."""
        return torch.mul(qb, torch.lt(qb, pb, out=self._buffer('below', qb)), out=out)

    def _write_grad(self, pb, qb, q_below, dot, tv_coef, kl_coef):
        """One block of :meth:`grad_`: ``q * (tv*dot + kl) - tv * (q * 1[q < p]) - kl * p``, from
        ``q_below = q * 1[q < p]`` when the caller has it (made here otherwise). Two passes for
        the TV term: the indicator product is the one the dot product summed."""
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
        # At most BLOCK_ELEMENTS values, and at most 1/MIN_BLOCKS of the rows: the
        # block-sized scratch (up to three blocks in pair_sums) then stays a small part of the
        # chunk's own logits at any shape, which the peak bound against the CE path needs
        # when the chunk is small (tests/test_memory_bound.py).
        by_values = self.BLOCK_ELEMENTS // max(1, z.shape[-1])
        step = max(1, min(by_values, z.shape[0] // self.MIN_BLOCKS))
        return [slice(start, start + step) for start in range(0, z.shape[0], step)]

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._scratch.take(name, like.shape, like.dtype, like.device)


def _check_source(z: torch.Tensor, source: Optional[torch.Tensor]) -> int:
    """Rows of ``z`` that ``normalise_`` reads from ``source`` (0 without one)."""
    if source is None:
        return 0
    if source.dim() != 2 or source.shape[0] > z.shape[0] or source.shape[1] != z.shape[1]:
        raise ValueError(f"source shape {tuple(source.shape)} does not fit logits {tuple(z.shape)}.")
    if source.dtype != z.dtype:
        raise ValueError(f"source dtype {source.dtype} differs from the logits' {z.dtype}.")
    return source.shape[0]


class TritonRowOps:
    """Triton implementation: logits stay logits; probabilities are recomputed per tile."""

    name = 'triton'

    def normalise_(
        self,
        z: torch.Tensor,
        group: ProcessGroup,
        vocab_start: Optional[int] = None,
        source: Optional[torch.Tensor] = None,
    ):
        """Leaves the logits in place (``source`` copied into ``z``'s first rows: the kernels read
        one buffer); returns ``((z, lse), RowStats)``."""
        if _check_source(z, source):
            z[: source.shape[0]].copy_(source)
        local_max, local_logsum, local_argmax = _triton().row_stats(z, with_argmax=vocab_start is not None)
        if local_argmax is not None:
            local_argmax += vocab_start
        lse, global_max, argmax = combine_row_stats(local_max, local_logsum, group, local_argmax)
        return (z, lse), RowStats(global_max, argmax, lse)

    @staticmethod
    def rows(state, start: int, stop: int):
        z, lse = state
        return z[start:stop], lse[start:stop]

    @staticmethod
    def written_grad(q):
        return q[0]

    def pair_sums(self, p, q, dot=False, kl=False, coefficients=None):
        overlap, dots, kls = _triton().pair_sums(*p, *q)
        sums = PairSums(overlap, dots if dot else None, kls if kl else None)
        if coefficients is not None:
            tv_coef, kl_coef = coefficients(slice(0, overlap.shape[0]), overlap)
            self.grad_(p, q, sums.dot, tv_coef, kl_coef)
        return sums

    def grad_(self, p, q, dot, tv_coef, kl_coef=None):
        return _triton().grad_(*p, *q, dot, tv_coef, kl_coef)

    @staticmethod
    def label_grad_(q, label, coef):
        """:meth:`TorchRowOps.label_grad_` on ``(logits, lse)`` rows: the probabilities are formed
        in place of the logits first (two elementwise passes; no kernel of its own)."""
        z, lse = q
        z.sub_(lse.unsqueeze(-1)).exp_().mul_(coef.unsqueeze(-1))
        _subtract_at_labels_(z, label, coef)
        return q


def _subtract_at_labels_(g: torch.Tensor, label: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``g[i, label[i]] -= coef[i]`` for the rows whose label lies in this shard (``label >= 0``).

    Every row adds at one column (its label's, or column 0 with nothing for a label outside the
    shard), so nothing depends on how many labels the shard holds: no ``nonzero``, no host
    synchronisation, and one deterministic write per row."""
    inside = label >= 0
    column = torch.where(inside, label, torch.zeros_like(label)).unsqueeze(1)
    g.scatter_add_(1, column, torch.where(inside, -coef, torch.zeros_like(coef)).unsqueeze(1).to(g.dtype))
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


def select_row_ops(logits: torch.Tensor, kernels: RowKernels = 'auto'):
    """``(ops, reason)``: a fresh row-ops object for ``logits`` and why Triton is not used.

    Args:
        logits: ``[n, V/tp]`` the chunk's logits.
        kernels: ``'auto'``: Triton where it can run (CUDA fp32 logits, or ``TRITON_INTERPRET=1``),
            else torch; ``'torch'``: always torch; ``'triton'``: Triton, or a RuntimeError saying
            why it cannot run (``mtp_tv_kernels``).

    Raises:
        ValueError: for ``kernels`` not in :data:`ROW_KERNELS` (the sweep calls
            :func:`row_ops_for` with the value :class:`~.options.MTPLossOptions` checked).
    """
    if kernels not in ROW_KERNELS:
        raise ValueError(f'kernels={kernels!r}; expected one of {list(ROW_KERNELS)}.')
    return row_ops_for(logits, kernels)


def row_ops_for(logits: torch.Tensor, kernels: RowKernels):
    """:func:`select_row_ops` for a ``kernels`` known to be one of :data:`ROW_KERNELS`."""
    if kernels == 'torch':
        return TorchRowOps(), "mtp_tv_kernels='torch'"
    reason = triton_unavailable_reason(logits)
    if reason is None:
        return TritonRowOps(), None
    if kernels == 'triton':
        raise RuntimeError(f"mtp_tv_kernels='triton' but the Triton kernel cannot run: {reason}.")
    return TorchRowOps(), reason


def _triton():
    from . import triton_kernels

    return triton_kernels
