#!/usr/bin/env python3
"""Eager NumPy APE and libape on the same shapes, in one run, with ratios.

Both sides time the same operation (B = 1, H heads, D, causal, float32, the seed's parameters).
Before timing, the NumPy version is checked against libape's float64 reference through ape-run on
a small input, so the baseline is known to compute the same thing.

usage: bench/side_by_side.py [--build build] [--backend opencl] [-L 1024 4096 16384]
                             [--numpy-max-L 4096] [--repeats 3]
NumPy is slow: lengths above --numpy-max-L are not run in NumPy; their ratio uses NumPy's time
extrapolated quadratically from its largest measured length, and is marked as such.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ape_numpy import ape_attention  # noqa: E402

DELTA = 2.0 ** (-4.0 / 3.0)


def check_numpy_against_reference(build):
    """Runs a small problem through NumPy and through ape-run --backend ref; returns max error."""
    rng = np.random.default_rng(1)
    H, L, D = 2, 97, 16
    q = rng.standard_normal((H, L, D), dtype=np.float32)
    k = rng.standard_normal((H, L, D), dtype=np.float32)
    v = rng.standard_normal((H, L, D), dtype=np.float32)
    o_np, lse_np = ape_attention(q, k, v, DELTA, DELTA / 10, DELTA / 10, 0.1)
    with tempfile.TemporaryDirectory() as d:
        for name, t in (("q", q), ("k", k), ("v", v)):
            np.save(os.path.join(d, name + ".npy"), t)
        subprocess.run([os.path.join(build, "bin", "ape-run"), "--backend", "ref",
                        "-q", os.path.join(d, "q.npy"), "-k", os.path.join(d, "k.npy"),
                        "-v", os.path.join(d, "v.npy"), "-o", os.path.join(d, "o.npy"),
                        "--lse", os.path.join(d, "lse.npy")], check=True)
        o_ref = np.load(os.path.join(d, "o.npy"))
        lse_ref = np.load(os.path.join(d, "lse.npy"))
    return float(np.abs(o_np - o_ref).max()), float(np.abs(lse_np - lse_ref).max())


def numpy_time(L, H, D, repeats):
    rng = np.random.default_rng()
    q = rng.standard_normal((H, L, D), dtype=np.float32)
    k = rng.standard_normal((H, L, D), dtype=np.float32)
    v = rng.standard_normal((H, L, D), dtype=np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ape_attention(q, k, v, DELTA, DELTA / 10, DELTA / 10, 0.1)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("-L", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("-H", type=int, default=6)
    ap.add_argument("-D", type=int, default=64)
    ap.add_argument("--numpy-max-L", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    err_o, err_lse = check_numpy_against_reference(args.build)
    print(f"NumPy baseline vs libape reference (H=2, L=97, D=16): max |dO| = {err_o:.2e}, "
          f"max |dLSE| = {err_lse:.2e}")
    if err_o > 1e-3 or err_lse > 1e-3:
        sys.exit("the NumPy baseline does not compute APE: refusing to compare")

    cmd = [os.path.join(args.build, "bin", "ape-bench"), "--backend", args.backend, "--json",
           "-H", str(args.H), "-D", str(args.D), "-L", ",".join(map(str, args.L)),
           "--repeats", str(args.repeats)]
    bench = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    np_times = {}
    for L in sorted(set(args.L)):
        if L <= args.numpy_max_L:
            np_times[L] = (numpy_time(L, args.H, args.D, 1 if L > 2048 else args.repeats), False)
    if not np_times:
        sys.exit("no length at or below --numpy-max-L")
    Lmax = max(np_times)
    for L in args.L:
        if L not in np_times:
            np_times[L] = (np_times[Lmax][0] * (L / Lmax) ** 2, True)

    dev = bench["device"]
    print(f"libape: {dev['backend']}:{dev['index']} {dev['name']}; B=1 H={args.H} D={args.D} "
          f"causal f32, seed parameters")
    print(f"{'L':>7} {'skip_tol':>9} {'numpy_ms':>11} {'libape_ms':>10} {'speedup':>9} "
          f"{'Mpairs/s':>9} {'computed':>9} {'err_O':>9}")
    for r in bench["results"]:
        t_np, extrap = np_times[r["L"]]
        speed = t_np * 1e3 / r["median_ms"]
        mark = "*" if extrap else " "
        print(f"{r['L']:>7} {r['skip_tol']:>9.3g} {t_np*1e3:>10.0f}{mark} {r['median_ms']:>10.2f} "
              f"{speed:>8.1f}x {r['pairs_per_s']/1e6:>9.1f} "
              f"{100*r['pairs_computed']/r['pairs_visible']:>8.2f}% {r['max_err_o']:>9.2e}")
    if any(e for _, e in np_times.values()):
        print("* NumPy time extrapolated as L^2 from its largest measured length "
              f"({Lmax}); not measured")


if __name__ == "__main__":
    main()
