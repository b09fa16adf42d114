"""libape.attention_backward and libape.torch: gradients against autograd of an eager float64
PyTorch APE (apetorch.py) at the spec's tolerances, torch.library.opcheck, torch.compile, the
APEAttention module, the autograd.Function fallback, and the examples."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import libape
from aperef import ape64
from conftest import BUILD, ROOT, has_backend

torch = pytest.importorskip("torch", reason="PyTorch is not installed here (make deps installs "
                            "it)")
import libape.torch as apet  # noqa: E402
from apetorch import ape_torch64  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
# The spec's gradient tolerances: max abs error <= tol * max|G_64|, per tensor and per head.
GTOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
NAMES = ("q", "k", "v", "delta", "beta", "gamma", "lam")


def inputs(seed, B=2, H=4, Hkv=2, Lq=13, Lk=17, D=16, dtype=torch.float32, per_head=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    if per_head:
        prm = [torch.tensor([0.3, 0.0, 0.1, 0.05][:H]), torch.tensor([0.02, 0.05, 0.0, 0.1][:H]),
               torch.tensor([0.0, 0.01, 0.02, 0.03][:H]), torch.tensor([0.2, 0.1, 0.0, 0.4][:H])]
    else:
        prm = [torch.tensor(0.2), torch.tensor(0.03), torch.tensor(0.02), torch.tensor(0.25)]
    return [q, k, v] + prm


def reference_grads(args, loss_fn, **kw):
    """Autograd of the float64 eager APE on the same stored values."""
    x64 = [a.detach().double().requires_grad_() for a in args]
    o, lse = ape_torch64(*x64, **kw)
    loss_fn(o, lse).backward()
    return [a.grad for a in x64]


def check_grads(got, ref, dtype=torch.float32):
    tol = GTOL[dtype]
    for name, g, r in zip(NAMES, got, ref):
        assert g is not None and g.shape == r.shape, name
        if r.dim() == 1 and name not in "qkv":  # per head: each head's own scale
            for h in range(r.shape[0]):
                assert abs(g[h].double() - r[h]) <= tol * max(r[h].abs(), 1e-12), (name, h)
        else:
            err = (g.double() - r).abs().max()
            assert err <= tol * r.abs().max(), (name, float(err), float(r.abs().max()))


def loss_o_and_lse(o, lse):
    w = torch.linspace(-1.0, 1.0, o.shape[-1], dtype=o.dtype)
    return (o * w).square().sum() + 0.5 * lse.sum()


# ------------------------------------------------------------------ libape.attention_backward

def test_attention_backward_numpy_matches_float64():
    args = inputs(1)
    kw = dict(causal=True, layout="interleaved", q_start=10, k_start=2, scale=0.4, rope_base=500.)
    q, k, v = (a.numpy() for a in args[:3])
    prm = dict(delta=args[3].numpy(), beta=args[4].numpy(), gamma=args[5].numpy(),
               lam=args[6].numpy())
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True, skip_tol=0.0, **prm, **kw)
    g = np.random.default_rng(2)
    do = g.standard_normal(o.shape).astype(np.float32)
    dlse = g.standard_normal(lse.shape).astype(np.float32)
    dq, dk, dv, dp = libape.attention_backward(q, k, v, o, lse, do, dlse=dlse, device="ref",
                                               **prm, **kw)
    assert dq.dtype == np.float32 and dp.shape == (4, 4) and dp.dtype == np.float32
    ref = reference_grads(args, lambda o6, l6: (o6 * torch.from_numpy(do).double()).sum() +
                          (l6 * torch.from_numpy(dlse).double()).sum(), **kw)
    got = [torch.from_numpy(x) for x in (dq, dk, dv)] + [torch.from_numpy(dp[:, i])
                                                        for i in range(4)]
    check_grads(got, ref)
    # what is not asked for is None, and the rest unchanged (deterministic)
    n = libape.attention_backward(q, k, v, o, lse, do, dlse=dlse, device="ref", wrt=("params",),
                                  **prm, **kw)
    assert n[:3] == (None, None, None) and np.array_equal(n[3], dp)


def test_attention_backward_errors():
    q = np.random.default_rng(3).standard_normal((1, 2, 8, 8)).astype(np.float32)
    o, lse = libape.attention(q, q, q, device="ref", return_lse=True)
    with pytest.raises(ValueError, match="wrt"):
        libape.attention_backward(q, q, q, o, lse, o, wrt=(), device="ref")
    with pytest.raises(ValueError, match="lse"):
        libape.attention_backward(q, q, q, o, lse[:, :1], o, device="ref")
    want = libape.attention_backward(q, q, q, o, lse, o, device="ref")
    for spec in [d["spec"] for d in libape.devices() if d["backend"] != "ref"]:
        got = libape.attention_backward(q, q, q, o, lse, o, device=spec)
        for g, w in zip(got, want):  # the spec's float32 gradient tolerance
            assert np.abs(g - w).max() <= 1e-3 * np.abs(w).max()


CUDA_EMU = os.path.join(BUILD, "tests", "cuda_emu", "libcuda.so.1")


@pytest.mark.skipif(not os.path.exists(CUDA_EMU),
                    reason="no CUDA emulator in this build (nvcc was not found)")
def test_backward_on_the_emulated_cuda_device():
    """The CUDA backend's backward kernels (through the emulated driver) against the
    reference's gradients, at the spec's float32 tolerance; the parameters alone as well."""
    code = ("import libape, numpy as np\n"
            "r = np.random.default_rng(5)\n"
            "q, k, v = (r.standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(3))\n"
            "do = r.standard_normal((1, 2, 9, 8)).astype(np.float32)\n"
            "kw = dict(delta=0.3, beta=0.05, gamma=0.05, lam=0.1)\n"
            "o, lse = libape.attention(q, k, v, device='ref', return_lse=True, **kw)\n"
            "want = libape.attention_backward(q, k, v, o, lse, do, device='ref', **kw)\n"
            "got = libape.attention_backward(q, k, v, o, lse, do, device='cuda', **kw)\n"
            "only = libape.attention_backward(q, k, v, o, lse, do, device='cuda',\n"
            "                                 wrt=('params',), **kw)\n"
            "err = [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)]\n"
            "err.append(float(np.abs(only[3] - want[3]).max() / np.abs(want[3]).max()))\n"
            "print(max(err), only[:3] == (None, None, None))\n")
    env = dict(os.environ, APE_CUDA_LIBRARY=CUDA_EMU, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    worst, nones = r.stdout.split()
    assert float(worst) <= 1e-3 and nones == "True", r.stdout


# ------------------------------------------------------------------ libape.torch

@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_grads_match_float64(per_head, causal):
    args = [a.requires_grad_() for a in inputs(4, per_head=per_head)]
    kw = dict(causal=causal, q_start=6, k_start=3, rope_base=300.0)
    o, lse = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5], lam=args[6],
                            return_lse=True, **kw)
    assert o.dtype == torch.float32 and lse.shape == (2, 4, 13)
    loss_o_and_lse(o, lse).backward()
    check_grads([a.grad for a in args], reference_grads(args, loss_o_and_lse, **kw))


def test_training_defaults_to_the_fastest_device_with_a_backward():
    """device=None with gradients runs on grad_device(): OpenCL wherever libape has an OpenCL
    device with a backward pass (as CI's PoCL has), else the float64 reference. The gradients
    equal an explicit call on that device bit for bit, match float64 autograd at the spec's
    tolerance, and (on OpenCL) are not the reference backend's."""
    opencl = has_backend("opencl")
    q = np.linspace(-1, 1, 24, dtype=np.float32).reshape(1, 1, 3, 8)
    try:
        o, lse = libape.attention(q, q, q, device="opencl", return_lse=True)
        libape.attention_backward(q, q, q, o, lse, q, device="opencl")
        has_bwd = True
    except (libape.ApeError, ValueError):
        has_bwd = False
    expect = "opencl" if opencl and has_bwd and os.environ.get("APE_BACKEND", "auto") == "auto" \
        else "auto" if os.environ.get("APE_BACKEND", "auto") != "auto" else "ref"
    assert apet.grad_device() == expect
    grads = {}
    for dev in (None, apet.grad_device(), "ref"):
        args = [a.requires_grad_() for a in inputs(11)]
        o, lse = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5],
                                lam=args[6], return_lse=True, device=dev)
        loss_o_and_lse(o, lse).backward()
        grads[dev] = [a.grad for a in args]
    for a, b in zip(grads[None], grads[apet.grad_device()]):
        assert torch.equal(a, b)
    check_grads(grads[None], reference_grads(inputs(11), loss_o_and_lse))
    if expect == "opencl":
        assert not all(torch.equal(a, b) for a, b in zip(grads[None], grads["ref"]))


@pytest.mark.skipif(apet.IMPLEMENTATION != "custom_op", reason="PyTorch before 2.4")
@pytest.mark.parametrize("loss", ["o", "o+lse", "lse"])
def test_eager_calls_take_the_function_with_the_custom_ops_gradients(loss):
    """In eager mode libape.torch.attention runs through its autograd.Function (the custom
    op's Python dispatch costs more than a small call), with gradients bit for bit those of
    torch.ops.libape.attention, for a loss of O alone (no dLSE reaches the C call), of O and
    LSE, and of LSE alone (dO zeros)."""
    fn = {"o": lambda o, lse: (o * o).sum(), "o+lse": loss_o_and_lse,
          "lse": lambda o, lse: (lse * lse).sum()}[loss]
    grads = []
    for direct in (False, True):
        args = [a.requires_grad_() for a in inputs(12)]
        if direct:
            o, lse = torch.ops.libape.attention(*args, True, None, 300.0, 1.0, "half", 6, 3,
                                                apet.grad_device(), None, None)
            assert "Function" not in type(o.grad_fn).__name__
        else:
            o, lse = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5],
                                    lam=args[6], return_lse=True, rope_base=300.0, q_start=6,
                                    k_start=3)
            assert type(o.grad_fn).__name__ == "FunctionBackward", type(o.grad_fn).__name__
        fn(o, lse).backward()
        grads.append([a.grad for a in args])
    for name, a, b in zip(NAMES, *grads):
        assert torch.equal(a, b), name
    ref = reference_grads(inputs(12), fn, rope_base=300.0, q_start=6, k_start=3)
    ref = [torch.zeros_like(g, dtype=torch.float64) if r is None else r  # LSE has no dL/dv
           for g, r in zip(grads[0], ref)]
    check_grads(grads[0], ref)


def test_no_double_backward():
    """The backward is differentiable once (as the custom op's, which has no autograd of its
    own): a second backward through it raises instead of returning wrong gradients."""
    args = [a.requires_grad_() for a in inputs(13)]
    o = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5], lam=args[6])
    g, = torch.autograd.grad(o.square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("which", ["q", "k", "v", "delta", "lam"])
def test_plain_calls_refuse_tensors_that_record_gradients(which):
    """libape.attention() and attention_varlen() record no gradient: a tensor that requires grad
    is refused naming libape.torch's call (not a result without grad_fn that fails later in
    loss.backward()); detached or under torch.no_grad() it is taken, with the same values."""
    args = inputs(9, B=1, H=2, Hkv=2, Lq=5, Lk=5, D=8, per_head=False)
    plain = dict(zip(NAMES, args))
    want = libape.attention(plain["q"], plain["k"], plain["v"], delta=float(plain["delta"]),
                            beta=float(plain["beta"]), gamma=float(plain["gamma"]),
                            lam=float(plain["lam"]))
    kw = dict(plain)
    kw[which] = kw[which].clone().requires_grad_()
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(ValueError, match=r"%s: requires grad.*libape\.torch\.attention\(\)"
                       % which):
        libape.attention(q, k, v, **kw)
    cu = np.array([0, 5], dtype=np.int64)
    pq, pk, pv = (x[0].transpose(0, 1) for x in (q, k, v))  # [total, H, D] views
    with pytest.raises(ValueError, match=r"%s: requires grad.*libape\.torch\."
                       r"attention_varlen\(\)" % which):
        libape.attention_varlen(pq, pk, pv, cu, cu, **kw)
    with torch.no_grad():
        got = libape.attention(q, k, v, **kw)
    assert got.grad_fn is None and torch.equal(got, want)
    got = libape.attention(q.detach(), k.detach(), v.detach(),
                           **{n: x.detach() for n, x in kw.items()})
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", ["ref", "opencl"])
def test_torch_grads_with_rope_scale(device):
    """Position interpolation through autograd: every gradient (q, k, v and the four
    parameters) at rope_scale 3 matches float64 autograd of the eager APE at the same scale, on
    the reference and (where it has a backward) OpenCL; APEAttention's rope_scale attribute
    reaches the call."""
    if device == "opencl" and apet.grad_device() != "opencl":
        pytest.skip("no OpenCL device with a backward pass here (grad_device() is %s)"
                    % apet.grad_device())
    args = [a.requires_grad_() for a in inputs(12)]
    kw = dict(causal=True, q_start=6, k_start=3, rope_base=300.0)
    o, lse = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5], lam=args[6],
                            return_lse=True, rope_scale=3.0, device=device, **kw)
    loss_o_and_lse(o, lse).backward()
    check_grads([a.grad for a in args],
                reference_grads(args, loss_o_and_lse, rope_scale=3.0, **kw))
    layer = apet.APEAttention(4, 16, device="ref")
    q, k, v = (x.detach() for x in inputs(13)[:3])
    k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
    o1 = layer(q, k, v)
    layer.rope_scale = 3.0
    o3 = layer(q, k, v)
    assert not torch.equal(o1, o3)
    assert torch.equal(o3, apet.attention(q, k, v, delta=layer.delta, beta=layer.beta,
                                          gamma=layer.gamma, lam=layer.lambda_, rope_scale=3.0,
                                          device="ref"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_grads_low_precision(dtype):
    args = inputs(5, dtype=dtype)
    args = [a.requires_grad_() for a in args]
    o = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5], lam=args[6])
    assert o.dtype == dtype and args[0].grad is None
    (o.float().square().sum()).backward()
    assert args[0].grad.dtype == dtype
    check_grads([a.grad for a in args],
                reference_grads(args, lambda o6, l6: o6.square().sum()), dtype)


def test_torch_device_choice_and_errors():
    q = torch.randn(1, 2, 8, 8)
    others = [d["spec"] for d in libape.devices() if d["backend"] != "ref"]
    x = q.clone().requires_grad_()
    apet.attention(x, q, q).sum().backward()  # device=None: training runs on "ref"
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for spec in others:  # an explicit device takes both passes
        y = q.clone().requires_grad_()
        apet.attention(y, q, q, device=spec).sum().backward()
        assert (y.grad - x.grad).abs().max() <= 1e-3 * x.grad.abs().max()
    with torch.no_grad():
        o = apet.attention(q, q, q)  # inference: the best device
    assert torch.allclose(o, torch.from_numpy(libape.attention(q.numpy(), q.numpy(), q.numpy())),
                          atol=1e-4)
    if hasattr(torch, "cuda") and torch.cuda.is_available():  # pragma: no cover - no GPU here
        with pytest.raises(ValueError, match="cpu"):
            apet.attention(q.cuda(), q.cuda(), q.cuda())


@pytest.mark.skipif(apet.IMPLEMENTATION != "custom_op", reason="PyTorch before 2.4")
def test_opcheck():
    args = inputs(6, B=1, H=2, Hkv=1, Lq=5, Lk=7, D=8)
    args = [a.requires_grad_() for a in args[:3]] + [p[:2].clone().requires_grad_()
                                                     for p in args[3:]]
    rest = (True, None, 10000.0, 1.0, "half", None, 0, "ref", None)  # skip_tol None: 2^-24
    torch.library.opcheck(torch.ops.libape.attention.default, (*args, *rest))
    shared = args[:3] + [torch.tensor(0.1, requires_grad=True) for _ in range(4)]
    torch.library.opcheck(torch.ops.libape.attention.default,
                          (*shared, False, 0.5, 100.0, 2.5, "interleaved", 2, 1, "ref", 0.0))


@pytest.mark.skipif(apet.IMPLEMENTATION != "custom_op", reason="PyTorch before 2.4")
def test_torch_compile_no_graph_breaks():
    layer = apet.APEAttention(2, 8)
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return layer(q, k, v).square().sum()

    import torch._dynamo as dynamo
    dynamo.reset()
    explained = dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    g = [layer.delta.grad.clone(), q.grad.clone()]
    layer.zero_grad()
    q.grad = None
    step(q, k, v).backward()
    assert torch.equal(g[0], layer.delta.grad) and torch.equal(g[1], q.grad)


# ------------------------------------------------------------------ APEAttention

def test_module_init_and_shapes():
    m = apet.APEAttention(3, 16)
    for name, val in (("delta", libape.SEED_DELTA), ("beta", libape.SEED_BETA),
                      ("gamma", libape.SEED_GAMMA), ("lambda_", 0.1)):
        p = getattr(m, name)
        assert p.shape == (3,) and torch.allclose(p, torch.full((3,), val)), name
    assert apet.APEAttention(3, 16, per_head=False).lambda_.shape == ()
    assert len(list(m.parameters())) == 4
    q = torch.randn(2, 3, 5, 16)
    assert m(q, q[:, :1], q[:, :1]).shape == (2, 3, 5, 16)
    with pytest.raises(ValueError, match="q: shape"):
        m(q[:, :2], q, q)
    with pytest.raises(ValueError, match="head_dim"):
        apet.APEAttention(2, 7)


@pytest.mark.parametrize("per_head", [True, False])
def test_module_frozen_qkv_trains_its_parameters(per_head):
    torch.manual_seed(0)
    H, D, L = 2, 8, 24
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))  # frozen: no gradient wanted
    true = dict(delta=0.15, beta=0.08, gamma=0.06, lam=0.3)
    with torch.no_grad():
        target = apet.attention(q, k, v, device="ref", **true)
    m = apet.APEAttention(H, D, per_head=per_head)
    opt = torch.optim.Adam(m.parameters(), lr=2e-2)
    first = None
    for _ in range(60):
        loss = (m(q, k, v) - target).square().mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        assert q.grad is None and m.delta.grad.shape == m.delta.shape
        opt.step()
    assert loss.item() < 0.2 * first
    assert abs(m.delta.detach().mean() - true["delta"]) < abs(libape.SEED_DELTA - true["delta"])


def test_module_keeps_lambda_non_negative():
    m = apet.APEAttention(2, 8)
    with torch.no_grad():
        m.lambda_.fill_(-0.5)
    q = torch.randn(1, 2, 4, 8)
    o1 = m(q, q, q)  # projected to 0 before use: no APE_EINVAL
    assert (m.lambda_ == 0).all()
    o0 = apet.attention(q, q, q, delta=m.delta, beta=m.beta, gamma=m.gamma, lam=0.0)
    assert torch.equal(o1, o0)
    # a second forward before the backward projects again without disturbing the first
    o2 = m(q, q, q)
    (o1.sum() + o2.sum()).backward()
    assert m.lambda_.grad is not None


# ------------------------------------------------------------------ distance-bias tables

def _table_inputs(seed, rows, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 100)
    return (0.4 * torch.randn(rows, 9, generator=g)).to(dtype).requires_grad_()


def _table_reference(args, table, loss_fn, **kw):
    """Autograd of the float64 eager APE with the table: the gradients of the seven inputs
    and of the table."""
    x64 = [a.detach().double().requires_grad_() for a in list(args) + [table]]
    o, lse = ape_torch64(*x64[:7], bias_table=x64[7], **kw)
    loss_fn(o, lse).backward()
    return [a.grad for a in x64]


@pytest.mark.parametrize("rows", [4, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_grads_with_bias_table(rows, causal):
    """libape.torch.attention differentiable in a distance-bias table ([H, M], and [1, M]
    whose gradient sums the heads): every gradient against float64 autograd of the eager APE
    with the table term; position interpolation on top; a float64 table gets a float64
    gradient; a table that needs no gradient still shapes the others."""
    args = [a.requires_grad_() for a in inputs(14, per_head=rows == 4)]
    T = _table_inputs(14, rows)
    kw = dict(causal=causal, q_start=6, k_start=3, rope_base=300.0, rope_scale=2.0)
    o, lse = apet.attention(*args[:3], delta=args[3], beta=args[4], gamma=args[5], lam=args[6],
                            return_lse=True, bias_table=T, **kw)
    loss_o_and_lse(o, lse).backward()
    ref = _table_reference(args, T, loss_o_and_lse, **kw)
    check_grads([a.grad for a in args], ref[:7])
    assert T.grad.shape == T.shape and T.grad.dtype == torch.float32
    assert (T.grad.double() - ref[7]).abs().max() <= GTOL[torch.float32] * ref[7].abs().max()
    T64 = T.detach().double().requires_grad_()
    apet.attention(*(a.detach() for a in args[:3]), bias_table=T64, **kw).square().sum() \
        .backward()
    assert T64.grad.dtype == torch.float64
    q = args[0].detach().clone().requires_grad_()
    loss_o_and_lse(*apet.attention(q, args[1].detach(), args[2].detach(), delta=args[3],
                                   beta=args[4], gamma=args[5], lam=args[6], return_lse=True,
                                   bias_table=T.detach(), **kw)).backward()
    assert (q.grad - args[0].grad).abs().max() <= 1e-6 * args[0].grad.abs().max()


def test_torch_varlen_grads_with_bias_table():
    """libape.torch.attention_varlen with a table: the table's gradient is the sum of each
    sequence's, against float64 autograd sequence by sequence."""
    cu = torch.tensor([0, 6, 6, 13])
    g = torch.Generator().manual_seed(15)
    q = torch.randn(13, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(13, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    T = _table_inputs(15, 4)
    o, lse = apet.attention_varlen(q, k, v, cu, cu, bias_table=T, return_lse=True)
    loss_o_and_lse(o, lse).backward()
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v, T)]
    prm = [torch.tensor(x, dtype=torch.float64) for x in (libape.SEED_DELTA, libape.SEED_BETA,
                                                          libape.SEED_GAMMA, libape.SEED_LAMBDA)]
    tot = 0
    for a, b in ((0, 6), (6, 13)):
        o6, l6 = ape_torch64(*(x[a:b].permute(1, 0, 2)[None] for x in x64[:3]), *prm,
                             bias_table=x64[3])
        tot = tot + loss_o_and_lse(o6[0].permute(1, 0, 2), l6[0].T)
    tot.backward()
    for name, x, r in zip(("q", "k", "v", "bias_table"), (q, k, v, T), x64):
        assert (x.grad.double() - r.grad).abs().max() <= 1e-3 * r.grad.abs().max(), name


@pytest.mark.skipif(apet.IMPLEMENTATION != "custom_op", reason="PyTorch before 2.4")
def test_opcheck_with_bias_table():
    args = inputs(16, B=1, H=2, Hkv=1, Lq=5, Lk=7, D=8)
    args = [a.requires_grad_() for a in args[:3]] + [p[:2].clone().requires_grad_()
                                                     for p in args[3:]]
    rest = (True, None, 10000.0, 1.0, "half", None, 0, "ref", None)
    for T in (_table_inputs(16, 2), _table_inputs(17, 1), _table_inputs(18, 2).detach()):
        torch.library.opcheck(torch.ops.libape.attention.default, (*args, *rest, T))
    cu = torch.tensor([0, 2, 5])
    q, k, v = (x[0].transpose(0, 1).contiguous().detach().requires_grad_()
               for x in (args[0], args[0], args[0]))
    torch.library.opcheck(torch.ops.libape.attention_varlen.default,
                          (q, k, v, *args[3:], cu, cu, None, None, True, None, 10000.0, 1.5,
                           "half", "ref", 0.0, _table_inputs(19, 2)))


def test_module_learns_a_bias_table():
    """APEAttention(bias_table_len=M): a fifth parameter, zeros ([H, M]; [1, M] with
    per_head=False), passed to the call (its output equals libape.torch.attention's with the
    table, and its gradient float64 autograd's); trained on frozen q, k, v towards the output
    of a Gaussian mask -0.05 n^2, the loss falls and the table learns to fall with distance."""
    H, D, L, M = 2, 8, 24, 12
    m = apet.APEAttention(H, D, bias_table_len=M, device="ref")
    assert m.bias_table.shape == (H, M) and not m.bias_table.any()
    assert len(list(m.parameters())) == 5 and "bias_table_len=12" in repr(m)
    assert apet.APEAttention(H, D, per_head=False, bias_table_len=M).bias_table.shape == (1, M)
    assert apet.APEAttention(H, D).bias_table is None
    with pytest.raises(ValueError, match="bias_table_len"):
        apet.APEAttention(H, D, bias_table_len=-1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    gauss = -0.05 * torch.arange(M, dtype=torch.float32)[None].square().expand(H, M)
    with torch.no_grad():
        m.bias_table.copy_(gauss)
        assert torch.equal(m(q, k, v), apet.attention(
            q, k, v, delta=m.delta, beta=m.beta, gamma=m.gamma, lam=m.lambda_,
            bias_table=gauss, device="ref"))
        target = m(q, k, v)
        m.bias_table.zero_()
    (m(q, k, v) - target).square().sum().backward()
    args = [q, k, v, m.delta, m.beta, m.gamma, m.lambda_]
    ref = _table_reference(args, m.bias_table, lambda o6, l6: (o6 - target.double()).square()
                           .sum())
    assert (m.bias_table.grad.double() - ref[7]).abs().max() <= 1e-3 * ref[7].abs().max()
    opt = torch.optim.Adam([m.bias_table], lr=5e-2)
    first = None
    for _ in range(80):
        loss = (m(q, k, v) - target).square().mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first
    t = m.bias_table.detach()
    assert (t[:, 1] - t[:, 6] > 0.5).all()  # far distances learnt to be penalised


@pytest.mark.skipif(apet.IMPLEMENTATION != "custom_op", reason="PyTorch before 2.4")
def test_torch_compile_with_a_bias_table():
    """A module learning a table compiles without graph breaks (the device libape.torch picks
    is probed once, eagerly, as for every module), with the eager gradients."""
    layer = apet.APEAttention(2, 8, bias_table_len=5)
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return layer(q, k, v).square().sum()

    step(q, k, v).backward()  # the device choice, eagerly
    import torch._dynamo as dynamo
    dynamo.reset()
    explained = dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    layer.zero_grad()
    torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v).backward()
    g = layer.bias_table.grad.clone()
    layer.zero_grad()
    step(q, k, v).backward()
    assert torch.equal(g, layer.bias_table.grad)


def test_table_device_choice():
    """device=None with a table passes over a device without the "bias_table" capability (for
    the most preferred one with it); an explicit device is used as given, and one that does
    not compute tables raises ApeError (APE_ENOTSUP) naming it."""
    q = torch.randn(1, 2, 5, 8)
    T = torch.randn(2, 3)
    want = libape.attention(q, q, q, device="ref", bias_table=T)
    assert torch.equal(apet.attention(q, q, q, bias_table=T), want) or \
        "bias_table" in libape.devices()[0]["capabilities"]
    for d in libape.devices():
        if "bias_table" not in d["capabilities"]:
            with pytest.raises(libape.ApeError, match="distance-bias tables") as e:
                apet.attention(q, q, q, bias_table=T, device=d["spec"])
            assert e.value.name == "APE_ENOTSUP"


# ------------------------------------------------------------------ the fallback and examples

def run_python(code_or_path, env_extra=None, args=(), timeout=300):
    """code_or_path in a new Python; env_extra's variables set, those given None unset."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), HERE]),
               **(env_extra or {}))
    env = {k: v for k, v in env.items() if v is not None}
    cmd = [sys.executable] + (["-c", code_or_path] if "\n" in code_or_path else
                              [code_or_path]) + list(args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


FALLBACK_CHECK = """
import torch, libape.torch as apet
import test_torch as t
assert apet.IMPLEMENTATION == "autograd.Function", apet.IMPLEMENTATION
assert not hasattr(torch.ops.libape, "attention")
assert not hasattr(torch.ops.libape, "attention_varlen")
for per_head in (True, False):
    t.test_torch_grads_match_float64(per_head, True)
t.test_torch_grads_with_bias_table(4, True)
t.test_torch_varlen_grads_with_bias_table()
t.test_module_frozen_qkv_trains_its_parameters(False)
t.test_module_keeps_lambda_non_negative()
import test_varlen as tv
tv.test_torch_varlen_grads_match_float64()
tv.test_torch_autograd_and_packed_module()
print("fallback ok")
"""


def test_autograd_function_fallback():
    r = run_python(FALLBACK_CHECK, {"LIBAPE_TORCH_FALLBACK": "1"})
    assert r.returncode == 0 and "fallback ok" in r.stdout, r.stdout + r.stderr


OMP_GUARD_CHECK = """
import threading, torch, libape.torch as apet
import test_torch as t
torch.set_num_threads(2)
gomp = any("libgomp" in line for line in open("/proc/self/maps"))
assert apet.omp_guard() is False  # not decided before a call
args = [a.requires_grad_() for a in t.inputs(3)]
apet.attention(*args[:3]).sum().backward()
names = [th.name for th in threading.enumerate()]
print("gomp", gomp, "guard", apet.omp_guard(), "thread", "libape-omp-guard" in names)
apet.omp_guard(False)
assert not apet.omp_guard() and "libape-omp-guard" not in [th.name for th in threading.enumerate()]
apet.attention(*args[:3]).sum().backward()  # stays off
assert not apet.omp_guard()
if gomp and apet._omp_guard_wanted() is None:
    assert apet.omp_guard(True)
"""


@pytest.mark.parametrize("env", [{}, {"LIBAPE_TORCH_OMP_GUARD": "1"},
                                 {"LIBAPE_TORCH_OMP_GUARD": "0"},
                                 {"LIBAPE_TORCH_OMP_GUARD": "1", "OMP_WAIT_POLICY": "passive"}])
def test_omp_guard(env):
    """The guard against PyTorch's spinning OpenMP threads (docs/python.md): opt-in; with
    LIBAPE_TORCH_OMP_GUARD=1 on after the first call on CPU tensors where torch runs 2 threads
    through libgomp, its helper thread alive; off by default, with LIBAPE_TORCH_OMP_GUARD=0 or
    where the user set libgomp's wait policy; omp_guard(False) ends it for good,
    omp_guard(True) starts it again (where it may run)."""
    r = run_python(OMP_GUARD_CHECK, dict({"LIBAPE_TORCH_OMP_GUARD": None,
                                          "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
                                         **env))
    assert r.returncode == 0, r.stdout + r.stderr
    on = "gomp True" in r.stdout and env == {"LIBAPE_TORCH_OMP_GUARD": "1"}
    assert ("guard %s thread %s" % (on, on)) in r.stdout, r.stdout


def test_fine_tune_example_small():
    t = time.perf_counter()
    r = run_python(os.path.join(EXAMPLES, "fine_tune_ape.py"), args=["--small"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "relative errors" in r.stdout and time.perf_counter() - t < 120, r.stdout


def test_training_skips_by_default_in_both_passes():
    """skip_tol=None (the default) reaches both C calls as 2^-24, 0 as 0 (the call log's JSON
    lines, APE_VERBOSE: read once per process, so a child); the gradients under skipping are
    the exact ones within the bound's share."""
    import json
    import subprocess
    import sys
    code = ("import torch, libape.torch as apet\n"
            "torch.manual_seed(0)\n"
            "q, k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))\n"
            "for tol in (None, 0.0):\n"
            "    apet.attention(q, k, v, device='ref', skip_tol=tol).square().sum().backward()\n")
    env = dict(os.environ, APE_VERBOSE="1", APE_VERBOSE_FORMAT="json",
               PYTHONPATH=os.path.dirname(os.path.dirname(apet.__file__)))
    err = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stderr
    lines = [json.loads(l[len("libape: "):]) for l in err.splitlines()
             if l.startswith("libape: {")]
    got = [(x["call"], x["skip_tol"]) for x in lines
           if x["call"] in ("ape_attention_forward", "ape_attention_backward")]
    assert got == [("ape_attention_forward", 2.0 ** -24), ("ape_attention_backward", 2.0 ** -24),
                   ("ape_attention_forward", 0.0), ("ape_attention_backward", 0.0)], got
    # the gradients: skipping at the default against every pair
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))
    grads = []
    for tol in (None, 0.0):
        for x in (q, k, v):
            x.grad = None
        apet.attention(q, k, v, device="ref", skip_tol=tol).square().sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
