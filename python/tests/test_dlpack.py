"""The DLPack path of the Python package (what torch CUDA tensors take), on CPU tensors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import libape
from libape import _capi, _core

pytestmark = pytest.mark.skipif(_capi.optional["ape_attention_forward_dlpack"] is None,
                                reason="this libape has no ape_attention_forward_dlpack()")


def _qkv(B=2, H=4, Hkv=2, L=37, D=32, layout="bhld", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "blhd":  # [B, L, H, D] storage, viewed as [B, H, L, D]
        q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
        k = torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2)
        v = torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2)
    else:
        q = torch.randn(B, H, L, D, generator=g)
        k = torch.randn(B, Hkv, L, D, generator=g)
        v = torch.randn(B, Hkv, L, D, generator=g)
    return q, k, v


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dlpack_equals_host_call(layout, dtype):
    q, k, v = (x.to(dtype) for x in _qkv(layout=layout))
    o1, l1 = libape.attention(q, k, v, device="ref", return_lse=True)
    o2, l2 = _core._dlpack_forward_cpu("ref", q, k, v, True)
    assert torch.equal(o1, o2)
    assert torch.equal(l1, l2)


def test_dlpack_refusals_name_the_tensor():
    q, k, v = _qkv()
    with pytest.raises(libape.ApeError) as e:
        _core._dlpack_forward_cpu("ref", q, k[:, :, :, :16].contiguous(), v, False)
    assert "k" in str(e.value)


def test_cuda_tensors_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/test_torch.py covers it")
    q, k, v = _qkv()
    # no CUDA tensor can exist here; the CPU path is untouched
    assert libape.attention(q, k, v, device="ref").shape == q.shape


@pytest.mark.skipif(_capi.optional["ape_attention_forward_dlpack_diag"] is None,
                    reason="this libape has no ape_attention_forward_dlpack_diag()")
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_dlpack_diagnostics_equal_host_call(layout):
    """attention_diagnostics()' device-tensor path (what torch CUDA tensors take), on CPU tensors
    through kDLCPU: O, LSE, entropy and mean distance equal the host call's bit for bit."""
    q, k, v = _qkv(layout=layout, seed=3)
    prm = dict(delta=0.4, lam=0.1)
    want = libape.attention_diagnostics(q, k, v, device="ref", **prm)
    got = _core._dlpack_forward_cpu("ref", q, k, v, True, diag=True, **prm)
    assert len(got) == 4
    for a, b in zip(want, got):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


@pytest.mark.skipif(_capi.optional["ape_attention_forward_dlpack_diag"] is None,
                    reason="this libape has no ape_attention_forward_dlpack_diag()")
def test_dlpack_diagnostics_refusal_names_the_call():
    q, k, v = _qkv()
    with pytest.raises(libape.ApeError) as e:
        _core._dlpack_forward_cpu("ref", q, k[:, :, :, :16].contiguous(), v, True, diag=True)
    assert "ape_attention_forward_dlpack_diag" in str(e.value)
