"""libape.attention_varlen (ragged batches of packed sequences) from NumPy and torch: every
sequence against the float64 evaluation at its positions (default, shifted, gaps, repeats),
on every device; strided views of a packed QKV buffer without copies; the position_ids helper;
errors."""
import numpy as np
import pytest

import libape
from aperef import ape64

DEVICES = [d["spec"] for d in libape.devices()]
PRM = dict(delta=[0.3, 0.05], beta=0.02, gamma=[0.0, 0.03], lam=0.2)


def batch(rng, lens_q, lens_k, H=2, Hkv=1, D=16):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((cq[-1], H, D)).astype(np.float32)
    k = rng.standard_normal((ck[-1], Hkv, D)).astype(np.float32)
    v = rng.standard_normal((ck[-1], Hkv, D)).astype(np.float32)
    return q, k, v, cq, ck


def check(o, lse, q, k, v, cq, ck, pq=None, pk=None, causal=True):
    m = max(1.0, np.abs(v).max())
    for s in range(len(cq) - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if a == b:
            continue
        if c == d:
            assert (o[a:b] == 0).all() and np.isneginf(lse[a:b]).all()
            continue
        kw = {}
        if pq is not None:
            kw = dict(positions_q=pq[a:b], positions_k=pk[c:d])
        o64, l64 = ape64(q[None, a:b].transpose(0, 2, 1, 3), k[None, c:d].transpose(0, 2, 1, 3),
                         v[None, c:d].transpose(0, 2, 1, 3), causal=causal, **PRM, **kw)
        assert np.abs(o[a:b].transpose(1, 0, 2) - o64[0]).max() <= 1e-4 * m, s
        got, want = lse[a:b].T, l64[0]
        fin = np.isfinite(want)
        assert (np.isfinite(got) == fin).all(), s
        assert (np.abs(got[fin] - want[fin]) <= 1e-4 * np.maximum(1, np.abs(want[fin]))).all(), s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_default_positions(device, causal):
    rng = np.random.default_rng(1 + causal)
    q, k, v, cq, ck = batch(rng, [5, 0, 1, 17, 3], [9, 4, 6, 17, 0])
    o, lse = libape.attention_varlen(q, k, v, cq, ck, causal=causal, device=device,
                                     return_lse=True, **PRM)
    assert o.shape == q.shape and o.dtype == np.float32 and lse.shape == (q.shape[0], 2)
    check(o, lse, q, k, v, cq, ck, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["shifted", "gaps", "repeats"])
def test_explicit_positions(device, kind):
    rng = np.random.default_rng(7)
    q, k, v, cq, ck = batch(rng, [6, 2, 11], [8, 5, 11])
    pq, pk = np.zeros(q.shape[0], np.int64), np.zeros(k.shape[0], np.int64)
    for s in range(3):
        lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        if kind == "shifted":
            pk[ck[s]:ck[s + 1]] = 100 * s + np.arange(lk)
        elif kind == "gaps":
            pk[ck[s]:ck[s + 1]] = np.cumsum(rng.integers(1, 5, lk))
        else:
            pk[ck[s]:ck[s + 1]] = np.cumsum(rng.integers(0, 2, lk))
        pq[cq[s]:cq[s + 1]] = pk[ck[s + 1] - 1] - lq + 1 + np.arange(lq) // (2 if kind == "repeats" else 1)
    o, lse = libape.attention_varlen(q, k, v, cq, ck, positions_q=pq, positions_k=pk,
                                     device=device, return_lse=True, **PRM)
    check(o, lse, q, k, v, cq, ck, pq, pk)


def test_torch_slices_of_a_packed_qkv_buffer_and_int32_offsets():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(30, 3, 2, 16, generator=g)  # [total, (q, k, v), H, D]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # strided views, no copies
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    o, lse = libape.attention_varlen(q, k, v, cu, cu, device="ref", return_lse=True, **PRM)
    assert isinstance(o, torch.Tensor) and o.shape == (30, 2, 16)
    cq = cu.numpy().astype(np.int64)
    check(o.numpy(), lse.numpy(), q.numpy(), k.numpy(), v.numpy(), cq, cq)


def test_position_ids_to_cu_seqlens():
    ids = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert libape.position_ids_to_cu_seqlens(ids).tolist() == [0, 3, 5, 9]
    with pytest.raises(ValueError, match="start at 0"):
        libape.position_ids_to_cu_seqlens([1, 2])


def test_errors_name_the_argument():
    rng = np.random.default_rng(0)
    q, k, v, cq, ck = batch(rng, [3, 2], [3, 2])
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        libape.attention_varlen(q, k, v, cq, ck[:-1], device="ref")
    with pytest.raises(ValueError, match=r"vl->cu_seqlens_q\[2\] = 4"):
        libape.attention_varlen(q, k, v, np.array([0, 3, 4]), ck, device="ref")
    with pytest.raises(ValueError, match="3-D"):
        libape.attention_varlen(q[None], k, v, cq, ck, device="ref")
    with pytest.raises(ValueError, match="positions_q"):
        libape.attention_varlen(q, k, v, cq, ck, positions_q=np.arange(2),
                                positions_k=np.arange(5), device="ref")


def test_backward_against_float64_finite_differences():
    """libape.attention_varlen_backward against central differences of the float64 oracle
    along random directions, explicit positions with gaps and two runs of keys."""
    rng = np.random.default_rng(11)
    q, k, v, cq, ck = batch(rng, [4, 3], [6, 5])
    pk = np.concatenate([np.array([0, 1, 2, 5, 6, 7]), np.array([3, 4, 9, 10, 11])])
    pq = np.concatenate([np.array([6, 7, 7, 8]), np.array([9, 11, 12])])
    o, lse = libape.attention_varlen(q, k, v, cq, ck, positions_q=pq, positions_k=pk,
                                     device="ref", return_lse=True, skip_tol=0.0, **PRM)
    do = rng.standard_normal(o.shape).astype(np.float32)
    dq, dk, dv, dp = libape.attention_varlen_backward(q, k, v, o, lse, do, cq, ck,
                                                      positions_q=pq, positions_k=pk,
                                                      device="ref", **PRM)

    def loss(q, k, v, prm):
        tot = 0.0
        for s in range(2):
            a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
            o64, _ = ape64(q[None, a:b].transpose(0, 2, 1, 3), k[None, c:d].transpose(0, 2, 1, 3),
                           v[None, c:d].transpose(0, 2, 1, 3), positions_q=pq[a:b],
                           positions_k=pk[c:d], **prm)
            tot += (o64[0].transpose(1, 0, 2) * do[a:b]).sum()
        return tot

    h = 1e-5
    for x, g in ((q, dq), (k, dk), (v, dv)):
        u = rng.standard_normal(x.shape)
        x64 = x.astype(np.float64)
        args = [q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)]
        i = [a is x for a in (q, k, v)].index(True)
        args[i] = x64 + h * u
        lp = loss(*args, PRM)
        args[i] = x64 - h * u
        lm = loss(*args, PRM)
        fd = (lp - lm) / (2 * h)
        assert abs(fd - (g.astype(np.float64) * u).sum()) <= 1e-3 * max(1.0, abs(fd))
    for j, name in enumerate(("delta", "beta", "gamma", "lam")):
        for hh in range(2):
            def at(eps):
                prm = {kk: np.array(vv, dtype=np.float64) * np.ones(2) for kk, vv in PRM.items()}
                prm[name][hh] += eps
                return loss(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), prm)
            fd = (at(h) - at(-h)) / (2 * h)
            assert abs(fd - dp[hh, j]) <= 1e-3 * max(1.0, abs(fd)), (name, hh, fd, dp[hh, j])


def test_torch_autograd_and_packed_module():
    torch = pytest.importorskip("torch")
    import libape.torch as lt
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, 2, 16, generator=g, requires_grad=True)
    k = torch.randn(12, 1, 16, generator=g, requires_grad=True)
    v = torch.randn(12, 1, 16, generator=g, requires_grad=True)
    cu = torch.tensor([0, 5, 12])
    delta = torch.tensor([0.3, 0.05], requires_grad=True)
    o = lt.attention_varlen(q, k, v, cu, cu, delta=delta, beta=0.02, gamma=0.0, lam=0.2)
    o.square().sum().backward()
    # the same through one dense call per document
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    d2 = delta.detach().clone().requires_grad_()
    tot = 0
    for a, b in ((0, 5), (5, 12)):
        od = lt.attention(q2[a:b].permute(1, 0, 2)[None], k2[a:b].permute(1, 0, 2)[None],
                          v2[a:b].permute(1, 0, 2)[None], delta=d2, beta=0.02, gamma=0.0, lam=0.2)
        tot = tot + od.square().sum()
    tot.backward()
    for x, y in ((q, q2), (k, k2), (v, v2), (delta, d2)):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-5)
    m = lt.APEAttention(2, 16)
    out = m(q.detach(), k.detach(), v.detach(), cu_seqlens=cu)
    assert out.shape == (12, 2, 16)
    out.sum().backward()
    assert m.delta.grad is not None and torch.isfinite(m.lambda_.grad).all()


def test_packed_training_example_small():
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys
    ex = os.path.join(os.path.dirname(__file__), "..", "examples", "packed_training.py")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, ".."), here]))
    r = subprocess.run([sys.executable, ex, "--small"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "agree" in r.stdout, r.stdout


# ------------------------------------------------------------------ libape.torch.attention_varlen

def _torch_batch(seed, lens_q, lens_k, H=2, Hkv=1, D=16):
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck = batch(np.random.default_rng(seed), lens_q, lens_k, H, Hkv, D)
    g = torch.Generator().manual_seed(seed)
    params = [torch.tensor(p, dtype=torch.float32) + 0.01 * torch.rand(H, generator=g)
              for p in (0.3, 0.05, 0.02, 0.2)]
    return ([torch.from_numpy(x).requires_grad_() for x in (q, k, v)] +
            [p.requires_grad_() for p in params], torch.from_numpy(cq), torch.from_numpy(ck))


def test_torch_varlen_grads_match_float64():
    """Every gradient (q, k, v, the four per-head parameters) of a batch with an empty
    sequence, a decode row and shifted positions against autograd of the float64 eager APE on
    each sequence, at the spec's float32 gradient tolerance."""
    torch = pytest.importorskip("torch")
    import libape.torch as lt
    from apetorch import ape_torch64
    args, cq, ck = _torch_batch(21, [5, 0, 1, 6], [7, 0, 4, 6])
    starts_k = [3, 0, 10, 0]  # each sequence's keys from here, queries end-aligned to them
    pk = torch.cat([s + torch.arange(int(ck[i + 1] - ck[i])) for i, s in enumerate(starts_k)])
    pq = torch.cat([s + int(ck[i + 1] - ck[i] - (cq[i + 1] - cq[i])) +
                    torch.arange(int(cq[i + 1] - cq[i])) for i, s in enumerate(starts_k)])
    w = torch.linspace(-1.0, 1.0, 16)
    o, lse = lt.attention_varlen(*args[:3], cq, ck, positions_q=pq, positions_k=pk,
                                 delta=args[3], beta=args[4], gamma=args[5], lam=args[6],
                                 causal=True, rope_base=300.0, return_lse=True)
    assert o.shape == args[0].shape and lse.shape == (12, 2) and lse.dtype == torch.float32
    ((o * w).square().sum() + 0.5 * lse.sum()).backward()
    x64 = [a.detach().double().requires_grad_() for a in args]
    tot = 0
    for s in range(4):
        a, b, c, d = (int(x) for x in (cq[s], cq[s + 1], ck[s], ck[s + 1]))
        if a == b:
            continue
        o6, l6 = ape_torch64(*(x[r0:r1].permute(1, 0, 2)[None] for x, r0, r1 in
                               ((x64[0], a, b), (x64[1], c, d), (x64[2], c, d))), *x64[3:],
                             rope_base=300.0, q_start=int(pq[a]), k_start=int(pk[c]))
        tot = tot + (o6[0].permute(1, 0, 2) * w.double()).square().sum() + 0.5 * l6.sum()
    tot.backward()
    for name, x, r in zip(("q", "k", "v", "delta", "beta", "gamma", "lam"), args, x64):
        err = (x.grad.double() - r.grad).abs().max()
        assert err <= 1e-3 * r.grad.abs().max(), (name, float(err))


def test_torch_varlen_is_the_custom_op_without_copies(monkeypatch):
    """torch.ops.libape.attention_varlen where custom ops exist (IMPLEMENTATION says which);
    slices of a packed QKV tensor reach the C calls, forward and backward, as they are."""
    torch = pytest.importorskip("torch")
    import libape._core as core
    import libape.torch as lt
    assert lt.IMPLEMENTATION in ("custom_op", "autograd.Function")
    assert hasattr(torch.ops.libape, "attention_varlen") == (lt.IMPLEMENTATION == "custom_op")
    qkv = torch.randn(9, 3, 2, 8, requires_grad=True)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    seen = {}
    real = core._torch_array

    def spy(name, x):
        arr = real(name, x)
        seen.setdefault(name, set()).add(arr.fields[0])
        return arr
    monkeypatch.setattr(core, "_torch_array", spy)
    cu = np.array([0, 4, 9], dtype=np.int32)  # NumPy offsets taken too
    lt.attention_varlen(q, k, v, cu, cu).sum().backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert seen[name] == {x.data_ptr()}, name
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


def test_torch_varlen_opcheck():
    torch = pytest.importorskip("torch")
    import libape.torch as lt
    if lt.IMPLEMENTATION != "custom_op":
        pytest.skip("PyTorch before 2.4")
    args, cq, ck = _torch_batch(22, [3, 0, 4], [5, 0, 4])
    op = torch.ops.libape.attention_varlen.default
    torch.library.opcheck(op, (*args, cq, ck, None, None, True, None, 10000.0, 1.0, "half",
                               "ref", None))
    shared = args[:3] + [torch.tensor(0.1, requires_grad=True) for _ in range(4)]
    pq = torch.tensor([5, 6, 6, 0, 1, 2, 9])  # a repeat, a gap
    pk = torch.tensor([0, 1, 3, 4, 5, 0, 1, 2, 3])
    torch.library.opcheck(op, (*shared, cq.int(), ck.int(), pq, pk, False, 0.5, 100.0, 4.0,
                               "interleaved", "ref", 0.0))


def test_torch_varlen_compile_no_graph_breaks():
    torch = pytest.importorskip("torch")
    import libape.torch as lt
    if lt.IMPLEMENTATION != "custom_op":
        pytest.skip("PyTorch before 2.4")
    import torch._dynamo as dynamo
    layer = lt.APEAttention(2, 8)
    q, k, v = (torch.randn(11, 2, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 4, 11])
    pos = torch.cat([torch.arange(4), 2 + torch.arange(7)])

    def step(q, k, v):
        a = layer(q, k, v, cu_seqlens=cu, positions=pos)
        b = lt.attention_varlen(q, k, v, cu, cu, delta=layer.delta, causal=False)
        return a.square().sum() + b.square().sum()

    dynamo.reset()
    explained = dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()
    g = [layer.delta.grad.clone(), layer.lambda_.grad.clone(), q.grad.clone(), k.grad.clone()]
    layer.zero_grad()
    q.grad = k.grad = v.grad = None
    step(q, k, v).backward()
    for x, y in zip(g, (layer.delta.grad, layer.lambda_.grad, q.grad, k.grad)):
        assert torch.equal(x, y)
