#!/usr/bin/env python3
"""Decode steps through the KV pool (libape.KVPool) against what a user has instead, side by
side in one process, in alternating rounds.

Cases (H = Hkv = 6, D = 64, float32, one query row per sequence at the end of its keys):
  batch     batched plain decode (no decay): --seqs sequences of lengths --min-len..--max-len
            (geometric steps; --spread even), all in one KVPool, one attend for all of them,
            against PyTorch SDPA called once per sequence on keys rotated once (as a cache
            holds them, kv_decode.py's way); with the K/V bytes a step reads
            (2 x keys x Hkv x D x 4) and the GB/s each achieves. The issue's case:
            64 sequences of 256..32768 (the default). With --membw auto, build/bench/membw
            reads as many bytes as the step (so that no more of them fit in the machine's
            last-level cache than of the step's) once in every round, and each round's step
            is given as a share of that round's bandwidth (target: 80%).
  decay     APE decode with the seed's decay and the default skip_tol, one sequence of Lk
            keys in a KVPool (--decay-Lk), against SDPA's plain decode over the same Lk.
            Targets: 0.1x SDPA at Lk = 32768; the pool's step at 131072 within 1.3x of its
            step at 4096 (the keys out of reach are never read).
  paged     the batch case's sequences in the caller's pages (libape.PagedKV: one NumPy
            array per K and V in vLLM's [num_pages, page_tokens, Hkv, D] layout ("NHD"), and
            the same pages as [num_pages, Hkv, page_tokens, D] ("HND"), pages in scrambled
            order, a CSR table; one plan, then runs) against the same step through KVPool
            and against SDPA once per sequence, the four alternating.
  single    one-sequence plain decode of --single-Lk keys through KVPool against
            libape.KVCache holding the same keys. Target: the pool at most 1.05x the cache.
Every result is checked first: plain decodes against SDPA (and the pool's single sequence
against the cache), decay decodes against libape's reference backend over every key
(skip_tol 0). Each contender is timed in rounds of --repeats calls (after one untimed call),
the contenders of a case taking turns round by round so that load on the machine falls on all
alike; the table gives the median of the rounds' medians, and the median of the per-round
ratios.

usage: build/venv/bin/python bench/pool_decode.py [--build build] [--device opencl]
       [--cases batch,decay,single,paged] [--seqs 64] [--max-len 32768] [--spread geometric]
       [--decay-Lk 4096,32768,131072] [--single-Lk 32768] [--page-tokens 16] [--rounds 5]
       [--repeats 5] [--membw GBPS|auto] [--quick]
The defaults are the issue's cases (about a minute on 2 cores; --quick: seconds).
LIBAPE_LIBRARY, when set, names the libape shared library to load (an A/B of two builds).
"""
import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers import SEED, ZERO  # noqa: E402

H, D = 6, 64
TOL = 1e-4  # float32, plain against SDPA and decay against the reference over every key


def call_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rounds(fns, nrounds, repeats, between=None):
    """Each fn's median of `repeats` calls (after one untimed), the fns taking turns, for
    `nrounds` rounds: per fn, the list of its round medians. `between`, if given, is called
    once in every round after the fns (a measurement that takes the same turns)."""
    med = [[] for _ in fns]
    for _ in range(nrounds):
        for i, f in enumerate(fns):
            f()
            med[i].append(statistics.median(call_ms(f) for _ in range(repeats)))
        if between:
            between()
    return med


def membw_gbps(build, nbytes, threads):
    """build/bench/membw's median GB/s for a read of nbytes (rounded up to whole MiB: the
    step's own size, so that the machine's last-level cache holds as much of it as of the
    step) with `threads` threads, 5 rounds."""
    exe = os.path.join(build, "bench", "membw")
    if not os.access(exe, os.X_OK):
        sys.exit("pool_decode.py: --membw auto needs %s (make bench-membw)" % exe)
    mib = max(1, -(-nbytes // 2 ** 20))
    out = subprocess.run([exe, str(mib), str(threads), "5"], check=True,
                         stdout=subprocess.PIPE, universal_newlines=True).stdout
    # "... median 13.95 ms (28.9 GB/s) [check ...]"
    return float(out.split("median", 1)[1].split("(", 1)[1].split(" GB/s", 1)[0])


def ratio(a, b):
    """The median of the per-round ratios a / b."""
    return statistics.median(x / y for x, y in zip(a, b))


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def lengths(n, lo, hi, even):
    """n lengths from lo to hi, ascending, as ape-bench --pool spreads them."""
    if n == 1:
        return [hi]
    out = []
    for i in range(n):
        f = i / (n - 1)
        x = round(lo + f * (hi - lo)) if even else round(lo * (hi / lo) ** f)
        out.append(min(hi, max(lo, x)))
    return out


class Ctx:
    """What every case uses: the modules, the options, the table's rows."""

    def __init__(self, args, np, torch, libape, rope_rotate):
        self.args, self.np, self.torch, self.libape = args, np, torch, libape
        self.rope_rotate = rope_rotate
        self.rows = []
        self.targets = []

    def gbps(self, nbytes, ms, membw=None):
        """GB/s of nbytes in ms, and its share of the read bandwidth (membw if given, else
        --membw's figure)."""
        bw = membw or (self.args.membw if self.args.membw != "auto" else 0)
        s = "%.2f" % (nbytes / ms / 1e6)
        if bw:
            s += " (%.0f%% of %.1f)" % (100 * nbytes / ms / 1e6 / bw, bw)
        return s

    def keys(self, n, seed):
        """Random K, V [n, H, D] (packed, float32) and the same as torch [1, H, n, D]: K rotated
        at positions 0..n-1, V as is."""
        g = self.np.random.default_rng(seed)
        k, v = (g.standard_normal((n, H, D), dtype=self.np.float32) for _ in range(2))
        tk = self.torch.from_numpy(k).permute(1, 0, 2)[None]
        kr = self.rope_rotate(tk, self.torch.arange(n)).contiguous()
        vt = self.torch.from_numpy(v).permute(1, 0, 2)[None].contiguous()
        return k, v, kr, vt

    def kv_bytes(self, st):
        """K/V bytes a step read: 2 x keys computed x Hkv x D x 4 (pairs count every query head;
        here H = Hkv)."""
        return 2 * st["pairs_computed"] * D * 4


def case_batch(c):
    a, np, torch, libape = c.args, c.np, c.torch, c.libape
    lens = lengths(a.seqs, min(a.min_len, a.max_len), a.max_len, a.spread == "even")
    total = sum(lens)
    pool = libape.KVPool(Hkv=H, D=D, H=H, capacity_tokens=total + a.page_tokens * len(lens),
                         page_tokens=a.page_tokens, device=a.device,
                         max_batch_tokens=max(256, len(lens)))
    g = np.random.default_rng(1)
    q = g.standard_normal((len(lens), H, D), dtype=np.float32)
    ids, peer = [], []
    for s, n in enumerate(lens):
        k, v, kr, vt = c.keys(n, 100 + s)
        ids.append(pool.add_sequence())
        pool.append(ids[-1], k, v)
        qr = c.rope_rotate(torch.from_numpy(q[s:s + 1]).permute(1, 0, 2)[None],
                           torch.tensor([n - 1]))
        peer.append((qr, kr, vt))
        del k, v
    cu = np.arange(len(lens) + 1, dtype=np.int64)

    def att(stats=False):
        return pool.attend(q, ids, cu, skip_tol=0.0, stats=stats, **ZERO)

    def sdpa_each():
        return [torch.nn.functional.scaled_dot_product_attention(x, y, z) for x, y, z in peer]

    got, st = att(stats=True)
    want = np.stack([o[0, :, 0].numpy() for o in sdpa_each()])
    err = float(np.abs(got - want).max())
    assert err < TOL, "batch: KVPool vs SDPA differ by %g" % err
    nbytes = c.kv_bytes(st)
    assert nbytes == 2 * total * H * D * 4, (nbytes, total)
    bw = []
    between = None
    if a.membw == "auto":
        def between():
            bw.append(membw_gbps(a.build, nbytes, a.threads))
    tp, ts = rounds([att, sdpa_each], a.rounds, a.repeats, between)
    mp, ms = statistics.median(tp), statistics.median(ts)
    membw = statistics.median(bw) if bw else None
    if membw:
        c.targets.append("batch: build/bench/membw over the step's %.0f MiB, in every round: "
                         "%s GB/s (median %.1f); the step's share of each round's: %s" % (
                             nbytes / 2 ** 20, ", ".join("%.1f" % x for x in bw), membw,
                             ", ".join("%.0f%%" % (100 * nbytes / t / 1e6 / x)
                                       for t, x in zip(tp, bw))))
    c.rows.append(("batch", "plain decode, %d sequences of %d..%d keys (%s), %d keys in all, "
                   "pages of %d" % (len(lens), lens[0], lens[-1], a.spread, total,
                                    a.page_tokens),
                   "KVPool, one attend", mp, "SDPA once per sequence", ms, ratio(tp, ts),
                   nbytes, c.gbps(nbytes, mp, membw), c.gbps(nbytes, ms, membw), "-", err))
    pool.close()


def case_decay(c):
    """Every Lk's pool is built first; then all steps and SDPA take turns in the same rounds, so
    that the flatness target (the step at 131072 keys over the step at 4096, the median of the
    per-round ratios) compares steps measured side by side, not in different minutes."""
    a, np, torch, libape = c.args, c.np, c.torch, c.libape
    lks = [int(x) for x in a.decay_Lk.split(",")]
    runs = []  # per Lk: (Lk, att, sdpa, stats, err)
    with contextlib.ExitStack() as stack:
        for Lk in lks:
            k, v, kr, vt = c.keys(Lk, Lk)
            q = np.random.default_rng(Lk + 1).standard_normal((1, H, D), dtype=np.float32)
            qr = c.rope_rotate(torch.from_numpy(q).permute(1, 0, 2)[None], torch.tensor([Lk - 1]))
            pool = stack.enter_context(libape.KVPool(
                Hkv=H, D=D, H=H, capacity_tokens=Lk + a.page_tokens, page_tokens=a.page_tokens,
                device=a.device))
            sid = pool.add_sequence()
            pool.append(sid, k, v)

            def att(stats=False, pool=pool, q=q, sid=sid):
                return pool.attend(q, [sid], [0, 1], stats=stats, **SEED)

            def sdpa(qr=qr, kr=kr, vt=vt):
                return torch.nn.functional.scaled_dot_product_attention(qr, kr, vt)

            got, st = att(stats=True)
            want = libape.attention(q[None].transpose(0, 2, 1, 3),
                                    k[None].transpose(0, 2, 1, 3),
                                    v[None].transpose(0, 2, 1, 3), skip_tol=0.0, device="ref",
                                    **SEED)[0].transpose(1, 0, 2)
            err = float(np.abs(got - want).max())
            assert err < TOL, "decay Lk %d: KVPool vs the reference differ by %g" % (Lk, err)
            del k, v
            runs.append((Lk, att, sdpa, st, err))
        fns = [f for r in runs for f in (r[1], r[2])]
        med = rounds(fns, a.rounds, a.repeats)
    steps = {}
    for i, (Lk, att, sdpa, st, err) in enumerate(runs):
        tp, ts = med[2 * i], med[2 * i + 1]
        mp, ms = statistics.median(tp), statistics.median(ts)
        r = ratio(tp, ts)
        steps[Lk] = tp
        nbytes, sdpa_bytes = c.kv_bytes(st), 2 * Lk * H * D * 4
        target = "-"
        if Lk == 32768:
            target = "<= 0.1x: %s" % ("met" if r <= 0.1 else "NOT met")
            c.targets.append("decay at Lk 32768: KVPool / SDPA %.3fx (target <= 0.1x): %s"
                             % (r, "met" if r <= 0.1 else "NOT met"))
        c.rows.append(("decay", "one sequence, Lk %d, the seed's decay (SDPA plain); %d of %d "
                       "keys read" % (Lk, st["pairs_computed"] // H, Lk),
                       "KVPool", mp, "SDPA", ms, r, nbytes, c.gbps(nbytes, mp),
                       c.gbps(sdpa_bytes, ms), target, err))
    if 4096 in steps and 131072 in steps:
        g = ratio(steps[131072], steps[4096])
        c.targets.append("decay: KVPool step at Lk 131072 / at 4096 %.2fx, the median of the "
                         "per-round ratios (target <= 1.3x): %s"
                         % (g, "met" if g <= 1.3 else "NOT met"))


def case_paged(c):
    a, np, torch, libape = c.args, c.np, c.torch, c.libape
    lens = lengths(a.seqs, min(a.min_len, a.max_len), a.max_len, a.spread == "even")
    total, P = sum(lens), a.page_tokens
    npg = [-(-n // P) for n in lens]
    N = sum(npg)
    order = np.random.default_rng(3).permutation(N)  # the caller's pages, scrambled
    kp = np.zeros((N, P, H, D), dtype=np.float32)
    vp = np.zeros((N, P, H, D), dtype=np.float32)
    pool = libape.KVPool(Hkv=H, D=D, H=H, capacity_tokens=total + P * len(lens),
                         page_tokens=P, device=a.device, max_batch_tokens=max(256, len(lens)))
    g = np.random.default_rng(1)
    q = g.standard_normal((len(lens), H, D), dtype=np.float32)
    ids, peer, indices, at = [], [], [], 0
    for s, n in enumerate(lens):
        k, v, kr, vt = c.keys(n, 100 + s)
        ids.append(pool.add_sequence())
        pool.append(ids[-1], k, v)
        pages = order[at:at + npg[s]]
        at += npg[s]
        indices.extend(int(x) for x in pages)
        pad = npg[s] * P - n
        kp[pages] = np.concatenate([k, np.zeros((pad, H, D), np.float32)]).reshape(-1, P, H, D)
        vp[pages] = np.concatenate([v, np.zeros((pad, H, D), np.float32)]).reshape(-1, P, H, D)
        qr = c.rope_rotate(torch.from_numpy(q[s:s + 1]).permute(1, 0, 2)[None],
                           torch.tensor([n - 1]))
        peer.append((qr, kr, vt))
        del k, v
    cu = np.arange(len(lens) + 1, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(npg)]).astype(np.int64)
    last = np.array([n - (m - 1) * P for n, m in zip(lens, npg)], dtype=np.int64)
    pk = libape.PagedKV(Hkv=H, D=D, H=H, page_tokens=P, num_pages=N, device=a.device,
                        max_batch_tokens=max(256, len(lens)))
    pk.plan(cu, indptr=indptr, indices=indices, last_page_len=last)

    kh, vh = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kp, vp))  # HND

    def run(stats=False):
        return pk.run(q, kp, vp, skip_tol=0.0, stats=stats, **ZERO)

    def run_hnd():
        return pk.run(q, kh, vh, kv_layout="HND", skip_tol=0.0, **ZERO)

    def att():
        return pool.attend(q, ids, cu, skip_tol=0.0, **ZERO)

    def sdpa_each():
        return [torch.nn.functional.scaled_dot_product_attention(x, y, z) for x, y, z in peer]

    got, st = run(stats=True)
    want = np.stack([o[0, :, 0].numpy() for o in sdpa_each()])
    err = float(np.abs(got - want).max())
    assert err < TOL, "paged: PagedKV vs SDPA differ by %g" % err
    assert np.array_equal(got, att()), "paged: PagedKV and KVPool differ"
    assert np.array_equal(got, run_hnd()), "paged: the NHD and HND pages differ"
    nbytes = c.kv_bytes(st)
    tr, th, tp, ts = rounds([run, run_hnd, att, sdpa_each], a.rounds, a.repeats)
    mr, mh, mp, ms = (statistics.median(x) for x in (tr, th, tp, ts))
    what = ("plain decode, %d sequences of %d..%d keys (%s), the caller's pages of %d "
            "(scrambled)" % (len(lens), lens[0], lens[-1], a.spread, P))
    c.rows.append(("paged", what, "PagedKV.run, NHD", mr, "KVPool.attend", mp, ratio(tr, tp),
                   nbytes, c.gbps(nbytes, mr), c.gbps(nbytes, mp), "-", 0.0))
    c.rows.append(("paged", what, "PagedKV.run, HND", mh, "KVPool.attend", mp, ratio(th, tp),
                   nbytes, c.gbps(nbytes, mh), c.gbps(nbytes, mp), "-", 0.0))
    c.rows.append(("paged", what, "PagedKV.run, HND", mh, "SDPA once per sequence", ms,
                   ratio(th, ts), nbytes, c.gbps(nbytes, mh), c.gbps(nbytes, ms), "-", err))
    pk.close()
    pool.close()


def case_single(c):
    a, np, torch, libape = c.args, c.np, c.torch, c.libape
    Lk = a.single_Lk
    k, v, kr, vt = c.keys(Lk, 7)
    q = np.random.default_rng(8).standard_normal((1, H, D), dtype=np.float32)
    qr = c.rope_rotate(torch.from_numpy(q).permute(1, 0, 2)[None], torch.tensor([Lk - 1]))
    q4 = np.ascontiguousarray(q[None].transpose(0, 2, 1, 3))  # [1, H, 1, D] for the cache
    with libape.KVPool(Hkv=H, D=D, H=H, capacity_tokens=Lk + a.page_tokens,
                       page_tokens=a.page_tokens, device=a.device) as pool, \
            libape.KVCache(B=1, Hkv=H, D=D, H=H, capacity_tokens=Lk,
                           device=a.device) as cache:
        sid = pool.add_sequence()
        pool.append(sid, k, v)
        cache.append(np.ascontiguousarray(k[None].transpose(0, 2, 1, 3)),
                     np.ascontiguousarray(v[None].transpose(0, 2, 1, 3)))
        del k, v
        ids, cu = [sid], [0, 1]

        def att(stats=False):
            return pool.attend(q, ids, cu, skip_tol=0.0, stats=stats, **ZERO)

        def cat():
            return cache.attend(q4, skip_tol=0.0, **ZERO)

        got, st = att(stats=True)
        want = torch.nn.functional.scaled_dot_product_attention(qr, kr, vt)[0, :, 0].numpy()
        err = float(np.abs(got[0] - want).max())
        err_cache = float(np.abs(cat()[0, :, 0] - got[0]).max())
        assert err < TOL, "single: KVPool vs SDPA differ by %g" % err
        assert err_cache < 1e-5, "single: KVPool vs KVCache differ by %g" % err_cache
        tp, tc = rounds([att, cat], a.rounds, a.repeats)
    mp, mc = statistics.median(tp), statistics.median(tc)
    r = ratio(tp, tc)
    nbytes = c.kv_bytes(st)
    c.rows.append(("single", "plain decode, one sequence, Lk %d, pages of %d" % (
        Lk, a.page_tokens), "KVPool", mp, "KVCache", mc, r, nbytes, c.gbps(nbytes, mp),
        c.gbps(nbytes, mc), "<= 1.05x: %s" % ("met" if r <= 1.05 else "NOT met"), err))
    c.targets.append("single: KVPool / KVCache %.3fx at Lk %d (target <= 1.05x): %s"
                     % (r, Lk, "met" if r <= 1.05 else "NOT met"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--cases", default="batch,decay,single",
                    help="which cases, comma-separated (batch, decay, single, paged)")
    ap.add_argument("--seqs", type=int, default=64, help="batch: sequences")
    ap.add_argument("--min-len", type=int, default=256, help="batch: the shortest")
    ap.add_argument("--max-len", type=int, default=32768, help="batch: the longest")
    ap.add_argument("--spread", choices=("geometric", "even"), default="geometric",
                    help="batch: lengths in geometric or even steps")
    ap.add_argument("--page-tokens", type=int, default=16, help="the pools' page size")
    ap.add_argument("--decay-Lk", default="4096,32768,131072",
                    help="decay: key lengths, comma-separated")
    ap.add_argument("--single-Lk", type=int, default=32768, help="single: key length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per round")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--membw", default="0", metavar="GBPS|auto",
                    help="memory read bandwidth (make bench-membw): GB/s also as a share of "
                    "it; auto: build/bench/membw over the batch step's own bytes, run in "
                    "every round of the batch case (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, 3 rounds of 3: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.seqs, args.max_len, args.single_Lk = 8, 2048, 4096
        args.decay_Lk, args.rounds, args.repeats = "1024,4096", 3, 3
    cases = [x for x in args.cases.split(",") if x]
    for x in cases:
        if x not in ("batch", "decay", "single", "paged"):
            ap.error("--cases: %r is not batch, decay, single or paged" % x)
    if args.seqs < 1 or args.min_len < 1 or args.max_len < 1 or args.page_tokens < 1 \
            or args.single_Lk < 1 or args.rounds < 1 or args.repeats < 1:
        ap.error("--seqs, --min-len, --max-len, --page-tokens, --single-Lk, --rounds and "
                 "--repeats must be >= 1")
    if args.membw != "auto":
        try:
            args.membw = float(args.membw)
        except ValueError:
            args.membw = -1.0
        if not args.membw >= 0:
            ap.error("--membw: must be a figure in GB/s, auto, or 0 for none")
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(args.build, "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import torch
    import libape
    from torch_ape import rope_rotate

    torch.set_num_threads(args.threads)
    c = Ctx(args, np, torch, libape, rope_rotate)
    t0 = time.perf_counter()
    for name in cases:
        {"batch": case_batch, "decay": case_decay, "single": case_single,
         "paged": case_paged}[name](c)
    print("machine: %s, %d threads for PyTorch %s; libape on %s (%s); H = Hkv = %d, D = %d, "
          "float32; median of %d rounds of %d calls each, contenders alternating round by "
          "round; %.0f s" % (cpu_model(), args.threads, torch.__version__, args.device,
                             os.environ["LIBAPE_LIBRARY"], H, D, args.rounds, args.repeats,
                             time.perf_counter() - t0))
    print()
    print("| case | what | libape | ms | peer | ms | libape / peer | K/V MiB per step | "
          "libape GB/s%s | peer GB/s | target | max diff |" % (
              " (share of the read bandwidth, GB/s)" if args.membw else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in c.rows:
        print("| %s | %s | %s | %.3f | %s | %.3f | %.3fx | %.4g | %s | %s | %s | %.1e |" % (
            r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7] / 2 ** 20, r[8], r[9], r[10],
            r[11]))
    if c.targets:
        print()
        for t in c.targets:
            print("- " + t)
    print()
    print("ms: the median of the rounds' medians; libape / peer: the median of the per-round "
          "ratios (on a loaded machine it may differ from the ratio of the two ms columns); K/V "
          "MiB per step: 2 x keys read x Hkv x D x 4 bytes, from libape's pairs_computed (under "
          "decay, the keys within reach); peer GB/s: the bytes the peer reads (SDPA: every key) "
          "per peer step")


if __name__ == "__main__":
    main()
