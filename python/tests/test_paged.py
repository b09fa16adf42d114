"""libape.PagedKV (ape_paged_kv_*): paged attention over the caller's own page buffers. Every
run is checked against the float64 reference (aperef.py) sequence by sequence, and with
skip_tol=0 against libape.KVPool holding the same tokens on the same device, bit for bit (the
two share one code path): FlashInfer's CSR table and vLLM's block table giving the same bits,
the NHD, HND and 5-D (K and V in one buffer) layouts and strided views too, pages shared
between sequences, scrambled page order, one plan run by two layers, GQA and MHA, float16 and
float32 (torch bfloat16), explicit positions, torch tables and pages, the host pages read where
they lie (never copied), the copying path, and the validation errors with libape's messages."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import libape
from aperef import ape64
from conftest import ROOT

DEVICES = [d["spec"] for d in libape.devices()]
PRM = dict(delta=0.05, beta=0.02, gamma=0.03, lam=0.2)
TOL = {"float32": (1e-4, 1e-4), "float16": (5e-3, 1e-3), "bfloat16": (2e-2, 5e-3)}

try:
    import torch
except ImportError:  # the NumPy tests still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed here")


def f64(x):
    if type(x).__module__.startswith("torch"):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


class Scene:
    """Pages [num_pages, P, Hkv, D] (NHD) of random keys and values, and sequences over them:
    each a list of page ids (scrambled, some shared with another sequence), its tokens and the
    position of its first token. Spare pages hold values no sequence may see."""

    def __init__(self, seed=0, P=4, lens=(10, 9, 0, 1, 16), k_starts=(0, 0, 5, 100, -7),
                 share=(1, 0, 2), H=4, Hkv=2, D=16, dtype="float32", spare=5):
        self.rng = np.random.default_rng(seed)
        self.P, self.H, self.Hkv, self.D, self.dtype = P, H, Hkv, D, dtype
        self.lens, self.k_starts = list(lens), list(k_starts)
        npg = [-(-n // P) for n in lens]
        self.N = sum(npg) + spare
        ids = self.rng.permutation(self.N)
        self.pages, at = [], 0
        for n in npg:
            self.pages.append([int(x) for x in ids[at:at + n]])
            at += n
        if share:  # sequence b's first m pages are a's (a prefix shared by a fork)
            b, a, m = share
            assert lens[a] >= m * P and lens[b] > m * P
            self.pages[b][:m] = self.pages[a][:m]
        self.k = self.arr(self.N, P, Hkv, D)
        self.v = self.arr(self.N, P, Hkv, D)

    def arr(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32).astype(self.dtype)

    def tokens(self, s, k=None, v=None):
        """Sequence s's keys and values [n, Hkv, D] gathered from the pages."""
        k = self.k if k is None else k
        v = self.v if v is None else v
        pg, n = self.pages[s], self.lens[s]
        if not pg:
            return k[:0, 0], v[:0, 0]
        return (k[pg].reshape(-1, self.Hkv, self.D)[:n], v[pg].reshape(-1, self.Hkv, self.D)[:n])

    def csr(self):
        indptr = np.concatenate([[0], np.cumsum([len(p) for p in self.pages])])
        indices = [x for p in self.pages for x in p]
        last = [n - (len(p) - 1) * self.P if p else 0 for p, n in zip(self.pages, self.lens)]
        return dict(indptr=indptr, indices=indices, last_page_len=last)

    def block_table(self):
        """vLLM's: a row per sequence, wider than needed and one row more, the unread entries
        garbage."""
        w = max(len(p) for p in self.pages) + 2
        bt = np.full((len(self.pages) + 1, w), -1, dtype=np.int32)
        for s, p in enumerate(self.pages):
            bt[s, :len(p)] = p
            bt[s, len(p):] = 10 ** 6 + s
        return dict(block_table=bt, seq_lens=np.array(self.lens, dtype=np.int32))

    def batch(self, rows):
        cu = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        return self.arr(int(cu[-1]), self.H, self.D), cu

    def paged(self, device, **kw):
        return libape.PagedKV(Hkv=self.Hkv, D=self.D, page_tokens=self.P, num_pages=self.N,
                              H=self.H, dtype=self.dtype, device=device, **kw)

    def pool_run(self, device, q, cu, positions=None, k=None, v=None, **prm):
        """The same rows through a KVPool holding the same tokens: (o, lse)."""
        with libape.KVPool(self.Hkv, self.D, sum(self.lens) + 64 * self.P, H=self.H,
                           page_tokens=self.P, dtype=self.dtype, device=device) as pool:
            ids = []
            for s, ks in enumerate(self.k_starts):
                ids.append(pool.add_sequence(ks))
                if self.lens[s]:
                    pool.append(ids[-1], *self.tokens(s, k, v))
            return pool.attend(q, ids, cu, positions_q=positions, return_lse=True, **prm)

    def check(self, q, cu, o, lse, positions=None, k=None, v=None, **prm):
        """Each sequence's rows against the float64 reference over its tokens."""
        to, tl = TOL[self.dtype]
        o, lse, qq = f64(o), f64(lse), f64(q)
        p = dict(PRM)
        p.update(prm)
        p.pop("skip_tol", None)
        for s in range(len(self.lens)):
            a, b = int(cu[s]), int(cu[s + 1])
            if a == b:
                continue
            ks, vs = (f64(x) for x in self.tokens(s, k, v))
            n = self.lens[s]
            kw = dict(k_start=self.k_starts[s])
            if positions is not None:
                kw = dict(positions_q=np.asarray(positions)[a:b],
                          positions_k=self.k_starts[s] + np.arange(n))
            wo, wl = ape64(qq[a:b].transpose(1, 0, 2)[None], ks.transpose(1, 0, 2)[None],
                           vs.transpose(1, 0, 2)[None], **p, **kw)
            wo, wl = wo[0].transpose(1, 0, 2), wl[0].T
            m = max(1.0, np.abs(vs).max()) if n else 1.0
            assert np.abs(o[a:b] - wo).max() <= to * m, (s, np.abs(o[a:b] - wo).max())
            fin = np.isfinite(wl)
            assert (np.isfinite(lse[a:b]) == fin).all(), s
            assert (np.abs(lse[a:b][fin] - wl[fin]) <= tl * np.maximum(1, np.abs(wl[fin]))).all()
            assert (o[a:b][~fin] == 0).all(), s


def same(x, y):
    assert np.array_equal(f64(x[0]), f64(y[0]), equal_nan=True)
    assert np.array_equal(f64(x[1]), f64(y[1]))


ROWS = [3, 1, 2, 1, 5]  # a prefill chunk's end, decodes, rows of a sequence of no key


# ------------------------------------------------------------------ the ctypes mirrors

def test_struct_layouts_match_the_header(tmp_path):
    """ApePagedKvOptions, ApePageTable and ApeDTensor against the C compiler's sizes and
    offsets."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    from libape import _capi
    structs = {"ape_paged_kv_options": _capi.ApePagedKvOptions,
               "ape_page_table": _capi.ApePageTable, "ape_dtensor": _capi.ApeDTensor}
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


# ------------------------------------------------------------------ results

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_matches_reference_and_kvpool(device, dtype):
    """GQA (H 4, Hkv 2), scrambled pages, a prefix shared by two sequences, an empty
    sequence, a full last page, negative and large k_start: the reference within the spec's
    tolerance; the KVPool's bits with skip_tol=0, and within the tolerance with the default."""
    sc = Scene(seed=1, dtype=dtype)
    q, cu = sc.batch(ROWS)
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr())
        o, lse = pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM)
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[0], sc.H)
        sc.check(q, cu, o, lse)
        assert (o[4:6] == 0).all() and np.isneginf(lse[4:6]).all()  # no key: O 0, LSE -inf
        same((o, lse), sc.pool_run(device, q, cu, skip_tol=0, **PRM))
        o2, lse2 = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)  # default skip_tol
        sc.check(q, cu, o2, lse2)
        o3 = pk.run(q, sc.k, sc.v, **PRM)  # no lse wanted
        assert np.array_equal(o3, o2)
        o4, st = pk.run(q, sc.k, sc.v, stats=True, **PRM)
        assert np.array_equal(o4, o2) and st["pairs_visible"] > 0 and st["backend"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("P", [1, 16])
def test_page_sizes_and_mha(device, P):
    sc = Scene(seed=2, P=P, lens=(40, 33, 7), k_starts=(3, 3, 0), share=(1, 0, 32 // P),
               H=3, Hkv=3, D=8)
    q, cu = sc.batch([4, 1, 7])
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.block_table())
        o, lse = pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM)
        sc.check(q, cu, o, lse)
        same((o, lse), sc.pool_run(device, q, cu, skip_tol=0, **PRM))


@pytest.mark.parametrize("device", DEVICES)
def test_csr_and_block_table_identical(device):
    sc = Scene(seed=3)
    q, cu = sc.batch(ROWS)
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        a = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        pk.plan(cu, **sc.block_table(), k_start=np.array(sc.k_starts, np.int32))
        b = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        same(a, b)
        sc.k_starts = [0] * 5  # no k_start: every sequence from position 0
        pk.plan(cu, **sc.csr())
        c = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        sc.check(q, cu, *c)
        bt = sc.block_table()
        pk.plan(list(cu), block_table=bt["block_table"].tolist(), seq_lens=list(sc.lens))
        same(c, pk.run(q, sc.k, sc.v, return_lse=True, **PRM))


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_identical(device):
    """NHD, HND, 5-D [num_pages, 2, ...] of both, strided views (pages inside a wider
    buffer, HND as a transposed view of NHD memory), an object with __dlpack__: the same
    bits."""
    sc = Scene(seed=4)
    q, cu = sc.batch(ROWS)
    k, v = sc.k, sc.v
    kh, vh = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    wide = np.zeros((2,) + k.shape[:3] + (sc.D + 6,), k.dtype)  # K and V in wider rows
    wide[0, ..., 3:3 + sc.D], wide[1, ..., 3:3 + sc.D] = k, v

    class Dl:  # a foreign array with __dlpack__
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        ref = pk.run(q, k, v, return_lse=True, **PRM)
        sc.check(q, cu, *ref)
        runs = [
            dict(k_pages=kh, v_pages=vh, kv_layout="HND"),
            dict(k_pages=np.stack([k, v], axis=1), v_pages=None),
            dict(k_pages=np.stack([kh, vh], axis=1), v_pages=None, kv_layout="HND"),
            dict(k_pages=wide[0, ..., 3:3 + sc.D], v_pages=wide[1, ..., 3:3 + sc.D]),
            dict(k_pages=k.transpose(0, 2, 1, 3), v_pages=v.transpose(0, 2, 1, 3), kv_layout="HND"),
            dict(k_pages=np.stack([vh, kh], axis=1)[:, ::-1], v_pages=None, kv_layout="HND"),
            dict(k_pages=Dl(k), v_pages=Dl(v)),
        ]
        for i, kw in enumerate(runs):
            kp, vp = kw.pop("k_pages"), kw.pop("v_pages")
            if kp.__class__ is np.ndarray and kp.strides[1] < 0:
                with pytest.raises(ValueError, match="negative or broadcast"):
                    pk.run(q, kp, vp, **kw, **PRM)
                continue
            same(ref, pk.run(q, kp, vp, return_lse=True, **kw, **PRM))


@pytest.mark.parametrize("device", DEVICES)
def test_plan_reused_by_two_layers(device):
    """One plan, two layers: each its own pages and parameters (per-head ones too), each right;
    running the first layer again gives its bits again."""
    sc = Scene(seed=5)
    q, cu = sc.batch(ROWS)
    k2, v2 = sc.arr(*sc.k.shape), sc.arr(*sc.k.shape)
    p2 = dict(delta=[0.1, 0.0, 0.2, 0.05], beta=0.0, gamma=[0.0, 0.01, 0.02, 0.03], lam=0.0,
              causal=False, scale=0.3, rope_base=500.0)
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.block_table(), k_start=sc.k_starts)
        a = pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM)
        b = pk.run(q, np.stack([k2, v2], axis=1), None, return_lse=True, skip_tol=0, **p2)
        sc.check(q, cu, *a, skip_tol=0)
        sc.check(q, cu, *b, k=k2, v=v2, **p2)
        same(b, sc.pool_run(device, q, cu, k=k2, v=v2, skip_tol=0, **p2))
        same(a, pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM))
        assert pk.info()["planned"] and pk.info()["total_q"] == sum(ROWS)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_positions(device):
    """positions_q: draft rows sharing a position, gaps, a row re-scored earlier, one before
    the sequence's first key (sees none), rows past the newest key."""
    sc = Scene(seed=6, lens=(10, 9, 3), k_starts=(100, 0, -4), share=(1, 0, 2))
    pos = np.array([109, 109, 111, 103, 99, 8, 8, 20, -2, -5])
    q, cu = sc.batch([5, 3, 2])
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts, positions_q=pos)
        o, lse = pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM)
        sc.check(q, cu, o, lse, positions=pos)
        assert np.isneginf(lse[9]).all() and (o[9] == 0).all()
        same((o, lse), sc.pool_run(device, q, cu, positions=pos, skip_tol=0, **PRM))
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts, positions_q=pos.astype(np.int32).tolist())
        same((o, lse), pk.run(q, sc.k, sc.v, return_lse=True, skip_tol=0, **PRM))


def test_empty_batch_and_info():
    sc = Scene(seed=7)
    with sc.paged("ref", max_batch_tokens=0) as pk:
        info = pk.info()
        assert info == dict(Hkv=2, H=4, D=16, page_tokens=4, num_pages=sc.N,
                            max_batch_tokens=256, attend_chunk=4096, max_device_bytes=0,
                            dtype="float32", device="ref:0", pages_in_place=True,
                            planned=False, sequences=0, total_q=0)
        pk.plan([0], indptr=[0], indices=[], last_page_len=[])
        o, lse = pk.run(np.zeros((0, 4, 16), np.float32), sc.k, sc.v, return_lse=True)
        assert o.shape == (0, 4, 16) and lse.shape == (0, 4)
        pk.plan([0, 0], block_table=np.zeros((1, 0), np.int64), seq_lens=[0])
        assert pk.info()["sequences"] == 1 and pk.info()["planned"]
        pk.run(np.zeros((0, 4, 16), np.float32), sc.k, sc.v)


# ------------------------------------------------------------------ host memory, torch

def test_pages_read_where_they_lie(monkeypatch):
    """On a device that reads host memory in place, the C call gets the arrays' own memory
    (their address and span), and a write into a page shows in the next run."""
    sc = Scene(seed=8)
    q, cu = sc.batch(ROWS)
    lent = []
    real = libape.PagedKV._lend

    def spy(self, role, ptr, nbytes):
        lent.append((role, ptr, nbytes))
        return real(self, role, ptr, nbytes)
    monkeypatch.setattr(libape.PagedKV, "_lend", spy)
    with sc.paged("ref") as pk:
        assert pk.info()["pages_in_place"]
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        kv = np.stack([sc.k, sc.v], axis=1)
        pk.run(q, sc.k, sc.v)
        pk.run(q, kv, None)
        assert lent == [("k_pages", sc.k.ctypes.data, sc.k.nbytes),
                        ("v_pages", sc.v.ctypes.data, sc.v.nbytes),
                        ("k_pages", kv.ctypes.data, kv.nbytes)]
        sc.v[sc.pages[0][0]] += 1.0  # a page of sequences 0 and 1
        o, lse = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        sc.check(q, cu, o, lse)


@pytest.mark.parametrize("device", DEVICES)
def test_copying_path(device):
    """A device that cannot read host memory copies the pages to its own buffers on each run
    (forced here on one that can): the same bits."""
    sc = Scene(seed=9)
    q, cu = sc.batch(ROWS)
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        a = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        pk._in_place = False
        same(a, pk.run(q, sc.k, sc.v, return_lse=True, **PRM))
        same(a, pk.run(q, np.stack([sc.k, sc.v], axis=1), None, return_lse=True, **PRM))
        sc.k[:] = sc.arr(*sc.k.shape)  # new keys: copied again
        b = pk.run(q, sc.k, sc.v, return_lse=True, **PRM)
        sc.check(q, cu, *b)
        assert len(pk._stage) == 2 and pk._queue is not None


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch(device, dtype):
    """torch CPU pages (a 5-D buffer, and an HND view), torch int32 tables and positions, torch
    q in, torch O and LSE out."""
    sc = Scene(seed=10)
    tk = torch.from_numpy(sc.k).to(getattr(torch, dtype))
    tv = torch.from_numpy(sc.v).to(getattr(torch, dtype))
    sc.k, sc.v, sc.dtype = f64(tk).astype(np.float32), f64(tv).astype(np.float32), dtype
    q, cu = Scene(seed=11).batch(ROWS)
    tq = torch.from_numpy(q).to(getattr(torch, dtype))
    i32 = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32)
    with libape.PagedKV(2, 16, 4, sc.N, H=4, dtype=getattr(torch, dtype), device=device) as pk:
        bt = sc.block_table()
        pk.plan(i32(cu), block_table=i32(bt["block_table"]), seq_lens=i32(bt["seq_lens"]),
                k_start=i32(sc.k_starts))
        o, lse = pk.run(tq, tk, tv, return_lse=True, **PRM)
        assert isinstance(o, torch.Tensor) and o.dtype == tq.dtype and o.shape == tq.shape
        assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
        sc.check(tq, cu, o, lse)
        c = sc.csr()
        pk.plan(i32(cu), **{n: i32(x) for n, x in c.items()}, k_start=i32(sc.k_starts))
        same((o, lse), pk.run(tq, torch.stack([tk, tv], 1), None, return_lse=True, **PRM))
        same((o, lse), pk.run(tq, tk.transpose(1, 2), tv.transpose(1, 2), kv_layout="HND",
                              return_lse=True, **PRM))
        if dtype == "float32":  # NumPy q over torch pages, and the reverse
            same((o, lse), pk.run(q, tk, tv, return_lse=True, **PRM))
            same((o, lse), pk.run(tq, sc.k, sc.v, return_lse=True, **PRM))


# ------------------------------------------------------------------ errors

def test_plan_errors_carry_libape_messages():
    sc = Scene(seed=12, lens=(6, 3), k_starts=(0, 0), share=None, spare=2)
    N = sc.N
    q, cu = sc.batch([2, 1])
    with sc.paged("ref") as pk:
        with pytest.raises(libape.ApeValueError, match="no plan"):
            pk.run(q, sc.k, sc.v)  # run before plan
        pk.plan(cu, **sc.csr())
        pk.run(q, sc.k, sc.v)
        bad = [
            (dict(indptr=[0, 2, 3], indices=[0, N, 2], last_page_len=[2, 3]),
             r"pt->indices\[1\] = %d: no such page \(sequence 0; num_pages = %d\)" % (N, N)),
            (dict(indptr=[0, 2, 3], indices=[0, -1, 2], last_page_len=[2, 3]),
             r"pt->indices\[1\] = -1: no such page"),
            (dict(indptr=[0, 2, 3], indices=[4, 4, 2], last_page_len=[2, 3]),
             r"pt->indices\[1\] = 4: sequence 0 holds page 4 twice"),
            (dict(indptr=[0, 2, 3], indices=[0, 1, 2], last_page_len=[0, 3]),
             r"pt->last_page_len\[0\] = 0: must be in 1..page_tokens for a sequence of 2 pages"),
            (dict(indptr=[0, 2, 3], indices=[0, 1, 2], last_page_len=[2, 5]),
             r"pt->last_page_len\[1\] = 5"),
            (dict(indptr=[0, 2, 1], indices=[0, 1, 2], last_page_len=[2, 3]),
             r"pt->indptr\[2\] = 1 < pt->indptr\[1\] = 2"),
            (dict(block_table=[[0, 0], [2, 3]], seq_lens=[6, 3]),
             r"pt->block_table\[1\] = 0: sequence 0 holds page 0 twice"),
            (dict(block_table=[[0], [2]], seq_lens=[6, 3]),
             r"pt->seq_lens\[0\] = 6 needs 2 pages: more than pt->block_table_stride = 1"),
        ]
        for table, msg in bad:
            with pytest.raises(libape.ApeValueError, match="ape_paged_kv_plan: " + msg):
                pk.plan(cu, **table)
            assert not pk.info()["planned"]
            with pytest.raises(ValueError, match="no plan"):  # a failed plan leaves none
                pk.run(q, sc.k, sc.v)
        pk.plan(cu, **sc.csr())  # pages 0, 1 of sequence 0 and page 2 of 1 ... shared is fine
        pk.plan(cu, indptr=[0, 2, 3], indices=[0, 1, 0], last_page_len=[2, 3])
        with pytest.raises(libape.ApeValueError, match=r"cu_seqlens_q\[2\] = 300: the rows "
                           "must number 0..max_batch_tokens = 256"):
            pk.plan([0, 1, 300], **sc.csr())
        with pytest.raises(libape.ApeError, match=r"k_start\[1\]"):
            pk.plan(cu, **sc.csr(), k_start=[0, 2 ** 62])
        # the package's own checks, before libape
        for kw, msg in [(dict(sc.csr(), **sc.block_table()), "both a CSR table"),
                        (dict(), "no page table"),
                        (dict(indptr=[0, 2, 3], last_page_len=[2, 3]), "indices missing"),
                        (dict(block_table=[[0, 1], [2, 3]]), "seq_lens missing"),
                        (dict(indptr=[0, 2, 3], indices=[0], last_page_len=[2, 3]),
                         r"indices: 1 entries, fewer than indptr\[2\] = 3"),
                        (dict(block_table=[0, 1, 2], seq_lens=[6, 3]), "block_table: .* 2-D"),
                        (dict(block_table=[[0, 1]], seq_lens=[6, 3]), "1 rows"),
                        (dict(sc.csr(), k_start=[0]), "k_start: 1 values"),
                        (dict(indptr=[0.0, 2.0, 3.0], indices=[0, 1, 2], last_page_len=[2, 3]),
                         "indptr: dtype float64")]:
            with pytest.raises(ValueError, match=msg):
                pk.plan(cu, **kw)
        with pytest.raises(ValueError, match="cu_seqlens_q: 2 values: must be nseq"):
            pk.plan([0, 3], **sc.csr())
        with pytest.raises(ValueError, match="positions_q: 2 values"):
            pk.plan(cu, **sc.csr(), positions_q=[1, 2])


def test_run_errors():
    sc = Scene(seed=13, lens=(6, 3), k_starts=(0, 0), share=None, spare=2)
    q, cu = sc.batch([2, 1])
    with sc.paged("ref") as pk:
        pk.plan(cu, **sc.csr())
        with pytest.raises(libape.ApeValueError,
                           match=r"ape_paged_kv_run: q->shape\[2\] = 2: the plan has 3 query rows"):
            pk.run(q[:2], sc.k, sc.v)  # wrong q rows
        with pytest.raises(libape.ApeValueError, match=r"k_pages->dtype = f16: must be f32"):
            pk.run(q, sc.k.astype(np.float16), sc.v.astype(np.float16))
        with pytest.raises(libape.ApeValueError, match="v_pages: strides .* differ from k_pages"):
            pk.run(q, sc.k, np.ascontiguousarray(sc.v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3))
        with pytest.raises(ValueError, match=r"k_pages: shape \(%d, 2, 4, 16\): must be "
                           r"\[num_pages, page_tokens, Hkv, D\]" % sc.N):
            pk.run(q, sc.k.transpose(0, 2, 1, 3), sc.v)  # HND given as NHD
        with pytest.raises(ValueError, match="must be 5-D"):
            pk.run(q, sc.k, None)
        with pytest.raises(ValueError, match=r"must be \[num_pages, 2, page_tokens"):
            pk.run(q, np.stack([sc.k, sc.v, sc.v], axis=1), None)
        with pytest.raises(ValueError, match="the D axis must be contiguous"):
            pk.run(q, np.asfortranarray(sc.k), np.asfortranarray(sc.v))
        with pytest.raises(ValueError, match="negative or broadcast"):
            pk.run(q, sc.k[::-1], sc.v[::-1])
        with pytest.raises(ValueError, match="negative or broadcast"):
            pk.run(q, np.broadcast_to(sc.k[:1], sc.k.shape), sc.v)
        with pytest.raises(ValueError, match="kv_layout = 'half'.*the rotation's is layout"):
            pk.run(q, sc.k, sc.v, kv_layout="half")
        with pytest.raises(ValueError, match="layout = 'NHD'.*kv_layout"):
            pk.run(q, sc.k, sc.v, layout="NHD")
        with pytest.raises(ValueError, match="dtype float64"):
            pk.run(q, sc.k.astype(np.float64), sc.v)
        with pytest.raises(ValueError, match="not an array"):
            pk.run(q, "pages", sc.v)
        with pytest.raises(libape.ApeValueError, match="q->dtype"):
            pk.run(q.astype(np.float16), sc.k, sc.v)
        pk.run(q, sc.k, sc.v)  # the plan stays through failed runs
    with pytest.raises(ValueError, match="closed"):
        pk.plan(cu, **sc.csr())
    with pytest.raises(ValueError, match="closed"):
        pk.info()
    with pytest.raises(libape.ApeValueError, match="opts->page_tokens = 0"):
        libape.PagedKV(2, 16, 0, 8, device="ref")
    with pytest.raises(libape.ApeValueError, match="opts->num_pages = 0"):
        libape.PagedKV(2, 16, 4, 0, device="ref")
    with pytest.raises(ValueError, match="dtype"):
        libape.PagedKV(2, 16, 4, 8, dtype="int8", device="ref")


def test_exit_with_an_object_open():
    """A PagedKV still open at exit (with device copies and a queue) is closed before its
    context is destroyed."""
    code = ("import numpy as np, libape\n"
            "pk = libape.PagedKV(Hkv=1, D=8, page_tokens=2, num_pages=3, device='ref')\n"
            "pk.plan([0, 1], indptr=[0, 2], indices=[2, 0], last_page_len=[1])\n"
            "pk._in_place = False\n"
            "x = np.ones((3, 2, 1, 8), np.float32)\n"
            "o = pk.run(np.ones((1, 1, 8), np.float32), x, x)\n"
            "print('open at exit', float(o[0, 0, 0]))\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "open at exit 1.0" in r.stdout, r.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_diagnostics_equal_the_pools(device):
    """return_diagnostics=True: entropy and mean distance, bit for bit those of a KVPool
    holding the same tokens (skip_tol=0, so neither leaves a key out); 0 for rows that see no
    key."""
    sc = Scene(seed=5)
    q, cu = sc.batch(ROWS)
    with sc.paged(device) as pk:
        pk.plan(cu, **sc.csr(), k_start=sc.k_starts)
        a = pk.run(q, sc.k, sc.v, return_lse=True, return_diagnostics=True, skip_tol=0, **PRM)
        b = sc.pool_run(device, q, cu, skip_tol=0, return_diagnostics=True, **PRM)
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert np.array_equal(f64(x), f64(y))
        assert (a[2][4:6] == 0).all() and (a[3][4:6] == 0).all()
        sc.check(q, cu, a[0], a[1])
