"""The ``'nla'`` loss -log(max(alpha, 1e-5)): near and at alpha = 0, the one-hot identity with
cross-entropy, and the low-precision gradient bound every loss states.

Against the float64 formula of ``mtp_tv_dev.reference`` (which does not import the package); the
general reference suites (every layout) parametrise over ``'nla'`` too.
"""

import math

import pytest
import torch

from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES, make_loss
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.row_ops import TorchRowOps
from mtp_tv_dev.models import forced_grad_storage
from mtp_tv_dev.reference import NLA_FLOOR, depth_terms, nla_values, objective, token_weights


def test_reference_gradient_is_the_log_derivative_above_the_floor_and_the_floor_one_below():
    alpha = torch.tensor([0.9, 1e-3, 2e-5, 1e-5, 1e-7, 0.0], dtype=torch.float64, requires_grad=True)
    values = nla_values(alpha)
    values.sum().backward()
    floored = alpha.detach().clamp(min=NLA_FLOOR)
    torch.testing.assert_close(values.detach(), -torch.log(floored), rtol=0, atol=0)
    torch.testing.assert_close(alpha.grad, -1.0 / floored, rtol=0, atol=0)
    above = alpha.detach()[:3].clone().requires_grad_()
    (-torch.log(above)).sum().backward()  # plain autograd of -log(alpha) where the floor is inactive
    torch.testing.assert_close(alpha.grad[:3], above.grad, rtol=1e-15, atol=0)


def _far_apart_inputs(gaps):
    """One depth, one position per gap: p peaks on token 0, q on token 1, ``gap`` logits apart.

    The overlap is a few ``e^-gap``: gaps of 9, 14, 18 and 120 give alpha ~ 4e-4 (above the
    floor), ~ 3e-6 and 4e-8 (below it) and 0 in fp32 (e^-120 underflows).
    """
    S, V = len(gaps) + 1, 4
    weight = torch.eye(V, dtype=torch.float64).requires_grad_()
    target = torch.zeros(S, 1, V, dtype=torch.float64)
    draft = torch.zeros(1, S, 1, V, dtype=torch.float64)
    for t, gap in enumerate(gaps):
        target[t + 1, 0, 0] = gap  # depth 0 at position t compares with target row t + 1
        draft[0, t, 0, 1] = gap
        draft[0, t, 0, 2] = 0.5  # q > p here, and q < p at 3: no near-ties whose order fp32
        draft[0, t, 0, 3] = -1.0  # could flip, and several distinct gradient entries
    masks = torch.ones(1, S, 1, dtype=torch.float64)
    masks[0, -1] = 0
    return draft.requires_grad_(), target, weight, masks


@pytest.mark.triton_slice  # also through the Triton kernels (tests/test_triton_kernels.py)
@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
def test_value_and_gradient_near_and_at_zero_acceptance_match_the_formula(storage):
    gaps = [9.0, 14.0, 18.0, 120.0]
    draft, target, weight, masks = _far_apart_inputs(gaps)
    with forced_grad_storage(storage):
        out = linear_tv_loss(draft, target, weight, token_weights('nla', masks, 1.0),
                             MTPLossOptions('nla', chunk_size=1))
    out.loss.backward()
    got = (draft.grad.clone(), weight.grad.clone())
    draft.grad = weight.grad = None
    alpha, kl = depth_terms(target, list(draft), weight)
    ref = objective('nla', alpha, kl, masks, 1.0)
    ref.backward()
    a = out.alpha[0, :, 0]
    assert 1e-4 < a[0] < 1e-3 and 1e-6 < a[1] < NLA_FLOOR and 1e-8 < a[2] < 1e-7 and a[3] == 0.0
    torch.testing.assert_close(out.alpha.double(), alpha.detach(), rtol=1e-4, atol=1e-30)
    floor_value = -math.log(NLA_FLOOR)
    assert torch.isfinite(out.loss) and torch.isfinite(out.per_depth).all()
    assert out.per_depth[0, 1:4, 0].tolist() == pytest.approx([floor_value] * 3, rel=1e-6)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-6, atol=0)
    # Below the floor the gradient is -(w / 1e-5) d alpha/dz: alive (a clamp would give 0), and
    # as small as d alpha/dz itself at alpha = 0.
    assert got[0][0, 2].abs().max() > 1e-4 and got[0][0, 1].abs().max() > 1e-2
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-12)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()


@pytest.mark.triton_slice  # also through the Triton kernels (tests/test_triton_kernels.py)
@pytest.mark.parametrize('temperature', [1.0, 0.7])
@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
def test_one_hot_target_is_cross_entropy(temperature, storage):
    # Orthonormal weight rows and target hidden states 300 * W[y]: the target logits are 300 at y
    # and 0 elsewhere, so p = e_y exactly in fp32, alpha = q_y and -log(alpha) is CE's -log q_y.
    g = torch.Generator().manual_seed(3)
    S, B, H, V = 6, 2, 12, 9
    basis, _ = torch.linalg.qr(torch.randn(H, V, generator=g, dtype=torch.float64))
    weight = basis.t().contiguous().requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (S, B), generator=g)
    target = 300.0 * weight.detach()[labels.roll(1, 0)]  # row t + 1 targets labels[t]
    draft = (torch.randn(1, S, B, H, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    masks = torch.ones(1, S, B, dtype=torch.float64)
    masks[0, -1] = 0
    weights = token_weights('nla', masks, 0.3)
    with forced_grad_storage(storage):
        out = linear_tv_loss(draft, target, weight, weights,
                             MTPLossOptions('nla', chunk_size=5, temperature=temperature))
    out.loss.backward()
    got = (draft.grad.clone(), weight.grad.clone())
    draft.grad = weight.grad = None
    ce = torch.nn.functional.cross_entropy(
        (draft[0] @ weight.t()).reshape(S * B, V) / temperature, labels.reshape(-1), reduction='none'
    ).view(S, B)
    ref = (weights[0] * ce).sum()
    ref.backward()
    assert (out.alpha[0, :-1] > NLA_FLOOR).all()  # the identity holds above the floor
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.per_depth[0, :-1].double(), ce.detach()[:-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-8)


def _rows(n, V, g):
    """Target and draft probability rows from warm (overlapping) to cold (far apart), one-hot
    targets and exact disjointness included."""
    zt = torch.randn(n, V, generator=g) * 3
    zq = zt + torch.randn(n, V, generator=g) * torch.linspace(0.1, 4, n).unsqueeze(1)
    zt[n // 2 :, 0] += torch.linspace(5, 200, n - n // 2)  # targets up to exactly one-hot
    zq[n // 2 :, 1] += torch.linspace(5, 200, n - n // 2)  # drafts elsewhere: alpha down to 0
    return torch.softmax(zt, -1), torch.softmax(zq, -1)


@pytest.mark.parametrize('loss_type', sorted(LOSSES))
def test_logit_gradient_stays_within_the_bound_the_loss_states(loss_type):
    # The bf16/fp16 scaling relies on max_v |dL/dz_v| <= grad_bound * w; 'nla' has coefficients
    # w / alpha far above w, yet its gradient entries stay within w.
    g = torch.Generator().manual_seed(1)
    G, n, V = 2, 64, 50
    loss = make_loss(loss_type)
    pairs = [_rows(n, V, g) for _ in range(G)]
    ops = TorchRowOps()
    sums = [ops.pair_sums(p, q, dot=True, kl=loss.needs_kl) for p, q in pairs]
    alpha = torch.stack([x.overlap for x in sums])
    kl = torch.stack([x.kl for x in sums]) if loss.needs_kl else None
    w = torch.rand(n if loss.per_chain else (G, n), generator=g) + 0.5
    terms = loss.terms(alpha, kl, w)
    assert alpha.min() == 0.0 and alpha.max() > 0.5  # cold through warm rows
    for k, (p, q) in enumerate(pairs):
        tv = terms.tv_coef[k] if terms.tv_coef is not None else None
        kl_coef = terms.kl_coef[k] if terms.kl_coef is not None else None
        grad = ops.grad_(p, q.clone(), sums[k].dot, tv, kl_coef)
        row_weight = w if loss.per_chain else w[k]
        assert (grad.abs().amax(-1) <= loss.grad_bound * row_weight * (1 + 1e-5)).all(), loss_type
    if loss_type == 'nla':
        assert (terms.tv_coef > 1e4 * w).any()  # the coefficient alone is no bound
