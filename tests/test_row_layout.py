"""Chunks of a fixed number of rows across many segments (packed sequences under context
parallelism): the loss, its gradients and every per-token output against the float64 reference,
and the chunk count that follows the tokens, not the segments."""

import pytest
import torch

from megatron.mtp_tv.alignment import RowLayout, TargetSegment
from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES, CrossEntropy
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.sweep import chunks
from mtp_tv_dev.models import forced_grad_storage
from mtp_tv_dev.reference import depth_terms, objective, token_weights

S, H, V = 23, 8, 13
#: Segment ends: lengths 1 to 6, one shorter than any depth count tested but 1.
BOUNDS = (0, 4, 5, 11, 13, 19, 23)


def _segments(target, G):
    """Segments at BOUNDS, each continued by the true next rows as its halo (what the next CP
    rank sends): the loss must equal the one-segment loss."""
    segments = []
    for a, b in zip(BOUNDS[:-1], BOUNDS[1:]):
        halo = target[b : b + G] if b + G <= S else None
        segments.append(TargetSegment(a, b, halo))
    return segments


def _inputs(G, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(G, S, b, H, generator=g, dtype=torch.float64).requires_grad_()
    target = torch.randn(S, b, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    masks = (torch.rand(G, S, b, generator=g) > 0.2).double()
    for k in range(G):
        masks[k, S - k - 1 :] = 0  # no target inside the sequence
    labels = torch.randint(0, V, (G, S, b), generator=g)
    return draft, target, weight, masks, labels


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('G', [1, 3])
@pytest.mark.parametrize('given, storage, b, chunk', [
    # 7 rows: chunks start and end inside segments; 0: the automatic chunk (one here)
    ('hidden', 'dense', 2, 7), ('logits', 'logit_grads', 1, 7), ('fp32 logits', 'dense', 1, 7),
    ('logits', 'dense', 2, 0)])
def test_chunks_across_segments_match_reference(loss_type, G, given, storage, b, chunk):
    draft, target, weight, masks, labels = _inputs(G, b)
    chunk_tokens = chunk * b
    logits = target @ weight.detach().t()
    # fp32 main logits: a chunk's first run of positions is read in place, not copied.
    kwargs = {'logits': dict(target_logits=logits), 'hidden': {},
              'fp32 logits': dict(target_logits=logits.float())}[given]
    with forced_grad_storage(storage):
        out = linear_tv_loss(
            draft, target if given == 'hidden' else None, weight, token_weights(loss_type, masks),
            MTPLossOptions(loss_type, chunk_size=chunk_tokens, metrics=True),
            segments=_segments(target, G), labels=labels, **kwargs)
    out.loss.backward()
    got = draft.grad.clone(), weight.grad.clone()
    draft.grad = weight.grad = None
    alpha, kl = depth_terms(target, list(draft), weight)
    ref = objective(loss_type, alpha, kl, masks, 0.3)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)
    # Per-token outputs at their positions (where a target exists: the last rows' halo is zeros).
    inside = masks > 0
    torch.testing.assert_close(out.alpha.double()[inside], alpha.detach()[inside], rtol=1e-6, atol=1e-8)
    draft_z, target_z = torch.einsum('gsbh,vh->gsbv', draft.detach(), weight.detach()), target @ weight.detach().t()
    assert torch.equal(out.greedy_correct, draft_z.argmax(-1) == labels)
    positions = torch.arange(S)
    for k in range(G):
        at = positions[: S - k - 1]
        agree = draft_z[k, at].argmax(-1) == target_z[at + k + 1].argmax(-1)
        assert torch.equal(out.greedy_agreement[k, at], agree)


@pytest.mark.parametrize('G', [1, 3])
@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
def test_cross_entropy_chunks_across_segments(G, storage):
    draft, target, weight, masks, labels = _inputs(G, 2, seed=1)
    weights = masks * 0.3
    with forced_grad_storage(storage):
        out = linear_tv_loss(draft, None, weight, weights, MTPLossOptions(CrossEntropy(), chunk_size=10),
                             segments=_segments(target, G), labels=labels)
    out.loss.backward()
    got = draft.grad.clone(), weight.grad.clone()
    x, w = draft.detach().requires_grad_(), weight.detach().requires_grad_()
    z = torch.einsum('gsbh,vh->gsbv', x, w)
    nll = torch.logsumexp(z, -1) - z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (weights * nll).sum().backward()
    torch.testing.assert_close(got[0], x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], w.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.greedy_correct, z.argmax(-1) == labels)


@pytest.mark.parametrize('G', [1, 2, 4])
def test_chunk_count_follows_the_tokens(G):
    # 64 segments of 16 positions (a CP rank's zigzag share of 32 packed sequences): the chunks
    # of 512 positions are as many as for one segment, not one (or more) per segment.
    segments = [TargetSegment(a, a + 16) for a in range(0, 1024, 16)]
    packed, whole = RowLayout(segments, G, 1024), RowLayout([TargetSegment(0, 1024)], G, 1024)
    n_packed = len(list(chunks(packed, 512, 1, G)))
    assert len(list(chunks(whole, 512, 1, G))) == 2
    assert n_packed == -(-(1024 + 63 * (G - 1)) // 512)  # the rows without a draft: G - 1 each
    assert packed.identity == (G == 1)


def test_layout_rows_and_runs():
    target = torch.arange(10.0).view(10, 1, 1)
    layout = RowLayout([TargetSegment(0, 3, target[3:5]), TargetSegment(3, 10)], 2, 10)
    assert layout.count == 11 and not layout.identity and layout.covers_positions
    # rows 0-2: positions 0-2; row 3: no draft; rows 4-10: positions 3-9
    weights = layout.to_rows(torch.arange(1.0, 11.0).view(1, 10, 1), dim=1)
    assert weights.view(-1).tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10]
    # target rows 1-4 are segment 0's (positions 1-2, then its 2 halo rows), 5.. segment 1's
    runs = layout.runs(1, 6, targets=True)
    assert [(r.lo, r.hi, r.position) for r in runs] == [(0, 2, 1), (2, 4, None), (4, 5, 4)]
    assert runs[1].halo_rows == slice(0, 2)
    back = layout.to_positions(weights, dim=1)
    assert back.view(-1).tolist() == list(range(1, 11))
    gap = RowLayout([TargetSegment(0, 4), TargetSegment(6, 10)], 1, 10)
    assert not gap.covers_positions and not gap.identity
