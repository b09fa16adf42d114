#!/usr/bin/env python3
"""APE attention as a PyTorch user would write it from the spec, PyTorch SDPA on RoPE-rotated
inputs, and libape's CUDA backend, timed side by side on one GPU (issue 6's benchmark).

- ape_eager(): docs/ape.md (../shared/APE-SPEC.md) line by line in eager PyTorch, float32
  arithmetic, blocked over query rows so the [rows, keys, D/2] angle tensors fit in memory.
- sdpa_rope(): plain RoPE attention, the fastest related thing a user has: rotate Q and K by their
  absolute positions (Hugging Face's apply_rotary_pos_emb for the half layout), then
  torch.nn.functional.scaled_dot_product_attention. Only SDPA is timed; the rotation is done once.
- libape: tools' ape-bench --backend cuda --json (its own inputs; kernel_ms is the device time of
  the attention kernels, CUDA events; median_ms the whole call with host copies).

Before timing, ape_eager is checked against libape's float64 reference (ape-run --backend ref,
through .npy files) and against sdpa_rope with all APE parameters 0 (spec identity 1).

Eager APE is slow: it is timed on the first --eager-heads (batch, head) slices and scaled by the
number of slices (its cost is exactly linear in them); the table says so.

usage: bench/torch_ape.py --build build/gpu --out OUT_DIR [--budget SECONDS] [--quick]
Writes OUT_DIR/bench.json and OUT_DIR/bench_table.txt and prints the table last. Needs a CUDA GPU
and PyTorch; nothing else on this machine needs this file.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

DELTA = 2.0 ** (-4.0 / 3.0)  # the seed's training values: delta, delta/10, delta/10, lambda 0.1
SEED = dict(delta=DELTA, beta=DELTA / 10, gamma=DELTA / 10, lam=0.1)
ZERO = dict(delta=0.0, beta=0.0, gamma=0.0, lam=0.0)


def _per_head(x, H, device):
    """A scalar or H values -> float32 tensor [H] (a scalar broadcasts to every head)."""
    import torch

    t = torch.as_tensor(x, dtype=torch.float32, device=device)
    return t.expand(H).contiguous() if t.dim() == 0 else t


def _pairs(x, layout):
    """The two components of every rotary pair: (x_p, y_p), each [..., D/2]."""
    P = x.shape[-1] // 2
    if layout == "half":  # (p, p + D/2): GPT-NeoX / LLaMA
        return x[..., :P], x[..., P:]
    return x[..., 0::2], x[..., 1::2]  # (2p, 2p + 1): GPT-J


def ape_eager(q, k, v, delta, beta, gamma, lam, rope_base=10000.0, scale=None, causal=True,
              q_start=None, k_start=0, layout="half", block=256, heads=None):
    """APE attention, eager. q [B, H, Lq, D]; k, v [B, Hkv, Lk, D]; any float dtype, any device.

    delta, beta, gamma, lam: one float each, or H values. Arithmetic in float32. Returns
    O [B, H, Lq, D] in q's dtype and LSE [B, H, Lq] float32. `heads`: compute only the first
    `heads` (batch, head) slices (for timing a sample); the other slices of O stay zero.
    """
    import torch

    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    assert D % 2 == 0 and H % Hkv == 0 and k.shape == v.shape
    dev = q.device
    G = H // Hkv  # grouped-query attention: head h reads kv head h // G
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q_start is None:
        q_start = k_start + Lk - Lq  # queries aligned to the end of the keys
    delta, beta, gamma, lam = (_per_head(p, H, dev) for p in (delta, beta, gamma, lam))
    P = D // 2
    omega = (rope_base ** (-2.0 * torch.arange(P, dtype=torch.float64, device=dev) / D)).float()
    pos_k = k_start + torch.arange(Lk, device=dev)
    out = torch.zeros(B, H, Lq, D, dtype=q.dtype, device=dev)
    lse = torch.full((B, H, Lq), -math.inf, dtype=torch.float32, device=dev)
    todo = B * H if heads is None else min(heads, B * H)
    for bh in range(todo):
        b, h = divmod(bh, H)
        kh = h // G
        kf, vf = k[b, kh].float(), v[b, kh].float()
        u, w = _pairs(kf, layout)  # [Lk, P]
        for i0 in range(0, Lq, block):
            qb = q[b, h, i0:i0 + block].float()  # [bq, D]
            bq = qb.shape[0]
            pos_q = q_start + i0 + torch.arange(bq, device=dev)
            # keys a causal block can see: none after its last query's position
            kend = Lk if not causal else int(min(max(q_start + i0 + bq - k_start, 0), Lk))
            if kend == 0:
                continue
            x, y = _pairs(qb, layout)  # [bq, P]
            sigma = qb.std(dim=-1, correction=1)  # sqrt(sum (q - mean)^2 / (D - 1))
            alpha = 1.0 + lam[h] * torch.sigmoid(-sigma)  # [bq]
            n = (pos_q[:, None] - pos_k[None, :kend]).float()  # signed distance [bq, kend]
            an = n.abs()
            theta = n[:, :, None] * (omega[None, None, :] / alpha[:, None, None])
            cos, sin = torch.cos(theta), torch.sin(theta)  # [bq, kend, P]
            uu, ww = u[None, :kend, :], w[None, :kend, :]
            xx, yy = x[:, None, :], y[:, None, :]
            dot = ((xx * uu + yy * ww) * cos + (xx * ww - yy * uu) * sin).sum(-1)
            del theta, cos, sin
            temp = 1.0 / (1.0 + lam[h] * an)
            bias = -delta[h] * an - beta[h] * torch.log1p(an) - gamma[h] * torch.sqrt(an)
            s = temp * scale * dot + bias
            if causal:
                s = s.masked_fill(n < 0, -math.inf)  # key after the query: invisible
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)  # rows with no key
            e = torch.exp(s - m)
            den = e.sum(dim=-1)  # 0 for a row that sees no key: O = 0, LSE = -inf
            o = (e @ vf[:kend]) / torch.where(den > 0, den, torch.ones_like(den))[:, None]
            out[b, h, i0:i0 + bq] = o.to(q.dtype)
            lse[b, h, i0:i0 + bq] = m[:, 0] + torch.log(den)
    return out, lse


def rope_rotate(x, pos, rope_base=10000.0, layout="half"):
    """x [B, H, L, D] rotated pair by pair by angle pos * omega_p (angles in float64)."""
    import torch

    D = x.shape[-1]
    P = D // 2
    omega = rope_base ** (-2.0 * torch.arange(P, dtype=torch.float64, device=x.device) / D)
    ang = pos.to(torch.float64)[:, None] * omega[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = _pairs(x, layout)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if layout == "half":
        return torch.cat((ra, rb), dim=-1)
    return torch.stack((ra, rb), dim=-1).flatten(-2)


def sdpa_rope(q, k, v, causal=True, q_start=None, k_start=0, layout="half", scale=None,
              rotated=None):
    """Plain RoPE attention with torch's scaled_dot_product_attention. `rotated`: (q, k) already
    rotated (for timing SDPA alone)."""
    import torch
    import torch.nn.functional as F

    Lq, Lk = q.shape[2], k.shape[2]
    if q_start is None:
        q_start = k_start + Lk - Lq
    if rotated is None:
        dev = q.device
        rotated = (rope_rotate(q, q_start + torch.arange(Lq, device=dev), layout=layout),
                   rope_rotate(k, k_start + torch.arange(Lk, device=dev), layout=layout))
    qr, kr = rotated
    vv = v
    if kr.shape[1] != qr.shape[1]:  # grouped-query attention: repeat the kv heads
        g = qr.shape[1] // kr.shape[1]
        kr, vv = kr.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    # SDPA's is_causal aligns queries to the top left; APE's default aligns them to the end of
    # the keys. They agree when Lq == Lk, the only causal case timed here.
    assert not causal or Lq == Lk
    return F.scaled_dot_product_attention(qr, kr, vv, is_causal=causal, scale=scale)


def cuda_time_ms(fn, warmup=1, repeats=3):
    """Median time of fn() in milliseconds, with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- checks

def check_against_reference(build):
    """ape_eager (float32, on the GPU) against libape's float64 reference on a small problem with
    the seed's parameters, GQA, both layouts. Returns the largest O and LSE errors."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(1)
    worst_o = worst_l = 0.0
    for layout, causal in (("half", True), ("interleaved", False)):
        q = torch.randn(1, 4, 97, 32, generator=g)
        k = torch.randn(1, 2, 97, 32, generator=g)
        v = torch.randn(1, 2, 97, 32, generator=g)
        o, lse = ape_eager(q.cuda(), k.cuda(), v.cuda(), causal=causal, layout=layout, block=40,
                           **SEED)
        with tempfile.TemporaryDirectory() as d:
            for name, t in (("q", q), ("k", k), ("v", v)):
                np.save(os.path.join(d, name + ".npy"), t.numpy().astype(np.float32))
            cmd = [os.path.join(build, "bin", "ape-run"), "--backend", "ref", "--layout", layout,
                   "--skip-tol", "0", "-q", os.path.join(d, "q.npy"), "-k",
                   os.path.join(d, "k.npy"), "-v", os.path.join(d, "v.npy"), "-o",
                   os.path.join(d, "o.npy"), "--lse", os.path.join(d, "lse.npy")]
            if not causal:
                cmd.append("--no-causal")
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)
            o_ref = torch.from_numpy(np.load(os.path.join(d, "o.npy")))
            l_ref = torch.from_numpy(np.load(os.path.join(d, "lse.npy")))
        worst_o = max(worst_o, (o.cpu() - o_ref).abs().max().item())
        worst_l = max(worst_l, (lse.cpu() - l_ref).abs().max().item())
    return worst_o, worst_l


def check_identity_1():
    """With every APE parameter 0, ape_eager equals SDPA on RoPE-rotated inputs (spec identity 1).
    Returns the largest O difference (float32)."""
    import torch

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 130, 64, generator=g).cuda()
    k = torch.randn(2, 2, 130, 64, generator=g).cuda()
    v = torch.randn(2, 2, 130, 64, generator=g).cuda()
    worst = 0.0
    for layout in ("half", "interleaved"):
        o, _ = ape_eager(q, k, v, layout=layout, block=64, **ZERO)
        ref = sdpa_rope(q, k, v, layout=layout)
        worst = max(worst, (o - ref).abs().max().item())
    return worst


# ---------------------------------------------------------------------------- libape

def ape_bench(build, args, timeout):
    """ape-bench --backend cuda --json with args; its results list, or an error string."""
    cmd = [os.path.join(build, "bin", "ape-bench"), "--backend", "cuda", "--json"] + args
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out after %ds" % timeout
    if p.returncode != 0:
        return "ape-bench failed (%d): %s" % (p.returncode, (p.stderr or p.stdout)[-300:])
    try:
        return json.loads(p.stdout)["results"]
    except (ValueError, KeyError) as e:
        return "unreadable ape-bench output: %s" % e


def random_qkv(B, H, L, D):
    """Random f16 Q, K, V [B, H, L, D] on the GPU, and Q and K RoPE-rotated (for SDPA)."""
    import torch

    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    pos = torch.arange(L, device="cuda")
    return q, k, v, (rope_rotate(q, pos), rope_rotate(k, pos))


def libape_fields(row, res):
    """An ape-bench result's times and verdict into a table row."""
    row.update(libape_kernel_ms=res["kernel_ms"], libape_call_ms=res["median_ms"],
               libape_within_tol=res["within_tol"])


# ---------------------------------------------------------------------------- the benchmark

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=170, help="seconds for everything")
    ap.add_argument("--eager-heads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    a = ap.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    rows, notes = [], []

    def left():
        return a.budget - (time.time() - t_start)

    def emit():
        with open(os.path.join(a.out, "bench.json"), "w") as f:
            json.dump({"rows": rows, "notes": notes}, f, indent=1)

    try:
        import torch
    except ImportError:
        torch = None
        notes.append("PyTorch not importable: torch columns empty")
    if torch is not None and not torch.cuda.is_available():
        notes.append("torch.cuda.is_available() is False: torch columns empty")
        torch = None
    gpu = torch.cuda.get_device_name(0) if torch is not None else "?"
    notes.append("GPU: %s; torch %s" % (gpu, torch.__version__ if torch is not None else "-"))

    if torch is not None:
        try:
            eo, el = check_against_reference(a.build)
            notes.append("eager APE vs libape float64 reference (seed params, small): "
                         "max |dO| %.2e, max |dLSE| %.2e" % (eo, el))
            if eo > 1e-4 or el > 1e-4:
                notes.append("WARNING: eager APE disagrees with the reference")
        except Exception as e:  # numpy missing, ape-run failing: say so, go on
            notes.append("eager APE vs reference not checked: %s" % e)
        try:
            d1 = check_identity_1()
            notes.append("eager APE (all params 0) vs SDPA on RoPE-rotated inputs: "
                         "max |dO| %.2e" % d1)
            if d1 > 1e-3:  # float32 both; SDPA may use tf32 or reduced-precision paths
                notes.append("WARNING: eager APE and SDPA disagree on plain RoPE attention")
        except Exception as e:
            notes.append("identity 1 not checked: %s" % e)

    B, H = (1, 2) if a.quick else (4, 16)
    L_dense = 256 if a.quick else 16384
    seed_Ls = [256, 512] if a.quick else [8192, 16384, 32768]
    for D in (64, 128):
        # ---- dense APE (skip_tol 0) at L_dense: libape vs eager APE vs SDPA
        row = {"case": "dense APE L=%d D=%d" % (L_dense, D)}
        r = ape_bench(a.build, ["-B", str(B), "-H", str(H), "-D", str(D), "-L", str(L_dense),
                                "--dtype", "f16", "--skip-tol", "0", "--warmup", "1",
                                "--repeats", "3", "--check-rows", "8"],
                      timeout=max(10, min(90, left() - 30)))
        if isinstance(r, str):
            row["libape_error"] = r
        else:
            libape_fields(row, r[0])
            row["tflops"] = r[0]["pairs_visible"] * 4 * D / (r[0]["kernel_ms"] * 1e-3) / 1e12
        if torch is not None and left() > 40:
            q, k, v, rot = random_qkv(B, H, L_dense, D)
            row["sdpa_ms"] = cuda_time_ms(lambda: sdpa_rope(q, k, v, rotated=rot), 2, 5)
            n = min(a.eager_heads, B * H)
            ms = cuda_time_ms(lambda: ape_eager(q, k, v, heads=n, **SEED), 0, 1)
            row["eager_ms"] = ms * (B * H) / n
            row["eager_note"] = "timed on %d of %d heads, scaled" % (n, B * H)
            del q, k, v, rot
            torch.cuda.empty_cache()
        rows.append(row)
        emit()

        # ---- seed parameters, default skip_tol: libape vs SDPA, L = 8192 ..
        r = ape_bench(a.build, ["-B", str(B), "-H", str(H), "-D", str(D), "-L",
                                ",".join(str(x) for x in seed_Ls), "--dtype", "f16",
                                "--warmup", "1", "--repeats", "3", "--check-rows", "4",
                                "--skip-tol", str(2.0 ** -24)],
                      timeout=max(10, min(90, left() - 25)))
        for i, L in enumerate(seed_Ls):
            row = {"case": "seed skip L=%d D=%d" % (L, D)}
            if isinstance(r, str):
                row["libape_error"] = r
            else:
                libape_fields(row, r[i])
                row["computed_frac"] = r[i]["pairs_computed"] / max(1, r[i]["pairs_visible"])
            if torch is not None and left() > 20:
                q, k, v, rot = random_qkv(B, H, L, D)
                row["sdpa_ms"] = cuda_time_ms(lambda: sdpa_rope(q, k, v, rotated=rot), 1, 3)
                del q, k, v, rot
                torch.cuda.empty_cache()
            rows.append(row)
        emit()

    # ---- decode: Lq = 1, B = 16, Lk = 128k, skipping off; bytes the kernel must read: K and V
    Bd, Hd, Hkvd, Lkd = (2, 2, 1, 2048) if a.quick else (16, 16, 2, 131072)
    for D in (64, 128):
        row = {"case": "decode Lq=1 B=%d H=%d Hkv=%d Lk=%d D=%d" % (Bd, Hd, Hkvd, Lkd, D)}
        if left() < 15:
            row["libape_error"] = "not run: out of time"
            rows.append(row)
            continue
        r = ape_bench(a.build, ["-B", str(Bd), "-H", str(Hd), "--kv-heads", str(Hkvd), "-D",
                                str(D), "-L", str(Lkd), "--lq", "1", "--dtype", "f16",
                                "--skip-tol", "0", "--warmup", "2", "--repeats", "10",
                                "--check-rows", "2"], timeout=max(10, min(60, left() - 5)))
        if isinstance(r, str):
            row["libape_error"] = r
        else:
            kv_bytes = 2 * Bd * Hkvd * Lkd * D * 2  # K and V, f16: what the kernel must read
            libape_fields(row, r[0])
            row["hbm_gbs"] = kv_bytes / (r[0]["kernel_ms"] * 1e-3) / 1e9
        rows.append(row)
        emit()

    # ---- the table
    def f(x, fmt="%.2f"):
        return fmt % x if isinstance(x, (int, float)) else "-"

    lines = ["%-44s %10s %10s %10s %10s %9s %9s %s" % (
        "case (B=%d H=%d f16 causal)" % (B, H), "libape ms", "eager ms", "SDPA ms",
        "eager/ape", "ape/SDPA", "ok", "other")]
    for row in rows:
        k = row.get("libape_kernel_ms")
        other = []
        if "tflops" in row:
            other.append("%.1f dense-eq TFLOP/s" % row["tflops"])
        if "computed_frac" in row:
            other.append("%.3f%% pairs computed" % (100 * row["computed_frac"]))
        if "hbm_gbs" in row:
            other.append("%.0f GB/s K+V read" % row["hbm_gbs"])
        if "libape_error" in row:
            other.append(row["libape_error"][:80])
        if "eager_note" in row:
            other.append("eager " + row["eager_note"])
        lines.append("%-44s %10s %10s %10s %10s %9s %9s %s" % (
            row["case"], f(k, "%.3f"), f(row.get("eager_ms"), "%.1f"),
            f(row.get("sdpa_ms"), "%.3f"),
            f(row["eager_ms"] / k if k and "eager_ms" in row else None, "%.1fx"),
            f(k / row["sdpa_ms"] if k and "sdpa_ms" in row else None, "%.2fx"),
            {True: "yes", False: "NO"}.get(row.get("libape_within_tol"), "-"), "; ".join(other)))
    lines.append("libape ms: device time of the attention kernels (CUDA events); the whole call "
                 "with host copies is in bench.json (libape_call_ms).")
    lines += ["note: " + n for n in notes]
    text = "\n".join(lines)
    with open(os.path.join(a.out, "bench_table.txt"), "w") as fh:
        fh.write(text + "\n")
    emit()
    print(text)
    bad = any("libape_error" in r or r.get("libape_within_tol") is False for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
