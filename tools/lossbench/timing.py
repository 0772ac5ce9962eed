"""The one timing harness of every benchmark (``bench_loss.py``, ``gpu_check.py``,
``bench_row_ops.py``; CPU and CUDA): the runs of a shape timed in interleaved rounds (A, B, C,
A, B, C, ...: a noisy machine slows all of them alike) after warm-up rounds, the median kept,
and each run's ratio to the baseline's run of the same round (:func:`paired_ratio`). On CUDA a
run is timed with CUDA events between two synchronisations. For lossbench's :class:`Case`\\ s,
:func:`measure` adds one untimed run per case for its memory.
"""

import gc
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from .cases import Case


def is_cuda(device) -> bool:
    return device is not None and str(device).startswith('cuda')


def time_interleaved(runs: Dict[str, Callable[[], None]], repeats: int, warmup: int,
                     device='cpu', before: Optional[Callable[[str], None]] = None,
                     sync: Optional[Callable[[float], float]] = None) -> Dict[str, List[float]]:
    """Seconds of every run of ``runs`` in ``warmup + repeats`` interleaved rounds (the warm-up
    rounds dropped).

    ``before(name)`` runs untimed before each run (resetting gradients, collecting garbage);
    ``sync(t)`` (TP runs) puts all ranks in step before a run and turns a rank's time into the
    slowest rank's time.
    """
    cuda = is_cuda(device)
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for it in range(warmup + repeats):
        for name, run in runs.items():
            if before is not None:
                before(name)
            if sync is not None:
                sync(0.0)
            if cuda:
                start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda.synchronize()
                start.record()
                run()
                stop.record()
                torch.cuda.synchronize()
                dt = start.elapsed_time(stop) / 1e3
            else:
                t0 = time.perf_counter()
                run()
                dt = time.perf_counter() - t0
            if sync is not None:
                dt = sync(dt)
            if it >= warmup:
                times[name].append(dt)
    return times


def paired_ratio(times: List[float], baseline: List[float]) -> float:
    """Median over rounds of ``times[i] / baseline[i]``.

    The cases of a shape run interleaved, one round after another, so a case's run and the
    baseline's run of the same round lie seconds apart, and a slowdown of the machine that lasts
    longer than a round slows both: the per-round ratio cancels it, where a ratio of medians
    compares runs minutes apart.
    """
    if len(times) != len(baseline) or not times:
        raise ValueError(f'{len(times)} timed runs against {len(baseline)} of the baseline.')
    return statistics.median(t / b for t, b in zip(times, baseline))


def summarise(times: Dict[str, List[float]], baseline: str) -> Dict[str, dict]:
    """Per run: its times, their median, the paired ratio to ``baseline`` and the ratio of
    medians."""
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        out[name] = {'times': ts, 'time': statistics.median(ts),
                     'ratio': 1.0 if name == baseline else paired_ratio(ts, base),
                     'ratio_of_medians': statistics.median(ts) / statistics.median(base)}
    return out


def peak_extra_bytes(run: Callable[[], None], device) -> Optional[int]:
    """Peak CUDA memory of one untimed ``run`` above what was allocated before (None off CUDA:
    the CPU instruments are :mod:`~lossbench.memory`'s, through :meth:`Case.memory`)."""
    if not is_cuda(device):
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_cases(cases: Dict[str, Case], repeats: int, warmup: int,
               sync: Optional[Callable[[float], float]] = None) -> Dict[str, List[float]]:
    """fwd+bwd seconds of every case (CPU), interleaved; gradients reset and garbage collected
    before each run."""
    def before(name):
        cases[name].reset()
        gc.collect()

    times = time_interleaved({name: case.step for name, case in cases.items()}, repeats, warmup,
                             before=before, sync=sync)
    for case in cases.values():
        case.reset()
    return times


def measure(cases: Dict[str, Case], repeats: int, warmup: int, sync=None) -> Dict[str, dict]:
    # The gc.collect() before every run walks every object alive: with megatron imported, 0.4 s
    # each on a busy machine, most of a --quick run. Frozen objects (what exists now: modules,
    # the cases themselves, all alive throughout) are not walked; the runs' own garbage still is.
    gc.collect()
    gc.freeze()
    try:
        times = time_cases(cases, repeats, warmup, sync)
        out = {}
        for name, case in cases.items():
            mem = case.memory()
            out[name] = {'times': times[name], 'time': statistics.median(times[name]), **mem}
    finally:
        gc.unfreeze()
    return out
