"""Which implementation a bench row or correctness case of this package ran, from the package's
own decisions (``megatron/mtp_tv`` is not changed for the check: these functions call the same
selection code the loss calls, on inputs with the properties that code reads).

* Row ops: the sweep takes ``row_ops_for(z, options.kernels)`` (``sweep.py``) on its chunk
  logits ``z``, always an fp32, row-major ``[n, V]`` buffer on the weight's device (the scratch
  ``'logits'``, or ``logits_fn``'s fp32 output). :func:`row_ops` asks ``row_ops_for`` about a
  probe of that kind on ``device``: the decision reads the device, the dtype, the layout,
  whether ``triton`` imports and ``TRITON_INTERPRET``, never the values or the size.
* Products: ``Products(weight)`` (``products.py``) multiplies in fp32 for an fp32 weight, with
  fp32-output GEMMs (``out_dtype``) for bf16/fp16 where ``gemm_path`` finds them, else on fp32
  copies of the operands (``upcast``). :func:`gemm` builds ``Products`` on a weight of that
  dtype and device and reads its choice.
"""

from typing import Dict

import torch

from megatron.mtp_tv.products import Products
from megatron.mtp_tv.row_ops import row_ops_for


def row_ops(device: str, kernels: str) -> str:
    """``'triton'`` or ``'torch'``: the row ops the sweep takes for ``kernels`` on ``device``;
    ``'error: ...'`` where ``kernels='triton'`` cannot run (the loss raises the same)."""
    probe = torch.empty(1, 8, dtype=torch.float32, device=device)
    try:
        return row_ops_for(probe, kernels).name
    except RuntimeError as error:
        return f'error: {error}'


def gemm(device: str, dtype: torch.dtype) -> str:
    """``'fp32'``, ``'out_dtype'`` (fp32-output GEMM) or ``'upcast'`` (its fallback): the products
    of a ``dtype`` weight on ``device``."""
    products = Products(torch.empty(1, 1, dtype=dtype, device=device))
    if products.native:
        return 'fp32'
    return 'out_dtype' if products.accumulating else 'upcast'


def package(device: str, kernels: str, *dtypes: torch.dtype) -> Dict[str, str]:
    """The path of this package's loss with a weight of each of ``dtypes`` (a case comparing
    dtypes names each dtype's products, ``'fp32 / upcast'``)."""
    return {'row_ops': row_ops(device, kernels),
            'gemm': ' / '.join(gemm(device, dtype) for dtype in dtypes)}


def megatron_ce(fused: bool = False) -> Dict[str, str]:
    """Megatron's own MTP cross-entropy: its output layer's product in the model dtype, then its
    cross-entropy (``cross_entropy_loss_fusion`` picks the fused one)."""
    name = 'fused_vocab_parallel_cross_entropy' if fused else 'vocab_parallel_cross_entropy'
    return {'megatron_ce': name}
