"""Chunked linear + draft loss for MTP heads: the entry point every loss of this package runs
through (:func:`linear_tv_loss`), its autograd Function and backward modes. What a call computes
(objective, chunk, temperature, row kernels, metrics) is one :class:`~.options.MTPLossOptions`;
the chunk loop itself is :mod:`.sweep`.

For draft hidden states ``x_k`` (MTP depth k), the detached main-model hidden states ``y`` and the
output weight ``W`` (possibly vocab-sharded over tensor parallelism), with
``q_k = softmax(f(x_k W^T) / T)`` and ``p = softmax(f(y W^T) / T)`` (``f``: optional logit
scaling, ``T``: the temperature drafts are verified at):

* ``alpha_k[t] = sum_v min(p[t + k + 1], q_k[t])`` is the probability that rejection sampling
  accepts the token drafted at depth k (``1 - alpha`` is the total variation distance);
* the objective is one of :mod:`.losses` (``'tv'``, ``'e2e_tv'``, ``'kl'``, ``'lk'``, ``'nla'``), a
  weighted sum over tokens of a per-row function of ``alpha`` and ``KL(p || q_k)``.

The weights ``w`` carry the loss mask and the whole normalisation (``scale / num_tokens``), so the
loss is a scalar and its gradient is fully known during the forward pass.

Memory: tokens are processed in chunks (:func:`auto_chunk_tokens` by default). Inside a chunk the
target rows ``t+1 .. t+chunk+G-1`` are shared by all depths (read from the main head's logits
when the caller has them, else projected once), every depth's draft logits are projected, and
the analytic logit gradient
``tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)`` is turned into the hidden-state gradient and
the weight gradient before the chunk's logits are freed. Live per chunk: ``(chunk + G - 1) +
G * chunk`` rows of ``V/tp`` fp32 (the depths of a chunk are coupled by the end-to-end objective
and share the collectives). Nothing of size V outlives a chunk; what is kept for backward is the
hidden-state gradient ``[G, s, b, h]`` and the weight gradient ``[V/tp, h]`` (both fp32), and
backward is a scalar multiply (or, where that is smaller, the logit gradients and backward's two
products: :func:`choose_grad_storage`). Without gradients (``torch.no_grad``,
or inputs that do not require them: evaluation, metrics-only passes) the sweep forms no gradient
at all: one projection per chunk.

Precision: every product accumulates in fp32 and returns fp32. The logits are fp32; the logit
gradient is formed in fp32 and, for bf16/fp16 weights, rounded to the weight's dtype for the two
gradient products after scaling by a power of two chosen from the largest row weight (every loss
states a bound ``|dL/dz| <= grad_bound * w / T``, :attr:`.DraftLoss.grad_bound`), so that fp16
does not flush the tiny per-token gradients (``scale / num_tokens`` is folded in here, while
Megatron's loss scale only arrives in backward) to zero; the stored gradients are fp32 and
unscaled in backward. On CUDA the low-precision products run as
``torch.mm(..., out_dtype=torch.float32)``; on CPU, which has no such kernel, their (already
rounded) operands are upcast, which computes the same products.

Ties ``q_v == p_v`` count as ``min = p`` (the detached side): the indicator ``1[q < p]`` is strict,
so such a vocabulary entry passes no TV gradient (torch.minimum's autograd would pass 1/2).

Tensor parallelism: the vocabulary is sharded. Collectives per chunk, whatever the number of
depths and the loss: forward one all-gather (each shard's row max, log-sum-exp and argmax of the
target rows and of every depth's rows, combined locally, see :func:`.combine_row_stats`) and one
SUM all-reduce (every depth's overlap, and as the loss needs them the gradient's dot product,
KL and the label hit count); backward none. The hidden-state gradient returned for
``draft_hidden`` is this rank's partial sum over its vocabulary shard, exactly like the input
gradient of a column-parallel linear layer before its backward all-reduce: the caller feeds
``draft_hidden`` through the usual copy-to-TP (or sequence-parallel all-gather) mapping, whose
backward reduces it once per micro-batch. Every TP rank walks the same chunks (they depend only on
shapes and segments), so no rank skips a collective another rank is waiting in, even when a
chunk holds no valid token.

No Megatron imports here.
"""

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .options import MTPLossOptions
from .products import Products
from .sweep import (DenseGradients, StoredLogitGradients, SweepOutput, SweepPlan, TargetSegment,
                    sweep)
from .vocab_parallel import ProcessGroup


class TVLossResult(NamedTuple):
    """What :func:`linear_tv_loss` returns."""

    loss: torch.Tensor
    """Scalar (fp32), the weighted objective; differentiable w.r.t. draft_hidden and weight."""
    alpha: Optional[torch.Tensor]
    """``[G, s, b]`` fp32, detached: the acceptance probability of every depth and position
    (None for cross-entropy without a target)."""
    greedy_correct: Optional[torch.Tensor]
    """``[G, s, b]`` bool, detached: whether the draft argmax equals the label (if labels given)."""
    per_depth: Optional[torch.Tensor] = None
    """``[G, s, b]`` fp32, detached: each depth's unweighted per-token objective."""
    greedy_agreement: Optional[torch.Tensor] = None
    """``[G, s, b]`` bool, detached: whether the draft argmax equals the target's argmax (the
    greedy verifier's acceptance; if ``options.metrics``)."""


#: Live fp32 logits the automatic chunk may always use, however small the hidden size: below
#: this, more chunks only add per-chunk overhead (and the bound against the CE path still holds).
AUTO_CHUNK_MIN_BYTES = 64 * 2**20

#: Live fp32 logits the automatic chunk may use, in units of the fp32 ``[V/tp, h]`` weight
#: gradient the loss holds anyway. Two, not one: a chunk's projection is one
#: ``[rows, h] x [h, V/tp]`` product, and one weight gradient's worth of rows (``h / (G + 1)``
#: tokens) makes it short and wide enough to run measurably slower than the full-size product of
#: the cross-entropy path (the ``mtp`` rows of ``tools/bench_loss.py`` show both chunks).
AUTO_CHUNK_WEIGHT_GRADS = 2


def auto_chunk_tokens(num_tokens: int, depths: int, hidden: int, vocab_local: int,
                      target_rows: bool = True) -> int:
    """The chunk :func:`linear_tv_loss` uses for ``chunk_size=0``, in tokens.

    A chunk holds ``(depths + 1) * chunk`` live fp32 rows of ``vocab_local`` (= V/tp) logits:
    every depth's draft rows and the shared target rows, or ``depths * chunk`` without target
    rows (cross-entropy against the labels, ``target_rows=False``). The rule keeps
    ``(depths + 1) * chunk`` rows at most the larger of :data:`AUTO_CHUNK_WEIGHT_GRADS` (2)
    times the ``[V/tp, hidden]`` fp32 weight gradient the loss holds anyway and
    :data:`AUTO_CHUNK_MIN_BYTES` (64 MiB), and at most half of the ``depths * num_tokens`` rows
    of softmax that Megatron's cross-entropy path saves for the same tokens
    (``chunk <= depths * num_tokens / (2 (depths + 1))``), so the loss never peaks above that
    path at any sequence length.

    Cross-entropy keeps that chunk where Megatron's saved rows dominate its peak
    (``depths * num_tokens >= (depths + 1) * hidden``): its live rows are then at most
    ``depths / (2 (depths + 1))`` of them, which with the weight gradient both paths hold puts
    its peak at half of Megatron's or below. Where they do not (few tokens next to the hidden
    size, the weight gradient dominating both peaks), it takes half of the saved rows
    (``chunk <= num_tokens / 2``): fewer, longer matrix products, which at hidden sizes of
    4096-7168 run measurably faster on a CPU (the ``ce`` rows of ``tools/bench_loss.py``).
    """
    budget_rows = max(
        AUTO_CHUNK_WEIGHT_GRADS * hidden, AUTO_CHUNK_MIN_BYTES // (4 * max(1, vocab_local))
    )
    per_budget = budget_rows // (depths + 1)
    saved_rows_dominate = depths * num_tokens >= (depths + 1) * hidden
    rows_per_token = depths + 1 if target_rows or saved_rows_dominate else depths
    per_ce = depths * num_tokens // (2 * rows_per_token)
    return max(1, min(per_budget, per_ce))


def choose_grad_storage(
    rows: int, hidden: int, vocab_local: int, dtype: torch.dtype, draft_grad: bool,
    weight_grad: bool,
) -> str:
    """What the loss keeps from forward to backward: the smaller of the two.

    ``'dense'`` holds the fp32 weight gradient ``[V/tp, h]`` and the fp32 hidden-state gradient
    ``[rows, h]`` (``rows = G * s * b``); ``'logit_grads'`` holds the ``[rows, V/tp]`` logit
    gradients in the weight's ``dtype`` (the inputs they multiply in backward are the draft
    hidden states, which the caller's graph holds anyway). Megatron's cross-entropy path keeps
    ``[rows, V/tp]`` fp32 softmax and allocates both gradients in backward, so either choice
    holds no more than it does; the smaller one keeps the loss below it at every shape: dense
    while ``rows`` is well above ``h`` (long sequences, the usual case), the logit gradients when
    ``rows`` is not (wide models at short sequences, e.g. h 7168 at 2k tokens).
    """
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
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    segments: Optional[Sequence[TargetSegment]] = None,
    labels: Optional[torch.Tensor] = None,
    target_logits: Optional[torch.Tensor] = None,
) -> TVLossResult:
    """A draft loss of G MTP depths against a detached target, chunked over tokens.

    What it computes (the objective, the chunk, the temperature, the row kernels, the metrics)
    is ``options``, validated when they were built; the arguments here are the tensors and the
    process group of the call, checked against each other.

    Args:
        draft_hidden: ``[G, s, b, h]`` hidden states of the G MTP depths (TP-replicated).
        target_hidden: ``[s, b, h]`` main-model hidden states (after the final norm); detached
            here. Row ``t + k + 1`` (within a segment) is the target of depth k at position t.
            May be None when ``target_logits`` is given, or for a loss against the labels
            (:class:`~.losses.CrossEntropy`), which then computes no overlaps.
        weight: ``[V/tp, h]`` output-layer weight shard.
        token_weights: loss weights, mask and normalisation included: ``[G, s, b]``, or
            ``[s, b]`` (one weight per chain) for ``'e2e_tv'``.
        options: the objective and its settings (:class:`~.options.MTPLossOptions`; its
            ``chunk_size`` 0 is :func:`auto_chunk_tokens`).
        tp_group: group the vocabulary is sharded over (None: full vocabulary on this rank).
        logits_fn: optional elementwise function applied to the logits (e.g. MuP scaling); it may
            return its input unchanged but must not modify it in place.
        segments: see :class:`TargetSegment`; default one segment over the whole sequence.
        labels: ``[G, s, b]`` token ids: for greedy-accuracy counts (optional), and the
            targets of a loss against the labels (required there; ids outside ``[0, V)`` count
            as Megatron's cross-entropy counts them: a label logit of 0).
        target_logits: optional ``[s, b, V/tp]`` logits of the target rows, i.e. the main head's
            own ``target_hidden @ W^T`` (any dtype; before ``logits_fn`` and temperature, which
            apply to them as to the draft logits); detached here. The sweep then reads the target
            rows instead of projecting them (one matrix product per chunk fewer); only the
            ``halo`` rows of the segments, which live on another rank, are projected here.

    Returns:
        :class:`TVLossResult`.
    """
    if not isinstance(options, MTPLossOptions):
        raise TypeError(f"options must be an MTPLossOptions, got {options!r}.")
    _check_shapes(draft_hidden, target_hidden, weight, token_weights, options, labels, target_logits)
    G, s, b, h = draft_hidden.shape
    tokens = options.chunk_size or auto_chunk_tokens(
        s * b, G, h, weight.shape[0], target_rows=target_hidden is not None or target_logits is not None
    )
    plan = SweepPlan(
        options=options,
        positions_per_chunk=max(1, tokens // b),
        tp_group=tp_group,
        logits_fn=logits_fn,
        segments=tuple(segments) if segments is not None else (TargetSegment(0, s),),
        labels=labels,
        target_is_logits=target_logits is not None,
    )
    target = target_logits if target_logits is not None else target_hidden
    target = target.detach() if target is not None else None
    token_weights = token_weights.detach().float()
    if torch.is_grad_enabled() and (draft_hidden.requires_grad or weight.requires_grad):
        mode = BACKWARD_MODES[choose_grad_storage(
            G * s * b, h, weight.shape[0], weight.dtype, draft_hidden.requires_grad,
            weight.requires_grad,
        )]()
        # The per-row results leave through a slot, not as outputs of the Function: autograd
        # would keep outputs marked non-differentiable alive until backward.
        slot = _ResultSlot()
        loss_value = _LinearTV.apply(draft_hidden, weight, target, token_weights, plan, mode, slot)
        out = slot.value
    else:  # evaluation or metrics only: no gradient work at all
        out = sweep(draft_hidden, weight, target, token_weights, plan)
        loss_value = out.loss
    return TVLossResult(
        loss_value, out.alpha, out.correct if labels is not None else None, out.per_depth,
        out.agreement if options.metrics else None,
    )


def _check_shapes(draft_hidden, target_hidden, weight, token_weights, options: MTPLossOptions,
                  labels, target_logits) -> None:
    """ValueError unless the tensors have the shapes :func:`linear_tv_loss` documents (and the
    ones ``options`` need are given)."""
    loss = options.loss
    if draft_hidden.dim() != 4:
        raise ValueError(f"draft_hidden must be [G, s, b, h], got shape {tuple(draft_hidden.shape)}.")
    G, s, b, h = draft_hidden.shape
    if target_logits is not None:
        if tuple(target_logits.shape) != (s, b, weight.shape[0]):
            raise ValueError(
                f"target_logits shape {tuple(target_logits.shape)} does not match "
                f"[s, b, V/tp] = {(s, b, weight.shape[0])}."
            )
    elif target_hidden is None and not loss.needs_target:
        if options.metrics:
            raise ValueError(f"metrics compare with a target: {loss.name!r} was given none.")
    elif target_hidden is None or target_hidden.shape != (s, b, h):
        raise ValueError(
            f"target_hidden shape {tuple(target_hidden.shape) if target_hidden is not None else None} "
            f"does not match draft positions [s, b, h] = {(s, b, h)}."
        )
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be [V/tp, {h}], got shape {tuple(weight.shape)}.")
    expected = (s, b) if loss.per_chain else (G, s, b)
    if tuple(token_weights.shape) != expected:
        raise ValueError(
            f"token_weights for {loss.name!r} must have shape {expected}, "
            f"got {tuple(token_weights.shape)}."
        )
    if labels is not None and tuple(labels.shape) != (G, s, b):
        raise ValueError(f"labels must have shape {(G, s, b)}, got {tuple(labels.shape)}.")
    if loss.needs_labels and labels is None:
        raise ValueError(f"the {loss.name!r} loss is against the labels: labels are required.")


class _ResultSlot:
    """Where :class:`_LinearTV`'s forward leaves the sweep's per-row results."""

    value: Optional[SweepOutput] = None


# ------------------------------------------------------------------------------------------------
# Backward modes: what forward keeps for backward, and how backward turns it into gradients.
# ------------------------------------------------------------------------------------------------
class DenseGradientsMode:
    """The fp32 hidden-state and weight gradients are formed in forward; backward scales them."""

    def forward_sink(self, draft_hidden, weight, plan, need_draft, need_weight):
        return DenseGradients(draft_hidden, weight, plan.segments, need_draft, need_weight)

    def save(self, ctx, out, sink, draft_hidden, weight, target, token_weights):
        ctx.save_for_backward(out.grad_scale, *(g for g in (sink.draft, sink.weight) if g is not None))

    def gradients(self, ctx, need_draft, need_weight):
        grad_scale, *saved = ctx.saved_tensors
        grad_draft = saved.pop(0) if need_draft else None
        grad_weight = saved.pop(0) if need_weight else None
        return grad_draft, grad_weight, grad_scale


class StoredLogitGradientsMode:
    """The logit gradients are kept in the weight's dtype; backward runs the two products CE's
    backward also runs."""

    def forward_sink(self, draft_hidden, weight, plan, need_draft, need_weight):
        return StoredLogitGradients(draft_hidden, weight, plan.segments)

    def save(self, ctx, out, sink, draft_hidden, weight, target, token_weights):
        # The inputs of the two products are saved by reference: no copy.
        ctx.save_for_backward(out.grad_scale, sink.logit_grads, draft_hidden, weight)

    def gradients(self, ctx, need_draft, need_weight):
        grad_scale, logit_grads, draft_hidden, weight = ctx.saved_tensors
        grad_draft, grad_weight = _gradients_from_logit_grads(
            logit_grads, draft_hidden, weight, need_draft, need_weight
        )
        return grad_draft, grad_weight, grad_scale


#: The backward modes by the name :func:`choose_grad_storage` gives.
BACKWARD_MODES = {'dense': DenseGradientsMode, 'logit_grads': StoredLogitGradientsMode}


class _LinearTV(torch.autograd.Function):
    """Scalar draft objective; what backward needs is set by the backward mode."""

    @staticmethod
    def forward(ctx, draft_hidden, weight, target, token_weights, plan: SweepPlan, mode,
                slot: _ResultSlot):
        need_draft, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sink = mode.forward_sink(draft_hidden, weight, plan, need_draft, need_weight)
        out = sweep(draft_hidden, weight, target, token_weights, plan, sink)
        mode.save(ctx, out, sink, draft_hidden, weight, target, token_weights)
        ctx.mode, ctx.need = mode, (need_draft, need_weight)
        slot.value = out
        return out.loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_draft, grad_weight, grad_scale = ctx.mode.gradients(ctx, *ctx.need)
        # The objective is linear in its upstream gradient: one scalar (which also undoes the
        # low-precision scaling) rescales everything. In place: a new [V/tp, h] tensor would cost
        # a full extra pass. The dense buffers therefore serve one backward; a second one
        # (retain_graph) fails autograd's saved-tensor version check instead of returning
        # gradients scaled twice (stored logit gradients are only read, so they serve any
        # number). Autograd casts the fp32 results to the inputs' dtypes.
        factor = grad_loss.float() / grad_scale
        if grad_draft is not None:
            grad_draft.mul_(factor)
        if grad_weight is not None:
            grad_weight.mul_(factor)
        return grad_draft, grad_weight, None, None, None, None, None


def _gradients_from_logit_grads(logit_grads, draft_hidden, weight, draft_grad, weight_grad):
    """``(g @ W, g^T x)`` over all rows: the two products CE's backward also runs, fp32 results.

    ``logit_grads``: ``[G, s, b, V/tp]`` in the weight's dtype; ``draft_hidden``: ``[G, s, b, h]``.
    """
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
