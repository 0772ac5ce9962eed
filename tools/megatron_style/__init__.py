"""Megatron-LM's own code style, applied to what the patches ship into ``megatron/core``.

The settings are those of Megatron-LM's ``pyproject.toml`` (black 26 at line length 100 without
string normalisation or magic trailing commas; isort's black profile with ``megatron`` first
party) and of its ``.pylintrc`` (``pylintrc`` here: docstrings, unused imports, line length,
``print``), with the versions it pins (``requirements.txt``). ``tests/test_megatron_style.py``
holds the shipped modules to them; ``python -m tools.megatron_style`` rewrites the package's
modules in place.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
PYLINTRC = HERE / 'pylintrc'
#: The first line of every file Megatron-LM ships.
COPYRIGHT = re.compile(r'# Copyright \(c\) (\d{4}-)?\d{4}, NVIDIA CORPORATION\. All rights reserved\.$')
HEADER = '# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.'


def black_mode():
    """Megatron-LM's ``[tool.black]``."""
    import black

    return black.Mode(line_length=100, string_normalization=False, magic_trailing_comma=False)


def isort_config():
    """Megatron-LM's ``[tool.isort]``."""
    import isort

    return isort.Config(
        profile='black', line_length=100, py_version='312', known_first_party=['megatron'],
        known_third_party=['transformer_engine'], default_section='THIRDPARTY',
        sections=['FUTURE', 'STDLIB', 'THIRDPARTY', 'FIRSTPARTY', 'LOCALFOLDER'],
    )


def formatted(text: str) -> str:
    """``text`` as Megatron-LM's isort then black leave it."""
    import black
    import isort

    return black.format_str(isort.code(text, config=isort_config()), mode=black_mode())


def problems(files: Dict[str, str]) -> List[str]:
    """What Megatron-LM's checks find in ``{path: source}``: the header, formatting, pylint."""
    found = []
    for path, text in files.items():
        if not COPYRIGHT.match(text.split('\n', 1)[0]):
            found.append(f'{path}:1: no NVIDIA copyright header ({HEADER!r})')
        if formatted(text) != text:
            found.append(f'{path}: not formatted as black and isort with Megatron-LM\'s settings')
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for path, text in files.items():
            out = Path(tmp) / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            paths.append(str(out))
        run = subprocess.run(
            [sys.executable, '-m', 'pylint', f'--rcfile={PYLINTRC}', '--score=n', *paths],
            capture_output=True, text=True, cwd=tmp,
        )
        found += [line.replace(tmp + '/', '') for line in run.stdout.splitlines()
                  if line.strip() and not line.startswith('*****')]
    return found
