"""Chunked linear + total-variation loss for MTP draft heads: the loss math of this package.

For draft hidden states ``x_k`` (MTP depth k), the detached main-model hidden states ``y`` and the
output weight ``W`` (possibly vocab-sharded over tensor parallelism), with
``q_k = softmax(f(x_k W^T))`` and ``p = softmax(f(y W^T))`` (``f``: optional logit scaling):

* ``alpha_k[t] = sum_v min(p[t + k + 1], q_k[t])`` is the probability that rejection sampling
  accepts the token drafted at depth k (``1 - alpha`` is the total variation distance);
* ``'tv'`` minimises ``sum_{k,t} w_k[t] * (1 - alpha_k[t])`` (Bebop Eq. 10, one term per depth);
* ``'e2e_tv'`` minimises ``sum_t w[t] * (1 - (1/G) sum_j prod_{i<=j} alpha_i[t])`` (Bebop Eq. 13),
  ``G`` the number of depths; ``sum_j prod_{i<=j} alpha_i`` is the expected number of accepted
  draft tokens per verify step.

The weights ``w`` carry the loss mask and the whole normalisation (``scale / num_tokens``), so the
loss is a scalar and its gradient is fully known during the forward pass.

Memory: tokens are processed in chunks of ``chunk_size``. Inside a chunk the target rows
``t+1 .. t+chunk+G-1`` are projected once and shared by all depths, every depth's draft logits
are projected, and (fused mode, the default) the analytic logit gradient
``dL/dz = -coef * q * (1[q < p] - sum_u q_u 1[q_u < p_u])`` is turned into the hidden-state
gradient and the weight gradient before the chunk's logits are freed. Live per chunk:
``(chunk + G - 1) + G * chunk`` rows of ``V/tp`` fp32 (the depths of a chunk are coupled by the
end-to-end objective and share the collectives). Nothing of size V outlives a chunk; what is kept
for backward is the hidden-state gradient ``[G, s, b, h]`` and the weight gradient ``[V/tp, h]``
(fp32), and backward is a scalar multiply. The recompute mode keeps only the inputs and runs the
same sweep again in backward (the projections twice), for debugging.

Ties ``q_v == p_v`` count as ``min = p`` (the detached side): the indicator ``1[q < p]`` is strict,
so such a vocabulary entry passes no gradient (torch.minimum's autograd would pass 1/2).

Tensor parallelism: the vocabulary is sharded. Collectives per chunk, whatever the number of
depths: forward one all-gather (each shard's row max and log-sum-exp of the target rows and of
every depth's rows, combined locally, see :func:`combine_logsumexp`) and one SUM all-reduce
(overlap, the gradient's dot product and the greedy hit count of every depth); backward none. The
hidden-state gradient returned for ``draft_hidden`` is this rank's partial sum over its
vocabulary shard, exactly like the input gradient of a column-parallel linear layer before its
backward all-reduce: the caller feeds ``draft_hidden`` through the usual copy-to-TP (or
sequence-parallel all-gather) mapping, whose backward reduces it once per micro-batch. Every TP
rank walks the same chunks (they depend only on shapes and segments), so no rank skips a
collective another rank is waiting in, even when a chunk holds no valid token.

No Megatron imports here.
"""

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional, Sequence

import torch

from .row_ops import Scratch, select_row_ops
from .vocab_parallel import ProcessGroup, all_reduce_sum_, group_size, vocab_range

TVLossType = Literal['tv', 'e2e_tv']


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


def linear_tv_loss(
    draft_hidden: torch.Tensor,
    target_hidden: torch.Tensor,
    weight: torch.Tensor,
    token_weights: torch.Tensor,
    loss_type: TVLossType = 'tv',
    chunk_size: int = 0,
    tp_group: ProcessGroup = None,
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    segments: Optional[Sequence[TargetSegment]] = None,
    labels: Optional[torch.Tensor] = None,
    fused: bool = True,
) -> TVLossResult:
    """Total-variation loss of G draft depths against a detached target, chunked over tokens.

    Args:
        draft_hidden: ``[G, s, b, h]`` hidden states of the G MTP depths (TP-replicated).
        target_hidden: ``[s, b, h]`` main-model hidden states (after the final norm); detached
            here. Row ``t + k + 1`` (within a segment) is the target of depth k at position t.
        weight: ``[V/tp, h]`` output-layer weight shard.
        token_weights: loss weights, mask and normalisation included: ``[G, s, b]`` for
            ``'tv'``, ``[s, b]`` (one weight per chain) for ``'e2e_tv'``.
        loss_type: ``'tv'`` or ``'e2e_tv'``.
        chunk_size: tokens per chunk (0: one chunk per segment). A chunk covers
            ``max(1, chunk_size // b)`` positions.
        tp_group: group the vocabulary is sharded over (None: full vocabulary on this rank).
        logits_fn: optional elementwise function applied to the logits (e.g. MuP scaling); it may
            return its input unchanged but must not modify it in place.
        segments: see :class:`TargetSegment`; default one segment over the whole sequence.
        labels: optional ``[G, s, b]`` token ids for greedy-accuracy counts.
        fused: compute gradients during forward (default) or recompute chunks in backward.

    Returns:
        :class:`TVLossResult`.
    """
    if loss_type not in ('tv', 'e2e_tv'):
        raise ValueError(f"loss_type={loss_type!r}; expected 'tv' or 'e2e_tv'.")
    if draft_hidden.dim() != 4:
        raise ValueError(f"draft_hidden must be [G, s, b, h], got shape {tuple(draft_hidden.shape)}.")
    G, s, b, h = draft_hidden.shape
    if target_hidden.shape != (s, b, h):
        raise ValueError(
            f"target_hidden shape {tuple(target_hidden.shape)} does not match draft positions "
            f"[s, b, h] = {(s, b, h)}."
        )
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be [V/tp, {h}], got shape {tuple(weight.shape)}.")
    expected = (G, s, b) if loss_type == 'tv' else (s, b)
    if tuple(token_weights.shape) != expected:
        raise ValueError(
            f"token_weights for {loss_type!r} must have shape {expected}, "
            f"got {tuple(token_weights.shape)}."
        )
    if labels is not None and tuple(labels.shape) != (G, s, b):
        raise ValueError(f"labels must have shape {(G, s, b)}, got {tuple(labels.shape)}.")
    if chunk_size < 0:
        raise ValueError(f"chunk_size={chunk_size} must be >= 0.")
    if segments is None:
        segments = (TargetSegment(0, s),)
    plan = _Plan(
        loss_type=loss_type,
        positions_per_chunk=max(1, chunk_size // b) if chunk_size > 0 else s,
        tp_group=tp_group,
        logits_fn=logits_fn,
        segments=tuple(segments),
        labels=labels,
        fused=fused,
    )
    loss, alpha, correct = _LinearTV.apply(
        draft_hidden, weight, target_hidden.detach(), token_weights.detach().float(), plan
    )
    return TVLossResult(loss, alpha, correct if labels is not None else None)


@dataclass(frozen=True)
class _Plan:
    loss_type: str
    positions_per_chunk: int
    tp_group: ProcessGroup
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    segments: tuple
    labels: Optional[torch.Tensor]
    fused: bool


class _LinearTV(torch.autograd.Function):
    """Scalar TV objective; gradients computed in forward (fused) or by a second sweep."""

    @staticmethod
    def forward(ctx, draft_hidden, weight, target_hidden, token_weights, plan: _Plan):
        need_draft_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sweep_grads = plan.fused and (need_draft_grad or need_weight_grad)
        out = _sweep(
            draft_hidden, weight, target_hidden, token_weights, plan,
            draft_grad=sweep_grads and need_draft_grad,
            weight_grad=sweep_grads and need_weight_grad,
        )
        ctx.plan = plan
        ctx.need = (need_draft_grad, need_weight_grad)
        if plan.fused:
            ctx.save_for_backward(*(g for g in (out.grad_draft, out.grad_weight) if g is not None))
        else:
            ctx.save_for_backward(draft_hidden, weight, target_hidden, token_weights)
        ctx.mark_non_differentiable(out.alpha, out.correct)
        return out.loss, out.alpha, out.correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_alpha, _grad_correct):
        need_draft_grad, need_weight_grad = ctx.need
        if ctx.plan.fused:
            saved = list(ctx.saved_tensors)
            grad_draft = saved.pop(0) if need_draft_grad else None
            grad_weight = saved.pop(0) if need_weight_grad else None
        else:
            draft_hidden, weight, target_hidden, token_weights = ctx.saved_tensors
            out = _sweep(
                draft_hidden, weight, target_hidden, token_weights, ctx.plan,
                draft_grad=need_draft_grad, weight_grad=need_weight_grad,
            )
            grad_draft, grad_weight = out.grad_draft, out.grad_weight
        # The objective is linear in its upstream gradient: a scalar rescales everything. In
        # place: a new [V/tp, h] tensor would cost a full extra pass. The fused buffers therefore
        # serve one backward; a second one (retain_graph) fails autograd's saved-tensor version
        # check instead of returning gradients scaled twice.
        if grad_draft is not None:
            grad_draft.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_draft, grad_weight, None, None, None


class _SweepOutput(NamedTuple):
    loss: torch.Tensor
    alpha: torch.Tensor
    correct: torch.Tensor
    grad_draft: Optional[torch.Tensor]
    grad_weight: Optional[torch.Tensor]


def _sweep(draft_hidden, weight, target_hidden, token_weights, plan: _Plan, draft_grad, weight_grad):
    """One pass over all chunks: loss and alpha, plus gradients when asked for."""
    G, s, b, h = draft_hidden.shape
    device = draft_hidden.device
    alpha = torch.zeros(G, s, b, dtype=torch.float32, device=device)
    correct = torch.zeros(G, s, b, dtype=torch.bool, device=device)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    grad_draft = torch.zeros_like(draft_hidden) if draft_grad else None
    # fp32 accumulation across chunks (the weight gradient sums every token of the batch). The
    # first product overwrites it: zero-filling [V/tp, h] first would be one more full pass.
    grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=device) if weight_grad else None
    weight_grad_started = False
    want_grad = draft_grad or weight_grad
    labels = plan.labels
    vocab_start, vocab_stop = vocab_range(weight.shape[0], plan.tp_group)
    scratch = Scratch()  # the chunk's inputs and logits, reused by every chunk
    grad_in_overlap = want_grad and plan.loss_type == 'tv' and group_size(plan.tp_group) == 1

    ops = None
    for seg in plan.segments:
        for start in range(seg.start, seg.stop, plan.positions_per_chunk):
            stop = min(start + plan.positions_per_chunk, seg.stop)
            rows = slice(start, stop)
            n = (stop - start) * b
            # One projection per chunk: target rows t+1 .. t+chunk+G-1 (shared by every depth),
            # then each depth's draft rows, into one [m, V/tp] fp32 buffer.
            target_rows = _virtual_rows(target_hidden, seg, start + 1, stop + G).reshape(-1, h)
            n_t = target_rows.shape[0]
            inputs = torch.cat(
                [target_rows] + [draft_hidden[k, rows].reshape(n, h) for k in range(G)],
                out=scratch.take('inputs', (n_t + G * n, h), weight.dtype, device),
            )
            raw = _project(inputs, weight, scratch.take('logits', (inputs.shape[0], weight.shape[0]), torch.float32, device))
            # Row ops overwrite their input; with a logits function, raw stays intact for its chain rule.
            z = plan.logits_fn(raw).float() if plan.logits_fn is not None else raw
            if ops is None:
                ops, _ = select_row_ops(z)
            draft_rows = [slice(n_t + k * n, n_t + (k + 1) * n) for k in range(G)]
            if labels is not None:
                chunk_labels = labels[:, rows].reshape(G, n)
                hits = [_label_logit(z[draft_rows[k]], chunk_labels[k], vocab_start, vocab_stop) for k in range(G)]

            # Collective 1: the normalisers of the target rows and of every depth's rows.
            probs, global_max = ops.normalise_(z, plan.tp_group)
            # Depth k at position t compares with target row t+k+1: target rows k*b .. k*b+n.
            pairs = [(ops.rows(probs, k * b, k * b + n), ops.rows(probs, r.start, r.stop)) for k, r in enumerate(draft_rows)]

            # Collective 2: overlap, the gradient's dot product and greedy hits of every depth.
            # Per-depth 'tv' on one shard knows each row's gradient coefficient (its weight) and
            # full dot product here, so the gradient is formed in the same pass.
            early_coef = token_weights[:, rows].reshape(G, n) if grad_in_overlap else None
            sums = []
            for k, (p, q) in enumerate(pairs):
                overlap, dot = ops.overlap(p, q, early_coef[k] if grad_in_overlap else None)
                if labels is not None:
                    chunk_hits = (hits[k] >= global_max[draft_rows[k]]).float()
                else:
                    chunk_hits = torch.zeros_like(overlap)
                sums.append(torch.stack([overlap, dot, chunk_hits]))
            chunk_alpha, dots, chunk_hits = all_reduce_sum_(torch.stack(sums, dim=1), plan.tp_group)
            alpha[:, rows] = chunk_alpha.view(G, stop - start, b)
            if labels is not None:
                correct[:, rows] = (chunk_hits > 0).view(G, stop - start, b)

            coef, chunk_loss = _objective(chunk_alpha, token_weights, rows, plan.loss_type, b)
            loss += chunk_loss
            if not want_grad:
                continue
            for k, (p, q) in enumerate(pairs):
                g = ops.written_grad(q) if grad_in_overlap else ops.grad_(p, q, dots[k], coef[k])
                if plan.logits_fn is not None:  # chain rule through the logit scaling function
                    with torch.enable_grad():
                        leaf = raw[draft_rows[k]].detach().requires_grad_()
                        (g,) = torch.autograd.grad(plan.logits_fn(leaf).float(), leaf, g)
                g = g.to(weight.dtype)  # bf16 weights: bf16 products, fp32 accumulation
                if grad_draft is not None:
                    _matmul_into(grad_draft[k, rows].view(n, h), g, weight)
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, g, inputs[draft_rows[k]], weight_grad_started)
                    weight_grad_started = True
    if grad_weight is not None and not weight_grad_started:
        grad_weight.zero_()
    return _SweepOutput(loss, alpha, correct, grad_draft, grad_weight)


def _objective(alpha: torch.Tensor, token_weights, rows: slice, loss_type: str, b: int):
    """Loss of one chunk and ``coef = -dL/dalpha`` per depth and row.

    Args:
        alpha: ``[G, n]`` acceptance probabilities of the chunk's rows.
    """
    G = alpha.shape[0]
    if loss_type == 'tv':
        w = token_weights[:, rows].reshape(G, -1)
        return w, (w * (1.0 - alpha)).sum()
    w = token_weights[rows].reshape(-1)
    # prefix[i] = prod_{k<i} alpha_k ; suffix[i] = 1 + sum_{j>i} prod_{i<k<=j} alpha_k.
    # dL/dalpha_i = -(w/G) * prefix[i] * suffix[i]: no division by alpha, so alpha = 0 is safe.
    ones = torch.ones_like(alpha[:1])
    prefix = torch.cat([ones, alpha[:-1]]).cumprod(0)
    suffix = [torch.ones_like(alpha[0])]
    for i in range(G - 1, 0, -1):
        suffix.append(1.0 + alpha[i] * suffix[-1])
    suffix = torch.stack(suffix[::-1])
    accepted = (prefix * alpha).sum(0)  # sum_j prod_{i<=j} alpha_i
    coef = (w / G) * prefix * suffix
    return coef, (w * (1.0 - accepted / G)).sum()


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``sum_j prod_{i<=j} alpha_i`` over the leading (depth) dimension of ``alpha``."""
    return alpha.cumprod(0).sum(0)


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


def _project(inputs, weight, out):
    """``out = inputs @ weight^T`` in fp32 (``out`` is ``[m, V/tp]`` fp32)."""
    if inputs.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.mm(inputs, weight.t(), out=out)
    return out.copy_(inputs @ weight.t())


def _matmul_into(out, g, weight):
    """``out = g @ weight`` (``g``: ``[n, V/tp]`` logit gradient in the weight's dtype)."""
    if out.dtype == g.dtype:
        torch.mm(g, weight, out=out)
    else:
        out.copy_(g @ weight)


def _label_logit(z, labels, vocab_start, vocab_stop):
    """Logit of each row's label when it lies in this rank's shard, else -inf."""
    local = labels - vocab_start
    in_shard = (labels >= vocab_start) & (labels < vocab_stop)
    picked = z.detach().gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(in_shard, picked, torch.full_like(picked, float('-inf')))


def _accumulate_weight_grad(grad_weight, g, x, accumulate: bool):
    """``grad_weight (+)= g^T x``: overwrite on the first chunk, accumulate in fp32 after."""
    if g.dtype == torch.float32:
        grad_weight.addmm_(g.t(), x.float(), beta=1.0 if accumulate else 0.0)
    elif accumulate:  # low-precision product, fp32 accumulation across chunks
        grad_weight.add_(g.t() @ x)
    else:
        grad_weight.copy_(g.t() @ x)
