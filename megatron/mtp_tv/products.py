"""The sweep's matrix products: fp32 accumulation and fp32 results for any weight dtype.

Three per chunk at most, the ones Megatron's cross-entropy path also runs: the logits
``x @ W^T``, the hidden-state gradient ``g @ W`` and the weight gradient ``g^T x``. No Megatron
imports.
"""

import math

import torch

#: Low-precision logit gradients are scaled so that their bound is this power of two: well
#: inside fp16's range (65504) with 16x headroom for a logit function's derivative (Megatron's
#: MuP output scaling is below 1), and far above fp16's smallest normal (6e-5).
GRAD_BOUND = 2.0**12


class Products:
    """The sweep's matrix products with fp32 accumulation and fp32 results for any weight dtype.

    fp32 weights use plain (in-place, ``out=``) fp32 GEMMs. bf16/fp16 weights keep their
    low-precision operands: on CUDA through ``out_dtype=torch.float32`` GEMMs (tensor cores
    accumulate in fp32); on CPU, which has no such kernel, by upcasting the operands, which gives
    the same products (the product of two bf16/fp16 numbers is exact in fp32). Other dtypes
    (fp64, in tests) are rounded to fp32 operands: the sweep computes in fp32 whatever the
    weight's dtype. The fp32 copy of a non-fp32 weight is made once per sweep.

    Attributes:
        native: the weight is fp32: its GEMMs need no conversion, and a logit gradient needs no
            copy in the weight's dtype (so every depth of a chunk can share one product).
        half: the weight is bf16/fp16: logit gradients are rounded to a narrow range and are
            scaled first (:meth:`gradient_scale`).
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.native = weight.dtype == torch.float32
        self.half = weight.dtype in (torch.float16, torch.bfloat16)
        self._weight32 = None

    def gradient_scale(self, token_weights: torch.Tensor, bound_per_weight: float) -> torch.Tensor:
        """Power of two that brings the logit gradient's bound ``max(w) * bound_per_weight``
        (the loss's ``grad_bound / T``) to :data:`GRAD_BOUND` for bf16/fp16 weights (1 for the
        others, whose dtype holds the unscaled gradient). A device scalar: no host sync."""
        one = torch.ones((), dtype=torch.float32, device=token_weights.device)
        if not self.half or token_weights.numel() == 0:
            return one
        bound = token_weights.abs().amax() * bound_per_weight
        exponent = (math.log2(GRAD_BOUND) - torch.ceil(torch.log2(bound))).clamp(-100, 100)
        return torch.where(bound > 0, torch.exp2(exponent), one)

    def logits(self, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = inputs @ W^T`` (``out``: ``[m, V/tp]`` fp32)."""
        if self.native:
            return torch.mm(inputs, self.weight.t(), out=out)
        if self.half and inputs.is_cuda:
            return _mm_out_fp32(inputs, self.weight.t(), out)
        return torch.mm(inputs.float(), self._fp32_weight().t(), out=out)

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """``out = g @ W`` (``g``: ``[n, V/tp]`` in the weight's dtype; ``out`` fp32)."""
        if self.native:
            torch.mm(g, self.weight, out=out)
        elif self.half and g.is_cuda:
            _mm_out_fp32(g, self.weight, out)
        else:
            torch.mm(g.float(), self._fp32_weight(), out=out)

    def weight_grad(self, grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, accumulate: bool) -> None:
        """``grad_weight (+)= g^T x``: overwrite on the first chunk, accumulate in fp32 after."""
        beta = 1.0 if accumulate else 0.0
        if self.native:
            grad_weight.addmm_(g.t(), x, beta=beta)
        elif self.half and g.is_cuda:
            _addmm_fp32_(grad_weight, g.t(), x, beta)
        else:
            grad_weight.addmm_(g.t().float(), x.float(), beta=beta)

    def _fp32_weight(self) -> torch.Tensor:
        if self._weight32 is None:
            self._weight32 = self.weight.detach().float()
        return self._weight32


def _mm_out_fp32(a, b, out):
    """``out = a @ b`` for low-precision CUDA operands, fp32 accumulation and result."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype_out
        return out.copy_(torch.mm(a, b, out_dtype=torch.float32))


def _addmm_fp32_(acc, a, b, beta: float):
    """``acc = beta * acc + a @ b`` for low-precision CUDA operands into an fp32 ``acc``."""
    try:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without addmm.dtype_out
        product = torch.mm(a, b, out_dtype=torch.float32)
        acc.add_(product) if beta else acc.copy_(product)
