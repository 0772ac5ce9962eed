"""The demo's outputs: the final table (text), ``results.json`` and the acceptance plot (PNG)."""

import json
import math
import os
from typing import Dict, List, Optional

ARM_COLORS = {'ce': '#1f77b4', 'tv': '#d62728', 'e2e_tv': '#2ca02c'}


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


def table_rows(evaluations: List[Dict], arms: List[str], heal_steps: int) -> List[Dict]:
    """One row per model: before drift, after drift (no healing), and each arm at the end."""
    by_key = {(e['arm'], e['step']): e for e in evaluations}
    rows = [dict(label='pretrained, before drift', **by_key[('pretrained', 0)]),
            dict(label='drifted, no healing', **by_key[('drifted', 0)])]
    for arm in arms:
        rows.append(dict(label=f'healed with {arm!r}', **by_key[(arm, heal_steps)]))
    reference = by_key.get(('ce', heal_steps)) if 'ce' in arms else None
    for row in rows:
        row['empirical_minus_predicted_at_n'] = paired_difference(
            row['speculative']['per_prompt'],
            row['teacher_forced']['accepted_at_prompt_end_per_window'])
        if reference is not None:
            row['vs_ce'] = paired_difference(row['speculative']['per_prompt'],
                                             reference['speculative']['per_prompt'])
    return rows


def format_table(rows: List[Dict], gamma: int) -> str:
    """The arm x metric table (mean ± standard error)."""
    headers = (['model'] + [f'alpha_{k + 1} (TF)' for k in range(gamma)]
               + ['predicted (TF)', 'predicted @n', 'empirical', 'emp. - pred@n', 'emp. - ce'])
    lines = []
    for row in rows:
        tf, sd = row['teacher_forced'], row['speculative']
        cells = [row['label']] + [fmt(a) for a in tf['alpha']] + [
            fmt(tf['accepted']), fmt(tf['accepted_at_prompt_end']), fmt(sd['accepted']),
            signed(row['empirical_minus_predicted_at_n']), signed(row.get('vs_ce')),
        ]
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
  rejection sampling at temperature 1). emp. - pred@n: empirical minus predicted @n, paired over
  prompts: what teacher forcing misses. emp. - ce: paired difference from the 'ce' arm (same
  prompts, same random numbers)."""


def write_json(path: str, payload: Dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(payload, f, indent=1, sort_keys=False)
        f.write('\n')


def plot(path: str, evaluations: List[Dict], arms: List[str], gamma: int,
         title: Optional[str] = None) -> Optional[str]:
    """Accepted drafts per verify step vs healing step per arm, and the final per-depth alpha.

    Returns None on success, or the reason the plot was skipped (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as err:  # the numbers are still in results.json and the table
        return f'matplotlib is not installed ({err})'

    by_arm: Dict[str, List[Dict]] = {}
    for e in evaluations:
        by_arm.setdefault(e['arm'], []).append(e)
    drifted = by_arm['drifted'][0]
    pretrained = by_arm['pretrained'][0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={'width_ratios': [3, 2]})

    for arm in arms:
        points = [drifted] + sorted(by_arm.get(arm, []), key=lambda e: e['step'])
        steps = [e['step'] for e in points]
        emp = [e['speculative']['accepted'] for e in points]
        pred = [e['teacher_forced']['accepted_at_prompt_end'] for e in points]
        color = ARM_COLORS.get(arm, None)
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
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
