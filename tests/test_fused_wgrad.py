"""Gradients as a GPU job forms them: gradient-accumulation fusion inside Megatron's DDP.

Megatron-LM turns ``gradient_accumulation_fusion`` on wherever apex or Transformer Engine is
installed: the output layer then adds its weight gradient into ``main_grad`` and hands autograd a
dummy that DDP's hook skips, so a weight gradient the MTP loss returned through autograd alone
was dropped for an untied output layer. Here every loss runs in a model built with fusion on
(apex's entry point emulated, :mod:`mtp_tv_dev.gpu_training`), wrapped in Megatron's own DDP with
each setting of :data:`~mtp_tv_dev.gpu_training.DDP_SETTINGS` (overlapped reduce in small
buckets, the distributed optimizer's buffers), and after backward and the gradient sync every
parameter's ``main_grad`` must equal the plain autograd gradient of the same model without
fusion or DDP: tied and untied output weights, ``mtp_detach_heads`` on and off, the TV losses'
target from the main logits and from their own projection. Pipeline stages: test_fused_wgrad_pp.py.
"""

import contextlib

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.gpu_training import DDP_SETTINGS, emulated_wgrad_fusion, gradients_after_step
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss, own_projection, random_batch

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH, DEPTHS = 64, 32, 16, 2, 2
#: name: the config fields of the MTP loss; 'ce' is Megatron's own code.
LOSS_CONFIGS = {
    'ce': dict(mtp_loss_type='ce'),
    'ce_chunked': dict(mtp_loss_type='ce', mtp_ce_chunked=True),
    **{name: dict(mtp_loss_type=name) for name in LOSSES},
}
RTOL, ATOL = 1e-5, 1e-6


def _step(config, tie, detach, fused, ddp_setting=None, scale=0.3):
    """One forward and backward of a fresh model (same weights every call); the gradients."""
    return gradients_after_step(config, tie, detach, fused, ddp_setting, scale, vocab=VOCAB,
                                hidden=HIDDEN, seq=SEQ, batch=BATCH, depths=DEPTHS)


def _assert_same(got, expected, msg):
    assert got.keys() == expected.keys(), msg
    for name, ref in expected.items():
        assert got[name] is not None, f'{msg}: no gradient for {name}'
        torch.testing.assert_close(got[name], ref, rtol=RTOL, atol=ATOL, msg=f'{msg}: {name}')


# Megatron's own 'ce' projects every depth itself: one source.
CASES = [(loss, source) for loss in LOSS_CONFIGS
         for source in (('main_logits',) if loss == 'ce' else ('main_logits', 'own_projection'))]


@pytest.mark.parametrize('detach', [False, True], ids=['trained_heads', 'detached_heads'])
@pytest.mark.parametrize('tie', [False, True], ids=['untied', 'tied'])
@pytest.mark.parametrize('loss, source', CASES)
def test_fused_ddp_gradients_match_plain_autograd(loss, source, tie, detach):
    config = LOSS_CONFIGS[loss]
    projection = own_projection() if source == 'own_projection' else contextlib.nullcontext()
    with single_process(), projection:
        expected = _step(config, tie, detach, fused=False)
        # The output weight without the MTP loss: its share must survive fusion, to 1%.
        weight = 'embedding.word_embeddings.weight' if tie else 'output_layer.weight'
        without = _step(config, tie, detach, fused=False, scale=0.0)[weight]
        share = expected[weight] - without
        assert (share.norm() > 0) != detach, f'{loss}: the share of a detached output weight'
        with emulated_wgrad_fusion():
            for name, *setting in DDP_SETTINGS:
                got = _step(config, tie, detach, fused=True, ddp_setting=setting)
                msg = f'{loss}, {name}'
                _assert_same(got, expected, msg)
                lost = (got[weight] - without - share).norm()
                assert lost <= 1e-2 * share.norm(), f'{msg}: {lost} of the share {share.norm()}'


@pytest.mark.parametrize('tie', [False, True], ids=['untied', 'tied'])
def test_chunked_ce_equals_megatron_ce_under_fusion(tie):
    """The project's chunked 'ce' is Megatron's 'ce' in every main_grad, fused, in DDP."""
    with single_process(), emulated_wgrad_fusion():
        for name, *setting in DDP_SETTINGS:
            megatron_ce = _step(LOSS_CONFIGS['ce'], tie, False, fused=True, ddp_setting=setting)
            chunked = _step(LOSS_CONFIGS['ce_chunked'], tie, False, fused=True, ddp_setting=setting)
            _assert_same(chunked, megatron_ce, f'chunked ce vs Megatron ce, {name}')


def test_fused_output_layer_without_ddp_flag_keeps_autograd_contract():
    """Without DDP's ``grad_added_to_main_grad`` attribute the loss returns no autograd gradient
    for the weight, as Megatron's linear does, and the whole gradient is in ``main_grad``."""
    from megatron.mtp_tv.linear_tv import accumulate_into_main_grad

    weight = torch.nn.Parameter(torch.randn(6, 4))
    weight.main_grad = torch.ones(6, 4)
    grad = torch.randn(6, 4)
    assert accumulate_into_main_grad(weight, grad) is None
    torch.testing.assert_close(weight.main_grad, 1 + grad)
    weight.grad_added_to_main_grad = False
    dummy = accumulate_into_main_grad(weight, grad)
    assert weight.grad_added_to_main_grad and dummy.shape == weight.shape
    weight.zero_out_wgrad = True
    assert accumulate_into_main_grad(weight, grad).abs().sum() == 0
    bf16 = torch.nn.Parameter(torch.randn(6, 4))
    bf16.main_grad = torch.zeros(6, 4, dtype=torch.bfloat16)
    accumulate_into_main_grad(bf16, grad)
    torch.testing.assert_close(bf16.main_grad, grad.bfloat16())


def test_transformer_engine_output_projection_flag_is_read():
    """Transformer Engine's output projection (``TELMHeadColumnParallelLinear``, GPTModel's
    output layer under an mxfp8 output projection) holds the fusion as
    ``fuse_wgrad_accumulation``: the loss must take it as Megatron's flag (its fused backward
    itself needs Transformer Engine and a GPU)."""
    from types import SimpleNamespace

    from megatron.mtp_tv.mtp_loss import _fuses_weight_grad

    weight = torch.nn.Parameter(torch.randn(6, 4))
    for flags, fused in (({}, False), ({'fuse_wgrad_accumulation': True}, True),
                         ({'fuse_wgrad_accumulation': False}, False),
                         ({'gradient_accumulation_fusion': True}, True)):
        assert _fuses_weight_grad(SimpleNamespace(**flags), weight, 'tv') is fused, flags


def test_megatron_fsdp_output_weight_under_fusion_is_refused():
    """Megatron-FSDP's fused linear overwrites the fetched gradient bucket (``out=``): a second
    writer of the output weight in one backward cannot be ordered, so the loss refuses it."""
    with single_process(), emulated_wgrad_fusion():
        model = build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, mtp_num_layers=DEPTHS,
                                   seq_length=SEQ, tie_embeddings=False, mtp_loss_type='tv',
                                   gradient_accumulation_fusion=True)
        model.output_layer.weight.__fsdp_param__ = True  # what Megatron-FSDP marks
        tokens, labels, mask = random_batch(VOCAB, SEQ, BATCH, seed=3)
        with pytest.raises(ValueError, match=r"mtp_loss_type='tv'.*Megatron-FSDP.*"
                                             r"gradient_accumulation_fusion=False"):
            forward_loss(model, tokens, labels, mask)


#: Other settings of a GPU job, each on top of fusion in DDP (overlapped reduce, the distributed
#: optimizer's buffers): name -> TransformerConfig fields.
GPU_SETTINGS = {
    'calculate_per_token_loss': dict(calculate_per_token_loss=True),
    'full_recompute': dict(recompute_granularity='full', recompute_method='uniform',
                           recompute_num_layers=1),
    'selective_recompute': dict(recompute_granularity='selective'),
    'cross_entropy_loss_fusion': dict(cross_entropy_loss_fusion=True,
                                      cross_entropy_fusion_impl='native'),
}


@pytest.mark.parametrize('setting', list(GPU_SETTINGS))
def test_fused_ddp_gradients_under_other_gpu_settings(setting):
    """Every loss, untied and trained heads (where the share was lost), equal to plain autograd
    of the same config."""
    ddp_setting = DDP_SETTINGS[-1][1:]
    with single_process():
        for loss, config in LOSS_CONFIGS.items():
            config = dict(config, **GPU_SETTINGS[setting])
            expected = _step(config, False, False, fused=False)
            with emulated_wgrad_fusion():
                got = _step(config, False, False, fused=True, ddp_setting=ddp_setting)
            _assert_same(got, expected, f'{loss}, {setting}')


def test_mtp_share_follows_the_schedules_loss_scale():
    """Megatron's schedule hands the optimizer's loss scale (fp16's dynamic scaler: its value at
    this step) over ``num_microbatches`` to ``MTPLossAutoScaler.set_loss_scale``: every loss's
    MTP share of every gradient scales with it, as Megatron's own 'ce' share does, fused, in
    DDP."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = 2.0 ** 7 / 4  # a loss scale over 4 micro-batches
    with single_process():
        for loss, config in LOSS_CONFIGS.items():
            with emulated_wgrad_fusion():
                setting = DDP_SETTINGS[-1][1:]
                full = _step(config, False, False, fused=True, ddp_setting=setting)
                without = _step(config, False, False, fused=True, ddp_setting=setting, scale=0.0)
                MTPLossAutoScaler.set_loss_scale(torch.tensor(scale))
                try:
                    got = _step(config, False, False, fused=True, ddp_setting=setting)
                finally:
                    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            for name, whole in full.items():
                expected = without[name] + scale * (whole - without[name])
                # the scaled share carries the rounding of two fp32 gradients times the scale
                atol = 4 * scale * torch.finfo(torch.float32).eps * whole.abs().max().item()
                torch.testing.assert_close(got[name], expected, rtol=RTOL, atol=atol,
                                           msg=f'{loss}, loss scale {scale}: {name}')


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_fused_ddp_gradients_in_mixed_precision(dtype):
    """bf16 / fp16 parameters inside ``Float16Module``, fp32 ``main_grad``: every gradient equal
    to plain autograd in the same dtype to that dtype's rounding (at this size the MTP share is
    below the rounding of the whole gradient: the fp32 cases hold the share itself)."""
    half = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    with single_process():
        for loss, config in LOSS_CONFIGS.items():
            config = dict(config, **half)
            expected = _step(config, False, False, fused=False)
            with emulated_wgrad_fusion():
                got = _step(config, False, False, fused=True, ddp_setting=DDP_SETTINGS[-1][1:])
            for name, ref in expected.items():
                error = (got[name].float() - ref.float()).norm() / ref.float().norm()
                assert error < 1e-2, f'{loss}, {dtype}: {name} off by {error:.2e}'
