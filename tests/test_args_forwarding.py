"""``--mtp-loss-type`` / ``--mtp-tv-chunk`` / ``--mtp-log-acceptance`` reach ``TransformerConfig``
through Megatron's own argument code, driven the way miles drives it
(``parse_args(extra_args_provider=...)`` with a provider that resets MTP defaults).

Runs in both modes: with the plugin (this checkout, ``install()``) and, under
``tools/run_patched_suite.py``, on megatron-core 0.19.2 patched with ``patches/`` (where the
fields are native TransformerConfig fields and nothing is installed).
"""

import pytest

import megatron.mtp_tv
from megatron.mtp_tv.config import MTP_LOSS_TYPES
from mtp_tv_dev.megatron_args import config_from_argv, miles_extra_args_provider, parse, reset_arg

import patch_mode

megatron.mtp_tv.install()  # a no-op in patch mode

# A small but complete model for validate_args (RoPE: MTP requires it).
BASE = [
    '--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', '4',
    '--seq-length', '128', '--max-position-embeddings', '128', '--position-embedding-type', 'rope',
    '--micro-batch-size', '1', '--global-batch-size', '8', '--train-iters', '10', '--lr', '1e-4',
    '--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '1000',
]


def test_mode_is_what_the_run_says():
    from megatron.core.transformer import transformer_config

    source = open(transformer_config.__file__).read()
    if patch_mode.active():
        assert 'mtp_loss_type: Literal' in source  # a native field of the patched tree
        assert megatron.mtp_tv.__name__ == 'megatron.core.transformer.mtp_tv'
    else:
        assert 'mtp_loss_type' not in source
        assert megatron.mtp_tv.is_installed()


def test_miles_style_provider_forwards_tv_flags_to_transformer_config(monkeypatch):
    argv = BASE + ['--enable-mtp-training', '--mtp-num-layers', '1',
                   '--mtp-loss-type', 'tv', '--mtp-tv-chunk', '512']
    args, config = config_from_argv(argv, monkeypatch, provider=miles_extra_args_provider)
    assert args.enable_mtp_training
    assert (config.mtp_loss_type, config.mtp_tv_chunk, config.mtp_log_acceptance) == ('tv', 512, False)
    assert config.mtp_num_layers == 1
    assert config.mtp_loss_scaling_factor == 0.2  # the provider's reset default survived


def test_e2e_tv_and_log_acceptance_flags(monkeypatch):
    argv = BASE + ['--mtp-num-layers', '2', '--mtp-loss-type', 'e2e_tv', '--mtp-log-acceptance']
    _, config = config_from_argv(argv, monkeypatch, provider=miles_extra_args_provider)
    assert (config.mtp_loss_type, config.mtp_tv_chunk, config.mtp_log_acceptance) == ('e2e_tv', 0, True)


def test_provider_can_reset_the_loss_type_default(monkeypatch):
    """The seed change's suggestion for miles: surface --mtp-loss-type with reset_arg."""

    def provider(parser):
        parser = miles_extra_args_provider(parser)
        reset_arg(parser, '--mtp-loss-type', type=str, default='tv')
        return parser

    _, config = config_from_argv(BASE + ['--mtp-num-layers', '1'], monkeypatch, provider=provider)
    assert config.mtp_loss_type == 'tv'


def test_flags_have_choices_and_help_from_the_field_docstrings(monkeypatch):
    from megatron.training.arguments import add_megatron_arguments
    import argparse

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions['mtp_loss_type'].choices) == MTP_LOSS_TYPES
    assert 'Training objective of the Multi-Token Prediction' in actions['mtp_loss_type'].help
    assert actions['mtp_tv_chunk'].type is int
    assert 'Tokens per chunk' in actions['mtp_tv_chunk'].help
    assert actions['mtp_tv_temperature'].type is float and actions['mtp_lk_eta'].type is float


def test_bad_values_are_rejected(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(BASE + ['--mtp-loss-type', 'lk_alpha'], miles_extra_args_provider, monkeypatch)
    assert exc.value.code == 2 and "invalid choice: 'lk_alpha'" in capsys.readouterr().err
    with pytest.raises(ValueError, match='mtp_num_layers'):
        config_from_argv(BASE + ['--mtp-loss-type', 'tv'], monkeypatch)
