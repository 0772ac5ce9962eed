#!/usr/bin/env python3
"""Generate the ``git apply`` patches in ``patches/`` from the package source.

One command regenerates every patch whose pristine tree it can reach::

    python tools/make_patches.py                                   # all (git targets: offline update)
    python tools/make_patches.py --megatron-lm ~/src/Megatron-LM   # git targets from a clone (repeatable)
    python tools/make_patches.py --check [--megatron-lm ...]       # exit 1 if a patch is stale
    python tools/make_patches.py --tree ~/Megatron-LM [-o x.patch] # a patch for any checkout's HEAD

What a patch does to a Megatron tree (the same changes :mod:`megatron.mtp_tv.plugin` makes at run
time, written into the source so the feature is native there):

* ``megatron/core/transformer/mtp_tv/``: every module of ``megatron/mtp_tv`` except the
  plugin-only ones (:data:`NOT_SHIPPED`), byte for byte: the package imports itself relatively,
  so the same files work under both names;
* ``transformer_config.py``: the annotated fields between ``# BEGIN MTP_TV FIELDS`` and
  ``# END MTP_TV FIELDS`` of ``megatron/mtp_tv/config.py``, copied verbatim (docstrings included,
  so the tree's ``ArgumentGroupFactory`` makes ``--mtp-loss-type`` & co.) after the tree's last
  ``mtp_*`` field, and ``validate_mtp_loss_config(self)`` at the end of ``__post_init__``;
* ``multi_token_prediction.py``: ``process_mtp_loss`` (where the tree has one) hands every loss
  type but ``'ce'`` (alias ``'cross_entropy'``, upstream's name) to ``process_mtp_tv_loss`` and
  keeps its own code for those;
  ``MTPLossLoggingHelper.track_mtp_metrics`` logs the acceptance metrics first;
* ``gpt_model.py`` of trees whose MTP loss is inline in ``GPTModel._postprocess`` (radixark
  ``miles-main``): the same dispatch there, fed exactly what the inline ``'ce'`` code uses.

Pristine sources, always pinned: megatron-core 0.19.2 by the sha256 of the files the patch
touches (read from the installed distribution when it is that release, else from the registry
wheel, itself pinned by sha256); the git targets (radixark/Megatron-LM forks, NVIDIA/Megatron-LM
main and dev) by commit, read with ``git show`` from any clone holding it. No copy of Megatron
code is kept in this repository (the patches' context lines aside).

``--tree``: the facts (:class:`Facts`) are derived from the checkout itself (its HEAD; or the
files on disk of a tree that is not a git checkout), every one is checked against what the
package knows (the literals of ``megatron/mtp_tv/plugin.py``, the checks ``install()`` makes),
and the patch is checked with ``git apply --check`` there; an unknown fact is refused by name.

Staleness without the fork (``--check`` and ``tests/test_patches.py``): every patch is split
into its files; the new package files must equal the package source, and the lines each patch
adds to (and removes from) Megatron files must equal what the generator renders for that tree
from the small record of facts kept per target in :data:`TARGETS` (which parameters its
``process_mtp_loss`` takes, the inline condition it replaces). Regenerating from the fork
re-derives those facts and fails if they no longer match. Without the fork, a stale fork patch
is updated in place (:func:`regenerate_offline`): same bytes as a regeneration from the fork.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import io
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO / 'megatron' / 'mtp_tv'
PATCH_DIR = REPO / 'patches'

#: Where the package lives in a patched tree (next to multi_token_prediction.py).
TARGET_PACKAGE = 'megatron/core/transformer/mtp_tv'
TARGET_MODULE = TARGET_PACKAGE.replace('/', '.')
#: Package files that only make sense for the plugin (or for tests) and are not shipped.
NOT_SHIPPED = ('launch.py', 'startup_hook.py')
NOT_SHIPPED_DIRS = ('testing',)

CONFIG_FILE = 'megatron/core/transformer/transformer_config.py'
MTP_FILE = 'megatron/core/transformer/multi_token_prediction.py'
GPT_FILE = 'megatron/core/models/gpt/gpt_model.py'
TOUCHED = (CONFIG_FILE, MTP_FILE, GPT_FILE)

#: The condition of the inline MTP loss branch in radixark miles-main's GPTModel._postprocess.
INLINE_CONDITION = "self.config.mtp_num_layers and mtp_kwargs.get('mtp_labels', None) is not None"

WHEEL_REQUIREMENT = 'megatron-core==0.19.2'
WHEEL_NAME = 'megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl'
WHEEL_SHA256 = '8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5'


def cache_dir() -> Path:
    """This project's cache folder (the wheel, the patched tree), created if it does not exist.

    ``$MTP_TV_CACHE`` if set and not empty, else ``~/.cache/megatron-mtp-tv``. Read at each call,
    not at import, so that a caller (CI, a test) can point it elsewhere after importing this
    module; created here because on a fresh machine nothing else creates it and every writer
    (``pip download -d``, ``tempfile.mkdtemp(dir=...)``) needs it to exist.
    """
    path = Path(os.environ.get('MTP_TV_CACHE') or Path.home() / '.cache' / 'megatron-mtp-tv')
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Facts:
    """What the rendered edits depend on in a pristine tree (checked when it is regenerated)."""

    process_mtp_loss_params: Optional[Tuple[str, ...]]
    """Parameters of ``process_mtp_loss`` (None: the tree has no such function)."""
    inline_gpt_loss: bool
    """Whether ``GPTModel._postprocess`` computes the MTP loss inline (radixark miles-main)."""
    roll_tensor_params: Tuple[str, ...]
    """Parameters of ``roll_tensor`` (its form: one tensor, or a list of them)."""
    tracker_api: Tuple[str, ...]
    """``(method, *parameters)`` of the ``MTPLossLoggingHelper`` method the metrics record the
    per-depth loss with (``save_metrics_to_tracker``, else ``save_loss_to_tracker``)."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    facts: Facts
    file_sha256: Dict[str, str] = field(default_factory=dict)  # wheel targets
    commit: Optional[str] = None  # git targets
    repo: str = 'radixark/Megatron-LM'  # where ``commit`` is (git targets)
    patch_file: Optional[Path] = None  # default: patches/<name>.patch

    @property
    def patch_path(self) -> Path:
        return self.patch_file or PATCH_DIR / f'{self.name}.patch'


_UPSTREAM_PARAMS = (
    'hidden_states', 'labels', 'loss_mask', 'output_layer', 'output_weight',
    'runtime_gather_output', 'is_training', 'compute_language_model_loss', 'config', 'cp_group',
    'tp_group', 'packed_seq_params', 'scale_logits_fn', 'input_ids',
)
_MILES_MAIN_PARAMS = (
    'hidden_states', 'labels', 'loss_mask', 'output_layer', 'output_weight',
    'runtime_gather_output', 'is_training', 'compute_language_model_loss', 'config', 'cp_group',
    'packed_seq_params',
)
_ROLL_ONE = ('tensor', 'shifts', 'dims', 'cp_group', 'packed_seq_params')
_ROLL_LIST = (
    'tensors', 'shifts', 'dims', 'cp_group', 'packed_seq_params', 'fill_values', 'roll_context',
    'sequence_fields', 'roll_depth',
)
_TRACKER_METRICS = (
    'save_metrics_to_tracker', 'loss', 'correct', 'total', 'layer_number', 'num_layers',
    'reduce_group', 'avg_group',
)
_TRACKER_LOSS = ('save_loss_to_tracker', 'loss', 'layer_number', 'num_layers', 'reduce_group',
                 'avg_group')

TARGETS: Dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            name='megatron-core-0.19.2',
            description='megatron-core 0.19.2 (the release on the registry; Megatron-LM core_r0.19)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS, inline_gpt_loss=False,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_METRICS,
            ),
            file_sha256={
                CONFIG_FILE: '3b0843377e6c827b1e2e389edec30392d3c288ab5c58d168167d0c85a26949ee',
                MTP_FILE: '3261d63df93a77493678265d4eb55cac0fc918901537a4076460b2b09d11e5ac',
                GPT_FILE: 'f42663bf44c39273ae4febfac9ce9e567c5d4b31bf60aa3c6df99372eff45cc1',
            },
        ),
        Target(
            name='miles-main-36ceb4fc0',
            description='radixark/Megatron-LM miles-main at 36ceb4fc0 (base of the seed change)',
            facts=Facts(
                process_mtp_loss_params=None, inline_gpt_loss=True,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_LOSS,
            ),
            commit='36ceb4fc0462c49e15fd80fd3ef08a852a0672f5',
        ),
        Target(
            name='miles-main-2e64d788b',
            description='radixark/Megatron-LM miles-main at 2e64d788b (branch head when generated)',
            facts=Facts(
                process_mtp_loss_params=_MILES_MAIN_PARAMS, inline_gpt_loss=True,
                roll_tensor_params=_ROLL_ONE, tracker_api=_TRACKER_LOSS,
            ),
            commit='2e64d788b67fe8155774200c87606e1e449c494b',
        ),
        Target(
            name='miles-main-20260819-235952df6',
            description='radixark/Megatron-LM miles-main-20260819 at 235952df6 (branch head when '
            'generated)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS + ('sequence_roll_context',),
                inline_gpt_loss=False, roll_tensor_params=_ROLL_LIST, tracker_api=_TRACKER_METRICS,
            ),
            commit='235952df607b3820716e5e67728a5ab470ca33ae',
        ),
        Target(
            name='nvidia-main-d98e8a64d',
            description='NVIDIA/Megatron-LM main at d98e8a64d (branch head when generated; '
            'package_info 0.20.0)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS, inline_gpt_loss=False,
                roll_tensor_params=_ROLL_ONE + ('return_sum',), tracker_api=_TRACKER_METRICS,
            ),
            commit='d98e8a64ddf34856e74b24714e3bedb2f5a39553',
            repo='NVIDIA/Megatron-LM',
        ),
        Target(
            name='nvidia-dev-d48bd6be0',
            description='NVIDIA/Megatron-LM dev at d48bd6be0 (branch head when generated)',
            facts=Facts(
                process_mtp_loss_params=_UPSTREAM_PARAMS + ('sequence_roll_context',),
                inline_gpt_loss=False, roll_tensor_params=_ROLL_LIST, tracker_api=_TRACKER_METRICS,
            ),
            commit='d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1',
            repo='NVIDIA/Megatron-LM',
        ),
    )
}


class PatchError(RuntimeError):
    """A pristine tree does not look like the generator expects."""


# ----------------------------------------------------------------------------------------------
# The package side
# ----------------------------------------------------------------------------------------------


def shipped_modules() -> Dict[str, str]:
    """``{relative path in the package: source}`` of the modules a patch carries."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob('*.py')):
        rel = path.relative_to(PACKAGE_DIR)
        if rel.parts[0] in NOT_SHIPPED_DIRS or rel.name in NOT_SHIPPED or '__pycache__' in rel.parts:
            continue
        text = path.read_text()
        _check_relocatable(rel.as_posix(), text)
        out[rel.as_posix()] = text
    return out


def _check_relocatable(rel: str, text: str) -> None:
    """The shipped modules must import each other relatively (they move in patch mode)."""
    if text and not text.endswith('\n'):
        raise PatchError(f'megatron/mtp_tv/{rel} does not end with a newline')
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name == 'megatron.mtp_tv' or name.startswith('megatron.mtp_tv.'):
                raise PatchError(
                    f'megatron/mtp_tv/{rel}:{node.lineno} imports {name} absolutely; shipped '
                    f'modules must use relative imports so that the patch can carry them to '
                    f'{TARGET_MODULE}.'
                )


def fields_block() -> str:
    """The field definitions of ``MTPLossConfig``, as they appear in config.py (4-space body)."""
    text = (PACKAGE_DIR / 'config.py').read_text()
    match = re.search(r'^# BEGIN MTP_TV FIELDS.*?\n(.*?)^# END MTP_TV FIELDS', text, re.S | re.M)
    if not match:
        raise PatchError('megatron/mtp_tv/config.py has no BEGIN/END MTP_TV FIELDS block')
    block = match.group(1)
    cls = next(n for n in ast.parse(block).body if isinstance(n, ast.ClassDef))
    body = cls.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the class docstring
    lines = block.splitlines()
    first = body[0].lineno - 1
    return '\n'.join(lines[first : cls.end_lineno]).rstrip() + '\n'


def field_names() -> Tuple[str, ...]:
    """Every field of ``MTPLossConfig``, in order (what a patch adds to ``TransformerConfig``)."""
    body = ast.parse(textwrap.dedent(fields_block())).body
    return tuple(n.target.id for n in body if isinstance(n, ast.AnnAssign))


def _tv_loss_function() -> ast.FunctionDef:
    tree = ast.parse((PACKAGE_DIR / 'mtp_loss.py').read_text())
    return next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == 'process_mtp_tv_loss'
    )


def tv_loss_params() -> Tuple[str, ...]:
    fn = _tv_loss_function()
    return tuple(a.arg for a in fn.args.args + fn.args.kwonlyargs)


def tv_loss_required_params() -> Tuple[str, ...]:
    """Parameters of ``process_mtp_tv_loss`` without a default."""
    fn = _tv_loss_function()
    positional = fn.args.args
    required = positional[: len(positional) - len(fn.args.defaults)]
    required += [a for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is None]
    return tuple(a.arg for a in required)


def _module_level(path: Path, names: Sequence[str]) -> Dict[str, ast.stmt]:
    """The top-level assignments and functions of ``path`` named ``names``."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], 'id', None)
        else:
            name = getattr(node, 'name', None) if isinstance(node, ast.FunctionDef) else None
        if name in names:
            found[name] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise PatchError(f'{path.relative_to(REPO)} no longer defines {missing}')
    return found


def cross_entropy_names() -> Tuple[str, ...]:
    """``config.CROSS_ENTROPY_NAMES``: the loss types that keep Megatron's own CE code."""
    node = _module_level(PACKAGE_DIR / 'config.py', ['CROSS_ENTROPY_NAMES'])['CROSS_ENTROPY_NAMES']
    return tuple(ast.literal_eval(node.value))


#: What megatron/mtp_tv/plugin.py knows of Megatron's MTP code, and its checks of it: the same
#: literals and functions install() uses, read from the source (the generator does not import
#: the package, which imports Megatron).
_PLUGIN_CHECKS = (
    'ROLL_TENSOR_FORMS', 'TRACKER_APIS', '_TV_ONLY_PARAMS', 'roll_tensor_problem',
    'tracker_problem', 'process_mtp_loss_problem',
)


def plugin_checks() -> Dict[str, object]:
    nodes = _module_level(PACKAGE_DIR / 'plugin.py', _PLUGIN_CHECKS)
    namespace: Dict[str, object] = {'Dict': Dict, 'Tuple': Tuple, 'Sequence': Sequence}
    module = ast.Module(body=[nodes[n] for n in _PLUGIN_CHECKS], type_ignores=[])
    exec(compile(module, str(PACKAGE_DIR / 'plugin.py'), 'exec'), namespace)
    return namespace


# ----------------------------------------------------------------------------------------------
# Rendered snippets (depend on the package source and on a target's Facts only)
# ----------------------------------------------------------------------------------------------

_HEADER = '# mtp_tv: generated by megatron-mtp-tv tools/make_patches.py from megatron/mtp_tv.'


def snippet_fields() -> List[str]:
    return [
        '',
        '    # MTP loss settings (megatron/core/transformer/mtp_tv/config.py, validated in',
        '    # __post_init__).',
        '',
    ] + fields_block().rstrip('\n').split('\n')


def snippet_config_import() -> List[str]:
    return [f'from {TARGET_MODULE}.config import validate_mtp_loss_config']


def snippet_validate() -> List[str]:
    return [
        '',
        '        # MTP loss settings (the mtp_tv fields above).',
        '        validate_mtp_loss_config(self)',
    ]


def _ce() -> str:
    """The tuple of cross-entropy names as it appears in the rendered code."""
    return repr(cross_entropy_names())


def snippet_process_mtp_loss(params: Sequence[str]) -> List[str]:
    tv = tv_loss_params()
    passed = [p for p in params if p in tv]
    kwargs = [f'            {p}={p},' for p in passed]
    return [
        f'    {_HEADER}',
        "    # Loss types other than 'ce' (alias 'cross_entropy') go to process_mtp_tv_loss; the",
        "    # code after this block is the 'ce' loss, unchanged (mtp_log_acceptance adds the",
        '    # acceptance metrics to it).',
        f'    if config.mtp_loss_type not in {_ce()} or (',
        '        config.mtp_log_acceptance and is_training',
        '    ):',
        '        # Imported here: the mtp_tv package imports this module.',
        f'        from {TARGET_MODULE}.mtp_loss import process_mtp_tv_loss',
        '',
        '        mtp_tv_kwargs = dict(',
        *kwargs,
        '        )',
        f'        if config.mtp_loss_type not in {_ce()}:',
        '            return process_mtp_tv_loss(**mtp_tv_kwargs)',
        '        with torch.no_grad():',
        '            process_mtp_tv_loss(**mtp_tv_kwargs, metrics_only=True)',
        '',
    ]


def snippet_track_metrics() -> List[str]:
    return [
        f'        {_HEADER}',
        "        # Acceptance metrics of every mtp_loss_type but 'ce', and of mtp_log_acceptance.",
        f'        from {TARGET_MODULE}.metrics import log_acceptance_metrics',
        '',
        '        log_acceptance_metrics(iteration, writer, wandb_writer, total_loss_dict)',
        '',
    ]


def snippet_inline_gpt() -> Tuple[List[str], List[str]]:
    """(lines inserted before the inline branch, lines replacing its ``if`` line)."""
    before = [
        f'        {_HEADER}',
        "        # Loss types other than 'ce' (alias 'cross_entropy') go to process_mtp_tv_loss, fed",
        "        # what the 'ce' branch below uses: the tokens in mtp_kwargs['mtp_labels'] rolled once",
        '        # into labels together with the loss mask, and a detached output layer (the MTP',
        '        # loss does not train it).',
        '        mtp_tv = (',
        '            self.config.mtp_num_layers',
        "            and mtp_kwargs.get('mtp_labels', None) is not None",
        '            and (',
        f'                self.config.mtp_loss_type not in {_ce()}',
        '                or (self.config.mtp_log_acceptance and self.training)',
        '            )',
        '        )',
        '        if mtp_tv:',
        '            # Imported here: the mtp_tv package imports multi_token_prediction.',
        f'            from {TARGET_MODULE}.mtp_loss import process_mtp_tv_loss',
        '',
        '            mtp_tv_kwargs = dict(',
        '                hidden_states=hidden_states,',
        '                labels=None,',
        "                input_ids=mtp_kwargs['mtp_labels'],",
        '                loss_mask=loss_mask,',
        '                output_layer=self.output_layer,',
        '                output_weight=(',
        '                    output_weight if output_weight is not None else self.output_layer.weight',
        '                ).detach(),',
        '                runtime_gather_output=runtime_gather_output,',
        '                is_training=self.training,',
        '                compute_language_model_loss=self.compute_language_model_loss,',
        '                config=self.config,',
        '                cp_group=self.cp_group,',
        '                packed_seq_params=packed_seq_params,',
        '            )',
        f'            if self.config.mtp_loss_type in {_ce()}:',
        '                with torch.no_grad():',
        '                    process_mtp_tv_loss(**mtp_tv_kwargs, metrics_only=True)',
        '',
    ]
    replace = [
        f'        if mtp_tv and self.config.mtp_loss_type not in {_ce()}:',
        '            hidden_states = process_mtp_tv_loss(**mtp_tv_kwargs)',
        f'        elif {INLINE_CONDITION}:',
    ]
    return before, replace


def expected_edits(facts: Facts) -> Dict[str, List[Tuple[List[str], List[str]]]]:
    """``{file: [(added lines, removed lines) per edit, in file order]}`` for a tree with ``facts``.

    File order holds in every supported tree: the import, the fields and ``__post_init__`` in
    transformer_config.py; ``track_mtp_metrics`` before ``process_mtp_loss``.
    """
    mtp = [(snippet_track_metrics(), [])]
    if facts.process_mtp_loss_params is not None:
        mtp.append((snippet_process_mtp_loss(facts.process_mtp_loss_params), []))
    out = {
        CONFIG_FILE: [(snippet_config_import(), []), (snippet_fields(), []), (snippet_validate(), [])],
        MTP_FILE: mtp,
    }
    if facts.inline_gpt_loss:
        before, replace = snippet_inline_gpt()
        out[GPT_FILE] = [(before, []), (replace, [f'        if {INLINE_CONDITION}:'])]
    return out


def expected_changes(facts: Facts) -> Dict[str, Tuple[List[str], List[str]]]:
    """``{file: (added lines, removed lines)}``, the edits of :func:`expected_edits` concatenated."""
    return {
        path: ([l for a, _ in edits for l in a], [l for _, r in edits for l in r])
        for path, edits in expected_edits(facts).items()
    }


# ----------------------------------------------------------------------------------------------
# Editing pristine files
# ----------------------------------------------------------------------------------------------


def _find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise PatchError(f'class {name} not found')


def _find_function(body, name: str):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _after_docstring(fn) -> int:
    """0-based line index just after the docstring of ``fn`` (or after its ``def`` line)."""
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
        first.value.value, str
    ):
        return first.end_lineno
    return first.lineno - 1


class Editor:
    """Line insertions/replacements on one file, and the unified diff that makes them.

    The diff is built from the edits themselves (3 lines of context, overlapping hunks merged),
    not by a diff algorithm: every rendered line is an added line and every replaced line a
    removed one, which is what the offline staleness check compares.
    """

    CONTEXT = 3

    def __init__(self, text: str):
        if not text.endswith('\n'):
            raise PatchError('pristine file does not end with a newline')
        self.lines = text.split('\n')[:-1]
        self.edits: List[Tuple[int, int, List[str]]] = []  # (start, stop, new lines), 0-based

    def insert(self, index: int, new: List[str]) -> None:
        self.edits.append((index, index, new))

    def replace(self, index: int, new: List[str]) -> None:
        self.edits.append((index, index + 1, new))

    def _sorted(self):
        edits = sorted(self.edits, key=lambda e: (e[0], e[1]))
        for (a0, a1, _), (b0, _, _) in zip(edits, edits[1:]):
            if b0 < a1:
                raise PatchError('overlapping edits')
        return edits

    def result(self) -> str:
        lines = list(self.lines)
        for start, stop, new in reversed(self._sorted()):
            lines[start:stop] = new
        return '\n'.join(lines) + '\n'

    def diff(self, path: str) -> str:
        edits = self._sorted()
        if not edits:
            return ''
        n, c = len(self.lines), self.CONTEXT
        groups: List[List[Tuple[int, int, List[str]]]] = []
        for e in edits:
            if groups and e[0] - c <= groups[-1][-1][1] + c:
                groups[-1].append(e)
            else:
                groups.append([e])
        out = [f'diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n']
        offset = 0  # new line number - old line number before the current hunk
        for group in groups:
            lo, hi = max(0, group[0][0] - c), min(n, group[-1][1] + c)
            body, pos, added, removed = [], lo, 0, 0
            for start, stop, new in group:
                body += [' ' + line for line in self.lines[pos:start]]
                body += ['-' + line for line in self.lines[start:stop]]
                body += ['+' + line for line in new]
                added, removed, pos = added + len(new), removed + stop - start, stop
            body += [' ' + line for line in self.lines[pos:hi]]
            old_len = hi - lo
            new_len = old_len - removed + added
            out.append(f'@@ -{lo + 1},{old_len} +{lo + 1 + offset},{new_len} @@\n')
            out.append(''.join(line + '\n' for line in body))
            offset += added - removed
        return ''.join(out)


def _params(fn) -> Tuple[str, ...]:
    return tuple(a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs)


def derive_facts(files: Dict[str, str]) -> Facts:
    """The facts the rendered edits and the package's code depend on, read from the tree."""
    mtp = ast.parse(files[MTP_FILE])
    fn = _find_function(mtp.body, 'process_mtp_loss')
    roll = _find_function(mtp.body, 'roll_tensor')
    tracker_api: Tuple[str, ...] = ()
    helper = next(
        (n for n in mtp.body if isinstance(n, ast.ClassDef) and n.name == 'MTPLossLoggingHelper'),
        None,
    )
    if helper is not None:
        for name in plugin_checks()['TRACKER_APIS']:  # the order metrics.py tries them in
            method = _find_function(helper.body, name)
            if method is not None:
                tracker_api = (name,) + _params(method)
                break
    return Facts(
        process_mtp_loss_params=None if fn is None else _params(fn),
        inline_gpt_loss=_inline_if(files[GPT_FILE]) is not None,
        roll_tensor_params=() if roll is None else _params(roll),
        tracker_api=tracker_api,
    )


def fact_problems(facts: Facts) -> List[str]:
    """What in ``facts`` the generator or the package does not know (empty: all known).

    The same checks as ``install()`` makes in plugin mode (megatron/mtp_tv/plugin.py), plus:
    the tree must have an MTP loss this generator can hook (``process_mtp_loss``, or the inline
    branch of radixark miles-main's ``GPTModel._postprocess``).
    """
    checks = plugin_checks()
    problems = []
    if facts.process_mtp_loss_params is None and not facts.inline_gpt_loss:
        problems.append(
            f'MTP loss: {MTP_FILE} has no process_mtp_loss and {GPT_FILE} has no inline MTP loss '
            f'branch `if {INLINE_CONDITION}:` in GPTModel._postprocess'
        )
    if facts.process_mtp_loss_params is not None:
        problems.append(checks['process_mtp_loss_problem'](
            facts.process_mtp_loss_params, tv_loss_params(), tv_loss_required_params()
        ))
    if not facts.roll_tensor_params:
        problems.append(f'{MTP_FILE} has no roll_tensor')
    else:
        problems.append(checks['roll_tensor_problem'](facts.roll_tensor_params))
    if not facts.tracker_api:
        problems.append(checks['tracker_problem']({}))
    else:
        problems.append(checks['tracker_problem']({facts.tracker_api[0]: facts.tracker_api[1:]}))
    return [p for p in problems if p]


def _inline_if(text: str) -> Optional[ast.If]:
    tree = ast.parse(text)
    post = _find_function(_find_class(tree, 'GPTModel').body, '_postprocess')
    if post is None:
        return None
    for node in ast.walk(post):
        if isinstance(node, ast.If) and ast.unparse(node.test) == INLINE_CONDITION:
            return node
    return None


def edit_config(text: str) -> str:
    tree = ast.parse(text)
    ed = Editor(text)
    lines = ed.lines
    if not any(
        isinstance(n, ast.ImportFrom) and n.module == 'typing' and any(a.name == 'Literal' for a in n.names)
        for n in tree.body
    ):
        raise PatchError(f'{CONFIG_FILE} does not import typing.Literal')
    imports = [
        n for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or '').startswith('megatron.core.transformer.')
    ]
    if not imports:
        raise PatchError(f'{CONFIG_FILE}: no megatron.core.transformer imports to anchor on')
    ed.insert(imports[-1].end_lineno, snippet_config_import())

    cls = _find_class(tree, 'TransformerConfig')
    body = cls.body
    names = field_names()
    last_mtp = None
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in names:
                raise PatchError(f'{CONFIG_FILE} already has {node.target.id}: already patched?')
            if node.target.id.startswith('mtp_'):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, 'value', None), ast.Constant)
                last_mtp = (nxt if doc else node).end_lineno
    if last_mtp is None:
        raise PatchError(f'{CONFIG_FILE}: TransformerConfig has no mtp_* field')
    ed.insert(last_mtp, snippet_fields())

    post = _find_function(body, '__post_init__')
    if post is None:
        raise PatchError(f'{CONFIG_FILE}: TransformerConfig has no __post_init__')
    for node in ast.walk(post):
        if isinstance(node, ast.Return) and _enclosing_function(post, node) is post:
            raise PatchError(f'{CONFIG_FILE}: __post_init__ returns early (line {node.lineno})')
    ed.insert(post.end_lineno, snippet_validate())
    return ed


def _enclosing_function(root, target):
    """The innermost function (or lambda) of ``root`` containing ``target``."""
    best = root
    for node in ast.walk(root):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not root:
            if node.lineno <= target.lineno <= node.end_lineno:
                best = node
    return best


def edit_mtp(text: str) -> str:
    tree = ast.parse(text)
    ed = Editor(text)
    helper = _find_class(tree, 'MTPLossLoggingHelper')
    track = _find_function(helper.body, 'track_mtp_metrics')
    if track is None or [a.arg for a in track.args.args[:4]] != [
        'loss_scale', 'iteration', 'writer', 'wandb_writer'
    ]:
        raise PatchError(f'{MTP_FILE}: MTPLossLoggingHelper.track_mtp_metrics not as expected')
    ed.insert(_after_docstring(track), snippet_track_metrics())
    fn = _find_function(tree.body, 'process_mtp_loss')
    if fn is not None:
        params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
        missing = {'hidden_states', 'config', 'is_training'} - set(params)
        if missing:
            raise PatchError(f'{MTP_FILE}: process_mtp_loss lacks {sorted(missing)}')
        ed.insert(_after_docstring(fn), snippet_process_mtp_loss(params))
    return ed


def edit_gpt(text: str) -> str:
    node = _inline_if(text)
    ed = Editor(text)
    if node is None:
        return ed
    line = ed.lines[node.lineno - 1]
    if line.strip() != f'if {INLINE_CONDITION}:' or not line.startswith('        if'):
        raise PatchError(f'{GPT_FILE}:{node.lineno}: inline MTP branch not on one line: {line!r}')
    index = node.lineno - 1
    # keep the comment that introduces the branch right above it
    while ed.lines[index - 1].strip().startswith('#'):
        index -= 1
    before, replace = snippet_inline_gpt()
    ed.insert(index, before)
    ed.replace(node.lineno - 1, replace)
    return ed


def megatron_edits(files: Dict[str, str]) -> Dict[str, Editor]:
    """The edits of each touched Megatron file (pristine text in ``files``)."""
    return {
        CONFIG_FILE: edit_config(files[CONFIG_FILE]),
        MTP_FILE: edit_mtp(files[MTP_FILE]),
        GPT_FILE: edit_gpt(files[GPT_FILE]),
    }


def patched_files(files: Dict[str, str]) -> Dict[str, str]:
    """What the patch turns the tree into: the patched Megatron files and the new package files."""
    out = {path: ed.result() for path, ed in megatron_edits(files).items()}
    for rel, text in shipped_modules().items():
        out[f'{TARGET_PACKAGE}/{rel}'] = text
    return out


# ----------------------------------------------------------------------------------------------
# Unified diffs that `git apply` takes
# ----------------------------------------------------------------------------------------------


def new_file_diff(path: str, text: str) -> str:
    """A ``git apply`` diff creating ``path`` with ``text``."""
    if not text.endswith('\n'):
        raise PatchError(f'{path}: no newline at end of file')
    lines = text.split('\n')[:-1]
    return (
        f'diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n'
        f'@@ -0,0 +1,{len(lines)} @@\n' + ''.join('+' + line + '\n' for line in lines)
    )


def render_header(target: Target) -> str:
    """The text before the first diff (a function of the target and the package's fields)."""
    names = field_names()
    listed = textwrap.wrap(
        f'Adds {TARGET_PACKAGE}/ and the TransformerConfig fields {", ".join(names)} (flags '
        + ', '.join('--' + n.replace('_', '-') for n in names) + ').',
        width=100, break_long_words=False, break_on_hyphens=False,
    )
    header = [
        f'megatron-mtp-tv patch for {target.description}.',
        '',
        'Generated by tools/make_patches.py from megatron/mtp_tv; do not edit by hand.',
        'Apply at the root of the tree:  git apply <this file>',
        *listed,
    ]
    if target.commit:
        header.append(f'Generated against {target.repo} commit {target.commit}.')
    else:
        header.append('Generated against files with sha256:')
        header += [f'  {target.file_sha256[p]}  {p}' for p in TOUCHED]
    return '\n'.join(header) + '\n\n'


def check_facts(name: str, facts: Facts) -> None:
    """Raise :class:`PatchError` naming every fact of a tree the generator does not know."""
    problems = fact_problems(facts)
    if problems:
        raise PatchError(
            f'{name}: this tree has MTP code the generator does not know, no patch written:\n  '
            + '\n  '.join(problems)
            + '\nA patch made anyway could apply and then misbehave. Use a supported tree '
            '(README, Patches) or teach megatron/mtp_tv (plugin.py lists what it knows).'
        )


def render_patch(target: Target, files: Dict[str, str]) -> str:
    facts = derive_facts(files)
    check_facts(target.name, facts)
    if facts != target.facts:
        raise PatchError(
            f'{target.name}: the tree differs from what TARGETS records:\n  recorded {target.facts}'
            f'\n  found    {facts}\nUpdate TARGETS (and review the rendered edits) if intended.'
        )
    if not target.commit:
        found = {p: files_sha(files[p]) for p in TOUCHED}
        if found != target.file_sha256:
            raise PatchError(f'{target.name}: files differ from the pinned sha256: {found}')
    edits = megatron_edits(files)
    parts = [render_header(target)]
    for path in TOUCHED:
        parts.append(edits[path].diff(path))
    for rel, text in sorted(shipped_modules().items()):
        parts.append(new_file_diff(f'{TARGET_PACKAGE}/{rel}', text))
    return ''.join(parts)


def files_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Pristine sources
# ----------------------------------------------------------------------------------------------


def wheel_path(download: bool = True) -> Path:
    """The megatron-core 0.19.2 wheel (cached; downloaded from the registry with pip)."""
    cache = cache_dir()
    path = cache / WHEEL_NAME
    if not path.exists() and download:
        subprocess.run(
            [sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary=:all:',
             '--platform', 'manylinux_2_28_x86_64', '--python-version', '3.12',
             '--implementation', 'cp', '-d', str(cache), WHEEL_REQUIREMENT],
            check=True,
        )
    if not path.exists():
        raise PatchError(f'{WHEEL_NAME} not found in {cache}')
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise PatchError(f'{path}: sha256 {digest} != pinned {WHEEL_SHA256}')
    return path


def files_from_wheel(paths: Sequence[str]) -> Dict[str, str]:
    with zipfile.ZipFile(wheel_path()) as zf:
        return {p: zf.read(p).decode() for p in paths}


def files_from_installed(paths: Sequence[str]) -> Optional[Dict[str, str]]:
    """The files of the installed megatron-core, if it is 0.19.2 (None otherwise)."""
    try:
        dist = importlib.metadata.distribution('megatron-core')
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != '0.19.2':
        return None
    out = {}
    for p in paths:
        located = Path(dist.locate_file(p))
        if not located.exists():
            return None
        out[p] = located.read_text()
    return out


def files_0192(paths: Sequence[str] = TOUCHED) -> Dict[str, str]:
    """Pristine 0.19.2 files, verified against the pinned sha256 (installed copy, else wheel)."""
    pins = TARGETS['megatron-core-0.19.2'].file_sha256
    files = files_from_installed(paths)
    if files is None or any(pins.get(p) and files_sha(files[p]) != pins[p] for p in paths):
        files = files_from_wheel(paths)
    for p in paths:
        if pins.get(p) and files_sha(files[p]) != pins[p]:
            raise PatchError(f'{p}: sha256 {files_sha(files[p])} != pinned {pins[p]}')
    return files


def files_from_git(git_dir: Path, commit: str, paths: Sequence[str]) -> Dict[str, str]:
    out = {}
    for p in paths:
        res = subprocess.run(
            ['git', f'--git-dir={git_dir}', 'show', f'{commit}:{p}'],
            capture_output=True, text=True,
        )
        if res.returncode:
            raise PatchError(f'git show {commit}:{p} in {git_dir}: {res.stderr.strip()}')
        out[p] = res.stdout
    return out


def git_dir_of(path: Path) -> Path:
    res = subprocess.run(
        ['git', '-C', str(path), 'rev-parse', '--absolute-git-dir'], capture_output=True, text=True
    )
    if res.returncode:  # a bare repository given as its directory
        res = subprocess.run(
            ['git', f'--git-dir={path}', 'rev-parse', '--absolute-git-dir'],
            capture_output=True, text=True,
        )
    if res.returncode:
        raise PatchError(f'{path} is not a git repository')
    return Path(res.stdout.strip())


def has_commit(git_dir: Path, commit: str) -> bool:
    res = subprocess.run(
        ['git', f'--git-dir={git_dir}', 'cat-file', '-e', f'{commit}^{{commit}}'],
        capture_output=True,
    )
    return res.returncode == 0


def clones(megatron_lm) -> List[Path]:
    """``--megatron-lm`` / ``MTP_TV_MEGATRON_LM`` as a list of clones (``os.pathsep``-joined)."""
    if megatron_lm is None:
        return []
    if isinstance(megatron_lm, (str, Path)):
        megatron_lm = [megatron_lm]
    out = []
    for item in megatron_lm:
        out += [Path(p) for p in str(item).split(os.pathsep) if p]
    return out


def pristine_files(target: Target, megatron_lm) -> Optional[Dict[str, str]]:
    """The target's pristine files, or None if its source is not available here.

    ``megatron_lm``: clones of Megatron-LM (a path, or several; bare or not): the first one
    that has the target's commit is read.
    """
    if target.commit is None:
        return files_0192()
    for clone in clones(megatron_lm):
        git_dir = git_dir_of(clone)
        if has_commit(git_dir, target.commit):
            return files_from_git(git_dir, target.commit, TOUCHED)
    return None


# ----------------------------------------------------------------------------------------------
# A patch for any checkout (--tree)
# ----------------------------------------------------------------------------------------------


def tree_files(tree: Path) -> Tuple[Dict[str, str], Optional[str]]:
    """The touched files of ``tree`` and its HEAD commit (None: not a git checkout).

    In a git checkout the files are read from HEAD (the patch is for that commit); otherwise
    (an unpacked or installed megatron-core) from disk.
    """
    res = subprocess.run(['git', '-C', str(tree), 'rev-parse', '--show-toplevel', 'HEAD'],
                         capture_output=True, text=True)
    lines = res.stdout.split()
    if res.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == tree.resolve():
        commit = lines[1]
        return files_from_git(git_dir_of(tree), commit, TOUCHED), commit
    missing = [p for p in TOUCHED if not (tree / p).is_file()]
    if missing:
        raise PatchError(f'{tree}: not the root of a Megatron tree (no {", ".join(missing)})')
    return {p: (tree / p).read_text() for p in TOUCHED}, None


def tree_target(tree: Path, files: Dict[str, str], commit: Optional[str], output: Path) -> Target:
    """A :class:`Target` for a checkout, its facts derived from the tree itself."""
    facts = derive_facts(files)
    check_facts(str(tree), facts)
    if commit:
        return Target(
            name=f'{tree.name}-{commit[:9]}', description=f'the checkout {tree} at {commit[:9]}',
            facts=facts, commit=commit, repo=str(tree), patch_file=output,
        )
    return Target(
        name=tree.name, description=f'the tree {tree}', facts=facts,
        file_sha256={p: files_sha(files[p]) for p in TOUCHED}, patch_file=output,
    )


def patch_tree(tree: Path, output: Optional[Path] = None) -> Path:
    """Write a patch for the checkout ``tree`` (its HEAD) and check it with ``git apply --check``.

    Raises :class:`PatchError` naming the fact the generator does not know, or why the patch
    does not apply; nothing is left behind then.
    """
    tree = tree.expanduser().resolve()
    if not tree.is_dir():
        raise PatchError(f'{tree}: no such directory')
    files, commit = tree_files(tree)
    if output is None:
        output = Path.cwd() / f'megatron-mtp-tv-{commit[:9] if commit else tree.name}.patch'
    target = tree_target(tree, files, commit, output.resolve())
    text = render_patch(target, files)
    output = target.patch_path
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    res = subprocess.run(['git', 'apply', '--check', str(output)], cwd=tree,
                         capture_output=True, text=True)
    if res.returncode:
        output.unlink()
        raise PatchError(
            f'{tree}: the patch for {"commit " + commit[:9] if commit else "this tree"} does not '
            f'apply to the files there (local changes, or already patched?):\n'
            f'{res.stderr.strip()}'
        )
    return output


# ----------------------------------------------------------------------------------------------
# Offline staleness check
# ----------------------------------------------------------------------------------------------


@dataclass
class FileDiff:
    path: str
    new_file: bool
    added: List[str]
    removed: List[str]


def parse_patch(text: str) -> Dict[str, FileDiff]:
    """Split a patch made by :func:`render_patch` into its files."""
    out: Dict[str, FileDiff] = {}
    current: Optional[FileDiff] = None
    in_hunk = False
    for line in text.split('\n'):
        if line.startswith('diff --git a/'):
            path = line.split(' b/', 1)[1]
            current = out[path] = FileDiff(path, False, [], [])
            in_hunk = False
        elif current is None:
            continue
        elif not in_hunk and line.startswith('new file mode'):
            current.new_file = True
        elif line.startswith('@@'):
            in_hunk = True
        elif in_hunk and line.startswith('+'):
            current.added.append(line[1:])
        elif in_hunk and line.startswith('-'):
            current.removed.append(line[1:])
    return out


def check_offline(target: Target, text: str) -> List[str]:
    """Problems of a committed patch that can be found without the target tree."""
    problems = [f'recorded facts: {p}' for p in fact_problems(target.facts)]
    if not text.startswith(render_header(target)):
        problems.append('the header (text before the first diff) differs from what the generator '
                        'renders now')
    files = parse_patch(text)
    shipped = {f'{TARGET_PACKAGE}/{rel}': src for rel, src in shipped_modules().items()}
    in_patch = {p for p, d in files.items() if p.startswith(TARGET_PACKAGE + '/')}
    for p in sorted(set(shipped) ^ in_patch):
        problems.append(f'{p}: {"missing from" if p in shipped else "no longer in"} the package')
    for p in sorted(set(shipped) & in_patch):
        d = files[p]
        if not d.new_file or d.removed or d.added != shipped[p].split('\n')[:-1]:
            problems.append(f'{p}: differs from megatron/mtp_tv/{p[len(TARGET_PACKAGE) + 1:]}')
    for path, (added, removed) in expected_changes(target.facts).items():
        d = files.get(path)
        if d is None:
            problems.append(f'{path}: not in the patch')
            continue
        if d.added != added:
            problems.append(f'{path}: added lines differ from what the generator renders now')
        if d.removed != removed:
            problems.append(f'{path}: removed lines differ from what the generator renders now')
    extra = set(files) - set(expected_changes(target.facts)) - in_patch
    for p in sorted(extra):
        problems.append(f'{p}: unexpected file in the patch')
    return problems


def regenerate_offline(target: Target, text: str) -> str:
    """Bring a committed patch up to date without its tree.

    The package files are re-rendered from the package source; in each Megatron hunk the lines
    of every edit are re-rendered while the context and removed lines (the tree's own code) are
    kept, and the hunk headers recounted. Raises :class:`PatchError` when that is not possible:
    the edits no longer line up with the committed hunks, or what an edit removes changed (both
    need the tree: ``--megatron-lm``).
    """
    _, _, rest = text.partition('diff --git ')
    sections = ['diff --git ' + part for part in rest.split('\ndiff --git ')]
    sections = [sec if sec.endswith('\n') else sec + '\n' for sec in sections]
    edits = expected_edits(target.facts)
    out = [render_header(target)]
    for sec in sections:
        path = sec.split('\n', 1)[0].split(' b/', 1)[1]
        if path.startswith(TARGET_PACKAGE + '/'):
            continue  # re-rendered below
        if path not in edits:
            raise PatchError(f'{target.name}: unexpected file {path} in the patch')
        out.append(_rerender_hunks(target.name, path, sec, edits[path]))
    for rel, text_ in sorted(shipped_modules().items()):
        out.append(new_file_diff(f'{TARGET_PACKAGE}/{rel}', text_))
    new = ''.join(out)
    problems = check_offline(target, new)
    if problems:
        raise PatchError(f'{target.name}: offline regeneration failed: {problems}')
    return new


def _rerender_hunks(name: str, path: str, section: str, edits) -> str:
    head, _, body = section.partition('\n@@')
    lines = ('@@' + body).split('\n')[:-1]
    hunks, current = [], None
    for line in lines:
        if line.startswith('@@'):
            m = re.match(r'@@ -(\d+),(\d+) \+(\d+),(\d+) @@', line)
            current = [int(m.group(1)), int(m.group(2)), []]
            hunks.append(current)
        else:
            current[2].append(line)
    # runs of changed lines: each is one edit ('-' lines then '+' lines)
    queue = list(edits)
    out = [head + '\n']
    offset = 0
    for old_start, old_len, body_lines in hunks:
        new_body, i = [], 0
        while i < len(body_lines):
            if body_lines[i][:1] == ' ':
                new_body.append(body_lines[i])
                i += 1
                continue
            removed, added = [], []
            while i < len(body_lines) and body_lines[i][:1] == '-':
                removed.append(body_lines[i][1:])
                i += 1
            while i < len(body_lines) and body_lines[i][:1] == '+':
                added.append(body_lines[i][1:])
                i += 1
            if not queue:
                raise PatchError(f'{name}: {path}: more changed runs than edits; needs the tree')
            new_added, new_removed = queue.pop(0)
            if removed != new_removed:
                raise PatchError(f'{name}: {path}: an edit now removes other lines; needs the tree')
            new_body += ['-' + l for l in removed] + ['+' + l for l in new_added]
        n_removed = sum(1 for l in new_body if l[:1] == '-')
        n_added = sum(1 for l in new_body if l[:1] == '+')
        new_len = old_len - n_removed + n_added
        out.append(f'@@ -{old_start},{old_len} +{old_start + offset},{new_len} @@\n')
        out.append(''.join(l + '\n' for l in new_body))
        offset += n_added - n_removed
    if queue:
        raise PatchError(f'{name}: {path}: fewer changed runs than edits; needs the tree')
    return ''.join(out)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--check', action='store_true',
                        help='do not write; exit 1 if a committed patch is stale')
    parser.add_argument('--megatron-lm', type=Path, action='append',
                        help='a clone of Megatron-LM (bare or not: radixark/Megatron-LM, '
                        'NVIDIA/Megatron-LM) holding the pinned commits; repeat for several '
                        '(default: $MTP_TV_MEGATRON_LM, os.pathsep-separated); without one the '
                        'git-target patches are only checked offline')
    parser.add_argument('--target', action='append', choices=sorted(TARGETS),
                        help='only these targets (default: all)')
    parser.add_argument('--tree', type=Path,
                        help='write a patch for this checkout (its HEAD; or an unpacked '
                        'megatron-core) instead, facts derived from the tree, checked with '
                        'git apply --check')
    parser.add_argument('-o', '--output', type=Path,
                        help='with --tree: the patch file (default: ./megatron-mtp-tv-<commit>.patch)')
    args = parser.parse_args(argv)
    if args.tree is not None:
        try:
            path = patch_tree(args.tree, args.output)
        except PatchError as exc:
            print(f'make_patches.py --tree: {exc}', file=sys.stderr)
            return 2
        print(f'wrote {path} (git apply --check passed in {args.tree}); apply it with:\n'
              f'  git -C {args.tree} apply {path}')
        return 0
    if args.megatron_lm is None:
        args.megatron_lm = os.environ.get('MTP_TV_MEGATRON_LM')

    stale = False
    for name in args.target or list(TARGETS):
        target = TARGETS[name]
        files = pristine_files(target, args.megatron_lm)
        committed = target.patch_path.read_text() if target.patch_path.exists() else None
        if files is None:
            if committed is None:
                print(f'{name}: no patch and no tree to generate it from (--megatron-lm with a '
                      f'clone of {target.repo})')
                stale = True
                continue
            problems = check_offline(target, committed)
            if not problems:
                print(f'{name}: up to date (offline check: package files and rendered edits)')
            elif args.check:
                for p in problems:
                    print(f'{name}: STALE: {p}')
                stale = True
            else:
                target.patch_path.write_text(regenerate_offline(target, committed))
                print(f'{name}: wrote {target.patch_path.relative_to(REPO)} (offline: package '
                      'files and rendered edits re-rendered, the tree\'s context kept)')
            continue
        text = render_patch(target, files)
        if committed == text:
            print(f'{name}: up to date')
        elif args.check:
            print(f'{name}: STALE: regenerate with python tools/make_patches.py')
            stale = True
        else:
            PATCH_DIR.mkdir(exist_ok=True)
            target.patch_path.write_text(text)
            print(f'{name}: wrote {target.patch_path.relative_to(REPO)}')
    return 1 if stale else 0


if __name__ == '__main__':
    sys.exit(main())
