"""The targets each row is held to (printed PASS/MISS as measured, never adjusted), the memory
summaries across sequence lengths, the matrix-product floors, and the Markdown report.
"""

from typing import Dict, List, Optional

from .memory import MiB, linear_fit
from .packed import render_packed

FUSED_TIME_TARGET = 1.35  # 'loss' rows: TV fwd+bwd vs linear + CE
#: 'mtp' rows: fused 'tv' (explicit or automatic chunk), 'kl', 'lk' vs Megatron's MTP CE path,
#: at these token counts (elsewhere only their peak is held to CE's).
MTP_TIME_TARGET = 1.10
MTP_TIME_TARGET_SEQS = (4096, 8192)
E2E_TIME_TARGET = 1.0  # 'mtp' rows: 'e2e_tv' with E2E_TARGET_DEPTH depths vs as many CE depths
E2E_TARGET_DEPTH = 3
NLA_TIME_TARGET = 1.4  # 'mtp' rows: fused 'nla' vs CE (peak <= CE's too)
STEP_TIME_TARGET = 1.03  # 'step' rows: GPTModel._postprocess with a TV loss vs with 'ce'
SAVED_FRACTION_TARGET = 1 / 8  # TV saved bytes per token vs CE's
TP_RATIO_TARGET = 1.25  # (TV/CE at TP=2) / (TV/CE at TP=1)
CE_TIME_TARGET = 1.05  # 'ce' rows: mtp_ce_chunked vs Megatron's MTP cross-entropy
CE_LOGITS_PEAK_TARGET = 0.5  # 'ce' rows where CE's logits dominate its peak: of CE's peak
FLAT_HIDDEN_TENSORS = 4  # "flat": peak grows by at most this many [s, b, h] fp32 tensors/token
#: "Peak at most CE's" allows this much O(1) state (a few scalars: the low-precision gradient
#: scale, the micro-batch's acceptance statistics waiting for the logging step), never a tensor
#: that grows with the tokens; tests/test_memory_bound.py holds the loss to the same bound.
PEAK_SLACK_BYTES = 4096

#: [tokens x h x V/tp] matrix products per head and token in a training step: the logits, the
#: hidden-state gradient and the weight gradient.
PRODUCTS_PER_HEAD = 3


def step_products(depths: int, target_products: int = 0,
                  per_head: int = PRODUCTS_PER_HEAD) -> int:
    """[tokens x h x V/tp] matrix products per token of a training step past the decoder.

    ``per_head`` for each of the ``depths`` MTP heads and for the main head, plus
    ``target_products``: the TV losses' own projection of their target rows (1: one per chunk
    pass, shared by all depths), 0 for CE and for TV losses that take the target from the main
    head's logits.
    """
    return per_head * (depths + 1) + target_products


def products_floor(depths: int, target_products: int,
                   per_head: int = PRODUCTS_PER_HEAD) -> float:
    """A step's matrix products over CE's step (``target_products=0``): the time ratio no
    elementwise work can beat. ``products_floor(1, 1)`` = 7/6 (own target projection, one
    depth); ``products_floor(G, 0)`` = 1 (target from the main logits)."""
    return step_products(depths, target_products, per_head) / step_products(depths, 0, per_head)


#: What a TV loss adds to CE's products, by where its target comes from (cases.tv_target_source).
TARGET_PRODUCTS = {'own projection': 1, 'main logits': 0}


def _verdict(ok: Optional[bool]) -> str:
    return '-' if ok is None else ('PASS' if ok else 'MISS')


def _peak_ok(r: dict, ce: dict) -> bool:
    """Whether row ``r`` peaks at most at its CE row's (up to O(1) state, PEAK_SLACK_BYTES)."""
    return r['peak_mib'] * MiB <= ce['peak_mib'] * MiB + PEAK_SLACK_BYTES


def _mtp_time_target(r: dict):
    """The time limit of a fused 'mtp' row, or ``(None, where it applies)``."""
    impl = r['impl'][:-len('-auto')] if r['impl'].endswith('-auto') else r['impl']
    if impl == 'nla':
        return NLA_TIME_TARGET, ''
    if impl == 'e2e_tv':
        if r['G'] == E2E_TARGET_DEPTH:
            return E2E_TIME_TARGET, ''
        return None, f"{E2E_TIME_TARGET}x with {E2E_TARGET_DEPTH} depths only"
    if r['seq'] in MTP_TIME_TARGET_SEQS:
        return MTP_TIME_TARGET, ''
    seqs = ', '.join(map(str, MTP_TIME_TARGET_SEQS))
    return None, f"{MTP_TIME_TARGET}x at {seqs} tokens only"


def _attach_step_floor(r: dict) -> None:
    """A 'step' row's products floor: the one of the measured code, and both variants."""
    G = r['G']
    r['floor_own'] = products_floor(G, TARGET_PRODUCTS['own projection'])
    r['floor_main'] = products_floor(G, TARGET_PRODUCTS['main logits'])
    extra = 0 if r['impl'] == 'ce' else TARGET_PRODUCTS[r['target_source']]
    r['products'] = step_products(G, extra)
    r['ce_products'] = step_products(G, 0)
    r['floor'] = products_floor(G, extra)


def apply_targets(rows: List[dict], args) -> List[dict]:
    """Attach each row's target and verdict; return the per-impl summaries (memory, saved)."""
    by_key = {(r['case'], r['seq'], r['tp'], r['G'], r['impl']): r for r in rows}
    by_key.update({(r['case'], r['seq'], r['tp'], r['G'], r['impl'], r['hidden']): r
                   for r in rows if r['case'] == 'wide'})
    by_key.update({(r['case'], r['seq'], r['tp'], r['G'], r['impl'], r['hidden'], r['vocab']): r
                   for r in rows if r['case'] == 'ce'})
    for r in rows:
        r['target'], r['met'] = '', None
        if r['case'] == 'step':
            _attach_step_floor(r)
        if r['impl'] == 'ce':
            r['target'] = 'baseline'
            continue
        if r['impl'].endswith('-products'):
            r['target'] = 'floor (see below)'
            continue
        if r['case'] == 'loss':
            r['target'] = f"time <= {FUSED_TIME_TARGET}x"
            r['met'] = r['ratio'] <= FUSED_TIME_TARGET
        elif r['case'] == 'mtp':
            if r['impl'].endswith('-own'):  # the own-target fallback
                r['target'] = 'reference'
                continue
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce')]
            peak_ok = _peak_ok(r, ce)
            limit, where = _mtp_time_target(r)
            if limit is None:
                r['target'] = f"peak <= CE's (time <= {where})"
                r['met'] = peak_ok
            else:
                r['target'] = f"time <= {limit}x, peak <= CE's"
                r['met'] = r['ratio'] <= limit and peak_ok
        elif r['case'] == 'step':
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce')]
            r['target'] = f"time <= {STEP_TIME_TARGET}x, peak <= CE's"
            r['met'] = r['ratio'] <= STEP_TIME_TARGET and _peak_ok(r, ce)
        elif r['case'] == 'wide':
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce', r['hidden'])]
            r['target'] = "peak <= CE's"
            r['met'] = _peak_ok(r, ce)
        elif r['case'] == 'ce':
            ce = by_key[(r['case'], r['seq'], r['tp'], r['G'], 'ce', r['hidden'], r['vocab'])]
            r['peak_ratio'] = r['peak_mib'] / ce['peak_mib']
            if logits_dominate(r['G'], r['seq'], r['hidden']):
                r['target'] = f"time <= {CE_TIME_TARGET}x, peak <= {CE_LOGITS_PEAK_TARGET:g}x CE's"
                peak_ok = r['peak_ratio'] <= CE_LOGITS_PEAK_TARGET
            else:
                r['target'] = f"time <= {CE_TIME_TARGET}x, peak <= CE's"
                peak_ok = _peak_ok(r, ce)
            r['met'] = r['ratio'] <= CE_TIME_TARGET and peak_ok
        elif r['case'] == 'packed' and r['sequences'] > 1:
            # Packing moves tokens between sequences: the chunks (two collectives each) are the
            # tokens'. (A chunk holding halo rows projects them: one small product more.)
            one = next(o for o in rows if o['case'] == 'packed' and o['impl'] == 'tv 1 sequence')
            r['target'] = f"collectives as 1 sequence's ({one['collectives']})"
            r['met'] = r['collectives'] == one['collectives']
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


def _peak(r: dict) -> str:
    if r['tp'] > 1:
        return "/".join(f"{p:.1f}" for p in r['peak_mib_per_rank']) + " per rank"
    return f"{r['peak_mib']:.1f} ({r['fwd_peak_mib']:.1f}/{r['bwd_peak_mib']:.1f})"


def _spread(r: dict) -> str:
    return f"{min(r['times_s']):.2f}-{max(r['times_s']):.2f}"


def attach_round_ratios(rows: List[dict]) -> None:
    """Each row's per-round ratios (``round_ratios``), from its ``times_s`` and its CE row's,
    round by round: for a fresh run and for a saved one alike. A run saved before the paired
    ratio (no ``ratio_of_medians``: its ratio is of medians) gets none."""
    def key(r):
        return (r['case'], r['seq'], r['tp'], r['G'], r.get('hidden'))

    baselines = {key(r): r['times_s'] for r in rows if r['impl'] == 'ce'}
    for r in rows:
        if 'ratio_of_medians' not in r:
            continue
        base = baselines.get(key(r))
        paired = r['impl'] != 'ce' and base is not None and len(base) == len(r['times_s'])
        r['round_ratios'] = [t / b for t, b in zip(r['times_s'], base)] if paired else None


def _ratio(r: dict) -> str:
    """The ratio vs CE, with the range of its per-round ratios when there are several rounds
    (how far one round's verdict could move; :func:`attach_round_ratios`)."""
    cell = f"{r['ratio']:.2f}x"
    rounds = r.get('round_ratios') or []
    if len(rounds) > 1:
        cell += f" ({min(rounds):.2f}-{max(rounds):.2f})"
    return cell


def _render_step(rows: List[dict], env: dict, args: dict) -> List[str]:
    source = rows[0]['target_source']
    package = env.get('loss_package', 'megatron.mtp_tv')
    G = sorted({r['G'] for r in rows})
    examples = ', '.join(f"G={g}: {products_floor(g, 1):.2f}x" for g in G)
    lines = [
        "", "## step: `GPTModel._postprocess` fwd+bwd", "",
        f"What a user pays past the decoder: a real megatron-core GPTModel (hidden {args['hidden']}, "
        f"vocab {args['vocab']}, `mtp_num_layers` G = {', '.join(map(str, G))}, local spec, rope, "
        "untied output layer) runs `_postprocess` on the decoder output, a leaf `[s, 1, h]`: the "
        "MTP layer(s), the MTP loss, the main logits and the main CE, forward and backward. One "
        "model serves every case (`mtp_loss_type` switched between them, same weights); "
        "`mtp_tv_chunk=0` (automatic); output weight std 2.5/sqrt(h). The MTP layers' attention "
        "is megatron's local `DotProductAttention` (no Transformer Engine on a CPU): its "
        "`[heads, s, s]` scores are the same in every case and part of every peak. "
        f"Measured: **{rows[0]['mode']} mode**, TV target from **{source}** "
        f"(`{package}.mtp_loss.attach_mtp_tv_loss` {'present' if source == 'main logits' else 'absent'}).",
        "",
        "Products floor: `[tokens x h x V/tp]` matrix products per token, as a ratio vs CE's "
        "`3G + 3` (3 per MTP depth, 3 for the main head). A TV loss that projects its own target "
        f"rows needs `3G + 4`, one more per chunk pass ({examples}); one that takes its target from "
        "the main logits needs `3G + 3` (1.00x). The package is being changed to reuse the main "
        f"logits; the code measured here uses **{source}**, whose floor is the 'products floor' "
        "column.", "",
        "| seq | G | impl | time (s) | min-max | ratio vs CE | products floor | "
        "floor: own projection / main logits | peak extra MiB (fwd/bwd) | target | met? |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = f"{r['floor']:.2f}x ({r['products']}/{r['ce_products']}"
        floor += ")" if r['impl'] == 'ce' else f", {r['target_source']})"
        lines.append(
            f"| {r['seq']} | {r['G']} | {r['impl']} | {r['time_s']:.3f} | {_spread(r)} | "
            f"{_ratio(r)} | {floor} | {r['floor_own']:.2f}x / {r['floor_main']:.2f}x | "
            f"{_peak(r)} | {r['target']} | {_verdict(r['met'])} |")
    return lines


def logits_dominate(depths: int, tokens: int, hidden: int) -> bool:
    """Whether Megatron CE's peak is its logits, as the ``ce`` target counts it: the
    ``depths * tokens`` rows of ``V/tp`` it keeps for backward at least ``depths + 1`` times the
    ``[V/tp, h]`` weight gradient. There the automatic chunk holds ``mtp_ce_chunked`` to half of
    CE's peak (``megatron.mtp_tv.linear_tv.auto_chunk_tokens``)."""
    return depths * tokens >= (depths + 1) * hidden


def _render_ce(rows: List[dict]) -> List[str]:
    lines = [
        "", "## ce: Megatron's MTP cross-entropy, and the same loss chunked (`mtp_ce_chunked`)", "",
        "Megatron's `process_mtp_loss` with `mtp_loss_type='ce'`, then with `mtp_ce_chunked=True` "
        "(the automatic chunk, per row below); output weight std 2.5/sqrt(h). Shapes where CE's "
        "logits dominate its peak (`G x tokens >= (G + 1) h`) are held to half of CE's peak.", "",
        "| G | hidden | V/tp | tokens | impl | chunk | time (s) | min-max | ratio vs CE | "
        "peak extra MiB (fwd/bwd) | peak / CE | target | met? |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chunk = '-' if r['impl'] == 'ce' else str(r['auto_chunk'])
        peak_ratio = f"{r['peak_ratio']:.2f}" if 'peak_ratio' in r else '1.00'
        lines.append(
            f"| {r['G']} | {r['hidden']} | {r['vocab']} | {r['seq']} | {r['impl']} | {chunk} | "
            f"{r['time_s']:.3f} | {_spread(r)} | {_ratio(r)} | {_peak(r)} | {peak_ratio} | "
            f"{r['target']} | {_verdict(r['met'])} |")
    return lines


def _render_wide(rows: List[dict], args: dict) -> List[str]:
    hidden = ', '.join(str(h) for h in sorted({r['hidden'] for r in rows}))
    lines = [
        "", "## wide: the MTP path at large hidden sizes", "",
        f"Megatron's `process_mtp_loss` as in the `mtp` rows (one depth, `mtp_tv_chunk=0`: the "
        f"automatic chunk, per row below) at hidden {hidden}, V/tp {rows[0]['vocab']}; output "
        "weight std 2.5/sqrt(h) (logits std ~2.5 at every h). Time is reported, not held to a "
        "target; the target is the peak.", "",
        "| hidden | seq | impl | chunk | time (s) | min-max | ratio vs CE | peak extra MiB (fwd/bwd) "
        "| saved B/token | target | met? |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chunk = '-' if r['impl'] == 'ce' or r.get('auto_chunk') is None else str(r['auto_chunk'])
        lines.append(
            f"| {r['hidden']} | {r['seq']} | {r['impl']} | {chunk} | {r['time_s']:.3f} | "
            f"{_spread(r)} | {_ratio(r)} | {_peak(r)} | {r['saved_per_token']:.0f} | "
            f"{r['target']} | {_verdict(r['met'])} |")
    return lines


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
    # Runs saved before the paired ratio (re-rendered with --report) have the ratio of medians.
    paired = all('ratio_of_medians' in r for r in report['rows'])
    lines[-1] += ("; ratio vs CE: the median over rounds of each round's time over CE's in the "
                  "same round (the cases run interleaved), in brackets the range of those "
                  "per-round ratios" if paired else
                  "; ratio vs CE: median time over CE's median time")
    rows = [r for r in report['rows'] if r['case'] in ('loss', 'mtp', 'tp')]
    if rows:
        lines += ["", "| case | seq | tp | G | impl | time (s) | min-max | ratio vs CE | peak extra "
                  "MiB (fwd/bwd) | saved B/token | target | met? |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = _ratio(r)
        if 'ratio_vs_tp1' in r:
            ratio += f" (TP1 {r['tp1_ratio']:.2f}x; {r['ratio_vs_tp1']:.2f} of it)"
        lines.append(
            f"| {r['case']} | {r['seq']} | {r['tp']} | {r['G']} | {r['impl']} | {r['time_s']:.3f} | "
            f"{_spread(r)} | {ratio} | {_peak(r)} | "
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
    step = [r for r in report['rows'] if r['case'] == 'step']
    if step:
        lines += _render_step(step, env, report['args'])
    wide = [r for r in report['rows'] if r['case'] == 'wide']
    if wide:
        lines += _render_wide(wide, report['args'])
    ce_rows = [r for r in report['rows'] if r['case'] == 'ce']
    if ce_rows:
        lines += _render_ce(ce_rows)
    packed = [r for r in report['rows'] if r['case'] == 'packed']
    if packed:
        lines += render_packed(packed)
    denormal = [r for r in report['rows'] if r.get('denormal_grad_fraction', 0) > 1e-3]
    if denormal:
        lines += ["", "WARNING: subnormal gradients (slow x86 GEMMs) in: " + ", ".join(
            f"{r['case']}/{'h=%d/' % r['hidden'] if 'hidden' in r else ''}{r['seq']}/{r['impl']} "
            f"({r['denormal_grad_fraction']:.1%})" for r in denormal)]
    verdicts = [r['met'] for r in report['rows'] if r['met'] is not None]
    verdicts += [t['met'] for sm in report['summaries'] for t in sm['targets']]
    lines += ["", f"targets met: {sum(verdicts)}/{len(verdicts)}"]
    return "\n".join(lines)
