"""The chunked sweep: one pass over the tokens that every draft loss of this package runs.

Per chunk of positions (see :mod:`.linear_tv` for the math, the memory and the collectives):

1. a **target source** writes the fp32 logits of the chunk's target rows ``t+1 .. t+chunk+G-1``
   (shared by every depth) and of every depth's draft rows into one ``[m, V/tp]`` buffer:
   :class:`OwnProjection` projects the target's hidden states with the draft rows,
   :class:`MainLogits` reads the main head's logits and projects the draft rows alone,
   :class:`NoTarget` (cross-entropy against the labels, without metrics) has no target rows;
2. the row ops (:mod:`.row_ops`) normalise every row (collective 1) and reduce each depth's
   draft rows against their target rows to the per-row sums the loss asks for, and the label's
   logit where the loss or the metrics read it (collective 2);
3. the loss (:class:`~.losses.DraftLoss`) turns the sums into the chunk's objective and its
   logit-gradient coefficients; the row ops write the logit gradient over the draft rows;
4. a **gradient sink** takes it: :class:`DenseGradients` turns it into the fp32 hidden-state and
   weight gradients, :class:`StoredLogitGradients` keeps it for backward; without gradients
   (evaluation, metrics) there is no sink and no gradient work.

The loop has no per-loss, per-source or per-sink branch. No Megatron imports.
"""

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from .losses import DraftLoss
from .options import MTPLossOptions
from .products import Products
from .row_ops import row_ops_for
from .scratch import Scratch
from .vocab_parallel import ProcessGroup, all_reduce_sum_, group_size, vocab_range


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


@dataclass(frozen=True)
class SweepPlan:
    """One call's sweep, fixed for all its chunks: the caller's options, its non-differentiable
    inputs and what :func:`~.linear_tv.linear_tv_loss` derived from their shapes."""

    options: MTPLossOptions
    """The loss, temperature, row kernels and metrics (validated when built)."""
    positions_per_chunk: int
    """Sequence positions per chunk (from ``options.chunk_size`` or the automatic chunk)."""
    tp_group: ProcessGroup
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    segments: tuple
    labels: Optional[torch.Tensor]
    """``[G, s, b]`` token ids: the greedy-accuracy counts' and a label loss's, or None."""
    target_is_logits: bool = False
    """The target is the main head's ``[s, b, V/tp]`` logits (else ``[s, b, h]`` hidden states,
    or None: no target rows)."""


class SweepOutput(NamedTuple):
    loss: torch.Tensor
    alpha: Optional[torch.Tensor]
    """None without target rows."""
    correct: torch.Tensor
    per_depth: torch.Tensor
    agreement: torch.Tensor
    grad_scale: torch.Tensor
    """Factor the sink's gradients carry (a power of two for bf16/fp16 weights, else 1)."""


class Chunk(NamedTuple):
    """Positions ``start .. stop-1`` of ``segment``, each with ``b`` tokens."""

    segment: TargetSegment
    start: int
    stop: int
    b: int
    depths: int
    with_target: bool = True

    @property
    def positions(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def tokens(self) -> int:
        """Draft rows per depth."""
        return (self.stop - self.start) * self.b

    @property
    def target_rows(self) -> int:
        """Target rows ``t+1 .. t+chunk+G-1``, shared by every depth (none without a target)."""
        return (self.stop - self.start + self.depths - 1) * self.b if self.with_target else 0

    def draft_rows(self, k: int) -> slice:
        """Depth k's draft rows in the chunk's logits buffer (after the target rows)."""
        return slice(self.target_rows + k * self.tokens, self.target_rows + (k + 1) * self.tokens)

    def target_of(self, k: int) -> slice:
        """The target rows depth k is compared with: position t against target row t+k+1."""
        return slice(k * self.b, k * self.b + self.tokens)


def chunks(segments: Sequence[TargetSegment], positions_per_chunk: int, b: int, depths: int,
           with_target: bool = True):
    """The chunks of every segment, in order (every TP rank walks the same ones)."""
    for seg in segments:
        for start in range(seg.start, seg.stop, positions_per_chunk):
            yield Chunk(seg, start, min(start + positions_per_chunk, seg.stop), b, depths, with_target)


# ------------------------------------------------------------------------------------------------
# Target sources: the chunk's logits, target rows first.
# ------------------------------------------------------------------------------------------------
class OwnProjection:
    """Target rows projected from the main hidden states together with the draft rows: one
    ``[target + G * tokens, h] x [h, V/tp]`` product per chunk."""

    has_target = True

    def __init__(self, target_hidden: torch.Tensor):
        self.hidden = target_hidden  # [s, b, h]

    def logits(self, chunk: Chunk, drafts: List[torch.Tensor], products: Products,
               scratch: Scratch, out: torch.Tensor):
        """Write the chunk's logits into ``out``; return ``(draft inputs, None)``."""
        n_t = chunk.target_rows
        target_rows = _virtual_rows(self.hidden, chunk.segment, chunk.start + 1, chunk.stop + chunk.depths)
        rows = torch.cat(
            [target_rows.reshape(n_t, -1)] + drafts,
            out=scratch.take('inputs', (out.shape[0], drafts[0].shape[1]), products.weight.dtype, out.device),
        )
        products.logits(rows, out)
        return rows[n_t:], None


class MainLogits:
    """Target rows read from the main head's ``[s, b, V/tp]`` logits; the draft rows projected
    alone (and the context-parallel halo rows, which live on another rank).

    ``read_in_place``: the row ops' softmax reads the target rows where they are instead of a
    copy in the chunk buffer (fp32 logits used as they are: no logit function, ``T = 1``).
    """

    has_target = True

    def __init__(self, target_logits: torch.Tensor, read_in_place: bool):
        self.main = target_logits
        self.read_in_place = read_in_place

    def logits(self, chunk: Chunk, drafts: List[torch.Tensor], products: Products,
               scratch: Scratch, out: torch.Tensor):
        """Write the chunk's logits into ``out``; return ``(draft inputs, target rows the softmax
        reads in place of ``out``'s first rows, or None)``."""
        n_t = chunk.target_rows
        inputs = torch.cat(
            drafts,
            out=scratch.take('inputs', (out.shape[0] - n_t, drafts[0].shape[1]), products.weight.dtype, out.device),
        )
        products.logits(inputs, out[n_t:])
        source = _target_logit_rows(
            self.main, chunk.segment, chunk.start + 1, chunk.stop + chunk.depths, products, out[:n_t],
            self.read_in_place,
        )
        return inputs, source


class NoTarget:
    """No target rows: the draft rows projected alone (a loss against the data labels)."""

    has_target = False

    def logits(self, chunk: Chunk, drafts: List[torch.Tensor], products: Products,
               scratch: Scratch, out: torch.Tensor):
        """Write the chunk's draft logits into ``out``; return ``(draft inputs, None)``."""
        inputs = torch.cat(
            drafts, out=scratch.take('inputs', (out.shape[0], drafts[0].shape[1]), products.weight.dtype, out.device),
        )
        products.logits(inputs, out)
        return inputs, None


def target_source(target: Optional[torch.Tensor], plan: SweepPlan):
    """The :class:`OwnProjection`, :class:`MainLogits` or :class:`NoTarget` of ``target``."""
    if target is None:
        return NoTarget()
    if not plan.target_is_logits:
        return OwnProjection(target)
    read_in_place = (
        plan.logits_fn is None and plan.options.inv_temperature == 1.0
        and target.dtype == torch.float32
    )
    return MainLogits(target, read_in_place)


# ------------------------------------------------------------------------------------------------
# Gradient sinks: what becomes of each chunk's logit gradient.
# ------------------------------------------------------------------------------------------------
class DenseGradients:
    """The fp32 hidden-state gradient ``[G, s, b, h]`` and weight gradient ``[V/tp, h]``, formed
    chunk by chunk (the weight gradient accumulates every token of the batch in fp32)."""

    def __init__(self, draft_hidden: torch.Tensor, weight: torch.Tensor, segments, draft_grad: bool,
                 weight_grad: bool):
        device = draft_hidden.device
        self.draft = (
            _new_rows_buffer(draft_hidden.shape, torch.float32, device, segments, draft_hidden.shape[1])
            if draft_grad else None
        )
        # The first product overwrites it: zero-filling [V/tp, h] first would be one more pass.
        self.weight = torch.empty(weight.shape, dtype=torch.float32, device=device) if weight_grad else None
        self._weight_started = False

    def add(self, chunk: Chunk, g: torch.Tensor, inputs: torch.Tensor, products: Products,
            scratch: Scratch) -> None:
        """``g``: ``[G * tokens, V/tp]`` fp32 logit gradients of the chunk; ``inputs`` the draft rows."""
        n, G = chunk.tokens, chunk.depths
        # fp32 weights: all depths in one product each, so the [V/tp, h] weight gradient is read
        # and written once per chunk, not G times. Other dtypes go depth by depth: all depths at
        # once would need a [G*n, V/tp] copy in the weight's dtype.
        blocks = [slice(0, G)] if products.native else [slice(k, k + 1) for k in range(G)]
        for depths in blocks:
            rows = slice(depths.start * n, depths.stop * n)
            g_k = g[rows].to(products.weight.dtype)  # bf16/fp16: low-precision operands, fp32 sums
            if self.draft is not None:
                _input_grad_into(products, g_k, self.draft[depths, chunk.positions], scratch)
            if self.weight is not None:
                products.weight_grad(self.weight, g_k, inputs[rows], self._weight_started)
                self._weight_started = True

    def finish(self) -> None:
        if self.weight is not None and not self._weight_started:  # no chunk at all
            self.weight.zero_()


class StoredLogitGradients:
    """The ``[G, s, b, V/tp]`` logit gradients in the weight's dtype, for backward's two products."""

    def __init__(self, draft_hidden: torch.Tensor, weight: torch.Tensor, segments):
        G, s, b, _ = draft_hidden.shape
        self.logit_grads = _new_rows_buffer(
            (G, s, b, weight.shape[0]), weight.dtype, draft_hidden.device, segments, s
        )

    def add(self, chunk: Chunk, g, inputs, products, scratch) -> None:
        # rounded to the weight's dtype as it is stored
        self.logit_grads[:, chunk.positions].copy_(g.reshape(chunk.depths, chunk.stop - chunk.start, chunk.b, -1))

    def finish(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------
def sweep(draft_hidden, weight, target, token_weights, plan: SweepPlan, sink=None) -> SweepOutput:
    """One pass over all chunks: the loss and per-row results, and each chunk's logit gradient
    handed to ``sink`` (:class:`DenseGradients` or :class:`StoredLogitGradients`; None: no
    gradient work).

    ``target`` is ``[s, b, h]`` hidden states, ``[s, b, V/tp]`` logits when
    ``plan.target_is_logits``, or None (no target rows: a loss against the labels, no
    overlaps); ``token_weights`` ``[G, s, b]`` (``[s, b]`` for a per-chain loss).
    """
    G, s, b, h = draft_hidden.shape
    options, device = plan.options, draft_hidden.device
    loss_fn, inv_temperature = options.loss, options.inv_temperature
    source = target_source(target, plan)
    out = _Results(G, s, b, device, source.has_target)
    products, scratch, ops = Products(weight), Scratch(), None
    # dL/dz of every row is at most grad_bound * its weight / T (each loss states grad_bound);
    # the sink's gradients carry grad_scale.
    grad_scale = products.gradient_scale(token_weights, loss_fn.grad_bound * inv_temperature)
    coef_scale = grad_scale * inv_temperature
    vocab = vocab_range(weight.shape[0], plan.tp_group)
    # Row-local losses on one shard know each row's coefficients as soon as its sums are done,
    # so the gradient is written in the same pass.
    one_pass_grad = sink is not None and loss_fn.row_local and group_size(plan.tp_group) == 1
    want_dot = sink is not None and loss_fn.tv_grad

    for chunk in chunks(plan.segments, plan.positions_per_chunk, b, G, source.has_target):
        n = chunk.tokens
        raw = scratch.take('logits', (chunk.target_rows + G * n, weight.shape[0]), torch.float32, device)
        drafts = [draft_hidden[k, chunk.positions].reshape(n, h) for k in range(G)]
        inputs, in_place_rows = source.logits(chunk, drafts, products, scratch, raw)
        z = _scaled_logits(raw, plan)  # row ops overwrite it; raw stays for the chain rule
        ops = ops or row_ops_for(z, options.kernels)[0]
        label_logits = _label_logits(z, chunk, plan.labels, vocab) if plan.labels is not None else None

        # Collective 1: the normalisers (and argmax) of the target rows and every depth's rows.
        probs, stats = ops.normalise_(z, plan.tp_group, vocab[0] if options.metrics else None, source=in_place_rows)
        pairs = [(ops.rows(probs, t.start, t.stop), ops.rows(probs, r.start, r.stop))
                 for t, r in ((chunk.target_of(k), chunk.draft_rows(k)) for k in range(G))
                 if source.has_target]
        w = token_weights[chunk.positions].reshape(n) if loss_fn.per_chain else token_weights[:, chunk.positions].reshape(G, n)

        # Collective 2: every depth's overlap and, as needed, dot product, KL and label logits.
        sums = [
            ops.pair_sums(p, q, dot=want_dot, kl=loss_fn.needs_kl,
                          coefficients=_row_coefficients(loss_fn, w[k], coef_scale) if one_pass_grad else None)
            for k, (p, q) in enumerate(pairs)
        ]
        row = _reduce(sums, label_logits, stats, chunk, want_dot, loss_fn.needs_kl, plan.tp_group)
        terms = loss_fn.terms(row.alpha, row.kl, w, row.nll)
        out.record(chunk, row, terms, stats if options.metrics else None)
        if sink is None:
            continue
        if not one_pass_grad:
            _write_grad(ops, pairs, terms, row.dot, coef_scale)
        if terms.label_coef is not None:
            for k in range(G):
                draft = chunk.draft_rows(k)
                ops.label_grad_(ops.rows(probs, draft.start, draft.stop), label_logits.local_index[k],
                                terms.label_coef[k] * coef_scale)
        # Every depth's logit gradient now lies over its draft rows: one [G*n, V/tp] block.
        g = ops.written_grad(ops.rows(probs, chunk.target_rows, chunk.target_rows + G * n))
        if plan.logits_fn is not None:
            _chain_rule_(g, raw, chunk, plan.logits_fn)
        sink.add(chunk, g, inputs, products, scratch)
    if sink is not None:
        sink.finish()
    return SweepOutput(out.loss, out.alpha, out.correct, out.per_depth, out.agreement, grad_scale)


def _write_grad(ops, pairs, terms, dot, coef_scale) -> None:
    """Each depth's TV and KL logit gradient over its draft rows, once its sums are reduced over
    the vocabulary (the coefficients need the whole row)."""
    if terms.tv_coef is None and terms.kl_coef is None:
        return
    for k, (p, q) in enumerate(pairs):
        tv_coef, kl_coef = (c[k] * coef_scale if c is not None else None
                            for c in (terms.tv_coef, terms.kl_coef))
        ops.grad_(p, q, dot[k] if dot is not None else None, tv_coef, kl_coef)


class _RowSums(NamedTuple):
    """A chunk's per-row sums over the full vocabulary, ``[G, tokens]`` each."""

    alpha: Optional[torch.Tensor]
    dot: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    hits: Optional[torch.Tensor]
    nll: Optional[torch.Tensor]
    """``log sum_v exp(z_v) - z_y``, when labels are given."""


class _Results:
    """The sweep's per-row outputs, ``[G, s, b]``, and its loss, filled chunk by chunk."""

    def __init__(self, G, s, b, device, with_alpha: bool):
        self.alpha = torch.zeros(G, s, b, dtype=torch.float32, device=device) if with_alpha else None
        self.per_depth = torch.zeros(G, s, b, dtype=torch.float32, device=device)
        self.correct = torch.zeros(G, s, b, dtype=torch.bool, device=device)
        self.agreement = torch.zeros(G, s, b, dtype=torch.bool, device=device)
        self.loss = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, chunk: Chunk, row: _RowSums, terms, stats) -> None:
        shape = (chunk.depths, chunk.stop - chunk.start, chunk.b)
        rows = chunk.positions
        if self.alpha is not None:
            self.alpha[:, rows] = row.alpha.view(shape)
        if row.hits is not None:
            self.correct[:, rows] = (row.hits > 0).view(shape)
        if stats is not None and chunk.with_target:
            agree = torch.stack([
                stats.argmax[chunk.target_of(k)] == stats.argmax[chunk.draft_rows(k)] for k in range(chunk.depths)
            ])
            self.agreement[:, rows] = agree.view(shape)
        self.loss += terms.loss
        self.per_depth[:, rows] = terms.per_depth.view(shape)


def _reduce(sums, label_logits, stats, chunk: Chunk, want_dot: bool, want_kl: bool, group) -> _RowSums:
    """All-reduce this shard's per-row sums (one collective for every depth and sum)."""
    columns = []
    if sums:
        columns.append(torch.stack([x.overlap for x in sums]))
        if want_dot:
            columns.append(torch.stack([x.dot for x in sums]))
        if want_kl:
            columns.append(torch.stack([x.kl for x in sums]))
    if label_logits is not None:
        # The label's logit lies on exactly one shard (0 elsewhere); it is the row's max there
        # iff the label is the greedy draft.
        columns.append(torch.stack([
            ((label_logits.value[k] >= stats.max[chunk.draft_rows(k)]) & (label_logits.local_index[k] >= 0)).float()
            for k in range(chunk.depths)
        ]))
        columns.append(label_logits.value)
    reduced = list(all_reduce_sum_(torch.stack(columns), group))  # [c, G, n]
    alpha = reduced.pop(0) if sums else None
    dot = reduced.pop(0) if sums and want_dot else None
    kl = reduced.pop(0) if sums and want_kl else None
    hits = nll = None
    if label_logits is not None:
        hits, label_logit = reduced
        lse = torch.stack([stats.lse[chunk.draft_rows(k)] for k in range(chunk.depths)])
        nll = lse - label_logit
    return _RowSums(alpha, dot, kl, hits, nll)


def _row_coefficients(loss_fn: DraftLoss, w: torch.Tensor, scale: torch.Tensor):
    """The one-pass gradient's ``(rows, overlap) -> (tv_coef, kl_coef)`` of one depth."""
    def coefficients(block, overlap):
        return tuple(c * scale if c is not None else None for c in loss_fn.row_coefficients(overlap, w[block]))
    return coefficients


def _scaled_logits(raw: torch.Tensor, plan: SweepPlan) -> torch.Tensor:
    """``f(raw) / T``: in place of ``raw`` without a logit function, else in a new tensor."""
    z = plan.logits_fn(raw).float() if plan.logits_fn is not None else raw
    inv_temperature = plan.options.inv_temperature
    if inv_temperature != 1.0:
        z = z.mul_(inv_temperature)
    return z


def _chain_rule_(g: torch.Tensor, raw: torch.Tensor, chunk: Chunk, logits_fn) -> None:
    """``g`` (w.r.t. ``f(raw)``) becomes the gradient w.r.t. ``raw``, depth by depth, written
    back over itself: its temporaries stay ``[tokens, V/tp]``."""
    n = chunk.tokens
    for k in range(chunk.depths):
        with torch.enable_grad():
            leaf = raw[chunk.draft_rows(k)].detach().requires_grad_()
            (chained,) = torch.autograd.grad(logits_fn(leaf).float(), leaf, g[k * n : (k + 1) * n])
        g[k * n : (k + 1) * n].copy_(chained)


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


class _LabelLogits(NamedTuple):
    """Each depth's draft logit at its label, on this shard: ``[G, tokens]`` each."""

    value: torch.Tensor
    """The logit where the label lies in this shard, else 0 (summed over shards: the logit)."""
    local_index: torch.Tensor
    """int64 index of the label into this shard, -1 where it lies elsewhere (or is no token)."""


def _label_logits(z: torch.Tensor, chunk: Chunk, labels: torch.Tensor, vocab) -> _LabelLogits:
    """Read before the row ops overwrite ``z``: a label outside ``[0, V)`` (padding, an ignore
    index) lies on no shard, and its logit counts as 0, as in Megatron's vocab-parallel
    cross-entropy."""
    start, stop = vocab
    chunk_labels = labels[:, chunk.positions].reshape(chunk.depths, chunk.tokens)
    in_shard = (chunk_labels >= start) & (chunk_labels < stop)
    local = torch.where(in_shard, chunk_labels - start, torch.full_like(chunk_labels, -1))
    picked = torch.stack([
        z[chunk.draft_rows(k)].detach().gather(1, local[k].clamp(min=0).unsqueeze(1)).squeeze(1)
        for k in range(chunk.depths)
    ])
    return _LabelLogits(torch.where(in_shard, picked, torch.zeros_like(picked)), local)
