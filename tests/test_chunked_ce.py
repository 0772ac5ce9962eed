"""``mtp_loss_type='ce'`` with ``mtp_ce_chunked``: Megatron's MTP cross-entropy computed in the
chunked sweep.

Held against Megatron's own ``'ce'`` code on the same inputs and layout (the loss it logs, the
gradients of every parameter to fp32 rounding): a whole GPTModel on one rank, tensor and sequence
parallel (TP=2) and ``process_mtp_loss`` under zigzag context parallelism and packed sequences;
and against a float64 cross-entropy written from its definition (chunks, gradient storages,
labels outside the vocabulary, a logit function, the contiguous packed layout
of NVIDIA dev). bf16/fp16 gradients are held to twice Megatron CE's own error in
``tests/test_precision.py``, peak memory to CE's in ``tests/test_memory_bound.py``.
"""


import contextlib

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import CrossEntropy
from megatron.mtp_tv.config import MTPLossOptions
from mtp_tv_dev.distributed import spawn
from mtp_tv_dev.models import forced_grad_storage, random_batch, sweep_targets_seen

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH, FACTOR = 64, 32, 12, 2, 0.3


def _batch(seed=0):
    return random_batch(VOCAB, SEQ, BATCH, seed)


# ------------------------------------------------------------------------- the sweep, float64

def _reference_ce(draft, weight, labels, token_weights, logits_fn=None):
    """``sum w * (logsumexp(z) - z_y)`` in float64; a label outside ``[0, V)`` has ``z_y = 0``
    (Megatron's vocab-parallel cross-entropy: no shard holds it)."""
    z = torch.einsum('gsbh,vh->gsbv', draft, weight)
    if logits_fn is not None:
        z = logits_fn(z)
    valid = (labels >= 0) & (labels < weight.shape[0])
    z_y = z.gather(-1, labels.clamp(0, weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
    return (token_weights * (z.logsumexp(-1) - torch.where(valid, z_y, torch.zeros_like(z_y)))).sum()


@pytest.mark.parametrize('chunk,grad_storage', [(1, 'dense'), (5, 'logit_grads'), (0, None)])
def test_sweep_matches_float64_cross_entropy(chunk, grad_storage):
    g = torch.Generator().manual_seed(3)
    G, s, b, h, V = 3, 7, 2, 16, 40
    draft = torch.randn(G, s, b, h, generator=g)
    weight = torch.randn(V, h, generator=g) * 0.4
    labels = torch.randint(0, V, (G, s, b), generator=g)
    labels[0, 0, 0], labels[1, 2, 1] = -100, V + 3  # an ignore index, a token past the vocabulary
    token_weights = torch.rand(G, s, b, generator=g)
    x, w = draft.clone().requires_grad_(), weight.clone().requires_grad_()
    with forced_grad_storage(grad_storage) if grad_storage else contextlib.nullcontext():
        out = linear_tv_loss(x, None, w, token_weights,
                             MTPLossOptions(CrossEntropy(), chunk_size=chunk), labels=labels)
    out.loss.backward()
    x64, w64 = draft.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference_ce(x64, w64, labels, token_weights.double())
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
    assert out.alpha is None  # no target rows were projected
    z = torch.einsum('gsbh,vh->gsbv', x64, w64)
    assert torch.equal(out.greedy_correct, z.argmax(-1) == labels)


def test_sweep_with_a_logit_function_and_the_metrics_from_a_target():
    g = torch.Generator().manual_seed(4)
    G, s, b, h, V = 2, 6, 1, 8, 24
    draft = torch.randn(G, s, b, h, generator=g)
    target = torch.randn(s, b, h, generator=g)
    weight = torch.randn(V, h, generator=g) * 0.5
    labels = torch.randint(0, V, (G, s, b), generator=g)
    token_weights = torch.rand(G, s, b, generator=g)

    def logits_fn(z):
        return z * 0.7

    x, w = draft.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_tv_loss(x, target, w, token_weights,
                         MTPLossOptions(CrossEntropy(), chunk_size=3, metrics=True,
                                        logits_fn=logits_fn), labels=labels)
    out.loss.backward()
    x64, w64 = draft.double().requires_grad_(), weight.double().requires_grad_()
    _reference_ce(x64, w64, labels, token_weights.double(), logits_fn).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
    # The acceptance of the same chunks, against the target: what 'tv' reports for them.
    tv = linear_tv_loss(draft, target, weight, token_weights,
                        MTPLossOptions('tv', chunk_size=3, metrics=True, logits_fn=logits_fn),
                        labels=labels)
    assert torch.equal(out.alpha, tv.alpha) and torch.equal(out.greedy_agreement, tv.greedy_agreement)


def test_sweep_refuses_what_cross_entropy_cannot_mean():
    x, w = torch.randn(1, 4, 1, 8), torch.randn(16, 8)
    weights, labels = torch.ones(1, 4, 1), torch.zeros(1, 4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match='labels are required'):
        linear_tv_loss(x, None, w, weights, MTPLossOptions(CrossEntropy()))
    with pytest.raises(ValueError, match='at temperature 1'):
        linear_tv_loss(x, None, w, weights, MTPLossOptions(CrossEntropy(), temperature=0.5),
                       labels=labels)
    with pytest.raises(ValueError, match='metrics compare with a target'):
        linear_tv_loss(x, None, w, weights, MTPLossOptions(CrossEntropy(), metrics=True),
                       labels=labels)


# ---------------------------------------------------------------------------------- config

@pytest.mark.parametrize('fields,message', [
    (dict(mtp_loss_type='tv', mtp_ce_chunked=True), "mtp_loss_type='tv' \\(always chunked\\)"),
    (dict(mtp_ce_chunked=True, mtp_tv_temperature=0.7), 'cross-entropy is at temperature 1'),
    (dict(mtp_ce_chunked=1), 'mtp_ce_chunked=1 is invalid; it must be True or False'),
])
def test_config_refuses_settings_it_would_ignore(fields, message):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, mtp_num_layers=2,
                          **fields)


def test_the_flag_is_a_megatron_argument(monkeypatch):
    from mtp_tv_dev.megatron_args import config_from_argv, miles_extra_args_provider
    from test_args_forwarding import BASE

    _, config = config_from_argv(BASE + ['--mtp-num-layers', '1', '--mtp-ce-chunked'], monkeypatch,
                                 provider=miles_extra_args_provider)
    assert config.mtp_loss_type == 'ce' and config.mtp_ce_chunked is True


# ------------------------------------------------------------- a GPTModel against Megatron's 'ce'

def _step(model, chunked, log_acceptance=False):
    """One forward and backward: ``(main loss, grads, tracker, metrics, sweeps seen)``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.mtp_tv.metrics import acceptance_metrics
    from mtp_tv_dev.models import forward_loss

    tokens, labels, mask = _batch()
    model.config.mtp_ce_chunked, model.config.mtp_log_acceptance = chunked, log_acceptance
    model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()
    with sweep_targets_seen() as seen:
        loss = forward_loss(model, tokens, labels, mask)
        ((loss * mask).sum() / mask.sum()).backward()
    tracker = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items()
               if k in ('loss_values', 'correct_values', 'total_values')}
    metrics = {k: float(v) for k, v in acceptance_metrics(MTPLossLoggingHelper.tracker).items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, tracker, metrics, seen


@pytest.mark.parametrize('tie,depth', [(True, 2), (False, 3)])
def test_gpt_model_matches_megatrons_cross_entropy(tie, depth):
    from mtp_tv_dev.distributed import single_process
    from mtp_tv_dev.models import build_gpt_with_mtp

    with single_process():
        model = build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ,
                                   mtp_num_layers=depth, tie_embeddings=tie, mtp_loss_type='ce',
                                   mtp_tv_chunk=5, mtp_loss_scaling_factor=FACTOR)
        loss, grads, tracker, metrics, seen = _step(model, chunked=False)
        c_loss, c_grads, c_tracker, c_metrics, c_seen = _step(model, chunked=True)
    assert seen == [] and c_seen == [False]  # Megatron's code, then one sweep without a target
    assert torch.equal(loss, c_loss)  # the main loss is Megatron's, bit for bit
    assert set(grads) == set(c_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(c_tracker['loss_values'], tracker['loss_values'], rtol=1e-6, atol=1e-6)
    for key in ('correct_values', 'total_values'):  # Megatron's greedy acceptance counts
        assert torch.equal(c_tracker[key], tracker[key])
    assert metrics == c_metrics == {}  # no acceptance statistics without mtp_log_acceptance


def test_acceptance_metrics_come_from_the_same_sweep_on_the_main_logits():
    from mtp_tv_dev.distributed import single_process
    from mtp_tv_dev.models import build_gpt_with_mtp

    with single_process():
        model = build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ,
                                   mtp_num_layers=2, mtp_loss_type='ce', mtp_tv_chunk=5)
        _, grads, _, metrics, seen = _step(model, chunked=False, log_acceptance=True)
        _, c_grads, _, c_metrics, c_seen = _step(model, chunked=True, log_acceptance=True)
    # Megatron's 'ce' runs a metrics-only sweep that projects its own target under no_grad; the
    # chunked loss is one sweep, on the main logits GPTModel._postprocess projects anyway.
    assert seen == [False] and c_seen == [True]
    assert set(c_metrics) == set(metrics) and c_metrics == pytest.approx(metrics, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _tp_worker(rank, sequence_parallel):
    import megatron.mtp_tv
    from mtp_tv_dev.cpu import allreduce_sequence_parallel_grads
    from mtp_tv_dev.models import build_gpt_with_mtp, gather_tp_params

    megatron.mtp_tv.install()
    model = build_gpt_with_mtp(vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ,
                               mtp_num_layers=2, sequence_parallel=sequence_parallel,
                               mtp_loss_type='ce', mtp_tv_chunk=5, mtp_loss_scaling_factor=FACTOR)
    runs = []
    for chunked in (False, True):
        loss, _, tracker, _, _ = _step(model, chunked)
        if sequence_parallel:
            allreduce_sequence_parallel_grads(model)
        runs.append((loss, gather_tp_params(model), tracker['loss_values']))
    return runs


@pytest.mark.parametrize('sequence_parallel', [False, True])
def test_tensor_and_sequence_parallel_match_megatrons_cross_entropy(sequence_parallel):
    from mtp_tv_dev.models import compare_gathered

    for (loss, params, logged), (c_loss, c_params, c_logged) in spawn(
        _tp_worker, 2, sequence_parallel, tp=2
    ):
        assert torch.equal(loss, c_loss)
        assert compare_gathered(params, c_params, atol=1e-7, rtol=1e-5) == []
        torch.testing.assert_close(c_logged, logged, rtol=1e-6, atol=1e-6)


# ---------------------------------------- process_mtp_loss: context parallelism, packed sequences

def _cp_worker(rank, depth, s, seq_lengths):
    """Megatron's 'ce' and the chunked one on this CP rank's zigzag rows: ``[(hidden grad,
    weight grad, logged loss)] * 2``."""
    import megatron.mtp_tv
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mtp_tv_dev.packed import make_packed_seq_params, zigzag_cp_index

    megatron.mtp_tv.install()
    cp_group = parallel_state.get_context_parallel_group()
    cp = cp_group.size()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn((1 + depth) * s, 1, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (1, s), generator=g)
    mask = (torch.rand(1, s, generator=g) > 0.2).float()
    packed = make_packed_seq_params(seq_lengths) if seq_lengths else None
    cu = packed.cu_seqlens_q if packed is not None else None
    index = zigzag_cp_index(s, cp_group.rank(), cp, cu) if cp > 1 else torch.arange(s)
    local = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)]).requires_grad_()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
        mtp_tv_chunk=3, mtp_loss_scaling_factor=FACTOR, use_cpu_initialization=True,
        context_parallel_size=cp,
    )
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_,
                                 bias=False, gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(weight)

    def language_model_loss(labels, logits):  # GPTModel.compute_language_model_loss
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1)).transpose(0, 1)

    runs = []
    for chunked in (False, True):
        config.mtp_ce_chunked = chunked
        local.grad = layer.weight.grad = None
        mtp.MTPLossLoggingHelper.tracker.clear()
        out = mtp.process_mtp_loss(
            hidden_states=local, labels=labels[:, index], loss_mask=mask[:, index],
            output_layer=layer, output_weight=None, runtime_gather_output=None, is_training=True,
            compute_language_model_loss=language_model_loss, config=config, cp_group=cp_group,
            packed_seq_params=packed,
        )
        (out * 0).sum().backward()  # only the MTP loss riding on MTPLossAutoScaler
        runs.append((local.grad.clone(), layer.weight.grad.clone(),
                     mtp.MTPLossLoggingHelper.tracker['loss_values'].clone()))
    return runs


@pytest.mark.parametrize('cp,seq_lengths', [(1, None), (2, None), (1, [5, 7, 4]), (2, [8, 4, 12])])
def test_context_parallel_and_packed_sequences_match_megatrons_cross_entropy(cp, seq_lengths):
    s = sum(seq_lengths) if seq_lengths else 16  # with CP, every sequence a multiple of 2 * cp
    for megatron_run, chunked_run in spawn(_cp_worker, cp, 2, s, seq_lengths, cp=cp):
        for got, want in zip(chunked_run, megatron_run):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# ------------------------------------ contiguous packed context parallelism (NVIDIA dev's layout)

#: Four packed sequences over two contiguous shards of 16 rows: two are cut by the shard boundary.
CONTIGUOUS_LENGTHS = [5, 13, 9, 5]


def _contiguous_worker(rank, depth):
    """The chunked 'ce' on this rank's contiguous shard, with dev's roll context and prefetched
    halos: ``(index, hidden grad, weight grad, logged per-depth loss)``."""
    import megatron.mtp_tv
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mtp_tv_dev.contiguous import contiguous_cp_index, tree_api
    from mtp_tv_dev.packed import make_packed_seq_params

    megatron.mtp_tv.install()
    api = tree_api(mtp)
    cp_group = parallel_state.get_context_parallel_group()
    s = sum(CONTIGUOUS_LENGTHS)
    hidden, weight, labels, mask = _contiguous_inputs(depth, s)
    index = contiguous_cp_index(s, cp_group.rank(), cp_group.size())
    packed = make_packed_seq_params(CONTIGUOUS_LENGTHS)
    packed.cp_partition_mode = 'contiguous'  # a field on dev; set as an attribute on 0.19.2
    local = dict(labels=labels[:, index], loss_mask=mask[:, index])
    context = api.prepare(local['labels'], cp_group, packed).prefetch_halos(width=depth + 1, **local)
    mtp.roll_tensor = api.roll_tensor  # dev's list form (this worker process only)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
        mtp_ce_chunked=True, mtp_tv_chunk=3, mtp_loss_scaling_factor=FACTOR,
        use_cpu_initialization=True, context_parallel_size=cp_group.size(),
    )
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_,
                                 bias=False, gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    local_hidden = torch.cat([c.index_select(0, index) for c in hidden.chunk(1 + depth)]).requires_grad_()
    mtp.MTPLossLoggingHelper.tracker.clear()
    out = api.process_mtp_loss(
        hidden_states=local_hidden, output_layer=layer, output_weight=None,
        runtime_gather_output=None, is_training=True, compute_language_model_loss=None,
        config=config, cp_group=cp_group, packed_seq_params=packed, sequence_roll_context=context,
        **local,
    )
    (out * 0).sum().backward()  # only the MTP loss riding on MTPLossAutoScaler
    return index, local_hidden.grad, layer.weight.grad, mtp.MTPLossLoggingHelper.tracker['loss_values'].clone()


def _contiguous_inputs(depth, s):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn((1 + depth) * s, 1, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (1, s), generator=g)
    mask = (torch.rand(1, s, generator=g) > 0.2).float()
    return hidden, weight, labels, mask


def _contiguous_reference(depth, index):
    """This rank's loss from the whole packed row in float64: depth k's label and mask are those
    ``k + 1`` rows on inside the same sequence, each rank normalising by its own token count (as
    Megatron's CE under context parallelism). ``(hidden grad, weight grad, logged)``."""
    from mtp_tv_dev.reference import shifted_mask

    s = sum(CONTIGUOUS_LENGTHS)
    bounds = [0]
    for n in CONTIGUOUS_LENGTHS:
        bounds.append(bounds[-1] + n)
    hidden, weight, labels, mask = _contiguous_inputs(depth, s)
    hidden, weight = hidden.double().requires_grad_(), weight.double().requires_grad_()
    drafts = hidden.chunk(1 + depth)[1:]
    loss, logged = 0, []
    for k in range(depth):
        z = (drafts[k][index, 0] @ weight.t())  # [n, V]
        label_k = shifted_mask(labels, k + 1, bounds)[0, index]
        mask_k = shifted_mask(mask, k + 1, bounds)[0, index].double()
        ce = z.logsumexp(-1) - z.gather(-1, label_k.unsqueeze(-1)).squeeze(-1)
        tokens = mask_k.sum().clamp(min=1)
        loss = loss + FACTOR / depth * (mask_k * ce).sum() / tokens
        logged.append(((mask_k * ce).sum() / tokens).detach())
    loss.backward()
    grad = torch.cat([c.index_select(0, index) for c in hidden.grad.chunk(1 + depth)])
    return grad, weight.grad, torch.stack(logged)


def test_contiguous_packed_context_parallel_matches_float64_cross_entropy():
    depth = 3
    for index, grad, weight_grad, logged in spawn(_contiguous_worker, 2, depth, cp=2):
        ref_grad, ref_weight_grad, ref_logged = _contiguous_reference(depth, index)
        torch.testing.assert_close(logged.double(), ref_logged, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(weight_grad.double(), ref_weight_grad, rtol=1e-4, atol=1e-7)
