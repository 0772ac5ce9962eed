"""Smoke test of the loss benchmark (``tools/bench_loss.py``) and of its memory instruments, and
of the GPU check (``tools/gpu_check.py``) run on the CPU at tiny sizes.

The benchmark itself runs in a subprocess with ``--quick`` (tiny shapes, the row groups: TP=1
and TP=2, the 'step' GPTModel and the 'wide' MTP path); the memory tracker is validated
in-process on allocation patterns whose byte counts are known, the targets and products floors
on made-up rows. The GPU check: its dry run, a planted failure, the exit without Megatron's CE;
NVIDIA PR #6473's values against ``'e2e_tv'`` (a stand-in of its two modules written here, with a
planted normalisation error, and the PR's own modules where ``tools/fetch_upstream_e2e_tv.py``
fetched them); the recorded paths against the package's own decisions; the wheels it installs.
"""

import argparse
import importlib.util
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
from lossbench.report import apply_targets, products_floor, step_products  # noqa: E402
from lossbench.timing import paired_ratio  # noqa: E402
from lossbench import report as report_module  # noqa: E402

#: Every row group, as the quick run below selects them.
GROUPS = 'loss,mtp,tp,step,wide'

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
        [sys.executable, os.path.join(TOOLS, 'bench_loss.py'), '--cases', GROUPS, '--quick',
         '--json', str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_quick_run_prints_table_and_json(quick_report):
    stdout, report = quick_report
    assert stdout.startswith('command: ')
    assert '| case | seq | tp | G | impl | time (s) |' in stdout
    assert 'targets met:' in stdout
    assert report['command'].endswith(
        f"tools/bench_loss.py --cases {GROUPS} --quick --json {report['args']['json']}")
    cases = {(r['case'], r['impl']) for r in report['rows']}
    for case, impls in (('loss', ('ce', 'tv')), ('mtp', ('ce', 'tv', 'e2e_tv')),
                        ('tp', ('ce', 'tv'))):
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


@pytest.mark.slow
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
        # Fused TV keeps the smaller of the dense gradients (the hidden-state gradient per token
        # and the weight gradient) and the [s, V/tp] fp32 logit gradients (the inputs of the two
        # products existed before the forward: nothing more).
        for r in report['rows']:
            if r['case'] == case and r['tp'] == tp and r['impl'] == 'tv':
                dense = 4 * h * (V // tp + r['tokens'])
                logit_grads = 4 * r['tokens'] * V // tp
                assert r['saved_bytes'] == pytest.approx(min(dense, logit_grads), abs=64)
    for r in report['rows']:
        if r['impl'] == 'ce' and r['case'] in ('loss', 'tp'):
            # CE's peak holds at least its [s, V/tp] fp32 logits.
            assert r['peak_mib'] * MiB >= r['seq'] * 4 * V // r['tp']


#: A stand-in of PR #6473's two modules (``tools/fetch_upstream_e2e_tv.py`` fetches the real
#: ones, never committed): its functions' signatures and meaning, in plain torch. ``{reduce}``
#: is how the prefix objective reduces over depths: the PR's ``mean``, or a planted ``sum``
#: (the normalisation the comparison must catch).
STAND_IN_TV = """
import torch

def fused_mtp_tv_unavailable_reason(draft_logits, target_logits):
    return {reason!r}

def vocab_parallel_tv_distance(draft_logits, target_logits, tp_group=None,
                               logits_are_vocab_sharded=True):
    q = torch.softmax(draft_logits.float(), -1)
    p = torch.softmax(target_logits.detach().float(), -1)
    return 1.0 - torch.minimum(p, q).sum(-1)
"""
STAND_IN_PREFIX = """
import torch

def fused_mtp_prefix_unavailable_reason(acceptances):
    return {reason!r}

def mtp_e2e_prefix_objective(acceptances):
    prefix_losses = 1.0 - torch.cumprod(acceptances, dim=0)
    return prefix_losses.{reduce}(dim=0), prefix_losses.detach()
"""


def stand_in_pr(folder, reduce='mean', reason='a stand-in has no kernel'):
    """Write the stand-in modules to ``folder``; the folder, as ``--upstream-dir`` takes it."""
    os.makedirs(folder, exist_ok=True)
    for name, text in (('fused_mtp_tv', STAND_IN_TV), ('fused_mtp_prefix', STAND_IN_PREFIX)):
        with open(os.path.join(folder, f'{name}.py'), 'w') as f:
            f.write(text.format(reduce=reduce, reason=reason))
    return str(folder)


def _without_triton_interpreter():
    env = dict(os.environ)
    env.pop('TRITON_INTERPRET', None)  # the torch row ops: the paths the test expects
    return env


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """``tools/gpu_check.py`` is meant for a short GPU lease: keep it runnable end to end, every
    phase done and every check passing, the report on disk, every row with the path it ran."""
    upstream = stand_in_pr(tmp_path / 'pr6473')
    out = tmp_path / 'out'
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'gpu_check.py'), '--device', 'cpu', '--quick',
         '--dtype', 'float32', '--repeats', '1', '--out', str(out), '--upstream-dir', upstream],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=_without_triton_interpreter(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / 'gpu_check.json').read_text())
    assert report['checks'] and all(c['ok'] for c in report['checks'])
    assert {name: p['status'] for name, p in report['phases'].items()} == {
        name: 'done' for name in ('reference', 'kernels', 'bf16', 'chunked_ce', 'main_logits',
                                  'big_chunk', 'model', 'fused_wgrad', 'precision', 'pr6473',
                                  'bench')}
    assert {c['check'] for c in report['checks']} >= {
        'reference', 'bf16 vs fp32', 'chunked ce vs megatron ce', 'main logits vs projection',
        'big chunk', 'GPTModel bf16 steps', 'fused weight gradient in DDP',
        'gradient precision vs float64'}
    fused = [c for c in report['checks'] if c['check'] == 'fused weight gradient in DDP']
    assert {c['loss_type'] for c in fused} == {'ce', 'ce_chunked', 'tv', 'e2e_tv', 'kl', 'lk',
                                               'nla'}
    assert all(c['fusion_path'] for c in fused)
    assert report['preflight']['megatron_ce'] == 'vocab_parallel_cross_entropy'
    assert report['preflight']['megatron_core'].startswith('0.19.2')
    assert report['preflight']['numpy'] and report['preflight']['packaging']
    cases = {(r['depths'], r['case']) for r in report['bench']}
    assert {(1, 'ce'), (1, 'ce fused'), (1, 'ce chunked'), (1, 'tv'), (1, 'tv projection'),
            (1, 'nla'), (3, 'ce x3'), (3, 'e2e_tv'), (3, 'PR #6473 e2e_tv')} <= cases
    # Which path ran, for every check and every row: on this CPU the torch row ops, fp32
    # products (the run is fp32) or, for a bf16 weight, the upcast fallback (no fp32-output GEMM
    # off CUDA), the stand-in's fallback with its reason.
    fallback = 'torch fallback: a stand-in has no kernel'
    for row in report['checks'] + report['bench']:
        assert row['path'] and all(row['path'].values()), row
        assert row['path'].get('row_ops', 'torch') in ('torch', 'triton against torch')
        assert row['path'].get('gemm', 'fp32') in ('fp32', 'upcast', 'fp32 / upcast'), row
        if row in report['bench'] or row['check'] == 'reference':
            assert row['path'].get('gemm', 'fp32') == 'fp32', row
    megatron = {'ce': 'vocab_parallel_cross_entropy',
                'ce fused': 'fused_vocab_parallel_cross_entropy'}
    for row in report['bench']:
        case = row['case'].removesuffix(' x3')
        expected = ({'pr6473_tv': fallback, 'pr6473_prefix': fallback} if case.startswith('PR')
                    else {'megatron_ce': megatron[case]} if case in megatron
                    else {'row_ops': 'torch', 'gemm': 'fp32'})
        assert row['path'] == expected, row
    pr = [c for c in report['checks'] if c['check'] == 'PR #6473 vs e2e_tv']
    assert [(c['dtype'], c['verdict']) for c in pr] == [('torch.float32', 'agree')]
    assert pr[0]['path'] == {'row_ops': 'torch', 'gemm': 'fp32', 'pr6473_tv': fallback,
                             'pr6473_prefix': fallback}
    md = (out / 'gpu_check.md').read_text()
    assert '## Benchmark' in md and "PR #6473 against 'e2e_tv' and float64" in md
    assert '| PR #6473 e2e_tv |' in md and f'pr6473_tv={fallback}' in md
    assert '- reference: ' in md and 'path row_ops=torch; gemm=fp32' in md


def test_gpu_check_records_a_failed_phase_and_runs_the_next(tmp_path, monkeypatch):
    """An exception in one phase is in the report with its traceback; the phases after it run,
    and the report on disk is complete after every phase."""
    sys.path.insert(0, TOOLS)
    import gpu_check
    from gpucheck import correctness

    written = []
    original_write = gpu_check.Report.write

    def write(self):
        original_write(self)
        written.append({n: p.get('status') for n, p in self.data['phases'].items()})

    def broken(*args, **kwargs):
        raise RuntimeError('planted failure')

    monkeypatch.setattr(gpu_check.Report, 'write', write)
    monkeypatch.setattr(correctness, 'bf16_against_fp32', broken)
    absent = str(tmp_path / 'no_pr6473')  # PR #6473 not carried: its phase is skipped
    rc = gpu_check.main(['--device', 'cpu', '--quick', '--dtype', 'float32', '--out',
                         str(tmp_path), '--upstream-dir', absent, '--skip',
                         'reference,main_logits,big_chunk,model,fused_wgrad,precision,bench'])
    assert rc == 1
    report = json.loads((tmp_path / 'gpu_check.json').read_text())
    assert report['phases']['pr6473']['status'] == 'skipped'
    assert 'tools/fetch_upstream_e2e_tv.py' in report['phases']['pr6473']['reason']
    assert report['preflight']['pr6473']['available'] is False
    assert report['phases']['bf16']['status'] == 'failed'
    assert 'planted failure' in report['phases']['bf16']['traceback']
    assert report['phases']['chunked_ce']['status'] == 'done'  # the next phase ran
    assert {'bf16': 'failed'}.items() <= written[-1].items()
    assert any(w.get('bf16') == 'running' for w in written)  # written as the phase began
    # A skipped phase is no failure: the same run without the planted one exits 0.
    monkeypatch.undo()
    assert gpu_check.main(['--device', 'cpu', '--quick', '--out', str(tmp_path / 'again'),
                           '--upstream-dir', absent, '--skip', 'reference,kernels,bf16,'
                           'chunked_ce,main_logits,big_chunk,model,fused_wgrad,precision,'
                           'bench']) == 0


def test_gpu_check_fails_loudly_without_megatrons_cross_entropy(tmp_path):
    """Without Megatron's CE (megatron-core missing, or installed without numpy) no ratio would
    mean anything: exit 2 before any phase, the reason in the report."""
    prelude = ("import sys, runpy; sys.modules['megatron.core.tensor_parallel'] = None; "
               f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--quick', '--out', {str(tmp_path)!r}]; "
               f"runpy.run_path({os.path.join(TOOLS, 'gpu_check.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, '-c', prelude], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / 'gpu_check.json').read_text())
    assert "vocab_parallel_cross_entropy is not importable" in report['fatal']
    assert not report['phases'] and not report['checks']


def _load_upstream(folder):
    from gpucheck import preflight

    upstream = preflight.upstream_e2e_tv(folder)
    assert upstream['available'], upstream
    return upstream


def test_pr6473_values_against_e2e_tv_and_float64(tmp_path):
    """PR #6473's e2e-TV (the stand-in: its signatures and meaning) and the package's 'e2e_tv' on
    the same inputs, both against float64: they agree in fp32 and bf16; a prefix objective
    summed over depths instead of averaged (a normalisation the alignment must not hide) is
    caught, in fp32 and in bf16 alike, as the PR's difference."""
    from gpucheck import correctness

    rows = correctness.pr6473_against_e2e_tv(
        'cpu', 'torch', torch.bfloat16, _load_upstream(stand_in_pr(tmp_path / 'mean')), True)
    assert [r['dtype'] for r in rows] == ['torch.float32', 'torch.bfloat16']
    for r in rows:
        assert r['ok'] and r['verdict'] == 'agree', r
        assert r['G'] == 3 and 0.2 < r['alpha_mean'] < 0.8  # a warm head: every depth counts
        for pair in ('ours_vs_pr', 'ours_vs_f64', 'pr_vs_f64'):
            assert set(r[pair]) == {f'{q}_max_{m}' for q in ('loss', 'grad_draft', 'grad_weight')
                                    for m in ('abs', 'rel')}
    assert rows[0]['ours_vs_pr']['grad_draft_max_rel'] < 1e-5  # fp32: the same objective
    assert rows[0]['loss_ours'] == pytest.approx(rows[0]['loss_f64'], rel=1e-5)

    planted = correctness.pr6473_against_e2e_tv(
        'cpu', 'torch', torch.bfloat16, _load_upstream(stand_in_pr(tmp_path / 'sum', 'sum')),
        True)
    for r in planted:
        assert not r['ok'] and r['verdict'] == 'DIFFER: pr_vs_f64, ours_vs_pr', r
        assert r['loss_pr'] > 2 * r['loss_ours']  # 3 depths summed, not averaged
        assert r['ours_vs_f64']['loss_max_rel'] < 1e-3  # the package is not the one off


def test_pr6473_bf16_verdict_records_the_prs_own_error():
    """In bf16 the PR's gradients may be off float64 on their own (its draft logits are rounded
    to bf16): recorded, not failed; the package off float64, or the PR's loss, fails; fp32
    holds both."""
    from gpucheck.correctness import _e2e_verdict

    def errs(ours, pr, pr_loss=0.0):
        one = lambda e, loss=0.0: {'loss_max_rel': loss, 'grad_draft_max_rel': e,  # noqa: E731
                                   'grad_weight_max_rel': e}
        return {'ours_vs_f64': one(ours), 'pr_vs_f64': one(pr, pr_loss),
                'ours_vs_pr': one(ours + pr, pr_loss)}

    verdict, ok = _e2e_verdict(errs(4e-3, 0.3), torch.bfloat16)
    assert ok and verdict.startswith("ours within float64's tolerance; PR's torch.bfloat16 "
                                     'gradients off float64 by 3.0e-01 (ours 4.0e-03)')
    assert _e2e_verdict(errs(4e-3, 1e-2), torch.bfloat16) == ('agree', True)
    assert _e2e_verdict(errs(0.1, 1e-2), torch.bfloat16)[1] is False
    assert _e2e_verdict(errs(4e-3, 0.3, pr_loss=0.5), torch.bfloat16) == (
        'DIFFER: pr_vs_f64, ours_vs_pr', False)  # its loss is off: no rounding explains that
    assert _e2e_verdict(errs(1e-6, 1e-2), torch.float32) == (
        'DIFFER: pr_vs_f64, ours_vs_pr', False)


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, '.cache', 'upstream_pr6473',
                                                    'fused_mtp_tv.py')),
                    reason='PR #6473 not fetched (tools/fetch_upstream_e2e_tv.py)')
def test_pr6473_own_modules_agree_with_e2e_tv():
    """The PR's own modules (its torch fallbacks on this CPU, its own reasons recorded): the
    alignment of its prefix objective with 'e2e_tv' holds in fp32 to fp32 accuracy."""
    from gpucheck import correctness, preflight

    rows = correctness.pr6473_against_e2e_tv('cpu', 'torch', torch.float32,
                                             _load_upstream(preflight.UPSTREAM_DIR), True)
    assert [(r['dtype'], r['verdict'], r['ok']) for r in rows] == [
        ('torch.float32', 'agree', True)]
    assert rows[0]['path'] == {
        'row_ops': 'torch', 'gemm': 'fp32',
        'pr6473_tv': 'torch fallback: logits are not CUDA tensors',
        'pr6473_prefix': 'torch fallback: acceptances are not a CUDA tensor'}


#: Runs one loss call with a spy on the sweep's own ``row_ops_for``; prints, per ``kernels``,
#: the row ops it took and the ones ``gpucheck.paths.row_ops`` records.
ROW_OPS_SPY = """
import json, sys, torch
sys.path.insert(0, {tools!r})
from gpucheck import paths
from megatron.mtp_tv import sweep
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.linear_tv import linear_tv_loss

taken, original = [], sweep.row_ops_for
sweep.row_ops_for = lambda logits, kernels: taken.append(original(logits, kernels)) or taken[-1]
g = torch.Generator().manual_seed(0)
draft, target = torch.randn(1, 4, 1, 8, generator=g), torch.randn(4, 1, 8, generator=g)
weight = torch.randn(40, 8, generator=g)
seen = {{}}
for kernels in ('torch', 'auto'):
    taken.clear()
    linear_tv_loss(draft, target, weight, torch.full((1, 4, 1), 0.25),
                   MTPLossOptions('tv', kernels=kernels))
    seen[kernels] = [sorted({{ops.name for ops in taken}}), paths.row_ops('cpu', kernels)]
seen['triton'] = paths.row_ops('cpu', 'triton')
print(json.dumps(seen))
"""


@pytest.mark.parametrize('interpret', ['0', '1'])
def test_recorded_row_ops_are_the_ones_the_sweep_takes(interpret):
    """``gpucheck.paths.row_ops`` against what the sweep's own ``row_ops_for`` returned in a real
    loss call (a subprocess: Triton picks its interpreter when the kernels are decorated): the
    torch ops by request; with 'auto' torch on a CPU, Triton under the interpreter; for
    'triton' where it cannot run, the loss's own error."""
    proc = subprocess.run([sys.executable, '-c', ROW_OPS_SPY.format(tools=TOOLS)], cwd=ROOT,
                          env=dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    auto = 'triton' if interpret == '1' else 'torch'
    assert seen['torch'] == [['torch'], 'torch'] and seen['auto'] == [[auto], auto]
    if interpret == '1':
        assert seen['triton'] == 'triton'
    else:
        assert seen['triton'].startswith(
            "error: mtp_tv_kernels='triton' but the Triton kernel cannot run")


def test_recorded_gemm_path_is_the_products_choice(monkeypatch):
    """``gpucheck.paths.gemm`` reads ``Products``' own choice: fp32 for an fp32 weight, the
    upcast fallback for bf16 on a CPU, the fp32-output GEMM where ``gemm_path`` found it."""
    from gpucheck import paths
    from megatron.mtp_tv import products

    assert paths.gemm('cpu', torch.float32) == 'fp32'
    assert paths.gemm('cpu', torch.bfloat16) == 'upcast'
    monkeypatch.setitem(products._GEMM_PATHS, ('cpu', torch.float16), 'out_dtype')
    assert paths.gemm('cpu', torch.float16) == 'out_dtype'
    assert paths.package('cpu', 'torch', torch.float32, torch.float16) == {
        'row_ops': 'torch', 'gemm': 'fp32 / out_dtype'}


def test_recorded_pr6473_path_is_its_own_dispatch(tmp_path):
    """The PR's path comes from its own ``*_unavailable_reason`` on the inputs it was given:
    None is its Triton kernel, a reason its torch fallback."""
    from gpucheck import pr6473

    drafts, weight = torch.randn(2, 4, 1, 8), torch.randn(16, 8)
    target, chains = torch.randn(4, 1, 16), torch.full((4, 1), 0.25)
    for reason, expected in ((None, 'triton (fused)'),
                             ('no GPU here', 'torch fallback: no GPU here')):
        upstream = _load_upstream(stand_in_pr(tmp_path / str(reason), reason=reason))
        _, path = pr6473.e2e_tv_loss(drafts, weight, target, chains, upstream)
        assert path == {'pr6473_tv': expected, 'pr6473_prefix': expected}
    del upstream['tv_unavailable_reason']  # a revision of the PR without the function
    _, path = pr6473.e2e_tv_loss(drafts, weight, target, chains, upstream)
    assert path['pr6473_tv'].startswith('unknown')


def test_device_installs_only_the_wheels_it_lacks(tmp_path, capsys):
    """``tools/gpucheck/wheels.py``: met requirements (a pinned version, or any version) install
    nothing; an unmet one takes its carried wheel, or exits 3 naming it."""
    import importlib.metadata

    from gpucheck import wheels

    core = importlib.metadata.version('megatron-core')
    assert wheels.unmet([f'megatron-core=={core}', 'numpy', 'packaging']) == []
    assert wheels.unmet(['megatron-core==0.0.1', 'numpy', 'no-such-distribution-here']) == [
        'megatron-core==0.0.1', 'no-such-distribution-here']
    carried = tmp_path / 'wheels'
    carried.mkdir()
    for name in ('megatron_core-0.0.1-cp312-cp312-manylinux_2_28_x86_64.whl',
                 'megatron_core-0.0.2-cp312-cp312-manylinux_2_28_x86_64.whl',
                 'numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl'):
        (carried / name).write_text('')
    assert wheels.plan(['megatron-core==0.0.1', 'numpy'], str(carried)) == [
        str(carried / 'megatron_core-0.0.1-cp312-cp312-manylinux_2_28_x86_64.whl')]
    assert wheels.main(['--wheel-dir', str(carried), 'megatron-core==0.0.3']) == 3
    assert 'megatron-core==0.0.3 is not installed here' in capsys.readouterr().err
    assert wheels.main(['--wheel-dir', str(carried), f'megatron-core=={core}', 'numpy']) == 0
    assert capsys.readouterr().out == ''  # nothing to install


def test_on_device_script_installs_nothing_the_interpreter_has(tmp_path):
    """``tools/gpu_check_on_device.sh`` with an interpreter that has megatron-core at the pin,
    numpy and packaging: no pip call, no wheel needed, then the check itself (here without CUDA:
    its exit 2)."""
    for script in ('gpu_check_on_device.sh', 'prepare_gpu_run.sh'):
        subprocess.run(['bash', '-n', os.path.join(TOOLS, script)], check=True)
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               GPU_CHECK_SITE=str(tmp_path / 'site'), CUDA_VISIBLE_DEVICES='')
    proc = subprocess.run(['bash', os.path.join(TOOLS, 'gpu_check_on_device.sh')], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / 'wheels.txt').read_text()
    assert 'megatron-core==0.19.2: installed 0.19.2' in log and log.endswith('nothing to install\n')
    assert not (tmp_path / 'site').exists()
    assert json.loads((tmp_path / 'gpu_check.json').read_text())['fatal'] == (
        'torch sees no CUDA device')


def test_paired_ratio_cancels_a_slowdown_that_hits_a_whole_round():
    # Round 2 ran on a machine twice as slow: both cases doubled. The ratio of medians would
    # compare CE's fast median with the case's slow one; the per-round ratio stays 1.1.
    ce = [1.0, 2.0, 2.0]
    tv = [1.1, 2.2, 2.2]
    assert paired_ratio(tv, ce) == pytest.approx(1.1)
    assert paired_ratio([1.0, 3.0, 1.2], [1.0, 1.0, 1.0]) == pytest.approx(1.2)  # the median
    with pytest.raises(ValueError, match='3 timed runs against 2'):
        paired_ratio(tv, ce[:2])


def test_ratio_cell_shows_the_range_of_its_rounds():
    # How far one round could move a verdict: the median, then the per-round range.
    row = {'ratio': 1.0621, 'round_ratios': [1.045, 1.078, 1.062]}
    assert report_module._ratio(row) == '1.06x (1.04-1.08)'
    assert report_module._ratio({'ratio': 1.1, 'round_ratios': [1.1]}) == '1.10x'  # one round
    assert report_module._ratio({'ratio': 1.0, 'round_ratios': None}) == '1.00x'  # the baseline
    assert report_module._ratio({'ratio': 1.2}) == '1.20x'  # a run of ratios of medians


def test_round_ratios_pair_each_round_with_ces_in_the_same_round():
    ce = {'case': 'mtp', 'seq': 8, 'tp': 1, 'G': 1, 'impl': 'ce', 'times_s': [1.0, 2.0],
          'ratio_of_medians': 1.0}
    tv = dict(ce, impl='tv', times_s=[1.1, 1.8])
    wide_tv = dict(tv, case='wide', hidden=64)  # no CE row of its own: nothing to pair with
    older = dict(tv, seq=16)
    del older['ratio_of_medians']  # saved before the paired ratio: its ratio is of medians
    rows = [ce, tv, wide_tv, older]
    report_module.attach_round_ratios(rows)
    assert ce['round_ratios'] is None and tv['round_ratios'] == pytest.approx([1.1, 0.9])
    assert wide_tv['round_ratios'] is None and 'round_ratios' not in older


def test_products_floor():
    # CE: 3 products per MTP depth and 3 for the main head.
    assert step_products(1) == 6 and step_products(3) == 12
    assert products_floor(1, 1) == pytest.approx(7 / 6)  # TV with its own target projection
    assert products_floor(3, 1) == pytest.approx(13 / 12)
    assert products_floor(2, 0) == 1.0  # TV with the target from the main logits
    assert products_floor(1, 2, per_head=4) == pytest.approx(10 / 8)


def _row(case, impl, seq=4096, G=1, ratio=1.0, peak=100.0, **extra):
    return {'case': case, 'seq': seq, 'tp': 1, 'G': G, 'impl': impl, 'tokens': seq * G,
            'ratio': ratio, 'peak_mib': peak, 'saved_bytes': 0, **extra}


def test_targets_on_made_up_rows():
    rows = [
        _row('mtp', 'ce'), _row('mtp', 'tv', ratio=1.09, peak=99),
        _row('mtp', 'kl', ratio=1.11, peak=99), _row('mtp', 'nla', ratio=1.39, peak=99),
        _row('mtp', 'tv-auto', ratio=1.05, peak=101), _row('mtp', 'tv-own', ratio=3.0),
        _row('mtp', 'ce', seq=1024), _row('mtp', 'lk', seq=1024, ratio=2.0, peak=99),
        _row('mtp', 'ce', G=3), _row('mtp', 'e2e_tv', G=3, ratio=1.01, peak=99),
        _row('step', 'ce', target_source='own projection'),
        _row('step', 'tv', ratio=1.02, peak=100, target_source='own projection'),
        _row('step', 'kl', ratio=1.04, peak=90, target_source='own projection'),
        _row('wide', 'ce', hidden=4096), _row('wide', 'tv', ratio=3.0, peak=50, hidden=4096),
        _row('wide', 'ce', hidden=7168, peak=10), _row('wide', 'tv', hidden=7168, peak=11),
    ]
    apply_targets(rows, argparse.Namespace(hidden=64))
    met = {(r['case'], r['seq'], r['G'], r['impl'], r.get('hidden')): r['met'] for r in rows}
    assert met[('mtp', 4096, 1, 'tv', None)] is True  # 1.09 <= 1.10
    assert met[('mtp', 4096, 1, 'kl', None)] is False  # 1.11 > 1.10
    assert met[('mtp', 4096, 1, 'nla', None)] is True  # 1.4x kept
    assert met[('mtp', 4096, 1, 'tv-auto', None)] is False  # peak above CE's
    assert met[('mtp', 4096, 1, 'tv-own', None)] is None  # the fallback: a reference
    assert met[('mtp', 1024, 1, 'lk', None)] is True  # no time target at 1k: peak only
    assert met[('mtp', 4096, 3, 'e2e_tv', None)] is False  # 1.0x with 3 depths
    assert met[('step', 4096, 1, 'tv', None)] is True  # 1.02 <= 1.03, peak equal
    assert met[('step', 4096, 1, 'kl', None)] is False
    assert met[('wide', 4096, 1, 'tv', 4096)] is True  # peak only, whatever the time
    assert met[('wide', 4096, 1, 'tv', 7168)] is False  # against its own hidden size's CE
    targets = {(r['case'], r['seq'], r['G'], r['impl']): r['target'] for r in rows}
    assert targets[('mtp', 4096, 1, 'tv')] == "time <= 1.1x, peak <= CE's"
    assert targets[('mtp', 1024, 1, 'lk')].startswith("peak <= CE's (time <= 1.1x at 4096, 8192")
    assert targets[('mtp', 4096, 3, 'e2e_tv')] == "time <= 1.0x, peak <= CE's"
    step = {r['impl']: r for r in rows if r['case'] == 'step'}
    assert step['ce']['floor'] == 1.0 and step['tv']['floor'] == pytest.approx(7 / 6)
    assert step['tv']['floor_main'] == 1.0 and step['tv']['products'] == 7


@pytest.mark.slow
def test_quick_run_step_rows(quick_report):
    """'step': GPTModel._postprocess per loss type, at every quick depth and length."""
    stdout, report = quick_report
    args, env = report['args'], report['environment']
    assert env['loss_mode'] == 'plugin'  # no patched tree on this path
    from megatron.mtp_tv import mtp_loss

    source = 'main logits' if hasattr(mtp_loss, 'attach_mtp_tv_loss') else 'own projection'
    assert env['tv_target'] == source
    rows = [r for r in report['rows'] if r['case'] == 'step']
    assert len(args['step_depths']) >= 1 and max(args['step_depths']) > 1  # e2e_tv exercised
    for G in args['step_depths']:
        for s in args['step_seqs']:
            got = {r['impl']: r for r in rows if r['G'] == G and r['seq'] == s}
            impls = {'ce', 'tv', 'kl', 'lk'} | ({'e2e_tv'} if G > 1 else set())
            assert set(got) == impls, (G, s, sorted(got))
            for impl, r in got.items():
                assert r['time_s'] > 0 and r['peak_mib'] > 0 and r['ratio'] > 0
                assert r['hidden'] == args['hidden'] and r['vocab'] == args['vocab']
                assert r['mode'] == 'plugin' and r['target_source'] == source
                assert r['floor_own'] == pytest.approx((3 * G + 4) / (3 * G + 3))
                assert r['floor_main'] == 1.0
                if impl == 'ce':
                    assert r['ratio'] == 1.0 and r['met'] is None and r['floor'] == 1.0
                else:
                    assert r['floor'] == (r['floor_main'] if source == 'main logits' else r['floor_own'])
                    assert r['target'] == "time <= 1.03x, peak <= CE's"
                    assert r['met'] in (True, False)
    assert '## step: `GPTModel._postprocess` fwd+bwd' in stdout
    assert f'TV target from **{source}**' in stdout
    assert '| 64 | 1 | tv |' in stdout


@pytest.mark.slow
def test_quick_run_wide_rows(quick_report):
    """'wide': the MTP path at each quick hidden size, 'ce', 'tv' (target from the main logits and its own), 'kl', the automatic chunk."""
    stdout, report = quick_report
    args = report['args']
    rows = [r for r in report['rows'] if r['case'] == 'wide']
    for h in args['wide_hidden']:
        for s in args['wide_seqs']:
            got = {r['impl']: r for r in rows if r['hidden'] == h and r['seq'] == s}
            assert set(got) == {'ce', 'tv', 'tv-own', 'kl'}, (h, s, sorted(got))
            for impl, r in got.items():
                assert r['time_s'] > 0 and r['peak_mib'] > 0 and r['G'] == 1
                assert r['vocab'] == args['wide_vocab'] and r['chunk'] == 0
                assert 0 < r['auto_chunk'] <= s
                if impl == 'ce':
                    assert r['met'] is None
                else:
                    assert r['target'] == "peak <= CE's"
                    slack = report_module.PEAK_SLACK_BYTES / MiB  # O(1) state allowed
                    assert r['met'] == (r['peak_mib'] <= got['ce']['peak_mib'] + slack)
    assert '## wide: the MTP path at large hidden sizes' in stdout


def test_report_option_rerenders_a_saved_run_without_measuring(quick_report, tmp_path):
    stdout, report = quick_report
    saved = tmp_path / 'run.json'
    saved.write_text(json.dumps(report))
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'bench_loss.py'), '--report', str(saved)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The measured rows as they were, the verdicts taken with this version's targets.
    for r in report['rows']:
        assert f"| {r['time_s']:.3f} |" in proc.stdout
    met = [line for line in stdout.splitlines() if line.startswith('targets met:')]
    assert met and met[-1] in proc.stdout  # the same targets as the run's: the same verdicts
    assert 'ratio vs CE: the median over rounds' in proc.stdout
    # A run saved before the paired ratio says which ratio its rows carry.
    older = json.loads(json.dumps(report))  # a copy: the fixture serves other tests
    for r in older['rows']:
        del r['ratio_of_medians']
    saved.write_text(json.dumps(older))
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, 'bench_loss.py'), '--report', str(saved)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'ratio vs CE: median time over CE' in proc.stdout
    assert 'median over rounds' not in proc.stdout


def test_row_ops_benchmark_times_each_choice_against_its_baseline(capsys):
    spec = importlib.util.spec_from_file_location('bench_row_ops', os.path.join(TOOLS, 'bench_row_ops.py'))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from megatron.mtp_tv import row_ops
    from megatron.mtp_tv.row_ops import TorchRowOps

    default = TorchRowOps.BLOCK_ELEMENTS
    bench.main(['--tokens', '8', '--vocab', '1024', '--repeats', '1', '--blocks', '10,12'])
    ops = bench.row_ops_with_blocks(1 << 10)  # a subclass: the product's class is untouched
    assert isinstance(ops, TorchRowOps) and ops.BLOCK_ELEMENTS == 1 << 10
    rows, profiles = bench.time_mtp_path(16, 1, hidden=32, vocab=256, chunk=4, profile=True)
    assert [name for name, _, _ in rows] == ["'ce'", "'tv'"] and rows[0][2] == 1.0
    for case in ('ce', 'tv'):  # every case multiplies matrices; the rows add up to the total
        seconds = profiles[case]
        assert seconds['matrix products'] > 0
        parts = sum(v for k, v in seconds.items() if k != 'total')
        assert abs(parts - seconds['total']) <= 1e-9 + 1e-6 * seconds['total']
    out = capsys.readouterr().out
    assert TorchRowOps.BLOCK_ELEMENTS == default  # never set by the tool
    assert row_ops.row_max_argmax.__module__ == 'megatron.mtp_tv.row_ops'
    exponent = default.bit_length() - 1
    assert f'| 2^{exponent} (default) | ' in out and '| 2^10 | ' in out and '| 2^12 | ' in out
    for variant in ('torch.max(z, -1)', 'row_max_argmax', 'torch.amax (no index)'):
        assert f'| {variant} | ' in out
    assert 'not adopted' not in out

    core = max(os.sched_getaffinity(0))
    for kind in ('memory', 'cpu'):
        with bench.hog(kind, core) as hog:  # busy on its core while the block runs, then gone
            assert hog.poll() is None and os.sched_getaffinity(hog.pid) == {core}
        assert hog.poll() is not None


def test_packed_rows_target_the_collectives_of_one_sequence():
    # The 'packed' rows (TP=2 x CP=2, run by `--cases packed`) on made-up counts: the packed row
    # meets its target only with one sequence's collective calls, and the table shows both.
    def row(impl, sequences, products, collectives):
        return {'case': 'packed', 'seq': 4096, 'tp': 2, 'cp': 2, 'G': 1, 'impl': impl,
                'sequences': sequences, 'tokens': 4096, 'time_s': 1.0, 'times_s': [1.0],
                'ratio': 1.0, 'vs_one_sequence': None if impl == 'ce' else 1.0,
                'products': products, 'collectives': collectives}

    args = argparse.Namespace(hidden=64)
    for collectives, met in ((10, True), (258, False)):
        rows = [row('ce', 1, 3, 4), row('tv 1 sequence', 1, 13, 10),
                row('tv 64 sequences', 64, 16, collectives)]
        apply_targets(rows, args)
        assert rows[2]['met'] is met and rows[1]['met'] is None and rows[0]['target'] == 'baseline'
    table = '\n'.join(report_module.render_packed(rows))
    assert "| tv 64 sequences | 64 | 16 | 258 |" in table and 'MISS' in table


def test_packed_counter_counts_products_and_collectives():
    import torch.distributed as dist

    from lossbench.packed import counting_calls

    counts = {}
    a = torch.randn(4, 3, requires_grad=True)
    group = dist.new_group(backend='gloo') if dist.is_initialized() else None
    if group is None:
        dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        with counting_calls(counts):
            (a @ torch.randn(3, 5)).sum().backward()  # mm forward, mm backward
            dist.all_reduce(torch.ones(2), group=group)
    finally:
        if group is None:
            dist.destroy_process_group()
    assert counts == {'products': 2, 'collectives': 1}
