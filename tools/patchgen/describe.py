"""The pull-request description of a patch (``patches/<name>.md``), ready to paste.

Rendered from the committed patch text and its target's facts only, so that every figure in it
(lines added per Megatron file, the new files and their sizes, the per-tree edits) is the patch's
own, and from the two pages that hold the measured figures (docs/benchmarks.md, read row by
row) so that no number is written twice. ``make_patches.py`` writes it next to the patch;
``tests/test_patches.py`` fails when it is stale.
"""

import ast
import re
from pathlib import Path
from typing import Dict, List, Tuple

from .layout import REPO, TOUCHED, PatchError
from .package import PACKAGE_DIR, UPSTREAM_TESTS_PATH, field_names
from .targets import Target

BENCHMARKS = REPO / 'docs' / 'benchmarks.md'


def description_path(target: Target) -> Path:
    return target.patch_path.with_suffix('.md')


def _file_stats(patch_text: str) -> Dict[str, Tuple[bool, int, int]]:
    """``{path: (new file, lines added, lines removed)}`` of a patch."""
    stats: Dict[str, List] = {}
    current = None
    for line in patch_text.split('\n'):
        if line.startswith('diff --git a/'):
            current = line.split(' b/', 1)[1]
            stats[current] = [False, 0, 0]
        elif current is None:
            continue
        elif line.startswith('new file mode'):
            stats[current][0] = True
        elif line.startswith('+') and not line.startswith('+++ '):
            stats[current][1] += 1
        elif line.startswith('-') and not line.startswith('--- '):
            stats[current][2] += 1
    return {path: tuple(value) for path, value in stats.items()}


def _loss_names() -> List[Tuple[str, str]]:
    """``(name, first docstring line)`` of each loss class of the registry (losses.py)."""
    found = []
    for node in ast.parse((PACKAGE_DIR / 'losses.py').read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        name = next((ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)
                     and getattr(s.targets[0], 'id', None) == 'name'), None)
        if name is not None:
            doc = (ast.get_docstring(node) or '').split('\n\n')[0].replace('\n', ' ')
            doc = doc.removeprefix(f"``{name!r}``").lstrip(': ').replace('``', '`')
            found.append((name, doc))
    return found


def _benchmark_rows(impls: Tuple[str, ...]) -> List[str]:
    """The ``mtp`` rows of docs/benchmarks.md's first table for ``impls``, as they stand there."""
    rows = []
    for line in BENCHMARKS.read_text().splitlines():
        cells = [c.strip() for c in line.strip('|').split('|')]
        if len(cells) > 8 and cells[0] == 'mtp' and cells[4] in impls:
            rows.append(line)
    if not rows:
        raise PatchError(f'{BENCHMARKS.relative_to(REPO)}: no mtp rows for {impls}')
    return rows


def _benchmark_header() -> List[str]:
    """The run's line (date, loss code, mode, machine) and the table's header."""
    lines = BENCHMARKS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('| case | seq |'))
    run = next(line for line in reversed(lines[:start]) if re.match(r'\d{4}-\d{2}-\d{2}, ', line))
    return [run.rstrip(':') + '.', '', *lines[start : start + 2]]


def _where(facts) -> str:
    places = ([] if facts.process_mtp_loss_params is None else ['in `process_mtp_loss`']) + (
        ['inline in `GPTModel._postprocess`'] if facts.inline_gpt_loss else [])
    return ' and '.join(places)


def _tree_edits(target: Target) -> List[str]:
    facts = target.facts
    roll = ('`roll_tensor` on a list with the roll context (`sequence_roll_context`)'
            if facts.roll_tensor_params[:1] == ('tensors',) else '`roll_tensor` on one tensor')
    tracker = facts.tracker_api[0] if facts.tracker_api else '(none)'
    return [
        f'- the MTP loss is {_where(facts)} (each place gets the branch);',
        f'- `mtp_loss_inputs` rolls with {roll} and records per-depth metrics with '
        f'`MTPLossLoggingHelper.{tracker}`;',
        f'- `mtp_detach_heads` {"is passed on (`detach_output_weight`)" if facts.mtp_detach_heads else "is not a field of this tree"};',
        f'- the FLOP count uses `{facts.flops_tokens}` tokens.',
    ]


def _tests_section(tests: List[str], stats: Dict[str, Tuple[bool, int, int]]) -> List[str]:
    if tests:
        shipped = [
            ', '.join(f'`{p}` ({stats[p][1]} lines)' for p in tests) + ', in Megatron\'s style '
            '(`Utils.initialize_model_parallel`, run by torchrun): through `process_mtp_loss`, '
            "every loss and `'ce'` with `mtp_ce_chunked` against a float64 reference written "
            'from the equations (loss, draft-row and output-weight gradients, the logged '
            "per-depth values), `'ce'` running Megatron's own code, the fused weight gradient "
            "(`main_grad`), a `GPTModel` with a repeated MTP layer, and on two ranks TP=2 "
            'vocabulary-parallel and CP=2 zigzag, unpacked and packed. The Triton cases are '
            'marked CUDA-only; the rest runs on CPU with gloo '
            '(`tools/run_upstream_tests.py` in the megatron-mtp-tv repository).',
        ]
    else:
        shipped = [
            "None ship with this patch: this tree computes the MTP loss inline in "
            '`GPTModel._postprocess`, and the unit tests drive `process_mtp_loss`; '
            '`tools/verify_patched_tree.py` checks the patched tree on CPU.',
        ]
    return shipped + [
        '',
        'The megatron-mtp-tv repository holds the rest (`make test`, CPU, gloo), in plugin mode '
        'and against megatron-core 0.19.2 patched with this generator: CP contiguous, TP x CP, '
        'pipeline parallel, gradient-accumulation fusion with DDP and the distributed '
        'optimizer, bf16/fp16 precision, the argument guard. Not yet run on a GPU.',
    ]


def render_description(target: Target, patch_text: str) -> str:
    """The pull-request description of ``target``'s patch."""
    stats = _file_stats(patch_text)
    touched = [p for p in TOUCHED if p in stats]
    created = sorted(p for p, (is_new, _, _) in stats.items() if is_new)
    tests = [p for p in created if p.startswith(UPSTREAM_TESTS_PATH + '/')]
    new = [p for p in created if p not in tests]
    added_megatron = sum(stats[p][1] for p in touched)
    removed_megatron = sum(stats[p][2] for p in touched)
    new_lines = sum(stats[p][1] for p in new)
    fields = field_names()
    losses = _loss_names()
    out = [
        f'# MTP: acceptance-aware losses for MTP draft heads ({target.description})',
        '',
        '<!-- Generated by tools/make_patches.py from the patch and docs/benchmarks.md; do not '
        'edit by hand. -->',
        '',
        '## What and why',
        '',
        "MTP heads serve as speculative-decoding drafters. Under rejection sampling a drafted "
        'token is accepted with probability `sum_v min(p, q) = 1 - TV(p, q)` (`p` the main '
        "model's distribution, `q` the draft's), so total variation is the objective serving "
        'measures; the cross-entropy Megatron trains MTP heads with only bounds it. This adds '
        '`mtp_loss_type` to `TransformerConfig` (flag `--mtp-loss-type`); the target of every '
        "loss but `'ce'` is the main model's own distribution, detached, aligned per depth:",
        '',
        *[f'- `{name}`: {doc}' for name, doc in losses],
        '',
        "`'ce'` (the default) is Megatron's own code, unchanged (losses and gradients "
        'bit-identical). The fields, each with its docstring in `TransformerConfig`: '
        + ', '.join(f'`{f}`' for f in fields) + '.',
        '',
        '## Design',
        '',
        '- The loss runs in chunks of rows (`mtp_tv_chunk`, 0: automatic), each chunk projected '
        'once and its gradient formed in the forward pass, so memory is bounded by the chunk '
        'instead of `[s, b, V]` logits per depth; the target is read from the main logits '
        '`GPTModel._postprocess` computes anyway.',
        '- Vocabulary-parallel under TP (row statistics all-reduced), sequence parallel, context '
        'parallel (zigzag and contiguous: each rank fetches the `mtp_num_layers` halo rows its '
        'last positions need), packed sequences, repeated MTP layers, pipeline parallel.',
        '- `megatron/core/transformer/mtp_tv/` imports nothing from `multi_token_prediction.py`: '
        'the tree hands it its own `roll_tensor`, MTP tracker and `MTPLossAutoScaler` through '
        '`mtp_loss_inputs`, so imports run one way, at module top. The Triton row kernels are '
        '`megatron/core/fusions/fused_mtp_tv_rows.py` (torch on CPU, `mtp_tv_kernels`).',
        '- Validation in `TransformerConfig.__post_init__` (a `ValueError` naming the value and '
        "what is allowed); the training side (`megatron/training/mtp_tv_args.py`) makes each "
        "built model's config hold what the arguments ask for, or stops (never a silent `'ce'`).",
        '',
        "## Changes to Megatron's files",
        '',
        '| file | added | removed |',
        '| --- | --- | --- |',
        *[f'| `{p}` | +{stats[p][1]} | -{stats[p][2]} |' for p in touched],
        f'| **total** | **+{added_megatron}** | **-{removed_megatron}** |',
        '',
        f'New files ({len(new)}, {new_lines} lines):',
        '',
        *[f'- `{p}` ({stats[p][1]} lines)' for p in new],
        '',
        'What this tree needs, written into its own edits by the generator:',
        '',
        *_tree_edits(target),
        '',
        '## Tests',
        '',
        *_tests_section(tests, stats),
        '',
        '## Measured (CPU, fp32, against MTP cross-entropy in the same run)',
        '',
        'From docs/benchmarks.md (`tools/bench_loss.py --cases mtp`): `tv` at chunk 512, '
        '`tv-auto` at the automatic chunk, `-own` projecting its own target instead of reading '
        'the main logits, `G` the MTP depths.',
        '',
        *_benchmark_header(),
        *_benchmark_rows(('ce', 'tv', 'tv-auto', 'tv-own', 'e2e_tv', 'e2e_tv-own')),
        '',
        '## Untested',
        '',
        'Nothing has run on a GPU: the Triton kernels are tested under Triton\'s CPU interpreter '
        'only; MoE MTP layers, Megatron-FSDP without gradient-accumulation fusion, '
        '`full_iteration` CUDA graphs and Transformer Engine\'s fused output-layer backward wait '
        'for one.',
        '',
    ]
    text = '\n'.join(out)
    if re.search(r'[ \t]+$', text, re.M):
        raise PatchError('description has trailing whitespace')
    return text
