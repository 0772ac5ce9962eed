"""The draft losses under tensor, sequence and context parallelism and packed sequences.

Spawned gloo workers on CPU. Whole-model runs compare TP=2 against TP=1 with the same weights;
``process_mtp_loss``-level runs compare context-parallel ranks and packed rows against the
independent full-sequence reference in ``mtp_tv_dev.reference``. Every worker runs both target
sources: the main logits (the default) and the loss's own projection of the target.
"""

import contextlib
import importlib

import pytest
import torch

from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import spawn
from mtp_tv_dev.models import random_batch
from mtp_tv_dev.reference import depth_terms, objective, per_token_values, shifted_mask

VOCAB, HIDDEN, SEQ, BATCH, FACTOR = 64, 32, 12, 2, 0.3


def _batch(seed=0):
    return random_batch(VOCAB, SEQ, BATCH, seed)


def _model_worker(rank, loss_type, depth, tie, sequence_parallel):
    import megatron.mtp_tv
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.mtp_tv.metrics import acceptance_metrics
    from mtp_tv_dev.cpu import allreduce_sequence_parallel_grads
    from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss, gather_tp_params, own_projection

    megatron.mtp_tv.install()
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        tie_embeddings=tie, sequence_parallel=sequence_parallel, mtp_loss_type=loss_type,
        mtp_tv_chunk=5, mtp_loss_scaling_factor=FACTOR,
    )
    # The loss's own sequence-parallel all-gathers (draft, and target if needed), counted in
    # whichever copy of the loss the model runs: this checkout's, or a patched tree's own.
    gathers, originals = [], {}
    for name in ('megatron.mtp_tv.mtp_loss', 'megatron.core.transformer.mtp_tv.mtp_loss'):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module not in originals:
            originals[module] = gather = module.gather_from_sequence_parallel_region
            module.gather_from_sequence_parallel_region = (
                lambda *a, _gather=gather, **k: gathers.append(1) or _gather(*a, **k)
            )
    tokens, labels, mask = _batch()
    runs = []
    # The default (the target from the main logits), then the loss projecting its own target.
    for own in (False, True):
        for param in model.parameters():
            param.grad = None
        MTPLossLoggingHelper.tracker.clear()
        gathers.clear()
        with own_projection() if own else contextlib.nullcontext():
            loss = forward_loss(model, tokens, labels, mask)
        if sequence_parallel:  # the target from the main logits needs no gathered hidden states
            assert len(gathers) == (2 if own else 1), gathers
        ((loss * mask).sum() / mask.sum()).backward()
        if sequence_parallel:
            allreduce_sequence_parallel_grads(model)
        logged = MTPLossLoggingHelper.tracker['loss_values'].clone()
        metrics = {k: float(v) for k, v in acceptance_metrics(MTPLossLoggingHelper.tracker).items()}
        runs.append((gather_tp_params(model), logged, metrics))
    for module, gather in originals.items():
        module.gather_from_sequence_parallel_region = gather
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
    from mtp_tv_dev.models import compare_gathered

    ((ref_params, ref_logged, ref_metrics), _), = spawn(
        _model_worker, 1, loss_type, depth, tie, False
    )
    results = spawn(_model_worker, 2, loss_type, depth, tie, sequence_parallel, tp=2)
    for runs in results:
        for run_params, run_logged, run_metrics in runs:  # both target sources
            assert compare_gathered(ref_params, run_params, atol=1e-5, rtol=1e-4) == []
            torch.testing.assert_close(run_logged, ref_logged, rtol=1e-5, atol=1e-6)
            assert run_metrics == pytest.approx(ref_metrics, rel=1e-5)
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
    from megatron.core.transformer import multi_token_prediction as mtp
    from mtp_tv_dev.packed import make_packed_seq_params, zigzag_cp_index

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
    runs = _both_target_sources(
        mtp.process_mtp_loss, local_hidden, weight, loss_type, depth, cp, temperature,
        labels=labels[:, index], loss_mask=mask[:, index], cp_group=cp_group,
        packed_seq_params=packed,
    )
    return (index, *runs[0], runs[1])


def _both_target_sources(process_mtp_loss, local_hidden, weight, loss_type, depth, cp,
                         temperature=1.0, **inputs):
    """``process_mtp_loss`` on this rank's rows projecting its own target, then with the target
    from the main logits: ``[(hidden grad, weight grad, logged per-depth loss)] * 2``; under
    tensor parallelism the output layer and the main logits are this rank's vocabulary shard
    (the weight gradient too). ``inputs``: labels, loss mask and layout arguments."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp_group = parallel_state.get_tensor_model_parallel_group()
    weight = weight.chunk(tp_group.size())[tp_group.rank()]
    local_hidden = local_hidden.clone().requires_grad_()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
        mtp_loss_type=loss_type, mtp_tv_chunk=3, mtp_loss_scaling_factor=FACTOR,
        use_cpu_initialization=True, context_parallel_size=cp, mtp_tv_temperature=temperature,
        tensor_model_parallel_size=tp_group.size(),
    )
    layer = ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False,
        gather_output=False,
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
    local_hidden.grad = layer.weight.grad = None
    mtp.MTPLossLoggingHelper.tracker.clear()
    out = process_mtp_loss(
        hidden_states=local_hidden, output_layer=layer, output_weight=None,
        runtime_gather_output=None, is_training=True, compute_language_model_loss=None,
        config=config, **inputs,
    )
    (out * 0).sum().backward()  # only the MTP loss riding on MTPLossAutoScaler
    runs = [(local_hidden.grad, layer.weight.grad,
             mtp.MTPLossLoggingHelper.tracker['loss_values'].clone())]
    # The target read from this rank's main logits (what GPTModel._postprocess hands over); the
    # halo rows of other ranks are still hidden states, projected by the loss.
    from mtp_tv_dev.models import mtp_loss_on_main_logits

    local_hidden.grad = layer.weight.grad = None
    mtp.MTPLossLoggingHelper.tracker.clear()
    main_logits = local_hidden.detach().chunk(1 + depth)[0] @ weight.t()
    out = mtp_loss_on_main_logits(
        main_logits, hidden_states=local_hidden, output_layer=layer, output_weight=None,
        runtime_gather_output=None, is_training=True, compute_language_model_loss=None,
        config=config, **inputs,
    )
    (out * 0).sum().backward()
    logged = mtp.MTPLossLoggingHelper.tracker['loss_values'].clone()
    runs.append((local_hidden.grad, layer.weight.grad, logged))
    return runs


def _reference_for_rank(loss_type, depth, s, index, seq_bounds, temperature=1.0, mask_shift=1):
    """Megatron's CP semantics: each rank normalises by its own token count.

    ``mask_shift``: depth k's mask is the loss mask ``k + mask_shift`` positions on (2 when the
    labels are derived from the input ids, whose mask is rolled once more)."""
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    chunks = hidden.chunk(1 + depth)
    alpha, kl = depth_terms(
        chunks[0].detach(), list(chunks[1:]), weight, seq_bounds=seq_bounds, temperature=temperature
    )
    masks = torch.stack(
        [shifted_mask(mask, k + mask_shift, seq_bounds).t() for k in range(depth)]
    ).double()
    local_alpha, local_kl, local_masks = alpha[:, index], kl[:, index], masks[:, index]
    objective(loss_type, local_alpha, local_kl, local_masks, FACTOR).backward()
    grad = torch.cat([c.index_select(0, index) for c in hidden.grad.chunk(1 + depth)])
    per_token = per_token_values(loss_type, local_alpha, local_kl).detach()
    logged = (local_masks * per_token).sum((1, 2)) / local_masks.sum((1, 2)).clamp(min=1)
    return grad, weight.grad, logged


def _check_against_reference(
    results, loss_type, depth, s, seq_bounds, temperature=1.0, mask_shift=1
):
    for index, grad, weight_grad, logged, from_main_logits in results:
        ref_grad, ref_weight_grad, ref_tv = _reference_for_rank(
            loss_type, depth, s, index, seq_bounds, temperature, mask_shift
        )
        for got_grad, got_weight_grad, got_logged in ((grad, weight_grad, logged), from_main_logits):
            torch.testing.assert_close(got_logged.double(), ref_tv, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(got_weight_grad.double(), ref_weight_grad, rtol=1e-4, atol=1e-7)


#: ``(depth, temperature)`` of a loss in the context-parallel cases (default: 2 depths, T = 1).
_CP_SETTINGS = {'e2e_tv': (3, 1.0), 'lk': (2, 0.7), 'nla': (2, 0.8)}


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('cp', [1, 2])
def test_context_parallel_zigzag_matches_full_sequence(loss_type, cp):
    s = 16
    depth, temperature = _CP_SETTINGS.get(loss_type, (2, 1.0))
    results = spawn(_loss_worker, cp, loss_type, depth, s, None, 1, temperature, cp=cp)
    _check_against_reference(results, loss_type, depth, s, None, temperature)


@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('cp', [1, 2])
def test_packed_sequences_never_cross_a_boundary(loss_type, cp):
    depth = 2
    # Three sequences of different lengths in one row; with CP every slot is a multiple of 4.
    lengths, pad = ([5, 8, 3], 1) if cp == 1 else ([8, 12, 16], 4)
    s = sum(lengths)
    results = spawn(_loss_worker, cp, loss_type, depth, s, lengths, pad, cp=cp)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    _check_against_reference(results, loss_type, depth, s, bounds)


def test_context_parallel_chunk_shorter_than_depth_is_a_clear_error():
    from mtp_tv_dev.distributed import WorkerError

    with pytest.raises(WorkerError, match='shorter than mtp_num_layers=3'):
        spawn(_loss_worker, 2, 'tv', 3, 8, None, 1, cp=2)  # chunks of 2 positions


# ------------------------------------- contiguous packed context parallelism (NVIDIA dev)
#
# NVIDIA dev (and radixark miles-main-20260819) split a packed row contiguously over the CP ranks
# when packed_seq_params.cp_partition_mode == 'contiguous': rank r holds rows [r*n, (r+1)*n), so
# a sequence runs on from one rank into the next and the targets of depth k near a shard's end
# are the next rank's first rows. dev's GPTModel hands process_mtp_loss a sequence_roll_context
# holding mtp_num_layers + 1 label / mask / input-id rows prefetched from the next rank, and its
# rolls read them (field and roll depth named per call). megatron-core 0.19.2 has no such layout:
# mtp_tv_dev.contiguous rebuilds dev's context (same attributes, duck-typed), its
# list-form roll_tensor and its process_mtp_loss signature from dev's semantics; on a dev tree
# (plugin or patch mode) the tree's own functions are used instead. The reference is the
# full-sequence one, sliced to the rank's rows.

# Four sequences in 32 rows, 16 per rank: the second runs from rank 0 into rank 1 (its chains
# at the shard end continue in the halo, the last ones cross into the third sequence); the
# other layout ends a sequence exactly at the shard boundary (no halo row is valid).
CONTIGUOUS_LENGTHS = ([5, 13, 9, 5], [6, 10, 11, 5])


def _contiguous_worker(rank, loss_type, depth, lengths, derive_labels=False, prefetch=True,
                       temperature=1.0, layout='contiguous'):
    """Run process_mtp_loss on this rank's contiguous shard; also return every roll's
    ``(got the context, fields, roll_depth)``."""
    import functools

    import megatron.mtp_tv
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp
    from mtp_tv_dev.contiguous import contiguous_cp_index, tree_api
    from mtp_tv_dev.packed import make_packed_seq_params

    megatron.mtp_tv.install()
    api = tree_api(mtp)
    cp_group = parallel_state.get_context_parallel_group()
    s = sum(lengths)
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    index = contiguous_cp_index(s, cp_group.rank(), cp_group.size())
    packed = make_packed_seq_params(lengths)
    packed.cp_partition_mode = layout  # a field on dev; set as an attribute on 0.19.2
    local = dict(labels=labels[:, index], loss_mask=mask[:, index], input_ids=labels[:, index])
    context = api.prepare(local['labels'], cp_group, packed)
    if prefetch and context is not None:  # as dev's GPTModel.forward, before the MTP block
        context = context.prefetch_halos(width=depth + 1, **local)
    if derive_labels:  # RL: no labels; they are the input ids rolled once
        local['labels'] = None

    rolls = []

    @functools.wraps(api.roll_tensor)
    def recording_roll_tensor(tensors, *args, **kwargs):
        rolls.append((kwargs.get('roll_context') is context, kwargs.get('sequence_fields'),
                      kwargs.get('roll_depth', 0)))
        return api.roll_tensor(tensors, *args, **kwargs)

    mtp.roll_tensor = recording_roll_tensor  # this worker process only
    local_hidden = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)])
    runs = _both_target_sources(
        api.process_mtp_loss, local_hidden, weight, loss_type, depth, cp_group.size(),
        temperature, cp_group=cp_group, packed_seq_params=packed, sequence_roll_context=context,
        **local,
    )
    return (index, *runs[0], runs[1]), rolls, api.native


def _expected_rolls(depth, derive_labels):
    """dev's process_mtp_loss: each depth rolls labels (or input ids) and mask once more."""
    field = 'input_ids' if derive_labels else 'labels'
    first = [(True, ['input_ids'], 0), (True, ['loss_mask'], 0)] if derive_labels else []
    per_depth = [
        roll for k in range(depth)
        for roll in ((True, [field], k + derive_labels), (True, ['loss_mask'], k + derive_labels))
    ]
    return (first + per_depth) * 2  # projecting the target, then from the main logits


def _bounds(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


@pytest.mark.parametrize('loss_type', sorted(LOSSES))
def test_contiguous_packed_context_parallel_matches_full_sequence(loss_type):
    """Every registered loss, CP=2, depth 3: targets of a shard's last rows on the next rank."""
    depth, lengths, temperature = 3, CONTIGUOUS_LENGTHS[0], 0.7 if loss_type == 'lk' else 1.0
    out = spawn(_contiguous_worker, 2, loss_type, depth, lengths, False, True, temperature, cp=2)
    _check_against_reference([r for r, _, _ in out], loss_type, depth, sum(lengths),
                             _bounds(lengths), temperature)
    for _, rolls, _ in out:  # the context reached every roll, with dev's fields and depths
        assert rolls == _expected_rolls(depth, False)


@pytest.mark.parametrize(
    'loss_type,derive_labels,prefetch,lengths',
    [('e2e_tv', True, True, CONTIGUOUS_LENGTHS[0]), ('tv', False, False, CONTIGUOUS_LENGTHS[1])],
)
def test_contiguous_packed_context_parallel_labels_from_input_ids_and_without_halos(
    loss_type, derive_labels, prefetch, lengths
):
    """Labels derived from the input ids (RL: one roll more, so every halo read is one row
    further); and a context without prefetched halos (dev's fallback: each roll exchanges one
    row) with a sequence ending exactly at the shard boundary."""
    depth = 2
    out = spawn(_contiguous_worker, 2, loss_type, depth, lengths, derive_labels, prefetch, cp=2)
    _check_against_reference([r for r, _, _ in out], loss_type, depth, sum(lengths),
                             _bounds(lengths), mask_shift=1 + derive_labels)
    for _, rolls, _ in out:
        assert rolls == _expected_rolls(depth, derive_labels)


def test_contiguous_shard_shorter_than_depth_is_a_clear_error():
    from mtp_tv_dev.distributed import WorkerError

    with pytest.raises(WorkerError, match='contiguous layout: shards of 2 positions are shorter '
                                          'than mtp_num_layers=3'):
        spawn(_contiguous_worker, 2, 'tv', 3, [3, 1], False, False, cp=2)


def test_an_unknown_context_parallel_layout_is_a_clear_error():
    from mtp_tv_dev.distributed import WorkerError

    with pytest.raises(WorkerError, match=r"layouts \('zigzag', 'contiguous'\); packed_seq_params"
                                          r".cp_partition_mode='striped' is not supported"):
        spawn(_contiguous_worker, 2, 'tv', 2, CONTIGUOUS_LENGTHS[0], False, False, 1.0, 'striped',
              cp=2)
