"""linear_tv_loss against the independent reference (single process, full vocabulary)."""

import pytest
import torch

from megatron.mtp_tv.linear_tv import (
    AUTO_CHUNK_MIN_BYTES, AUTO_CHUNK_WEIGHT_GRADS, auto_chunk_tokens, linear_tv_loss,
)
from megatron.mtp_tv.losses import LOSSES, EndToEndTVLoss, make_loss
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.row_ops import TorchRowOps
from mtp_tv_dev.models import forced_grad_storage
from mtp_tv_dev.reference import depth_terms, objective, token_weights

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


def _loss(loss_type, eta):
    """``loss_type`` with ``eta`` where it has one (``'lk'``)."""
    return make_loss(loss_type, **({'eta': eta} if 'eta' in LOSSES[loss_type].config_fields else {}))


def _reference(loss_type, draft, target, weight, masks, scale=0.3, logits_fn=None, temperature=1.0, eta=3.0):
    alpha, kl = depth_terms(target, list(draft), weight, logits_fn=logits_fn, temperature=temperature)
    return objective(loss_type, alpha, kl, masks.double(), scale, eta), alpha


#: Cases that tests/test_triton_kernels.py also runs through the Triton kernels (interpreted).
TRITON = pytest.mark.triton_slice

F64, F32 = torch.float64, torch.float32
DE, LG = 'dense', 'logit_grads'  # what the loss keeps for backward (forced_grad_storage)


@pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv'])
# Every pair of values of depths, chunk (one chunk, 1 token, non-divisor, > tokens), what is
# kept for backward (the gradients, or the logit gradients), and dtype (float32 weights take every
# depth of a chunk through one product; other dtypes go depth by depth) appears in some row: 12
# rows instead of the 48 of every combination.
@pytest.mark.parametrize('G,chunk,storage,dtype', [
    (1, 0, LG, F32), (1, 1, LG, F32), pytest.param(1, 5, DE, F32, marks=TRITON), (1, 100, LG, F64),
    (2, 0, DE, F32), (2, 1, DE, F64), pytest.param(2, 5, LG, F64, marks=TRITON), (2, 100, LG, F64),
    (3, 0, DE, F64), (3, 1, LG, F64), pytest.param(3, 5, DE, F32, marks=TRITON), (3, 100, DE, F32),
])
def test_matches_reference(loss_type, G, chunk, storage, dtype):
    draft, target, weight, masks = _inputs(G, dtype=dtype)
    with forced_grad_storage(storage):
        out = linear_tv_loss(draft, target, weight, token_weights(loss_type, masks).to(dtype),
                             MTPLossOptions(loss_type, chunk_size=chunk))
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


@pytest.mark.parametrize(
    'loss_type,temperature,eta',
    [('kl', 1.0, 3.0), ('lk', 1.0, 3.0), ('lk', 1.0, 0.0), ('lk', 1.0, 50.0), ('lk', 0.6, 1.5),
     ('tv', 0.7, 3.0), ('e2e_tv', 1.7, 3.0), ('kl', 0.5, 3.0), ('nla', 1.0, 3.0), ('nla', 0.6, 3.0)],
)
# Every pair of values of depths, chunk and storage, in 8 rows instead of 16.
@pytest.mark.parametrize('G,chunk,storage', [
    (1, 0, DE), (3, 0, LG), (1, 1, DE), (3, 1, LG),
    (1, 5, LG), pytest.param(3, 5, DE, marks=TRITON), (1, 100, LG), (3, 100, DE),
])
def test_kl_lk_and_temperature_match_reference(loss_type, temperature, eta, G, chunk, storage):
    draft, target, weight, masks = _inputs(G)
    with forced_grad_storage(storage):
        out = linear_tv_loss(
            draft, target, weight, token_weights(loss_type, masks),
            MTPLossOptions(_loss(loss_type, eta), chunk_size=chunk, temperature=temperature),
        )
    out.loss.backward()
    got = (draft.grad.clone(), weight.grad.clone())
    draft.grad = weight.grad = None
    ref, ref_alpha = _reference(loss_type, draft, target, weight, masks, temperature=temperature, eta=eta)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.alpha.double(), ref_alpha.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)


@TRITON
def test_lk_with_eta_zero_is_kl_and_large_eta_approaches_tv():
    draft, target, weight, masks = _inputs(2, dtype=torch.float32)
    values = {}
    for name, loss_type, eta in (('kl', 'kl', 3.0), ('lk0', 'lk', 0.0), ('tv', 'tv', 3.0), ('lk_big', 'lk', 1e4)):
        d, w = draft.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        out = linear_tv_loss(d, target, w, token_weights(loss_type, masks),
                             MTPLossOptions(_loss(loss_type, eta)))
        out.loss.backward()
        values[name] = (out.loss, d.grad, w.grad)
    for a, b in zip(values['kl'], values['lk0']):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    # exp(-1e4 alpha) vanishes for every alpha of these inputs: only the TV term is left.
    for a, b in zip(values['tv'], values['lk_big']):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_e2e_equals_tv_for_one_depth():
    draft, target, weight, masks = _inputs(1)
    tv = linear_tv_loss(draft, target, weight, token_weights('tv', masks), MTPLossOptions('tv'))
    e2e = linear_tv_loss(draft, target, weight, token_weights('e2e_tv', masks),
                         MTPLossOptions('e2e_tv'))
    torch.testing.assert_close(tv.loss, e2e.loss)


@TRITON
def test_logits_fn_chain_rule():
    draft, target, weight, masks = _inputs(2)
    fn = lambda z: 0.37 * z  # noqa: E731  (MuP-style output scaling)
    out = linear_tv_loss(draft, target, weight, token_weights('tv', masks),
                         MTPLossOptions('tv', chunk_size=3, logits_fn=fn))
    out.loss.backward()
    got = weight.grad.clone()
    weight.grad = draft.grad = None
    ref, _ = _reference('tv', draft, target, weight, masks, logits_fn=fn)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, weight.grad, rtol=1e-4, atol=1e-7)


@TRITON
def test_logits_fn_returning_its_input_matches_no_logits_fn():
    # Megatron's _scale_logits returns the logits tensor itself when MuP's multiplier is 1.
    results = []
    for fn in (None, lambda z: z):
        draft, target, weight, masks = _inputs(2, dtype=torch.float32)
        out = linear_tv_loss(draft, target, weight, token_weights('e2e_tv', masks),
                             MTPLossOptions('e2e_tv', chunk_size=3, logits_fn=fn))
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


@TRITON
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
    out = linear_tv_loss(draft, target, weight.requires_grad_(), token_weights('e2e_tv', masks),
                         MTPLossOptions('e2e_tv'))
    assert out.alpha[0, 0, 0].item() == 0.0
    out.loss.backward()
    assert torch.isfinite(draft.grad).all() and torch.isfinite(weight.grad).all()


def test_detached_weight_gets_no_gradient_and_skips_weight_products():
    draft, target, weight, masks = _inputs(2)
    out = linear_tv_loss(draft, target, weight.detach(), token_weights('tv', masks),
                         MTPLossOptions('tv'))
    out.loss.backward()
    assert weight.grad is None and draft.grad is not None


@pytest.mark.parametrize('storage', [DE, LG])
def test_upstream_gradient_scales_and_a_second_backward_is_refused_for_dense_gradients(storage):
    draft, target, weight, masks = _inputs(2)
    with forced_grad_storage(storage):
        out = linear_tv_loss(
            draft, target, weight, token_weights('tv', masks), MTPLossOptions('tv'),
        )
    ref, _ = _reference('tv', draft, target, weight, masks)
    (3.0 * out.loss).backward(retain_graph=True)
    got = draft.grad.clone(), weight.grad.clone()
    draft.grad = weight.grad = None
    (3.0 * ref).backward()
    torch.testing.assert_close(got[0], draft.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-4, atol=1e-7)
    if storage == DE:  # the gradients were scaled in place: handing them out twice must fail loudly
        with pytest.raises(RuntimeError, match='modified by an inplace operation'):
            out.loss.backward()
    else:  # the stored logit gradients are only read
        out.loss.backward()


@TRITON
def test_greedy_correct_counts_argmax_hits():
    draft, target, weight, masks = _inputs(2)
    with torch.no_grad():
        argmax = torch.stack([(d @ weight.t()).argmax(-1) for d in draft])
    labels = argmax.clone()
    labels[:, ::2] = (labels[:, ::2] + 1) % V  # every other position wrong
    out = linear_tv_loss(draft, target, weight, token_weights('tv', masks), MTPLossOptions('tv'),
                         labels=labels)
    assert torch.equal(out.greedy_correct, labels == argmax)


def test_bad_shapes_raise():
    draft, target, weight, masks = _inputs(2)
    with pytest.raises(ValueError, match='token_weights'):
        linear_tv_loss(draft, target, weight, masks[0], MTPLossOptions('tv'))
    with pytest.raises(ValueError, match='labels are required'):
        linear_tv_loss(draft, target, weight, masks, MTPLossOptions('ce'))
    with pytest.raises(ValueError, match='target_hidden'):
        linear_tv_loss(draft, target[:-1], weight, masks, MTPLossOptions('tv'))


@TRITON
def test_greedy_agreement_compares_draft_and_target_argmax():
    draft, target, weight, masks = _inputs(2)
    with torch.no_grad():
        target_argmax = (target @ weight.t()).argmax(-1)  # [s, b]
        draft_argmax = torch.stack([(d @ weight.t()).argmax(-1) for d in draft])
    out = linear_tv_loss(draft, target, weight, token_weights('kl', masks),
                         MTPLossOptions('kl', chunk_size=3, temperature=0.5, metrics=True))
    for k in range(2):
        expected = draft_argmax[k, : S - k - 1] == target_argmax[k + 1 :]
        assert torch.equal(out.greedy_agreement[k, : S - k - 1], expected)
    assert linear_tv_loss(
        draft, target, weight, token_weights('kl', masks), MTPLossOptions('kl'),
    ).greedy_agreement is None


@TRITON
@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('chunk', [0, 4])
def test_empty_local_sequence_gives_a_zero_loss_that_keeps_the_graph(loss_type, chunk):
    draft = torch.randn(2, 0, 3, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    weights = torch.zeros(0, 3) if loss_type == 'e2e_tv' else torch.zeros(2, 0, 3)
    out = linear_tv_loss(draft, torch.randn(0, 3, 8), weight, weights,
                         MTPLossOptions(loss_type, chunk_size=chunk))
    assert out.loss.item() == 0.0 and out.loss.requires_grad and out.alpha.shape == (2, 0, 3)
    out.loss.backward()
    assert draft.grad.shape == draft.shape and not weight.grad.any()


def test_e2e_loss_value_does_not_cancel_near_full_acceptance():
    # mean_j (1 - prod_{i<=j} alpha_i) with alpha = (1, 1 - 2**-24): exactly 2**-25 = 2.98e-8;
    # 1 - sum_j prod / G rounds to 0 in fp32.
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # fp32: 1 - 2**-24
    alpha = torch.stack([torch.ones(1), below_one.view(1)])
    terms = EndToEndTVLoss().terms(alpha, None, torch.ones(1))
    assert terms.loss.item() == 2.0**-25


def test_kl_stays_finite_when_the_draft_underflows_and_its_gradient_stays_exact():
    # The draft puts e^-200 on the target's token: q underflows fp32, KL is ~200 * p there.
    weight = torch.eye(3) * 100.0
    target = torch.tensor([[[1.0, 0.0, 0.0]], [[1.0, 0.0, 0.0]]])  # p ~ one-hot(0)
    draft = torch.tensor([[[[0.0, 2.0, 0.0]], [[0.0, 2.0, 0.0]]]], requires_grad=True)  # q ~ one-hot(1)
    masks = torch.tensor([[[1.0], [0.0]]])
    out = linear_tv_loss(draft, target, weight.requires_grad_(), token_weights('kl', masks, 1.0),
                         MTPLossOptions('kl'))
    assert torch.isfinite(out.loss) and out.loss.item() > 80.0
    out.loss.backward()
    p = torch.softmax(target[1, 0] @ weight.t(), -1)
    q = torch.softmax(draft[0, 0, 0] @ weight.t(), -1)
    torch.testing.assert_close(draft.grad[0, 0, 0], (q - p) @ weight)


def test_auto_chunk_keeps_logits_within_both_bounds():
    V = 32768
    assert auto_chunk_tokens(8192, 1, 1024, V) == 1024  # two weight gradients: 2 x 1024 rows <= 2h
    assert auto_chunk_tokens(4096, 1, 1024, V) == 1024  # and half of CE's 4096 saved softmax rows
    assert auto_chunk_tokens(1024, 1, 1024, V) == 256  # half of CE's 1 x 1024 saved softmax rows
    assert auto_chunk_tokens(8192, 3, 4096, 151936 // 2) == 2048
    assert auto_chunk_tokens(4096, 3, 64, 256) == 1536  # tiny model: the 64 MiB floor, CE bound
    # Cross-entropy without target rows: half of CE's saved rows where the weight gradient
    # dominates both peaks (few tokens next to h), the chunk above where the saved rows do.
    assert auto_chunk_tokens(512, 1, 7168, 16384, target_rows=False) == 256  # not 128
    assert auto_chunk_tokens(512, 1, 128, 8192, target_rows=False) == 128  # not 256
    assert auto_chunk_tokens(4096, 1, 1024, V, target_rows=False) == 1024  # the budget binds
    floor_rows = AUTO_CHUNK_MIN_BYTES // 4
    for tokens in (1, 7, 100, 4096, 65536):
        for depths in (1, 2, 3):
            for hidden in (64, 1024, 8192):
                for vocab in (256, 32768, 151936):
                    chunk = auto_chunk_tokens(tokens, depths, hidden, vocab)
                    assert chunk >= 1
                    if chunk > 1:
                        assert (depths + 1) * chunk * vocab <= max(AUTO_CHUNK_WEIGHT_GRADS * hidden * vocab, floor_rows)
                        assert 2 * (depths + 1) * chunk <= depths * tokens
                    ce_chunk = auto_chunk_tokens(tokens, depths, hidden, vocab, target_rows=False)
                    if depths * tokens >= (depths + 1) * hidden:
                        assert ce_chunk == chunk  # CE's saved rows dominate: half its peak
                    else:
                        assert chunk <= ce_chunk and (ce_chunk == 1 or 2 * ce_chunk <= tokens)


@pytest.mark.parametrize('vocab', [300, 512, 1000, 32768, 32769])
def test_row_max_argmax_is_torch_max_ties_included(vocab):
    from megatron.mtp_tv.row_ops import ARGMAX_GROUP, row_max_argmax

    g = torch.Generator().manual_seed(vocab)
    z = torch.randn(6, vocab, generator=g)
    z[1] = z[1].round()  # many ties: the lowest index wins, across and inside groups
    z[2, -1] = z[2].max() + 1.0  # the max in the columns past the last whole group
    z[3, -1] = z[3].max()  # a tie between those columns and the groups: the group wins
    z[4, ARGMAX_GROUP - 1 : ARGMAX_GROUP + 1] = z[4].max() + 1.0  # a tie across two groups
    best, index = torch.empty(6), torch.empty(6, dtype=torch.long)
    row_max_argmax(z, best, index)
    expected = torch.max(z, dim=-1)
    assert torch.equal(best, expected.values) and torch.equal(index, expected.indices)


@pytest.mark.parametrize('vocab', [7, 4096, 32769])
def test_single_shard_normalise_is_the_softmax_written_over_its_input(vocab):
    """The single-shard probabilities are written over the logits and held to the float64
    softmax at 4e-6 (relative), with the row max and argmax beside them, on rows far from zero
    and a one-hot row. ATen's fused float32 softmax misses this bound at V 32k (7e-6: its
    lane-wise sum), which is why ``normalise_`` does not use it."""
    g = torch.Generator().manual_seed(vocab)
    # 40 rows: several of TorchRowOps' blocks at the small vocabularies, one at the largest.
    z = torch.randn(40, vocab, generator=g, dtype=torch.float64) * 4.0
    z[1] += 80.0  # exp would overflow without the max shift
    z[2] -= 300.0
    z[3, vocab // 2] = 200.0  # a numerically one-hot row
    logits = z.float()
    expected = torch.softmax(logits.double(), dim=-1)
    ops = TorchRowOps()
    work = logits.clone()
    probs, stats = ops.normalise_(work, None, vocab_start=5)
    assert probs.data_ptr() == work.data_ptr()  # in place: no [n, V] allocation
    torch.testing.assert_close(probs.double(), expected, rtol=4e-6, atol=1e-30)
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(40, dtype=torch.float64), rtol=0, atol=4e-6)
    max_, argmax = torch.max(logits, dim=-1)
    assert torch.equal(stats.max, max_) and torch.equal(stats.argmax, argmax + 5)


@pytest.mark.parametrize('source_rows', [0, 9, 40])
@pytest.mark.parametrize('with_argmax', [False, True])
def test_normalise_reading_rows_from_a_source_equals_copying_them_first(source_rows, with_argmax):
    """The main-logit target rows are read by the softmax's first pass instead of being copied
    into the chunk buffer: bit for bit the same probabilities and statistics as copying first,
    with a block across the end of the source rows (9 of 40, blocks of 5) and the source left
    as it was."""
    g = torch.Generator().manual_seed(source_rows)
    logits = torch.randn(40, 1000, generator=g) * 3.0
    source = logits[:source_rows].clone()
    source_before = source.clone()
    ops = TorchRowOps()
    vocab_start = 3 if with_argmax else None
    expected, expected_stats = ops.normalise_(logits.clone(), None, vocab_start=vocab_start)
    work = logits.clone()
    work[:source_rows] = float('nan')  # not yet written: must not be read
    probs, stats = ops.normalise_(work, None, vocab_start=vocab_start, source=source)
    assert probs.data_ptr() == work.data_ptr()
    assert torch.equal(probs, expected) and torch.equal(stats.max, expected_stats.max)
    if with_argmax:
        assert torch.equal(stats.argmax, expected_stats.argmax)
    assert torch.equal(source, source_before)
