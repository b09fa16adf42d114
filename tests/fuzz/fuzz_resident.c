/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the device-resident calls on the reference backend. The input describes a
 * call three ways over:
 *
 * - ape_attention_enqueue() (or, when the input asks for entropy or mean distance,
 *   ape_attention_enqueue_diag(), whose two outputs are fuzzed like lse) on device tensors in
 *   one to three buffers of fuzzed sizes
 *   (ape_buffer_alloc: the reference's buffers are exact heap blocks, so AddressSanitizer sees
 *   any access outside them), each tensor with a fuzzed buffer, byte offset, dtype, shape and
 *   strides (compact, padded layouts, raw values at the edges of int64);
 * - ape_attention_backward_enqueue() likewise, on its eleven tensors (the optional ones
 *   sometimes NULL);
 * - ape_attention_forward_dlpack() (or ape_attention_forward_dlpack_diag(), with entropy and
 *   mean distance DLTensors fuzzed like lse) on kDLCPU DLTensors with fuzzed data pointers (NULL,
 *   misaligned), byte offsets, ndim, shapes, strides (NULL, negative, huge), dtypes (codes,
 *   bits, lanes), devices and streams, over host blocks exactly as large as the tensor
 *   addresses;
 * - ape_attention_backward_dlpack() likewise, on its eleven DLTensors (dlse and the outputs
 *   sometimes NULL; dparams 2-D), and sometimes with an output over the memory of another
 *   tensor of the call (a gradient over q, two gradients over one block).
 *
 * Promises checked:
 * - a refused call returns APE_EINVAL, APE_EOVERFLOW or APE_ENOTSUP with a message naming the
 *   function (ape__check_resident() / ape__check_resident_diag() and the public call give the
 *   same verdict), and enqueues nothing;
 * - an accepted call small enough to run in microseconds runs (and ape_queue_synchronize()
 *   succeeds) without touching a byte outside its buffers;
 * - any other call (more work, or DLTensors over memory not backed: NULL, misaligned, unmapped
 *   addresses, spans past 2^40) is made with an invalid desc, which validation finds only after
 *   every tensor was read and checked: it must be refused, without touching memory (ASan and
 *   the unmapped addresses would see it);
 * - buffer copies (ape_buffer_write / _read) of fuzzed ranges are refused outside the buffer and
 *   stay inside it otherwise;
 * - a refused DLPack call writes no byte of any block, and an output sharing memory with another
 *   tensor of the call is refused unless one of the two has no element.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"
#include "api/resident.h"
#include "api/validate.h"

#define FUZZ_NAME "fuzz_resident"
#include "fuzz/fuzz_input.h"

/* ---------------------------------------------------------------- reading the input */

/* Small enough to run on the float64 reference in microseconds. */
static bool tiny(int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D)
{
	if (B < 0 || H < 0 || Lq < 0 || Lk < 0 || D < 0 || B > 4 || H > 16 || Lq > 64 ||
	    Lk > 64 || D > 512)
		return false;
	return (uint64_t)B * (uint64_t)H * (uint64_t)(Lq + 1) * (uint64_t)(Lk + 1) *
		       (uint64_t)D <= (1u << 15);
}

static void take_strides(struct in *in, const int64_t shape[4], int64_t s[4])
{
	unsigned mode = (unsigned)take(in, 1) & 3;
	uint64_t row;

	memset(s, 0, 4 * sizeof(*s));
	if (mode == 0)
		return; /* compact */
	if (mode == 1) {
		for (int d = 0; d < 4; d++)
			s[d] = take_int(in);
		return;
	}
	/* [B, L, H, D] rows with padding, or padded [B, H, L, D] (in uint64_t: absurd shapes wrap) */
	row = (uint64_t)shape[3] + (uint64_t)take_int(in);
	s[3] = 1;
	if (mode == 2) {
		s[1] = (int64_t)row;
		s[2] = (int64_t)((uint64_t)shape[1] * row);
	} else {
		s[2] = (int64_t)row;
		s[1] = (int64_t)((uint64_t)shape[2] * row);
	}
	s[0] = (int64_t)((uint64_t)shape[1] * (uint64_t)shape[2] * row);
}

/* ---------------------------------------------------------------- the call's shape */

struct shape5 {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dt;
	ape_attn_desc desc;
	bool want_lse;
};

static void take_shape(struct in *in, struct shape5 *s)
{
	unsigned flags;

	s->B = take_int(in);
	s->H = take_int(in);
	s->Hkv = take_int(in);
	s->Lq = take_int(in);
	s->Lk = take_int(in);
	s->D = (int64_t)((uint64_t)take_int(in) * 2);
	s->dt = (ape_dtype)(take(in, 1) % 4); /* 3: not a type */
	ape_attn_desc_init(&s->desc);
	flags = (unsigned)take(in, 1);
	s->desc.causal = flags & 1;
	s->want_lse = flags & 2;
	s->desc.delta.value = flags & 4 ? 0.3f : 0.0f;
	s->desc.lambda.value = flags & 8 ? 0.1f : 0.0f;
	if (flags & 16) {
		s->desc.q_start_set = true;
		s->desc.q_start = take_int(in);
	}
}

static void dims_of(const struct shape5 *s, int i, int64_t d[4])
{
	const bool kv = i == 1 || i == 2;

	d[0] = s->B;
	d[1] = kv ? s->Hkv : s->H;
	d[2] = kv ? s->Lk : s->Lq;
	d[3] = i >= 4 ? 1 : s->D; /* lse, entropy, mean distance: [B, H, Lq, 1] */
}

/*
 * The promises on one call, given validation's verdict ret (and, when it accepted, the problem
 * p, released here): a refusal is EINVAL or EOVERFLOW, names the function, and the public call
 * (made through `call` with a desc) refuses it alike, naming itself; an accepted small call is
 * enqueued and runs; a larger one, given an invalid desc, is refused with nothing enqueued.
 */
typedef int (*public_call)(const void *args, ape_queue *queue, const ape_attn_desc *desc);

static void judge(int ret, struct ape__problem *p, const ape_attn_desc *desc, ape_queue *queue,
		  const char *name, public_call call, const void *args)
{
	const size_t n = strlen(name);
	int eret;

	if (ret) {
		check(ret == APE_EINVAL || ret == APE_EOVERFLOW, "refused with EINVAL or EOVERFLOW");
		check(!strncmp(ape_last_error(), "fuzz: ", 6), "the message names the function");
		eret = call(args, queue, desc);
		check(eret == ret, "the public call refuses what validation refuses");
		check(!strncmp(ape_last_error(), name, n) && !strncmp(ape_last_error() + n, ": ", 2),
		      "the public message names the public call");
	} else {
		ape_attn_desc bad = *desc;
		bool run = tiny(p->B, p->H, p->Lq, p->Lk, p->D);

		ape__problem_fini(p);
		if (!run) /* too much work to run: refused by its desc alone, nothing enqueued */
			bad.rope_base = -1;
		eret = call(args, queue, &bad);
		check(run ? eret == 0 : eret == APE_EINVAL,
		      "an accepted small call is enqueued; a larger one with a bad desc refused");
		check(ape_queue_synchronize(queue) == 0, "and runs");
	}
}

/* args: the five tensor pointers (lse NULL where not wanted) */
static int forward_call(const void *args, ape_queue *queue, const ape_attn_desc *desc)
{
	const ape_dtensor *const *t = args;

	return ape_attention_enqueue(queue, desc, t[0], t[1], t[2], t[3], t[4]);
}

/* args: the seven tensor pointers (lse, entropy, mean distance NULL where not wanted) */
static int diag_call(const void *args, ape_queue *queue, const ape_attn_desc *desc)
{
	const ape_dtensor *const *t = args;

	return ape_attention_enqueue_diag(queue, desc, t[0], t[1], t[2], t[3], t[4], t[5], t[6]);
}

/* args: the eleven tensor pointers, NULL where absent */
static int backward_call(const void *args, ape_queue *queue, const ape_attn_desc *desc)
{
	const ape_dtensor *const *t = args;

	return ape_attention_backward_enqueue(queue, desc, t[0], t[1], t[2], t[3], t[4], t[5],
					      t[6], t[7], t[8], t[9], t[10]);
}

/* ---------------------------------------------------------------- ape_attention_enqueue */

/* One to three buffers of fuzzed sizes, filled from the input (then zeros); returns how many. */
static int take_buffers(struct in *in, ape_queue *queue, ape_buffer *bufs[3])
{
	const int nbuf = 1 + (int)(take(in, 1) % 3);

	for (int b = 0; b < nbuf; b++) {
		size_t bytes = (size_t)(take(in, 2) % 20000) + 1;
		uint8_t *host;

		check(ape_buffer_alloc(ref, bytes, &bufs[b]) == 0, "ape_buffer_alloc");
		/* the inputs: what the input has left, then zeros (never uninitialised) */
		host = calloc(1, bytes);
		check(host != NULL, "calloc");
		for (size_t i = 0; i < bytes && in->n; i++)
			host[i] = (uint8_t)take(in, 1);
		check(ape_buffer_write(queue, bufs[b], 0, host, bytes) == 0,
		      "ape_buffer_write inside the buffer");
		check(ape_queue_synchronize(queue) == 0, "synchronize after a write");
		free(host);
	}
	return nbuf;
}

/* A device tensor of dims d and type dt in one of the buffers, then fuzzed: its buffer, byte
 * offset (small multiples of 4, or any), one shape entry, its dtype (float32 where f32_ok, or
 * any byte), its strides. */
static void take_dtensor(struct in *in, ape_dtensor *t, ape_buffer *const bufs[3], int nbuf,
			 const int64_t d[4], ape_dtype dt, bool f32_ok)
{
	const unsigned which = (unsigned)take(in, 1);

	ape_dtensor_init(t, bufs[which % (unsigned)nbuf], 0, dt, d[0], d[1], d[2], d[3]);
	if (f32_ok && (which & 4))
		t->dtype = APE_F32;
	if (which & 8)
		t->byte_offset = (uint64_t)take_int(in);
	else
		t->byte_offset = (take(in, 2) % 4096) * 4;
	if (which & 16)
		t->shape[which >> 6] = take_int(in);
	if (which & 32)
		t->dtype = (ape_dtype)(int)(int8_t)take(in, 1);
	take_strides(in, t->shape, t->strides);
}

static void fuzz_enqueue(struct in *in, const struct shape5 *s, ape_queue *queue)
{
	ape_buffer *bufs[3] = { NULL };
	ape_dtensor t[7];
	struct ape__problem p;
	struct ape_be_buf *bb[APE_BE_T_COUNT], *db[2];
	struct ape_be_view views[APE_BE_T_COUNT], dv[2];
	const unsigned diag = (unsigned)take(in, 1) & 3; /* 1: entropy, 2: mean distance */
	const ape_dtensor *ent = NULL, *md = NULL;
	int nbuf, ret;

	nbuf = take_buffers(in, queue, bufs);
	for (int i = 0; i < (diag ? 7 : 5); i++) {
		int64_t d[4];

		dims_of(s, i, d);
		take_dtensor(in, &t[i], bufs, nbuf, d, i >= 4 ? APE_F32 : s->dt, i == 3);
	}
	if (take(in, 1) & 1) /* a buffer nobody computes with, or none */
		t[take(in, 1) % (diag ? 7 : 5)].buf = NULL;
	ent = diag & 1 ? &t[5] : NULL;
	md = diag & 2 ? &t[6] : NULL;
	/* per-head parameters are materialised (4 floats a head) before anything runs: a call
	 * claiming millions of heads legitimately allocates that much (as in fuzz_problem.c) */
	if (t[0].shape[1] > (1 << 16))
		goto out;
	ret = ape__check_resident_diag("fuzz", ref, &s->desc, &t[0], &t[1], &t[2], &t[3],
				       s->want_lse ? &t[4] : NULL, ent, md, &p, bb, views, db, dv);
	if (!diag) {
		struct ape__problem p2;
		int ret2 = ape__check_resident("fuzz", ref, &s->desc, &t[0], &t[1], &t[2], &t[3],
					       s->want_lse ? &t[4] : NULL, &p2, bb, views);

		check(ret2 == ret, "without diagnostics, the diag validation is the plain one");
		if (!ret2)
			ape__problem_fini(&p2);
	}
	{
		const ape_dtensor *tp[7] = { &t[0], &t[1], &t[2], &t[3],
					     s->want_lse ? &t[4] : NULL, ent, md };

		judge(ret, &p, &s->desc, queue,
		      diag ? "ape_attention_enqueue_diag" : "ape_attention_enqueue",
		      diag ? diag_call : forward_call, tp);
	}
	/* copies of fuzzed ranges: refused outside the buffer, inside it otherwise */
	{
		size_t off = (size_t)take_int(in), n = (size_t)(take(in, 2) % 30000);
		uint8_t *host = malloc(n + 1);

		check(host != NULL, "malloc");
		memset(host, 0, n + 1);
		ret = ape_buffer_read(queue, host, bufs[0], off, n);
		check(ret == 0 || ret == APE_EINVAL, "ape_buffer_read: 0 or EINVAL");
		check((ret == 0) == (off <= ape_buffer_size(bufs[0]) &&
				     n <= ape_buffer_size(bufs[0]) - off),
		      "ape_buffer_read accepts exactly the ranges inside the buffer");
		ret = ape_buffer_write(queue, bufs[0], off, host, n);
		check(ret == 0 || ret == APE_EINVAL, "ape_buffer_write: 0 or EINVAL");
		check(ape_queue_synchronize(queue) == 0, "synchronize after copies");
		free(host);
	}
out:
	for (int b = 0; b < nbuf; b++)
		ape_buffer_free(bufs[b]);
}

/* ---------------------------------------------------------------- ape_attention_backward_enqueue */

/* The backward on device tensors: q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams (enum
 * ape__rb_tensor order), each fuzzed like the forward's, the optional ones sometimes NULL. The
 * same promises as fuzz_enqueue(): ape__check_resident_bwd() and the public call agree, a
 * refusal names the function and enqueues nothing, an accepted small call runs. */
static void fuzz_backward(struct in *in, const struct shape5 *s, ape_queue *queue)
{
	static const int kind[APE__RB_COUNT] = { 0, 1, 1, 0, 4, 0, 4, 0, 1, 1, 5 };
	ape_buffer *bufs[3] = { NULL };
	ape_dtensor t[APE__RB_COUNT];
	const ape_dtensor *tp[APE__RB_COUNT];
	struct ape__resident_bwd_req r;
	struct ape__problem p;
	unsigned absent;
	int nbuf, ret;

	nbuf = take_buffers(in, queue, bufs);
	for (int i = 0; i < APE__RB_COUNT; i++) {
		int64_t d[4];
		const bool f32 = kind[i] >= 4; /* lse, dlse, dparams */

		if (kind[i] == 5) {
			d[0] = d[1] = 1;
			d[2] = s->H;
			d[3] = 4;
		} else {
			dims_of(s, kind[i], d);
		}
		take_dtensor(in, &t[i], bufs, nbuf, d, f32 ? APE_F32 : s->dt,
			     !f32 && i != APE__RB_Q && i != APE__RB_K && i != APE__RB_V);
		tp[i] = &t[i];
	}
	/* dlse, dq, dk, dv, dparams each absent or not (all four outputs absent: refused) */
	absent = (unsigned)take(in, 1);
	for (int i = APE__RB_DLSE; i < APE__RB_COUNT; i++)
		if (absent & (1u << (i - APE__RB_DLSE)))
			tp[i] = NULL;
	if (absent & 0x40) /* a buffer nobody computes with */
		t[take(in, 1) % APE__RB_COUNT].buf = NULL;
	if (t[0].shape[1] > (1 << 16)) /* millions of heads: see fuzz_enqueue() */
		goto out;
	memset(&r, 0, sizeof(r));
	ret = ape__check_resident_bwd("fuzz", queue, &s->desc, tp, &p, &r);
	judge(ret, &p, &s->desc, queue, "ape_attention_backward_enqueue", backward_call, tp);
out:
	for (int b = 0; b < nbuf; b++)
		ape_buffer_free(bufs[b]);
}

/* ---------------------------------------------------------------- the KV cache */

/* a * b, or UINT64_MAX when either is negative or the product passes 2^62 */
static uint64_t small_mul(int64_t a, int64_t b)
{
	if (a < 0 || b < 0 || (b && (uint64_t)a > (1ull << 62) / (uint64_t)b))
		return UINT64_MAX;
	return (uint64_t)a * (uint64_t)b;
}

/* A contiguous host tensor [d0, d1, d2, d3] of type dt over a block of exactly its bytes (filled
 * from the input), or, past 2^18 elements, over memory not backed (the call must refuse it: no
 * cache fuzz_kv() creates takes that much at once). *block: what to free. */
static void take_host(struct in *in, ape_tensor *t, void **block, ape_dtype dt, int64_t d0,
		      int64_t d1, int64_t d2, int64_t d3)
{
	const uint64_t n = small_mul((int64_t)small_mul(d0, d1), (int64_t)small_mul(d2, d3));
	const size_t esz = dt >= APE_F32 && dt <= APE_BF16 ? ape_dtype_size(dt) : 4;

	*block = NULL;
	if (n <= (1u << 18)) {
		const size_t bytes = (size_t)n * esz + 1, from_input = bytes < in->n ? bytes : in->n;

		*block = malloc(bytes);
		check(*block != NULL, "malloc");
		memcpy(*block, in->p, from_input);
		memset((uint8_t *)*block + from_input, 0, bytes - from_input);
		in->p += from_input;
		in->n -= from_input;
	}
	ape_tensor_init(t, *block ? *block : (void *)(uintptr_t)0x7f0000000000ull, dt, d0, d1, d2,
			d3);
}

/* ret is 0 or one of the codes a refusal may have, with a message naming fn. */
static void refused_or_done(int ret, const char *fn)
{
	char what[128];

	if (!ret)
		return;
	snprintf(what, sizeof(what), "%s refuses with EINVAL, EOVERFLOW, ENOMEM or ENOTSUP", fn);
	check(ret == APE_EINVAL || ret == APE_EOVERFLOW || ret == APE_ENOMEM || ret == APE_ENOTSUP,
	      what);
	snprintf(what, sizeof(what), "the message names %s", fn);
	check(strstr(ape_last_error(), fn) != NULL, what);
}

/*
 * A KV-cache session on the reference with fuzzed options (within sizes whose host allocations
 * stay small: the device memory under a fuzzed max_device_bytes of at most 8 MiB), then a host
 * append, a device append (ape_kv_cache_append_device() of fuzzed device tensors), a release and
 * an attend (ape_kv_cache_attend_diag() when the input asks for entropy or mean distance),
 * each with fuzzed shapes (one entry of each tensor, the token and query counts), dtypes and
 * descriptor. Every call succeeds or refuses with a message naming it; a refused
 * append appends nothing (ape_kv_cache_get_info()); accepted calls run inside their memory.
 */
static void fuzz_kv(struct in *in, const struct shape5 *s, ape_queue *queue)
{
	const unsigned flags = (unsigned)take(in, 1);
	ape_kv_cache_options o;
	ape_kv_cache_info before, after;
	ape_kv_cache *cache = (ape_kv_cache *)(uintptr_t)1; /* must be NULL after a failure */
	ape_buffer *bufs[3] = { NULL };
	void *blk[7] = { NULL }; /* k, v, q, o, lse, entropy, mean distance */
	ape_tensor k, v, q, out;
	ape_dtensor dk, dv;
	int64_t n, d[4];
	int nbuf, ret;

	ape_kv_cache_options_init(&o);
	o.B = s->B;
	o.Hkv = s->Hkv;
	o.H = flags & 1 ? s->H : 0;
	o.D = s->D;
	o.dtype = s->dt;
	o.block_tokens = take_int(in);
	o.capacity_tokens = take_int(in);
	if (flags & 2)
		o.k_start = take_int(in);
	o.max_queries = (int64_t)(take(in, 1) % 40);
	o.append_chunk = (int64_t)(take(in, 1) % 40);
	o.attend_chunk = (int64_t)(take(in, 1) % 80);
	o.max_device_bytes = take(in, 3) % (8u << 20) + 1;
	o.allow_release = flags & 4;
	o.max_query_norm = flags & 8 ? (double)take_int(in) : 100.0;
	/* the host allocations of a create (per-block norms, staging, per-head tables) stay small,
	 * and so do the cache and the largest query: every tensor a call may accept has at most
	 * 2^18 elements (take_host()). Negative and zero sizes are the create's to refuse; a
	 * capacity past 2^40 tokens is refused before anything is allocated. */
	{
#define POS(x) ((x) > 0 ? (x) : 1)
		/* block_tokens 0 is the library's default, 256 (ape.h): a capacity of one token
		 * still holds a whole block (the finding of 2026-12-06: B = 1498, a 47-token append
		 * of 281,624 elements fit in a "one-token" cache) */
		const int64_t bt = o.block_tokens ? POS(o.block_tokens) : 256;
		const int64_t ac = o.append_chunk ? o.append_chunk : 1024;
		const int64_t blocks = (o.capacity_tokens >> 41 ? 1 : POS(o.capacity_tokens)) / bt + 1;
		const uint64_t bg = small_mul(POS(o.B), POS(o.Hkv));
		const int64_t H = o.H > 0 ? o.H : o.Hkv;

		if (bg > (1u << 12) || o.D > 256 || H > (1 << 16) ||
		    small_mul((int64_t)small_mul(blocks, bt), (int64_t)bg * POS(o.D)) > (1u << 18) ||
		    small_mul((int64_t)bg * ac, POS(o.D)) > (1u << 22) ||
		    small_mul((int64_t)small_mul(POS(o.B), POS(H)), 40 * POS(o.D)) > (1u << 18))
			return;
#undef POS
	}
	ret = ape_kv_cache_create(ref, &o, &cache);
	refused_or_done(ret, "ape_kv_cache_create");
	if (ret) {
		check(cache == NULL, "a failed create leaves *out NULL");
		return;
	}
	check(ape_kv_cache_get_info(cache, &before) == 0, "ape_kv_cache_get_info");
	/* a host append of n tokens, one entry of k's or v's shape perhaps fuzzed */
	n = (int64_t)(take(in, 1) % 48);
	d[0] = o.B, d[1] = o.Hkv, d[2] = n, d[3] = o.D;
	if (flags & 16)
		d[take(in, 1) & 3] = take_int(in);
	take_host(in, &k, &blk[0], flags & 32 ? (ape_dtype)(take(in, 1) % 4) : o.dtype, d[0], d[1],
		  d[2], d[3]);
	take_host(in, &v, &blk[1], o.dtype, o.B, o.Hkv, d[2], o.D);
	ret = ape_kv_cache_append(cache, &k, &v);
	refused_or_done(ret, "ape_kv_cache_append");
	check(ape_kv_cache_get_info(cache, &after) == 0, "ape_kv_cache_get_info");
	check(after.tokens == before.tokens + (ret ? 0 : d[2]),
	      "an append adds its tokens, a refused one none");
	/* a device append from fuzzed device tensors */
	before = after;
	nbuf = take_buffers(in, queue, bufs);
	d[0] = o.B, d[1] = o.Hkv, d[2] = (int64_t)(take(in, 1) % 24), d[3] = o.D;
	take_dtensor(in, &dk, bufs, nbuf, d, o.dtype, false);
	take_dtensor(in, &dv, bufs, nbuf, d, o.dtype, false);
	if (dk.shape[1] <= (1 << 16)) {
		ret = ape_kv_cache_append_device(cache, queue, &dk, &dv);
		refused_or_done(ret, "ape_kv_cache_append_device");
		check(ape_kv_cache_get_info(cache, &after) == 0, "ape_kv_cache_get_info");
		check(after.tokens == before.tokens + (ret ? 0 : dk.shape[2]),
		      "a device append adds its tokens, a refused one none");
		check(ape_queue_synchronize(queue) == 0, "synchronize after a device append");
	}
	for (int b = 0; b < nbuf; b++)
		ape_buffer_free(bufs[b]);
	/* a release (refused without allow_release), then an attend of Lq queries */
	if (flags & 64) {
		int64_t released = -1;

		ret = ape_kv_cache_release_unreachable(cache, &s->desc, &released);
		refused_or_done(ret, "ape_kv_cache_release_unreachable");
		check(ret || released >= 0, "a release says how many tokens it released");
		check(ret || o.allow_release, "a release needs allow_release");
	}
	{
		const int64_t H = o.H ? o.H : o.Hkv, Lq = (int64_t)(take(in, 1) % 24);
		const uint64_t rows = small_mul((int64_t)small_mul(o.B, H), Lq);

		d[0] = o.B, d[1] = H, d[2] = Lq, d[3] = o.D;
		if (flags & 128)
			d[take(in, 1) & 3] = take_int(in);
		take_host(in, &q, &blk[2], o.dtype, d[0], d[1], d[2], d[3]);
		const unsigned ob = (unsigned)take(in, 1); /* 1: O float32; 2, 4: entropy, distance */

		take_host(in, &out, &blk[3], ob & 1 ? APE_F32 : o.dtype, o.B, H, Lq, o.D);
		/* LSE and the diagnostics: rows floats each, where wanted and that is small */
		for (int i = 0; i < 3 && rows <= (1u << 16); i++)
			if (i == 0 ? s->want_lse : (ob & (2u << (i - 1))) != 0) {
				blk[4 + i] = calloc(rows + 1, sizeof(float));
				check(blk[4 + i] != NULL, "calloc");
			}
		if (ob & 6) {
			ret = ape_kv_cache_attend_diag(cache, &s->desc, &q, &out, blk[4], blk[5],
						       blk[6], NULL);
			refused_or_done(ret, "ape_kv_cache_attend_diag");
		} else {
			ret = ape_kv_cache_attend(cache, &s->desc, &q, &out, blk[4], NULL);
			refused_or_done(ret, "ape_kv_cache_attend");
		}
	}
	ape_kv_cache_destroy(cache);
	for (int i = 0; i < 7; i++)
		free(blk[i]);
}

/* ---------------------------------------------------------------- the DLPack calls */

/* A DLPack call's tensors: the forward's q, k, v, o, lse, entropy, mean distance, or the
 * backward's q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams; each over a host block exactly as
 * large as it addresses (when that is small), with a copy of the block as it was before the
 * call. */
struct dlf {
	DLTensor t[APE__RB_COUNT];
	int64_t shp[APE__RB_COUNT][4], str[APE__RB_COUNT][4];
	void *block[APE__RB_COUNT], *before[APE__RB_COUNT];
	size_t bytes[APE__RB_COUNT];
	bool runnable; /* every tensor backed and the work tiny */
};

/* Tensor i of nd dimensions (d: its shape, [B, H, L, D], [B, H, Lq, 1] or [H, 4, 1, 1]) of type
 * dt, then fuzzed: its dtype (codes, bits, lanes), device, ndim, one shape entry, strides (NULL,
 * the layouts of take_strides(), one raw value), byte offset, data pointer (NULL, misaligned, or
 * memory not backed). */
static void take_dl(struct in *in, struct dlf *f, int i, const int64_t d[4], int nd, ape_dtype dt)
{
	const unsigned which = (unsigned)take(in, 1), more = (unsigned)take(in, 1);
	DLTensor *t = &f->t[i];
	int64_t *shp = f->shp[i], *str = f->str[i], s4[4];
	uint64_t elems, esz;

	memcpy(shp, d, 4 * sizeof(*shp));
	memset(t, 0, sizeof(*t));
	t->device = (DLDevice){ kDLCPU, 0 };
	t->ndim = nd;
	t->shape = shp;
	t->dtype = (DLDataType){ dt == APE_F32 || dt == APE_F16 ? kDLFloat : kDLBfloat,
				 dt == APE_F32 ? 32 : 16, 1 };
	if (which & 1)
		t->dtype = (DLDataType){ (uint8_t)take(in, 1), (uint8_t)take(in, 1),
					 (uint16_t)take(in, 2) };
	if (which & 2)
		t->device = (DLDevice){ (DLDeviceType)(take(in, 1) % 16), (int)(int8_t)take(in, 1) };
	if (which & 4)
		t->ndim = (int)(take(in, 1) % 6);
	if (which & 8)
		shp[more & 3] = take_int(in);
	take_strides(in, shp, s4);
	if (which & 16) { /* explicit strides: the layout's, or compact ones */
		const bool compact = !s4[0] && !s4[1] && !s4[2] && !s4[3];

		/* in uint64_t: absurd shapes wrap here instead of being undefined */
		for (int k = nd - 1; k >= 0; k--)
			str[k] = !compact     ? s4[k]
				 : k == nd - 1 ? 1
					       : (int64_t)((uint64_t)str[k + 1] *
							   (uint64_t)(shp[k + 1] > 0 ? shp[k + 1] : 1));
		if (more & 4)
			str[more >> 5 & 3] = take_int(in);
		t->strides = str;
	}
	t->byte_offset = (more & 8) ? (uint64_t)take_int(in) : (take(in, 1) % 8) * 4;
	/* a block exactly as large as the tensor addresses, when that is small */
	esz = t->dtype.bits / 8 ? t->dtype.bits / 8 : 1;
	if (t->strides) {
		elems = t->ndim >= 1 && t->ndim <= 4 ? span_elems(shp, t->strides, t->ndim) : 0;
	} else {
		int64_t cs[4] = { 1, 1, 1, 1 }; /* compact strides, from the last axis */

		for (int k = t->ndim - 2; k >= 0 && t->ndim <= 4; k--)
			cs[k] = (int64_t)((uint64_t)cs[k + 1] *
					  (uint64_t)(shp[k + 1] > 0 ? shp[k + 1] : 1));
		elems = t->ndim >= 1 && t->ndim <= 4 && shp[0] <= 64 && shp[1] <= 64 && shp[2] <= 64 &&
					(t->ndim < 4 || shp[3] <= 1024)
				? span_elems(shp, cs, t->ndim)
				: 0;
	}
	if (elems && t->byte_offset < 4096 && elems * esz < (1u << 20)) {
		const size_t bytes = (size_t)(t->byte_offset + elems * esz),
			     from_input = bytes < in->n ? bytes : in->n;

		f->block[i] = malloc(bytes);
		f->before[i] = malloc(bytes);
		check(f->block[i] && f->before[i], "malloc");
		/* what the input has left, then zeros */
		memcpy(f->block[i], in->p, from_input);
		memset((uint8_t *)f->block[i] + from_input, 0, bytes - from_input);
		in->p += from_input;
		in->n -= from_input;
		f->bytes[i] = bytes;
		t->data = f->block[i];
	} else {
		/* not backed: the call must refuse it, or runnable is false */
		t->data = (void *)(uintptr_t)(0x7f0000000000ull + ((uint64_t)i << 36));
		f->runnable = false;
	}
	if (more & 16) {
		t->data = (more & 128) ? NULL : (uint8_t *)t->data + 1; /* misaligned */
		f->runnable = false;
	}
}

/* True when tensor i has no element by the shape the call reads (ndim 1 to 4). */
static bool dl_empty(const struct dlf *f, int i)
{
	for (int d = 0; d < f->t[i].ndim && d < 4; d++)
		if (f->shp[i][d] == 0)
			return true;
	return false;
}

/*
 * One DLPack call, forward (diag: with entropy 1, mean distance 2) or backward, on kDLCPU
 * tensors. A call that may touch only backed memory runs as it is. Any other (memory not
 * backed, or too much work) gets an invalid desc, found only once every tensor was read, wrapped
 * and checked: it must then be refused, having touched nothing. A refusal is EINVAL, EOVERFLOW
 * or ENOTSUP, names the call, and leaves every block as it was. The backward may also be given
 * an output over the memory of another tensor of the call (a gradient over q, two gradients
 * over one block): refused, unless one of the two has no element.
 */
static void fuzz_dlpack(struct in *in, const struct shape5 *s, bool backward)
{
	/* the backward's tensors as fuzz_backward() has them: 0 q-like, 1 k-like, 4 [B, H, Lq],
	 * 5 [H, 4] */
	static const int kind[APE__RB_COUNT] = { 0, 1, 1, 0, 4, 0, 4, 0, 1, 1, 5 };
	struct dlf f = { .runnable = tiny(s->B, s->H, s->Lq, s->Lk, s->D) };
	const unsigned pick = (unsigned)take(in, 1);
	const unsigned diag = backward ? 0 : pick & 3; /* 1: entropy, 2: mean distance */
	const int n = backward ? APE__RB_COUNT : diag ? 7 : 5;
	const char *pub = backward ? "ape_attention_backward_dlpack: "
			  : diag   ? "ape_attention_forward_dlpack_diag: "
				   : "ape_attention_forward_dlpack: ";
	const DLTensor *bt[APE__RB_COUNT]; /* the backward's, NULL where absent */
	int alias_out = -1, alias_of = -1;
	void *stream = NULL;
	ape_attn_desc desc;
	int ret;

	for (int i = 0; i < n; i++) {
		const int k = backward ? kind[i] : i;
		int64_t d[4];

		if (k == 5) {
			d[0] = s->H;
			d[1] = 4;
			d[2] = d[3] = 1;
		} else {
			dims_of(s, k, d);
		}
		take_dl(in, &f, i, d, k == 5 ? 2 : k >= 4 ? 3 : 4, k >= 4 ? APE_F32 : s->dt);
		bt[i] = &f.t[i];
	}
	if (backward) {
		/* dlse, dq, dk, dv, dparams each absent or not (all four outputs absent: refused);
		 * then perhaps an output over the memory of another tensor of the call */
		const unsigned absent = (unsigned)take(in, 1), alias = (unsigned)take(in, 1);

		for (int i = APE__RB_DLSE; i < APE__RB_COUNT; i++)
			if (absent & (1u << (i - APE__RB_DLSE)))
				bt[i] = NULL;
		if (alias & 1) {
			alias_out = APE__RB_DQ + (int)(alias >> 1 & 3);
			alias_of = (int)((alias >> 3) % APE__RB_COUNT);
			if (alias_of == alias_out || !bt[alias_out] || !bt[alias_of]) {
				alias_out = alias_of = -1;
			} else {
				f.t[alias_out].data = f.t[alias_of].data;
				f.t[alias_out].byte_offset = f.t[alias_of].byte_offset;
				/* its own block stays (freed below), unused */
			}
		}
	}
	if (take(in, 1) == 0xA5)
		stream = (void *)f.t;
	if (f.shp[0][1] > (1 << 16)) /* millions of heads: see fuzz_enqueue() */
		goto out;
	for (int i = 0; i < n; i++)
		if (f.block[i])
			memcpy(f.before[i], f.block[i], f.bytes[i]);
	desc = s->desc;
	if (!f.runnable)
		desc.rope_base = -1;
	if (backward)
		ret = ape_attention_backward_dlpack(ref, &desc, bt[0], bt[1], bt[2], bt[3], bt[4],
						    bt[5], bt[6], (DLTensor *)bt[7],
						    (DLTensor *)bt[8], (DLTensor *)bt[9],
						    (DLTensor *)bt[10], stream);
	else if (diag)
		ret = ape_attention_forward_dlpack_diag(ref, &desc, &f.t[0], &f.t[1], &f.t[2],
							&f.t[3], s->want_lse ? &f.t[4] : NULL,
							diag & 1 ? &f.t[5] : NULL,
							diag & 2 ? &f.t[6] : NULL, stream);
	else
		ret = ape_attention_forward_dlpack(ref, &desc, &f.t[0], &f.t[1], &f.t[2], &f.t[3],
						   s->want_lse ? &f.t[4] : NULL, stream);
	check(f.runnable || ret, "a call with an invalid desc is refused");
	check(alias_out < 0 || ret || dl_empty(&f, alias_out) || dl_empty(&f, alias_of),
	      "an output over the memory of another tensor is refused");
	if (ret) {
		check(ret == APE_EINVAL || ret == APE_EOVERFLOW || ret == APE_ENOTSUP,
		      "the DLPack call refuses with EINVAL, EOVERFLOW or ENOTSUP");
		check(strstr(ape_last_error(), pub) != NULL, "the message names the DLPack call");
		for (int i = 0; i < n; i++)
			check(!f.block[i] || !memcmp(f.before[i], f.block[i], f.bytes[i]),
			      "a refused call writes nothing");
	}
out:
	for (int i = 0; i < APE__RB_COUNT; i++) {
		free(f.block[i]);
		free(f.before[i]);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	struct shape5 s;
	ape_queue *queue = NULL;
	unsigned sel;

	memset(&s, 0, sizeof(s));
	take_shape(&in, &s);
	sel = (unsigned)take(&in, 1);
	if (sel & 1) {
		check(ape_queue_create(ref, &queue) == 0, "ape_queue_create");
		if (sel & 4)
			fuzz_kv(&in, &s, queue);
		else if (sel & 2)
			fuzz_backward(&in, &s, queue);
		else
			fuzz_enqueue(&in, &s, queue);
		ape_queue_destroy(queue);
	} else {
		fuzz_dlpack(&in, &s, sel & 2);
	}
	return 0;
}
