#!/usr/bin/env python
"""The CPU demo as evidence: every loss on the same learning-rate grid, then seeds as the unit.

``examples/cpu_demo.py`` runs one seed at one rate per scenario. This runs it as a comparison
that survives the evidence rule (``cpu_demo_lib.report.seed_difference``):

1. **Rate grid, selection seed.** The demo at ``--select-seed`` with the warm and cold rates
   (``--heal-lr``, ``--cold-lr``) scaled by each of ``--lr-factors``: every arm trains at
   every factor, at the full budget. Each arm keeps the factor with the most accepted drafts
   per verify step at T=1; a factor that wins at an end of the grid is extended by a
   half-decade (up to ``--lr-extensions`` times), so the choice is not an edge.
2. **Seeds.** The demo at each of ``--seeds`` (disjoint from the selection seed, so the
   claims do not reuse the data that chose the rates), every arm at its chosen factor. A seed
   changes everything: the pretraining, the drift, the batches, the fresh heads and the
   evaluation prompts.
3. **Report.** Per scenario and serving mode (T=1, greedy, the serving temperature): each arm's
   accepted drafts per seed and the paired difference from ``'ce'`` and from ``'tv'`` (the same
   prompts and random numbers within a seed), resolved when every seed's difference has one
   sign and the mean over seeds exceeds 2 standard errors across seeds and over prompts;
   otherwise "not resolved". Also the selection seed's rate-sensitivity table.

Each demo run leaves a small record in ``--results-dir``/runs (its command, settings, time and
the per-prompt counts the report needs; the demo's full output stays in ``--out-dir``); a run
whose record exists, made by the same command, is read instead of rerun, so an interrupted
experiment resumes (``--commit`` commits each record as it is written). Writes ``report.md``
and ``summary.json`` to ``--results-dir`` and prints the report.

    .venv/bin/python examples/cpu_demo_seeds.py --commit        # the evidence: ~2 CPU-hours
    .venv/bin/python examples/cpu_demo_seeds.py -- --arms ce,tv,cold_ce,cold_kl   # demo flags
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # cpu_demo, cpu_demo_lib
import cpu_demo  # noqa: E402
from cpu_demo_lib import report as R  # noqa: E402
from cpu_demo_lib.arms import arm_kind  # noqa: E402

#: The arms every other arm of a scenario is compared with (serve_* arms belong to 'warm').
REFERENCES = {'warm': ('ce', 'tv'), 'cold': ('cold_ce', 'cold_tv')}
#: mode -> the demo's key of its speculative-decoding record (T=1, greedy, serving temperature)
MODES = {'T=1': 'speculative', 'greedy': 'speculative_greedy', 'serving': 'speculative_serving'}


def parse_args(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, argparse.Namespace]:
    """``(args, demo_args)``: this script's options, and the demo's (after ``--``) as the demo
    parses them (bad values exit with status 2 before anything runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_argv = argv[argv.index('--') + 1:] if '--' in argv else []
    argv = argv[:argv.index('--')] if '--' in argv else argv
    p = argparse.ArgumentParser(prog='cpu_demo_seeds.py', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--select-seed', type=int, default=0, help='the seed that picks the rates')
    p.add_argument('--seeds', default='1,2,3', help='the seeds the claims rest on (at least 3)')
    p.add_argument('--lr-factors', default='0.3,1,3',
                   help="the grid: factors of the demo's --heal-lr and --cold-lr")
    p.add_argument('--lr-extensions', type=int, default=3,
                   help='half-decades the grid may grow past a winning end, per arm')
    p.add_argument('--results-dir', default=os.path.join('examples', 'cpu_demo_results'),
                   help="runs/ (each demo run's record), report.md and summary.json")
    p.add_argument('--out-dir', default=os.path.join('out', 'cpu_demo_seeds'),
                   help="the demo runs' own outputs (results.json, log), one folder each")
    p.add_argument('--commit', action='store_true',
                   help='git-commit each demo run as it finishes (so that a rerun on a new '
                        'machine resumes), then the report')
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(',') if s.strip()]
        args.lr_factors = sorted(float(f) for f in args.lr_factors.split(',') if f.strip())
    except ValueError as e:
        p.error(f'--seeds / --lr-factors: {e}')
    if len(args.seeds) < 2 or len(set(args.seeds)) != len(args.seeds):
        p.error(f'--seeds {args.seeds}: at least two distinct seeds (a claim needs 3)')
    if args.select_seed in args.seeds:
        p.error(f'--select-seed {args.select_seed} is also in --seeds: the rates would be chosen '
                'on the data the claims are made on')
    if not args.lr_factors or min(args.lr_factors) <= 0:
        p.error(f'--lr-factors {args.lr_factors}: positive factors')
    if args.lr_extensions < 0:
        p.error(f'--lr-extensions must be >= 0, got {args.lr_extensions}')
    for flag in ('--seed', '--heal-lr', '--cold-lr', '--out-dir'):
        if any(a == flag or a.startswith(flag + '=') for a in demo_argv):
            p.error(f'{flag} is set by this script, not passed to the demo')
    demo_args = cpu_demo.parse_args(demo_argv)
    args.demo_argv = without_arms(demo_argv)  # each run names its own arms
    return args, demo_args


def without_arms(argv: List[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if not skip and a != '--arms' and not a.startswith('--arms='):
            out.append(a)
        skip = a == '--arms'
    return out


def half_decade(factor: float, up: bool) -> float:
    return float(f'{factor * math.sqrt(10) ** (1 if up else -1):.3g}')


class Runs:
    """Demo runs, keyed by their command line: each one's record (its command, settings, time
    and the per-prompt accepted drafts of every arm's last step, every mode) is
    ``<results_dir>/runs/<name>.json``; the demo's own outputs go to ``<out_dir>/<name>``."""

    def __init__(self, args: argparse.Namespace, demo_args: argparse.Namespace):
        self.results_dir, self.out_dir = args.results_dir, args.out_dir
        self.demo_argv, self.commit = args.demo_argv, args.commit
        self.heal_lr, self.cold_lr = demo_args.heal_lr, demo_args.cold_lr
        self.wall_s = 0.0

    def argv(self, seed: int, factor: float, arms: Sequence[str]) -> List[str]:
        return ['--seed', str(seed), '--heal-lr', f'{self.heal_lr * factor:.6g}',
                '--cold-lr', f'{self.cold_lr * factor:.6g}', '--arms', ','.join(arms),
                '--no-plot', *self.demo_argv]

    def get(self, seed: int, factor: float, arms: Sequence[str]) -> Dict:
        """The record of the demo at ``seed``, rates times ``factor``, ``arms`` (run if need be)."""
        name = f'seed{seed}_x{factor:g}_' + '-'.join(arms)
        path = os.path.join(self.results_dir, 'runs', f'{name}.json')
        argv = self.argv(seed, factor, arms)
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
            if record['argv'] == argv:
                return record
        folder = os.path.join(self.out_dir, name)
        print(f'run: seed {seed}, rates x{factor:g}, arms {",".join(arms)}', file=sys.stderr,
              flush=True)
        t0 = time.monotonic()
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, 'demo.log'), 'w') as log:
            subprocess.run([sys.executable, os.path.join(HERE, 'cpu_demo.py'), *argv,
                            '--out-dir', folder], stdout=log, stderr=subprocess.STDOUT,
                           check=True)
        self.wall_s += time.monotonic() - t0
        with open(os.path.join(folder, 'results.json')) as f:
            results = json.load(f)
        finals = {arm: final_record(results, arm) for arm in arms}
        record = {'argv': argv, 'settings': results['settings'],
                  'timings_s': results['timings_s'], 'accepted': {
                      arm: {mode: final[key]['per_prompt'] for mode, key in MODES.items()
                            if key in final} for arm, final in finals.items()}}
        R.write_json(path, record)
        if self.commit:
            R.commit_files([path], f'cpu_demo_seeds: run {name}')
        return record


def final_record(results: Dict, arm: str) -> Dict:
    """The demo's evaluation of ``arm`` at its last step."""
    settings = results['settings']
    step = settings['steps_cold'] if arm_kind(arm)[0] == 'cold' else settings['steps_heal']
    return next(e for e in results['evaluations'] if e['arm'] == arm and e['step'] == step)


def accepted(record: Dict, arm: str, mode: str = 'T=1') -> List[float]:
    """Per prompt, the accepted drafts of ``arm`` at its last step in ``mode``."""
    return record['accepted'][arm][mode]


def select_rates(runs: Runs, seed: int, arms: Sequence[str], factors: Sequence[float],
                 extensions: int) -> Tuple[Dict[str, float], Dict[str, Dict[float, float]]]:
    """``(chosen factor per arm, accepted drafts at T=1 per arm and factor)`` at ``seed``."""
    scores: Dict[str, Dict[float, float]] = {arm: {} for arm in arms}
    todo = {factor: list(arms) for factor in factors}
    for _ in range(extensions + 1):
        for factor, group in sorted(todo.items()):
            results = runs.get(seed, factor, group)
            for arm in group:
                scores[arm][factor] = R.mean_of(accepted(results, arm))
        todo = {}
        for arm in arms:
            best = max(scores[arm], key=scores[arm].get)
            if len(scores[arm]) > 1 and best in (min(scores[arm]), max(scores[arm])):
                todo.setdefault(half_decade(best, up=best == max(scores[arm])), []).append(arm)
        if not todo:
            break
    chosen = {arm: max(scores[arm], key=scores[arm].get) for arm in arms}
    return chosen, scores


def seed_results(runs: Runs, seeds: Sequence[int], chosen: Dict[str, float]) -> Dict[int, Dict]:
    """Per seed, arm -> the run record holding it (one demo run per distinct factor)."""
    groups: Dict[float, List[str]] = {}
    for arm, factor in chosen.items():
        groups.setdefault(factor, []).append(arm)
    out: Dict[int, Dict] = {}
    for seed in seeds:
        out[seed] = {}
        for factor, group in sorted(groups.items()):
            record = runs.get(seed, factor, group)
            out[seed].update(dict.fromkeys(group, record))
    return out


def summarize(chosen: Dict[str, float], scores: Dict[str, Dict[float, float]],
              per_seed: Dict[int, Dict], runs: Runs) -> Dict:
    """Tables per scenario and mode, with the paired differences across seeds."""
    tables = {}
    for scenario, kinds in (('warm', ('warm', 'serve')), ('cold', ('cold',))):
        members = [arm for arm in chosen if arm_kind(arm)[0] in kinds]
        for mode in MODES:
            # The demo verifies warm arms at the serving temperature only in a run with a serve_*
            # arm: the arms that ran without one (at another rate) are left out of that table.
            verified = [arm for arm in members
                        if all(mode in per_seed[s][arm]['accepted'][arm] for s in per_seed)]
            if not verified:
                continue
            units = {arm: {s: accepted(per_seed[s][arm], arm, mode) for s in per_seed}
                     for arm in verified}
            rows = []
            for arm in verified:
                values = [R.mean_of(units[arm][s]) for s in sorted(per_seed)]
                row = {'arm': arm, 'lr_factor': chosen[arm], 'per_seed': values,
                       'mean': R.mean_of(values), 'se_seeds': R.standard_error(values)}
                for ref in REFERENCES[scenario]:
                    if ref in units and ref != arm:
                        row[f'vs {ref}'] = R.seed_difference(units[arm], units[ref])
                rows.append(row)
            tables[f'{scenario} {mode}'] = rows
    return {'seeds': sorted(per_seed), 'chosen_factor': chosen, 'selection_scores': {
        arm: {f'{k:g}': v for k, v in s.items()} for arm, s in scores.items()},
        'heal_lr': runs.heal_lr, 'cold_lr': runs.cold_lr, 'tables': tables}


def _diff(d: Dict) -> str:
    if not d:
        return ''
    per = ', '.join(f'{x:+.3f}' for x in d['per_seed'])
    verdict = 'resolved' if d['resolved'] else 'not resolved'
    return (f"{d['mean']:+.3f} ±{d['se_seeds']:.3f} (prompts ±{d['se_units']:.3f}; {per}) "
            f'{verdict}')


def render(summary: Dict, gamma: int, serving_temperature: float) -> str:
    seeds = summary['seeds']
    lines = [f"Accepted drafts per verify step (of {gamma}) at each arm's last step, seeds "
             f"{', '.join(map(str, seeds))}; every arm at the rate factor it won on the selection "
             "seed (of the demo's warm and cold rates). Differences are paired within a seed; "
             "mean ±SE across seeds (the prompt-level SE in brackets, then each seed's value); "
             "'resolved': every seed of one sign and the mean beyond 2 of both SEs.", '']
    for name, rows in summary['tables'].items():
        scenario, mode = name.split()
        title = f'T={serving_temperature:g}' if mode == 'serving' else mode
        refs = sorted({k for row in rows for k in row if k.startswith('vs ')})
        lines += [f'### {scenario}, {title}', '',
                  '| arm | rate x | per seed | mean | ' + ' | '.join(refs) + ' |',
                  '|---|---|---|---|' + '---|' * len(refs)]
        for row in rows:
            per = ', '.join(f'{v:.3f}' for v in row['per_seed'])
            lines.append(f"| {row['arm']} | {row['lr_factor']:g} | {per} | {row['mean']:.3f} "
                         f"±{row['se_seeds']:.3f} | "
                         + ' | '.join(_diff(row.get(r, {})) for r in refs) + ' |')
        lines.append('')
    factors = sorted({float(f) for s in summary['selection_scores'].values() for f in s})
    lines += ['### Rate sensitivity (selection seed, T=1, accepted drafts; * chosen)', '',
              '| arm | ' + ' | '.join(f'x{f:g}' for f in factors) + ' |',
              '|---|' + '---|' * len(factors)]
    for arm, scores in summary['selection_scores'].items():
        cells = []
        for f in factors:
            value = scores.get(f'{f:g}')
            star = '*' if f == summary['chosen_factor'][arm] else ''
            cells.append('' if value is None else f'{value:.3f}{star}')
        lines.append(f'| {arm} | ' + ' | '.join(cells) + ' |')
    lines += ['', f"(x1 = --heal-lr {summary['heal_lr']:g} for the warm arms, --cold-lr "
                  f"{summary['cold_lr']:g} for the cold ones)"]
    return '\n'.join(lines)


def plot(path: str, summary: Dict, gamma: int) -> Optional[str]:
    """Gain over ``'ce'`` in accepted drafts per verify step, one panel per scenario (T=1 and
    greedy): a dot per seed, the mean over seeds with a bar of 2 standard errors across seeds
    (filled: resolved). Returns why it was skipped, or None."""
    plt, why_not = R.pyplot()
    if plt is None:
        return why_not
    panels = [name for name in ('warm T=1', 'warm greedy', 'cold T=1', 'cold greedy')
              if name in summary['tables']]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, name in zip(axes[0], panels):
        scenario, mode = name.split()
        ref = REFERENCES[scenario][0]
        rows = [row for row in summary['tables'][name] if f'vs {ref}' in row]
        for y, row in enumerate(rows):
            d = row[f'vs {ref}']
            color = R.arm_color(row['arm'])
            ax.scatter(d['per_seed'], [y] * len(d['per_seed']), s=12, color=color, alpha=0.5)
            ax.errorbar(d['mean'], y, xerr=R.RESOLVED_AT * d['se_seeds'], fmt='o', color=color,
                        mfc=color if d['resolved'] else 'white', capsize=3)
        ax.axvline(0, color='grey', lw=0.8)
        ax.set_yticks(range(len(rows)), [row['arm'] for row in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{'grafted heads, healed' if scenario == 'warm' else 'fresh heads'}, "
                     f'{mode}', fontsize=9)
        ax.set_xlabel(f"accepted drafts (of {gamma}) minus {ref!r}", fontsize=8)
    seeds = ', '.join(map(str, summary['seeds']))
    R.save_figure(plt, fig, path, f'CPU toy, seeds {seeds}: dots are seeds; filled = resolved '
                  '(every seed one sign, mean beyond 2 SE)', 120)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    args, demo_args = parse_args(argv)
    runs = Runs(args, demo_args)
    chosen, scores = select_rates(runs, args.select_seed, demo_args.arms, args.lr_factors,
                                  args.lr_extensions)
    per_seed = seed_results(runs, args.seeds, chosen)
    summary = summarize(chosen, scores, per_seed, runs)
    summary['command'] = ['examples/cpu_demo_seeds.py', *(argv if argv is not None
                                                           else sys.argv[1:])]
    summary['wall_s_this_invocation'] = runs.wall_s
    text = render(summary, demo_args.gamma or demo_args.mtp_num_layers,
                  demo_args.serving_temperature)
    outputs = [os.path.join(args.results_dir, name) for name in ('summary.json', 'report.md',
                                                                  'gains.png')]
    R.write_json(outputs[0], summary)
    with open(outputs[1], 'w') as f:
        f.write(text + '\n')
    skipped = plot(outputs[2], summary, demo_args.gamma)
    if skipped:
        print(f'plot: skipped, {skipped}')
        outputs.pop()
    if args.commit:
        R.commit_files(outputs, 'cpu_demo_seeds: report')
    print(text)
    print(f'\nreport: {outputs[1]} (demo runs this time: {runs.wall_s:.0f} s wall; each run\'s '
          'own wall and CPU seconds are in its record)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
