"""libape.KVPool (ape_kv_pool_*): many sequences in pages on one device. Every attend is
checked, sequence by sequence, against libape.attention on the reference device over everything
appended to that sequence (its keys at k_start.., its rows end-aligned or at explicit positions):
mixed prefill and decode steps, forks with copy on write, removal and reuse of pages, pages of
1, 16 and 256 tokens, GQA, float16 (and torch bfloat16), explicit positions, full pools, unknown
ids, results independent of the rest of the batch and of its order, strided views without
copies, the ctypes structs against the header, and the serving example."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import libape
import libape._core as core
from conftest import ROOT

DEVICES = [d["spec"] for d in libape.devices()]
PRM = dict(delta=0.05, beta=0.02, gamma=0.03, lam=0.2)
# the spec's tolerances (docs/ape.md, "Storage and accuracy"): O against max|V|, LSE
TOL = {"float32": (1e-4, 1e-4), "float16": (5e-3, 1e-3), "bfloat16": (2e-2, 5e-3)}
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
except ImportError:  # the NumPy tests still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed here")


def is_torch(x):
    return type(x).__module__.startswith("torch")


def f64(x):
    """Any result (NumPy, torch of any float dtype) as float64 NumPy."""
    if is_torch(x):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def dense(x):
    """A packed [L, H, D] array as the [1, H, L, D] view libape.attention takes."""
    return x.permute(1, 0, 2)[None] if is_torch(x) else x.transpose(1, 0, 2)[None]


class Mirror:
    """A KVPool and, on the host, every token appended to each of its sequences (the oracle's
    keys and values). Every attend goes through check()."""

    def __init__(self, seed=0, kind="numpy", dtype="float32", H=4, Hkv=2, D=16, device="ref",
                 capacity_tokens=512, **opts):
        self.rng = np.random.default_rng(seed)
        self.kind, self.dtype, self.H, self.Hkv, self.D = kind, dtype, H, Hkv, D
        self.pool = libape.KVPool(Hkv=Hkv, D=D, capacity_tokens=capacity_tokens, H=H,
                                  dtype=dtype, device=device, **opts)
        self.seqs = {}  # id -> [k_start, k chunks, v chunks]

    def arr(self, *shape, scale=1.0):
        x = (scale * self.rng.standard_normal(shape)).astype(np.float32)
        if self.kind == "torch":
            return torch.from_numpy(x).to(getattr(torch, self.dtype))
        return x.astype(self.dtype)

    def cat(self, xs):
        return torch.cat(xs) if self.kind == "torch" else np.concatenate(xs)

    def add(self, k_start=0):
        sid = self.pool.add_sequence(k_start)
        assert sid not in self.seqs
        self.seqs[sid] = [k_start, [], []]
        return sid

    def fork(self, sid):
        new = self.pool.fork(sid)
        ks, kk, vv = self.seqs[sid]
        self.seqs[new] = [ks, list(kk), list(vv)]
        return new

    def remove(self, sid):
        self.pool.remove(sid)
        del self.seqs[sid]

    def tokens(self, sid):
        return sum(x.shape[0] for x in self.seqs[sid][1])

    def append(self, sid, n):
        k, v = self.arr(n, self.Hkv, self.D), self.arr(n, self.Hkv, self.D)
        self.pool.append(sid, k, v)
        self.seqs[sid][1].append(k)
        self.seqs[sid][2].append(v)

    def append_batch(self, ids, lens, cu_type=list):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        k, v = self.arr(int(cu[-1]), self.Hkv, self.D), self.arr(int(cu[-1]), self.Hkv, self.D)
        self.pool.append_batch(ids, cu_type(cu), k, v)
        for i, sid in enumerate(ids):
            self.seqs[sid][1].append(k[cu[i]:cu[i + 1]])
            self.seqs[sid][2].append(v[cu[i]:cu[i + 1]])

    def attend(self, ids, lens, positions=None, q=None, cu_type=list, **kw):
        """Attends rows lens[i] of sequence ids[i] and checks each against the oracle; returns
        o, lse as returned (of the call's kind)."""
        cu = np.concatenate([[0], np.cumsum([int(n) for n in lens])]).astype(np.int64)
        if q is None:
            q = self.arr(int(cu[-1]), self.H, self.D)
        prm = dict(PRM)
        prm.update(kw)
        o, lse = self.pool.attend(q, ids, cu_type(cu), positions_q=positions, return_lse=True,
                                  **prm)
        assert o.shape == q.shape and o.dtype == q.dtype and type(o) is type(q)
        assert lse.shape == (q.shape[0], self.H)
        self.check([int(s) for s in ids], cu, q, o, lse, positions, prm)
        return o, lse

    def oracle(self, sid, q, pq, prm):
        """libape.attention on the reference device over sequence sid's keys: (o, lse) float64
        packed like the rows ([Lq, H, D], [Lq, H])."""
        ks, kk, vv = self.seqs[sid]
        T = self.tokens(sid)
        if T == 0:
            return np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
        k, v = self.cat(kk), self.cat(vv)
        if pq is None:  # rows at the end: q_start = k_start + tokens - Lq
            o, lse = libape.attention(dense(q), dense(k), dense(v), k_start=ks, device="ref",
                                      return_lse=True, **prm)
        else:
            o, lse = libape.attention(dense(q), dense(k), dense(v), positions_q=pq,
                                      positions_k=ks + np.arange(T), device="ref",
                                      return_lse=True, **prm)
        return f64(o)[0].transpose(1, 0, 2), f64(lse)[0].T

    def check(self, ids, cu, q, o, lse, pq, prm):
        to, tl = TOL[self.dtype]
        o, lse = f64(o), f64(lse)
        for i, sid in enumerate(ids):
            a, b = int(cu[i]), int(cu[i + 1])
            if a == b:
                continue
            wo, wl = self.oracle(sid, q[a:b], None if pq is None else pq[a:b], prm)
            m = max([1.0] + [np.abs(f64(x)).max() for x in self.seqs[sid][2] if x.shape[0]])
            assert np.abs(o[a:b] - wo).max() <= to * m, (sid, np.abs(o[a:b] - wo).max())
            fin = np.isfinite(wl)
            assert (np.isfinite(lse[a:b]) == fin).all(), sid
            err = np.abs(lse[a:b][fin] - wl[fin])
            assert (err <= tl * np.maximum(1, np.abs(wl[fin]))).all(), sid
            assert (o[a:b][~fin] == 0).all(), sid


# ------------------------------------------------------------------ the ctypes mirrors

def test_struct_layouts_match_the_header(tmp_path):
    """ApeKvPoolOptions and ApeKvPoolInfo against the C compiler's sizes and offsets."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    from libape import _capi
    structs = {"ape_kv_pool_options": _capi.ApeKvPoolOptions,
               "ape_kv_pool_info": _capi.ApeKvPoolInfo}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ape/ape.h>",
             "int main(void){"]
    expect = []
    for cname, py in structs.items():
        lines.append('printf("%%zu\\n", sizeof(%s));' % cname)
        expect.append(("sizeof " + cname, _capi.ctypes.sizeof(py)))
        for f in py._fields_:
            lines.append('printf("%%zu\\n", offsetof(%s, %s));' % (cname, f[0]))
            expect.append(("%s.%s" % (cname, f[0]), getattr(py, f[0]).offset))
    lines.append("return 0;}")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)],
                   check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert [(n, v) for (n, v), g in zip(expect, got) if v != g] == []
    assert len(got) == len(expect)


def test_info_has_every_field():
    with libape.KVPool(2, 16, 100, page_tokens=16, device="ref") as pool:
        info = pool.info()
        assert set(info) == {n for n, _ in libape._capi.ApeKvPoolInfo._fields_}
        assert info["page_tokens"] == 16 and info["pages_total"] == 7  # 100 rounded up
        assert info["pages_free"] == 7 and info["pages_used"] == 0 and info["sequences"] == 0
        assert info["tokens"] == 0 and info["pages_copied"] == 0 and info["device_bytes"] > 0
        a = pool.add_sequence(k_start=-3)
        assert pool.sequence_info(a) == {"tokens": 0, "k_start": -3}
        assert pool.info()["sequences"] == 1 and pool.info()["pages_used"] == 0  # no page yet


# ------------------------------------------------------------------ results

def serve_steps(m, page_tokens):
    """Steps of continuous batching: chunked prefills beside decodes, sequences joining at
    different steps and positions, a row-less entry, batch orders that differ from the append
    order, one sequence's appends one by one (append()) and the rest in batches."""
    s0, s1, s2 = m.add(0), m.add(7), m.add(-5)
    m.append_batch([s0, s1], [20, 5])
    m.attend([s0, s1], [20, 5])  # two prefills
    m.append_batch([s1, s0, s2], [1, 13, 9], cu_type=lambda c: np.asarray(c, np.int32))
    m.attend([s2, s1, s0], [9, 1, 13])  # a decode, a prefill's second chunk, a prefill
    s3 = m.add(2 ** 40)
    for step in range(4):
        m.append_batch([s0, s1, s2], [1, 1, 1])
        m.append(s3, 11)  # s3's prefill in chunks of 11
        m.attend([s0, s3, s1, s2], [1, 11, 1, 1] if step else [1, 11, 0, 1])
    info = m.pool.info()
    assert info["sequences"] == 4 and info["tokens"] == sum(m.tokens(s) for s in m.seqs)
    used = sum(-(-m.tokens(s) // page_tokens) for s in m.seqs)
    assert info["pages_used"] == used and info["pages_free"] == info["pages_total"] - used
    for s in m.seqs:
        assert m.pool.sequence_info(s) == {"tokens": m.tokens(s), "k_start": m.seqs[s][0]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_tokens", [1, 16, 256])
def test_mixed_prefill_and_decode(device, page_tokens):
    m = Mirror(seed=page_tokens, device=device, page_tokens=page_tokens,
               capacity_tokens=max(512, 4 * page_tokens))
    with m.pool:
        serve_steps(m, page_tokens)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors(device, dtype):
    """torch in, torch out (q's dtype); offsets as torch int32 tensors."""
    m = Mirror(seed=3, kind="torch", dtype=dtype, device=device)
    with m.pool:
        serve_steps(m, 16)
        ids = list(m.seqs)
        o, lse = m.attend(torch.tensor(ids), [2, 0, 1, 3],
                          cu_type=lambda c: torch.tensor(c, dtype=torch.int32))
        assert isinstance(o, torch.Tensor) and o.dtype == getattr(torch, dtype)
        assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_float16_and_mha(device):
    m = Mirror(seed=4, dtype="float16", H=2, Hkv=2, device=device)
    with m.pool:
        serve_steps(m, 16)
    m = Mirror(seed=5, dtype="float16", H=3, Hkv=3, D=8, device=device, page_tokens=4)
    with m.pool:
        a = m.add(0)
        m.append(a, 9)
        o, _ = m.attend([a], [3])
        assert o.dtype == np.float16


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_positions(device):
    """positions_q: a decode row, draft rows sharing one position, gaps, rows re-scored at
    earlier positions, a row past the newest token, a row before the first (sees no key)."""
    m = Mirror(seed=6, device=device, page_tokens=8)
    with m.pool:
        a, b = m.add(100), m.add(-4)
        m.append(a, 30)
        m.append(b, 17)
        pa = np.array([129, 131, 131, 131, 140, 105, 99])  # newest key of a at 129
        pb = np.array([12, 12, 0, -6])  # newest key of b at 12, first at -4
        m.attend([a, b], [7, 4], positions=np.concatenate([pa, pb]))
        m.attend([b, a], [4, 7], positions=list(np.concatenate([pb, pa])), causal=False)
        m.attend([a], [2], positions=np.array([129, 129], dtype=np.int32),
                 delta=[0.1, 0.0, 0.2, 0.05])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_see_no_key(device):
    """A sequence with no token yet: its rows get O = 0 and LSE = -inf, beside a sequence
    that has keys."""
    m = Mirror(seed=7, device=device)
    with m.pool:
        a, b = m.add(0), m.add(5)
        m.append(a, 6)
        o, lse = m.attend([a, b], [2, 3])
        assert (o[2:] == 0).all() and np.isneginf(lse[2:]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_diagnostics(device):
    """return_diagnostics=True: each row's entropy and mean distance against
    libape.attention_diagnostics on the reference device over its sequence's keys; rows that
    see no key get 0 in both."""
    m = Mirror(seed=11, device=device, capacity_tokens=1024)
    with m.pool:
        ids = [m.add(s) for s in (0, 5, -3)]
        m.append(ids[0], 150)
        m.append(ids[1], 1)
        lens = [1, 3, 2]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        q = m.arr(int(cu[-1]), m.H, m.D)
        o, lse, ent, md = m.pool.attend(q, ids, cu, return_lse=True, return_diagnostics=True,
                                        **PRM)
        assert ent.shape == md.shape == (cu[-1], m.H) and ent.dtype == np.float32
        m.check(ids, cu, q, o, lse, None, PRM)
        for i, sid in enumerate(ids):
            a, b = int(cu[i]), int(cu[i + 1])
            ks, kk, vv = m.seqs[sid]
            if not kk:
                assert (ent[a:b] == 0).all() and (md[a:b] == 0).all()
                continue
            _, wl, we, wm = libape.attention_diagnostics(
                dense(q[a:b]), dense(m.cat(kk)), dense(m.cat(vv)), k_start=ks, device="ref",
                **PRM)
            we, wm, wl = f64(we)[0].T, f64(wm)[0].T, f64(wl)[0].T
            tl = TOL[m.dtype][1]
            assert np.abs(ent[a:b] - we).max() <= tl * np.maximum(1, np.abs(wl)).max()
            assert np.abs(md[a:b] - wm).max() <= tl * max(1.0, float(m.tokens(sid) + 3))
        # the mean distance alone is not a thing: both come back, with stats after them
        res = m.pool.attend(q, ids, cu, return_diagnostics=True, stats=True, **PRM)
        assert len(res) == 4 and isinstance(res[3], dict)


@pytest.mark.parametrize("device", DEVICES)
def test_bit_identical_whatever_the_batch(device):
    """A sequence's rows are the same bits alone, beside others, and in any batch order."""
    m = Mirror(seed=8, device=device, page_tokens=16)
    with m.pool:
        a, b, c = m.add(0), m.add(3), m.add(50)
        m.append(a, 40)
        m.append(b, 70)
        m.append(c, 5)
        qa, qb, qc = m.arr(3, 4, 16), m.arr(9, 4, 16), m.arr(1, 4, 16)
        ref = m.pool.attend(qa, [a], [0, 3], return_lse=True, **PRM)
        for order in ([a, b, c], [c, b, a], [b, a], [c, a], [a, c]):
            qs = {a: qa, b: qb, c: qc}
            q = np.concatenate([qs[s] for s in order])
            cu = np.concatenate([[0], np.cumsum([qs[s].shape[0] for s in order])])
            o, lse = m.pool.attend(q, order, cu, return_lse=True, **PRM)
            i = order.index(a)
            r = slice(int(cu[i]), int(cu[i + 1]))
            assert np.array_equal(o[r], ref[0]) and np.array_equal(lse[r], ref[1]), order
        m.check([a], [0, 3], qa, ref[0], ref[1], None, PRM)


# ------------------------------------------------------------------ pages

@pytest.mark.parametrize("device", DEVICES)
def test_fork_copies_a_shared_partial_page_once(device):
    m = Mirror(seed=9, device=device, page_tokens=16)
    with m.pool:
        a = m.add(10)
        m.append(a, 20)  # one full page, one partial
        before = m.pool.info()
        b = m.fork(a)
        info = m.pool.info()
        assert info["pages_used"] == before["pages_used"] == 2 and info["pages_shared"] == 2
        assert info["sequences"] == 2 and info["tokens"] == 40
        assert m.pool.sequence_info(b) == {"tokens": 20, "k_start": 10}
        m.attend([a, b], [2, 2])  # shared pages, nothing copied
        assert m.pool.info()["pages_copied"] == 0
        m.append(a, 3)  # into the shared partial page: copied once
        assert m.pool.info()["pages_copied"] == 1
        m.append_batch([b], [2])  # b now holds the old partial page alone: no copy
        info = m.pool.info()
        assert info["pages_copied"] == 1 and info["pages_shared"] == 1 and info["pages_used"] == 3
        m.attend([b, a], [3, 4])  # divergent branches, both right
        m.append_batch([a, b], [20, 1])
        m.attend([a, b], [21, 2])
        assert m.pool.info()["pages_copied"] == 1

        c = m.add(0)
        m.append(c, 32)  # whole pages only: nothing to copy on write
        d = m.fork(c)
        m.append_batch([c, d], [1, 2])
        assert m.pool.info()["pages_copied"] == 1
        m.attend([c, d], [1, 2])

        e = m.add(-7)
        m.append(e, 5)  # one partial page, three holders
        f, g = m.fork(e), m.fork(e)
        m.append(f, 1)
        m.append(e, 2)
        m.append(g, 3)  # the last holder writes in place
        assert m.pool.info()["pages_copied"] == 3
        m.attend([e, f, g], [1, 1, 3])

        m.remove(a)  # b's shared full page stays
        used = m.pool.info()["pages_used"]
        m.attend([b], [3])
        m.remove(b)
        assert m.pool.info()["pages_used"] < used
        h = m.fork(d)  # fork of a fork
        m.append(h, 40)
        m.attend([h, d, c], [5, 1, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_remove_frees_pages_for_reuse(device):
    m = Mirror(seed=10, device=device, page_tokens=16, capacity_tokens=64)
    with m.pool:
        a = m.add(0)
        m.append(a, 64)
        assert m.pool.info()["pages_free"] == 0
        b = m.add(0)
        with pytest.raises(libape.ApeError):
            m.pool.append(b, m.arr(1, 2, 16), m.arr(1, 2, 16))
        m.attend([a], [1])
        m.remove(a)
        info = m.pool.info()
        assert info["pages_free"] == 4 and info["pages_used"] == 0 and info["sequences"] == 1
        with pytest.raises(ValueError):
            m.pool.attend(m.arr(1, 4, 16), [a], [0, 1])
        # b and c take a's pages, with other values: nothing of a may show through
        m.append(b, 40)
        c = m.add(3)
        m.append_batch([c, b], [14, 0])
        m.attend([b, c], [40, 14])
        assert m.pool.info()["pages_free"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_full_pool_appends_nothing(device):
    m = Mirror(seed=11, device=device, page_tokens=16, capacity_tokens=64)
    with m.pool:
        a, b = m.add(0), m.add(0)
        m.append(a, 40)  # 3 pages, the last with 8 tokens
        m.append(b, 10)  # the fourth
        assert m.pool.info()["pages_free"] == 0
        k = m.arr(7, 2, 16)
        with pytest.raises(libape.ApeError) as e:
            m.pool.append(b, k, k)  # 17 tokens would need a fifth page
        assert e.value.code == -12 and e.value.name == "APE_ENOMEM"
        assert not isinstance(e.value, ValueError)
        assert m.pool.sequence_info(b)["tokens"] == 10
        # a batch whose first sequence fits and second does not: neither gets a token
        kk = m.arr(8 + 9, 2, 16)
        before = m.pool.info()
        with pytest.raises(libape.ApeError, match="APE_ENOMEM"):
            m.pool.append_batch([a, b], [0, 8, 17], kk, kk)
        assert [m.pool.sequence_info(s)["tokens"] for s in (a, b)] == [40, 10]
        assert m.pool.info() == before
        m.attend([a, b], [2, 2])  # the failed appends left the pool as it was
        m.append(a, 4)  # what fits still goes in
        m.attend([a, b], [1, 1])
        # a copy on write needs a free page too
        c = m.fork(a)
        with pytest.raises(libape.ApeError, match="APE_ENOMEM"):
            m.pool.append(c, k[:1], k[:1])
        assert m.pool.sequence_info(c)["tokens"] == 44 and m.pool.info()["pages_copied"] == 0
        m.remove(b)
        m.append(c, 1)
        assert m.pool.info()["pages_copied"] == 1 and m.pool.info()["pages_free"] == 0
        m.attend([c, a], [2, 2])


def test_unknown_ids_are_value_errors():
    with libape.KVPool(1, 8, 64, device="ref") as pool:
        a = pool.add_sequence()
        z = np.zeros((1, 1, 8), np.float32)
        for call in (lambda: pool.append(a + 1, z, z), lambda: pool.fork(a + 1),
                     lambda: pool.remove(a + 1), lambda: pool.sequence_info(-1),
                     lambda: pool.attend(z, [a + 1], [0, 1])):
            with pytest.raises(ValueError, match="%d|-1" % (a + 1)):
                call()
        with pytest.raises(ValueError, match=r"seq_ids\[1\] = 7"):
            pool.append_batch([a, 7], [0, 1, 1], z, z)
        with pytest.raises(ValueError, match="seq_id"):
            pool.append("0", z, z)
        pool.remove(a)
        with pytest.raises(ValueError, match="not a sequence"):
            pool.remove(a)
        with pytest.raises(ValueError, match="not a sequence"):
            pool.append(a, z, z)
        b = pool.add_sequence()
        assert b != a  # ids are not reused
        with pytest.raises(ValueError, match="cu_seqlens"):
            pool.append_batch([b], [0], z, z)  # nseq + 1 offsets
        with pytest.raises(ValueError):
            pool.append(b, z.astype(np.float16), z.astype(np.float16))  # the pool's dtype
        with libape.KVPool(1, 8, 64, device="ref") as other:
            c = other.add_sequence()
            if c != b:
                with pytest.raises(ValueError):
                    pool.sequence_info(c)
    with pytest.raises(ValueError, match="closed"):
        pool.info()
    with pytest.raises(ValueError, match="dtype"):
        libape.KVPool(1, 8, 64, dtype="int8", device="ref")
    with pytest.raises(ValueError, match="capacity_tokens"):
        libape.KVPool(1, 8, 0, device="ref")


# ------------------------------------------------------------------ the binding

@pytest.mark.parametrize("kind", ["numpy", pytest.param("torch", marks=needs_torch)])
def test_strided_views_go_without_copies(kind, monkeypatch):
    """Slices of a packed QKV buffer reach the C calls as they are, appends and attends."""
    seen = {}
    name = "_torch_array" if kind == "torch" else "_as_array"
    real = getattr(core, name)

    def spy(n, x):
        arr = real(n, x)
        seen.setdefault(n, []).append(arr.fields[0])
        return arr
    m = Mirror(seed=12, kind=kind, H=2, Hkv=2)
    with m.pool:
        a = m.add(0)
        qkv = m.arr(10, 3, 2, 16)  # [total, (q, k, v), H, D]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        monkeypatch.setattr(core, name, spy)
        m.pool.append(a, k, v)
        m.pool.append_batch([a], np.array([0, 10], np.int32), k, v)
        o, lse = m.pool.attend(q, [a], [0, 10], return_lse=True, **PRM)
        monkeypatch.undo()
        m.seqs[a][1] += [k, k]
        m.seqs[a][2] += [v, v]
        m.check([a], [0, 10], q, o, lse, None, PRM)
    ptr = (lambda x: x.data_ptr()) if kind == "torch" else (lambda x: x.ctypes.data)
    assert seen["k"] == [ptr(k)] * 2 and seen["v"] == [ptr(v)] * 2 and seen["q"] == [ptr(q)]


def test_stats_and_per_head_parameters():
    m = Mirror(seed=13)
    with m.pool:
        a = m.add(0)
        m.append(a, 33)
        m.attend([a], [4], delta=[0.3, 0.0, 0.1, 0.05], lam=[0.2, 0.0, 0.1, 0.4])
        o, st = m.pool.attend(m.arr(4, 4, 16), [a], [0, 4], stats=True)
        assert o.shape == (4, 4, 16) and st["pairs_visible"] > 0
        o, lse, st = m.pool.attend(m.arr(0, 4, 16), [], [0], return_lse=True, stats=True)
        assert o.shape == (0, 4, 16) and lse.shape == (0, 4)  # an empty batch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_statistics_change_no_bit(device, dtype):
    """An attend without statistics (on a device that reads host memory, one key chunk: its
    launch writes o and lse in place) and the same attend with them (merged into the session's
    accumulators): the same bits, under decay with skipping, for one sequence and a batch."""
    rng = np.random.default_rng(17)
    H, Hkv, D = 4, 2, 32
    with libape.KVPool(Hkv=Hkv, D=D, H=H, capacity_tokens=1024, page_tokens=16,
                       dtype=dtype, device=device) as pool:
        ids = [pool.add_sequence() for _ in range(3)]
        for sid, n in zip(ids, (300, 17, 129)):
            pool.append(sid, *(rng.standard_normal((n, Hkv, D)).astype(dtype) for _ in "kv"))
        for seqs, cu in (([ids[0]], [0, 1]), (ids, [0, 1, 3, 6])):
            q = rng.standard_normal((cu[-1], H, D)).astype(dtype)
            o1, l1 = pool.attend(q, seqs, cu, return_lse=True, **PRM)
            o2, l2, st = pool.attend(q, seqs, cu, return_lse=True, stats=True, **PRM)
            assert st["pairs_computed"] > 0
            assert np.array_equal(o1, o2) and np.array_equal(l1, l2)


def test_exit_with_a_pool_open():
    """A pool still open at exit is closed before its context is destroyed."""
    code = ("import numpy as np, libape\n"
            "p = libape.KVPool(Hkv=2, D=16, capacity_tokens=64, device='ref')\n"
            "a = p.add_sequence()\n"
            "x = np.ones((4, 2, 16), np.float32)\n"
            "p.append(a, x, x)\n"
            "print('open at exit')\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "open at exit" in r.stdout, r.stderr


def test_serve_example():
    ex = os.path.join(HERE, "..", "examples", "serve.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), HERE]))
    r = subprocess.run([sys.executable, ex, "--requests", "5", "--steps", "40"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens/s" in r.stdout and "pages used" in r.stdout and "agree" in r.stdout, r.stdout


@pytest.mark.parametrize("device", DEVICES)
def test_release_unreachable(device):
    """KVPool(max_query_norm=...).release_unreachable(): the oldest pages the proof covers go
    back to the pool; decodes stay right over every token; an attend that breaks the release's
    terms (here an earlier position) raises ApeError; a pool without max_query_norm refuses."""
    seed = dict(delta=0.4, beta=0.02, gamma=0.02, lam=0.1)
    m = Mirror(seed=5, device=device, H=2, Hkv=1, D=32, capacity_tokens=4096,
               max_query_norm=12.0, max_batch_tokens=64)
    with m.pool:
        a = m.add(-40)
        m.append(a, 2000)
        free = m.pool.info()["pages_free"]
        n = m.pool.release_unreachable(a, **seed)
        assert n > 0 and n % 16 == 0
        assert m.pool.info()["pages_free"] == free + n // 16
        m.attend([a], [1], **seed)  # checked against every token appended
        m.append(a, 1)
        m.attend([a], [1], **seed)
        with pytest.raises(libape.ApeError, match="released for queries at positions"):
            m.pool.attend(m.arr(1, 2, 32), [a], [0, 1], positions_q=[0], **seed)
    with libape.KVPool(Hkv=1, D=32, capacity_tokens=64, device=device) as pool:
        s = pool.add_sequence()
        with pytest.raises(libape.ApeError, match="max_query_norm"):
            pool.release_unreachable(s, **seed)
