"""Trains a tiny model on packed documents: several documents of different lengths in one
[total, H, D] batch, attention kept within each document by cu_seqlens (the packed training
that Hugging Face's DataCollatorWithFlattening sets up, with position_ids restarting at 0 per
document; libape.position_ids_to_cu_seqlens turns those into cu_seqlens). The same model,
trained from the same initial weights on one document at a time through the dense call, must
give the same losses to rounding: the example exits 1 otherwise.

The model: token embeddings, q/k/v projections into H heads, one APEAttention layer (its four
parameters learned too), an output projection to next-token logits; plain SGD.

    python packed_training.py            # 6 documents of 5..40 tokens, 30 steps
    python packed_training.py --small    # a quick run (the tests use it)
"""
import argparse
import sys

import torch

import libape
import libape.torch as apet

VOCAB, H, D = 32, 2, 16


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, H * D)
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, bias=False)
        self.att = apet.APEAttention(H, D, device="ref")
        self.out = torch.nn.Linear(H * D, VOCAB)

    def forward(self, tokens, cu_seqlens=None):
        x = self.emb(tokens)  # [total, H * D]
        q, k, v = self.qkv(x).view(-1, 3, H, D).unbind(1)  # strided views of one buffer
        if cu_seqlens is not None:
            a = self.att(q, k, v, cu_seqlens=cu_seqlens)  # [total, H, D]
        else:  # one document: the dense [1, H, L, D] call
            a = self.att(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                         v.permute(1, 0, 2)[None])[0].permute(1, 0, 2)
        return self.out(a.reshape(-1, H * D))


def doc_loss(logits, tokens, cu):
    """Next-token cross entropy within each document, summed."""
    tot = 0
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        if b - a > 1:
            tot = tot + torch.nn.functional.cross_entropy(logits[a:b - 1], tokens[a + 1:b],
                                                          reduction="sum")
    return tot


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="3 documents, 5 steps")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    steps, ndoc = (5, 3) if args.small else (args.steps, 6)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(5, 41, (ndoc,), generator=g)
    tokens = torch.randint(0, VOCAB, (int(lens.sum()),), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lens.tolist()])
    cu = torch.from_numpy(libape.position_ids_to_cu_seqlens(position_ids))

    torch.manual_seed(1)
    packed = Tiny()
    single = Tiny()
    single.load_state_dict(packed.state_dict())
    opt_p = torch.optim.SGD(packed.parameters(), lr=0.05)
    opt_s = torch.optim.SGD(single.parameters(), lr=0.05)
    worst = 0.0
    for step in range(steps):
        opt_p.zero_grad()
        lp = doc_loss(packed(tokens, cu), tokens, cu)
        lp.backward()
        opt_p.step()

        opt_s.zero_grad()
        ls = 0
        for s in range(ndoc):
            a, b = int(cu[s]), int(cu[s + 1])
            t = tokens[a:b]
            ls = ls + doc_loss(single(t), t, torch.tensor([0, b - a]))
        ls.backward()
        opt_s.step()
        rel = abs(lp.item() - ls.item()) / max(1.0, abs(ls.item()))
        worst = max(worst, rel)
        print("step %3d  packed loss %.6f  one document at a time %.6f  (rel. diff %.1e)"
              % (step, lp.item(), ls.item(), rel))
    print("delta after training:", packed.att.delta.detach().numpy(),
          "vs", single.att.delta.detach().numpy())
    if worst > 1e-4:
        print("packed and per-document training differ by %.2e: FAIL" % worst)
        return 1
    print("packed and per-document training agree (largest relative difference %.1e)" % worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
