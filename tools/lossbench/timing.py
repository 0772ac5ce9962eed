"""Timing: every case of a shape run in turn (interleaved, so that a noisy machine slows all of
them alike), the median kept, and one untimed run per case for its memory.
"""

import gc
import statistics
import time
from typing import Callable, Dict, List, Optional

from .cases import Case


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
