"""Facts: what the rendered edits depend on in a pristine Megatron tree.

:func:`derive_facts` reads them from a tree's source (with :mod:`ast`), :func:`fact_problems`
checks each against what the package knows (the same checks ``install()`` makes in plugin mode),
and :func:`check_facts` refuses a tree with an unknown one, naming it.
"""

import ast
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .layout import CONFIG_FILE, GPT_FILE, INLINE_CONDITION, MTP_FILE, TRAINING_FILE, PatchError
from .package import plugin_checks, tv_loss_params, tv_loss_required_params


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
    postprocess_output_processor: bool
    """Whether ``GPTModel._postprocess`` takes an ``output_processor`` (no main logits then)."""
    main_logits_projections: Tuple[int, ...]
    """The indentation of each ``logits, _ = self.output_layer(...)`` of ``GPTModel._postprocess``
    (the main head's projections; the MTP loss attaches to the one that runs)."""
    process_mtp_loss_call: Tuple[Tuple[str, str], ...] = ()
    """``(keyword, source of its value)`` of each argument of ``_postprocess``'s
    ``process_mtp_loss(...)`` call (empty with the inline loss): the patched ``_postprocess``
    passes the same ones to ``attach_mtp_tv_loss``."""
    flops_tokens: str = 'total_real_tokens_in_batch'
    """The tokens of the global batch as ``training.py``'s ``num_floating_point_operations``
    counts them (``batch_size * args.seq_length`` in trees without real-token counts)."""
    mtp_detach_heads: bool = True
    """Whether ``TransformerConfig`` has Megatron's ``mtp_detach_heads`` (the MTP losses then
    leave the output weight untrained as its ``process_mtp_loss`` does)."""



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
    post = _postprocess(files[GPT_FILE])
    return Facts(
        process_mtp_loss_params=None if fn is None else _params(fn),
        inline_gpt_loss=_inline_if(files[GPT_FILE]) is not None,
        roll_tensor_params=() if roll is None else _params(roll),
        tracker_api=tracker_api,
        postprocess_output_processor=post is not None and 'output_processor' in _params(post),
        main_logits_projections=tuple(
            node.col_offset for node in main_logits_projections(post)
        ) if post is not None else (),
        process_mtp_loss_call=tuple(
            (kw.arg, ast.get_source_segment(files[GPT_FILE], kw.value))
            for kw in process_mtp_loss_call(post).keywords
        ) if post is not None and _inline_if(files[GPT_FILE]) is None else (),
        flops_tokens=_checked_flops_tokens(files.get(TRAINING_FILE)),
        mtp_detach_heads=_config_has_field(files[CONFIG_FILE], 'mtp_detach_heads'),
    )


def _config_has_field(text: str, name: str) -> bool:
    """Whether ``TransformerConfig`` of transformer_config.py's source declares ``name``."""
    return any(
        isinstance(node, ast.AnnAssign) and getattr(node.target, 'id', None) == name
        for node in _find_class(ast.parse(text), 'TransformerConfig').body
    )


#: What each top-level ``return`` of ``num_floating_point_operations`` calls, and whether that
#: branch counts a hybrid model.
FLOPS_RETURNS = {'hybrid_flops': True, 'transformer_flops': False}


def flops_function(text: str):
    """``num_floating_point_operations`` of training.py's source."""
    fn = _find_function(ast.parse(text).body, 'num_floating_point_operations')
    if fn is None or _params(fn)[:2] != ('args', 'batch_size'):
        raise PatchError(f'{TRAINING_FILE}: no num_floating_point_operations(args, batch_size, ...)')
    return fn


def flops_returns(fn) -> List[ast.Return]:
    """The ``return`` statements of ``num_floating_point_operations`` outside its nested
    functions, in file order: one ``return hybrid_flops(`` and one ``return transformer_flops()``."""
    found = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Return):
                found.append(node)
            for field in ('body', 'orelse', 'handlers', 'finalbody'):
                visit(getattr(node, field, None) or [])

    visit(fn.body)
    called = [ast.unparse(r.value.func) if isinstance(r.value, ast.Call) else None for r in found]
    if sorted(map(str, called)) != sorted(FLOPS_RETURNS):
        raise PatchError(f'{TRAINING_FILE}: num_floating_point_operations returns {called}, '
                         f'expected one return of each of {list(FLOPS_RETURNS)}')
    return sorted(found, key=lambda r: r.lineno)


def _checked_flops_tokens(text: Optional[str]) -> str:
    """:func:`flops_tokens` of training.py's source, its returns checked ('' without it)."""
    if text is None:
        return ''
    fn = flops_function(text)
    flops_returns(fn)
    return flops_tokens(fn)


def flops_tokens(fn) -> str:
    """How ``num_floating_point_operations`` (``fn``) counts the global batch's tokens."""
    if 'total_real_tokens_in_batch' in _params(fn):
        return 'total_real_tokens_in_batch'
    return 'batch_size * args.seq_length'


def _postprocess(text: str):
    """``GPTModel._postprocess`` of gpt_model.py's source (None if it has none)."""
    return _find_function(_find_class(ast.parse(text), 'GPTModel').body, '_postprocess')


def process_mtp_loss_call(post) -> ast.Call:
    """The one ``process_mtp_loss(...)`` call of ``_postprocess``."""
    calls = [n for n in ast.walk(post)
             if isinstance(n, ast.Call) and ast.unparse(n.func) == 'process_mtp_loss']
    if len(calls) != 1:
        raise PatchError(f'{GPT_FILE}: GPTModel._postprocess calls process_mtp_loss {len(calls)} '
                         'times (expected once)')
    return calls[0]


def main_logits_projections(post) -> List[ast.Assign]:
    """The ``logits, _ = self.output_layer(...)`` statements of ``_postprocess``, in file order."""
    found = []
    for node in ast.walk(post):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == 'self.output_layer'
            and isinstance(node.targets[0], ast.Tuple)
            and ast.unparse(node.targets[0].elts[0]) == 'logits'
        ):
            found.append(node)
    return sorted(found, key=lambda n: n.lineno)


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
    if not facts.main_logits_projections:
        problems.append(f'{GPT_FILE}: GPTModel has no _postprocess with a main-head projection '
                        '`logits, _ = self.output_layer(...)`')
    if not facts.tracker_api:
        problems.append(checks['tracker_problem']({}))
    else:
        problems.append(checks['tracker_problem']({facts.tracker_api[0]: facts.tracker_api[1:]}))
    return [p for p in problems if p]


def _inline_if(text: str) -> Optional[ast.If]:
    post = _postprocess(text)
    if post is None:
        return None
    for node in ast.walk(post):
        if isinstance(node, ast.If) and ast.unparse(node.test) == INLINE_CONDITION:
            return node
    return None


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
