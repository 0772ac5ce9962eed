"""linear_tv_loss against the independent reference (single process, full vocabulary)."""

import pytest
import torch

from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.row_ops import TorchRowOps
from tests.reference import depth_alphas, e2e_objective, token_weights, tv_objective

S, B, H, V = 7, 2, 8, 13


def _inputs(G, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(G, S, B, H, generator=g, dtype=dtype).requires_grad_()
    target = torch.randn(S, B, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    masks = (torch.rand(G, S, B, generator=g) > 0.3).to(dtype)
    for k in range(G):  # the last k+1 positions have no target, as after Megatron's rolls
        masks[k, S - k - 1 :] = 0
    return draft, target, weight, masks


def _reference(loss_type, draft, target, weight, masks, scale=0.3, logits_fn=None):
    alpha = depth_alphas(target, list(draft), weight, logits_fn=logits_fn)
    objective = tv_objective if loss_type == 'tv' else e2e_objective
    return objective(alpha, masks.double(), scale), alpha


@pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv'])
@pytest.mark.parametrize('G', [1, 2, 3])
@pytest.mark.parametrize('chunk', [0, 1, 5, 100])  # one chunk, 1 token, non-divisor, > tokens
@pytest.mark.parametrize('fused', [True, False])
def test_matches_reference(loss_type, G, chunk, fused):
    draft, target, weight, masks = _inputs(G)
    out = linear_tv_loss(
        draft, target, weight, token_weights(loss_type, masks), loss_type=loss_type,
        chunk_size=chunk, fused=fused,
    )
    out.loss.backward()
    got = (draft.grad.clone(), weight.grad.clone())
    draft.grad = weight.grad = None
    ref, ref_alpha = _reference(loss_type, draft, target, weight, masks)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.alpha.double(), ref_alpha.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)
    assert target.grad is None  # the target is detached


@pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv'])
@pytest.mark.parametrize('chunk', [0, 1, 5, 100])
def test_fused_and_recompute_paths_agree_exactly(loss_type, chunk):
    results = []
    for fused in (True, False):
        draft, target, weight, masks = _inputs(3, dtype=torch.float32)
        out = linear_tv_loss(draft, target, weight, token_weights(loss_type, masks), loss_type=loss_type,
                             chunk_size=chunk, fused=fused)
        out.loss.backward()
        results.append((out.loss, out.alpha, draft.grad, weight.grad))
    for fused_value, recomputed_value in zip(*results):
        assert torch.equal(fused_value, recomputed_value)


def test_e2e_equals_tv_for_one_depth():
    draft, target, weight, masks = _inputs(1)
    tv = linear_tv_loss(draft, target, weight, token_weights('tv', masks), loss_type='tv')
    e2e = linear_tv_loss(draft, target, weight, token_weights('e2e_tv', masks), loss_type='e2e_tv')
    torch.testing.assert_close(tv.loss, e2e.loss)


def test_logits_fn_chain_rule():
    draft, target, weight, masks = _inputs(2)
    fn = lambda z: 0.37 * z  # noqa: E731  (MuP-style output scaling)
    out = linear_tv_loss(draft, target, weight, token_weights('tv', masks), loss_type='tv', logits_fn=fn, chunk_size=3)
    out.loss.backward()
    got = weight.grad.clone()
    weight.grad = draft.grad = None
    ref, _ = _reference('tv', draft, target, weight, masks, logits_fn=fn)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, weight.grad, rtol=1e-4, atol=1e-7)


def test_logits_fn_returning_its_input_matches_no_logits_fn():
    # Megatron's _scale_logits returns the logits tensor itself when MuP's multiplier is 1.
    results = []
    for fn in (None, lambda z: z):
        draft, target, weight, masks = _inputs(2, dtype=torch.float32)
        out = linear_tv_loss(draft, target, weight, token_weights('e2e_tv', masks), loss_type='e2e_tv',
                             logits_fn=fn, chunk_size=3)
        out.loss.backward()
        results.append((out.loss, draft.grad, weight.grad))
    for plain, through_fn in zip(*results):
        assert torch.equal(plain, through_fn)


def test_tie_convention_passes_no_gradient_through_tied_entries():
    # Exact binary fractions: entry 0 has q < p, entry 1 ties, entry 2 has q > p.
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    ops = TorchRowOps()
    overlap, dot, _ = ops.pair_sums(p, q, dot=True)
    assert overlap.item() == 0.75 and dot.item() == 0.25
    grad = ops.grad_(p, q.clone(), dot, torch.ones(1))
    # q * (dot - 1[q < p]); torch.minimum's 1/2 convention would give [-0.15625, -0.03125, 0.1875].
    assert grad.tolist() == [[-0.1875, 0.0625, 0.125]]


def test_e2e_gradient_is_finite_when_an_alpha_is_zero():
    # Depth 0's draft puts all mass where the target has none: alpha_0 == 0 exactly.
    weight = torch.eye(4, dtype=torch.float32) * 200.0
    target = torch.zeros(3, 1, 4)
    target[:, 0, 0] = 1.0  # p = one-hot(0)
    draft = torch.zeros(2, 3, 1, 4)
    draft[0, :, 0, 1] = 1.0  # q_0 = one-hot(1)  -> alpha_0 = 0
    draft[1, :, 0, 0] = 1.0
    draft.requires_grad_()
    masks = torch.ones(2, 3, 1)
    masks[0, 2:] = 0
    masks[1, 1:] = 0
    out = linear_tv_loss(draft, target, weight.requires_grad_(), token_weights('e2e_tv', masks), loss_type='e2e_tv')
    assert out.alpha[0, 0, 0].item() == 0.0
    out.loss.backward()
    assert torch.isfinite(draft.grad).all() and torch.isfinite(weight.grad).all()


def test_detached_weight_gets_no_gradient_and_skips_weight_products():
    draft, target, weight, masks = _inputs(2)
    out = linear_tv_loss(draft, target, weight.detach(), token_weights('tv', masks), loss_type='tv')
    out.loss.backward()
    assert weight.grad is None and draft.grad is not None


@pytest.mark.parametrize('fused', [True, False])
def test_upstream_gradient_scales_and_a_second_backward_is_refused_when_fused(fused):
    draft, target, weight, masks = _inputs(2)
    out = linear_tv_loss(draft, target, weight, token_weights('tv', masks), loss_type='tv', fused=fused)
    ref, _ = _reference('tv', draft, target, weight, masks)
    (3.0 * out.loss).backward(retain_graph=True)
    got = draft.grad.clone(), weight.grad.clone()
    draft.grad = weight.grad = None
    (3.0 * ref).backward()
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)
    if fused:  # the gradients were scaled in place: handing them out twice must fail loudly
        with pytest.raises(RuntimeError, match='modified by an inplace operation'):
            out.loss.backward()
    else:
        out.loss.backward()


def test_greedy_correct_counts_argmax_hits():
    draft, target, weight, masks = _inputs(2)
    with torch.no_grad():
        argmax = torch.stack([(d @ weight.t()).argmax(-1) for d in draft])
    labels = argmax.clone()
    labels[:, ::2] = (labels[:, ::2] + 1) % V  # every other position wrong
    out = linear_tv_loss(draft, target, weight, token_weights('tv', masks), loss_type='tv', labels=labels)
    assert torch.equal(out.greedy_correct, labels == argmax)


def test_bad_shapes_raise():
    draft, target, weight, masks = _inputs(2)
    with pytest.raises(ValueError, match='token_weights'):
        linear_tv_loss(draft, target, weight, masks[0], loss_type='tv')
    with pytest.raises(ValueError, match="loss_type='ce'"):
        linear_tv_loss(draft, target, weight, masks, loss_type='ce')
    with pytest.raises(ValueError, match='target_hidden'):
        linear_tv_loss(draft, target[:-1], weight, masks, loss_type='tv')
