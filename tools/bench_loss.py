"""Benchmark the MTP TV losses against Megatron's cross-entropy, CPU fp32, side by side.

Three groups of rows, each TV row measured in the same run as (and interleaved with) its
cross-entropy baseline, so that the ratios survive a noisy machine:

``loss``  per-depth TV (``linear_tv_loss``, G=1, chunked) vs ``logits = hidden @ W^T`` followed
          by Megatron's ``vocab_parallel_cross_entropy``, same hidden states and weight; fused and
          recompute TV. Reports fwd+bwd time, peak extra memory and bytes saved for backward.
``mtp``   Megatron's own MTP path: ``process_mtp_loss`` through the installed plugin dispatcher
          with ``mtp_loss_type`` 'ce' / 'tv' / 'e2e_tv' (and, with one depth, 'kl', 'lk', 'nla' and
          'tv' at the automatic default chunk, ``tv-auto``), a real ``ColumnParallelLinear``
          output layer and a stand-in for ``GPTModel.compute_language_model_loss``.
``tp``    the ``loss`` rows with the vocabulary sharded over two gloo processes (TP=2).

Time is the median of ``--repeats`` fwd+bwd runs (after ``--warmup``); memory and saved bytes
come from one extra untimed run under :mod:`bench_memory`'s instruments. Targets are printed
with PASS/MISS as measured, never adjusted.

    .venv/bin/python tools/bench_loss.py                      # the full benchmark (~45 min)
    .venv/bin/python tools/bench_loss.py --quick --json x.json  # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_memory import MiB, LiveBytesTracker, SavedTensorsCounter, linear_fit  # noqa: E402

FUSED_TIME_TARGET = 1.35  # fused TV fwd+bwd vs CE (issue: per-depth loss and MTP path)
ANY_TIME_TARGET = 2.5  # any TV mode vs CE
KL_LK_TIME_TARGET = 1.4  # fused 'kl' / 'lk' / 'nla' vs CE on the MTP path (peak <= CE's too)
#: MTP-path cases beside the depth-1 'tv' row: the cold-start losses and the default chunk.
EXTRA_MTP_TYPES = ('kl', 'lk', 'nla')
SAVED_FRACTION_TARGET = 1 / 8  # TV saved bytes per token vs CE's
TP_RATIO_TARGET = 1.25  # (TV/CE at TP=2) / (TV/CE at TP=1)
FLAT_HIDDEN_TENSORS = 4  # "flat": peak grows by at most this many [s, b, h] fp32 tensors/token


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------
class Case:
    """One implementation at one shape: ``step()`` runs forward+backward and drops the result.

    ``forward()`` returns the tensor whose ``.sum().backward()`` is the backward pass; ``reset()``
    clears the gradients of the leaves (outside the timed region).
    """

    def __init__(self, forward: Callable[[], torch.Tensor], leaves: List[torch.Tensor],
                 env: Optional[Dict[str, str]] = None):
        self.forward = forward
        self.leaves = leaves
        self.env = env or {}

    @contextlib.contextmanager
    def environment(self):
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def reset(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None

    def step(self) -> None:
        with self.environment():
            out = self.forward()
            out.sum().backward()

    def memory(self) -> Dict[str, float]:
        """Peak extra bytes of fwd+bwd and bytes saved for backward (one untimed run)."""
        self.reset()
        gc.collect()
        with self.environment():
            tracker = LiveBytesTracker()
            with tracker:
                tracker.mark('forward')
                with SavedTensorsCounter(tracker) as saved:
                    out = self.forward().sum()
                tracker.mark('backward')
                out.backward()
                del out
            peak, saved_bytes = tracker.peak, saved.bytes
            fwd_peak, bwd_peak = tracker.phase_peak('forward'), tracker.phase_peak('backward')
        denormal = max(_denormal_fraction(leaf.grad) for leaf in self.leaves)
        self.reset()
        return {'peak': peak, 'fwd_peak': fwd_peak, 'bwd_peak': bwd_peak, 'saved': saved_bytes,
                'saved_tensors': saved.tensors, 'denormal_grad_fraction': denormal}


def _denormal_fraction(grad: Optional[torch.Tensor]) -> float:
    """Share of subnormal values in ``grad``: x86 GEMMs on them run many times slower, so a
    benchmark whose gradients are full of them measures the FPU, not the loss."""
    if grad is None or not grad.is_floating_point():
        return 0.0
    tiny = torch.finfo(grad.dtype).tiny
    g = grad.detach().abs()
    return float(((g < tiny) & (g > 0)).float().mean())


def time_cases(cases: Dict[str, Case], repeats: int, warmup: int,
               sync: Optional[Callable[[float], float]] = None) -> Dict[str, List[float]]:
    """fwd+bwd seconds of every case, interleaved (case A, B, C, A, B, C, ...).

    ``sync(t)`` (TP runs) puts all ranks in step before a run and turns a rank's time into the
    slowest rank's time.
    """
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for it in range(warmup + repeats):
        for name, case in cases.items():
            case.reset()
            gc.collect()
            if sync is not None:
                sync(0.0)
            t0 = time.perf_counter()
            case.step()
            dt = time.perf_counter() - t0
            if sync is not None:
                dt = sync(dt)
            if it >= warmup:
                times[name].append(dt)
    for case in cases.values():
        case.reset()
    return times


def measure(cases: Dict[str, Case], repeats: int, warmup: int, sync=None) -> Dict[str, dict]:
    times = time_cases(cases, repeats, warmup, sync)
    out = {}
    for name, case in cases.items():
        mem = case.memory()
        out[name] = {'times': times[name], 'time': statistics.median(times[name]), **mem}
    return out


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------
def loss_cases(s: int, h: int, V: int, chunk: int, tp_group, tp_rank: int, tp: int,
               seed: int = 0) -> Dict[str, Case]:
    """Per-depth loss on one depth: CE (matmul + vocab_parallel_cross_entropy) vs TV."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from megatron.mtp_tv.linear_tv import linear_tv_loss

    b = 1
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).requires_grad_()
    # The target: another hidden state, close enough that p and q overlap (alpha ~ 0.5).
    target = hidden.detach() + torch.randn(s, b, h, generator=g)
    full_weight = torch.randn(V, h, generator=g) * 0.02 * 4  # logits std ~ 2.5 at h=1024
    shard = V // tp
    weight = full_weight[tp_rank * shard : (tp_rank + 1) * shard].clone().requires_grad_()
    del full_weight
    labels = torch.randint(0, V, (s, b), generator=g)
    ce_weights = torch.full((s, b), 1.0 / (s * b))
    tv_weights = torch.full((1, s, b), 1.0 / (s * b))

    def into_tp(x):
        return copy_to_tensor_model_parallel_region(x, tp_group) if tp > 1 else x

    def ce():
        logits = torch.matmul(into_tp(hidden), weight.t())
        return vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group) * ce_weights

    def tv(fused):
        def run():
            draft = into_tp(hidden).unsqueeze(0)
            return linear_tv_loss(draft, target, weight, tv_weights, 'tv', chunk_size=chunk,
                                  tp_group=tp_group if tp > 1 else None, fused=fused).loss
        return run

    def ce_products():
        return _CEProducts.apply(into_tp(hidden).view(s * b, h), weight)

    def tv_products():
        draft = into_tp(hidden).view(s * b, h)
        return _TVProducts.apply(draft, target.view(s * b, h), weight, max(1, chunk // b) * b)

    leaves = [hidden, weight]
    return {'ce': Case(ce, leaves), 'tv': Case(tv(True), leaves),
            'tv-recompute': Case(tv(False), leaves),
            # The matrix products alone, same shapes, nothing else: the floor of each side.
            'ce-products': Case(ce_products, leaves), 'tv-products': Case(tv_products, leaves)}


class _CEProducts(torch.autograd.Function):
    """CE's three products: ``z = x W^T`` (materialised, as CE does), then ``g x``-side and
    ``g^T x`` with ``g = z`` standing in for the logit gradient (same shape, no softmax)."""

    @staticmethod
    def forward(ctx, x, weight):
        z = x @ weight.t()
        ctx.save_for_backward(x, weight, z)
        return z.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        x, weight, z = ctx.saved_tensors
        return z @ weight, z.t() @ x


class _TVProducts(torch.autograd.Function):
    """The fused TV sweep's four products per chunk (target and draft rows in one projection
    into a reused buffer, ``g @ W`` and ``g^T x`` in forward) with the draft logits standing in
    for the logit gradient: what the sweep costs with free row passes."""

    @staticmethod
    def forward(ctx, draft, target, weight, chunk):
        n_tok, h = draft.shape
        grad_x, grad_w = torch.empty_like(draft), torch.empty_like(weight)
        inputs = draft.new_empty(2 * chunk + 1, h)
        logits = draft.new_empty(2 * chunk + 1, weight.shape[0])
        for start in range(0, n_tok, chunk):
            stop = min(start + chunk, n_tok)
            n, n_t = stop - start, min(stop + 1, n_tok) - (start + 1)
            x = draft[start:stop]
            m = n_t + n
            torch.cat([target[start + 1 : start + 1 + n_t], x], out=inputs[:m])
            torch.mm(inputs[:m], weight.t(), out=logits[:m])
            g = logits[n_t:m]
            torch.mm(g, weight, out=grad_x[start:stop])
            grad_w.addmm_(g.t(), x, beta=1.0 if start else 0.0)
        ctx.save_for_backward(grad_x, grad_w)
        return draft.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x.mul_(grad), grad_w.mul_(grad), None, None, None


class _LanguageModelStub:
    """What ``process_mtp_loss`` needs of a GPTModel: ``compute_language_model_loss``.

    Calls ``LanguageModule.compute_language_model_loss`` itself (Megatron's code: vocab-parallel
    CE, or the fused one when ``config.cross_entropy_loss_fusion``).
    """

    def __init__(self, config, tp_group):
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        self.tp_group = tp_group
        self.pg_collection = ProcessGroupCollection(tp=tp_group)

    def compute_language_model_loss(self, labels, logits):
        from megatron.core.models.common.language_module.language_module import LanguageModule

        return LanguageModule.compute_language_model_loss(self, labels, logits)


def mtp_cases(G: int, s: int, h: int, V: int, chunk: int, tp_group, tp: int,
              tv_type: str, seed: int = 0) -> Dict[str, Case]:
    """Megatron's MTP loss path, ``process_mtp_loss`` via the plugin dispatcher."""
    import megatron.mtp_tv
    from megatron.core.models.gpt import gpt_model
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.mtp_tv.mtp_loss import FUSED_ENV

    megatron.mtp_tv.install()

    def config(loss_type, chunk=chunk):
        return TransformerConfig(
            num_layers=1, hidden_size=h, num_attention_heads=8, mtp_num_layers=G,
            tensor_model_parallel_size=tp, use_cpu_initialization=True,
            params_dtype=torch.float32, mtp_loss_type=loss_type, mtp_tv_chunk=chunk,
        )

    ce_config = config('ce')
    # The weight must not share a seed with the hidden states below: the same normal draws in
    # both make W's first rows copies of the hidden rows, logits of ~80, probabilities below
    # 1e-38 and gradient GEMMs on denormals (50x slower on x86).
    torch.manual_seed(seed + 7919)
    output_layer = ColumnParallelLinear(
        h, V, config=ce_config, init_method=torch.nn.init.normal_, bias=False,
        skip_bias_add=False, gather_output=False, tp_group=tp_group,
    )
    with torch.no_grad():
        output_layer.weight.mul_(0.08)  # logits std ~ 2.5, as in the loss rows
    b = 1
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(s, b, h, generator=g)
    drafts = [main + torch.randn(s, b, h, generator=g) for _ in range(G)]
    hidden = torch.cat([main] + drafts).requires_grad_()  # [(1+G)*s, b, h]
    del main, drafts
    labels = torch.randint(0, V, (b, s), generator=g)
    loss_mask = torch.ones(b, s)

    def run(cfg):
        stub = _LanguageModelStub(cfg, tp_group)

        def forward():
            return gpt_model.process_mtp_loss(
                hidden_states=hidden, labels=labels, loss_mask=loss_mask,
                output_layer=output_layer, output_weight=None, runtime_gather_output=None,
                is_training=True, compute_language_model_loss=stub.compute_language_model_loss,
                config=cfg, cp_group=None, tp_group=tp_group, packed_seq_params=None,
            )
        return forward

    leaves = [hidden, output_layer.weight]
    tv_config = config(tv_type)
    cases = {
        'ce': Case(run(ce_config), leaves),
        tv_type: Case(run(tv_config), leaves, env={FUSED_ENV: '1'}),
        f'{tv_type}-recompute': Case(run(tv_config), leaves, env={FUSED_ENV: '0'}),
    }
    if G == 1:
        for loss_type in EXTRA_MTP_TYPES:
            cases[loss_type] = Case(run(config(loss_type)), leaves, env={FUSED_ENV: '1'})
        if chunk != 0:  # mtp_tv_chunk=0 is the default: what a user who sets nothing gets
            cases[f'{tv_type}-auto'] = Case(run(config(tv_type, 0)), leaves, env={FUSED_ENV: '1'})
    return cases


# ------------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------------
def _rows(group: str, seq: int, tp: int, G: int, results: Dict[str, dict], tokens: int,
          extra: Optional[dict] = None) -> List[dict]:
    base = results['ce']['time']
    rows = []
    for impl, r in results.items():
        rows.append({
            'case': group, 'seq': seq, 'tp': tp, 'G': G, 'impl': impl, 'tokens': tokens,
            'time_s': r['time'], 'times_s': r['times'],
            'ratio': r['time'] / base if impl != 'ce' else 1.0,
            'peak_mib': r['peak'] / MiB, 'fwd_peak_mib': r['fwd_peak'] / MiB,
            'bwd_peak_mib': r['bwd_peak'] / MiB,
            'peak_mib_per_rank': [r['peak'] / MiB],
            'saved_bytes': r['saved'], 'saved_per_token': r['saved'] / tokens,
            'saved_tensors': r['saved_tensors'][:12],
            'denormal_grad_fraction': r['denormal_grad_fraction'],
            **(extra or {}),
        })
    return rows


def run_loss(args, tp_group=None, tp_rank=0, tp=1, sync=None, log=print) -> List[dict]:
    rows = []
    for s in args.seqs:
        cases = loss_cases(s, args.hidden, args.vocab, args.chunk, tp_group, tp_rank, tp)
        res = measure(cases, args.repeats, args.warmup, sync)
        rows += _rows('loss' if tp == 1 else 'tp', s, tp, 1, res, s)
        log(f"  loss tp={tp} s={s}: " + ", ".join(f"{k} {v['time']:.3f}s" for k, v in res.items()))
        del cases, res
    return rows


def run_mtp(args, log=print) -> List[dict]:
    from megatron.mtp_tv.testing.distributed import reset_mtp_tracker

    rows = []
    for G, tv_type, seqs in ((1, 'tv', args.mtp_seqs), (args.e2e_depth, 'e2e_tv', args.e2e_seqs)):
        for s in seqs:
            # Megatron's MTP metrics tracker is sized by the first call's depth count.
            reset_mtp_tracker()
            cases = mtp_cases(G, s, args.hidden, args.vocab, args.chunk, None, 1, tv_type)
            res = measure(cases, args.repeats, args.warmup)
            rows += _rows('mtp', s, 1, G, res, G * s)
            log(f"  mtp G={G} s={s}: " + ", ".join(f"{k} {v['time']:.3f}s" for k, v in res.items()))
            del cases, res
    return rows


def _tp_worker(rank: int, args_dict: dict) -> List[dict]:
    """One rank of the TP run (inside ``megatron.mtp_tv.testing.distributed.spawn``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    args = argparse.Namespace(**args_dict)
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)

    def sync(dt: float) -> float:
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    rows = run_loss(args, group, parallel_state.get_tensor_model_parallel_rank(), tp, sync,
                    log=(lambda *a: print(time.strftime('%H:%M:%S'), *a, flush=True))
                    if rank == 0 else (lambda *a: None))
    return rows


def run_tp(args, tp: int, log=print) -> List[dict]:
    from megatron.mtp_tv.testing.distributed import spawn

    per_rank = spawn(_tp_worker, tp, vars(args), tp=tp, timeout=args.tp_timeout)
    rows = per_rank[0]
    for i, row in enumerate(rows):
        row['peak_mib_per_rank'] = [r[i]['peak_mib'] for r in per_rank]
        row['peak_mib'] = max(row['peak_mib_per_rank'])
        row['threads_per_rank'] = max(1, cpu_count() // tp)
    return rows


# ------------------------------------------------------------------------------------------------
# Targets and report
# ------------------------------------------------------------------------------------------------
def _verdict(ok: Optional[bool]) -> str:
    return '-' if ok is None else ('PASS' if ok else 'MISS')


def apply_targets(rows: List[dict], args) -> List[dict]:
    """Attach each row's target and verdict; return the per-impl summaries (memory, saved)."""
    by_key = {(r['case'], r['seq'], r['tp'], r['G'], r['impl']): r for r in rows}
    for r in rows:
        r['target'], r['met'] = '', None
        if r['impl'] == 'ce':
            r['target'] = 'baseline'
            continue
        if r['impl'].endswith('-products'):
            r['target'] = 'floor (see below)'
            continue
        fused = not r['impl'].endswith('-recompute')
        if r['case'] == 'loss':
            limit = FUSED_TIME_TARGET if fused else ANY_TIME_TARGET
            r['target'] = f"time <= {limit}x"
            r['met'] = r['ratio'] <= limit
        elif r['case'] == 'mtp':
            if not fused:
                r['target'] = 'reference'
                continue
            limit = KL_LK_TIME_TARGET if r['impl'] in EXTRA_MTP_TYPES else FUSED_TIME_TARGET
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce')]
            r['target'] = f"time <= {limit}x, peak <= CE's"
            r['met'] = r['ratio'] <= limit and r['peak_mib'] <= ce['peak_mib']
        elif r['case'] == 'tp':
            ref = by_key.get(('loss', r['seq'], 1, r['G'], r['impl']))
            r['target'] = f"ratio <= {TP_RATIO_TARGET} x TP1 ratio"
            if ref is not None:
                r['tp1_ratio'] = ref['ratio']
                r['ratio_vs_tp1'] = r['ratio'] / ref['ratio']
                r['target'] += f" ({TP_RATIO_TARGET * ref['ratio']:.2f}x)"
                r['met'] = r['ratio_vs_tp1'] <= TP_RATIO_TARGET

    summaries = []
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r['case'] in ('loss', 'tp') and not r['impl'].endswith('-products'):
            groups.setdefault((r['case'], r['tp'], r['impl']), []).append(r)
    for (case, tp, impl), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != 'loss')):
        rs = sorted(rs, key=lambda r: r['seq'])
        tokens = [float(r['tokens']) for r in rs]
        fixed, per_token = linear_fit(tokens, [float(r['saved_bytes']) for r in rs])
        peak0, peak_slope = linear_fit(tokens, [r['peak_mib'] * MiB for r in rs])
        summaries.append({
            'case': case, 'tp': tp, 'impl': impl, 'seqs': [r['seq'] for r in rs],
            'peak_mib': [r['peak_mib'] for r in rs],
            'peak_slope_bytes_per_token': peak_slope,
            'saved_fixed_bytes': fixed, 'saved_per_token_bytes': per_token,
        })
    ce = {(s['case'], s['tp']): s for s in summaries if s['impl'] == 'ce'}
    flat_limit = FLAT_HIDDEN_TENSORS * args.hidden * 4
    for sm in summaries:
        sm['targets'] = []
        if sm['impl'] == 'ce' or sm['saved_per_token_bytes'] is None:
            continue
        base = ce.get((sm['case'], sm['tp']))
        if base is not None and base['saved_per_token_bytes']:
            frac = sm['saved_per_token_bytes'] / base['saved_per_token_bytes']
            sm['saved_fraction_of_ce'] = frac
            sm['targets'].append({
                'target': f"saved/token <= 1/{round(1 / SAVED_FRACTION_TARGET)} of CE",
                'value': f"{frac:.4f} of CE", 'met': frac <= SAVED_FRACTION_TARGET})
        if base is not None and base['seqs'] == sm['seqs']:
            worst = max(p / c for p, c in zip(sm['peak_mib'], base['peak_mib']))
            sm['targets'].append({
                'target': "peak <= CE's at every seq", 'value': f"{worst:.2f} of CE at worst",
                'met': worst <= 1.0})
        sm['targets'].append({
            'target': f"peak flat (slope <= {FLAT_HIDDEN_TENSORS} x h x 4 = {flat_limit} B/token)",
            'value': f"{sm['peak_slope_bytes_per_token']:.0f} B/token",
            'met': sm['peak_slope_bytes_per_token'] <= flat_limit})
    return summaries


def product_floors(rows: List[dict]) -> List[dict]:
    """Per (case, seq, tp): TV's products / CE's products, and fused TV against both."""
    by_key = {(r['case'], r['seq'], r['tp'], r['impl']): r for r in rows}
    floors = []
    for (case, seq, tp, impl), r in by_key.items():
        if impl != 'tv-products' or (case, seq, tp, 'ce-products') not in by_key:
            continue
        ce_p = by_key[(case, seq, tp, 'ce-products')]['time_s']
        tv = by_key.get((case, seq, tp, 'tv'))
        floors.append({
            'case': case, 'seq': seq, 'tp': tp, 'ce_products_s': ce_p, 'tv_products_s': r['time_s'],
            'floor': r['time_s'] / ce_p,
            'tv_ratio': tv['ratio'] if tv else float('nan'),
            'tv_over_products': tv['time_s'] / r['time_s'] if tv else float('nan'),
        })
    return floors


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return 'n/a'
    if abs(b) >= MiB:
        return f"{b / MiB:.1f} MiB"
    return f"{b:.0f} B"


def render(report: dict) -> str:
    lines = ["# MTP TV loss benchmark", "", f"command: `{report['command']}`", ""]
    env = report['environment']
    lines.append(
        f"torch {env['torch']}, megatron-core {env['megatron_core']}, {env['threads']} threads "
        f"(TP ranks: {env['threads_tp']} each), CPU fp32, hidden {report['args']['hidden']}, "
        f"vocab {report['args']['vocab']}, chunk {report['args']['chunk']}, batch 1, "
        f"median of {report['args']['repeats']} (warmup {report['args']['warmup']}), "
        f"wall {report['wall_s']:.0f} s; loss code {env['mtp_tv']} @ {env['git']}")
    if report['args'].get('label'):
        lines[-1] += f"; {report['args']['label']}"
    lines += ["", "| case | seq | tp | G | impl | time (s) | min-max | ratio vs CE | peak extra MiB "
              "(fwd/bwd) | saved B/token | target | met? |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report['rows']:
        peak = f"{r['peak_mib']:.1f} ({r['fwd_peak_mib']:.1f}/{r['bwd_peak_mib']:.1f})"
        if r['tp'] > 1:
            peak = "/".join(f"{p:.1f}" for p in r['peak_mib_per_rank']) + " per rank"
        ratio = f"{r['ratio']:.2f}x"
        if 'ratio_vs_tp1' in r:
            ratio += f" (TP1 {r['tp1_ratio']:.2f}x; {r['ratio_vs_tp1']:.2f} of it)"
        lines.append(
            f"| {r['case']} | {r['seq']} | {r['tp']} | {r['G']} | {r['impl']} | {r['time_s']:.3f} | "
            f"{min(r['times_s']):.2f}-{max(r['times_s']):.2f} | {ratio} | {peak} | "
            f"{r['saved_per_token']:.0f} | {r['target']} | {_verdict(r['met'])} |")
    floors = product_floors(report['rows'])
    if floors:
        lines += ["", "Matrix-product floor: the same shapes through only the products each side "
                  "must do (CE 3, TV 4), same run", "",
                  "| case | seq | tp | CE products (s) | TV products (s) | floor (TV/CE products) "
                  "| fused TV vs CE | fused TV vs its products |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in floors:
            lines.append(
                f"| {f['case']} | {f['seq']} | {f['tp']} | {f['ce_products_s']:.3f} | "
                f"{f['tv_products_s']:.3f} | {f['floor']:.2f}x | {f['tv_ratio']:.2f}x | "
                f"{f['tv_over_products']:.2f}x |")
    if report['summaries']:
        lines += ["", "Memory across sequence lengths (saved for backward: least-squares fixed + "
                  "per-token parts; peak: its per-token slope)", "",
                  "| case | tp | impl | seqs | peak extra MiB | peak slope | saved fixed | "
                  "saved per token | target | value | met? |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for sm in report['summaries']:
            slope = sm['peak_slope_bytes_per_token']
            head = (f"| {sm['case']} | {sm['tp']} | {sm['impl']} | "
                    f"{','.join(map(str, sm['seqs']))} | "
                    f"{' / '.join(f'{p:.1f}' for p in sm['peak_mib'])} | "
                    f"{'n/a' if slope is None else f'{slope:.0f} B/token'} | "
                    f"{_fmt_bytes(sm['saved_fixed_bytes'])} | "
                    f"{_fmt_bytes(sm['saved_per_token_bytes'])} |")
            if not sm['targets']:
                lines.append(head + " | | |")
            for t in sm['targets']:
                lines.append(head + f" {t['target']} | {t['value']} | {_verdict(t['met'])} |")
    denormal = [r for r in report['rows'] if r.get('denormal_grad_fraction', 0) > 1e-3]
    if denormal:
        lines += ["", "WARNING: subnormal gradients (slow x86 GEMMs) in: " + ", ".join(
            f"{r['case']}/{r['seq']}/{r['impl']} ({r['denormal_grad_fraction']:.1%})"
            for r in denormal)]
    verdicts = [r['met'] for r in report['rows'] if r['met'] is not None]
    verdicts += [t['met'] for sm in report['summaries'] for t in sm['targets']]
    lines += ["", f"targets met: {sum(verdicts)}/{len(verdicts)}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    def ints(text):
        return [int(x) for x in text.split(',') if x.strip()]

    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seqs', type=ints, default=None, help='sequence lengths (default 1024,4096,8192)')
    p.add_argument('--mtp-seqs', type=ints, default=None,
                   help="'mtp' rows with G=1 (default: the --seqs >= 4096)")
    p.add_argument('--e2e-seqs', type=ints, default=None,
                   help="'mtp' rows with e2e_tv and G=--e2e-depth (default: the smallest --mtp-seqs)")
    p.add_argument('--e2e-depth', type=int, default=3)
    p.add_argument('--hidden', type=int, default=None)
    p.add_argument('--vocab', type=int, default=None)
    p.add_argument('--chunk', type=int, default=None)
    p.add_argument('--repeats', type=int, default=None)
    p.add_argument('--warmup', type=int, default=None)
    p.add_argument('--tp', type=ints, default=[1, 2], help='TP sizes for the loss rows (1,2)')
    p.add_argument('--cases', default='loss,mtp,tp', help='subset of loss,mtp,tp')
    p.add_argument('--threads', type=int, default=0, help='torch threads (0: all cores)')
    p.add_argument('--tp-timeout', type=float, default=7200.0)
    p.add_argument('--quick', action='store_true', help='tiny shapes (smoke test)')
    p.add_argument('--json', default=None, help='also write the report as JSON here')
    p.add_argument('--label', default='',
                   help='free text for the report header (e.g. which revision of the loss code)')
    args = p.parse_args(argv)
    full = dict(seqs=[1024, 4096, 8192], hidden=1024, vocab=32768, chunk=512, repeats=3, warmup=1)
    quick = dict(seqs=[64, 128], hidden=64, vocab=512, chunk=32, repeats=1, warmup=0)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mtp_seqs is None:
        args.mtp_seqs = [s for s in args.seqs if s >= 4096] or list(args.seqs)
    if args.e2e_seqs is None:
        args.e2e_seqs = args.mtp_seqs[:1]
    args.cases = [c.strip() for c in args.cases.split(',') if c.strip()]
    bad = set(args.cases) - {'loss', 'mtp', 'tp'}
    if bad:
        p.error(f"unknown --cases {sorted(bad)}")
    if args.vocab % max(args.tp) != 0:
        p.error(f"--vocab {args.vocab} must be divisible by every --tp")
    return args


def _dist_version(name: str) -> str:
    # megatron.core.__version__ appends the short hash of whatever git tree holds the venv.
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return '?'


def _git_head(path: str) -> str:
    import subprocess

    try:
        head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=path, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no', '.'],
                               cwd=path, text=True, capture_output=True, timeout=10).stdout.strip()
        return (head + (' (+uncommitted changes)' if dirty else '')) or 'not a git tree'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    threads = args.threads or cpu_count()
    torch.set_num_threads(threads)
    command = ' '.join(shlex.quote(a) for a in [sys.executable, 'tools/bench_loss.py', *argv])
    print(f"command: {command}", flush=True)
    import megatron.mtp_tv  # noqa: F401  (its location goes into the report)
    from megatron.mtp_tv.testing.distributed import single_process

    log = lambda *a: print(time.strftime('%H:%M:%S'), *a, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    rows: List[dict] = []
    if 1 in args.tp or 'mtp' in args.cases:
        with single_process():
            if 'loss' in args.cases and 1 in args.tp:
                rows += run_loss(args, log=log)
            if 'mtp' in args.cases:
                rows += run_mtp(args, log=log)
    if 'tp' in args.cases:
        for tp in args.tp:
            if tp > 1:
                rows += run_tp(args, tp, log=log)
    summaries = apply_targets(rows, args)
    report = {
        'command': command,
        'args': {k: v for k, v in vars(args).items()},
        'environment': {
            'torch': torch.__version__, 'megatron_core': _dist_version('megatron-core'),
            'python': platform.python_version(), 'cpu': platform.processor() or platform.machine(),
            'threads': threads, 'threads_tp': max(1, cpu_count() // max(args.tp)),
            'mtp_tv': os.path.dirname(sys.modules['megatron.mtp_tv'].__file__),
            'git': _git_head(os.path.dirname(sys.modules['megatron.mtp_tv'].__file__)),
        },
        'wall_s': time.perf_counter() - t0,
        'rows': rows,
        'summaries': summaries,
        'floors': product_floors(rows),
    }
    print(render(report), flush=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == '__main__':
    main()
