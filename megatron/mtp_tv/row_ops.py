"""The per-row vocabulary passes of the TV loss, in torch and in Triton.

One chunk of the sweep in :mod:`.linear_tv` holds the fp32 logits of the chunk's target rows and
of every depth's draft rows in one ``[m, V/tp]`` buffer, and needs:

1. the normaliser of every row over the full vocabulary (``normalise_``: per-shard statistics
   combined with one all-gather under tensor parallelism, see :func:`.combine_logsumexp`);
2. for a block of draft rows ``q`` and the target rows ``p`` they are compared with (``rows``
   slices the normalised buffer), this shard's overlap ``sum_v min(p, q)`` and dot product
   ``sum_v q_v 1[q_v < p_v]`` (``overlap``; all-reduced by the caller);
3. the logit gradient ``coef * q * (dot - 1[q < p])``, written over the draft rows (``grad_``,
   or ``overlap`` itself when the shard is the whole vocabulary and ``coef`` is known up front).

:class:`TorchRowOps` materialises the probabilities in place and is the CPU path and test oracle.
:class:`TritonRowOps` runs one program per row looping over vocabulary tiles (online max and
normaliser, then overlap and dot, then the gradient) and never materialises ``p`` or ``q``.
:func:`select_row_ops` picks one and can say why the kernel is not used.
"""

import os
from typing import Dict, Optional, Tuple

import torch

from .vocab_parallel import ProcessGroup, combine_logsumexp, group_size

#: ``auto`` (default): Triton on CUDA fp32 logits; ``0``: always torch; ``1``: require Triton.
TRITON_ENV = 'MEGATRON_MTP_TV_TRITON'


class Scratch:
    """Named buffers reused from one chunk to the next; each only ever grows."""

    def __init__(self):
        self._buffers: Dict[str, torch.Tensor] = {}

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` view of buffer ``name``."""
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


class TorchRowOps:
    """Torch implementation: probabilities materialised in place of the logits.

    Why it is shaped this way (CPU, where this is the production path):

    * every pass writes into memory that already exists (the logits, or block-sized scratch
      buffers that live as long as this object, i.e. one sweep): a fresh ``[n, V]`` tensor per
      pass costs more in page faults than the arithmetic;
    * the indicator ``1[q < p]`` is kept as 0/1 floats: mixed bool/float products take a slow
      path;
    * the passes of a phase run over blocks of about :data:`BLOCK_ELEMENTS` values, so the
      second and later passes over a block find it in cache instead of streaming the chunk again.
    """

    name = 'torch'

    #: Values per row block: small enough that a block of the 2-4 operands fits in a core's L2,
    #: large enough that Python dispatch (a few microseconds per op) stays negligible.
    BLOCK_ELEMENTS = 1 << 18

    def __init__(self):
        self._scratch = Scratch()

    def normalise_(self, z: torch.Tensor, group: ProcessGroup):
        """Overwrite ``z`` with its softmax over the full (possibly sharded) vocabulary.

        Returns ``(probabilities [n, V/tp] (z itself), full-vocabulary row max [n])``.
        """
        single_shard = group_size(group) == 1
        local_max, local_logsum = z.new_empty(z.shape[0]), z.new_empty(z.shape[0])
        for rows in self._blocks(z):
            zb, mb, sb = z[rows], local_max[rows], local_logsum[rows]
            torch.amax(zb, dim=-1, out=mb)
            zb.sub_(mb.unsqueeze(-1)).exp_()
            torch.sum(zb, dim=-1, out=sb)
            if single_shard:  # the normaliser is complete: divide while the block is in cache
                zb.div_(sb.unsqueeze(-1))
        local_logsum.log_()
        lse, global_max = combine_logsumexp(local_max, local_logsum, group)
        if not single_shard:
            z.mul_((local_max - lse).exp_().unsqueeze(-1))
        return z, global_max

    @staticmethod
    def rows(state: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return state[start:stop]

    @staticmethod
    def written_grad(q: torch.Tensor) -> torch.Tensor:
        """The logit gradient ``overlap(..., grad_coef)`` wrote over the draft rows ``q``."""
        return q

    def overlap(
        self, p: torch.Tensor, q: torch.Tensor, grad_coef: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """This shard's ``(sum_v min(p, q), sum_v q_v 1[q_v < p_v])`` per row.

        With ``grad_coef`` (only when this shard holds the whole vocabulary, so the dot product is
        already complete) the logit gradient is also written into ``q`` in the same pass, while
        each block is in cache, as :meth:`grad_` would.
        """
        overlap, dot = q.new_empty(q.shape[0]), q.new_empty(q.shape[0])
        neg_coef = grad_coef.neg().unsqueeze(-1) if grad_coef is not None else None
        for rows in self._blocks(q):
            qb, pb = q[rows], p[rows]
            below, work = self._buffer('below', qb), self._buffer('work', qb)
            torch.lt(qb, pb, out=below)  # strict: at a tie min() is p
            torch.sum(torch.minimum(pb, qb, out=work), dim=-1, out=overlap[rows])
            torch.sum(torch.mul(qb, below, out=work), dim=-1, out=dot[rows])
            if neg_coef is not None:
                qb.mul_(below.sub_(dot[rows].unsqueeze(-1)).mul_(neg_coef[rows]))
        return overlap, dot

    def grad_(self, p: torch.Tensor, q: torch.Tensor, dot: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """``coef * q * (dot - 1[q < p])`` written into ``q``; the indicator is recomputed (one
        compare, in cache) rather than kept per depth from :meth:`overlap`."""
        dot, neg_coef = dot.unsqueeze(-1), coef.neg().unsqueeze(-1)
        for rows in self._blocks(q):
            factor = torch.lt(q[rows], p[rows], out=self._buffer('below', q[rows]))
            q[rows].mul_(factor.sub_(dot[rows]).mul_(neg_coef[rows]))
        return q

    def _blocks(self, z: torch.Tensor):
        step = max(1, self.BLOCK_ELEMENTS // max(1, z.shape[-1]))
        return [slice(start, start + step) for start in range(0, z.shape[0], step)]

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._scratch.take(name, like.shape, like.dtype, like.device)


class TritonRowOps:
    """Triton implementation: logits stay logits; probabilities are recomputed per tile."""

    name = 'triton'

    def normalise_(self, z: torch.Tensor, group: ProcessGroup):
        """Leaves the logits in place; returns ``((z, lse), full-vocabulary row max)``."""
        local_max, local_logsum = _triton().row_stats(z)
        lse, global_max = combine_logsumexp(local_max, local_logsum, group)
        return (z, lse), global_max

    @staticmethod
    def rows(state, start: int, stop: int):
        z, lse = state
        return z[start:stop], lse[start:stop]

    @staticmethod
    def written_grad(q):
        return q[0]

    def overlap(self, p, q, grad_coef=None):
        overlap, dot = _triton().overlap(*p, *q)
        if grad_coef is not None:
            self.grad_(p, q, dot, grad_coef)
        return overlap, dot

    def grad_(self, p, q, dot, coef):
        return _triton().grad_(*p, *q, dot, coef)


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
    """``(ops, reason)``: a fresh row-ops object for ``logits`` and why Triton is not used."""
    mode = os.environ.get(TRITON_ENV, 'auto')
    if mode not in ('auto', '0', '1'):
        raise ValueError(f"{TRITON_ENV}={mode!r}; expected 'auto', '0' or '1'.")
    if mode == '0':
        return TorchRowOps(), f'disabled by {TRITON_ENV}=0'
    reason = triton_unavailable_reason(logits)
    if reason is None:
        return TritonRowOps(), None
    if mode == '1':
        raise RuntimeError(f'{TRITON_ENV}=1 but the Triton kernel cannot run: {reason}.')
    return TorchRowOps(), reason


def _triton():
    from . import triton_kernels

    return triton_kernels
