"""NumPy and PyTorch front end of libape's forward pass, devices, KV cache, KV pool and paged
attention over the caller's pages."""
import atexit
import ctypes
import struct
import sys
import threading
import weakref

import numpy as np

from . import _capi
from ._capi import lib

SEED_DELTA = 2.0 ** (-4.0 / 3.0)
SEED_BETA = SEED_DELTA / 10.0
SEED_GAMMA = SEED_DELTA / 10.0
SEED_LAMBDA = 0.1
EINVAL = -22

_KINDS = {0: "cpu", 1: "gpu", 2: "accelerator", 3: "reference"}
_LAYOUTS = {"half": _capi.ROPE_HALF, "interleaved": _capi.ROPE_INTERLEAVED}


class ApeError(RuntimeError):
    """A libape call failed. `code` is the C code (negative), `name` its symbolic name
    ("APE_EINVAL"), and the message is libape's own, naming the argument and value."""

    def __init__(self, code, message):
        self.code = code
        self.name = lib.ape_err_name(code).decode()
        super().__init__("%s: %s" % (self.name, message))


class ApeValueError(ApeError, ValueError):
    """A bad argument (APE_EINVAL): both an ApeError and a ValueError."""


def _raise(code):
    msg = lib.ape_last_error().decode(errors="replace")
    raise (ApeValueError if code == EINVAL else ApeError)(code, msg)


def _bad(msg):
    """An argument the package itself refuses before calling libape: the same exception type
    libape's own validation raises."""
    raise ApeValueError(EINVAL, msg)


def _refuse_grad(fn, **arrays):
    """A torch tensor that records gradients would come back from libape.`fn`() with no grad_fn
    (the autograd graph silently dropped, and loss.backward() failing later): refused, naming
    the differentiable call. Under torch.no_grad(), or detached, it is taken."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return
    for name, x in arrays.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            _bad("%s: requires grad, and libape.%s() records no gradient (its result would "
                 "have no grad_fn): call libape.torch.%s() for a differentiable result, or "
                 "pass %s.detach() (or call under torch.no_grad())" % (name, fn, fn, name))


def _stats_arg(stats):
    """For a call asked for its statistics (stats=True): an ape_stats, and the pointer to pass
    (both None otherwise)."""
    if not stats:
        return None, None
    st = _capi.ApeStats()
    lib.ape_stats_init(ctypes.byref(st))
    return st, ctypes.byref(st)


def _with_stats(result, st):
    """result, or with stats=True result + (the C call's ape_stats as a dict,): every field
    of include/ape/ape.h's ape_stats but struct_size, backend and device as str."""
    if st is None:
        return result
    d = {}
    for name, _ in st._fields_:
        if name != "struct_size":
            x = getattr(st, name)
            d[name] = x.decode(errors="replace") if isinstance(x, bytes) else x
    return (result if isinstance(result, tuple) else (result,)) + (d,)


# ------------------------------------------------------------------ the context and its devices

class _Context:
    """One libape context per process, created on first use, destroyed at exit. libape
    contexts may be shared by threads; the lock only guards creation and the selection cache."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ctx = None
        self._selected = {}
        # objects holding memory of the context (KV caches): closed before it is destroyed, so
        # that one still open at exit is not freed after its context (a crash at shutdown)
        self._owned = weakref.WeakSet()

    def get(self):
        if self._ctx is None:
            with self._lock:
                if self._ctx is None:
                    ctx = ctypes.c_void_p()
                    err = lib.ape_context_create(ctypes.byref(ctx), None)
                    if err:
                        _raise(err)
                    self._ctx = ctx
                    atexit.register(self.close)
        return self._ctx

    def device(self, spec):
        dev = self._selected.get(spec)
        if dev is not None:
            return dev
        ctx = self.get()
        sel = _capi.ApeSelection()
        err = lib.ape_device_select_spec(ctx, spec.encode(), ctypes.byref(sel))
        if err:
            _raise(err)
        with self._lock:
            self._selected[spec] = sel.device
        return sel.device

    def own(self, obj):
        with self._lock:
            self._owned.add(obj)

    def close(self):
        with self._lock:
            owned = list(self._owned)
            self._owned = weakref.WeakSet()
        for obj in owned:
            obj.close()
        with self._lock:
            if self._ctx is not None:
                lib.ape_context_destroy(self._ctx)
                self._ctx = None
                self._selected.clear()


_context = _Context()


def _capabilities(dev):
    """What dev states it can do (ape_device_capabilities()), in the capabilities' words."""
    bits = lib.ape_device_capabilities(dev)
    return [lib.ape_be_cap_name(1 << b).decode() for b in range(64)
            if bits >> b & 1 and lib.ape_be_cap_name(1 << b)]


def _device_dict(dev):
    info = _capi.ApeDeviceInfo()
    err = lib.ape_device_get_info(dev, ctypes.byref(info))
    if err:
        _raise(err)
    return {
        "capabilities": _capabilities(dev),
        "index": info.index,
        "backend": info.backend.decode(),
        "backend_index": info.backend_index,
        "spec": "%s:%d" % (info.backend.decode(), info.backend_index),
        "name": info.name.decode(errors="replace"),
        "vendor": info.vendor.decode(errors="replace"),
        "kind": _KINDS.get(info.kind, "?"),
        "driver_version": info.driver_version.decode(errors="replace"),
        "compute_units": info.compute_units,
        "global_mem_bytes": info.global_mem_bytes,
        "pci_address": info.pci_address.decode(),
        "physical_index": info.physical_index,
        "numa_node": info.numa_node,
        "cpuset": info.cpuset.decode(),
    }


def devices():
    """The devices libape can compute on, most preferred first, as dicts (what `ape-info`
    lists): index, backend, spec (what `device=` takes), name, vendor, kind, driver_version,
    compute_units, global_mem_bytes, pci_address, physical_index, numa_node, cpuset, and
    capabilities (what the device states it can do: "diag", "backward", ...;
    ape_device_capabilities())."""
    ctx = _context.get()
    n = lib.ape_device_list(ctx, None, 0)
    if n < 0:
        _raise(n)
    arr = (ctypes.c_void_p * max(n, 1))()
    n = lib.ape_device_list(ctx, arr, n)
    if n < 0:
        _raise(n)
    return [_device_dict(arr[i]) for i in range(n)]


def backends():
    """Every backend libape knows of, as dicts: name, built, available, device_count, reason
    (why it is not available)."""
    ctx = _context.get()
    n = lib.ape_backend_get_info(ctx, 0, None)
    out = []
    for i in range(n):
        info = _capi.ApeBackendInfo()
        err = lib.ape_backend_get_info(ctx, i, ctypes.byref(info))
        if err:
            _raise(err)
        out.append({"name": info.name.decode(), "built": info.built, "available": info.available,
                    "device_count": info.device_count, "reason": info.reason.decode()})
    return out


def plugins():
    """Every backend plugin libape found (APE_BACKEND_PATH, then the plugin folder under the
    install prefix), loaded or not, as dicts: path, name (its backend name, what `device=`
    takes once loaded), loaded, device_count, abi (major, minor), reason (why it did not
    load)."""
    ctx = _context.get()
    n = lib.ape_plugin_get_info(ctx, 0, None)
    if n < 0:
        _raise(n)
    out = []
    for i in range(n):
        info = _capi.ApePluginInfo()
        err = lib.ape_plugin_get_info(ctx, i, ctypes.byref(info))
        if err:
            _raise(err)
        out.append({"path": info.path.decode(errors="replace"), "name": info.name.decode(),
                    "loaded": info.loaded, "device_count": info.device_count,
                    "abi": (info.abi_major, info.abi_minor),
                    "reason": info.reason.decode(errors="replace")})
    return out


class trace_range:
    """A named range around a block, for profilers (ape_range_push() and ape_range_pop()):
    an NVTX range when libape was built with NVTX and a tool is attached, and with APE_TRACE
    set, a span of the session trace around the libape calls the block makes
    (docs/profiling.md)::

        with libape.trace_range("decode step"):
            o = libape.attention(q, k, v)
    """

    def __init__(self, name):
        self._name = str(name).encode()

    def __enter__(self):
        lib.ape_range_push(self._name)
        return self

    def __exit__(self, *exc):
        lib.ape_range_pop()
        return False


def version():
    """The version of the loaded libape, "0.1.0"."""
    return lib.ape_version_string().decode()


# ------------------------------------------------------------------ arrays

class _Array:
    """A 4-D array as libape sees it: pointer, dtype code, shape, element strides, and the
    object that owns the memory (kept alive for the call). `kind` is "numpy" or "torch"."""
    __slots__ = ("obj", "kind", "np_dtype", "shape", "fields")

    def __init__(self, obj, kind, np_dtype, ptr, code, shape, strides):
        self.obj, self.kind, self.np_dtype, self.shape = obj, kind, np_dtype, shape
        # struct ape_tensor's fields in order: data, dtype, shape[4], strides[4]
        self.fields = (ptr, code) + tuple(shape) + tuple(strides)


_NP_DTYPES = {np.dtype(np.float32): _capi.F32, np.dtype(np.float16): _capi.F16}
# struct ape_tensor as bytes: void *data; ape_dtype dtype; int64_t shape[4], strides[4]
_TENSOR = struct.Struct("Pi4x4q4q")
assert _TENSOR.size == ctypes.sizeof(_capi.ApeTensor)


def _torch():
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # optional dependency: imported only for torch tensors
    return torch


_TORCH_DTYPES = None


def _torch_dtypes(torch):
    """torch's dtypes libape stores, to their ape_dtype codes (built once)."""
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        _TORCH_DTYPES = {torch.float32: _capi.F32, torch.float16: _capi.F16,
                         torch.bfloat16: _capi.BF16}
    return _TORCH_DTYPES


def _as_array(name, x):
    if type(x) is not np.ndarray:
        if type(x).__module__.startswith("torch"):
            return _torch_array(name, x)
        if isinstance(x, np.ndarray):
            pass
        elif hasattr(x, "__dlpack__"):
            x = np.from_dlpack(x)
        else:
            _bad("%s: a %s is not an array: pass a NumPy array, a torch tensor or an object "
                 "with __dlpack__" % (name, type(x).__name__))
    if x.ndim != 4:
        _bad("%s: shape %s: must be 4-D [B, H, L, D]" % (name, tuple(x.shape)))
    code = _NP_DTYPES.get(x.dtype)
    if code is None:
        _bad("%s: dtype %s: libape stores float32, float16 or bfloat16 (a torch tensor); "
             "convert it first, e.g. x.astype(np.float32)" % (name, x.dtype))
    isz = x.itemsize
    st = x.strides
    if (st[0] % isz or st[1] % isz or st[2] % isz or st[3] % isz or min(st) <= 0) and \
            _needs_copy(st, x.shape, isz):
        # negative, unaligned or broadcast (0) strides: the layout demands a copy
        x = np.ascontiguousarray(x)
        st = x.strides
    return _Array(x, "numpy", x.dtype, x.ctypes.data, code, x.shape,
                  (st[0] // isz, st[1] // isz, st[2] // isz, st[3] // isz))


def _needs_copy(strides, shape, isz=1):
    """Strides libape cannot take as they are: negative, not whole elements, or 0 on a
    dimension of more than one element (a broadcast view; all-0 strides mean "contiguous" to
    libape)."""
    return any(s < 0 or s % isz or (s == 0 and n > 1) for s, n in zip(strides, shape))


def _torch_array(name, x):
    if not x.is_cpu:
        _bad("%s: a tensor on %s: this call takes CPU tensors (CUDA tensors go to libape's CUDA "
             "device through libape.attention's DLPack path, forward only for now); move it "
             "with .cpu()" % (name, x.device))
    if x.dim() != 4:
        _bad("%s: shape %s: must be 4-D [B, H, L, D]" % (name, tuple(x.shape)))
    code = (_TORCH_DTYPES or _torch_dtypes(_torch())).get(x.dtype)
    if code is None:
        _bad("%s: dtype %s: libape stores float32, float16 or bfloat16; convert it first"
             % (name, x.dtype))
    st = x.stride()
    if min(st) <= 0 and _needs_copy(st, x.shape):
        x = x.contiguous()
        st = x.stride()
    return _Array(x, "torch", x.dtype, x.data_ptr(), code, tuple(x.shape), st)


class _Tensors:
    """ape_tensor structs of one call, packed into one buffer per thread (building ctypes
    structures field by field costs more than the C call's own validation)."""
    _local = threading.local()

    @classmethod
    def pack(cls, arrays):
        buf = getattr(cls._local, "buf", None)
        if buf is None or len(buf) < _TENSOR.size * len(arrays):
            buf = cls._local.buf = ctypes.create_string_buffer(_TENSOR.size * 8)
        base = ctypes.addressof(buf)
        out = []
        for i, a in enumerate(arrays):
            _TENSOR.pack_into(buf, i * _TENSOR.size, *a.fields)
            out.append(base + i * _TENSOR.size)
        return out


def _tensor(a):
    """One ape_tensor as a ctypes structure (for calls off the hot path)."""
    f = a.fields
    return _capi.ApeTensor(f[0], f[1], _I64x4(*f[2:6]), _I64x4(*f[6:10]))


_I64x4 = ctypes.c_int64 * 4


def _empty_like(a, shape):
    """A new contiguous output of the inputs' kind and dtype (shape a tuple)."""
    if a.kind == "torch":
        # new, contiguous, on the CPU, of a dtype a was checked to have: nothing to check
        t = _torch().empty(shape, dtype=a.np_dtype)
        return _Array(t, "torch", a.np_dtype, t.data_ptr(), a.fields[1], shape, t.stride())
    x = np.empty(shape, dtype=a.np_dtype)
    # strides all 0: libape's "contiguous row-major", right for empty shapes too
    return _Array(x, "numpy", a.np_dtype, x.ctypes.data, a.fields[1], shape, (0, 0, 0, 0))


def _empty_lse(a, shape):
    if a.kind == "torch":
        torch = _torch()
        t = torch.empty(shape, dtype=torch.float32)
        return t, t.data_ptr()
    arr = np.empty(shape, dtype=np.float32)
    return arr, arr.ctypes.data


# ------------------------------------------------------------------ parameters

def _param(name, value, H, keep):
    """An ape_param from a float or a per-head sequence; `keep` holds what must live for the
    call."""
    p = _capi.ApeParam()
    if np.ndim(value) == 0:
        p.value = float(value)
        return p
    arr = np.ascontiguousarray(np.asarray(value, dtype=np.float32).reshape(-1))
    if arr.size != H:
        _bad("%s: %d values: give one per query head (H = %d) or a single float"
             % (name, arr.size, H))
    keep.append(arr)
    p.per_head = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    return p


_SCALAR = (float, int)
_desc_cache = {}
_desc_base = {}


def _desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start, k_start,
          skip_tol, keep, rope_scale=1.0):
    """An ape_attn_desc; those of scalar parameters are cached (they never change once built,
    and libape only reads them). A new set of scalar values (a training step's) is a copy of
    the cached descriptor of the same other arguments with the four values set: what
    _build_desc() would make, without building it field by field."""
    key = None
    if (type(delta) in _SCALAR and type(beta) in _SCALAR and type(gamma) in _SCALAR and
            type(lam) in _SCALAR):
        key = (delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start, k_start,
               skip_tol, rope_scale)
        d = _desc_cache.get(key)
        if d is not None:
            return d
        base = _desc_base.get(key[4:])
        if base is None:
            base = _build_desc(H, 0.0, 0.0, 0.0, 0.0, causal, scale, rope_base, layout,
                               q_start, k_start, skip_tol, keep, rope_scale)
            if len(_desc_base) > 64:
                _desc_base.clear()
            _desc_base[key[4:]] = base
        d = _capi.ApeAttnDesc.from_buffer_copy(base)
        d.delta.value, d.beta.value = float(delta), float(beta)
        d.gamma.value, d.lambda_.value = float(gamma), float(lam)
    else:
        d = _build_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start,
                        k_start, skip_tol, keep, rope_scale)
    if key is not None:
        if len(_desc_cache) > 256:
            _desc_cache.clear()
        _desc_cache[key] = d
    return d


def _build_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start, k_start,
                skip_tol, keep, rope_scale=1.0):
    d = _capi.ApeAttnDesc()
    lib.ape_attn_desc_init(ctypes.byref(d))
    d.delta = _param("delta", delta, H, keep)
    d.beta = _param("beta", beta, H, keep)
    d.gamma = _param("gamma", gamma, H, keep)
    d.lambda_ = _param("lam", lam, H, keep)
    d.causal = bool(causal)
    if scale is not None:
        d.scale = float(scale)
        d.scale_set = True
    d.rope_base = float(rope_base)
    d.rope_scale = float(rope_scale)
    lay = _LAYOUTS.get(layout)
    if lay is None:
        _bad("layout = %r: must be 'half' or 'interleaved'" % (layout,))
    d.layout = lay
    d.k_start = int(k_start)
    if q_start is not None:
        d.q_start = int(q_start)
        d.q_start_set = True
    d.skip_tol = float(skip_tol)
    return d


def _bias_array(bias_table, H):
    """A distance-bias table (ape_attn_desc.bias_table) as libape reads it: contiguous float32
    host memory [rows, M], rows H (one per query head) or 1 (shared by every head). NumPy
    arrays, torch tensors (copied to the host if elsewhere), objects with __dlpack__, and
    nested lists; anything else, another dtype or shape, is refused naming bias_table (the
    library checks the values and M's upper bound)."""
    x = bias_table
    if type(x).__module__.startswith("torch"):
        torch = _torch()
        if x.dtype != torch.float32:
            _bad("bias_table: dtype %s: must be float32; convert it first (t.float())"
                 % x.dtype)
        x = x.detach().cpu().numpy()
    elif isinstance(x, (list, tuple)):
        x = np.asarray(x, dtype=np.float32)
    elif not isinstance(x, np.ndarray):
        if not hasattr(x, "__dlpack__"):
            _bad("bias_table: a %s is not an array: pass a float32 NumPy array or torch tensor "
                 "[H, M] or [1, M]" % type(x).__name__)
        x = np.from_dlpack(x)
    if x.dtype != np.float32:
        _bad("bias_table: dtype %s: must be float32; convert it first, e.g. "
             "t.astype(np.float32)" % x.dtype)
    if x.ndim != 2 or x.shape[0] not in (H, 1) or x.shape[1] < 1:
        _bad("bias_table: shape %s: must be [H, M] = [%d, M] (a row per query head) or [1, M] "
             "(one row for every head), M >= 1" % (tuple(x.shape), H))
    return np.ascontiguousarray(x)


def _with_table(desc, table, keep, dbias_ptr=None):
    """A copy of desc (cached ones are shared) reading the distance-bias table `table` (what
    _bias_array() gives), and with dbias_ptr writing its gradient there; table kept in keep."""
    d = _capi.ApeAttnDesc()
    ctypes.pointer(d)[0] = desc
    d.bias_table = table.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    d.bias_table_heads, d.bias_table_len = table.shape
    if dbias_ptr is not None:
        d.dbias_table = ctypes.cast(dbias_ptr, ctypes.POINTER(ctypes.c_float))
    keep.append(table)
    return d


def _table_desc(desc, bias_table, H, keep):
    """desc as it is without a table, else a copy reading it."""
    if bias_table is None:
        return desc
    return _with_table(desc, _bias_array(bias_table, H), keep)


_forward = lib.ape_attention_forward
_forward_diag = lib.ape_attention_forward_diag


def _device_spec(device):
    if not isinstance(device, str):
        _bad("device = %r: give a string such as 'auto', 'ref', 'opencl', 'opencl:0' or a PCI "
             "address" % (device,))
    return _context.device(device)


# ------------------------------------------------------------------ attention

def _host_call(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start,
               k_start, skip_tol, rope_scale=1.0):
    """The host arrays of one call (all NumPy or all torch CPU) and its descriptor; `keep`
    holds what the descriptor points to and must outlive the call."""
    qa = _as_array("q", q)
    ka = _as_array("k", k)
    va = _as_array("v", v)
    if not (qa.kind == ka.kind == va.kind):
        _bad("q, k, v: mixed kinds (%s, %s, %s): pass all NumPy arrays or all torch tensors"
             % (qa.kind, ka.kind, va.kind))
    keep = []
    desc = _desc(qa.shape[1], delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start,
                 k_start, skip_tol, keep, rope_scale)
    return qa, ka, va, desc, keep


def attention(q, k, v, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA,
              causal=True, scale=None, rope_base=10000.0, layout="half", q_start=None, k_start=0,
              skip_tol=2.0 ** -24, device="auto", return_lse=False, positions_q=None,
              positions_k=None, stats=False, rope_scale=1.0, bias_table=None):
    """APE attention of q `[B, H, Lq, D]` over k, v `[B, Hkv, Lk, D]`; returns O `[B, H, Lq, D]`
    (and LSE `[B, H, Lq]` float32 with return_lse=True).

    positions_q `[Lq]` and positions_k `[Lk]` (int32 or int64, both or neither, shared by the
    batch; any order, gaps, repeats) are explicit positions in place of q_start and k_start:
    n = positions_q[i] - positions_k[j] (ape_attn_desc.pos_q, .pos_k; host arrays only).

    Arrays: NumPy (float32, float16), torch CPU tensors (float32, float16, bfloat16), or any
    object with __dlpack__; the result is of the same kind and dtype as q. Strided views are
    passed without a copy. Parameters are floats or sequences of H values; the defaults are the
    seed's initial values (delta = 2^(-4/3), beta = gamma = delta/10, lambda = 0.1).
    Raises ApeValueError (a ValueError) for a bad argument, ApeError for other failures; also
    for torch tensors that record gradients (requires_grad outside torch.no_grad()): this call
    records none, libape.torch.attention() does.

    rope_scale (default 1; finite, > 0): position interpolation, the rotation turning by
    n / rope_scale while the bias and temperature keep n (ape_attn_desc.rope_scale).

    bias_table (default None): a distance-bias table, float32 `[H, M]` (a row per query head)
    or `[1, M]` (one row for every head), NumPy or torch: every score of head h gets
    `bias_table[h][min(|n|, M - 1)]` added beside the decay bias (ape_attn_desc.bias_table;
    docs/ape.md, "Distance-bias tables"): T5's buckets, a Gaussian -lambda n^2, any learned
    function of the distance. A device whose backend does not compute tables raises ApeError
    (APE_ENOTSUP) naming it; a bad table ApeValueError naming bias_table.

    stats=True appends the C call's statistics (ape_stats: times, pairs visible and computed,
    chunks, bytes copied, backend and device) as a dict to what it returns: (o, stats), or
    (o, lse, stats) with return_lse=True. Host arrays only.
    """
    _refuse_grad("attention", q=q, k=k, v=v, delta=delta, beta=beta, gamma=gamma, lam=lam,
                 bias_table=bias_table)
    if _is_torch_cuda(q) or _is_torch_cuda(k) or _is_torch_cuda(v):
        if stats:
            _bad("stats=True: CUDA tensors go through ape_attention_forward_dlpack(), which "
                 "reports no statistics")
        if positions_q is not None or positions_k is not None:
            _bad("positions_q, positions_k: explicit positions take host arrays only for now")
        return _attention_cuda(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base,
                               layout, q_start, k_start, skip_tol, device, return_lse,
                               rope_scale=rope_scale, bias_table=bias_table)
    qa, ka, va, desc, keep = _host_call(q, k, v, delta, beta, gamma, lam, causal, scale,
                                        rope_base, layout, q_start, k_start, skip_tol,
                                        rope_scale)
    B, H, Lq, D = qa.shape
    desc = _table_desc(desc, bias_table, H, keep)
    if positions_q is not None or positions_k is not None:
        desc = _with_positions(desc, positions_q, positions_k, Lq, ka.shape[2], q_start,
                               k_start, keep)
    dev = _device_spec(device)
    oa = _empty_like(qa, (B, H, Lq, D))
    lse, lse_ptr = _empty_lse(qa, (B, H, Lq)) if return_lse else (None, None)
    tq, tk, tv, to = _Tensors.pack((qa, ka, va, oa))
    st, st_ptr = _stats_arg(stats)
    err = _forward(dev, ctypes.byref(desc), tq, tk, tv, to, lse_ptr, st_ptr)
    if err:
        _raise(err)
    return _with_stats((oa.obj, lse) if return_lse else oa.obj, st)


# ------------------------------------------------------------------ ragged batches

def _packed_view(name, x):
    """A packed [total, H, D] array (NumPy or torch CPU) as the [1, H, total, D] view the C
    call takes: the same memory, strides swapped, never a copy."""
    if type(x).__module__.startswith("torch"):
        if x.dim() != 3:
            _bad("%s: shape %s: must be 3-D [total, H, D] (packed tokens)" % (name, tuple(x.shape)))
        return _as_array(name, x.unsqueeze(0).permute(0, 2, 1, 3))
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        x = np.from_dlpack(x)
    if not isinstance(x, np.ndarray):
        _bad("%s: a %s is not an array: pass a NumPy array or a torch tensor"
             % (name, type(x).__name__))
    if x.ndim != 3:
        _bad("%s: shape %s: must be 3-D [total, H, D] (packed tokens)" % (name, tuple(x.shape)))
    return _as_array(name, x[None].transpose(0, 2, 1, 3))


def _int64_array(name, x, n=None):
    """cu_seqlens or positions as a contiguous int64 NumPy array (int32 and int64 taken)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        _bad("%s: must be a 1-D integer array (int32 or int64), got shape %s dtype %s"
             % (name, a.shape, a.dtype))
    if n is not None and a.shape[0] != n:
        _bad("%s: %d values: must be %d" % (name, a.shape[0], n))
    return np.ascontiguousarray(a, dtype=np.int64)


def _i64p(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)) if a is not None else None


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, positions_q=None, positions_k=None,
                     delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA,
                     causal=True, scale=None, rope_base=10000.0, layout="half",
                     skip_tol=2.0 ** -24, device="auto", return_lse=False, stats=False,
                     rope_scale=1.0, bias_table=None):
    """APE attention over a ragged batch of packed sequences (ape_attention_forward_varlen()).

    q `[total_q, H, D]`, k and v `[total_k, Hkv, D]` (NumPy or torch CPU; strided views, such as
    slices of a packed QKV tensor, are passed without a copy); cu_seqlens_q, cu_seqlens_k the
    S + 1 row offsets of the sequences (int32 or int64, non-decreasing from 0 to the totals);
    positions_q `[total_q]` and positions_k `[total_k]` optional int64 positions (default: each
    sequence's keys at 0.. and its queries end-aligned to them). Query i of sequence s sees the
    keys of s only, with causal those with pos_k <= pos_q, at n = pos_q - pos_k. Returns O
    `[total_q, H, D]` of q's kind and dtype (and LSE `[total_q, H]` float32 with
    return_lse=True). On host arrays; gradients: attention_varlen_backward(), or
    libape.torch.attention_varlen() for autograd. Raises ApeValueError for a bad argument, and
    for torch tensors that record gradients (as attention() does). stats=True, rope_scale and
    bias_table as for attention().
    """
    _refuse_grad("attention_varlen", q=q, k=k, v=v, delta=delta, beta=beta, gamma=gamma,
                 lam=lam, bias_table=bias_table)
    qa = _packed_view("q", q)
    ka = _packed_view("k", k)
    va = _packed_view("v", v)
    if not (qa.kind == ka.kind == va.kind):
        _bad("q, k, v: mixed kinds (%s, %s, %s): pass all NumPy arrays or all torch tensors"
             % (qa.kind, ka.kind, va.kind))
    _, H, tq, D = qa.shape
    tk = ka.shape[2]
    cq = _int64_array("cu_seqlens_q", cu_seqlens_q)
    ck = _int64_array("cu_seqlens_k", cu_seqlens_k, cq.shape[0])
    if cq.shape[0] < 1:
        _bad("cu_seqlens_q: empty: needs S + 1 >= 1 offsets")
    pq = None if positions_q is None else _int64_array("positions_q", positions_q, tq)
    pk = None if positions_k is None else _int64_array("positions_k", positions_k, tk)
    keep = []
    desc = _table_desc(_build_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                                   None, 0, skip_tol, keep, rope_scale), bias_table, H, keep)
    vl = _varlen_struct(cq, ck, pq, pk)
    dev = _device_spec(device)
    if qa.kind == "torch":
        out = _torch().empty((tq, H, D), dtype=qa.np_dtype)
    else:
        out = np.empty((tq, H, D), dtype=qa.np_dtype)
    oa = _packed_view("o", out)
    lse, lse_ptr = _empty_lse(qa, (tq, H)) if return_lse else (None, None)
    tq_, tk_, tv_, to_ = _Tensors.pack((qa, ka, va, oa))
    st, st_ptr = _stats_arg(stats)
    err = lib.ape_attention_forward_varlen(dev, ctypes.byref(desc), ctypes.byref(vl), tq_, tk_,
                                           tv_, to_, lse_ptr, st_ptr)
    if err:
        _raise(err)
    return _with_stats((out, lse) if return_lse else out, st)


def _with_positions(desc, positions_q, positions_k, Lq, Lk, q_start, k_start, keep):
    """A copy of desc (cached ones are shared) with explicit positions, kept alive in keep."""
    if positions_q is None or positions_k is None:
        _bad("positions_q, positions_k: give both or neither")
    if q_start is not None or k_start != 0:
        _bad("q_start, k_start: explicit positions replace them (leave q_start None, k_start 0)")
    pq = _int64_array("positions_q", positions_q, Lq)
    pk = _int64_array("positions_k", positions_k, Lk)
    d = _capi.ApeAttnDesc()
    ctypes.pointer(d)[0] = desc
    d.pos_q = _i64p(pq)
    d.pos_k = _i64p(pk)
    keep.extend((pq, pk))
    return d


def _varlen_struct(cq, ck, pq, pk):
    vl = _capi.ApeVarlen()
    lib.ape_varlen_init(ctypes.byref(vl))
    vl.num_seqs = cq.shape[0] - 1
    vl.cu_seqlens_q = _i64p(cq)
    vl.cu_seqlens_k = _i64p(ck)
    vl.pos_q = _i64p(pq)
    vl.pos_k = _i64p(pk)
    return vl


def attention_varlen_backward(q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, *, dlse=None,
                              positions_q=None, positions_k=None, delta=SEED_DELTA,
                              beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA, causal=True,
                              scale=None, rope_base=10000.0, layout="half", wrt=None,
                              device="auto", stats=False, rope_scale=1.0, skip_tol=0.0,
                              bias_table=None):
    """The gradients of `attention_varlen()` (ape_attention_backward_varlen()): its inputs, O
    and LSE `[total_q, H]` (return_lse=True), dL/dO `dout` `[total_q, H, D]` and optionally
    dL/dLSE; returns `(dq, dk, dv, dparams)` packed like q, k, k and `[H, 4]`, and with a
    bias_table `(dq, dk, dv, dparams, dbias_table)`, those not in `wrt` None (wrt and the table's
    gradient as for attention_backward()). Arrays as for `attention_varlen()`. stats=True as for
    attention(); skip_tol as for attention_backward() (default 0)."""
    want = _wanted(wrt, bias_table)
    qa, ka, va = _packed_view("q", q), _packed_view("k", k), _packed_view("v", v)
    oa, da = _packed_view("o", o), _packed_view("dout", dout)
    if not (qa.kind == ka.kind == va.kind == oa.kind == da.kind):
        _bad("q, k, v, o, dout: mixed kinds: pass all NumPy arrays or all torch tensors")
    _, H, tq, D = qa.shape
    tk, Hkv = ka.shape[2], ka.shape[1]
    cq = _int64_array("cu_seqlens_q", cu_seqlens_q)
    ck = _int64_array("cu_seqlens_k", cu_seqlens_k, cq.shape[0])
    if cq.shape[0] < 1:
        _bad("cu_seqlens_q: empty: needs S + 1 >= 1 offsets")
    pq = None if positions_q is None else _int64_array("positions_q", positions_q, tq)
    pk = None if positions_k is None else _int64_array("positions_k", positions_k, tk)
    lse_keep, lse_ptr = _lse_buffer("lse", lse, qa.kind, (tq, H), "[total_q, H]")
    dlse_keep, dlse_ptr = (None, None) if dlse is None else \
        _lse_buffer("dlse", dlse, qa.kind, (tq, H), "[total_q, H]")
    keep = []
    desc, db = _grad_table(_build_desc(H, delta, beta, gamma, lam, causal, scale, rope_base,
                                       layout, None, 0, float(skip_tol), keep, rope_scale),
                           bias_table, H, want, qa, keep)
    vl = _varlen_struct(cq, ck, pq, pk)
    dev = _device_spec(device)

    def empty(shape):
        if qa.kind == "torch":
            return _torch().empty(shape, dtype=qa.np_dtype)
        return np.empty(shape, dtype=qa.np_dtype)

    dq = empty((tq, H, D)) if "q" in want else None
    dk = empty((tk, Hkv, D)) if "k" in want else None
    dv = empty((tk, Hkv, D)) if "v" in want else None
    dp, dp_ptr = _empty_lse(qa, (H, 4)) if "params" in want else (None, None)
    views = [_packed_view(n, x) for n, x in (("dq", dq), ("dk", dk), ("dv", dv)) if x is not None]
    ptrs = iter(_Tensors.pack([qa, ka, va, oa, da] + views))
    tq_, tk_, tv_, to_, tdo = (next(ptrs) for _ in range(5))
    tdq = next(ptrs) if dq is not None else None
    tdk = next(ptrs) if dk is not None else None
    tdv = next(ptrs) if dv is not None else None
    devs = (ctypes.c_void_p * 1)(dev)
    st, st_ptr = _stats_arg(stats)
    err = lib.ape_attention_backward_varlen(devs, 1, None, ctypes.byref(desc), ctypes.byref(vl),
                                            tq_, tk_, tv_, to_, lse_ptr, tdo, dlse_ptr, tdq, tdk,
                                            tdv, dp_ptr, st_ptr)
    if err:
        _raise(err)
    return _with_stats((dq, dk, dv, dp) + (() if bias_table is None else (db,)), st)


def position_ids_to_cu_seqlens(position_ids):
    """Hugging Face style position_ids (one row of packed documents, each restarting at 0, as
    DataCollatorWithFlattening emits) to cu_seqlens: int64 offsets of the documents' starts,
    from 0 to the length. A 2-D input must be one row."""
    if type(position_ids).__module__.startswith("torch"):
        position_ids = position_ids.detach().cpu().numpy()
    p = np.asarray(position_ids)
    if p.ndim == 2 and p.shape[0] == 1:
        p = p[0]
    if p.ndim != 1 or p.dtype.kind not in "iu":
        _bad("position_ids: must be one row of integers, got shape %s dtype %s"
             % (p.shape, p.dtype))
    starts = np.flatnonzero(p == 0) if p.size else np.zeros(0, dtype=np.int64)
    if p.size and (starts.size == 0 or starts[0] != 0):
        _bad("position_ids: must start at 0 (each document restarts at 0)")
    return np.concatenate([starts, [p.size]]).astype(np.int64)


def _is_torch_cuda(x):
    return type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False)


_DL_DTYPES = None


def _dl_tensor(name, x, keep):
    """A DLTensor describing torch tensor x where it is (no copy); its shape and strides arrays
    go into `keep`, which must outlive the call."""
    global _DL_DTYPES
    torch = _torch()
    if _DL_DTYPES is None:
        _DL_DTYPES = {torch.float32: (_capi.KDL_FLOAT, 32), torch.float16: (_capi.KDL_FLOAT, 16),
                      torch.bfloat16: (_capi.KDL_BFLOAT, 16)}
    dt = _DL_DTYPES.get(x.dtype)
    if dt is None:
        _bad("%s: dtype %s: libape stores float32, float16 or bfloat16; convert it first"
             % (name, x.dtype))
    shape = (ctypes.c_int64 * x.dim())(*x.shape)
    strides = (ctypes.c_int64 * x.dim())(*x.stride())
    keep.extend((x, shape, strides))
    kind = _capi.KDL_CUDA if x.is_cuda else _capi.KDL_CPU
    return _capi.DLTensor(x.data_ptr(), _capi.DLDevice(kind, x.device.index or 0), x.dim(),
                          _capi.DLDataType(dt[0], dt[1], 1), shape, strides, 0)


def _attention_cuda(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base, layout, q_start,
                    k_start, skip_tol, device, return_lse, diag=False, rope_scale=1.0,
                    bias_table=None):
    """CUDA tensors: libape's CUDA device of the same ordinal computes on them where they are,
    on PyTorch's current stream (ape_attention_forward_dlpack(), or with diag
    ape_attention_forward_dlpack_diag(), returning (O, LSE, entropy, mean_distance)); nothing is
    copied and the call returns once the work is enqueued, as PyTorch's own operations do."""
    torch = _torch()
    name = "ape_attention_forward_dlpack_diag" if diag else "ape_attention_forward_dlpack"
    fn = _capi.optional[name]
    if fn is None:
        _bad("q: a CUDA tensor, but %s has no %s(): build libape with libdlpack-dev (make deps) "
             "or move the tensors with .cpu()" % (_capi.path, name))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_torch_cuda(x) or x.device != q.device:
            _bad("%s: on %s, q on %s: pass q, k and v on one CUDA device"
                 % (name, getattr(x, "device", type(x).__name__), q.device))
        if x.dim() != 4:
            _bad("%s: shape %s: must be 4-D [B, H, L, D]" % (name, tuple(x.shape)))
    if any(s <= 0 and n > 1 for x in (q, k, v) for s, n in zip(x.stride(), x.shape)) or \
            any(x.stride(3) != 1 for x in (q, k, v)):
        q, k, v = (x.contiguous() for x in (q, k, v))  # the layout demands a copy
    B, H, Lq, D = q.shape
    keep = []
    desc = _table_desc(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                             q_start, k_start, skip_tol, keep, rope_scale), bias_table, H, keep)
    spec = "cuda:%d" % q.device.index if device in (None, "auto") else device
    dev = _device_spec(spec)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    return _dlpack_call(fn, dev, desc, keep, q, k, v, return_lse, diag, ctypes.c_void_p(stream))


def _dlpack_call(fn, dev, desc, keep, q, k, v, return_lse, diag, stream):
    """The DLPack call on torch tensors q, k, v (all on one device): allocates O (and LSE, and
    with diag the entropy and mean distance) there and returns them as the public call does."""
    torch = _torch()
    B, H, Lq, D = q.shape
    o = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    rows = [torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
            for _ in range(1 + 2 * bool(diag))] if return_lse or diag else []
    tq, tk, tv, to = (_dl_tensor(n, x, keep) for n, x in (("q", q), ("k", k), ("v", v), ("o", o)))
    trows = [_dl_tensor(n, x, keep) for n, x in zip(("lse", "entropy", "mean_distance"), rows)]
    args = [ctypes.byref(t) for t in [tq, tk, tv, to] + trows]
    if not rows:
        args.append(None)  # lse not wanted
    err = fn(dev, ctypes.byref(desc), *args, stream)
    if err:
        _raise(err)
    if diag:
        return (o,) + tuple(rows)
    return (o, rows[0]) if return_lse else o


def _dlpack_forward_cpu(dev, q, k, v, return_lse, diag=False, **params):
    """The DLPack path on CPU torch tensors (kDLCPU): what CUDA tensors take, exercised where
    there is no GPU (with diag: attention_diagnostics()' path). For tests."""
    fn = _capi.optional["ape_attention_forward_dlpack_diag" if diag else
                        "ape_attention_forward_dlpack"]
    H = q.shape[1]
    keep = []
    desc = _desc(H, params.get("delta", SEED_DELTA), params.get("beta", SEED_BETA),
                 params.get("gamma", SEED_GAMMA), params.get("lam", SEED_LAMBDA),
                 params.get("causal", True), params.get("scale"), 10000.0, "half",
                 params.get("q_start"), params.get("k_start", 0), params.get("skip_tol", 2.0 ** -24),
                 keep)
    desc = _table_desc(desc, params.get("bias_table"), H, keep)
    return _dlpack_call(fn, _device_spec(dev), desc, keep, q, k, v, return_lse, diag, None)


def _backward_dlpack(dev, q, k, v, o, lse, dout, dlse, delta, beta, gamma, lam, causal, scale,
                     rope_base, layout, q_start, k_start, wrt, stream, rope_scale=1.0,
                     skip_tol=0.0, bias_table=None):
    """ape_attention_backward_dlpack() on torch tensors where they are (CPU: kDLCPU, returning
    once written; CUDA: kDLCUDA on `stream`, returning once enqueued): (dq, dk, dv, dparams
    [H, 4] float32), each None where `wrt` does not name it, allocated beside q. A bias_table
    is read (host memory), its gradient not computed: that is attention_backward()'s."""
    torch = _torch()
    fn = _capi.optional["ape_attention_backward_dlpack"]
    want = set(wrt)
    if not want or not want <= set(_WRT):
        _bad("wrt = %r: name one or more of 'q', 'k', 'v', 'params'" % (wrt,))
    # what libape cannot address in place (broadcast or negative strides, as autograd's dO of a
    # sum() is, or a D axis that is not contiguous) is copied into a dense tensor first
    q, k, v, o, lse, dout, dlse = (
        x if x is None or (x.stride(-1) == 1 and
                           all(st > 0 or n <= 1 for st, n in zip(x.stride(), x.shape)))
        else x.contiguous() for x in (q, k, v, o, lse, dout, dlse))
    B, H, Lq, D = q.shape
    keep = []
    desc = _table_desc(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                             q_start, k_start, skip_tol, keep, rope_scale), bias_table, H, keep)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if "q" in want else None
    dk = torch.empty(k.shape, dtype=q.dtype, device=q.device) if "k" in want else None
    dv = torch.empty(k.shape, dtype=q.dtype, device=q.device) if "v" in want else None
    dp = torch.empty((H, 4), dtype=torch.float32, device=q.device) if "params" in want else None
    ts = [None if x is None else _dl_tensor(n, x, keep) for n, x in
          (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("dout", dout),
           ("dlse", dlse), ("dq", dq), ("dk", dk), ("dv", dv), ("dparams", dp))]
    err = fn(_device_spec(dev), ctypes.byref(desc),
             *(None if t is None else ctypes.byref(t) for t in ts),
             None if stream is None else ctypes.c_void_p(stream))
    if err:
        _raise(err)
    return dq, dk, dv, dp


def _attention_backward_cuda(q, k, v, o, lse, dout, dlse, delta, beta, gamma, lam, causal,
                             scale, rope_base, layout, q_start, k_start, wrt, device,
                             rope_scale=1.0, skip_tol=0.0, bias_table=None):
    """CUDA tensors: the gradients computed where the tensors are, by libape's CUDA device of
    their ordinal, on PyTorch's current stream (ape_attention_backward_dlpack()): nothing is
    copied through host memory, and the call returns once the work is enqueued. None when this
    libape has no ape_attention_backward_dlpack() (the caller copies through the host)."""
    torch = _torch()
    if _capi.optional["ape_attention_backward_dlpack"] is None:
        return None
    for name, x in (("k", k), ("v", v), ("o", o), ("lse", lse), ("dout", dout), ("dlse", dlse)):
        if x is not None and (not _is_torch_cuda(x) or x.device != q.device):
            _bad("%s: on %s, q on %s: pass every tensor on one CUDA device"
                 % (name, getattr(x, "device", type(x).__name__), q.device))
    spec = "cuda:%d" % (q.device.index or 0) if device in (None, "auto") else device
    stream = torch.cuda.current_stream(q.device).cuda_stream
    return _backward_dlpack(spec, q, k, v, o, lse, dout, dlse, delta, beta, gamma, lam, causal,
                            scale, rope_base, layout, q_start, k_start, wrt, stream,
                            rope_scale=rope_scale, skip_tol=skip_tol, bias_table=bias_table)


def _dlpack_backward_cpu(dev, q, k, v, o, lse, dout, dlse=None, wrt=("q", "k", "v", "params"),
                         **params):
    """The DLPack backward on CPU torch tensors (kDLCPU): what CUDA tensors take, exercised
    where there is no GPU. For tests."""
    return _backward_dlpack(dev, q, k, v, o, lse, dout, dlse, params.get("delta", SEED_DELTA),
                            params.get("beta", SEED_BETA), params.get("gamma", SEED_GAMMA),
                            params.get("lam", SEED_LAMBDA), params.get("causal", True),
                            params.get("scale"), 10000.0, "half", params.get("q_start"),
                            params.get("k_start", 0), wrt, None,
                            bias_table=params.get("bias_table"))


def attention_diagnostics(q, k, v, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA,
                          lam=SEED_LAMBDA, causal=True, scale=None, rope_base=10000.0,
                          layout="half", q_start=None, k_start=0, skip_tol=2.0 ** -24,
                          device="auto", rope_scale=1.0, bias_table=None):
    """`attention()` that also returns each row's attention entropy -sum_j P ln P and mean
    attention distance sum_j P |pos_q - pos_k| (docs/diagnostics.md), computed in the same
    pass: returns (O, LSE, entropy, mean_distance), the last three `[B, H, Lq]` float32 of q's
    kind. Arguments as attention(); the call runs under min(skip_tol, 2^-24), where the
    diagnostics stay within the spec's tolerance. torch CUDA tensors are computed where they
    are, on PyTorch's current stream (ape_attention_forward_dlpack_diag()), as attention() does.
    Raises ApeError on a device whose backend does not compute them (the reference, OpenCL
    and CUDA backends all do; CUDA's kernels have run on the CPU emulator only). rope_scale
    and bias_table as for attention(): the entropy curve of any distance-bias table."""
    if _is_torch_cuda(q) or _is_torch_cuda(k) or _is_torch_cuda(v):
        return _attention_cuda(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base,
                               layout, q_start, k_start, skip_tol, device, True, diag=True,
                               rope_scale=rope_scale, bias_table=bias_table)
    qa, ka, va, desc, keep = _host_call(q, k, v, delta, beta, gamma, lam, causal, scale,
                                        rope_base, layout, q_start, k_start, skip_tol,
                                        rope_scale)
    B, H, Lq, D = qa.shape
    desc = _table_desc(desc, bias_table, H, keep)
    devs = (ctypes.c_void_p * 1)(_device_spec(device))
    oa = _empty_like(qa, (B, H, Lq, D))
    outs = [_empty_lse(qa, (B, H, Lq)) for _ in range(3)]
    tq, tk, tv, to = _Tensors.pack((qa, ka, va, oa))
    err = _forward_diag(devs, 1, None, ctypes.byref(desc), tq, tk, tv, to,
                        *(ptr for _, ptr in outs), None)
    if err:
        _raise(err)
    return (oa.obj,) + tuple(arr for arr, _ in outs)


# ------------------------------------------------------------------ KV cache

class KVCache:
    """Keys and values of one sequence kept on a device, for decoding and chunked prefill (see
    ape_kv_cache_* in ape.h). `append(k, v)` adds tokens `[B, Hkv, n, D]`; `attend(q, ...)`
    runs queries `[B, H, Lq, D]` (Lq <= max_queries) over every cached token and returns O
    (and LSE). Use it from one thread at a time; `close()` (or a `with` block) frees it."""

    _DTYPES = {"float32": _capi.F32, "float16": _capi.F16, "bfloat16": _capi.BF16}

    def __init__(self, *, B=1, Hkv, D, capacity_tokens, H=0, dtype="float32", block_tokens=0,
                 k_start=0, max_queries=0, append_chunk=0, attend_chunk=0, max_device_bytes=0,
                 allow_release=False, max_query_norm=0.0, device="auto"):
        code = self._DTYPES.get(str(dtype).replace("torch.", "").replace("numpy.", ""))
        if code is None:
            _bad("dtype = %r: must be float32, float16 or bfloat16" % (dtype,))
        opts = _capi.ApeKvCacheOptions()
        lib.ape_kv_cache_options_init(ctypes.byref(opts))
        for field, val in (("B", B), ("Hkv", Hkv), ("H", H), ("D", D),
                           ("block_tokens", block_tokens), ("capacity_tokens", capacity_tokens),
                           ("k_start", k_start), ("max_queries", max_queries),
                           ("append_chunk", append_chunk), ("attend_chunk", attend_chunk),
                           ("max_device_bytes", max_device_bytes)):
            setattr(opts, field, int(val))
        opts.dtype = code
        opts.allow_release = bool(allow_release)
        opts.max_query_norm = float(max_query_norm)
        self._dtype = code
        self._H = int(H) or int(Hkv)
        self._c = None
        dev = _device_spec(device)
        c = ctypes.c_void_p()
        err = lib.ape_kv_cache_create(dev, ctypes.byref(opts), ctypes.byref(c))
        if err:
            _raise(err)
        self._c = c
        _context.own(self)

    def _live(self):
        if self._c is None:
            _bad("KVCache: the cache was closed")
        return self._c

    def append(self, k, v):
        c = self._live()
        ka, va = _as_array("k", k), _as_array("v", v)
        tk, tv = _tensor(ka), _tensor(va)
        err = lib.ape_kv_cache_append(c, ctypes.byref(tk), ctypes.byref(tv))
        if err:
            _raise(err)

    def attend(self, q, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA,
               causal=True, scale=None, rope_base=10000.0, layout="half", q_start=None,
               skip_tol=2.0 ** -24, return_lse=False, stats=False, rope_scale=1.0,
               bias_table=None):
        """ape_kv_cache_attend(): o (and lse with return_lse=True; the C call's statistics as
        a dict after them with stats=True, as for attention()); rope_scale and bias_table as
        for attention() (a cache that released blocks refuses a table)."""
        c = self._live()
        qa = _as_array("q", q)
        B, H, Lq, D = qa.shape
        keep = []
        desc = _table_desc(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                                 q_start, 0, skip_tol, keep, rope_scale), bias_table, H, keep)
        oa = _empty_like(qa, (B, H, Lq, D))
        lse, lse_ptr = _empty_lse(qa, (B, H, Lq)) if return_lse else (None, None)
        tq, to = _tensor(qa), _tensor(oa)
        st, st_ptr = _stats_arg(stats)
        err = lib.ape_kv_cache_attend(c, ctypes.byref(desc), ctypes.byref(tq), ctypes.byref(to),
                                      lse_ptr, st_ptr)
        if err:
            _raise(err)
        return _with_stats((oa.obj, lse) if return_lse else oa.obj, st)

    def release_unreachable(self, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA,
                            lam=SEED_LAMBDA, causal=True, scale=None, rope_base=10000.0,
                            layout="half", skip_tol=2.0 ** -24):
        """Releases the oldest blocks no future query with these parameters can reach; returns
        how many tokens were released."""
        c = self._live()
        keep = []
        desc = _desc(self._H, delta, beta, gamma, lam, causal, scale, rope_base, layout, None, 0,
                     skip_tol, keep)
        n = ctypes.c_int64()
        err = lib.ape_kv_cache_release_unreachable(c, ctypes.byref(desc), ctypes.byref(n))
        if err:
            _raise(err)
        return n.value

    def info(self):
        """The cache's state as a dict (ape_kv_cache_info's fields)."""
        c = self._live()
        i = _capi.ApeKvCacheInfo()
        err = lib.ape_kv_cache_get_info(c, ctypes.byref(i))
        if err:
            _raise(err)
        return {name: getattr(i, name) for name, _ in _capi.ApeKvCacheInfo._fields_}

    def close(self):
        if self._c is not None:
            lib.ape_kv_cache_destroy(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # interpreter shutdown may have torn the module down already
        if getattr(self, "_c", None) is not None and lib is not None:
            self.close()


# ------------------------------------------------------------------ KV pool

class _RaggedOut:
    """The outputs of a ragged attend (KVPool.attend, PagedKV.run) for q `[total_q, H, D]`:
    O of q's kind and dtype, and LSE, entropy and mean distance `[total_q, H]` float32 as asked
    for, with their addresses; result() is what the call returns."""

    def __init__(self, qa, return_lse, return_diagnostics):
        _, H, tq, D = qa.shape
        if qa.kind == "torch":
            self.out = _torch().empty((tq, H, D), dtype=qa.np_dtype)
        else:
            self.out = np.empty((tq, H, D), dtype=qa.np_dtype)
        self.oa = _packed_view("o", self.out)
        self.lse, self.lse_ptr = _empty_lse(qa, (tq, H)) if return_lse else (None, None)
        self.diag = return_diagnostics
        (self.ent, self.ent_ptr), (self.md, self.md_ptr) = (
            (_empty_lse(qa, (tq, H)), _empty_lse(qa, (tq, H))) if return_diagnostics
            else ((None, None), (None, None)))

    def result(self, st):
        res = (self.out,) + ((self.lse,) if self.lse is not None else ())
        if self.diag:
            res += (self.ent, self.md)
        return _with_stats(res if len(res) > 1 else self.out, st)


def _dtype_code(dtype):
    """A storage dtype given as a string ("float16"), a NumPy type or dtype, or a torch dtype:
    its ape_dtype code."""
    try:
        name = np.dtype(dtype).name  # strings, NumPy types and dtypes
    except TypeError:
        name = str(dtype)  # torch.float16, "bfloat16"
    code = KVCache._DTYPES.get(name.replace("torch.", "").replace("numpy.", ""))
    if code is None:
        _bad("dtype = %r: must be float32, float16 or bfloat16" % (dtype,))
    return code


_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1


class KVPool:
    """Keys and values of many sequences on one device, in fixed-size pages taken from one
    pool allocated at creation: the KV store of a server doing continuous batching (see
    ape_kv_pool_* in ape.h, and docs/python.md, "KV pool").

        pool = libape.KVPool(Hkv=2, D=64, capacity_tokens=65536, H=8)
        a = pool.add_sequence()                # an id; positions from k_start (default 0)
        pool.append(a, k, v)                   # k, v [n, Hkv, D] packed token by token
        b = pool.fork(a)                       # shares a's pages, copied on first write
        pool.append_batch([a, b], [0, 1, 2], k2, v2)   # one decode step of both
        o = pool.attend(q, [a, b], [0, 1, 2])  # q [total_q, H, D]: each run of rows sees
                                               # the keys of its own sequence only
        pool.remove(b)                         # its unshared pages go back to the pool

    Arrays are NumPy (float32, float16) or torch CPU tensors (float32, float16, bfloat16) of
    the pool's dtype; strided views (slices of a packed QKV buffer) go to libape without a copy.
    Offsets and ids take lists, NumPy int32/int64 arrays and torch tensors. A pool with too
    few free pages raises ApeError (APE_ENOMEM) and appends nothing; an id that is not a live
    sequence of this pool raises ValueError. Use it from one thread at a time; `close()` (or a
    `with` block) frees it and its device memory.
    """

    def __init__(self, Hkv, D, capacity_tokens, *, H=0, page_tokens=16, dtype="float32",
                 device="auto", max_batch_tokens=0, attend_chunk=0, max_device_bytes=0,
                 max_query_norm=0.0):
        self._p = None
        self._seqs = set()
        self._H = int(H) or int(Hkv)
        code = _dtype_code(dtype)
        if int(max_device_bytes) < 0:
            _bad("max_device_bytes = %d: must be >= 0 (0: no limit)" % int(max_device_bytes))
        opts = _capi.ApeKvPoolOptions()
        lib.ape_kv_pool_options_init(ctypes.byref(opts))
        for field, val in (("Hkv", Hkv), ("H", H), ("D", D), ("page_tokens", page_tokens),
                           ("capacity_tokens", capacity_tokens),
                           ("max_batch_tokens", max_batch_tokens),
                           ("attend_chunk", attend_chunk), ("max_device_bytes", max_device_bytes)):
            val = int(val)
            if not _I64_MIN <= val <= _I64_MAX:
                _bad("%s = %d: out of range" % (field, val))
            setattr(opts, field, val)
        opts.max_query_norm = float(max_query_norm)
        opts.dtype = code
        self._dtype = code
        dev = _device_spec(device)
        p = ctypes.c_void_p()
        err = lib.ape_kv_pool_create(dev, ctypes.byref(opts), ctypes.byref(p))
        if err:
            _raise(err)
        self._p = p
        _context.own(self)

    def _live(self):
        if self._p is None:
            _bad("KVPool: the pool was closed")
        return self._p

    def _known(self, sid, name="seq_id"):
        """One sequence id, checked against the live ones (a ValueError naming it)."""
        try:
            i = int(sid.__index__())
        except (AttributeError, TypeError, ValueError, RuntimeError):
            _bad("%s = %r: a sequence id is an int (what add_sequence() or fork() returned)"
                 % (name, sid))
        if i not in self._seqs:
            _bad("%s = %d: not a sequence of this pool (never added, or removed); %d live"
                 % (name, i, len(self._seqs)))
        return i

    def _ids(self, seq_ids):
        """The ids of a batch as a contiguous int64 array, each a live sequence."""
        if type(seq_ids).__module__.startswith("torch"):
            seq_ids = seq_ids.detach().cpu().numpy()
        a = np.asarray(seq_ids)
        if a.ndim == 1 and a.size == 0:
            return np.zeros(0, dtype=np.int64)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            _bad("seq_ids: must be a 1-D sequence of integer ids, got shape %s dtype %s"
                 % (a.shape, a.dtype))
        a = np.ascontiguousarray(a, dtype=np.int64)
        if not self._seqs.issuperset(a.tolist()):
            for j, i in enumerate(a.tolist()):
                if i not in self._seqs:
                    self._known(i, "seq_ids[%d]" % j)
        return a

    def add_sequence(self, k_start=0):
        """A new empty sequence whose first token will sit at position k_start; returns its id
        (ids are never reused). It takes no page until its first append."""
        p = self._live()
        k_start = int(k_start)
        if not _I64_MIN <= k_start <= _I64_MAX:
            _bad("k_start = %d: out of range" % k_start)
        sid = ctypes.c_int64()
        err = lib.ape_kv_pool_add_sequence(p, k_start, ctypes.byref(sid))
        if err:
            _raise(err)
        self._seqs.add(sid.value)
        return sid.value

    def fork(self, seq_id):
        """A new sequence holding the tokens of seq_id at the same positions, sharing its pages
        (a shared page is copied once, when either first appends into it); returns its id."""
        p = self._live()
        sid = self._known(seq_id)
        new = ctypes.c_int64()
        err = lib.ape_kv_pool_fork(p, sid, ctypes.byref(new))
        if err:
            _raise(err)
        self._seqs.add(new.value)
        return new.value

    def remove(self, seq_id):
        """Removes a sequence: its id becomes unknown, and each of its pages returns to the pool
        once no other sequence shares it."""
        p = self._live()
        sid = self._known(seq_id)
        err = lib.ape_kv_pool_remove_sequence(p, sid)
        if err:
            _raise(err)
        self._seqs.discard(sid)

    def append(self, seq_id, k, v):
        """Appends k, v `[n, Hkv, D]` (packed token by token, of the pool's dtype) to one
        sequence, at the positions after its tokens. ApeError APE_ENOMEM when the pool has too
        few free pages: nothing is appended."""
        p = self._live()
        sid = self._known(seq_id)
        ka, va = _packed_view("k", k), _packed_view("v", v)
        if ka.kind != va.kind:
            _bad("k, v: mixed kinds (%s, %s): pass NumPy arrays or torch tensors, not both"
                 % (ka.kind, va.kind))
        tk, tv = _Tensors.pack((ka, va))
        err = lib.ape_kv_pool_append(p, sid, tk, tv)
        if err:
            _raise(err)

    def append_batch(self, seq_ids, cu_seqlens, k, v):
        """Appends to many sequences at once (a step of every request): seq_ids[i] gets the
        tokens [cu_seqlens[i], cu_seqlens[i + 1]) of the packed k, v `[total, Hkv, D]`. Every
        sequence gets its tokens, or (ApeError, ValueError) none does."""
        p = self._live()
        ids = self._ids(seq_ids)
        cu = _int64_array("cu_seqlens", cu_seqlens, ids.shape[0] + 1)
        ka, va = _packed_view("k", k), _packed_view("v", v)
        if ka.kind != va.kind:
            _bad("k, v: mixed kinds (%s, %s): pass NumPy arrays or torch tensors, not both"
                 % (ka.kind, va.kind))
        tk, tv = _Tensors.pack((ka, va))
        err = lib.ape_kv_pool_append_batch(p, ids.shape[0], _i64p(ids), _i64p(cu), tk, tv)
        if err:
            _raise(err)

    def attend(self, q, seq_ids, cu_seqlens_q, *, positions_q=None, delta=SEED_DELTA,
               beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA, causal=True, scale=None,
               rope_base=10000.0, layout="half", skip_tol=2.0 ** -24, rope_scale=1.0,
               return_lse=False, return_diagnostics=False, stats=False, bias_table=None):
        """Attention of a ragged batch of query rows over the pool (ape_kv_pool_attend()): q
        `[total_q, H, D]` (total_q <= max_batch_tokens), rows [cu_seqlens_q[i],
        cu_seqlens_q[i + 1]) of sequence seq_ids[i] see that sequence's keys only. Rows sit at
        the end of their sequence's keys (the last at its newest token's position: append a
        step's keys first), or at positions_q `[total_q]` (int64, any values). Parameters as
        for attention(). Returns O `[total_q, H, D]` of q's kind and dtype (0 for rows that see
        no key), and LSE `[total_q, H]` float32 with return_lse=True (-inf for those rows);
        return_diagnostics=True appends each row's attention entropy and mean attention
        distance, `[total_q, H]` float32 each (ape_kv_pool_attend_diag(): 0 for rows that see
        no key); stats=True appends the call's statistics as for attention(); bias_table as
        for attention() (a sequence that released pages refuses a table)."""
        p = self._live()
        qa = _packed_view("q", q)
        _, H, tq, D = qa.shape
        ids = self._ids(seq_ids)
        cq = _int64_array("cu_seqlens_q", cu_seqlens_q, ids.shape[0] + 1)
        pq = None if positions_q is None else _int64_array("positions_q", positions_q, tq)
        keep = []
        desc = _table_desc(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                                 None, 0, skip_tol, keep, rope_scale), bias_table, H, keep)
        r = _RaggedOut(qa, return_lse, return_diagnostics)
        tq_, to_ = _Tensors.pack((qa, r.oa))
        st, st_ptr = _stats_arg(stats)
        if return_diagnostics:
            err = lib.ape_kv_pool_attend_diag(p, ctypes.byref(desc), ids.shape[0], _i64p(ids),
                                              _i64p(cq), _i64p(pq), tq_, to_, r.lse_ptr,
                                              r.ent_ptr, r.md_ptr, st_ptr)
        else:
            err = lib.ape_kv_pool_attend(p, ctypes.byref(desc), ids.shape[0], _i64p(ids),
                                         _i64p(cq), _i64p(pq), tq_, to_, r.lse_ptr, st_ptr)
        if err:
            _raise(err)
        return r.result(st)

    def release_unreachable(self, seq_id, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA,
                            lam=SEED_LAMBDA, causal=True, scale=None, rope_base=10000.0,
                            layout="half", skip_tol=2.0 ** -24):
        """ape_kv_pool_release_unreachable(): releases the oldest whole pages of sequence
        seq_id that no later query with these parameters (and |q| <= the pool's
        max_query_norm) can reach; returns how many tokens were released. Later attends of the
        sequence that break those terms raise ApeError (APE_EINVAL)."""
        p = self._live()
        sid = self._known(seq_id)
        keep = []
        desc = _desc(self._H, delta, beta, gamma, lam, causal, scale, rope_base, layout, None, 0,
                     skip_tol, keep)
        n = ctypes.c_int64()
        err = lib.ape_kv_pool_release_unreachable(p, sid, ctypes.byref(desc), ctypes.byref(n))
        if err:
            _raise(err)
        return n.value

    def info(self):
        """The pool's state as a dict (every field of ape_kv_pool_info): page_tokens,
        pages_total, pages_used, pages_free, pages_shared, sequences, tokens, pages_copied,
        device_bytes."""
        p = self._live()
        i = _capi.ApeKvPoolInfo()
        err = lib.ape_kv_pool_get_info(p, ctypes.byref(i))
        if err:
            _raise(err)
        return {name: getattr(i, name) for name, _ in _capi.ApeKvPoolInfo._fields_}

    def sequence_info(self, seq_id):
        """One sequence's state: dict(tokens=, k_start=) (the position of its first token)."""
        p = self._live()
        sid = self._known(seq_id)
        tokens, k_start = ctypes.c_int64(), ctypes.c_int64()
        err = lib.ape_kv_pool_sequence_info(p, sid, ctypes.byref(tokens), ctypes.byref(k_start))
        if err:
            _raise(err)
        return {"tokens": tokens.value, "k_start": k_start.value}

    def close(self):
        if self._p is not None:
            lib.ape_kv_pool_destroy(self._p)
            self._p = None
            self._seqs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # interpreter shutdown may have torn the module down already
        if getattr(self, "_p", None) is not None and lib is not None:
            self.close()


# ------------------------------------------------------------------ the caller's pages (PagedKV)

ENOTSUP = -95
# a pages argument's dims in the order [num_pages, Hkv, page_tokens, D] that ape_dtensor takes,
# per layout and rank (5-D: [num_pages, 2, ...], K at index 0 and V at 1 of dim 1)
_PAGE_DIMS = {("NHD", 4): (0, 2, 1, 3), ("HND", 4): (0, 1, 2, 3),
              ("NHD", 5): (0, 3, 2, 4), ("HND", 5): (0, 2, 3, 4)}
_PAGE_ROWS = {"NHD": "page_tokens, Hkv, D", "HND": "Hkv, page_tokens, D"}


def _table_array(name, x, ndim=1):
    """A page table's array (a list, NumPy array, torch tensor of any device) as contiguous
    int64 NumPy of `ndim` dims; an empty one of any dtype is taken."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != ndim:
        _bad("%s: shape %s: must be %d-D" % (name, a.shape, ndim))
    if a.size and a.dtype.kind not in "iu":
        _bad("%s: dtype %s: must be integers (int32 or int64)" % (name, a.dtype))
    return np.ascontiguousarray(a, dtype=np.int64)


def _host_pages(name, x):
    """Host memory of pages, where it lies: (object to keep alive, address, ape_dtype code,
    element size, shape, strides in elements). NumPy arrays, torch CPU tensors and objects
    with __dlpack__ on the CPU."""
    if type(x).__module__.startswith("torch"):
        torch = _torch()
        if x.device.type != "cpu":
            _bad("%s: a tensor on %s: PagedKV.run takes pages in host memory (NumPy arrays, "
                 "torch CPU tensors)" % (name, x.device))
        code = _torch_dtypes(torch).get(x.dtype)
        if code is None:
            _bad("%s: dtype %s: libape stores float32, float16 or bfloat16" % (name, x.dtype))
        return x, x.data_ptr(), code, x.element_size(), tuple(x.shape), tuple(x.stride())
    if not isinstance(x, np.ndarray):
        if not hasattr(x, "__dlpack__"):
            _bad("%s: a %s is not an array: pass a NumPy array, a torch CPU tensor or an object "
                 "with __dlpack__" % (name, type(x).__name__))
        try:
            x = np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            _bad("%s: not host memory NumPy can read through __dlpack__ (%s)" % (name, e))
    code = _NP_DTYPES.get(x.dtype)
    if code is None:
        _bad("%s: dtype %s: libape stores float32 or float16 (bfloat16 as a torch tensor)"
             % (name, x.dtype))
    isz = x.itemsize
    if any(s % isz for s in x.strides):
        _bad("%s: strides %s bytes: not whole %d-byte elements" % (name, x.strides, isz))
    return x, x.ctypes.data, code, isz, tuple(x.shape), tuple(s // isz for s in x.strides)


class PagedKV:
    """Paged attention over the caller's own pages (ape_paged_kv_* in ape.h; docs/python.md,
    "Paged attention over your own pages"): the keys and values stay in the caller's page
    buffers, vLLM's or FlashInfer's, and a page table says which pages hold each sequence.

        pk = libape.PagedKV(Hkv=2, D=64, page_tokens=16, num_pages=1024, H=8)
        pk.plan(cu_seqlens_q, indptr=indptr, indices=indices, last_page_len=last)  # CSR, or
        pk.plan(cu_seqlens_q, block_table=block_table, seq_lens=seq_lens)         # vLLM's
        o = pk.run(q, k_cache, v_cache)      # per layer: q [total_q, H, D], pages
                                             # [num_pages, page_tokens, Hkv, D] ("NHD")

    A plan (one per step) checks the table and the batch once; every layer then runs it with
    its own pages and parameters. Pages are NumPy arrays or torch CPU tensors of the object's
    dtype, in any strides with D contiguous; on a device that reads host memory in place (the
    reference, OpenCL CPU devices) they are read where they lie, never copied; other devices
    get a copy on each run. Use it from one thread at a time; `close()` (or a `with` block)
    frees it.
    """

    def __init__(self, Hkv, D, page_tokens, num_pages, *, H=0, dtype="float32", device="auto",
                 max_batch_tokens=256, attend_chunk=0, max_device_bytes=0):
        self._p = None
        self._stage = {}  # role -> (ape_buffer, bytes): device copies where not in place
        self._queue = None
        code = _dtype_code(dtype)
        if int(max_device_bytes) < 0:
            _bad("max_device_bytes = %d: must be >= 0 (0: no limit)" % int(max_device_bytes))
        opts = _capi.ApePagedKvOptions()
        lib.ape_paged_kv_options_init(ctypes.byref(opts))
        for field, val in (("Hkv", Hkv), ("H", H), ("D", D), ("page_tokens", page_tokens),
                           ("num_pages", num_pages), ("max_batch_tokens", max_batch_tokens),
                           ("attend_chunk", attend_chunk), ("max_device_bytes", max_device_bytes)):
            val = int(val)
            if not _I64_MIN <= val <= _I64_MAX:
                _bad("%s = %d: out of range" % (field, val))
            setattr(opts, field, val)
        opts.dtype = code
        dev = _device_spec(device)
        p = ctypes.c_void_p()
        err = lib.ape_paged_kv_create(dev, ctypes.byref(opts), ctypes.byref(p))
        if err:
            _raise(err)
        self._p, self._dev = p, dev
        self._opts = {name: getattr(opts, name) for name, _ in opts._fields_
                      if name not in ("struct_size", "dtype")}
        self._opts["H"] = self._opts["H"] or self._opts["Hkv"]
        self._opts["max_batch_tokens"] = self._opts["max_batch_tokens"] or 256
        self._opts["attend_chunk"] = self._opts["attend_chunk"] or 4096
        self._dtype = code
        self._dtype_name = {v: k for k, v in KVCache._DTYPES.items()}[code]
        self._device = _device_dict(dev)["spec"]
        self._plan = None  # (sequences, total_q) of the current plan
        self._in_place = self._probe_in_place()
        _context.own(self)

    def _probe_in_place(self):
        """Whether the device reads host memory in place (ape_buffer_wrap_host() takes it)."""
        probe = np.zeros(4, dtype=np.float32)
        buf = ctypes.c_void_p()
        err = lib.ape_buffer_wrap_host(self._dev, probe.ctypes.data, probe.nbytes,
                                       ctypes.byref(buf))
        if err == ENOTSUP:
            return False
        if err:
            _raise(err)
        lib.ape_buffer_free(buf)
        return True

    def _live(self):
        if self._p is None:
            _bad("PagedKV: the object was closed")
        return self._p

    # -------------------------------------------------------------- the plan

    def plan(self, cu_seqlens_q, *, indptr=None, indices=None, last_page_len=None,
             block_table=None, seq_lens=None, k_start=None, positions_q=None):
        """Plans a step (ape_paged_kv_plan()): one page table, FlashInfer's CSR form (indptr
        `[nseq + 1]`, indices, last_page_len `[nseq]`) or vLLM's block table (block_table
        `[rows >= nseq, max_pages]`, seq_lens `[nseq]`), and the rows [cu_seqlens_q[s],
        cu_seqlens_q[s + 1]) of each sequence. k_start `[nseq]`: the position of each
        sequence's first token (default 0); positions_q `[total_q]`: every row's position
        (default: each sequence's rows at the end of its keys). Arrays: lists, NumPy arrays or
        torch tensors of integers. Replaces the previous plan; a failed one leaves none."""
        p = self._live()
        self._plan = None
        csr = indptr is not None or indices is not None or last_page_len is not None
        bt = block_table is not None or seq_lens is not None
        if csr and bt:
            _bad("plan: both a CSR table (indptr, indices, last_page_len) and a block table "
                 "(block_table, seq_lens) given: give one")
        if not csr and not bt:
            _bad("plan: no page table: give indptr, indices and last_page_len (FlashInfer's CSR "
                 "form), or block_table and seq_lens (vLLM's block table)")
        pt = _capi.ApePageTable()
        lib.ape_page_table_init(ctypes.byref(pt))
        keep = []
        if csr:
            missing = [n for n, x in (("indptr", indptr), ("indices", indices),
                                      ("last_page_len", last_page_len)) if x is None]
            if missing:
                _bad("plan: a CSR table needs indptr, indices and last_page_len: %s missing"
                     % ", ".join(missing))
            ip = _table_array("indptr", indptr)
            if ip.shape[0] < 1:
                _bad("indptr: empty: needs nseq + 1 >= 1 offsets")
            nseq = ip.shape[0] - 1
            ix = _table_array("indices", indices)
            lp = _table_array("last_page_len", last_page_len)
            if lp.shape[0] != nseq:
                _bad("last_page_len: %d values: must be nseq = %d (len(indptr) - 1)"
                     % (lp.shape[0], nseq))
            if ip[-1] > ix.shape[0]:
                _bad("indices: %d entries, fewer than indptr[%d] = %d"
                     % (ix.shape[0], nseq, ip[-1]))
            keep += [ip, ix, lp]
            pt.indptr, pt.indices, pt.last_page_len = _i64p(ip), _i64p(ix), _i64p(lp)
        else:
            if block_table is None or seq_lens is None:
                _bad("plan: a block table needs block_table and seq_lens: %s missing"
                     % ("block_table" if block_table is None else "seq_lens"))
            sl = _table_array("seq_lens", seq_lens)
            nseq = sl.shape[0]
            tb = _table_array("block_table", block_table, ndim=2)
            if tb.shape[0] < nseq:
                _bad("block_table: %d rows: fewer than the %d sequences of seq_lens"
                     % (tb.shape[0], nseq))
            keep += [sl, tb]
            pt.block_table, pt.block_table_stride, pt.seq_lens = _i64p(tb), tb.shape[1], _i64p(sl)
        pt.nseq = nseq
        if k_start is not None:
            ks = _table_array("k_start", k_start)
            if ks.shape[0] != nseq:
                _bad("k_start: %d values: must be one per sequence (%d)" % (ks.shape[0], nseq))
            keep.append(ks)
            pt.k_start = _i64p(ks)
        cq = _table_array("cu_seqlens_q", cu_seqlens_q)
        if cq.shape[0] != nseq + 1:
            _bad("cu_seqlens_q: %d values: must be nseq + 1 = %d" % (cq.shape[0], nseq + 1))
        pq = None
        if positions_q is not None:
            pq = _table_array("positions_q", positions_q)
            if cq[-1] >= 0 and pq.shape[0] != cq[-1]:
                _bad("positions_q: %d values: must be one per query row (cu_seqlens_q[-1] = %d)"
                     % (pq.shape[0], cq[-1]))
        err = lib.ape_paged_kv_plan(p, ctypes.byref(pt), _i64p(cq), _i64p(pq))
        if err:
            _raise(err)
        self._plan = (nseq, int(cq[-1]))

    # -------------------------------------------------------------- a run

    def _lend(self, role, ptr, nbytes):
        """An ape_buffer over host memory [ptr, ptr + nbytes): the memory itself on a device
        that reads host memory in place (freed by the caller after the run), else the object's
        device copy of it (kept). Returns (buffer, whether the caller frees it)."""
        buf = ctypes.c_void_p()
        if self._in_place:
            err = lib.ape_buffer_wrap_host(self._dev, ptr, nbytes, ctypes.byref(buf))
            if err:
                _raise(err)
            return buf, True
        staged = self._stage.get(role)
        if staged is None or staged[1] < nbytes:
            if staged is not None:
                del self._stage[role]
                lib.ape_buffer_free(staged[0])
            err = lib.ape_buffer_alloc(self._dev, nbytes, ctypes.byref(buf))
            if err:
                _raise(err)
            staged = self._stage[role] = (buf, nbytes)
        if self._queue is None:
            q = ctypes.c_void_p()
            err = lib.ape_queue_create(self._dev, ctypes.byref(q))
            if err:
                _raise(err)
            self._queue = q
        err = lib.ape_buffer_write(self._queue, staged[0], 0, ptr, nbytes)
        if err:
            _raise(err)
        return staged[0], False

    def _pages(self, k_pages, v_pages, kv_layout):
        """The run's pages as two ape_dtensor over lent buffers: (k, v, buffers to free, the
        arrays kept alive)."""
        if kv_layout not in ("NHD", "HND"):
            _bad("kv_layout = %r: the pages' layout is 'NHD' ([num_pages, %s], vLLM's) or "
                 "'HND' ([num_pages, %s]); the rotation's is layout"
                 % (kv_layout, _PAGE_ROWS["NHD"], _PAGE_ROWS["HND"]))
        o = self._opts
        N, P, Hkv, D = o["num_pages"], o["page_tokens"], o["Hkv"], o["D"]
        want4 = (N, P, Hkv, D) if kv_layout == "NHD" else (N, Hkv, P, D)
        if v_pages is None:
            x = _host_pages("k_pages", k_pages)
            if len(x[4]) != 5:
                _bad("k_pages: shape %s with v_pages = None: must be 5-D [num_pages, 2, %s] = %s "
                     "(K and V halves of one buffer; kv_layout = %r)"
                     % (x[4], _PAGE_ROWS[kv_layout], (N, 2) + want4[1:], kv_layout))
            arrays = [("k_pages", x, (N, 2) + want4[1:])]
        else:
            arrays = [("k_pages", _host_pages("k_pages", k_pages), want4),
                      ("v_pages", _host_pages("v_pages", v_pages), want4)]
        tensors, free, keep = [], [], []
        try:
            for name, (obj, ptr, code, isz, shape, strides), want in arrays:
                # a dimension of one element is never stepped along: any stride will do
                strides = tuple(0 if n == 1 else st for n, st in zip(shape, strides))
                if shape != want:
                    _bad("%s: shape %s: must be [num_pages, %s%s] = %s (kv_layout = %r)"
                         % (name, shape, "2, " if len(want) == 5 else "", _PAGE_ROWS[kv_layout],
                            want, kv_layout))
                if strides[-1] != 1:
                    _bad("%s: strides %s (elements): the D axis must be contiguous (stride 1); "
                         "pass a copy with D contiguous (np.ascontiguousarray, .contiguous())"
                         % (name, strides))
                for st, n in zip(strides, shape):
                    if st < 0 or (st == 0 and n > 1):
                        _bad("%s: strides %s (elements): negative or broadcast (0) strides "
                             "address no page buffer; pass a copy (np.ascontiguousarray, "
                             ".contiguous())" % (name, strides))
                last = sum((n - 1) * st for n, st in zip(shape, strides))
                buf, owned = self._lend(name, ptr, (last + 1) * isz)
                if owned:
                    free.append(buf)
                keep.append(obj)
                dims = _PAGE_DIMS[(kv_layout, len(shape))]
                st4 = [strides[d] for d in dims]
                halves = [0, strides[1]] if len(shape) == 5 else [0]
                for off in halves:
                    t = _capi.ApeDTensor()
                    t.buf, t.byte_offset, t.dtype = buf, off * isz, code
                    t.shape[:] = [shape[d] for d in dims]
                    t.strides[:] = st4
                    tensors.append(t)
            if self._queue is not None and not self._in_place:
                err = lib.ape_queue_synchronize(self._queue)
                if err:
                    _raise(err)
        except BaseException:
            for b in free:
                lib.ape_buffer_free(b)
            raise
        return tensors[0], tensors[1], free, keep

    def run(self, q, k_pages, v_pages=None, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA,
            lam=SEED_LAMBDA, causal=True, scale=None, rope_base=10000.0, layout="half",
            skip_tol=2.0 ** -24, rope_scale=1.0, kv_layout="NHD", return_lse=False,
            return_diagnostics=False, stats=False, bias_table=None):
        """Runs the plan over one layer's pages (ape_paged_kv_run()): q `[total_q, H, D]` (the
        plan's rows), k_pages and v_pages `[num_pages, page_tokens, Hkv, D]` (kv_layout="NHD",
        vLLM's) or `[num_pages, Hkv, page_tokens, D]` ("HND"), or one 5-D `[num_pages, 2, ...]`
        buffer holding K and V (FlashInfer's) as k_pages with v_pages None. Parameters as for
        attention(), the rotation's layout as layout ("half", "interleaved"). Returns O
        `[total_q, H, D]` of q's kind and dtype (0 for rows that see no key), and LSE
        `[total_q, H]` float32 with return_lse=True; return_diagnostics=True appends each row's
        entropy and mean distance `[total_q, H]` (ape_paged_kv_run_diag()); stats=True appends
        the call's statistics; bias_table as for attention()."""
        p = self._live()
        if layout not in _LAYOUTS:
            _bad("layout = %r: must be 'half' or 'interleaved' (the pages' layout is "
                 "kv_layout, 'NHD' or 'HND')" % (layout,))
        qa = _packed_view("q", q)
        _, H, tq, D = qa.shape
        keep = []
        desc = _table_desc(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                                 None, 0, skip_tol, keep, rope_scale), bias_table, H, keep)
        kt, vt, free, pages = self._pages(k_pages, v_pages, kv_layout)
        try:
            r = _RaggedOut(qa, return_lse, return_diagnostics)
            tq_, to_ = _Tensors.pack((qa, r.oa))
            st, st_ptr = _stats_arg(stats)
            if return_diagnostics:
                err = lib.ape_paged_kv_run_diag(p, ctypes.byref(desc), ctypes.byref(kt),
                                                ctypes.byref(vt), tq_, to_, r.lse_ptr, r.ent_ptr,
                                                r.md_ptr, st_ptr)
            else:
                err = lib.ape_paged_kv_run(p, ctypes.byref(desc), ctypes.byref(kt),
                                           ctypes.byref(vt), tq_, to_, r.lse_ptr, st_ptr)
        finally:
            for b in free:
                lib.ape_buffer_free(b)
            del pages
        if err:
            _raise(err)
        return r.result(st)

    def info(self):
        """The object as a dict: its options (Hkv, H, D, page_tokens, num_pages,
        max_batch_tokens, attend_chunk, max_device_bytes; defaults resolved), dtype, device (its
        spec), pages_in_place (whether host pages are read where they lie, or copied to the
        device on each run), and its plan: planned, sequences, total_q."""
        self._live()
        d = dict(self._opts)
        d.update(dtype=self._dtype_name, device=self._device, pages_in_place=self._in_place,
                 planned=self._plan is not None,
                 sequences=self._plan[0] if self._plan else 0,
                 total_q=self._plan[1] if self._plan else 0)
        return d

    def close(self):
        if self._p is not None:
            lib.ape_paged_kv_destroy(self._p)
            self._p = None
            self._plan = None
        for buf, _ in self._stage.values():
            lib.ape_buffer_free(buf)
        self._stage.clear()
        if self._queue is not None:
            lib.ape_queue_destroy(self._queue)
            self._queue = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # interpreter shutdown may have torn the module down already
        if getattr(self, "_p", None) is not None and lib is not None:
            self.close()


# ------------------------------------------------------------------ gradients

_backward = lib.ape_attention_backward
_WRT = ("q", "k", "v", "params")


def _wanted(wrt, bias_table):
    """The gradients a backward call is asked for, checked: wrt's names (None: every one, the
    table's too where a bias_table is given)."""
    if wrt is None:
        wrt = _WRT + (("bias_table",) if bias_table is not None else ())
    want = set(wrt)
    if not want or not want <= set(_WRT + ("bias_table",)):
        _bad("wrt = %r: name one or more of 'q', 'k', 'v', 'params', 'bias_table'" % (wrt,))
    if "bias_table" in want and bias_table is None:
        _bad("wrt = %r names 'bias_table', but no bias_table was given" % (wrt,))
    return want


def _grad_table(desc, bias_table, H, want, like, keep):
    """desc reading bias_table and, where `want` names it, writing the table's gradient into a
    new float32 array of its shape and of like's kind: (desc, that array or None)."""
    if bias_table is None:
        return desc, None
    table = _bias_array(bias_table, H)
    if "bias_table" not in want:
        return _with_table(desc, table, keep), None
    db, db_ptr = _empty_lse(like, table.shape)
    return _with_table(desc, table, keep, db_ptr), db


def _lse_buffer(name, x, kind, shape, dims="[B, H, Lq]"):
    """LSE or dLSE as contiguous float32 `dims` (`[B, H, Lq]`; a ragged batch's `[total_q,
    H]`): (the object kept alive, its address)."""
    if kind == "torch":
        torch = _torch()
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            _bad("%s: pass a torch CPU tensor like q" % name)
        x = x.detach().to(torch.float32).contiguous()
        got, ptr = tuple(x.shape), x.data_ptr()
    else:
        x = np.ascontiguousarray(x, dtype=np.float32)
        got, ptr = x.shape, x.ctypes.data
    if got != shape:
        _bad("%s: shape %s: must be %s = %s" % (name, got, dims, shape))
    return x, ptr


def attention_backward(q, k, v, o, lse, dout, *, dlse=None, delta=SEED_DELTA, beta=SEED_BETA,
                       gamma=SEED_GAMMA, lam=SEED_LAMBDA, causal=True, scale=None,
                       rope_base=10000.0, layout="half", q_start=None, k_start=0,
                       wrt=None, device="auto", stats=False, rope_scale=1.0, skip_tol=0.0,
                       bias_table=None):
    """The gradients of `attention()` (ape_attention_backward()): given the forward's inputs and
    parameters, its O and LSE (`return_lse=True`), dL/dO `dout` and optionally dL/dLSE `dlse`,
    returns `(dq, dk, dv, dparams)`: dq like q, dk and dv like k (summed over the query heads
    that share a kv head), dparams `[H, 4]` float32 (per head: d delta, d beta, d gamma,
    d lambda; a parameter shared by all heads has the sum over h as its gradient).

    With a bias_table (as for attention()) it returns `(dq, dk, dv, dparams, dbias_table)`:
    dbias_table float32 of the table's shape ([H, M] or [1, M]) and q's kind, entry m the sum
    of dL/ds over every pair whose min(|n|, M - 1) is m (over the heads too for a [1, M] table;
    ape_attn_desc.dbias_table, deterministic).

    `wrt` names what is wanted, of "q", "k", "v", "params", "bias_table" (default: all of
    them, "bias_table" where a table is given); the others are None and cost
    nothing (frozen q, k, v with wrt=("params",) is one pass over the pairs). Arrays as for
    `attention()`; the gradients have q's kind and dtype. `device` as for `attention()`: the
    reference, OpenCL (with or without float64: docs/kernels.md) and CUDA backends have a
    backward pass; a device without one (a backend plugin that has none) raises ApeError
    (APE_ENOTSUP) with libape's message naming it, and nothing falls back. stats=True appends the C call's statistics as for attention().
    skip_tol (default 0: every pair) lets the backward leave out keys its bound proves carry at
    most that share of each gradient (docs/kernels.md, "Skipping in the backward pass"); pass
    the forward's LSE computed under the same or a smaller skip_tol.
    """
    want = _wanted(wrt, bias_table)
    qa, ka, va = _as_array("q", q), _as_array("k", k), _as_array("v", v)
    oa, da = _as_array("o", o), _as_array("dout", dout)
    if not (qa.kind == ka.kind == va.kind == oa.kind == da.kind):
        _bad("q, k, v, o, dout: mixed kinds: pass all NumPy arrays or all torch tensors")
    B, H, Lq, D = qa.shape
    lse_keep, lse_ptr = _lse_buffer("lse", lse, qa.kind, (B, H, Lq))
    dlse_keep, dlse_ptr = (None, None) if dlse is None else \
        _lse_buffer("dlse", dlse, qa.kind, (B, H, Lq))
    keep = []
    desc, db = _grad_table(_desc(H, delta, beta, gamma, lam, causal, scale, rope_base, layout,
                                 q_start, k_start, float(skip_tol), keep, rope_scale),
                           bias_table, H, want, qa, keep)
    dev = _device_spec(device)
    dqa = _empty_like(qa, qa.shape) if "q" in want else None
    dka = _empty_like(qa, ka.shape) if "k" in want else None
    dva = _empty_like(qa, ka.shape) if "v" in want else None
    dp, dp_ptr = _empty_lse(qa, (H, 4)) if "params" in want else (None, None)
    arrays = [qa, ka, va, oa, da] + [a for a in (dqa, dka, dva) if a is not None]
    ptrs = iter(_Tensors.pack(arrays))
    tq, tk, tv, to, tdo = (next(ptrs) for _ in range(5))
    tdq = next(ptrs) if dqa is not None else None
    tdk = next(ptrs) if dka is not None else None
    tdv = next(ptrs) if dva is not None else None
    st, st_ptr = _stats_arg(stats)
    err = _backward(dev, ctypes.byref(desc), tq, tk, tv, to, lse_ptr, tdo, dlse_ptr, tdq, tdk,
                    tdv, dp_ptr, st_ptr)
    if err:
        _raise(err)
    return _with_stats(tuple(None if a is None else a.obj for a in (dqa, dka, dva)) + (dp,) +
                       (() if bias_table is None else (db,)), st)
