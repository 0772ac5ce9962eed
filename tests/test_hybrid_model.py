"""The TV losses through a real megatron-core HybridModel with MTP.

``HybridModel`` calls ``process_mtp_loss`` by its own imported name (``hybrid_model.py``), which
the plugin replaces and the patch changes at its source. This builds one with an attention/MLP
layer pattern (``'*-/*-/*-'``: main ``*-``, then ``*-`` per MTP depth; no Mamba, which needs the
CUDA-only ``mamba_ssm``) from local modules (``build_hybrid_with_mtp``) and checks the package's
loss, logged per-depth loss and every parameter gradient (``'tv'``, ``'e2e_tv'``, and
``'kl'``/``'lk'``/``'nla'``) against the independent reference the
GPTModel tests use (``tests/model_reference.py``: the model's own hidden states, the objective
from the equations, plain autograd).
"""

import pytest
import torch

import megatron.mtp_tv
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_hybrid_with_mtp, forward_loss
from tests.model_reference import mtp_reference_objective, recorded_mtp_hidden

megatron.mtp_tv.install()

HYBRID_MODULE = 'megatron.core.models.hybrid.hybrid_model'
VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2
FACTOR = 0.3


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _build(depth, tie, **overrides):
    return build_hybrid_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        tie_embeddings=tie, mtp_loss_scaling_factor=FACTOR, **overrides,
    )


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _run_package(depth, loss_type, chunk, tie, **overrides):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model = _build(depth, tie, mtp_loss_type=loss_type, mtp_tv_chunk=chunk, **overrides)
    tokens, labels, mask = _batch()
    MTPLossLoggingHelper.tracker.clear()
    loss = forward_loss(model, tokens, labels, mask)
    main = (loss * mask).sum() / mask.sum()
    main.backward()
    logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
    return main.detach(), _grads(model), logged


def _run_reference(depth, loss_type, tie, **overrides):
    model = _build(depth, tie, **overrides)
    tokens, labels, mask = _batch()
    with recorded_mtp_hidden((HYBRID_MODULE,)) as record:
        loss = forward_loss(model, tokens, labels, mask)
    assert 'hidden' in record, 'HybridModel did not call process_mtp_loss'
    main = (loss * mask).sum() / mask.sum()
    weight = (model.shared_embedding_or_output_weight() if tie else model.output_layer.weight)
    if overrides.get('mtp_detach_heads'):
        weight = weight.detach()
    mtp, _, _, logged = mtp_reference_objective(
        record['hidden'], depth, weight, mask, loss_type, FACTOR
    )
    (main + mtp).backward()
    return main.detach(), _grads(model), logged


def _assert_same_grads(got, ref):
    assert got.keys() == ref.keys()
    for name in ref:
        if ref[name] is None:
            assert got[name] is None or not got[name].any(), name
            continue
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    'loss_type,depth,chunk,tie,overrides',
    [
        ('tv', 2, 0, True, {}),
        ('e2e_tv', 3, 5, True, {}),
        ('tv', 2, 7, False, {}),
        ('e2e_tv', 2, 1, False, {'mtp_detach_heads': True}),
        ('kl', 2, 5, True, {}),
        ('lk', 2, 5, False, {}),
        ('nla', 2, 5, True, {}),
    ],
)
def test_hybrid_loss_and_every_gradient_match_reference(loss_type, depth, chunk, tie, overrides):
    with single_process():
        main, grads, logged = _run_package(depth, loss_type, chunk, tie, **overrides)
    with single_process():
        ref_main, ref_grads, ref_logged = _run_reference(depth, loss_type, tie, **overrides)
    # The MTP layers' inner stacks are real: their attention and MLP weights get gradients.
    assert any(n.startswith('mtp.layers.0.mtp_model_layer.layers.1.mlp') for n in grads)
    torch.testing.assert_close(main, ref_main)
    torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)  # mtp_{k} loss
    _assert_same_grads(grads, ref_grads)


def test_hybrid_tv_differs_from_ce():
    """The comparison above can fail: with 'ce' the same model's MTP gradients are not TV's."""
    with single_process():
        _, ce, _ = _run_package(2, 'ce', 0, True)
    with single_process():
        _, tv, _ = _run_package(2, 'tv', 0, True)
    name = 'mtp.layers.0.eh_proj.weight'
    assert not torch.allclose(ce[name], tv[name], rtol=1e-3, atol=1e-6)


@pytest.mark.plugin_only
def test_hybrid_ce_is_bit_identical_with_the_plugin_installed():
    import importlib

    from megatron.mtp_tv import plugin

    hybrid_model = importlib.import_module(HYBRID_MODULE)
    original = hybrid_model.process_mtp_loss.__wrapped__
    assert plugin.is_installed() and hybrid_model.process_mtp_loss is not original
    with single_process():
        main, grads, logged = _run_package(2, 'ce', 0, True)
    saved = hybrid_model.process_mtp_loss
    hybrid_model.process_mtp_loss = original
    try:
        with single_process():
            ref_main, ref_grads, ref_logged = _run_package(2, 'ce', 0, True)
    finally:
        hybrid_model.process_mtp_loss = saved
    assert torch.equal(main, ref_main) and torch.equal(logged, ref_logged)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def _tp_worker(rank, loss_type, depth, sequence_parallel):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from mtp_tv_dev.cpu import allreduce_sequence_parallel_grads
    from mtp_tv_dev.models import gather_tp_params

    megatron.mtp_tv.install()
    model = _build(depth, True, sequence_parallel=sequence_parallel, mtp_loss_type=loss_type,
                   mtp_tv_chunk=5)
    tokens, labels, mask = _batch()
    MTPLossLoggingHelper.tracker.clear()
    loss = forward_loss(model, tokens, labels, mask)
    ((loss * mask).sum() / mask.sum()).backward()
    if sequence_parallel:
        allreduce_sequence_parallel_grads(model)
    return gather_tp_params(model), MTPLossLoggingHelper.tracker['loss_values'].clone()


def test_hybrid_tp2_sequence_parallel_matches_tp1():
    """Vocabulary-parallel output layer and sequence-parallel MTP chunks in the hybrid model: the
    same weights, gradients and logged TV as one rank (TP=1 itself matches the reference above)."""
    from mtp_tv_dev.distributed import spawn
    from mtp_tv_dev.models import compare_gathered

    (ref_params, ref_logged), = spawn(_tp_worker, 1, 'e2e_tv', 2, False)
    for params, logged in spawn(_tp_worker, 2, 'e2e_tv', 2, True, tp=2):
        assert compare_gathered(ref_params, params, atol=1e-5, rtol=1e-4) == []
        torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)


PACKED_LENGTHS = [5, 8, 3]


def _packed_batch(seed=1):
    from mtp_tv_dev.packed import make_packed_seq_params

    g = torch.Generator().manual_seed(seed)
    total = sum(PACKED_LENGTHS)
    tokens = torch.randint(0, VOCAB, (1, total + 1), generator=g)
    mask = (torch.rand(1, total, generator=g) > 0.2).float()
    return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask,
            make_packed_seq_params(PACKED_LENGTHS))


@pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv', 'kl', 'nla'])
def test_hybrid_packed_sequences_match_reference(loss_type):
    """A packed row of three sequences (THD, batch 1): no target crosses a sequence boundary;
    loss, logged loss and every gradient against the reference with the sequences' bounds."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    depth = 3 if loss_type == 'e2e_tv' else 2
    seq = sum(PACKED_LENGTHS)
    bounds = [0, 5, 13, 16]
    runs = []
    for reference in (False, True):
        with single_process():
            model = build_hybrid_with_mtp(
                vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=seq, mtp_num_layers=depth,
                tie_embeddings=True, mtp_loss_scaling_factor=FACTOR, mtp_loss_type=loss_type,
                mtp_tv_chunk=4)
            tokens, labels, mask, packed = _packed_batch()
            MTPLossLoggingHelper.tracker.clear()
            if not reference:
                loss = forward_loss(model, tokens, labels, mask, packed_seq_params=packed)
                ((loss * mask).sum() / mask.sum()).backward()
                runs.append((_grads(model), MTPLossLoggingHelper.tracker['loss_values'].clone()))
                continue
            with recorded_mtp_hidden((HYBRID_MODULE,)) as record:
                loss = forward_loss(model, tokens, labels, mask, packed_seq_params=packed)
            mtp, _, _, logged = mtp_reference_objective(
                record['hidden'], depth, model.shared_embedding_or_output_weight(), mask,
                loss_type, FACTOR, seq_bounds=bounds)
            ((loss * mask).sum() / mask.sum() + mtp).backward()
            runs.append((_grads(model), logged))
    (grads, logged), (ref_grads, ref_logged) = runs
    torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)
    _assert_same_grads(grads, ref_grads)


def _hybrid_cp_worker(rank, loss_type, depth, s):
    """``process_mtp_loss`` by the name HybridModel calls it (``hybrid_model.process_mtp_loss``:
    the plugin's dispatcher, or the patched tree's) on this context-parallel rank's zigzag rows."""
    import importlib

    import megatron.mtp_tv
    from megatron.core import parallel_state
    from mtp_tv_dev.packed import zigzag_cp_index
    from tests.test_parallel import _both_target_sources, _loss_inputs

    megatron.mtp_tv.install()
    hybrid = importlib.import_module(HYBRID_MODULE)
    cp_group = parallel_state.get_context_parallel_group()
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    index = zigzag_cp_index(s, cp_group.rank(), cp_group.size())
    local_hidden = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)])
    runs = _both_target_sources(hybrid.process_mtp_loss, local_hidden, weight, loss_type, depth,
                                cp_group.size(), labels=labels[:, index], loss_mask=mask[:, index],
                                cp_group=cp_group)
    return (index, *runs[0], runs[1])


@pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv', 'nla'])
def test_hybrid_context_parallel_matches_full_sequence(loss_type):
    """CP=2 through HybridModel's ``process_mtp_loss`` (a whole model cannot run CP > 1 on a CPU:
    the local attention asserts CP == 1): the same reference as the GPT path's."""
    from mtp_tv_dev.distributed import spawn
    from tests.test_parallel import _check_against_reference

    depth, s = (3 if loss_type == 'e2e_tv' else 2), 16
    results = spawn(_hybrid_cp_worker, 2, loss_type, depth, s, cp=2)
    _check_against_reference(results, loss_type, depth, s, None)
