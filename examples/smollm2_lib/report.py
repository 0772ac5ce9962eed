"""The SmolLM2 experiment's report: tables, paired differences, the ranking and the plot.

Everything here is read from the stored parts (``experiment.Store``), so ``--report-only``
rebuilds it without training. Conventions:

* *tokens per verify step* is one more than the accepted drafts (the bonus or residual token is
  always emitted); both are measured by speculative decoding on the test prompts;
* a difference between two arms is paired over the same prompts (speculative, common random
  numbers) or windows (teacher-forced): per prompt, the mean over seeds of ``a_s - b_s``; its
  standard error is over prompts. A difference is *resolved* when it is at least 2 standard
  errors from 0, otherwise the report says "not resolved";
* the gain over ``'ce'`` in percent is the difference divided by ``'ce'``'s tokens per step.
"""

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from cpu_demo_lib.report import pyplot, save_figure

from .experiment import Preset, Store, chain_losses, depth_one_losses

RESOLVED_AT = 2.0  # standard errors
MODES = {'T=1': 'spec_sampled', 'greedy': 'spec_greedy'}
COLORS = {'ce': '#1f77b4', 'tv': '#d62728', 'e2e_tv': '#2ca02c', 'kl': '#9467bd',
          'lk': '#ff7f0e', 'nla': '#8c564b'}


def _stats(values: Sequence[float]) -> Dict:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float('nan')
    return {'mean': mean, 'se': math.sqrt(var / n), 'n': n}


def per_unit(records: List[Dict], path: Sequence[str]) -> List[float]:
    """Per prompt (or window), the mean over ``records`` (seeds) of the values at ``path``."""
    series = []
    for record in records:
        node = record['final']
        for key in path:
            node = node[key]
        series.append(node)
    return [sum(vals) / len(vals) for vals in zip(*series)]


def measure(records: List[Dict], path: Sequence[str], offset: float = 0.0) -> Dict:
    values = per_unit(records, path)
    out = _stats(values)
    out['mean'] += offset
    return out


def pooled(stats: List[Dict]) -> Dict:
    """The mean over seeds of per-seed means, with their standard errors combined."""
    return {'mean': sum(s['mean'] for s in stats) / len(stats),
            'se': math.sqrt(sum(s['se'] ** 2 for s in stats)) / len(stats)}


def paired(a: List[Dict], b: List[Dict], path: Sequence[str]) -> Dict:
    """``a - b`` paired per unit, each side averaged over its seeds (the same seeds)."""
    return difference(per_unit(a, path), per_unit(b, path))


def difference(a: List[float], b: List[float]) -> Dict:
    """Mean and SE of ``a - b`` over the same units, and whether it is resolved."""
    out = _stats([x - y for x, y in zip(a, b)])
    out['resolved'] = bool(out['se'] > 0 and abs(out['mean']) >= RESOLVED_AT * out['se'])
    return out


def fmt(stat: Optional[Dict], digits: int = 3, signed: bool = False) -> str:
    if not stat or stat.get('mean') is None or math.isnan(stat['mean']):
        return ''
    sign = '+' if signed and stat['mean'] >= 0 else ''
    return f"{sign}{stat['mean']:.{digits}f}±{stat['se']:.{digits}f}"


def _spec(mode: str) -> List[str]:
    return [MODES[mode], 'per_prompt']


def arm_row(label: str, records: List[Dict], baseline: Optional[List[Dict]],
            gamma: int = 1) -> Dict:
    """One table row: tokens per step (both modes), teacher-forced alpha, and the paired
    difference from ``baseline`` (absolute and in percent of the baseline)."""
    row = {'label': label, 'seeds': [r.get('seed') for r in records],
           'lr': records[0].get('lr')}
    final = records[0]['final']
    for mode in MODES:
        if MODES[mode] not in final:
            continue
        row[f'tokens {mode}'] = measure(records, _spec(mode), offset=1.0)
        row[f'per seed {mode}'] = [measure([r], _spec(mode), offset=1.0)['mean']
                                   for r in records]
        if baseline is not None:
            diff = paired(records, baseline, _spec(mode))
            base = measure(baseline, _spec(mode), offset=1.0)['mean']
            row[f'vs {mode}'] = diff
            row[f'gain% {mode}'] = {'mean': 100 * diff['mean'] / base,
                                    'se': 100 * diff['se'] / base}
    for key, name in (('tf_test', 'text'), ('tf_continuation', 'continuations')):
        if key in final:
            row[f'TF alpha {name}'] = [pooled([r['final'][key]['sampled']['alpha'][k]
                                               for r in records]) for k in range(gamma)]
            row[f'TF accepted {name}'] = measure(records, [key, 'sampled', 'per_window'])
            row[f'TF greedy agreement {name}'] = measure(records, [key, 'greedy', 'per_window'])
    return row


def _group(parts: Dict[str, Dict], prefix: str, loss: str, seeds: Sequence[int]) -> List[Dict]:
    return [parts[f'{prefix}_{loss}_s{s}'] for s in seeds if f'{prefix}_{loss}_s{s}' in parts]


def scenario_rows(parts: Dict[str, Dict], prefix: str, seeds: Sequence[int],
                  extra: Sequence[str] = ()) -> List[Dict]:
    """Rows of the cold or heal scenario: the ``extra`` reference parts, then every loss."""
    baseline = _group(parts, prefix, 'ce', seeds)
    rows = [arm_row(name, [parts[name]], None) for name in extra
            if name in parts and 'spec_sampled' in parts[name]['final']]
    for loss in depth_one_losses():
        records = _group(parts, prefix, loss, seeds)
        if records:
            common = [r for r in baseline if r['seed'] in {x['seed'] for x in records}]
            rows.append(arm_row(loss, records, common if loss != 'ce' and common else None))
    return rows


def ranking(parts: Dict[str, Dict], prefix: str, seeds: Sequence[int]) -> Dict:
    """The order of the losses by validation accepted drafts (mean over seeds) at every curve
    point of the last third of training, and whether it stayed the same."""
    curves = {}
    for loss in depth_one_losses():
        records = _group(parts, prefix, loss, seeds)
        if records:
            points = [r['curve']['validation'] for r in records]
            curves[loss] = {p['step']: sum(x[i]['sampled']['accepted'] for x in points) / len(points)
                            for i, p in enumerate(points[0])}
    if not curves:
        return {}
    steps = sorted(next(iter(curves.values())))
    last_third = [s for s in steps if s >= steps[-1] * 2 / 3]
    orders = {s: sorted(curves, key=lambda loss: -curves[loss][s]) for s in last_third}
    first = next(iter(orders.values()))
    held = 0  # the longest leading run of the order that every point shares
    while held < len(first) and all(o[held] == first[held] for o in orders.values()):
        held += 1
    return {'steps': last_third, 'orders': orders, 'stable': held == len(first),
            'stable_top': first[:held]}


def summarize(parts: Dict[str, Dict], preset: Preset) -> Dict:
    seeds = preset.seeds
    out: Dict = {'preset': preset.name, 'common': preset.common(), 'parts': sorted(parts),
                 'compute_s': sum(p.get('wall_s', 0) for p in parts.values()),
                 'cpu_s': sum(p.get('cpu_s', 0) for p in parts.values())}
    out['cold'] = scenario_rows(parts, 'cold', seeds, extra=('cold_init',))
    out['cold_ranking'] = ranking(parts, 'cold', seeds)
    out['heal'] = scenario_rows(parts, 'heal', seeds, extra=('graft_drifted',))
    out['heal_ranking'] = ranking(parts, 'heal', seeds)
    if 'graft_before' in parts and 'graft_drifted' in parts:
        before, after = parts['graft_before']['final'], parts['graft_drifted']['final']
        out['drift'] = {'alpha_before': before['tf_test']['sampled']['alpha'][0],
                        'alpha_after': after['tf_test']['sampled']['alpha'][0],
                        'difference': paired([parts['graft_drifted']], [parts['graft_before']],
                                             ['tf_test', 'sampled', 'per_window'])}
    if 'sft' in parts:
        out['sft'] = {'main_model_before': parts['sft']['main_model_before'],
                      'main_model': parts['sft']['main_model']}
    joint = [parts[f'joint_{x}'] for x in ('ce', 'tv') if f'joint_{x}' in parts]
    out['joint'] = []
    for record in joint:
        row = arm_row(record['loss'], [record], None if record['loss'] == 'ce' else
                      [parts['joint_ce']] if 'joint_ce' in parts else None)
        row['main_model'] = {d: record['main_model'][d]['nll'] for d in ('A', 'B')}
        if 'sft' in parts:
            row['main_model_vs_sft'] = {d: difference(record['main_model'][d]['per_window'],
                                                        parts['sft']['main_model'][d]['per_window'])
                                        for d in ('A', 'B')}
        out['joint'].append(row)
    chain = [parts[f'chain_{x}'] for x in dict.fromkeys(chain_losses() + depth_one_losses())
             if f'chain_{x}' in parts]
    base = parts.get('chain_tv')
    out['chain'] = [arm_row(r['loss'], [r], None if r is base or base is None else [base],
                            gamma=r['depths']) for r in chain]
    out['sweeps'] = {kind: {name[len(f'sweep_{kind}_'):]: p['curve']['validation'][-1]['sampled']
                            ['accepted'] for name, p in parts.items()
                            if name.startswith(f'sweep_{kind}_')} for kind in ('cold', 'heal')}
    return out


def _verdict(stat: Optional[Dict]) -> str:
    if not stat:
        return ''
    return 'resolved' if stat['resolved'] else 'not resolved'


def table(rows: List[Dict], gamma: int = 1) -> str:
    """Markdown: tokens per step and the paired gain over the baseline, both modes, and the
    teacher-forced acceptance."""
    head = ['arm', 'lr', 'tokens/step T=1', 'per seed', 'vs ce T=1', 'gain % T=1', '',
            'tokens/step greedy', 'vs ce greedy', '', 'TF alpha text', 'TF alpha continuations']
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        alpha = lambda key: ' / '.join(fmt(a) for a in r.get(key, []))  # noqa: E731
        cells = [r['label'], '' if r.get('lr') is None else f"{r['lr']:g}",
                 fmt(r.get('tokens T=1')),
                 ' / '.join(f'{x:.3f}' for x in r.get('per seed T=1', [])),
                 fmt(r.get('vs T=1'), signed=True),
                 fmt(r.get('gain% T=1'), 1, signed=True), _verdict(r.get('vs T=1')),
                 fmt(r.get('tokens greedy')), fmt(r.get('vs greedy'), signed=True),
                 _verdict(r.get('vs greedy')), alpha('TF alpha text'),
                 alpha('TF alpha continuations')]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def render(summary: Dict, preset: Preset) -> str:
    out = [f"# SmolLM2-135M: MTP heads per loss (preset `{preset.name}`)", '',
           f"Parts: {len(summary['parts'])}; compute in the parts: "
           f"{summary['compute_s'] / 60:.0f} min wall, {summary['cpu_s'] / 60:.0f} CPU-min "
           f"(each part's `wall_s`, `cpu_s`, `load_average`). "
           f"Tokens per verify step = 1 + accepted drafts, "
           f"speculative decoding on {preset.spec_prompts} test prompts x {preset.spec_rounds} "
           f"verify steps; +- one standard error over prompts; differences paired, "
           f"'resolved' at >= {RESOLVED_AT:g} SE.", '']
    if summary['cold']:
        out += ['## Cold start: fresh heads, one depth, English docs', '',
                table(summary['cold']), '', _ranking_text(summary['cold_ranking']), '']
    if summary.get('drift'):
        d = summary['drift']
        out += ['## Grafted head after drift: the official `ce` head on the model fine-tuned on '
                'code, healed on code', '',
                f"Teacher-forced alpha on code before the fine-tuning {fmt(d['alpha_before'])}, "
                f"after {fmt(d['alpha_after'])} (paired: {fmt(d['difference'], signed=True)}, "
                f"{_verdict(d['difference'])}).", '']
    if summary['heal']:
        out += [table(summary['heal']), '', _ranking_text(summary['heal_ranking']), '']
    if summary['joint']:
        out += ['## Joint training: backbone and head fine-tuned together on code', '',
                table(summary['joint']), '']
        for row in summary['joint']:
            vs = row.get('main_model_vs_sft', {})
            out.append(f"- `{row['label']}`: main model held-out NLL on code "
                       f"{fmt(row['main_model']['A'])}, on docs {fmt(row['main_model']['B'])}; "
                       f"vs the fine-tuning without MTP: code {fmt(vs.get('A'), 4, True)} "
                       f"({_verdict(vs.get('A'))}), docs {fmt(vs.get('B'), 4, True)} "
                       f"({_verdict(vs.get('B'))})")
        out.append('')
    if summary['chain']:
        out += [f'## Chain: {preset.chain_depths} depths, fresh heads', '',
                table(summary['chain'], preset.chain_depths).replace('vs ce', 'vs tv'), '']
    for kind, scores in summary['sweeps'].items():
        if scores:
            out += [f'Learning-rate sweep ({kind}), validation accepted drafts at T=1: ' +
                    ', '.join(f'{k} {v:.3f}' for k, v in sorted(scores.items())), '']
    return '\n'.join(out)


def _ranking_text(rank: Dict) -> str:
    if not rank:
        return ''
    orders = ['>'.join(o) for o in rank['orders'].values()]
    if rank['stable']:
        verdict = 'the same at every point'
    elif rank.get('stable_top'):
        verdict = f"the first {len(rank['stable_top'])} held ({', '.join(rank['stable_top'])}), the rest moved"
    else:
        verdict = 'changed at the top'
    return (f"Validation ranking (predicted accepted drafts) at the evaluations of the last third "
            f"of training (steps {rank['steps']}): {verdict}: {'; '.join(dict.fromkeys(orders))}.")


def plot(path: str, parts: Dict[str, Dict], preset: Preset) -> Optional[str]:
    """Held-out (validation) predicted accepted drafts at T=1 against step, every arm."""
    plt, skipped = pyplot()
    if skipped:
        return skipped
    panels = [('cold', 'cold start (fresh heads, docs)'), ('heal', 'grafted head healed on code'),
              ('chain', f'{preset.chain_depths}-depth chain (fresh heads)'),
              ('joint', 'joint fine-tuning on code')]
    # The scenarios this run has curves of (the default preset: cold start alone).
    panels = [(prefix, title) for prefix, title in panels
              if any(n.startswith(prefix + '_') and 'curve' in r for n, r in parts.items())]
    if not panels:
        return 'no held-out curves in these parts'
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (prefix, title) in zip(axes[0], panels):
        for name, record in sorted(parts.items()):
            if not name.startswith(prefix + '_') or 'curve' not in record:
                continue
            points = record['curve']['validation']
            if not points:
                continue
            loss = record['loss']
            style = '-' if record.get('seed', 0) == 0 else '--'
            ax.plot([p['step'] for p in points], [p['sampled']['accepted'] for p in points],
                    style, color=COLORS.get(loss), marker='.', label=name[len(prefix) + 1:])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel('step')
        ax.set_ylabel('validation accepted drafts per step (T=1, predicted)')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    save_figure(plt, fig, path, f'SmolLM2-135M, preset {preset.name}', dpi=90)
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
        plot(os.path.join(results_dir, 'smollm2_curves.png'), parts, preset)
    return text
