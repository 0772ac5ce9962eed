"""AST-anchored edits of the pristine Megatron files, and the unified diffs that make them.

One function per touched file (:func:`edit_config`, :func:`edit_mtp`, :func:`edit_gpt`,
:func:`edit_training`) finds
where each snippet goes and records it on an :class:`Editor`, which renders the result and the
diff.
"""

import ast
from typing import Dict, List, Tuple

from .facts import (
    FLOPS_RETURNS, _find_class, _find_function, _inline_if, _postprocess,
    derive_facts, flops_function, flops_returns, flops_tokens, main_logits_projections, process_mtp_loss_call,
)
from .layout import (
    CONFIG_FILE, GPT_FILE, INLINE_CONDITION, MTP_FILE, TRAINING_FILE, PatchError,
)
from .package import field_names, new_files
from .snippets import (
    FLOPS_RETURN_INDENT, MTP_LOSS_MODULE, snippet_attach, snippet_config_import, snippet_fields,
    snippet_flops_import, snippet_flops_return, snippet_get_model, snippet_gpt_import,
    snippet_inline_gpt, snippet_mtp_imports, snippet_mtp_loss_inputs, snippet_postprocess_start,
    snippet_process_mtp_loss,
    snippet_process_mtp_loss_call, snippet_track_metrics, snippet_validate, snippet_wrapped_call,
)


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

    def replace(self, index: int, new: List[str], stop: int = None) -> None:
        """Lines ``index .. stop-1`` (default: the one line ``index``) become ``new``."""
        self.edits.append((index, index + 1 if stop is None else stop, new))

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



def _after_transformer_imports(tree: ast.Module, path: str) -> int:
    """0-based line index just after the last top-level ``from megatron.core.transformer.* import``."""
    imports = [
        n for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or '').startswith('megatron.core.transformer.')
    ]
    if not imports:
        raise PatchError(f'{path}: no megatron.core.transformer imports to anchor on')
    return imports[-1].end_lineno


def edit_config(text: str) -> Editor:
    tree = ast.parse(text)
    ed = Editor(text)
    if not any(
        isinstance(n, ast.ImportFrom) and n.module == 'typing' and any(a.name == 'Literal' for a in n.names)
        for n in tree.body
    ):
        raise PatchError(f'{CONFIG_FILE} does not import typing.Literal')
    ed.insert(_after_transformer_imports(tree, CONFIG_FILE), snippet_config_import())

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


def edit_mtp(text: str, facts) -> Editor:
    """The MTP losses' imports; the metrics logging in ``track_mtp_metrics``; in
    ``process_mtp_loss`` (where the tree has it) the branch of the MTP losses; at the end,
    ``mtp_loss_inputs`` in this tree's forms."""
    tree = ast.parse(text)
    ed = Editor(text)
    ed.insert(_after_transformer_imports(tree, MTP_FILE), snippet_mtp_imports())
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
    ed.insert(len(ed.lines), snippet_mtp_loss_inputs(facts))
    return ed


def edit_gpt(text: str, facts) -> Editor:
    """In ``GPTModel._postprocess``: no drafts split off at first; the ``process_mtp_loss`` call
    (or radixark miles-main's inline branch) only splits the hidden states where the loss runs
    on the main logits; the loss on the logits of each main-head projection."""
    tree = ast.parse(text)
    ed = Editor(text)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == MTP_LOSS_MODULE:
            raise PatchError(f'{GPT_FILE}:{node.lineno} already imports {MTP_LOSS_MODULE}: '
                             'already patched?')
    ed.insert(_after_transformer_imports(tree, GPT_FILE), snippet_gpt_import(facts.inline_gpt_loss))

    post = _postprocess(text)
    if post is None:
        raise PatchError(f'{GPT_FILE}: GPTModel has no _postprocess')
    ed.insert(_after_docstring(post), snippet_postprocess_start())

    node = _inline_if(text)
    if node is None:
        _wrap_process_mtp_loss_call(ed, post, facts)
    else:
        line = ed.lines[node.lineno - 1]
        if line.strip() != f'if {INLINE_CONDITION}:' or not line.startswith('        if'):
            raise PatchError(f'{GPT_FILE}:{node.lineno}: inline MTP branch not on one line: {line!r}')
        index = node.lineno - 1
        # keep the comment that introduces the branch right above it
        while ed.lines[index - 1].strip().startswith('#'):
            index -= 1
        before, replace = snippet_inline_gpt(facts.postprocess_output_processor)
        ed.insert(index, before)
        ed.replace(node.lineno - 1, replace)

    projections = main_logits_projections(post)
    if not projections:
        raise PatchError(f'{GPT_FILE}: GPTModel._postprocess has no `logits, _ = self.output_layer(...)`')
    for statement in projections:
        ed.insert(statement.end_lineno, snippet_attach(statement.col_offset))
    return ed


def edit_training(text: str) -> Editor:
    """In ``megatron/training/training.py``'s ``get_model``, right after the built model becomes a
    list of chunks: Megatron's arguments applied to their configs."""
    tree = ast.parse(text)
    fn = _find_function(tree.body, 'get_model')
    if fn is None or not fn.args.args or fn.args.args[0].arg != 'model_provider_func':
        raise PatchError(f'{TRAINING_FILE}: no get_model(model_provider_func, ...)')
    if 'apply_mtp_loss_args' in text:
        raise PatchError(f'{TRAINING_FILE} already calls apply_mtp_loss_args: already patched?')
    listed = [n for n in fn.body if isinstance(n, ast.If)
              and ast.unparse(n) == 'if not isinstance(model, list):\n    model = [model]']
    if len(listed) != 1 or listed[0].col_offset != 4:
        raise PatchError(f'{TRAINING_FILE}: get_model has no `if not isinstance(model, list): '
                         'model = [model]` at its top level')
    ed = Editor(text)
    _edit_flops(ed, text)
    ed.insert(listed[0].end_lineno, snippet_get_model())
    return ed


def _edit_flops(ed: Editor, text: str) -> None:
    """``num_floating_point_operations`` adds the MTP loss's projections to both of its counts."""
    fn = flops_function(text)
    ed.insert(_after_docstring(fn), snippet_flops_import())
    tokens = flops_tokens(fn)
    for ret in flops_returns(fn):
        called = ast.unparse(ret.value.func)
        new, removed = snippet_flops_return(called, FLOPS_RETURNS[called], tokens)
        if ed.lines[ret.lineno - 1] != removed[0]:
            raise PatchError(f'{TRAINING_FILE}:{ret.lineno}: expected `{removed[0].strip()}` '
                             f'at indentation {len(FLOPS_RETURN_INDENT)}')
        ed.replace(ret.lineno - 1, new)

def _wrap_process_mtp_loss_call(ed: Editor, post, facts) -> None:
    """``hidden_states = process_mtp_loss(...)`` gets the edits of
    :func:`~patchgen.snippets.snippet_wrapped_call`; the statement must read exactly as
    :func:`~patchgen.snippets.snippet_process_mtp_loss_call` renders it from the facts (keyword
    arguments one per line), so that the offline check can render the removed lines."""
    call = process_mtp_loss_call(post)
    statement = next(n for n in ast.walk(post) if isinstance(n, ast.Assign) and n.value is call)
    expected = snippet_process_mtp_loss_call(facts.process_mtp_loss_call)
    found = ed.lines[statement.lineno - 1 : statement.end_lineno]
    if found != expected:
        raise PatchError(f'{GPT_FILE}:{statement.lineno}: the process_mtp_loss call is not '
                         '`hidden_states = process_mtp_loss(` with keyword arguments one per line')
    first = statement.lineno - 1
    for start, stop, new in snippet_wrapped_call(facts.process_mtp_loss_call,
                                                 facts.postprocess_output_processor):
        ed.replace(first + start, new, stop=first + stop)


def megatron_edits(files: Dict[str, str]) -> Dict[str, Editor]:
    """The edits of each touched Megatron file (pristine text in ``files``)."""
    facts = derive_facts(files)
    return {
        CONFIG_FILE: edit_config(files[CONFIG_FILE]),
        MTP_FILE: edit_mtp(files[MTP_FILE], facts),
        GPT_FILE: edit_gpt(files[GPT_FILE], facts),
        TRAINING_FILE: edit_training(files[TRAINING_FILE]),
    }


def patched_files(files: Dict[str, str]) -> Dict[str, str]:
    """What the patch turns the tree into: the patched Megatron files and the new package files."""
    out = {path: ed.result() for path, ed in megatron_edits(files).items()}
    out.update(new_files())
    return out
