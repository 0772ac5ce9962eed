# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The entry point of every draft loss, :func:`linear_tv_loss`."""

from typing import List, Optional, Sequence

import torch

from .alignment import RowLayout, TargetSegment
from .config import MTPLossOptions
from .products import Products
from .sweep import DenseGradients, StoredLogitGradients, SweepPlan, TVLossResult, sweep
from .vocab_parallel import ProcessGroup

AUTO_CHUNK_MIN_BYTES = 64 * 2**20

AUTO_CHUNK_WEIGHT_GRADS = 2


def auto_chunk_tokens(
    num_tokens: int, depths: int, hidden: int, vocab_local: int, target_rows: bool = True
) -> int:
    """The chunk, in tokens, for ``chunk_size=0``: its ``depths + 1`` rows per token hold as
    many fp32 logits as :data:`AUTO_CHUNK_WEIGHT_GRADS` weight gradients ``[V/tp, h]`` (at
    least :data:`AUTO_CHUNK_MIN_BYTES`), and at most half of the logits cross-entropy builds
    for all depths (so the chunk never costs more memory than the loss it replaces)."""
    budget_rows = max(
        AUTO_CHUNK_WEIGHT_GRADS * hidden, AUTO_CHUNK_MIN_BYTES // (4 * max(1, vocab_local))
    )
    per_budget = budget_rows // (depths + 1)
    saved_rows_dominate = depths * num_tokens >= (depths + 1) * hidden
    rows_per_token = depths + 1 if target_rows or saved_rows_dominate else depths
    per_ce = depths * num_tokens // (2 * rows_per_token)
    return max(1, min(per_budget, per_ce))


def choose_grad_storage(
    rows: int,
    hidden: int,
    vocab_local: int,
    dtype: torch.dtype,
    draft_grad: bool,
    weight_grad: bool,
) -> str:
    """``'dense'`` (fp32 gradients) or ``'logit_grads'``, whichever is smaller to keep."""
    dense = 4 * hidden * (vocab_local * weight_grad + rows * draft_grad)
    logit_grads = torch.finfo(dtype).bits // 8 * rows * vocab_local
    return 'logit_grads' if logit_grads < dense else 'dense'


def linear_tv_loss(
    draft_hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    weight: torch.Tensor,
    token_weights: torch.Tensor,
    options: MTPLossOptions,
    tp_group: ProcessGroup = None,
    segments: Optional[Sequence[TargetSegment]] = None,
    labels: Optional[torch.Tensor] = None,
    target_logits: Optional[torch.Tensor] = None,
    fuse_weight_grad: bool = False,
) -> TVLossResult:
    """The :class:`TVLossResult` of G MTP depths against a detached target, chunked over tokens.

    Args:
        draft_hidden: ``[G, s, b, h]`` hidden states of the G depths (TP-replicated).
        target_hidden: ``[s, b, h]`` main hidden states; row ``t + k + 1`` of a segment is
            depth k's target at t. None with ``target_logits`` or for a loss against labels.
        weight: ``[V/tp, h]`` output-layer weight shard.
        token_weights: ``[G, s, b]`` weights with mask and normalisation (``[s, b]`` per chain).
        options: what it computes (:class:`~.options.MTPLossOptions`).
        tp_group: the group the vocabulary is sharded over (None: not sharded).
        segments: :class:`TargetSegment` list (default: the whole sequence).
        labels: ``[G, s, b]`` token ids for the greedy accuracy and a loss against labels.
        target_logits: ``[s, b, V/tp]`` main-head logits of ``target_hidden`` (not projected).
        fuse_weight_grad: the output layer accumulates its weight gradient into
            ``weight.main_grad`` (its ``gradient_accumulation_fusion``); so does this loss, and
            autograd gets what Megatron's fused linear returns (:func:`accumulate_into_main_grad`).

    Raises:
        TypeError, ValueError: for ``options`` of another type, inputs that do not fit.
    """
    if not isinstance(options, MTPLossOptions):
        raise TypeError(f"options must be an MTPLossOptions, got {options!r}.")
    _check_shapes(
        draft_hidden, target_hidden, weight, token_weights, options, labels, target_logits
    )
    G, s, b, h = draft_hidden.shape
    tokens = options.chunk_size or auto_chunk_tokens(
        s * b,
        G,
        h,
        weight.shape[0],
        target_rows=target_hidden is not None or target_logits is not None,
    )
    layout = RowLayout(segments if segments is not None else (TargetSegment(0, s),), G, s)
    plan = SweepPlan(
        options,
        max(1, tokens // b),
        tp_group,
        options.logits_fn,
        layout,
        labels,
        target_is_logits=target_logits is not None,
    )
    target = target_logits if target_logits is not None else target_hidden
    target = target.detach() if target is not None else None
    token_weights = token_weights.detach().float()
    if torch.is_grad_enabled() and (draft_hidden.requires_grad or weight.requires_grad):
        storage = choose_grad_storage(
            G * s * b,
            h,
            weight.shape[0],
            weight.dtype,
            draft_hidden.requires_grad,
            weight.requires_grad,
        )
        # Results leave via a list: autograd would keep non-differentiable outputs alive.
        results = []
        loss_value = _LinearTV.apply(
            draft_hidden, weight, target, token_weights, plan, storage, fuse_weight_grad, results
        )
        return results[0]._replace(loss=loss_value)
    return sweep(draft_hidden, weight, target, token_weights, plan)[0]  # no gradient work at all


def _check_shapes(
    draft_hidden,
    target_hidden,
    weight,
    token_weights,
    options: MTPLossOptions,
    labels,
    target_logits,
) -> None:
    loss = options.loss
    if draft_hidden.dim() != 4:
        raise ValueError(
            f"draft_hidden must be [G, s, b, h], got shape {tuple(draft_hidden.shape)}."
        )
    G, s, b, h = draft_hidden.shape
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be [V/tp, {h}], got shape {tuple(weight.shape)}.")
    if target_logits is not None:
        _check_shape('target_logits', target_logits, (s, b, weight.shape[0]))
    elif target_hidden is not None or loss.needs_target:
        _check_shape('target_hidden', target_hidden, (s, b, h))
    elif options.metrics:
        raise ValueError(f"metrics compare with a target: {loss.name!r} was given none.")
    _check_shape(
        f'token_weights for {loss.name!r}', token_weights, (s, b) if loss.per_chain else (G, s, b)
    )
    if labels is not None:
        _check_shape('labels', labels, (G, s, b))
    elif loss.needs_labels:
        raise ValueError(f"the {loss.name!r} loss is against the labels: labels are required.")


def _check_shape(name: str, tensor: Optional[torch.Tensor], expected) -> None:
    got = tuple(tensor.shape) if tensor is not None else None
    if got != tuple(expected):
        raise ValueError(f"{name} shape {got} does not match {tuple(expected)}.")


class _LinearTV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        draft_hidden,
        weight,
        target,
        token_weights,
        plan: SweepPlan,
        storage: str,
        fuse_weight_grad: bool,
        results: List[TVLossResult],
    ):
        need = ctx.needs_input_grad[:2]
        # A leaf parameter, not saved for backward: its main_grad is what backward writes.
        ctx.main_grad_weight = weight if fuse_weight_grad and need[1] else None
        if storage == 'dense':  # fp32 gradients formed in forward, scaled in backward
            sink = DenseGradients(draft_hidden, weight, plan.layout, *need)
            saved = [g for g in (sink.draft, sink.weight) if g is not None]
        else:  # logit gradients in the weight's dtype, multiplied out in backward
            sink = StoredLogitGradients(draft_hidden, weight, plan.layout)
            saved = [sink.logit_grads, draft_hidden, weight]
        out, grad_scale = sweep(draft_hidden, weight, target, token_weights, plan, sink)
        sink.finish()
        ctx.save_for_backward(grad_scale, *saved)
        ctx.storage, ctx.need = storage, need
        results.append(out)
        return out.loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_scale, *saved = ctx.saved_tensors
        need_draft, need_weight = ctx.need
        if ctx.storage == 'dense':
            grad_draft = saved.pop(0) if need_draft else None
            grad_weight = saved.pop(0) if need_weight else None
        else:
            grad_draft, grad_weight = _gradients_from_logit_grads(*saved, need_draft, need_weight)
        # In place (no [V/tp, h] copy): the dense buffers serve one backward.
        factor = grad_loss.float() / grad_scale
        if grad_draft is not None:
            grad_draft.mul_(factor)
        if grad_weight is not None:
            grad_weight.mul_(factor)
            if ctx.main_grad_weight is not None:
                grad_weight = accumulate_into_main_grad(ctx.main_grad_weight, grad_weight)
        return grad_draft, grad_weight, None, None, None, None, None, None


def accumulate_into_main_grad(
    weight: torch.Tensor, grad_weight: torch.Tensor
) -> Optional[torch.Tensor]:
    """Megatron's gradient-accumulation fusion for a weight gradient formed here: adds
    ``grad_weight`` (fp32 ``[V/tp, h]``) into ``weight.main_grad`` (fp32 or the buffer's dtype) and
    returns what ``LinearWithGradAccumulationAndAsyncCommunication.backward`` hands autograd, so
    that DDP's backward hook treats both alike: with ``grad_added_to_main_grad`` (DDP) a dummy it
    skips, zeros where ``zero_out_wgrad`` makes it add ``.grad`` (a tied weight's embedding
    gradient), and without the attribute nothing."""
    weight.main_grad.add_(grad_weight)
    if not hasattr(weight, 'grad_added_to_main_grad'):
        return None
    weight.grad_added_to_main_grad = True
    dummy = torch.zeros if getattr(weight, 'zero_out_wgrad', False) else torch.empty
    return dummy(weight.shape, dtype=weight.dtype, device=weight.device)


def _gradients_from_logit_grads(logit_grads, draft_hidden, weight, draft_grad, weight_grad):
    G, s, b, h = draft_hidden.shape
    g = logit_grads.view(G * s * b, weight.shape[0])
    products = Products(weight)
    grad_draft = grad_weight = None
    if draft_grad:
        grad_draft = torch.empty(G, s, b, h, dtype=torch.float32, device=g.device)
        products.input_grad(g, grad_draft.view(G * s * b, h))
    if weight_grad:
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=g.device)
        x = draft_hidden.reshape(G * s * b, h).to(weight.dtype)
        products.weight_grad(grad_weight, g, x, accumulate=False)
    return grad_draft, grad_weight
