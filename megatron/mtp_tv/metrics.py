# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Acceptance metrics in Megatron's MTP tracker, next to ``mtp_{i} loss``."""

from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

#: One flat statistics vector per micro-batch: per depth ``[alpha sum, token count, greedy
#: agreements]``, then ``[sum of expected accepted drafts, of greedy accepted drafts, chains]``.
STATS = 'tv_acceptance_stats'


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``sum_j prod_{i<=j} alpha_i`` over the leading (depth) dimension."""
    return alpha.cumprod(0).sum(0)


def save_acceptance_to_tracker(
    result,
    masks: torch.Tensor,
    tracker: Dict[str, Any],
    record_depth_metrics: Optional[Callable] = None,
    avg_group=None,
) -> None:
    """Adds one training micro-batch's statistics to Megatron's MTP tracker.

    Args:
        result: its :class:`~.linear_tv.TVLossResult` (``[D, s, b]`` per-token values; greedy
            hits against the labels, and alpha and greedy agreement where it has a target).
        masks: ``[D, s, b]`` loss masks.
        tracker: Megatron's ``MTPLossLoggingHelper.tracker``.
        record_depth_metrics: records each depth's mean objective and greedy hits as
            ``mtp_{k} loss`` (the tree's tracker method); None: only the acceptance statistics.
        avg_group: the group the statistics are summed over when logged.
    """
    depth = masks.shape[0]
    masks = masks.float()
    count = masks.sum(dim=(1, 2))
    if record_depth_metrics is not None:
        loss_mean = (result.per_depth * masks).sum(dim=(1, 2)) / count.clamp(min=1)
        correct = (result.greedy_correct & masks.bool()).sum(dim=(1, 2)).float()
        for k in range(depth):
            record_depth_metrics(loss_mean[k], correct[k], count[k], k, depth, avg_group)
    alpha = result.alpha
    if alpha is None:  # cross-entropy without the acceptance metrics
        return
    agree = result.greedy_agreement.float()
    chains = masks.prod(dim=0)
    stats = torch.cat(
        [
            (alpha * masks).sum(dim=(1, 2)),
            count,
            (agree * masks).sum(dim=(1, 2)),
            torch.stack(
                [
                    (expected_accepted(alpha) * chains).sum(),
                    (expected_accepted(agree) * chains).sum(),
                    chains.sum(),
                ]
            ),
        ]
    )
    if STATS not in tracker or tracker[STATS].shape != stats.shape:
        tracker[STATS] = torch.zeros_like(stats)
    tracker[STATS] += stats.detach()
    tracker['tv_avg_group'] = avg_group


def acceptance_metrics(tracker: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Reduces and clears the statistics accumulated in ``tracker`` (Megatron's
    ``MTPLossLoggingHelper.tracker``); returns the metrics by name (or {})."""
    if STATS not in tracker:
        return {}
    stats = tracker.pop(STATS)
    group = tracker.pop('tv_avg_group', None)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    depth = (stats.numel() - 3) // 3
    alpha_sum, count, agree_sum = (
        stats[:depth],
        stats[depth : 2 * depth],
        stats[2 * depth : 3 * depth],
    )
    accepted, greedy_accepted, chains = stats[3 * depth :]
    metrics = {}
    for k in range(depth):
        metrics[f'mtp_{k + 1}_tv_acceptance'] = alpha_sum[k] / count[k].clamp(min=1)
    drafts = accepted / chains.clamp(min=1)
    metrics['mtp_expected_accepted_drafts'] = drafts
    metrics['mtp_expected_tokens_per_step'] = 1.0 + drafts
    for k in range(depth):
        metrics[f'mtp_{k + 1}_greedy_agreement'] = agree_sum[k] / count[k].clamp(min=1)
    metrics['mtp_expected_accepted_drafts_greedy'] = greedy_accepted / chains.clamp(min=1)
    return metrics


def log_acceptance_metrics(
    tracker: Dict[str, Any], iteration: int, writer=None, wandb_writer=None, total_loss_dict=None
) -> Dict[str, torch.Tensor]:
    """Writes :func:`acceptance_metrics` to TensorBoard, W&B and ``total_loss_dict``."""
    metrics = acceptance_metrics(tracker)
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, torch.zeros_like(value)) + value
    return metrics
