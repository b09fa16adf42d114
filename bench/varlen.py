#!/usr/bin/env python3
"""Ragged batches (issue 25): one libape.attention_varlen call against what a CPU user does
today, side by side in one run, in alternating rounds.

Cases (H = 6, D = 64, float32, causal, plain RoPE unless said):
  packed32   32 sequences, lengths drawn from 64..2048: one attention_varlen call, against
             PyTorch SDPA once per sequence (on RoPE-rotated inputs, the rotation not timed)
             and against libape.attention once per sequence;
  tiny4096   4096 sequences of 16 tokens in one call, against one dense libape call of about
             the same visible pairs (one sequence of L with L(L+1)/2 = 4096 * 136): pairs/s;
  decay      the seed's decay with skipping: packed calls of the same total tokens, one of
             short sequences and one of a few long ones (their cost grows with total tokens,
             not with the longest sequence's square, when skipping proves far keys negligible);
  train32    packed32's batch forward and backward (dq, dk, dv) through
             libape.torch.attention_varlen, against SDPA forward and backward once per
             sequence and libape.torch.attention once per sequence;
  tinytrain  tiny4096's batch forward and backward, against one dense libape.torch.attention
             forward and backward of about the same visible pairs: pairs/s.
Every result is checked against the per-sequence calls first.

usage: bench/varlen.py [--build build] [--device opencl] [--repeats 3] [--quick]
                       [--cases packed32,tiny4096,decay,train32,tinytrain]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import ensure_venv, SEED, ZERO  # noqa: E402


def ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def alternate(fns, repeats):
    """Medians of `repeats` alternating rounds of each fn (one warm-up round first)."""
    for f in fns:
        f()
    t = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t[i].append(ms(f))
    return [statistics.median(x) for x in t]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--venv", default=os.path.join(ROOT, "build", "venv"))
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    ap.add_argument("--cases", default="packed32,tiny4096,decay,train32,tinytrain",
                    help="comma-separated cases to run (see above)")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    ensure_venv(os.path.abspath(args.venv))
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(args.build, "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import torch
    import libape
    from torch_ape import rope_rotate

    torch.set_num_threads(args.threads)
    H, D, dev = 6, 64, args.device
    rng = np.random.default_rng(25)
    S, lo, hi = (8, 32, 256) if args.quick else (32, 64, 2048)

    def packed(lens):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        q, k, v = (rng.standard_normal((cu[-1], H, D)).astype(np.float32) for _ in range(3))
        return q, k, v, cu

    def var(q, k, v, cu, p, skip):
        return libape.attention_varlen(q, k, v, cu, cu, skip_tol=2.0 ** -24 if skip else 0.0,
                                       device=dev, **p)

    def dense_each(q, k, v, cu, p, skip):
        out = np.empty_like(q)
        for s in range(len(cu) - 1):
            a, b = cu[s], cu[s + 1]
            out[a:b] = libape.attention(
                q[None, a:b].transpose(0, 2, 1, 3), k[None, a:b].transpose(0, 2, 1, 3),
                v[None, a:b].transpose(0, 2, 1, 3), skip_tol=2.0 ** -24 if skip else 0.0,
                device=dev, **p)[0].transpose(1, 0, 2)
        return out

    print("machine: %s, %d threads for PyTorch %s; libape on %s; median of %d alternating "
          "rounds" % (open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
                      .strip(": \t"), args.threads, torch.__version__, dev, args.repeats))

    print("| case | what | libape varlen | SDPA per sequence | libape dense per sequence | "
          "varlen / SDPA | varlen / dense |")
    print("|---|---|---|---|---|---|---|")

    # ---- the packed batch of packed32 and train32
    lens = rng.integers(lo, hi + 1, S)
    q, k, v, cu = packed(lens)
    tq = [torch.from_numpy(x) for x in (q, k, v)]
    rot = []
    for s in range(S):
        a, b = cu[s], cu[s + 1]
        pos = torch.arange(b - a)
        qs, ks, vs = (x[a:b].permute(1, 0, 2)[None] for x in tq)
        rot.append((rope_rotate(qs, pos), rope_rotate(ks, pos), vs.contiguous()))
    train(args, cases, torch, libape, q, k, v, cu, lens, rot)
    if "packed32" in cases:
        packed32(args, torch, q, k, v, cu, lens, rot, var, dense_each)
    if "tiny4096" in cases or "tinytrain" in cases:
        tiny(args, cases, torch, libape, packed, var, rng)
    if "decay" in cases:
        decay(args, packed, var)


def packed32(args, torch, q, k, v, cu, lens, rot, var, dense_each):
    import numpy as np
    S = len(lens)

    def sdpa_each():
        return [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)
                for a, b, c in rot]

    want = dense_each(q, k, v, cu, ZERO, False)
    got = var(q, k, v, cu, ZERO, False)
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
    sd = sdpa_each()
    err = max(np.abs(got[cu[s]:cu[s + 1]] - sd[s][0].permute(1, 0, 2).numpy()).max()
              for s in range(S))
    assert err < 1e-4, err
    t_var, t_sdpa, t_dense = alternate([lambda: var(q, k, v, cu, ZERO, False), sdpa_each,
                                        lambda: dense_each(q, k, v, cu, ZERO, False)],
                                       args.repeats)
    print("| packed32 | %d sequences, %d tokens (lengths %d..%d), rope | %.1f ms | %.1f ms | "
          "%.1f ms | %.2fx | %.2fx |" % (S, cu[-1], lens.min(), lens.max(), t_var, t_sdpa,
                                         t_dense, t_var / t_sdpa, t_var / t_dense))



def tiny(args, cases, torch, libape, packed, var, rng):
    import numpy as np
    H, D, dev = 6, 64, args.device
    n, Lt = (512, 16) if args.quick else (4096, 16)
    q, k, v, cu = packed(np.full(n, Lt))
    pairs_var = n * Lt * (Lt + 1) // 2
    L1 = int((np.sqrt(8 * pairs_var + 1) - 1) / 2)
    q1, k1, v1 = (rng.standard_normal((1, H, L1, D)).astype(np.float32) for _ in range(3))
    pairs_one = L1 * (L1 + 1) // 2
    if "tinytrain" in cases:
        import libape.torch as lt
        tv = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        t1 = [torch.from_numpy(x).requires_grad_() for x in (q1, k1, v1)]
        cut = torch.from_numpy(cu)
        g = torch.randn(cu[-1], H, D)
        g1 = torch.randn(1, H, L1, D)

        def var_step():
            for x in tv:
                x.grad = None
            lt.attention_varlen(*tv, cut, cut, device=dev, skip_tol=0.0, **ZERO).backward(g)

        def one_step():
            for x in t1:
                x.grad = None
            lt.attention(*t1, device=dev, skip_tol=0.0, **ZERO).backward(g1)

        t_var, t_one = alternate([var_step, one_step], args.repeats)
        print("| tinytrain | %d x %d tokens fwd+bwd vs one dense L = %d fwd+bwd, rope | %.1f ms "
              "(%.1f Mpairs/s) | - | %.1f ms (%.1f Mpairs/s) | - | %.2f of dense pairs/s |"
              % (n, Lt, L1, t_var, H * pairs_var / t_var / 1e3, t_one,
                 H * pairs_one / t_one / 1e3, (pairs_var / t_var) / (pairs_one / t_one)))
    if "tiny4096" not in cases:
        return
    t_var, t_one = alternate([lambda: var(q, k, v, cu, ZERO, False),
                              lambda: libape.attention(q1, k1, v1, skip_tol=0.0, device=dev,
                                                       **ZERO)], args.repeats)
    print("| tiny%d | %d x %d tokens vs one dense L = %d, rope | %.1f ms (%.0f Mpairs/s) | - | "
          "%.1f ms (%.0f Mpairs/s) | - | %.2f of dense pairs/s |"
          % (n, n, Lt, L1, t_var, H * pairs_var / t_var / 1e3, t_one,
             H * pairs_one / t_one / 1e3, (pairs_var / t_var) / (pairs_one / t_one)))



def decay(args, packed, var):
    import numpy as np
    total = 4096 if args.quick else 16384
    for count in (64, 4):
        q, k, v, cu = packed(np.full(count, total // count))
        t_skip, t_dense = alternate([lambda: var(q, k, v, cu, SEED, True),
                                     lambda: var(q, k, v, cu, SEED, False)], args.repeats)
        print("| decay | %d x %d tokens, the seed's decay | %.1f ms skipping | - | %.1f ms "
              "without skipping | - | - |" % (count, total // count, t_skip, t_dense))


def train(args, cases, torch, libape, q, k, v, cu, lens, rot):
    """train32: forward and backward of the packed batch, dq, dk, dv, upstream gradient g."""
    if "train32" not in cases:
        return
    import libape.torch as lt
    dev, S = args.device, len(lens)
    tv = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
    cut = torch.from_numpy(cu)
    g = torch.randn(tv[0].shape)
    sd = [tuple(x.detach().clone().requires_grad_() for x in r) for r in rot]
    sg = [g[cu[s]:cu[s + 1]].permute(1, 0, 2)[None].contiguous() for s in range(S)]
    each = [tuple(x[None, cu[s]:cu[s + 1]].permute(0, 2, 1, 3).detach().clone()
                  .requires_grad_() for x in tv) for s in range(S)]

    def var_step():
        for x in tv:
            x.grad = None
        lt.attention_varlen(*tv, cut, cut, device=dev, skip_tol=0.0, **ZERO).backward(g)

    def sdpa_step():
        for s, (a, b, c) in enumerate(sd):
            a.grad = b.grad = c.grad = None
            torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True) \
                .backward(sg[s])

    def dense_step():
        for s, (a, b, c) in enumerate(each):
            a.grad = b.grad = c.grad = None
            lt.attention(a, b, c, device=dev, skip_tol=0.0, **ZERO).backward(sg[s])

    var_step()
    dense_step()
    for s in range(S):  # the gradients agree with the per-sequence calls
        for x, y in zip(tv, each[s]):
            got = x.grad[cu[s]:cu[s + 1]].permute(1, 0, 2)
            assert (got - y.grad[0]).abs().max() < 1e-3, (got - y.grad[0]).abs().max()
    t_var, t_sdpa, t_dense = alternate([var_step, sdpa_step, dense_step], args.repeats)
    print("| train32 | %d sequences, %d tokens (lengths %d..%d), rope, fwd+bwd (dq, dk, dv) | "
          "%.1f ms | %.1f ms | %.1f ms | %.2fx | %.2fx |"
          % (S, cu[-1], lens.min(), lens.max(), t_var, t_sdpa, t_dense, t_var / t_sdpa,
             t_var / t_dense))


if __name__ == "__main__":
    main()
