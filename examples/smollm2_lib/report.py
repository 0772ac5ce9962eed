"""The SmolLM2 demo's outputs beyond the toy demo's tables (``cpu_demo_lib.report``, reused):
the teacher-forced table at the serving temperature and the plot."""

from typing import Dict, List, Optional

from cpu_demo_lib.arms import arm_kind
from cpu_demo_lib.report import arm_color, arm_label, evaluations_by_arm, fmt, pyplot, save_figure

TABLE_TITLES = {
    'warm': "Warm heads ('ce' on domain A) continued on domain B, sampling at T=1",
    'cold': 'Cold start: fresh heads trained on domain B, sampling at T=1',
    'greedy': 'Greedy decoding (T=0), every model',
    'serving_tf': 'Teacher-forced at the serving temperature T={t:g} (no speculative run)',
}


def _finals(evaluations: List[Dict], arms: List[str], steps: int) -> Dict[str, Dict]:
    by_key = {(e['arm'], e['step']): e for e in evaluations}
    out = {a: by_key[(a, 0)] for a in ('cold_init', 'drifted') if (a, 0) in by_key}
    out.update({a: by_key[(a, steps)] for a in arms})
    return out


def teacher_forced_rows(evaluations: List[Dict], arms: List[str], steps: int,
                        labels: Dict[str, str]) -> List[Dict]:
    """Per model at its end: teacher-forced alpha_k and predicted accepted drafts at the serving
    temperature (summaries only, for results.json and the printed table)."""
    rows = []
    for arm, record in _finals(evaluations, arms, steps).items():
        tf = record['teacher_forced_serving']
        rows.append({'label': labels.get(arm) or arm_label(arm), 'arm': arm,
                     'step': record['step'], 'alpha': tf['alpha'], 'accepted': tf['accepted']})
    return rows


def format_teacher_forced(rows: List[Dict], gamma: int) -> str:
    headers = ['model'] + [f'alpha_{k + 1} (TF)' for k in range(gamma)] + ['predicted (TF)']
    lines = [[r['label']] + [fmt(a) for a in r['alpha']] + [fmt(r['accepted'])] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(headers)]
    out = ['  '.join(h.ljust(w) for h, w in zip(headers, widths)),
           '  '.join('-' * w for w in widths)]
    out += ['  '.join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return '\n'.join(out)


def plot(path: str, evaluations: List[Dict], curves: Dict[str, Dict], arms: List[str],
         gamma: int, title: Optional[str] = None) -> Optional[str]:
    """Held-out acceptance against step for every arm (cold and warm panels: teacher-forced
    predicted accepted drafts at T=1, lines; speculative decoding at the end, dots) and each
    arm's gradient norm per step. Returns None, or why it was skipped."""
    plt, skipped = pyplot()
    if skipped:
        return skipped
    by_arm = evaluations_by_arm(evaluations)
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    panels = [(axes[0], 'cold', 'cold_init', 'teacher_forced', 'speculative', 'T=1'),
              (axes[1], 'cold', 'cold_init', 'teacher_forced_greedy', 'speculative_greedy',
               'greedy'),
              (axes[2], 'warm', 'drifted', 'teacher_forced', 'speculative', 'T=1')]
    for ax, kind, start, tf_key, sd_key, mode in panels:
        for arm in [a for a in arms if arm_kind(a)[0] == kind]:
            points = by_arm.get(start, []) + sorted(by_arm.get(arm, []), key=lambda e: e['step'])
            color, loss = arm_color(arm), arm_kind(arm)[1]
            ax.plot([e['step'] for e in points],
                    [e[tf_key]['accepted_at_prompt_end']['mean'] for e in points], color=color,
                    linestyle='--', marker='x', label=f'{loss}: predicted (teacher-forced)')
            ends = [e for e in points if sd_key in e]
            ax.errorbar([e['step'] for e in ends], [e[sd_key]['accepted']['mean'] for e in ends],
                        yerr=[e[sd_key]['accepted']['se'] for e in ends], color=color, marker='o',
                        linestyle='none', capsize=3, label=f'{loss}: speculative decoding')
        ax.set_xlabel('training step (heads only, backbone frozen)')
        ax.set_ylabel(f'accepted drafts per verify step (gamma={gamma})')
        what = 'fresh heads' if kind == 'cold' else "warm 'ce' heads continued on B"
        ax.set_title(f'{what}, {mode}, held out', fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    nx = axes[3]
    for arm in arms:
        norms = curves.get(arm, {}).get('grad_norm', [])
        if norms:
            kind, loss = arm_kind(arm)
            nx.plot(range(1, len(norms) + 1), norms, color=arm_color(arm),
                    linestyle='-' if kind == 'cold' else ':', label=f'{kind} {loss}')
    nx.set_yscale('log')
    nx.set_xlabel('training step')
    nx.set_ylabel("heads' gradient L2 norm (no clipping)")
    nx.set_title('Gradient norm of each loss (solid: cold, dotted: warm)', fontsize=10)
    nx.grid(alpha=0.3, which='both')
    nx.legend(fontsize=6, ncol=2)
    save_figure(plt, fig, path, title, dpi=100)
    return None
