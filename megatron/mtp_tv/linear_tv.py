"""Chunked linear + draft loss for MTP heads: the sweep that every loss of this package runs in.

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
target rows ``t+1 .. t+chunk+G-1`` are projected once and shared by all depths, every depth's
draft logits are projected, and (fused mode, the default) the analytic logit gradient
``tv_coef * q * (dot - 1[q < p]) + kl_coef * (q - p)`` is turned into the hidden-state gradient and
the weight gradient before the chunk's logits are freed. Live per chunk: ``(chunk + G - 1) +
G * chunk`` rows of ``V/tp`` fp32 (the depths of a chunk are coupled by the end-to-end objective
and share the collectives). Nothing of size V outlives a chunk; what is kept for backward is the
hidden-state gradient ``[G, s, b, h]`` and the weight gradient ``[V/tp, h]`` (both fp32), and
backward is a scalar multiply. The recompute mode keeps only the inputs and runs the same sweep
again in backward (the projections twice), for debugging. Without gradients (``torch.no_grad``,
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

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional, Sequence, Union

import torch

from .losses import DraftLoss, make_loss
from .row_ops import select_row_ops
from .scratch import Scratch
from .vocab_parallel import ProcessGroup, all_reduce_sum_, group_size, vocab_range

GradStorage = Literal['auto', 'dense', 'logit_grads']
_GRAD_STORAGES = ('auto', 'dense', 'logit_grads')

#: Low-precision logit gradients are scaled so that their bound is this power of two: well
#: inside fp16's range (65504) with 16x headroom for a logit function's derivative (Megatron's
#: MuP output scaling is below 1), and far above fp16's smallest normal (6e-5).
_GRAD_BOUND = 2.0**12


@dataclass(frozen=True)
class TargetSegment:
    """A run of local sequence positions whose targets are contiguous.

    Positions ``start .. stop-1`` (dim 0 of ``[s, b, h]``) take their depth-k target from row
    ``t + k + 1`` of the virtual sequence ``target_hidden[start:stop] ++ halo``. ``halo`` holds the
    ``G`` rows that follow ``stop`` in the global sequence (another context-parallel rank's rows)
    or is None, meaning zeros: those targets fall outside the sequence and carry zero weight.
    """

    start: int
    stop: int
    halo: Optional[torch.Tensor] = None  # [G, b, h]


class TVLossResult(NamedTuple):
    """What :func:`linear_tv_loss` returns."""

    loss: torch.Tensor
    """Scalar (fp32), the weighted objective; differentiable w.r.t. draft_hidden and weight."""
    alpha: torch.Tensor
    """``[G, s, b]`` fp32, detached: the acceptance probability of every depth and position."""
    greedy_correct: Optional[torch.Tensor]
    """``[G, s, b]`` bool, detached: whether the draft argmax equals the label (if labels given)."""
    per_depth: Optional[torch.Tensor] = None
    """``[G, s, b]`` fp32, detached: each depth's unweighted per-token objective."""
    greedy_agreement: Optional[torch.Tensor] = None
    """``[G, s, b]`` bool, detached: whether the draft argmax equals the target's argmax (the
    greedy verifier's acceptance; if ``metrics``)."""


#: Live fp32 logits the automatic chunk may always use, however small the hidden size: below
#: this, more chunks only add per-chunk overhead (and the bound against the CE path still holds).
AUTO_CHUNK_MIN_BYTES = 64 * 2**20

#: Live fp32 logits the automatic chunk may use, in units of the fp32 ``[V/tp, h]`` weight
#: gradient the fused path holds anyway. Two, not one: a chunk's projection is one
#: ``[rows, h] x [h, V/tp]`` product, and one weight gradient's worth of rows (``h / (G + 1)``
#: tokens) makes it short and wide enough to run measurably slower than the full-size product of
#: the cross-entropy path (the ``mtp`` rows of ``tools/bench_loss.py`` show both chunks).
AUTO_CHUNK_WEIGHT_GRADS = 2


def auto_chunk_tokens(num_tokens: int, depths: int, hidden: int, vocab_local: int) -> int:
    """The chunk :func:`linear_tv_loss` uses for ``chunk_size=0``, in tokens.

    Live fp32 logits of a chunk are ``(depths + 1) * chunk`` rows of ``vocab_local`` (= V/tp).
    The rule keeps them at most the larger of :data:`AUTO_CHUNK_WEIGHT_GRADS` (2) times the
    ``[V/tp, hidden]`` fp32 weight gradient the fused path holds anyway and
    :data:`AUTO_CHUNK_MIN_BYTES` (64 MiB), and at most half of the ``depths * num_tokens`` rows
    of softmax that Megatron's cross-entropy path saves for the same tokens
    (``chunk <= depths * num_tokens / (2 (depths + 1))``), so the loss never peaks above that
    path at any sequence length.
    """
    budget_rows = max(
        AUTO_CHUNK_WEIGHT_GRADS * hidden, AUTO_CHUNK_MIN_BYTES // (4 * max(1, vocab_local))
    )
    per_budget = budget_rows // (depths + 1)
    per_ce = depths * num_tokens // (2 * (depths + 1))
    return max(1, min(per_budget, per_ce))


def choose_grad_storage(
    rows: int, hidden: int, vocab_local: int, dtype: torch.dtype, draft_grad: bool,
    weight_grad: bool,
) -> str:
    """What the fused path keeps from forward to backward: the smaller of the two.

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
    loss_type: Union[str, DraftLoss] = 'tv',
    chunk_size: int = 0,
    tp_group: ProcessGroup = None,
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    segments: Optional[Sequence[TargetSegment]] = None,
    labels: Optional[torch.Tensor] = None,
    fused: bool = True,
    temperature: float = 1.0,
    metrics: bool = False,
    target_logits: Optional[torch.Tensor] = None,
    grad_storage: GradStorage = 'auto',
) -> TVLossResult:
    """A draft loss of G MTP depths against a detached target, chunked over tokens.

    Args:
        draft_hidden: ``[G, s, b, h]`` hidden states of the G MTP depths (TP-replicated).
        target_hidden: ``[s, b, h]`` main-model hidden states (after the final norm); detached
            here. Row ``t + k + 1`` (within a segment) is the target of depth k at position t.
            May be None when ``target_logits`` is given.
        weight: ``[V/tp, h]`` output-layer weight shard.
        token_weights: loss weights, mask and normalisation included: ``[G, s, b]``, or
            ``[s, b]`` (one weight per chain) for ``'e2e_tv'``.
        loss_type: the objective: a :class:`~.losses.DraftLoss`, or the name of one in
            :data:`~.losses.LOSSES` (built with its default hyper-parameters).
        chunk_size: tokens per chunk (0: :func:`auto_chunk_tokens`). A chunk covers
            ``max(1, chunk_size // b)`` positions.
        tp_group: group the vocabulary is sharded over (None: full vocabulary on this rank).
        logits_fn: optional elementwise function applied to the logits (e.g. MuP scaling); it may
            return its input unchanged but must not modify it in place.
        segments: see :class:`TargetSegment`; default one segment over the whole sequence.
        labels: optional ``[G, s, b]`` token ids for greedy-accuracy counts.
        fused: compute gradients during forward (default) or recompute chunks in backward.
        temperature: verification temperature T > 0: p and q are softmax(logits / T).
        metrics: also compute the greedy agreement of draft and target argmax.
        target_logits: optional ``[s, b, V/tp]`` logits of the target rows, i.e. the main head's
            own ``target_hidden @ W^T`` (any dtype; before ``logits_fn`` and temperature, which
            apply to them as to the draft logits); detached here. The sweep then reads the target
            rows instead of projecting them (one matrix product per chunk fewer); only the
            ``halo`` rows of the segments, which live on another rank, are projected here.
        grad_storage: what the fused path keeps from forward to backward: ``'dense'`` the fp32
            ``[V/tp, h]`` weight gradient and ``[G, s, b, h]`` hidden-state gradient, formed
            chunk by chunk; ``'logit_grads'`` the ``[G, s, b, V/tp]`` logit gradients in the
            weight's dtype, turned into both gradients by two products in backward; ``'auto'``
            (default) the smaller of the two (:func:`choose_grad_storage`).

    Returns:
        :class:`TVLossResult`.
    """
    loss = loss_type if isinstance(loss_type, DraftLoss) else make_loss(loss_type)
    if draft_hidden.dim() != 4:
        raise ValueError(f"draft_hidden must be [G, s, b, h], got shape {tuple(draft_hidden.shape)}.")
    G, s, b, h = draft_hidden.shape
    if target_logits is not None:
        if tuple(target_logits.shape) != (s, b, weight.shape[0]):
            raise ValueError(
                f"target_logits shape {tuple(target_logits.shape)} does not match "
                f"[s, b, V/tp] = {(s, b, weight.shape[0])}."
            )
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
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 0.")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float('inf')):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0.")
    if grad_storage not in _GRAD_STORAGES:
        raise ValueError(f"grad_storage={grad_storage!r}; expected one of {_GRAD_STORAGES}.")
    if segments is None:
        segments = (TargetSegment(0, s),)
    tokens = chunk_size if chunk_size > 0 else auto_chunk_tokens(s * b, G, h, weight.shape[0])
    plan = _Plan(
        loss=loss,
        positions_per_chunk=max(1, tokens // b),
        tp_group=tp_group,
        logits_fn=logits_fn,
        segments=tuple(segments),
        labels=labels,
        fused=fused,
        inv_temperature=1.0 / float(temperature),
        metrics=metrics,
        grad_storage=grad_storage,
        target_is_logits=target_logits is not None,
    )
    if target_logits is not None:
        target_hidden = target_logits.detach()  # the sweep's target rows are then logit rows
    target_hidden, token_weights = target_hidden.detach(), token_weights.detach().float()
    if torch.is_grad_enabled() and (draft_hidden.requires_grad or weight.requires_grad):
        # The per-row results leave through a side channel, not as outputs of the Function:
        # autograd would keep outputs marked non-differentiable alive until backward.
        per_row = {}
        loss_value = _LinearTV.apply(draft_hidden, weight, target_hidden, token_weights, plan, per_row)
        alpha, correct, per_depth, agreement = per_row['results']
    else:  # evaluation or metrics only: no gradient work at all
        out = _sweep(draft_hidden, weight, target_hidden, token_weights, plan, False, False)
        loss_value, alpha, correct, per_depth, agreement = out[:5]
    return TVLossResult(
        loss_value, alpha, correct if labels is not None else None, per_depth,
        agreement if metrics else None,
    )


@dataclass(frozen=True)
class _Plan:
    loss: DraftLoss
    positions_per_chunk: int
    tp_group: ProcessGroup
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    segments: tuple
    labels: Optional[torch.Tensor]
    fused: bool
    inv_temperature: float
    metrics: bool
    grad_storage: str = 'auto'
    target_is_logits: bool = False


class _LinearTV(torch.autograd.Function):
    """Scalar draft objective; gradients computed in forward (fused) or by a second sweep."""

    @staticmethod
    def forward(ctx, draft_hidden, weight, target, token_weights, plan: _Plan, per_row: dict):
        need_draft_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        storage = plan.grad_storage
        if plan.fused and storage == 'auto':
            G, s, b, h = draft_hidden.shape
            storage = choose_grad_storage(
                G * s * b, h, weight.shape[0], weight.dtype, need_draft_grad, need_weight_grad
            )
        keep_logit_grads = plan.fused and storage == 'logit_grads'
        out = _sweep(
            draft_hidden, weight, target, token_weights, plan,
            draft_grad=plan.fused and need_draft_grad,
            weight_grad=plan.fused and need_weight_grad,
            keep_logit_grads=keep_logit_grads,
        )
        # Only the recompute mode needs the plan in backward; the fused modes must not keep its
        # labels and halos alive until then.
        ctx.plan = None if plan.fused else plan
        ctx.need = (need_draft_grad, need_weight_grad)
        ctx.keep_logit_grads = keep_logit_grads
        if keep_logit_grads:
            # The inputs of the two products are saved by reference: no copy.
            ctx.save_for_backward(out.grad_scale, out.logit_grads, draft_hidden, weight)
        elif plan.fused:
            grads = (g for g in (out.grad_draft, out.grad_weight) if g is not None)
            ctx.save_for_backward(out.grad_scale, *grads)
        else:
            ctx.save_for_backward(draft_hidden, weight, target, token_weights)
        per_row['results'] = (out.alpha, out.correct, out.per_depth, out.agreement)
        return out.loss

    @staticmethod
    def backward(ctx, grad_loss):
        need_draft_grad, need_weight_grad = ctx.need
        if ctx.keep_logit_grads:
            grad_scale, logit_grads, draft_hidden, weight = ctx.saved_tensors
            grad_draft, grad_weight = _gradients_from_logit_grads(
                logit_grads, draft_hidden, weight, need_draft_grad, need_weight_grad
            )
        elif ctx.plan is None:  # fused, dense gradients
            grad_scale, *saved = ctx.saved_tensors
            grad_draft = saved.pop(0) if need_draft_grad else None
            grad_weight = saved.pop(0) if need_weight_grad else None
        else:
            draft_hidden, weight, target, token_weights = ctx.saved_tensors
            # Forward already returned the label hits and the argmax agreement: not again.
            plan = dataclasses.replace(ctx.plan, labels=None, metrics=False)
            out = _sweep(
                draft_hidden, weight, target, token_weights, plan,
                draft_grad=need_draft_grad, weight_grad=need_weight_grad,
            )
            grad_draft, grad_weight, grad_scale = out.grad_draft, out.grad_weight, out.grad_scale
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
        return grad_draft, grad_weight, None, None, None, None


def _gradients_from_logit_grads(logit_grads, draft_hidden, weight, draft_grad, weight_grad):
    """``(g @ W, g^T x)`` over all rows: the two products CE's backward also runs, fp32 results.

    ``logit_grads``: ``[G, s, b, V/tp]`` in the weight's dtype; ``draft_hidden``: ``[G, s, b, h]``.
    """
    G, s, b, h = draft_hidden.shape
    g = logit_grads.view(G * s * b, weight.shape[0])
    products = _Products(weight)
    grad_draft = grad_weight = None
    if draft_grad:
        grad_draft = torch.empty(G, s, b, h, dtype=torch.float32, device=g.device)
        products.input_grad(g, grad_draft.view(G * s * b, h))
    if weight_grad:
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=g.device)
        x = draft_hidden.reshape(G * s * b, h).to(weight.dtype)
        products.weight_grad(grad_weight, g, x, accumulate=False)
    return grad_draft, grad_weight


class _SweepOutput(NamedTuple):
    loss: torch.Tensor
    alpha: torch.Tensor
    correct: torch.Tensor
    per_depth: torch.Tensor
    agreement: torch.Tensor
    grad_draft: Optional[torch.Tensor]
    grad_weight: Optional[torch.Tensor]
    grad_scale: torch.Tensor
    """Factor the stored gradients carry (a power of two for low-precision weights, else 1)."""
    logit_grads: Optional[torch.Tensor] = None
    """``[G, s, b, V/tp]`` in the weight's dtype (``keep_logit_grads``), carrying grad_scale."""


def _sweep(draft_hidden, weight, target, token_weights, plan: _Plan, draft_grad, weight_grad,
           keep_logit_grads=False):
    """One pass over all chunks: loss and per-row results, plus gradients when asked for.

    ``target`` is ``[s, b, h]`` hidden states, or ``[s, b, V/tp]`` logits when
    ``plan.target_is_logits``. With ``keep_logit_grads`` the logit gradients are stored for
    backward instead of being turned into the hidden-state and weight gradients here.
    """
    G, s, b, h = draft_hidden.shape
    device = draft_hidden.device
    loss_fn = plan.loss
    alpha = torch.zeros(G, s, b, dtype=torch.float32, device=device)
    per_depth = torch.zeros(G, s, b, dtype=torch.float32, device=device)
    correct = torch.zeros(G, s, b, dtype=torch.bool, device=device)
    agreement = torch.zeros(G, s, b, dtype=torch.bool, device=device)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    want_grad = draft_grad or weight_grad
    products = _Products(weight)
    # dL/dz of every row is at most grad_bound * its weight / T (each loss states grad_bound);
    # the stored gradients carry grad_scale.
    grad_scale = products.gradient_scale(token_weights, loss_fn.grad_bound * plan.inv_temperature)
    coef_scale = grad_scale * plan.inv_temperature
    logit_grads = None
    if keep_logit_grads:
        logit_grads = _new_rows_buffer((G, s, b, weight.shape[0]), weight.dtype, device, plan.segments, s)
        draft_grad = weight_grad = False  # both are formed from logit_grads in backward
    grad_draft = _new_rows_buffer(draft_hidden.shape, torch.float32, device, plan.segments, s) if draft_grad else None
    # fp32 accumulation across chunks (the weight gradient sums every token of the batch). The
    # first product overwrites it: zero-filling [V/tp, h] first would be one more full pass.
    grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=device) if weight_grad else None
    want_grad = want_grad or keep_logit_grads
    weight_grad_started = False
    labels = plan.labels
    vocab_start, vocab_stop = vocab_range(weight.shape[0], plan.tp_group)
    scratch = Scratch()  # the chunk's inputs and logits, reused by every chunk
    # Row-local losses on one shard know each row's coefficients as soon as its sums are done,
    # so the gradient is formed in the same pass.
    one_pass_grad = want_grad and loss_fn.row_local and group_size(plan.tp_group) == 1
    # Target rows taken from fp32 main logits as they are (no logit function, T = 1) are not
    # copied into the chunk buffer first: the softmax's first pass reads them where they are.
    defer_target_copy = (
        plan.target_is_logits and plan.logits_fn is None and plan.inv_temperature == 1.0
        and target.dtype == torch.float32
    )
    want_dot = want_grad and loss_fn.tv_grad

    ops = None
    for seg in plan.segments:
        for start in range(seg.start, seg.stop, plan.positions_per_chunk):
            stop = min(start + plan.positions_per_chunk, seg.stop)
            rows = slice(start, stop)
            n = (stop - start) * b
            # One [m, V/tp] fp32 buffer per chunk: the target rows t+1 .. t+chunk+G-1 (shared by
            # every depth), then each depth's draft rows. One projection for all of them, or,
            # when the target rows are given as logits, for the draft rows alone.
            n_t = (stop - start + G - 1) * b
            raw = scratch.take('logits', (n_t + G * n, weight.shape[0]), torch.float32, device)
            drafts = [draft_hidden[k, rows].reshape(n, h) for k in range(G)]
            target_source = None  # target logit rows the softmax reads in place of a copy
            if plan.target_is_logits:
                inputs = torch.cat(drafts, out=scratch.take('inputs', (G * n, h), weight.dtype, device))
                products.logits(inputs, raw[n_t:])
                target_source = _target_logit_rows(
                    target, seg, start + 1, stop + G, products, raw[:n_t], defer_target_copy
                )
            else:
                target_rows = _virtual_rows(target, seg, start + 1, stop + G).reshape(n_t, h)
                all_rows = torch.cat(
                    [target_rows] + drafts,
                    out=scratch.take('inputs', (n_t + G * n, h), weight.dtype, device),
                )
                products.logits(all_rows, raw)
                inputs = all_rows[n_t:]  # the draft rows, for the weight gradient
            # Row ops overwrite their input; with a logits function, raw stays intact for its chain rule.
            z = plan.logits_fn(raw).float() if plan.logits_fn is not None else raw
            if plan.inv_temperature != 1.0:
                z = z.mul_(plan.inv_temperature)
            if ops is None:
                ops, _ = select_row_ops(z)
            draft_rows = [slice(n_t + k * n, n_t + (k + 1) * n) for k in range(G)]
            if labels is not None:
                chunk_labels = labels[:, rows].reshape(G, n)
                hits = [_label_logit(z[draft_rows[k]], chunk_labels[k], vocab_start, vocab_stop) for k in range(G)]

            # Collective 1: the normalisers (and argmax) of the target rows and every depth's rows.
            probs, stats = ops.normalise_(
                z, plan.tp_group, vocab_start if plan.metrics else None, source=target_source
            )
            # Depth k at position t compares with target row t+k+1: target rows k*b .. k*b+n.
            target_of = [slice(k * b, k * b + n) for k in range(G)]
            pairs = [(ops.rows(probs, t.start, t.stop), ops.rows(probs, r.start, r.stop)) for t, r in zip(target_of, draft_rows)]
            w = token_weights[rows].reshape(n) if loss_fn.per_chain else token_weights[:, rows].reshape(G, n)

            # Collective 2: every depth's overlap and, as needed, dot product, KL and label hits.
            sums = []
            for k, (p, q) in enumerate(pairs):
                coefficients = None
                if one_pass_grad:
                    def coefficients(block, overlap, w_k=w[k]):
                        return _scaled(loss_fn.row_coefficients(overlap, w_k[block]), coef_scale)
                sums.append(ops.pair_sums(p, q, dot=want_dot, kl=loss_fn.needs_kl, coefficients=coefficients))
            columns = [torch.stack([x.overlap for x in sums])]
            if want_dot:
                columns.append(torch.stack([x.dot for x in sums]))
            if loss_fn.needs_kl:
                columns.append(torch.stack([x.kl for x in sums]))
            if labels is not None:
                columns.append(torch.stack([(hits[k] >= stats.max[r]).float() for k, r in enumerate(draft_rows)]))
            reduced = all_reduce_sum_(torch.stack(columns), plan.tp_group)  # [c, G, n]
            chunk_alpha, rest = reduced[0], list(reduced[1:])
            dots = rest.pop(0) if want_dot else None
            chunk_kl = rest.pop(0) if loss_fn.needs_kl else None
            alpha[:, rows] = chunk_alpha.view(G, stop - start, b)
            if labels is not None:
                correct[:, rows] = (rest.pop(0) > 0).view(G, stop - start, b)
            if plan.metrics:
                agree = torch.stack([stats.argmax[t] == stats.argmax[r] for t, r in zip(target_of, draft_rows)])
                agreement[:, rows] = agree.view(G, stop - start, b)

            terms = loss_fn.terms(chunk_alpha, chunk_kl, w)
            loss += terms.loss
            per_depth[:, rows] = terms.per_depth.view(G, stop - start, b)
            if not want_grad:
                continue
            if not one_pass_grad:
                for k, (p, q) in enumerate(pairs):
                    tv_coef, kl_coef = _scaled(
                        (terms.tv_coef[k] if terms.tv_coef is not None else None,
                         terms.kl_coef[k] if terms.kl_coef is not None else None),
                        coef_scale,
                    )
                    ops.grad_(p, q, dots[k] if dots is not None else None, tv_coef, kl_coef)
            # Every depth's logit gradient now lies over its draft rows: one [G*n, V/tp] block.
            g = ops.written_grad(ops.rows(probs, n_t, n_t + G * n))
            if plan.logits_fn is not None:  # chain rule through the logit scaling function
                # depth by depth, written back over the block: its temporaries stay [n, V/tp]
                for k in range(G):
                    with torch.enable_grad():
                        leaf = raw[draft_rows[k]].detach().requires_grad_()
                        (chained,) = torch.autograd.grad(plan.logits_fn(leaf).float(), leaf, g[k * n : (k + 1) * n])
                    g[k * n : (k + 1) * n].copy_(chained)
            if logit_grads is not None:  # rounded to the weight's dtype as it is stored
                logit_grads[:, rows].copy_(g.reshape(G, stop - start, b, -1))
                continue
            # fp32 weights: all depths in one product each, so the [V/tp, h] weight gradient is
            # read and written once per chunk, not G times. bf16/fp16 weights go depth by depth:
            # all depths at once would need a [G*n, V/tp] copy in the weight's dtype.
            depth_blocks = [slice(0, G)] if not products.low_precision else [slice(k, k + 1) for k in range(G)]
            for depths in depth_blocks:
                rows_k = slice(depths.start * n, depths.stop * n)
                g_k = g[rows_k].to(weight.dtype)  # bf16/fp16 weights: low-precision operands, fp32 sums
                if grad_draft is not None:
                    _input_grad_into(products, g_k, grad_draft[depths, rows], scratch)
                if grad_weight is not None:
                    products.weight_grad(grad_weight, g_k, inputs[rows_k], weight_grad_started)
                    weight_grad_started = True
    if grad_weight is not None and not weight_grad_started:
        grad_weight.zero_()
    return _SweepOutput(
        loss, alpha, correct, per_depth, agreement, grad_draft, grad_weight, grad_scale, logit_grads
    )


def _input_grad_into(products, g: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
    """``out = g @ W`` for ``out`` ``[depths, positions, b, h]`` (rows of the ``[G, s, b, h]``
    gradient): straight into it for one depth, whose rows are contiguous; through a scratch
    ``[rows, h]`` buffer for several."""
    if out.shape[0] == 1:
        products.input_grad(g, out.view(g.shape[0], -1))
        return
    flat = scratch.take('input_grad', (g.shape[0], out.shape[-1]), out.dtype, out.device)
    products.input_grad(g, flat)
    out.copy_(flat.view(out.shape))


def _new_rows_buffer(shape, dtype, device, segments, s) -> torch.Tensor:
    """A ``[G, s, ...]`` buffer every chunk writes its rows of: uninitialised when the segments
    cover ``[0, s)`` (every row is written), else zero-filled (rows no chunk visits stay 0)."""
    bounds = sorted((seg.start, seg.stop) for seg in segments)
    covered = 0
    for start, stop in bounds:
        if start != covered:
            break
        covered = stop
    if covered == s:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _scaled(coefficients, factor):
    """``(tv_coef, kl_coef)`` times ``factor`` (None stays None)."""
    return tuple(c * factor if c is not None else None for c in coefficients)


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``sum_j prod_{i<=j} alpha_i`` over the leading (depth) dimension of ``alpha``."""
    return alpha.cumprod(0).sum(0)


class _Products:
    """The sweep's matrix products with fp32 accumulation and fp32 results for any weight dtype.

    fp32 weights use plain (in-place, ``out=``) fp32 GEMMs. bf16/fp16 weights keep their
    low-precision operands: on CUDA through ``out_dtype=torch.float32`` GEMMs (tensor cores
    accumulate in fp32); on CPU, which has no such kernel, by upcasting the operands, which gives
    the same products (the product of two bf16/fp16 numbers is exact in fp32). The CPU copy of the
    weight in fp32 is made once per sweep.
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.low_precision = weight.dtype != torch.float32
        self._weight32 = None

    def gradient_scale(self, token_weights: torch.Tensor, bound_per_weight: float) -> torch.Tensor:
        """Power of two that brings the logit gradient's bound ``max(w) * bound_per_weight``
        (the loss's ``grad_bound / T``) to ``_GRAD_BOUND`` (1 for fp32 weights, where no rounding
        happens). A device scalar: no host sync."""
        one = torch.ones((), dtype=torch.float32, device=token_weights.device)
        if not self.low_precision or token_weights.numel() == 0:
            return one
        bound = token_weights.abs().amax() * bound_per_weight
        exponent = (math.log2(_GRAD_BOUND) - torch.ceil(torch.log2(bound))).clamp(-100, 100)
        return torch.where(bound > 0, torch.exp2(exponent), one)

    def logits(self, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = inputs @ W^T`` (``out``: ``[m, V/tp]`` fp32)."""
        if not self.low_precision:
            return torch.mm(inputs, self.weight.t(), out=out)
        if inputs.is_cuda:
            return _mm_out_fp32(inputs, self.weight.t(), out)
        return torch.mm(inputs.float(), self._fp32_weight().t(), out=out)

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """``out = g @ W`` (``g``: ``[n, V/tp]`` in the weight's dtype; ``out`` fp32)."""
        if not self.low_precision:
            torch.mm(g, self.weight, out=out)
        elif g.is_cuda:
            _mm_out_fp32(g, self.weight, out)
        else:
            torch.mm(g.float(), self._fp32_weight(), out=out)

    def weight_grad(self, grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, accumulate: bool) -> None:
        """``grad_weight (+)= g^T x``: overwrite on the first chunk, accumulate in fp32 after."""
        beta = 1.0 if accumulate else 0.0
        if not self.low_precision:
            grad_weight.addmm_(g.t(), x, beta=beta)
        elif g.is_cuda:
            _addmm_fp32_(grad_weight, g.t(), x, beta)
        else:
            grad_weight.addmm_(g.t().float(), x.float(), beta=beta)

    def _fp32_weight(self) -> torch.Tensor:
        if self._weight32 is None:
            self._weight32 = self.weight.detach().float()
        return self._weight32


def _mm_out_fp32(a, b, out):
    """``out = a @ b`` for low-precision CUDA operands, fp32 accumulation and result."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype_out
        return out.copy_(torch.mm(a, b, out_dtype=torch.float32))


def _addmm_fp32_(acc, a, b, beta: float):
    """``acc = beta * acc + a @ b`` for low-precision CUDA operands into an fp32 ``acc``."""
    try:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without addmm.dtype_out
        product = torch.mm(a, b, out_dtype=torch.float32)
        acc.add_(product) if beta else acc.copy_(product)


def _virtual_rows(target_hidden, seg: TargetSegment, first: int, stop: int) -> torch.Tensor:
    """Rows ``[first, stop)`` of ``target_hidden[seg.start:seg.stop] ++ halo`` (zeros if no halo)."""
    if stop <= seg.stop:
        return target_hidden[first:stop]
    body = target_hidden[first : seg.stop]
    extra = stop - max(first, seg.stop)
    if seg.halo is not None:
        tail = seg.halo[:extra].to(target_hidden.dtype)
    else:
        tail = target_hidden.new_zeros((extra,) + tuple(target_hidden.shape[1:]))
    return torch.cat([body, tail]) if body.shape[0] else tail


def _target_logit_rows(target_logits, seg: TargetSegment, first: int, stop: int, products, out,
                       defer_body: bool = False) -> Optional[torch.Tensor]:
    """``out`` = the logits of rows ``[first, stop)`` of :func:`_virtual_rows`, read from the
    target's logits: copied (the row ops overwrite ``out`` in place, the main logits must stay
    intact); only the halo rows, hidden states from another rank, are projected, then rounded to
    the logits' dtype like the rows around them. Rows past the sequence without a halo are zeros
    (their targets carry zero weight).

    With ``defer_body`` the rows inside the sequence are not copied: they are returned,
    ``[r, V/tp]``, for the row ops' softmax to read as ``out``'s first ``r`` rows
    (``normalise_(..., source=)``); None otherwise."""
    body_stop = min(stop, seg.stop)
    n_body = max(0, body_stop - first) * target_logits.shape[1]
    body = None
    if n_body:
        body = target_logits[first:body_stop].reshape(n_body, target_logits.shape[-1])
        if not defer_body:
            out[:n_body].copy_(body)
            body = None
    extra = stop - max(first, seg.stop)
    if extra <= 0:
        return body
    tail = out[n_body:]
    if seg.halo is None:
        tail.zero_()
        return body
    halo = seg.halo[:extra].reshape(tail.shape[0], -1).to(products.weight.dtype)
    products.logits(halo, tail)
    if target_logits.dtype != torch.float32:
        tail.copy_(tail.to(target_logits.dtype))
    return body


def _label_logit(z, labels, vocab_start, vocab_stop):
    """Logit of each row's label when it lies in this rank's shard, else -inf."""
    local = labels - vocab_start
    in_shard = (labels >= vocab_start) & (labels < vocab_stop)
    picked = z.detach().gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(in_shard, picked, torch.full_like(picked, float('-inf')))
