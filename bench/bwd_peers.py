#!/usr/bin/env python3
"""libape's forward + backward against eager PyTorch autograd of the same APE, side by side in
one run, on this CPU (issue 13's target: libape at least 100x faster).

- libape: the Python package (python/libape, ctypes over build/lib/libape.so.0) on one device
  (default opencl, PoCL on this CPU): libape.attention(..., return_lse=True) with the seed's
  parameters and skipping (skip_tol 2^-24), then libape.attention_backward() for dQ, dK, dV and
  the per-head parameter gradients (the backward skips nothing). Wall time of each call.
- eager: bench/torch_ape.py's ape_eager() (APE-SPEC.md line by line in eager PyTorch, float32,
  no skipping: eager code has no bound to skip by), with q, k, v and per-head delta, beta,
  gamma, lambda as leaves requiring grad, loss = sum(O * dO), loss.backward(). The whole
  sequence's autograd graph holds a few [rows, keys, D/2] tensors per block and does not fit in
  memory at L = 4096 (about 100 GB), so the graph is built and run backward one (head, block
  of 256 query rows) at a time: rows are independent, so the arithmetic is the whole graph's,
  with nothing recomputed. Forward and backward times are summed over the blocks.

Both get the same number of threads (--threads, default 2: torch.set_num_threads, and PoCL's
POCL_MAX_PTHREAD_COUNT / POCL_CPU_MAX_CU_COUNT set before libape loads). Before timing, the
eager gradients are compared with libape's on a small problem (so both compute the same thing).
Eager APE is slow: --eager-heads times only that many heads and scales by H / heads (each head
is the same work: its cost is linear in them); the table says so.

usage: bench/bwd_peers.py [--build build] [--device opencl] [-L 1024 4096] [-H 6] [-D 64]
                          [--threads 2] [--repeats 3] [--eager-heads N] [--json FILE]
Needs build/venv (make deps: numpy and torch from PyPI) and a built library:
  build/venv/bin/python bench/bwd_peers.py
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def setup(args):
    """Threads and the library, before anything loads them."""
    n = str(args.threads)
    os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", n)
    os.environ.setdefault("POCL_CPU_MAX_CU_COUNT", n)
    os.environ.setdefault("OMP_NUM_THREADS", n)
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(os.path.abspath(args.build), "lib",
                                                         "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)


def inputs(B, H, L, D, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(4))
    return q, k, v, do


def libape_run(q, k, v, do, params, device):
    """One forward + backward through the package: (fwd_s, bwd_s, (o, dq, dk, dv, dparams))."""
    import libape

    t0 = time.perf_counter()
    o, lse = libape.attention(q, k, v, delta=params[0], beta=params[1], gamma=params[2],
                              lam=params[3], device=device, return_lse=True)
    t1 = time.perf_counter()
    dq, dk, dv, dp = libape.attention_backward(q, k, v, o, lse, do, delta=params[0],
                                               beta=params[1], gamma=params[2], lam=params[3],
                                               device=device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, (o, dq, dk, dv, dp)


def eager_run(q, k, v, do, params, heads, block=256):
    """Eager autograd over the first `heads` heads, one (head, row block) graph at a time:
    (fwd_s, bwd_s, (dq, dk, dv, dparams [H, 4])) with gradients of the heads run."""
    import torch
    from torch_ape import ape_eager

    B, H, L, D = q.shape
    Hkv = k.shape[1]
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_numpy(do)
    tp = [torch.tensor(p, dtype=torch.float32).requires_grad_() for p in params]
    fwd = bwd = 0.0
    for h in range(heads):
        kh = h // (H // Hkv)
        for i0 in range(0, L, block):
            t0 = time.perf_counter()
            o, _ = ape_eager(tq[:, h:h + 1, i0:i0 + block], tk[:, kh:kh + 1], tv[:, kh:kh + 1],
                             *(p[h:h + 1] for p in tp), q_start=i0, causal=True,
                             block=block)
            loss = (o * tdo[:, h:h + 1, i0:i0 + block]).sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd += t1 - t0
            bwd += t2 - t1
            del o, loss
    dparams = torch.stack([p.grad for p in tp], dim=1)  # [H, 4]
    return fwd, bwd, (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy(), dparams.numpy())


def rel(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_same_operation(params_of, device):
    """Eager autograd and libape on a small problem (H = 2, L = 300: two row blocks, keys far
    enough for the decay to matter): the largest relative difference of each gradient."""
    B, H, L, D = 1, 2, 300, 16
    q, k, v, do = inputs(B, H, L, D, 1)
    params = params_of(H)
    _, _, (_, dq, dk, dv, dp) = libape_run(q, k, v, do, params, device)
    _, _, (eq, ek, ev, ep) = eager_run(q, k, v, do, params, H)
    return {"dq": rel(eq, dq), "dk": rel(ek, dk), "dv": rel(ev, dv), "dparams": rel(ep, dp)}


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="opencl", help="libape's device (default opencl)")
    ap.add_argument("-L", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("-H", type=int, default=6)
    ap.add_argument("-D", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="libape's timed runs (median)")
    ap.add_argument("--eager-heads", type=int, default=0,
                    help="heads eager autograd runs, scaled to H (default 0: all H)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.threads < 1 or args.repeats < 1 or args.H < 1 or args.D < 2 or args.D % 2:
        ap.error("--threads, --repeats, -H >= 1; -D even")
    eh = args.eager_heads or args.H
    if not 1 <= eh <= args.H:
        ap.error("--eager-heads %d: between 1 and -H %d" % (eh, args.H))
    setup(args)
    import libape
    import torch

    seed = (libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA, libape.SEED_LAMBDA)

    def params_of(H):
        return [[p] * H for p in seed]  # per-head parameters, as the seed trains them

    dev = [d for d in libape.devices() if args.device in (d.get("backend"), d.get("spec"))]
    devname = dev[0].get("name", args.device) if dev else args.device
    diffs = check_same_operation(params_of, args.device)
    print("same operation: eager autograd against libape (%s), H=2 L=300 D=16, largest "
          "relative difference: %s" % (args.device, ", ".join("%s %.1e" % kv
                                                              for kv in diffs.items())))
    if max(diffs.values()) > 1e-3:
        sys.exit("bwd_peers: eager and libape disagree: not the same operation")
    rows = []
    for L in args.L:
        q, k, v, do = inputs(1, args.H, L, args.D, L)
        params = params_of(args.H)
        libape_run(q, k, v, do, params, args.device)  # warm-up: kernels built, memory touched
        f, b = [], []
        for _ in range(args.repeats):
            tf, tb, _ = libape_run(q, k, v, do, params, args.device)
            f.append(tf)
            b.append(tb)
        ef, eb, _ = eager_run(q, k, v, do, params, eh)
        scale = args.H / eh
        row = {"L": L, "libape_fwd_ms": 1e3 * median(f), "libape_bwd_ms": 1e3 * median(b),
               "eager_fwd_ms": 1e3 * ef * scale, "eager_bwd_ms": 1e3 * eb * scale,
               "eager_heads_timed": eh}
        row["libape_ms"] = row["libape_fwd_ms"] + row["libape_bwd_ms"]
        row["eager_ms"] = row["eager_fwd_ms"] + row["eager_bwd_ms"]
        row["ratio"] = row["eager_ms"] / row["libape_ms"]
        rows.append(row)
        print("L=%d done: libape %.1f ms, eager %.1f ms" % (L, row["libape_ms"], row["eager_ms"]),
              file=sys.stderr, flush=True)
    head = ("| L | libape fwd ms | libape bwd ms | libape fwd+bwd ms | eager fwd ms | eager bwd ms "
            "| eager fwd+bwd ms | eager / libape |")
    print("\nB=1 H=%d D=%d float32 causal, seed's parameters; libape on %s (%s), forward with "
          "skip_tol 2^-24; %d threads each; libape: median of %d; eager: one run%s" %
          (args.H, args.D, args.device, devname, args.threads, args.repeats,
           "" if eh == args.H else ", %d of %d heads, scaled" % (eh, args.H)))
    print("torch %s, libape %s" % (torch.__version__, libape.version()))
    print(head)
    print("|" + "---|" * 8)
    for r in rows:
        print("| %d | %.1f | %.1f | %.1f | %.0f | %.0f | %.0f | %.0fx |" % (
            r["L"], r["libape_fwd_ms"], r["libape_bwd_ms"], r["libape_ms"], r["eager_fwd_ms"],
            r["eager_bwd_ms"], r["eager_ms"], r["ratio"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"check": diffs, "rows": rows, "threads": args.threads,
                       "device": args.device}, f, indent=1)


if __name__ == "__main__":
    main()
