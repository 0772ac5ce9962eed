"""Times the torch row passes of one chunk of the sweep (CPU, fp32): the settings they rest on.

The fused TV sweep spends its time outside the matrix products in ``TorchRowOps`` (the CPU
path): ``normalise_`` of the target and draft rows (with the argmax the greedy-agreement metric
needs) and ``pair_sums`` writing the one-pass TV gradient. The choices there are measured here,
each beside its alternatives in the same run (median of repeats, ratios to the first row):

* ``block``: ``TorchRowOps.BLOCK_ELEMENTS``, the values per row block of every pass;
* ``argmax``: :func:`megatron.mtp_tv.row_ops.row_max_argmax` against ``torch.max(z, -1)`` and
  ``torch.amax`` (no index: the floor);
* formulations tried and not adopted (the dot product as ``bmm``, KL through ``xlogy``, ATen's
  fused softmax), each beside the one in use.

With ``--mtp-tokens N`` it also runs Megatron's MTP path (the benchmark's ``mtp`` case: hidden
1024, V 32k, one depth, ``'tv'`` at chunk ``--mtp-chunk``, default 512, target from the main
logits) end to end, ``'ce'`` and ``'tv'`` with these defaults and ``'tv'`` with the earlier ones
(2^18-value blocks, ``torch.max``), interleaved in one process, the ratio of medians to
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
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.mtp_tv import row_ops  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, scratch buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_blocks(tokens: int, vocab: int, exponents, repeats: int):
    """One chunk's row passes (``'tv'``, one depth, metrics on) per ``BLOCK_ELEMENTS``."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * tokens, vocab, generator=g) * 2.5  # target rows, then draft rows
    z = torch.empty_like(logits)
    weights = torch.full((tokens,), 1.0 / tokens)

    def chunk():
        z.copy_(logits)  # the projection's output, the same in every row
        ops = row_ops.TorchRowOps()
        probs, _ = ops.normalise_(z, None, vocab_start=0)
        ops.pair_sums(probs[:tokens], probs[tokens:], dot=True,
                      coefficients=lambda rows, overlap: (weights[rows], None))

    default = row_ops.TorchRowOps.BLOCK_ELEMENTS
    rows = []
    try:
        for exponent in exponents:
            row_ops.TorchRowOps.BLOCK_ELEMENTS = 1 << exponent
            rows.append((f'2^{exponent}' + (' (default)' if 1 << exponent == default else ''),
                         _median_time(chunk, repeats)))
    finally:
        row_ops.TorchRowOps.BLOCK_ELEMENTS = default
    return rows


def time_argmax(tokens: int, vocab: int, repeats: int):
    """Row max with index over ``2 * tokens`` rows, block by block as ``normalise_`` runs it."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2 * tokens, vocab, generator=g) * 2.5
    blocks = row_ops.TorchRowOps()._blocks(z)
    best, index = torch.empty(2 * tokens), torch.empty(2 * tokens, dtype=torch.long)

    def blocked(op):
        def run():
            for rows in blocks:
                op(z[rows], best[rows], index[rows])
        return run

    variants = [
        ('torch.max(z, -1)', lambda zb, b, i: torch.max(zb, dim=-1, out=(b, i))),
        ('row_max_argmax', row_ops.row_max_argmax),
        ('torch.amax (no index)', lambda zb, b, i: torch.amax(zb, dim=-1, out=b)),
    ]
    return [(name, _median_time(blocked(op), repeats)) for name, op in variants]


def time_rejected(tokens: int, vocab: int, repeats: int):
    """Torch formulations tried for the row passes and not adopted, each beside the one in use,
    over ``tokens`` rows in :class:`TorchRowOps` blocks: the dot product ``sum q 1[q<p]`` and
    ``KL(p || q)`` as ``pair_sums`` writes them, the single-shard softmax (``normalise_``
    itself against ATen's fused kernel written over its input: faster, but less exact, see
    ``tests/test_linear_tv.py``), and target rows taken from the main logits (read by the
    softmax's first pass against copied into the chunk buffer first)."""
    g = torch.Generator().manual_seed(2)
    zp = torch.randn(tokens, vocab, generator=g) * 2.5
    P, Q = torch.softmax(zp, -1), torch.softmax(zp + torch.randn(tokens, vocab, generator=g), -1)
    blocks = row_ops.TorchRowOps()._blocks(Q)  # the blocks pair_sums walks
    step = blocks[0].stop - blocks[0].start
    work, work2, below = (torch.empty(step, vocab) for _ in range(3))
    z = torch.empty_like(zp)
    tiny = torch.finfo(torch.float32).tiny

    def blocked(op, fresh_logits=False):
        def run():
            if fresh_logits:
                z.copy_(zp)
            for rows in blocks:
                op(P[rows], Q[rows], z[rows])
        return run

    def dot_mul_sum(p, q, _):
        torch.sum(torch.mul(q, torch.lt(q, p, out=below), out=work), dim=-1)

    def dot_bmm(p, q, _):
        torch.bmm(q.unsqueeze(1), torch.lt(q, p, out=below).unsqueeze(2))

    def kl_log_ratio(p, q, _):
        ratio = torch.clamp(p, min=tiny, out=work)
        torch.sum(ratio.div_(torch.clamp(q, min=tiny, out=work2)).log_().mul_(p), dim=-1)

    def kl_xlogy(p, q, _):
        ratio = torch.div(p, torch.clamp(q, min=tiny, out=work), out=work)
        torch.sum(torch.xlogy(p, ratio, out=work), dim=-1)

    ops = row_ops.TorchRowOps()

    def softmax_in_use():  # the sweep's own single-shard normalise (it runs in blocks itself)
        ops.normalise_(z.copy_(zp), None)

    def softmax_fused(p, q, zb):
        torch.softmax(zb, dim=-1, out=zb)

    # Target rows given as main logits (which must stay intact): the softmax's first pass reads
    # them where they are, against copying them into the chunk buffer first.
    def target_read_in_place():
        ops.normalise_(z, None, source=zp)

    def target_copied():
        ops.normalise_(z.copy_(zp), None)

    pairs = [
        ('dot product', 'mul + sum', blocked(dot_mul_sum), 'bmm row dot', blocked(dot_bmm)),
        ('KL', 'clamp, div, log, mul, sum', blocked(kl_log_ratio), 'div, xlogy, sum', blocked(kl_xlogy)),
        # both softmax rows include a copy of the logits per run (the passes overwrite them)
        ('softmax', 'normalise_: sub, exp, sum, div', softmax_in_use,
         'torch.softmax(out=input)', blocked(softmax_fused, True)),
        ('target rows from main logits', 'normalise_(source=)', target_read_in_place,
         'copy, then normalise_', target_copied),
    ]
    return [(what, used, _median_time(run_used, repeats), alt, _median_time(run_alt, repeats))
            for what, used, run_used, alt, run_alt in pairs]


def _rejected_table(rows) -> str:
    lines = ['| pass | in use | (ms) | not adopted | (ms) | ratio |', '|---|---|---|---|---|---|']
    lines += [f'| {what} | {used} | {t_used * 1e3:.1f} | {alt} | {t_alt * 1e3:.1f} | {t_alt / t_used:.2f}x |'
              for what, used, t_used, alt, t_alt in rows]
    return '\n'.join(lines)


#: The row-pass settings before 8cc12a1, for the end-to-end comparison.
EARLIER_BLOCK_ELEMENTS = 1 << 18


def _earlier_argmax(z, out_max, out_argmax):
    torch.max(z, dim=-1, out=(out_max, out_argmax))


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
                  profile: bool = False, blocks=()):
    """``'ce'`` and ``'tv'`` (current and earlier row passes, and ``'tv'`` with
    ``BLOCK_ELEMENTS = 2^e`` for each exponent in ``blocks``) on the MTP path, interleaved.

    Returns ``(rows, profiles)``: the median time per setting, and with ``profile`` the
    :func:`profile_step` of one more ``'ce'`` and ``'tv'`` step each (else None).
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lossbench.cases import mtp_cases
    from mtp_tv_dev.distributed import reset_mtp_tracker, single_process

    current = (row_ops.TorchRowOps.BLOCK_ELEMENTS, row_ops.row_max_argmax)
    settings = {"'ce'": None, "'tv'": current,
                "'tv', earlier row passes": (EARLIER_BLOCK_ELEMENTS, _earlier_argmax)}
    for e in blocks:
        settings[f"'tv', 2^{e}-value blocks"] = (1 << e, row_ops.row_max_argmax)
    times = {name: [] for name in settings}
    try:
        with single_process():
            reset_mtp_tracker()
            cases = mtp_cases(1, tokens, hidden, vocab, chunk, None, 1, 'tv', impls=['ce', 'tv'])
            for repeat in range(repeats + 1):  # the first round warms up
                for name, setting in settings.items():
                    case = cases['ce' if setting is None else 'tv']
                    if setting is not None:
                        row_ops.TorchRowOps.BLOCK_ELEMENTS, row_ops.row_max_argmax = setting
                    case.reset()
                    start = time.perf_counter()
                    case.step()
                    if repeat:
                        times[name].append(time.perf_counter() - start)
            # the loop ends on the earlier settings: profile with the current ones
            row_ops.TorchRowOps.BLOCK_ELEMENTS, row_ops.row_max_argmax = current
            profiles = {name: profile_step(cases[name]) for name in ('ce', 'tv')} if profile else None
    finally:
        row_ops.TorchRowOps.BLOCK_ELEMENTS, row_ops.row_max_argmax = current
    return [(name, statistics.median(t)) for name, t in times.items()], profiles


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
    base = rows[0][1]
    lines = [f'| {title} | time (ms) | ratio |', '|---|---|---|']
    lines += [f'| {name} | {t * 1e3:.1f} | {t / base:.2f}x |' for name, t in rows]
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
    parser.add_argument('--mtp-blocks', default='',
                        help="with --mtp-tokens: also time 'tv' at these BLOCK_ELEMENTS "
                             "exponents")
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
          f'tokens (2 x {args.tokens} rows of V/tp {args.vocab}), median of {args.repeats}\n')
    print(_table('BLOCK_ELEMENTS: normalise_ + pair_sums', time_blocks(args.tokens, args.vocab, exponents, args.repeats)))
    print()
    print(_table('row max with index', time_argmax(args.tokens, args.vocab, args.repeats)))
    print()
    print(_rejected_table(time_rejected(args.tokens, args.vocab, args.repeats)))
    if args.mtp_tokens:
        print()
        mtp_blocks = [int(e) for e in args.mtp_blocks.split(',') if e]
        rows, profiles = time_mtp_path(args.mtp_tokens, args.repeats, chunk=args.mtp_chunk,
                                       profile=args.profile, blocks=mtp_blocks)
        print(_table(f'MTP path, {args.mtp_tokens} tokens, chunk {args.mtp_chunk}', rows))
        if profiles:
            print()
            print(_profile_table(f'one step, {args.mtp_tokens} tokens, self CPU time', profiles))
        if hog_core is not None:
            with hog(args.hog, hog_core):
                rows, _ = time_mtp_path(args.mtp_tokens, args.repeats, chunk=args.mtp_chunk,
                                        blocks=mtp_blocks)
            print()
            print(_table(f'the same, beside a {args.hog} hog on core {hog_core}', rows))


if __name__ == '__main__':
    main()
