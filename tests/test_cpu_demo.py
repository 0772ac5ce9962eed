"""examples/cpu_demo.py: a fast smoke run, determinism, bad input, and the demo's own forward.

The smoke run goes through the real entry point in a subprocess with tiny sizes (a few steps per
phase, every default arm: warm, serving-temperature and cold start); it checks the exit status,
the printed tables, ``results.json`` and both PNGs.
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
    '--steps-pretrain', '6', '--steps-drift', '3', '--steps-heal', '4', '--steps-cold', '4',
    '--eval-points', '2',
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


WARM = ('ce', 'tv', 'e2e_tv')
COLD = ('cold_ce', 'cold_kl', 'cold_tv', 'cold_lk', 'cold_nla', 'cold_e2e_tv')
DEFAULT_ARMS = [*WARM, 'serve_tv', *COLD]


@pytest.mark.slow
def test_smoke_run(tmp_path):
    out = tmp_path / 'out'
    res = run_demo(*TINY, '--out-dir', str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    for phase in ('pretrain (A)', 'drift (B)', 'heal ce', 'heal tv', 'heal e2e_tv', 'heal tv T=0.7',
                  'eval fresh heads', 'cold ce', 'cold kl', 'cold tv', 'cold lk', 'cold nla',
                  'cold e2e_tv'):
        assert phase in res.stderr  # a progress bar per phase
    assert "healed with 'tv'" in res.stdout and 'empirical' in res.stdout
    for title in ('Warm start', 'Cold start', 'Greedy decoding (T=0)',
                  'serving temperature T=0.7'):
        assert title in res.stdout
    assert "cold start, 'lk'" in res.stdout and "healed with 'tv' at T=0.7" in res.stdout
    assert f"results: {out / 'results.json'}" in res.stdout
    data = json.loads((out / 'results.json').read_text())
    settings = data['settings']
    assert settings['gamma'] == 2 and settings['arms'] == DEFAULT_ARMS
    assert settings['serving_temperature'] == 0.7 and settings['lk_eta'] == 3.0
    assert settings['mtp_tv_chunk'] == 4 * 16  # one chunk per micro-batch
    assert settings['training_temperature']['serve_tv'] == 0.7
    assert settings['arm_scenarios']['cold_kl'] == {'scenario': 'cold', 'loss': 'kl'}
    assert data['eval_steps'] == [2, 4] and data['cold_eval_steps'] == [2, 4]
    seen = {(e['arm'], e['step']) for e in data['evaluations']}
    assert seen == {('pretrained', 0), ('drifted', 0), ('cold_init', 0)} | {
        (arm, step) for arm in DEFAULT_ARMS for step in (2, 4)}
    for e in data['evaluations']:
        final = e['step'] in (0, 4)
        warm = e['arm'] in ('pretrained', 'drifted', *WARM, 'serve_tv')
        assert ('speculative_greedy' in e) == final
        assert ('speculative_serving' in e) == (final and warm)
        assert 'teacher_forced_greedy' in e and 'teacher_forced_serving' in e
        for tf_key, sd_key in (('teacher_forced', 'speculative'),
                               ('teacher_forced_greedy', 'speculative_greedy'),
                               ('teacher_forced_serving', 'speculative_serving')):
            tf, sd = e[tf_key], e.get(sd_key)
            assert len(tf['alpha']) == 2
            assert all(0.0 <= a['mean'] <= 1.0 and a['se'] >= 0 for a in tf['alpha'])
            if sd is None:
                continue
            assert len(sd['depth_acceptance']) == 2
            assert 0.0 <= sd['accepted']['mean'] <= 2.0 and sd['accepted']['n'] == 12
            assert sd['tokens_per_step']['mean'] == pytest.approx(sd['accepted']['mean'] + 1)
            assert len(sd['per_prompt']) == 12
        assert e['speculative']['temperature'] == 1.0
        if 'speculative_greedy' in e:
            assert e['speculative_greedy']['temperature'] == 0.0
            for a in e['teacher_forced_greedy']['alpha_at_prompt_end']:  # a mean of 0/1 values
                assert a['mean'] * a['n'] == pytest.approx(round(a['mean'] * a['n']), abs=1e-6)
        tf = e['teacher_forced']
        for k in range(2):  # the TV logit gradient 2 s (1 - s) with s <= alpha is at most 1/2
            assert 0.0 <= tf['tv_logit_grad_l1'][k]['mean'] <= 0.5
            assert tf['kl_logit_grad_l1'][k]['mean'] == pytest.approx(
                2 * (1 - tf['alpha'][k]['mean']), abs=1e-5)
    for e in data['evaluations']:
        if e['arm'] in DEFAULT_ARMS:  # the plugin logged training-time acceptance
            metrics = e['plugin_train_metrics']
            assert 'mtp_expected_accepted_drafts' in metrics
            assert 'mtp_expected_accepted_drafts_greedy' in metrics
    for arm in DEFAULT_ARMS:
        curve = data['train_curves'][arm]
        assert len(curve['grad_norm']) == 4 and all(g > 0 for g in curve['grad_norm'])
    assert [row['label'] for row in data['table']][:2] == [
        'pretrained, before drift', 'drifted, no healing']
    tables = data['tables']
    assert set(tables) == {'warm', 'cold', 'greedy', 'serving'}
    assert [row['arm'] for row in tables['warm']] == ['pretrained', 'drifted', *WARM]
    assert [row['arm'] for row in tables['cold']] == ['cold_init', *COLD]
    assert [row['arm'] for row in tables['greedy']] == [
        'pretrained', 'drifted', *WARM, 'serve_tv', 'cold_init', *COLD]
    assert [row['arm'] for row in tables['serving']] == [
        'pretrained', 'drifted', *WARM, 'serve_tv']
    for name, rows in tables.items():
        for row in rows:
            assert row['empirical_minus_predicted_at_n']['n'] == 12 and 'vs_ce' in row
            assert 'per_prompt' not in row['speculative']
    serve_row = tables['serving'][-1]
    assert serve_row['vs_t1']['n'] == 12  # serve_tv minus tv, both verified at T=0.7
    cold_ce = next(r for r in tables['cold'] if r['arm'] == 'cold_ce')
    assert cold_ce['vs_ce']['mean'] == 0.0  # cold rows compare with the cold 'ce' arm
    assert 'emp. - pred@n' in res.stdout  # predicted vs empirical, side by side
    assert 'emp. - same loss at T=1' in res.stdout
    assert data['corpora']['B']['source'].startswith('pydoc_data')
    pytest.importorskip('matplotlib')
    for png in (out / 'acceptance.png', out / 'cold_start.png'):
        assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
        assert f'plot: {png}' in res.stdout


@pytest.mark.slow
def test_same_seed_same_numbers(tmp_path):
    """Deterministic for a given seed (two in-process runs), different for another seed."""
    import cpu_demo

    args = [*TINY, '--arms', 'tv,serve_lk,cold_kl,cold_lk', '--no-plot',
            '--corpus-b', str(_text_file(tmp_path))]
    results = []
    for name, seed in (('a', '3'), ('b', '3'), ('c', '4')):
        assert cpu_demo.main([*args, '--seed', seed, '--out-dir', str(tmp_path / name)]) == 0
        data = json.loads((tmp_path / name / 'results.json').read_text())
        results.append((data['evaluations'], data['train_curves']))
    assert results[0] == results[1]
    assert results[0][0] != results[2][0]
    arms = {e['arm'] for e in results[0][0]}
    assert arms == {'pretrained', 'drifted', 'cold_init', 'tv', 'serve_lk', 'cold_kl', 'cold_lk'}


def _text_file(tmp_path):
    path = tmp_path / 'user_corpus.txt'
    path.write_text('A user corpus of plain English text, repeated so that it is long enough. ' * 80)
    return path


BAD_ARGS = {
    'unknown arm': (['--arms', 'ce,cold_xx'], "unknown ['cold_xx']"),
    'serve_ce': (['--arms', 'serve_ce'], 'does not depend on the temperature'),
    'twice': (['--arms', 'tv,tv'], 'names an arm twice'),
    'temperature 0': (['--serving-temperature', '0'], 'finite number > 0'),
    'temperature nan': (['--serving-temperature', 'nan'], 'finite number > 0'),
    'temperature 1': (['--serving-temperature', '1'], 'same as the plain ones'),
    'eta': (['--lk-eta', '-1'], '--lk-eta must be a finite number >= 0'),
    'cold steps': (['--steps-cold', '0'], '--steps-cold must be >= 1'),
    'cold lr': (['--cold-lr', '0'], '--cold-lr must be > 0'),
    'cold eval points': (['--steps-cold', '2', '--eval-points', '3'], 'exceeds --steps-cold 2'),
}


@pytest.mark.parametrize('case', sorted(BAD_ARGS))
def test_bad_settings_exit_with_a_clear_message(capsys, case):
    import cpu_demo

    args, expect = BAD_ARGS[case]
    with pytest.raises(SystemExit) as exc:
        cpu_demo.parse_args(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expect in err and 'Traceback' not in err


def test_new_settings_are_in_the_help():
    import cpu_demo

    text = cpu_demo.build_parser().format_help()
    for flag in ('--steps-cold', '--cold-lr', '--serving-temperature', '--lk-eta'):
        assert flag in text
    for arm in ('cold_<loss>', 'serve_<loss>'):
        assert arm in text
    assert cpu_demo.parse_args([]).arms == DEFAULT_ARMS


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
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.mtp_tv.metrics import acceptance_metrics
    from mtp_tv_dev.models import capture_mtp_hidden_states, forward_loss

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

    # One depth at a time (speculative decoding's drafting): the same states; and depth k at
    # position n does not see the tokens after n + k + 1 (the drafts not drawn yet).
    previous = M.main_states(model, tokens)
    torch.testing.assert_close(previous, ours[0], rtol=0, atol=0)
    n = 12
    for k in range(3):
        previous = M.mtp_depth(model, k, previous, tokens)
        torch.testing.assert_close(previous, ours[k + 1], rtol=0, atol=1e-6)
        changed = tokens.clone()
        changed[:, n + k + 2:] = 7
        later = M.mtp_depth(model, k, M.hidden_states(model, changed, k)[k], changed)
        torch.testing.assert_close(later[: n + 1], previous[: n + 1], rtol=0, atol=1e-6)

    tf = E.teacher_forced_modes(model, tokens, 3, {'sampled': 1.0, 'greedy': 0.0, 'hot': 0.7})
    assert tf['sampled'] == E.teacher_forced(model, tokens, gamma=3)
    for temperature, mode in ((1.0, 'sampled'), (0.7, 'hot')):
        model.config.mtp_tv_temperature = temperature
        model.train()
        acceptance_metrics(MTPLossLoggingHelper.tracker)
        with torch.no_grad():
            forward_loss(model, tokens, tokens.roll(-1, 1), torch.ones(3, 20))
        plugin = acceptance_metrics(MTPLossLoggingHelper.tracker)
        assert tf[mode]['accepted']['mean'] == pytest.approx(
            float(plugin['mtp_expected_accepted_drafts']), abs=1e-5)
        assert tf['greedy']['accepted']['mean'] == pytest.approx(
            float(plugin['mtp_expected_accepted_drafts_greedy']), abs=1e-5)


def test_demo_helpers_match_gpt_model_forward_for_a_rope_model(megatron_cpu):
    """For a rope model (SmolLM2's kind) the helpers pass ``rotary_pos_emb`` as GPTModel.forward
    does: main and MTP states equal the model's own, one depth at a time too, and with cached
    main states. Without rope the states differ far beyond the tolerance (checked, so the test can
    fail; on SmolLM2 itself by up to 30)."""
    from mtp_tv_dev.cpu import causal_attention_mask
    from mtp_tv_dev.models import (
        build_gpt_with_mtp, capture_mtp_hidden_states, forward_loss)

    from cpu_demo_lib import model as M

    model = build_gpt_with_mtp(vocab_size=64, hidden_size=32, num_layers=2, mtp_num_layers=2,
                               seq_length=24, num_attention_heads=4, seed=3,
                               position_embedding_type='rope', rotary_base=100000)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad(), capture_mtp_hidden_states(model) as cap:
        forward_loss(model, tokens, labels=None)
    ours = M.hidden_states(model, tokens, 2)
    for k in range(3):
        torch.testing.assert_close(ours[k], cap.chunks[k], rtol=0, atol=1e-5)
    cached = M.hidden_states(model, tokens, 2, main=cap.chunks[0])
    for k in range(3):
        torch.testing.assert_close(cached[k], cap.chunks[k], rtol=0, atol=1e-5)
    previous = M.main_states(model, tokens)
    for k in range(2):
        previous = M.mtp_depth(model, k, previous, tokens)
        torch.testing.assert_close(previous, cap.chunks[k + 1], rtol=0, atol=1e-5)
    with torch.no_grad():  # the old call, without rotary_pos_emb: silently wrong
        embedded = model.embedding(input_ids=tokens, position_ids=None)
        no_rope = model.decoder(hidden_states=embedded, attention_mask=causal_attention_mask(24))
    assert (no_rope - cap.chunks[0]).abs().max() > 100 * 1e-5  # far outside the tolerance above


@pytest.mark.parametrize('arm', ['ce', 'tv', 'e2e_tv', 'kl', 'lk', 'serve_tv', 'serve_lk',
                                 'cold_ce', 'cold_kl', 'cold_tv', 'cold_lk', 'cold_nla', 'cold_e2e_tv'])
def test_heal_step_trains_only_the_heads(megatron_cpu, arm):
    """A training step of every kind of arm (warm, at a temperature, cold start) changes every MTP
    head parameter and no backbone parameter (the shared, tied output weight included), through
    the real Megatron loss path."""
    import megatron.mtp_tv
    from cpu_demo import arm_kind

    from cpu_demo_lib import model as M

    megatron.mtp_tv.install()
    spec = M.ModelSpec(hidden_size=16, num_layers=1, mtp_num_layers=2, seq_length=12,
                       num_attention_heads=2, seed=1)
    kind, loss = arm_kind(arm)
    phase = 'cold' if kind == 'cold' else 'heal'
    overrides = M.phase_overrides(phase, loss, 0.1, temperature=0.7 if kind == 'serve' else 1.0,
                                  lk_eta=3.0 if loss == 'lk' else None)
    state = None
    if kind == 'cold':  # fresh heads on a backbone: the heads differ from the backbone's model's
        trained = {k: v for k, v in M.build_model(
            spec, M.phase_overrides('heal', 'ce', 0.1)).state_dict().items() if torch.is_tensor(v)}
        state = M.fresh_heads(trained, spec, init_seed=99)
        assert all(torch.equal(state[k], v) for k, v in trained.items() if not k.startswith('mtp.'))
        assert any(not torch.equal(state[k], v) for k, v in trained.items() if k.startswith('mtp.'))
    model = M.build_model(spec, overrides, state)
    if kind == 'serve':
        assert model.config.mtp_tv_temperature == 0.7
    assert model.config.mtp_loss_type == loss
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
