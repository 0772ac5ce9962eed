"""Generate the ``git apply`` patches in ``patches/`` from the package source.

The command line of ``tools/make_patches.py`` (the usage is in :mod:`patchgen`): regenerate every
patch whose pristine tree it can reach, update the others offline, ``--check`` for staleness, or
``--tree`` a patch for any checkout.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .checkout import patch_tree
from .describe import description_path, render_description
from .layout import PATCH_DIR, REPO, PatchError
from .offline import check_offline, regenerate_offline
from .render import render_patch
from .sources import pristine_files
from .targets import TARGETS


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--check', action='store_true',
                        help='do not write; exit 1 if a committed patch is stale')
    parser.add_argument('--megatron-lm', type=Path, action='append',
                        help='a clone of Megatron-LM (bare or not: radixark/Megatron-LM, '
                        'NVIDIA/Megatron-LM) holding the pinned commits; repeat for several '
                        '(default: $MTP_TV_MEGATRON_LM, os.pathsep-separated); without one the '
                        'git-target patches are only checked offline')
    parser.add_argument('--target', action='append', choices=sorted(TARGETS),
                        help='only these targets (default: all)')
    parser.add_argument('--tree', type=Path,
                        help='write a patch for this checkout (its HEAD; or an unpacked '
                        'megatron-core) instead, facts derived from the tree, checked with '
                        'git apply --check')
    parser.add_argument('-o', '--output', type=Path,
                        help='with --tree: the patch file (default: ./megatron-mtp-tv-<commit>.patch)')
    args = parser.parse_args(argv)
    if args.tree is not None:
        try:
            path = patch_tree(args.tree, args.output)
        except PatchError as exc:
            print(f'make_patches.py --tree: {exc}', file=sys.stderr)
            return 2
        print(f'wrote {path} (git apply --check passed in {args.tree}); apply it with:\n'
              f'  git -C {args.tree} apply {path}')
        return 0
    if args.megatron_lm is None:
        args.megatron_lm = os.environ.get('MTP_TV_MEGATRON_LM')

    stale = False
    for name in args.target or list(TARGETS):
        target = TARGETS[name]
        files = pristine_files(target, args.megatron_lm)
        committed = target.patch_path.read_text() if target.patch_path.exists() else None
        if files is None:
            if committed is None:
                print(f'{name}: no patch and no tree to generate it from (--megatron-lm with a '
                      f'clone of {target.repo})')
                stale = True
                continue
            problems = check_offline(target, committed)
            if not problems:
                print(f'{name}: up to date (offline check: package files and rendered edits)')
            elif args.check:
                for p in problems:
                    print(f'{name}: STALE: {p}')
                stale = True
            else:
                target.patch_path.write_text(regenerate_offline(target, committed))
                print(f'{name}: wrote {target.patch_path.relative_to(REPO)} (offline: package '
                      'files and rendered edits re-rendered, the tree\'s context kept)')
            continue
        text = render_patch(target, files)
        if committed == text:
            print(f'{name}: up to date')
        elif args.check:
            print(f'{name}: STALE: regenerate with python tools/make_patches.py')
            stale = True
        else:
            PATCH_DIR.mkdir(exist_ok=True)
            target.patch_path.write_text(text)
            print(f'{name}: wrote {target.patch_path.relative_to(REPO)}')
    for name in args.target or list(TARGETS):
        stale |= _describe(TARGETS[name], args.check)
    return 1 if stale else 0


def _describe(target, check: bool) -> bool:
    """Write (or with ``check``, compare) the patch's pull-request description; True: stale."""
    if not target.patch_path.exists():
        return False
    path = description_path(target)
    text = render_description(target, target.patch_path.read_text())
    if path.exists() and path.read_text() == text:
        return False
    if check:
        print(f'{target.name}: STALE: {path.relative_to(REPO)}')
        return True
    path.write_text(text)
    print(f'{target.name}: wrote {path.relative_to(REPO)}')
    return False
