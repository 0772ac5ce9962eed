"""The demo's outputs: the tables (text), ``results.json`` and the two plots (PNG).

Tables, one per serving mode and scenario, each a list of rows (one model at the end of its
training) with the teacher-forced stats and the speculative-decoding stats of that mode:

* ``warm``: sampling at T=1; before drift, after drift, and every warm arm (healed grafted heads);
* ``cold``: sampling at T=1; the fresh heads and every cold-start arm;
* ``greedy``: greedy decoding (T=0), every model;
* ``serving``: sampling at the serving temperature; the warm arms and the serve_* arms (trained at
  that temperature), with the paired difference of each serve_* arm from the same loss at T=1.
"""

import json
import math
import os
import subprocess
import time
from typing import Dict, List, Optional, Sequence

from .arms import arm_kind

ARM_COLORS = {'ce': '#1f77b4', 'tv': '#d62728', 'e2e_tv': '#2ca02c', 'kl': '#9467bd',
              'lk': '#ff7f0e', 'nla': '#8c564b'}
#: mode -> (teacher-forced key, speculative key) of an evaluation record.
MODE_KEYS = {'sampled': ('teacher_forced', 'speculative'),
             'greedy': ('teacher_forced_greedy', 'speculative_greedy'),
             'serving': ('teacher_forced_serving', 'speculative_serving')}


def arm_color(arm: str) -> Optional[str]:
    return ARM_COLORS.get(arm_kind(arm)[1])


def arm_label(arm: str, serving_temperature: Optional[float] = None) -> str:
    kind, loss = arm_kind(arm)
    if arm == 'pretrained':
        return 'pretrained, before drift'
    if arm == 'drifted':
        return 'drifted, no healing'
    if arm == 'cold_init':
        return 'fresh heads, untrained'
    if kind == 'cold':
        return f'cold start, {loss!r}'
    if kind == 'serve':
        return f'healed with {loss!r} at T={serving_temperature:g}'
    return f'healed with {loss!r}'


def fmt(stat: Dict, digits: int = 3) -> str:
    """``0.812±0.004``."""
    if stat is None or math.isnan(stat.get('mean', float('nan'))):
        return 'n/a'
    return f"{stat['mean']:.{digits}f}±{stat['se']:.{digits}f}"


def signed(stat: Optional[Dict], digits: int = 3) -> str:
    """``+0.271±0.051`` (explicit sign, for differences)."""
    if stat is None:
        return 'n/a'
    return ('+' if stat['mean'] >= 0 else '') + fmt(stat, digits)


def paired_difference(a: List[int], b: List[int]) -> Dict:
    """Mean and standard error of ``a - b`` over the same prompts and random numbers."""
    n = len(a)
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else float('nan')
    return {'mean': mean, 'se': math.sqrt(var / n), 'n': n}


#: Standard errors a mean difference over seeds must exceed to be called resolved.
RESOLVED_AT = 2.0


def mean_of(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (nan for fewer than two values)."""
    n = len(values)
    if n < 2:
        return float('nan')
    mean = mean_of(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def seed_difference(a: Dict[int, List[float]], b: Dict[int, List[float]]) -> Dict:
    """``a - b`` with seeds as the unit of variance.

    ``a`` and ``b`` map a seed to per-unit values (prompts or windows, the same units in the
    same order for both). Per seed: the paired mean difference and its standard error over the
    units; then the mean over seeds, its standard error across seeds (``se_seeds``) and the
    units' one (``se_units``). *Resolved* when every seed's difference has the same sign and the
    mean exceeds ``RESOLVED_AT`` times both standard errors (so never with one seed)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {}
    per_seed, unit_se = [], []
    for s in seeds:
        diffs = [x - y for x, y in zip(a[s], b[s])]
        per_seed.append(mean_of(diffs))
        unit_se.append(standard_error(diffs))
    mean = mean_of(per_seed)
    se_seeds = standard_error(per_seed)
    se_units = math.sqrt(sum(se ** 2 for se in unit_se)) / len(seeds)
    same_sign = all(d > 0 for d in per_seed) or all(d < 0 for d in per_seed)
    resolved = bool(same_sign and len(seeds) > 1 and abs(mean) > RESOLVED_AT * se_seeds
                    and abs(mean) > RESOLVED_AT * se_units)
    return {'seeds': seeds, 'per_seed': per_seed, 'mean': mean, 'se_seeds': se_seeds,
            'se_units': se_units, 'resolved': resolved}


def _row(record: Dict, mode: str, label: str) -> Dict:
    tf_key, sd_key = MODE_KEYS[mode]
    row = {'label': label, 'arm': record['arm'], 'step': record['step'],
           'teacher_forced': record[tf_key], 'speculative': record[sd_key]}
    row['empirical_minus_predicted_at_n'] = paired_difference(
        row['speculative']['per_prompt'],
        row['teacher_forced']['accepted_at_prompt_end_per_window'])
    return row


def build_tables(evaluations: List[Dict], arms: List[str], heal_steps: int, cold_steps: int,
                 serving_temperature: Optional[float] = None,
                 labels: Optional[Dict[str, str]] = None) -> Dict[str, List[Dict]]:
    """The tables (see the module docstring); a table whose arms were not run is left out, and
    so is a reference model ('pretrained', 'drifted', 'cold_init') that was not evaluated.
    ``labels`` overrides :func:`arm_label` for some arms."""
    by_key = {(e['arm'], e['step']): e for e in evaluations}
    final = {arm: by_key[(arm, cold_steps if arm_kind(arm)[0] == 'cold' else heal_steps)]
             for arm in arms}
    final.update({a: by_key[(a, 0)] for a in ('pretrained', 'drifted', 'cold_init')
                  if (a, 0) in by_key})
    warm = [a for a in arms if arm_kind(a)[0] == 'warm']
    serve = [a for a in arms if arm_kind(a)[0] == 'serve']
    cold = [a for a in arms if arm_kind(a)[0] == 'cold']
    plan = {'warm': ('sampled', ['pretrained', 'drifted'] + warm),
            'cold': ('sampled', ['cold_init'] + cold if cold else []),
            'greedy': ('greedy', ['pretrained', 'drifted'] + warm + serve
                       + (['cold_init'] + cold if cold else [])),
            'serving': ('serving', ['pretrained', 'drifted'] + warm + serve if serve else [])}
    tables = {}
    labels = labels or {}
    for name, (mode, members) in plan.items():
        members = [a for a in members if a in final]
        if not members:
            continue
        rows = {a: _row(final[a], mode, labels.get(a) or arm_label(a, serving_temperature))
                for a in members}
        for arm, row in rows.items():
            is_cold = arm in cold or arm == 'cold_init'
            for key, reference in (('vs_ce', 'cold_ce' if is_cold else 'ce'),
                                   ('vs_tv', 'cold_tv' if is_cold else 'tv')):
                if reference in rows:
                    row[key] = paired_difference(row['speculative']['per_prompt'],
                                                 rows[reference]['speculative']['per_prompt'])
            kind, loss = arm_kind(arm)
            if kind == 'serve' and loss in rows:
                row['vs_t1'] = paired_difference(row['speculative']['per_prompt'],
                                                 rows[loss]['speculative']['per_prompt'])
        tables[name] = list(rows.values())
    return tables


def table_rows(evaluations: List[Dict], arms: List[str], heal_steps: int) -> List[Dict]:
    """The warm table alone (before drift, after drift, each warm arm at the end)."""
    return build_tables(evaluations, arms, heal_steps, heal_steps)['warm']


def json_rows(rows: List[Dict]) -> List[Dict]:
    """A table for results.json: the per-prompt lists stay in the evaluations only."""
    return [{**row,
             'teacher_forced': {k: v for k, v in row['teacher_forced'].items()
                                if not k.endswith('_per_window')},
             'speculative': {k: v for k, v in row['speculative'].items() if k != 'per_prompt'}}
            for row in rows]


def format_table(rows: List[Dict], gamma: int, greedy: bool = False) -> str:
    """The arm x metric table (mean ± standard error)."""
    name = 'agree' if greedy else 'alpha'
    with_t1 = any('vs_t1' in row for row in rows)
    with_tv = any('vs_tv' in row for row in rows)
    headers = (['model'] + [f'{name}_{k + 1} (TF)' for k in range(gamma)]
               + ['predicted (TF)', 'predicted @n', 'empirical', 'emp. - pred@n', 'emp. - ce']
               + (['emp. - tv'] if with_tv else [])
               + (['emp. - same loss at T=1'] if with_t1 else []))
    lines = []
    for row in rows:
        tf, sd = row['teacher_forced'], row['speculative']
        cells = [row['label']] + [fmt(a) for a in tf['alpha']] + [
            fmt(tf['accepted']), fmt(tf['accepted_at_prompt_end']), fmt(sd['accepted']),
            signed(row['empirical_minus_predicted_at_n']), signed(row.get('vs_ce')),
        ] + ([signed(row.get('vs_tv'))] if with_tv else []) + (
            [signed(row.get('vs_t1'))] if with_t1 else [])
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(headers)]
    out = ['  '.join(h.ljust(w) for h, w in zip(headers, widths)),
           '  '.join('-' * w for w in widths)]
    out += ['  '.join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return '\n'.join(out)


TABLE_NOTE = """\
Accepted drafts per verify step; tokens per verify step are one more. +- is one standard error.
alpha_k (TF): teacher-forced acceptance of depth k, the mean over held-out positions of
  sum_v min(p_main, q_k) with the heads reading the real text. predicted (TF): the mean over
  positions of sum_j prod_{i<=j} alpha_i, the training-time metric. predicted @n: the same at the
  one position n the speculative run drafts from, on the same prompts. empirical: counted in real
  speculative decoding (the heads draft from their own samples, the main model verifies by
  rejection sampling at the table's temperature; greedy: argmax drafts accepted iff they equal the
  main model's argmax, and agree_k is the teacher-forced agreement of the two argmaxes).
  emp. - pred@n: empirical minus predicted @n, paired over prompts: what teacher forcing misses.
  emp. - ce, emp. - tv: paired difference from the 'ce' ('tv') arm of the same scenario (cold
  rows: 'cold_ce', 'cold_tv'; same prompts, same random numbers). emp. - same loss at T=1: a
  serve arm minus the arm trained with the same loss at T=1, both verified in the table's mode."""


def write_json(path: str, payload: Dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(payload, f, indent=1, sort_keys=False)
        f.write('\n')


def commit_files(paths: Sequence[str], message: str) -> bool:
    """``git commit`` exactly ``paths`` (a long experiment's finished part, so that an
    interrupted run resumes from what is committed). Another git command holding the index is
    waited for and retried; a failure is reported, never fatal: the files are written."""
    paths = [os.path.abspath(p) for p in paths]
    cwd = os.path.dirname(paths[0])
    for attempt in range(5):
        done = subprocess.run(['git', 'add', '--', *paths], cwd=cwd,
                              capture_output=True).returncode == 0 and subprocess.run(
            ['git', 'commit', '-q', '-m', message, '--', *paths], cwd=cwd,
            capture_output=True).returncode == 0
        if done:
            return True
        time.sleep(2 + 3 * attempt)
    print(f'written, but git commit failed; commit {" ".join(paths)} by hand', flush=True)
    return False


def pyplot():
    """``(matplotlib.pyplot, None)`` with the file-only Agg backend, or ``(None, why not)``."""
    try:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as err:
        return None, f'matplotlib is not installed ({err})'
    return plt, None


def save_figure(plt, fig, path: str, title: Optional[str], dpi: int) -> None:
    """Title (small), tight layout, write ``path`` (its folder made), close."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def evaluations_by_arm(evaluations: List[Dict]) -> Dict[str, List[Dict]]:
    """The evaluation records grouped by arm, in the order they were made."""
    by_arm: Dict[str, List[Dict]] = {}
    for e in evaluations:
        by_arm.setdefault(e['arm'], []).append(e)
    return by_arm


def plot(path: str, evaluations: List[Dict], arms: List[str], gamma: int,
         title: Optional[str] = None) -> Optional[str]:
    """Accepted drafts per verify step vs healing step per arm, and the final per-depth alpha.

    Returns None on success, or the reason the plot was skipped (matplotlib missing).
    """
    plt, skipped = pyplot()
    if skipped:  # the numbers are still in results.json and the table
        return skipped
    by_arm = evaluations_by_arm(evaluations)
    drifted = by_arm['drifted'][0]
    pretrained = by_arm['pretrained'][0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={'width_ratios': [3, 2]})

    for arm in arms:
        points = [drifted] + sorted(by_arm.get(arm, []), key=lambda e: e['step'])
        steps = [e['step'] for e in points]
        emp = [e['speculative']['accepted'] for e in points]
        pred = [e['teacher_forced']['accepted_at_prompt_end'] for e in points]
        color = arm_color(arm)
        ax.errorbar(steps, [s['mean'] for s in emp], yerr=[s['se'] for s in emp], color=color,
                    marker='o', capsize=3, label=f'{arm}: empirical (spec. decoding)')
        ax.plot(steps, [s['mean'] for s in pred], color=color, linestyle='--', marker='x',
                alpha=0.8, label=f'{arm}: predicted (teacher-forced, same prompts)')
    level = pretrained['speculative']['accepted']['mean']
    ax.axhline(level, color='gray', linestyle=':', label='before drift (empirical)')
    ax.set_xlabel('healing step (heads only, backbone frozen)')
    ax.set_ylabel(f'accepted drafts per verify step (gamma={gamma})')
    ax.set_title('Acceptance while healing drifted MTP heads (held-out domain B)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc='lower right')

    labels = ['before drift', 'drifted'] + arms
    finals = [pretrained, drifted] + [max(by_arm[a], key=lambda e: e['step']) for a in arms]
    width = 0.8 / gamma
    for k in range(gamma):
        xs = [i + (k - (gamma - 1) / 2) * width for i in range(len(labels))]
        tf = [e['teacher_forced']['alpha'][k] for e in finals]
        emp = [e['speculative']['depth_acceptance'][k] for e in finals]
        bx.bar(xs, [s['mean'] for s in tf], width=width * 0.9, yerr=[s['se'] for s in tf],
               label=f'alpha_{k + 1} teacher-forced', alpha=0.55 + 0.45 * k / max(1, gamma - 1),
               color='#555555')
        bx.errorbar(xs, [s['mean'] for s in emp], yerr=[s['se'] for s in emp], fmt='D',
                    color='#ff7f0e', markersize=4, capsize=2,
                    label='empirical accept rate (given reached)' if k == 0 else None)
    bx.set_xticks(range(len(labels)))
    bx.set_xticklabels(labels, fontsize=8)
    lows = [s['mean'] - s['se'] for e in finals
            for s in e['teacher_forced']['alpha'] + e['speculative']['depth_acceptance']
            if not math.isnan(s['mean'])]
    bx.set_ylim(max(0.0, min(lows) - 0.1), 1.0)
    bx.set_ylabel('per-depth acceptance')
    bx.set_title('Per-depth acceptance at the end')
    bx.legend(fontsize=7, loc='lower right')
    bx.grid(alpha=0.3, axis='y')
    save_figure(plt, fig, path, title, dpi=110)
    return None


def plot_cold(path: str, evaluations: List[Dict], arms: List[str], curves: Dict[str, Dict],
              gamma: int, title: Optional[str] = None) -> Optional[str]:
    """The cold-start arms: accepted drafts per verify step against training steps at T=1 and
    greedy, and the heads' gradient norm per step. Returns None, or why it was skipped."""
    plt, skipped = pyplot()
    if skipped:
        return skipped
    by_arm = evaluations_by_arm(evaluations)
    start = by_arm['cold_init'][0]
    fig, (ax, gx, nx) = plt.subplots(1, 3, figsize=(16, 4.8),
                                     gridspec_kw={'width_ratios': [3, 3, 2.4]})
    def smooth(values, window=10):
        return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
                for i in range(len(values))]

    for arm in arms:
        points = [start] + sorted(by_arm.get(arm, []), key=lambda e: e['step'])
        steps = [e['step'] for e in points]
        color, loss = arm_color(arm), arm_kind(arm)[1]
        curve = curves.get(arm, {})
        plugin = curve.get('plugin_metrics', {})
        for axis, key in ((ax, 'mtp_expected_accepted_drafts'),
                          (gx, 'mtp_expected_accepted_drafts_greedy')):
            if plugin.get(key):
                axis.plot(range(1, len(plugin[key]) + 1), smooth(plugin[key]), color=color,
                          linewidth=0.8, alpha=0.45)
        emp = [e['speculative']['accepted'] for e in points]
        ax.errorbar(steps, [s['mean'] for s in emp], yerr=[s['se'] for s in emp], color=color,
                    marker='o', capsize=3, label=f'{loss}')
        greedy_pred = [e['teacher_forced_greedy']['accepted_at_prompt_end'] for e in points]
        gx.plot(steps, [s['mean'] for s in greedy_pred], color=color, linestyle='--', marker='x',
                alpha=0.8, label=f'{loss}: predicted (held-out agreement)')
        ends = [e for e in points if 'speculative_greedy' in e]
        gx.errorbar([e['step'] for e in ends],
                    [e['speculative_greedy']['accepted']['mean'] for e in ends],
                    yerr=[e['speculative_greedy']['accepted']['se'] for e in ends], color=color,
                    marker='o', linestyle='none', capsize=3, label=f'{loss}: empirical')
        norms = curve.get('grad_norm', [])
        if norms:
            nx.plot(range(1, len(norms) + 1), smooth(norms), color=color, label=loss)
    for axis, key in ((ax, 'speculative'), (gx, 'speculative_greedy')):
        for arm, style, text in (('drifted', ':', 'grafted drifted heads'),
                                 ('tv', '-.', "warm heal with 'tv' (end)")):
            records = by_arm.get(arm)
            if records:
                record = max(records, key=lambda e: e['step'])
                if key in record:
                    axis.axhline(record[key]['accepted']['mean'], color='gray', linestyle=style,
                                 label=text)
        axis.set_xlabel('training step (fresh heads only, backbone frozen)')
        axis.set_ylabel(f'accepted drafts per verify step (gamma={gamma})')
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc='lower right', ncol=2)
    ax.set_title('Cold start, T=1: empirical (dots, held out); thin: training batches',
                 fontsize=10)
    gx.set_title('Cold start, greedy (T=0); thin: training batches', fontsize=10)
    nx.set_yscale('log')
    nx.set_xlabel('training step')
    nx.set_ylabel('heads\' gradient L2 norm before clipping (10-step mean)')
    nx.set_title('Gradient norm of each loss')
    nx.grid(alpha=0.3, which='both')
    nx.legend(fontsize=7)
    save_figure(plt, fig, path, title, dpi=100)
    return None
