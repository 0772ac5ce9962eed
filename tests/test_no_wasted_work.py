"""No gradient work where no gradient is wanted, counted in matrix products.

Evaluation (``torch.no_grad``, as Megatron's ``evaluate()``) and the metrics-only pass of
``mtp_log_acceptance`` need one projection per chunk (target and draft rows in one product);
training adds one input- and one weight-gradient product per chunk for all depths (fp32
weights). Counted with a torch dispatch mode, so a regression (e.g. deciding from
``ctx.needs_input_grad`` alone, which is True for a Parameter even under ``no_grad``) shows up
as extra products.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron.mtp_tv
from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES
from megatron.mtp_tv.config import MTPLossOptions
from mtp_tv_dev.distributed import single_process
from mtp_tv_dev.models import build_gpt_with_mtp, forced_grad_storage, forward_loss
from mtp_tv_dev.reference import token_weights

megatron.mtp_tv.install()

_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out,
             torch.ops.aten.addmm_.default}


class ProductCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    counter = ProductCounter()
    with counter:
        yield counter


def _inputs(G=2, s=12, b=2, h=8, V=32):
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(G, s, b, h, generator=g).requires_grad_()
    target = torch.randn(s, b, h, generator=g)
    weight = torch.nn.Parameter(torch.randn(V, h, generator=g))
    masks = torch.ones(G, s, b)
    return draft, target, weight, masks


@pytest.mark.parametrize('loss_type', list(LOSSES))
def test_products_in_eval_and_training(loss_type):
    G, chunk_positions = 2, 3
    draft, target, weight, masks = _inputs(G)
    chunks = 12 // chunk_positions
    options = MTPLossOptions(loss_type, chunk_size=chunk_positions * 2)
    with torch.no_grad(), counting() as evaluation:
        linear_tv_loss(draft, target, weight, token_weights(loss_type, masks), options)
    assert evaluation.count == chunks  # one projection per chunk, no gradient products
    with counting() as training:
        out = linear_tv_loss(draft, target, weight, token_weights(loss_type, masks), options)
        out.loss.backward()
    # projection + input grad + weight grad per chunk, every depth in each (fp32 weights)
    assert training.count == chunks * (1 + 2)


def _model_step(loss_type, log_acceptance, train=True):
    model = build_gpt_with_mtp(
        vocab_size=64, hidden_size=32, seq_length=8, mtp_num_layers=2, mtp_loss_type=loss_type,
        mtp_log_acceptance=log_acceptance, mtp_tv_chunk=8,
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    mask = torch.ones(2, 8)
    model.train(train)
    with counting() as counter:
        if train:
            loss = forward_loss(model, tokens, torch.roll(tokens, -1, 1), mask)
            loss.sum().backward()
        else:
            with torch.no_grad():
                forward_loss(model, tokens, torch.roll(tokens, -1, 1), mask)
    return counter.count


def test_ce_metrics_only_pass_costs_one_projection_per_chunk():
    with single_process():
        plain = _model_step('ce', False)
    with single_process():
        logged = _model_step('ce', True)
    # 16 tokens in chunks of 8: 2 chunks, one product each (no gradients in the metrics pass)
    assert logged - plain == 2


def test_tv_evaluation_forms_no_gradients():
    with single_process():
        evaluation = _model_step('tv', False, train=False)
    with single_process():
        ce_evaluation = _model_step('ce', False, train=False)
    # CE projects each of the 2 depths once; TV reads its target from the main logits and
    # projects the drafts once per chunk (2).
    assert evaluation == ce_evaluation


@pytest.mark.parametrize('storage', ['dense', 'logit_grads'])
def test_target_logits_project_only_the_drafts(storage):
    G, chunk_positions = 2, 3
    draft, target, weight, masks = _inputs(G)
    chunks = 12 // chunk_positions
    options = MTPLossOptions('tv', chunk_size=chunk_positions * 2)
    target_logits = target @ weight.detach().t()
    with torch.no_grad(), counting() as evaluation:
        linear_tv_loss(draft, None, weight, token_weights('tv', masks), options,
                       target_logits=target_logits)
    assert evaluation.count == chunks  # the draft rows of every depth in one product per chunk
    with counting() as training, forced_grad_storage(storage):
        out = linear_tv_loss(draft, None, weight, token_weights('tv', masks), options,
                             target_logits=target_logits)
        out.loss.backward()
    # dense: input grad + weight grad per chunk in forward, every depth in each; logit_grads:
    # both over all rows at once in backward.
    gradients = chunks * 2 if storage == 'dense' else 2
    assert training.count == chunks + gradients


def test_low_precision_weights_take_the_gradient_products_depth_by_depth():
    # bf16/fp16: one product per depth, so no [G*n, V/tp] low-precision copy of the logit
    # gradients exists at once (fp32 weights batch the depths: test above).
    G, chunk_positions = 2, 3
    draft, target, weight, masks = _inputs(G)
    weight = torch.nn.Parameter(weight.detach().bfloat16())
    chunks = 12 // chunk_positions
    with counting() as training:
        out = linear_tv_loss(draft, target.bfloat16(), weight, token_weights('tv', masks),
                             MTPLossOptions('tv', chunk_size=chunk_positions * 2))
        out.loss.backward()
    assert training.count == chunks * (1 + 2 * G)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _row_op_launches(device: str, rows: int, vocab: int = 151936) -> int:
    """aten calls (one kernel launch each on a GPU) of the torch row ops' passes over one
    chunk: normalise target and draft rows, the pair sums, the gradient. Fake tensors: the
    count needs shapes and devices only, not a GPU or the memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron.mtp_tv.row_ops import TorchRowOps

    with FakeTensorMode():
        zt, zq = (torch.empty(rows, vocab, device=device) for _ in range(2))
        coef = torch.empty(rows, device=device)
        ops = TorchRowOps()
        with _OpCounter() as counter:
            p, _ = ops.normalise_(zt, None)
            q, _ = ops.normalise_(zq, None, vocab_start=0)
            sums = ops.pair_sums(p, q, dot=True, kl=True)
            ops.grad_(p, q, sums.dot, coef, coef)
    return counter.count


def test_torch_row_ops_launch_per_chunk_on_cuda_and_block_for_the_cache_on_cpu():
    """On CUDA every pass of the torch row ops is one kernel over the chunk, whatever its rows
    (cache-sized blocks of ~6 rows at a 152k vocabulary would be thousands of launches per
    chunk); on a CPU the passes run block by block, so their count grows with the rows."""
    cuda = [_row_op_launches('cuda', rows) for rows in (64, 1024)]
    cpu = [_row_op_launches('cpu', rows) for rows in (64, 1024)]
    assert cuda[0] == cuda[1] < 200  # 186 here
    assert cpu[1] > 8 * cpu[0] and cpu[0] > 5 * cuda[0]
