"""APE attention as eager float64 PyTorch, straight from the spec, differentiable by autograd
with respect to q, k, v and the four parameters: the reference for the package's gradients."""
import math

import torch


def ape_torch64(q, k, v, delta, beta, gamma, lam, causal=True, scale=None, rope_base=10000.0,
                layout="half", q_start=None, k_start=0, rope_scale=1.0, bias_table=None):
    """q [B,H,Lq,D], k, v [B,Hkv,Lk,D] (float64 tensors); parameters float64 tensors of shape
    [] or [H]; bias_table None or a float64 tensor [H, M] or [1, M] (differentiable too),
    T[h][min(|n|, M - 1)] added to every score. Returns O [B,H,Lq,D] and LSE [B,H,Lq]; every
    row must see a key."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    P = D // 2
    delta, beta, gamma, lam = (p.expand(H)[None, :, None, None] for p in (delta, beta, gamma, lam))
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q_start is None:
        q_start = k_start + Lk - Lq
    idx = torch.arange(P)
    ia, ib = (idx, idx + P) if layout == "half" else (2 * idx, 2 * idx + 1)
    omega = rope_base ** (-2.0 * idx.double() / D)
    n = (q_start + torch.arange(Lq))[:, None] - (k_start + torch.arange(Lk))[None, :]
    an = n.abs().double()
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    sigma = q.std(dim=-1, unbiased=True)                                  # [B,H,Lq]
    alpha = 1.0 + lam[..., 0] * torch.sigmoid(-sigma)                     # [B,H,Lq]
    # position interpolation: the rotation at n / rope_scale
    theta = (n.double() / rope_scale)[None, None, :, :, None] * omega / alpha[..., None, None]
    x, y = q[..., ia][:, :, :, None, :], q[..., ib][:, :, :, None, :]
    u, w = k[..., ia][:, :, None, :, :], k[..., ib][:, :, None, :, :]
    dot = ((x * u + y * w) * torch.cos(theta) + (x * w - y * u) * torch.sin(theta)).sum(-1)
    s = dot * scale / (1.0 + lam * an) - delta * an - beta * torch.log1p(an) - gamma * an.sqrt()
    if bias_table is not None:
        M = bias_table.shape[1]
        s = s + bias_table.expand(H, M)[:, n.abs().clamp(max=M - 1)][None]  # [1,H,Lq,Lk]
    if causal:
        s = s.masked_fill(n < 0, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse
