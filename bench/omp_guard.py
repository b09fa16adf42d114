#!/usr/bin/env python3
"""PyTorch's spinning OpenMP threads against a libape call, and libape.torch's guard (issue 28).

In one process, rounds alternating three modes: "spin" (torch on --threads threads, the guard
off: libgomp's workers busy-wait after each torch op), "guard" (the same with
libape.torch.omp_guard() on) and "alone" (torch on one thread: no worker to spin, the call as
it runs alone). Each mode times libape.torch's backward (loss.backward() of one
libape.torch.attention call, B = 1, H = 6, D = 64, f32, causal, the seed's parameters, every
gradient), which starts right after torch's own ops on the loss; the median of --repeats calls
per round, then the median over rounds of each mode's ratio to "alone" (the issue's target: a
call beside spinning threads at most 1.1x the call alone).

Then what the guard costs PyTorch's own ops (no libape call in the loop): a chain of
elementwise ops, a reduction and a 64x512x512 matmul, guard off and on alternating.

usage: build/venv/bin/python bench/omp_guard.py [-L 1024] [--rounds 5] [--repeats 7]
       [--threads 2]
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
    ap.add_argument("-L", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(ROOT, "build", "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    import libape
    import libape.torch as apet

    H, D, L = 6, 64, args.L
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
    prm = [torch.tensor(x, requires_grad=True) for x in
           (libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA, libape.SEED_LAMBDA)]

    def backward_ms():
        o = apet.attention(q, k, v, delta=prm[0], beta=prm[1], gamma=prm[2], lam=prm[3])
        loss = o.square().sum()
        t0 = time.perf_counter()
        loss.backward()
        return (time.perf_counter() - t0) * 1e3

    torch.set_num_threads(args.threads)
    backward_ms()
    why = apet._omp_guard_wanted()
    print("torch %s, %d threads; the guard %s" % (
        torch.__version__, args.threads, "can run here" if why is None else "is off: " + why))
    modes = ("spin", "guard", "alone")
    ratios = {m: [] for m in modes}
    for r in range(args.rounds):
        t = {}
        for mode in modes:
            torch.set_num_threads(1 if mode == "alone" else args.threads)
            apet.omp_guard(mode == "guard")
            backward_ms()
            t[mode] = statistics.median(backward_ms() for _ in range(args.repeats))
        for m in modes:
            ratios[m].append(t[m] / t["alone"])
        print("round %d, L %d: " % (r, L) + ", ".join("%s %.1f ms" % kv for kv in t.items()),
              flush=True)
    for m in ("spin", "guard"):
        print("libape backward, %s / alone: median %.2fx over %d rounds" % (
            m, statistics.median(ratios[m]), args.rounds))

    torch.set_num_threads(args.threads)
    x = torch.randn(1 << 18)
    w = torch.randn(512, 512)
    a = torch.randn(64, 512)

    def torch_ms():
        t0 = time.perf_counter()
        for _ in range(50):
            (x * 1.5 + 0.5).relu().sum()
            a @ w
        return (time.perf_counter() - t0) / 50 * 1e3

    res = {False: [], True: []}
    for r in range(args.rounds):
        for on in (False, True):
            apet.omp_guard(on)
            torch_ms()
            res[on].append(statistics.median(torch_ms() for _ in range(args.repeats)))
    for on in (False, True):
        print("PyTorch alone, guard %s: %.3f ms per iteration (median of %d rounds)" % (
            "on " if on else "off", statistics.median(res[on]), args.rounds))
    apet.omp_guard(False)


if __name__ == "__main__":
    main()
