"""The SmolLM2 experiment's report: tables per seed, paired differences, rate sensitivity, curves.

Everything here is read from the stored parts (``experiment.Store``), so ``--report-only``
rebuilds it without training. Conventions:

* *tokens per verify step* is one more than the accepted drafts (the bonus or residual token is
  always emitted), measured by speculative decoding on the test prompts; *counted* is the
  number of accepted drafts, *Rao-Blackwell* its expectation given each step's drafts (the same
  mean, a smaller variance; ``mtp_tv_dev.speculative.rao_blackwell_accepted``);
* **seeds are the unit of variance.** A difference between two losses is paired per seed (the
  same seed orders the same windows and, from a cold start, draws the same initial heads) and,
  within a seed, over the same prompts with common random numbers. It is *resolved* when every
  seed's paired difference has the same sign and the mean over seeds exceeds
  ``RESOLVED_AT`` standard errors computed across seeds, and as many of the prompt-level
  standard error; otherwise the report says "not resolved";
* the gain over ``'ce'`` in percent is the mean difference over ``'ce'``'s tokens per step.
"""

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from cpu_demo_lib.report import (RESOLVED_AT, mean_of, pyplot, save_figure, seed_difference,
                                 standard_error)

from .experiment import Preset, Store, chained_losses, part_name, point_at, tau_gain

MODES = {'T=1': 'spec_sampled', 'greedy': 'spec_greedy'}
ESTIMATORS = {'counted': 'per_prompt', 'rao_blackwell': 'per_prompt_rao_blackwell'}
COLORS = {'ce': '#1f77b4', 'tv': '#d62728', 'e2e_tv': '#2ca02c', 'kl': '#9467bd',
          'lk': '#ff7f0e', 'nla': '#8c564b'}


def _units(records: List[Dict], path: Sequence[str]) -> Dict[int, List[float]]:
    """Per seed, the per-unit values at ``path`` under ``record['final']``."""
    out = {}
    for record in records:
        node = record['final']
        for key in path:
            node = node[key]
        out[record['seed']] = node
    return out


def _over_seeds(values: Sequence[float]) -> Dict:
    return {'mean': mean_of(values), 'se': standard_error(values), 'n': len(values)}


def arm_row(loss: str, records: List[Dict], baseline: Optional[List[Dict]]) -> Dict:
    """One table row: tokens per step per seed (both modes, both estimators), teacher-forced
    alpha, and the paired difference from ``baseline``."""
    row = {'label': loss, 'seeds': [r['seed'] for r in records], 'lr': records[0].get('lr'),
           'steps': records[0].get('steps')}
    for mode, spec in MODES.items():
        for estimator, key in ESTIMATORS.items():
            units = _units(records, [spec, key])
            per_seed = [1.0 + mean_of(units[s]) for s in sorted(units)]
            row[f'tokens {mode} {estimator}'] = _over_seeds(per_seed)
            row[f'per seed {mode} {estimator}'] = per_seed
            if baseline:
                diff = seed_difference(units, _units(baseline, [spec, key]))
                base = mean_of([1.0 + mean_of(v) for v in _units(baseline, [spec, key]).values()])
                row[f'vs {mode} {estimator}'] = diff
                row[f'gain% {mode} {estimator}'] = 100 * diff['mean'] / base
    for key, name in (('tf_test', 'text'), ('tf_continuation', 'continuations')):
        row[f'TF alpha {name}'] = _over_seeds([r['final'][key]['sampled']['alpha'][0]['mean']
                                               for r in records])
    return row


def _arm_name(scenario: str, test: Dict) -> str:
    """The training part of a test part (``experiment.HeadsArm.name``)."""
    return f"{scenario}_{test['loss']}_lr{test['lr']:g}_n{test['steps']}_s{test['seed']}"


def _tests(parts: Dict[str, Dict], scenario: str, loss: str, seeds: Sequence[int]) -> List[Dict]:
    names = [part_name(f'test_{scenario}', loss, s) for s in seeds]
    return [parts[n] for n in names if n in parts]


def headline_rows(parts: Dict[str, Dict], scenario: str, seeds: Sequence[int],
                  baseline: str = 'ce') -> List[Dict]:
    """Every loss's test results at its chosen rate, compared with ``baseline``'s."""
    reference = _tests(parts, scenario, baseline, seeds)
    rows = []
    for loss in chained_losses():
        records = _tests(parts, scenario, loss, seeds)
        if records:
            rows.append(arm_row(loss, records, reference if loss != baseline else None))
    return rows


def versus_leader(parts: Dict[str, Dict], scenario: str, seeds: Sequence[int],
                  rows: List[Dict]) -> Dict:
    """The alternatives to ``'ce'`` (``rows``: ``headline_rows``) against the best of them, the
    highest T=1 tokens per step by the Rao-Blackwell estimate (the lower-variance one): whether
    the leader is separated from the runners-up. ``{'leader': loss, 'rows': [...]}``, or ``{}``
    with fewer than two alternatives."""
    alternatives = [r for r in rows if r['label'] != 'ce']
    if len(alternatives) < 2:
        return {}
    leader = max(alternatives, key=lambda r: r['tokens T=1 rao_blackwell']['mean'])['label']
    return {'leader': leader, 'rows': [r for r in headline_rows(parts, scenario, seeds, leader)
                                       if r['label'] != 'ce']}


def sensitivity(parts: Dict[str, Dict], scenario: str, seed: int) -> Dict[str, Dict]:
    """Per loss: whole-validation accepted drafts (T=1) at the last step for every rate of the
    grid on ``seed`` (at the grid's budget, the smallest: plateau arms run longer), the best
    rate, the rate the curve windows would have picked at a third of the budget, and each arm's
    plateau gain."""
    out = {}
    for loss in chained_losses():
        arms = [r for n, r in parts.items() if n.startswith(f'{scenario}_{loss}_lr')
                and r.get('seed') == seed and 'curve' in r]
        if not arms:
            continue
        steps = min(r['steps'] for r in arms)
        arms = [r for r in arms if r['steps'] == steps]
        score = {r['lr']: r['validation']['sampled']['accepted'] for r in arms}
        third = {r['lr']: point_at(r['curve']['validation'], steps / 3)['sampled']['accepted']
                 for r in arms}
        out[loss] = {'steps': steps, 'score': dict(sorted(score.items())),
                     'best': max(score, key=score.get), 'best_at_third': max(third, key=third.get),
                     'plateau_gain': {r['lr']: r['plateau_gain'] for r in arms},
                     'spread': max(score.values()) - min(score.values())}
    return out


def plateau_rows(parts: Dict[str, Dict], scenario: str, seed: int) -> List[Dict]:
    """Every budget doubling on ``seed`` (an arm and the same arm at twice its steps): the
    validation tau (T=1) of both and the relative gain, the plateau rule's evidence."""
    arms = {(r['loss'], r['lr'], r['steps']): r for n, r in parts.items()
            if n.startswith(f'{scenario}_') and r.get('seed') == seed and 'curve' in r}
    rows = []
    for (loss, lr, steps), short in sorted(arms.items()):
        long = arms.get((loss, lr, 2 * steps))
        if long is not None:
            rows.append({'loss': loss, 'lr': lr, 'steps': steps,
                         'tau': 1 + short['validation']['sampled']['accepted'],
                         'tau_doubled': 1 + long['validation']['sampled']['accepted'],
                         'gain': tau_gain(short, long)})
    return rows


def recovery(parts: Dict[str, Dict], seeds: Sequence[int]) -> Dict:
    """Per loss (at its chosen rate), per seed: the first curve step at which the healed head's
    alpha (curve windows, T=1) is back at the official head's alpha on the original model
    (``'step'``, None: not within its ``'steps'``), and the best alpha its curve reached
    (``'best'``, at ``'best_step'``). ``{'goal': alpha, 'losses': {loss: [...]}}``, or ``{}``
    before the drift is scored or any healed head is tested."""
    before = parts.get('drift_before')
    if before is None:
        return {}
    goal = before['curve_validation']['sampled']['alpha'][0]
    out = {'goal': goal, 'losses': {}}
    for loss in chained_losses():
        per_seed = []
        for t in _tests(parts, 'heal', loss, seeds):
            arm = parts.get(_arm_name('heal', t))
            if arm is None:
                continue
            points = [(p['step'], p['sampled']['alpha'][0]) for p in arm['curve']['validation']]
            best_step, best = max(points, key=lambda p: p[1])
            hit = [step for step, alpha in points if alpha >= goal]
            per_seed.append({'seed': t['seed'], 'steps': arm['steps'],
                             'step': hit[0] if hit else None, 'best': best,
                             'best_step': best_step})
        if per_seed:
            out['losses'][loss] = per_seed
    return out if out['losses'] else {}


def drift_summary(parts: Dict[str, Dict]) -> Dict:
    if not {'drift_before', 'drift_after', 'drift_move'} <= set(parts):
        return {}
    before, after, move = parts['drift_before'], parts['drift_after'], parts['drift_move']

    def alpha(record, where):
        node = record[where] if where in ('validation', 'curve_validation') else \
            record['final'][where]
        a = node['sampled']['alpha'][0]
        return a['mean'] if isinstance(a, dict) else a

    out = {'steps': move['steps'], 'lr': move['lr'], 'target_reached': move['target_reached']}
    for where in ('curve_validation', 'validation', 'tf_test', 'tf_continuation'):
        out[where] = {'before': alpha(before, where), 'after': alpha(after, where)}
        out[where]['drop'] = out[where]['before'] - out[where]['after']
    for mode, spec in MODES.items():
        out[f'tokens {mode}'] = {k: 1 + r['final'][spec]['accepted']['mean']
                                 for k, r in (('before', before), ('after', after))}
    out['main_model_nll'] = {k: r['main_model']['nll'] for k, r in (('before', before),
                                                                     ('after', after))}
    return out


def joint_rows(parts: Dict[str, Dict], seeds: Sequence[int]) -> List[Dict]:
    def records(loss):
        names = [part_name('joint', loss, s) for s in seeds]
        return [parts[n] for n in names if n in parts]

    rows = []
    moved = parts.get('drift_after')
    for loss in chained_losses():
        recs = records(loss)
        if not recs:
            continue
        row = arm_row(loss, recs, records('ce') if loss != 'ce' else None)
        row['main_model_nll'] = _over_seeds([r['main_model']['nll']['mean'] for r in recs])
        if moved is not None:
            # the same fine-tuning without heads, window by window (one run: no seed to pair)
            row['main_model_vs_no_heads'] = seed_difference(
                {r['seed']: r['main_model']['per_window'] for r in recs},
                {r['seed']: moved['main_model']['per_window'] for r in recs})
        rows.append(row)
    return rows


def pending(parts: Dict[str, Dict], preset: Preset) -> Dict[str, List[int]]:
    """The protocol's final parts (test results, drift scores, joint runs) not yet stored, what
    the report of an interrupted run lacks: ``{'cold `kl`': [1, 2], 'drift_before': [], ...}``,
    each group's missing seeds."""
    groups: Dict[str, Dict[Optional[int], str]] = {}  # label -> {seed (None: one part): name}

    def per_loss(scenario: str, kind: str, seeds: Sequence[int]) -> None:
        for loss in preset.loss_names():
            groups[f'{scenario} `{loss}`'] = {s: part_name(kind, loss, s) for s in seeds}

    if 'cold' in preset.scenarios:
        per_loss('cold', 'test_cold', preset.seeds)
    if 'drift' in preset.scenarios:
        groups.update({name: {None: name} for name in ('drift_before', 'drift_after')})
        per_loss('heal', 'test_heal', preset.seeds)
    if 'joint' in preset.scenarios:
        per_loss('joint', 'joint', preset.joint_seeds)
    out = {}
    for label, names in groups.items():
        missing = [seed for seed, name in names.items() if name not in parts]
        if missing:
            out[label] = [seed for seed in missing if seed is not None]
    return out


def _pending_line(groups: Dict[str, List[int]]) -> str:
    return ', '.join(label + (f" (seed{'s' if len(seeds) > 1 else ''} "
                              f"{', '.join(map(str, seeds))})" if seeds else '')
                     for label, seeds in groups.items())


def summarize(parts: Dict[str, Dict], preset: Preset) -> Dict:
    seeds = preset.seeds
    cold, heal = (headline_rows(parts, scenario, seeds) for scenario in ('cold', 'heal'))
    return {
        'preset': preset.name, 'common': preset.common(), 'parts': sorted(parts),
        'pending': pending(parts, preset),
        'compute_s': sum(p.get('wall_s', 0) for p in parts.values()),
        'cpu_s': sum(p.get('cpu_s', 0) for p in parts.values()),
        'cold': cold,
        'cold_vs_leader': versus_leader(parts, 'cold', seeds, cold),
        'cold_sensitivity': sensitivity(parts, 'cold', seeds[0]),
        'cold_plateau': plateau_rows(parts, 'cold', seeds[0]),
        'cold_init': parts.get('cold_init', {}).get('validation'),
        'drift': drift_summary(parts),
        'heal': heal,
        'heal_vs_leader': versus_leader(parts, 'heal', seeds, heal),
        'heal_sensitivity': sensitivity(parts, 'heal', seeds[0]),
        'heal_recovery': recovery(parts, seeds),
        'joint': joint_rows(parts, preset.joint_seeds),
    }


def fmt(stat: Optional[Dict], digits: int = 3, signed: bool = False, se: str = 'se') -> str:
    if not stat or stat.get('mean') is None or math.isnan(stat['mean']):
        return ''
    sign = '+' if signed and stat['mean'] >= 0 else ''
    spread = stat.get(se, float('nan'))
    tail = '' if spread is None or math.isnan(spread) else f'±{spread:.{digits}f}'
    return f"{sign}{stat['mean']:.{digits}f}{tail}"


def _verdict(diff: Optional[Dict]) -> str:
    if not diff:
        return ''
    return 'resolved' if diff['resolved'] else 'not resolved'


def _diff_cell(row: Dict, mode: str, estimator: str) -> str:
    diff = row.get(f'vs {mode} {estimator}')
    if not diff:
        return ''
    per_seed = ', '.join(f'{d:+.3f}' for d in diff['per_seed'])
    seeds = ('one seed' if math.isnan(diff['se_seeds']) else  # no spread across seeds yet
             f"seeds ±{diff['se_seeds']:.3f}")
    return (f"{diff['mean']:+.3f} ({seeds}, prompts ±{diff['se_units']:.3f};"
            f" per seed {per_seed}) {row[f'gain% {mode} {estimator}']:+.1f}% "
            f"{_verdict(diff)}")


def table(rows: List[Dict], baseline: str = 'ce') -> str:
    """Markdown: tokens per step per seed and the paired difference from the baseline, both
    modes (counted), the Rao-Blackwell difference at T=1, and teacher-forced alpha."""
    head = ['loss', 'lr', 'tokens/step T=1 (per seed)', f'vs {baseline} T=1',
            f'vs {baseline} T=1, Rao-Blackwell', 'tokens/step greedy (per seed)',
            f'vs {baseline} greedy', 'TF alpha text', 'TF alpha continuations']
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        seeds = lambda mode: ' / '.join(f'{x:.3f}' for x in r[f'per seed {mode} counted'])  # noqa
        cells = [f"`{r['label']}`", '' if r.get('lr') is None else f"{r['lr']:g}",
                 f"{fmt(r['tokens T=1 counted'])} ({seeds('T=1')})",
                 _diff_cell(r, 'T=1', 'counted'), _diff_cell(r, 'T=1', 'rao_blackwell'),
                 f"{fmt(r['tokens greedy counted'])} ({seeds('greedy')})",
                 _diff_cell(r, 'greedy', 'counted'), fmt(r['TF alpha text']),
                 fmt(r['TF alpha continuations'])]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def sensitivity_table(sens: Dict[str, Dict]) -> str:
    rates = sorted({lr for s in sens.values() for lr in s['score']})
    head = ['loss', 'steps'] + [f'lr {lr:g}' for lr in rates] + [
        'best', 'best at a third (curve)', 'spread', 'plateau gain at best']
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for loss, s in sens.items():
        cells = [f'`{loss}`', str(s['steps'])]
        for lr in rates:
            v = s['score'].get(lr)
            cell = '' if v is None else f'{v:.3f}'
            cells.append(f'**{cell}**' if lr == s['best'] and cell else cell)
        cells += [f"{s['best']:g}", f"{s['best_at_third']:g}", f"{s['spread']:.3f}",
                  f"{100 * s['plateau_gain'][s['best']]:+.1f}%"]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plateau_table(rows: List[Dict], threshold: float) -> str:
    lines = ['| loss | lr | steps N | tau at N | tau at 2N | gain | plateau at N? |',
             '|---|---|---|---|---|---|---|']
    lines += [f"| `{r['loss']}` | {r['lr']:g} | {r['steps']} | {r['tau']:.3f} | "
              f"{r['tau_doubled']:.3f} | {100 * r['gain']:+.1f}% | "
              f"{'yes' if r['gain'] < threshold else 'no'} |" for r in rows]
    return '\n'.join(lines)


def _leader_section(versus: Dict) -> List[str]:
    if not versus:
        return []
    return [f"Between the alternatives to `ce`: each against `{versus['leader']}`, the best of "
            f"them at T=1 (Rao-Blackwell):", '', table(versus['rows'], versus['leader']), '']


def render(summary: Dict, preset: Preset) -> str:
    out = [f"# SmolLM2-135M: MTP heads per loss (preset `{preset.name}`)", '',
           f"Parts: {len(summary['parts'])}; compute in the parts: "
           f"{summary['compute_s'] / 60:.0f} min wall, {summary['cpu_s'] / 60:.0f} CPU-min "
           f"(each part's `wall_s`, `cpu_s`, `load_average`). Tokens per verify step = 1 + "
           f"accepted drafts, speculative decoding on {preset.spec_prompts} test prompts x "
           f"{preset.spec_rounds} verify steps, per seed; differences paired per seed and over "
           f"prompts; 'resolved': every seed's difference of one sign and the mean beyond "
           f"{RESOLVED_AT:g} standard errors across seeds and {RESOLVED_AT:g} prompt-level ones.",
           '']
    if summary['pending']:
        out += [f"**Incomplete**: not yet run: {_pending_line(summary['pending'])}. "
                f"The tables hold what has landed; the same command resumes the run.", '']
    if summary['cold_sensitivity']:
        depths = 'one-depth' if preset.depths == 1 else f'{preset.depths}-depth'
        out += [f'## Cold start: fresh {depths} heads on the pretrained model, code', '',
                f'Learning rates, seed {preset.seeds[0]}: whole-validation accepted drafts at '
                f'T=1 at the last step (best in bold); the rate the curve windows would pick at a '
                f'third of the budget; the best arm\'s gain over the last quarter (plateau: '
                f'under {100 * preset.plateau_gain:g}%).', '',
                sensitivity_table(summary['cold_sensitivity']), '']
    if summary['cold_plateau']:
        out += [f'Plateau, seed {preset.seeds[0]}: validation tau (1 + accepted drafts, T=1) '
                f'at a budget and at twice it (a plateau: the double gains under '
                f'{100 * preset.plateau_gain:g}%).', '', plateau_table(summary['cold_plateau'], preset.plateau_gain),
                '']
    if summary['cold']:
        out += ['Test, each loss at its best rate:', '', table(summary['cold']), '']
    out += _leader_section(summary['cold_vs_leader'])
    d = summary.get('drift')
    if d:
        out += ['## Drift: the official `ce` head on a backbone moved by SFT on English docs', '',
                f"The backbone fine-tuned {d['steps']} steps (lr {d['lr']:g}) on English docs "
                f"(pydoc); the official head's alpha on code "
                f"(T=1) before -> after: curve windows {d['curve_validation']['before']:.3f} -> "
                f"{d['curve_validation']['after']:.3f}, whole validation "
                f"{d['validation']['before']:.3f} -> {d['validation']['after']:.3f} "
                f"(drop {d['validation']['drop']:.3f}), test text {d['tf_test']['before']:.3f} -> "
                f"{d['tf_test']['after']:.3f} (drop {d['tf_test']['drop']:.3f}), the backbone's "
                f"own continuations {d['tf_continuation']['before']:.3f} -> "
                f"{d['tf_continuation']['after']:.3f}; tokens per step T=1 "
                f"{d['tokens T=1']['before']:.3f} -> {d['tokens T=1']['after']:.3f}, greedy "
                f"{d['tokens greedy']['before']:.3f} -> {d['tokens greedy']['after']:.3f}; main "
                f"model NLL on code {fmt(d['main_model_nll']['before'])} -> "
                f"{fmt(d['main_model_nll']['after'])}.", '']
    if summary['heal_sensitivity']:
        out += ['Healing the grafted head, learning rates:', '',
                sensitivity_table(summary['heal_sensitivity']), '']
    if summary['heal']:
        out += ['Test after healing, each loss at its best rate:', '', table(summary['heal']), '']
    out += _leader_section(summary['heal_vs_leader'])
    rec = summary['heal_recovery']
    if rec:
        def seed_cell(r):
            return (f"step {r['step']}" if r['step'] is not None else
                    f"not within {r['steps']} (best {r['best']:.3f} at step {r['best_step']})")
        out += [f"Back at the pre-drift alpha ({rec['goal']:.3f}, curve windows, T=1): the first "
                f"curve step the healed head reaches it, per seed:", '']
        out += [f"- `{loss}`: " + '; '.join(f"seed {r['seed']} {seed_cell(r)}" for r in rows)
                for loss, rows in rec['losses'].items()]
        out.append('')
    if summary['joint']:
        out += ['## Joint: the same fine-tuning with the official head trained alongside', '',
                table(summary['joint']), '']
        for row in summary['joint']:
            vs = row.get('main_model_vs_no_heads', {})
            out.append(f"- `{row['label']}`: main model NLL on code {fmt(row['main_model_nll'])}"
                       + (f"; vs the fine-tuning without heads {vs['mean']:+.4f} (windows "
                          f"±{vs['se_units']:.4f}, {_verdict(vs)})" if vs else ''))
        out.append('')
    return '\n'.join(out)


def _curves(ax, parts: Dict[str, Dict], summary_rows: List[Dict], scenario: str,
            seeds: Sequence[int]) -> None:
    for row in summary_rows:
        loss = row['label']
        for seed in seeds:
            arm = parts.get(_arm_name(scenario, {'loss': loss, 'lr': row['lr'],
                                                 'steps': row['steps'], 'seed': seed}))
            if arm is None:
                continue
            points = arm['curve']['validation']
            ax.plot([p['step'] for p in points], [p['sampled']['accepted'] for p in points],
                    '-', color=COLORS.get(loss), alpha=0.9 if seed == seeds[0] else 0.45,
                    lw=1.6 if seed == seeds[0] else 0.9,
                    label=f"{loss} (lr {row['lr']:g})" if seed == seeds[0] else None)
    ax.set_xlabel('step (1024 tokens each)')
    ax.set_ylabel('accepted drafts per verify step\n(validation, T=1, expected)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot(path: str, parts: Dict[str, Dict], summary: Dict, preset: Preset) -> Optional[str]:
    """Validation accepted drafts at T=1 against step, each loss at its chosen rate, every
    seed (thin lines: seeds after the first): cold start and healing."""
    plt, skipped = pyplot()
    if skipped:
        return skipped
    panels = [(s, t) for s, t in (('cold', 'cold start: fresh heads'),
                                  ('heal', 'healing the official head after drift'))
              if summary[s]]
    if not panels:
        return 'no arm has test results yet'
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (scenario, title) in zip(axes[0], panels):
        _curves(ax, parts, summary[scenario], scenario, preset.seeds)
        if scenario == 'heal' and parts.get('drift_before'):
            goal = parts['drift_before']['curve_validation']['sampled']['accepted']
            ax.axhline(goal, color='k', ls=':', lw=1, label='official head before the drift')
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
    save_figure(plt, fig, path, f'SmolLM2-135M, one MTP depth, preset {preset.name}', dpi=90)
    return None


# The measures of a gains panel: (mode, estimator, marker, label).
GAIN_MEASURES = (('T=1', 'counted', 'o', 'T=1, counted'),
                 ('T=1', 'rao_blackwell', 'D', 'T=1, expected (Rao-Blackwell)'),
                 ('greedy', 'counted', 's', 'greedy'))
SCENARIO_TITLES = {'cold': 'fresh heads (cold start)', 'heal': 'official head healed after drift',
                   'joint': 'official head trained with the fine-tuning'}


def gains_plot(path: str, summary: Dict, preset: Preset) -> Optional[str]:
    """The headline: each loss's gain over ``'ce'`` in tokens per verify step (percent of
    ``'ce'``'s), one panel per scenario with test results, one row per loss and measure: a dot
    per seed, the mean over seeds with a bar of ``RESOLVED_AT`` standard errors across seeds,
    filled where resolved. Returns why it was skipped, or None."""
    plt, skipped = pyplot()
    if skipped:
        return skipped
    panels = [s for s in SCENARIO_TITLES if any('vs T=1 counted' in r for r in summary[s])]
    if not panels:
        return "no loss has test results beside 'ce' yet"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0), squeeze=False,
                             sharex=True)
    for ax, scenario in zip(axes[0], panels):
        rows = summary[scenario]
        ce = next(r for r in rows if r['label'] == 'ce')
        others = [r for r in rows if 'vs T=1 counted' in r]
        for y, row in enumerate(others):
            color = COLORS.get(row['label'])
            for k, (mode, estimator, marker, _) in enumerate(GAIN_MEASURES):
                diff = row[f'vs {mode} {estimator}']
                scale = 100 / ce[f'tokens {mode} {estimator}']['mean']
                at = y + (k - 1) * 0.22
                ax.scatter([scale * d for d in diff['per_seed']], [at] * len(diff['per_seed']),
                           s=9, color=color, alpha=0.45, marker=marker, lw=0)
                spread = diff['se_seeds']
                ax.errorbar(scale * diff['mean'], at,
                            xerr=None if math.isnan(spread) else RESOLVED_AT * scale * spread,
                            fmt=marker, ms=5, color=color, capsize=2,
                            mfc=color if diff['resolved'] else 'white')
        ax.axvline(0, color='grey', lw=0.8)
        ax.set_yticks(range(len(others)), [r['label'] for r in others], fontsize=8)
        ax.invert_yaxis()
        budget = f"{ce['steps']} steps, " if ce.get('steps') else ''
        ax.set_title(f"{SCENARIO_TITLES[scenario]}\n{budget}seeds "
                     f"{', '.join(map(str, ce['seeds']))}", fontsize=9)
        ax.set_xlabel("tokens per verify step, % over 'ce'", fontsize=8)
        ax.grid(axis='x', alpha=0.3)
    handles = [plt.Line2D([], [], ls='', marker=m, color='k', mfc='white', label=label)
               for _, _, m, label in GAIN_MEASURES]
    axes[0][0].legend(handles=handles, fontsize=7, loc='upper left', ncol=len(handles),
                      bbox_to_anchor=(0, -0.16), frameon=False)  # under the axes, off the data
    save_figure(plt, fig, path, 'SmolLM2-135M, one MTP depth: gain over cross-entropy\n'
                f'dots are seeds, bars {RESOLVED_AT:g} SE across seeds, filled = resolved',
                dpi=110)
    return None


def write_report(store: Store, preset: Preset, results_dir: str, plot_png: bool = True) -> str:
    parts = store.all()
    summary = summarize(parts, preset)
    text = render(summary, preset)
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
        f.write('\n')
    with open(os.path.join(results_dir, 'report.md'), 'w') as f:
        f.write(text + '\n')
    if plot_png:
        plot(os.path.join(results_dir, 'smollm2_curves.png'), parts, summary, preset)
        gains_plot(os.path.join(results_dir, 'smollm2_gains.png'), summary, preset)
    return text
