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
    from megatron.mtp_tv.testing.models import forward_loss
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


def test_smoke_run_of_the_command(tmp_path):
    """The demo's command end to end with tiny sizes, both scenarios: exit status, tables, the
    results JSON (the main model's held-out perplexity shows wrong weights) and the plot."""
    import json
    import os
    import subprocess
    import time

    pytest.importorskip('transformers', reason='the pinned Hugging Face stack (make setup-hf)')
    out = tmp_path / 'out'
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''),
           'OMP_NUM_THREADS': '1'}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(ROOT / 'examples' / 'smollm2_demo.py'), '--steps', '2',
         '--warm-steps', '1', '--arms', 'cold_ce,cold_tv,tv', '--prompts', '3',
         '--seq-length', '16', '--batch-size', '1', '--eval-length', '8', '--eval-points', '1',
         '--stdlib-chars', '20000', '--seed', '3', '--out-dir', str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for phase in ('load SmolLM2', 'backbone: train B', 'cold ce', 'cold tv', "warm-up 'ce' (A)",
                  'warm tv'):
        assert phase in res.stderr  # a tqdm bar per long phase
    for title in ('Warm heads', 'Cold start', 'Greedy decoding (T=0)', 'serving temperature'):
        assert title in res.stdout
    data = json.loads((out / 'results.json').read_text())
    assert data['settings']['arms'] == ['cold_ce', 'cold_tv', 'tv']
    assert data['settings']['seed'] == 3 and data['settings']['prompts'] == 3
    assert data['settings']['clipping'] == 'none'
    assert data['model']['gguf_metadata']['general.license'].lower() == 'apache-2.0'
    # 8-token windows from random offsets: a few hundred; random weights: tens of thousands
    assert 1.0 < data['main_model_held_out_perplexity'] < 2000
    finals = {(e['arm'], e['step']) for e in data['evaluations'] if 'speculative' in e}
    assert finals == {('cold_init', 0), ('cold_ce', 2), ('cold_tv', 2), ('drifted', 0), ('tv', 2)}
    assert [row['arm'] for row in data['tables']['cold']] == ['cold_init', 'cold_ce', 'cold_tv']
    for e in data['evaluations']:
        if 'speculative' in e:
            assert len(e['speculative']['per_prompt']) == 3
    assert (out / 'smollm2_acceptance.png').stat().st_size > 10_000
    assert elapsed < 120 or os.getloadavg()[0] > 4, f'{elapsed:.0f}s on an idle machine'


def test_default_arms_come_from_the_registry():
    import smollm2_demo

    arms = smollm2_demo.default_arms()
    assert arms[: len(LOSSES)] == [f'cold_{x}' for x in LOSSES]
    assert arms[len(LOSSES):] == ['ce', 'tv', 'e2e_tv', 'lk']


@pytest.mark.parametrize('argv, message', [
    (['--arms', 'cold_xx'], "unknown ['cold_xx']"),
    (['--steps', '0'], '--steps must be >= 1'),
    (['--prompts', '1'], '--prompts must be >= 2'),
    (['--clip', '0'], '--clip must be > 0'),
    (['--eval-length', '3'], 'too short for gamma=2'),
])
def test_bad_flags_exit_with_a_clear_message(capsys, argv, message):
    import smollm2_demo

    with pytest.raises(SystemExit) as exc:
        smollm2_demo.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
