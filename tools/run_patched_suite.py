#!/usr/bin/env python3
"""Run the test suite against megatron-core 0.19.2 patched with ``patches/megatron-core-0.19.2.patch``.

    python tools/run_patched_suite.py                 # what `make test` runs after the plugin suite
    python tools/run_patched_suite.py -- tests/test_model_tv.py -x   # pytest arguments after --
    python tools/run_patched_suite.py --keep /tmp/t   # keep the patched tree there

Steps: take the registry wheel of megatron-core 0.19.2 (cached in $MTP_TV_CACHE or else
~/.cache/megatron-mtp-tv, created if missing; downloaded with pip, sha256-pinned), unpack it, ``git apply`` the patch at its root
(the result is cached next to the wheel, keyed by the sha256 of wheel and patch, with its .pyc
files; --fresh builds a throw-away one), and run pytest with ``MTP_TV_MODE=patch`` and the tree first
on ``PYTHONPATH``: ``mtp_tv_dev/patch_mode.py`` then makes every ``megatron.mtp_tv`` import resolve to the
tree's ``megatron.core.transformer.mtp_tv`` and skips the plugin's ``install()``, so what is tested
is the patched tree alone (the start-up hook is switched off too). With the default test files it
then runs the unit tests the patch ships, in the tree (``tools/run_upstream_tests.py``). Exit
status: pytest's, else theirs.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / 'tools'))

from patchgen import sources  # noqa: E402
from patchgen.targets import TARGETS  # noqa: E402

PATCH = TARGETS['megatron-core-0.19.2'].patch_path

#: What runs against the patched tree by default: every test that goes through Megatron code the
#: patch changes (config fields and validation, the generated CLI, GPTModel's MTP loss in all
#: parallel layouts, HybridModel's, args forwarding, the examples). The loss math itself (linear_tv, the
#: kernels, the verifier) is byte-identical in both places (tests/test_patches.py checks that)
#: and runs once, in plugin mode.
PATCH_MODE_TESTS = (
    'tests/test_config_cli.py',
    'tests/test_model_tv.py',
    'tests/test_main_logits.py',
    'tests/test_hybrid_model.py',
    'tests/test_parallel.py',
    'tests/test_tp_cp.py',
    'tests/test_pipeline_layout.py',
    'tests/test_fused_wgrad.py',
    'tests/test_fused_wgrad_pp.py',
    'tests/test_flops.py',
    'tests/test_chunked_ce.py',
    'tests/test_args_forwarding.py',
    'tests/test_args_guard.py',
    'tests/test_bridge.py',
    'tests/test_examples.py',
    'tests/test_upstream_names.py',
)


def unpack_and_patch(dest: Path) -> Path:
    """Unpack the 0.19.2 wheel's ``megatron/`` into ``dest`` and apply the patch there."""
    with zipfile.ZipFile(sources.wheel_path()) as zf:
        members = [m for m in zf.namelist() if m.startswith('megatron/')]
        zf.extractall(dest, members)
        for info in zf.infolist():  # keep the compiled helper executable bits
            if info.filename in members and info.external_attr >> 16:
                os.chmod(dest / info.filename, (info.external_attr >> 16) & 0o777 or 0o644)
    for args in (['--check'], []):
        subprocess.run(['git', 'apply', *args, str(PATCH)], cwd=dest, check=True)
    return dest


def cached_patched_tree() -> Path:
    """The patched tree in the cache, rebuilt when the wheel or the patch changed.

    Reusing it keeps its compiled .pyc files: compiling a fresh megatron-core costs a minute on
    two cores, in every process the tests spawn until the first one has written them.
    """
    key = hashlib.sha256(
        (sources.WHEEL_SHA256 + hashlib.sha256(PATCH.read_bytes()).hexdigest()).encode()
    ).hexdigest()[:16]
    cache = sources.cache_dir()  # creates it: on a fresh machine nothing else has
    tree = cache / f'megatron-core-0.19.2-patched-{key}'
    stamp = tree / '.complete'
    if stamp.exists():
        return tree
    for old in cache.glob('megatron-core-0.19.2-patched-*'):
        shutil.rmtree(old, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix='building-', dir=cache))
    unpack_and_patch(building)
    subprocess.run([sys.executable, '-m', 'compileall', '-q', '-j', '0', str(building / 'megatron')],
                   check=False, stdout=subprocess.DEVNULL)
    (building / '.complete').write_text(key + '\n')
    building.rename(tree)
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--keep', type=Path, help='build the patched tree here and keep it')
    parser.add_argument('--fresh', action='store_true',
                        help='build in a temporary directory instead of reusing the cached tree')
    parser.add_argument('pytest_args', nargs='*',
                        help='after --: pytest arguments; test paths replace the default '
                        'PATCH_MODE_TESTS files (tests for the whole suite)')
    args = parser.parse_args()

    start = time.time()
    tmp = None
    if args.keep:
        if args.keep.exists():
            shutil.rmtree(args.keep)
        tree = unpack_and_patch(args.keep)
    elif args.fresh:
        tmp = tempfile.TemporaryDirectory(prefix='mtp_tv_patched_')
        tree = unpack_and_patch(Path(tmp.name))
    else:
        tree = cached_patched_tree()
    print(f'patched megatron-core 0.19.2 at {tree} ({time.time() - start:.1f}s)', flush=True)

    env = dict(os.environ)
    env.pop('MEGATRON_MTP_TV', None)  # the plugin's start-up hook stays off
    env['MTP_TV_MODE'] = 'patch'
    env['MTP_TV_TREE'] = str(tree)
    env['PYTHONPATH'] = os.pathsep.join([str(tree)] + [p for p in [env.get('PYTHONPATH')] if p])
    selection = [a for a in args.pytest_args if not a.startswith('-')]
    whole_stage = not selection
    if whole_stage:  # only options given: keep the default test files
        selection = [t for t in PATCH_MODE_TESTS if (REPO / t).exists()]
    options = [a for a in args.pytest_args if a.startswith('-')]
    cmd = [sys.executable, '-m', 'pytest', '-q', '-ra', '-p', 'no:cacheprovider', *options,
           *selection]
    try:
        status = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if whole_stage:  # and the unit tests the patch ships, in the tree, on two gloo ranks
            from run_upstream_tests import TEST_FILE, run

            start = time.time()
            upstream = run(tree, quiet=True)
            print(f'{TEST_FILE} in the patched tree, 2 ranks: '
                  f'{"passed" if upstream == 0 else "FAILED"} ({time.time() - start:.0f}s)',
                  flush=True)
            status = status or upstream
        return status
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == '__main__':
    sys.exit(main())
