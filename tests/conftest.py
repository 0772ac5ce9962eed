"""Shared pytest set-up.

* The repository root is put on sys.path, so the tests also run from a plain checkout without
  ``pip install -e .`` (``megatron`` is a namespace package: the checkout's ``megatron/mtp_tv`` and
  site-packages' ``megatron/core`` combine).
* megatron-core's CPU-irrelevant warnings are silenced (see ``quiet_megatron_warnings``).
* Every test starts and ends with the environment variables it started with, and without
  megatron parallel state, MTP logging tracker contents, a
  leftover process group (but the world of one ``single_process`` keeps for its next use) or the
  CPU shims applied, whatever the previous test did.
* Under pytest-xdist (``make test`` runs one worker per core) each worker keeps to its share of
  the cores, it and the processes it starts (see ``_share_the_cores``).
* Fixture ``megatron_cpu``: the body of the test runs inside ``single_process()`` (gloo world of
  one, TP=CP=1, CPU shims, seeded).

Multi-process tests: ``mtp_tv_dev.distributed.spawn(fn, world_size, *args, tp=, cp=)``
with ``fn`` a module-level function of the test module (it is pickled by name).
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _share_the_cores() -> None:
    """One worker per core, each with torch threads for its share: with torch's default of one
    thread per core in every worker the threads of two workers fight over the cores (on 2
    cores: a quarter more CPU time and no shorter suite)."""
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
    if workers <= 1:
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ['OMP_NUM_THREADS'] = str(threads)  # the demos and tools the tests run as subprocesses
    torch.set_num_threads(threads)


_share_the_cores()

#: The unit tests the patches ship (Megatron-LM's style, its ``tests.unit_tests`` package): they
#: run in a patched tree, by tools/run_upstream_tests.py, not in this suite.
collect_ignore = ['megatron_unit_tests']

# MTP_TV_MODE=patch (tools/run_patched_suite.py): megatron.mtp_tv is the patched tree's copy.
import patch_mode  # noqa: E402
from patch_mode import pytest_collection_modifyitems, pytest_configure  # noqa: E402,F401

if patch_mode.active():
    patch_mode.activate()

from mtp_tv_dev.cpu import quiet_megatron_warnings  # noqa: E402

quiet_megatron_warnings()


def _reset_if_megatron_loaded():
    from mtp_tv_dev.cpu import cpu_shims_applied, remove_cpu_shims

    # A test that applied the CPU shims itself: restore torch.cuda for the next (maybe GPU) test.
    if cpu_shims_applied():
        remove_cpu_shims()
    # Only when a test imported megatron: importing it just to reset costs seconds.
    if "megatron.core.parallel_state" not in sys.modules:
        return
    import torch.distributed as dist

    from mtp_tv_dev.distributed import keeps_world, reset_megatron_state

    reset_megatron_state()
    # A process group a test made goes; the world of one single_process() keeps does not (its
    # gloo groups cost 0.1-0.25 s to tear down, and megatron's state is reset above).
    if dist.is_available() and dist.is_initialized() and not keeps_world():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _clean_megatron_state():
    _reset_if_megatron_loaded()
    environ = dict(os.environ)  # Megatron's parse_args sets NVTE_* variables a later model reads
    yield
    os.environ.clear()
    os.environ.update(environ)
    _reset_if_megatron_loaded()


@pytest.fixture
def megatron_cpu():
    """Run the test inside ``single_process()``: world size 1, TP=CP=1, CPU shims, seed 1234."""
    from mtp_tv_dev.distributed import single_process

    with single_process():
        yield
