#!/usr/bin/env python3
"""APE attention written the way a user would without libape: eager NumPy, float32, blocked over
query rows so the [rows, Lk, D/2] angle tensors fit in memory. The baseline of bench/RESULTS.md.

Usage as a script: ape_numpy.py -L 1024 [-H 6 -D 64 --block 64 --repeats 1 --json]
"""
import argparse
import json
import math
import sys
import time

import numpy as np


def ape_attention(q, k, v, delta, beta, gamma, lam, rope_base=10000.0, scale=None, causal=True,
                  q_start=None, k_start=0, block=32):
    """q: [H, Lq, D], k and v: [Hkv, Lk, D] float32; half rope layout. Returns O [H, Lq, D], LSE."""
    H, Lq, D = q.shape
    Hkv, Lk, _ = k.shape
    P = D // 2
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q_start is None:
        q_start = k_start + Lk - Lq
    omega = (rope_base ** (-2.0 * np.arange(P) / D)).astype(np.float32)
    pos_k = k_start + np.arange(Lk)
    out = np.empty_like(q)
    lse = np.empty((H, Lq), dtype=np.float32)
    for h in range(H):
        kh = h // (H // Hkv)
        for i0 in range(0, Lq, block):
            qb = q[h, i0:i0 + block]
            # keys a causal block can see: none after the block's last query position
            kend = Lk if not causal else int(np.clip(q_start + i0 + qb.shape[0] - k_start, 0, Lk))
            u, w = k[kh, :kend, :P], k[kh, :kend, P:]
            x, y = qb[:, :P], qb[:, P:]
            sigma = qb.std(axis=-1, ddof=1)
            alpha = 1.0 + lam * (1.0 / (1.0 + np.exp(sigma)))
            n = (q_start + i0 + np.arange(qb.shape[0]))[:, None] - pos_k[None, :kend]
            an = np.abs(n).astype(np.float32)
            theta = n[:, :, None].astype(np.float32) * omega / alpha[:, None, None].astype(np.float32)
            a = x[:, None, :] * u[None, :, :] + y[:, None, :] * w[None, :, :]
            b = x[:, None, :] * w[None, :, :] - y[:, None, :] * u[None, :, :]
            dot = (a * np.cos(theta) + b * np.sin(theta)).sum(-1)
            s = dot * scale / (1.0 + lam * an) - delta * an - beta * np.log1p(an) - gamma * np.sqrt(an)
            if causal:
                s = np.where(n >= 0, s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            den = p.sum(-1, keepdims=True)
            out[h, i0:i0 + block] = (p @ v[kh, :kend]) / np.where(den > 0, den, 1.0)
            lse[h, i0:i0 + block] = (m + np.log(den))[:, 0]
    return out, lse


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-L", type=int, nargs="+", default=[1024])
    ap.add_argument("-H", type=int, default=6)
    ap.add_argument("-D", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    delta = 2.0 ** (-4.0 / 3.0)
    rng = np.random.default_rng()
    results = []
    for L in args.L:
        q = rng.standard_normal((args.H, L, args.D), dtype=np.float32)
        k = rng.standard_normal((args.H, L, args.D), dtype=np.float32)
        v = rng.standard_normal((args.H, L, args.D), dtype=np.float32)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ape_attention(q, k, v, delta, delta / 10, delta / 10, 0.1, block=args.block)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        pairs = args.H * L * (L + 1) // 2
        results.append({"L": L, "median_s": t, "pairs_visible": pairs, "pairs_per_s": pairs / t})
    if args.json:
        json.dump({"impl": "numpy-eager", "numpy": np.__version__, "results": results}, sys.stdout)
        print()
    else:
        for r in results:
            print(f"numpy L={r['L']}: {r['median_s']*1e3:.1f} ms, {r['pairs_per_s']/1e6:.2f} M pairs/s")


if __name__ == "__main__":
    main()
