"""The CPU test/demo support layer (mtp_tv_dev) does what the other tests rely on:
megatron-core GPTModel with MTP runs forward+backward on CPU, TP=2 (with and without sequence
parallel) reproduces TP=1, the packed-sequence and context-parallel helpers follow megatron's
conventions, and spawn() reports worker failures instead of hanging."""

import time

import pytest
import torch

from mtp_tv_dev import cpu, distributed, models, packed

VOCAB, HIDDEN, SEQ, BATCH, DEPTHS = 64, 32, 16, 2, 2
TOL = 1e-5


def _batch(seed=0, batch=BATCH, seq=SEQ, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    mask = torch.ones(batch, seq)
    mask[0, 3] = 0.0  # a masked position, so the mask actually matters
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


# TP=2 variants -> the TP=1 variant they must reproduce. "swiglu" has the fc1 weight sharded
# with partition_stride 2 (interleaved gate/up halves), which gather_tp_params must undo.
TP_VARIANTS = {
    "no_sp": ({}, "no_sp"),
    "sp": ({"sequence_parallel": True}, "no_sp"),
    "swiglu": ({"gated_linear_unit": True, "activation_func": "silu"}, "swiglu"),
}


def _train_step(rank, variant):
    """Build, run forward+backward with the mean masked loss, return (loss [b,s], params)."""
    kwargs = dict(TP_VARIANTS[variant][0])
    if kwargs.get("activation_func") == "silu":
        kwargs["activation_func"] = torch.nn.functional.silu
    tokens, labels, mask = _batch()
    model = models.build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=DEPTHS, **kwargs
    )
    loss = models.forward_loss(model, tokens, labels, mask)
    ((loss * mask).sum() / mask.sum()).backward()
    cpu.allreduce_sequence_parallel_grads(model)
    return loss.detach(), models.gather_tp_params(model)


def _tp2_worker(rank):
    return {variant: _train_step(rank, variant) for variant in TP_VARIANTS}


def _raise_on_rank_1(rank):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _sleep_on_rank_0(rank):
    if rank == 0:
        time.sleep(60)
    return rank


def _return_rank_and_groups(rank, extra):
    from megatron.core import parallel_state as ps

    return (rank, extra, ps.get_tensor_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())


def _cp_roll_worker(rank, full, cu_seqlens):
    """roll_tensor over a CP group of 2 on zigzag-split inputs (plain and packed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    cp_group = ps.get_context_parallel_group()
    cp_rank, cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    plain, _ = roll_tensor(packed.split_for_cp(full, cp_rank, cp_size), -1, -1, cp_group)
    params = packed.make_packed_seq_params(
        (cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), pad_to_multiple_of=2 * cp_size,
        padded_as_real=True,
    )
    local = packed.split_for_cp(full, cp_rank, cp_size, cu_seqlens=params.cu_seqlens_q)
    rolled_packed, _ = roll_tensor(local, -1, -1, cp_group, packed_seq_params=params)
    return plain, rolled_packed


# --------------------------------------------------------------------------------------------
# single process


def test_shims_are_idempotent_target_cpu_and_undo():
    original_current_device = torch.cuda.current_device
    cpu.apply_cpu_shims()
    count = len(cpu._PATCHES)
    cpu.apply_cpu_shims()
    assert len(cpu._PATCHES) == count > 0
    assert torch.device(torch.cuda.current_device()).type == "cpu"
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.equal(get_default_causal_mask(4), cpu.causal_attention_mask(4)[0, 0])
    cpu.remove_cpu_shims()
    assert torch.cuda.current_device is original_current_device and not cpu.cpu_shims_applied()


def test_gpt_with_mtp_forward_backward_on_cpu(megatron_cpu):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tokens, labels, mask = _batch()
    model = models.build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=DEPTHS
    )
    assert len(model.mtp.layers) == DEPTHS
    with models.capture_mtp_hidden_states(model) as cap:
        loss = models.forward_loss(model, tokens, labels, mask)
    assert loss.shape == (BATCH, SEQ) and torch.isfinite(loss).all()
    ((loss * mask).sum() / mask.sum()).backward()

    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    for depth in range(DEPTHS):  # the MTP loss reached every depth
        assert model.mtp.layers[depth].eh_proj.weight.grad.abs().sum() > 0

    # The captured per-depth hidden states reproduce megatron's logged MTP losses.
    assert cap.calls == 1 and len(cap.depths) == DEPTHS
    assert cap.main.shape == (SEQ, BATCH, HIDDEN)
    tracker = MTPLossLoggingHelper.tracker["loss_values"]
    weight = model.shared_embedding_or_output_weight()
    ref_labels, ref_mask = labels, mask
    for depth, hidden in enumerate(cap.depths):
        ref_labels = torch.nn.functional.pad(ref_labels[:, 1:], (0, 1))
        ref_mask = torch.nn.functional.pad(ref_mask[:, 1:], (0, 1))
        logits = (hidden @ weight.t()).transpose(0, 1)  # [b, s, V]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), ref_labels.reshape(-1), reduction="none"
        ).view(BATCH, SEQ)
        expected = (ce * ref_mask).sum() / ref_mask.sum()
        assert torch.allclose(tracker[depth], expected, atol=TOL), depth


def test_default_causal_mask_matches_explicit_mask(megatron_cpu):
    tokens, labels, mask = _batch()
    model = models.build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ)
    with torch.no_grad():
        explicit = models.forward_loss(model, tokens, labels, mask)
        default = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels,
                        loss_mask=mask)
        no_mask = models.forward_loss(
            model, tokens, labels, mask,
            attention_mask=torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool),
        )
    assert torch.allclose(explicit, default, atol=1e-6)
    assert not torch.allclose(explicit, no_mask, atol=1e-3)  # the mask is really applied


def test_single_process_is_reentrant_and_cleans_up():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    for _ in range(2):
        with distributed.single_process():
            assert dist.get_world_size() == 1 and ps.model_parallel_is_initialized()
            with distributed.single_process(seed=7):
                assert ps.get_tensor_model_parallel_world_size() == 1
            assert ps.model_parallel_is_initialized()
            MTPLossLoggingHelper.tracker["loss_values"] = torch.ones(1)
            ps.set_tensor_model_parallel_world_size(4)  # what a test may change in between
        assert not ps.model_parallel_is_initialized()
        assert distributed.keeps_world() and dist.get_world_size() == 1  # kept for the next use
        assert not cpu.cpu_shims_applied()  # torch.cuda is left as it was found
        assert MTPLossLoggingHelper.tracker == {}
    assert distributed.run_single_process(lambda rank, x: (rank, x), 5) == (0, 5)


def test_single_process_restores_megatrons_state_and_rebuilds_a_destroyed_world():
    """The kept world comes back as initialize_model_parallel left it; a world somebody
    destroyed, or one somebody else initialised, is not mistaken for it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with distributed.single_process():
        groups = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        ps.set_tensor_model_parallel_world_size(4)
    with distributed.single_process():
        assert ps.get_tensor_model_parallel_world_size() == 1
        assert (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()) == groups
        dist.destroy_process_group()
    assert not distributed.keeps_world()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert not distributed.keeps_world()  # somebody else's world of one
    dist.destroy_process_group()
    with distributed.single_process():
        assert distributed.keeps_world() and ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_group() is not groups[0]
        x = torch.ones(3)
        dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
        assert x.tolist() == [1.0, 1.0, 1.0]


def test_same_seed_same_weights(megatron_cpu):
    a = models.gather_tp_params(models.build_gpt_with_mtp(seed=3), grads=False)
    b = models.gather_tp_params(models.build_gpt_with_mtp(seed=3), grads=False)
    c = models.gather_tp_params(models.build_gpt_with_mtp(seed=4), grads=False)
    assert models.compare_gathered(a, b, atol=0, rtol=0, grads=False) == []
    assert models.compare_gathered(a, c, grads=False) != []


# --------------------------------------------------------------------------------------------
# tensor parallel over two gloo processes


@pytest.fixture(scope="module")
def tp1_references():
    return {
        variant: distributed.run_single_process(_train_step, variant)
        for variant in {reference for _, reference in TP_VARIANTS.values()}
    }


@pytest.fixture(scope="module")
def tp2_results():
    return distributed.spawn(_tp2_worker, 2, tp=2)


@pytest.mark.parametrize("variant", list(TP_VARIANTS))
def test_tp2_matches_tp1(tp1_references, tp2_results, variant):
    ref_loss, ref_params = tp1_references[TP_VARIANTS[variant][1]]
    for rank, by_variant in enumerate(tp2_results):
        loss, params = by_variant[variant]
        assert torch.allclose(loss, ref_loss, atol=TOL), (rank, (loss - ref_loss).abs().max())
        assert models.compare_gathered(ref_params, params, atol=TOL, rtol=TOL) == [], rank
        # The comparison covers sharded params of every kind, with their grads.
        assert params["embedding.word_embeddings.weight"].data.shape == (VOCAB, HIDDEN)
        assert params["mtp.layers.1.eh_proj.weight"].grad.shape == (HIDDEN, 2 * HIDDEN)
        fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"].data.shape
        assert fc1 == ((8 if variant == "swiglu" else 4) * HIDDEN, HIDDEN)


def test_spawn_returns_results_by_rank_with_groups():
    out = distributed.spawn(_return_rank_and_groups, 2, "x", tp=1, cp=2)
    assert out == [(0, "x", 1, 2, 1), (1, "x", 1, 2, 1)]


def test_spawn_propagates_worker_exceptions():
    start = time.monotonic()
    with pytest.raises(distributed.WorkerError) as info:
        distributed.spawn(_raise_on_rank_1, 2)
    assert "rank 1" in str(info.value) and "ValueError: boom from rank 1" in str(info.value)
    assert time.monotonic() - start < 30


def test_spawn_enforces_timeout():
    start = time.monotonic()
    with pytest.raises(distributed.WorkerError, match="timed out"):
        distributed.spawn(_sleep_on_rank_0, 2, timeout=3)
    assert time.monotonic() - start < 20


# --------------------------------------------------------------------------------------------
# packed sequences and context parallel


def test_packed_seq_params():
    params = packed.make_packed_seq_params([3, 5])
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 8] and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv.tolist() == [0, 3, 8]
    assert params.cu_seqlens_q_padded is None and params.max_seqlen_q == 5
    assert packed.packed_position_ids(params).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]

    padded = packed.make_packed_seq_params([3, 5], pad_to_multiple_of=4)
    assert padded.cu_seqlens_q.tolist() == [0, 3, 8]
    assert padded.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert padded.cu_seqlens_kv_padded.tolist() == [0, 4, 12]
    assert padded.max_seqlen_q == padded.max_seqlen_kv == 8
    assert packed.packed_position_ids(padded).tolist() == [[0, 1, 2, 3] + list(range(8))]
    assert packed.packed_loss_mask([3, 5], pad_to_multiple_of=4).tolist() == [
        [1, 1, 1, 0] + [1] * 5 + [0] * 3
    ]
    as_real = packed.make_packed_seq_params([3, 5], pad_to_multiple_of=4, padded_as_real=True)
    assert as_real.cu_seqlens_q.tolist() == [0, 4, 12]

    with pytest.raises(ValueError):
        packed.make_packed_seq_params([3, 0])


def test_roll_tensor_respects_packed_boundaries():
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    params = packed.make_packed_seq_params([3, 5])
    rolled, total = roll_tensor(torch.arange(1, 9).view(1, 8), -1, -1, None, params)
    assert rolled.tolist() == [[2, 3, 0, 5, 6, 7, 8, 0]] and int(total) == 31


def test_zigzag_cp_index():
    assert packed.zigzag_cp_index(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert packed.zigzag_cp_index(8, 1, 2).tolist() == [2, 3, 4, 5]
    cu = torch.tensor([0, 4, 12])
    assert packed.zigzag_cp_index(12, 0, 2, cu).tolist() == [0, 3, 4, 5, 10, 11]
    assert packed.zigzag_cp_index(12, 1, 2, cu).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError):
        packed.zigzag_cp_index(6, 0, 2)


def test_roll_tensor_with_cp2_matches_full_roll():
    """Our zigzag split + megatron's CP roll == the full roll, split the same way."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    full = torch.arange(1, 25, dtype=torch.float32).view(2, 12)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    params = packed.make_packed_seq_params([4, 8])
    expected_plain, _ = roll_tensor(full, -1, -1, None)
    expected_packed, _ = roll_tensor(full, -1, -1, None, packed_seq_params=params)
    results = distributed.spawn(_cp_roll_worker, 2, full, cu, cp=2)
    for cp_rank, (plain, rolled_packed) in enumerate(results):
        assert torch.equal(plain, packed.split_for_cp(expected_plain, cp_rank, 2))
        assert torch.equal(
            rolled_packed, packed.split_for_cp(expected_packed, cp_rank, 2, cu_seqlens=cu)
        )


def test_packed_forward_matches_separate_sequences(megatron_cpu):
    """THD-packed row through the full model (attention shim) == each sequence on its own."""
    lengths = [5, 7]
    model = models.build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ)
    tokens, labels, _ = _batch(seed=1, batch=1, seq=sum(lengths))
    params = packed.make_packed_seq_params(lengths)
    with torch.no_grad(), models.capture_mtp_hidden_states(model) as cap:
        packed_loss = models.forward_loss(model, tokens, labels, None, packed_seq_params=params)
        packed_depths = [d.clone() for d in cap.depths]
        start = 0
        for length in lengths:
            sl = slice(start, start + length)
            alone = models.forward_loss(model, tokens[:, sl], labels[:, sl], None)
            assert torch.allclose(packed_loss[:, sl], alone, atol=TOL)
            for depth, hidden in enumerate(cap.depths):
                assert torch.allclose(packed_depths[depth][sl], hidden, atol=TOL), depth
            start += length
