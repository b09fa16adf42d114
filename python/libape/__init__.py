"""libape: APE attention (adaptive positional encoding) from Python, over the C library.

    import numpy as np, libape
    o = libape.attention(q, k, v)            # NumPy in, NumPy out; torch in, torch out
    o, lse = libape.attention(q, k, v, lam=0.0, return_lse=True, device="ref")
    dq, dk, dv, dparams = libape.attention_backward(q, k, v, o, lse, do, device="ref")
    o, lse, ent, md = libape.attention_diagnostics(q, k, v)   # entropy, mean distance per row
    o = libape.attention(q, k, v, bias_table=T)   # + T[h][min(|n|, M - 1)]: T5, Gaussian, learned
    o = libape.attention_varlen(q, k, v, cu_q, cu_k)  # packed [total, H, D] ragged batches
    import libape.torch                      # autograd, torch.compile, APEAttention
    pool = libape.KVPool(Hkv=2, D=64, capacity_tokens=4096)  # paged KV of many sequences
    pk = libape.PagedKV(Hkv=2, D=64, page_tokens=16, num_pages=256)  # over your own pages
    libape.devices()                         # what ape-info lists

Pure Python over libape.so through ctypes: no compiled extension. The library is found through
LIBAPE_LIBRARY, else the copy `pip install ./python` bundled, else the installed one.
"""
from ._capi import LibraryError, path as library_path
from ._core import (ApeError, ApeValueError, KVCache, KVPool, PagedKV, SEED_BETA, SEED_DELTA,
                    SEED_GAMMA, SEED_LAMBDA, attention, attention_backward, attention_diagnostics,
                    attention_varlen, attention_varlen_backward, backends, devices, plugins, position_ids_to_cu_seqlens, trace_range, version)

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_diagnostics", "attention_varlen",
           "attention_varlen_backward",
           "position_ids_to_cu_seqlens", "devices", "backends", "plugins", "version", "trace_range", "KVCache", "KVPool", "PagedKV", "ApeError",
           "ApeValueError", "LibraryError", "library_path", "SEED_DELTA", "SEED_BETA",
           "SEED_GAMMA", "SEED_LAMBDA"]
