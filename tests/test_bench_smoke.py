"""Smoke test of the loss benchmark (``tools/bench_loss.py``) and of its memory instruments.

The benchmark itself runs in a subprocess with ``--quick`` (tiny shapes, TP=1 and TP=2); the
memory tracker is validated in-process on allocation patterns whose byte counts are known.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, 'tools')
sys.path.insert(0, TOOLS)

from lossbench.memory import LiveBytesTracker, SavedTensorsCounter, linear_fit  # noqa: E402

MiB = 1 << 20


def test_tracker_counts_allocations_and_frees():
    pre = torch.zeros(MiB // 4)  # 1 MiB that exists before: never counted
    with LiveBytesTracker() as tracker:
        a = torch.empty(MiB // 4)  # 1 MiB
        b = torch.empty(MiB // 2)  # 2 MiB
        assert tracker.live == 3 * MiB
        view = a[10:].view(-1, 2)  # a view allocates nothing
        del a
        assert tracker.live == 3 * MiB  # the view keeps a's storage alive
        del view
        assert tracker.live == 2 * MiB
        c = torch.empty(MiB // 8)  # 0.5 MiB
        assert tracker.live == 2 * MiB + MiB // 2
        # Views, in-place and out= ops on pre-existing tensors allocate nothing.
        pre.add_(1)
        pre.t()
        pre.view(2, -1).detach()
        torch.mul(pre, 2, out=pre)
        assert tracker.live == 2 * MiB + MiB // 2
        del b, c
        assert tracker.live == 0
    assert tracker.peak == 3 * MiB


def test_tracker_through_autograd():
    x = torch.randn(MiB // 4, requires_grad=True)  # 1 MiB leaf, pre-existing
    with LiveBytesTracker() as tracker:
        with SavedTensorsCounter(tracker) as saved:
            y = (x * 2).exp()  # x * 2: 1 MiB temporary; exp saves its 1 MiB result
            loss = y.sum()
        del y
        assert saved.bytes == MiB  # only exp's result; x (a leaf) is saved by nobody here
        assert tracker.live == MiB + 4  # exp's result (held by the graph) + the scalar
        loss.backward()
        del loss
    assert x.grad is not None
    # Forward peak 2 MiB (temporary + result); backward holds the saved result, the upstream
    # gradient times it, and the gradient of x: never more than 3 MiB (+ scalars).
    assert 2 * MiB <= tracker.peak <= 3 * MiB + 64
    assert tracker.live == MiB + 4 or tracker.live == MiB  # x.grad stays alive (+ maybe a scalar)


def test_saved_counter_dedupes_and_excludes_leaves():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(8, 256, requires_grad=True)
    with LiveBytesTracker() as tracker:
        with SavedTensorsCounter(tracker) as saved:
            h = x @ w.t()  # saves x and w (pre-existing): 0 bytes
            z = h * h  # saves h twice: counted once
        assert saved.bytes == h.untyped_storage().nbytes()
        del z


def test_linear_fit():
    assert linear_fit([1, 2, 3], [10, 12, 14]) == (8.0, 2.0)
    assert linear_fit([5], [1]) == (None, None)


@pytest.fixture(scope='module')
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench') / 'report.json'
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'bench_loss.py'), '--quick', '--json', str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_quick_run_prints_table_and_json(quick_report):
    stdout, report = quick_report
    assert stdout.startswith('command: ')
    assert '| case | seq | tp | G | impl | time (s) |' in stdout
    assert 'targets met:' in stdout
    assert report['command'].endswith('tools/bench_loss.py --quick --json ' + report['args']['json'])
    cases = {(r['case'], r['impl']) for r in report['rows']}
    for case, impls in (('loss', ('ce', 'tv', 'tv-recompute')),
                        ('mtp', ('ce', 'tv', 'tv-recompute', 'e2e_tv', 'e2e_tv-recompute')),
                        ('tp', ('ce', 'tv', 'tv-recompute'))):
        for impl in impls:
            assert (case, impl) in cases, (case, impl)
    for r in report['rows']:
        assert r['time_s'] > 0 and r['peak_mib'] > 0
        assert r['denormal_grad_fraction'] < 1e-3  # otherwise the GEMMs time subnormals
        if r['impl'] == 'ce':
            assert r['ratio'] == 1.0 and r['met'] is None
        elif r['impl'].endswith('-products'):
            assert r['met'] is None and r['case'] in ('loss', 'tp')
        elif r['case'] == 'tp':
            assert len(r['peak_mib_per_rank']) == 2 and 'ratio_vs_tp1' in r
    # Every loss/tp shape has its matrix-product floor, measured in the same run.
    shapes = {(r['case'], r['seq'], r['tp']) for r in report['rows'] if r['case'] in ('loss', 'tp')}
    assert {(f['case'], f['seq'], f['tp']) for f in report['floors']} == shapes
    for f in report['floors']:
        assert f['floor'] > 0 and f['tv_over_products'] > 0
    assert 'Matrix-product floor' in stdout


def test_quick_run_memory_is_sane(quick_report):
    """Known byte counts at the quick shapes (h=64, V=512, one depth, fp32)."""
    _, report = quick_report
    h, V = report['args']['hidden'], report['args']['vocab']
    summaries = {(s['case'], s['tp'], s['impl']): s for s in report['summaries']}
    for tp in (1, 2):
        case = 'loss' if tp == 1 else 'tp'
        ce = summaries[(case, tp, 'ce')]
        # CE keeps its fp32 [s, V/tp] softmax (plus a mask and the shifted labels) per token.
        assert 4 * V // tp <= ce['saved_per_token_bytes'] <= 4 * V // tp + 64
        assert abs(ce['saved_fixed_bytes']) < 1024
        tv = summaries[(case, tp, 'tv')]
        # Fused TV keeps the hidden-state gradient (per token) and the weight gradient (fixed).
        assert tv['saved_per_token_bytes'] == pytest.approx(4 * h, abs=1)
        assert tv['saved_fixed_bytes'] == pytest.approx(4 * V // tp * h, abs=64)
        # Recompute keeps only the inputs, which existed before the forward: nothing.
        rec = summaries[(case, tp, 'tv-recompute')]
        assert rec['saved_per_token_bytes'] == pytest.approx(0, abs=1)
    for r in report['rows']:
        if r['impl'] == 'ce' and r['case'] in ('loss', 'tp'):
            # CE's peak holds at least its [s, V/tp] fp32 logits.
            assert r['peak_mib'] * MiB >= r['seq'] * 4 * V // r['tp']


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """``tools/gpu_check.py`` is meant for a short GPU lease: keep it runnable, checks passing."""
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'gpu_check.py'), '--device', 'cpu', '--quick',
         '--dtype', 'float32', '--warmup', '0', '--repeats', '1', '--out', str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / 'gpu_check.json').read_text())
    assert report['checks'] and all(c['ok'] for c in report['checks'])
    cases = {r['case'] for r in report['bench']['rows']}
    assert {'ce', 'tv chunk 32', 'tv-recompute chunk 32', 'tv-products chunk 32',
            'ce-products', 'e2e_tv chunk 32'} <= cases
    assert '## Benchmark' in (tmp_path / 'gpu_check.md').read_text()
