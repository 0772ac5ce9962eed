"""examples/cpu_demo.py: a fast smoke run, determinism, bad input, and the demo's own forward.

The smoke run goes through the real entry point in a subprocess with tiny sizes (a few steps per
phase, every arm); it checks the exit status, the printed table, ``results.json`` and the PNG.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / 'examples' / 'cpu_demo.py'
sys.path.insert(0, str(ROOT / 'examples'))

TINY = [
    '--steps-pretrain', '6', '--steps-drift', '3', '--steps-heal', '4', '--eval-points', '2',
    '--eval-prompts', '12', '--hidden-size', '16', '--num-layers', '1',
    '--num-attention-heads', '2', '--mtp-num-layers', '2', '--seq-length', '16',
    '--batch-size', '4',
]


def run_demo(*args, timeout=240):
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    return subprocess.run(
        [sys.executable, str(DEMO), *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def test_smoke_run(tmp_path):
    out = tmp_path / 'out'
    res = run_demo(*TINY, '--out-dir', str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    for phase in ('pretrain (A)', 'drift (B)', 'heal ce', 'heal tv', 'heal e2e_tv'):
        assert phase in res.stderr  # a progress bar per phase
    assert "healed with 'tv'" in res.stdout and 'empirical' in res.stdout
    assert f"results: {out / 'results.json'}" in res.stdout
    data = json.loads((out / 'results.json').read_text())
    assert data['settings']['gamma'] == 2 and data['settings']['arms'] == ['ce', 'tv', 'e2e_tv']
    assert data['eval_steps'] == [2, 4]
    seen = {(e['arm'], e['step']) for e in data['evaluations']}
    assert seen == {('pretrained', 0), ('drifted', 0)} | {
        (arm, step) for arm in ('ce', 'tv', 'e2e_tv') for step in (2, 4)}
    for e in data['evaluations']:
        tf, sd = e['teacher_forced'], e['speculative']
        assert len(tf['alpha']) == 2 and len(sd['depth_acceptance']) == 2
        assert all(0.0 <= a['mean'] <= 1.0 and a['se'] >= 0 for a in tf['alpha'])
        assert 0.0 <= sd['accepted']['mean'] <= 2.0 and sd['accepted']['n'] == 12
        assert sd['tokens_per_step']['mean'] == pytest.approx(sd['accepted']['mean'] + 1)
        assert len(sd['per_prompt']) == 12
    for e in data['evaluations']:
        if e['arm'] in ('ce', 'tv', 'e2e_tv'):  # the plugin logged training-time acceptance
            assert 'mtp_expected_accepted_drafts' in e['plugin_train_metrics']
    assert [row['label'] for row in data['table']][:2] == [
        'pretrained, before drift', 'drifted, no healing']
    assert 'emp. - pred@n' in res.stdout  # predicted vs empirical, side by side
    for row in data['table']:
        assert row['empirical_minus_predicted_at_n']['n'] == 12 and 'vs_ce' in row
    assert data['corpora']['B']['source'].startswith('pydoc_data')
    png = out / 'acceptance.png'
    pytest.importorskip('matplotlib')
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert f'plot: {png}' in res.stdout


def test_same_seed_same_numbers(tmp_path):
    """Deterministic for a given seed (two in-process runs), different for another seed."""
    import cpu_demo

    args = [*TINY, '--arms', 'tv', '--no-plot', '--corpus-b', str(_text_file(tmp_path))]
    results = []
    for name, seed in (('a', '3'), ('b', '3'), ('c', '4')):
        assert cpu_demo.main([*args, '--seed', seed, '--out-dir', str(tmp_path / name)]) == 0
        data = json.loads((tmp_path / name / 'results.json').read_text())
        results.append(data['evaluations'])
    assert results[0] == results[1]
    assert results[0] != results[2]


def _text_file(tmp_path):
    path = tmp_path / 'user_corpus.txt'
    path.write_text('A user corpus of plain English text, repeated so that it is long enough. ' * 80)
    return path


@pytest.mark.parametrize('case', ['missing', 'empty', 'directory', 'gamma'])
def test_bad_input_exits_nonzero_with_a_clear_message(tmp_path, case):
    if case == 'missing':
        args, expect = ['--corpus-a', str(tmp_path / 'nope.txt')], 'does not exist'
    elif case == 'empty':
        (tmp_path / 'empty.txt').write_text('  \n')
        args, expect = ['--corpus-b', str(tmp_path / 'empty.txt')], 'is empty'
    elif case == 'directory':
        args, expect = ['--corpus-b', str(tmp_path)], 'is a directory'
    else:
        args, expect = ['--mtp-num-layers', '2', '--gamma', '3'], "larger than the model's MTP depth"
    res = run_demo(*args, '--out-dir', str(tmp_path / 'out'), timeout=60)
    assert res.returncode != 0
    assert expect in res.stderr, res.stderr
    assert 'Traceback' not in res.stderr
    assert not (tmp_path / 'out').exists()


def test_too_short_corpus_is_rejected(tmp_path):
    import cpu_demo

    path = tmp_path / 'short.txt'
    path.write_text('tiny')
    with pytest.raises(SystemExit) as exc:
        cpu_demo.parse_args(['--corpus-b', str(path)])
    assert exc.value.code != 0


def test_demo_forward_matches_gpt_model_forward(megatron_cpu):
    """The loss-free forward the demo drafts with equals GPTModel's own forward (main logits and
    every MTP depth's hidden states), and its teacher-forced expected acceptance equals what the
    plugin's TV loss logs for the same batch (two independent implementations)."""
    import megatron.mtp_tv
    from megatron.mtp_tv.metrics import acceptance_metrics
    from megatron.mtp_tv.testing.models import capture_mtp_hidden_states, forward_loss

    from cpu_demo_lib import evaluate as E
    from cpu_demo_lib import model as M

    megatron.mtp_tv.install()
    spec = M.ModelSpec(hidden_size=32, num_layers=2, mtp_num_layers=3, seq_length=20,
                       num_attention_heads=4, seed=5)
    model = M.build_model(spec, M.phase_overrides('heal', 'tv', 0.1))
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))

    model.eval()
    with torch.no_grad(), capture_mtp_hidden_states(model) as cap:
        logits = forward_loss(model, tokens, labels=None)  # [b, s, V]
    ours = M.hidden_states(model, tokens, 3)
    for k in range(4):
        torch.testing.assert_close(ours[k], cap.chunks[k], rtol=0, atol=1e-6)
    torch.testing.assert_close(M.project(model, ours[0]).transpose(0, 1), logits.float(),
                               rtol=0, atol=1e-5)

    # Fewer depths: the same leading hidden states.
    for k, h in enumerate(M.hidden_states(model, tokens, 1)):
        torch.testing.assert_close(h, ours[k], rtol=0, atol=0)

    tf = E.teacher_forced(model, tokens, gamma=3)
    model.train()
    acceptance_metrics()
    with torch.no_grad():
        forward_loss(model, tokens, tokens.roll(-1, 1), torch.ones(3, 20))
    plugin = acceptance_metrics()
    assert tf['accepted']['mean'] == pytest.approx(float(plugin['mtp_expected_accepted_drafts']),
                                                   abs=1e-5)


@pytest.mark.parametrize('arm', ['ce', 'tv', 'e2e_tv'])
def test_heal_step_trains_only_the_heads(megatron_cpu, arm):
    """Healing changes every MTP head parameter and no backbone parameter (the shared, tied
    output weight included), through the real Megatron loss path."""
    import megatron.mtp_tv

    from cpu_demo_lib import model as M

    megatron.mtp_tv.install()
    spec = M.ModelSpec(hidden_size=16, num_layers=1, mtp_num_layers=2, seq_length=12,
                       num_attention_heads=2, seed=1)
    model = M.build_model(spec, M.phase_overrides('heal', arm, 0.1))
    backbone, heads = M.backbone_and_heads(model)
    assert {id(p) for p in backbone}.isdisjoint(id(p) for p in heads)
    assert len(backbone) + len(heads) == len(list(model.parameters()))
    before = [p.detach().clone() for p in backbone], [p.detach().clone() for p in heads]
    params = M.set_trainable(model, 'heads')
    optimizer, _ = M.make_optimizer(params, 1e-2, 10)
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    M.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    assert all(torch.equal(a, p) for a, p in zip(before[0], backbone))
    assert all(not torch.equal(a, p) for a, p in zip(before[1], heads) if p.dim() > 1)
