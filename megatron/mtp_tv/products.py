"""The sweep's matrix products: fp32 accumulation and fp32 results for any weight dtype.

Three per chunk at most, the ones Megatron's cross-entropy path also runs: the logits
``x @ W^T``, the hidden-state gradient ``g @ W`` and the weight gradient ``g^T x``. No Megatron
imports.
"""

import math
import warnings
from typing import Dict, Literal, Tuple

import torch

#: Low-precision logit gradients are scaled so that their bound is this power of two: well
#: inside fp16's range (65504) with 16x headroom for a logit function's derivative (Megatron's
#: MuP output scaling is below 1), and far above fp16's smallest normal (6e-5).
GRAD_BOUND = 2.0**12


class Products:
    """The sweep's matrix products with fp32 accumulation and fp32 results for any weight dtype.

    fp32 weights use plain (in-place, ``out=``) fp32 GEMMs. bf16/fp16 weights keep their
    low-precision operands: on CUDA through ``out_dtype=torch.float32`` GEMMs written in place
    (tensor cores accumulate in fp32; :func:`gemm_path` checks once per device and dtype that
    the torch build has them); on CPU, which has no such kernel, by upcasting the operands,
    which gives the same products (the product of two bf16/fp16 numbers is exact in fp32). Other dtypes
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
        # Low-precision operands with fp32 accumulation in place: CUDA where torch has the
        # out_dtype GEMMs; everywhere else the operands are upcast.
        self.accumulating = self.half and gemm_path(weight.device, weight.dtype) == 'out_dtype'
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
        if self.accumulating:
            return torch.mm(inputs, self.weight.t(), out_dtype=torch.float32, out=out)
        return torch.mm(inputs.float(), self._fp32_weight().t(), out=out)

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """``out = g @ W`` (``g``: ``[n, V/tp]`` in the weight's dtype; ``out`` fp32)."""
        if self.native:
            torch.mm(g, self.weight, out=out)
        elif self.accumulating:
            torch.mm(g, self.weight, out_dtype=torch.float32, out=out)
        else:
            torch.mm(g.float(), self._fp32_weight(), out=out)

    def weight_grad(self, grad_weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor, accumulate: bool) -> None:
        """``grad_weight (+)= g^T x``: overwrite on the first chunk, accumulate in fp32 after."""
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
    """How :class:`Products` multiplies ``dtype`` (bf16/fp16) operands on ``device``, decided once
    per device type and dtype.

    ``'out_dtype'``: ``torch.mm`` / ``torch.addmm`` with ``out_dtype=torch.float32`` into the
    fp32 result in place (CUDA in torch >= 2.8); ``'upcast'``: fp32 copies of the operands (the
    CPU path; on CUDA a torch build without those kernels, with a warning, since it costs an fp32
    copy of the weight). The probe is a 1x1 product after a device synchronisation, so that
    an error still pending from earlier work is raised there and not taken for a missing
    kernel; only the errors torch gives for a missing overload are caught.
    """
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _GEMM_PATHS:
        _GEMM_PATHS[key] = _probe_gemm_path(device, dtype)
        if _GEMM_PATHS[key] == 'upcast' and device.type == 'cuda':
            warnings.warn(f'megatron.mtp_tv: this torch build ({torch.__version__}) has no '
                          f'out_dtype=float32 GEMM for {dtype} on CUDA; the loss multiplies fp32 '
                          f'copies of the operands (an fp32 copy of the output weight per call).',
                          RuntimeWarning, stacklevel=3)
    return _GEMM_PATHS[key]


def _probe_gemm_path(device: torch.device, dtype: torch.dtype) -> GemmPath:
    if device.type != 'cuda':
        return 'upcast'
    torch.cuda.synchronize(device)  # once per process: a pending asynchronous error raises here
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
