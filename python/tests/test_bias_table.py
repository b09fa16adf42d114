"""Distance-bias tables (ape_attn_desc.bias_table, docs/ape.md "Distance-bias tables") from
Python: libape.attention, attention_varlen, attention_diagnostics, KVCache.attend, KVPool.attend
and PagedKV.run against the float64 evaluation of the spec (aperef.py) on every device (a
device that does not compute tables is skipped with libape's message), the table's gradient
from attention_backward and attention_varlen_backward against float64 autograd (apetorch.py),
and the refusals naming bias_table."""
import numpy as np
import pytest

import libape
from aperef import ape64

DEVICES = [d["spec"] for d in libape.devices()]
PRM = dict(delta=[0.2, 0.0, 0.1, 0.05], beta=0.02, gamma=0.01, lam=[0.3, 0.0, 0.5, 0.1])


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def tables(rng, H=4):
    """Tables of the kinds the issue names, by name: T5's buckets (log-spaced, shared), a
    Gaussian -lambda n^2 covering every distance, one shorter than the distances, random
    per-head, and a non-monotone one that rises again far away."""
    n = np.arange(64, dtype=np.float64)
    bucket = np.where(n < 8, n, 8 + np.floor(np.log(np.maximum(n, 8) / 8) / np.log(8) * 8))
    return {
        "t5": (rng.standard_normal(16)[np.minimum(bucket, 15).astype(int)] * 0.5)[None]
        .astype(np.float32),
        "gauss": np.stack([-lam * n ** 2 for lam in (0.01, 0.002, 0.0, 0.05)][:H])
        .astype(np.float32),
        "short": rand(rng, H, 3),
        "random": rand(rng, H, 40),
        "rising": np.stack([0.05 * (n - 20) ** 2 / 20 - 2.0] * H).astype(np.float32)[:, :50],
    }


def call_or_skip(fn, *args, **kw):
    """fn(*args, **kw), or a skip saying why where the device does not compute tables."""
    try:
        return fn(*args, **kw)
    except libape.ApeError as e:
        if e.name == "APE_ENOTSUP":
            pytest.skip(str(e))
        raise


def close(got, want, scale, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    assert (np.isfinite(got) == fin).all()
    err = np.abs(got[fin] - want[fin]).max() if fin.any() else 0.0
    assert err <= tol * scale, (err, tol * scale)


# ------------------------------------------------------------------ the forward calls

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["t5", "gauss", "short", "random", "rising"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_float64(device, name, causal):
    """Every kind of table, GQA, both layouts, with position interpolation, under the default
    skipping (the rising table tests the bound's suffix maximum)."""
    rng = np.random.default_rng(hash((device, name, causal)) % 2 ** 32)
    T = tables(rng)[name]
    q, k, v = rand(rng, 2, 4, 21, 16), rand(rng, 2, 2, 45, 16), rand(rng, 2, 2, 45, 16)
    for layout, rope_scale in (("half", 1.0), ("interleaved", 2.5)):
        kw = dict(PRM, causal=causal, layout=layout, k_start=3, rope_scale=rope_scale)
        o, lse = call_or_skip(libape.attention, q, k, v, device=device, return_lse=True,
                              bias_table=T, **kw)
        o64, lse64 = ape64(q, k, v, bias_table=T, **kw)
        close(o, o64, max(1.0, np.abs(v).max()))
        close(lse, lse64, max(1.0, np.abs(lse64[np.isfinite(lse64)]).max()))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_table_is_no_table_and_float16(device):
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, 1, 4, 30, 16) for _ in range(3))
    plain = libape.attention(q, k, v, device=device, **PRM)
    got = call_or_skip(libape.attention, q, k, v, device=device, bias_table=np.zeros((1, 7),
                                                                                     np.float32),
                       **PRM)
    assert np.array_equal(got, plain)
    T = tables(rng)["random"]
    h = [x.astype(np.float16) for x in (q, k, v)]
    o, lse = libape.attention(*h, device=device, return_lse=True, bias_table=T, **PRM)
    assert o.dtype == np.float16
    o64, lse64 = ape64(*h, bias_table=T, **PRM)
    close(o, o64, max(1.0, np.abs(v).max()), 5e-3)


def test_torch_tables_and_strided_numpy_are_taken():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = (rand(rng, 1, 4, 12, 8) for _ in range(3))
    T = rand(rng, 4, 10)
    want = libape.attention(q, k, v, device="ref", bias_table=T)
    assert np.array_equal(libape.attention(q, k, v, device="ref", bias_table=torch.from_numpy(T)),
                          want)
    wide = np.zeros((4, 20), np.float32)
    wide[:, ::2] = T  # a strided view: copied to contiguous memory
    assert np.array_equal(libape.attention(q, k, v, device="ref", bias_table=wide[:, ::2]), want)
    assert np.array_equal(libape.attention(q, k, v, device="ref", bias_table=T.tolist()), want)
    ot = libape.attention(*(torch.from_numpy(x) for x in (q, k, v)), device="ref",
                          bias_table=torch.from_numpy(T))
    assert torch.equal(ot, torch.from_numpy(want))
    with pytest.raises(ValueError, match=r"bias_table: requires grad.*libape\.torch"):
        libape.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                         bias_table=torch.from_numpy(T).requires_grad_())


@pytest.mark.parametrize("bad, text", [
    (np.zeros((3, 5), np.float32), r"bias_table: shape \(3, 5\): must be \[H, M\] = \[4, M\]"),
    (np.zeros(5, np.float32), r"bias_table: shape \(5,\)"),
    (np.zeros((4, 0), np.float32), r"bias_table: shape \(4, 0\).*M >= 1"),
    (np.zeros((4, 5)), "bias_table: dtype float64: must be float32"),
    ("table", "bias_table: a str is not an array"),
    (np.array([[0.0, np.nan]] * 4, np.float32), r"desc->bias_table\[0\]\[1\] = nan"),
    (np.full((1, 2), np.inf, np.float32), r"desc->bias_table\[0\]\[0\] = inf"),
])
def test_bad_tables_are_refused_naming_the_argument(bad, text):
    q = np.ones((1, 4, 4, 8), np.float32)
    with pytest.raises(ValueError, match=text):
        libape.attention(q, q, q, device="ref", bias_table=bad)
    with pytest.raises(ValueError, match=text):
        libape.attention_backward(q, q, q, q.copy(), np.zeros((1, 4, 4), np.float32), q.copy(),
                                  device="ref", bias_table=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_diagnostics(device):
    """attention_diagnostics with a table: the entropy curve of an encoding (what ape-curve and
    examples/encodings.py draw)."""
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 1, 4, 33, 16), rand(rng, 1, 2, 40, 16), rand(rng, 1, 2, 40, 16)
    T = tables(rng)["gauss"]
    prm = dict(PRM, q_start=10, k_start=3, rope_scale=2.0)
    o, lse, ent, md = call_or_skip(libape.attention_diagnostics, q, k, v, device=device,
                                   bias_table=T, **prm)
    _, lse64, ent64, md64 = ape64(q, k, v, diag=True, bias_table=T, **prm)
    close(ent, ent64, max(1.0, np.abs(lse64).max()))
    close(md, md64, 50.0)
    _, _, ent0, _ = libape.attention_diagnostics(q, k, v, device=device, **prm)
    assert ent.mean() < ent0.mean() - 0.1  # the Gaussian focuses attention


@pytest.mark.parametrize("device", DEVICES)
def test_varlen(device):
    rng = np.random.default_rng(5)
    lens_q, lens_k = [5, 0, 9, 3], [9, 4, 9, 0]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q, k, v = rand(rng, cq[-1], 4, 16), rand(rng, ck[-1], 2, 16), rand(rng, ck[-1], 2, 16)
    T = tables(rng)["short"]
    o, lse = call_or_skip(libape.attention_varlen, q, k, v, cq, ck, device=device,
                          return_lse=True, bias_table=T, **PRM)
    for s in range(len(lens_q)):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if a == b or c == d:
            continue
        o64, l64 = ape64(q[None, a:b].transpose(0, 2, 1, 3), k[None, c:d].transpose(0, 2, 1, 3),
                         v[None, c:d].transpose(0, 2, 1, 3), bias_table=T, **PRM)
        close(o[a:b].transpose(1, 0, 2), o64[0], max(1.0, np.abs(v).max()))
        close(lse[a:b].T, l64[0], max(1.0, np.abs(l64).max()))


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_and_pool_decode_match_the_dense_call(device):
    """Token-by-token decoding through KVCache.attend and KVPool.attend with a table: every
    step's row as the dense call's."""
    rng = np.random.default_rng(6)
    L = 24
    q, k, v = rand(rng, 1, 4, L, 16), rand(rng, 1, 2, L, 16), rand(rng, 1, 2, L, 16)
    T = tables(rng)["rising"]
    want = call_or_skip(libape.attention, q, k, v, device=device, bias_table=T, **PRM)
    with libape.KVCache(Hkv=2, H=4, D=16, capacity_tokens=L, device=device) as kv, \
            libape.KVPool(2, 16, 64, H=4, page_tokens=4, device=device) as pool:
        sid = pool.add_sequence()
        for t in range(L):
            kv.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            got = kv.attend(q[:, :, t:t + 1], bias_table=T, **PRM)
            close(got, want[:, :, t:t + 1], max(1.0, np.abs(v).max()))
            pool.append(sid, k[0, :, t:t + 1].transpose(1, 0, 2),
                        v[0, :, t:t + 1].transpose(1, 0, 2))
            got = pool.attend(q[0, :, t:t + 1].transpose(1, 0, 2), [sid], [0, 1], bias_table=T,
                              **PRM)
            close(got.transpose(1, 0, 2), want[0, :, t:t + 1], max(1.0, np.abs(v).max()))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_run_matches_float64(device):
    from test_paged import PRM as PAGED_PRM, Scene
    sc = Scene(seed=7)
    q, cu = sc.batch([3, 1, 0, 1, 5])
    T = tables(np.random.default_rng(7))["t5"]
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        o, lse = call_or_skip(pk.run, q, sc.k, sc.v, return_lse=True, bias_table=T,
                              **PAGED_PRM)
    sc.check(q, cu, o, lse, bias_table=T)


# ------------------------------------------------------------------ the table's gradient

@pytest.mark.parametrize("rows", [4, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_returns_the_table_gradient(rows, causal):
    """attention_backward with a table: every gradient, the table's included, against float64
    autograd of the eager APE; a shared [1, M] table's the sum over heads; wrt=("bias_table",)
    alone; deterministic."""
    torch = pytest.importorskip("torch")
    from apetorch import ape_torch64
    rng = np.random.default_rng(8 + rows)
    q, k, v = rand(rng, 2, 4, 11, 16), rand(rng, 2, 2, 15, 16), rand(rng, 2, 2, 15, 16)
    T = (0.3 * rand(rng, rows, 9)).astype(np.float32)
    kw = dict(causal=causal, q_start=6, k_start=2, rope_scale=1.5)
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True, skip_tol=0.0,
                              bias_table=T, **PRM, **kw)
    do, dlse = rand(rng, *o.shape), rand(rng, *lse.shape)
    got = libape.attention_backward(q, k, v, o, lse, do, dlse=dlse, device="ref", bias_table=T,
                                    **PRM, **kw)
    assert len(got) == 5 and got[4].shape == T.shape and got[4].dtype == np.float32
    x64 = [torch.from_numpy(x).double().requires_grad_() for x in (q, k, v, T)]
    prm = [torch.tensor(np.broadcast_to(PRM[n], 4), dtype=torch.float64)
           for n in ("delta", "beta", "gamma", "lam")]
    o64, l64 = ape_torch64(*x64[:3], *prm, bias_table=x64[3], **kw)
    ((o64 * torch.from_numpy(do).double()).sum() +
     (l64 * torch.from_numpy(dlse).double()).sum()).backward()
    for g, x in zip((got[0], got[1], got[2], got[4]), x64):
        ref = x.grad.numpy()
        assert np.abs(g - ref).max() <= 1e-3 * np.abs(ref).max()
    only = libape.attention_backward(q, k, v, o, lse, do, dlse=dlse, device="ref", bias_table=T,
                                     wrt=("bias_table",), **PRM, **kw)
    assert only[:4] == (None, None, None, None) and np.array_equal(only[4], got[4])
    none = libape.attention_backward(q, k, v, o, lse, do, dlse=dlse, device="ref", bias_table=T,
                                     wrt=("q",), **PRM, **kw)
    assert none[4] is None and np.array_equal(none[0], got[0])
    with pytest.raises(ValueError, match="names 'bias_table', but no bias_table"):
        libape.attention_backward(q, k, v, o, lse, do, device="ref", wrt=("bias_table",))


def test_table_gradient_against_finite_differences():
    """dL/dT by central differences of L = sum(O * W) + sum(LSE) in float64 NumPy: the
    library's gradient is the derivative of the function it computes."""
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 1, 2, 7, 8), rand(rng, 1, 2, 9, 8), rand(rng, 1, 2, 9, 8)
    T = (0.5 * rand(rng, 2, 5)).astype(np.float32)
    W = rand(rng, 1, 2, 7, 8)
    kw = dict(delta=0.1, beta=0.0, gamma=0.0, lam=0.2, causal=False)
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True, skip_tol=0.0,
                              bias_table=T, **kw)
    dT = libape.attention_backward(q, k, v, o, lse, W, dlse=np.ones_like(lse), device="ref",
                                   bias_table=T, wrt=("bias_table",), **kw)[4]

    def loss(t):
        o64, l64 = ape64(q, k, v, bias_table=t, **kw)
        return (o64 * W).sum() + l64.sum()
    eps = 1e-5
    fd = np.zeros(T.shape)
    for h in range(2):
        for m in range(5):
            tp, tm = T.astype(np.float64), T.astype(np.float64)
            tp[h, m] += eps
            tm[h, m] -= eps
            fd[h, m] = (loss(tp) - loss(tm)) / (2 * eps)
    assert np.abs(dT - fd).max() <= 1e-4 * max(1.0, np.abs(fd).max())


def test_varlen_backward_table_gradient_is_the_sum_over_sequences():
    rng = np.random.default_rng(10)
    lens = [6, 4, 9]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    q, k, v = rand(rng, cu[-1], 4, 8), rand(rng, cu[-1], 2, 8), rand(rng, cu[-1], 2, 8)
    T = rand(rng, 4, 6)
    o, lse = libape.attention_varlen(q, k, v, cu, cu, device="ref", return_lse=True,
                                     skip_tol=0.0, bias_table=T, **PRM)
    do = rand(rng, *o.shape)
    got = libape.attention_varlen_backward(q, k, v, o, lse, do, cu, cu, device="ref",
                                           bias_table=T, **PRM)
    assert len(got) == 5 and got[4].shape == (4, 6)
    want = np.zeros((4, 6))
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]

        def dense(x):
            return np.ascontiguousarray(x[None, a:b].transpose(0, 2, 1, 3))
        g = libape.attention_backward(dense(q), dense(k), dense(v), dense(o), lse[a:b].T[None],
                                      dense(do), device="ref", bias_table=T,
                                      wrt=("bias_table",), **PRM)
        want += g[4]
    assert np.abs(got[4] - want).max() <= 1e-5 * np.abs(want).max()


def test_dlpack_paths_read_the_table_and_refuse_its_gradient():
    """The DLPack forward (what CUDA tensors take, here kDLCPU) reads a table; the DLPack
    backward computes with it but refuses to return its gradient (ape_attention_backward()
    does): libape.torch takes the host-array backward for it."""
    torch = pytest.importorskip("torch")
    from libape import _capi, _core
    if _capi.optional["ape_attention_forward_dlpack"] is None:
        pytest.skip("this libape has no DLPack calls (built without libdlpack-dev)")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    T = torch.randn(2, 4, generator=g)
    o, lse = _core._dlpack_forward_cpu("ref", q, k, v, True, bias_table=T)
    o2, lse2 = libape.attention(q, k, v, device="ref", return_lse=True, bias_table=T)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    dq = _core._dlpack_backward_cpu("ref", q, k, v, o, lse, o, bias_table=T)[0]
    want = libape.attention_backward(q, k, v, o, lse, o, device="ref", bias_table=T)[0]
    assert (dq - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(ValueError, match="wrt"):
        _core._dlpack_backward_cpu("ref", q, k, v, o, lse, o, wrt=("bias_table",),
                                   bias_table=T)


# ------------------------------------------------------------------ the example

def test_encodings_example(tmp_path):
    """python/examples/encodings.py: every encoding at every length in seconds on the
    reference device, the Gaussian mask and APE focusing attention where RoPE spreads it; the
    tables it saves, and the ape-curve command it prints drawing the same encodings."""
    import os
    import shlex
    import subprocess
    import sys
    import time
    from conftest import BUILD, ROOT
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "python", "examples", "encodings.py"),
                        "--max-len", "128", "--device", "ref", "--save-tables", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.perf_counter() - t < 60
    ent = {}
    for line in r.stdout.splitlines():
        w = line.split()
        if len(w) == 6 and w[1] in ("64", "128"):
            ent[w[0], int(w[1])] = float(w[2])
    assert sorted({n for n, _ in ent}) == ["alibi", "ape", "gauss", "rope", "t5"], r.stdout
    assert ent["gauss", 128] < ent["rope", 128] and ent["ape", 128] < ent["rope", 128]
    assert np.load(tmp_path / "t5.npy").shape == (4, 129)
    assert np.load(tmp_path / "gauss.npy").shape == (1, 128)
    assert np.load(tmp_path / "alibi.npy").shape == (4, 128)
    curve = os.path.join(BUILD, "bin", "ape-curve")
    if not os.path.exists(curve):
        pytest.skip("ape-curve is not built here (make)")
    sets = set()
    for line in r.stdout.splitlines()[-2:]:
        cmd = shlex.split(line)
        assert cmd[0] == "ape-curve"
        c = subprocess.run([curve] + cmd[1:] + ["--backend", "ref", "--csv", "--quiet"],
                           capture_output=True, text=True, timeout=120)
        assert c.returncode == 0, c.stderr
        sets |= {row.split(",")[0].strip('"') for row in c.stdout.splitlines()[1:]}
    assert sets == {"alibi", "t5", "gauss", "rope", "ape"}, r.stdout
