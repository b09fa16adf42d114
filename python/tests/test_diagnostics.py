"""libape.attention_diagnostics: the entropy and mean distance of every row against a float64
NumPy evaluation of their definitions, on every device (reference, OpenCL, CUDA)."""
import numpy as np
import pytest

import libape
from aperef import ape64

DEVICES = [d["spec"] for d in libape.devices()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_definitions(device, causal):
    rng = np.random.default_rng(7 + causal)
    q = rng.standard_normal((1, 4, 33, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    prm = dict(delta=[0.3, 0.0, 0.1, 0.05], beta=0.02, gamma=0.01, lam=0.2, causal=causal,
               q_start=10, k_start=3)
    o, lse, ent, md = libape.attention_diagnostics(q, k, v, device=device, **prm)
    _, lse64, ent64, md64 = ape64(q, k, v, diag=True, **prm)
    assert ent.shape == md.shape == (1, 4, 33) and ent.dtype == np.float32
    scale = np.maximum(1.0, np.where(np.isfinite(lse64), np.abs(lse64), 1.0))
    assert (np.abs(ent - ent64) <= 1e-4 * scale).all()
    assert (np.abs(md - md64) <= 1e-4 * np.maximum(1.0, 50.0)).all()  # |n| <= 50 here
    # rows that see no key (causal, positions 10..16 see keys from 3 on: all see some)
    assert np.isfinite(ent).all()
