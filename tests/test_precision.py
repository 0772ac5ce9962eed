"""bf16 / fp16 gradients of the draft losses against float64, held to Megatron CE's own error.

Same inputs rounded alike, Megatron's normalisation, fp16 with a realistic loss scale (2**16,
the loss scale only arriving in backward): see tools/grad_precision.py, which also prints the
table the README quotes.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tools'))

import grad_precision  # noqa: E402

from megatron.mtp_tv.losses import LOSSES  # noqa: E402

#: The issue's bar: at most twice Megatron CE's gradient error in the same setting.
MAX_RATIO = 2.0


#: Every way the product runs: its own target projection, the target from the main logits in the
#: model dtype, and the logit gradients stored for backward in the model dtype. The longer runs
#: (whose point is the token count: the normalisation fp16 must not flush) use the first alone.
ALL_PATHS = grad_precision.VARIANTS
#: 'ce' with mtp_ce_chunked, held to the same bar as every other loss.
CHUNKED_CE = grad_precision.CHUNKED_CE


@pytest.mark.parametrize(
    'dtype,tokens,losses,variants',
    [
        ('fp16', 1024, tuple(LOSSES) + (CHUNKED_CE,), ALL_PATHS),
        ('fp16', 8192, ('tv', 'nla', CHUNKED_CE), ('own',)),
        ('bf16', 1024, tuple(LOSSES) + (CHUNKED_CE,), ALL_PATHS),
        ('bf16', 4096, ('tv', 'nla', CHUNKED_CE), ('own',)),
    ],
)
@pytest.mark.slow
def test_gradient_error_is_at_most_twice_megatron_ce(dtype, tokens, losses, variants):
    results = grad_precision.measure(dtype, tokens, losses, variants=variants)
    ce_draft, ce_weight = results.pop('ce')
    for loss_type, (draft, weight) in results.items():
        assert draft <= MAX_RATIO * ce_draft, (loss_type, draft, ce_draft)
        assert weight <= MAX_RATIO * ce_weight, (loss_type, weight, ce_weight)


@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
@pytest.mark.slow
def test_cold_head_gradient_error_is_at_most_twice_megatron_ce(dtype):
    # A fresh head (draft unrelated to the target): 'nla''s coefficient w / alpha is 7-160 w.
    results = grad_precision.measure(dtype, 1024, ('tv', 'nla'), cold=True, variants=ALL_PATHS)
    ce_draft, ce_weight = results.pop('ce')
    for loss_type, (draft, weight) in results.items():
        assert draft <= MAX_RATIO * ce_draft, (loss_type, draft, ce_draft)
        assert weight <= MAX_RATIO * ce_weight, (loss_type, weight, ce_weight)


def test_fp16_gradients_are_not_flushed_to_zero():
    # The tiny normalisation (scale / num_tokens) is in the logit gradient before Megatron's loss
    # scale arrives; rounded to fp16 unscaled, most of a row's entries would underflow.
    from megatron.mtp_tv.linear_tv import linear_tv_loss
    from megatron.mtp_tv.config import MTPLossOptions

    draft, main, weight, mask, _ = grad_precision.make_inputs(4096, 64, 2048, torch.float16)
    w = weight.clone().requires_grad_()
    token_weights = (mask * (0.1 / mask.sum()))[None, :, None]
    out = linear_tv_loss(draft[None], main, w, token_weights, MTPLossOptions('tv'))
    out.loss.mul(65536.0).backward()
    w64 = weight.double().requires_grad_()
    from mtp_tv_dev.reference import depth_terms, objective

    alpha, kl = depth_terms(main.double(), [draft.double()], w64)
    objective('tv', alpha, kl, mask.double()[None, :, None], 0.1).mul(65536.0).backward()
    lost = (w.grad == 0) & (w64.grad.abs() > 6e-8)  # representable in fp16, yet zero
    assert lost.float().mean() < 1e-3


def test_reference_runs_on_the_device_of_its_inputs():
    """The GPU check's precision phase hands the float64 reference CUDA tensors: every index it
    builds must live on the inputs' device (``meta`` stands in for CUDA here)."""
    from mtp_tv_dev.reference import depth_terms

    hidden = torch.randn(6, 2, 4, device='meta')
    drafts = [torch.randn(6, 2, 4, device='meta') for _ in range(2)]
    alpha, kl = depth_terms(hidden, drafts, torch.randn(10, 4, device='meta'), seq_bounds=[0, 3, 6])
    assert alpha.device.type == kl.device.type == 'meta' and alpha.shape == (2, 6, 2)
