"""stats=True: the C call's ape_stats as a dict after the results (libape.attention,
attention_backward, attention_varlen, attention_varlen_backward, KVCache.attend), against
ape-run --stats on the same inputs, with the results unchanged."""
import os
import re
import subprocess

import numpy as np
import pytest

import libape
from conftest import BUILD, has_backend

FIELDS = {"pairs_visible", "pairs_computed", "kernel_ms", "total_ms", "bytes_to_device",
          "bytes_from_device", "backend", "device", "chunks", "chunks_skipped", "chunk_q",
          "chunk_k", "pipeline_depth", "devices", "device_budget", "peak_device_bytes",
          "bytes_device_to_device", "copy_ms", "overlap_ms", "path"}


def qkv(seed, B=1, H=2, Hkv=2, L=40, D=16):
    r = np.random.default_rng(seed)
    return [r.standard_normal((B, h, L, D)).astype(np.float32) for h in (H, Hkv, Hkv)]


def causal_pairs(Lq, Lk):
    """Visible pairs of one head, queries end-aligned to the keys."""
    return sum(min(Lk, Lk - Lq + i + 1) for i in range(Lq))


@pytest.mark.parametrize("device", ["ref", "opencl"])
def test_forward_stats_are_ape_run_s(tmp_path, device):
    if not has_backend(device):
        pytest.skip("no OpenCL device here (libape.backends() says why)")
    q, k, v = qkv(1)
    o0, lse0 = libape.attention(q, k, v, device=device, return_lse=True)
    o, lse, st = libape.attention(q, k, v, device=device, return_lse=True, stats=True)
    assert np.array_equal(o, o0) and np.array_equal(lse, lse0)
    assert set(st) == FIELDS
    assert st["backend"] == device and st["devices"] == 1 and st["device"]
    assert st["pairs_visible"] == 2 * causal_pairs(40, 40)
    assert 0 < st["pairs_computed"] <= st["pairs_visible"] and st["chunks"] >= 1
    assert st["total_ms"] > 0 and st["kernel_ms"] >= 0
    o1, st1 = libape.attention(q, k, v, device=device, stats=True, skip_tol=0.0)
    assert np.abs(o1 - o0).max() <= 1e-5  # skipping at 2^-24 moves O by far less
    assert st1["pairs_computed"] == st1["pairs_visible"]
    # the same call through ape-run --stats: the counts it prints are the dict's
    for name, x in zip("qkv", (q, k, v)):
        np.save(str(tmp_path / (name + ".npy")), x)
    out = subprocess.run([os.path.join(BUILD, "bin", "ape-run"), "-q", str(tmp_path / "q.npy"),
                          "-k", str(tmp_path / "k.npy"), "-v", str(tmp_path / "v.npy"),
                          "-o", str(tmp_path / "o.npy"), "--backend", device, "--stats"],
                         capture_output=True, text=True, check=True).stderr
    m = re.search(r"pairs visible (\d+), computed (\d+)", out)
    assert m, out
    assert (int(m.group(1)), int(m.group(2))) == (st["pairs_visible"], st["pairs_computed"])
    m = re.search(r"chunks computed (\d+), skipped (\d+) \((\d+) x (\d+) rows, (\d+) in flight, "
                  r"(\d+) device", out)
    assert m, out
    assert tuple(int(x) for x in m.groups()) == (st["chunks"], st["chunks_skipped"],
                                                  st["chunk_q"], st["chunk_k"],
                                                  st["pipeline_depth"], st["devices"])
    m = re.search(r"bytes copied to device (\d+), from device (\d+), within device (\d+)", out)
    assert m, out
    assert tuple(int(x) for x in m.groups()) == (st["bytes_to_device"], st["bytes_from_device"],
                                                  st["bytes_device_to_device"])
    assert re.search(r"backend %s, device %s" % (device, re.escape(st["device"])), out), out
    # the kernel path: the reference's own, OpenCL's general kernel at lambda != 0 (counting
    # pairs keeps launches off the split path), both named as ape-run names them
    assert st["path"] == ("reference" if device == "ref" else "general"), st
    assert "kernel path %s " % st["path"] in out, out


def test_backward_and_ragged_stats():
    q, k, v = qkv(2)
    o, lse = libape.attention(q, k, v, device="ref", return_lse=True)
    g0 = libape.attention_backward(q, k, v, o, lse, o, device="ref")
    *g, st = libape.attention_backward(q, k, v, o, lse, o, device="ref", stats=True)
    assert all(np.array_equal(a, b) for a, b in zip(g, g0))
    assert set(st) == FIELDS and st["backend"] == "ref" and st["path"] == "reference"
    assert st["pairs_visible"] == 2 * causal_pairs(40, 40)
    # a ragged batch of two sequences, 15 and 25 tokens: its pairs are theirs
    pq, pk, pv = (x[0].transpose(1, 0, 2) for x in (q, k, v))  # [total, H, D] views
    cu = np.array([0, 15, 40], dtype=np.int64)
    o0 = libape.attention_varlen(pq, pk, pv, cu, cu, device="ref")
    ov, lv, st = libape.attention_varlen(pq, pk, pv, cu, cu, device="ref", return_lse=True,
                                         stats=True)
    assert np.array_equal(ov, o0) and lv.shape == (40, 2)
    assert st["pairs_visible"] == 2 * (causal_pairs(15, 15) + causal_pairs(25, 25))
    *gv, st = libape.attention_varlen_backward(pq, pk, pv, ov, lv, ov, cu, cu, device="ref",
                                               stats=True)
    assert len(gv) == 4 and st["pairs_visible"] == 2 * (causal_pairs(15, 15) +
                                                        causal_pairs(25, 25))


def test_kv_cache_attend_stats_show_the_window():
    """Under the seed's decay a decode step computes only the keys within reach: its
    pairs_computed is a small part of pairs_visible at 3000 cached keys; without decay, all."""
    q, k, v = qkv(3, L=3000, D=32)
    with libape.KVCache(Hkv=2, D=32, capacity_tokens=3000, device="ref") as c:
        c.append(k, v)
        o, st = c.attend(q[:, :, -1:], stats=True)
        assert st["pairs_visible"] == 2 * 3000
        assert 0 < st["pairs_computed"] < 2 * 500, st
        assert np.array_equal(o, c.attend(q[:, :, -1:]))
        o, st = c.attend(q[:, :, -1:], delta=0.0, beta=0.0, gamma=0.0, lam=0.0, stats=True)
        assert st["pairs_computed"] == st["pairs_visible"] == 2 * 3000


def test_a_refused_call_raises_the_same_with_stats():
    q, k, v = qkv(4)
    msgs = []
    for stats in (False, True):
        with pytest.raises(ValueError) as e:
            libape.attention(q, k[..., :8], v, device="ref", stats=stats)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "k" in msgs[0], msgs


def test_trace_range_and_the_session_trace(tmp_path):
    """APE_TRACE (read once per process: a child): the call's span with its path, inside the
    caller's libape.trace_range(); the file is JSON."""
    import json
    import sys
    trace = tmp_path / "s.json"
    code = ("import numpy as np, libape\n"
            "r = np.random.default_rng(0)\n"
            "q, k, v = (r.standard_normal((1, 2, 20, 8)).astype(np.float32) for _ in range(3))\n"
            "with libape.trace_range('my step'):\n"
            "    libape.attention(q, k, v, device='ref')\n")
    env = dict(os.environ, APE_TRACE=str(trace),
               PYTHONPATH=os.path.dirname(os.path.dirname(libape.__file__)))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    ev = json.loads(trace.read_text())["traceEvents"]
    rng = [e for e in ev if e.get("cat") == "range" and e["name"] == "my step"]
    call = [e for e in ev if e.get("cat") == "call" and e["name"] == "ape_attention_forward"]
    assert len(rng) == 1 and len(call) == 1, ev
    assert call[0]["args"]["path"] == "reference"
    assert rng[0]["ts"] <= call[0]["ts"]
    assert call[0]["ts"] + call[0]["dur"] <= rng[0]["ts"] + rng[0]["dur"] + 1e-3
