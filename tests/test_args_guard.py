"""The MTP loss stops, never falls back, when the config is not what was asked for.

* Megatron's parsed arguments ask for one loss and the model's config holds another (the config
  was built without them): building the model (Megatron's ``get_model``; in plugin mode already
  its MTP block) raises ``ValueError`` naming both.
* A bad value assigned after construction (which skips ``__post_init__``): a ``ValueError`` at
  the loss (``MTPLossOptions``' own checks) naming the value and the same rule as construction's,
  instead of a ``KeyError`` deep in the loss code.
"""

import pytest
import torch

import megatron.mtp_tv
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss
from mtp_tv_dev.megatron_args import miles_extra_args_provider, parse
from test_args_forwarding import BASE

megatron.mtp_tv.install()

VOCAB, SEQ = 32, 8


def _step(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    loss = forward_loss(model, tokens[:, :-1], tokens[:, 1:], torch.ones(1, SEQ))
    loss.mean().backward()


def _model(**config):
    return build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=16, seq_length=SEQ, **config)


def _get_model(args, **config):
    """A model as Megatron's ``get_model`` builds it: the provider's model, then the arguments
    applied to its config (``megatron/training/mtp_tv_args.py`` in a patched tree)."""
    from megatron.mtp_tv.training_args import apply_mtp_loss_args

    model = _model(**config)
    apply_mtp_loss_args([model], args)
    return model


@pytest.fixture
def megatron_args(monkeypatch):
    """``set(argv)``: Megatron's ``parse_args`` on ``argv`` (miles' provider), made the global
    arguments as ``set_args`` does; unset again after the test."""
    import megatron.training.global_vars as global_vars

    def set_(argv):
        args = parse(BASE + argv, miles_extra_args_provider, monkeypatch)
        monkeypatch.setattr(global_vars, '_GLOBAL_ARGS', args)
        return args

    return set_


@pytest.mark.parametrize('held', [
    'ce',  # Megatron's own CE loss
    'kl',  # one of this package's losses
])
def test_arguments_asking_for_another_loss_stop_the_model_construction(megatron_args, held):
    args = megatron_args(['--mtp-num-layers', '2', '--mtp-loss-type', 'tv', '--mtp-tv-temperature',
                          '0.5'])
    with single_process():
        with pytest.raises(ValueError) as err:
            _get_model(args, mtp_loss_type=held)  # its config not built from the arguments
    message = str(err.value)
    assert "--mtp-loss-type 'tv'" in message and f"mtp_loss_type={held!r}" in message
    assert "--mtp-tv-temperature 0.5" in message and 'mtp_tv_temperature=1.0' in message
    assert "provider.mtp_loss_type = 'tv'" in message  # how to fix it


def test_arguments_at_their_defaults_ask_for_nothing(megatron_args):
    # A config set up in code ('tv') while the command line left the flag alone trains.
    args = megatron_args(['--mtp-num-layers', '2'])
    with single_process():
        _step(_get_model(args, mtp_loss_type='tv'))


def test_arguments_matching_the_config_train(megatron_args):
    args = megatron_args(['--mtp-num-layers', '2', '--mtp-loss-type', 'cross_entropy'])  # == 'ce'
    with single_process():
        _step(_get_model(args, mtp_loss_type='ce'))


@pytest.mark.parametrize('field,bad', [('mtp_loss_type', 'TV'), ('mtp_tv_chunk', -1)])
def test_bad_value_assigned_after_construction_is_refused_at_the_loss(field, bad):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {'mtp_loss_type': 'tv', field: bad}
    with pytest.raises(ValueError) as at_construction:
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, mtp_num_layers=2,
                          **fields)
    with single_process():
        model = _model(mtp_loss_type='tv')
        setattr(model.config, field, bad)  # dataclass assignment: no __post_init__
        with pytest.raises(ValueError) as at_loss:
            _step(model)
    loss_error, construction_error = str(at_loss.value), str(at_construction.value)
    assert f'={bad!r}' in loss_error and f'{field}={bad!r}' in construction_error
    if field == 'mtp_loss_type':  # the allowed losses: the registry's, in both
        assert "'tv', 'e2e_tv', 'kl', 'lk', 'nla']" in loss_error
        assert "'tv', 'e2e_tv', 'kl', 'lk', 'nla']" in construction_error
    else:  # the same rule
        assert loss_error.split(' is invalid; ')[1] == construction_error.split(' is invalid; ')[1]
