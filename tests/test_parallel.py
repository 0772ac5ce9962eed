"""The draft losses under tensor, sequence and context parallelism and packed sequences.

Spawned gloo workers on CPU. Whole-model runs compare TP=2 against TP=1 with the same weights;
``process_mtp_loss``-level runs compare context-parallel ranks and packed rows against the
independent full-sequence reference in ``tests.reference``. Every worker also reruns with
``MEGATRON_MTP_TV_FUSED=0`` (the recompute path), which must give the same numbers.
"""

import os

import pytest
import torch

from megatron.mtp_tv.mtp_loss import FUSED_ENV
from megatron.mtp_tv.testing.distributed import spawn
from tests.reference import depth_terms, objective, per_token_values, shifted_mask

VOCAB, HIDDEN, SEQ, BATCH, FACTOR = 64, 32, 12, 2, 0.3


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _model_worker(rank, loss_type, depth, tie, sequence_parallel):
    import megatron.mtp_tv
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.mtp_tv.metrics import acceptance_metrics
    from megatron.mtp_tv.testing.cpu import allreduce_sequence_parallel_grads
    from megatron.mtp_tv.testing.models import build_gpt_with_mtp, forward_loss, gather_tp_params

    megatron.mtp_tv.install()
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        tie_embeddings=tie, sequence_parallel=sequence_parallel, mtp_loss_type=loss_type,
        mtp_tv_chunk=5, mtp_loss_scaling_factor=FACTOR,
    )
    tokens, labels, mask = _batch()
    runs = []
    for fused in ('1', '0'):  # the default fused path, then the recompute path on the same model
        os.environ[FUSED_ENV] = fused
        for param in model.parameters():
            param.grad = None
        MTPLossLoggingHelper.tracker.clear()
        loss = forward_loss(model, tokens, labels, mask)
        ((loss * mask).sum() / mask.sum()).backward()
        if sequence_parallel:
            allreduce_sequence_parallel_grads(model)
        logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
        metrics = {k: float(v) for k, v in acceptance_metrics().items()}
        runs.append((gather_tp_params(model), logged, metrics))
    return runs


@pytest.mark.parametrize(
    'loss_type,depth,tie,sequence_parallel',
    [
        ('tv', 2, True, False),
        ('tv', 2, False, True),
        ('tv', 2, True, True),
        ('e2e_tv', 3, False, False),
        ('e2e_tv', 3, True, True),
        ('kl', 2, True, True),
        ('lk', 2, False, False),
        ('nla', 2, True, True),
    ],
)
def test_whole_model_tp2_matches_tp1(loss_type, depth, tie, sequence_parallel):
    from megatron.mtp_tv.testing.models import compare_gathered

    ((ref_params, ref_logged, ref_metrics), _), = spawn(_model_worker, 1, loss_type, depth, tie, False)
    results = spawn(_model_worker, 2, loss_type, depth, tie, sequence_parallel, tp=2)
    for (params, logged, metrics), recomputed in results:
        assert compare_gathered(ref_params, params, atol=1e-5, rtol=1e-4) == []
        torch.testing.assert_close(logged, ref_logged, rtol=1e-5, atol=1e-6)
        assert metrics == pytest.approx(ref_metrics, rel=1e-5)
        # MEGATRON_MTP_TV_FUSED=0 recomputes the same chunks in backward: the same numbers.
        assert compare_gathered(params, recomputed[0], atol=0, rtol=0) == []
        assert torch.equal(logged, recomputed[1]) and metrics == recomputed[2]
    assert results[0][0][2] == results[1][0][2]  # the metrics agree across TP ranks


# ---------------------------------------------------------------- process_mtp_loss level

def _loss_inputs(depth, s, b=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((1 + depth) * s, b, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    return hidden, weight, labels, mask


def _loss_worker(rank, loss_type, depth, s, seq_lengths, pad, temperature=1.0):
    """Run the installed process_mtp_loss on this CP rank's zigzag slice; return grads."""
    import megatron.mtp_tv
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.mtp_tv.testing.packed import make_packed_seq_params, zigzag_cp_index

    megatron.mtp_tv.install()
    cp_group = parallel_state.get_context_parallel_group()
    cp, cp_rank = cp_group.size(), cp_group.rank()
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    packed = None
    cu = None
    if seq_lengths is not None:
        packed = make_packed_seq_params(seq_lengths, pad_to_multiple_of=pad, padded_as_real=pad > 1)
        cu = packed.cu_seqlens_q
    index = zigzag_cp_index(s, cp_rank, cp, cu) if cp > 1 else torch.arange(s)
    local_hidden = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)])
    local_hidden.requires_grad_()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
        mtp_loss_type=loss_type, mtp_tv_chunk=3, mtp_loss_scaling_factor=FACTOR,
        use_cpu_initialization=True, context_parallel_size=cp, mtp_tv_temperature=temperature,
    )
    layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False,
        gather_output=False,
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
    runs = []
    for fused in ('1', '0'):  # the default fused path, then the recompute path
        os.environ[FUSED_ENV] = fused
        local_hidden.grad = layer.weight.grad = None
        mtp.MTPLossLoggingHelper.tracker.clear()
        out = mtp.process_mtp_loss(
            hidden_states=local_hidden, labels=labels[:, index], loss_mask=mask[:, index],
            output_layer=layer, output_weight=None, runtime_gather_output=None, is_training=True,
            compute_language_model_loss=None, config=config, cp_group=cp_group,
            packed_seq_params=packed,
        )
        (out * 0).sum().backward()  # only the MTP loss riding on MTPLossAutoScaler
        logged = mtp.MTPLossLoggingHelper.tracker['loss_values'].clone()
        runs.append((local_hidden.grad, layer.weight.grad, logged))
    return (index, *runs[0], runs[1])


def _reference_for_rank(loss_type, depth, s, index, seq_bounds, temperature=1.0):
    """Megatron's CP semantics: each rank normalises by its own token count."""
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    chunks = hidden.chunk(1 + depth)
    alpha, kl = depth_terms(
        chunks[0].detach(), list(chunks[1:]), weight, seq_bounds=seq_bounds, temperature=temperature
    )
    masks = torch.stack([shifted_mask(mask, k + 1, seq_bounds).t() for k in range(depth)]).double()
    local_alpha, local_kl, local_masks = alpha[:, index], kl[:, index], masks[:, index]
    objective(loss_type, local_alpha, local_kl, local_masks, FACTOR).backward()
    grad = torch.cat([c.index_select(0, index) for c in hidden.grad.chunk(1 + depth)])
    per_token = per_token_values(loss_type, local_alpha, local_kl).detach()
    logged = (local_masks * per_token).sum((1, 2)) / local_masks.sum((1, 2)).clamp(min=1)
    return grad, weight.grad, logged


def _check_against_reference(results, loss_type, depth, s, seq_bounds, temperature=1.0):
    for index, grad, weight_grad, logged, recomputed in results:
        for fused_value, recomputed_value in zip((grad, weight_grad, logged), recomputed):
            assert torch.equal(fused_value, recomputed_value)  # fused and recompute paths agree
        ref_grad, ref_weight_grad, ref_tv = _reference_for_rank(
            loss_type, depth, s, index, seq_bounds, temperature
        )
        torch.testing.assert_close(logged.double(), ref_tv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(weight_grad.double(), ref_weight_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    'loss_type,depth,temperature', [('tv', 2, 1.0), ('e2e_tv', 3, 1.0), ('lk', 2, 0.7), ('kl', 2, 1.0), ('nla', 2, 0.8)]
)
@pytest.mark.parametrize('cp', [1, 2])
def test_context_parallel_zigzag_matches_full_sequence(loss_type, depth, temperature, cp):
    s = 16
    results = spawn(_loss_worker, cp, loss_type, depth, s, None, 1, temperature, cp=cp)
    _check_against_reference(results, loss_type, depth, s, None, temperature)


@pytest.mark.parametrize('loss_type,depth', [('tv', 2), ('e2e_tv', 2), ('kl', 2), ('lk', 2), ('nla', 2)])
@pytest.mark.parametrize('cp', [1, 2])
def test_packed_sequences_never_cross_a_boundary(loss_type, depth, cp):
    # Three sequences of different lengths in one row; with CP every slot is a multiple of 4.
    lengths, pad = ([5, 8, 3], 1) if cp == 1 else ([8, 12, 16], 4)
    s = sum(lengths)
    results = spawn(_loss_worker, cp, loss_type, depth, s, lengths, pad, cp=cp)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    _check_against_reference(results, loss_type, depth, s, bounds)


def test_context_parallel_chunk_shorter_than_depth_is_a_clear_error():
    from megatron.mtp_tv.testing.distributed import WorkerError

    with pytest.raises(WorkerError, match='shorter than mtp_num_layers=3'):
        spawn(_loss_worker, 2, 'tv', 3, 8, None, 1, cp=2)  # chunks of 2 positions
