"""Serves concurrent requests of a tiny decoder with continuous batching over libape.KVPool.

The model: token embeddings, two layers of APE attention (4 query heads sharing 2 key/value
heads, head dimension 16) and an MLP, random weights; NumPy for everything but attention. Each
layer keeps its keys and values in a KVPool of its own (pages of 16 tokens); a request holds one
sequence in each.

Every step serves one ragged batch: requests that arrived join (admitted while the pools' pages
can hold them), a prompt is prefilled in chunks that share the step with the other requests'
decode tokens, finished requests leave and their pages go back to the pools. One request asks
for two samples (parallel sampling): when its prompt is in, its sequences are forked, and both
branches decode from the shared prompt pages (a shared partial page is copied on first write).
The step's keys and values go in with one append_batch() per layer, its attention with one
attend() per layer.

At the end, requests (the forked pair among them) are run again without the pool, one dense
libape.attention call per layer over the whole sequence, and the logits they were sampled from
must agree: the example exits 1 otherwise.

    python serve.py                          # 8 requests, up to 80 steps, the best device
    python serve.py --requests 20 --device ref
"""
import argparse
import sys
import time

import numpy as np

import libape

VOCAB, LAYERS, H, HKV, D = 96, 2, 4, 2, 16
DM = H * D  # model width
PAGE = 16


class Model:
    """Random weights: embeddings (tied output), per layer one fused q|k|v projection, an output
    projection and an MLP."""

    def __init__(self, rng):
        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        self.emb = (rng.standard_normal((VOCAB, DM))).astype(np.float32)
        self.wqkv = [w(DM, (H + 2 * HKV) * D) for _ in range(LAYERS)]
        self.wo = [w(H * D, DM) for _ in range(LAYERS)]
        self.w1 = [w(DM, 2 * DM) for _ in range(LAYERS)]
        self.w2 = [w(2 * DM, DM) for _ in range(LAYERS)]

    def forward(self, tokens, attend):
        """Logits [n, VOCAB] of n tokens; attend(layer, q, k, v) gives the attention of q
        [n, H, D] given the tokens' own keys and values k, v [n, HKV, D]."""
        x = self.emb[tokens]
        n = len(tokens)
        for l in range(LAYERS):
            qkv = rms(x) @ self.wqkv[l]  # one buffer; q, k, v are strided views of it
            q = qkv[:, :H * D].reshape(n, H, D)
            k = qkv[:, H * D:(H + HKV) * D].reshape(n, HKV, D)
            v = qkv[:, (H + HKV) * D:].reshape(n, HKV, D)
            x = x + attend(l, q, k, v).reshape(n, H * D) @ self.wo[l]
            x = x + np.maximum(rms(x) @ self.w1[l], 0) @ self.w2[l]
        return rms(x) @ self.emb.T


def rms(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


class Request:
    def __init__(self, name, arrival, prompt, max_new, seed, samples=1):
        self.name, self.arrival, self.prompt, self.max_new = name, arrival, prompt, max_new
        self.samples = samples
        self.rng = np.random.default_rng(seed)
        self.sids = None  # one sequence id per layer's pool
        self.done_prompt = 0  # prompt tokens in the pools
        self.generated = []
        self.logits = []  # the rows each generated token was sampled from, for the check
        self.reserved = 0  # pages per pool set aside for it at admission

    def sample(self, logits, temperature=0.8):
        p = np.exp((logits - logits.max()) / temperature)
        self.generated.append(int(self.rng.choice(VOCAB, p=p / p.sum())))
        self.logits.append(logits)

    def reserve(self):
        """Pages per pool this request may come to hold (each branch of a fork its own)."""
        return self.samples * -(-(len(self.prompt) + self.max_new) // PAGE)


def make_requests(n, rng):
    out = []
    for i in range(n):
        arrival = 0 if i < 2 else int(rng.integers(0, 2 * n))
        prompt = rng.integers(0, VOCAB, int(rng.integers(5, 41)))
        out.append(Request("r%d" % i, arrival, prompt, int(rng.integers(4, 17)), 1000 + i,
                           samples=2 if i == 1 else 1))
    return sorted(out, key=lambda r: r.arrival)


def occupancy(pool):
    i = pool.info()
    return ("pages used %3d / free %3d (shared %d, copied %d)"
            % (i["pages_used"], i["pages_free"], i["pages_shared"], i["pages_copied"]))


def serve(args, model, pools, requests):
    waiting, running, finished = list(requests), [], []
    pages_total = pools[0].info()["pages_total"]
    reserved = 0
    processed = generated = 0
    t0 = time.perf_counter()
    step = 0
    for step in range(args.steps):
        # admission: arrived requests join while their pages fit
        while (waiting and waiting[0].arrival <= step and
               reserved + waiting[0].reserve() <= pages_total):
            r = waiting.pop(0)
            r.sids = [p.add_sequence() for p in pools]
            r.reserved = r.reserve()
            reserved += r.reserved
            running.append(r)
            print("step %3d: %s arrives: prompt %d tokens, %d new%s"
                  % (step, r.name, len(r.prompt), r.max_new,
                     ", 2 samples (forked after the prompt)" if r.samples == 2 else ""))
        if not running:
            if not waiting:
                break
            continue
        # the batch: every decode token, then prompt chunks within the token budget
        batch, budget = [], args.batch_tokens
        for r in running:
            if r.done_prompt == len(r.prompt):
                batch.append((r, np.array(r.generated[-1:])))
                budget -= 1
        for r in running:
            left = len(r.prompt) - r.done_prompt
            if left and budget > 0:
                n = min(left, args.chunk, budget)
                batch.append((r, r.prompt[r.done_prompt:r.done_prompt + n]))
                budget -= n
        lens = [len(t) for _, t in batch]
        cu = np.concatenate([[0], np.cumsum(lens)])
        tokens = np.concatenate([t for _, t in batch])

        def attend(l, q, k, v):
            ids = [r.sids[l] for r, _ in batch]
            pools[l].append_batch(ids, cu, k, v)  # this step's keys first ...
            return pools[l].attend(q, ids, cu)  # ... then its rows at the end of each sequence

        logits = model.forward(tokens, attend)
        processed += len(tokens)
        n_decode = sum(1 for (r, _) in batch if r.done_prompt == len(r.prompt))
        # sampling: decode rows, and the last row of a prompt that is now complete
        for (r, t), end in zip(batch, cu[1:]):
            if r.done_prompt < len(r.prompt):
                r.done_prompt += len(t)
                if r.done_prompt < len(r.prompt):
                    continue  # a prefill chunk: nothing to sample yet
                if r.samples == 2:  # parallel sampling: a second branch on the same pages
                    twin = Request(r.name + "b", r.arrival, r.prompt, r.max_new,
                                   int(r.rng.integers(1 << 30)))
                    twin.sids = [p.fork(s) for p, s in zip(pools, r.sids)]
                    twin.done_prompt = r.done_prompt
                    twin.reserved = r.reserved // 2
                    r.reserved -= twin.reserved
                    twin.sample(logits[end - 1])
                    generated += 1
                    running.append(twin)
                    r.samples = 1
                    print("step %3d: %s forked into %s (prompt pages shared)"
                          % (step, r.name, twin.name))
            r.sample(logits[end - 1])
            generated += 1
        for r in [r for r in running if len(r.generated) >= r.max_new]:
            for p, s in zip(pools, r.sids):
                p.remove(s)
            running.remove(r)
            reserved -= r.reserved
            finished.append(r)
            print("step %3d: %s done: %d tokens generated" % (step, r.name, len(r.generated)))
        print("step %3d: %2d running, %3d tokens (%3d prefill + %2d decode); layer 0: %s"
              % (step, len(running), len(tokens), len(tokens) - n_decode, n_decode,
                 occupancy(pools[0])))
        if not running and not waiting:
            break
    dt = time.perf_counter() - t0
    print("%d steps in %.2f s: %d tokens generated (%.0f tokens/s), %d processed (%.0f tokens/s)"
          % (step + 1, dt, generated, generated / dt, processed, processed / dt))
    print("at the end, layer 0: %s" % occupancy(pools[0]))
    if running or waiting:
        print("unfinished after %d steps: %s" % (args.steps, ", ".join(
            r.name for r in running + waiting)))
    return finished


def check(model, reqs, device):
    """Each request's logits again, without the pool: one dense libape.attention per layer over
    the whole sequence (prompt and the tokens it was fed back)."""
    worst = 0.0
    for r in reqs:
        seq = np.concatenate([r.prompt, np.array(r.generated[:-1], dtype=r.prompt.dtype)])

        def attend(l, q, k, v):
            o = libape.attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                 v.transpose(1, 0, 2)[None], device=device)
            return o[0].transpose(1, 0, 2)

        logits = model.forward(seq, attend)[len(r.prompt) - 1:]
        got = np.stack(r.logits)
        worst = max(worst, float(np.abs(logits - got).max() / max(1.0, np.abs(logits).max())))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="requests to serve (default 8)")
    ap.add_argument("--steps", type=int, default=80, help="most steps to run (default 80)")
    ap.add_argument("--device", default="auto", help="libape device (default auto)")
    ap.add_argument("--batch-tokens", type=int, default=64, help="tokens per step (default 64)")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (default 16)")
    ap.add_argument("--pages", type=int, default=32,
                    help="pages of %d tokens per layer's pool (default 32)" % PAGE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    model = Model(rng)
    requests = make_requests(max(args.requests, 2), rng)
    pools = [libape.KVPool(Hkv=HKV, D=D, H=H, capacity_tokens=args.pages * PAGE, page_tokens=PAGE,
                           max_batch_tokens=args.batch_tokens, device=args.device)
             for _ in range(LAYERS)]
    try:
        finished = serve(args, model, pools, requests)
    finally:
        for p in pools:
            p.close()
    forked = [r for r in finished if r.name in ("r1", "r1b")]
    others = [r for r in finished if r.name not in ("r1", "r1b")][:2]
    if not finished:
        print("no request finished: nothing to check")
        return 0
    worst = check(model, forked + others, args.device)
    names = ", ".join(r.name for r in forked + others)
    if worst > 1e-3:
        print("dense recomputation of %s: logits DISAGREE (largest difference %.2e of max|logit|)"
              % (names, worst))
        return 1
    print("dense recomputation of %s: logits agree (largest difference %.2e of max|logit|)"
          % (names, worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
