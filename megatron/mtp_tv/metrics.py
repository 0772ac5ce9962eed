"""Acceptance metrics in Megatron's MTP tracker, next to ``mtp_{i} loss`` (docs/metrics.md)."""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.transformer import multi_token_prediction as _mtp


#: One flat statistics vector per micro-batch: per depth ``[alpha sum, token count, greedy
#: agreements]``, then ``[sum of expected accepted drafts, of greedy accepted drafts, chains]``.
STATS = 'tv_acceptance_stats'


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``sum_j prod_{i<=j} alpha_i`` over the leading (depth) dimension."""
    return alpha.cumprod(0).sum(0)


def save_acceptance_to_tracker(
    alpha: Optional[torch.Tensor],
    masks: torch.Tensor,
    greedy_correct: Optional[torch.Tensor],
    avg_group=None,
    log_loss: bool = True,
    greedy_agreement: Optional[torch.Tensor] = None,
    per_depth_loss: Optional[torch.Tensor] = None,
) -> None:
    """Adds one micro-batch's ``[D, s, b]`` statistics to Megatron's MTP tracker."""
    depth = masks.shape[0]
    masks = masks.float()
    count = masks.sum(dim=(1, 2))
    if log_loss:
        per_token = per_depth_loss if per_depth_loss is not None else 1.0 - alpha
        loss_mean = (per_token * masks).sum(dim=(1, 2)) / count.clamp(min=1)
        correct = (
            (greedy_correct & masks.bool()).sum(dim=(1, 2)).float()
            if greedy_correct is not None
            else torch.zeros_like(count)
        )
        helper = _mtp.MTPLossLoggingHelper
        for k in range(depth):
            if hasattr(helper, 'save_metrics_to_tracker'):
                helper.save_metrics_to_tracker(
                    loss_mean[k], correct[k], count[k], k, depth, avg_group=avg_group
                )
            else:  # trees without greedy-acceptance logging (radixark miles-main)
                helper.save_loss_to_tracker(loss_mean[k], k, depth, avg_group=avg_group)
    if alpha is None:
        return
    alpha_sum = (alpha * masks).sum(dim=(1, 2))
    agree = greedy_agreement.float() if greedy_agreement is not None else torch.zeros_like(alpha)
    chains = masks.prod(dim=0)
    stats = torch.cat([
        alpha_sum, count, (agree * masks).sum(dim=(1, 2)),
        torch.stack([
            (expected_accepted(alpha) * chains).sum(),
            (expected_accepted(agree) * chains).sum(),
            chains.sum(),
        ]),
    ])
    tracker = _mtp.MTPLossLoggingHelper.tracker
    if STATS not in tracker or tracker[STATS].shape != stats.shape:
        tracker[STATS] = torch.zeros_like(stats)
    tracker[STATS] += stats.detach()
    tracker['tv_avg_group'] = avg_group


def acceptance_metrics() -> Dict[str, torch.Tensor]:
    """Reduces and clears the accumulated statistics; returns the metrics by name (or {})."""
    tracker = _mtp.MTPLossLoggingHelper.tracker
    if STATS not in tracker:
        return {}
    stats = tracker.pop(STATS)
    group = tracker.pop('tv_avg_group', None)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    depth = (stats.numel() - 3) // 3
    alpha_sum, count, agree_sum = stats[:depth], stats[depth : 2 * depth], stats[2 * depth : 3 * depth]
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
    iteration: int, writer=None, wandb_writer=None, total_loss_dict=None
) -> Dict[str, torch.Tensor]:
    """Writes :func:`acceptance_metrics` to TensorBoard, W&B and ``total_loss_dict``."""
    metrics = acceptance_metrics()
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, torch.zeros_like(value)) + value
    return metrics
