# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Tests of ``TransformerConfig.mtp_loss_type`` through ``process_mtp_loss`` and ``GPTModel``.

Every loss is held to a float64 reference written here from its equation (full vocabulary,
unchunked): with p the main model's detached next-token distribution at position t + k + 1 and
q_k depth k's draft at t, both ``softmax(logits / T)``, alpha_k = sum_v min(p, q_k);
'tv': 1 - alpha_k per depth; 'e2e_tv': 1 - (1/D) sum_j prod_{i<=j} alpha_i per chain;
'kl': KL(p || q_k); 'lk': lambda KL + (1 - lambda)(1 - alpha_k), lambda = exp(-eta alpha_k)
held constant; 'nla': -log(max(alpha_k, 1e-5)) with d/dalpha = -1/max(alpha_k, 1e-5).
Each depth is normalised as Megatron's MTP cross-entropy is: the mean over its rolled loss
mask, times ``mtp_loss_scaling_factor / mtp_num_layers``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_model as gpt_model_module
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import multi_token_prediction as mtp_module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper, process_mtp_loss
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
LOSS_TYPES = ('tv', 'e2e_tv', 'kl', 'lk', 'nla')
NLA_FLOOR = 1e-5
SCALE = 0.3


class _OutputLayer:
    """The output layer as ``process_mtp_loss`` uses it: ``weight`` (a vocabulary shard under
    TP), its TP group and Megatron's ``gradient_accumulation_fusion`` flag."""

    def __init__(self, weight, tp_group=None, gradient_accumulation_fusion=False):
        self.weight = weight
        self.tp_group = tp_group
        self.sequence_parallel = False
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def __call__(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ (self.weight if weight is None else weight).t(), None


def _cross_entropy(labels, logits):
    """``[b, s]`` per-token cross-entropy of ``[s, b, V]`` logits."""
    return F.cross_entropy(logits.permute(1, 2, 0).float(), labels, reduction='none')


def _config(loss_type, depths=2, **kwargs):
    return TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        mtp_num_layers=depths,
        mtp_loss_scaling_factor=SCALE,
        mtp_loss_type=loss_type,
        use_cpu_initialization=True,
        **kwargs,
    )


def _depth_masks(loss_mask, depths, cu_seqlens=None):
    """``[D, b, s]``: depth k's mask at t is ``loss_mask[t + k + 1]`` inside t's sequence."""
    s = loss_mask.shape[-1]
    bounds = [0, s] if cu_seqlens is None else list(cu_seqlens)
    masks = torch.zeros(depths, *loss_mask.shape, dtype=torch.float64)
    for k in range(depths):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            masks[k, :, lo : hi - k - 1] = loss_mask[:, lo + k + 1 : hi].double()
    return masks


def _depth_labels(labels, depths, cu_seqlens=None):
    """``[D, b, s]``: depth k's label at t is ``labels[t + k + 1]`` (0 past its sequence)."""
    s = labels.shape[-1]
    bounds = [0, s] if cu_seqlens is None else list(cu_seqlens)
    out = torch.zeros(depths, *labels.shape, dtype=labels.dtype)
    for k in range(depths):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out[k, :, lo : hi - k - 1] = labels[:, lo + k + 1 : hi]
    return out


def _reference(hidden, weight, labels, loss_mask, config, cu_seqlens=None, positions=None):
    """``(objective, per-depth logged values [D])`` in float64 from ``[(1+D)*s, b, h]`` hidden
    states (differentiable w.r.t. the draft rows and ``weight``); ``positions``: those a
    context-parallel rank holds, which it normalises by its own tokens, as Megatron does."""
    depths, loss_type = config.mtp_num_layers, config.mtp_loss_type
    temperature = getattr(config, 'mtp_tv_temperature', 1.0)
    main, *drafts = torch.chunk(hidden, 1 + depths, dim=0)
    s = main.shape[0]
    masks = _depth_masks(loss_mask, depths, cu_seqlens).transpose(1, 2)  # [D, s, b]
    depth_labels = _depth_labels(labels, depths, cu_seqlens).transpose(1, 2)
    log_p_all = torch.log_softmax(main.detach() @ weight.detach().t() / temperature, -1)
    values, alphas = [], []
    for k, draft in enumerate(drafts):
        logits = draft @ weight.t()
        if loss_type == 'ce':
            log_q = torch.log_softmax(logits, -1)
            values.append(-log_q.gather(-1, depth_labels[k].unsqueeze(-1)).squeeze(-1))
            continue
        log_q = torch.log_softmax(logits / temperature, -1)
        target = (torch.arange(s) + k + 1).clamp(max=s - 1)
        log_p = log_p_all[target]  # masked past each sequence
        p, q = log_p.exp(), log_q.exp()
        alpha = torch.where(q < p, q, p).sum(-1)
        kl = (p * (log_p - log_q)).sum(-1)
        alphas.append(alpha)
        if loss_type in ('tv', 'e2e_tv'):
            values.append(1 - alpha)
        elif loss_type == 'kl':
            values.append(kl)
        elif loss_type == 'lk':
            lam = torch.exp(-config.mtp_lk_eta * alpha.detach())
            values.append(lam * kl + (1 - lam) * (1 - alpha))
        else:  # 'nla'
            kept = alpha.detach().clamp(min=NLA_FLOOR)
            values.append(-torch.log(kept) - (alpha - alpha.detach()) / kept)
    values = torch.stack(values)
    if positions is not None:
        values, masks, alphas = (
            values[:, positions],
            masks[:, positions],
            [a[positions] for a in alphas],
        )
    counts = masks.sum(dim=(1, 2)).clamp(min=1)
    logged = (values * masks).sum(dim=(1, 2)) / counts
    if loss_type == 'e2e_tv':
        chains = masks.prod(0)
        accepted = torch.stack(alphas).cumprod(0).sum(0)
        objective = SCALE * (chains * (1 - accepted / depths)).sum() / chains.sum().clamp(min=1)
    else:
        objective = SCALE / depths * logged.sum()
    return objective, logged.detach()


def _tracked_losses(depths):
    tracker = MTPLossLoggingHelper.tracker
    values = tracker['loss_values'] if 'loss_values' in tracker else tracker['values']
    return values[:depths].double().cpu()


def _inputs(s=12, b=2, h=16, vocab=40, depths=2, seed=0):
    """``(hidden [(1+D)*s, b, h], weight [V, h], labels [b, s], loss_mask [b, s])``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn((1 + depths) * s, b, h, generator=generator)
    weight = torch.randn(vocab, h, generator=generator) / math.sqrt(h)
    labels = torch.randint(0, vocab, (b, s), generator=generator)
    loss_mask = (torch.rand(b, s, generator=generator) > 0.2).float()
    return hidden, weight, labels, loss_mask


def _backward(config, hidden, weight, labels, loss_mask, output_layer=None, **kwargs):
    """``process_mtp_loss`` in training, ``backward()`` of its output's sum: the hidden states'
    gradient (``weight``'s is in ``weight.grad`` or ``main_grad``)."""
    hidden = hidden.detach().to(DEVICE).requires_grad_()
    result = process_mtp_loss(
        hidden_states=hidden,
        labels=labels.to(DEVICE),
        loss_mask=loss_mask.to(DEVICE),
        output_layer=output_layer or _OutputLayer(weight),
        output_weight=None,
        runtime_gather_output=None,
        is_training=True,
        compute_language_model_loss=_cross_entropy,
        config=config,
        **kwargs,
    )
    result.sum().backward()
    return hidden.grad


def _check_against_reference(config, hidden, weight, labels, loss_mask, grad, weight_grad):
    """Asserts the gradients are the reference's; returns its per-depth logged values."""
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    objective, logged = _reference(hidden64, weight64, labels, loss_mask, config)
    objective.backward()
    s = hidden.shape[0] // (1 + config.mtp_num_layers)
    # The main rows receive only the sum's ones: the target is detached.
    torch.testing.assert_close(grad[:s].cpu(), torch.ones_like(grad[:s].cpu()))
    torch.testing.assert_close(grad[s:].double().cpu(), hidden64.grad[s:], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight_grad.double().cpu(), weight64.grad, rtol=1e-4, atol=1e-6)
    return logged


class TestMTPLossType:
    """One rank: every loss, 'ce' and its chunked form, the fused weight gradient, a model."""

    def setup_method(self, method):
        """A world of one, seeded, an empty MTP tracker."""
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)
        MTPLossLoggingHelper.tracker = {}

    def teardown_method(self, method):
        """Parallel state and the MTP tracker cleared."""
        MTPLossLoggingHelper.tracker = {}
        Utils.destroy_model_parallel()

    def test_ce_is_megatrons_own_code(self, monkeypatch):
        """'ce' (the default) runs Megatron's MTP cross-entropy, not the new losses."""

        def forbidden(*args, **kwargs):
            raise AssertionError("mtp_loss_type='ce' reached the new MTP losses")

        monkeypatch.setattr(mtp_module, 'process_mtp_tv_loss', forbidden)
        config = _config('ce')
        hidden, weight, labels, loss_mask = _inputs()
        weight = weight.clone().to(DEVICE).requires_grad_()
        grad = _backward(config, hidden, weight, labels, loss_mask)
        _check_against_reference(
            config, hidden, weight.detach().cpu(), labels, loss_mask, grad, weight.grad
        )

    @pytest.mark.parametrize('loss_type', LOSS_TYPES)
    @pytest.mark.parametrize('temperature', [1.0, 0.7])
    def test_loss_matches_float64_reference(self, loss_type, temperature):
        """Loss, draft-row and weight gradients against the reference, in chunks of 5 tokens
        (rows of both sequences in one chunk, a chunk ending mid-sequence)."""
        config = _config(loss_type, mtp_tv_chunk=5, mtp_tv_temperature=temperature)
        hidden, weight, labels, loss_mask = _inputs()
        weight_param = weight.clone().to(DEVICE).requires_grad_()
        grad = _backward(config, hidden, weight_param, labels, loss_mask)
        logged = _check_against_reference(
            config, hidden, weight, labels, loss_mask, grad, weight_param.grad
        )
        torch.testing.assert_close(_tracked_losses(2), logged, rtol=1e-5, atol=1e-6)

    def test_chunked_ce_matches_float64_reference(self):
        """``mtp_ce_chunked``: Megatron's cross-entropy, one chunk of logits at a time."""
        config = _config('ce', mtp_ce_chunked=True, mtp_tv_chunk=5)
        hidden, weight, labels, loss_mask = _inputs()
        weight_param = weight.clone().to(DEVICE).requires_grad_()
        grad = _backward(config, hidden, weight_param, labels, loss_mask)
        _check_against_reference(config, hidden, weight, labels, loss_mask, grad, weight_param.grad)

    @pytest.mark.parametrize('loss_type', ['tv', 'kl'])
    def test_fused_weight_gradient_goes_to_main_grad(self, loss_type):
        """Under ``gradient_accumulation_fusion`` the output layer adds its weight gradient into
        ``main_grad`` and hands autograd no weight gradient; so does the loss: ``main_grad``
        accumulates the reference gradient onto what it held."""
        config = _config(loss_type, mtp_tv_chunk=5)
        hidden, weight, labels, loss_mask = _inputs()
        weight_param = weight.clone().to(DEVICE).requires_grad_()
        weight_param.main_grad = torch.ones_like(weight_param, dtype=torch.float32)
        layer = _OutputLayer(weight_param, gradient_accumulation_fusion=True)
        grad = _backward(config, hidden, weight_param, labels, loss_mask, output_layer=layer)
        expected_w_grad = weight_param.main_grad - 1
        assert weight_param.grad is None
        _check_against_reference(config, hidden, weight, labels, loss_mask, grad, expected_w_grad)

    def test_repeated_layer_model(self, monkeypatch):
        """A ``GPTModel`` whose one MTP layer is applied at every depth
        (``mtp_use_repeated_layer``), its loss on the main logits: the loss it logs per depth and
        the gradient of the MTP hidden states are the reference's on the hidden states the
        model splits into main and drafts."""
        seen = {}
        original = gpt_model_module.split_mtp_hidden_states

        def recording(hidden_states, config):
            hidden_states.retain_grad()
            seen['hidden_states'] = hidden_states
            return original(hidden_states, config)

        monkeypatch.setattr(gpt_model_module, 'split_mtp_hidden_states', recording)
        config = _config('tv', depths=3, mtp_use_repeated_layer=True, mtp_tv_chunk=7)
        vocab, s, b = 64, 16, 2
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=vocab,
            max_sequence_length=s,
            mtp_block_spec=get_gpt_mtp_block_spec(
                config, get_gpt_layer_local_spec(), use_transformer_engine=False
            ),
            share_embeddings_and_output_weights=False,
        ).to(DEVICE)
        assert len(model.mtp.layers) == 1
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (b, s), generator=generator).to(DEVICE)
        labels = torch.roll(tokens, -1, 1)
        loss_mask = torch.ones(b, s, device=DEVICE)
        position_ids = torch.arange(s, device=DEVICE).expand(b, s)
        model.train()
        loss = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
        loss.sum().backward()
        weight = model.output_layer.weight
        assert model.mtp.layers[0].eh_proj.weight.grad is not None
        hidden = seen['hidden_states'].detach().double().cpu().requires_grad_()
        weight64 = weight.detach().double().cpu().requires_grad_()
        objective, logged = _reference(hidden, weight64, labels.cpu(), loss_mask.cpu(), config)
        torch.testing.assert_close(_tracked_losses(3), logged, rtol=1e-5, atol=1e-6)
        objective.backward()
        torch.testing.assert_close(
            seen['hidden_states'].grad[s:].double().cpu(), hidden.grad[s:], rtol=1e-4, atol=1e-6
        )


@pytest.mark.skipif(Utils.world_size < 2, reason="needs 2 ranks")
class TestMTPLossTypeParallel:
    """Tensor- and context-parallel layouts against the single-rank reference."""

    def teardown_method(self, method):
        """Parallel state and the MTP tracker cleared."""
        MTPLossLoggingHelper.tracker = {}
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('loss_type', ['tv', 'e2e_tv'])
    def test_vocab_parallel(self, loss_type):
        """TP=2: each rank holds half the vocabulary; the row statistics are all-reduced."""
        Utils.initialize_model_parallel(tensor_model_parallel_size=2)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        config = _config(loss_type, mtp_tv_chunk=5, tensor_model_parallel_size=2)
        hidden, weight, labels, loss_mask = _inputs()
        vocab_local = weight.shape[0] // 2
        shard = weight[rank * vocab_local : (rank + 1) * vocab_local].to(DEVICE).requires_grad_()
        grad = _backward(config, hidden, shard, labels, loss_mask, _OutputLayer(shard, tp_group))
        hidden64, weight64 = (
            hidden.detach().double().requires_grad_(),
            weight.detach().double().requires_grad_(),
        )
        objective, logged = _reference(hidden64, weight64, labels, loss_mask, config)
        objective.backward()
        s = hidden.shape[0] // 3
        torch.testing.assert_close(grad[s:].double().cpu(), hidden64.grad[s:], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(
            shard.grad.double().cpu(),
            weight64.grad[rank * vocab_local : (rank + 1) * vocab_local],
            rtol=1e-4,
            atol=1e-6,
        )
        torch.testing.assert_close(_tracked_losses(2), logged, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize('packed', [False, True])
    @pytest.mark.parametrize('loss_type', ['tv', 'kl'])
    def test_context_parallel_zigzag(self, loss_type, packed):
        """CP=2, zigzag (each sequence in 4 chunks, rank r holds chunks r and 3 - r): the
        targets of a chunk's last positions are another rank's rows."""
        Utils.initialize_model_parallel(context_parallel_size=2)
        cp_group = parallel_state.get_context_parallel_group()
        rank = parallel_state.get_context_parallel_rank()
        config = _config(loss_type, mtp_tv_chunk=5, context_parallel_size=2)
        depths = config.mtp_num_layers
        s = 24
        cu_seqlens = [0, 8, 24] if packed else [0, s]
        hidden, weight, labels, loss_mask = _inputs(s=s, b=1)
        local = []  # this rank's positions, sequence by sequence
        for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            quarter = (hi - lo) // 4
            for c in (rank, 3 - rank):
                local += range(lo + c * quarter, lo + (c + 1) * quarter)
        local = torch.tensor(local)
        rows = torch.cat([local + d * s for d in range(1 + depths)])
        packed_seq_params = None
        if packed:
            cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=DEVICE)
            packed_seq_params = PackedSeqParams(
                qkv_format='thd',
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                cu_seqlens_q_padded=cu,
                cu_seqlens_kv_padded=cu,
                max_seqlen_q=16,
                max_seqlen_kv=16,
            )
        weight_param = weight.clone().to(DEVICE).requires_grad_()
        grad = _backward(
            config,
            hidden[rows],
            weight_param,
            labels[:, local],
            loss_mask[:, local],
            cp_group=cp_group,
            packed_seq_params=packed_seq_params,
        )
        hidden64, weight64 = (
            hidden.detach().double().requires_grad_(),
            weight.detach().double().requires_grad_(),
        )
        objective, logged = _reference(
            hidden64, weight64, labels, loss_mask, config, cu_seqlens if packed else None, local
        )
        objective.backward()
        n = local.numel()
        torch.testing.assert_close(
            grad[n:].double().cpu(), hidden64.grad[rows[n:]], rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(
            weight_param.grad.double().cpu(), weight64.grad, rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(_tracked_losses(depths), logged, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton row kernels need CUDA")
class TestMTPLossTypeTriton:
    """The Triton row kernels (``mtp_tv_kernels='triton'``) on CUDA."""

    def setup_method(self, method):
        """A world of one, an empty MTP tracker."""
        Utils.initialize_model_parallel(1, 1)
        MTPLossLoggingHelper.tracker = {}

    def teardown_method(self, method):
        """Parallel state and the MTP tracker cleared."""
        MTPLossLoggingHelper.tracker = {}
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize('loss_type', LOSS_TYPES)
    def test_triton_kernels_match_reference(self, loss_type):
        """Every loss through the Triton kernels against the float64 reference."""
        config = _config(loss_type, mtp_tv_chunk=5, mtp_tv_kernels='triton')
        hidden, weight, labels, loss_mask = _inputs()
        weight_param = weight.clone().to(DEVICE).requires_grad_()
        grad = _backward(config, hidden, weight_param, labels, loss_mask)
        _check_against_reference(config, hidden, weight, labels, loss_mask, grad, weight_param.grad)
