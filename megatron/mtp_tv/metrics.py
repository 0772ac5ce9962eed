"""Acceptance metrics in Megatron's MTP tracker, logged next to ``mtp_{i} loss``.

Per step (summed over micro-batches and averaged over the data- and context-parallel ranks as
sum / count, i.e. a token-weighted mean), at the configured ``mtp_tv_temperature``:

* ``mtp_{i}_tv_acceptance``: mean of ``alpha_i = sum_v min(p, q_i)`` over the depth-i tokens, the
  expected rejection-sampling acceptance rate of the token drafted at depth i;
* ``mtp_expected_accepted_drafts``: mean over valid chains of ``sum_j prod_{i<=j} alpha_i``, the
  expected number of accepted draft tokens per verify step;
* ``mtp_expected_tokens_per_step``: one more than that (the verifier always adds a token);
* ``mtp_{i}_greedy_agreement``: mean over depth-i tokens of ``1[argmax q_i == argmax p]``, the
  acceptance of greedy (T = 0) verification (unlike Megatron's ``mtp_{i}_acceptance_rate``,
  which compares with the data label);
* ``mtp_expected_accepted_drafts_greedy``: mean over valid chains of
  ``sum_j prod_{i<=j} agree_i``, the accepted drafts per greedy verify step.

Megatron's tracker is class-level state of ``MTPLossLoggingHelper``; the extra keys below live in
the same dict, are reduced before Megatron's own reduction and cleared with it.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.transformer import multi_token_prediction as _mtp


#: One flat statistics vector per micro-batch: per depth ``[alpha sum, token count, greedy
#: agreements]``, then ``[sum of expected accepted drafts, of greedy accepted drafts, chains]``.
STATS = 'tv_acceptance_stats'


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``sum_j prod_{i<=j} alpha_i`` over the leading (depth) dimension of ``alpha``."""
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
    """Accumulate one micro-batch's acceptance statistics into Megatron's MTP tracker.

    Args:
        alpha: ``[D, s, b]`` per-depth acceptance probabilities; None: no acceptance statistics
            (cross-entropy without ``mtp_log_acceptance``), only the loss.
        masks: ``[D, s, b]`` rolled loss masks (1: the depth-k token is scored).
        greedy_correct: ``[D, s, b]`` bool, draft argmax == label, or None.
        avg_group: group the metrics are averaged over (Megatron passes DP x CP).
        log_loss: also record ``mtp_{i} loss`` (the mean per-token objective per depth) and the
            greedy correct/total counts through Megatron's ``save_metrics_to_tracker``.
        greedy_agreement: ``[D, s, b]`` bool, draft argmax == main-model argmax (None: zeros).
        per_depth_loss: ``[D, s, b]`` per-token objective of each depth (None: ``1 - alpha``).
    """
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
    """Reduce the accumulated statistics over the averaging group and return named metrics.

    Clears the statistics. Returns an empty dict if nothing was recorded.
    """
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
    """Write :func:`acceptance_metrics` to TensorBoard / W&B the way Megatron writes MTP losses,
    and add them to ``total_loss_dict`` so that Megatron's console iteration line prints their
    mean over the logging interval (as it does for ``mtp_{i} loss``)."""
    metrics = acceptance_metrics()
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, torch.zeros_like(value)) + value
    return metrics
