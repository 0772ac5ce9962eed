# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Where each MTP depth's target rows are: segments of positions under context parallelism and
packing, and the rows the sweep chunks."""

import bisect
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .vocab_parallel import ProcessGroup, group_rank, group_size

CP_LAYOUTS = ('zigzag', 'contiguous')


@dataclass(frozen=True)
class TargetSegment:
    """Positions ``start .. stop-1`` whose depth-k target is row ``t + k + 1`` of
    ``target_hidden[start:stop] ++ halo``: ``halo`` the ``G`` rows after ``stop`` (another CP
    rank's), or None for zeros (targets past the sequence, of zero weight)."""

    start: int
    stop: int
    halo: Optional[torch.Tensor] = None  # [G, b, h]


class Run(NamedTuple):
    """Rows ``lo .. hi-1`` of a chunk: rows ``r ..`` of ``segment``'s ``positions ++ halo``."""

    lo: int
    hi: int
    segment: TargetSegment
    r: int

    @property
    def position(self) -> Optional[int]:
        """The first row's position, or None past the segment's positions (halo or no draft)."""
        return (
            self.segment.start + self.r if self.segment.start + self.r < self.segment.stop else None
        )

    @property
    def halo_rows(self) -> slice:
        """The run's rows within its segment's halo."""
        first = self.r - (self.segment.stop - self.segment.start)
        return slice(first, first + self.hi - self.lo)


class RowLayout:
    """The rows the sweep chunks: every segment's positions in order, each segment followed by
    ``G - 1`` rows without a draft (zero weight), so that depth k's target of row u is target
    row ``u + k + 1`` in every segment. A chunk is a fixed number of rows wherever the segments
    end: its products and collectives follow the tokens, not the number of packed sequences.

    With one depth and segments that tile the positions in order (no CP, contiguous CP, or zigzag
    at G = 1), rows are positions (``identity``)."""

    def __init__(self, segments: Sequence[TargetSegment], depths: int, s: int):
        self.segments, self.gap, self.s = tuple(segments), depths - 1, s
        self.starts, row, in_order = [], 0, 0
        for seg in self.segments:
            self.starts.append(row)
            row += seg.stop - seg.start + self.gap
            in_order = seg.stop if seg.start == in_order else -1
        self.count = max(0, row - self.gap)
        self.identity = self.gap == 0 and in_order == s
        reach = 0
        for start, stop in sorted((seg.start, seg.stop) for seg in self.segments):
            reach = stop if start == reach else reach
        self.covers_positions = reach == s

    def runs(self, lo: int, hi: int, targets: bool = False) -> List[Run]:
        """Rows ``lo .. hi-1`` as :class:`Run` pieces, chunk-local; ``targets``: as target rows
        (segment j's reach one row further: its last halo row is segment j+1's first row)."""
        shift = int(targets)
        runs, row = [], lo
        j = max(0, bisect.bisect_right(self.starts, lo - shift) - 1)
        while row < hi:
            seg, start = self.segments[j], self.starts[j]
            end = (self.starts[j + 1] + shift) if j + 1 < len(self.starts) else hi
            r = row - start
            body = seg.stop - seg.start
            stop = min(hi, end, start + body) if r < body else min(hi, end)
            runs.append(Run(row - lo, stop - lo, seg, r))
            row = stop
            if row == end:
                j += 1
        return runs

    def to_rows(self, x: torch.Tensor, dim: int, fill=0) -> torch.Tensor:
        """``x`` (positions along ``dim``) in this layout, ``fill`` where a row has no draft."""
        if self.identity:
            return x
        parts = []
        for run in self.runs(0, self.count):
            if run.position is not None:
                parts.append(x.narrow(dim, run.position, run.hi - run.lo))
            else:
                shape = list(x.shape)
                shape[dim] = run.hi - run.lo
                parts.append(x.new_full(shape, fill))
        return torch.cat(parts, dim) if parts else x.narrow(dim, 0, 0)

    def to_positions(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows of ``x`` along ``dim`` back at their positions (zeros at positions of no row)."""
        if self.identity:
            return x
        shape = list(x.shape)
        shape[dim] = self.s
        out = x.new_zeros(shape)
        self.scatter(out, x, 0, dim)
        return out

    def scatter(self, out: torch.Tensor, rows: torch.Tensor, lo: int, dim: int = 0) -> None:
        """``out`` (positions along ``dim``) takes ``rows`` (rows ``lo ..`` along ``dim``)."""
        n = rows.shape[dim]
        if self.identity:
            out.narrow(dim, lo, n).copy_(rows)
            return
        for run in self.runs(lo, lo + n):
            if run.position is not None:
                out.narrow(dim, run.position, run.hi - run.lo).copy_(
                    rows.narrow(dim, run.lo, run.hi - run.lo)
                )


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
    cp, rank = group_size(cp_group), group_rank(cp_group)
    if cp == 1:
        return [TargetSegment(0, s_local)]
    if layout == 'contiguous':  # one segment; its halo: the next rank's first rows
        if s_local < depth:
            raise ValueError(
                f"context parallel size {cp}, contiguous layout: shards of {s_local} positions "
                f"are shorter than mtp_num_layers={depth}, so MTP targets would lie two ranks "
                "away; use longer packed rows or a smaller context parallel size."
            )
        (halo,), _ = _exchange([target_hidden[:depth]], None, rank, cp, cp_group)
        return [TargetSegment(0, s_local, halo)]

    chunks = _zigzag_chunks(_local_sequence_bounds(s_local, cp, cu_seqlens), depth, cp)
    heads_front = [target_hidden[a : a + depth] for a, _, _, _ in chunks]
    heads_back = [target_hidden[c : c + depth] for _, _, c, _ in chunks]
    front_halos, back_halos = _exchange(heads_front, heads_back, rank, cp, cp_group)
    segments = []
    for i, (a, b_, c, d) in enumerate(chunks):
        front = front_halos[i] if front_halos[i] is not None else heads_back[i]
        segments.append(TargetSegment(a, b_, front))
        segments.append(TargetSegment(c, d, back_halos[i]))
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
    """``(front halos, back halos)``: each rank's front heads go to rank - 1 (the halos of its
    front chunks), its back heads (if any) to rank + 1; None for a halo no rank sends."""
    ranks = dist.get_process_group_ranks(group)
    front = torch.stack(heads_front)
    back = torch.stack(heads_back) if heads_back is not None else None
    ops, recv_front, recv_back = [], None, None
    if rank > 0:
        ops.append(dist.P2POp(dist.isend, front, ranks[rank - 1], group))
        if back is not None:
            recv_back = torch.empty_like(back)
            ops.append(dist.P2POp(dist.irecv, recv_back, ranks[rank - 1], group))
    if rank < cp - 1:
        recv_front = torch.empty_like(front)
        ops.append(dist.P2POp(dist.irecv, recv_front, ranks[rank + 1], group))
        if back is not None:
            ops.append(dist.P2POp(dist.isend, back, ranks[rank + 1], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return (
        list(recv_front) if recv_front is not None else [None] * len(heads_front),
        list(recv_back) if recv_back is not None else [None] * len(heads_back or ()),
    )
