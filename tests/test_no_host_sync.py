"""The loss path of a micro-batch reads nothing back to the host.

On a GPU, ``nonzero``, ``.item()``, ``.tolist()`` or ``bool(tensor)`` each stall the host until
the device has caught up, and each breaks CUDA-graph capture. On a CPU they cost nothing, so
they are caught here by name: a ``TorchFunctionMode`` for the Python-level reads (``tolist``,
``item``, ``bool``/``int``/``float``/``index`` of a tensor) and a ``TorchDispatchMode`` for
aten's data-dependent ops (``nonzero``, ``_local_scalar_dense``, ``masked_select``, ``unique``,
boolean indexing). Megatron's own ``roll_tensor`` is exempt: its packed-sequence branch slices
at every sequence's bounds (not this package's code, and Megatron's cross-entropy path runs it
too).

What is checked: forward and backward of the chunked sweep for every loss and for the chunked
cross-entropy, with several target segments and halo rows (what context parallelism gives), and
the whole ``process_mtp_loss`` dispatch of a ``GPTModel``, packed and unpacked. Zigzag context
parallelism with packed sequences still reads the packed bounds once per micro-batch (the halos'
place depends on them): that case is not here.
"""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import megatron.mtp_tv
from megatron.mtp_tv.linear_tv import linear_tv_loss
from megatron.mtp_tv.losses import LOSSES, CrossEntropy
from megatron.mtp_tv.config import MTPLossOptions
from megatron.mtp_tv.alignment import TargetSegment
from mtp_tv_dev.reference import token_weights

megatron.mtp_tv.install()

#: Tensor methods that read a value back to Python.
HOST_READS = {'tolist', 'item', '__bool__', '__int__', '__float__', '__index__', 'numpy'}
#: aten ops whose output shape or value depends on the data (or that read it to the host).
DATA_DEPENDENT = {'nonzero', '_local_scalar_dense', 'masked_select', '_unique2', 'unique_dim',
                  'unique_consecutive', 'repeat_interleave'}


class HostSyncError(AssertionError):
    pass


class _Exempt:
    depth = 0


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, '__name__', '')
        if name in HOST_READS and not _Exempt.depth:
            raise HostSyncError(f'Tensor.{name} reads a value back to the host')
        return func(*args, **(kwargs or {}))


class _NoDataDependentOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _Exempt.depth:
            name = func._schema.name.split('::')[-1]
            if name in DATA_DEPENDENT:
                raise HostSyncError(f'aten.{name} depends on the data (a host synchronisation)')
            if name == 'index' and any(t is not None and t.dtype == torch.bool
                                       for t in (args[1] if len(args) > 1 else ())):
                raise HostSyncError('boolean indexing (a nonzero inside)')
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    with _NoHostReads(), _NoDataDependentOps():
        yield


@contextlib.contextmanager
def megatron_roll_exempt():
    """Megatron's ``roll_tensor`` runs outside the checks (it is called by attribute lookup)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    original = mtp.roll_tensor

    def roll_tensor(*args, **kwargs):
        _Exempt.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _Exempt.depth -= 1

    mtp.roll_tensor = roll_tensor
    try:
        yield
    finally:
        mtp.roll_tensor = original


def test_the_checks_catch_what_they_are_for():
    """Each kind of read the issue found (a ``nonzero`` on labels, a ``tolist`` of packed
    bounds) and the other usual ones fail inside ``no_host_sync``."""
    x = torch.arange(6)
    for read in (lambda: (x >= 2).nonzero(), lambda: x.tolist(), lambda: x[1].item(),
                 lambda: bool(x[2] > 1), lambda: x[x > 2], lambda: int(x[0])):
        with pytest.raises(HostSyncError), no_host_sync():
            read()
    with no_host_sync():  # data-independent work passes
        torch.where(x >= 2, x, 0).scatter_add_(0, x, torch.ones_like(x)).sum()


def _inputs(G, S=11, B=2, H=8, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(G, S, B, H, generator=g).requires_grad_()
    target = torch.randn(S, B, H, generator=g)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    masks = (torch.rand(G, S, B, generator=g) > 0.2).float()
    labels = torch.randint(0, V, (G, S, B), generator=g)
    return draft, target, weight, masks, labels


@pytest.mark.parametrize('loss_type', list(LOSSES) + ['ce'])
@pytest.mark.parametrize('given', ['projection', 'main_logits'])
def test_sweep_forward_and_backward_read_nothing_back(loss_type, given):
    G = 2
    draft, target, weight, masks, labels = _inputs(G)
    loss_fn = CrossEntropy() if loss_type == 'ce' else loss_type
    segments = [TargetSegment(0, 5, halo=target[5 : 5 + G]), TargetSegment(5, target.shape[0])]
    options = MTPLossOptions(loss_fn, chunk_size=3, metrics=True)
    kwargs = dict(segments=segments, labels=labels)
    if given == 'main_logits':
        kwargs['target_logits'] = target @ weight.detach().t()
    w = token_weights('tv' if loss_type == 'ce' else loss_type, masks)

    def run():
        out = linear_tv_loss(draft, None if given == 'main_logits' else target, weight, w,
                             options, **kwargs)
        out.loss.backward()
        return out

    run()  # first call: whatever is decided once per process (row kernels, GEMM path)
    with no_host_sync():
        run()


@pytest.mark.parametrize('loss_type', ['ce_chunked'] + list(LOSSES))
@pytest.mark.parametrize('packed', [False, True], ids=['unpacked', 'packed'])
def test_process_mtp_loss_reads_nothing_back(megatron_cpu, loss_type, packed):
    """Megatron's MTP loss path with the plugin (the dispatcher, the rolls, the sweep and the
    tracker's metrics) on a ``GPTModel``'s hidden states, forward and backward."""
    from megatron.core.models.gpt import gpt_model
    from mtp_tv_dev.models import build_gpt_with_mtp
    from mtp_tv_dev.packed import make_packed_seq_params

    S, depth = 12, 2
    config = dict(mtp_loss_type='ce', mtp_ce_chunked=True) if loss_type == 'ce_chunked' else \
        dict(mtp_loss_type=loss_type)
    model = build_gpt_with_mtp(vocab_size=40, hidden_size=16, seq_length=S, mtp_num_layers=depth,
                               mtp_tv_chunk=5, **config)
    g = torch.Generator().manual_seed(1)
    batch = 1 if packed else 2
    tokens = torch.randint(0, 40, (batch, S), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    params = make_packed_seq_params([5, 7]) if packed else None
    hidden = torch.randn((1 + depth) * S, batch, 16, generator=g).requires_grad_()
    weight = model.shared_embedding_or_output_weight()

    def run():
        out = gpt_model.process_mtp_loss(
            hidden_states=hidden, labels=labels, loss_mask=torch.ones(batch, S),
            output_layer=model.output_layer, output_weight=weight, runtime_gather_output=None,
            is_training=True, compute_language_model_loss=model.compute_language_model_loss,
            config=model.config, cp_group=model.pg_collection.cp, tp_group=model.tp_group,
            packed_seq_params=params, scale_logits_fn=None, input_ids=tokens)
        out.backward(torch.zeros_like(out))

    with megatron_roll_exempt():
        run()
        with no_host_sync():
            run()
