# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Run a Megatron script with the plugin installed, without editing the script.

    torchrun --nproc-per-node 8 -m megatron.mtp_tv.launch pretrain_gpt.py <usual args> \\
        --mtp-loss-type tv --mtp-tv-chunk 512
    python -m megatron.mtp_tv.launch path/to/script.py args...
    python -m megatron.mtp_tv.launch -m some.module args...

:func:`megatron.mtp_tv.install` runs first, then the script runs exactly as ``python script.py
args...`` would run it: as ``__main__``, with ``sys.argv == [script, *args]``, with the script's
directory first on ``sys.path`` (so ``pretrain_gpt.py`` finds ``gpt_builders``, ``model_provider``
and the checkout's ``megatron`` next to it; for a symlinked script, the directory of the file it
links to, as Python does), and with its exit code and exceptions propagating
unchanged (``sys.exit(3)`` exits 3; an uncaught exception prints its traceback and exits 1).
``-m module`` runs a module the way ``python -m module`` does.

Plugin-only: patches do not carry this module (a patched tree needs no launcher).
"""

import os
import runpy
import sys

USAGE = 'usage: python -m megatron.mtp_tv.launch (SCRIPT | -m MODULE) [ARGS...]'


def main(argv=None) -> None:
    """Install the plugin and run the script (or module) named in ``argv`` as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(USAGE + '\n\n' + __doc__.strip().split('\n\n', 1)[1], file=sys.stderr)
        raise SystemExit(0 if argv else 2)

    if argv[0] == '-m':
        if len(argv) < 2:
            raise SystemExit(USAGE)
        module, args = argv[1], argv[2:]
        target = None
    else:
        target, args = argv[0], argv[1:]
        if not os.path.exists(target):
            raise SystemExit(f'megatron.mtp_tv.launch: {target}: no such file')

    # As `python script.py` would: the script's directory replaces this launcher's sys.path[0]
    # (for `python -m megatron.mtp_tv.launch` that entry is the current directory). Set before
    # install() so a Megatron-LM checkout next to the script is the megatron that gets patched.
    # realpath, not abspath: Python resolves symlinks here, so a linked script finds the modules
    # next to the file it links to, not those next to the link.
    if target is not None:
        sys.path[0] = os.path.dirname(os.path.realpath(target))

    from megatron.mtp_tv import install

    install()

    if target is None:
        sys.argv = [module, *args]  # runpy replaces argv[0] with the module's file
        runpy.run_module(module, run_name='__main__', alter_sys=True)
    else:
        sys.argv = [target, *args]
        runpy.run_path(target, run_name='__main__')


if __name__ == '__main__':
    main()
