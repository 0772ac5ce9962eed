# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The sweep's matrix products, accumulating in fp32 for any weight dtype."""

import math
import warnings
from typing import Dict, Literal, Tuple

import torch

#: Low-precision logit gradients are scaled to this bound.
GRAD_BOUND = 2.0**12


class Products:
    """The chunk's GEMMs against the output weight ``[V/tp, h]``: fp32 products, or bf16/fp16
    operands with fp32 sums (an fp32-output GEMM where the device has one, else an upcast)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.native = weight.dtype == torch.float32
        self.half = weight.dtype in (torch.float16, torch.bfloat16)
        self.accumulating = self.half and gemm_path(weight.device, weight.dtype) == 'out_dtype'
        self._weight32 = None

    def gradient_scale(self, token_weights: torch.Tensor, bound_per_weight: float) -> torch.Tensor:
        """Power of two taking ``max(w) * bound_per_weight`` to :data:`GRAD_BOUND` (bf16/fp16)."""
        one = torch.ones((), dtype=torch.float32, device=token_weights.device)
        if not self.half or token_weights.numel() == 0:
            return one
        bound = token_weights.abs().amax() * bound_per_weight
        exponent = (math.log2(GRAD_BOUND) - torch.ceil(torch.log2(bound))).clamp(-100, 100)
        return torch.where(bound > 0, torch.exp2(exponent), one)

    def logits(self, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``inputs [n, h] @ weight^T`` into ``out [n, V/tp]`` (fp32)."""
        if self.native:
            return torch.mm(inputs, self.weight.t(), out=out)
        if self.accumulating:
            return torch.mm(inputs, self.weight.t(), out_dtype=torch.float32, out=out)
        return torch.mm(inputs.float(), self._fp32_weight().t(), out=out)

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """``out = g @ W``, ``g`` ``[n, V/tp]`` in the weight's dtype."""
        if self.native:
            torch.mm(g, self.weight, out=out)
        elif self.accumulating:
            torch.mm(g, self.weight, out_dtype=torch.float32, out=out)
        else:
            torch.mm(g.float(), self._fp32_weight(), out=out)

    def weight_grad(
        self, grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, accumulate: bool
    ) -> None:
        """``grad_weight (+)= g^T x``: overwrite on the first chunk, accumulate after."""
        beta = 1.0 if accumulate else 0.0
        if self.native:
            grad_weight.addmm_(g.t(), x, beta=beta)
        elif self.accumulating:
            torch.addmm(grad_weight, g.t(), x, beta=beta, out_dtype=torch.float32, out=grad_weight)
        else:
            grad_weight.addmm_(g.t().float(), x.float(), beta=beta)

    def _fp32_weight(self) -> torch.Tensor:
        if self._weight32 is None:
            self._weight32 = self.weight.detach().float()
        return self._weight32


GemmPath = Literal['out_dtype', 'upcast']
_GEMM_PATHS: Dict[Tuple[str, torch.dtype], GemmPath] = {}


def gemm_path(device: torch.device, dtype: torch.dtype) -> GemmPath:
    """``'out_dtype'`` (fp32-output GEMMs) or ``'upcast'`` for bf16/fp16 on ``device``."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _GEMM_PATHS:
        _GEMM_PATHS[key] = _probe_gemm_path(device, dtype)
        if _GEMM_PATHS[key] == 'upcast' and device.type == 'cuda':
            warnings.warn(
                f'megatron.mtp_tv: this torch build ({torch.__version__}) has no '
                f'out_dtype=float32 GEMM for {dtype} on CUDA; the loss multiplies fp32 '
                f'copies of the operands (an fp32 copy of the output weight per call).',
                RuntimeWarning,
                stacklevel=3,
            )
    return _GEMM_PATHS[key]


def _probe_gemm_path(device: torch.device, dtype: torch.dtype) -> GemmPath:
    if device.type != 'cuda':
        return 'upcast'
    torch.cuda.synchronize(device)  # a pending asynchronous error raises here, not below
    a = torch.ones(1, 1, device=device, dtype=dtype)
    acc = torch.zeros(1, 1, device=device, dtype=torch.float32)
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, a, beta=1.0, out_dtype=torch.float32, out=acc)
    except (TypeError, NotImplementedError):  # no such overload (older torch, this backend)
        return 'upcast'
    except RuntimeError as error:  # the overload exists but refuses these dtypes
        if 'dtype' not in str(error):
            raise
        return 'upcast'
    return 'out_dtype'
