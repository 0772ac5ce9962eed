"""Tiny megatron-core GPTModels with MTP for CPU tests and the demo.

Call these inside :func:`mtp_tv_dev.distributed.spawn` workers or
:func:`~mtp_tv_dev.distributed.single_process` (they need megatron's parallel state
and the CPU shims).

How GPTModel 0.19.2 wires MTP (``models/gpt/gpt_model.py::_postprocess``):
``hidden = decoder(...)`` (after the final norm) -> ``hidden = self.mtp(...)`` returns the
concatenation ``[(1+D)*s, b, h]`` (main chunk first, then one chunk per depth; each chunk is
``[s/tp, b, h]`` under sequence parallelism) -> ``process_mtp_loss(hidden, labels, loss_mask,
output_layer, output_weight, ...)`` adds the MTP losses through ``MTPLossAutoScaler`` and returns
the main chunk -> ``output_layer`` -> ``compute_language_model_loss(labels, logits)`` ``[b, s]``.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, NamedTuple, Optional

import torch

__all__ = [
    "random_batch",
    "own_projection",
    "forced_grad_storage",
    "sweep_targets_seen",
    "build_gpt_with_mtp",
    "build_hybrid_with_mtp",
    "forward_loss",
    "MTPCapture",
    "capture_mtp_hidden_states",
    "gather_sequence_parallel",
    "GatheredParam",
    "gather_tp_params",
    "compare_gathered",
]


def random_batch(vocab: int, seq: int, batch: int, seed: int = 0, keep: float = 0.75):
    """``(tokens [b, s], labels [b, s], loss_mask [b, s])``: labels the next tokens, a random
    fraction ``keep`` of the mask set."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    mask = (torch.rand(batch, seq, generator=g) > 1 - keep).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def _loss_modules(name: str) -> list:
    """Module ``name`` of every copy of the loss package this process has: this checkout's
    ``megatron.mtp_tv`` and a patched tree's ``megatron.core.transformer.mtp_tv`` (in patch mode
    they are one package in the test process, two in a spawned worker)."""
    import importlib
    import importlib.util

    modules = []
    for package in ('megatron.mtp_tv', 'megatron.core.transformer.mtp_tv'):
        try:
            found = importlib.util.find_spec(f'{package}.{name}') is not None
        except ImportError:  # the parent package is missing
            found = False
        if found:
            module = importlib.import_module(f'{package}.{name}')
            if module not in modules:
                modules.append(module)
    return modules


@contextlib.contextmanager
def _patched(name: str, attribute: str, make) -> Iterator[None]:
    """``<loss package>.<name>.<attribute> = make(original)`` in every copy, restored after."""
    saved = []
    for module in _loss_modules(name):
        owner, _, attr = attribute.rpartition('.')
        target = getattr(module, owner) if owner else module
        saved.append((target, attr, target.__dict__[attr] if owner else getattr(target, attr)))
        setattr(target, attr, make(saved[-1][2]))
    try:
        yield
    finally:
        for target, attr, original in saved:
            setattr(target, attr, original)


@contextlib.contextmanager
def own_projection() -> Iterator[None]:
    """While open, ``GPTModel._postprocess`` computes its MTP loss in ``process_mtp_loss``, before
    the main logits exist, so the TV losses project their target themselves, as they do where no
    main logits follow (``HybridModel``, an ``output_processor``): the other target source on the
    same model, for comparisons. Patch mode too (the patched tree's package and ``gpt_model``'s
    binding of the predicate, as well as this checkout's package)."""
    import megatron.core.models.gpt.gpt_model as gpt_model

    never = lambda original: (lambda *args, **kwargs: False)  # noqa: E731
    with _patched('mtp_loss', 'mtp_loss_follows_main_logits', never):
        name = 'mtp_loss_follows_main_logits'
        bound = gpt_model.__dict__.get(name)  # patch mode: imported by name
        if bound is not None:
            setattr(gpt_model, name, never(bound))
        try:
            yield
        finally:
            if bound is not None:
                setattr(gpt_model, name, bound)


def forced_grad_storage(storage: str):
    """While open, ``linear_tv_loss`` keeps ``storage`` (``'dense'`` or ``'logit_grads'``) for
    backward, whatever its shapes would choose (:func:`~megatron.mtp_tv.linear_tv.choose_grad_storage`)."""
    return _patched('linear_tv', 'choose_grad_storage',
                    lambda original: (lambda *args, **kwargs: storage))


@contextlib.contextmanager
def sweep_targets_seen() -> Iterator[List[bool]]:
    """For every ``linear_tv_loss`` call of the MTP loss while open, whether it read the main
    logits as its target (``target_logits`` given)."""
    from megatron.mtp_tv import mtp_loss

    seen, original = [], mtp_loss.linear_tv_loss

    def spy(*args, **kwargs):
        seen.append(kwargs.get('target_logits') is not None)
        return original(*args, **kwargs)

    mtp_loss.linear_tv_loss = spy
    try:
        yield seen
    finally:
        mtp_loss.linear_tv_loss = original


def _cpu_config(vocab_size, num_layers, hidden_size, num_attention_heads, mtp_num_layers,
                sequence_parallel, params_dtype, overrides):
    """A ``TransformerConfig`` for a CPU model in the current parallel layout (no dropout, CPU
    initialisation, no gradient-accumulation fusion), with ``overrides`` applied last."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if vocab_size % tp != 0:
        raise ValueError(f"vocab_size={vocab_size} must be divisible by TP={tp}")
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        mtp_num_layers=mtp_num_layers,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_with_mtp(
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 1,
    mtp_num_layers: int = 2,
    seq_length: int = 16,
    num_attention_heads: int = 4,
    tie_embeddings: bool = True,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    position_embedding_type: str = "learned_absolute",
    rotary_base: int = 10000,
    **config_overrides,
):
    """A megatron-core ``GPTModel`` with ``mtp_num_layers`` MTP depths, local (non-TE) spec.

    Weights are initialised on the CPU from a full master weight that is then split over TP
    (``use_cpu_initialization=True``), after re-seeding with ``seed``: the same seed gives the
    same full weights at any TP size. Dropout is 0. ``tensor_model_parallel_size`` and
    ``context_parallel_size`` come from megatron's parallel state. Any other ``TransformerConfig``
    field (``mtp_loss_type``, ``mtp_tv_chunk``, ``mtp_detach_heads``, ``calculate_per_token_loss``,
    ``mtp_loss_scaling_factor``, ...) can be passed through ``config_overrides``.
    ``position_embedding_type`` may be ``'learned_absolute'``, ``'rope'`` (base ``rotary_base``, a
    ``GPTModel`` argument, not a config field) or ``'none'``. ``normalization='RMSNorm'`` in
    ``config_overrides`` also selects RMSNorm in the layer spec.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mtp_tv_dev.distributed import seed_everything

    config = _cpu_config(
        vocab_size, num_layers, hidden_size, num_attention_heads, mtp_num_layers,
        sequence_parallel, params_dtype, config_overrides,
    )

    layer_spec = get_gpt_layer_local_spec(normalization=config.normalization)
    mtp_block_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    seed_everything(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        mtp_block_spec=mtp_block_spec,
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type=position_embedding_type,
        rotary_base=rotary_base,
        parallel_output=True,
    )
    return model


def _local_hybrid_stack_spec():
    """A ``HybridStack`` spec with attention (``*``) and MLP (``-``) layers and MTP, local modules.

    megatron-core 0.19.2 ships only Transformer Engine specs for the hybrid model
    (``hybrid_layer_specs.py``), so this one reuses the local GPT layer spec's pieces: its
    attention half for ``*`` (``TransformerLayer`` with input norm, ``SelfAttention``), its MLP
    half for ``-`` (``MLPLayer`` with pre-MLP norm), and a ``MultiTokenPredictionLayer`` with
    local norms and a ``ColumnParallelLinear`` ``eh_proj`` whose inner layers are built from the
    MTP pattern with this same stack spec. No Mamba (``M``): ``MambaMixer`` raises ImportError
    without the ``mamba_ssm`` package, whose scan kernels are CUDA/Triton only.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = get_gpt_layer_local_spec().submodules
    norm = gpt.input_layernorm
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda
        ),
    )
    mtp_layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
            layer_norm=norm,
        ),
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=attention, mlp_layer=mlp, mtp_block_spec=mtp_block
        ),
    )


@contextlib.contextmanager
def _hybrid_final_norm_without_te():
    """While a ``HybridModel`` is built: the decoder's final norm from torch, not TE.

    ``HybridStack.__init__`` builds its final norm (``post_layer_norm``) with ``TENorm``
    unconditionally, whatever the spec says, and ``TENorm`` raises ``ImportError`` without
    Transformer Engine: the one piece of an attention/MLP hybrid model that cannot be built on
    a CPU. The name is looked up only there, so swapping the module's ``TENorm`` for the torch
    norm the local specs use (same ``(config, hidden_size, eps)`` constructor, LayerNorm or
    RMSNorm from ``config.normalization``) during construction changes nothing else; the MTP
    layers' inner stacks have ``post_layer_norm=False`` and their own local norms.
    """
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    saved = hybrid_block.TENorm
    hybrid_block.TENorm = WrappedTorchNorm
    try:
        yield
    finally:
        hybrid_block.TENorm = saved


def build_hybrid_with_mtp(
    vocab_size: int = 128,
    hidden_size: int = 32,
    main_pattern: str = "*-",
    mtp_pattern: str = "*-",
    mtp_num_layers: int = 2,
    seq_length: int = 16,
    num_attention_heads: int = 4,
    tie_embeddings: bool = True,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    position_embedding_type: str = "learned_absolute",
    **config_overrides,
):
    """A megatron-core ``HybridModel`` with ``mtp_num_layers`` MTP depths, attention/MLP only.

    The layer pattern is ``main_pattern`` followed by ``/mtp_pattern`` once per depth
    (megatron's unified ``hybrid_layer_pattern``, e.g. ``'*-/*-/*-'``), with ``*`` attention and
    ``-`` MLP layers from local (non-TE) modules (:func:`_local_hybrid_stack_spec`; Mamba and
    the other TE-only layer types are not available). Initialisation, dropout, parallel sizes and
    ``config_overrides`` are as in :func:`build_gpt_with_mtp`; ``num_layers`` is
    ``len(main_pattern)``, as megatron's argument validation derives it.
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mtp_tv_dev.distributed import seed_everything

    if set(main_pattern + mtp_pattern) - set("*-"):
        raise ValueError(
            f"patterns {main_pattern!r}/{mtp_pattern!r}: only '*' (attention) and '-' (MLP) "
            "layers can be built without Transformer Engine"
        )
    config = _cpu_config(
        vocab_size, len(main_pattern), hidden_size, num_attention_heads, mtp_num_layers,
        sequence_parallel, params_dtype, config_overrides,
    )
    seed_everything(seed)
    with _hybrid_final_norm_without_te():
        model = HybridModel(
            config=config,
            hybrid_stack_spec=_local_hybrid_stack_spec(),
            vocab_size=vocab_size,
            max_sequence_length=seq_length,
            hybrid_layer_pattern=main_pattern + f"/{mtp_pattern}" * mtp_num_layers,
            share_embeddings_and_output_weights=tie_embeddings,
            position_embedding_type=position_embedding_type,
            parallel_output=True,
        )
    return model


def _default_position_ids(tokens: torch.Tensor, packed_seq_params) -> torch.Tensor:
    if packed_seq_params is not None:
        from mtp_tv_dev.packed import packed_position_ids

        return packed_position_ids(packed_seq_params, tokens.size(0)).to(tokens.device)
    batch, seq = tokens.shape
    return torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)


def forward_loss(
    model,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    packed_seq_params=None,
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run ``model`` forward and return the main per-token loss ``[b, s]`` (unmasked).

    The MTP losses are not in the returned tensor: ``process_mtp_loss`` attaches them to the
    graph through ``MTPLossAutoScaler``, so ``backward()`` of anything computed from the returned
    loss also back-propagates ``scale * sum(mtp_loss)`` (scaled by
    ``MTPLossAutoScaler.main_loss_backward_scale``, 1 by default).

    ``tokens``/``labels``/``loss_mask`` are ``[b, s]`` with labels already shifted once
    (``labels[:, t] = tokens[:, t+1]``). ``position_ids`` default to ``arange(s)`` (restarting
    per sequence when ``packed_seq_params`` is given, ``b`` must then be 1). ``attention_mask``
    defaults to the causal mask (ignored for packed batches, see ``cpu.py``).
    """
    from mtp_tv_dev.cpu import causal_attention_mask

    if position_ids is None:
        position_ids = _default_position_ids(tokens, packed_seq_params)
    if attention_mask is None and packed_seq_params is None:
        attention_mask = causal_attention_mask(tokens.size(1), device=tokens.device)
    return model(
        input_ids=tokens,
        position_ids=position_ids,
        attention_mask=attention_mask,
        labels=labels,
        loss_mask=loss_mask,
        packed_seq_params=packed_seq_params,
    )


class MTPCapture:
    """What :func:`capture_mtp_hidden_states` recorded for the latest forward.

    ``output`` is the MTP block's output ``[(1+D)*s_local, b, h]`` (still in the autograd graph);
    ``main`` is its first chunk (the decoder output after its final norm) and ``depths[k]`` the
    output of MTP depth ``k`` (0-based; after that depth's final norm). Under sequence
    parallelism every chunk is this rank's ``[s/tp, b, h]`` slice: use
    :func:`gather_sequence_parallel` for the full sequence. ``calls`` counts forwards.
    """

    def __init__(self, num_depths: int):
        self.num_depths = num_depths
        self.output: Optional[torch.Tensor] = None
        self.calls = 0

    @property
    def chunks(self) -> List[torch.Tensor]:
        if self.output is None:
            raise RuntimeError("no forward has been captured yet")
        return list(torch.chunk(self.output, 1 + self.num_depths, dim=0))

    @property
    def main(self) -> torch.Tensor:
        return self.chunks[0]

    @property
    def depths(self) -> List[torch.Tensor]:
        return self.chunks[1:]


@contextlib.contextmanager
def capture_mtp_hidden_states(model) -> Iterator[MTPCapture]:
    """Record the MTP block's output hidden states (main + one per depth) via a forward hook.

    >>> with capture_mtp_hidden_states(model) as cap:
    ...     loss = forward_loss(model, tokens, labels, mask)
    >>> cap.depths[0]  # [s, b, h], depth 0's hidden states, part of the graph
    """
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise ValueError("model has no MTP block (mtp_num_layers unset or not the last stage)")
    capture = MTPCapture(model.config.mtp_num_layers)

    def hook(module, args, output):
        capture.output = output
        capture.calls += 1

    handle = mtp.register_forward_hook(hook)
    try:
        yield capture
    finally:
        handle.remove()


def gather_sequence_parallel(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """All-gather a ``[s/tp, ...]`` sequence-parallel slice into ``[s, ...]`` (no autograd)."""
    import torch.distributed as dist

    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    world = dist.get_world_size(group=tp_group)
    local = tensor.detach().contiguous()
    if world == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=tp_group)
    return torch.cat(parts, dim=0)


class GatheredParam(NamedTuple):
    """A parameter and its gradient, unsharded (full size), detached CPU copies."""

    data: torch.Tensor
    grad: Optional[torch.Tensor]


def _unshard(local: torch.Tensor, tp_group, dim: int, stride: int) -> torch.Tensor:
    """Inverse of megatron's ``_initialize_affine_weight_cpu`` split: the full tensor was cut into
    ``stride * tp`` equal chunks along ``dim`` and rank ``r`` holds chunks ``r, r+tp, ...``
    concatenated."""
    import torch.distributed as dist

    world = dist.get_world_size(group=tp_group)
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=tp_group)
    if stride == 1:
        return torch.cat(parts, dim=dim)
    per_rank = [list(torch.chunk(part, stride, dim=dim)) for part in parts]
    ordered = [per_rank[k % world][k // world] for k in range(stride * world)]
    return torch.cat(ordered, dim=dim)


def gather_tp_params(model, tp_group=None, grads: bool = True) -> Dict[str, GatheredParam]:
    """Every parameter of ``model`` (and its grad), unsharded over tensor parallelism.

    Megatron marks each TP-sharded param with ``tensor_model_parallel=True``, ``partition_dim``
    (0 for ``ColumnParallelLinear`` weight and bias and ``VocabParallelEmbedding``, 1 for
    ``RowParallelLinear`` weight) and ``partition_stride``; those are all-gathered over
    ``tp_group`` and reassembled. Other params are replicated and returned as they are on this
    rank (under sequence parallelism, call ``allreduce_sequence_parallel_grads`` first so the
    norm grads are complete). ``main_grad`` is used when present. Collective: call on every TP
    rank. Keys are ``model.named_parameters()`` names (tied weights appear once).
    """
    import torch.distributed as dist

    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    world = dist.get_world_size(group=tp_group)
    out: Dict[str, GatheredParam] = {}
    for name, param in model.named_parameters():
        grad = None
        if grads:
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
        sharded = getattr(param, "tensor_model_parallel", False) and world > 1
        if sharded:
            dim = int(getattr(param, "partition_dim", 0))
            stride = int(getattr(param, "partition_stride", 1))
            data = _unshard(param.data, tp_group, dim, stride)
            if grads:
                # Every rank must take part in the collective, with or without a grad.
                has = torch.tensor([0 if grad is None else 1])
                dist.all_reduce(has, group=tp_group, op=dist.ReduceOp.MIN)
                full_grad = _unshard(grad, tp_group, dim, stride) if int(has) == 1 else None
            else:
                full_grad = None
        else:
            data = param.detach().clone()
            full_grad = None if grad is None else grad.detach().clone()
        out[name] = GatheredParam(data.cpu(), None if full_grad is None else full_grad.cpu())
    return out


def compare_gathered(
    expected: Dict[str, GatheredParam],
    actual: Dict[str, GatheredParam],
    atol: float = 1e-5,
    rtol: float = 1e-5,
    grads: bool = True,
) -> List[str]:
    """Human-readable differences between two :func:`gather_tp_params` results (empty if the
    same names, shapes and values within tolerance)."""
    problems: List[str] = []
    if set(expected) != set(actual):
        problems.append(
            f"names differ: only expected {sorted(set(expected) - set(actual))}, "
            f"only actual {sorted(set(actual) - set(expected))}"
        )
    for name in sorted(set(expected) & set(actual)):
        pairs = [("data", expected[name].data, actual[name].data)]
        if grads:
            pairs.append(("grad", expected[name].grad, actual[name].grad))
        for kind, a, b in pairs:
            if a is None or b is None:
                if (a is None) != (b is None):
                    problems.append(f"{name}.{kind}: None in one of them")
                continue
            if a.shape != b.shape:
                problems.append(f"{name}.{kind}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            elif not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
                diff = (a.float() - b.float()).abs().max().item()
                problems.append(f"{name}.{kind}: max abs diff {diff:.3e}")
    return problems


def mtp_loss_on_main_logits(main_logits, hidden_states, **process_mtp_loss_kwargs):
    """What the patched ``GPTModel._postprocess`` does with ``process_mtp_loss``'s arguments:
    split ``hidden_states`` ``[(1+D)s, b, h]``, then the MTP loss against ``main_logits`` attached
    to them (returned)."""
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.mtp_tv.mtp_loss import attach_mtp_tv_loss, split_mtp_hidden_states

    from mtp_tv_dev.contiguous import dev_mtp_loss_inputs

    main, drafts = split_mtp_hidden_states(hidden_states, process_mtp_loss_kwargs['config'])
    # dev's roll context (contiguous packed CP) where the caller passes one
    inputs = dev_mtp_loss_inputs(mtp, **process_mtp_loss_kwargs)
    return attach_mtp_tv_loss(main_logits, main, drafts, inputs, mtp.MTPLossAutoScaler)
