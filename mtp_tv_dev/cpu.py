"""Run megatron-core 0.19.2 models on a CPU (tests and the demo only; never the loss path).

megatron-core is written for CUDA. A GPTModel with MTP built from the local (non Transformer
Engine) spec with ``use_cpu_initialization=True`` computes fine on CPU tensors, but a handful of
places reach for CUDA unconditionally. :func:`apply_cpu_shims` patches exactly those, each for a
reason given next to it:

* ``torch.cuda.current_device()`` is passed as ``device=`` when megatron allocates buffers
  (``GlobalMemoryBuffer`` for attention scores, the MTP logging tracker, ``roll_tensor``'s CP
  branch, tensor-parallel mappings, ...). We make it return the CPU device.
* ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker`` read and write CUDA RNG
  state. On CPU every random op draws from the CPU default generator, so we map "the CUDA
  generator" onto it (same seeding semantics: the tracker's ``fork()`` swaps the CPU generator
  state in and out).
* ``get_default_causal_mask`` (used by ``FusedScaleMaskSoftmax`` when no mask is passed)
  builds its mask with ``device="cuda"``: we build it on the CPU.
* ``WrappedTorchNorm`` (the plain torch LayerNorm/RMSNorm used when Apex/TE are absent) asserts
  ``not config.sequence_parallel``. Under sequence parallelism each TP rank normalises only its
  own ``s/tp`` tokens, so the norm weights see a partial gradient; Megatron's fused norms tag
  their params ``sequence_parallel=True`` so that ``finalize_model_grads`` all-reduces those
  grads over TP. We allow sequence parallel, tag the params the same way, and
  :func:`allreduce_sequence_parallel_grads` does the all-reduce for runs that have no
  ``finalize_model_grads`` (our tests call it after ``backward()``).
* ``DotProductAttention`` (the local, non-TE attention) asserts ``packed_seq_params is None``:
  THD-packed batches need TE's fused attention. A packed row (batch 1) is plain attention with a
  block-diagonal causal mask, so when ``packed_seq_params`` (format ``thd``) is given we build
  that mask from ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``) and call the original without it.
  The rest of the model (rope with ``cu_seqlens``, the MTP ``roll_tensor``,
  ``process_mtp_loss``) then runs its real packed-sequence code on CPU. Context parallelism > 1
  still cannot run the whole model (the local attention asserts CP == 1); ``roll_tensor`` and
  ``process_mtp_loss`` run with a CP group of 2 on their own.

Every patch is process-wide and idempotent, and :func:`remove_cpu_shims` undoes them all
(:func:`~mtp_tv_dev.distributed.single_process` does so on exit). Do not leave them
applied in a process that should use a GPU.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from typing import Callable, Dict, Iterable, List, Tuple

import torch

__all__ = [
    "apply_cpu_shims",
    "remove_cpu_shims",
    "cpu_shims_applied",
    "allreduce_sequence_parallel_grads",
    "sequence_parallel_params",
    "causal_attention_mask",
    "packed_causal_attention_mask",
    "quiet_megatron_warnings",
    "no_te_shims",
]

_LOCK = threading.Lock()
# (owner object, attribute name, original value) for every patch, in application order.
_PATCHES: List[Tuple[object, str, object]] = []


def cpu_shims_applied() -> bool:
    """True after :func:`apply_cpu_shims` (and before :func:`remove_cpu_shims`)."""
    return bool(_PATCHES)


def _patch(owner: object, name: str, value: object) -> None:
    # vars() (not getattr) so that a class's staticmethod wrapper is restored as it was.
    _PATCHES.append((owner, name, vars(owner)[name]))
    setattr(owner, name, value)


def causal_attention_mask(seq_length: int, device="cpu") -> torch.Tensor:
    """Megatron's causal mask convention: bool ``[1, 1, s, s]``, True where attention is masked
    (strictly upper triangle)."""
    return torch.triu(
        torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1
    ).view(1, 1, seq_length, seq_length)


def _cpu_current_device() -> torch.device:
    # Megatron uses the result only as a `device=` argument (or compares it with a tensor's
    # device); a torch.device works everywhere an int index would there.
    return torch.device("cpu")


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    # `_get_cuda_rng_state(device, clone, graph_safe)` / `torch.cuda.get_rng_state(device)`.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs) -> None:
    # `_set_cuda_rng_state(state, device, graph_safe)` / `torch.cuda.set_rng_state(state, device)`.
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed) -> None:
    # `torch.cuda.manual_seed(seed)`: seeds "the CUDA generator", i.e. the CPU one here. Note:
    # model_parallel_cuda_manual_seed therefore also re-seeds the CPU generator with `seed`.
    torch.manual_seed(int(seed))


def _make_cpu_causal_mask_fn() -> Callable[[int], torch.Tensor]:
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """CPU version of megatron.core.transformer.utils.get_default_causal_mask."""
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return get_default_causal_mask


def packed_causal_attention_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, total, total]`` (True = masked) for a packed row.

    Position ``i`` may attend to ``j`` iff ``j <= i`` and both lie in the same segment
    ``[cu_seqlens[k], cu_seqlens[k+1])``; positions past ``cu_seqlens[-1]`` form one more
    segment (trailing padding)."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.long).flatten()
    positions = torch.arange(total)
    segment = torch.bucketize(positions, cu[1:], right=True)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = positions.unsqueeze(0) <= positions.unsqueeze(1)  # [i, j]: j <= i
    return (~(same & causal)).view(1, 1, total, total)


def _make_packed_attention_forward(original_forward):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # Attention.forward squeezed the dummy batch dim for THD: [t, np, hn] -> [t, 1, np, hn].
            if query.dim() == 3:
                query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            attention_mask = packed_causal_attention_mask(cu, query.size(0)).to(query.device)
            packed_seq_params = None
        return original_forward(self, query, key, value, attention_mask,
                                attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                packed_seq_params=packed_seq_params, **kwargs)

    return forward


def _make_norm_new(original_new):
    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if sequence_parallel:
            # WrappedTorchNorm asserts `not config.sequence_parallel`; the norm itself is
            # token-wise, so it is correct under SP once its grads are all-reduced over TP.
            config = copy.copy(config)  # shallow: no __post_init__ re-validation
            config.sequence_parallel = False
        norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            # Same tag as megatron's FusedLayerNorm / TENorm: "grad is a partial sum over TP".
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm

    return __new__


# (message regex, category) of warnings that say nothing on a CPU-only machine without TE/Apex.
_NOISE = [
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("absl.logging is not installed", UserWarning),
    (".*CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    ("full scope is deprecated", UserWarning),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
]


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's CPU-irrelevant warnings and log lines (no TE/Apex, no CUDA,
    GPTModel's deprecation notice). Call it before importing megatron to also catch the
    import-time ones. Process-wide; other warnings are untouched."""
    for message, category in _NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model"):
        logging.getLogger(name).setLevel(logging.ERROR)


def apply_cpu_shims() -> None:
    """Patch megatron-core (and ``torch.cuda.current_device``) so models run on CPU. Idempotent."""
    quiet_megatron_warnings()
    with _LOCK:
        if _PATCHES:
            return
        import megatron.core.fusions.fused_softmax as fused_softmax
        import megatron.core.tensor_parallel.random as tp_random
        import megatron.core.transformer.dot_product_attention as dot_product_attention
        import megatron.core.transformer.torch_norm as torch_norm
        import megatron.core.transformer.utils as transformer_utils

        # 1. CUDA device used as an allocation target.
        _patch(torch.cuda, "current_device", _cpu_current_device)

        # 2. CUDA RNG -> CPU generator. Megatron's random.py calls its own module-level helpers
        #    (_get/_set_cuda_rng_state) and torch.cuda.{get_rng_state,manual_seed} directly.
        _patch(tp_random, "_get_cuda_rng_state", _cpu_get_rng_state)
        _patch(tp_random, "_set_cuda_rng_state", _cpu_set_rng_state)
        _patch(torch.cuda, "get_rng_state", _cpu_get_rng_state)
        _patch(torch.cuda, "set_rng_state", _cpu_set_rng_state)
        _patch(torch.cuda, "manual_seed", _cpu_manual_seed)
        # NVIDIA main seeds its hidden-state-mixing RNG (mtp_hsm) from torch.cuda.initial_seed().
        _patch(torch.cuda, "initial_seed", torch.initial_seed)

        # 3. Causal mask built on "cuda". fused_softmax imported the name, so patch both.
        cpu_mask = _make_cpu_causal_mask_fn()
        _patch(transformer_utils, "get_default_causal_mask", cpu_mask)
        _patch(fused_softmax, "get_default_causal_mask", cpu_mask)

        # 4. Sequence parallel with the plain torch norm (see module docstring). Specs hold the
        #    class itself, so patch its __new__.
        wrapped = torch_norm.WrappedTorchNorm
        _patch(wrapped, "__new__", staticmethod(_make_norm_new(vars(wrapped)["__new__"].__func__)))

        # 5. THD-packed sequences through the local attention (see module docstring).
        attention = dot_product_attention.DotProductAttention
        _patch(attention, "forward", _make_packed_attention_forward(vars(attention)["forward"]))


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims`: restore every patched attribute (no-op if none)."""
    with _LOCK:
        while _PATCHES:
            owner, name, original = _PATCHES.pop()
            setattr(owner, name, original)


def sequence_parallel_params(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """Params whose grads are partial sums over the TP group under sequence parallelism."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(model: torch.nn.Module, tp_group=None) -> int:
    """All-reduce (SUM) over TP the grads of params tagged ``sequence_parallel`` (the norms).

    Megatron's ``finalize_model_grads`` does this in real training; tests that call
    ``loss.backward()`` directly call this afterwards. Returns how many grads were reduced.
    A no-op when the TP group has one rank.
    """
    import torch.distributed as dist

    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group=tp_group) == 1:
        return 0
    grads: Dict[int, torch.Tensor] = {}
    for param in sequence_parallel_params(model):
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads[id(param)] = grad
    if not grads:
        return 0
    # One flat all-reduce instead of one per norm.
    tensors = list(grads.values())
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=tp_group)
    for tensor, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(reduced)
    return len(tensors)


def no_te_shims() -> list:
    """Work around upstream code that assumes Transformer Engine, in this process only.

    NVIDIA main (d98e8a64d) builds every MTP layer through ``is_inference_column_parallel_linear``,
    whose ``isinstance`` check gets the ``MagicMock`` placeholders that stand in for the
    inference layer classes without Transformer Engine and raises ``TypeError``: the check is
    narrowed to the classes that exist (without TE no layer can be one of them). Applied alike
    to the patched and the pristine tree; returns the names it replaced.
    """
    applied = []
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:
        return applied
    from megatron.core.transformer import multi_token_prediction as mtp

    classes = tuple(
        getattr(inference_layers, n, None)
        for n in ('InferenceColumnParallelLinear', 'InferenceLayerNormColumnParallelLinear')
    )
    if hasattr(inference_layers, 'is_inference_column_parallel_linear') and not all(
        isinstance(c, type) for c in classes
    ):
        real = tuple(c for c in classes if isinstance(c, type))

        def is_inference_column_parallel_linear(module) -> bool:
            return bool(real) and isinstance(module, real)

        for module in (inference_layers, mtp):
            if hasattr(module, 'is_inference_column_parallel_linear'):
                module.is_inference_column_parallel_linear = is_inference_column_parallel_linear
                applied.append(f'{module.__name__}.is_inference_column_parallel_linear')
    return applied
