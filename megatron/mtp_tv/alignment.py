"""Each MTP depth's target rows under context parallelism (docs/context_parallel.md)."""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .sweep import TargetSegment
from .vocab_parallel import ProcessGroup, group_rank, group_size

CP_LAYOUTS = ('zigzag', 'contiguous')


def target_segments(
    target_hidden: torch.Tensor,
    depth: int,
    cp_group: ProcessGroup = None,
    cu_seqlens: Optional[Sequence[int]] = None,
    layout: str = 'zigzag',
) -> List[TargetSegment]:
    """The :class:`TargetSegment` list over this rank's ``[s_local, b, h]``, halos exchanged.

    Raises:
        ValueError: for a chunk shorter than ``depth``, an odd zigzag length or another layout.
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
    front_halos, back_halos = _exchange(heads_front, heads_back, rank, cp, cp_group)
    segments = []
    for i, (a, b_, c, d) in enumerate(chunks):
        front = front_halos[i] if front_halos is not None else heads_back[i]
        back = back_halos[i] if back_halos is not None else None
        segments.append(TargetSegment(a, b_, front))
        segments.append(TargetSegment(c, d, back))
    return segments


def _zigzag_chunks(bounds, depth: int, cp: int) -> List[Tuple[int, int, int, int]]:
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
    """A contiguous shard's ``[TargetSegment(0, s_local, halo)]``: the next rank's first rows."""
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
