#!/usr/bin/env python3
"""Run the unit tests a patch ships (``tests/unit_tests/transformer/test_mtp_loss_type.py``) in
a patched tree, on two ranks, as Megatron-LM's CI runs its unit tests (torchrun, pytest).

    python tools/run_upstream_tests.py                    # the cached patched megatron-core 0.19.2
    python tools/run_upstream_tests.py --tree /tmp/v-nvidia-main   # a patched Megatron-LM tree

On a CPU the ranks use gloo (``-p mtp_tv_dev.megatron_unit_tests``: Megatron's ``Utils`` and the
CPU shims); the CUDA-only cases are skipped by their own marks, and any other skip fails the run.
A tree without Megatron-LM's ``tests/unit_tests/test_utilities.py`` (the megatron-core wheel)
gets the stand-in ``mtp_tv_dev/stand_ins/megatron_tests`` in a copy of its ``tests/``. Exit
status: torchrun's (non-zero if a rank failed), or 1 for an unexpected skip.
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAND_IN = REPO / 'mtp_tv_dev' / 'stand_ins' / 'megatron_tests'
TEST_FILE = 'tests/unit_tests/transformer/test_mtp_loss_type.py'
#: The one reason a case may be skipped on a CPU.
CUDA_ONLY = 'the Triton row kernels need CUDA'
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def _scaffold(tree: Path, scratch: Path) -> Path:
    """The folder to run from: ``tree`` itself if it has Megatron-LM's test utilities, else
    ``scratch`` holding the stand-in's ``tests/`` and the tree's shipped test."""
    if (tree / 'tests' / 'unit_tests' / 'test_utilities.py').exists():
        return tree
    shutil.copytree(STAND_IN / 'tests', scratch / 'tests')
    target = scratch / TEST_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / '__init__.py').touch()
    shutil.copy(tree / TEST_FILE, target)
    return scratch


def run(tree: Path, pytest_args=(), quiet: bool = False) -> int:
    """Runs the shipped test file of patched ``tree`` on two ranks; returns the exit status
    (``quiet``: the output only if it failed)."""
    if not (tree / TEST_FILE).exists():
        print(f'{tree} has no {TEST_FILE}: not a patched tree', file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix='mtp_tv_upstream_') as scratch:
        root = _scaffold(tree, Path(scratch))
        env = dict(os.environ)
        env.pop('MEGATRON_MTP_TV', None)  # the plugin's start-up hook stays off
        env['PYTHONPATH'] = os.pathsep.join(
            dict.fromkeys([str(root), str(tree), str(REPO), *filter(None, [env.get('PYTHONPATH')])])
        )
        env.setdefault('OMP_NUM_THREADS', '1')
        cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={RANKS}',
               f'--master-port={_free_port()}', '-m', 'pytest', TEST_FILE, '-q', '-rs',
               '-p', 'no:cacheprovider', '-p', 'mtp_tv_dev.megatron_unit_tests',
               '--noconftest', *pytest_args]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    skipped = re.findall(r'^SKIPPED \[\d+\] [^:]+:\d+: (.*)$', out, re.M)
    unexpected = sorted({reason for reason in skipped if reason != CUDA_ONLY})
    status = proc.returncode or (1 if unexpected else 0)
    if status or not quiet:
        print(out)
    if proc.returncode == 0 and unexpected:
        print(f'unexpected skips: {unexpected}', file=sys.stderr)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tree', type=Path,
                        help='a patched tree (default: the cached patched megatron-core 0.19.2)')
    parser.add_argument('pytest_args', nargs='*', help='after --: more pytest arguments')
    args = parser.parse_args()
    tree = args.tree
    if tree is None:
        sys.path.insert(0, str(REPO / 'tools'))
        from run_patched_suite import cached_patched_tree

        tree = cached_patched_tree()
    return run(tree.resolve(), args.pytest_args)


if __name__ == '__main__':
    sys.exit(main())
