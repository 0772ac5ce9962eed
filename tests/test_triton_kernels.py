"""The Triton row kernels, run on CPU through Triton's interpreter, against the torch path.

The interpreter is chosen when kernels are decorated, so these run in a subprocess that starts
with ``TRITON_INTERPRET=1``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron.mtp_tv.row_ops import TorchRowOps, TritonRowOps, row_ops_for, triton_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env):
    full_env = {**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONPATH': str(ROOT), **env}
    proc = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(code)], env=full_env, capture_output=True,
        text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_kernels_match_torch_row_ops_over_several_vocab_tiles():
    _run('''
        import torch
        from megatron.mtp_tv.row_ops import TorchRowOps, TritonRowOps
        torch.manual_seed(0)
        n, V = 3, 5000  # two 4096-wide tiles, the second one partial
        zt = torch.randn(n + 2, V) * 3
        zq = torch.randn(n, V) * 3
        dot_coef = torch.rand(n)
        kl_coef = torch.rand(n)
        zq[1, 4500] = zq[1].max() + 1.0  # an argmax in the second (partial) tile
        zq[2, :2] = zq[2].max() + 1.0    # a tie: the lowest index wins, as torch.argmax

        def passes(ops, offset):
            t, _ = ops.normalise_(zt.clone(), None, vocab_start=7)
            d, stats = ops.normalise_(zq.clone(), None, vocab_start=7)
            p = ops.rows(t, offset, offset + n)
            ov, dot, kl = ops.pair_sums(p, d, dot=True, kl=True)
            tv_only = ops.grad_(p, ops.normalise_(zq.clone(), None)[0], dot, dot_coef).clone()
            both = ops.grad_(p, d, dot, dot_coef, kl_coef)  # the LK form
            return stats.max, stats.argmax, ov, dot, kl, tv_only, both

        for offset in (0, 2):
            ref = passes(TorchRowOps(), offset)
            got = passes(TritonRowOps(), offset)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            assert got[1].tolist() == (zq.argmax(-1) + 7).tolist()
            for a, b in zip(got[2:5], ref[2:5]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(got[5:], ref[5:]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
        print('ok')
    ''')


@pytest.mark.slow
@pytest.mark.parametrize('test_file', ['test_linear_tv.py', 'test_nla.py'])
def test_reference_cases_through_the_kernels(test_file):
    """The cases of ``test_file`` marked ``triton_slice`` (every loss, chunking, fused and
    recompute, logit functions, greedy counts, empty shards, 'nla' at alpha ~ 0 and at one-hot
    targets), run where ``kernels='auto'`` takes the Triton kernels: under the interpreter, every
    sweep's fp32 logits qualify (``test_dispatch_says_why_the_kernel_is_not_used``)."""
    proc = subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m', 'triton_slice',
         str(ROOT / 'tests' / test_file)],
        env={**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONPATH': str(ROOT)},
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    # pytest exits 5 when the marker selected nothing: that fails here too.
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_dispatch_says_why_the_kernel_is_not_used(monkeypatch):
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    reason = triton_unavailable_reason(torch.zeros(2, 3))
    assert 'cpu' in reason and 'CUDA' in reason
    assert isinstance(row_ops_for(torch.zeros(2, 3), 'auto'), TorchRowOps)
    with pytest.raises(RuntimeError, match="mtp_tv_kernels='triton' but the Triton kernel cannot run"):
        row_ops_for(torch.zeros(2, 3), 'triton')
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    assert isinstance(row_ops_for(torch.zeros(2, 3), 'auto'), TritonRowOps)  # what the sweeps get
    assert 'bfloat16' in triton_unavailable_reason(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert isinstance(row_ops_for(torch.zeros(2, 3, dtype=torch.bfloat16), 'auto'), TorchRowOps)
    assert isinstance(row_ops_for(torch.zeros(2, 3), 'torch'), TorchRowOps)
