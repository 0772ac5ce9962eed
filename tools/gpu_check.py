"""One-shot GPU check: pre-flight, correctness on CUDA, then the bf16 benchmark against Megatron.

Made for a short lease on one GPU (about 15 minutes, machine start included): one command that
writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``$OUT``, else
``out/gpu_check``) after every phase and every benchmark row, so an error, an out-of-memory or
the lease's time limit leaves every figure measured so far. Each phase runs in its own guard: a
failure is recorded with its traceback and the next phase runs.

Phases (``tools/gpucheck/``):

1. **preflight**: the toolchain Triton's first launch needs and one real launch; where it fails
   the row kernels are the torch ones, with the failure recorded. TF32 pinned to IEEE fp32.
   Megatron's cross-entropy (a hard error without it: it is the baseline of every ratio) and
   its fused variant; the GEMM path of bf16 products; NVIDIA PR #6473's fused e2e-TV kernel
   (``tools/fetch_upstream_e2e_tv.py``) where it was carried.
2. **correctness**: every loss against the float64 reference; the Triton kernels against the
   torch row ops at vocabularies 151936 and 129280; bf16 against fp32; the chunked CE against
   Megatron's; the main-logits target against the projection; one chunk above 2^31 logits
   (151936 x 16384); a ``GPTModel`` with MTP trained a few steps in bf16 with ``'ce'`` and
   ``'tv'``, finite and bit-identical across two runs; every loss's gradients under
   gradient-accumulation fusion in Megatron's DDP against plain autograd (apex's kernel where
   installed, its torch stand-in elsewhere: the path is recorded); bf16 and fp16 gradients of
   every loss and target path against float64, each within twice Megatron CE's own error;
   NVIDIA PR #6473's e2e-TV against ``'e2e_tv'`` and both against float64 on the same inputs
   (loss and gradients, fp32 and the run's dtype; skipped, with the reason, where its modules
   were not carried).
3. **bench**: per shape (tokens 4096/16384, hidden 4096/7168, vocabulary 151936/129280, 1 and 3
   depths), every case against Megatron's MTP cross-entropy in the same rounds: time ratios,
   peak memory (allocated and reserved), TFLOP/s against a same-run bf16 GEMM; the targets.
   Shapes stop being started past ``--budget-s``.

Every check and benchmark row records which path ran (``path``): the Triton row kernels or the
torch row ops, fp32 / fp32-output (``out_dtype``) GEMMs or their ``upcast`` fallback, Megatron's
CE, PR #6473's fused kernels or its torch fallbacks (``gpucheck/paths.py``, ``gpucheck/pr6473.py``).

    python3 tools/gpu_check.py                          # on the GPU machine (docs/development.md)
    TRITON_INTERPRET=1 python3 tools/gpu_check.py --device cpu --quick   # dry run on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, List

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpucheck import preflight as P  # noqa: E402  (torch only: the report is up before megatron)
from gpucheck import wheels as W  # noqa: E402  (the standard library only)

FULL_SHAPES = [  # (tokens, hidden, vocab, depths), the most telling first
    (4096, 4096, 151936, 1), (4096, 4096, 151936, 3), (4096, 7168, 129280, 1),
    (4096, 7168, 129280, 3), (16384, 4096, 151936, 1), (16384, 7168, 129280, 1),
    (16384, 4096, 151936, 3), (16384, 7168, 129280, 3), (4096, 4096, 129280, 1),
    (4096, 7168, 151936, 1), (4096, 4096, 129280, 3), (4096, 7168, 151936, 3),
    (16384, 4096, 129280, 1), (16384, 7168, 151936, 1), (16384, 4096, 129280, 3),
    (16384, 7168, 151936, 3),
]
QUICK_SHAPES = [(64, 64, 512, 1), (64, 64, 512, 3)]


class Report:
    """The report, rewritten in full (JSON and markdown) whenever something is added."""

    def __init__(self, out_dir: str, command: str):
        self.out_dir = out_dir
        self.data: Dict = {'command': command, 'started': time.strftime('%Y-%m-%d %H:%M:%S'),
                           'phases': {}, 'checks': [], 'bench': [], 'targets': []}
        os.makedirs(out_dir, exist_ok=True)
        self.write()

    def write(self) -> None:
        self.data['elapsed_s'] = time.monotonic() - _T0
        tmp = os.path.join(self.out_dir, 'gpu_check.json.tmp')
        with open(tmp, 'w') as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out_dir, 'gpu_check.json'))
        with open(os.path.join(self.out_dir, 'gpu_check.md'), 'w') as f:
            f.write(render(self.data) + '\n')

    @contextlib.contextmanager
    def phase(self, name: str):
        """Run a phase: its wall time and outcome recorded, an exception kept with its
        traceback (the next phase still runs), the report written either way."""
        entry = self.data['phases'].setdefault(name, {})
        entry.update(status='running', started_s=time.monotonic() - _T0)
        self.write()
        t0 = time.monotonic()
        try:
            yield entry
            entry['status'] = 'done'
        except Exception as error:  # recorded, never hidden: the report names it
            entry.update(status='failed', error=repr(error), traceback=traceback.format_exc())
            print(f'gpu_check: phase {name} failed: {error!r}', file=sys.stderr, flush=True)
        finally:
            entry['wall_s'] = time.monotonic() - t0
            if torch.cuda.is_available():
                entry['max_memory_allocated'] = torch.cuda.max_memory_allocated()
            self.write()

    def add_checks(self, rows: List[Dict]) -> None:
        self.data['checks'] += rows
        self.write()


_T0 = time.monotonic()


def render(report: Dict) -> str:
    lines = ['# GPU check', '', f"command: `{report['command']}`; started {report['started']}; "
             f"{report.get('elapsed_s', 0):.0f} s so far", '']
    pre = report.get('preflight', {})
    if pre:
        lines += ['## Pre-flight', '', '| item | value |', '|---|---|']
        for key, value in pre.items():
            lines.append(f'| {key} | {json.dumps(value, default=str)[:300]} |')
        lines.append('')
    lines += ['## Phases', '', '| phase | status | wall s | error |', '|---|---|---|---|']
    for name, p in report['phases'].items():
        lines.append(f"| {name} | {p.get('status')} | {p.get('wall_s', 0):.1f} | "
                     f"{(p.get('error') or p.get('reason', ''))[:200]} |")
    checks = report['checks']
    failed = [c for c in checks if not c['ok']]
    lines += ['', '## Correctness', '', f'{len(checks) - len(failed)}/{len(checks)} checks passed',
              '']
    by_kind: Dict[str, List[Dict]] = {}
    for c in checks:
        by_kind.setdefault(c['check'], []).append(c)
    for kind, rows in by_kind.items():
        bad = [r for r in rows if not r['ok']]
        lines.append(f"- {kind}: {len(rows) - len(bad)}/{len(rows)}; path {paths_of(rows)}"
                     + (f"; FAILED: {json.dumps(bad, default=str)[:1500]}" if bad else ''))
    verdicts = [c for c in checks if 'verdict' in c]
    if verdicts:
        lines += ['', "PR #6473 against 'e2e_tv' and float64 (max abs difference over the "
                  "reference's largest magnitude):", '',
                  '| dtype | V | loss ours / PR | grad draft ours-PR | grad weight ours-PR | '
                  'ours-f64 | PR-f64 | verdict |', '|---|---|---|---|---|---|---|---|']
        worst = lambda e: max(e['grad_draft_max_rel'], e['grad_weight_max_rel'])  # noqa: E731
        for c in verdicts:
            pair, ours, pr = c['ours_vs_pr'], c['ours_vs_f64'], c['pr_vs_f64']
            lines.append(f"| {c['dtype']} | {c['V']} | {c['loss_ours']:.6g} / {c['loss_pr']:.6g}"
                         f" | {pair['grad_draft_max_rel']:.2e} | {pair['grad_weight_max_rel']:.2e}"
                         f" | {worst(ours):.2e} | {worst(pr):.2e} | {c['verdict']} |")
    rows = report['bench']
    if rows:
        b = report.get('bench_setup', {})
        lines += ['', '## Benchmark', '', f"{b.get('dtype')} hidden states and weight, fp32 loss "
                  f"math, batch 1; row kernels {b.get('kernels')}; GEMM rate (bf16 "
                  f"{b.get('roofline_n')}^3, same run) {b.get('roofline_tflops', 0):.0f} TFLOP/s; "
                  "'vs CE': the median of each round's ratio to CE's run", '',
                  '| tokens | hidden | vocab | depths | case | ms | vs CE | peak alloc MiB | '
                  'peak reserved MiB | peak vs CE | TFLOP/s | of GEMM rate | path |',
                  '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
        for r in rows:
            mib = lambda v: '-' if v is None else f'{v / 2**20:.0f}'  # noqa: E731
            vs = r.get('peak_vs_ce')
            lines.append(
                f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['depths']} | {r['case']} | "
                f"{r['time_s'] * 1e3:.2f} | {r['ratio_vs_ce']:.2f}x | {mib(r['peak_allocated'])} | "
                f"{mib(r['peak_reserved'])} | {'-' if vs is None else f'{vs:.2f}x'} | "
                f"{r['tflops']:.0f} | {r['of_roofline']:.0%} | {paths_of([r])} |")
    if report.get('targets'):
        met = sum(t['ok'] for t in report['targets'])
        lines += ['', '## Targets', '', f"{met}/{len(report['targets'])} met", '',
                  '| shape (tokens, hidden, vocab, depths) | target | value | met |',
                  '|---|---|---|---|']
        for t in report['targets']:
            lines.append(f"| {tuple(t['shape'])} | {t['target']} | {t['value']:.2f} | "
                         f"{'yes' if t['ok'] else 'NO'} |")
    return '\n'.join(lines)


def paths_of(rows: List[Dict]) -> str:
    """The paths ``rows`` ran, each setting with every value seen (``row_ops=torch; ...``)."""
    seen: Dict[str, List[str]] = {}
    for r in rows:
        for key, value in (r.get('path') or {}).items():
            if value not in seen.setdefault(key, []):
                seen[key].append(value)
    return '; '.join(f"{k}={' | '.join(v)}" for k, v in seen.items()) or 'not recorded'


def _world(device: str):
    """A process group of one for Megatron's cross-entropy (its ``tp_group``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = 'nccl' if device.startswith('cuda') else 'gloo'
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda')
    p.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
    p.add_argument('--quick', action='store_true', help='tiny shapes (the CPU dry run)')
    p.add_argument('--out', default=os.environ.get('OUT') or os.path.join(_ROOT, 'out', 'gpu_check'))
    p.add_argument('--upstream-dir', default=P.UPSTREAM_DIR,
                   help="PR #6473's modules (tools/fetch_upstream_e2e_tv.py)")
    p.add_argument('--warmup', type=int, default=None, help='default 2 (--quick: 1)')
    p.add_argument('--repeats', type=int, default=None, help='default 5 (--quick: 2)')
    p.add_argument('--budget-s', type=float, default=420.0,
                   help='no benchmark shape is started after this many seconds')
    p.add_argument('--skip', default='', help='comma-separated phases to skip')
    args = p.parse_args(argv)
    device, quick = args.device, args.quick
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    skip = set(filter(None, args.skip.split(',')))
    report = Report(args.out, ' '.join(['python3', 'tools/gpu_check.py', *(argv or sys.argv[1:])]))
    if device.startswith('cuda') and not torch.cuda.is_available():
        report.data['fatal'] = 'torch sees no CUDA device'
        report.write()
        print('gpu_check: torch sees no CUDA device', file=sys.stderr)
        return 2

    pre = report.data['preflight'] = {
        'device': torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu',
        'torch': torch.__version__, 'cuda': torch.version.cuda,
        'triton_interpret': os.environ.get('TRITON_INTERPRET') == '1'}
    try:
        import triton
        pre['triton'] = triton.__version__
    except ImportError:
        pre['triton'] = None
    pre['toolchain'] = P.toolchain()
    pre['tf32'] = P.pin_ieee_fp32()
    try:
        ce = P.megatron_cross_entropy()
    except P.MissingBaseline as error:
        report.data['fatal'] = str(error)
        report.write()
        print(f'gpu_check: {error}', file=sys.stderr)
        return 2
    pre['megatron_ce'] = 'vocab_parallel_cross_entropy'
    from megatron.core import package_info

    pre['megatron_core'] = package_info.__version__
    # megatron-core's imports, the image's own or carried (gpu_check_on_device.sh: wheels.txt)
    pre['numpy'], pre['packaging'] = W.installed('numpy'), W.installed('packaging')
    import megatron.mtp_tv
    from gpucheck import bench as B
    from gpucheck import correctness as C

    megatron.mtp_tv.install()  # the config fields, for the GPTModel phase
    pre['megatron_fused_ce'] = 'fused_vocab_parallel_cross_entropy' if ce['fused'] else ce['fused_error']
    failure = P.triton_launch(device) if pre['triton'] else 'triton is not installed'
    kernels = 'triton' if failure is None else 'torch'
    pre['row_kernels'] = kernels if failure is None else f'torch (Triton failed: {failure})'
    from megatron.mtp_tv.products import gemm_path

    pre['bf16_gemm_path'] = gemm_path(torch.device(device), torch.bfloat16)
    upstream = P.upstream_e2e_tv(args.upstream_dir)
    pre['pr6473'] = {k: v for k, v in upstream.items() if k in ('available', 'commit', 'reason')}
    tp_group = _world(device)
    report.write()

    dtype = getattr(torch, args.dtype)
    correctness: List[tuple] = [
        ('reference', lambda: C.against_reference(device, kernels, quick)),
        ('kernels', lambda: C.kernels_against_torch(device, [5000] if quick else [151936, 129280],
                                                    3 if quick else 48)
         if kernels == 'triton' else []),
        ('bf16', lambda: C.bf16_against_fp32(device, kernels, quick)),
        ('chunked_ce', lambda: C.chunked_ce_against_megatron(device, kernels, ce['unfused'], quick,
                                                            tp_group)),
        ('main_logits', lambda: C.main_logits_against_projection(device, kernels, torch.float32,
                                                                 quick)
         + C.main_logits_against_projection(device, kernels, dtype, quick)),
        ('big_chunk', lambda: C.big_chunk(device, kernels, dtype, *((256, 64, 1024) if quick
                                                                    else (16384, 1024, 151936)))),
        ('model', lambda: C.model_steps(device, kernels, quick)),
        ('fused_wgrad', lambda: C.fused_weight_gradient(device, kernels, quick)),
        ('precision', lambda: C.precision_against_float64(device, quick)),
        ('pr6473', lambda: C.pr6473_against_e2e_tv(device, kernels, dtype, upstream, quick,
                                                   tp_group)),
    ]
    for name, run in correctness:
        if name in skip:
            continue
        if name == 'pr6473' and not upstream['available']:
            report.data['phases'][name] = {'status': 'skipped', 'reason': upstream['reason']}
            report.write()
            continue
        with report.phase(name):
            report.add_checks(run())
    print(f"gpu_check: {sum(c['ok'] for c in report.data['checks'])}/"
          f"{len(report.data['checks'])} checks passed", flush=True)

    if 'bench' not in skip:
        with report.phase('bench') as entry:
            n = 512 if quick else 8192
            report.data['bench_setup'] = {'dtype': args.dtype, 'kernels': kernels, 'roofline_n': n,
                                          'roofline_tflops': B.gemm_roofline(device, dtype, n)}
            for shape in (QUICK_SHAPES if quick else FULL_SHAPES):
                if time.monotonic() - _T0 > args.budget_s:
                    entry['stopped'] = f'budget of {args.budget_s:.0f} s spent before {shape}'
                    break
                rows = B.bench_shape(*shape, device, dtype, kernels, ce, upstream, tp_group,
                                     warmup, repeats,
                                     report.data['bench_setup']['roofline_tflops'])
                report.data['bench'] += rows
                report.data['targets'] = B.targets(report.data['bench'])
                report.write()
                if device.startswith('cuda'):
                    torch.cuda.empty_cache()
    print(render(report.data), flush=True)
    failed = [n for n, p in report.data['phases'].items()
              if p['status'] not in ('done', 'skipped')]
    return 0 if all(c['ok'] for c in report.data['checks']) and not failed else 1


if __name__ == '__main__':
    sys.exit(main())
