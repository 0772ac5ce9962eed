"""The TV losses' target from the main head's logits (megatron.mtp_tv.mtp_loss.attach_mtp_tv_loss) through a real
megatron-core GPTModel: used where the main logits follow, Megatron's main loss untouched, and the
own projection wherever they do not."""

import contextlib

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import (build_gpt_with_mtp, forward_loss, own_projection, random_batch,
                               sweep_targets_seen)

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2


@pytest.fixture(autouse=True)
def _process_group():
    with single_process():
        yield


def _batch(seed=0):
    return random_batch(VOCAB, SEQ, BATCH, seed)


def _model(loss_type='tv', depth=2, **overrides):
    return build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        mtp_loss_type=loss_type, mtp_tv_chunk=5, **overrides,
    )


def _step(model, monkeypatch=None, own=False):
    tokens, labels, mask = _batch()
    with contextlib.ExitStack() as stack:
        if own:
            stack.enter_context(own_projection())
        seen = stack.enter_context(sweep_targets_seen())
        loss = forward_loss(model, tokens, labels, mask)
        (loss * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, seen


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('tie', [True, False])
def test_main_logits_target_equals_the_own_projection_and_keeps_megatrons_main_loss(loss_type, tie):
    model = _model(loss_type, tie_embeddings=tie)
    loss, grads, seen = _step(model)
    assert seen == [True]  # the target came from the main logits
    own_loss, own_grads, own_seen = _step(model, own=True)
    assert own_seen == [False]
    assert torch.equal(loss, own_loss)  # Megatron's main loss, bit for bit
    for name, g in grads.items():
        torch.testing.assert_close(g, own_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # ... and that is the main loss of Megatron's own 'ce' model with the same weights.
    model.config.mtp_loss_type = 'ce'
    ce_loss, _, _ = _step(model)
    assert torch.equal(loss, ce_loss)


def test_without_labels_the_returned_logits_are_megatrons_and_carry_the_mtp_gradient():
    # RL stacks (miles): no labels; the MTP labels come from input_ids, the logits are returned.
    model = _model('tv', depth=1)
    tokens, _, _ = _batch()
    with sweep_targets_seen() as seen:
        logits = forward_loss(model, tokens, None)
    assert seen == [True]
    logits.float().logsumexp(-1).sum().backward()
    mtp_grads = [p.grad for n, p in model.named_parameters() if n.startswith('mtp.')]
    assert all(g is not None and g.abs().sum() > 0 for g in mtp_grads)
    model.zero_grad(set_to_none=True)
    model.config.mtp_loss_type = 'ce'
    with torch.no_grad():
        ce_logits = forward_loss(model, tokens, None)
    assert torch.equal(logits.detach(), ce_logits)


def test_output_processor_falls_back_to_the_own_projection():
    model = _model('tv', depth=1)
    tokens, labels, mask = _batch()

    def output_processor(hidden_states, output_layer, output_weight, labels, **_):
        logits, _ = output_layer(hidden_states, weight=output_weight)
        return logits.float().logsumexp(-1).sum()

    with sweep_targets_seen() as seen:
        out = model(
            input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
            attention_mask=None, labels=labels, loss_mask=mask, output_processor=output_processor,
        )
    assert seen == [False]
    out.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith('mtp.'))


def test_fused_linear_cross_entropy_falls_back(monkeypatch):
    model = _model('tv', depth=1)
    model.fuse_linear_cross_entropy = True  # Megatron dev: no main logits are materialised
    _, _, seen = _step(model)
    assert seen == [False]


def test_eval_uses_the_main_logits_without_gradients():
    model = _model('tv', depth=2).eval()
    tokens, labels, mask = _batch()
    with torch.no_grad(), sweep_targets_seen() as seen:
        loss = forward_loss(model, tokens, labels, mask)
    assert seen == [True] and torch.isfinite(loss).all()


def _process_mtp_loss_kwargs(model, depth):
    _, labels, mask = _batch()
    return dict(
        labels=labels, loss_mask=mask, output_layer=model.output_layer,
        output_weight=model.shared_embedding_or_output_weight(), runtime_gather_output=None,
        is_training=True, compute_language_model_loss=model.compute_language_model_loss,
        config=model.config, tp_group=model.tp_group,
    )


def test_the_loss_on_the_main_logits_is_the_loss_on_its_own_projection():
    """What the patched _postprocess does (split, project the main head, attach the loss to its
    logits) gives the gradients of process_mtp_loss, where the loss projects the target itself."""
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.mtp_tv.mtp_loss import (
        attach_mtp_tv_loss, mtp_loss_follows_main_logits, split_mtp_hidden_states)

    model = _model('tv', depth=2)
    kwargs = _process_mtp_loss_kwargs(model, 2)
    hidden = torch.randn(3 * SEQ, BATCH, HIDDEN, requires_grad=True)
    assert mtp_loss_follows_main_logits(model)
    assert not mtp_loss_follows_main_logits(model, output_processor=lambda **_: None)
    with sweep_targets_seen() as seen:
        mtp.process_mtp_loss(hidden_states=hidden, **kwargs).sum().backward()
    own = hidden.grad.clone()
    hidden.grad = None
    with sweep_targets_seen() as seen_logits:
        main, drafts = split_mtp_hidden_states(hidden, model.config)
        logits, _ = model.output_layer(main, weight=kwargs['output_weight'])
        inputs = mtp.mtp_loss_inputs(**kwargs)
        attached = attach_mtp_tv_loss(logits, main, drafts, inputs, mtp.MTPLossAutoScaler)
    assert seen == [False] and seen_logits == [True] and attached is logits
    attached.sum().backward()
    assert hidden.grad[2 * SEQ:].abs().sum() > 0  # the MTP loss's gradient reached depth 2
    torch.testing.assert_close(hidden.grad[SEQ:], own[SEQ:], rtol=1e-5, atol=1e-8)
    # the main rows: the gradient of what each path returned (main hidden states, logits), alone
    main_head = torch.ones(SEQ, BATCH, VOCAB) @ kwargs['output_weight'].detach()
    assert torch.equal(own[:SEQ], torch.ones_like(own[:SEQ]))
    torch.testing.assert_close(hidden.grad[:SEQ], main_head, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='main logits with 63 vocabulary entries'):
        attach_mtp_tv_loss(torch.zeros(SEQ, BATCH, VOCAB - 1), main, drafts, inputs,
                           mtp.MTPLossAutoScaler)


@pytest.mark.plugin_only
def test_a_loss_nobody_picks_up_is_an_error_in_plugin_mode():
    """The plugin's hook recognises the main projection by its input; a _postprocess whose
    output layer never sees the main hidden states leaves the loss uncomputed: an error."""
    model = _model('tv', depth=1)
    # The output layer gets a copy of its input: not the main hidden states the loss waits for.
    model.output_layer.register_forward_pre_hook(lambda module, args: (args[0].clone(), *args[1:]))
    with pytest.raises(RuntimeError, match='never projected the main hidden states'):
        _step(model)


@pytest.mark.plugin_only
def test_the_plugin_wraps_postprocess_once():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.mtp_tv import plugin

    once = GPTModel._postprocess
    plugin._install_main_logits()
    assert GPTModel._postprocess is once and once.__mtp_tv_main_logits__


def test_the_kernels_field_reaches_the_sweep(monkeypatch):
    """mtp_tv_kernels='triton' on a CPU without Triton's interpreter: the error names why, so the
    field is what the loss's sweep used (not a silent torch fallback)."""
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    model = _model('tv', depth=1, mtp_tv_kernels='triton')
    with pytest.raises(RuntimeError, match="mtp_tv_kernels='triton' but the Triton kernel cannot run"):
        _step(model)
    model.config.mtp_tv_kernels = 'torch'
    _step(model)
