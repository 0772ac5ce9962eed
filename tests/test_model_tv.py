"""The TV losses through a real megatron-core GPTModel with MTP (TP=1, one process)."""

import contextlib

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss
from tests.model_reference import mtp_reference_objective, recorded_mtp_hidden

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2
FACTOR = 0.3


def _batch(seed=0, zero_mask=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    if zero_mask:
        mask.zero_()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _output_weight(model):
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@contextlib.contextmanager
def _target(config, target):
    """Run the package's loss with its target from the main logits (``'main_logits'``, where
    GPTModel._postprocess computes them) or projected by the loss (``'own'``, the fallback), and
    check that this is the path taken."""
    from megatron.mtp_tv import mtp_loss
    from mtp_tv_dev.models import own_projection

    del config  # the target source is the model's: main logits where it projects them
    seen = []
    original = mtp_loss.linear_tv_loss

    def spy(*args, **kwargs):
        seen.append('main_logits' if kwargs.get('target_logits') is not None else 'own')
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, (
            own_projection() if target == 'own' else contextlib.nullcontext()):
        mp.setattr(mtp_loss, 'linear_tv_loss', spy)
        yield
    assert set(seen) <= {target}, seen


def _run_package(depth, loss_type, chunk, tie, zero_mask=False, factor=FACTOR, target='main_logits',
                 **overrides):
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        tie_embeddings=tie, mtp_loss_type=loss_type, mtp_tv_chunk=chunk,
        mtp_loss_scaling_factor=factor, **overrides,
    )
    tokens, labels, mask = _batch(zero_mask=zero_mask)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    if model.config.bf16:  # as Megatron's training loop wraps a bf16 model
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    with _target(model.config, target):
        loss = forward_loss(model, tokens, labels, mask)
    main = (loss * mask).sum() / mask.sum().clamp(min=1)
    main.backward()
    logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
    return main.detach(), _grads(model), logged


#: Settings of the package's loss, read by the reference from the same overrides.
_LOSS_SETTINGS = ('mtp_tv_temperature', 'mtp_lk_eta')


def _run_reference(depth, loss_type, tie, zero_mask=False, **overrides):
    model_overrides = {k: v for k, v in overrides.items() if k not in _LOSS_SETTINGS}
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        tie_embeddings=tie, mtp_loss_scaling_factor=FACTOR, **model_overrides,
    )
    tokens, labels, mask = _batch(zero_mask=zero_mask)
    with recorded_mtp_hidden() as record:
        loss = forward_loss(model, tokens, labels, mask)
    main = (loss * mask).sum() / mask.sum().clamp(min=1)
    weight = _output_weight(model)
    if overrides.get('mtp_detach_heads'):
        weight = weight.detach()
    per_token = mask.sum() if overrides.get('calculate_per_token_loss') else 1.0
    mtp, _, _, logged = mtp_reference_objective(
        record['hidden'], depth, weight, mask, loss_type, FACTOR, per_token_scale=per_token,
        temperature=overrides.get('mtp_tv_temperature', 1.0), eta=overrides.get('mtp_lk_eta', 3.0),
    )
    (main + mtp).backward()
    return main.detach(), _grads(model), logged


def _assert_same_grads(got, ref, atol=1e-6):
    assert got.keys() == ref.keys()
    for name in ref:
        if ref[name] is None:
            assert got[name] is None or not got[name].any(), name
            continue
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize('loss_type,depth', [('tv', 2), ('e2e_tv', 3)])
@pytest.mark.parametrize('chunk', [0, 1, 7, 1000])  # one chunk, one position, non-divisor, > tokens
@pytest.mark.parametrize('target', ['main_logits', 'own'])
def test_loss_and_every_gradient_match_reference(loss_type, depth, chunk, target):
    with single_process():
        main, grads, logged = _run_package(depth, loss_type, chunk, tie=True, target=target)
    with single_process():
        ref_main, ref_grads, ref_tv = _run_reference(depth, loss_type, tie=True)
    torch.testing.assert_close(main, ref_main)
    torch.testing.assert_close(logged, ref_tv, rtol=1e-5, atol=1e-6)  # mtp_{k} loss = mean TV
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize(
    'loss_type,overrides',
    [
        ('kl', {}),
        ('lk', {}),
        ('lk', {'mtp_lk_eta': 0.0}),  # lambda = 1: the KL loss
        ('lk', {'mtp_lk_eta': 40.0}),  # lambda ~ 0 where alpha is not small: close to TV
        ('lk', {'mtp_lk_eta': 1.5, 'mtp_tv_temperature': 0.6}),
        ('tv', {'mtp_tv_temperature': 0.7}),
        ('e2e_tv', {'mtp_tv_temperature': 1.8}),
        ('kl', {'mtp_tv_temperature': 0.5}),
        ('nla', {}),
        ('nla', {'mtp_tv_temperature': 0.6}),
    ],
)
@pytest.mark.parametrize('chunk', [1, 7])  # one position per chunk, a non-divisor
def test_kl_lk_and_temperature_match_reference(loss_type, overrides, chunk):
    with single_process():
        main, grads, logged = _run_package(2, loss_type, chunk, tie=True, **overrides)
    with single_process():
        ref_main, ref_grads, ref_logged = _run_reference(2, loss_type, tie=True, **overrides)
    torch.testing.assert_close(main, ref_main)
    torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)  # mtp_{k} loss
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize(
    'tie,overrides',
    [
        (False, {}),
        (True, {'mtp_detach_heads': True}),
        (False, {'mtp_detach_heads': True}),
        (True, {'calculate_per_token_loss': True}),
    ],
)
@pytest.mark.parametrize('target', ['main_logits', 'own'])
def test_output_weight_variants_match_reference(loss_type, tie, overrides, target):
    with single_process():
        _, grads, _ = _run_package(2, loss_type, 5, tie=tie, target=target, **overrides)
    with single_process():
        _, ref_grads, _ = _run_reference(2, loss_type, tie=tie, **overrides)
    _assert_same_grads(grads, ref_grads)


def test_detached_heads_leave_output_weight_without_mtp_gradient():
    # Untied, detached heads: the output weight's gradient is the main loss's alone.
    with single_process():
        _, with_mtp, _ = _run_package(2, 'tv', 5, tie=False, mtp_detach_heads=True)
    with single_process():
        _, without, _ = _run_package(
            2, 'tv', 5, tie=False, mtp_detach_heads=True, factor=0.0
        )
    torch.testing.assert_close(with_mtp['output_layer.weight'], without['output_layer.weight'])
    assert not torch.equal(with_mtp['mtp.layers.0.eh_proj.weight'], without['mtp.layers.0.eh_proj.weight'])


def test_all_zero_mask_gives_finite_loss_and_no_mtp_gradient():
    with single_process():
        main, grads, logged = _run_package(2, 'tv', 4, tie=True, zero_mask=True)
    assert torch.isfinite(main) and torch.isfinite(logged).all()
    for name, g in grads.items():
        assert g is None or torch.isfinite(g).all(), name
    assert not grads['mtp.layers.0.eh_proj.weight'].any()


def test_bf16_model_is_finite_and_close_to_fp32():
    with single_process():
        _, _, fp32 = _run_package(2, 'tv', 5, tie=True)
    with single_process():
        _, grads, bf16 = _run_package(2, 'tv', 5, tie=True, params_dtype=torch.bfloat16, bf16=True)
    assert torch.isfinite(bf16).all()
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.02)
    assert all(g is None or torch.isfinite(g.float()).all() for g in grads.values())


@pytest.mark.plugin_only
def test_ce_is_bit_identical_with_the_plugin_installed():
    import megatron.core.models.gpt.gpt_model as gpt_model
    from megatron.mtp_tv import plugin

    original = gpt_model.process_mtp_loss.__wrapped__
    assert plugin.is_installed() and gpt_model.process_mtp_loss is not original
    with single_process():
        main, grads, logged = _run_package(2, 'ce', 0, tie=True)
    saved = gpt_model.process_mtp_loss
    gpt_model.process_mtp_loss = original
    try:
        with single_process():
            ref_main, ref_grads, ref_logged = _run_package(2, 'ce', 0, tie=True)
    finally:
        gpt_model.process_mtp_loss = saved
    assert torch.equal(main, ref_main) and torch.equal(logged, ref_logged)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


@pytest.mark.parametrize('depth', [1, 2])
def test_e2e_shallow_chains_match_reference(depth):
    with single_process():
        _, grads, logged = _run_package(depth, 'e2e_tv', 7, tie=True)
    with single_process():
        _, ref_grads, ref_tv = _run_reference(depth, 'e2e_tv', tie=True)
    torch.testing.assert_close(logged, ref_tv, rtol=1e-5, atol=1e-6)
    _assert_same_grads(grads, ref_grads)


def test_e2e_with_one_depth_equals_tv():
    with single_process():
        _, tv_grads, _ = _run_package(1, 'tv', 5, tie=True)
    with single_process():
        _, e2e_grads, _ = _run_package(1, 'e2e_tv', 5, tie=True)
    _assert_same_grads(e2e_grads, tv_grads, atol=1e-7)
