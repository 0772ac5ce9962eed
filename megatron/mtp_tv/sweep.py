# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The chunked sweep every draft loss runs: chunk logits, row passes, loss, gradient sink."""

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional

import torch

from .alignment import RowLayout
from .config import MTPLossOptions
from .losses import DraftLoss
from .products import Products
from .row_ops import Scratch, row_ops_for
from .vocab_parallel import ProcessGroup, all_reduce_sum_, group_size, vocab_range


@dataclass(frozen=True)
class SweepPlan:
    """What one sweep computes and how: the loss options, rows per chunk, the vocabulary's tensor-
    parallel group, the logits hook, the row layout and the labels ``[G, s, b]``."""

    options: MTPLossOptions
    rows_per_chunk: int
    tp_group: ProcessGroup
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    layout: RowLayout
    labels: Optional[torch.Tensor]  # [G, s, b]
    target_is_logits: bool = False


class TVLossResult(NamedTuple):
    """Scalar loss; detached ``[G, s, b]`` alpha, argmax == label, objective, argmax == p's."""

    loss: torch.Tensor
    alpha: Optional[torch.Tensor]
    greedy_correct: Optional[torch.Tensor]
    per_depth: Optional[torch.Tensor] = None
    greedy_agreement: Optional[torch.Tensor] = None


class Chunk(NamedTuple):
    """Rows ``start .. stop-1`` of the layout, each with ``b`` tokens."""

    layout: RowLayout
    start: int
    stop: int
    b: int
    depths: int
    with_target: bool = True

    @property
    def span(self) -> slice:
        """The chunk's rows, as a slice of the layout."""
        return slice(self.start, self.stop)

    @property
    def tokens(self) -> int:
        """Tokens per depth in the chunk (rows times batch)."""
        return (self.stop - self.start) * self.b

    @property
    def target_rows(self) -> int:
        """Target rows ``t+1 .. t+chunk+G-1``, shared by every depth (none without a target)."""
        return (self.stop - self.start + self.depths - 1) * self.b if self.with_target else 0

    def draft_rows(self, k: int) -> slice:
        """Depth ``k``'s rows in the chunk's stacked ``[target ++ drafts]`` inputs."""
        return slice(self.target_rows + k * self.tokens, self.target_rows + (k + 1) * self.tokens)

    def target_of(self, k: int) -> slice:
        """Depth k's target rows: row t against target row t+k+1."""
        return slice(k * self.b, k * self.b + self.tokens)

    def drafts(self, hidden: torch.Tensor) -> List[torch.Tensor]:
        """One depth's ``[s, b, h]`` draft states of these rows, ``[rows * b, h]`` pieces."""
        return [_positions(hidden, run) for run in self.layout.runs(self.start, self.stop)]

    def target_runs(self):
        """The :class:`~.alignment.Run` pieces of the chunk's target rows."""
        return self.layout.runs(self.start + 1, self.stop + self.depths, targets=True)


def _positions(x: torch.Tensor, run) -> torch.Tensor:
    """``x``'s ``[s, b, ...]`` rows of ``run`` as ``[rows * b, ...]`` (zeros where none)."""
    n = run.hi - run.lo
    rows = (
        x[run.position : run.position + n]
        if run.position is not None
        else x.new_zeros((n,) + x.shape[1:])
    )
    return rows.reshape((n * x.shape[1],) + tuple(x.shape[2:]))


def chunks(layout: RowLayout, rows_per_chunk: int, b: int, depths: int, with_target: bool = True):
    """The layout's chunks in order (every TP rank walks the same ones)."""
    for start in range(0, layout.count, rows_per_chunk):
        yield Chunk(
            layout, start, min(start + rows_per_chunk, layout.count), b, depths, with_target
        )


def _chunk_logits(
    target,
    plan: SweepPlan,
    chunk: Chunk,
    drafts: List[torch.Tensor],
    products: Products,
    scratch: Scratch,
    out: torch.Tensor,
    read_in_place: bool,
):
    """Writes the chunk's target rows' then its draft rows' logits into ``out``; returns ``(draft
    inputs [G*n, h], target rows the row ops read in place or None)``. Target rows are projected
    with the draft rows in one product (``target`` the main hidden states) or read from the main
    head's ``[s, b, V/tp]`` logits (``plan.target_is_logits``; ``read_in_place``: a first run of
    them is left for the row ops to read)."""
    n_t, h = chunk.target_rows, drafts[0].shape[1]
    own_projection = target is not None and not plan.target_is_logits
    pieces = (
        [_target_hidden_rows(target, run) for run in chunk.target_runs()] if own_projection else []
    )
    first = 0 if own_projection else n_t  # the first row of out this product writes
    rows = torch.cat(
        pieces + drafts,
        out=scratch.take('inputs', (out.shape[0] - first, h), products.weight.dtype, out.device),
    )
    products.logits(rows, out[first:])
    inputs = rows[n_t - first :]
    if own_projection or target is None:
        return inputs, None
    return inputs, _target_logit_rows(target, chunk, products, scratch, out[:n_t], read_in_place)


class DenseGradients:
    """Gradient sink: fp32 ``[G, s, b, h]`` and ``[V/tp, h]`` gradients, formed chunk by chunk."""

    def __init__(
        self,
        draft_hidden: torch.Tensor,
        weight: torch.Tensor,
        layout: RowLayout,
        draft_grad: bool,
        weight_grad: bool,
    ):
        self.draft = (
            _new_rows_buffer(draft_hidden.shape, torch.float32, draft_hidden.device, layout)
            if draft_grad
            else None
        )
        # The first product overwrites it: zero-filling [V/tp, h] first would be one more pass.
        self.weight = (
            torch.empty(weight.shape, dtype=torch.float32, device=draft_hidden.device)
            if weight_grad
            else None
        )
        self._weight_started = False

    def add(
        self,
        chunk: Chunk,
        g: torch.Tensor,
        inputs: torch.Tensor,
        products: Products,
        scratch: Scratch,
    ) -> None:
        """Adds the chunk's logit gradient ``g``, projected, into the draft states' and the
        weight's gradients."""
        n, G = chunk.tokens, chunk.depths
        # fp32: all depths in one product; others depth by depth (no [G*n, V/tp] cast copy).
        blocks = [slice(0, G)] if products.native else [slice(k, k + 1) for k in range(G)]
        for depths in blocks:
            rows = slice(depths.start * n, depths.stop * n)
            g_k = g[rows].to(products.weight.dtype)  # bf16/fp16: low-precision operands, fp32 sums
            if self.draft is not None:
                _input_grad_into(products, g_k, self.draft[depths], chunk, scratch)
            if self.weight is not None:
                products.weight_grad(self.weight, g_k, inputs[rows], self._weight_started)
                self._weight_started = True

    def finish(self) -> None:
        """Zeroes the weight gradient if no chunk reached it."""
        if self.weight is not None and not self._weight_started:  # no chunk at all
            self.weight.zero_()


class StoredLogitGradients:
    """Gradient sink: ``[G, s, b, V/tp]`` logit gradients in the weight's dtype."""

    def __init__(self, draft_hidden: torch.Tensor, weight: torch.Tensor, layout: RowLayout):
        G, s, b, _ = draft_hidden.shape
        self.logit_grads = _new_rows_buffer(
            (G, s, b, weight.shape[0]), weight.dtype, draft_hidden.device, layout
        )

    def add(self, chunk: Chunk, g, inputs, products, scratch) -> None:
        """Stores the chunk's logit gradient at its rows."""
        rows = g.reshape(chunk.depths, chunk.stop - chunk.start, chunk.b, -1)
        chunk.layout.scatter(self.logit_grads, rows, chunk.start, dim=1)

    def finish(self) -> None:
        """Nothing to finish: every chunk's gradient is stored."""
        pass


def sweep(draft_hidden, weight, target, token_weights, plan: SweepPlan, sink=None):
    """One pass over all chunks, each chunk's logit gradient handed to ``sink`` (if any; its owner
    finishes it); returns ``(TVLossResult, the factor the sink's gradients carry)``."""
    G, s, b, h = draft_hidden.shape
    options, device, layout = plan.options, draft_hidden.device, plan.layout
    loss_fn, inv_temperature = options.loss, options.inv_temperature
    has_target = target is not None
    # Target logits the row ops would only copy are read in place: fp32, no logit function or T.
    read_in_place = (
        has_target
        and plan.target_is_logits
        and plan.logits_fn is None
        and inv_temperature == 1.0
        and target.dtype == torch.float32
    )
    out = _Results(G, layout.count, b, device, has_target)
    # Per-token tensors in the layout's rows: weight 0 (and no label) where a row has no draft.
    token_weights = layout.to_rows(token_weights, dim=token_weights.dim() - 2)
    labels = layout.to_rows(plan.labels, dim=1, fill=-1) if plan.labels is not None else None
    products, scratch, ops = Products(weight), Scratch(), None
    # |dL/dz| <= grad_bound * w / T per row; the sink's gradients carry grad_scale.
    grad_scale = products.gradient_scale(token_weights, loss_fn.grad_bound * inv_temperature)
    coef_scale = grad_scale * inv_temperature
    vocab = vocab_range(weight.shape[0], plan.tp_group)
    # One shard, row-local loss: a row's coefficients are known in its sums' pass.
    one_pass_grad = sink is not None and loss_fn.row_local and group_size(plan.tp_group) == 1
    want_dot = sink is not None and loss_fn.tv_grad

    for chunk in chunks(layout, plan.rows_per_chunk, b, G, has_target):
        n = chunk.tokens
        raw = scratch.take(
            'logits', (chunk.target_rows + G * n, weight.shape[0]), torch.float32, device
        )
        drafts = [piece for k in range(G) for piece in chunk.drafts(draft_hidden[k])]
        inputs, in_place_rows = _chunk_logits(
            target, plan, chunk, drafts, products, scratch, raw, read_in_place
        )
        z = _scaled_logits(raw, plan)  # row ops overwrite it; raw stays for the chain rule
        ops = ops or row_ops_for(z, options.kernels)
        label_logits = _label_logits(z, chunk, labels, vocab) if labels is not None else None

        # Collective 1: the normalisers (and argmax) of the target rows and every depth's rows.
        probs, stats = ops.normalise_(
            z, plan.tp_group, vocab[0] if options.metrics else None, source=in_place_rows
        )
        pairs = [
            (ops.rows(probs, t.start, t.stop), ops.rows(probs, r.start, r.stop))
            for t, r in ((chunk.target_of(k), chunk.draft_rows(k)) for k in range(G))
            if has_target
        ]
        w = (
            token_weights[chunk.span].reshape(n)
            if loss_fn.per_chain
            else token_weights[:, chunk.span].reshape(G, n)
        )

        # Collective 2: every depth's overlap and, as needed, dot product, KL and label logits.
        sums = [
            ops.pair_sums(
                p,
                q,
                dot=want_dot,
                kl=loss_fn.needs_kl,
                coefficients=(
                    _row_coefficients(loss_fn, w[k], coef_scale) if one_pass_grad else None
                ),
            )
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
            _write_label_grad(ops, probs, chunk, label_logits, terms.label_coef * coef_scale)
        g = ops.written_grad(ops.rows(probs, chunk.target_rows, chunk.target_rows + G * n))
        if plan.logits_fn is not None:
            _chain_rule_(g, raw, chunk, plan.logits_fn)
        sink.add(chunk, g, inputs, products, scratch)
    return out.output(layout, plan.labels is not None, options.metrics), grad_scale


def _write_label_grad(ops, probs, chunk: Chunk, label_logits, coef: torch.Tensor) -> None:
    for k in range(chunk.depths):
        draft = chunk.draft_rows(k)
        ops.label_grad_(
            ops.rows(probs, draft.start, draft.stop), label_logits.local_index[k], coef[k]
        )


def _write_grad(ops, pairs, terms, dot, coef_scale) -> None:
    if terms.tv_coef is None and terms.kl_coef is None:
        return
    for k, (p, q) in enumerate(pairs):
        tv_coef, kl_coef = (
            c[k] * coef_scale if c is not None else None for c in (terms.tv_coef, terms.kl_coef)
        )
        ops.grad_(p, q, dot[k] if dot is not None else None, tv_coef, kl_coef)


class _RowSums(NamedTuple):
    alpha: Optional[torch.Tensor]
    dot: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    hits: Optional[torch.Tensor]
    nll: Optional[torch.Tensor]


class _Results:
    def __init__(self, G, s, b, device, with_alpha: bool):
        self.alpha = (
            torch.zeros(G, s, b, dtype=torch.float32, device=device) if with_alpha else None
        )
        self.per_depth = torch.zeros(G, s, b, dtype=torch.float32, device=device)
        self.correct = torch.zeros(G, s, b, dtype=torch.bool, device=device)
        self.agreement = torch.zeros(G, s, b, dtype=torch.bool, device=device)
        self.loss = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, chunk: Chunk, row: _RowSums, terms, stats) -> None:
        """Stores the chunk's per-token values and adds its loss."""
        shape = (chunk.depths, chunk.stop - chunk.start, chunk.b)
        rows = chunk.span
        if self.alpha is not None:
            self.alpha[:, rows] = row.alpha.view(shape)
        if row.hits is not None:
            self.correct[:, rows] = (row.hits > 0).view(shape)
        if stats is not None and chunk.with_target:
            agree = torch.stack(
                [
                    stats.argmax[chunk.target_of(k)] == stats.argmax[chunk.draft_rows(k)]
                    for k in range(chunk.depths)
                ]
            )
            self.agreement[:, rows] = agree.view(shape)
        self.loss += terms.loss
        self.per_depth[:, rows] = terms.per_depth.view(shape)

    def output(self, layout: RowLayout, with_labels: bool, metrics: bool) -> TVLossResult:
        """The per-token results at their positions."""
        alpha, correct, per_depth, agreement = (
            layout.to_positions(x, dim=1) if x is not None else None
            for x in (
                self.alpha,
                self.correct if with_labels else None,
                self.per_depth,
                self.agreement if metrics else None,
            )
        )
        return TVLossResult(self.loss, alpha, correct, per_depth, agreement)


def _reduce(
    sums, label_logits, stats, chunk: Chunk, want_dot: bool, want_kl: bool, group
) -> _RowSums:
    """All-reduce this shard's per-row sums (one collective for every depth and sum)."""
    columns = []
    if sums:
        columns.append(torch.stack([x.overlap for x in sums]))
        if want_dot:
            columns.append(torch.stack([x.dot for x in sums]))
        if want_kl:
            columns.append(torch.stack([x.kl for x in sums]))
    if label_logits is not None:
        # The label's logit (0 off its shard) is the row's max iff it is the greedy draft.
        columns.append(
            torch.stack(
                [
                    (
                        (label_logits.value[k] >= stats.max[chunk.draft_rows(k)])
                        & (label_logits.local_index[k] >= 0)
                    ).float()
                    for k in range(chunk.depths)
                ]
            )
        )
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
    def coefficients(block, overlap):
        return tuple(
            c * scale if c is not None else None
            for c in loss_fn.row_coefficients(overlap, w[block])
        )

    return coefficients


def _scaled_logits(raw: torch.Tensor, plan: SweepPlan) -> torch.Tensor:
    z = plan.logits_fn(raw).float() if plan.logits_fn is not None else raw
    inv_temperature = plan.options.inv_temperature
    if inv_temperature != 1.0:
        z = z.mul_(inv_temperature)
    return z


def _chain_rule_(g: torch.Tensor, raw: torch.Tensor, chunk: Chunk, logits_fn) -> None:
    """``g`` w.r.t. ``f(raw)`` becomes the gradient w.r.t. ``raw``, in place, depth by depth."""
    n = chunk.tokens
    for k in range(chunk.depths):
        with torch.enable_grad():
            leaf = raw[chunk.draft_rows(k)].detach().requires_grad_()
            (chained,) = torch.autograd.grad(logits_fn(leaf).float(), leaf, g[k * n : (k + 1) * n])
        g[k * n : (k + 1) * n].copy_(chained)


def _input_grad_into(
    products, g: torch.Tensor, out: torch.Tensor, chunk: Chunk, scratch: Scratch
) -> None:
    """``g @ W`` of the chunk's rows for ``out``'s depths (``[d, s, b, h]``), at their positions."""
    d, _, b, h = out.shape
    if d == 1 and chunk.layout.identity:  # rows are positions: straight into the gradient
        products.input_grad(g, out[0, chunk.span].view(g.shape[0], h))
        return
    flat = scratch.take('input_grad', (g.shape[0], h), out.dtype, out.device)
    products.input_grad(g, flat)
    chunk.layout.scatter(out, flat.view(d, chunk.stop - chunk.start, b, h), chunk.start, dim=1)


def _new_rows_buffer(shape, dtype, device, layout: RowLayout) -> torch.Tensor:
    if layout.covers_positions:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _target_hidden_rows(target_hidden: torch.Tensor, run) -> torch.Tensor:
    """A target :class:`~.alignment.Run`'s ``[rows * b, h]``: positions, halo rows or zeros."""
    if run.position is not None:
        return _positions(target_hidden, run)
    halo = run.segment.halo
    if halo is None:
        return target_hidden.new_zeros(
            ((run.hi - run.lo) * target_hidden.shape[1], target_hidden.shape[2])
        )
    return halo[run.halo_rows].to(target_hidden.dtype).reshape(-1, target_hidden.shape[2])


def _target_logit_rows(
    target_logits, chunk: Chunk, products, scratch: Scratch, out, defer_first: bool = False
) -> Optional[torch.Tensor]:
    """The chunk's target logits into ``out``: positions' read from ``target_logits``, halo rows
    projected in one product. ``defer_first``: a first run of positions is returned, not copied
    (read in place)."""
    b, V = target_logits.shape[1], target_logits.shape[-1]
    deferred, halos = None, []
    for i, run in enumerate(chunk.target_runs()):
        rows = out[run.lo * b : run.hi * b]
        if run.position is not None:
            body = _positions(target_logits, run)
            if i == 0 and defer_first:
                deferred = body
            else:
                rows.copy_(body)
        elif run.segment.halo is None:
            rows.zero_()
        else:
            halos.append((run, rows))
    if halos:
        hidden = torch.cat(
            [run.segment.halo[run.halo_rows].reshape(rows.shape[0], -1) for run, rows in halos]
        )
        logits = scratch.take('halo_logits', (hidden.shape[0], V), out.dtype, out.device)
        products.logits(hidden.to(products.weight.dtype), logits)
        if target_logits.dtype != torch.float32:  # as the main head's own logits
            logits.copy_(logits.to(target_logits.dtype))
        first = 0
        for _, rows in halos:
            rows.copy_(logits[first : first + rows.shape[0]])
            first += rows.shape[0]
    return deferred


class _LabelLogits(NamedTuple):
    value: torch.Tensor
    local_index: torch.Tensor


def _label_logits(z: torch.Tensor, chunk: Chunk, labels: torch.Tensor, vocab) -> _LabelLogits:
    """Read before the row ops overwrite ``z``; a label outside ``[0, V)`` counts as logit 0."""
    start, stop = vocab
    chunk_labels = labels[:, chunk.span].reshape(chunk.depths, chunk.tokens)
    in_shard = (chunk_labels >= start) & (chunk_labels < stop)
    local = torch.where(in_shard, chunk_labels - start, torch.full_like(chunk_labels, -1))
    picked = torch.stack(
        [
            z[chunk.draft_rows(k)].detach().gather(1, local[k].clamp(min=0).unsqueeze(1)).squeeze(1)
            for k in range(chunk.depths)
        ]
    )
    return _LabelLogits(torch.where(in_shard, picked, torch.zeros_like(picked)), local)
