"""The loss registry is the one list of loss names: every other list agrees with it."""

import sys
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from megatron.mtp_tv import config
from megatron.mtp_tv.fields import MTPLossConfig
from megatron.mtp_tv.losses import LOSSES, DraftLoss, loss_from_config, make_loss
from mtp_tv_dev import reference

ROOT = Path(__file__).resolve().parents[1]


def test_mtp_loss_type_choices_are_cross_entropy_then_the_registry():
    assert config.MTP_LOSS_TYPES == config.CROSS_ENTROPY_NAMES + tuple(LOSSES)
    # The Literal is spelled out in the field (the patches copy its source); it must agree.
    literal = get_type_hints(MTPLossConfig)['mtp_loss_type']
    assert get_args(literal) == config.MTP_LOSS_TYPES


def test_every_registered_loss_is_a_named_draft_loss_with_a_float64_reference():
    for name, cls in LOSSES.items():
        assert issubclass(cls, DraftLoss) and cls.name == name
        assert cls.grad_bound > 0
    # mtp_tv_dev/reference.py writes each loss from its equations; a new loss needs one there.
    assert set(reference.LOSS_TYPES) == set(LOSSES)


def test_hyperparameters_are_config_fields_read_by_loss_from_config():
    fields = {f for f in MTPLossConfig.__dataclass_fields__}
    for name, cls in LOSSES.items():
        for arg, field in cls.config_fields.items():
            assert field in fields, (name, field)
            default = MTPLossConfig.__dataclass_fields__[field].default
            built = loss_from_config(MTPLossConfig(mtp_loss_type=name, **{field: default}))
            assert getattr(built, arg) == default
    lk = loss_from_config(MTPLossConfig(mtp_loss_type='lk', mtp_lk_eta=0.5))
    assert lk.eta == 0.5


def test_unknown_loss_names_the_registry():
    with pytest.raises(ValueError, match=r"loss_type='tv2'; expected one of \['tv', 'e2e_tv'"):
        make_loss('tv2')


def test_the_cpu_demo_arms_cover_the_registry():
    sys.path.insert(0, str(ROOT / 'examples'))
    try:
        from cpu_demo_lib import arms
    finally:
        sys.path.remove(str(ROOT / 'examples'))
    # A list of its own: the demo checks its command line before importing torch.
    assert set(arms.LOSSES) == {'ce'} | set(LOSSES)
