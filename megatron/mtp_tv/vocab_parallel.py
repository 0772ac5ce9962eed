"""Softmax statistics over a vocabulary that may be sharded across a tensor-parallel group.

Plain torch + torch.distributed; no Megatron imports. Every function here is a no-op
communication-wise when ``tp_group`` is None or has one rank.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    """World size of ``group`` (1 when None or when torch.distributed is not initialised)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group: ProcessGroup) -> int:
    """Rank in ``group`` (0 when None or when torch.distributed is not initialised)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def all_reduce_sum_(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """In-place SUM all-reduce over ``group`` (identity on one rank)."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def combine_logsumexp(
    local_max: torch.Tensor, local_logsum: torch.Tensor, group: ProcessGroup
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-normaliser from each shard's ``(row max, log sum exp(z - max))``.

    Instead of the two all-reduces cross-entropy uses (MAX of the row max, then SUM of the
    shifted sum-exp), every rank all-gathers the per-shard pairs and combines them with a local
    log-sum-exp: one collective, same result.

    Args:
        local_max, local_logsum: ``[n]`` statistics of this rank's vocabulary shard.
        group: the tensor-parallel group the vocabulary is sharded over (None: not sharded).

    Returns:
        ``(lse [n], global_max [n])``.
    """
    world = group_size(group)
    if world == 1:
        return local_max + local_logsum, local_max
    stats = torch.stack([local_max, local_logsum], dim=-1)  # [n, 2]
    gathered = stats.new_empty((world * stats.shape[0], 2))
    dist.all_gather_into_tensor(gathered, stats, group=group)
    gathered = gathered.view(world, -1, 2)
    return torch.logsumexp(gathered[..., 0] + gathered[..., 1], dim=0), gathered[..., 0].amax(dim=0)


def vocab_range(local_vocab: int, group: ProcessGroup) -> Tuple[int, int]:
    """``[start, stop)`` of this rank's vocabulary shard, as Megatron's VocabUtility splits it."""
    start = group_rank(group) * local_vocab
    return start, start + local_vocab
