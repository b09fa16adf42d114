/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the device-resident calls on the reference backend. The input describes a
 * call twice over:
 *
 * - ape_attention_enqueue() (or, when the input asks for entropy or mean distance,
 *   ape_attention_enqueue_diag(), whose two outputs are fuzzed like lse) on device tensors in
 *   one to three buffers of fuzzed sizes
 *   (ape_buffer_alloc: the reference's buffers are exact heap blocks, so AddressSanitizer sees
 *   any access outside them), each tensor with a fuzzed buffer, byte offset, dtype, shape and
 *   strides (compact, padded layouts, raw values at the edges of int64);
 * - ape_attention_forward_dlpack() (or ape_attention_forward_dlpack_diag(), with entropy and
 *   mean distance DLTensors fuzzed like lse) on kDLCPU DLTensors with fuzzed data pointers (NULL,
 *   misaligned), byte offsets, ndim, shapes, strides (NULL, negative, huge), dtypes (codes,
 *   bits, lanes), devices and streams, over host blocks exactly as large as the tensor
 *   addresses.
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
 *   stay inside it otherwise.
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

/* Elements from the first addressed to the last, +1 (0: no element, or beyond 2^40). */
static uint64_t span_elems(const int64_t *shape, const int64_t *strides, int nd)
{
	uint64_t last = 0;

	for (int d = 0; d < nd; d++) {
		if (shape[d] <= 0 || strides[d] < 0)
			return 0;
		if (shape[d] > 1) {
			if ((uint64_t)strides[d] > (1ull << 40) / (uint64_t)shape[d])
				return 0;
			last += (uint64_t)(shape[d] - 1) * (uint64_t)strides[d];
			if (last > (1ull << 40))
				return 0;
		}
	}
	return last + 1;
}

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

/* ---------------------------------------------------------------- ape_attention_enqueue */

static void fuzz_enqueue(struct in *in, const struct shape5 *s, ape_queue *queue)
{
	ape_buffer *bufs[3] = { NULL };
	ape_dtensor t[7];
	struct ape__problem p;
	struct ape__buf *bb[APE__T_COUNT], *db[2];
	struct ape__view views[APE__T_COUNT], dv[2];
	const unsigned diag = (unsigned)take(in, 1) & 3; /* 1: entropy, 2: mean distance */
	const ape_dtensor *ent = NULL, *md = NULL;
	const char *pub = diag ? "ape_attention_enqueue_diag: " : "ape_attention_enqueue: ";
	int nbuf = 1 + (int)(take(in, 1) % 3), ret, eret;

	for (int b = 0; b < nbuf; b++) {
		size_t bytes = (size_t)(take(in, 2) % 20000) + 1;

		check(ape_buffer_alloc(ref, bytes, &bufs[b]) == 0, "ape_buffer_alloc");
		/* the inputs: what the input has left, then zeros (never uninitialised) */
		{
			uint8_t *host = calloc(1, bytes);

			check(host != NULL, "calloc");
			for (size_t i = 0; i < bytes && in->n; i++)
				host[i] = (uint8_t)take(in, 1);
			check(ape_buffer_write(queue, bufs[b], 0, host, bytes) == 0,
			      "ape_buffer_write inside the buffer");
			check(ape_queue_synchronize(queue) == 0, "synchronize after a write");
			free(host);
		}
	}
	for (int i = 0; i < (diag ? 7 : 5); i++) {
		int64_t d[4];
		unsigned which = (unsigned)take(in, 1);

		dims_of(s, i, d);
		ape_dtensor_init(&t[i], bufs[which % nbuf], 0, i >= 4 ? APE_F32 : s->dt, d[0], d[1],
				 d[2], d[3]);
		if (i == 3 && (which & 4))
			t[i].dtype = APE_F32;
		if (which & 8)
			t[i].byte_offset = (uint64_t)take_int(in);
		else
			t[i].byte_offset = (take(in, 2) % 4096) * 4;
		if (which & 16)
			t[i].shape[which >> 6] = take_int(in);
		if (which & 32)
			t[i].dtype = (ape_dtype)(int)(int8_t)take(in, 1);
		take_strides(in, t[i].shape, t[i].strides);
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
	if (ret) {
		check(ret == APE_EINVAL || ret == APE_EOVERFLOW, "refused with EINVAL or EOVERFLOW");
		check(!strncmp(ape_last_error(), "fuzz: ", 6), "the message names the function");
		eret = diag ? ape_attention_enqueue_diag(queue, &s->desc, &t[0], &t[1], &t[2], &t[3],
							 s->want_lse ? &t[4] : NULL, ent, md)
			    : ape_attention_enqueue(queue, &s->desc, &t[0], &t[1], &t[2], &t[3],
						    s->want_lse ? &t[4] : NULL);
		check(eret == ret, "the public call refuses what validation refuses");
		check(!strncmp(ape_last_error(), pub, strlen(pub)),
		      "the public message names the public call");
	} else {
		ape_attn_desc bad = s->desc;
		bool run = tiny(p.B, p.H, p.Lq, p.Lk, p.D);

		ape__problem_fini(&p);
		if (!run) /* too much work to run: refused by its desc alone, nothing enqueued */
			bad.rope_base = -1;
		eret = diag ? ape_attention_enqueue_diag(queue, &bad, &t[0], &t[1], &t[2], &t[3],
							 s->want_lse ? &t[4] : NULL, ent, md)
			    : ape_attention_enqueue(queue, &bad, &t[0], &t[1], &t[2], &t[3],
						    s->want_lse ? &t[4] : NULL);
		check(run ? eret == 0 : eret == APE_EINVAL,
		      "an accepted small call is enqueued; a larger one with a bad desc refused");
		check(ape_queue_synchronize(queue) == 0, "and runs");
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

/* ---------------------------------------------------------------- the DLPack call */

static void fuzz_dlpack(struct in *in, const struct shape5 *s)
{
	DLTensor t[7];
	int64_t shp[7][4], str[7][4];
	void *block[7] = { NULL };
	bool runnable = tiny(s->B, s->H, s->Lq, s->Lk, s->D);
	const unsigned diag = (unsigned)take(in, 1) & 3; /* 1: entropy, 2: mean distance */
	const char *pub = diag ? "ape_attention_forward_dlpack_diag: "
			       : "ape_attention_forward_dlpack: ";
	void *stream = NULL;
	ape_attn_desc desc;
	int ret;

	for (int i = 0; i < (diag ? 7 : 5); i++) {
		unsigned which = (unsigned)take(in, 1), more = (unsigned)take(in, 1);
		const int nd = i >= 4 ? 3 : 4;
		uint64_t elems, esz;
		int64_t s4[4];

		dims_of(s, i, shp[i]);
		memset(&t[i], 0, sizeof(t[i]));
		t[i].device = (DLDevice){ kDLCPU, 0 };
		t[i].ndim = nd;
		t[i].shape = shp[i];
		t[i].dtype = (DLDataType){ s->dt == APE_F32 || i >= 4 ? kDLFloat
					   : s->dt == APE_F16	  ? kDLFloat
								  : kDLBfloat,
					   s->dt == APE_F32 || i >= 4 ? 32 : 16, 1 };
		if (which & 1)
			t[i].dtype = (DLDataType){ (uint8_t)take(in, 1), (uint8_t)take(in, 1),
						   (uint16_t)take(in, 2) };
		if (which & 2)
			t[i].device = (DLDevice){ (DLDeviceType)(take(in, 1) % 16),
						  (int)(int8_t)take(in, 1) };
		if (which & 4)
			t[i].ndim = (int)(take(in, 1) % 6);
		if (which & 8)
			shp[i][more & 3] = take_int(in);
		take_strides(in, shp[i], s4);
		if (which & 16) { /* explicit strides: the layout's, or compact ones */
			bool compact = !s4[0] && !s4[1] && !s4[2] && !s4[3];

			/* in uint64_t: absurd shapes wrap here instead of being undefined */
			for (int d = nd - 1; d >= 0; d--)
				str[i][d] = !compact	     ? s4[d]
					    : d == nd - 1 ? 1
							  : (int64_t)((uint64_t)str[i][d + 1] *
								      (uint64_t)(shp[i][d + 1] > 0
											 ? shp[i][d + 1]
											 : 1));
			if (nd == 3 && !compact) {
				str[i][0] = s4[0];
				str[i][1] = s4[1];
				str[i][2] = s4[2];
			}
			if (more & 4)
				str[i][more >> 5 & 3] = take_int(in);
			t[i].strides = str[i];
		}
		t[i].byte_offset = (more & 8) ? (uint64_t)take_int(in) : (take(in, 1) % 8) * 4;
		/* a block exactly as large as the tensor addresses, when that is small */
		esz = t[i].dtype.bits / 8 ? t[i].dtype.bits / 8 : 1;
		if (t[i].strides) {
			elems = t[i].ndim >= 1 && t[i].ndim <= 4
					? span_elems(shp[i], t[i].strides, t[i].ndim)
					: 0;
		} else {
			int64_t cs[4] = { 1, 1, 1, 1 }; /* compact strides, from the last axis */

			for (int d = t[i].ndim - 2; d >= 0 && t[i].ndim <= 4; d--)
				cs[d] = (int64_t)((uint64_t)cs[d + 1] *
						  (uint64_t)(shp[i][d + 1] > 0 ? shp[i][d + 1] : 1));
			elems = t[i].ndim >= 1 && t[i].ndim <= 4 && shp[i][0] <= 64 && shp[i][1] <= 64 &&
						shp[i][2] <= 64 && (t[i].ndim < 4 || shp[i][3] <= 1024)
					? span_elems(shp[i], cs, t[i].ndim)
					: 0;
		}
		if (elems && t[i].byte_offset < 4096 && elems * esz < (1u << 20)) {
			const size_t bytes = (size_t)(t[i].byte_offset + elems * esz);

			block[i] = malloc(bytes);
			check(block[i] != NULL, "malloc");
			for (size_t b = 0; b < bytes; b++)
				((uint8_t *)block[i])[b] = (uint8_t)take(in, 1);
			t[i].data = block[i];
		} else {
			/* not backed: the call must refuse it, or runnable is false */
			t[i].data = (void *)(uintptr_t)(0x7f0000000000ull + ((uint64_t)i << 36));
			runnable = false;
		}
		if (more & 16) {
			t[i].data = (more & 128) ? NULL : (uint8_t *)t[i].data + 1; /* misaligned */
			runnable = false;
		}
	}
	if (take(in, 1) == 0xA5)
		stream = (void *)t;
	/* A call that may touch only backed memory runs as it is. Any other (memory not backed,
	 * or too much work) gets an invalid desc, found only once every tensor was read, wrapped
	 * and checked: it must then be refused, having touched nothing. */
	if (shp[0][1] > (1 << 16)) /* millions of heads: see fuzz_enqueue() */
		goto out;
	desc = s->desc;
	if (!runnable)
		desc.rope_base = -1;
	if (diag)
		ret = ape_attention_forward_dlpack_diag(ref, &desc, &t[0], &t[1], &t[2], &t[3],
							s->want_lse ? &t[4] : NULL,
							diag & 1 ? &t[5] : NULL,
							diag & 2 ? &t[6] : NULL, stream);
	else
		ret = ape_attention_forward_dlpack(ref, &desc, &t[0], &t[1], &t[2], &t[3],
						   s->want_lse ? &t[4] : NULL, stream);
	check(runnable || ret, "a call with an invalid desc is refused");
	if (ret) {
		check(ret == APE_EINVAL || ret == APE_EOVERFLOW || ret == APE_ENOTSUP,
		      "the DLPack call refuses with EINVAL, EOVERFLOW or ENOTSUP");
		check(strstr(ape_last_error(), pub) != NULL, "the message names the DLPack call");
	}
out:
	for (int i = 0; i < 7; i++)
		free(block[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	struct shape5 s;
	ape_queue *queue = NULL;

	memset(&s, 0, sizeof(s));
	take_shape(&in, &s);
	if (take(&in, 1) & 1) {
		check(ape_queue_create(ref, &queue) == 0, "ape_queue_create");
		fuzz_enqueue(&in, &s, queue);
		ape_queue_destroy(queue);
	} else {
		fuzz_dlpack(&in, &s);
	}
	return 0;
}
