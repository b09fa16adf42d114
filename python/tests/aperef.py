"""APE attention in float64 NumPy, straight from the spec, for small test cases (no blocking):
the package's results are compared with it."""
import math

import numpy as np


def ape64(q, k, v, delta, beta, gamma, lam, causal=True, scale=None, rope_base=10000.0,
          layout="half", q_start=None, k_start=0, diag=False, positions_q=None,
          positions_k=None, rope_scale=1.0, bias_table=None):
    """q [B,H,Lq,D], k, v [B,Hkv,Lk,D]; parameters floats or per-head sequences; bias_table
    None or [H, M] / [1, M]: T[h][min(|n|, M - 1)] added to every score.
    Returns O [B,H,Lq,D] and LSE [B,H,Lq] in float64; with diag=True also the entropy
    -sum P ln P and the mean distance sum P |n| of every row [B,H,Lq] (0 with no visible key)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    P = D // 2
    prm = [np.broadcast_to(np.asarray(x, dtype=np.float64), (H,)) for x in (delta, beta, gamma, lam)]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q_start is None:
        q_start = k_start + Lk - Lq
    if layout == "half":
        ia, ib = np.arange(P), np.arange(P) + P
    else:
        ia, ib = 2 * np.arange(P), 2 * np.arange(P) + 1
    omega = rope_base ** (-2.0 * np.arange(P) / D)
    pq = q_start + np.arange(Lq) if positions_q is None else np.asarray(positions_q, np.int64)
    pk = k_start + np.arange(Lk) if positions_k is None else np.asarray(positions_k, np.int64)
    n = pq[:, None] - pk[None, :]
    an = np.abs(n).astype(np.float64)
    if bias_table is not None:
        tab = np.asarray(bias_table, dtype=np.float64)
        tab = np.broadcast_to(tab, (H, tab.shape[1]))
        tix = np.minimum(np.abs(n), tab.shape[1] - 1)
    o = np.zeros((B, H, Lq, D))
    lse = np.full((B, H, Lq), -np.inf)
    ent, md = np.zeros((B, H, Lq)), np.zeros((B, H, Lq))
    for b in range(B):
        for h in range(H):
            dl, bt, gm, lm = (p[h] for p in prm)
            kh = h // (H // Hkv)
            qq, kk, vv = q[b, h], k[b, kh], v[b, kh]
            sigma = qq.std(axis=-1, ddof=1)
            alpha = 1.0 + lm / (1.0 + np.exp(sigma))
            # position interpolation: the rotation at n / rope_scale, bias and temperature at n
            theta = (n / rope_scale)[:, :, None] * omega[None, None, :] / alpha[:, None, None]
            x, y = qq[:, ia][:, None, :], qq[:, ib][:, None, :]
            u, w = kk[:, ia][None, :, :], kk[:, ib][None, :, :]
            dot = ((x * u + y * w) * np.cos(theta) + (x * w - y * u) * np.sin(theta)).sum(-1)
            s = dot * scale / (1.0 + lm * an) - dl * an - bt * np.log1p(an) - gm * np.sqrt(an)
            if bias_table is not None:
                s = s + tab[h][tix]
            if causal:
                s = np.where(n >= 0, s, -np.inf)
            for i in range(Lq):
                row = s[i]
                if not np.isfinite(row).any():
                    continue
                m = row[np.isfinite(row)].max()
                p = np.exp(row - m)
                o[b, h, i] = p @ vv / p.sum()
                lse[b, h, i] = m + math.log(p.sum())
                pn = p / p.sum()
                ent[b, h, i] = -(pn[pn > 0] * np.log(pn[pn > 0])).sum()
                md[b, h, i] = (pn * an[i]).sum()
    return (o, lse, ent, md) if diag else (o, lse)
