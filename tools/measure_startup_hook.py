#!/usr/bin/env python3
"""Measure what the MEGATRON_MTP_TV start-up hook costs a Python process.

    python tools/measure_startup_hook.py [--runs 5]

Times (median wall clock of ``--runs`` fresh interpreters) a process that processes the hook's
.pth line the way ``site`` does at start-up and then exits, with ``MEGATRON_MTP_TV`` unset and set
to 1, against a bare ``python -c pass``; and, for scale, a process that imports megatron.core
itself. The .pth is written to a temporary directory, nothing is installed.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron.mtp_tv.startup_hook import ENV, PTH_LINE, PTH_NAME  # noqa: E402


def median_seconds(code, env, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, '-W', 'ignore', '-c', code], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--runs', type=int, default=5)
    args = parser.parse_args()
    base_env = {k: v for k, v in os.environ.items() if k != ENV}
    base_env['PYTHONPATH'] = os.pathsep.join(
        [str(REPO)] + [p for p in [base_env.get('PYTHONPATH')] if p])
    with tempfile.TemporaryDirectory() as d:
        Path(d, PTH_NAME).write_text(PTH_LINE)
        hook = f'import site; site.addsitedir({d!r})'
        rows = [
            ('python -c pass', 'pass', base_env),
            (f'hook, {ENV} unset', hook, base_env),
            (f'hook, {ENV}=1', hook, {**base_env, ENV: '1'}),
            ('import megatron.core (for scale)', 'import megatron.core', base_env),
        ]
        median_seconds('import megatron.core', base_env, 1)  # warm the .pyc and file caches
        for label, code, env in rows:
            print(f'{label:40s} {median_seconds(code, env, args.runs):7.3f} s', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
