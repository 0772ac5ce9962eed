"""The GPU check's benchmark: every loss against Megatron's MTP cross-entropy at LLM shapes.

One shape is ``(tokens, hidden, vocab, depths)``, batch 1, bf16 hidden states and weight. Its
cases run interleaved (``lossbench.timing.time_interleaved``: CUDA events, the median, each
round's ratio to CE's run of the same round), then once more each for the peak memory above
what was allocated before, as allocated bytes and as the caching allocator's reserved bytes
(fragmentation shows in the second). Cases:

* ``ce`` / ``ce fused``: Megatron's MTP path per depth: ``logits = x W^T`` then
  ``vocab_parallel_cross_entropy`` (or ``fused_vocab_parallel_cross_entropy``,
  ``cross_entropy_loss_fusion``), backward through both;
* ``ce chunked``: the same cross-entropy through the chunked sweep (``mtp_ce_chunked``);
* ``tv`` and the cold-start losses with the target read from the main logits (the default: the
  main head's logits exist anyway, outside the timed region), and ``tv projection`` with the
  target projected by the loss itself (models without main logits);
* at ``depths > 1``: ``e2e_tv`` (main-logits target), and NVIDIA PR #6473's fused e2e-TV as its
  ``_process_mtp_e2e_tv_loss`` composes it (the target projected once under ``no_grad``, each
  depth's full logits, the fused TV distance and prefix objective, autograd for the rest;
  ``gpucheck/pr6473.py``, whose values the correctness phase ``pr6473`` compares with
  ``'e2e_tv'``).

Every row records which path ran (``path``): the row ops and products of this package's losses
(``gpucheck/paths.py``), Megatron's CE, the PR's Triton kernels or its torch fallbacks (its own
dispatch tests on its inputs, run beside it: a few attribute checks per depth).

FLOPs count the products each case runs (``2 n h V`` each); achieved TFLOP/s are set against a
bf16 GEMM measured in the same run.
"""

import statistics
from typing import Callable, Dict, List, Optional, Tuple

import torch

from lossbench.timing import is_cuda, summarise, time_interleaved
from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import CrossEntropy
from megatron.mtp_tv.config import MTPLossOptions

from gpucheck import paths, pr6473

Run = Callable[[], None]
#: A case: its run, its FLOPs, and which path it runs (a dict the PR's case fills as it runs).
Case = Tuple[Run, int, Dict[str, str]]


def gemm_roofline(device: str, dtype: torch.dtype, n: int) -> float:
    """TFLOP/s of one ``n^3`` GEMM in ``dtype``: what this device's matrix units deliver."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = time_interleaved({'gemm': lambda: a @ b}, repeats=10, warmup=3, device=device)
    return 2 * n ** 3 / statistics.median(times['gemm']) / 1e12


def peak_memory(run: Run, device: str) -> Dict[str, Optional[int]]:
    """Peak bytes of one untimed ``run`` above what was there before: allocated, and reserved
    by the caching allocator (None off CUDA)."""
    if not is_cuda(device):
        return {'allocated': None, 'reserved': None}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return {'allocated': torch.cuda.max_memory_allocated() - allocated,
            'reserved': torch.cuda.max_memory_reserved() - reserved}


def shape_cases(tokens: int, hidden: int, vocab: int, depths: int, device: str,
                dtype: torch.dtype, kernels: str, ce: Dict, upstream: Dict,
                tp_group) -> Tuple[str, Dict[str, Case]]:
    """``(baseline name, {case: (run, flops, path)})`` for one shape (see the module docstring)."""
    g = torch.Generator().manual_seed(tokens + hidden + depths)
    drafts = torch.randn(depths, tokens, 1, hidden, generator=g).to(device, dtype).requires_grad_()
    main = torch.randn(tokens, 1, hidden, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (depths, tokens, 1), generator=g).to(device)
    with torch.no_grad():
        main_logits = torch.matmul(main, weight.t())  # the main head's, computed by the model
    per_depth = torch.full((depths, tokens, 1), 1.0 / tokens, device=device)
    per_chain = torch.full((tokens, 1), 1.0 / tokens, device=device)
    gemm = 2 * tokens * hidden * vocab

    def clear():
        drafts.grad = weight.grad = None

    def megatron(fn):
        def run():
            clear()
            loss = sum((fn(torch.matmul(drafts[k], weight.t()), labels[k], tp_group=tp_group)
                        .sum() / tokens) for k in range(depths))
            loss.backward()
        return run

    def ours(loss_type, target_logits=True, **kwargs):
        options = MTPLossOptions(loss_type, kernels=kernels)

        def run():
            clear()
            w = per_chain if options.loss.per_chain else per_depth
            linear_tv_loss(drafts, None if target_logits else main, weight, w, options,
                           target_logits=main_logits if target_logits else None,
                           tp_group=tp_group, **kwargs).loss.backward()
        return run

    suffix = f' x{depths}' if depths > 1 else ''
    products = 3 * depths * gemm
    ours_path = paths.package(device, kernels, dtype)
    cases: Dict[str, Case] = {
        f'ce{suffix}': (megatron(ce['unfused']), products, paths.megatron_ce())}
    if ce['fused'] is not None:
        cases[f'ce fused{suffix}'] = (megatron(ce['fused']), products, paths.megatron_ce(True))
    cases['ce chunked'] = (ours(CrossEntropy(), target_logits=False, labels=labels), products,
                           ours_path)
    cases['tv'] = (ours('tv'), products, ours_path)
    cases['tv projection'] = (ours('tv', target_logits=False), products + gemm, ours_path)
    if depths == 1:
        for loss_type in ('kl', 'lk', 'nla'):
            cases[loss_type] = (ours(loss_type), products, ours_path)
    else:
        cases['e2e_tv'] = (ours('e2e_tv'), products, ours_path)
        if upstream.get('available'):
            run, path = _upstream_e2e(drafts, main, weight, per_chain, upstream, tp_group,
                                      clear)
            cases['PR #6473 e2e_tv'] = (run, products + gemm, path)
    return f'ce{suffix}', cases


def _upstream_e2e(drafts, main, weight, chain_weights, upstream, tp_group,
                  clear) -> Tuple[Run, Dict[str, str]]:
    """NVIDIA PR #6473's e2e-TV as its ``_process_mtp_e2e_tv_loss`` composes it (the target
    projected once, in the timed region), and the path its runs took."""
    path: Dict[str, str] = {}

    def run():
        clear()
        with torch.no_grad():
            target = torch.matmul(main, weight.t())  # [s, 1, V]
        loss, ran = pr6473.e2e_tv_loss(drafts, weight, target, chain_weights, upstream,
                                       tp_group)
        loss.backward()
        path.update(ran)
    return run, path


def bench_shape(tokens: int, hidden: int, vocab: int, depths: int, device: str,
                dtype: torch.dtype, kernels: str, ce: Dict, upstream: Dict, tp_group,
                warmup: int, repeats: int, roofline: float) -> List[Dict]:
    """One report row per case of the shape."""
    baseline, cases = shape_cases(tokens, hidden, vocab, depths, device, dtype, kernels, ce,
                                  upstream, tp_group)
    stats = summarise(time_interleaved({n: case[0] for n, case in cases.items()}, repeats,
                                       warmup, device), baseline)
    base_peak = None
    rows = []
    for name, (run, flops, path) in cases.items():
        peak = peak_memory(run, device)
        if name == baseline:
            base_peak = peak
        t = stats[name]['time']
        rows.append({'tokens': tokens, 'hidden': hidden, 'vocab': vocab, 'depths': depths,
                     'case': name, 'time_s': t, 'times_s': stats[name]['times'],
                     'ratio_vs_ce': stats[name]['ratio'],
                     'ratio_of_medians': stats[name]['ratio_of_medians'],
                     'peak_allocated': peak['allocated'], 'peak_reserved': peak['reserved'],
                     'tflops': flops / t / 1e12, 'of_roofline': flops / t / 1e12 / roofline,
                     'path': dict(path)})
    for row in rows:
        if base_peak and base_peak['allocated']:
            row['peak_vs_ce'] = row['peak_allocated'] / base_peak['allocated']
    return rows


def targets(rows: List[Dict]) -> List[Dict]:
    """The issue's targets per shape: ``'tv'`` at most 1.10x CE's time, ``'e2e_tv'`` at most PR
    #6473's, every loss's peak at most CE's, the loss head at >= 70% of the GEMM rate."""
    verdicts = []
    by_shape: Dict[Tuple, Dict[str, Dict]] = {}
    for r in rows:
        by_shape.setdefault((r['tokens'], r['hidden'], r['vocab'], r['depths']), {})[r['case']] = r
    for shape, cases in by_shape.items():
        ce = next(c for n, c in cases.items() if n.startswith('ce') and 'fused' not in n
                  and 'chunked' not in n)
        if 'tv' in cases:
            verdicts.append({'shape': shape, 'target': "'tv' <= 1.10x CE time",
                             'value': cases['tv']['ratio_vs_ce'],
                             'ok': cases['tv']['ratio_vs_ce'] <= 1.10})
            verdicts.append({'shape': shape, 'target': "'tv' >= 70% of the GEMM rate",
                             'value': cases['tv']['of_roofline'],
                             'ok': cases['tv']['of_roofline'] >= 0.70})
        if 'e2e_tv' in cases and 'PR #6473 e2e_tv' in cases:
            ratio = cases['e2e_tv']['time_s'] / cases['PR #6473 e2e_tv']['time_s']
            verdicts.append({'shape': shape, 'target': "'e2e_tv' <= PR #6473's time",
                             'value': ratio, 'ok': ratio <= 1.0})
        for name, c in cases.items():
            if name.startswith('ce') or name.startswith('PR') or c.get('peak_allocated') is None:
                continue
            verdicts.append({'shape': shape, 'target': f"'{name}' peak <= CE's",
                             'value': c['peak_allocated'] / max(1, ce['peak_allocated']),
                             'ok': c['peak_allocated'] <= ce['peak_allocated']})
    return verdicts
