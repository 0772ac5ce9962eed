"""Acceptance metrics in Megatron's MTP tracker, logged next to ``mtp_{i} loss``.

Per step (summed over micro-batches and averaged over the data- and context-parallel ranks as
sum / count, i.e. a token-weighted mean):

* ``mtp_{i}_tv_acceptance``: mean of ``alpha_i = sum_v min(p, q_i)`` over the depth-i tokens, the
  expected rejection-sampling acceptance rate of the token drafted at depth i;
* ``mtp_expected_accepted_drafts``: mean over valid chains of ``sum_j prod_{i<=j} alpha_i``, the
  expected number of accepted draft tokens per verify step;
* ``mtp_expected_tokens_per_step``: one more than that (the verifier always adds a token).

Megatron's tracker is class-level state of ``MTPLossLoggingHelper``; the extra keys below live in
the same dict, are reduced before Megatron's own reduction and cleared with it.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.transformer import multi_token_prediction as _mtp

from .linear_tv import expected_accepted

ALPHA_SUM, ALPHA_COUNT, ACCEPTED = 'tv_alpha_sum', 'tv_alpha_count', 'tv_expected_accepted'
_KEYS = (ALPHA_SUM, ALPHA_COUNT, ACCEPTED)


def save_acceptance_to_tracker(
    alpha: torch.Tensor,
    masks: torch.Tensor,
    greedy_correct: Optional[torch.Tensor],
    avg_group=None,
    log_loss: bool = True,
) -> None:
    """Accumulate one micro-batch's acceptance statistics into Megatron's MTP tracker.

    Args:
        alpha: ``[D, s, b]`` per-depth acceptance probabilities.
        masks: ``[D, s, b]`` rolled loss masks (1: the depth-k token is scored).
        greedy_correct: ``[D, s, b]`` bool, draft argmax == label, or None.
        avg_group: group the metrics are averaged over (Megatron passes DP x CP).
        log_loss: also record ``mtp_{i} loss`` (the mean TV distance per depth) and the greedy
            correct/total counts through Megatron's ``save_metrics_to_tracker``.
    """
    depth = alpha.shape[0]
    masks = masks.float()
    count = masks.sum(dim=(1, 2))
    alpha_sum = (alpha * masks).sum(dim=(1, 2))
    chains = masks.prod(dim=0)
    accepted = torch.stack([(expected_accepted(alpha) * chains).sum(), chains.sum()])
    if log_loss:
        tv_mean = (count - alpha_sum) / count.clamp(min=1)
        correct = (
            (greedy_correct & masks.bool()).sum(dim=(1, 2)).float()
            if greedy_correct is not None
            else torch.zeros_like(count)
        )
        helper = _mtp.MTPLossLoggingHelper
        for k in range(depth):
            if hasattr(helper, 'save_metrics_to_tracker'):
                helper.save_metrics_to_tracker(
                    tv_mean[k], correct[k], count[k], k, depth, avg_group=avg_group
                )
            else:  # trees without greedy-acceptance logging (radixark miles-main)
                helper.save_loss_to_tracker(tv_mean[k], k, depth, avg_group=avg_group)
    tracker = _mtp.MTPLossLoggingHelper.tracker
    for key, value in ((ALPHA_SUM, alpha_sum), (ALPHA_COUNT, count), (ACCEPTED, accepted)):
        if key not in tracker or tracker[key].shape != value.shape:
            tracker[key] = torch.zeros_like(value)
        tracker[key] += value.detach()
    tracker['tv_avg_group'] = avg_group


def acceptance_metrics() -> Dict[str, torch.Tensor]:
    """Reduce the accumulated statistics over the averaging group and return named metrics.

    Clears the statistics. Returns an empty dict if nothing was recorded.
    """
    tracker = _mtp.MTPLossLoggingHelper.tracker
    if ALPHA_SUM not in tracker:
        return {}
    stats = torch.cat([tracker[k] for k in _KEYS])
    group = tracker.get('tv_avg_group')
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    depth = tracker[ALPHA_SUM].numel()
    alpha_sum, count, (acc_sum, chains) = stats[:depth], stats[depth : 2 * depth], stats[2 * depth :]
    metrics = {
        f'mtp_{k + 1}_tv_acceptance': alpha_sum[k] / count[k].clamp(min=1) for k in range(depth)
    }
    drafts = acc_sum / chains.clamp(min=1)
    metrics['mtp_expected_accepted_drafts'] = drafts
    metrics['mtp_expected_tokens_per_step'] = 1.0 + drafts
    for key in _KEYS:
        tracker.pop(key)
    tracker.pop('tv_avg_group', None)
    return metrics


def log_acceptance_metrics(iteration: int, writer=None, wandb_writer=None) -> Dict[str, torch.Tensor]:
    """Write :func:`acceptance_metrics` to TensorBoard / W&B the way Megatron writes MTP losses."""
    metrics = acceptance_metrics()
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)
    return metrics
