"""Config fields, validation, and Megatron's own CLI with the plugin installed."""

import argparse
import dataclasses
import sys

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.config import MTP_LOSS_TYPES
from megatron.mtp_tv.row_ops import ROW_KERNELS
from megatron.mtp_tv.fields import MTPLossConfig, field_docstrings

megatron.mtp_tv.install()

from megatron.core.transformer.transformer_config import (  # noqa: E402
    MLATransformerConfig,
    TransformerConfig,
)

BASE = dict(num_layers=2, hidden_size=8, num_attention_heads=2)


def test_fields_are_real_dataclass_fields_on_every_subclass():
    for cls in (TransformerConfig, MLATransformerConfig):
        names = {f.name: f for f in dataclasses.fields(cls)}
        assert names['mtp_loss_type'].default == 'ce'
        assert names['mtp_tv_chunk'].default == 0
        assert names['mtp_log_acceptance'].default is False
        assert names['mtp_tv_temperature'].default == 1.0 and names['mtp_lk_eta'].default == 3.0
    config = MLATransformerConfig(**BASE, mtp_num_layers=1, mtp_loss_type='e2e_tv', mtp_tv_chunk=512)
    assert (config.mtp_loss_type, config.mtp_tv_chunk) == ('e2e_tv', 512)
    # Megatron's own fields and defaults are untouched.
    assert TransformerConfig(**BASE).mtp_loss_scaling_factor == 0.1


@pytest.mark.plugin_only
def test_install_is_idempotent():
    before = dataclasses.fields(TransformerConfig)
    megatron.mtp_tv.install()
    from megatron.mtp_tv.plugin import add_config_fields

    add_config_fields(TransformerConfig)
    assert dataclasses.fields(TransformerConfig) == before


@pytest.mark.parametrize(
    'kwargs,message',
    [
        (dict(mtp_num_layers=1, mtp_loss_type='lk_alpha'),
         f"mtp_loss_type='lk_alpha' is not supported; choose one of {list(MTP_LOSS_TYPES)}"),
        (dict(mtp_num_layers=1, mtp_tv_temperature=0.0), 'mtp_tv_temperature=0.0 is invalid; it must be a finite number > 0'),
        (dict(mtp_num_layers=1, mtp_tv_temperature=-0.7), 'mtp_tv_temperature=-0.7 is invalid'),
        (dict(mtp_num_layers=1, mtp_tv_temperature=float('nan')), 'mtp_tv_temperature=nan is invalid'),
        (dict(mtp_num_layers=1, mtp_tv_temperature=float('inf')), 'mtp_tv_temperature=inf is invalid'),
        (dict(mtp_num_layers=1, mtp_tv_temperature=True), 'mtp_tv_temperature=True is invalid'),
        (dict(mtp_num_layers=1, mtp_lk_eta=-1.0), 'mtp_lk_eta=-1.0 is invalid; it must be a finite number >= 0'),
        (dict(mtp_num_layers=1, mtp_lk_eta=float('nan')), 'mtp_lk_eta=nan is invalid'),
        (dict(mtp_loss_type='kl'), "mtp_loss_type='kl' trains MTP heads, but mtp_num_layers=None"),
        (dict(mtp_num_layers=1, mtp_tv_chunk=-1), 'mtp_tv_chunk=-1 is invalid'),
        (dict(mtp_num_layers=1, mtp_tv_chunk=2.5), 'mtp_tv_chunk=2.5 is invalid'),
        (dict(mtp_loss_type='tv'), "mtp_loss_type='tv' trains MTP heads, but mtp_num_layers=None"),
        (dict(mtp_num_layers=0, mtp_loss_type='e2e_tv'), 'mtp_num_layers=0'),
        (dict(mtp_num_layers=1, mtp_tv_kernels='cuda'),
         "mtp_tv_kernels='cuda' is not supported; choose one of ['auto', 'torch', 'triton']"),
    ],
)
def test_bad_values_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError) as err:
        TransformerConfig(**BASE, **kwargs)
    assert message in str(err.value)
    with pytest.raises(ValueError):
        MLATransformerConfig(**BASE, **kwargs)


def _megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    return {action.dest: action for action in parser._actions}


def test_flags_come_from_megatrons_argument_factory_with_help():
    actions = _megatron_parser()
    docs = field_docstrings(MTPLossConfig)
    loss_type = actions['mtp_loss_type']
    assert loss_type.option_strings == ['--mtp-loss-type']
    assert tuple(loss_type.choices) == MTP_LOSS_TYPES
    assert loss_type.default == 'ce'
    assert actions['mtp_tv_chunk'].option_strings == ['--mtp-tv-chunk'] and actions['mtp_tv_chunk'].type is int
    assert actions['mtp_log_acceptance'].option_strings == ['--mtp-log-acceptance']
    for name in ('mtp_tv_temperature', 'mtp_lk_eta'):
        assert actions[name].option_strings == ['--' + name.replace('_', '-')]
        assert actions[name].type is float
    assert tuple(actions['mtp_tv_kernels'].choices) == ROW_KERNELS  # the row ops' own list
    for name in (f.name for f in dataclasses.fields(MTPLossConfig)):
        assert actions[name].help == ' '.join(docs[name].split()) and len(docs[name]) > 40


def test_parse_args_round_trip_into_transformer_config(monkeypatch):
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', [
        'pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '8', '--num-attention-heads', '2',
        '--no-rope-fusion', '--mtp-num-layers', '2', '--mtp-loss-type', 'e2e_tv',
        '--mtp-tv-chunk', '64', '--mtp-log-acceptance', '--mtp-tv-temperature', '0.7',
        '--mtp-lk-eta', '2.5', '--mtp-tv-kernels', 'torch',
    ])
    args = parse_args()
    fields = ('mtp_loss_type', 'mtp_tv_chunk', 'mtp_log_acceptance', 'mtp_tv_temperature', 'mtp_lk_eta',
              'mtp_tv_kernels')
    expected = ('e2e_tv', 64, True, 0.7, 2.5, 'torch')
    assert tuple(getattr(args, f) for f in fields) == expected
    args.params_dtype = torch.float32
    config = core_transformer_config_from_args(args)
    assert tuple(getattr(config, f) for f in fields) == expected


@pytest.mark.parametrize('loss_type', ['kl', 'lk', 'nla', 'cross_entropy'])
def test_cli_accepts_the_new_loss_types(monkeypatch, loss_type):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', [
        'pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '8', '--num-attention-heads', '2',
        '--mtp-num-layers', '1', '--mtp-loss-type', loss_type,
    ])
    assert parse_args().mtp_loss_type == loss_type


def test_cli_rejects_unknown_loss_type(monkeypatch, capsys):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', ['x', '--mtp-loss-type', 'lk_alpha'])
    with pytest.raises(SystemExit):
        parse_args()
    assert "invalid choice: 'lk_alpha'" in capsys.readouterr().err


def test_the_fields_are_the_settings_a_user_makes():
    """Seven fields: the loss, its chunk, temperature and hyper-parameter, the row kernels, the
    metrics with 'ce' and the chunked 'ce'. Where the target comes from (the main logits where
    the model has them) and how backward runs are the loss's own business, not settings."""
    assert [f.name for f in dataclasses.fields(MTPLossConfig)] == [
        'mtp_loss_type', 'mtp_tv_chunk', 'mtp_tv_temperature', 'mtp_lk_eta', 'mtp_tv_kernels',
        'mtp_log_acceptance', 'mtp_ce_chunked']


@pytest.mark.parametrize('flag', ['--mtp-tv-target', '--mtp-tv-backward'])
def test_a_removed_debugging_flag_is_refused_by_name(monkeypatch, capsys, flag):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', ['x', '--mtp-num-layers', '1', flag, 'projection'])
    with pytest.raises(SystemExit):
        parse_args()
    assert f'unrecognized arguments: {flag}' in capsys.readouterr().err
