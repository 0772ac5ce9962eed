#!/usr/bin/env python
"""Copy NVIDIA/Megatron-LM PR #6473's fused e2e-TV modules into a git-ignored folder, for the GPU
check to measure beside ``'e2e_tv'``. Never committed: the GPU machine reaches no network, so the
files travel with the working tree as a carried path.

    python tools/fetch_upstream_e2e_tv.py --git-dir /path/to/Megatron-LM/.git
    # then, on the GPU machine: carry .cache/upstream_pr6473 (docs/development.md)

``--git-dir`` is any clone or mirror of NVIDIA/Megatron-LM that holds the PR's head commit.
"""

import argparse
import os
import subprocess
import sys

#: PR #6473's head ("perf(mtp): fuse end-to-end TV objective").
COMMIT = '38be10fa21ae3e1fe6d47f2df6a26c43c26b2654'
FILES = ('megatron/core/fusions/fused_mtp_tv.py', 'megatron/core/fusions/fused_mtp_prefix.py')
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.cache',
                           'upstream_pr6473')


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--git-dir', required=True, help='a clone or mirror of NVIDIA/Megatron-LM')
    p.add_argument('--commit', default=COMMIT)
    p.add_argument('--out', default=DEFAULT_OUT)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for path in FILES:
        shown = subprocess.run(['git', '--git-dir', args.git_dir, 'show', f'{args.commit}:{path}'],
                               capture_output=True, text=True)
        if shown.returncode != 0:
            print(f'fetch_upstream_e2e_tv: {path} at {args.commit}: {shown.stderr.strip()}',
                  file=sys.stderr)
            return 1
        with open(os.path.join(args.out, os.path.basename(path)), 'w') as f:
            f.write(shown.stdout)
    with open(os.path.join(args.out, 'COMMIT'), 'w') as f:
        f.write(args.commit + '\n')
    print(f'wrote {len(FILES)} modules of {args.commit[:10]} to {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
