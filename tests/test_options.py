"""MTPLossOptions: every value checked once, when the options are built, and built from a
``TransformerConfig``'s fields as the Megatron glue builds them."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES, CrossEntropy, LKLoss, TVLoss
from megatron.mtp_tv.config import MTP_LOSS_TYPES, MTPLossOptions, draft_objective


@pytest.mark.parametrize('name', MTP_LOSS_TYPES)
def test_a_loss_name_becomes_its_class(name):
    options = MTPLossOptions(name)
    expected = CrossEntropy if name in ('ce', 'cross_entropy') else LOSSES[name]
    assert type(options.loss) is expected and options.loss.name == expected.name


def test_defaults_and_derived_values():
    options = MTPLossOptions('tv', temperature=2)
    assert (options.chunk_size, options.kernels, options.metrics) == (0, 'auto', False)
    assert isinstance(options.temperature, float) and options.inv_temperature == 0.5
    loss = LKLoss(eta=1.5)
    assert MTPLossOptions(loss).loss is loss  # a DraftLoss is kept as given
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.chunk_size = 4


@pytest.mark.parametrize('kwargs,message', [
    (dict(loss='TV'), r"loss='TV'; expected a DraftLoss or one of \['ce', 'cross_entropy', 'tv'"),
    (dict(loss=3), r'loss=3; expected'),
    (dict(loss='tv', chunk_size=-1), r'chunk_size=-1 is invalid; it must be an int >= 0'),
    (dict(loss='tv', chunk_size=True), r'chunk_size=True is invalid; it must be'),
    (dict(loss='tv', chunk_size=2.0), r'chunk_size=2.0 is invalid; it must be'),
    (dict(loss='tv', temperature=0), r'temperature=0 is invalid; it must be a finite number > 0'),
    (dict(loss='tv', temperature=-0.5), r'temperature=-0.5 is invalid; it must be'),
    (dict(loss='tv', temperature=math.inf), r'temperature=inf is invalid; it must be'),
    (dict(loss='tv', temperature=math.nan), r'temperature=nan is invalid; it must be'),
    (dict(loss='tv', temperature=True), r'temperature=True is invalid; it must be'),
    (dict(loss='tv', temperature='1'), r"temperature='1' is invalid; it must be"),
    (dict(loss='ce', temperature=0.7), r"temperature=0.7: the 'ce' loss is at temperature 1"),
    (dict(loss='tv', kernels='cuda'), r"kernels='cuda' is not supported; choose one of \['auto', 'torch', 'triton'\]"),
    (dict(loss='tv', metrics=1), r'metrics=1 is invalid; it must be True or False'),
])
def test_bad_values_raise_naming_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MTPLossOptions(**kwargs)


def test_the_loss_takes_options_not_a_loss_name():
    draft, weight = torch.randn(1, 4, 1, 8), torch.randn(16, 8)
    with pytest.raises(TypeError, match="options must be an MTPLossOptions, got 'tv'"):
        linear_tv_loss(draft, torch.randn(4, 1, 8), weight, torch.ones(1, 4, 1), 'tv')


def _config(loss_type, **fields):
    defaults = dict(mtp_tv_chunk=0, mtp_tv_temperature=1.0, mtp_tv_kernels='auto', mtp_lk_eta=3.0,
                    mtp_log_acceptance=False, mtp_ce_chunked=False)
    return SimpleNamespace(mtp_loss_type=loss_type, **{**defaults, **fields})


def test_from_config_reads_the_fields():
    config = _config('lk', mtp_tv_chunk=96, mtp_tv_temperature=0.7, mtp_tv_kernels='torch',
                     mtp_lk_eta=1.5)
    options = MTPLossOptions.from_config(config, metrics=True)
    assert type(options.loss) is LKLoss and options.loss.eta == 1.5
    assert (options.chunk_size, options.temperature, options.kernels, options.metrics) == (
        96, 0.7, 'torch', True)
    assert not MTPLossOptions.from_config(config, metrics=False).metrics


@pytest.mark.parametrize('ce_name', ['ce', 'cross_entropy'])
@pytest.mark.parametrize('chunked,log_acceptance,metrics_only,loss,metrics', [
    (True, False, False, CrossEntropy, False),  # chunked CE: no target, so no metrics
    (True, True, False, CrossEntropy, True),  # ... unless mtp_log_acceptance asks for them
    (False, True, True, TVLoss, True),  # the metrics-only pass of Megatron's 'ce': 'tv''s sums
    (True, True, True, TVLoss, True),
])
def test_from_config_of_cross_entropy(ce_name, chunked, log_acceptance, metrics_only, loss, metrics):
    config = _config(ce_name, mtp_ce_chunked=chunked, mtp_log_acceptance=log_acceptance)
    options = MTPLossOptions.from_config(config, metrics=True, metrics_only=metrics_only)
    assert type(options.loss) is loss and options.metrics == metrics
    assert options.with_target == (loss is TVLoss or log_acceptance)
    assert type(draft_objective(config, metrics_only)) is loss
