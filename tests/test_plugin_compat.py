"""``install()`` on a megatron-core whose MTP code differs from what the package knows.

It must either work or fail at install time, before changing anything, with an error naming
what it does not support (a ``process_mtp_loss`` parameter, a ``roll_tensor`` form, the
tracker's API); never a ``TypeError`` at the first forward or a silently wrong loss. NVIDIA
dev's extra ``process_mtp_loss`` parameter ``sequence_roll_context`` is supported.
"""

import inspect

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv import plugin
from mtp_tv_dev.contiguous import with_extra_parameter as _with_extra_parameter
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss

pytestmark = pytest.mark.plugin_only

megatron.mtp_tv.install()


def _mtp():
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction


def _original_process_mtp_loss():
    return inspect.unwrap(_mtp().process_mtp_loss)


def test_this_megatron_core_is_known():
    plugin.check_megatron()


def test_install_refuses_an_unknown_process_mtp_loss_parameter_and_changes_nothing(monkeypatch):
    mtp = _mtp()
    monkeypatch.setattr(
        mtp, 'process_mtp_loss', _with_extra_parameter(_original_process_mtp_loss(), 'halo_plan')
    )
    monkeypatch.setattr(plugin, '_installed', False)
    monkeypatch.setattr(plugin, '_has_fields', lambda cls: False)  # as on a fresh megatron-core
    changed = []
    monkeypatch.setattr(plugin, 'add_config_fields', lambda base: changed.append('fields'))
    monkeypatch.setattr(plugin, '_install_loss', lambda: changed.append('loss'))
    monkeypatch.setattr(plugin, '_install_metrics_logging', lambda: changed.append('metrics'))
    with pytest.raises(plugin.UnsupportedMegatronError) as err:
        megatron.mtp_tv.install()
    message = str(err.value)
    assert "process_mtp_loss has parameter(s) ['halo_plan']" in message, message
    assert mtp.__file__ in message and 'left unchanged' in message
    assert changed == [] and not plugin.is_installed()


@pytest.mark.parametrize(
    'attribute,change,expected',
    [
        ('roll_tensor', lambda fn: _with_extra_parameter(fn, 'fill_value'),
         "has unknown parameter(s) ['fill_value']"),
        ('roll_tensor', lambda fn: (lambda tensor_list, shifts=-1: None),
         "roll_tensor's first parameter is 'tensor_list'"),
    ],
)
def test_check_names_an_unknown_roll_tensor_form(monkeypatch, attribute, change, expected):
    mtp = _mtp()
    monkeypatch.setattr(mtp, attribute, change(getattr(mtp, attribute)))
    with pytest.raises(plugin.UnsupportedMegatronError) as err:
        plugin.check_megatron()
    assert expected in str(err.value), str(err.value)


def test_check_names_a_missing_process_mtp_loss(monkeypatch):
    """radixark miles-main at 36ceb4fc0: the MTP loss is inline, nothing to wrap."""
    monkeypatch.delattr(_mtp(), 'process_mtp_loss')
    with pytest.raises(plugin.UnsupportedMegatronError, match='no process_mtp_loss .*patch'):
        plugin.check_megatron()


def test_check_names_an_unknown_tracker_api(monkeypatch):
    helper = _mtp().MTPLossLoggingHelper

    def save_metrics_to_tracker(loss_sum, num_tokens, layer_number, num_layers):
        raise AssertionError('not called')

    monkeypatch.setattr(helper, 'save_metrics_to_tracker', staticmethod(save_metrics_to_tracker))
    with pytest.raises(plugin.UnsupportedMegatronError) as err:
        plugin.check_megatron()
    assert "MTPLossLoggingHelper.save_metrics_to_tracker('loss_sum', 'num_tokens'" in str(err.value)


def test_the_checks_accept_what_nvidia_dev_has(monkeypatch):
    """dev: ``process_mtp_loss(..., sequence_roll_context=None)``, ``roll_tensor`` on lists."""
    mtp = _mtp()
    monkeypatch.setattr(mtp, 'process_mtp_loss', _with_extra_parameter(
        _original_process_mtp_loss(), 'sequence_roll_context'))

    def roll_tensor(tensors, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None,
                    fill_values=None, roll_context=None, sequence_fields=None, roll_depth=0):
        raise AssertionError('not called')

    monkeypatch.setattr(mtp, 'roll_tensor', roll_tensor)
    plugin.check_megatron()


def _tv_step(monkeypatch=None, dev_like=False):
    import megatron.core.models.gpt.gpt_model as gpt_model

    if dev_like:
        # What NVIDIA dev's GPTModel does: pass sequence_roll_context (None outside contiguous
        # packed context parallelism) to a process_mtp_loss that takes it.
        dev_process_mtp_loss = _with_extra_parameter(
            _original_process_mtp_loss(), 'sequence_roll_context'
        )
        dispatcher = plugin._with_tv_losses(dev_process_mtp_loss)
        monkeypatch.setattr(
            gpt_model, 'process_mtp_loss',
            lambda *a, **k: dispatcher(*a, **k, sequence_roll_context=None),
        )
    model = build_gpt_with_mtp(vocab_size=64, hidden_size=32, seq_length=12, mtp_num_layers=2,
                               mtp_loss_type='tv', mtp_tv_chunk=5)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 13), generator=g)
    loss = forward_loss(model, tokens[:, :-1], tokens[:, 1:])
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_sequence_roll_context_reaches_the_tv_loss_and_changes_nothing(monkeypatch):
    with single_process():
        ref_loss, ref_grads = _tv_step()
    with single_process():
        loss, grads = _tv_step(monkeypatch, dev_like=True)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
