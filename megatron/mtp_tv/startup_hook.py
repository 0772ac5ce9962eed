"""Install the plugin at interpreter start-up, for programs you do not launch yourself.

A one-line ``megatron_mtp_tv.pth`` file in site-packages runs at every interpreter start-up::

    import os; os.environ.get('MEGATRON_MTP_TV', '0') not in ('', '0') and __import__('megatron.mtp_tv.startup_hook')

* ``MEGATRON_MTP_TV`` unset, empty or ``0`` (the default): nothing else happens; the cost is that
  one environment lookup (``os`` is already imported by ``site``).
* ``MEGATRON_MTP_TV=1``: this module is imported and calls :func:`megatron.mtp_tv.install`, which
  imports megatron-core (and torch) in *every* Python process that sees the variable, whether it
  uses Megatron or not (measured: ``tools/measure_startup_hook.py``). Set it only in the
  environment of the training processes (e.g. ``env MEGATRON_MTP_TV=1 torchrun ...``, or a Ray
  job's ``runtime_env``); child processes inherit it.

Turn it off with ``unset MEGATRON_MTP_TV`` (or ``MEGATRON_MTP_TV=0``); remove the file with
``python -m megatron.mtp_tv.startup_hook uninstall``. Manage the file::

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
PTH_NAME = 'megatron_mtp_tv.pth'
PTH_LINE = (
    f"import os; os.environ.get('{ENV}', '0') not in ('', '0') "
    "and __import__('megatron.mtp_tv.startup_hook')\n"
)


def enabled() -> bool:
    """Whether the environment asks for the plugin at start-up."""
    return os.environ.get(ENV, '0') not in ('', '0')


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
        print(f'{path}: {"present" if os.path.exists(path) else "absent"}; '
              f'{ENV}={os.environ.get(ENV, "")!r} ({"on" if enabled() else "off"})')
    return 0


if __name__ == '__main__':
    sys.exit(_cli(sys.argv[1:]))
elif enabled():
    _install_at_startup()
