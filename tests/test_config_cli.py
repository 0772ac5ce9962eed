"""Config fields, validation, and Megatron's own CLI with the plugin installed."""

import argparse
import dataclasses
import sys

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.plugin import field_docstrings

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
    config = MLATransformerConfig(**BASE, mtp_num_layers=1, mtp_loss_type='e2e_tv', mtp_tv_chunk=512)
    assert (config.mtp_loss_type, config.mtp_tv_chunk) == ('e2e_tv', 512)
    # Megatron's own fields and defaults are untouched.
    assert TransformerConfig(**BASE).mtp_loss_scaling_factor == 0.1


def test_install_is_idempotent():
    before = dataclasses.fields(TransformerConfig)
    megatron.mtp_tv.install()
    from megatron.mtp_tv.plugin import add_config_fields

    add_config_fields(TransformerConfig)
    assert dataclasses.fields(TransformerConfig) == before


@pytest.mark.parametrize(
    'kwargs,message',
    [
        (dict(mtp_num_layers=1, mtp_loss_type='kl'), "mtp_loss_type='kl' is not supported; choose one of ['ce', 'tv', 'e2e_tv']"),
        (dict(mtp_num_layers=1, mtp_tv_chunk=-1), 'mtp_tv_chunk=-1 is invalid'),
        (dict(mtp_num_layers=1, mtp_tv_chunk=2.5), 'mtp_tv_chunk=2.5 is invalid'),
        (dict(mtp_loss_type='tv'), "mtp_loss_type='tv' trains MTP heads, but mtp_num_layers=None"),
        (dict(mtp_num_layers=0, mtp_loss_type='e2e_tv'), 'mtp_num_layers=0'),
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
    docs = field_docstrings(megatron.mtp_tv.MTPLossConfig)
    loss_type = actions['mtp_loss_type']
    assert loss_type.option_strings == ['--mtp-loss-type']
    assert tuple(loss_type.choices) == ('ce', 'tv', 'e2e_tv') and loss_type.default == 'ce'
    assert actions['mtp_tv_chunk'].option_strings == ['--mtp-tv-chunk'] and actions['mtp_tv_chunk'].type is int
    assert actions['mtp_log_acceptance'].option_strings == ['--mtp-log-acceptance']
    for name in ('mtp_loss_type', 'mtp_tv_chunk', 'mtp_log_acceptance'):
        assert actions[name].help == ' '.join(docs[name].split()) and len(docs[name]) > 40


def test_parse_args_round_trip_into_transformer_config(monkeypatch):
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', [
        'pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '8', '--num-attention-heads', '2',
        '--no-rope-fusion', '--mtp-num-layers', '2', '--mtp-loss-type', 'e2e_tv',
        '--mtp-tv-chunk', '64', '--mtp-log-acceptance',
    ])
    args = parse_args()
    assert (args.mtp_loss_type, args.mtp_tv_chunk, args.mtp_log_acceptance) == ('e2e_tv', 64, True)
    args.params_dtype = torch.float32
    config = core_transformer_config_from_args(args)
    assert (config.mtp_loss_type, config.mtp_tv_chunk, config.mtp_log_acceptance) == ('e2e_tv', 64, True)


def test_cli_rejects_unknown_loss_type(monkeypatch, capsys):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', ['x', '--mtp-loss-type', 'kl'])
    with pytest.raises(SystemExit):
        parse_args()
    assert "invalid choice: 'kl'" in capsys.readouterr().err
