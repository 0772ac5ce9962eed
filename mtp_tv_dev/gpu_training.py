"""Megatron-LM's GPU training settings on a CPU (tests only; never the loss path).

``pretrain_gpt.py`` turns ``gradient_accumulation_fusion`` on wherever apex or Transformer Engine
is installed, and wraps the model in Megatron's ``DistributedDataParallel``. Then
``LinearWithGradAccumulationAndAsyncCommunication.backward`` adds each weight gradient straight
into ``weight.main_grad`` with apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``
(or ``_fp16``), sets ``weight.grad_added_to_main_grad`` and returns a dummy gradient, and DDP's
backward hook adds ``param.grad`` to ``main_grad`` only where that flag is unset (or
``zero_out_wgrad`` is). A loss that forms its own weight gradient must follow that contract, and
only a model built this way shows whether it does.

:func:`emulated_wgrad_fusion` provides apex's entry point as torch code (``main_grad +=
grad_output^T @ input``, what the CUDA kernels compute), so that configs with
``gradient_accumulation_fusion=True`` build and run unchanged, Megatron's own layers included;
nothing of Megatron's code is patched beyond that module and two CUDA stream calls DDP makes.
:func:`wrap_in_ddp` wraps a model in Megatron's real DDP.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Dict, Iterator, List

import torch

__all__ = [
    "emulated_wgrad_fusion", "wrap_in_ddp", "main_grads", "defer_output_layer_wgrad",
    "gradients_after_step", "DDP_SETTINGS",
]

#: DDP settings a GPU job runs with: (name, overlap_grad_reduce, use_distributed_optimizer[,
#: overlap_param_gather]). Overlap uses small buckets, so that several buckets start their reduce
#: during backward; the parameter gather's forward pre-hooks are installed by DDP itself.
DDP_SETTINGS = (
    ('ddp', False, False),
    ('ddp_overlap', True, False),
    ('distopt_overlap', True, True),
    ('distopt_overlap_param_gather', True, True, True),
)

_OVERLAP_BUCKET_SIZE = 4096


def _wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad) -> None:
    """apex's ``wgrad_gemm_accum_fp32`` / ``_fp16``: ``main_grad += grad_output^T @ input``,
    accumulated in fp32 (``[n, out]`` and ``[n, in]`` rows, any leading shape). A CUDA kernel
    outside autograd: the deferred drain hands it activations that still require grad."""
    with torch.no_grad():
        grad = grad_output.reshape(-1, grad_output.shape[-1]).float()
        inputs = total_input.reshape(-1, total_input.shape[-1]).float()
        main_grad.add_((grad.t() @ inputs).to(main_grad.dtype))


_APEX = types.ModuleType('fused_weight_gradient_mlp_cuda')
_APEX.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum
_APEX.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum


class _NoStream:
    """``torch.cuda.current_stream()`` for DDP's bucket code: nothing runs asynchronously."""

    def wait_event(self, *args) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass


def apex_wgrad_fusion_installed() -> bool:
    """Whether apex's real ``fused_weight_gradient_mlp_cuda`` is importable here."""
    import importlib.util

    return importlib.util.find_spec(_APEX.__name__) is not None


@contextlib.contextmanager
def emulated_wgrad_fusion() -> Iterator[None]:
    """While open, apex's fused weight-gradient module exists (as torch code) and Megatron's DDP
    runs on CPU tensors. Build models with ``gradient_accumulation_fusion=True`` inside. Where
    apex is installed its own kernels stay; on a machine with CUDA the streams stay real."""
    from megatron.core.tensor_parallel import layers

    if apex_wgrad_fusion_installed() and layers._grad_accum_fusion_available:
        yield
        return
    saved_layers = {name: layers.__dict__.get(name, None)
                    for name in ('fused_weight_gradient_mlp_cuda', '_grad_accum_fusion_available')}
    saved_module = sys.modules.get(_APEX.__name__)
    saved_stream = torch.cuda.current_stream
    # layers.py imports the module at import time (and checks for it when a linear is built);
    # drain_embedding_wgrad_compute imports it by name.
    layers.fused_weight_gradient_mlp_cuda = _APEX
    layers._grad_accum_fusion_available = True
    sys.modules[_APEX.__name__] = _APEX
    if not torch.cuda.is_available():
        torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    try:
        yield
    finally:
        torch.cuda.current_stream = saved_stream
        if saved_module is None:
            sys.modules.pop(_APEX.__name__, None)
        else:
            sys.modules[_APEX.__name__] = saved_module
        for name, value in saved_layers.items():
            if value is None:
                layers.__dict__.pop(name, None)
            else:
                setattr(layers, name, value)


def wrap_in_ddp(model, overlap_grad_reduce: bool, use_distributed_optimizer: bool, config=None,
                overlap_param_gather: bool = False):
    """``model`` inside Megatron's ``DistributedDataParallel`` (fp32 gradient buffer), its
    gradient buffers zeroed; ``config``: the one the schedule reads (default: the model's);
    ``overlap_param_gather``: the distributed optimizer's forward pre-hooks installed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=_OVERLAP_BUCKET_SIZE if overlap_grad_reduce else None,
        overlap_param_gather=overlap_param_gather,
    )
    ddp = DistributedDataParallel(config or model.config, ddp_config, model)
    ddp.zero_grad_buffer()
    return ddp


def main_grads(model, names: List[str] = None) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient by name: ``main_grad`` where DDP gave it one, else ``.grad``."""
    out = {}
    for name, param in model.named_parameters():
        if names is not None and name not in names:
            continue
        grad = getattr(param, 'main_grad', None)
        grad = param.grad if grad is None else grad
        out[name] = None if grad is None else grad.detach().clone()
    return out


def defer_output_layer_wgrad(model, wgrad_deferral_limit: int = 0):
    """``defer_embedding_wgrad_compute`` for the output layer of ``model`` (the last stage's),
    returned as the config to hand DDP (the schedule reads its flag there and drains the deferred
    gradients in the pipeline flush).

    On a GPU the flag lives in the one config every module shares, and only the output layer acts
    on it: Transformer Engine's linears ignore it. The local spec's ``ColumnParallelLinear``
    (``linear_qkv``, ``linear_fc1``) would append to activation buffers they do not have, so
    here the output layer alone gets a config with the flag, and the buffers ``GPTModel`` makes
    for it.
    """
    import dataclasses

    config = dataclasses.replace(model.config, defer_embedding_wgrad_compute=True,
                                 wgrad_deferral_limit=wgrad_deferral_limit)
    model.embedding_activation_buffer, model.grad_output_buffer = [], []
    layer = model.output_layer
    layer.config = config
    layer.embedding_activation_buffer = model.embedding_activation_buffer
    layer.grad_output_buffer = model.grad_output_buffer
    return config


def gradients_after_step(loss_fields: Dict, tie: bool, detach: bool, fused: bool,
                         ddp_setting=None, scale: float = 0.3, device: str = 'cpu',
                         vocab: int = 64, hidden: int = 32, seq: int = 16, batch: int = 2,
                         depths: int = 2) -> Dict[str, torch.Tensor]:
    """One forward and backward of a fresh seeded ``GPTModel`` with MTP (the same weights every
    call); every parameter's gradient (``main_grad`` in DDP). ``loss_fields``: the config fields
    of the MTP loss and any other setting; ``ddp_setting``: ``(overlap_grad_reduce,
    use_distributed_optimizer[, overlap_param_gather])`` or None for plain autograd. Half-precision parameters run inside
    ``Float16Module``, as Megatron-LM builds them. Inside Megatron's parallel state."""
    from mtp_tv_dev.models import build_gpt_with_mtp, forward_loss, random_batch

    model = build_gpt_with_mtp(
        vocab_size=vocab, hidden_size=hidden, mtp_num_layers=depths, seq_length=seq,
        tie_embeddings=tie, mtp_detach_heads=detach, mtp_tv_chunk=5,
        mtp_loss_scaling_factor=scale, gradient_accumulation_fusion=fused, **loss_fields,
    ).to(device)
    module = model
    if model.config.params_dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(model.config, model)
    if ddp_setting is not None:
        overlap, distributed_optimizer, *param_gather = ddp_setting
        module = wrap_in_ddp(module, overlap, distributed_optimizer,
                             overlap_param_gather=bool(param_gather and param_gather[0]))
    tokens, labels, mask = (t.to(device) for t in random_batch(vocab, seq, batch, seed=3))
    (forward_loss(module, tokens, labels, mask) * mask).sum().backward()
    if ddp_setting is not None:
        module.finish_grad_sync()
    return main_grads(model)
