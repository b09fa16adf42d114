"""libape.attention from NumPy: against a float64 evaluation of the spec, on every device, with
strided views, per-head parameters, both layouts, offsets, GQA; and its errors."""
import numpy as np
import pytest

import libape
from aperef import ape64
from conftest import has_backend

# The spec's tolerances: O relative to max|V|, LSE relative to max(1, |LSE|).
TOL = {np.float32: (1e-4, 1e-4), np.float16: (5e-3, 1e-3)}
DEVICES = [d["spec"] for d in libape.devices()]


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def check(o, lse, q, k, v, dtype=np.float32, **kw):
    o64, lse64 = ape64(q, k, v, **kw)
    to, tl = TOL[dtype]
    m = max(1.0, np.abs(np.asarray(v, dtype=np.float64)).max())
    assert o.shape == o64.shape
    assert np.abs(o.astype(np.float64) - o64).max() <= to * m
    fin = np.isfinite(lse64)
    assert (np.isfinite(lse) == fin).all()
    assert (np.abs(lse[fin] - lse64[fin]) <= tl * np.maximum(1.0, np.abs(lse64[fin]))).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_spec(device, layout, causal):
    rng = np.random.default_rng(hash((device, layout, causal)) % 2**32)
    q, k, v = rand(rng, 2, 4, 37, 16), rand(rng, 2, 2, 45, 16), rand(rng, 2, 2, 45, 16)
    prm = dict(delta=[0.3, 0.0, 0.1, 0.05], beta=0.02, gamma=[0.0, 0.01, 0.02, 0.03], lam=0.2,
               causal=causal, layout=layout, q_start=20, k_start=3, scale=0.3, rope_base=500.0)
    o, lse = libape.attention(q, k, v, device=device, return_lse=True, **prm)
    assert o.dtype == np.float32 and lse.dtype == np.float32 and lse.shape == (2, 4, 37)
    check(o, lse, q, k, v, **prm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_explicit_positions(device, causal):
    rng = np.random.default_rng(hash((device, causal, "pos")) % 2**32)
    q, k, v = rand(rng, 3, 4, 11, 16), rand(rng, 3, 2, 13, 16), rand(rng, 3, 2, 13, 16)
    pk = rng.permutation(np.concatenate([np.arange(8), [3, 40, 41, 41, 90]]))
    pq = np.array([95, 2, 41, 41, 0, 7, 60, -5, 8, 40, 3], dtype=np.int32)
    prm = dict(delta=[0.3, 0.0, 0.1, 0.05], beta=0.02, gamma=0.01, lam=0.2, causal=causal)
    o, lse = libape.attention(q, k, v, device=device, return_lse=True, positions_q=pq,
                              positions_k=pk, **prm)
    check(o, lse, q, k, v, positions_q=pq, positions_k=pk, **prm)
    with pytest.raises(libape.ApeValueError, match="both or neither"):
        libape.attention(q, k, v, positions_q=pq)
    with pytest.raises(libape.ApeValueError, match="positions_k: 12 values: must be 13"):
        libape.attention(q, k, v, positions_q=pq, positions_k=pk[:12])
    with pytest.raises(libape.ApeValueError, match="q_start"):
        libape.attention(q, k, v, positions_q=pq, positions_k=pk, q_start=3)


@pytest.mark.parametrize("device", DEVICES)
def test_defaults_are_the_seed_values(device):
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 1, 2, 30, 8), rand(rng, 1, 2, 30, 8), rand(rng, 1, 2, 30, 8)
    o, lse = libape.attention(q, k, v, device=device, return_lse=True)
    check(o, lse, q, k, v, delta=2 ** (-4 / 3), beta=2 ** (-4 / 3) / 10,
          gamma=2 ** (-4 / 3) / 10, lam=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_float16(device):
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, 1, 2, 33, 32, dtype=np.float16) for _ in range(3))
    o, lse = libape.attention(q, k, v, device=device, return_lse=True, lam=0.3)
    assert o.dtype == np.float16
    check(o, lse, q, k, v, dtype=np.float16, delta=libape.SEED_DELTA, beta=libape.SEED_BETA,
          gamma=libape.SEED_GAMMA, lam=0.3)


def test_strided_views_need_no_copy_and_agree():
    """A [B, L, H, D] buffer seen as [B, H, L, D], and one slice of a packed QKV tensor."""
    rng = np.random.default_rng(3)
    qkv = rand(rng, 2, 40, 3, 4, 16)  # [B, L, 3, H, D]
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    assert not q.flags.c_contiguous
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True)
    oc, lsec = libape.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), device="ref",
                                return_lse=True)
    assert np.array_equal(o, oc) and np.array_equal(lse, lsec)


def test_negative_strides_are_copied():
    rng = np.random.default_rng(4)
    q = rand(rng, 1, 2, 20, 8)
    o = libape.attention(q[:, :, ::-1], q, q, device="ref")
    oc = libape.attention(np.ascontiguousarray(q[:, :, ::-1]), q, q, device="ref")
    assert np.array_equal(o, oc)


def test_devices_agree():
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, 1, 3, 70, 32), rand(rng, 1, 3, 70, 32), rand(rng, 1, 3, 70, 32)
    ref = libape.attention(q, k, v, device="ref")
    for dev in DEVICES:
        o = libape.attention(q, k, v, device=dev)
        assert np.abs(o - ref).max() <= 1e-4 * np.abs(v).max()


def test_empty_and_dlpack():
    rng = np.random.default_rng(6)
    q = np.zeros((1, 2, 0, 8), np.float32)
    k = rand(rng, 1, 2, 5, 8)
    o, lse = libape.attention(q, k, k, device="ref", return_lse=True)
    assert o.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)

    class Capsule:  # any object with __dlpack__
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    q = rand(rng, 1, 2, 5, 8)
    assert np.array_equal(libape.attention(Capsule(q), Capsule(k), Capsule(k), device="ref"),
                          libape.attention(q, k, k, device="ref"))


# ------------------------------------------------------------------ errors

def q1():
    return np.ones((1, 2, 4, 8), np.float32)


@pytest.mark.parametrize("kw, text", [
    (dict(lam=-0.5), "desc->lambda.value = -0.5: must be >= 0"),
    (dict(delta=[0.1, float("nan")]), "desc->delta.per_head[1]"),
    (dict(rope_base=0.0), "rope_base"),
    (dict(skip_tol=-1.0), "skip_tol"),
])
def test_bad_parameters_raise_value_error_with_libape_message(kw, text):
    with pytest.raises(ValueError) as e:
        libape.attention(q1(), q1(), q1(), device="ref", **kw)
    assert isinstance(e.value, libape.ApeError)
    assert e.value.name == "APE_EINVAL" and e.value.code == -22
    assert text in str(e.value)


def test_package_checks():
    with pytest.raises(libape.ApeValueError, match="must be 4-D"):
        libape.attention(np.ones((2, 4, 8), np.float32), q1(), q1())
    with pytest.raises(libape.ApeValueError, match="dtype float64"):
        libape.attention(q1().astype(np.float64), q1(), q1())
    with pytest.raises(libape.ApeValueError, match="give one per query head"):
        libape.attention(q1(), q1(), q1(), delta=[0.1, 0.2, 0.3])
    with pytest.raises(libape.ApeValueError, match="layout"):
        libape.attention(q1(), q1(), q1(), layout="neox")
    with pytest.raises(libape.ApeValueError, match="not an array"):
        libape.attention([[1.0]], q1(), q1())


def test_shape_mismatch_is_libape_s_message():
    with pytest.raises(ValueError, match=r"k->shape\[3\] = 4: must equal D = 8"):
        libape.attention(q1(), np.ones((1, 2, 4, 4), np.float32), q1(), device="ref")


def test_unknown_device_is_an_error_not_a_fallback():
    with pytest.raises(libape.ApeError) as e:
        libape.attention(q1(), q1(), q1(), device="nosuchbackend")
    assert "nosuchbackend" in str(e.value)


@pytest.mark.parametrize("device", ["ref", "opencl"])
def test_rope_scale_is_position_interpolation(device):
    """rope_scale = s rotates by n / s while the bias and temperature keep n: against the
    float64 eager reference at s = 4 and 0.5, GQA, both layouts; s = 1 is the call without it
    bit for bit; the backward takes it too (its gradients differ from s = 1's); a bad value is
    refused naming desc->rope_scale."""
    if not has_backend(device):
        pytest.skip("no OpenCL device here (libape.backends() says why)")
    r = np.random.default_rng(7)
    q = r.standard_normal((2, 4, 9, 16)).astype(np.float32)
    k = r.standard_normal((2, 2, 13, 16)).astype(np.float32)
    v = r.standard_normal((2, 2, 13, 16)).astype(np.float32)
    prm = dict(delta=[0.2, 0.0, 0.1, 0.05], beta=0.02, gamma=0.01, lam=[0.3, 0.0, 0.5, 0.1])
    for s in (4.0, 0.5):
        for layout in ("half", "interleaved"):
            o, lse = libape.attention(q, k, v, device=device, return_lse=True, rope_scale=s,
                                      layout=layout, skip_tol=0.0, k_start=5, **prm)
            o64, lse64 = ape64(q, k, v, causal=True, layout=layout, k_start=5, rope_scale=s,
                               **prm)
            assert np.abs(o - o64).max() < 1e-4 * max(1.0, np.abs(v).max()), (s, layout)
            assert np.abs(lse - lse64).max() < 1e-4 * max(1.0, np.abs(lse64).max())
            o1 = libape.attention(q, k, v, device=device, rope_scale=1.0, layout=layout,
                                  skip_tol=0.0, k_start=5, **prm)
            assert np.abs(o - o1).max() > 1e-3  # the scale did something
    assert np.array_equal(libape.attention(q, k, v, device=device, rope_scale=1.0, **prm),
                          libape.attention(q, k, v, device=device, **prm))
    o, lse = libape.attention(q, k, v, device=device, return_lse=True, rope_scale=4.0, **prm)
    g4 = libape.attention_backward(q, k, v, o, lse, o, device=device, rope_scale=4.0, **prm)
    o1, lse1 = libape.attention(q, k, v, device=device, return_lse=True, **prm)
    g1 = libape.attention_backward(q, k, v, o1, lse1, o1, device=device, **prm)
    assert all(np.isfinite(g).all() for g in g4)
    assert np.abs(g4[0] - g1[0]).max() > 1e-4
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rope_scale"):
            libape.attention(q, k, v, device=device, rope_scale=bad)
