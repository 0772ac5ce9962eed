"""Which of the GPU check's carried wheels the device lacks (standard library only: it runs
before anything is installed).

The device image has torch, Triton, numpy and packaging; the check also needs megatron-core at
the version ``requirements.txt`` pins (the one place versions are pinned). A requirement is
``name==version`` (met by exactly that installed version) or ``name`` (met by any installed
version). Installing only what is unmet keeps the image's own builds, which match its CUDA.

    python3 tools/gpucheck/wheels.py --wheel-dir .gpu_wheels megatron-core==0.19.2 numpy packaging

prints the wheel files to install, one a line (none: everything is there), and what it found to
stderr; exit 3 when an unmet requirement has no wheel in ``--wheel-dir``.
"""

import argparse
import importlib.metadata
import os
import re
import sys
from typing import List, Optional, Tuple


class MissingWheel(RuntimeError):
    """An unmet requirement whose wheel was not carried."""


def parse(requirement: str) -> Tuple[str, Optional[str]]:
    """``'megatron-core==0.19.2'`` -> ``('megatron-core', '0.19.2')``; ``'numpy'`` -> ``('numpy',
    None)``."""
    name, _, version = requirement.strip().partition('==')
    return name.strip(), version.strip() or None


def installed(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(requirements: List[str]) -> List[str]:
    """The requirements the running interpreter does not meet."""
    out = []
    for requirement in requirements:
        name, version = parse(requirement)
        have = installed(name)
        if have is None or (version is not None and have != version):
            out.append(requirement)
    return out


def _normalise(name: str) -> str:
    return re.sub(r'[-_.]+', '_', name).lower()


def wheel_for(requirement: str, wheel_dir: str) -> str:
    """The carried wheel that meets ``requirement`` (its name and, if pinned, its version)."""
    name, version = parse(requirement)
    files = sorted(os.listdir(wheel_dir)) if os.path.isdir(wheel_dir) else []
    for file in files:
        parts = file[:-len('.whl')].split('-') if file.endswith('.whl') else []
        if (len(parts) >= 2 and _normalise(parts[0]) == _normalise(name)
                and (version is None or parts[1] == version)):
            return os.path.join(wheel_dir, file)
    raise MissingWheel(f'{requirement} is not installed here and {wheel_dir} has no wheel for '
                       f'it (tools/prepare_gpu_run.sh; GPU_EXTRA_WHEELS for what the device '
                       f'lacks): {files}')


def plan(requirements: List[str], wheel_dir: str) -> List[str]:
    """The wheel files to install: one per unmet requirement."""
    return [wheel_for(requirement, wheel_dir) for requirement in unmet(requirements)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--wheel-dir', default='.gpu_wheels')
    p.add_argument('requirements', nargs='+')
    args = p.parse_args(argv)
    for requirement in args.requirements:
        print(f'{requirement}: installed {installed(parse(requirement)[0])}', file=sys.stderr)
    try:
        files = plan(args.requirements, args.wheel_dir)
    except MissingWheel as error:
        print(f'wheels: {error}', file=sys.stderr)
        return 3
    for file in files:
        print(file)
    return 0


if __name__ == '__main__':
    sys.exit(main())
