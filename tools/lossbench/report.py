"""The targets each row is held to (printed PASS/MISS as measured, never adjusted), the memory
summaries across sequence lengths, the matrix-product floors, and the Markdown report.
"""

from typing import Dict, List, Optional

from .cases import EXTRA_MTP_TYPES
from .memory import MiB, linear_fit

FUSED_TIME_TARGET = 1.35  # fused TV fwd+bwd vs CE (issue: per-depth loss and MTP path)
ANY_TIME_TARGET = 2.5  # any TV mode vs CE
KL_LK_TIME_TARGET = 1.4  # fused 'kl' / 'lk' / 'nla' vs CE on the MTP path (peak <= CE's too)
SAVED_FRACTION_TARGET = 1 / 8  # TV saved bytes per token vs CE's
TP_RATIO_TARGET = 1.25  # (TV/CE at TP=2) / (TV/CE at TP=1)
FLAT_HIDDEN_TENSORS = 4  # "flat": peak grows by at most this many [s, b, h] fp32 tensors/token


def _verdict(ok: Optional[bool]) -> str:
    return '-' if ok is None else ('PASS' if ok else 'MISS')


def apply_targets(rows: List[dict], args) -> List[dict]:
    """Attach each row's target and verdict; return the per-impl summaries (memory, saved)."""
    by_key = {(r['case'], r['seq'], r['tp'], r['G'], r['impl']): r for r in rows}
    for r in rows:
        r['target'], r['met'] = '', None
        if r['impl'] == 'ce':
            r['target'] = 'baseline'
            continue
        if r['impl'].endswith('-products'):
            r['target'] = 'floor (see below)'
            continue
        fused = not r['impl'].endswith('-recompute')
        if r['case'] == 'loss':
            limit = FUSED_TIME_TARGET if fused else ANY_TIME_TARGET
            r['target'] = f"time <= {limit}x"
            r['met'] = r['ratio'] <= limit
        elif r['case'] == 'mtp':
            if not fused:
                r['target'] = 'reference'
                continue
            limit = KL_LK_TIME_TARGET if r['impl'] in EXTRA_MTP_TYPES else FUSED_TIME_TARGET
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce')]
            r['target'] = f"time <= {limit}x, peak <= CE's"
            r['met'] = r['ratio'] <= limit and r['peak_mib'] <= ce['peak_mib']
        elif r['case'] == 'tp':
            ref = by_key.get(('loss', r['seq'], 1, r['G'], r['impl']))
            r['target'] = f"ratio <= {TP_RATIO_TARGET} x TP1 ratio"
            if ref is not None:
                r['tp1_ratio'] = ref['ratio']
                r['ratio_vs_tp1'] = r['ratio'] / ref['ratio']
                r['target'] += f" ({TP_RATIO_TARGET * ref['ratio']:.2f}x)"
                r['met'] = r['ratio_vs_tp1'] <= TP_RATIO_TARGET

    summaries = []
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r['case'] in ('loss', 'tp') and not r['impl'].endswith('-products'):
            groups.setdefault((r['case'], r['tp'], r['impl']), []).append(r)
    for (case, tp, impl), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != 'loss')):
        rs = sorted(rs, key=lambda r: r['seq'])
        tokens = [float(r['tokens']) for r in rs]
        fixed, per_token = linear_fit(tokens, [float(r['saved_bytes']) for r in rs])
        peak0, peak_slope = linear_fit(tokens, [r['peak_mib'] * MiB for r in rs])
        summaries.append({
            'case': case, 'tp': tp, 'impl': impl, 'seqs': [r['seq'] for r in rs],
            'peak_mib': [r['peak_mib'] for r in rs],
            'peak_slope_bytes_per_token': peak_slope,
            'saved_fixed_bytes': fixed, 'saved_per_token_bytes': per_token,
        })
    ce = {(s['case'], s['tp']): s for s in summaries if s['impl'] == 'ce'}
    flat_limit = FLAT_HIDDEN_TENSORS * args.hidden * 4
    for sm in summaries:
        sm['targets'] = []
        if sm['impl'] == 'ce' or sm['saved_per_token_bytes'] is None:
            continue
        base = ce.get((sm['case'], sm['tp']))
        if base is not None and base['saved_per_token_bytes']:
            frac = sm['saved_per_token_bytes'] / base['saved_per_token_bytes']
            sm['saved_fraction_of_ce'] = frac
            sm['targets'].append({
                'target': f"saved/token <= 1/{round(1 / SAVED_FRACTION_TARGET)} of CE",
                'value': f"{frac:.4f} of CE", 'met': frac <= SAVED_FRACTION_TARGET})
        if base is not None and base['seqs'] == sm['seqs']:
            worst = max(p / c for p, c in zip(sm['peak_mib'], base['peak_mib']))
            sm['targets'].append({
                'target': "peak <= CE's at every seq", 'value': f"{worst:.2f} of CE at worst",
                'met': worst <= 1.0})
        sm['targets'].append({
            'target': f"peak flat (slope <= {FLAT_HIDDEN_TENSORS} x h x 4 = {flat_limit} B/token)",
            'value': f"{sm['peak_slope_bytes_per_token']:.0f} B/token",
            'met': sm['peak_slope_bytes_per_token'] <= flat_limit})
    return summaries


def product_floors(rows: List[dict]) -> List[dict]:
    """Per (case, seq, tp): TV's products / CE's products, and fused TV against both."""
    by_key = {(r['case'], r['seq'], r['tp'], r['impl']): r for r in rows}
    floors = []
    for (case, seq, tp, impl), r in by_key.items():
        if impl != 'tv-products' or (case, seq, tp, 'ce-products') not in by_key:
            continue
        ce_p = by_key[(case, seq, tp, 'ce-products')]['time_s']
        tv = by_key.get((case, seq, tp, 'tv'))
        floors.append({
            'case': case, 'seq': seq, 'tp': tp, 'ce_products_s': ce_p, 'tv_products_s': r['time_s'],
            'floor': r['time_s'] / ce_p,
            'tv_ratio': tv['ratio'] if tv else float('nan'),
            'tv_over_products': tv['time_s'] / r['time_s'] if tv else float('nan'),
        })
    return floors


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return 'n/a'
    if abs(b) >= MiB:
        return f"{b / MiB:.1f} MiB"
    return f"{b:.0f} B"


def render(report: dict) -> str:
    lines = ["# MTP TV loss benchmark", "", f"command: `{report['command']}`", ""]
    env = report['environment']
    lines.append(
        f"torch {env['torch']}, megatron-core {env['megatron_core']}, {env['threads']} threads "
        f"(TP ranks: {env['threads_tp']} each), CPU fp32, hidden {report['args']['hidden']}, "
        f"vocab {report['args']['vocab']}, chunk {report['args']['chunk']}, batch 1, "
        f"median of {report['args']['repeats']} (warmup {report['args']['warmup']}), "
        f"wall {report['wall_s']:.0f} s; loss code {env['mtp_tv']} @ {env['git']}")
    if 'loss_mode' in env:
        lines[-1] += f" ({env['loss_mode']} mode; TV target: {env['tv_target']})"
    if report['args'].get('label'):
        lines[-1] += f"; {report['args']['label']}"
    lines += ["", "| case | seq | tp | G | impl | time (s) | min-max | ratio vs CE | peak extra MiB "
              "(fwd/bwd) | saved B/token | target | met? |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report['rows']:
        peak = f"{r['peak_mib']:.1f} ({r['fwd_peak_mib']:.1f}/{r['bwd_peak_mib']:.1f})"
        if r['tp'] > 1:
            peak = "/".join(f"{p:.1f}" for p in r['peak_mib_per_rank']) + " per rank"
        ratio = f"{r['ratio']:.2f}x"
        if 'ratio_vs_tp1' in r:
            ratio += f" (TP1 {r['tp1_ratio']:.2f}x; {r['ratio_vs_tp1']:.2f} of it)"
        lines.append(
            f"| {r['case']} | {r['seq']} | {r['tp']} | {r['G']} | {r['impl']} | {r['time_s']:.3f} | "
            f"{min(r['times_s']):.2f}-{max(r['times_s']):.2f} | {ratio} | {peak} | "
            f"{r['saved_per_token']:.0f} | {r['target']} | {_verdict(r['met'])} |")
    floors = product_floors(report['rows'])
    if floors:
        lines += ["", "Matrix-product floor: the same shapes through only the products each side "
                  "must do (CE 3, TV 4), same run", "",
                  "| case | seq | tp | CE products (s) | TV products (s) | floor (TV/CE products) "
                  "| fused TV vs CE | fused TV vs its products |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in floors:
            lines.append(
                f"| {f['case']} | {f['seq']} | {f['tp']} | {f['ce_products_s']:.3f} | "
                f"{f['tv_products_s']:.3f} | {f['floor']:.2f}x | {f['tv_ratio']:.2f}x | "
                f"{f['tv_over_products']:.2f}x |")
    if report['summaries']:
        lines += ["", "Memory across sequence lengths (saved for backward: least-squares fixed + "
                  "per-token parts; peak: its per-token slope)", "",
                  "| case | tp | impl | seqs | peak extra MiB | peak slope | saved fixed | "
                  "saved per token | target | value | met? |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for sm in report['summaries']:
            slope = sm['peak_slope_bytes_per_token']
            head = (f"| {sm['case']} | {sm['tp']} | {sm['impl']} | "
                    f"{','.join(map(str, sm['seqs']))} | "
                    f"{' / '.join(f'{p:.1f}' for p in sm['peak_mib'])} | "
                    f"{'n/a' if slope is None else f'{slope:.0f} B/token'} | "
                    f"{_fmt_bytes(sm['saved_fixed_bytes'])} | "
                    f"{_fmt_bytes(sm['saved_per_token_bytes'])} |")
            if not sm['targets']:
                lines.append(head + " | | |")
            for t in sm['targets']:
                lines.append(head + f" {t['target']} | {t['value']} | {_verdict(t['met'])} |")
    denormal = [r for r in report['rows'] if r.get('denormal_grad_fraction', 0) > 1e-3]
    if denormal:
        lines += ["", "WARNING: subnormal gradients (slow x86 GEMMs) in: " + ", ".join(
            f"{r['case']}/{r['seq']}/{r['impl']} ({r['denormal_grad_fraction']:.1%})"
            for r in denormal)]
    verdicts = [r['met'] for r in report['rows'] if r['met'] is not None]
    verdicts += [t['met'] for sm in report['summaries'] for t in sm['targets']]
    lines += ["", f"targets met: {sum(verdicts)}/{len(verdicts)}"]
    return "\n".join(lines)

