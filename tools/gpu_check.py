"""One-shot GPU check: correctness on CUDA, then the bf16 benchmark with TFLOP/s.

Made for a short lease on one GPU (an H200 here): one command, a few minutes, everything
written to ``--out``. It needs only torch (+ Triton for the kernels). Timing and the CE
baseline are the CPU benchmark's own (``tools/lossbench``): :func:`lossbench.timing.time_interleaved`
(interleaved rounds after warm-up, CUDA events, medians, each case's ratio to CE's run of the
same round) and :func:`lossbench.cases.ce_baseline` (the matmul, then Megatron's
``vocab_parallel_cross_entropy`` with megatron-core importable, otherwise torch's
``cross_entropy`` on the same fp32 logits: cheaper than Megatron's, so a stricter baseline).

1. **Correctness** (fp32, Triton row kernels required): ``linear_tv_loss`` against the
   independent full-vocabulary reference of ``mtp_tv_dev/reference.py`` (float64, CPU) for ``'tv'``,
   ``'e2e_tv'``, ``'kl'``, ``'lk'`` (at T = 0.7) and ``'nla'``, 1 and 3 depths, several chunk
   sizes, fused and recompute; the Triton kernels against the torch row ops at an LLM vocabulary
   (151936, several tiles); a bf16 model against its fp32 twin.
2. **Benchmark** (bf16 inputs and weight, fp32 loss math): per-depth TV fused / recompute against
   linear + CE on the same tensors (and fused ``'kl'`` / ``'lk'`` / ``'nla'``), the products-only
   floor of each side, and ``'e2e_tv'`` with 3 depths against 3 CE depths; CUDA-event medians,
   the median per-round ratio to CE, peak extra memory, and achieved TFLOP/s of each against a
   large bf16 GEMM measured in the same run (the practical roofline).

    python3 tools/gpu_check.py --out "$OUT"            # on the GPU machine
    python3 tools/gpu_check.py --device cpu --quick    # dry run of the same code on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from lossbench.cases import _CEProducts, _TVProducts, ce_baseline  # noqa: E402
from lossbench.timing import peak_extra_bytes, summarise, time_interleaved  # noqa: E402
from megatron.mtp_tv.linear_tv import linear_tv_loss  # noqa: E402
from megatron.mtp_tv.losses import LOSSES  # noqa: E402
from megatron.mtp_tv.row_ops import TorchRowOps, TritonRowOps, select_row_ops  # noqa: E402
from mtp_tv_dev.reference import depth_terms, objective, token_weights  # noqa: E402


def kernels_for(device: str) -> str:
    """The row kernels every loss call here uses: Triton required on CUDA (the check is about the
    kernels: never a silent fallback to torch), the default elsewhere (the CPU dry run)."""
    return 'triton' if str(device).startswith('cuda') else 'auto'


# ------------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------------
def check_against_reference(device: str, quick: bool) -> List[dict]:
    """fp32 loss and gradients on ``device`` vs the float64 CPU reference."""
    S, B, H, V = (9, 2, 16, 300) if quick else (37, 2, 32, 5003)
    results = []
    for loss_type in LOSSES:
        temperature = 0.7 if loss_type == 'lk' else 1.0
        for G in (1, 3):
            g = torch.Generator().manual_seed(G)
            draft = torch.randn(G, S, B, H, generator=g, dtype=torch.float64)
            target = torch.randn(S, B, H, generator=g, dtype=torch.float64)
            weight = torch.randn(V, H, generator=g, dtype=torch.float64)
            masks = (torch.rand(G, S, B, generator=g) > 0.3).double()
            for k in range(G):
                masks[k, S - k - 1 :] = 0
            d_ref, w_ref = draft.clone().requires_grad_(), weight.clone().requires_grad_()
            alpha, kl = depth_terms(target, list(d_ref), w_ref, temperature=temperature)
            ref = objective(loss_type, alpha, kl, masks, 0.3)
            ref.backward()
            for chunk in (0, 7, 64):
                for fused in (True, False):
                    d = draft.float().to(device).requires_grad_()
                    w = weight.float().to(device).requires_grad_()
                    out = linear_tv_loss(d, target.float().to(device), w,
                                         token_weights(loss_type, masks).float().to(device),
                                         loss_type=loss_type, chunk_size=chunk, fused=fused,
                                         temperature=temperature, kernels=kernels_for(device))
                    out.loss.backward()
                    errs = {
                        'loss': abs(out.loss.item() - ref.item()),
                        'grad_draft': (d.grad.cpu().double() - d_ref.grad).abs().max().item(),
                        'grad_weight': (w.grad.cpu().double() - w_ref.grad).abs().max().item(),
                    }
                    ok = (errs['loss'] <= 1e-5 + 1e-4 * abs(ref.item())
                          and errs['grad_draft'] <= 1e-6 + 1e-3 * d_ref.grad.abs().max().item()
                          and errs['grad_weight'] <= 1e-6 + 1e-3 * w_ref.grad.abs().max().item())
                    results.append({'check': 'reference', 'loss_type': loss_type, 'G': G,
                                    'chunk': chunk, 'fused': fused, **errs, 'ok': ok})
    return results


def check_kernels_against_torch(device: str, quick: bool) -> List[dict]:
    """Triton row kernels vs the torch row ops on the same logits (several vocabulary tiles)."""
    n, V = (3, 5000) if quick else (48, 151936)
    g = torch.Generator().manual_seed(0)
    zt = (torch.randn(n + 2, V, generator=g) * 3).to(device)
    zq = (torch.randn(n, V, generator=g) * 3).to(device)
    coef = torch.rand(n, generator=g).to(device)

    kl_coef = torch.rand(n, generator=g).to(device)

    def passes(ops, offset):
        t, _ = ops.normalise_(zt.clone(), None, vocab_start=0)
        q, q_stats = ops.normalise_(zq.clone(), None, vocab_start=0)
        p = ops.rows(t, offset, offset + n)
        overlap, dot, kl = ops.pair_sums(p, q, dot=True, kl=True)
        grad = ops.grad_(p, q, dot, coef, kl_coef).clone()  # the LK form: both terms
        return q_stats.max, q_stats.argmax.float(), overlap, dot, kl, grad

    results = []
    names = ('row_max', 'argmax', 'overlap', 'dot', 'kl', 'grad')
    for offset in (0, 2):
        ref = passes(TorchRowOps(), offset)
        got = passes(TritonRowOps(), offset)
        errs = {name: (a - b).abs().max().item() for name, a, b in zip(names, got, ref)}
        ok = (errs['row_max'] == 0.0 and errs['argmax'] == 0.0 and errs['overlap'] <= 1e-5
              and errs['dot'] <= 1e-5 and errs['kl'] <= 1e-4
              and errs['grad'] <= 1e-4 * ref[-1].abs().max().item() + 1e-9)
        results.append({'check': 'kernels', 'n': n, 'V': V, 'offset': offset, **errs, 'ok': ok})
    return results


def check_bf16(device: str, quick: bool) -> List[dict]:
    """A bf16 model (hidden states and weight) against its fp32 twin: same loss, finite grads."""
    S, B, H, V = (16, 2, 32, 512) if quick else (256, 2, 512, 32768)
    g = torch.Generator().manual_seed(3)
    draft = torch.randn(2, S, B, H, generator=g)
    target = torch.randn(S, B, H, generator=g)
    weight = torch.randn(V, H, generator=g) * H ** -0.5
    w = torch.full((S, B), 1.0 / (S * B))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        d = draft.to(device, dtype, copy=True).requires_grad_()
        wt = weight.to(device, dtype, copy=True).requires_grad_()
        res = linear_tv_loss(d, target.to(device, dtype), wt, w.to(device), 'e2e_tv', chunk_size=64,
                             kernels=kernels_for(device))
        res.loss.backward()
        out[dtype] = (res.loss.item(), torch.isfinite(d.grad).all().item(),
                      torch.isfinite(wt.grad).all().item())
    diff = abs(out[torch.float32][0] - out[torch.bfloat16][0])
    return [{'check': 'bf16 vs fp32', 'loss_fp32': out[torch.float32][0],
             'loss_bf16': out[torch.bfloat16][0], 'abs_diff': diff,
             'ok': diff <= 2e-2 and all(out[torch.bfloat16][1:])}]


# ------------------------------------------------------------------------------------------------
# Benchmark
# ------------------------------------------------------------------------------------------------
def gemm_roofline(device: str, dtype: torch.dtype, quick: bool) -> float:
    """TFLOP/s of one large square GEMM in ``dtype``: what this device's matrix units deliver."""
    n = 512 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = time_interleaved({'gemm': lambda: a @ b}, repeats=10, warmup=3, device=device)
    return 2 * n ** 3 / statistics.median(times['gemm']) / 1e12


def _timed_rows(cases: Dict[str, tuple], baseline: str, device: str, warmup: int, repeats: int,
                roofline: float, **fields) -> List[dict]:
    """``cases`` (name: (run, flops)) timed in interleaved rounds against ``baseline``, then one
    untimed run each for the peak memory; one report row per case."""
    stats = summarise(time_interleaved({name: run for name, (run, _) in cases.items()},
                                       repeats, warmup, device), baseline)
    rows = []
    for name, (run, flops) in cases.items():
        t = stats[name]['time']
        rows.append({**fields, 'case': name, 'time_s': t, 'times_s': stats[name]['times'],
                     'ratio_vs_ce': stats[name]['ratio'],
                     'ratio_of_medians': stats[name]['ratio_of_medians'],
                     'peak_extra_bytes': peak_extra_bytes(run, device),
                     'tflops': flops / t / 1e12, 'of_roofline': flops / t / 1e12 / roofline})
    return rows


def bench(device: str, dtype: torch.dtype, seqs: List[int], hidden: int, vocab: int,
          chunks: List[int], e2e_depth: int, warmup: int, repeats: int, quick: bool) -> dict:
    ce_loss, ce_name = ce_baseline()
    roofline = gemm_roofline(device, dtype, quick)
    rows = []
    for s in seqs:
        g = torch.Generator().manual_seed(s)
        x = torch.randn(s, 1, hidden, generator=g).to(device, dtype).requires_grad_()
        y = (x.detach().float().cpu() + torch.randn(s, 1, hidden, generator=g)).to(device, dtype)
        weight = (torch.randn(vocab, hidden, generator=g) * 0.08).to(device, dtype).requires_grad_()
        labels = torch.randint(0, vocab, (s, 1), generator=g).to(device)
        w_tv = torch.full((1, s, 1), 1.0 / s, device=device)

        def clear():
            x.grad = weight.grad = None

        def ce():
            clear()
            (ce_loss(x, weight, labels).sum() / s).backward()

        def tv(chunk, fused, loss_type='tv'):
            def run():
                clear()
                linear_tv_loss(x.unsqueeze(0), y, weight, w_tv, loss_type, chunk_size=chunk,
                               fused=fused, kernels=kernels_for(device)).loss.backward()
            return run

        def products(fn):
            def run():
                clear()
                fn().backward()
            return run

        n = s  # tokens (batch 1)
        ce_flops = 3 * 2 * n * hidden * vocab
        cases: Dict[str, tuple] = {'ce': (ce, ce_flops),
                                   'ce-products': (products(lambda: _CEProducts.apply(x.view(s, hidden), weight)), ce_flops)}
        for chunk in chunks:
            tv_flops = 4 * 2 * n * hidden * vocab  # target, draft, g@W, g^T x (per token)
            cases[f'tv chunk {chunk}'] = (tv(chunk, True), tv_flops)
            cases[f'tv-recompute chunk {chunk}'] = (tv(chunk, False), tv_flops * 6 // 4)
            for loss_type in ('kl', 'lk', 'nla'):  # the cold-start losses, same products
                cases[f'{loss_type} chunk {chunk}'] = (tv(chunk, True, loss_type), tv_flops)
            cases[f'tv-products chunk {chunk}'] = (
                products(lambda c=chunk: _TVProducts.apply(x.view(s, hidden), y.view(s, hidden), weight, c)),
                tv_flops)
        rows += _timed_rows(cases, 'ce', device, warmup, repeats, roofline, seq=s, G=1)
        clear()

    # 'e2e_tv' with G depths against G CE depths, at the first sequence length.
    s, G = seqs[0], e2e_depth
    g = torch.Generator().manual_seed(7)
    drafts = torch.randn(G, s, 1, hidden, generator=g).to(device, dtype).requires_grad_()
    y = torch.randn(s, 1, hidden, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.08).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (s, 1), generator=g).to(device)
    w_e2e = torch.full((s, 1), 1.0 / s, device=device)

    def ce_depths():
        drafts.grad = weight.grad = None
        loss = sum(ce_loss(drafts[k], weight, labels).sum() / s for k in range(G))
        loss.backward()

    def e2e(chunk):
        def run():
            drafts.grad = weight.grad = None
            linear_tv_loss(drafts, y, weight, w_e2e, 'e2e_tv', chunk_size=chunk,
                           kernels=kernels_for(device)).loss.backward()
        return run

    cases = {f'ce x{G}': (ce_depths, G * 6 * s * hidden * vocab)}
    for chunk in chunks:
        cases[f'e2e_tv chunk {chunk}'] = (e2e(chunk), 2 * hidden * vocab * (s + 3 * G * s))
    rows += _timed_rows(cases, f'ce x{G}', device, warmup, repeats, roofline, seq=s, G=G)
    return {'ce_baseline': ce_name, 'gemm_roofline_tflops': roofline, 'rows': rows}


# ------------------------------------------------------------------------------------------------
def render(report: dict) -> str:
    lines = ['# GPU check', '', f"command: `{report['command']}`", '',
             f"device: {report['device_name']}; torch {report['torch']}; triton "
             f"{report['triton']}; row ops: {report['row_ops']}", '', '## Correctness', '']
    checks = report['checks']
    failed = [c for c in checks if not c['ok']]
    lines.append(f"{len(checks) - len(failed)}/{len(checks)} checks passed"
                 + (': FAILED ' + json.dumps(failed) if failed else ''))
    b = report.get('bench')
    if b:
        lines += ['', '## Benchmark', '',
                  f"{report['dtype']} inputs and weight, fp32 loss math; hidden {report['hidden']}, "
                  f"vocab {report['vocab']}, batch 1; CE baseline: {b['ce_baseline']}; "
                  f"GEMM roofline (8192^3 {report['dtype']} product, same run): "
                  f"{b['gemm_roofline_tflops']:.0f} TFLOP/s; vs CE: the median over rounds of "
                  "each round's ratio to CE's run", '',
                  '| seq | G | case | time (ms) | vs CE | peak extra MiB | TFLOP/s | of roofline |',
                  '|---|---|---|---|---|---|---|---|']
        for r in b['rows']:
            peak = '-' if r['peak_extra_bytes'] is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
            roof = f"{r['of_roofline']:.0%}" if 'of_roofline' in r else '-'
            lines.append(f"| {r['seq']} | {r['G']} | {r['case']} | {r['time_s'] * 1e3:.2f} | "
                         f"{r['ratio_vs_ce']:.2f}x | {peak} | {r['tflops']:.1f} | {roof} |")
    return '\n'.join(lines)


def main(argv=None) -> int:
    def ints(text):
        return [int(v) for v in text.split(',') if v]

    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
    p.add_argument('--seqs', type=ints, default=None, help='default 4096,8192')
    p.add_argument('--hidden', type=int, default=None, help='default 1024')
    p.add_argument('--vocab', type=int, default=None, help='default 32768')
    p.add_argument('--chunks', type=ints, default=None, help='default 512,4096')
    p.add_argument('--e2e-depth', type=int, default=3)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--quick', action='store_true', help='tiny shapes (dry run)')
    p.add_argument('--skip-bench', action='store_true')
    p.add_argument('--out', default=None, help='folder for gpu_check.md and gpu_check.json')
    args = p.parse_args(argv)
    quick = args.quick
    seqs = args.seqs or ([64, 128] if quick else [4096, 8192])
    hidden = args.hidden or (64 if quick else 1024)
    vocab = args.vocab or (512 if quick else 32768)
    chunks = args.chunks or ([32] if quick else [512, 4096])
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        print('gpu_check: torch sees no CUDA device', file=sys.stderr)
        return 2
    ops, reason = select_row_ops(torch.zeros(1, 1, device=args.device), kernels_for(args.device))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = 'not installed'
    report = {
        'command': ' '.join(['python3', 'tools/gpu_check.py', *(argv or sys.argv[1:])]),
        'device_name': torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu',
        'torch': torch.__version__, 'triton': triton_version,
        'row_ops': ops.name + (f' ({reason})' if reason else ''),
        'dtype': args.dtype, 'hidden': hidden, 'vocab': vocab,
    }
    t0 = time.perf_counter()
    checks = check_against_reference(args.device, quick)
    if ops.name == 'triton':
        checks += check_kernels_against_torch(args.device, quick)
    checks += check_bf16(args.device, quick)
    report['checks'] = checks
    print(f"correctness: {sum(c['ok'] for c in checks)}/{len(checks)} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if not args.skip_bench:
        report['bench'] = bench(args.device, getattr(torch, args.dtype), seqs, hidden, vocab,
                                chunks, args.e2e_depth, args.warmup, args.repeats, quick)
    text = render(report)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'gpu_check.md'), 'w') as f:
            f.write(text + '\n')
        with open(os.path.join(args.out, 'gpu_check.json'), 'w') as f:
            json.dump(report, f, indent=1)
    return 0 if all(c['ok'] for c in checks) else 1


if __name__ == '__main__':
    sys.exit(main())
