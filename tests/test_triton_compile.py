"""Every Triton kernel compiles ahead of time for real GPU targets, with no GPU.

``tests/test_triton_kernels.py`` runs the kernels through Triton's interpreter, which accepts
programs the compiler rejects (and never lowers them). Here each ``@triton.jit`` kernel of
``megatron.mtp_tv.triton_kernels`` goes through Triton's whole pipeline down to a cubin, with the
``ptxas`` shipped in the triton wheel, for Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100).
"""

import inspect

import pytest

triton = pytest.importorskip('triton')

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron.mtp_tv import triton_kernels  # noqa: E402

KERNELS = {name: fn for name, fn in vars(triton_kernels).items()
           if isinstance(fn, triton.runtime.jit.JITFunction)}


def _signature(kernel):
    """The row kernels' arguments: ``*_ptr`` fp32 buffers (the sweep keeps its rows fp32), int
    strides and vocabulary size, and the ``BLOCK`` tile width."""
    out = {}
    for name in inspect.signature(kernel.fn).parameters:
        out[name] = 'constexpr' if name == 'BLOCK' else '*fp32' if name.endswith('_ptr') else 'i32'
    return out


def test_the_module_has_the_kernels_the_row_ops_launch():
    assert sorted(KERNELS) == ['_grad_kernel', '_pair_sums_kernel', '_row_stats_kernel']


@pytest.mark.parametrize('arch', [80, 90, 100])
@pytest.mark.parametrize('name', sorted(KERNELS))
def test_kernel_compiles_to_a_cubin(name, arch):
    block = triton_kernels._block(151936)  # the widest tile the row ops launch
    source = ASTSource(fn=KERNELS[name], signature=_signature(KERNELS[name]),
                       constexprs={'BLOCK': block})
    compiled = triton.compile(source, target=GPUTarget('cuda', arch, 32))
    assert f'.target sm_{arch}' in compiled.asm['ptx']
    assert len(compiled.asm['cubin']) > 1000
