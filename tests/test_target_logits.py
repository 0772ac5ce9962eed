"""linear_tv_loss with the target given as the main head's logits, and with the logit gradients
stored for backward, against the independent float64 reference."""

import pytest
import torch

from megatron.mtp_tv.linear_tv import TargetSegment, choose_grad_storage, linear_tv_loss
from megatron.mtp_tv.losses import LOSSES
from megatron.mtp_tv.config import MTPLossOptions
from mtp_tv_dev.models import forced_grad_storage
from mtp_tv_dev.reference import depth_terms, objective, token_weights

S, B, H, V = 7, 2, 8, 13


def _inputs(G, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(G, S, B, H, generator=g, dtype=torch.float64).requires_grad_()
    target = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    masks = (torch.rand(G, S, B, generator=g) > 0.3).double()
    for k in range(G):
        masks[k, S - k - 1 :] = 0
    return draft, target, weight, masks


def _grads(out, draft, weight):
    out.loss.backward()
    got = draft.grad.clone(), weight.grad.clone()
    draft.grad = weight.grad = None
    return got


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('G', [1, 3])
@pytest.mark.parametrize('chunk', [0, 1, 5])
@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
@pytest.mark.parametrize('given', ['hidden', 'logits'])
@pytest.mark.parametrize('scaling', ['mup', 'temperature', 'none'])
def test_target_logits_and_stored_logit_grads_match_reference(loss_type, G, chunk, storage, given, scaling):
    draft, target, weight, masks = _inputs(G)
    logits_fn = (lambda z: 0.7 * z) if scaling == 'mup' else None  # noqa: E731  (applied to the given logits too)
    temperature = 1.0 if scaling == 'none' else 0.8
    kwargs = dict(target_logits=target @ weight.detach().t()) if given == 'logits' else {}
    with forced_grad_storage(storage):
        out = linear_tv_loss(
            draft, None if given == 'logits' else target, weight, token_weights(loss_type, masks),
            MTPLossOptions(loss_type, chunk_size=chunk, temperature=temperature,
                           logits_fn=logits_fn), **kwargs,
        )
    got = _grads(out, draft, weight)
    alpha, kl = depth_terms(target, list(draft), weight, logits_fn=logits_fn, temperature=temperature)
    ref = objective(loss_type, alpha, kl, masks, 0.3)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
def test_target_logits_with_halo_rows_match_one_segment(storage):
    # Two segments, the first continued by the second's rows as a halo (what another
    # context-parallel rank sends): the halo rows, hidden states, are projected.
    G = 2
    draft, target, weight, masks = _inputs(G, seed=1)
    segments = [TargetSegment(0, 4, halo=target[4 : 4 + G]), TargetSegment(4, S)]
    with forced_grad_storage(storage):
        out = linear_tv_loss(draft, None, weight, token_weights('tv', masks),
                             MTPLossOptions('tv', chunk_size=3), segments=segments,
                             target_logits=target @ weight.detach().t())
    got = _grads(out, draft, weight)
    alpha, kl = depth_terms(target, list(draft), weight)
    objective('tv', alpha, kl, masks, 0.3).backward()
    torch.testing.assert_close(out.alpha.double(), alpha.detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)


def test_rows_no_segment_covers_get_no_gradient_with_stored_logit_grads():
    draft, target, weight, masks = _inputs(1)
    masks[:, 5:] = 0
    with forced_grad_storage('logit_grads'):
        out = linear_tv_loss(draft, target, weight, token_weights('tv', masks),
                             MTPLossOptions('tv'), segments=[TargetSegment(0, 5)])
    out.loss.backward()
    assert torch.all(draft.grad[:, 5:] == 0) and torch.isfinite(draft.grad).all()


def test_stored_logit_grads_serve_a_second_backward():
    draft, target, weight, masks = _inputs(2)
    with forced_grad_storage('logit_grads'):
        out = linear_tv_loss(draft, target, weight, token_weights('tv', masks), MTPLossOptions('tv'))
    out.loss.backward(retain_graph=True)
    first = draft.grad.clone()
    draft.grad = None
    out.loss.backward()  # only read in backward: the same gradients again
    torch.testing.assert_close(draft.grad, first)


def test_bad_target_logits_raise():
    draft, target, weight, masks = _inputs(1)
    w = token_weights('tv', masks)
    with pytest.raises(ValueError, match=r'target_logits shape \(7, 2, 12\)'):
        linear_tv_loss(draft, None, weight, w, MTPLossOptions('tv'),
                       target_logits=torch.zeros(S, B, V - 1))
    with pytest.raises(ValueError, match='target_hidden shape None'):
        linear_tv_loss(draft, None, weight, w, MTPLossOptions('tv'))


def test_grad_storage_choice_holds_the_smaller_and_never_more_than_ce():
    assert choose_grad_storage(4096, 1024, 32768, torch.float32, True, True) == 'dense'
    assert choose_grad_storage(2048, 7168, 16384, torch.float32, True, True) == 'logit_grads'
    assert choose_grad_storage(2048, 4096, 16384, torch.bfloat16, True, True) == 'logit_grads'
    assert choose_grad_storage(512, 4096, 16384, torch.float32, True, False) == 'dense'  # detached W
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        for rows in (1, 100, 1024, 4096, 3 * 8192, 65536):
            for hidden in (64, 1024, 4096, 7168, 16384):
                for vocab in (256, 16384, 75968):
                    choice = choose_grad_storage(rows, hidden, vocab, dtype, True, True)
                    dense = 4 * hidden * (vocab + rows)
                    stored = size * rows * vocab
                    held = stored if choice == 'logit_grads' else dense
                    assert held == min(dense, stored)
                    # Never more than the [rows, V/tp] fp32 softmax Megatron's CE path keeps
                    # for the same rows (which also allocates both gradients in backward).
                    assert held <= 4 * rows * vocab
