"""Times the torch row passes of one chunk of the sweep (CPU, fp32): the settings they rest on.

The fused TV sweep spends its time outside the matrix products in ``TorchRowOps`` (the CPU
path): ``normalise_`` of the target and draft rows (with the argmax the greedy-agreement metric
needs) and ``pair_sums`` writing the one-pass TV gradient. The product's choices there are timed
here against their baselines, with the benchmarks' one harness (:mod:`lossbench.timing`:
interleaved rounds after a warm-up round, medians, each row's ratio to the baseline's run of the
same round):

* ``block``: ``TorchRowOps.BLOCK_ELEMENTS``, the values per row block of every pass: the default
  against other sizes (each timed through a subclass that sets the class attribute, the
  product's own class untouched);
* ``argmax``: :func:`megatron.mtp_tv.row_ops.row_max_argmax` against ``torch.max(z, -1)``, with
  ``torch.amax`` (no index) as the floor.

With ``--mtp-tokens N`` it also runs Megatron's MTP path (the benchmark's ``mtp`` case: hidden
1024, V 32k, one depth, ``'tv'`` at chunk ``--mtp-chunk``, default 512, target from the main
logits) end to end, ``'ce'`` and ``'tv'`` interleaved in one process, with ``'tv'``'s ratio to
``'ce'``; ``--profile`` then profiles one more ``'ce'`` and ``'tv'`` step and prints their self
CPU time side by side: matrix products, row max / argmax, everything else. ``--hog memory``
times the MTP path twice, on all cores but one, first alone and then beside a process that
streams copies of two 256 MiB buffers on the remaining core (memory-bandwidth and last-level
cache contention, as a busy neighbour on a shared host makes it); ``--hog cpu`` times it on all
cores, alone and beside a busy loop on the last core, so that one of its threads shares a core
(as on a loaded machine, or a virtual CPU whose host takes time from it): every parallel op then
waits for that thread, and a path of many short ops loses more than one of a few long ones.

    .venv/bin/python tools/bench_row_ops.py                 # one 1024-token chunk of V 32k
    .venv/bin/python tools/bench_row_ops.py --tokens 512 --vocab 151936 --repeats 7
    .venv/bin/python tools/bench_row_ops.py --mtp-tokens 8192 --repeats 3
    .venv/bin/python tools/bench_row_ops.py --mtp-tokens 4096 --repeats 3 --profile
    .venv/bin/python tools/bench_row_ops.py --mtp-tokens 4096 --repeats 3 --profile --mtp-chunk 1024
    .venv/bin/python tools/bench_row_ops.py --mtp-tokens 4096 --repeats 3 --hog memory
    .venv/bin/python tools/bench_row_ops.py --mtp-tokens 4096 --repeats 3 --hog cpu
"""

import argparse
import contextlib
import os
import subprocess
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from lossbench.timing import summarise, time_cases, time_interleaved  # noqa: E402
from megatron.mtp_tv.row_ops import TorchRowOps, row_max_argmax  # noqa: E402


def _timed(runs, repeats: int, baseline: str):
    """``[(name, median seconds, ratio to baseline)]``: one warm-up round, then ``repeats``."""
    stats = summarise(time_interleaved(runs, repeats, warmup=1), baseline)
    return [(name, r['time'], r['ratio']) for name, r in stats.items()]


def row_ops_with_blocks(block_elements: int) -> TorchRowOps:
    """``TorchRowOps`` whose passes walk blocks of ``block_elements`` values (a subclass)."""
    return type(f'TorchRowOps{block_elements}', (TorchRowOps,),
                {'BLOCK_ELEMENTS': block_elements})()


def time_blocks(tokens: int, vocab: int, exponents, repeats: int):
    """One chunk's row passes (``'tv'``, one depth, metrics on) per block size, against the
    default ``TorchRowOps.BLOCK_ELEMENTS`` (first row)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * tokens, vocab, generator=g) * 2.5  # target rows, then draft rows
    z = torch.empty_like(logits)
    weights = torch.full((tokens,), 1.0 / tokens)

    def chunk(ops):
        def run():
            z.copy_(logits)  # the projection's output, the same in every row
            probs, _ = ops.normalise_(z, None, vocab_start=0)
            ops.pair_sums(probs[:tokens], probs[tokens:], dot=True,
                          coefficients=lambda rows, overlap: (weights[rows], None))
        return run

    default = TorchRowOps.BLOCK_ELEMENTS
    baseline = f'2^{default.bit_length() - 1} (default)'
    runs = {baseline: chunk(TorchRowOps())}
    for exponent in exponents:
        if 1 << exponent != default:
            runs[f'2^{exponent}'] = chunk(row_ops_with_blocks(1 << exponent))
    return _timed(runs, repeats, baseline)


def time_argmax(tokens: int, vocab: int, repeats: int):
    """Row max with index over ``2 * tokens`` rows, block by block as ``normalise_`` runs it:
    ``row_max_argmax`` against ``torch.max(z, -1)`` (first row), and ``torch.amax`` (no index,
    the floor)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2 * tokens, vocab, generator=g) * 2.5
    blocks = TorchRowOps()._blocks(z)
    best, index = torch.empty(2 * tokens), torch.empty(2 * tokens, dtype=torch.long)

    def blocked(op):
        def run():
            for rows in blocks:
                op(z[rows], best[rows], index[rows])
        return run

    runs = {
        'torch.max(z, -1)': blocked(lambda zb, b, i: torch.max(zb, dim=-1, out=(b, i))),
        'row_max_argmax': blocked(row_max_argmax),
        'torch.amax (no index)': blocked(lambda zb, b, i: torch.amax(zb, dim=-1, out=b)),
    }
    return _timed(runs, repeats, 'torch.max(z, -1)')


#: ``torch.profiler`` op names per row of the ``--profile`` table (self CPU time; the rest is
#: "everything else": the row passes, copies, collectives, Python).
PROFILE_GROUPS = {
    'matrix products': ('aten::mm', 'aten::addmm', 'aten::addmm_', 'aten::bmm'),
    'row max / argmax': ('aten::max', 'aten::amax', 'aten::argmax'),
}


def profile_step(case) -> dict:
    """Self CPU seconds of one ``case.step()`` per :data:`PROFILE_GROUPS` row, and in all."""
    from torch.profiler import ProfilerActivity, profile

    case.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        case.step()
    case.reset()
    seconds = {group: 0.0 for group in PROFILE_GROUPS}
    total = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total / 1e6
        for group, names in PROFILE_GROUPS.items():
            if event.key in names:
                seconds[group] += event.self_cpu_time_total / 1e6
    seconds['everything else'] = total - sum(seconds.values())
    seconds['total'] = total
    return seconds


def time_mtp_path(tokens: int, repeats: int, hidden: int = 1024, vocab: int = 32768, chunk: int = 512,
                  profile: bool = False):
    """``'ce'`` and ``'tv'`` on the MTP path, interleaved (one warm-up round).

    Returns ``(rows, profiles)``: ``[(name, median seconds, ratio to 'ce')]``, and with
    ``profile`` the :func:`profile_step` of one more ``'ce'`` and ``'tv'`` step each (else None).
    """
    from lossbench.cases import mtp_cases
    from mtp_tv_dev.distributed import reset_mtp_tracker, single_process

    with single_process():
        reset_mtp_tracker()
        cases = mtp_cases(1, tokens, hidden, vocab, chunk, None, 1, 'tv', impls=['ce', 'tv'])
        stats = summarise(time_cases(cases, repeats, warmup=1), 'ce')
        profiles = {name: profile_step(cases[name]) for name in ('ce', 'tv')} if profile else None
    return [(f"'{name}'", r['time'], r['ratio']) for name, r in stats.items()], profiles


#: The ``--hog`` processes: two 256 MiB buffers copied into each other, or a busy loop; forever.
_HOG_SOURCES = {
    'memory': """
import torch
torch.set_num_threads(1)
a = torch.randn(1 << 26)
b = torch.empty_like(a)
print('ready', flush=True)
while True:
    b.copy_(a)
    a.copy_(b)
""",
    'cpu': """
print('ready', flush=True)
while True:
    pass
""",
}


@contextlib.contextmanager
def hog(kind: str, core: int):
    """A ``kind`` (:data:`_HOG_SOURCES`) process busy on ``core`` while the block runs (yielded)."""
    proc = subprocess.Popen([sys.executable, '-c', _HOG_SOURCES[kind]],
                            stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(proc.pid, {core})
        if proc.stdout.readline().strip() != 'ready':
            raise RuntimeError(f'the {kind} hog exited with {proc.wait()}')
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _table(title: str, rows) -> str:
    lines = [f'| {title} | time (ms) | ratio |', '|---|---|---|']
    lines += [f'| {name} | {t * 1e3:.1f} | {ratio:.2f}x |' for name, t, ratio in rows]
    return '\n'.join(lines)


def _profile_table(title: str, profiles: dict) -> str:
    lines = [f"| {title} | 'ce' (ms) | 'tv' (ms) | 'tv' - 'ce' (ms) |", '|---|---|---|---|']
    for group in profiles['ce']:
        ce, tv = profiles['ce'][group] * 1e3, profiles['tv'][group] * 1e3
        lines.append(f'| {group} | {ce:.0f} | {tv:.0f} | {tv - ce:+.0f} |')
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokens', type=int, default=1024, help='tokens of the chunk')
    parser.add_argument('--vocab', type=int, default=32768, help='V/tp')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--blocks', default='16,17,18,19,20,21',
                        help='BLOCK_ELEMENTS exponents to time')
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: all cores)')
    parser.add_argument('--mtp-tokens', type=int, default=0,
                        help="also time the MTP path end to end at this many tokens (0: no)")
    parser.add_argument('--mtp-chunk', type=int, default=512, help="with --mtp-tokens: 'tv''s mtp_tv_chunk")
    parser.add_argument('--profile', action='store_true',
                        help="with --mtp-tokens: also profile one 'ce' and one 'tv' step and "
                             "print where their self CPU time goes")
    parser.add_argument('--hog', choices=sorted(_HOG_SOURCES),
                        help='with --mtp-tokens: time the MTP path again beside a process busy on '
                             "the last core: 'memory' copying buffers (this process then keeps off "
                             "that core), 'cpu' a busy loop (this process keeps every core)")
    args = parser.parse_args(argv)
    if (args.profile or args.hog) and not args.mtp_tokens:
        parser.error('--profile and --hog need --mtp-tokens')
    hog_core = None
    if args.hog:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            parser.error(f'--hog needs two cores, this process may use {len(cores)}')
        hog_core = cores[-1]
        if args.hog == 'memory':
            os.sched_setaffinity(0, cores[:-1])
            torch.set_num_threads(args.threads or len(cores) - 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    exponents = [int(e) for e in args.blocks.split(',')]
    print(f'command: {" ".join([sys.executable, "tools/bench_row_ops.py", *(argv or sys.argv[1:])])}')
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, chunk of {args.tokens} '
          f'tokens (2 x {args.tokens} rows of V/tp {args.vocab}), median of {args.repeats}; '
          "ratio: the median of each round's ratio to the first row\n")
    print(_table('BLOCK_ELEMENTS: normalise_ + pair_sums', time_blocks(args.tokens, args.vocab, exponents, args.repeats)))
    print()
    print(_table('row max with index', time_argmax(args.tokens, args.vocab, args.repeats)))
    if args.mtp_tokens:
        print()
        rows, profiles = time_mtp_path(args.mtp_tokens, args.repeats, chunk=args.mtp_chunk,
                                       profile=args.profile)
        print(_table(f'MTP path, {args.mtp_tokens} tokens, chunk {args.mtp_chunk}', rows))
        if profiles:
            print()
            print(_profile_table(f'one step, {args.mtp_tokens} tokens, self CPU time', profiles))
        if hog_core is not None:
            with hog(args.hog, hog_core):
                rows, _ = time_mtp_path(args.mtp_tokens, args.repeats, chunk=args.mtp_chunk)
            print()
            print(_table(f'the same, beside a {args.hog} hog on core {hog_core}', rows))


if __name__ == '__main__':
    main()
