"""The seed's entropy curve (docs/diagnostics.md): attention entropy and mean attention
distance against sequence length, for plain RoPE, an ALiBi-like linear bias and APE with the
seed's values, on random N(0,1) inputs (or, for a real model, on its captured Q, K, V).

    python entropy_curve.py [--max-len 4096] [--device auto] [--out curve.png]

Draws the curve with matplotlib when it is installed, else prints it as a table. The same
figures, faster and as CSV or JSON: `ape-curve` (tools/ape-curve.c).
"""
import argparse
import math

import numpy as np

import libape

SETS = {
    "rope": dict(delta=0.0, beta=0.0, gamma=0.0, lam=0.0),
    "alibi": dict(delta=libape.SEED_DELTA, beta=0.0, gamma=0.0, lam=0.0),
    "ape": dict(delta=libape.SEED_DELTA, beta=libape.SEED_BETA, gamma=libape.SEED_GAMMA,
                lam=libape.SEED_LAMBDA),
}


def curve(max_len, heads, dim, device, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, heads, max_len, dim)).astype(np.float32)
               for _ in range(3))
    lengths = [64 * 2 ** i for i in range(int(math.log2(max_len / 64)) + 1)]
    rows = []
    for name, prm in SETS.items():
        for L in lengths:
            _, _, ent, md = libape.attention_diagnostics(q[:, :, :L], k[:, :, :L], v[:, :, :L],
                                                         device=device, **prm)
            rows.append((name, L, ent[0].mean(), ent[0, :, -1].mean(), md[0].mean()))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="entropy_curve.png")
    a = ap.parse_args()
    rows = curve(a.max_len, a.heads, a.dim, a.device, a.seed)
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("%-6s %7s %9s %9s %9s" % ("set", "L", "ent_mean", "ent_last", "md_mean"))
        for r in rows:
            print("%-6s %7d %9.4f %9.4f %9.2f" % r)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in SETS:
        pts = [r for r in rows if r[0] == name]
        ax1.plot([r[1] for r in pts], [r[2] for r in pts], "o-", label=name)
        ax2.plot([r[1] for r in pts], [r[4] for r in pts], "o-", label=name)
    for ax, what in ((ax1, "mean entropy (nats)"), (ax2, "mean attention distance (tokens)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(what)
        ax.legend()
    ax2.set_yscale("log")
    fig.tight_layout()
    fig.savefig(a.out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
