"""The survey's positional encodings side by side on libape's fused kernels (docs/ape.md, "The
survey's encodings"): plain RoPE, ALiBi, T5's relative buckets, the Gaussian mask of "dynamic
mask calibration" exp(-lambda (i - j)^2), and APE with the seed's values, compared on one input
by attention entropy and mean attention distance against sequence length.

    python encodings.py [--max-len 512] [--device ref] [--save-tables DIR]

Each encoding is a set of libape's parameters: ALiBi a per-head linear decay (delta), T5's buckets
and the Gaussian mask distance-bias tables (bias_table: T5's expanded once from its buckets, the
mask as -lambda n^2 in the scores, which is exp(-lambda n^2) on the weights), APE its four
parameters. ALiBi and T5 rotate nothing (the survey's W(n) = I): rope_scale = 1e30 turns every
rotation angle n / rope_scale below floating-point resolution; the Gaussian mask calibrates RoPE
attention. Every figure comes from libape.attention_diagnostics(), the call ape-curve makes
(ape_attention_forward_diag()): the entropy -sum P ln P and mean distance sum P |n| of every row,
in the same pass as the attention. Inputs are random N(0,1) Q, K, V (each length the first L rows
of the longest), as ape-curve draws them. --save-tables DIR writes the two tables and ALiBi's as
.npy files and prints the ape-curve command that draws the same encodings' curves (per head, on
ape-curve's own random inputs). A few seconds on the reference device.
"""
import argparse
import math
import os

import numpy as np

import libape

T5_BUCKETS, T5_MAX_DISTANCE = 32, 128
#: rope_scale giving no rotation: every angle n / rope_scale below floating-point resolution
NO_ROTATION = 1e30


def alibi_slopes(H):
    """ALiBi's per-head slopes 2^(-8 h / H), h = 1..H."""
    return [2.0 ** (-8.0 * h / H) for h in range(1, H + 1)]


def t5_bucket(n, num_buckets=T5_BUCKETS, max_distance=T5_MAX_DISTANCE):
    """T5's causal relative-position bucket of distance n >= 0: exact below num_buckets / 2,
    then logarithmic up to max_distance, the last bucket beyond."""
    exact = num_buckets // 2
    n = np.asarray(n)
    far = exact + (np.log(np.maximum(n, 1) / exact) / math.log(max_distance / exact) *
                   (num_buckets - exact)).astype(np.int64)
    return np.where(n < exact, n, np.minimum(far, num_buckets - 1))


def t5_table(H, M):
    """T5's bias expanded once into a table [H, M]: every distance takes its bucket's value.
    The values stand in for learned ones: each head falls linearly over the buckets, at its
    own rate. M covers max_distance: the last entry serves every longer distance, as T5's last
    bucket does."""
    b = t5_bucket(np.arange(M))
    return np.stack([-0.25 * (h + 1) / H * b for h in range(H)]).astype(np.float32)


def gauss_table(M, lam):
    """The Gaussian mask exp(-lambda n^2) on the weights is -lambda n^2 in the scores: one row
    shared by every head, covering every distance the input has."""
    return (-lam * np.arange(M, dtype=np.float64) ** 2)[None].astype(np.float32)


def encodings(H, max_len, lam):
    """Each encoding as libape's parameters: name -> keyword arguments of libape.attention."""
    none = dict(delta=0.0, beta=0.0, gamma=0.0, lam=0.0)
    return {
        "rope": dict(none),
        "alibi": dict(none, delta=alibi_slopes(H), rope_scale=NO_ROTATION),
        "t5": dict(none, bias_table=t5_table(H, T5_MAX_DISTANCE + 1), rope_scale=NO_ROTATION),
        "gauss": dict(none, bias_table=gauss_table(max_len, lam)),
        "ape": dict(delta=libape.SEED_DELTA, beta=libape.SEED_BETA, gamma=libape.SEED_GAMMA,
                    lam=libape.SEED_LAMBDA),
    }


def table_device():
    """The most preferred device that computes distance-bias tables."""
    for d in libape.devices():
        if "bias_table" in d["capabilities"]:
            return d["spec"]
    raise SystemExit("no device here computes distance-bias tables (libape.devices())")


def curve(sets, max_len, H, D, device, seed):
    """(name, L, mean entropy, last row's entropy, mean distance) per encoding and length,
    averaged over the heads."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, H, max_len, D)).astype(np.float32) for _ in range(3))
    lengths = [64 * 2 ** i for i in range(int(math.log2(max_len / 64)) + 1)]
    rows = []
    for name, prm in sets.items():
        for L in lengths:
            _, _, ent, md = libape.attention_diagnostics(q[:, :, :L], k[:, :, :L], v[:, :, :L],
                                                         device=device, **prm)
            rows.append((name, L, ent[0].mean(), ent[0, :, -1].mean(), md[0].mean()))
    return rows


def save_tables(folder, H, max_len, lam):
    """The tables as .npy files, and the ape-curve command drawing the same curves."""
    os.makedirs(folder, exist_ok=True)
    files = {"t5": t5_table(H, T5_MAX_DISTANCE + 1), "gauss": gauss_table(max_len, lam),
             "alibi": -np.outer(alibi_slopes(H), np.arange(max_len)).astype(np.float32)}
    for name, t in files.items():
        np.save(os.path.join(folder, name + ".npy"), t)
    lengths = ",".join(str(64 * 2 ** i) for i in range(int(math.log2(max_len / 64)) + 1))
    print("the same encodings through ape-curve (per head, its own random inputs; ALiBi as a "
          "table of its slopes):")
    print("  ape-curve -H %d -L %s --rope-scale %g -b %s -b %s" % (
        H, lengths, NO_ROTATION, *(os.path.join(folder, n + ".npy") for n in ("alibi", "t5"))))
    print("  ape-curve -H %d -L %s -b %s -p rope -p ape" % (
        H, lengths, os.path.join(folder, "gauss.npy")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-len", type=int, default=512, help="longest length, a power of 2 "
                    ">= 64 (default 512)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--gauss-lambda", type=float, default=1.0 / 2048,
                    help="lambda of the Gaussian mask (default 1/2048: a width of 32 tokens)")
    ap.add_argument("--device", default=None, help="default: the most preferred device that "
                    "computes distance-bias tables")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-tables", metavar="DIR")
    a = ap.parse_args()
    if a.max_len < 64 or a.max_len & (a.max_len - 1):
        ap.error("--max-len %d: must be a power of 2, >= 64" % a.max_len)
    device = a.device or table_device()
    sets = encodings(a.heads, a.max_len, a.gauss_lambda)
    rows = curve(sets, a.max_len, a.heads, a.dim, device, a.seed)
    print("attention entropy (nats) and distance (tokens) against length, %d heads, D = %d, "
          "on %s; ln L: uniform attention" % (a.heads, a.dim, device))
    print("%-6s %6s %9s %9s %9s %7s" % ("enc", "L", "ent_mean", "ent_last", "md_mean", "ln L"))
    for name, L, em, el, md in rows:
        print("%-6s %6d %9.4f %9.4f %9.2f %7.3f" % (name, L, em, el, md, math.log(L)))
    if a.save_tables:
        save_tables(a.save_tables, a.heads, a.max_len, a.gauss_lambda)


if __name__ == "__main__":
    main()
