# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Install the plugin at interpreter start-up, for programs you do not launch yourself.

A one-line ``megatron_mtp_tv.pth`` file in site-packages runs at every interpreter start-up
(:data:`PTH_LINE`). It reads ``MEGATRON_MTP_TV`` (case and surrounding blanks ignored):

* unset, empty, ``0``, ``false``, ``no`` or ``off`` (the default): nothing else happens; the cost
  is that one environment lookup (``os`` and ``sys`` are already imported by ``site``).
* ``1``, ``true``, ``yes`` or ``on``: this module is imported and calls
  :func:`megatron.mtp_tv.install`, which imports megatron-core (and torch) in *every* Python
  process that sees the variable, whether it uses Megatron or not (measured:
  ``tools/measure_startup_hook.py``). Set it only in the environment of the training processes
  (e.g. ``env MEGATRON_MTP_TV=1 torchrun ...``, or a Ray job's ``runtime_env``); child processes
  inherit it.
* anything else (a typo, ``2``, ``enabled``): one line on stderr naming the value and the accepted
  spellings, and the hook stays off. Off, not on, because a value the hook cannot read must not
  import torch and megatron-core into every process; the warning is decided in the line itself,
  so even it imports nothing.

Turn it off with ``unset MEGATRON_MTP_TV`` (or ``MEGATRON_MTP_TV=0`` or ``false``); remove the
file with ``python -m megatron.mtp_tv.startup_hook uninstall``. Manage the file::

    python -m megatron.mtp_tv.startup_hook install     # write the .pth into this interpreter's site-packages
    python -m megatron.mtp_tv.startup_hook uninstall   # remove it
    python -m megatron.mtp_tv.startup_hook status

``pip install <this repo>`` puts the file in site-packages (setup.py); an editable install does
not, run ``install`` above once. If the plugin cannot be installed at start-up (torch or
megatron-core missing, an incompatible megatron-core), the program still runs, without the
plugin: ``site`` prints the traceback (or, for a failing ``install()``, one line) to stderr, and
the program then fails on its first ``--mtp-loss-type`` flag.

Plugin-only: patches do not carry this module.
"""

import os
import sys

ENV = 'MEGATRON_MTP_TV'
#: Values of ``MEGATRON_MTP_TV`` (lower-cased, blanks stripped) that turn the hook on / off.
ON_VALUES = ('1', 'true', 'yes', 'on')
OFF_VALUES = ('', '0', 'false', 'no', 'off')
#: Printed (``%`` the raw value) for any other value; the hook then stays off.
UNRECOGNISED_WARNING = (
    f'megatron.mtp_tv: {ENV}=%r is not recognised, so the start-up hook stays off '
    f'(on: {", ".join(ON_VALUES)}; off: unset, empty, {", ".join(OFF_VALUES[1:])}; any case)\n'
)
PTH_NAME = 'megatron_mtp_tv.pth'
#: The .pth line. ``site`` executes it in every interpreter, so it decides by itself, with the
#: ``os`` and ``sys`` modules ``site`` has already imported: off and unrecognised values import
#: nothing (not even this package, whose ``__init__`` imports torch); only on values import this
#: module, which installs the plugin. ``site`` runs a line only if it starts with ``import``.
PTH_LINE = (
    f"import os, sys; v = os.environ.get({ENV!r}, '').strip().lower(); "
    f"v in {ON_VALUES!r} and __import__('megatron.mtp_tv.startup_hook'); "
    f"v in {ON_VALUES + OFF_VALUES!r} or "
    f"sys.stderr.write({UNRECOGNISED_WARNING!r} % (os.environ[{ENV!r}],))\n"
)


def state(value=None) -> str:
    """``'on'``, ``'off'`` or ``'unrecognised'`` (which is off too) for a ``MEGATRON_MTP_TV`` value.

    Args:
        value: The value to read; None reads the environment (unset counts as empty).
    """
    value = os.environ.get(ENV, '') if value is None else value
    key = value.strip().lower()
    if key in ON_VALUES:
        return 'on'
    return 'off' if key in OFF_VALUES else 'unrecognised'


def enabled() -> bool:
    """Whether the environment asks for the plugin at start-up (what :data:`PTH_LINE` decides)."""
    return state() == 'on'


def _install_at_startup() -> None:
    try:
        from megatron.mtp_tv import install

        install()
    except Exception as exc:  # never stop an unrelated program from starting
        print(
            f'megatron.mtp_tv: {ENV}={os.environ.get(ENV)} but install() failed ({exc!r}); '
            'running without the plugin.',
            file=sys.stderr,
        )


def site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()['purelib']


def _cli(argv) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog='python -m megatron.mtp_tv.startup_hook')
    parser.add_argument('action', choices=['install', 'uninstall', 'status'])
    parser.add_argument('--site-packages', default=None, help='default: this interpreter\'s')
    args = parser.parse_args(argv)
    path = os.path.join(args.site_packages or site_packages(), PTH_NAME)
    if args.action == 'install':
        with open(path, 'w') as f:
            f.write(PTH_LINE)
        print(f'wrote {path}; enable with {ENV}=1')
    elif args.action == 'uninstall':
        if os.path.exists(path):
            os.remove(path)
            print(f'removed {path}')
        else:
            print(f'{path} does not exist')
    else:
        print(
            f'{path}: {"present" if os.path.exists(path) else "absent"}; '
            f'{ENV}={os.environ.get(ENV, "")!r} ({state()}'
            f'{"" if state() != "unrecognised" else ": off"})'
        )
    return 0


if __name__ == '__main__':
    sys.exit(_cli(sys.argv[1:]))
elif enabled():
    _install_at_startup()
