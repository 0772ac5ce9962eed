"""What the patches ship into a Megatron tree follows Megatron-LM's own style: its copyright
header, black and isort with its ``pyproject.toml`` settings, and its ``.pylintrc`` checks (a
docstring on every public function and class, no unused import, lines within 100 characters,
no ``print``), at the versions Megatron-LM pins (``tools/megatron_style``)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
sys.path.insert(0, str(ROOT))

pytest.importorskip('black', reason="Megatron-LM's black (requirements.txt)")
pytest.importorskip('isort', reason="Megatron-LM's isort (requirements.txt)")


def test_shipped_modules_follow_megatron_style():
    from patchgen.package import new_files, shipped_tests

    from tools.megatron_style import problems

    found = problems({**new_files(), **shipped_tests()})
    assert not found, '\n'.join(found)


def test_the_check_finds_what_megatron_refuses():
    """Each kind of problem is found: a missing header, unformatted code, a public function
    without docstring, a line over 100 characters, an unused import, a print."""
    from tools.megatron_style import HEADER, problems

    good = f'{HEADER}\n"""A module."""\n\n\ndef f():\n    """A function."""\n    return 1\n'
    assert problems({'good.py': good}) == []
    bad = {
        'header.py': good.replace(HEADER + '\n', ''),
        'format.py': good.replace('return 1', 'return  1'),
        'doc.py': good.replace('    """A function."""\n', ''),
        'long.py': good.replace('return 1', 'return ' + ' + '.join(['1'] * 40)),
        'unused.py': good.replace('"""A module."""\n', '"""A module."""\n\nimport os\n'),
        'print.py': good.replace('return 1', 'print(1)'),
    }
    found = problems(bad)
    for name, needle in (('header.py', 'copyright'), ('format.py', 'black'),
                         ('doc.py', 'C0116'), ('long.py', 'C0301'), ('unused.py', 'W0611'),
                         ('print.py', 'W0141')):
        assert any(line.startswith(name) and needle in line for line in found), (name, found)


def test_shipped_modules_point_to_nothing_the_patch_does_not_ship():
    """A patched tree has no ``docs/`` of this project and no plugin: the shipped modules name
    neither (a reader of the tree could not follow them)."""
    import re

    from patchgen.package import new_files

    pattern = re.compile(r'docs/\w+\.md|\bfields\.py\b|\binstall\(\)|\bplugin\b')
    found = [f'{path}:{i}: {line.strip()}' for path, text in new_files().items()
             for i, line in enumerate(text.split('\n'), 1) if pattern.search(line)]
    assert not found, '\n'.join(found)


def test_no_shipped_function_takes_over_ten_parameters():
    """Grouped inputs instead of long signatures; aside: ``process_mtp_tv_loss``, which takes
    Megatron's ``process_mtp_loss`` arguments as they are, and Triton kernels (pointers,
    strides and block sizes are their interface)."""
    import ast

    from patchgen.package import new_files

    mirrors_megatron = {'process_mtp_tv_loss'}
    long = []
    for path, text in new_files().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len(a.posonlyargs + a.args + a.kwonlyargs) - (
                    1 if a.args and a.args[0].arg in ('self', 'cls', 'ctx') else 0)
                kernel = any(ast.unparse(d).endswith('jit') for d in node.decorator_list)
                if count > 10 and node.name not in mirrors_megatron and not kernel:
                    long.append(f'{path}:{node.lineno}: {node.name} takes {count}')
    assert not long, '\n'.join(long)


def test_the_triton_kernels_ship_where_megatron_keeps_fused_kernels():
    """``megatron/core/fusions/fused_*.py``, and the package imports them from there."""
    from patchgen.layout import TARGET_PACKAGE
    from patchgen.package import new_files

    files = new_files()
    assert 'megatron/core/fusions/fused_mtp_tv_rows.py' in files
    assert f'{TARGET_PACKAGE}/triton_kernels.py' not in files
    row_ops = files[f'{TARGET_PACKAGE}/row_ops.py']
    assert 'from megatron.core.fusions import fused_mtp_tv_rows as triton_kernels' in row_ops
    assert 'from . import triton_kernels' not in row_ops
