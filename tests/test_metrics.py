"""Acceptance metrics in Megatron's tracker and the end-to-end chain mask."""

import pytest
import torch

import megatron.mtp_tv
from megatron.mtp_tv.losses import LOSSES
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss
from tests.model_reference import mtp_reference_objective, recorded_mtp_hidden
from mtp_tv_dev.reference import depth_alphas, e2e_objective

megatron.mtp_tv.install()

VOCAB, HIDDEN, SEQ, BATCH, FACTOR = 64, 32, 12, 2, 0.3


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.25).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _expected_metrics(depth, temperature=1.0):
    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        mtp_loss_scaling_factor=FACTOR,
    )
    tokens, labels, mask = _batch()
    with recorded_mtp_hidden() as record:
        forward_loss(model, tokens, labels, mask)
    weight = model.shared_embedding_or_output_weight()
    _, alpha, masks, _ = mtp_reference_objective(
        record['hidden'], depth, weight, mask, 'tv', FACTOR, temperature=temperature
    )
    alpha = alpha.detach()
    # Greedy verification: depth k's argmax at t against the main model's argmax at t+k+1.
    with torch.no_grad():
        argmax = [(h @ weight.t()).argmax(-1) for h in record['hidden'].chunk(1 + depth)]  # [s, b]
    agree = torch.zeros_like(alpha)
    for k in range(depth):
        agree[k, : SEQ - k - 1] = (argmax[k + 1][: SEQ - k - 1] == argmax[0][k + 1 :]).double()
    expected = {
        f'mtp_{k + 1}_tv_acceptance': float((alpha[k] * masks[k]).sum() / masks[k].sum())
        for k in range(depth)
    }
    chains = masks.prod(0)
    accepted = alpha.cumprod(0).sum(0)
    drafts = float((accepted * chains).sum() / chains.sum())
    expected['mtp_expected_accepted_drafts'] = drafts
    expected['mtp_expected_tokens_per_step'] = 1 + drafts
    for k in range(depth):
        expected[f'mtp_{k + 1}_greedy_agreement'] = float((agree[k] * masks[k]).sum() / masks[k].sum())
    expected['mtp_expected_accepted_drafts_greedy'] = float(
        (agree.cumprod(0).sum(0) * chains).sum() / chains.sum()
    )
    return expected


def _logged_metrics(depth, total_loss_dict=None, **config):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model = build_gpt_with_mtp(
        vocab_size=VOCAB, hidden_size=HIDDEN, seq_length=SEQ, mtp_num_layers=depth,
        mtp_loss_scaling_factor=FACTOR, mtp_tv_chunk=5, **config,
    )
    tokens, labels, mask = _batch()
    loss = forward_loss(model, tokens, labels, mask)
    ((loss * mask).sum() / mask.sum()).backward()
    writer = _Writer()
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, writer, total_loss_dict=total_loss_dict)
    return writer.scalars


@pytest.mark.parametrize('config', [
    {'mtp_loss_type': name, **({'mtp_tv_temperature': 0.7} if name == 'lk' else {})} for name in LOSSES
] + [
    {'mtp_loss_type': 'ce', 'mtp_log_acceptance': True},
    {'mtp_loss_type': 'ce', 'mtp_log_acceptance': True, 'mtp_tv_temperature': 0.6},
])
def test_tracker_metrics_match_reference_alphas(config):
    with single_process():
        expected = _expected_metrics(3, config.get('mtp_tv_temperature', 1.0))
    with single_process():
        totals = {}
        logged = _logged_metrics(3, total_loss_dict=totals, **config)
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, rel=1e-5), name
        # Megatron's console iteration line prints every total_loss_dict entry.
        assert float(totals[name]) == pytest.approx(value, rel=1e-5), name
    assert {'mtp_1 loss', 'mtp_1_acceptance_rate'} <= logged.keys()  # Megatron's own, kept


def test_ce_without_opt_in_logs_no_acceptance():
    with single_process():
        logged = _logged_metrics(2, mtp_loss_type='ce')
    assert 'mtp_1 loss' in logged and not any('tv_acceptance' in k for k in logged)


def test_packed_chain_mask_two_sequences_gamma_two():
    """Lengths 5 and 3, mask all ones, gamma 2: chains at positions 0, 1, 2 and 5 only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.mtp_tv import mtp_loss
    from mtp_tv_dev.packed import make_packed_seq_params

    with single_process():
        g = torch.Generator().manual_seed(0)
        depth, s = 2, 8
        hidden = torch.randn((1 + depth) * s, 1, HIDDEN, generator=g, requires_grad=True)
        labels = torch.randint(0, VOCAB, (1, s), generator=g)
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, mtp_num_layers=depth,
            mtp_loss_type='e2e_tv', mtp_loss_scaling_factor=1.0, use_cpu_initialization=True,
        )
        layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_,
                                     bias=False, gather_output=False)
        seen = {}
        real = mtp_loss.linear_tv_loss

        def spy(*args, **kwargs):
            seen['weights'] = args[3]
            seen['result'] = real(*args, **kwargs)
            return seen['result']

        mtp_loss.linear_tv_loss = spy
        try:
            mtp.process_mtp_loss(
                hidden_states=hidden, labels=labels, loss_mask=torch.ones(1, s), output_layer=layer,
                output_weight=None, runtime_gather_output=None, is_training=True,
                compute_language_model_loss=None, config=config,
                packed_seq_params=make_packed_seq_params([5, 3]),
            )
        finally:
            mtp_loss.linear_tv_loss = real
        weights = seen['weights'][:, 0]
        assert weights.nonzero().flatten().tolist() == [0, 1, 2, 5]
        assert torch.allclose(weights[[0, 1, 2, 5]], torch.full((4,), 0.25))
        chunks = hidden.detach().double().chunk(1 + depth)
        alpha = depth_alphas(chunks[0], list(chunks[1:]), layer.weight.detach().double(), seq_bounds=[0, 5, 8])
        chains = torch.zeros(depth, s, 1, dtype=torch.float64)
        chains[:, [0, 1, 2, 5]] = 1
        expected = e2e_objective(alpha, chains, 1.0)
        assert float(seen['result'].loss) == pytest.approx(float(expected), rel=1e-5)
