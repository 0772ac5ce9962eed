#!/usr/bin/env python3
"""Generate the ``git apply`` patches in ``patches/`` from the package source.

    python tools/make_patches.py                                   # all (git targets: offline update)
    python tools/make_patches.py --megatron-lm ~/src/Megatron-LM   # git targets from a clone (repeatable)
    python tools/make_patches.py --check [--megatron-lm ...]       # exit 1 if a patch is stale
    python tools/make_patches.py --tree ~/Megatron-LM [-o x.patch] # a patch for any checkout's HEAD

The generator is the package ``tools/patchgen`` (its modules: docs/patch_generator.md); this is
its command (``make patches``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, where patchgen is, if imported

from patchgen.cli import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
