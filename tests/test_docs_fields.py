"""Every config field, flag, choice and default the README and docs/ name is the code's.

The docs-links test checks that links resolve; this one checks the words: a field that no longer
exists, a misspelt one, a choice a ``Literal`` does not hold, a default the dataclass does not
have, or a flag Megatron's argument factory does not build, named anywhere in README.md or
docs/*.md inside backticks, fails here (so the next drift is found by the suite, not a user).
"""

import argparse
import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

import megatron.mtp_tv
from megatron.mtp_tv.fields import MTPLossConfig

megatron.mtp_tv.install()

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
SPAN = re.compile(r'`([^`\n]+)`')
FIELD_WORD = re.compile(r'(?<![\w.])(mtp_[a-z][a-z0-9_]*)\b')
ASSIGNMENT = re.compile(r'(?<![\w.])(mtp_[a-z][a-z0-9_]*)\s*=\s*([^,)\s]+)')
FLAG = re.compile(r'(?<![\w-])(--mtp-[a-z0-9-]+)')
#: ``mtp_*`` words in the docs that are not config fields: modules and packages, the metrics
#: Megatron's tracker logs, Megatron's and miles' own non-field identifiers the docs quote, and
#: the variables and the function (``mtp_loss_inputs``) the patches write into Megatron's files.
NOT_FIELDS = {'mtp_tv', 'mtp_tv_dev', 'mtp_loss', 'mtp_block_spec', 'mtp_kwargs', 'mtp_labels',
              'mtp_in_postprocess', 'mtp_on_this_rank', 'mtp_standalone', 'mtp_tv_drafts', 'mtp_tv_kwargs',
              'mtp_tv_hidden_states', 'mtp_tv_inputs', 'mtp_loss_inputs', 'mtp_hsm'}  # mtp_hsm: a field of NVIDIA main, not of the megatron-core pinned here
METRIC = re.compile(r'mtp_(\d+|\{[a-z]\})(_[a-z_]+)?$|mtp_expected_[a-z_]+$')


def _transformer_config_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name: f for f in dataclasses.fields(TransformerConfig)}


def _spans():
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for span in SPAN.findall(line):
                yield f'{page.relative_to(ROOT)}:{number}', span


def _is_field_name(word, fields):
    return word in fields or word in NOT_FIELDS or METRIC.match(word)


def test_every_mtp_word_in_backticks_is_a_field_or_a_known_name():
    fields = _transformer_config_fields()
    unknown = sorted({f'{where}: {word}' for where, span in _spans()
                      for word in FIELD_WORD.findall(span)
                      if not _is_field_name(word, fields) and not span.endswith('.py')
                      and f'{word}.py' not in span and f'{word}(' not in span})
    assert not unknown, unknown


def _choices(name):
    annotation = typing.get_type_hints(MTPLossConfig)[name]
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def test_every_assignment_names_a_field_and_a_value_it_accepts():
    fields = _transformer_config_fields()
    ours = {f.name for f in dataclasses.fields(MTPLossConfig)}
    bad = []
    for where, span in _spans():
        for name, value in ASSIGNMENT.findall(span):
            if name in NOT_FIELDS:
                continue
            if name not in fields:
                bad.append(f'{where}: {name} is not a TransformerConfig field ({span})')
            elif name in ours and _choices(name) and value.startswith("'"):
                if ast.literal_eval(value.rstrip('.;')) not in _choices(name):
                    bad.append(f'{where}: {name}={value} is not one of {_choices(name)}')
    assert not bad, bad


def test_every_flag_is_one_megatrons_argument_factory_builds():
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    missing = sorted({f'{where}: {flag}' for where, span in _spans() if '.py' not in span
                      for flag in FLAG.findall(span) if flag not in flags})  # not a tool's
    assert not missing, missing


def _readme_configuration_rows():
    text = (ROOT / 'README.md').read_text()
    table = text.split('## Configuration', 1)[1].split('\n## ', 1)[0]
    for line in table.splitlines():
        if line.startswith('| `mtp_'):
            name = SPAN.findall(line)[0]
            yield name, line.split('|')[2]


def test_the_readme_configuration_table_is_the_dataclass():
    rows = dict(_readme_configuration_rows())
    ours = {f.name: f for f in dataclasses.fields(MTPLossConfig)}
    assert set(rows) == set(ours), set(rows) ^ set(ours)
    for name, cell in rows.items():
        spans = SPAN.findall(cell)
        assert repr(ours[name].default) == spans[-1], (name, spans[-1], ours[name].default)
        if _choices(name):
            assert spans[0] == f'Literal[{", ".join(map(repr, _choices(name)))}]', (name, spans[0])


@pytest.mark.parametrize('span,words', [
    ("mtp_tv_chunks=4", ['mtp_tv_chunks']), ("--mtp-tv-targets", [])])
def test_the_patterns_see_a_misspelt_field(span, words):
    fields = _transformer_config_fields()
    assert [w for w in FIELD_WORD.findall(span) if not _is_field_name(w, fields)] == words
