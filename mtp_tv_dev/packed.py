"""Packed (THD) sequences and the context-parallel zigzag layout, for tests.

Conventions follow megatron-core 0.19.2:

* A packed batch is one row (``b == 1``) holding several sequences back to back.
  ``PackedSeqParams(qkv_format='thd')`` describes it with cumulative offsets
  ``cu_seqlens_q == cu_seqlens_kv == [0, l0, l0+l1, ...]`` (int32).
* When every sequence is padded to a multiple of ``pad_to_multiple_of`` (Megatron pads to
  ``2 * cp_size`` for context parallelism), ``cu_seqlens_*_padded`` holds the padded offsets:
  they are the offsets *in the tensor*; sequence ``i``'s real tokens occupy
  ``[pad[i], pad[i] + l_i)`` and the rest of its slot is padding. ``max_seqlen_*`` is the
  longest padded length.
* ``roll_tensor`` (the MTP label roll) reads ``cu_seqlens_q`` only, and with CP > 1 divides those
  offsets by ``cp_size``: for CP it needs ``cu_seqlens_q`` in padded (tensor) coordinates, so
  :func:`make_packed_seq_params` can put the padded offsets there (``padded_as_real=True``).
* Context parallelism splits every sequence (for packed rows: every padded sequence) into
  ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r`` and ``2*cp - 1 - r`` (zigzag), in that
  order. :func:`zigzag_cp_index` gives the token indices a rank holds.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = [
    "make_packed_seq_params",
    "packed_position_ids",
    "packed_loss_mask",
    "zigzag_cp_index",
    "split_for_cp",
]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _cumsum(lengths: Sequence[int]) -> List[int]:
    out = [0]
    for length in lengths:
        out.append(out[-1] + int(length))
    return out


def make_packed_seq_params(
    seq_lengths: Sequence[int],
    *,
    pad_to_multiple_of: int = 1,
    padded_as_real: bool = False,
    device="cpu",
):
    """``PackedSeqParams`` (THD) for sequences of ``seq_lengths`` packed into one row.

    Args:
        seq_lengths: real length of each sequence (each >= 1).
        pad_to_multiple_of: pad each sequence's slot to a multiple of this (1: no padding; use
            ``2 * cp_size`` for context parallelism). When > 1 the ``*_padded`` offsets are set
            (even if no sequence needed padding), as Megatron does for CP.
        padded_as_real: also put the padded offsets into ``cu_seqlens_q/kv`` (what
            ``roll_tensor`` reads; needed when the tensor layout is padded).

    Example: ``[3, 5]`` -> ``cu_seqlens_q = [0, 3, 8]``, ``max_seqlen_q = 5``; with
    ``pad_to_multiple_of=4``: ``cu_seqlens_q_padded = [0, 4, 12]``, ``max_seqlen_q = 8``.
    The row's length is ``cu_seqlens_q_padded[-1]`` (or ``cu_seqlens_q[-1]``).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [int(n) for n in seq_lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"seq_lengths must be non-empty and positive, got {list(seq_lengths)}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    padded = [_round_up(n, pad_to_multiple_of) for n in lengths]
    cu = torch.tensor(_cumsum(lengths), dtype=torch.int32, device=device)
    cu_padded = None
    max_seqlen = max(lengths)
    if pad_to_multiple_of > 1:
        cu_padded = torch.tensor(_cumsum(padded), dtype=torch.int32, device=device)
        max_seqlen = max(padded)
        if padded_as_real:
            cu = cu_padded.clone()
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu.clone(),
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=None if cu_padded is None else cu_padded.clone(),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def _slot_offsets(packed_seq_params) -> torch.Tensor:
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return cu.to("cpu", torch.long)


def packed_position_ids(packed_seq_params, batch_size: int = 1) -> torch.Tensor:
    """Position ids ``[b, t]`` restarting at 0 at every sequence slot (padding continues the
    count of its slot)."""
    cu = _slot_offsets(packed_seq_params)
    total = int(cu[-1])
    positions = torch.arange(total)
    starts = cu[torch.bucketize(positions, cu[1:], right=True)]
    return (positions - starts).unsqueeze(0).expand(batch_size, total).contiguous()


def packed_loss_mask(
    seq_lengths: Sequence[int], *, pad_to_multiple_of: int = 1, batch_size: int = 1
) -> torch.Tensor:
    """Float mask ``[b, t]`` for the layout of :func:`make_packed_seq_params` with the same
    arguments: 1 on each sequence's real tokens, 0 on the padding at the end of its slot."""
    pieces = []
    for length in seq_lengths:
        slot = _round_up(int(length), pad_to_multiple_of)
        pieces.append(torch.cat([torch.ones(int(length)), torch.zeros(slot - int(length))]))
    mask = torch.cat(pieces)
    return mask.unsqueeze(0).expand(batch_size, mask.numel()).contiguous()


def zigzag_cp_index(
    total: int, cp_rank: int, cp_size: int, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Indices (along the sequence) of the tokens CP rank ``cp_rank`` holds.

    Without ``cu_seqlens`` the whole row is one sequence (Megatron's per-sequence balancing);
    with it, every segment ``[cu[i], cu[i+1])`` is split on its own (per-document balancing,
    what ``roll_tensor``'s packed CP branch expects). Each (segment) length must be divisible
    by ``2 * cp_size``.
    """
    if cu_seqlens is None:
        bounds = [0, int(total)]
    else:
        bounds = [int(x) for x in cu_seqlens.flatten().tolist()]
        if bounds[-1] != total:
            raise ValueError(f"cu_seqlens ends at {bounds[-1]}, row has {total} tokens")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp_size) != 0:
            raise ValueError(
                f"segment [{start}, {end}) of length {length} is not divisible by "
                f"2 * cp_size = {2 * cp_size}"
            )
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def split_for_cp(
    tensor: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    dim: int = -1,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The part of ``tensor`` (sequence along ``dim``) that CP rank ``cp_rank`` holds."""
    index = zigzag_cp_index(tensor.size(dim), cp_rank, cp_size, cu_seqlens).to(tensor.device)
    return tensor.index_select(dim, index)
