"""Python overhead of libape.attention over the C call it makes: a tiny problem on the reference,
timed both ways alternately; the minimum over rounds of each, to see past a busy machine.
Usage: overhead.py [ROUNDS] [--torch] (prints one line; bench/RESULTS.md records it). --torch
adds a line for libape.torch.attention on torch tensors (the custom op's dispatch, forward only,
no gradient wanted) against libape.attention on the same tensors."""
import ctypes
import sys
import time

import numpy as np

import libape
from libape import _capi, _core


def main():
    args = [a for a in sys.argv[1:] if a != "--torch"]
    rounds = int(args[0]) if args else 30
    q = np.ones((1, 1, 1, 8), np.float32)
    o = np.empty_like(q)
    dev = _core._context.device("ref")
    qa, oa = _core._as_array("q", q), _core._as_array("o", o)
    tq, to = _core._tensor(qa), _core._tensor(oa)
    d = _core._desc(1, libape.SEED_DELTA, libape.SEED_BETA, libape.SEED_GAMMA,
                    libape.SEED_LAMBDA, True, None, 10000.0, "half", None, 0, 2.0 ** -24, [])
    args = (dev, ctypes.byref(d), ctypes.addressof(tq), ctypes.addressof(tq),
            ctypes.addressof(tq), ctypes.addressof(to), None, None)
    fwd = _capi.lib.ape_attention_forward
    n = 300
    raw, wrapped = alternate(rounds, n, lambda: fwd(*args),
                             lambda: libape.attention(q, q, q, device="ref"))
    print("tiny call (1x1x1x8, ref): C call through ctypes %.1f us, libape.attention %.1f us, "
          "overhead %.1f us (minimum of %d rounds of %d)"
          % (raw * 1e6, wrapped * 1e6, (wrapped - raw) * 1e6, rounds, n))
    if "--torch" in sys.argv[1:]:
        torch_overhead(rounds, n)


def alternate(rounds, n, *calls):
    """The minimum over rounds of each call's time (seconds), the calls timed in turn."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            for _ in range(n):
                call()
            best[i] = min(best[i], (time.perf_counter() - t) / n)
    return best


def torch_overhead(rounds, n):
    import torch
    import libape.torch as apet
    q = torch.ones((1, 1, 1, 8))
    plain, op = alternate(rounds, n, lambda: libape.attention(q, q, q, device="ref"),
                          lambda: apet.attention(q, q, q, device="ref"))
    print("tiny call, torch tensors: libape.attention %.1f us, libape.torch.attention (%s) "
          "%.1f us, overhead %.1f us" % (plain * 1e6, apet.IMPLEMENTATION, op * 1e6,
                                         (op - plain) * 1e6))


if __name__ == "__main__":
    main()
