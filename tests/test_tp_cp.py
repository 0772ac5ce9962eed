"""Tensor and context parallelism together: TP=2 x CP=2 on four gloo ranks (miles' Qwen3.5
default layout), every loss, zigzag CP, unpacked and packed sequences, the target projected by
the loss and read from the main logits (this rank's vocabulary shard, or the gathered vocabulary
that an output layer with ``gather_output`` returns, sliced by the loss to this rank's shard).

``process_mtp_loss`` runs on each rank's rows and vocabulary shard; the reference is the
independent full-sequence, full-vocabulary float64 objective (``mtp_tv_dev.reference``) sliced
to the rank's positions (each CP rank normalises by its own tokens, as Megatron does) and its
weight gradient to the rank's shard. The hidden-state gradient of every TP rank is the whole
vocabulary's (the copy-to-TP region's backward all-reduces it).
"""

import pytest
import torch

from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import spawn
from tests.test_parallel import FACTOR, HIDDEN, VOCAB, _loss_inputs, _reference_for_rank


def _tp_cp_worker(rank, loss_type, depth, s, seq_lengths, pad, main_logits_layout):
    import megatron.mtp_tv
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mtp_tv_dev.models import mtp_loss_on_main_logits
    from mtp_tv_dev.packed import make_packed_seq_params, zigzag_cp_index

    megatron.mtp_tv.install()
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp, cp_rank, tp, tp_rank = cp_group.size(), cp_group.rank(), tp_group.size(), tp_group.rank()
    hidden, weight, labels, mask = _loss_inputs(depth, s)
    packed = cu = None
    if seq_lengths is not None:
        packed = make_packed_seq_params(seq_lengths, pad_to_multiple_of=pad, padded_as_real=pad > 1)
        cu = packed.cu_seqlens_q
    index = zigzag_cp_index(s, cp_rank, cp, cu)
    local_hidden = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)])
    local_hidden.requires_grad_()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
        mtp_loss_type=loss_type, mtp_tv_chunk=3, mtp_loss_scaling_factor=FACTOR,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, context_parallel_size=cp,
    )
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_,
                                 bias=False, gather_output=False)
    shard = weight.chunk(tp)[tp_rank]
    with torch.no_grad():
        layer.weight.copy_(shard)
    inputs = dict(hidden_states=local_hidden, labels=labels[:, index], loss_mask=mask[:, index],
                  output_layer=layer, output_weight=None, runtime_gather_output=None,
                  is_training=True, compute_language_model_loss=None, config=config,
                  cp_group=cp_group, tp_group=tp_group, packed_seq_params=packed)
    main = local_hidden.detach().chunk(1 + depth)[0]
    runs = {}
    for source in ('projection', 'main_logits'):
        local_hidden.grad = layer.weight.grad = None
        mtp.MTPLossLoggingHelper.tracker.clear()
        if source == 'projection':
            out = mtp.process_mtp_loss(**inputs)
        else:  # this rank's shard, or the gathered vocabulary (gather_output / runtime gather)
            logits = main @ (weight if main_logits_layout == 'gathered' else shard).t()
            out = mtp_loss_on_main_logits(logits, **inputs)
        (out * 0).sum().backward()  # only the MTP loss riding on MTPLossAutoScaler
        runs[source] = (local_hidden.grad.clone(), layer.weight.grad.clone(),
                        mtp.MTPLossLoggingHelper.tracker['loss_values'].clone())
    return index, tp_rank, tp, runs


def _check(results, loss_type, depth, s, seq_bounds, temperature=1.0):
    for index, tp_rank, tp, runs in results:
        ref_grad, ref_weight_grad, ref_logged = _reference_for_rank(
            loss_type, depth, s, index, seq_bounds, temperature)
        ref_shard = ref_weight_grad.chunk(tp)[tp_rank]
        for source, (grad, weight_grad, logged) in runs.items():
            msg = f'{source}, TP rank {tp_rank}'
            torch.testing.assert_close(logged.double(), ref_logged, rtol=1e-5, atol=1e-6, msg=msg)
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7, msg=msg)
            torch.testing.assert_close(weight_grad.double(), ref_shard, rtol=1e-4, atol=1e-7,
                                       msg=msg)


@pytest.mark.slow
@pytest.mark.parametrize('loss_type', list(LOSSES))
@pytest.mark.parametrize('packed', [False, True], ids=['unpacked', 'packed'])
def test_tp2_cp2_zigzag_matches_full_sequence(loss_type, packed):
    depth = 3 if loss_type == 'e2e_tv' else 2
    lengths, pad = ([12, 16, 20], 4) if packed else (None, 1)  # CP chunks of >= 3 positions
    s = sum(lengths) if packed else 16
    layout = 'gathered' if loss_type in ('tv', 'nla') else 'shard'
    results = spawn(_tp_cp_worker, 4, loss_type, depth, s, lengths, pad, layout, tp=2, cp=2)
    bounds = None
    if packed:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
    _check(results, loss_type, depth, s, bounds)


@pytest.mark.slow
@pytest.mark.parametrize('loss_type', ['e2e_tv', 'lk'])
def test_tp2_cp2_contiguous_packed_matches_full_sequence(loss_type):
    """NVIDIA dev's contiguous layout (``cp_partition_mode='contiguous'``, through the dev
    ``process_mtp_loss`` with its sequence roll context, ``mtp_tv_dev.contiguous``) with TP=2:
    each rank's shard of the packed row and its vocabulary shard, both target sources."""
    from tests.test_parallel import (CONTIGUOUS_LENGTHS, _bounds, _contiguous_worker,
                                     _expected_rolls)

    depth, lengths = (3 if loss_type == 'e2e_tv' else 2), CONTIGUOUS_LENGTHS[0]
    temperature = 0.7 if loss_type == 'lk' else 1.0
    out = spawn(_contiguous_worker, 4, loss_type, depth, lengths, False, True, temperature,
                tp=2, cp=2)
    results = []
    for rank, ((index, grad, weight_grad, logged, from_main_logits), rolls, _) in enumerate(out):
        assert rolls == _expected_rolls(depth, False)
        runs = {'projection': (grad, weight_grad, logged), 'main_logits': from_main_logits}
        results.append((index, rank % 2, 2, runs))  # Megatron's rank order: TP innermost
    _check(results, loss_type, depth, sum(lengths), _bounds(lengths), temperature)

