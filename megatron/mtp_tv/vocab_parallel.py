# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Row statistics over a vocabulary sharded across a tensor-parallel group (None: unsharded)."""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    """The size of ``group``; 1 for None or without torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group: ProcessGroup) -> int:
    """The rank in ``group``; 0 for None or without torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def all_reduce_sum_(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group`` (a no-op on one rank); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def combine_row_stats(
    local_max: torch.Tensor,
    local_logsum: torch.Tensor,
    group: ProcessGroup,
    local_argmax: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(lse, max, argmax or None)`` ``[n]`` over the full vocabulary from this shard's row
    max, ``log sum exp(z - max)`` and argmax, in one all-gather (lowest index on ties)."""
    world = group_size(group)
    if world == 1:
        return local_max + local_logsum, local_max, local_argmax
    columns = [local_max, local_logsum] + (
        [local_argmax.float()] if local_argmax is not None else []
    )
    stats = torch.stack(columns, dim=-1)  # [n, c]
    gathered = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    dist.all_gather_into_tensor(gathered, stats, group=group)
    gathered = gathered.view(world, -1, stats.shape[1])
    lse = torch.logsumexp(gathered[..., 0] + gathered[..., 1], dim=0)
    global_max, shard = gathered[..., 0].max(dim=0)  # first shard holding the max
    argmax = None
    if local_argmax is not None:
        argmax = gathered[..., 2].gather(0, shard.unsqueeze(0)).squeeze(0).long()
    return lse, global_max, argmax


def vocab_range(local_vocab: int, group: ProcessGroup) -> Tuple[int, int]:
    """``[start, stop)`` of this rank's shard, as Megatron's VocabUtility splits it."""
    start = group_rank(group) * local_vocab
    return start, start + local_vocab
