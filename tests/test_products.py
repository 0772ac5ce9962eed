"""The GEMM path for bf16/fp16 operands is decided once per device and dtype, by a probe that
tells a missing kernel from a real error.

CUDA is not here: the probe runs on fake CUDA tensors (shapes and devices, no GPU), with
``torch.mm`` replaced to play each way a torch build can answer.
"""

import pytest
import torch

from megatron.mtp_tv import products as P


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(P, '_GEMM_PATHS', {})
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: None)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        yield


def test_cpu_upcasts_low_precision_operands():
    assert P.gemm_path(torch.device('cpu'), torch.bfloat16) == 'upcast'
    assert not P.Products(torch.zeros(4, 2, dtype=torch.bfloat16)).accumulating


def test_cuda_with_out_dtype_gemms_accumulates_in_place(fresh_probe):
    assert P.gemm_path(torch.device('cuda'), torch.bfloat16) == 'out_dtype'


@pytest.mark.parametrize('error', [TypeError("mm() got an unexpected keyword argument 'out_dtype'"),
                                   NotImplementedError("Could not run 'aten::mm.dtype_out'"),
                                   RuntimeError('out_dtype is only supported for bf16/fp16 inputs')])
def test_a_missing_kernel_falls_back_once_with_a_warning(fresh_probe, monkeypatch, error):
    calls = []

    def mm(*args, **kwargs):
        calls.append(kwargs)
        if 'out_dtype' in kwargs:
            raise error
        return torch.ops.aten.mm(*args)

    monkeypatch.setattr(torch, 'mm', mm)
    with pytest.warns(RuntimeWarning, match='no out_dtype=float32 GEMM'):
        assert P.gemm_path(torch.device('cuda'), torch.float16) == 'upcast'
    assert P.gemm_path(torch.device('cuda'), torch.float16) == 'upcast'
    assert len(calls) == 1  # decided once


def test_a_real_error_is_not_taken_for_a_missing_kernel(fresh_probe, monkeypatch):
    def mm(*args, **kwargs):
        raise RuntimeError('CUDA out of memory. Tried to allocate 2.50 GiB')

    monkeypatch.setattr(torch, 'mm', mm)
    with pytest.raises(RuntimeError, match='out of memory'):
        P.gemm_path(torch.device('cuda'), torch.bfloat16)
    assert P._GEMM_PATHS == {}
