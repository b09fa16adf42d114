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

B = 1, H = 6, D = 64, float32, causal. libape.torch's OpenMP guard (docs/python.md, "PyTorch's
OpenMP threads") is off for SDPA and, as by default, for libape; --guard turns it on for libape's
candidates (switched before each).
Each round times every candidate once per length
(--repeats calls, the median), in turn, after one untimed call; prints each round and the
median over rounds of each ratio to SDPA.

With --breakdown, instead: where one training step's time goes, per length and for the seed's
lambda and lambda = 0: libape.torch's forward and its loss.backward() timed apart, beside the C
calls inside them (ape_attention_forward's and ape_attention_backward's wall and kernel times,
read from the call log, APE_VERBOSE=1 in JSON, captured from stderr), and SDPA's forward and
backward timed apart. Medians of --repeats calls per round, the median over rounds.

usage: build/venv/bin/python bench/train_step.py [-L 1024 4096] [--ref-L 1024] [--rounds 5]
       [--repeats 3] [--threads 2] [--lam 0] [--breakdown]
"""
import argparse
import json
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
    ap.add_argument("--guard", action="store_true",
                    help="libape with its OpenMP guard on (libape.torch.omp_guard(True))")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the passes apart, and the C calls inside them (see above)")
    args = ap.parse_args()
    if args.breakdown:  # the call log, read by every context libape creates from here on
        os.environ["APE_VERBOSE"] = "1"
        os.environ["APE_VERBOSE_FORMAT"] = "json"
    os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(ROOT, "build", "lib", "libape.so.0"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, HERE)
    import torch
    import libape
    import libape.torch as apet
    from torch_ape import rope_rotate

    torch.set_num_threads(args.threads)

    def guard(peer):
        """The OpenMP guard off for the peer, for libape as --guard says."""
        apet.omp_guard(not peer and args.guard)
    H, D = 6, 64
    print("libape.torch.grad_device(): %s; torch %s, %d threads; OpenMP guard for libape: %s" % (
        apet.grad_device(), torch.__version__, args.threads, "on" if args.guard else "off"))

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

    if args.breakdown:
        return breakdown(args, torch, libape, apet, rope_rotate, H, D, guard)
    cands = {}
    for L in args.L:
        cands[L] = [("sdpa", step_sdpa(L)), ("libape default", step_libape(L, None)),
                    ("libape skip_tol=0", step_libape(L, None, 0.0))]
        if L in args.ref_L:
            cands[L].append(("libape ref", step_libape(L, "ref")))
    ratios = {}
    for r in range(args.rounds):
        for L in args.L:
            t = {}
            for name, fn in cands[L]:
                guard(name == "sdpa")
                t[name] = median_ms(fn)
            print("round %d, L %d: " % (r, L) + ", ".join(
                "%s %.1f ms" % (n, x) for n, x in t.items()), flush=True)
            for n, x in t.items():
                ratios.setdefault((L, n), []).append(x / t["sdpa"])
    for (L, n), v in ratios.items():
        if n != "sdpa":
            print("L %d: %s / SDPA: median %.2fx over %d rounds" % (L, n, statistics.median(v),
                                                                    len(v)))


class CallLog:
    """The C calls' log lines (APE_VERBOSE=1, JSON) written to stderr while it is open: fd 2 goes
    to a temporary file, read back by calls()."""

    def __enter__(self):
        import tempfile
        sys.stderr.flush()
        self.f = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.f.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)

    def calls(self):
        """{call name: [(wall_ms, kernel_ms), ...]} of the lines written so far."""
        self.f.seek(0)
        out = {}
        for line in self.f.read().decode(errors="replace").splitlines():
            if line.startswith("libape: {"):
                d = json.loads(line[len("libape: "):])
                if "wall_ms" in d:
                    out.setdefault(d["call"], []).append((d["wall_ms"], d["kernel_ms"]))
        return out


def breakdown(args, torch, libape, apet, rope_rotate, H, D, guard):
    med = statistics.median
    for L in args.L:
        for lam in ((libape.SEED_LAMBDA, 0.0) if args.lam is None else (args.lam,)):
            g = torch.Generator().manual_seed(L)
            q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
            prm = [torch.tensor(x, requires_grad=True) for x in
                   (libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA, lam)]
            pos = torch.arange(L)
            rows = {}

            def timed(name, fn):
                t0 = time.perf_counter()
                fn()
                rows.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

            for r in range(args.rounds + 1):  # the first round untimed
                guard(False)
                for _ in range(args.repeats):
                    with CallLog() as log:
                        box = {}
                        timed("libape.torch forward", lambda: box.setdefault("o", apet.attention(
                            q, k, v, delta=prm[0], beta=prm[1], gamma=prm[2], lam=prm[3])))
                        loss = box["o"].square().sum()
                        timed("libape.torch backward", loss.backward)
                    for call, v_ in log.calls().items():
                        for wall, kern in v_:
                            rows.setdefault(call + " wall", []).append(wall)
                            rows.setdefault(call + " kernels", []).append(kern)
                guard(True)
                for _ in range(args.repeats):
                    box = {}
                    timed("SDPA forward", lambda: box.setdefault(
                        "o", torch.nn.functional.scaled_dot_product_attention(
                            rope_rotate(q, pos), rope_rotate(k, pos), v, is_causal=True)))
                    loss = box["o"].square().sum()
                    timed("SDPA backward", loss.backward)
                if r == 0:
                    rows.clear()
            print("L %d, lambda %g (medians of %d calls, ms):" % (L, lam,
                                                                 args.rounds * args.repeats))
            for name, t in rows.items():
                print("  %-40s %9.2f" % (name, med(t)))
            step = med(rows["libape.torch forward"]) + med(rows["libape.torch backward"])
            sdpa = med(rows["SDPA forward"]) + med(rows["SDPA backward"])
            print("  step: libape %.2f ms, SDPA %.2f ms, ratio %.2fx" % (step, sdpa, step / sdpa),
                  flush=True)


if __name__ == "__main__":
    main()
