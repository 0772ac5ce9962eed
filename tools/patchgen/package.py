"""The package side: what a patch takes from ``megatron/mtp_tv``, read from its source.

The modules it ships (:func:`shipped_modules`), the ``TransformerConfig`` fields it copies
(:func:`fields_block`), the parameters of ``process_mtp_tv_loss`` and the literals and checks of
``plugin.py``. Read with :mod:`ast`, never imported: the package imports Megatron, the generator
must run without it.
"""

import ast
import re
import textwrap
from pathlib import Path
from typing import Dict, Sequence, Tuple

from .layout import REPO, TARGET_MODULE, TARGET_PACKAGE, TRAINING_MODULE_FILE, PatchError

#: The package source. Only this module reads it (tests point it at a changed copy).
PACKAGE_DIR = REPO / 'megatron' / 'mtp_tv'
#: Package files that only make sense for the plugin and are not shipped: a patched tree has the
#: feature in its own source (``install()`` is a no-op there).
NOT_SHIPPED = ('fields.py', 'launch.py', 'plugin.py', 'startup_hook.py', 'training_args.py')
#: Package modules of the training side: a patch installs each at the tree path given (nothing
#: under megatron/core imports them), its relative imports of the package made absolute.
TRAINING_SIDE = {'training_args.py': TRAINING_MODULE_FILE}
#: Shipped modules a patch installs outside the package: Megatron keeps its fused kernels under
#: ``megatron/core/fusions`` as ``fused_*`` modules. The package's relative imports of them are
#: rewritten to the tree's path (:func:`_relocated_imports`).
RELOCATED = {'triton_kernels.py': 'megatron/core/fusions/fused_mtp_tv_rows.py'}
#: The tests a patch ships, in Megatron-LM's own style: this folder's files go to the tree's
#: ``tests/unit_tests/`` (tools/run_upstream_tests.py runs them there).
UPSTREAM_TESTS_DIR = REPO / 'tests' / 'megatron_unit_tests'
UPSTREAM_TESTS_PATH = 'tests/unit_tests'


def shipped_modules() -> Dict[str, str]:
    """``{relative path in the package: source}`` of the modules a patch carries."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob('*.py')):
        rel = path.relative_to(PACKAGE_DIR)
        if rel.name in NOT_SHIPPED or '__pycache__' in rel.parts:
            continue
        text = _without_plugin_only(path.read_text(), rel.as_posix())
        _check_relocatable(rel.as_posix(), text)
        out[rel.as_posix()] = text
    return out


def _without_plugin_only(text: str, rel: str) -> str:
    """``text`` less its ``# BEGIN PLUGIN ONLY`` .. ``# END PLUGIN ONLY`` block (and the blank
    lines before it): code that only the plugin's copy of the package has."""
    begin, end = text.count('# BEGIN PLUGIN ONLY'), text.count('# END PLUGIN ONLY')
    if (begin, end) not in ((0, 0), (1, 1)):
        raise PatchError(f'megatron/mtp_tv/{rel}: unbalanced PLUGIN ONLY markers')
    return re.sub(r'\n*^# BEGIN PLUGIN ONLY.*?^# END PLUGIN ONLY\n', '\n', text, flags=re.S | re.M)


def shipped_tests() -> Dict[str, str]:
    """``{path in the patched tree: source}`` of the unit tests a patch ships."""
    return {
        f'{UPSTREAM_TESTS_PATH}/{path.relative_to(UPSTREAM_TESTS_DIR).as_posix()}': path.read_text()
        for path in sorted(UPSTREAM_TESTS_DIR.rglob('test_*.py'))
    }


def patch_files(facts) -> Dict[str, str]:
    """``{path in the patched tree: source}`` of every file the patch of a tree with ``facts``
    creates: :func:`new_files`, and the unit tests where the tree's ``GPTModel`` computes its MTP
    loss in ``process_mtp_loss``, the function they drive (not radixark's older miles-main
    trees, whose loss is inline in ``GPTModel._postprocess``)."""
    return {**new_files(), **({} if facts.inline_gpt_loss else shipped_tests())}


def new_files() -> Dict[str, str]:
    """``{path in the patched tree: source}`` of the modules every patch creates: the shipped
    modules under the core's package and the training side's modules."""
    out = {}
    for rel, text in shipped_modules().items():
        out[RELOCATED.get(rel, f'{TARGET_PACKAGE}/{rel}')] = _relocated_imports(rel, text)
    for rel, path in TRAINING_SIDE.items():
        text = (PACKAGE_DIR / rel).read_text()
        _check_relocatable(rel, text)
        out[path] = re.sub(r'^from \.(\w+) import', rf'from {TARGET_MODULE}.\1 import', text, flags=re.M)
    return out


def _relocated_imports(rel: str, text: str) -> str:
    """``text`` with its ``from . import <module>`` of each :data:`RELOCATED` module made
    ``from <its tree package> import <its tree name> as <module>``."""
    for module_file, tree_path in RELOCATED.items():
        module = module_file[:-3]
        package, name = tree_path[:-3].replace('/', '.').rsplit('.', 1)
        pattern = rf'^(\s*)from \. import {module}$'
        if rel == module_file:
            continue
        text = re.sub(pattern, rf'\1from {package} import {name} as {module}', text, flags=re.M)
        if re.search(rf'\bfrom \.{module} import|\bfrom \. import .*\b{module}\b', text):
            raise PatchError(f'megatron/mtp_tv/{rel} imports {module} other than as '
                             f'`from . import {module}` (the form a patch can relocate)')
    return text


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
    """The field definitions of ``MTPLossConfig``, as they appear in fields.py (4-space body)."""
    text = (PACKAGE_DIR / 'fields.py').read_text()
    match = re.search(r'^# BEGIN MTP_TV FIELDS.*?\n(.*?)^# END MTP_TV FIELDS', text, re.S | re.M)
    if not match:
        raise PatchError('megatron/mtp_tv/fields.py has no BEGIN/END MTP_TV FIELDS block')
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


def tv_loss_params() -> Tuple[str, ...]:
    """The ``process_mtp_loss`` parameters the MTP losses know (the plugin's list)."""
    return tuple(plugin_checks()['PROCESS_MTP_LOSS_PARAMS'])


def tv_loss_required_params() -> Tuple[str, ...]:
    """Those every known tree has."""
    return tuple(plugin_checks()['REQUIRED_PROCESS_MTP_LOSS_PARAMS'])


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


#: What megatron/mtp_tv/plugin.py knows of Megatron's MTP code, and its checks of it: the same
#: literals and functions install() uses, read from the source (the generator does not import
#: the package, which imports Megatron).
_PLUGIN_CHECKS = (
    'PROCESS_MTP_LOSS_PARAMS', 'REQUIRED_PROCESS_MTP_LOSS_PARAMS', 'ROLL_TENSOR_FORMS', 'TRACKER_APIS', 'roll_tensor_problem',
    'tracker_problem', 'process_mtp_loss_problem',
)


def plugin_checks() -> Dict[str, object]:
    nodes = _module_level(PACKAGE_DIR / 'plugin.py', _PLUGIN_CHECKS)
    namespace: Dict[str, object] = {'Dict': Dict, 'Tuple': Tuple, 'Sequence': Sequence}
    module = ast.Module(body=[nodes[n] for n in _PLUGIN_CHECKS], type_ignores=[])
    exec(compile(module, str(PACKAGE_DIR / 'plugin.py'), 'exec'), namespace)
    return namespace
