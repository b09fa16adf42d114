#!/usr/bin/env python3
"""libape against what a user would pick instead, on the CPU, side by side in one run (issue 16).

Cases (B = 1, H = 6, D = 64, float32, causal, the same inputs for every contender):
  rope        plain RoPE attention (delta = beta = gamma = lambda = 0)
  alibi       ALiBi-style: delta = 2^(-4/3) only, skipping on (skip_tol 2^-24)
  ape-dense   APE with the seed's parameters, skip_tol 0
  ape-skip    APE with the seed's parameters, skipping on
  sep-dense   the seed's delta, beta, gamma with lambda = 0 (the separable path), skip_tol 0
  sep-skip    the same, skipping on
  decode      one query against Lk = 32768 keys, no decay; libape's keys are resident in a KV
              cache, SDPA's already rotated (as a cache holds them)
Contenders: PyTorch's scaled_dot_product_attention on RoPE-rotated inputs (the rotation done
once, not timed), eager PyTorch APE (bench/torch_ape.py's ape_eager, float32; sampled on one
head and scaled by the head count, its cost being linear in heads; lengths above --eager-max-L
left out), and libape (the Python package, in-process: the forward call as a user times it,
inputs and outputs in host memory). All use the same thread count (--threads, default: the
machine's cores; PoCL uses every core).

Every libape result is checked against SDPA (rope) or eager APE (the others, on a small length)
before timing. The table gives median milliseconds and libape's time as a multiple of SDPA's;
the decode, a few milliseconds a step, in alternating rounds of 9 calls of each (the median of
the rounds' medians).

usage: bench/peers.py [--build build] [--device opencl] [-L 1024 4096 16384] [--repeats 3]
                      [--venv build/venv] [--quick]
PyTorch comes from PyPI, in the virtual environment --venv (created there, with torch installed,
when it is missing: about 5 GB and a minute); the script re-runs itself in it.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DELTA = 2.0 ** (-4.0 / 3.0)
SEED = dict(delta=DELTA, beta=DELTA / 10, gamma=DELTA / 10, lam=0.1)
ZERO = dict(delta=0.0, beta=0.0, gamma=0.0, lam=0.0)
ALIBI = dict(delta=DELTA, beta=0.0, gamma=0.0, lam=0.0)
SEP = dict(SEED, lam=0.0)  # every decay, no slow-down: the rotation separates


def ensure_venv(venv):
    """Re-executes this script inside `venv` (made with torch from PyPI when missing)."""
    py = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        return
    if not os.path.exists(py):
        print("peers: creating %s with torch from PyPI" % venv, file=sys.stderr)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                       check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "torch"], check=True)
    os.execv(py, [py] + sys.argv)


def median_ms(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="opencl")
    ap.add_argument("-L", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--decode-L", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--eager-max-L", type=int, default=4096)
    ap.add_argument("--venv", default=os.path.join(ROOT, "build", "venv"))
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = ap.parse_args()
    ensure_venv(os.path.abspath(args.venv))
    if args.quick:
        args.L, args.decode_L, args.repeats = [256], 2048, 1

    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(args.build, "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, HERE)
    import numpy as np
    import torch
    import libape
    from torch_ape import ape_eager, rope_rotate, sdpa_rope

    torch.set_num_threads(args.threads)
    H, D = 6, 64
    dev = args.device
    rows = []

    def lib(q, k, v, p, skip):
        return libape.attention(q, k, v, delta=p["delta"], beta=p["beta"], gamma=p["gamma"],
                                lam=p["lam"], skip_tol=2.0 ** -24 if skip else 0.0, device=dev)

    # correctness first, on a small length
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 256, D, generator=g) for _ in range(3))
    err = (lib(q, k, v, ZERO, False) - sdpa_rope(q, k, v)).abs().max().item()
    assert err < 1e-4, "libape plain RoPE vs SDPA: max |diff| %g" % err
    for name, p in (("alibi", ALIBI), ("ape", SEED), ("sep", SEP)):
        ref, _ = ape_eager(q, k, v, **p)
        err = (lib(q, k, v, p, True) - ref).abs().max().item()
        assert err < 1e-4, "libape %s vs eager PyTorch: max |diff| %g" % (name, err)

    for L in args.L:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
        pos = torch.arange(L)
        rot = (rope_rotate(q, pos), rope_rotate(k, pos))
        t_sdpa = median_ms(lambda: sdpa_rope(q, k, v, rotated=rot), args.repeats)
        for case, p, skip in (("rope", ZERO, False), ("alibi", ALIBI, True),
                              ("ape-dense", SEED, False), ("ape-skip", SEED, True),
                              ("sep-dense", SEP, False), ("sep-skip", SEP, True)):
            t_lib = median_ms(lambda: lib(q, k, v, p, skip), args.repeats)
            t_eager = None
            if L <= args.eager_max_L:  # one head, scaled by H
                t_eager = H * median_ms(lambda: ape_eager(q, k, v, heads=1, **p), 1,
                                        warmup=1 if L <= 1024 else 0)
            rows.append((case, L, t_sdpa, t_eager, t_lib))
            print("  %-9s L=%-6d sdpa %9.1f ms  libape %9.1f ms" % (case, L, t_sdpa, t_lib),
                  file=sys.stderr)

    # decode: one query over Lk resident keys, no decay
    Lk = args.decode_L
    g = torch.Generator().manual_seed(Lk)
    k, v = (torch.randn(1, H, Lk, D, generator=g) for _ in range(2))
    q1 = torch.randn(1, H, 1, D, generator=g)
    kr = rope_rotate(k, torch.arange(Lk))
    qr = rope_rotate(q1, torch.tensor([Lk - 1]))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qr, kr, v)  # noqa: E731
    with libape.KVCache(B=1, Hkv=H, D=D, capacity_tokens=Lk, device=dev) as cache:
        cache.append(k.numpy(), v.numpy())
        qn = q1.numpy()
        att = lambda: cache.attend(qn, delta=0.0, beta=0.0, gamma=0.0,  # noqa: E731
                                   lam=0.0, skip_tol=0.0)
        assert np.abs(att() - sdpa().numpy()).max() < 1e-4, "decode: libape vs SDPA differ"
        # a step takes milliseconds: more calls, in alternating rounds (load falls on both alike);
        # each contender's figure is the median of its rounds' medians
        ts, tl = [], []
        for _ in range(max(args.repeats, 3)):
            ts.append(median_ms(sdpa, 9))
            tl.append(median_ms(att, 9))
        t_sdpa, t_lib = statistics.median(ts), statistics.median(tl)
    rows.append(("decode", Lk, t_sdpa, None, t_lib))

    print("| case | L | PyTorch SDPA (plain RoPE) | eager PyTorch APE | libape %s | libape / SDPA |"
          % dev)
    print("|---|---|---|---|---|---|")
    for case, L, ts, te, tl in rows:
        print("| %s | %d | %.1f ms | %s | %.1f ms | %.2fx |" % (
            case, L, ts, "%.0f ms" % te if te is not None else "-", tl, tl / ts))
    print("\n%d threads for PyTorch (torch %s); libape %s on %s; median of %d" % (
        args.threads, torch.__version__, libape.version(), dev, args.repeats))


if __name__ == "__main__":
    main()
