"""Upstream Megatron-LM's names for the same settings (its pull request NVIDIA/Megatron-LM #6473).

``mtp_loss_type='cross_entropy'`` is upstream's name of Megatron's own CE loss: it must take the
very code path of ``'ce'`` (bit-identical losses, logged values and gradients), with and without
``mtp_log_acceptance``, and reach the config from ``--mtp-loss-type cross_entropy``.

Runs in both modes: with the plugin (this checkout, ``install()``) and, under
``tools/run_patched_suite.py`` (``MTP_TV_MODE=patch``), against the patched tree, whose own
``process_mtp_loss`` makes the dispatch.
"""

import sys

import pytest
import torch

import megatron.mtp_tv
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss

megatron.mtp_tv.install()  # a no-op in patch mode

VOCAB, SEQ, BATCH = 64, 12, 2


def _train_step(loss_type, **overrides):
    """Main loss, every gradient and the MTP tracker after one step with ``loss_type``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=32, seq_length=SEQ, mtp_num_layers=2, tie_embeddings=True,
        mtp_loss_type=loss_type, mtp_loss_scaling_factor=0.3, **overrides,
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    MTPLossLoggingHelper.tracker.clear()
    loss = forward_loss(model, tokens[:, :-1], tokens[:, 1:], mask)
    main = (loss * mask).sum() / mask.sum()
    main.backward()
    tracker = {
        k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)
    }
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return main.detach(), grads, tracker


def _assert_identical(a, b):
    (main_a, grads_a, tracker_a), (main_b, grads_b, tracker_b) = a, b
    assert torch.equal(main_a, main_b)
    assert grads_a.keys() == grads_b.keys() and any(n.startswith('mtp.') for n in grads_a)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert tracker_a.keys() == tracker_b.keys()
    for key in tracker_a:
        assert torch.equal(tracker_a[key], tracker_b[key]), key


@pytest.mark.parametrize('log_acceptance', [False, True])
def test_cross_entropy_is_bit_identical_to_ce(log_acceptance):
    runs = {}
    for loss_type in ('ce', 'cross_entropy'):
        with single_process():
            runs[loss_type] = _train_step(loss_type, mtp_log_acceptance=log_acceptance)
    _assert_identical(runs['ce'], runs['cross_entropy'])
    # Megatron's CE code ran (its greedy counts are in the tracker); the TV path only for the
    # acceptance metrics when asked to.
    tracker = runs['cross_entropy'][2]
    assert 'loss_values' in tracker or 'loss_sums' in tracker
    assert any(k.startswith('tv_') for k in tracker) == log_acceptance


def test_cross_entropy_is_not_the_tv_loss():
    """The comparison above can fail: the TV path gives another MTP gradient on the same step."""
    runs = {}
    for loss_type in ('cross_entropy', 'tv'):
        with single_process():
            runs[loss_type] = _train_step(loss_type)
    grads_ce, grads_tv = runs['cross_entropy'][1], runs['tv'][1]
    assert any(
        not torch.equal(grads_ce[n], grads_tv[n]) for n in grads_ce if n.startswith('mtp.')
    )


def test_cli_accepts_cross_entropy(monkeypatch):
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, 'argv', [
        'pretrain_gpt.py', '--num-layers', '2', '--hidden-size', '8', '--num-attention-heads', '2',
        '--no-rope-fusion', '--mtp-num-layers', '1', '--mtp-loss-type', 'cross_entropy',
    ])
    args = parse_args()
    args.params_dtype = torch.float32
    config = core_transformer_config_from_args(args)
    assert config.mtp_loss_type == 'cross_entropy'
