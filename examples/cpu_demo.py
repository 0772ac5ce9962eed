#!/usr/bin/env python
"""Graft-and-heal and cold start on CPU: which MTP loss makes draft heads accepted most often.

A tiny megatron-core GPTModel with MTP heads (the real Megatron loss path, with the
``megatron.mtp_tv`` plugin) goes through the life of a grafted draft head:

1. pretrain backbone + MTP heads jointly with cross-entropy on domain A (Python stdlib code);
2. drift: fine-tune the backbone alone (a model without MTP heads) on domain B (English Python
   docs), then graft the pretrained heads back on -- the situation of an official MTP head
   grafted onto an SFT'd or RL'd model;
3. heal (warm start): from the same drifted weights and with the same budget and batches, train
   only the heads (backbone frozen, ``mtp_detach_heads``) with ``mtp_loss_type`` 'ce', 'tv' and
   'e2e_tv' (arms named by the loss), and 'tv' trained at the serving temperature
   (``mtp_tv_temperature``; arm 'serve_tv');
4. cold start: re-initialise the MTP layers on the drifted backbone (MTP heads added to an existing
   model) and train them the same way with 'ce', 'kl', 'tv', 'lk', 'nla' and 'e2e_tv' (arms
   'cold_<loss>');
5. measure on held-out domain-B text, at a few points while training each arm: teacher-forced
   per-depth acceptance ``alpha = sum min(p, q)`` and the accepted drafts per verify step it
   predicts, next to the number counted in real speculative decoding (heads draft ``gamma`` tokens
   from their own samples, the main model verifies by rejection sampling at temperature 1); at the
   end of each arm also greedy speculative decoding (T=0: argmax drafts, accepted iff they are
   the main model's argmax) and, for the warm arms, sampling at the serving temperature.

Writes ``results.json`` (every number and setting), ``acceptance.png`` (warm heal) and
``cold_start.png`` to ``--out-dir`` and prints the tables. Defaults finish in minutes on two
CPU cores (measured: docs/cpu_demo.md); deterministic for a seed.

    .venv/bin/python examples/cpu_demo.py                       # the default experiment
    .venv/bin/python examples/cpu_demo.py --corpus-b my.txt     # drift/heal on your own text
"""

import argparse
import importlib.util
import math
import os
import platform
import resource
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_demo_lib
from cpu_demo_lib.arms import ARMS, DEFAULT_ARMS, LOSSES, arm_kind  # noqa: E402


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Parser(argparse.ArgumentParser):
    """Errors as one clear line (not the whole usage block), exit status 2."""

    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n(run {self.prog} --help for all options)\n')


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog='cpu_demo.py',
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group('experiment')
    g.add_argument('--steps-pretrain', type=int, default=500, help='phase 1 steps (CE, domain A)')
    g.add_argument('--steps-drift', type=int, default=300, help='phase 2 steps (backbone, domain B)')
    g.add_argument('--steps-heal', type=int, default=200,
                   help='steps per warm arm (grafted heads only, phase 3)')
    g.add_argument('--steps-cold', type=int, default=200,
                   help='steps per cold-start arm (re-initialised heads only, phase 4)')
    g.add_argument('--arms', default=','.join(DEFAULT_ARMS),
                   help='comma-separated arms: a loss (' + ','.join(LOSSES) + ') heals the '
                        'grafted heads at T=1; serve_<loss> heals them with mtp_tv_temperature = '
                        '--serving-temperature (all but ce); cold_<loss> trains re-initialised '
                        'heads. Every arm of a scenario starts from the same weights with the '
                        'same batches and budget')
    g.add_argument('--lr', type=float, default=2e-3, help='peak learning rate, phases 1 and 2')
    g.add_argument('--heal-lr', type=float, default=1e-3, help='peak learning rate, warm arms')
    g.add_argument('--cold-lr', type=float, default=2e-3, help='peak learning rate, cold arms')
    g.add_argument('--serving-temperature', type=float, default=0.7,
                   help='temperature of the serve_* arms (training, mtp_tv_temperature) and of '
                        'the serving-temperature evaluation of every warm arm')
    g.add_argument('--lk-eta', type=float, default=3.0,
                   help="mtp_lk_eta of the 'lk' arms: lambda = exp(-eta * alpha)")
    g.add_argument('--pretrain-mtp-scale', type=float, default=0.3,
                   help='mtp_loss_scaling_factor of the joint pretraining')
    g.add_argument('--seed', type=int, default=0, help='seeds weights, data order and sampling')
    m = p.add_argument_group('model')
    m.add_argument('--hidden-size', type=int, default=64)
    m.add_argument('--num-layers', type=int, default=2, help='decoder layers of the backbone')
    m.add_argument('--num-attention-heads', type=int, default=4)
    m.add_argument('--mtp-num-layers', type=int, default=3, help='MTP depths (draft heads)')
    m.add_argument('--seq-length', type=int, default=64)
    m.add_argument('--batch-size', type=int, default=16)
    d = p.add_argument_group('data')
    d.add_argument('--corpus-a', default=None,
                   help='text file for pretraining (default: the Python stdlib *.py sources)')
    d.add_argument('--corpus-b', default=None,
                   help='text file for drift, healing and evaluation '
                        '(default: pydoc_data.topics, the English docs)')
    e = p.add_argument_group('evaluation')
    e.add_argument('--gamma', type=int, default=None,
                   help='drafts per verify step, <= --mtp-num-layers (default: all depths)')
    e.add_argument('--eval-prompts', type=int, default=512,
                   help='held-out windows per evaluation: each is a prompt for one speculative '
                        'verify step and a teacher-forced sample')
    e.add_argument('--eval-points', type=int, default=3,
                   help='evaluations while training each arm (evenly spaced, the last at the '
                        'end; the cold arms also share one of their fresh heads at step 0)')
    o = p.add_argument_group('output')
    o.add_argument('--out-dir', default=os.path.join('out', 'cpu_demo'))
    o.add_argument('--threads', type=int, default=1,
                   help='torch threads. 1 is about as fast for this tiny model (per-op overhead '
                        'dominates), keeps the numbers independent of the core count and is much '
                        'faster than 2 on a busy machine')
    o.add_argument('--no-plot', action='store_true', help='skip the PNGs')
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate; every bad value exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(',') if a.strip()]
    if 'serve_ce' in arms:
        parser.error("--arms: 'serve_ce' is not an arm: cross-entropy against the data labels "
                     "does not depend on the temperature (the 'ce' arm is evaluated at "
                     "--serving-temperature too)")
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        parser.error(f'--arms {args.arms!r}: unknown {bad}; choose from {",".join(ARMS)}')
    if len(set(arms)) != len(arms):
        parser.error(f'--arms {args.arms!r} names an arm twice')
    args.arms = arms
    t = args.serving_temperature
    if not (math.isfinite(t) and t > 0):
        parser.error(f'--serving-temperature must be a finite number > 0, got {t}')
    if t == 1.0 and any(arm_kind(a)[0] == 'serve' for a in arms):
        parser.error('--serving-temperature 1 makes the serve_* arms the same as the plain ones; '
                     'choose another temperature or drop the serve_* arms')
    if not (math.isfinite(args.lk_eta) and args.lk_eta >= 0):
        parser.error(f'--lk-eta must be a finite number >= 0, got {args.lk_eta}')
    for name in ('steps_pretrain', 'steps_drift'):
        if getattr(args, name) < 0:
            parser.error(f'--{name.replace("_", "-")} must be >= 0')
    for name in ('steps_heal', 'steps_cold', 'hidden_size', 'num_layers', 'num_attention_heads',
                 'mtp_num_layers', 'batch_size', 'eval_prompts', 'eval_points'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
    if args.eval_prompts < 2:
        parser.error('--eval-prompts must be >= 2 (for a standard error)')
    if args.hidden_size % args.num_attention_heads:
        parser.error(f'--hidden-size {args.hidden_size} must be divisible by '
                     f'--num-attention-heads {args.num_attention_heads}')
    if args.gamma is None:
        args.gamma = args.mtp_num_layers
    if args.gamma < 1:
        parser.error(f'--gamma must be >= 1, got {args.gamma}')
    if args.gamma > args.mtp_num_layers:
        parser.error(
            f'--gamma {args.gamma} is larger than the model\'s MTP depth (--mtp-num-layers '
            f'{args.mtp_num_layers}): each drafted token needs its own MTP head'
        )
    if args.seq_length < args.gamma + 4:
        parser.error(f'--seq-length {args.seq_length} is too short for gamma={args.gamma} '
                     f'(needs >= gamma + 4 = {args.gamma + 4})')
    if args.eval_points > args.steps_heal:
        parser.error(f'--eval-points {args.eval_points} exceeds --steps-heal {args.steps_heal}')
    if args.eval_points > args.steps_cold and any(arm_kind(a)[0] == 'cold' for a in arms):
        parser.error(f'--eval-points {args.eval_points} exceeds --steps-cold {args.steps_cold}')
    if args.lr <= 0 or args.heal_lr <= 0 or args.cold_lr <= 0:
        parser.error('--lr, --heal-lr and --cold-lr must be > 0')
    if args.threads < 1:
        parser.error('--threads must be >= 1')
    from cpu_demo_lib.corpus import CorpusError, load_corpus, read_text_file

    try:  # before importing torch and Megatron, so a bad path fails in a fraction of a second
        for path in (args.corpus_a, args.corpus_b):
            if path is not None:
                read_text_file(path)
        args.corpus_a_data = load_corpus('A', args.corpus_a, 'stdlib', args.seq_length + 1)
        args.corpus_b_data = load_corpus('B', args.corpus_b, 'pydoc', args.seq_length + 1)
    except CorpusError as err:
        parser.error(str(err))
    return args


def _ensure_importable() -> None:
    """Let a plain checkout run this file before ``pip install -e .`` (repo root on sys.path)."""
    if importlib.util.find_spec('megatron') is None or importlib.util.find_spec('megatron.mtp_tv') is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def progress_bar(label: str, total: int):
    """A tqdm bar for one phase on stderr: redrawn in place on a terminal; into a log or a pipe
    (CI, a test) only at the start, the end and every 30 s, so captured output stays short."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 30.0)


def start_megatron(threads: int) -> None:
    """Quiet megatron-core's CPU warnings, install the plugin, fix torch's threads and make its
    algorithms deterministic (a demo's numbers depend on the seed alone)."""
    import torch

    from mtp_tv_dev.cpu import quiet_megatron_warnings

    quiet_megatron_warnings()
    import megatron.mtp_tv

    megatron.mtp_tv.install()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def run(args: argparse.Namespace) -> Dict:
    """The experiment; returns everything that goes into results.json."""
    import torch

    start_megatron(args.threads)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.mtp_tv.metrics import acceptance_metrics
    from mtp_tv_dev.distributed import single_process

    from cpu_demo_lib import corpus as C
    from cpu_demo_lib import evaluate as E
    from cpu_demo_lib import model as M

    started, cpu_started = time.monotonic(), _cpu_seconds()
    timings: Dict[str, float] = {}
    domain_a, domain_b = args.corpus_a_data, args.corpus_b_data
    gamma, seed = args.gamma, args.seed
    spec = M.ModelSpec(args.hidden_size, args.num_layers, args.mtp_num_layers, args.seq_length,
                       args.num_attention_heads, seed)
    kinds = {arm: arm_kind(arm) for arm in args.arms}
    serving = any(kind == 'serve' for kind, _ in kinds.values())
    modes = {E.SAMPLED: 1.0, E.GREEDY: 0.0}
    if serving:
        modes[E.SERVING] = args.serving_temperature

    # Held-out evaluation set: fixed for the whole run, so every model sees the same prompts.
    eval_gen = torch.Generator().manual_seed(seed * 1000 + 1)
    eval_windows = C.windows(domain_b.held_out, args.eval_prompts, args.seq_length, eval_gen)
    prompts = eval_windows[:, : args.seq_length - 1 - gamma]  # the rest is the real continuation
    evaluations: List[Dict] = []
    train_curves: Dict[str, Dict] = {}

    def evaluate(model, arm: str, step: int, train_alpha=None, final=False,
                 at_serving=False) -> Dict:
        """Teacher-forced in every mode and speculative decoding at T=1; at the end of an arm
        (``final``) also greedy speculative decoding, and at the serving temperature if asked."""
        t0 = time.monotonic()
        tf = E.teacher_forced_modes(model, eval_windows, gamma, modes)
        decode_seed = seed * 1000 + 7  # common random numbers: the same for every model
        record = {
            'arm': arm, 'step': step,
            'teacher_forced': tf[E.SAMPLED],
            'teacher_forced_greedy': tf[E.GREEDY],
            'speculative': E.speculative_decoding(model, prompts, gamma, seed=decode_seed),
        }
        if E.SERVING in tf:
            record['teacher_forced_serving'] = tf[E.SERVING]
        if final:
            record['speculative_greedy'] = E.speculative_decoding(
                model, prompts, gamma, seed=decode_seed, temperature=0.0)
        if final and at_serving:
            record['speculative_serving'] = E.speculative_decoding(
                model, prompts, gamma, seed=decode_seed, temperature=args.serving_temperature)
        if train_alpha:
            record['plugin_train_metrics'] = train_alpha
        timings['evaluation'] = timings.get('evaluation', 0.0) + time.monotonic() - t0
        evaluations.append(record)
        return record

    def evaluate_once(model, arm: str, label: str, at_serving: bool) -> None:
        with progress_bar(label, 1) as bar:
            evaluate(model, arm, 0, final=True, at_serving=at_serving)
            bar.update()

    def train(model, part: str, batches, steps: int, lr: float, label: str, eval_at=(), arm=None,
              at_serving=False):
        params = M.set_trainable(model, part)
        optimizer, schedule = M.make_optimizer(params, lr, steps)
        curve = {'loss': [], 'mtp_loss': [], 'grad_norm': [], 'plugin_metrics': {}}
        since_eval: Dict[str, List[float]] = {}
        t0 = time.monotonic()
        with progress_bar(label, steps) as bar:
            for step in range(1, steps + 1):
                tokens, labels = batches.next()
                stats = {}
                loss = M.train_step(model, optimizer, tokens, labels, stats=stats)
                schedule.step()
                mtp = M.mtp_tracker_losses()
                info = {'loss': loss}
                curve['loss'].append(loss)
                curve['grad_norm'].append(stats['grad_norm'])
                if mtp is not None and getattr(model, 'mtp', None) is not None:
                    info['mtp'] = float(mtp.mean())
                    curve['mtp_loss'].append(info['mtp'])
                # The plugin's training-time acceptance on this step's batch (teacher-forced, all
                # positions): a per-step curve at no extra forward.
                for key, value in acceptance_metrics(MTPLossLoggingHelper.tracker).items():
                    curve['plugin_metrics'].setdefault(key, []).append(float(value))
                    since_eval.setdefault(key, []).append(float(value))
                bar.set_postfix(info, refresh=False)
                bar.update()
                if step in eval_at:
                    # Every step has the same tokens, so the mean of the per-step values is the
                    # pooled mean over the steps since the last evaluation.
                    metrics = {k: sum(v) / len(v) for k, v in since_eval.items()}
                    since_eval = {}
                    timings[label] = timings.get(label, 0.0) + time.monotonic() - t0
                    evaluate(model, arm, step, metrics, final=step == steps,
                             at_serving=at_serving)
                    t0 = time.monotonic()
        timings[label] = timings.get(label, 0.0) + time.monotonic() - t0
        train_curves[arm or label] = curve

    def eval_steps(steps: int) -> List[int]:
        return sorted({round(steps * i / args.eval_points) for i in range(1, args.eval_points + 1)})

    eval_at = eval_steps(args.steps_heal)
    cold_eval_at = eval_steps(args.steps_cold)
    with single_process(seed=seed):
        # 1. Pretrain backbone + heads jointly with CE on domain A.
        model = M.build_model(spec, M.phase_overrides('pretrain', 'ce', args.pretrain_mtp_scale))
        train(model, 'all', C.Batches(domain_a.train, args.batch_size, args.seq_length, seed * 1000 + 2),
              args.steps_pretrain, args.lr, 'pretrain (A)')
        evaluate_once(model, 'pretrained', 'eval pretrained', serving)
        pretrained = model.state_dict()
        # 2. Drift: the backbone alone (a model without MTP heads) fine-tuned on domain B.
        model = M.build_model(spec, M.phase_overrides('drift', 'ce', args.pretrain_mtp_scale),
                              {k: v for k, v in pretrained.items() if not k.startswith('mtp.')})
        train(model, 'all', C.Batches(domain_b.train, args.batch_size, args.seq_length,
                                      seed * 1000 + 3),
              args.steps_drift, args.lr, 'drift (B)')
        # Graft the pretrained heads onto the drifted backbone.
        drifted = M.graft(model.state_dict(), pretrained)
        model = M.build_model(spec, M.phase_overrides('heal', 'ce', args.pretrain_mtp_scale),
                              drifted)
        evaluate_once(model, 'drifted', 'eval drifted', serving)

        def heal_batches():  # every arm of every scenario: the same batches
            return C.Batches(domain_b.train, args.batch_size, args.seq_length, seed * 1000 + 4)

        def overrides(phase, loss, temperature=1.0):
            return M.phase_overrides(phase, loss, args.pretrain_mtp_scale, temperature,
                                     args.lk_eta if loss == 'lk' else None,
                                     chunk=args.batch_size * args.seq_length)

        # 3. Heal the grafted heads: every arm from the same drifted weights, same budget.
        for arm in args.arms:
            kind, loss = kinds[arm]
            if kind == 'cold':
                continue
            temperature = args.serving_temperature if kind == 'serve' else 1.0
            model = M.build_model(spec, overrides('heal', loss, temperature), drifted)
            acceptance_metrics(MTPLossLoggingHelper.tracker)  # start the plugin's training-time statistics afresh
            label = f'heal {loss}' if kind == 'warm' else f'heal {loss} T={temperature:g}'
            train(model, 'heads', heal_batches(), args.steps_heal, args.heal_lr, label,
                  eval_at=eval_at, arm=arm, at_serving=serving)
        # 4. Cold start: re-initialised heads on the drifted backbone, the same for every arm.
        cold_arms = [arm for arm in args.arms if kinds[arm][0] == 'cold']
        if cold_arms:
            cold = M.fresh_heads(drifted, spec, init_seed=seed * 1000 + 5)
            evaluate_once(M.build_model(spec, overrides('cold', 'ce'), cold), 'cold_init',
                          'eval fresh heads', False)
        for arm in cold_arms:
            loss = kinds[arm][1]
            model = M.build_model(spec, overrides('cold', loss), cold)
            acceptance_metrics(MTPLossLoggingHelper.tracker)
            train(model, 'heads', heal_batches(), args.steps_cold, args.cold_lr, f'cold {loss}',
                  eval_at=cold_eval_at, arm=arm)

    timings['total_wall_s'] = time.monotonic() - started
    timings['total_cpu_s'] = _cpu_seconds() - cpu_started
    return {
        'evaluations': evaluations,
        'eval_steps': eval_at,
        'cold_eval_steps': cold_eval_at,
        'train_curves': train_curves,
        'timings_s': timings,
        'torch_threads': torch.get_num_threads(),
        'torch_version': torch.__version__,
    }


def settings(args: argparse.Namespace) -> Dict:
    keys = ('steps_pretrain', 'steps_drift', 'steps_heal', 'steps_cold', 'arms', 'lr', 'heal_lr',
            'cold_lr', 'serving_temperature', 'lk_eta', 'pretrain_mtp_scale', 'seed',
            'hidden_size', 'num_layers', 'num_attention_heads', 'mtp_num_layers', 'seq_length',
            'batch_size', 'gamma', 'eval_prompts', 'eval_points', 'threads')
    out = {k: getattr(args, k) for k in keys}
    out['vocab'] = 'bytes (256)'
    out['prompt_length'] = args.seq_length - 1 - args.gamma
    out['temperature'] = 1.0
    out['arm_scenarios'] = {arm: dict(zip(('scenario', 'loss'), arm_kind(arm))) for arm in args.arms}
    out['training_temperature'] = {
        arm: (args.serving_temperature if arm_kind(arm)[0] == 'serve' else 1.0) for arm in args.arms}
    out['verification'] = {
        'speculative': 'rejection sampling at T=1 (every evaluation)',
        'speculative_greedy': 'greedy, T=0 (the end of every arm, pretrained, drifted, fresh heads)',
        'speculative_serving': f'rejection sampling at T={args.serving_temperature:g} (the end of '
                               'the warm and serve arms, pretrained, drifted; only with serve arms)',
    }
    out['cold_init_seed'] = args.seed * 1000 + 5
    out['mtp_tv_chunk'] = args.batch_size * args.seq_length  # one chunk per micro-batch
    return out


TABLE_TITLES = {
    'warm': 'Warm start: grafted heads healed on the drifted backbone, sampling at T=1',
    'cold': 'Cold start: re-initialised heads trained on the drifted backbone, sampling at T=1',
    'greedy': 'Greedy decoding (T=0), every model',
    'serving': 'Sampling at the serving temperature T={t:g}',
}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    _ensure_importable()
    wall_start = time.monotonic()
    result = run(args)
    from cpu_demo_lib import report as R

    tables = R.build_tables(result['evaluations'], args.arms, args.steps_heal, args.steps_cold,
                            args.serving_temperature)
    payload = {
        'settings': settings(args),
        'corpora': {'A': args.corpus_a_data.describe(), 'B': args.corpus_b_data.describe()},
        'table': R.json_rows(tables['warm']),
        'tables': {name: R.json_rows(rows) for name, rows in tables.items()},
        **result,
        'python': platform.python_version(),
        'machine': platform.machine(),
        'cpu_count': os.cpu_count(),
    }
    out_dir = os.path.abspath(args.out_dir)
    json_path = os.path.join(out_dir, 'results.json')
    png_path = os.path.join(out_dir, 'acceptance.png')
    cold_png_path = os.path.join(out_dir, 'cold_start.png')
    warm_arms = [a for a in args.arms if arm_kind(a)[0] == 'warm']
    cold_arms = [a for a in args.arms if arm_kind(a)[0] == 'cold']
    plots = []  # (path or None, reason skipped)
    if not args.no_plot:
        common = (f"seed {args.seed}, gamma {args.gamma}, hidden {args.hidden_size}, "
                  f"{args.num_layers}+{args.mtp_num_layers} layers, {args.eval_prompts} prompts")
        plots.append((png_path, R.plot(
            png_path, result['evaluations'], warm_arms, args.gamma,
            title=f'{common}, heal {args.steps_heal} steps per arm')))
        if cold_arms:
            plots.append((cold_png_path, R.plot_cold(
                cold_png_path, result['evaluations'], cold_arms, result['train_curves'],
                args.gamma, title=f'{common}, {args.steps_cold} steps per cold arm, '
                                  f'lr {args.cold_lr:g}')))
    payload['timings_s']['including_report_s'] = time.monotonic() - wall_start
    R.write_json(json_path, payload)

    print()
    print(f'Accepted drafts per verify step on held-out domain B (gamma={args.gamma}, '
          f'{args.eval_prompts} prompts; {args.steps_heal} steps per warm arm, '
          f'{args.steps_cold} per cold arm).')
    for name, rows in tables.items():
        print()
        print(TABLE_TITLES[name].format(t=args.serving_temperature) + ':')
        print(R.format_table(rows, args.gamma, greedy=name == 'greedy'))
    print(R.TABLE_NOTE)
    t = payload['timings_s']
    print(f"\nwall {t['total_wall_s']:.0f}s (cpu {t['total_cpu_s']:.0f}s, "
          f"{result['torch_threads']} torch threads)")
    print(f'results: {json_path}')
    if args.no_plot:
        print('plot: skipped (--no-plot)')
    for path, skipped in plots:
        print(f'plot: skipped, {skipped}' if skipped else f'plot: {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
