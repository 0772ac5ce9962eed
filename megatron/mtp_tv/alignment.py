"""Where each MTP depth finds its target: segments of contiguous positions and their halos.

Depth k at position t is scored against the main model's distribution at position t + k + 1,
with the semantics of Megatron's ``roll_tensor`` (rolled once per depth): never across the end
of the sequence and, for packed sequences, never across a sequence boundary (those positions are
masked by the rolled loss mask, so their target only has to be finite).

* Without context parallelism the local sequence is one segment; rows past its end are zeros.
* With context parallelism Megatron's zigzag layout gives each rank two chunks of every sequence
  (chunk ``r`` and chunk ``2*cp - 1 - r``). The targets of a chunk's last positions are the first
  rows of the next chunk, which lives on a neighbouring rank: every rank sends the first ``G``
  rows of its chunks to the neighbours that need them (one batched exchange, ``G`` rows per chunk,
  never the whole sequence), as ``roll_tensor`` exchanges its boundary elements.
* NVIDIA Megatron-LM ``dev``'s contiguous layout for packed sequences
  (``packed_seq_params.cp_partition_mode == 'contiguous'``) gives rank ``r`` the rows
  ``[r * s_local, (r + 1) * s_local)`` of the whole packed row, sequences cut wherever the shard
  ends. The local rows are one segment whose halo is the first ``G`` rows of rank ``r + 1`` (none
  on the last rank): the targets of depth k may live on the next rank. Targets that cross a
  sequence boundary, inside the shard or in the halo, are read but carry zero weight (the rolled
  mask is zero there, so no chain crosses a sequence).

Plain torch + torch.distributed; no Megatron imports.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .sweep import TargetSegment
from .vocab_parallel import ProcessGroup, group_rank, group_size

#: Context-parallel layouts :func:`target_segments` aligns (``PackedSeqParams.cp_partition_mode``).
CP_LAYOUTS = ('zigzag', 'contiguous')


def target_segments(
    target_hidden: torch.Tensor,
    depth: int,
    cp_group: ProcessGroup = None,
    cu_seqlens: Optional[Sequence[int]] = None,
    layout: str = 'zigzag',
) -> List[TargetSegment]:
    """Build the segments (and exchange the halos) for ``linear_tv_loss``.

    Args:
        target_hidden: ``[s_local, b, h]`` main-model hidden states on this rank (full sequence
            of the local chunks, i.e. after any sequence-parallel all-gather).
        depth: number of MTP depths G (rows of halo per chunk).
        cp_group: context-parallel group (None or one rank: no context parallelism).
        cu_seqlens: global cumulative sequence lengths of packed sequences (THD), or None.
        layout: how context parallelism splits the sequence: ``'zigzag'`` (Megatron's default)
            or ``'contiguous'`` (packed sequences on NVIDIA dev; see
            :func:`contiguous_target_segments`).

    Returns:
        The list of :class:`TargetSegment` covering ``[0, s_local)``.

    Raises:
        ValueError: if a context-parallel chunk is shorter than ``depth`` (its targets would lie
            two ranks away), the local length does not split into the zigzag chunks, or
            ``layout`` is not one of :data:`CP_LAYOUTS`.
    """
    if layout not in CP_LAYOUTS:
        raise ValueError(f"context parallel layout {layout!r}; expected one of {CP_LAYOUTS}.")
    s_local = target_hidden.shape[0]
    cp = group_size(cp_group)
    if cp == 1:
        return [TargetSegment(0, s_local)]
    if layout == 'contiguous':
        return contiguous_target_segments(target_hidden, depth, cp_group)

    chunks = _zigzag_chunks(_local_sequence_bounds(s_local, cp, cu_seqlens), depth, cp)
    rank = group_rank(cp_group)
    heads_front = [target_hidden[a : a + depth] for a, _, _, _ in chunks]
    heads_back = [target_hidden[c : c + depth] for _, _, c, _ in chunks]
    # front chunk r continues in front chunk r+1 (rank r+1); the last rank's front chunk
    # continues in its own back chunk. back chunk 2cp-1-r continues in back chunk of rank r-1;
    # rank 0's back chunk ends the sequence.
    front_halos, back_halos = _exchange(heads_front, heads_back, rank, cp, cp_group)
    segments = []
    for i, (a, b_, c, d) in enumerate(chunks):
        front = front_halos[i] if front_halos is not None else heads_back[i]
        back = back_halos[i] if back_halos is not None else None
        segments.append(TargetSegment(a, b_, front))
        segments.append(TargetSegment(c, d, back))
    return segments


def _zigzag_chunks(bounds, depth: int, cp: int) -> List[Tuple[int, int, int, int]]:
    """``(front start, front stop, back start, back stop)`` of every local sequence: the two
    zigzag chunks of each, in order. Raises ValueError for a sequence that does not split into
    two chunks of at least ``depth`` positions."""
    chunks = []
    for lo, hi in bounds:
        length = hi - lo
        if length == 0:
            continue
        if length % 2:
            raise ValueError(
                f"context parallel size {cp}: a local sequence of {length} positions cannot be "
                "split into the two zigzag chunks; pad sequences to a multiple of 2 * cp."
            )
        half = length // 2
        if half < depth:
            raise ValueError(
                f"context parallel size {cp}: chunks of {half} positions are shorter than "
                f"mtp_num_layers={depth}, so MTP targets would lie two ranks away; use longer "
                "sequences or a smaller context parallel size."
            )
        chunks.append((lo, lo + half, lo + half, hi))
    return chunks


def contiguous_target_segments(
    target_hidden: torch.Tensor, depth: int, cp_group: ProcessGroup
) -> List[TargetSegment]:
    """The one segment of a contiguous context-parallel shard, with the next rank's rows as halo.

    Every rank sends its first ``depth`` rows to rank - 1 and receives those of rank + 1 (one
    exchange of ``G`` rows, as NVIDIA dev prefetches its label halos); where a packed sequence
    ends inside the shard or the halo, the targets past its end carry zero weight.

    Args:
        target_hidden: ``[s_local, b, h]`` this rank's contiguous shard of the packed row.
        depth: number of MTP depths G (rows of halo).
        cp_group: context-parallel group of more than one rank.

    Returns:
        ``[TargetSegment(0, s_local, halo)]``, ``halo`` ``[G, b, h]`` or None on the last rank.

    Raises:
        ValueError: if the shard is shorter than ``depth`` (targets would lie two ranks away).
    """
    s_local = target_hidden.shape[0]
    cp, rank = group_size(cp_group), group_rank(cp_group)
    if s_local < depth:
        raise ValueError(
            f"context parallel size {cp}, contiguous layout: shards of {s_local} positions are "
            f"shorter than mtp_num_layers={depth}, so MTP targets would lie two ranks away; use "
            "longer packed rows or a smaller context parallel size."
        )
    ranks = dist.get_process_group_ranks(cp_group)
    ops, halo = [], None
    if rank > 0:
        ops.append(dist.P2POp(dist.isend, target_hidden[:depth].contiguous(), ranks[rank - 1], cp_group))
    if rank < cp - 1:
        halo = torch.empty_like(target_hidden[:depth])
        ops.append(dist.P2POp(dist.irecv, halo, ranks[rank + 1], cp_group))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return [TargetSegment(0, s_local, halo)]


def _local_sequence_bounds(s_local: int, cp: int, cu_seqlens) -> List[tuple]:
    if cu_seqlens is None:
        return [(0, s_local)]
    cu = [int(v) for v in cu_seqlens]
    if cu[-1] // cp != s_local:
        raise ValueError(
            f"packed sequences: cu_seqlens ends at {cu[-1]}, which is not context parallel size "
            f"{cp} times the local length {s_local}."
        )
    return [(cu[i] // cp, cu[i + 1] // cp) for i in range(len(cu) - 1)]


def _exchange(heads_front, heads_back, rank, cp, group):
    """Send front heads to rank-1 and back heads to rank+1; return what arrives.

    Returns:
        ``(front_halos, back_halos)``: lists indexed like the chunks, or None where the halo
        does not come from a neighbour (last rank's front, first rank's back).
    """
    ranks = dist.get_process_group_ranks(group)
    ops, recv_front, recv_back = [], None, None
    if rank > 0:  # my front head is the halo of rank-1's front chunk
        ops.append(dist.P2POp(dist.isend, torch.stack(heads_front).contiguous(), ranks[rank - 1], group))
        recv_back = torch.empty_like(torch.stack(heads_back))
        ops.append(dist.P2POp(dist.irecv, recv_back, ranks[rank - 1], group))
    if rank < cp - 1:
        recv_front = torch.empty_like(torch.stack(heads_front))
        ops.append(dist.P2POp(dist.irecv, recv_front, ranks[rank + 1], group))
        ops.append(dist.P2POp(dist.isend, torch.stack(heads_back).contiguous(), ranks[rank + 1], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return (
        list(recv_front) if recv_front is not None else None,
        list(recv_back) if recv_back is not None else None,
    )
