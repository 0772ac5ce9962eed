"""Benchmark the MTP TV losses against Megatron's cross-entropy, CPU fp32, side by side.

The command line of ``tools/bench_loss.py`` (the row groups are described in :mod:`lossbench`):
parse the arguments, run the selected groups, print the report and write it as JSON.
"""

import argparse
import importlib
import json
import os
import platform
import shlex
import sys
import time
from typing import List

import torch

from .cases import loss_mode, loss_package, tv_target_source
from .packed import run_packed
from .report import apply_targets, attach_round_ratios, product_floors, render
from .runs import cpu_count, run_ce, run_loss, run_mtp, run_step, run_tp, run_wide

#: The row groups ``--cases`` selects from (see :mod:`lossbench`).
GROUPS = ('loss', 'mtp', 'tp', 'step', 'wide', 'ce', 'packed')


def parse_args(argv=None):
    def ints(text):
        return [int(x) for x in text.split(',') if x.strip()]

    def shapes(text):
        try:
            return [tuple(int(n) for n in x.split('x')) for x in text.split(',') if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f'{text!r}: expected HIDDENxVOCABxTOKENS,...') from None

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
    p.add_argument('--step-seqs', type=ints, default=None,
                   help="'step' rows: sequence lengths (default 2048,4096)")
    p.add_argument('--step-depths', type=ints, default=None,
                   help="'step' rows: mtp_num_layers of the model, one set of rows each (default 1)")
    p.add_argument('--wide-hidden', type=ints, default=None,
                   help="'wide' rows: hidden sizes (default 4096,7168)")
    p.add_argument('--wide-vocab', type=int, default=None,
                   help="'wide' rows: vocabulary per rank, V/tp (default 16384)")
    p.add_argument('--wide-seqs', type=ints, default=None,
                   help="'wide' rows: tokens (default 1024,2048,4096)")
    p.add_argument('--ce-depths', type=ints, default=None,
                   help="'ce' rows: mtp_num_layers, one set of rows each (default 1,3)")
    p.add_argument('--ce-shapes', type=shapes, default=None,
                   help="'ce' rows: HIDDENxVOCABxTOKENS shapes, comma-separated (default "
                        "1024x32768x4096,4096x16384x1024,7168x16384x512)")
    p.add_argument('--packed-tokens', type=int, default=None,
                   help="'packed' rows: tokens per micro-batch (default 4096)")
    p.add_argument('--packed-seqs', type=int, default=None,
                   help="'packed' rows: sequences packed into it (default 64)")
    p.add_argument('--cases', default='loss,mtp,tp',
                   help=f"subset of {','.join(GROUPS)} (default loss,mtp,tp)")
    p.add_argument('--threads', type=int, default=None,
                   help='torch threads (0: all cores; default all cores, --quick 1)')
    p.add_argument('--tp-timeout', type=float, default=7200.0)
    p.add_argument('--quick', action='store_true', help='tiny shapes, one thread (smoke test)')
    p.add_argument('--json', default=None, help='also write the report as JSON here')
    p.add_argument('--report', default=None, metavar='JSON',
                   help='print the report of an earlier run (its --json file) with the current '
                        'targets, measuring nothing')
    p.add_argument('--label', default='',
                   help='free text for the report header (e.g. which revision of the loss code)')
    args = p.parse_args(argv)
    full = dict(seqs=[1024, 4096, 8192], hidden=1024, vocab=32768, chunk=512, repeats=3, warmup=1,
                threads=0,
                step_seqs=[2048, 4096], step_depths=[1], wide_hidden=[4096, 7168],
                wide_vocab=16384, wide_seqs=[1024, 2048, 4096], ce_depths=[1, 3],
                ce_shapes=[(1024, 32768, 4096), (4096, 16384, 1024), (7168, 16384, 512)],
                packed_tokens=4096, packed_seqs=64)
    # One thread: at tiny shapes a second thread only waits for a busy machine's other core
    # at every op (0.6 s instead of 0.02 s per step of the 'step' model on two shared cores).
    quick = dict(seqs=[64, 128], hidden=64, vocab=512, chunk=32, repeats=1, warmup=0, threads=1,
                 step_seqs=[64, 128], step_depths=[1, 2], wide_hidden=[96, 128],
                 wide_vocab=512, wide_seqs=[64, 128], ce_depths=[1, 2],
                 ce_shapes=[(64, 512, 256), (128, 512, 32)], packed_tokens=256, packed_seqs=8)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mtp_seqs is None:
        args.mtp_seqs = [s for s in args.seqs if s >= 4096] or list(args.seqs)
    if args.e2e_seqs is None:
        args.e2e_seqs = args.mtp_seqs[:1]
    args.cases = [c.strip() for c in args.cases.split(',') if c.strip()]
    bad = set(args.cases) - set(GROUPS)
    if bad:
        p.error(f"unknown --cases {sorted(bad)}")
    if args.vocab % max(args.tp) != 0:
        p.error(f"--vocab {args.vocab} must be divisible by every --tp")
    if any(len(shape) != 3 for shape in args.ce_shapes):
        p.error(f"--ce-shapes {args.ce_shapes}: each shape is HIDDENxVOCABxTOKENS")
    if any(G < 1 for G in args.step_depths + args.ce_depths):
        p.error(f"--step-depths {args.step_depths} / --ce-depths {args.ce_depths}: every depth "
                "must be >= 1")
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
    if args.report:
        return rerender(args.report)
    threads = args.threads or cpu_count()
    torch.set_num_threads(threads)
    command = ' '.join(shlex.quote(a) for a in [sys.executable, 'tools/bench_loss.py', *argv])
    print(f"command: {command}", flush=True)
    from mtp_tv_dev.distributed import single_process

    measured = importlib.import_module(loss_package())  # its location goes into the report
    print(f"loss code: {loss_mode()} mode ({loss_package()} at "
          f"{os.path.dirname(measured.__file__)}); TV target: {tv_target_source()}", flush=True)

    log = lambda *a: print(time.strftime('%H:%M:%S'), *a, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    rows: List[dict] = []
    if ('loss' in args.cases and 1 in args.tp) or {'mtp', 'step', 'wide', 'ce'} & set(args.cases):
        with single_process():
            if 'loss' in args.cases and 1 in args.tp:
                rows += run_loss(args, log=log)
            if 'mtp' in args.cases:
                rows += run_mtp(args, log=log)
            if 'step' in args.cases:
                rows += run_step(args, log=log)
            if 'wide' in args.cases:
                rows += run_wide(args, log=log)
            if 'ce' in args.cases:
                rows += run_ce(args, log=log)
    if 'tp' in args.cases:
        for tp in args.tp:
            if tp > 1:
                rows += run_tp(args, tp, log=log)
    if 'packed' in args.cases:
        rows += run_packed(args, log=log)
    attach_round_ratios(rows)
    summaries = apply_targets(rows, args)
    report = {
        'command': command,
        'args': {k: v for k, v in vars(args).items()},
        'environment': {
            'torch': torch.__version__, 'megatron_core': _dist_version('megatron-core'),
            'python': platform.python_version(), 'cpu': platform.processor() or platform.machine(),
            'threads': threads, 'threads_tp': max(1, cpu_count() // max(args.tp)),
            'mtp_tv': os.path.dirname(measured.__file__),
            'git': _git_head(os.path.dirname(measured.__file__)),
            # plugin (this checkout's package, install()ed) or patch (a patched tree's own code)
            'loss_mode': loss_mode(), 'loss_package': loss_package(),
            # where the TV losses' target comes from in the measured code
            'tv_target': tv_target_source(),
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


def rerender(path: str) -> dict:
    """The report of an earlier run, its verdicts taken again with this version's targets (the
    measured rows are not touched)."""
    with open(path) as f:
        report = json.load(f)
    attach_round_ratios(report['rows'])
    report['summaries'] = apply_targets(report['rows'], argparse.Namespace(**report['args']))
    report['floors'] = product_floors(report['rows'])
    print(render(report), flush=True)
    return report
