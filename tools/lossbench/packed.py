"""The ``packed`` rows: one micro-batch under TP=2 x CP=2 (4 gloo ranks, zigzag), its tokens as one
sequence and as many packed sequences, the loss's matrix products and collective calls per
forward+backward on a rank, and its time (the slowest rank's), beside Megatron's CE on the same
draft rows.

Under zigzag context parallelism every packed sequence gives a rank two stretches of positions;
a loss whose chunks end with each stretch does a chunk, its products and its collectives per
stretch. The rows show whether that cost depends on the number of sequences or on the tokens.
"""

import argparse
import contextlib
import importlib
import time
from typing import Dict, List

import torch

from .cases import Case, ce_baseline, loss_module, loss_package
from .timing import paired_ratio, summarise, time_cases

TP, CP = 2, 2
#: aten matrix products (``torch.matmul`` lowers to these; the weight gradient accumulates).
_PRODUCT_OPS = ('mm', 'addmm', 'addmm_', 'bmm', 'baddbmm')
#: Every torch.distributed call the loss or Megatron's CE make (p2p batches count once).
_COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor', 'reduce_scatter_tensor',
                'broadcast', 'batch_isend_irecv')


@contextlib.contextmanager
def counting_calls(counts: Dict[str, int]):
    """Counts matrix products (``counts['products']``) and collective calls (``'collectives'``)
    made inside the block, backward included."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {getattr(torch.ops.aten, name) for name in _PRODUCT_OPS}

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:
                counts['products'] += 1
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(fn):
        def call(*args, **kwargs):
            counts['collectives'] += 1
            return fn(*args, **kwargs)
        return call

    counts.setdefault('products', 0)
    counts.setdefault('collectives', 0)
    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    try:
        with Products():
            yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def packed_cases(tokens: int, sequences: int, h: int, V: int, chunk: int, seed: int = 0):
    """``{impl: Case}`` on this rank: Megatron's CE on the draft rows, the TV loss (target: the
    main head's logits) with the tokens as one sequence and as ``sequences``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    linear_tv_loss = loss_module('linear_tv').linear_tv_loss
    target_segments = loss_module('alignment').target_segments
    MTPLossOptions = importlib.import_module(loss_package()).MTPLossOptions  # noqa: N806  (the class)

    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    s = tokens // CP
    g = torch.Generator().manual_seed(seed + cp_rank)  # this CP rank's positions
    draft = torch.randn(s, 1, h, generator=g).requires_grad_()
    target = draft.detach() + torch.randn(s, 1, h, generator=g)
    full = torch.Generator().manual_seed(seed)  # the weight: the same on every CP rank
    weight = (torch.randn(V, h, generator=full) * 0.08)[tp_rank * (V // TP):(tp_rank + 1) * (V // TP)]
    weight = weight.clone().requires_grad_()
    main_logits = (target @ weight.detach().t())  # [s, 1, V/tp]: the main head's, computed once
    labels = torch.randint(0, V, (s, 1), generator=g)
    weights = torch.full((1, s, 1), 1.0 / tokens)
    options = MTPLossOptions('tv', chunk_size=chunk)
    ce_loss, _ = ce_baseline(tp_group)

    def ce():
        return ce_loss(copy_to_tensor_model_parallel_region(draft, tp_group), weight, labels) * weights[0]

    def tv(cu_seqlens):
        def forward():
            segments = target_segments(target, 1, cp_group, cu_seqlens, 'zigzag')
            return linear_tv_loss(copy_to_tensor_model_parallel_region(draft, tp_group).unsqueeze(0),
                                  None, weight, weights, options, tp_group=tp_group,
                                  segments=segments, target_logits=main_logits).loss
        return forward

    packed = list(range(0, tokens + 1, tokens // sequences))
    forwards = {'ce': ce, 'tv 1 sequence': tv(None), f'tv {sequences} sequences': tv(packed)}
    return {name: Case(forward, [draft, weight]) for name, forward in forwards.items()}


def _worker(rank: int, args_dict: dict) -> List[dict]:
    import torch.distributed as dist

    args = argparse.Namespace(**args_dict)
    # Subnormal logit gradients (a few percent of one rank's, with these random inputs) slow x86
    # GEMMs 2-4x, not a GPU's: flushed, so that the slowest rank is not the one with them.
    torch.set_flush_denormal(True)
    cases = packed_cases(args.packed_tokens, args.packed_seqs, args.hidden, args.vocab, args.chunk)

    def sync(dt: float) -> float:
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    counts = {}
    for name, case in cases.items():
        case.reset()
        counts[name] = {}
        with counting_calls(counts[name]):
            case.step()
    times = time_cases(cases, args.repeats, args.warmup, sync)
    if rank == 0:
        print(time.strftime('%H:%M:%S'), f"  packed tokens={args.packed_tokens}: " + ", ".join(
            f"{n} {min(ts):.3f}s" for n, ts in times.items()), flush=True)
    rows, one = [], times['tv 1 sequence']
    for name, r in summarise(times, 'ce').items():
        rows.append({
            'case': 'packed', 'seq': args.packed_tokens, 'tp': TP, 'cp': CP, 'G': 1, 'impl': name,
            'sequences': args.packed_seqs if name.endswith('sequences') else 1,
            'tokens': args.packed_tokens, 'time_s': r['time'], 'times_s': r['times'],
            'ratio': r['ratio'], 'ratio_of_medians': r['ratio_of_medians'],
            'vs_one_sequence': paired_ratio(r['times'], one) if name.startswith('tv') else None,
            **counts[name],
        })
    return rows


def run_packed(args, log=print) -> List[dict]:
    from mtp_tv_dev.distributed import spawn

    if args.packed_tokens % (2 * CP * args.packed_seqs):
        raise ValueError(f"--packed-tokens {args.packed_tokens}: each of {args.packed_seqs} "
                         f"sequences must have a multiple of 2 x CP = {2 * CP} tokens")
    log(f"  packed: TP={TP} x CP={CP}, {args.packed_tokens} tokens, 1 and {args.packed_seqs} "
        "sequences")
    return spawn(_worker, TP * CP, vars(args), tp=TP, cp=CP, timeout=args.tp_timeout)[0]


def render_packed(rows: List[dict]) -> List[str]:
    r0 = rows[0]
    lines = [
        "", f"## packed: one micro-batch, TP={r0['tp']} x CP={r0['cp']} (zigzag), packed or not",
        "",
        f"{r0['tokens']} tokens per micro-batch ({r0['tokens'] // r0['cp']} per CP rank), one "
        "depth, the TV target from the main head's logits; the same tokens as one sequence and as "
        "packed sequences; matrix products and collective calls of one forward+backward on a rank "
        "(the halo exchange's p2p batch counts once); time of the slowest rank, subnormals flushed.", "",
        "| impl | sequences | products | collectives | time (s) | min-max | ratio vs CE | "
        "vs 1 sequence | target | met? |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one = '-' if r.get('vs_one_sequence') is None else f"{r['vs_one_sequence']:.2f}x"
        lines.append(
            f"| {r['impl']} | {r['sequences']} | {r['products']} | {r['collectives']} | "
            f"{r['time_s']:.3f} | {min(r['times_s']):.2f}-{max(r['times_s']):.2f} | "
            f"{r['ratio']:.2f}x | {one} | {r['target']} | "
            f"{'-' if r['met'] is None else ('PASS' if r['met'] else 'MISS')} |")
    return lines
