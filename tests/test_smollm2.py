"""The SmolLM2-135M demo's model: the GGUF checkpoint mapped into megatron-core, and heads-only
training on cached backbone states through the plugin.

The reference is transformers' own Llama forward of the same checkpoint (an implementation
independent of the mapping and of Megatron), and GPTModel's own forward + backward for the
cached-states training step. The model is loaded once per module (converted checkpoint cached
in ``.cache/smollm2`` after the first load).
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'examples'))

TEXTS = [
    'The capital of France is Paris. It is known for the Eiffel Tower and its museums.',
    'def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n',
    'A for statement is used to iterate over the elements of a sequence (such as a string, tuple '
    'or list) or other iterable object.',
]


@pytest.fixture(scope='module')
def smollm2():
    pytest.importorskip('transformers', reason='the pinned Hugging Face stack (make setup-hf)')
    from smollm2_lib import weights as W

    torch.set_num_threads(1)
    return W.load_hf()


def _build(hf_model, loss='ce', mtp_num_layers=2, seed=5):
    import megatron.mtp_tv
    from cpu_demo_lib import model as M
    from smollm2_lib import weights as W

    megatron.mtp_tv.install()
    overrides = M.phase_overrides('cold', loss, 1.0, lk_eta=3.0 if loss == 'lk' else None)
    model = W.build_megatron(hf_model.config, mtp_num_layers, 64, seed=seed, **overrides)
    W.load_backbone(model, hf_model)
    return model


def test_licence_and_shape(smollm2):
    from smollm2_lib import weights as W

    hf_model, _ = smollm2
    assert W.gguf_metadata()['general.license'].lower() == 'apache-2.0'
    cfg = hf_model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert W.rope_base(cfg) == 100000.0


def test_mapping_matches_transformers_forward(smollm2, megatron_cpu):
    """Megatron's logits of the mapped weights equal transformers' own forward (1e-4, top-1 100%)
    on three texts; a model that skipped rope, or mixed up q/k/v groups, gate/up, or the norms
    would be off by whole units."""
    from cpu_demo_lib import model as M

    hf_model, tokenizer = smollm2
    model = _build(hf_model)
    for text in TEXTS:
        ids = tokenizer(text, return_tensors='pt').input_ids
        with torch.no_grad():
            ref = hf_model(ids).logits[0].double()
        ours = M.project(model, M.main_states(model, ids))[:, 0].double()
        assert ours.shape == ref.shape == (ids.shape[1], 49152)
        assert (ours - ref).abs().max().item() < 1e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_answer(smollm2, megatron_cpu):
    """Greedy decoding with the mapped model (chat template from the GGUF file) answers."""
    from cpu_demo_lib import model as M

    hf_model, tokenizer = smollm2
    model = _build(hf_model)
    prompt = tokenizer.apply_chat_template(
        [{'role': 'user', 'content': 'What is the capital of France?'}],
        add_generation_prompt=True, return_tensors='pt', return_dict=True)['input_ids']
    ids = prompt
    for _ in range(8):
        logits = M.project(model, M.main_states(model, ids))[-1, 0]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert 'Paris' in tokenizer.decode(ids[0, prompt.shape[1]:])


def _registry_losses():
    from megatron.mtp_tv.losses import LOSSES as REGISTRY  # torch only, no Megatron

    return ['ce'] + list(REGISTRY)


#: Every loss the plugin has (a loss added to the registry is tested without a change here).
LOSSES = _registry_losses()


@pytest.mark.parametrize('loss', LOSSES)
def test_cached_states_step_equals_gpt_model_backward(smollm2, megatron_cpu, loss):
    """One heads-only step on cached backbone states through the plugin, for every loss type:
    the heads' gradients equal those of GPTModel.forward's own loss path (which recomputes the
    backbone and the main cross-entropy); the step changes every head parameter and nothing else."""
    from mtp_tv_dev.models import forward_loss
    from smollm2_lib import heads as H

    hf_model, tokenizer = smollm2
    model = _build(hf_model, loss)
    ids = tokenizer(TEXTS[2], return_tensors='pt').input_ids[:, :25].repeat(2, 1)
    ids[1] = ids[1].roll(3)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    params = H.freeze_backbone(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert params and all(names[id(p)].startswith('mtp.') for p in params)

    model.train()
    loss_full = forward_loss(model, tokens, labels, torch.ones_like(labels, dtype=torch.float))
    loss_full.mean().backward()
    reference = {names[id(p)]: p.grad.clone() for p in params}
    for p in params:
        p.grad = None

    main = H.cache_states(model, tokens, 2, 'test')
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adam(params, lr=1e-3)
    stats = H.train_step(model, optimizer, tokens, labels, main, clip=None)
    assert torch.isfinite(torch.tensor(stats['mtp_loss'])) and stats['grad_norm'] > 0
    for p in params:
        torch.testing.assert_close(p.grad, reference[names[id(p)]], rtol=1e-4, atol=1e-7)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == name.startswith('mtp.'), name


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_demo(args, env_extra=None):
    import os
    import subprocess

    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''),
           **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / 'examples' / 'smollm2_demo.py'), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _cache_sharing_the_converted_checkpoint(folder: Path) -> Path:
    """A cache folder of its own (its ``runs`` checkpoints start empty) whose converted
    checkpoint files are links to the shared cache's (the ``smollm2`` fixture converted it): a
    second 540 MB copy, and a second minute of dequantising the GGUF file, would test nothing
    more."""
    from smollm2_lib import weights as W

    shared = Path(W.default_cache_dir())
    folder.mkdir()
    for path in shared.iterdir():
        if path.is_file():
            (folder / path.name).symlink_to(path)
    return folder


@pytest.mark.slow
def test_smoke_preset_runs_every_scenario_and_resumes(tmp_path, smollm2):
    """The command end to end on the ``smoke`` preset: every scenario of the ``long`` preset
    (the learning-rate grid at the full budget, every seed's test,
    the moved backbone and the healing grid, joint training) on 32-token windows; its report,
    summary and plot. Then the resume: with one part's file removed, a rerun runs that
    part alone, reading the heads and the moved backbone it needs from the cache folder."""
    import json

    out = tmp_path / 'results'
    cache = _cache_sharing_the_converted_checkpoint(tmp_path / 'cache')
    cpu_before = _children_cpu_seconds()
    res = _run_demo(['--preset', 'smoke', '--results-dir', str(out), '--cache-dir', str(cache)])
    cpu = _children_cpu_seconds() - cpu_before
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from smollm2_lib import experiment as X

    preset = X.PRESETS['smoke']
    parts = {p.stem: json.loads(p.read_text()) for p in (out / 'parts').glob('*.json')}
    losses = preset.loss_names()
    assert {p.split('_')[1] for p in parts if p.startswith('cold_') and p != 'cold_init'} == set(losses)
    last = preset.cold_steps
    for loss in losses:
        grid = {r['lr'] for n, r in parts.items()
                if n.startswith(f'cold_{loss}_lr') and r['steps'] == last}
        assert set(preset.lr_grid) <= grid  # every loss ran the whole grid at the budget
        test = parts[f'test_cold_{loss}_s0']
        assert test['steps'] == last and test['lr'] in grid
        assert f'test_heal_{loss}_s0' in parts and f'joint_{loss}_s0' in parts
    assert {'cold_init', 'drift_move', 'drift_before', 'drift_after'} <= set(parts)
    arm = parts[f"cold_tv_lr{parts['test_cold_tv_s0']['lr']:g}_n{last}_s0"]
    assert arm['common'] == preset.common() and arm['key']['loss'] == 'tv'
    assert [p['step'] for p in arm['curve']['validation']] == [0] + X.eval_points(
        last, preset.eval_every)
    spec = parts['test_cold_tv_s0']['final']['spec_sampled']
    assert spec['verify_steps'] == preset.spec_prompts * preset.spec_rounds
    assert len(spec['per_prompt']) == len(spec['per_prompt_rao_blackwell']) == preset.spec_prompts
    summary = json.loads((out / 'summary.json').read_text())
    assert [row['label'] for row in summary['cold']] == losses
    assert '## Cold start' in res.stdout and '## Joint' in res.stdout
    assert summary['pending'] == {} and 'Incomplete' not in res.stdout
    assert (out / 'report.md').read_text().strip() == res.stdout.strip()
    for plot in ('smollm2_curves.png', 'smollm2_gains.png'):
        assert (out / plot).stat().st_size > 10_000, plot
    # A smoke run stays one: CPU time, not wall time, which doubles when the other pytest-xdist
    # worker shares the core.
    assert cpu < 240, f'the smoke preset took {cpu:.0f} CPU-seconds'

    (out / 'parts' / 'test_heal_tv_s0.json').unlink()
    rerun = _run_demo(['--preset', 'smoke', '--results-dir', str(out), '--cache-dir', str(cache),
                       '--no-plot'])
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert [line for line in rerun.stderr.splitlines() if line.endswith(': running')] == [
        'part test_heal_tv_s0: running']
    assert 'making them' not in rerun.stderr  # the heads and backbone came from the cache folder
    assert json.loads((out / 'parts' / 'test_heal_tv_s0.json').read_text())['loss'] == 'tv'


def test_window_order_curve_points_and_plateau_rule():
    """An extended arm sees the same windows first; curves have a point every ``every`` steps
    and at the last; the plateau gain is over the last quarter of the run."""
    from smollm2_lib import experiment as X

    order = X.window_order(10, 7, 2, seed=3)
    assert torch.equal(X.window_order(10, 4, 2, seed=3), order[:4])
    assert X.eval_points(7, 3) == [3, 6, 7]
    curve = [{'step': s, 'sampled': {'accepted': a}} for s, a in ((0, 0.1), (3, 0.5), (6, 0.6),
                                                                  (8, 0.61))]
    assert abs(X.plateau_gain(curve, 8) - (0.61 - 0.6) / 0.6) < 1e-12


@pytest.mark.slow
def test_an_interrupted_arm_resumes_from_its_checkpoint(smollm2, megatron_cpu, tmp_path):
    """A heads arm stopped after its first checkpoint and run again to a larger budget resumes
    there (the same windows, heads and optimiser state) and ends with the heads of one
    uninterrupted run; its curve is the uninterrupted one."""
    import megatron.mtp_tv
    from smollm2_lib import experiment as X

    megatron.mtp_tv.install()
    preset = X.PRESETS['smoke']
    runs = {}
    for name in ('straight', 'resumed'):
        experiment = X.Experiment(preset, X.Store(str(tmp_path / f'{name}-results'),
                                                  preset.common()), None, log=print)
        experiment.runs_dir = str(tmp_path / name)  # the checkpoints; the model's own cache kept
        experiment.setup()
        if name == 'resumed':
            experiment.run_arm(X.HeadsArm('cold', 'tv', 1e-3, 0, preset.checkpoint_every))
        runs[name] = experiment.run_arm(X.HeadsArm('cold', 'tv', 1e-3, 0,
                                                   2 * preset.checkpoint_every))
    (straight, heads), (resumed, heads_resumed) = runs['straight'], runs['resumed']
    assert straight['curve'] == resumed['curve']
    for key in heads:
        assert torch.equal(heads[key], heads_resumed[key]), key


def test_scenario_losses_come_from_the_registry():
    """The arms derive from the plugin's registry: every per-depth loss is a one-depth arm; the
    per-chain ones equal 'tv' at one depth."""
    from megatron.mtp_tv.losses import LOSSES as REGISTRY
    from smollm2_lib import experiment as X

    per_chain = [name for name, cls in REGISTRY.items() if cls.per_chain]
    assert per_chain == ['e2e_tv']
    assert X.depth_one_losses() == ['ce'] + [n for n in REGISTRY if n not in per_chain]


def test_store_reuses_a_part_only_for_the_same_settings(tmp_path):
    """A stored part is reused for the same key under the same common settings only: another
    learning rate (key) or other evaluation sizes (common settings) run it again."""
    from smollm2_lib.experiment import PRESETS, Store

    key = {'loss': 'tv', 'lr': 1e-3}
    store = Store(str(tmp_path), PRESETS['long'].common())
    store.save('cold_tv_s0', key, {'loss': 'tv'})
    assert store.load('cold_tv_s0', key)['loss'] == 'tv'
    assert store.load('cold_tv_s0', {**key, 'lr': 3e-3}) is None
    assert Store(str(tmp_path), PRESETS['default'].common()).load('cold_tv_s0', key) is None
    assert list(store.all()) == ['cold_tv_s0']
    assert not list(tmp_path.glob('parts/*.tmp'))


@pytest.mark.parametrize('argv, message', [
    (['--preset', 'huge'], "invalid choice: 'huge'"),
])
def test_bad_flags_exit_with_a_clear_message(capsys, argv, message):
    import smollm2_demo

    with pytest.raises(SystemExit) as exc:
        smollm2_demo.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def _synthetic_test(loss, seed, per_prompt, tf_alpha=0.2):
    spec = {'per_prompt': per_prompt, 'per_prompt_rao_blackwell': per_prompt}
    tf = {'sampled': {'alpha': [{'mean': tf_alpha, 'se': 0.01}]}}
    return {'loss': loss, 'seed': seed, 'lr': 1e-3, 'steps': 10, 'final': {
        'spec_sampled': spec, 'spec_greedy': spec, 'tf_test': tf, 'tf_continuation': tf}}


def test_report_resolves_a_difference_only_when_every_seed_agrees():
    """The report's difference from 'ce', computed here by hand on synthetic parts: per seed the
    paired mean over prompts, the mean over seeds, the standard errors across seeds and over
    prompts, the gain in percent; 'resolved' needs every seed of one sign and the mean beyond 2
    standard errors of both kinds."""
    import math

    from smollm2_lib import report as R

    ce = {0: [0.1, 0.2, 0.3, 0.2], 1: [0.3, 0.2, 0.1, 0.2], 2: [0.2, 0.2, 0.2, 0.3]}
    tv = {0: [0.4, 0.5, 0.5, 0.6], 1: [0.5, 0.4, 0.6, 0.5], 2: [0.4, 0.5, 0.4, 0.6]}
    kl = {0: [0.4, 0.5, 0.5, 0.6], 1: [0.1, 0.1, 0.1, 0.2], 2: [0.4, 0.5, 0.4, 0.6]}  # seed 1 <
    parts = {}
    for seed in ce:
        for loss, values in (('ce', ce), ('tv', tv), ('kl', kl)):
            parts[f'test_cold_{loss}_s{seed}'] = _synthetic_test(loss, seed, values[seed])
    rows = {r['label']: r for r in R.headline_rows(parts, 'cold', (0, 1, 2))}
    per_seed = [sum(t - c for t, c in zip(tv[s], ce[s])) / 4 for s in ce]
    mean = sum(per_seed) / 3
    se_seeds = math.sqrt(sum((d - mean) ** 2 for d in per_seed) / 2 / 3)
    got = rows['tv']['vs T=1 counted']
    assert math.isclose(got['mean'], mean) and math.isclose(got['se_seeds'], se_seeds)
    assert got['per_seed'] == pytest.approx(per_seed) and got['resolved']
    ce_tokens = sum(1 + sum(v) / 4 for v in ce.values()) / 3
    assert math.isclose(rows['tv']['gain% T=1 counted'], 100 * mean / ce_tokens)
    assert rows['tv']['per seed T=1 counted'] == pytest.approx([1 + sum(v) / 4 for v in
                                                                tv.values()])
    assert rows['kl']['vs T=1 counted']['mean'] > 0 and not rows['kl']['vs T=1 counted'][
        'resolved']  # one seed of the other sign
    assert 'vs T=1 counted' not in rows['ce']  # the baseline is not compared with itself
    # between the alternatives: each against the best of them ('tv' here), 'ce' left out
    versus = R.versus_leader(parts, 'cold', (0, 1, 2), list(rows.values()))
    between = {r['label']: r for r in versus['rows']}
    assert versus['leader'] == 'tv' and set(between) == {'tv', 'kl'}
    assert 'vs T=1 counted' not in between['tv']
    kl_vs_tv = [sum(k - t for k, t in zip(kl[s], tv[s])) / 4 for s in ce]
    assert between['kl']['vs greedy counted']['per_seed'] == pytest.approx(kl_vs_tv)
    one = R.seed_difference({0: tv[0]}, {0: ce[0]})
    assert one['mean'] > 0 and not one['resolved']  # one seed never resolves a difference


def test_an_interrupted_runs_report_says_what_it_lacks():
    """The report of a run stopped after some parts names, by scenario and loss, every final
    part of the protocol not yet stored."""
    import dataclasses

    from smollm2_lib import experiment as X
    from smollm2_lib import report as R

    preset = dataclasses.replace(X.PRESETS['long'], losses=('ce', 'tv'))
    parts = {f'test_cold_ce_s{s}': _synthetic_test('ce', s, [0.2, 0.3]) for s in preset.seeds}
    parts['test_cold_tv_s0'] = _synthetic_test('tv', 0, [0.3, 0.3])
    summary = R.summarize(parts, preset)
    assert summary['pending'] == {
        'cold `tv`': [1, 2], 'drift_before': [], 'drift_after': [], 'heal `ce`': [0, 1, 2],
        'heal `tv`': [0, 1, 2], 'joint `ce`': [0, 1], 'joint `tv`': [0, 1]}
    assert ('not yet run: cold `tv` (seeds 1, 2), drift_before, drift_after, heal `ce` (seeds 0, '
            '1, 2), heal `tv` (seeds 0, 1, 2), joint `ce` (seeds 0, 1), joint `tv` (seeds 0, 1).'
            ) in R.render(summary, preset)


def test_healing_recovery_is_the_first_curve_step_back_at_the_pre_drift_alpha():
    """Steps to recover: the first curve point whose alpha reaches the official head's alpha
    before the drift; a head that never does reports its best point instead."""
    from smollm2_lib import report as R

    def curve(alphas):
        return {'validation': [{'step': 25 * i, 'sampled': {'alpha': [a]}}
                               for i, a in enumerate(alphas)]}

    parts = {'drift_before': {'curve_validation': {'sampled': {'alpha': [0.40]}}}}
    for seed, alphas in ((0, [0.30, 0.38, 0.40, 0.39]), (1, [0.30, 0.36, 0.37, 0.35])):
        test = _synthetic_test('ce', seed, [0.2])
        test['steps'] = 75
        parts[f'test_heal_ce_s{seed}'] = test
        parts[R._arm_name('heal', test)] = {'steps': 75, 'curve': curve(alphas)}
    rec = R.recovery(parts, (0, 1))
    assert rec['goal'] == 0.40
    assert rec['losses']['ce'] == [
        {'seed': 0, 'steps': 75, 'step': 50, 'best': 0.40, 'best_step': 50},
        {'seed': 1, 'steps': 75, 'step': None, 'best': 0.37, 'best_step': 50}]
    assert R.recovery({}, (0, 1)) == {}  # no drift scored yet


def test_grid_extends_past_a_winning_edge(tmp_path):
    """A learning rate that wins at an end of the grid is not taken as the optimum: the grid
    grows by a half-decade beyond it until an inner value wins (or its extension budget is
    spent); every tried value is a stored part."""
    import math

    from smollm2_lib import experiment as X

    best = 1e-4
    experiment = X.Experiment(X.PRESETS['long'], X.Store(str(tmp_path), {}), cache_dir='',
                              log=lambda m: None)
    score = {}
    experiment.run_arm = lambda arm: ({'validation': {'sampled': {'accepted': score[arm.lr]}},
                                       'seed': arm.seed}, {})
    experiment.arm_key = lambda arm: {'lr': arm.lr, 'loss': arm.loss}
    for lr in (3e-5, 1e-4, 3e-4, 1e-3, 3e-3):
        score[lr] = 1.0 / (1.0 + abs(math.log10(lr / best)))
    assert experiment.best_lr('cold', 'tv', 99, (3e-4, 1e-3, 3e-3)) == best
    assert sorted(experiment.records) == sorted(
        f'cold_tv_lr{x:g}_n99_s0' for x in (3e-5, 1e-4, 3e-4, 1e-3, 3e-3))
    assert X.half_decade(1e-3, up=True) == 3e-3 and X.half_decade(1e-3, up=False) == 3e-4
    score.update({3e-4: 0.0, 1e-3: 1.0, 3e-3: 0.0})
    assert experiment.best_lr('cold', 'ce', 99, (3e-4, 1e-3, 3e-3)) == 1e-3
    assert 'cold_ce_lr0.0001_n99_s0' not in experiment.records  # an inner winner: no extension


def test_retrained_heads_are_checked_against_their_stored_part(tmp_path):
    """Heads missing from the cache folder (a new machine) are retrained from the arm's key,
    and the log sets the replay's whole-validation score beside the stored part's."""
    from smollm2_lib import experiment as X

    lines = []
    experiment = X.Experiment(X.PRESETS['long'], X.Store(str(tmp_path), {}), cache_dir='',
                              log=lines.append)
    experiment.arm_key = lambda arm: {'lr': arm.lr, 'loss': arm.loss}
    arm = X.HeadsArm('cold', 'ce', 1e-3, 0, 99)
    experiment.store.save(arm.name, experiment.arm_key(arm),
                          {'validation': {'sampled': {'accepted': 0.25}}})
    experiment.run_arm = lambda arm: ({'validation': {'sampled': {'accepted': 0.5}}},
                                      {'w': 1})
    assert experiment.heads(arm) == {'w': 1}
    assert lines[-1] == (f'{arm.name}: replayed, whole-validation accepted drafts 0.500000 '
                         '(the stored part: 0.250000, difference +2.50e-01)')


def test_chained_smoke_preset_runs_and_resumes(tmp_path, smollm2):
    """Issue 59's preset at toy sizes: one shared MTP layer at two depths scored with two
    chained drafts (per-depth alpha, speculative decoding at gamma 2), the cosine schedule, the
    rate grid, the plateau arm at twice the budget and the budget doubled when that gains
    (the seeds run at the budget chosen); a rerun runs nothing."""
    import json

    from smollm2_lib import experiment as X

    out = tmp_path / 'results'
    cache = _cache_sharing_the_converted_checkpoint(tmp_path / 'cache')
    argv = ['--preset', 'chained-smoke', '--results-dir', str(out), '--cache-dir', str(cache),
            '--no-plot']
    res = _run_demo(argv)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    preset = X.PRESETS['chained-smoke']
    parts = {p.stem: json.loads(p.read_text()) for p in (out / 'parts').glob('*.json')}
    n = preset.cold_steps
    assert {f'cold_ce_lr{lr:g}_n{n}_s0' for lr in preset.lr_grid} <= set(parts)
    best, budget = parts['test_cold_ce_s0']['lr'], parts['test_cold_ce_s0']['steps']
    assert f'cold_ce_lr{best:g}_n{2 * n}_s0' in parts  # the plateau arm
    short, long = (parts[f'cold_ce_lr{best:g}_n{k}_s0'] for k in (n, 2 * n))
    assert budget == (n if X.tau_gain(short, long) < preset.plateau_gain else 2 * n)
    assert 'cold_init' in parts and 'test_cold_ce_s1' not in parts  # other seeds: S3
    assert '| `ce` | ' in (out / 'report.md').read_text().split('Plateau, seed 0')[1]
    arm = parts[f'cold_ce_lr{best:g}_n{n}_s0']
    assert arm['depths'] == 2 and arm['common']['repeated_layer'] is True
    assert len(arm['validation']['sampled']['alpha']) == 2
    spec = parts['test_cold_ce_s0']['final']['spec_sampled']
    assert len(spec['depth_acceptance_given_reached']) == 2
    assert spec['verify_steps'] == preset.spec_prompts * preset.spec_rounds
    assert parts['cold_init']['data']['files']['rl'] > 0
    rerun = _run_demo(argv)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert not [line for line in rerun.stderr.splitlines() if line.endswith(': running')]


def test_cosine_schedule_warms_up_then_decays_to_zero():
    from smollm2_lib import experiment as X

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    rates = []
    for step in range(1, 11):
        X.set_lr(opt, 1.0, step, warmup=2, total=10, schedule='cosine')
        rates.append(opt.param_groups[0]['lr'])
    assert rates[:2] == [0.5, 1.0] and rates[-1] == 0.0
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))
    X.set_lr(opt, 1.0, 7, warmup=2, total=10, schedule='constant')
    assert opt.param_groups[0]['lr'] == 1.0
    with pytest.raises(ValueError, match="schedule='linear'"):
        X.set_lr(opt, 1.0, 7, warmup=2, total=10, schedule='linear')


def test_file_split_shares_no_file_between_splits():
    """Evaluation files are disjoint from training files: each file's split is a function of
    its name alone, and every split holds files."""
    from cpu_demo_lib.corpus import stdlib_files
    from smollm2_lib import data as D

    names = [name for name, _ in stdlib_files()]
    splits = {name: D.split_of_file(name) for name in names}
    assert set(splits.values()) == {'train', 'rl', 'validation', 'test'}
    assert all(D.split_of_file(name) == split for name, split in splits.items())  # stable
