"""Run code under megatron's parallel state on CPU: gloo worker processes, or the current process.

* :func:`spawn` starts ``world_size`` worker processes, each with a gloo process group, megatron's
  model-parallel groups (TP x CP x DP), the CPU shims and a seeded RNG, runs ``fn(rank, *args)``
  and returns every rank's (picklable) return value, indexed by rank. A worker's exception is
  re-raised in the parent with the worker's traceback; on the first failure or on timeout all
  workers are killed, so a test never hangs.
* :func:`single_process` does the same set-up for world size 1 inside the current process (a
  context manager; :func:`run_single_process` is the function form).

Workers are started with the ``forkserver`` method and the fork server pre-imports megatron, so
each :func:`spawn` costs a fork (~0.1 s) instead of a fresh interpreter importing torch and
megatron (~6 s on the 2-core CI machine). The fork server is a clean single-threaded process
(no CUDA, no process group), which is what makes forking from it safe. Set
``MTP_TV_START_METHOD=spawn`` to use plain spawn instead.

``fn`` and ``args`` are pickled: ``fn`` must be a module-level function of an importable module
(pytest test modules are fine). As with any non-fork start method, a *script* that calls
:func:`spawn` must do so under ``if __name__ == "__main__":``: workers re-import the main module.
Workers inherit the fork server's stdout/stderr (under pytest: the capture of the test that
started it), so look at the :class:`WorkerError` message, which carries each failing rank's
traceback, rather than at worker prints.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue as queue_module
import random
import time
import traceback
from typing import Any, Callable, Iterator, List, Optional

import torch

from mtp_tv_dev.cpu import apply_cpu_shims, cpu_shims_applied, remove_cpu_shims

__all__ = [
    "WorkerError",
    "spawn",
    "single_process",
    "run_single_process",
    "seed_everything",
    "reset_mtp_tracker",
    "reset_megatron_state",
    "keeps_world",
]

DEFAULT_TIMEOUT = 120.0
DEFAULT_SEED = 1234
# Modules the fork server imports once, so that forked workers start warm. (Our testing modules
# import megatron lazily, so megatron's heavy modules must be named here explicitly.)
_PRELOAD = [
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.multi_token_prediction",
    "mtp_tv_dev.distributed",
    "mtp_tv_dev.models",
    "mtp_tv_dev.packed",
]


class WorkerError(RuntimeError):
    """A worker of :func:`spawn` raised, died or timed out. The message holds its traceback."""


def seed_everything(seed: int) -> None:
    """Seed python, numpy (if present), torch, and megatron's model-parallel RNG tracker.

    Requires the CPU shims and an initialised parallel state (for the tracker).
    """
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional here
        pass
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # Seeds the data-parallel ("default") state with `seed` (== the CPU generator under the
    # shims) and the tensor-parallel tracker state with seed + 2718 + tp_rank.
    model_parallel_cuda_manual_seed(seed)


def reset_mtp_tracker() -> None:
    """Empty megatron's class-level MTP logging tracker (``MTPLossLoggingHelper.tracker``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    # Clear in place: the dict object is shared by reference with anyone who imported it.
    MTPLossLoggingHelper.tracker.clear()


def reset_megatron_state() -> None:
    """Reset megatron's process-global state that leaks between tests: the model-parallel groups
    (and the global memory buffer, which ``destroy_model_parallel`` drops), the model-parallel
    RNG tracker (its states are CPU generator states under the shims), the MTP logging tracker
    and the MTP loss auto-scaler's backward scale. Does not touch torch.distributed."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    parallel_state.destroy_model_parallel()
    if tp_random._CUDA_RNG_STATE_TRACKER is not None:
        tp_random._CUDA_RNG_STATE_TRACKER.reset()
    reset_mtp_tracker()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _initialise(rank: int, world_size: int, tp: int, cp: int, seed: int, store, timeout: float):
    import torch.distributed as dist
    from megatron.core import parallel_state

    apply_cpu_shims()
    if world_size % (tp * cp) != 0:
        raise ValueError(f"world_size={world_size} is not a multiple of tp*cp={tp}*{cp}")
    dist.init_process_group(
        backend="gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        # The default backend is already gloo: no need for a second set of gloo groups.
        create_gloo_process_groups=False,
        distributed_timeout_minutes=max(1, int(timeout // 60) + 1),
    )
    reset_mtp_tracker()
    seed_everything(seed)


def _teardown() -> None:
    import torch.distributed as dist

    reset_megatron_state()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank, world_size, tp, cp, seed, port, timeout, threads, fn_bytes, result_queue):
    """Body of one worker process. Always reports exactly one message to the parent."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size=None,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        fn, args = pickle.loads(fn_bytes)
        _initialise(rank, world_size, tp, cp, seed, store, timeout)
        try:
            result = fn(rank, *args)
        finally:
            _teardown()
        # Pickle here, not in the queue's feeder thread, so that an unpicklable result is
        # reported as this rank's error instead of being lost.
        payload = pickle.dumps(result)
        result_queue.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        result_queue.put((rank, False, traceback.format_exc()))


_CONTEXT = None


def _context():
    """The multiprocessing context for workers (see the module docstring)."""
    global _CONTEXT
    if _CONTEXT is None:
        method = os.environ.get("MTP_TV_START_METHOD", "forkserver")
        if method not in multiprocessing.get_all_start_methods():
            method = "spawn"
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _kill(processes) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    cp: int = 1,
    seed: int = DEFAULT_SEED,
    timeout: float = DEFAULT_TIMEOUT,
) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo worker processes; return results by rank.

    Each worker has: the CPU shims applied, ``torch.distributed`` initialised (gloo),
    ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    context_parallel_size=cp)`` (data parallel takes the rest), every RNG seeded with ``seed``
    (megatron's TP tracker with ``seed + 2718 + tp_rank`` as usual), and the parent's torch
    threads shared among them (at least one each). The parallel state and process group are
    destroyed after ``fn`` returns.

    Raises :class:`WorkerError` (with the worker tracebacks) when a worker raises, dies, or the
    whole run exceeds ``timeout`` seconds; all workers are killed first. ``timeout`` also bounds
    every collective inside the workers.
    """
    import torch.distributed as dist

    if world_size < 1 or tp < 1 or cp < 1 or world_size % (tp * cp) != 0:
        raise ValueError(
            f"need world_size >= 1 divisible by tp * cp, got world_size={world_size}, "
            f"tp={tp}, cp={cp}"
        )
    fn_bytes = pickle.dumps((fn, args))
    threads = max(1, torch.get_num_threads() // world_size)
    ctx = _context()
    # The parent hosts the rendezvous store on a port the OS picks (port 0): no free-port race.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    result_queue = ctx.Queue()
    processes = []
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, tp, cp, seed, store.port, timeout, threads, fn_bytes,
                      result_queue),
                name=f"mtp_tv-worker-{rank}",
                daemon=True,
            )
            proc.start()
            processes.append(proc)

        results: dict = {}
        errors: dict = {}
        first_error_at: Optional[float] = None
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            # After the first failure give the others a moment to report (their errors are
            # usually "peer closed the connection"), then stop waiting.
            if first_error_at is not None and now - first_error_at > 2.0:
                break
            if now > deadline:
                missing = [r for r in range(world_size) if r not in results and r not in errors]
                errors.setdefault(
                    min(missing),
                    f"timed out after {timeout:.0f}s; ranks {missing} had not finished",
                )
                break
            try:
                rank, ok, payload = result_queue.get(timeout=0.1)
            except queue_module.Empty:
                # A worker that died without reporting (segfault, OOM kill, os._exit).
                for rank, proc in enumerate(processes):
                    if (
                        proc.exitcode is not None
                        and rank not in results
                        and rank not in errors
                        and result_queue.empty()
                    ):
                        errors[rank] = f"worker exited with code {proc.exitcode} without reporting"
                        first_error_at = first_error_at or time.monotonic()
                continue
            if ok:
                results[rank] = payload
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()

        if errors:
            _kill(processes)
            report = "\n".join(
                f"----- rank {rank} -----\n{text}" for rank, text in sorted(errors.items())
            )
            raise WorkerError(
                f"{len(errors)} of {world_size} worker(s) of {getattr(fn, '__qualname__', fn)} "
                f"failed (tp={tp}, cp={cp}):\n{report}"
            )
        for proc in processes:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
        return [pickle.loads(results[rank]) for rank in range(world_size)]
    finally:
        _kill(processes)
        result_queue.close()
        result_queue.join_thread()
        del store


_SINGLE_DEPTH = 0
_SINGLE_OWNS_SHIMS = False


class _KeptWorld:
    """The world of one that :func:`single_process` built in this process, kept between uses.

    Megatron's ``initialize_model_parallel`` builds about twenty gloo groups, and tearing a gloo
    group down joins its event-loop thread, which wakes every 10 ms: 0.1-0.25 s a use, most of
    a small test's time. So the groups are built once per process: on exit megatron's parallel
    state is reset as before (its globals are None, ``model_parallel_is_initialized()`` is False),
    and the next use restores the globals that ``initialize_model_parallel`` left, whatever a
    test changed in between.
    """

    world = None  # torch's default group of the kept world
    megatron_globals: dict = {}

    @classmethod
    def is_current(cls) -> bool:
        import torch.distributed as dist

        return cls.world is not None and dist.is_initialized() and dist.group.WORLD is cls.world

    @classmethod
    def build(cls, seed: int, timeout: float) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        _initialise(0, 1, 1, 1, seed, dist.HashStore(), timeout)
        cls.world = dist.group.WORLD
        cls.megatron_globals = {name: value for name, value in vars(parallel_state).items()
                                if name.startswith('_') and name[1:2].isupper()}

    @classmethod
    def enter(cls, seed: int) -> None:
        from megatron.core import parallel_state

        vars(parallel_state).update(cls.megatron_globals)
        reset_mtp_tracker()
        seed_everything(seed)


def keeps_world() -> bool:
    """True if torch.distributed's default group is the world of one :func:`single_process` keeps
    for its next use (tests/conftest.py leaves that one initialised between tests)."""
    return _KeptWorld.is_current()


@contextlib.contextmanager
def single_process(seed: int = DEFAULT_SEED, timeout: float = DEFAULT_TIMEOUT) -> Iterator[None]:
    """World size 1 in the current process: CPU shims, gloo group, megatron TP=CP=1, seeded RNGs.

    Re-entrant: a nested ``single_process`` reuses the outer set-up (and only re-seeds). On the
    outermost exit the megatron parallel state, the RNG tracker, the MTP tracker, the MTP loss
    scale and (if this function applied them) the CPU shims are torn down, so consecutive tests
    start clean; the gloo groups are kept for the next use (:class:`_KeptWorld`). Models built
    inside are meant to be used inside.
    """
    global _SINGLE_DEPTH, _SINGLE_OWNS_SHIMS
    import torch.distributed as dist

    if _SINGLE_DEPTH == 0:
        _SINGLE_OWNS_SHIMS = not cpu_shims_applied()
        apply_cpu_shims()
        if _KeptWorld.is_current():
            _KeptWorld.enter(seed)
        elif not dist.is_initialized():
            _KeptWorld.build(seed, timeout)
        else:
            # Someone else set up torch.distributed (e.g. a caller under torchrun): use it.
            if dist.get_world_size() != 1:
                raise RuntimeError(
                    "single_process() needs world size 1, but torch.distributed is already "
                    f"initialised with world size {dist.get_world_size()}"
                )
            from megatron.core import parallel_state

            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
            reset_mtp_tracker()
            seed_everything(seed)
    else:
        seed_everything(seed)
    _SINGLE_DEPTH += 1
    try:
        yield
    finally:
        _SINGLE_DEPTH -= 1
        if _SINGLE_DEPTH == 0:
            reset_megatron_state()
            if _SINGLE_OWNS_SHIMS:
                # Leave torch.cuda as we found it: a later GPU test in the same process needs
                # the real current_device / RNG functions.
                remove_cpu_shims()
                _SINGLE_OWNS_SHIMS = False


def run_single_process(fn: Callable[..., Any], *args: Any, seed: int = DEFAULT_SEED) -> Any:
    """``fn(0, *args)`` inside :func:`single_process` (the in-process twin of :func:`spawn`)."""
    with single_process(seed=seed):
        return fn(0, *args)
