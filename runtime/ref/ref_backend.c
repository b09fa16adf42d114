/* SPDX-License-Identifier: MIT */
/*
 * The reference backend: "device" memory is host memory and a queue runs each command when it is
 * enqueued, on the calling thread. It exists so the core's path (pack, copy, launch, copy back) is
 * the same for every backend, and so that every test has an oracle. Only buf_alloc, buf_wrap,
 * queue_create, event_record, scratch_alloc and attention_backward can fail (host memory); the
 * other ops cannot, and none names itself (the core's table does). Since its memory
 * is host memory, it wraps the caller's host arrays as they are (buf_wrap, APE_BE_MEM_HOST).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

#define APE_REAL double
#include "ape/ape_math.h"

/* The last choice of "auto": the host without a driver (ranks: core/backend.h). */
#define REF_RANK 0

struct ape_be_buf {
	size_t size;
	unsigned char *bytes; /* mem, or the caller's memory when wrapped */
	bool wrapped;
	max_align_t mem[]; /* the allocation itself (not wrapped): aligned for every type */
};

struct ape_be_queue {
	struct ape_device *dev; /* first, as every backend's (core/backend.h, "Objects") */
};

struct ape_be_event {
	struct ape_device *dev; /* first, likewise */
	double ms; /* CLOCK_MONOTONIC at record time; commands before it have completed */
};

_Static_assert(offsetof(struct ape_be_queue, dev) == 0 && offsetof(struct ape_be_event, dev) == 0,
	       "core/backend.h: queues and events begin with their device");
_Static_assert(APE_BACKEND_ABI_MAJOR == 1, "ref: written for backend ABI 1: review the changes of "
	       "ape/ape_backend.h's contract, then this backend");

static int ref_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	/* everything: its memory is host memory, and it is the oracle of every feature */
	static const struct ape_be_caps caps = {
		.features = APE_BE_CAP_HOST_MEMORY | APE_BE_CAP_DIAG | APE_BE_CAP_DIAG_VIEWS |
			    APE_BE_CAP_BACKWARD | APE_BE_CAP_RESIDENT_BACKWARD | APE_BE_CAP_TIMESTAMPS |
			    APE_BE_CAP_SEGMENTS | APE_BE_CAP_POSITIONS | APE_BE_CAP_BIAS_TABLE |
			    APE_BE_CAP_BWD_SEGMENTS | APE_BE_CAP_BWD_VIEWS,
		.max_alloc = UINT64_MAX,
	};
	struct ape_device_info info;

	(void)res;
	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "reference (plain C, float64)");
	snprintf(info.vendor, sizeof(info.vendor), "libape");
	snprintf(info.driver_version, sizeof(info.driver_version), "%s", ape_version_string());
	info.kind = APE_DEVICE_HOST_REFERENCE;
	info.compute_units = 1;
	return ape_be_device_add(be, &info, &caps, REF_RANK, NULL);
}

/* buf_alloc, and scratch_alloc */
static int ref_alloc(size_t bytes, struct ape_be_buf **out)
{
	struct ape_be_buf *b;

	*out = NULL;
	if (bytes > SIZE_MAX - sizeof(*b) - 64)
		return ape_be_error(APE_ENOMEM, "%zu bytes is more than memory can hold", bytes);
	b = ape_be_malloc(sizeof(*b) + bytes);
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory allocating %zu bytes", bytes);
	b->size = bytes;
	b->bytes = (unsigned char *)b->mem;
	b->wrapped = false;
	*out = b;
	return 0;
}

static int ref_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	(void)dev;
	return ref_alloc(bytes, out);
}

/* Host memory is this device's memory: wrapping it costs one small allocation. */
static int ref_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
			struct ape_be_buf **out, size_t *bytes_out)
{
	struct ape_be_buf *b;

	(void)dev;
	*out = NULL;
	*bytes_out = 0;
	if (kind != APE_BE_MEM_HOST)
		return ape_be_error(APE_ENOTSUP,
				  "the reference computes on host memory only, not on %s memory",
				  kind == APE_BE_MEM_OPENCL ? "OpenCL" : "CUDA");
	b = ape_be_malloc(sizeof(*b));
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory");
	b->size = bytes;
	b->bytes = handle;
	b->wrapped = true;
	*out = b;
	*bytes_out = bytes;
	return 0;
}

static void ref_buf_free(struct ape_device *dev, struct ape_be_buf *buf)
{
	(void)dev;
	free(buf);
}

static int ref_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	struct ape_be_queue *q = ape_be_calloc(1, sizeof(*q));

	*out = NULL;
	if (!q)
		return ape_be_error(APE_ENOMEM, "out of host memory");
	q->dev = dev;
	*out = q;
	return 0;
}

static void ref_queue_destroy(struct ape_be_queue *q)
{
	free(q);
}

static int ref_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
			size_t n)
{
	(void)q;
	memcpy(dst->bytes + off, src, n);
	return 0;
}

static int ref_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n)
{
	(void)q;
	memcpy(dst, src->bytes + off, n);
	return 0;
}

static int ref_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
			struct ape_be_buf *src, size_t src_off, size_t n)
{
	(void)q;
	memmove(dst->bytes + dst_off, src->bytes + src_off, n);
	return 0;
}

static int ref_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		    size_t n)
{
	(void)q;
	for (size_t i = 0; i < n; i += 4)
		memcpy(dst->bytes + off + i, &pattern, 4);
	return 0;
}

static int ref_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	struct ape_be_event *e = ape_be_malloc(sizeof(*e));

	*out = NULL;
	if (!e)
		return ape_be_error(APE_ENOMEM, "out of host memory");
	e->dev = q->dev;
	e->ms = ape_be_now_ms();
	*out = e;
	return 0;
}

static int ref_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	(void)q;
	(void)e; /* commands complete when enqueued: nothing can be pending */
	return 0;
}

static int ref_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	*ms = end->ms - start->ms;
	return 0;
}

/* Commands run when enqueued, so the record time is when everything before it completed. */
static int ref_event_timestamp(struct ape_be_event *e, double *ms)
{
	*ms = e->ms;
	return 0;
}

/* The reference computes straight from the launch's buffers. */
static uint64_t ref_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	(void)dev;
	(void)l;
	return 0;
}

static void ref_event_destroy(struct ape_be_event *e)
{
	free(e);
}

static int ref_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	(void)q;
	ape_be_path_note(l->path, APE_BE_PATH_REFERENCE, "plain C, double accumulation");
	ape__ref_rows(l, l->q->bytes, l->k->bytes, l->v->bytes, l->o->bytes,
		      l->lse ? (float *)l->lse->bytes : NULL,
		      l->pairs ? (uint64_t *)l->pairs->bytes : NULL,
		      l->ent ? (float *)l->ent->bytes : NULL, l->md ? (float *)l->md->bytes : NULL, 0,
		      l->B * l->H * l->Lq);
	return 0;
}

static void *bytes_of(struct ape_be_buf *b)
{
	return b ? b->bytes : NULL;
}

static int ref_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	const struct ape__ref_bwd_io io = {
		.q = bytes_of(l->f.q), .k = bytes_of(l->f.k), .v = bytes_of(l->f.v),
		.o = bytes_of(l->f.o), .dout = bytes_of(l->dout),
		.lse = bytes_of(l->f.lse), .dlse = bytes_of(l->dlse),
		.dq = bytes_of(l->dq), .dk = bytes_of(l->dk),
		.dv = bytes_of(l->dv), .dparams = bytes_of(l->dparams),
		.dbias = bytes_of(l->dbias),
	};

	(void)q;
	ape_be_path_note(l->f.path, APE_BE_PATH_REFERENCE, "plain C, double accumulation");
	return ape__ref_backward(l, &io);
}

/* Commands run when enqueued: queue-ordered memory is plain memory. */
static int ref_scratch_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out)
{
	(void)q;
	return ref_alloc(bytes, out);
}

static int ref_scratch_free(struct ape_be_queue *q, struct ape_be_buf *buf)
{
	ref_buf_free(q->dev, buf);
	return 0;
}

/* One element of type t (enum ape_be_elem) as a double, and back: exact both ways for every
 * conversion copy_view takes (float64 to float32 rounds once, in the cast). */
static double ref_load(const unsigned char *p, int t)
{
	uint16_t h;
	float f;
	double d;

	switch (t) {
	case APE_BE_E_F16:
		memcpy(&h, p, 2);
		return ape_be_f16_to_f32(h);
	case APE_BE_E_BF16:
		memcpy(&h, p, 2);
		return ape_be_bf16_to_f32(h);
	case APE_BE_E_F64:
		memcpy(&d, p, 8);
		return d;
	default:
		memcpy(&f, p, 4);
		return f;
	}
}

static void ref_store(unsigned char *p, int t, double x)
{
	const float f = (float)x;
	uint16_t h;

	switch (t) {
	case APE_BE_E_F16:
		h = ape_be_f32_to_f16(f);
		memcpy(p, &h, 2);
		break;
	case APE_BE_E_BF16:
		h = ape_be_f32_to_bf16(f);
		memcpy(p, &h, 2);
		break;
	case APE_BE_E_F64:
		memcpy(p, &x, 8);
		break;
	default:
		memcpy(p, &f, 4);
	}
}

static size_t ref_elem_size(int t)
{
	return t == APE_BE_E_F64 ? 8 : t == APE_BE_E_F32 ? 4 : 2;
}

static int ref_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c)
{
	const size_t ds = ref_elem_size(c->dst_type), ss = ref_elem_size(c->src_type);

	(void)q;
	for (int64_t b = 0; b < c->B; b++)
		for (int64_t h = 0; h < c->H; h++)
			for (int64_t i = 0; i < c->L; i++) {
				const int64_t so = c->sv.off + b * c->sv.sb + h * c->sv.sh + i * c->sv.sl;
				const int64_t dof = c->dv.off + b * c->dv.sb + h * c->dv.sh + i * c->dv.sl;

				for (int64_t d = 0; d < c->D; d++) {
					const unsigned char *s = c->src->bytes + (size_t)(so + d) * ss;
					unsigned char *t = c->dst->bytes + (size_t)(dof + d) * ds;

					if (c->src_type == c->dst_type)
						memcpy(t, s, ds); /* a bit copy: NaN payloads too */
					else
						ref_store(t, c->dst_type, ref_load(s, c->src_type));
				}
			}
	return 0;
}

/* A partial result folded into the running one, in float64 (ape/ape_math.h, ape_merge_lse()). */
static int ref_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m)
{
	float *o = (float *)m->o->bytes, *lse = (float *)m->lse->bytes;
	const float *po = (const float *)m->po->bytes, *plse = (const float *)m->plse->bytes;
	float *ent = m->ent ? (float *)m->ent->bytes : NULL, *md = m->md ? (float *)m->md->bytes : NULL;
	const float *pent = m->pent ? (const float *)m->pent->bytes : NULL;
	const float *pmd = m->pmd ? (const float *)m->pmd->bytes : NULL;

	(void)q;
	for (int64_t r = 0; r < m->rows; r++) {
		float *orow = o + r * m->D;
		const float *prow = po + r * m->D;
		double l, w1, w2, lw1, lw2;

		if (m->pairs && m->pairs32)
			((uint32_t *)m->pairs->bytes)[r] +=
				(uint32_t)((const uint64_t *)m->ppairs->bytes)[r];
		else if (m->pairs)
			((uint64_t *)m->pairs->bytes)[r] += ((const uint64_t *)m->ppairs->bytes)[r];
		switch (ape_merge_lse(lse[r], plse[r], &l, &w1, &w2, &lw1, &lw2)) {
		case APE_MERGE_KEEP:
			continue;
		case APE_MERGE_TAKE:
			memcpy(orow, prow, (size_t)m->D * sizeof(float));
			lse[r] = plse[r];
			if (ent) {
				ent[r] = pent[r];
				md[r] = pmd[r];
			}
			continue;
		case APE_MERGE_NAN:
			for (int64_t d = 0; d < m->D; d++)
				orow[d] = NAN;
			lse[r] = NAN;
			if (ent)
				ent[r] = md[r] = NAN;
			continue;
		default:
			break;
		}
		for (int64_t d = 0; d < m->D; d++)
			orow[d] = (float)(w1 * orow[d] + w2 * prow[d]);
		if (ent) {
			ent[r] = (float)ape_merge_entropy(w1, ent[r], lw1, w2, pent[r], lw2);
			md[r] = (float)(w1 * md[r] + w2 * pmd[r]);
		}
		lse[r] = (float)l;
	}
	return 0;
}

static int ref_synchronize(struct ape_be_queue *q)
{
	(void)q;
	return 0;
}

const struct ape_backend_plugin ape__ref_ops = {
	APE_BACKEND_PLUGIN_HEAD("ref"),
	.probe = ref_probe,
	.buf_alloc = ref_buf_alloc,
	.buf_free = ref_buf_free,
	.queue_create = ref_queue_create,
	.queue_destroy = ref_queue_destroy,
	.copy_h2d = ref_copy_h2d,
	.copy_d2h = ref_copy_d2h,
	.fill = ref_fill,
	.event_record = ref_event_record,
	.event_wait = ref_event_wait,
	.event_elapsed = ref_event_elapsed,
	.event_destroy = ref_event_destroy,
	.attention = ref_attention,
	.synchronize = ref_synchronize,
	.copy_d2d = ref_copy_d2d,
	.event_timestamp = ref_event_timestamp,
	.attention_scratch = ref_attention_scratch,
	.attention_backward = ref_attention_backward,
	.buf_wrap = ref_buf_wrap,
	.scratch_alloc = ref_scratch_alloc,
	.scratch_free = ref_scratch_free,
	.copy_view = ref_copy_view,
	.attention_merge = ref_attention_merge,
	/* no queue_wrap: the reference has no native queue; no native: no native objects */
};
