# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Megatron glue: the MTP losses behind ``process_mtp_loss``."""

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.config_logger import has_config_logger_enabled
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .alignment import CP_LAYOUTS, TargetSegment, target_segments
from .config import MTPLossOptions, runs_megatron_ce
from .linear_tv import linear_tv_loss
from .metrics import save_acceptance_to_tracker
from .vocab_parallel import group_size, vocab_range

#: ``roll(tensor, field, depth) -> (rolled, rolled.sum())``: ``tensor [b, s]`` one position left
#: as ``process_mtp_loss`` rolls it (``field``: ``'labels'``, ``'loss_mask'`` or ``'input_ids'``;
#: ``depth``: how many rolls it had).
RollFn = Callable[[Tensor, str, int], Tuple[Tensor, Tensor]]
#: ``record(loss, correct, count, layer_number, num_layers, avg_group)``: one depth's mean
#: objective, greedy hits and token count into Megatron's MTP tracker (``mtp_{k} loss``).
RecordDepthFn = Callable[[Tensor, Tensor, Tensor, int, int, Any], None]


def _cp_layout(packed_seq_params, cp_group, loss_type: str) -> str:
    layout = getattr(packed_seq_params, 'cp_partition_mode', None) or 'zigzag'
    if group_size(cp_group) > 1 and layout not in CP_LAYOUTS:
        raise ValueError(
            f"mtp_loss_type={loss_type!r} aligns context-parallel targets in the layouts "
            f"{CP_LAYOUTS}; packed_seq_params.cp_partition_mode={layout!r} is not supported."
        )
    return layout


@dataclass(frozen=True)
class MTPLossInputs:
    """What the MTP loss reads besides the hidden states: ``process_mtp_loss``'s arguments (less
    the two that build full logits, which the loss never does) and the tree's own ``roll_tensor``
    and MTP tracker. Tensors: ``labels``, ``loss_mask`` and ``input_ids`` ``[b, s]``."""

    labels: Optional[Tensor]
    loss_mask: Optional[Tensor]
    output_layer: Callable
    output_weight: Optional[Tensor]
    is_training: bool
    config: Any
    roll: RollFn
    record_depth_metrics: RecordDepthFn
    tracker: Dict[str, Any]
    cp_group: Any = None
    tp_group: Any = None
    packed_seq_params: Any = None
    scale_logits_fn: Optional[Callable[[Tensor], Tensor]] = None
    input_ids: Optional[Tensor] = None
    detach_output_weight: bool = False


def process_mtp_tv_loss(
    hidden_states: Tensor, inputs: MTPLossInputs
) -> Tuple[Tensor, Optional[Tensor]]:
    """The MTP loss of ``config.mtp_loss_type`` on ``process_mtp_loss``'s hidden states.

    With Megatron's own ``'ce'`` (which ``process_mtp_loss`` computes) only the acceptance
    metrics are logged, without gradient.

    Args:
        hidden_states: ``[(1+D)s, b, h]``, the main rows then each depth's.
        inputs: the rest of ``process_mtp_loss``'s arguments.

    Returns:
        ``(main hidden states [s, b, h], the scalar loss)``, for ``MTPLossAutoScaler`` to
        attach; the loss is None for ``'ce'`` and without labels and input ids.
    """
    config = inputs.config
    metrics_only = runs_megatron_ce(config)
    main_hidden, draft_hidden = split_mtp_hidden_states(hidden_states, config)
    if metrics_only and not (inputs.is_training and config.mtp_log_acceptance):
        return main_hidden, None
    with torch.no_grad() if metrics_only else contextlib.nullcontext():
        loss = _mtp_tv_loss(main_hidden, draft_hidden, None, inputs, metrics_only)
    return main_hidden, None if metrics_only else loss


def attach_mtp_tv_loss(
    main_logits: Tensor,
    main_hidden: Tensor,
    draft_hidden: Tensor,
    inputs: MTPLossInputs,
    loss_scaler: type,
) -> Tensor:
    """Runs the MTP loss against ``main_logits`` and returns them with it attached.

    Args:
        main_logits: ``[s, b, V/tp]`` (or the gathered vocabulary), the detached target.
        main_hidden: ``[s, b, h]``, what they were projected from.
        draft_hidden: ``[D*s, b, h]``, every depth's hidden states.
        inputs: ``process_mtp_loss``'s other arguments.
        loss_scaler: Megatron's ``MTPLossAutoScaler``, whose ``main_loss_backward_scale`` the
            loss's gradient takes.
    """
    loss = _mtp_tv_loss(main_hidden, draft_hidden, main_logits.detach(), inputs)
    if loss is None or not (torch.is_grad_enabled() and loss.requires_grad):
        return main_logits
    return _AttachMTPLoss.apply(main_logits, loss, loss_scaler)


def split_mtp_hidden_states(hidden_states: Tensor, config) -> Tuple[Tensor, Tensor]:
    """``([s, b, h] main, [D*s, b, h] drafts)``, one split: one full-size gradient in backward."""
    s_main = hidden_states.shape[0] // (1 + config.mtp_num_layers)
    main, drafts = torch.split(hidden_states, [s_main, config.mtp_num_layers * s_main], dim=0)
    return main, drafts


def mtp_loss_follows_main_logits(model, output_processor=None) -> bool:
    """Whether ``model._postprocess`` runs the MTP loss on its main logits."""
    config = model.config
    if not config.mtp_num_layers or runs_megatron_ce(config) or output_processor is not None:
        return False
    if getattr(model, 'fuse_linear_cross_entropy', False) or has_config_logger_enabled(config):
        return False
    if getattr(model, 'output_layer', None) is None or not getattr(model, 'post_process', False):
        return False
    return MTPLossOptions.from_config(config, metrics=model.training).with_target


class _AttachMTPLoss(torch.autograd.Function):
    """``MTPLossAutoScaler`` for logits, returned as the same tensor marked dirty (not a view),
    so that Megatron's cross-entropy may still work on them in place."""

    @staticmethod
    def forward(ctx, logits: Tensor, mtp_loss: Tensor, loss_scaler: type):
        ctx.save_for_backward(mtp_loss)
        ctx.loss_scaler = loss_scaler
        ctx.mark_dirty(logits)
        return logits

    @staticmethod
    def backward(ctx, grad_logits: Tensor):
        (mtp_loss,) = ctx.saved_tensors
        scale = ctx.loss_scaler.main_loss_backward_scale
        return grad_logits, torch.ones_like(mtp_loss) * scale, None


def _mtp_tv_loss(
    main_hidden: Tensor,
    draft_hidden: Tensor,
    main_logits: Optional[Tensor],
    inputs: MTPLossInputs,
    metrics_only: bool = False,
) -> Optional[Tensor]:
    """The scalar MTP loss, its metrics logged; None without labels and input ids.

    Args:
        main_hidden: ``[s, b, h]``; draft_hidden: ``[D*s, b, h]``.
        main_logits: ``[s, b, V/tp]`` the detached target, or None: projected from
            ``main_hidden``.
        metrics_only: Megatron's own ``'ce'`` computes the loss; only the metrics are logged.
    """
    config = inputs.config
    cp_group, packed_seq_params = inputs.cp_group, inputs.packed_seq_params
    options = MTPLossOptions.from_config(
        config,
        metrics=inputs.is_training,
        metrics_only=metrics_only,
        logits_fn=inputs.scale_logits_fn,
    )
    depth = config.mtp_num_layers
    cp_layout = _cp_layout(packed_seq_params, cp_group, config.mtp_loss_type)

    rolled = _roll_per_depth(inputs.labels, inputs.input_ids, inputs.loss_mask, depth, inputs.roll)
    if rolled is None:
        return None
    output_layer = inputs.output_layer
    tp_group = inputs.tp_group
    if tp_group is None:
        tp_group = getattr(output_layer, 'tp_group', None)
    weight = _output_weight(inputs)
    fuse_weight_grad = _fuses_weight_grad(output_layer, weight, config.mtp_loss_type)
    draft, target = _vocab_parallel_layout(
        draft_hidden,
        main_hidden,
        depth,
        tp_group,
        bool(getattr(output_layer, 'sequence_parallel', False)),
        # the own projection's rows, and the context-parallel halos (another rank's rows)
        needs_target=options.with_target and (main_logits is None or group_size(cp_group) > 1),
    )
    if not options.with_target:  # cross-entropy without metrics: no target rows
        target = None
    # Under zigzag CP the packed bounds place the halos: this function's one host sync.
    segments = [TargetSegment(0, draft.shape[1])]
    if target is not None and group_size(cp_group) > 1:
        zigzag_packed = packed_seq_params is not None and cp_layout == 'zigzag'
        cu_seqlens = packed_seq_params.cu_seqlens_q.tolist() if zigzag_packed else None
        segments = target_segments(target, depth, cp_group, cu_seqlens, cp_layout)
    if main_logits is not None:
        main_logits = _local_vocab_shard(main_logits, weight.shape[0], tp_group)
    with_labels = inputs.is_training or options.loss.needs_labels
    result = linear_tv_loss(
        draft,
        target if main_logits is None else None,
        weight,
        _token_weights(options.loss, rolled, config),
        options,
        tp_group=tp_group,
        segments=segments,
        labels=torch.stack(rolled.labels).transpose(1, 2) if with_labels else None,
        target_logits=main_logits if options.with_target else None,
        fuse_weight_grad=fuse_weight_grad,
    )
    if inputs.is_training:
        save_acceptance_to_tracker(
            result,
            rolled.masks.transpose(1, 2),
            inputs.tracker,
            inputs.record_depth_metrics if not metrics_only else None,
            avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
    return result.loss


class _Rolled(NamedTuple):
    labels: List[Tensor]  # D x [b, s]
    masks: Tensor  # [D, b, s] float
    num_tokens: List[Tensor]  # D x roll_tensor's sum
    original_num_tokens: Tensor  # the unrolled mask's sum


def _roll_per_depth(labels, input_ids, loss_mask, depth: int, roll) -> Optional[_Rolled]:
    """Every depth's labels and masks, rolled as on Megatron's CE path (None without labels)."""
    derived = labels is None
    label_field = 'input_ids' if derived else 'labels'
    if derived:
        if input_ids is None:
            return None
        loss_mask = torch.ones_like(input_ids) if loss_mask is None else loss_mask
        labels, _ = roll(input_ids, 'input_ids', 0)
        loss_mask, _ = roll(loss_mask, 'loss_mask', 0)
    elif loss_mask is None:
        loss_mask = torch.ones_like(labels)
    original_num_tokens = loss_mask.sum()
    depth_labels, depth_masks, depth_num_tokens = [], [], []
    for k in range(depth):
        labels, _ = roll(labels, label_field, k + derived)
        loss_mask, num_tokens = roll(loss_mask, 'loss_mask', k + derived)
        depth_labels.append(labels)
        depth_masks.append(loss_mask)
        depth_num_tokens.append(num_tokens)
    return _Rolled(
        depth_labels, torch.stack(depth_masks).float(), depth_num_tokens, original_num_tokens
    )


def _token_weights(loss_fn, rolled: _Rolled, config) -> Tensor:
    """Mask and normalisation as on Megatron's CE path, ``[D, s, b]`` (``[s, b]`` per chain)."""
    if loss_fn.per_chain:  # [s, b]
        masks = rolled.masks.prod(0)
        norm = config.mtp_loss_scaling_factor / masks.sum().clamp(min=1)
    else:  # [D, s, b], each depth over its own token count
        masks = rolled.masks
        num_tokens = torch.stack(rolled.num_tokens).float().clamp(min=1)
        norm = (config.mtp_loss_scaling_factor / masks.shape[0] / num_tokens).view(-1, 1, 1)
    if config.calculate_per_token_loss:
        norm = norm * rolled.original_num_tokens
    return (masks * norm).transpose(-2, -1)


def _output_weight(inputs: MTPLossInputs) -> Tensor:
    output_layer = inputs.output_layer
    weight = inputs.output_weight if inputs.output_weight is not None else output_layer.weight
    if inputs.detach_output_weight:
        weight = weight.detach()
    if getattr(output_layer, 'bias', None) is not None:
        raise ValueError(
            f"mtp_loss_type={inputs.config.mtp_loss_type!r} supports an output layer without bias "
            "(GPTModel's); this output layer has a bias."
        )
    return weight


def _fuses_weight_grad(output_layer, weight: Tensor, loss_type: str) -> bool:
    """Whether the loss adds its output-weight gradient into ``main_grad``, as the output layer
    does under Megatron's ``gradient_accumulation_fusion`` (DDP then skips ``.grad``): Megatron's
    ``ColumnParallelLinear`` holds the flag as ``gradient_accumulation_fusion``, Transformer
    Engine's output projection (``TELMHeadColumnParallelLinear``) as ``fuse_wgrad_accumulation``."""
    fused = bool(
        getattr(output_layer, 'gradient_accumulation_fusion', False)
        or getattr(output_layer, 'fuse_wgrad_accumulation', False)
    )
    if fused and weight.requires_grad and hasattr(weight, '__fsdp_param__'):
        # Megatron-FSDP's fused linear overwrites the fetched gradient bucket (``out=``), so a
        # second writer of the same weight in one backward cannot be ordered safely.
        raise ValueError(
            f"mtp_loss_type={loss_type!r} trains the output weight, a Megatron-FSDP parameter, "
            "with gradient_accumulation_fusion=True: not supported (Megatron-FSDP's fused linear "
            "overwrites the gradient bucket); set gradient_accumulation_fusion=False "
            "(--no-gradient-accumulation-fusion) or mtp_detach_heads=True."
        )
    return fused


def _vocab_parallel_layout(draft, main_hidden, depth, tp_group, sequence_parallel, needs_target):
    """``(draft [D, s, b, h], target [s, b, h] or None)`` through Megatron's TP mappings."""
    target = main_hidden.detach()
    tp = group_size(tp_group)
    if tp > 1 and sequence_parallel:
        draft = gather_from_sequence_parallel_region(draft, True, tp_group)
        s_local = main_hidden.shape[0]
        draft = draft.view(tp, depth, s_local, *draft.shape[1:]).transpose(0, 1)
        draft = draft.reshape(depth, tp * s_local, *draft.shape[3:])
        target = (
            gather_from_sequence_parallel_region(target, True, tp_group) if needs_target else None
        )
        return draft, target
    if tp > 1:
        draft = copy_to_tensor_model_parallel_region(draft, tp_group)
    return draft.view(depth, main_hidden.shape[0], *draft.shape[1:]), target


def _local_vocab_shard(main_logits: Tensor, vocab_local: int, tp_group) -> Tensor:
    if main_logits.shape[-1] == vocab_local:
        return main_logits
    start, stop = vocab_range(vocab_local, tp_group)
    if main_logits.shape[-1] != vocab_local * group_size(tp_group):
        raise ValueError(
            f"main logits with {main_logits.shape[-1]} vocabulary entries are neither this "
            f"rank's shard ({vocab_local}) nor the gathered vocabulary "
            f"({vocab_local * group_size(tp_group)})."
        )
    return main_logits[..., start:stop]
