#!/usr/bin/python3
# Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/): a few meaningful
# inputs each, so that fuzzing starts from the formats' real shapes instead of from nothing.
# The files are committed; run this again only to change them. The regress_* files beside them
# are inputs that once found a bug, kept as the fuzzer wrote them.  usage: make-seeds.py [DIR]
import io, os, struct, sys

import numpy as np

top = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")


def put(target, name, data):
    os.makedirs(os.path.join(top, target), exist_ok=True)
    with open(os.path.join(top, target, name), "wb") as f:
        f.write(data)


# ---- npy: what NumPy itself writes, in every version, plus the refusals people meet
def npy(arr, version=None, fortran=False):
    b = io.BytesIO()
    np.lib.format.write_array(b, np.asfortranarray(arr) if fortran else arr,
                              version=version, allow_pickle=False)
    return b.getvalue()


a = np.arange(6, dtype="<f4").reshape(2, 3)
put("npy", "v1_f4_2x3.npy", npy(a, (1, 0)))
put("npy", "v2_f2_4.npy", npy(np.arange(4, dtype="<f2"), (2, 0)))
put("npy", "v3_f4_2x2.npy", npy(np.ones((2, 2), "<f4"), (3, 0)))
put("npy", "v1_f4_scalar.npy", npy(np.array(1.5, "<f4"), (1, 0)))
put("npy", "v1_f4_empty_0x5.npy", npy(np.zeros((0, 5), "<f4"), (1, 0)))
put("npy", "v1_f4_4d.npy", npy(np.zeros((1, 2, 3, 2), "<f4"), (1, 0)))
put("npy", "fortran_order.npy", npy(np.arange(6, dtype="<f4").reshape(2, 3), (1, 0), True))
put("npy", "truncated.npy", npy(a, (1, 0))[:-5])
put("npy", "big_endian.npy", npy(a.astype(">f4"), (1, 0)))
put("npy", "f8.npy", npy(a.astype("<f8"), (1, 0)))
# Python 2 wrote long dimensions: accepted in versions 1 and 2
hdr = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 1L), }"
hdr += b" " * (64 - 10 - len(hdr) - 1) + b"\n"
put("npy", "py2_long_dims.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr +
    np.zeros(2, "<f4").tobytes())

# ---- problem: the byte encoding fuzz_problem.c reads (see take_call() there).
# take_int: a byte below 0xA0 is its low 5 bits; take_float: a byte below 0xC0 picks special[],
# index 1 = 0.1, 2 = 0.397, 4 = 1.0, 13 = 2.0, 14 = 0.01, 3 = -0.5, 0xC1 = NaN.
# strides: per tensor, its mode byte followed by what that mode reads (mode 2, 3: a pad; 1: four
# strides)
def call(B, H, Hkv, Lq, Lk, Dhalf, dt=0, o_f32=0, which=0, strides=(b"\0",) * 4,
         params=(2, 14, 14, 1), per_head=None, flags=1, tail=b""):
    b = bytes([B, H, Hkv, Lq, Lk, Dhalf, dt, o_f32, which]) + b"".join(strides)
    for i, p in enumerate(params):
        b += bytes([p])
        if per_head and per_head[i] is not None:
            b += bytes([1]) + bytes(per_head[i])
        else:
            b += bytes([0])
    return b + struct.pack("<H", flags) + tail


# after the call: no aliasing, no NULL, then (accepted calls) the streamed run's options:
# stream?, chunk_q, chunk_k, depth, atomic?, budget? [3 budget bytes], then the tensors' bytes
put("problem", "f32_causal.bin",
    call(1, 2, 1, 4, 4, 4) + b"\0\0" + bytes([1, 2, 3, 2, 1, 0]) + bytes(range(256)) * 4)
# f16, GQA, [B, L, H, D] strides (mode 2, pad 0) for q and o, per-head lambda
put("problem", "f16_gqa_blhd.bin",
    call(2, 4, 2, 3, 5, 8, dt=1, strides=(b"\2\0", b"\0", b"\0", b"\2\0"), tail=b"\0\0",
         per_head=(None, None, None, [1, 4, 13, 14])) + bytes([1, 1, 1, 0, 0, 1, 0, 0x40, 0]) +
    bytes(512))
# bf16 in, f32 out, interleaved, not causal, LSE wanted, explicit q_start and scale
put("problem", "bf16_interleaved_lse.bin",
    call(1, 1, 1, 2, 6, 2, dt=2, o_f32=1, flags=(8 | 16 | 2 | 4 | 512)) +
    bytes([3]) + bytes([1, 4]) + b"\0\0" + bytes([1, 1, 0, 1, 0, 0]) + bytes(64))
put("problem", "nan_delta.bin", call(1, 2, 1, 4, 4, 4, params=(0xC1, 0, 0, 0)))
put("problem", "negative_lambda.bin", call(1, 2, 1, 4, 4, 4, params=(2, 0, 0, 3)))
put("problem", "shape_overflow.bin", call(1, 0xC2, 1, 0xC2, 4, 4))
put("problem", "padded_strides.bin", call(1, 2, 2, 4, 4, 4, strides=(b"\3\2", b"\3\1", b"\3\0", b"\3\3")) +
    b"\0\0" + bytes([1, 3, 0, 0, 0, 0]) + bytes([1] * 8))
# The int64 ends of the distances (issue 24): a query INT64_MAX after a key (causal and not),
# INT64_MIN before one; the kernels' rules once overflowed there (diag + 1, -INT64_MIN).
# take_int's 0xA0 reads 8 raw bytes. After the call: no aliasing, no NULL, the diagnostics'
# outputs apart (63), one call or streamed in chunks of one query and one key row (the streamed
# merge once took its weights from l_i - LSE, which a float64 cannot hold at |LSE| ~ 1e18: both
# sides weighed 1 and the entropy left [0, ln Lk]), then q, k, v, o (D = 8): q varied, V
# constant.
P62 = 1 << 62


def i64(v):
    return b"\xa0" + struct.pack("<q", v)


def ends(Lq, Lk, causal, k_start, q_start, stream=False):
    data = struct.pack("<%df" % (2 * Lq * 8), *[(i % 7 - 3) / 4 for i in range(2 * Lq * 8)])
    data += struct.pack("<%df" % (Lk * 8), *[(i % 5 - 2) / 2 for i in range(Lk * 8)])
    data += struct.pack("<%df" % (Lk * 8), *[1.5] * (Lk * 8)) + bytes(2 * Lq * 8 * 4)
    return (call(1, 2, 1, Lq, Lk, 4, flags=causal | 2 | 8 | 256 | 512,
                 tail=i64(k_start) + i64(q_start)) + b"\0\0" +
            bytes([63, 1, 1, 1, 2, 0, 0] if stream else [63, 0, 2, 3, 2, 0, 0]) +
            data)


put("problem", "ends_causal_int64_max.bin", ends(3, 4, 1, -P62, P62 - 3))
put("problem", "ends_noncausal_int64_max.bin", ends(3, 4, 0, -P62, P62 - 3))
put("problem", "ends_noncausal_int64_min.bin", ends(1, 4, 0, P62 - 3, -P62))
put("problem", "ends_causal_int64_min.bin", ends(2, 5, 1, P62 - 4, -P62))
put("problem", "ends_causal_int64_max_streamed.bin", ends(3, 4, 1, -P62, P62 - 3, True))
put("problem", "ends_noncausal_int64_min_streamed.bin", ends(1, 4, 0, P62 - 3, -P62, True))

# Explicit positions (flag 2048: check_positions() reads a byte how (1, 2, 3: small, raw; 0:
# 0.. end-aligned; 4: a base follows; 8, 16: pos_q, pos_k NULL), the key positions, the query
# positions (small: one byte each, mod 40; raw: take_int), then q, k, v, o (B 2, H 2, Hkv 1,
# D 8, float32): gaps and a repeat; 0.. end-aligned (the implicit call); distances past int64;
# pos_q NULL; q_start_set with positions.
def posdata(Lq, Lk):
    return (struct.pack("<%df" % (2 * 2 * Lq * 8), *[(i % 9 - 4) / 4 for i in range(32 * Lq)]) +
            struct.pack("<%df" % (2 * 2 * Lk * 8), *[(i % 7 - 3) / 2 for i in range(32 * Lk)]) +
            bytes(2 * 2 * Lq * 8 * 4))


def atpos(Lq, Lk, how, pos, flags=1):
    return call(2, 2, 1, Lq, Lk, 4, flags=flags | 2048) + bytes([how]) + pos + posdata(Lq, Lk)


# distance-bias tables (flags bit 8192): length byte (len + 2), rows byte, len x rows entries
# (take_float bytes), then the length-override byte (0: len)
put("problem", "bias_table.bin", call(1, 2, 1, 4, 6, 4, flags=1 | 8192,
                                      tail=bytes([7, 2, 1, 2, 3, 4, 13, 14, 1, 2, 3, 4, 0])))
put("problem", "bias_table_shared_short.bin", call(2, 2, 1, 5, 9, 4, flags=8192,
                                                   tail=bytes([4, 1, 13, 3, 0])))
put("problem", "bias_table_nan.bin", call(1, 2, 1, 4, 6, 4, flags=1 | 8192,
                                          tail=bytes([5, 2, 1, 2, 0xC1, 4, 13, 14, 0])))
put("problem", "positions_gaps.bin", atpos(3, 4, 1, bytes([0, 1, 5, 6, 5, 6, 6])))
put("problem", "positions_default.bin", atpos(3, 4, 0, b""))
put("problem", "positions_int64_ends.bin",
    atpos(1, 2, 2, i64(-1) + i64(0) + i64((1 << 63) - 1)))
put("problem", "positions_pos_q_null.bin", atpos(3, 4, 1 | 8, bytes([0, 1, 5, 6, 5, 6, 6])))
put("problem", "positions_q_start_set.bin",
    atpos(3, 4, 1, bytes([0, 1, 5, 6, 5, 6, 6]), flags=1 | 2))

# ---- cache: an entry for fuzz_cache.c's key, as ape__progcache_format writes it, and damaged ones
KEY = b"opencl|pthread-fuzz|PoCL 3.1|-cl-std=CL1.2 -DAPE_D=64|src=0123456789abcdef"


def fnv(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def entry(payload, key=KEY):
    return (b"APECACHE" + struct.pack("<IIQQ", 1, len(key), len(payload), fnv(payload)) + key +
            payload)


binary = b"\x7fELF\x02\x01\x01" + bytes(57) + b"pocl program binary " * 8
put("cache", "valid.bin", entry(binary))
put("cache", "valid_empty_payload.bin", entry(b""))
put("cache", "truncated.bin", entry(binary)[:-7])
bad = bytearray(entry(binary))
bad[-1] ^= 1
put("cache", "bad_checksum.bin", bytes(bad))
put("cache", "other_key.bin", entry(binary, KEY[:-1] + b"0"))


# ---- resident: the byte encoding fuzz_resident.c reads (see take_shape(), fuzz_enqueue() and
# fuzz_dlpack() there). Small ints are one byte below 160; floats in the buffers small and finite.
def floats(n, seed):
    return b"".join(struct.pack("<f", ((i * 37 + seed) % 17 - 8) / 8.0) for i in range(n))


def shape(B, H, Hkv, Lq, Lk, Dhalf, dt=0, flags=2):
    return bytes([B, H, Hkv, Lq, Lk, Dhalf, dt, flags])


# enqueue: one buffer of 1024 bytes holding q, k, v, o, lse at element offsets 0, 48, 88, 128, 176
put("resident", "enqueue_one_buffer.bin",
    shape(1, 2, 1, 3, 5, 4) + b"\1" + b"\0" + struct.pack("<H", 1023) + floats(256, 1) +
    b"".join(b"\0" + struct.pack("<H", off) + b"\0" for off in (0, 48, 88, 128, 176)) +
    b"\0" + b"\0" + struct.pack("<H", 64))
# enqueue: q, k, v in one buffer, o and lse in a second, [B, L, H, D] strides with padding
put("resident", "enqueue_two_buffers_blhd.bin",
    shape(1, 2, 2, 4, 4, 4) + b"\1" + b"\1" + struct.pack("<H", 1999) + floats(500, 2) +
    struct.pack("<H", 999) + floats(250, 3) +
    b"".join(bytes([w]) + struct.pack("<H", off) + b"\2\2" for w, off in
             ((0, 0), (0, 100), (0, 200), (1, 0), (1, 100))) + b"\0" + b"\0\0\0")
# backward enqueue: one buffer of 1024 bytes holding q, k, v, o, lse, dout, dlse, dq, dk, dv,
# dparams compact at element offsets 0, 24, 44, 64, 88, 94, 118, 124, 148, 168, 188 (D = 4)
put("resident", "backward_one_buffer.bin",
    shape(1, 2, 1, 3, 5, 2) + b"\3" + b"\0" + struct.pack("<H", 1023) + floats(256, 4) +
    b"".join(b"\0" + struct.pack("<H", off) + b"\0" for off in
             (0, 24, 44, 64, 88, 94, 118, 124, 148, 168, 188)) + b"\0")
# DLPack: compact kDLCPU tensors, float32, blocks as large as each addresses (after the selector,
# the byte that asks for the diagnostics; per tensor: which, more, strides mode, byte offset)
put("resident", "dlpack_compact.bin",
    shape(1, 2, 1, 3, 5, 4) + b"\0" + b"\0" +
    b"".join(b"\0\0" + b"\0" + b"\0" + floats(n, i) for i, n in
             enumerate((48, 40, 40, 48, 6))) + b"\0")
# DLPack backward (selector 2): q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams compact (D = 4),
# then the absent mask, the alias byte and the stream byte; and the same with dq over q's memory
# (alias 1: output dq, tensor 0), which must be refused
BWD_ELEMS = (24, 20, 20, 24, 6, 24, 6, 24, 20, 20, 8)


def dlpack_backward(alias):
    return (shape(1, 2, 1, 3, 5, 2) + b"\2" + b"\0" +
            b"".join(b"\0\0" + b"\0" + b"\0" + floats(n, i + 7) for i, n in
                     enumerate(BWD_ELEMS)) + b"\0" + bytes([alias]) + b"\0")


put("resident", "dlpack_backward_compact.bin", dlpack_backward(0))
put("resident", "dlpack_backward_dq_over_q.bin", dlpack_backward(1))
# KV cache (selector 5): H query heads, allow_release, a release; blocks of 4 tokens, 16 tokens,
# max_queries 4, append_chunk 8, attend_chunk 8, 1 MiB of device memory; a host append of 6
# tokens, a device append of 3 from one buffer of 256 bytes (k at 0, v 48 bytes in), an attend
# of 2 queries
put("resident", "kv_cache_session.bin",
    shape(1, 2, 1, 2, 2, 2, flags=3) + b"\5" + bytes([1 | 4 | 64, 4, 16, 4, 8, 8]) +
    b"\0\0\x10" + b"\6" + floats(24, 5) + b"\0" + floats(24, 6) + b"\0" +
    b"\0" + struct.pack("<H", 255) + floats(64, 7) + b"\3" +
    b"\0" + struct.pack("<H", 0) + b"\0" + b"\0" + struct.pack("<H", 12) + b"\0" +
    b"\2" + floats(16, 8) + b"\0" + b"\0" + bytes(65))


# ---- varlen: the byte encoding fuzz_varlen.c reads: S, flags (1, 2: raw offsets; 4: raw
# cu_seqlens_q[0]; 8, 16: explicit query, key positions; 32: causal; 64: raw int64 positions;
# 128: negative num_seqs), total_q, total_k, then per sequence one byte of each length (mod 6),
# 24 pairs of position bytes (query i, key i; mod 40), q, k, v bytes, delta, lambda.
def varlen(S, flags, tq, tk, lens, pos=b"", tail=b""):
    b = bytes([S, flags, tq, tk])
    for lq, lk in lens:
        b += bytes([lq, lk])
    return b + (pos or bytes(48)) + tail


put("varlen", "default_positions.bin",
    varlen(3, 32, 9, 12, [(2, 3), (0, 4), (7, 5)], tail=bytes(range(256)) * 2 + bytes([4, 2])))
put("varlen", "gaps_and_repeats.bin",
    varlen(2, 8 | 16 | 32, 7, 9, [(4, 5), (3, 4)],
           pos=bytes([5, 5, 6, 9, 30, 31, 31, 0, 0, 0] + [0] * 14 +
                     [0, 1, 2, 5, 6, 20, 21, 29, 30] + [0] * 15),
           tail=bytes(range(255, 0, -1)) * 2 + bytes([3, 5])))
put("varlen", "int64_ends.bin",
    varlen(1, 8 | 16 | 64, 1, 2, [(1, 2)],
           pos=b"\xc2" + b"\xa0" + struct.pack("<q", (1 << 62) - 1) + b"\xc3" + b"\xc2" * 45,
           tail=bytes(range(128)) * 2 + bytes([2, 1])))
put("varlen", "decreasing_offsets.bin", varlen(2, 2, 4, 4, [(2, 3)], tail=b"\x05\x02" + bytes(60)))
# the position bytes are read in pairs, query i then key i: pairs() lays two lists out so.
def pairs(pq, pk):
    pq, pk = pq + [0] * (24 - len(pq)), pk + [0] * (24 - len(pk))
    return bytes(x for ij in zip(pq, pk) for x in ij)


# shuffled key positions with repeats and gaps in three sequences (causal): on the reference one
# ragged launch with explicit positions, the host call's and enqueue_varlen's alike
put("varlen", "shuffled_positions.bin",
    varlen(3, 8 | 16 | 32, 10, 12, [(4, 5), (1, 3), (5, 4)],
           pos=pairs([9, 3, 3, 12, 7, 30, 31, 2, 39, 20],
                     [4, 0, 9, 2, 2, 33, 30, 38, 20, 0, 25, 21]),
           tail=bytes(range(7, 256, 3)) * 3 + bytes([5, 3])))
# one sequence over every key at repeated, decreasing positions (not causal): the explicit
# positions' one segment, never the dense problem at implied ones
put("varlen", "one_sequence_repeats.bin",
    varlen(1, 8 | 16, 3, 5, [(3, 5)], pos=pairs([6, 6, 1], [5, 5, 4, 0, 9]),
           tail=bytes(range(200, 0, -1)) * 2 + bytes([6, 2])))


# ---- kvpool: the byte encoding fuzz_kvpool.c reads. The options: flags (1: H, 2: page_tokens,
# 4: max_batch_tokens, 8: attend_chunk as take_int, else one byte each; 16: max_device_bytes,
# 3 bytes; 32: a struct_size byte), Hkv, [H], D / 2, dtype, page_tokens, capacity_tokens,
# max_batch_tokens, attend_chunk; then calls, each an op byte (0 add, 1 remove, 2 fork,
# 3 append, 4 append_batch, 5 attend, 6 sequence_info) and its arguments (see op_*() there).
# take_int: a byte below 0xA0 is its low 5 bits, 0xA0 eight raw bytes, 0xC0 + i edge[i]
# (2: INT64_MAX), 0xE0 two raw bytes. An id byte 8 * i picks the i-th id handed out.
def kvp_small(v):
    return bytes([v]) if v < 32 else b"\xe0" + struct.pack("<H", v)


def kvp_pool(Hkv, H, Dhalf, dt, page, cap, mb, chunk=0):
    return (bytes([1 | 2 | 4 | 8]) + kvp_small(Hkv) + kvp_small(H) + kvp_small(Dhalf) +
            bytes([dt]) + kvp_small(page) + kvp_small(cap) + kvp_small(mb) + kvp_small(chunk))


def kvp_add(k_start):
    return b"\0\0" + kvp_small(k_start)


def kvp_add_near(top, delta):  # +-2^62 + delta (-128..127)
    return b"\0" + bytes([1 | (2 if top else 0)]) + struct.pack("<b", delta)


def kvp_values(n, seed):
    return bytes((i * 37 + seed * 11) % 256 for i in range(n))


# append: flags (16: k packed [n, Hkv, D], 64: v packed), the id, n, then k's and v's values
def kvp_append(i, n, Hkv, D, seed=0):
    return (b"\3" + bytes([16 | 64, 8 * i, n]) + kvp_values(n * Hkv * D, seed) +
            kvp_values(n * Hkv * D, seed + 1))


# append_batch: flags, the batch (flags 0, count, per sequence its id and count), the values
def kvp_batch(entries, Hkv, D, seed=0, fb=0, tail=b"", ntok=None):
    n = sum(c for _, c in entries) if ntok is None else ntok
    b = b"\4" + bytes([16 | 64, fb, len(entries)])
    for i, c in entries:
        b += bytes([8 * i]) + (c if isinstance(c, bytes) else bytes([c]))
    return b + tail + kvp_values(n * Hkv * D, seed) + kvp_values(n * Hkv * D, seed + 1)


# attend: f (4: positions, 8: stats, 32: LSE), g (1: O float32, 2: causal, 4: delta 0.3,
# 16: lambda 0.2, 32: skip_tol 1e-3, 64: skip_tol 0), o's strides mode, the batch (counts of
# rows), the positions (a raw byte, then per row one byte, base + b % 12 - 8, or a take_int),
# then q's values
def kvp_attend(entries, H, D, f=8 | 32, g=2 | 4 | 16, pos=b"", seed=5):
    n = sum(c for _, c in entries)
    b = b"\5" + bytes([f, g, 0, 0, len(entries)])
    for i, c in entries:
        b += bytes([8 * i, c])
    return b + pos + kvp_values(n * H * D, seed)


# a serving step: two requests, a fork (parallel sampling), a batched decode append with a copy
# on write, a ragged attend of the three, a one-sequence decode; pages of 4 tokens, GQA
s = (kvp_pool(2, 4, 4, 0, 4, 64, 16) + kvp_add(0) + kvp_add(5) + kvp_append(0, 10, 2, 8) +
     b"\2\0" + kvp_batch([(0, 1), (1, 2), (2, 3)], 2, 8) +
     kvp_attend([(0, 2), (1, 1), (2, 1)], 4, 8) + kvp_attend([(2, 1)], 4, 8, g=2) +
     b"\6\x08\0" + b"\1\0" + kvp_attend([(1, 3)], 4, 8, g=0))
put("kvpool", "serving_step.bin", s)
# f16 and bf16 storage, O float32, pages of 1 token, explicit positions with gaps and repeats
for dt, name in ((1, "f16"), (2, "bf16")):
    put("kvpool", "positions_%s.bin" % name,
        kvp_pool(1, 2, 8, dt, 1, 24, 8) + kvp_add(3) + kvp_append(0, 7, 1, 16) + b"\2\0" +
        kvp_append(1, 2, 1, 16, seed=3) +
        kvp_attend([(0, 3), (1, 2)], 2, 16, f=4 | 8 | 32, g=1 | 2 | 4,
                   pos=b"\0" + bytes([8, 8, 11, 2, 9])))
# a full pool (5 pages of 4): an append and a batch refused for want of pages, then what fits
put("kvpool", "full_pool.bin",
    kvp_pool(1, 1, 4, 0, 4, 20, 8) + kvp_add(0) + kvp_add(0) + kvp_append(0, 13, 1, 8) +
    kvp_append(1, 9, 1, 8) + kvp_batch([(0, 2), (1, 5)], 1, 8) +
    kvp_batch([(0, 3), (1, 4)], 1, 8) + kvp_attend([(0, 1), (1, 1)], 1, 8))
# refusals of a batch: an id named twice, decreasing offsets (raw: 2, then 1), an attend naming
# one sequence twice
put("kvpool", "batch_refusals.bin",
    kvp_pool(1, 1, 4, 0, 4, 32, 8) + kvp_add(0) + kvp_add(0) +
    kvp_batch([(0, 1), (0, 1)], 1, 8) + kvp_batch([(0, 2), (1, 1)], 1, 8, fb=1, ntok=1) +
    kvp_attend([(1, 1), (1, 1)], 1, 8))
# The int64 ends (each once overflowed in the pool): an offset past the total (INT64_MAX: the
# pages it would need); a row at INT64_MAX followed by another (the run of consecutive
# positions); a row at INT64_MAX over keys from -2^62 with decay and skipping (the window proof
# ran before the position check); a position whose distance overflows (the message kept).
put("kvpool", "batch_offset_int64_max.bin",
    kvp_pool(1, 1, 4, 0, 4, 32, 8) + kvp_add(0) + kvp_append(0, 3, 1, 8) +
    b"\4" + bytes([16 | 64, 1, 1, 0, 0xC2]))
put("kvpool", "positions_int64_max_run.bin",
    kvp_pool(1, 1, 4, 0, 4, 32, 8) + kvp_add(0) + kvp_append(0, 4, 1, 8) +
    kvp_attend([(0, 2)], 1, 8, f=4 | 32, g=2, pos=b"\1\xc2\0"))
put("kvpool", "window_int64_ends.bin",
    kvp_pool(1, 1, 4, 0, 4, 32, 8) + kvp_add_near(False, 0) + kvp_append(0, 4, 1, 8) +
    kvp_attend([(0, 1)], 1, 8, f=4 | 32, g=2 | 4, pos=b"\1\xc2"))
put("kvpool", "position_overflow_message.bin",
    kvp_pool(1, 1, 4, 0, 4, 32, 8) + kvp_add_near(True, -1) + kvp_append(0, 2, 1, 8) +
    kvp_attend([(0, 1)], 1, 8, f=4 | 32, g=2, pos=b"\1\xc1"))


# ---- kvpaged: the byte encoding fuzz_kvpaged.c reads. The options: flags (1: H, 2: page_tokens,
# 4: max_batch_tokens, 8: attend_chunk as take_int, else (H: 0) a byte each; 16: max_device_bytes,
# 3 bytes; 32: a struct_size byte; 128: OpenCL where the fuzz build has it), Hkv, [H], D / 2,
# dtype, page_tokens, num_pages (take_int), max_batch_tokens, attend_chunk; then calls, each an
# op byte (0 plan, 3 run, 7 the NULL arguments) and its arguments (see op_plan(), op_run() there).
def kpg_obj(Hkv, H, Dhalf, dt, page, npages, mb, chunk=0, ocl=False):
    return (bytes([1 | 2 | 4 | 8 | (128 if ocl else 0)]) + kvp_small(Hkv) + kvp_small(H) +
            kvp_small(Dhalf) + bytes([dt]) + kvp_small(page) + kvp_small(npages) +
            kvp_small(mb) + kvp_small(chunk))


def kpg_int(v):  # take_int of any value
    return kvp_small(v) if 0 <= v < 65536 else i64(v)


def kpg_ks(v):  # a k_start: a take_int
    return b"\0" + kpg_int(v)


def kpg_ks_near(top, delta):  # +-2^62 + delta (-128..127)
    return bytes([1 | (2 if top else 0)]) + struct.pack("<b", delta)


# A sequence of a plan: its tokens, its pages (mode 0: from `start`, `step` apart; 1: the
# previous sequence's first pages, then on from its last; 2: the page numbers given), its rows,
# its k_start (encoded, when the plan's flags say k_start is given).
def kpg_seq(n, mode=0, start=0, step=1, rows=0, pages=(), ks=b""):
    return (kpg_int(n) + bytes([mode | (step - 1) << 2, start]) + bytes(pages) + bytes([rows]) +
            ks)


# A plan: flags (0, 1, 2, 3: CSR, block table, both, neither; 4: k_start; 8: pos_q; 16: raw
# positions; 32: raw cu_seqlens_q; 64: a field broken; 128: a NULL), the sequences, the block
# table's stride byte (below 0xf0: the most pages of a sequence + byte % 3 - 1), then `tail`: what
# the flags read after (raw offsets, the broken field, the positions, the form's byte).
def kpg_plan(f, seqs, stride=1, tail=b""):
    return b"\0" + bytes([f, len(seqs)]) + b"".join(seqs) + bytes([stride]) + tail


# A run: m (0-7 the pages' layout: contiguous, vLLM, FlashInfer HND, NHD, padded, raw strides, v
# contiguous, a raw shape entry; 8: a buffer short; 16: byte offsets; 32: a dtype; 64: q's rows;
# 128: a NULL), g (1: O float32, 2: causal, 4: decay, 8: lambda, 16: skip_tol 0, 32: LSE,
# 64: stats, 128: a desc field refused), a seed for the values, then what m and g read.
def kpg_run(m, g, seed=5, tail=b""):
    return b"\3" + bytes([m, g, seed]) + tail


# A serving step over CSR pages (GQA, D 32, pages of 4, chunks of 8 keys): a sequence of 10
# tokens on pages 5-7 (more than a chunk: it runs alone), one sharing its first two pages, one
# of no page, one at k_start -5; the layer's pages in every layout: contiguous, vLLM's,
# FlashInfer's K and V halves of one buffer (HND, NHD), padded
put("kvpaged", "csr_shared_prefix_layouts.bin",
    kpg_obj(2, 4, 16, 0, 4, 16, 24, 8) +
    kpg_plan(4, [kpg_seq(10, 0, 5, rows=2, ks=kpg_ks(3)), kpg_seq(7, 1, rows=1, ks=kpg_ks(3)),
                 kpg_seq(0, rows=1, ks=kpg_ks(0)), kpg_seq(3, 0, 0, rows=3, ks=kpg_ks(-5))]) +
    kpg_run(0, 0x22) + kpg_run(1, 0x25, 6) + kpg_run(2, 0x62, 7) + kpg_run(3, 0x2a, 8) +
    kpg_run(4, 0x22, 9, bytes([1, 2, 3])))
# A decode step over a block table (float16, one key head, D 64, pages of 2, the stride one more
# than the longest row): pages 3 apart, a shared prefix, k_start at 2^62 - 20 and -2^62, one row
# each at explicit positions (after the keys, among them, a repeat)
put("kvpaged", "block_table_decode_f16.bin",
    kpg_obj(1, 2, 32, 1, 2, 24, 8) +
    kpg_plan(1 | 4 | 8, [kpg_seq(9, 0, 3, 3, rows=1, ks=kpg_ks_near(True, -20)),
                         kpg_seq(4, 1, rows=1, ks=kpg_ks_near(False, 0)),
                         kpg_seq(1, 0, 20, rows=2, ks=kpg_ks(0))], stride=2,
             tail=bytes([8, 5, 9, 9])) +
    kpg_run(1, 0x23) + kpg_run(3, 0x22, 6) + kpg_run(0, 0x32, 7))
# bfloat16, pages of one token given in any order, the second sequence their prefix, positions
# with gaps and repeats; small byte offsets into the buffers
put("kvpaged", "bf16_scattered_pages.bin",
    kpg_obj(2, 2, 16, 2, 1, 64, 16, 4) +
    kpg_plan(8, [kpg_seq(6, 2, pages=(9, 3, 40, 7, 2, 11), rows=3), kpg_seq(5, 1, rows=2)],
             tail=bytes([8, 8, 2, 11, 0])) +
    kpg_run(0x10, 0x22, 5, bytes([1, 3, 5, 1])) + kpg_run(0x11, 0x21, 6, bytes([1, 0, 7, 2])))
# The same decode step on OpenCL, where the fuzz build has it (FUZZ_OPENCL=yes): the pages read
# in place through the page table
put("kvpaged", "block_table_decode_opencl.bin",
    kpg_obj(1, 2, 16, 0, 2, 24, 8, ocl=True) +
    kpg_plan(1 | 4 | 8, [kpg_seq(9, 0, 3, 3, rows=1, ks=kpg_ks(0)),
                         kpg_seq(4, 1, rows=1, ks=kpg_ks(7)),
                         kpg_seq(1, 0, 20, rows=2, ks=kpg_ks(0))], stride=2,
             tail=bytes([8, 5, 9, 9])) +
    kpg_run(1, 0x23) + kpg_run(3, 0x22, 6) + kpg_run(2, 0x22, 7))
# Plans the header refuses, each followed by a run (refused: no plan): a page out of range, a
# page twice in one sequence, last_page_len 0 and past the page, a decreasing indptr, a block
# table's stride one short, seq_lens negative (and one accepted with pages shared by two
# sequences); k_start 2^62, both forms, neither, a decreasing cu_seqlens_q, nseq < 0, pt NULL,
# pk NULL, a wrong struct_size, positions at the int64 ends (distances that overflow).
R = kpg_run(0, 0x20)
two = [kpg_seq(8, 0, 2, rows=1), kpg_seq(8, 0, 4, rows=1)]
put("kvpaged", "plan_refusals_table.bin",
    kpg_obj(1, 1, 4, 0, 4, 8, 16) +
    kpg_plan(0, [kpg_seq(4, 2, pages=(8,), rows=1)]) + R +
    kpg_plan(0, [kpg_seq(8, 2, pages=(3, 3), rows=1)]) + R +
    kpg_plan(0, [kpg_seq(8, 0, 2, rows=1), kpg_seq(8, 1, rows=1)]) + R +
    kpg_plan(64, two, tail=bytes([1 | 16, 0])) + R +
    kpg_plan(64, two, tail=bytes([1 | 32, 1])) + R +
    kpg_plan(64, two, tail=bytes([0 | 8, 1, 0])) + R +
    kpg_plan(1, two, stride=0) + R +
    kpg_plan(1 | 64, two, tail=bytes([2 | 16, 1])) + R)
put("kvpaged", "plan_refusals_args.bin",
    kpg_obj(1, 1, 4, 0, 4, 8, 16) +
    kpg_plan(4 | 64, [kpg_seq(8, 0, 2, rows=1, ks=kpg_ks(0))], tail=bytes([5 | 16 | 32, 0])) +
    R + kpg_plan(2, two) + R + kpg_plan(3, two, tail=b"\0") + R +
    kpg_plan(32, two, tail=bytes([1, 0, 0])) + R +
    kpg_plan(64, two, tail=bytes([6 | 3 << 3, 0])) + R +
    kpg_plan(128, two, tail=b"\3") + R + kpg_plan(128, two, tail=b"\4") +
    kpg_plan(128, two, tail=b"\0\7") + R +
    kpg_plan(8 | 16, two, tail=b"\xc2\xc1") + R)
# Runs the header refuses over a valid plan (float16, GQA): a buffer short of its tensor, raw
# strides, v's strides not k's, a wrong shape entry, a wrong dtype, q one row short, desc NULL,
# q_start_set, a byte offset not a multiple of the element; then a valid run
put("kvpaged", "run_refusals.bin",
    kpg_obj(2, 4, 16, 1, 4, 8, 8) + kpg_plan(0, [kpg_seq(6, 0, 1, rows=2)]) +
    kpg_run(8, 0x20, 5, b"\0\3") +
    kpg_run(5, 0x20, 5, b"\xc2\x05\x03\x01") + kpg_run(6, 0x20) +
    kpg_run(7, 0x20, 5, b"\0\x09") + kpg_run(32, 0x20, 5, b"\1") +
    kpg_run(64, 0x20, 5, b"\0") + kpg_run(128, 0x20, 5, b"\5") +
    kpg_run(0, 0xa0, 5, b"\0\1") + kpg_run(16, 0x20, 5, b"\0\0\1\3") + kpg_run(1, 0x20))
# Far positions: keys from 2^62 - 100, rows at 2^62 - 1 (valid), then rows at INT64_MAX and
# INT64_MIN against keys at -2^62 (distances past int64: refused)
put("kvpaged", "positions_int64_ends.bin",
    kpg_obj(1, 1, 4, 0, 4, 8, 8) +
    kpg_plan(4 | 8 | 16, [kpg_seq(5, 0, 0, rows=2, ks=kpg_ks_near(True, -100))],
             tail=i64((1 << 62) - 1) + i64((1 << 62) - 2)) + kpg_run(0, 0x22) +
    kpg_plan(4 | 8 | 16, [kpg_seq(5, 0, 0, rows=2, ks=kpg_ks_near(False, 0))],
             tail=b"\xc2\xc1") + kpg_run(0, 0x22))

# ---- plugins: the byte encoding fuzz_plugins.c reads. A flags byte (1: APE_CONTEXT_NO_PLUGIN_DIR;
# 2 * src: the path as backend_path (0), "" (1), APE_BACKEND_PATH (2), neither (3); 8 * mode:
# backends NULL, "ref", "ref,NAME", "NAME"; 32 * folder: the plugin folder sub/ (0, 1), the test
# folder (2), NULL (3), "" (4), missing (5), a file (6), 4095 or 4096 bytes (7: a last byte picks)),
# the count of entries, the entries (a kind byte, kind | 8 * param: 0 the test folder's entry
# fixed[param & 15], 2 a name inside it, 3 raw bytes, 4 empty, 5 fixed[next byte & 15] '/'-padded
# to 4080 + param bytes, 6 a name without '/', 7 raw bytes repeated to 4080 + param, 31: 8192),
# NAME (modes 2, 3), the names for ape_backend_get_proc(), a raw index (4 bytes).
def plg_raw(b):
    return bytes([len(b)]) + b


def plg(flags, entries, name=None, backend=b"", fn=b"", index=0, tail=b""):
    return (bytes([flags, len(entries)]) + b"".join(entries) +
            (plg_raw(name) if name is not None else b"") + plg_raw(backend) + plg_raw(fn) +
            struct.pack("<i", index) + tail)


def plg_fixed(i):
    return bytes([8 * i])


# every entry of the test folder, the plugin folder sub/ searched after them
put("plugins", "every_fixed_entry.bin", plg(0, [plg_fixed(i) for i in range(16)]))
# through APE_BACKEND_PATH, the reference only, no plugin folder
put("plugins", "env_path.bin",
    plg(1 | 2 * 2 | 8 * 1, [plg_fixed(0), plg_fixed(12), plg_fixed(14), plg_fixed(13)]))
# paths around 4096 bytes: the folder of 4095 (its files' paths longer), a file of 4095, 4096
# and 4097, raw bytes to 4096 and 8192; the plugin folder 4095 bytes long
put("plugins", "long_paths.bin",
    plg(32 * 7, [bytes([5 | 8 * 15, 0]), bytes([5 | 8 * 15, 2]), bytes([5 | 8 * 16, 2]),
                 bytes([5 | 8 * 17, 3]), bytes([7 | 8 * 16]) + plg_raw(b"/x.so:"),
                 bytes([7 | 8 * 31]) + plg_raw(b"ab/")], tail=b"\0"))
# names in backends that the registry does not have, and one it has
put("plugins", "backends_unknown.bin", plg(8 * 2, [plg_fixed(2)], name=b"nosuch"))
put("plugins", "backends_leading_comma.bin", plg(1 | 8 * 3, [plg_fixed(12)], name=b",ref"))
put("plugins", "backends_not_built.bin", plg(8 * 2 | 32 * 2, [], name=b"opencl,cuda"))
# names inside the folder and raw ones (':' splitting them, '/' anywhere), empty entries,
# names without a '/'
put("plugins", "raw_entries.bin",
    plg(1 | 32 * 3, [bytes([2]) + plg_raw(b"sub/libape-backend-s.so"),
                     bytes([3]) + plg_raw(b"/nonexistent/x.so:/usr/:gone.so.1"), b"\4", b"\4",
                     bytes([2]) + plg_raw(b"sub//./"), bytes([6]), bytes([6 | 8 * 1]),
                     bytes([6 | 8 * 2]), bytes([6 | 8 * 4])]))
# ape_backend_get_proc() of the reference, a raw index of INT32_MAX; "" as backend_path
put("plugins", "get_proc.bin",
    plg(2 * 1 | 8 * 1 | 32 * 6, [plg_fixed(2)], backend=b"ref", fn=b"attention_pages",
        index=0x7fffffff))
