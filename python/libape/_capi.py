"""The C API of libape through ctypes: loading the library, the structs, the prototypes.

Nothing here allocates per call beyond what ctypes itself does; the layouts mirror
include/ape/ape.h of libape 0.1 and are checked against the library's version at load time.
"""
import ctypes
import ctypes.util
import os

__all__ = ["lib", "path", "ApeTensor", "ApeParam", "ApeAttnDesc", "ApeStats", "ApeVarlen", "ApeDeviceInfo",
           "ApeBackendInfo", "ApeSelection", "ApeKvCacheOptions", "ApeKvCacheInfo",
           "ApeKvPoolOptions", "ApeKvPoolInfo", "ApePagedKvOptions", "ApePageTable", "ApeDTensor",
           "ApeContextOptions", "ApePluginInfo", "DLTensor", "LibraryError"]

# The major version whose struct layouts this package was written for.
ABI_MAJOR = 0
F32, F16, BF16 = 0, 1, 2
ROPE_HALF, ROPE_INTERLEAVED = 0, 1


class LibraryError(ImportError):
    """libape.so could not be loaded, or is a version this package cannot drive."""


c_int64 = ctypes.c_int64
c_size_t = ctypes.c_size_t


class ApeTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int),
                ("shape", c_int64 * 4), ("strides", c_int64 * 4)]


class ApeParam(ctypes.Structure):
    _fields_ = [("value", ctypes.c_float), ("per_head", ctypes.POINTER(ctypes.c_float))]


class ApeAttnDesc(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t),
                ("delta", ApeParam), ("beta", ApeParam), ("gamma", ApeParam), ("lambda_", ApeParam),
                ("rope_base", ctypes.c_double), ("scale", ctypes.c_double),
                ("scale_set", ctypes.c_bool), ("causal", ctypes.c_bool),
                ("layout", ctypes.c_int), ("k_start", c_int64), ("q_start", c_int64),
                ("q_start_set", ctypes.c_bool), ("skip_tol", ctypes.c_double),
                ("pos_q", ctypes.POINTER(c_int64)), ("pos_k", ctypes.POINTER(c_int64)),
                ("rope_scale", ctypes.c_double),
                ("bias_table", ctypes.POINTER(ctypes.c_float)), ("bias_table_len", c_int64),
                ("bias_table_heads", c_int64), ("dbias_table", ctypes.POINTER(ctypes.c_float))]


class ApeStats(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("pairs_visible", ctypes.c_uint64),
                ("pairs_computed", ctypes.c_uint64), ("kernel_ms", ctypes.c_double),
                ("total_ms", ctypes.c_double), ("bytes_to_device", ctypes.c_uint64),
                ("bytes_from_device", ctypes.c_uint64), ("backend", ctypes.c_char * 16),
                ("device", ctypes.c_char * 128), ("chunks", ctypes.c_uint64),
                ("chunks_skipped", ctypes.c_uint64), ("chunk_q", c_int64), ("chunk_k", c_int64),
                ("pipeline_depth", ctypes.c_int), ("devices", ctypes.c_int),
                ("device_budget", ctypes.c_uint64), ("peak_device_bytes", ctypes.c_uint64),
                ("bytes_device_to_device", ctypes.c_uint64), ("copy_ms", ctypes.c_double),
                ("overlap_ms", ctypes.c_double), ("path", ctypes.c_char * 64)]


class ApeContextOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("backends", ctypes.c_char_p), ("flags", ctypes.c_uint),
                ("topology_xml", ctypes.c_char_p), ("numa", ctypes.c_int),
                ("visible_devices", ctypes.c_char_p), ("opencl_context", ctypes.c_void_p),
                ("opencl_device", ctypes.c_void_p), ("verbose", ctypes.c_int),
                ("backend_path", ctypes.c_char_p)]


class ApeBackendInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 16), ("built", ctypes.c_bool),
                ("available", ctypes.c_bool), ("device_count", ctypes.c_int),
                ("reason", ctypes.c_char * 256)]


class ApePluginInfo(ctypes.Structure):
    _fields_ = [("path", ctypes.c_char * 4096), ("name", ctypes.c_char * 16),
                ("loaded", ctypes.c_bool), ("device_count", ctypes.c_int),
                ("abi_major", ctypes.c_uint), ("abi_minor", ctypes.c_uint),
                ("reason", ctypes.c_char * 512)]


class ApeDeviceInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 128), ("vendor", ctypes.c_char * 64),
                ("backend", ctypes.c_char * 16), ("driver_version", ctypes.c_char * 64),
                ("kind", ctypes.c_int), ("index", ctypes.c_int), ("backend_index", ctypes.c_int),
                ("compute_units", ctypes.c_int), ("global_mem_bytes", ctypes.c_uint64),
                ("pci_address", ctypes.c_char * 16), ("physical_index", ctypes.c_int),
                ("numa_node", ctypes.c_int), ("cpuset", ctypes.c_char * 256)]


class ApeSelection(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("passed_over", ctypes.c_bool),
                ("note", ctypes.c_char * 768)]


class ApeKvCacheOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("B", c_int64), ("Hkv", c_int64), ("H", c_int64),
                ("D", c_int64), ("dtype", ctypes.c_int), ("block_tokens", c_int64),
                ("capacity_tokens", c_int64), ("k_start", c_int64), ("max_queries", c_int64),
                ("append_chunk", c_int64), ("attend_chunk", c_int64),
                ("max_device_bytes", ctypes.c_uint64), ("allow_release", ctypes.c_bool),
                ("max_query_norm", ctypes.c_double)]


class ApeKvCacheInfo(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("live_tokens", c_int64), ("first_live_position", c_int64),
                ("next_position", c_int64), ("capacity_tokens", c_int64),
                ("block_tokens", c_int64), ("blocks_live", c_int64),
                ("blocks_released", c_int64), ("min_query_position", c_int64),
                ("device_bytes", ctypes.c_uint64)]


class ApeKvPoolOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("Hkv", c_int64), ("H", c_int64), ("D", c_int64),
                ("dtype", ctypes.c_int), ("page_tokens", c_int64), ("capacity_tokens", c_int64),
                ("max_batch_tokens", c_int64), ("attend_chunk", c_int64),
                ("max_device_bytes", ctypes.c_uint64), ("max_query_norm", ctypes.c_double)]


class ApeKvPoolInfo(ctypes.Structure):
    _fields_ = [("page_tokens", c_int64), ("pages_total", c_int64), ("pages_used", c_int64),
                ("pages_free", c_int64), ("pages_shared", c_int64), ("sequences", c_int64),
                ("tokens", c_int64), ("pages_copied", c_int64), ("device_bytes", ctypes.c_uint64)]


class ApePagedKvOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("Hkv", c_int64), ("H", c_int64), ("D", c_int64),
                ("dtype", ctypes.c_int), ("page_tokens", c_int64), ("num_pages", c_int64),
                ("max_batch_tokens", c_int64), ("attend_chunk", c_int64),
                ("max_device_bytes", ctypes.c_uint64)]


class ApePageTable(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("nseq", c_int64),
                ("indptr", ctypes.POINTER(c_int64)), ("indices", ctypes.POINTER(c_int64)),
                ("last_page_len", ctypes.POINTER(c_int64)),
                ("block_table", ctypes.POINTER(c_int64)), ("block_table_stride", c_int64),
                ("seq_lens", ctypes.POINTER(c_int64)), ("k_start", ctypes.POINTER(c_int64))]


class ApeDTensor(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64), ("dtype", ctypes.c_int),
                ("shape", c_int64 * 4), ("strides", c_int64 * 4)]


class ApeVarlen(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("num_seqs", c_int64),
                ("cu_seqlens_q", ctypes.POINTER(c_int64)), ("cu_seqlens_k", ctypes.POINTER(c_int64)),
                ("pos_q", ctypes.POINTER(c_int64)), ("pos_k", ctypes.POINTER(c_int64))]


# DLPack's unversioned DLTensor (dlpack/dlpack.h), for ape_attention_forward_dlpack()
KDL_CPU, KDL_CUDA, KDL_OPENCL = 1, 2, 4
KDL_FLOAT, KDL_BFLOAT = 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(c_int64)),
                ("strides", ctypes.POINTER(c_int64)), ("byte_offset", ctypes.c_uint64)]


P = ctypes.POINTER
vp = ctypes.c_void_p
_PROTOS = {
    "ape_version": (ctypes.c_uint, []),
    "ape_version_string": (ctypes.c_char_p, []),
    "ape_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "ape_err_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ape_last_error": (ctypes.c_char_p, []),
    "ape_attn_desc_init": (None, [P(ApeAttnDesc)]),
    "ape_stats_init": (None, [P(ApeStats)]),
    "ape_range_push": (None, [ctypes.c_char_p]),
    "ape_range_pop": (None, []),
    "ape_context_options_init": (None, [P(ApeContextOptions)]),
    "ape_context_create": (ctypes.c_int, [P(vp), P(ApeContextOptions)]),
    "ape_context_destroy": (None, [vp]),
    "ape_backend_get_info": (ctypes.c_int, [vp, ctypes.c_int, P(ApeBackendInfo)]),
    "ape_plugin_get_info": (ctypes.c_int, [vp, ctypes.c_int, P(ApePluginInfo)]),
    "ape_device_list": (ctypes.c_int, [vp, P(vp), ctypes.c_int]),
    "ape_device_get_info": (ctypes.c_int, [vp, P(ApeDeviceInfo)]),
    "ape_device_capabilities": (ctypes.c_uint64, [vp]),
    "ape_be_cap_name": (ctypes.c_char_p, [ctypes.c_uint64]),
    "ape_device_select_spec": (ctypes.c_int, [vp, ctypes.c_char_p, P(ApeSelection)]),
    # tensors by address: the front end packs them into one buffer (see _core._Tensors)
    "ape_attention_forward": (ctypes.c_int, [vp, P(ApeAttnDesc), vp, vp, vp, vp, vp, P(ApeStats)]),
    "ape_varlen_init": (None, [P(ApeVarlen)]),
    "ape_attention_forward_varlen": (ctypes.c_int, [vp, P(ApeAttnDesc), P(ApeVarlen), vp, vp, vp,
                                                    vp, vp, P(ApeStats)]),
    "ape_attention_backward_varlen": (ctypes.c_int, [P(vp), ctypes.c_int, vp, P(ApeAttnDesc),
                                                     P(ApeVarlen)] + [vp] * 11 + [P(ApeStats)]),
    "ape_attention_forward_diag": (ctypes.c_int, [P(vp), ctypes.c_int, vp, P(ApeAttnDesc), vp, vp,
                                                  vp, vp, vp, vp, vp, P(ApeStats)]),
    "ape_attention_backward": (ctypes.c_int, [vp, P(ApeAttnDesc), vp, vp, vp, vp, vp, vp, vp, vp,
                                              vp, vp, vp, P(ApeStats)]),
    "ape_kv_cache_options_init": (None, [P(ApeKvCacheOptions)]),
    "ape_kv_cache_create": (ctypes.c_int, [vp, P(ApeKvCacheOptions), P(vp)]),
    "ape_kv_cache_destroy": (None, [vp]),
    "ape_kv_cache_append": (ctypes.c_int, [vp, P(ApeTensor), P(ApeTensor)]),
    "ape_kv_cache_attend": (ctypes.c_int, [vp, P(ApeAttnDesc), P(ApeTensor), P(ApeTensor), vp,
                                           P(ApeStats)]),
    "ape_kv_cache_release_unreachable": (ctypes.c_int, [vp, P(ApeAttnDesc), P(c_int64)]),
    "ape_kv_cache_get_info": (ctypes.c_int, [vp, P(ApeKvCacheInfo)]),
    "ape_kv_pool_options_init": (None, [P(ApeKvPoolOptions)]),
    "ape_kv_pool_create": (ctypes.c_int, [vp, P(ApeKvPoolOptions), P(vp)]),
    "ape_kv_pool_destroy": (None, [vp]),
    "ape_kv_pool_add_sequence": (ctypes.c_int, [vp, c_int64, P(c_int64)]),
    "ape_kv_pool_remove_sequence": (ctypes.c_int, [vp, c_int64]),
    "ape_kv_pool_fork": (ctypes.c_int, [vp, c_int64, P(c_int64)]),
    # tensors by address, packed as for ape_attention_forward (see _core._Tensors)
    "ape_kv_pool_append": (ctypes.c_int, [vp, c_int64, vp, vp]),
    "ape_kv_pool_append_batch": (ctypes.c_int, [vp, c_int64, P(c_int64), P(c_int64), vp, vp]),
    "ape_kv_pool_attend": (ctypes.c_int, [vp, P(ApeAttnDesc), c_int64, P(c_int64), P(c_int64),
                                          P(c_int64), vp, vp, vp, P(ApeStats)]),
    "ape_kv_pool_attend_diag": (ctypes.c_int, [vp, P(ApeAttnDesc), c_int64, P(c_int64),
                                               P(c_int64), P(c_int64), vp, vp, vp, vp, vp,
                                               P(ApeStats)]),
    "ape_kv_pool_get_info": (ctypes.c_int, [vp, P(ApeKvPoolInfo)]),
    "ape_kv_pool_release_unreachable": (ctypes.c_int, [vp, c_int64, P(ApeAttnDesc),
                                                       P(c_int64)]),
    "ape_kv_pool_sequence_info": (ctypes.c_int, [vp, c_int64, P(c_int64), P(c_int64)]),
    "ape_buffer_alloc": (ctypes.c_int, [vp, c_size_t, P(vp)]),
    "ape_buffer_wrap_host": (ctypes.c_int, [vp, vp, c_size_t, P(vp)]),
    "ape_buffer_free": (None, [vp]),
    "ape_buffer_write": (ctypes.c_int, [vp, vp, c_size_t, vp, c_size_t]),
    "ape_queue_create": (ctypes.c_int, [vp, P(vp)]),
    "ape_queue_destroy": (None, [vp]),
    "ape_queue_synchronize": (ctypes.c_int, [vp]),
    "ape_paged_kv_options_init": (None, [P(ApePagedKvOptions)]),
    "ape_paged_kv_create": (ctypes.c_int, [vp, P(ApePagedKvOptions), P(vp)]),
    "ape_paged_kv_destroy": (None, [vp]),
    "ape_page_table_init": (None, [P(ApePageTable)]),
    "ape_paged_kv_plan": (ctypes.c_int, [vp, P(ApePageTable), P(c_int64), P(c_int64)]),
    # q and o by address, packed as for ape_attention_forward (see _core._Tensors)
    "ape_paged_kv_run": (ctypes.c_int, [vp, P(ApeAttnDesc), P(ApeDTensor), P(ApeDTensor), vp, vp,
                                        vp, P(ApeStats)]),
    "ape_paged_kv_run_diag": (ctypes.c_int, [vp, P(ApeAttnDesc), P(ApeDTensor), P(ApeDTensor), vp,
                                             vp, vp, vp, vp, P(ApeStats)]),
}
# Calls a library built without them lacks: bound when present, else None.
_OPTIONAL = {
    "ape_attention_forward_dlpack": (ctypes.c_int, [vp, P(ApeAttnDesc), P(DLTensor), P(DLTensor),
                                                    P(DLTensor), P(DLTensor), P(DLTensor), vp]),
    "ape_attention_forward_dlpack_diag": (ctypes.c_int, [vp, P(ApeAttnDesc)] + [P(DLTensor)] * 7
                                          + [vp]),
    "ape_attention_backward_dlpack": (ctypes.c_int, [vp, P(ApeAttnDesc)] + [P(DLTensor)] * 11 +
                                      [vp]),
}


def _candidates():
    """Where the library is looked for, in order, each with how it was chosen."""
    env = os.environ.get("LIBAPE_LIBRARY")
    if env:
        return [(env, "LIBAPE_LIBRARY")]
    out = []
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "libape.so.0")
    if os.path.exists(here):
        out.append((here, "the copy bundled by pip install"))
    found = ctypes.util.find_library("ape")
    out.append((found or "libape.so.0", "the installed library"))
    return out


def _load():
    tried = []
    for cand, how in _candidates():
        try:
            handle = ctypes.CDLL(cand)
        except OSError as e:
            tried.append("%s (%s): %s" % (cand, how, e))
            continue
        try:
            major = handle.ape_version() >> 16
        except AttributeError:
            raise LibraryError("%s (%s) is not libape: it has no ape_version()" % (cand, how))
        if major != ABI_MAJOR:
            raise LibraryError(
                "%s (%s) is libape %s, but this package drives libape %d.x: install the matching "
                "package (pip install ./python from the same source tree) or point LIBAPE_LIBRARY "
                "at a libape %d.x" % (cand, how, _version_of(handle), ABI_MAJOR, ABI_MAJOR))
        return handle, cand
    raise LibraryError("cannot load libape; tried: %s. Build it with `make` and install the "
                       "package with `pip install ./python`, or set LIBAPE_LIBRARY to the path "
                       "of libape.so.0" % "; ".join(tried))


def _version_of(handle):
    handle.ape_version_string.restype = ctypes.c_char_p
    return handle.ape_version_string().decode()


lib, path = _load()
for _name, (_res, _args) in _PROTOS.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args
optional = {}
for _name, (_res, _args) in _OPTIONAL.items():
    _fn = getattr(lib, _name, None)
    if _fn is not None:
        _fn.restype = _res
        _fn.argtypes = _args
    optional[_name] = _fn
