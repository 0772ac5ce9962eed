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


def combine_row_stats(
    local_max: torch.Tensor,
    local_logsum: torch.Tensor,
    group: ProcessGroup,
    local_argmax: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Full-vocabulary log-normaliser, max and argmax from each shard's row statistics.

    Instead of the two all-reduces cross-entropy uses (MAX of the row max, then SUM of the
    shifted sum-exp), every rank all-gathers the per-shard statistics and combines them with a
    local log-sum-exp: one collective, same result. The argmax travels in the same all-gather
    (as fp32, exact for vocabularies below 2**24): the global argmax is that of the first shard
    holding the global max, i.e. the lowest index on ties, as ``torch.argmax`` on the full row.

    Args:
        local_max, local_logsum: ``[n]`` row max and ``log sum exp(z - max)`` of this rank's
            vocabulary shard.
        group: the tensor-parallel group the vocabulary is sharded over (None: not sharded).
        local_argmax: optional ``[n]`` int64 global index of this shard's row max.

    Returns:
        ``(lse [n], global_max [n], global_argmax [n] or None)``.
    """
    world = group_size(group)
    if world == 1:
        return local_max + local_logsum, local_max, local_argmax
    columns = [local_max, local_logsum] + ([local_argmax.float()] if local_argmax is not None else [])
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
    """``[start, stop)`` of this rank's vocabulary shard, as Megatron's VocabUtility splits it."""
    start = group_rank(group) * local_vocab
    return start, start + local_vocab
