#!/usr/bin/env python3
"""Decode through the KV cache against PyTorch SDPA, in one process, interleaved (issues 16, 26).

One query (B = 1, H = 6, D = 64, float32) against Lk keys held in a libape.KVCache, and
PyTorch's scaled_dot_product_attention on the same keys rotated once (as a cache holds them);
the two timed in alternation, --rounds rounds of --repeats calls each, so that load on the
machine falls on both alike. Prints each round's medians, the median of the per-round ratios
libape / SDPA, and the fastest call of each (on a loaded machine the fastest calls are the
nearest to what a quiet one gives).

libape runs plain RoPE attention (all four parameters 0, skip_tol 0: the same operation as
SDPA's, checked against it), or with --decay the seed's APE (delta 2^(-4/3), beta = gamma =
delta / 10, lambda 0.1, the default skip_tol: issue 26's decode under decay, checked against
libape's reference backend on the same keys) against SDPA's plain decode. --Lk takes a list:
each length is its own cache and its own rounds, in one process.

usage: build/venv/bin/python bench/kv_decode.py [--build build] [--Lk 32768[,N...]]
       [--rounds 5] [--repeats 9] [--threads N] [--dtype float32] [--alternate N] [--decay]
LIBAPE_LIBRARY, when set, names the libape shared library to load (an A/B of two builds).
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def call_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn, repeats, mins, i):
    """Median of `repeats` timed calls (after one untimed); the fastest lowers mins[i]."""
    fn()
    t = [call_ms(fn) for _ in range(repeats)]
    mins[i] = min(mins[i], min(t))
    return statistics.median(t)


def alternate(sdpa, att, args, err):
    """--alternate: single calls in turn; percentiles of each and of the per-pair ratio."""
    ts, tl = [], []
    for _ in range(3):  # warm-up pairs, not counted
        sdpa()
        att()
    for _ in range(args.alternate):
        ts.append(call_ms(sdpa))
        tl.append(call_ms(att))

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    for name, t in (("sdpa", ts), ("libape", tl)):
        print("%-6s p10 %.2f  p25 %.2f  p50 %.2f  p75 %.2f  p90 %.2f ms" % (
            (name,) + tuple(pct(t, q) for q in (0.1, 0.25, 0.5, 0.75, 0.9))))
    r = [b / a for a, b in zip(ts, tl)]
    print("alternating calls: median ratio libape / SDPA %.2fx (p25 %.2f, p75 %.2f; %d pairs, "
          "%s, Lk %d, %s cache, %d threads, OMP_WAIT_POLICY=%s, max |diff| %.1e)" % (
              pct(r, 0.5), pct(r, 0.25), pct(r, 0.75), args.alternate,
              os.environ["LIBAPE_LIBRARY"], args.Lk, args.dtype, args.threads,
              os.environ.get("OMP_WAIT_POLICY", "(unset)"), err))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--Lk", default="32768", help="key lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                    help="the cache's storage type (SDPA keeps float32: the same inputs)")
    ap.add_argument("--alternate", type=int, default=0, metavar="N",
                    help="instead of rounds: N pairs of single calls, SDPA then libape, each "
                         "right after the other (as in a model where PyTorch ops and libape "
                         "take turns); prints percentiles of each")
    ap.add_argument("--decay", action="store_true",
                    help="libape with the seed's decay and skipping (SDPA stays plain)")
    args = ap.parse_args()
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(args.build, "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, HERE)
    import numpy as np
    import torch
    import libape
    from torch_ape import rope_rotate

    torch.set_num_threads(args.threads)
    for Lk in [int(x) for x in args.Lk.split(",")]:
        args.Lk = Lk
        one_length(args, np, torch, libape, rope_rotate)


def one_length(args, np, torch, libape, rope_rotate):
    H, D, Lk = 6, 64, args.Lk
    g = torch.Generator().manual_seed(Lk)
    k, v = (torch.randn(1, H, Lk, D, generator=g) for _ in range(2))
    q1 = torch.randn(1, H, 1, D, generator=g)
    kr = rope_rotate(k, torch.arange(Lk))
    qr = rope_rotate(q1, torch.tensor([Lk - 1]))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qr, kr, v)  # noqa: E731
    prm = {} if args.decay else dict(delta=0.0, beta=0.0, gamma=0.0, lam=0.0, skip_tol=0.0)
    with libape.KVCache(B=1, Hkv=H, D=D, capacity_tokens=Lk, device=args.device,
                        dtype=args.dtype) as cache:
        cache.append(k.numpy().astype(args.dtype), v.numpy().astype(args.dtype))
        qn = q1.numpy().astype(args.dtype)
        att = lambda: cache.attend(qn, **prm)  # noqa: E731
        if args.decay:  # the seed's APE on the reference backend, every key
            want = libape.attention(qn, k.numpy().astype(args.dtype),
                                    v.numpy().astype(args.dtype), skip_tol=0.0, device="ref")
        else:
            want = sdpa().numpy()
        err = np.abs(att() - want).max()
        assert err < (1e-4 if args.dtype == "float32" else 5e-2), \
            "decode: libape vs %s differ by %g" % ("the reference" if args.decay else "SDPA", err)
        if args.alternate:
            alternate(sdpa, att, args, err)
            return
        ratios, mins, tls = [], [float("inf"), float("inf")], []
        for r in range(args.rounds):
            ts = median_ms(sdpa, args.repeats, mins, 0)
            tl = median_ms(att, args.repeats, mins, 1)
            ratios.append(tl / ts)
            tls.append(tl)
            print("Lk %d round %d: sdpa %.3f ms  libape %.3f ms  ratio %.3f" % (
                Lk, r, ts, tl, tl / ts))
    print("median ratio libape%s / SDPA: %.3fx; libape median %.3f ms; fastest calls: sdpa "
          "%.3f ms, libape %.3f ms, ratio %.3fx (%s, Lk %d, %s cache, %d threads, max |diff| "
          "%.1e)" % (
              " with decay" if args.decay else "", statistics.median(ratios),
              statistics.median(tls), mins[0], mins[1], mins[1] / mins[0],
              os.environ["LIBAPE_LIBRARY"], Lk, args.dtype, args.threads, err))

if __name__ == "__main__":
    main()
