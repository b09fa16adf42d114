#!/usr/bin/env python3
"""One training step of attention as a PyTorch user gets it, side by side in one process (issue 28).

- libape: libape.torch.attention(q, k, v) with the seed's parameters as learnable tensors, then
  loss.backward() (every gradient: q, k, v and the four parameters), with device=None: the
  device libape.torch picks for training (libape.torch.grad_device()).
- libape, skip_tol=0: the same computing every pair (what libape.torch trained with before
  2026-12-06, when it skipped nothing; since then skip_tol=None, 2^-24, is the default in both
  passes);
- libape, device="ref": the same on the float64 reference backend (what device=None ran before
  2026-12-06); only at the lengths given by --ref-L, since it is tens of times slower.
- SDPA: torch.nn.functional.scaled_dot_product_attention (causal) on RoPE-rotated q and k, then
  backward: plain RoPE attention, what a user would pick instead (APE has no PyTorch kernel).

B = 1, H = 6, D = 64, float32, causal. Each round times every candidate once per length
(--repeats calls, the median), in turn, after one untimed call; prints each round and the
median over rounds of each ratio to SDPA.

usage: build/venv/bin/python bench/train_step.py [-L 1024 4096] [--ref-L 1024] [--rounds 5]
       [--repeats 3] [--threads 2] [--lam 0]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-L", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--ref-L", type=int, nargs="*", default=[1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lam", type=float, default=None,
                    help="lambda's initial value (default: the seed's, 0.1; 0: the separable path)")
    args = ap.parse_args()
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(ROOT, "build", "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, HERE)
    import torch
    import libape
    import libape.torch as apet
    from torch_ape import rope_rotate

    torch.set_num_threads(args.threads)
    H, D = 6, 64
    print("libape.torch.grad_device(): %s; torch %s, %d threads" % (
        apet.grad_device(), torch.__version__, args.threads))

    def step_libape(L, device, skip_tol=None):
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
        lam = libape.SEED_LAMBDA if args.lam is None else args.lam
        prm = [torch.tensor(x, requires_grad=True) for x in
               (libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA, lam)]

        def run():
            o = apet.attention(q, k, v, delta=prm[0], beta=prm[1], gamma=prm[2], lam=prm[3],
                               device=device, skip_tol=skip_tol)
            o.square().sum().backward()
        return run

    def step_sdpa(L):
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
        pos = torch.arange(L)

        def run():
            o = torch.nn.functional.scaled_dot_product_attention(
                rope_rotate(q, pos), rope_rotate(k, pos), v, is_causal=True)
            o.square().sum().backward()
        return run

    def median_ms(fn):
        fn()
        t = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t)

    cands = {}
    for L in args.L:
        cands[L] = [("sdpa", step_sdpa(L)), ("libape default", step_libape(L, None)),
                    ("libape skip_tol=0", step_libape(L, None, 0.0))]
        if L in args.ref_L:
            cands[L].append(("libape ref", step_libape(L, "ref")))
    ratios = {}
    for r in range(args.rounds):
        for L in args.L:
            t = {name: median_ms(fn) for name, fn in cands[L]}
            print("round %d, L %d: " % (r, L) + ", ".join(
                "%s %.1f ms" % (n, x) for n, x in t.items()), flush=True)
            for n, x in t.items():
                ratios.setdefault((L, n), []).append(x / t["sdpa"])
    for (L, n), v in ratios.items():
        if n != "sdpa":
            print("L %d: %s / SDPA: median %.2fx over %d rounds" % (L, n, statistics.median(v),
                                                                    len(v)))


if __name__ == "__main__":
    main()
