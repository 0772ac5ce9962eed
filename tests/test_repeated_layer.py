"""``mtp_use_repeated_layer=True``: one MTP layer applied at every depth (GLM-style recurrent
shared MTP; the setting ``'e2e_tv'`` over seven steps was written for), through a real
megatron-core ``GPTModel``.

The loss sees the same ``[(1+D)s, b, h]`` hidden states as with separate layers; what changes is
that every depth's gradient lands on the one layer. Held against the independent reference
objective on the model's own recorded hidden states (``tests/model_reference.py``: float64,
full vocabulary, unchunked), for the main loss, the per-depth loss Megatron logs and the gradient
of every parameter; 1, 3 and 7 depths, every loss, tied and untied output weights,
``mtp_detach_heads`` on and off.
"""

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss, random_batch
from tests.model_reference import mtp_reference_objective, recorded_mtp_hidden

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH, FACTOR = 64, 32, 16, 2, 0.3


def _model(depth, loss_type, tie, detach):
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        mtp_use_repeated_layer=True, tie_embeddings=tie, mtp_loss_type=loss_type,
        mtp_tv_chunk=5, mtp_loss_scaling_factor=FACTOR, mtp_detach_heads=detach,
    )
    assert len(model.mtp.layers) == 1  # one layer, applied at every depth
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(depth, loss_type, tie, detach, reference):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    with single_process():
        model = _model(depth, loss_type, tie, detach)
        tokens, labels, mask = random_batch(VOCAB, SEQ, BATCH, seed=depth)
        MTPLossLoggingHelper.tracker.clear()
        if not reference:
            loss = forward_loss(model, tokens, labels, mask)
            main = (loss * mask).sum() / mask.sum()
            main.backward()
            return main.detach(), _grads(model), MTPLossLoggingHelper.tracker['loss_values'].clone()
        with recorded_mtp_hidden() as record:  # the loss replaced by a recorder
            loss = forward_loss(model, tokens, labels, mask)
        main = (loss * mask).sum() / mask.sum()
        weight = (model.shared_embedding_or_output_weight() if tie else model.output_layer.weight)
        mtp, _, _, logged = mtp_reference_objective(
            record['hidden'], depth, weight.detach() if detach else weight, mask, loss_type, FACTOR)
        (main + mtp).backward()
        return main.detach(), _grads(model), logged


CASES = [(3, tie, detach) for tie in (True, False) for detach in (False, True)] + [
    (depth, True, detach) for depth in (1, 7) for detach in (False, True)]


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('depth,tie,detach', CASES)
def test_repeated_layer_matches_the_reference(loss_type, depth, tie, detach):
    main, grads, logged = _run(depth, loss_type, tie, detach, reference=False)
    ref_main, ref_grads, ref_logged = _run(depth, loss_type, tie, detach, reference=True)
    torch.testing.assert_close(main, ref_main)
    torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
    # The one layer's gradient is every depth's: it moves with all of them.
    assert grads['mtp.layers.0.eh_proj.weight'].abs().sum() > 0
