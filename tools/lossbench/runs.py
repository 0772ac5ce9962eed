"""The runs: each row group's shapes measured and turned into report rows (``loss``, ``mtp``,
``step``, ``wide``, ``ce`` in this process; ``tp`` in gloo processes, one per rank, the slowest rank's
time kept).
"""

import argparse
import os
import time
from typing import Dict, List, Optional

import torch

from .cases import (CE_IMPLS, LOGIT_STD, WIDE_IMPLS, auto_chunk, loss_cases, loss_mode, mtp_cases,
                    step_cases, tv_target_source)
from .memory import MiB
from .timing import measure, paired_ratio


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _rows(group: str, seq: int, tp: int, G: int, results: Dict[str, dict], tokens: int,
          extra: Optional[dict] = None) -> List[dict]:
    base = results['ce']['times']
    rows = []
    for impl, r in results.items():
        rows.append({
            'case': group, 'seq': seq, 'tp': tp, 'G': G, 'impl': impl, 'tokens': tokens,
            'time_s': r['time'], 'times_s': r['times'],
            'ratio': paired_ratio(r['times'], base) if impl != 'ce' else 1.0,
            'ratio_of_medians': r['time'] / results['ce']['time'],
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
    from mtp_tv_dev.distributed import reset_mtp_tracker

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


def run_step(args, log=print) -> List[dict]:
    """The 'step' rows: ``GPTModel._postprocess`` fwd+bwd per depth count and sequence length."""
    from mtp_tv_dev.distributed import reset_mtp_tracker

    rows = []
    for G in args.step_depths:
        for s in args.step_seqs:
            reset_mtp_tracker()
            extra = {'hidden': args.hidden, 'vocab': args.vocab, 'chunk': 0,
                     'auto_chunk': auto_chunk(s, G, args.hidden, args.vocab),
                     'mode': loss_mode(), 'target_source': tv_target_source()}
            rows += _measured_rows('step', lambda: step_cases(G, s, args.hidden, args.vocab),
                                   args, s, G, extra, f"G={G} s={s}", log)
    return rows


def run_wide(args, log=print) -> List[dict]:
    """The 'wide' rows: the MTP path (G=1, automatic chunk) at large hidden sizes."""
    from mtp_tv_dev.distributed import reset_mtp_tracker

    rows = []
    for h in args.wide_hidden:
        for s in args.wide_seqs:
            reset_mtp_tracker()
            extra = {'hidden': h, 'vocab': args.wide_vocab, 'chunk': 0,
                     'auto_chunk': auto_chunk(s, 1, h, args.wide_vocab), 'mode': loss_mode()}
            # Logits std ~ LOGIT_STD at every h: 0.08 (the 'mtp' rows' scale) would give 5-7 here.
            rows += _measured_rows(
                'wide', lambda: mtp_cases(1, s, h, args.wide_vocab, 0, None, 1, 'tv',
                                          weight_scale=LOGIT_STD / h ** 0.5, impls=WIDE_IMPLS),
                args, s, 1, extra, f"h={h} s={s}", log)
    return rows


def run_ce(args, log=print) -> List[dict]:
    """The 'ce' rows: Megatron's MTP cross-entropy against the same loss through the chunked sweep
    (``mtp_ce_chunked``, automatic chunk), per depth count and ``(hidden, V/tp, tokens)`` shape."""
    from mtp_tv_dev.distributed import reset_mtp_tracker

    rows = []
    for G in args.ce_depths:
        for h, V, s in args.ce_shapes:
            reset_mtp_tracker()
            extra = {'hidden': h, 'vocab': V, 'chunk': 0,
                     'auto_chunk': auto_chunk(s, G, h, V, target_rows=False), 'mode': loss_mode()}
            rows += _measured_rows(
                'ce', lambda: mtp_cases(G, s, h, V, 0, None, 1, 'tv', weight_scale=LOGIT_STD / h ** 0.5,
                                        impls=CE_IMPLS),
                args, s, G, extra, f"G={G} h={h} V={V} s={s}", log)
    return rows


def _measured_rows(group: str, make_cases, args, s: int, G: int, extra: dict, label: str,
                   log) -> List[dict]:
    """Build one shape's cases, measure them and turn them into rows (the cases are dropped
    before the next shape is built)."""
    cases = make_cases()
    res = measure(cases, args.repeats, args.warmup)
    del cases
    log(f"  {group} {label}: " + ", ".join(f"{k} {v['time']:.3f}s" for k, v in res.items()))
    return _rows(group, s, 1, G, res, s, extra)


def _tp_worker(rank: int, args_dict: dict) -> List[dict]:
    """One rank of the TP run (inside ``mtp_tv_dev.distributed.spawn``)."""
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
    from mtp_tv_dev.distributed import spawn

    per_rank = spawn(_tp_worker, tp, vars(args), tp=tp, timeout=args.tp_timeout)
    rows = per_rank[0]
    for i, row in enumerate(rows):
        row['peak_mib_per_rank'] = [r[i]['peak_mib'] for r in per_rank]
        row['peak_mib'] = max(row['peak_mib_per_rank'])
        row['threads_per_rank'] = max(1, cpu_count() // tp)
    return rows

