"""What the GPU check needs before its first figure, each piece recorded.

* the toolchain Triton compiles its launcher with at the first launch (a C compiler,
  ``Python.h``, ``libcuda.so.1`` found through ``ldconfig``), then one real launch of this
  package's row kernel: where any of it fails, the check runs the torch row ops and says why;
* TF32 pinned off (IEEE fp32 products), so the fp32 tolerances mean what they say;
* Megatron's cross-entropy, the baseline of every ratio: a hard error if it is not importable
  (a silent fallback to torch's would make every ratio a comparison with something else), and
  its fused variant where it imports;
* NVIDIA/Megatron-LM PR #6473's fused e2e-TV kernel, from the folder
  ``tools/fetch_upstream_e2e_tv.py`` fills (never committed), or why it is absent.
"""

import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import traceback
from typing import Dict, Optional

import torch


class MissingBaseline(RuntimeError):
    """Megatron's cross-entropy cannot be imported: no figure of the check would mean anything."""


def toolchain() -> Dict:
    """The pieces Triton's first launch needs, and where each was found (None: missing)."""
    include = sysconfig.get_paths().get('include') or ''
    found = {'cc': shutil.which(os.environ.get('CC', 'cc')) or shutil.which('gcc'),
             'python_h': os.path.join(include, 'Python.h')
             if os.path.exists(os.path.join(include, 'Python.h')) else None,
             'libcuda': None}
    try:
        listing = subprocess.run(['ldconfig', '-p'], capture_output=True, text=True,
                                 timeout=30).stdout
        found['libcuda'] = next((line.split('=>')[-1].strip() for line in listing.splitlines()
                                 if 'libcuda.so.1' in line), None)
    except (OSError, subprocess.SubprocessError) as error:
        found['ldconfig_error'] = repr(error)
    if found['libcuda'] is None:
        found['libcuda'] = ctypes.util.find_library('cuda')
    return found


def triton_launch(device: str) -> Optional[str]:
    """Launch the row-statistics kernel once on ``device``; None on success, else the error."""
    try:
        from megatron.mtp_tv import triton_kernels

        z = torch.randn(4, 1000, device=device)
        row_max, log_sum, _ = triton_kernels.row_stats(z)
        got, expect = row_max + log_sum, torch.logsumexp(z, -1)
        if not torch.allclose(got, expect, atol=1e-4):
            return f'row_stats disagrees with torch.logsumexp by {(got - expect).abs().max()}'
        return None
    except Exception:  # recorded, and the check runs the torch row ops instead
        return traceback.format_exc(limit=4)


def pin_ieee_fp32() -> Dict:
    """No TF32 in fp32 products or convolutions: the fp32 tolerances assume IEEE fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision('highest')
    return {'matmul.allow_tf32': torch.backends.cuda.matmul.allow_tf32,
            'cudnn.allow_tf32': torch.backends.cudnn.allow_tf32,
            'float32_matmul_precision': torch.get_float32_matmul_precision()}


def megatron_cross_entropy() -> Dict:
    """Megatron's two CE implementations (``vocab_parallel_cross_entropy``, and the fused one
    where it imports). Raises :class:`MissingBaseline` without the first."""
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except ImportError as error:  # megatron-core missing, or installed without numpy/packaging
        raise MissingBaseline(
            f"Megatron's vocab_parallel_cross_entropy is not importable ({error}): install the "
            f"megatron-core wheel and its imports (numpy, packaging) before the GPU check") from error
    out = {'unfused': vocab_parallel_cross_entropy, 'fused': None, 'fused_error': None}
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        out['fused'] = fused_vocab_parallel_cross_entropy
    except ImportError as error:
        out['fused_error'] = repr(error)
    return out


#: Where ``tools/fetch_upstream_e2e_tv.py`` puts PR #6473's two modules (git-ignored).
UPSTREAM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), '.cache', 'upstream_pr6473')


def upstream_e2e_tv(folder: str = UPSTREAM_DIR) -> Dict:
    """PR #6473's ``vocab_parallel_tv_distance`` and ``mtp_e2e_prefix_objective`` from
    ``folder``, or why they are not there."""
    modules = {}
    for name in ('fused_mtp_tv', 'fused_mtp_prefix'):
        path = os.path.join(folder, f'{name}.py')
        if not os.path.exists(path):
            return {'available': False, 'reason': f'{path} is missing: run '
                    f'tools/fetch_upstream_e2e_tv.py and carry {os.path.relpath(folder)}'}
        spec = importlib.util.spec_from_file_location(f'upstream_pr6473_{name}', path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    commit_file = os.path.join(folder, 'COMMIT')
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    tv, prefix = modules['fused_mtp_tv'], modules['fused_mtp_prefix']
    # Its dispatch tests (gpucheck/pr6473.py records which path ran from them): None where the
    # Triton kernel takes the input, else why its torch fallback runs.
    return {'available': True, 'commit': commit,
            'tv_distance': tv.vocab_parallel_tv_distance,
            'prefix_objective': prefix.mtp_e2e_prefix_objective,
            'tv_unavailable_reason': getattr(tv, 'fused_mtp_tv_unavailable_reason', None),
            'prefix_unavailable_reason': getattr(prefix, 'fused_mtp_prefix_unavailable_reason',
                                                 None)}
