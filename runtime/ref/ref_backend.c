/* SPDX-License-Identifier: MIT */
/*
 * The reference backend: "device" memory is host memory and a queue runs each command when it is
 * enqueued, on the calling thread. It exists so the core's path (pack, copy, launch, copy back) is
 * the same for every backend, and so that every test has an oracle. Only buf_alloc, buf_wrap,
 * queue_create and event_record can fail (host memory); the other ops cannot. Since its memory
 * is host memory, it wraps the caller's host arrays as they are (buf_wrap, APE__MEM_HOST).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "ref.h"

/* The last choice of "auto": the host without a driver (ranks: core/backend.h). */
#define REF_RANK 0

struct ape__buf {
	size_t size;
	unsigned char *bytes; /* mem, or the caller's memory when wrapped */
	bool wrapped;
	max_align_t mem[]; /* the allocation itself (not wrapped): aligned for every type */
};

struct ape__queue {
	struct ape_device *dev;
};

struct ape__event {
	double ms; /* CLOCK_MONOTONIC at record time; commands before it have completed */
};

static int ref_probe(struct ape__backend *be, struct ape__probe_result *res)
{
	struct ape_device_info info;

	(void)res;
	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "reference (plain C, float64)");
	snprintf(info.vendor, sizeof(info.vendor), "libape");
	snprintf(info.driver_version, sizeof(info.driver_version), "%s", ape_version_string());
	info.kind = APE_DEVICE_HOST_REFERENCE;
	info.compute_units = 1;
	return ape__device_add(be, &info, REF_RANK, NULL);
}

static int ref_buf_alloc(struct ape_device *dev, size_t bytes, struct ape__buf **out)
{
	struct ape__buf *b;

	*out = NULL;
	if (bytes > SIZE_MAX - sizeof(*b) - 64) {
		ape__error(APE_ENOMEM, "%zu bytes is more than memory can hold", bytes);
		return ape__op_error(APE_ENOMEM, dev, "buf_alloc");
	}
	b = ape__malloc(sizeof(*b) + bytes);
	if (!b) {
		ape__error(APE_ENOMEM, "out of host memory allocating %zu bytes", bytes);
		return ape__op_error(APE_ENOMEM, dev, "buf_alloc");
	}
	b->size = bytes;
	b->bytes = (unsigned char *)b->mem;
	b->wrapped = false;
	*out = b;
	return 0;
}

/* Host memory is this device's memory: wrapping it costs one small allocation. */
static int ref_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
			struct ape__buf **out, size_t *bytes_out)
{
	struct ape__buf *b;

	*out = NULL;
	*bytes_out = 0;
	if (kind != APE__MEM_HOST)
		return ape__op_error(ape__error(APE_ENOTSUP,
						"the reference computes on host memory only, not "
						"on %s memory",
						kind == APE__MEM_OPENCL ? "OpenCL" : "CUDA"),
				     dev, "buf_wrap");
	b = ape__malloc(sizeof(*b));
	if (!b)
		return ape__op_error(ape__error(APE_ENOMEM, "out of host memory"), dev, "buf_wrap");
	b->size = bytes;
	b->bytes = handle;
	b->wrapped = true;
	*out = b;
	*bytes_out = bytes;
	return 0;
}

static void ref_buf_free(struct ape_device *dev, struct ape__buf *buf)
{
	(void)dev;
	free(buf);
}

static int ref_queue_create(struct ape_device *dev, struct ape__queue **out)
{
	struct ape__queue *q = ape__calloc(1, sizeof(*q));

	*out = NULL;
	if (!q)
		return ape__op_error(ape__error(APE_ENOMEM, "out of host memory"), dev,
				     "queue_create");
	q->dev = dev;
	*out = q;
	return 0;
}

static void ref_queue_destroy(struct ape__queue *q)
{
	free(q);
}

static int ref_copy_h2d(struct ape__queue *q, struct ape__buf *dst, size_t off, const void *src,
			size_t n)
{
	(void)q;
	memcpy(dst->bytes + off, src, n);
	return 0;
}

static int ref_copy_d2h(struct ape__queue *q, void *dst, struct ape__buf *src, size_t off, size_t n)
{
	(void)q;
	memcpy(dst, src->bytes + off, n);
	return 0;
}

static int ref_copy_d2d(struct ape__queue *q, struct ape__buf *dst, size_t dst_off,
			struct ape__buf *src, size_t src_off, size_t n)
{
	(void)q;
	memmove(dst->bytes + dst_off, src->bytes + src_off, n);
	return 0;
}

static int ref_fill(struct ape__queue *q, struct ape__buf *dst, size_t off, uint32_t pattern,
		    size_t n)
{
	(void)q;
	for (size_t i = 0; i < n; i += 4)
		memcpy(dst->bytes + off + i, &pattern, 4);
	return 0;
}

static int ref_event_record(struct ape__queue *q, struct ape__event **out)
{
	struct ape__event *e = ape__malloc(sizeof(*e));

	*out = NULL;
	if (!e)
		return ape__op_error(ape__error(APE_ENOMEM, "out of host memory"), q->dev,
				     "event_record");
	e->ms = ape__now_ms();
	*out = e;
	return 0;
}

static int ref_event_wait(struct ape__queue *q, struct ape__event *e)
{
	(void)q;
	(void)e; /* commands complete when enqueued: nothing can be pending */
	return 0;
}

static int ref_event_elapsed(struct ape__event *start, struct ape__event *end, double *ms)
{
	*ms = end->ms - start->ms;
	return 0;
}

/* Commands run when enqueued, so the record time is when everything before it completed. */
static int ref_event_timestamp(struct ape__event *e, double *ms)
{
	*ms = e->ms;
	return 0;
}

/* The reference computes straight from the launch's buffers. */
static uint64_t ref_attention_scratch(struct ape_device *dev, const struct ape__launch *l)
{
	(void)dev;
	(void)l;
	return 0;
}

static void ref_event_destroy(struct ape__event *e)
{
	free(e);
}

static int ref_attention(struct ape__queue *q, const struct ape__launch *l)
{
	(void)q;
	ape__ref_rows(l, l->q->bytes, l->k->bytes, l->v->bytes, l->o->bytes,
		      l->lse ? (float *)l->lse->bytes : NULL,
		      l->pairs ? (uint64_t *)l->pairs->bytes : NULL,
		      l->ent ? (float *)l->ent->bytes : NULL, l->md ? (float *)l->md->bytes : NULL, 0,
		      l->B * l->H * l->Lq);
	return 0;
}

static void *bytes_of(struct ape__buf *b)
{
	return b ? b->bytes : NULL;
}

static int ref_attention_backward(struct ape__queue *q, const struct ape__bwd_launch *l)
{
	const struct ape__ref_bwd_io io = {
		.q = bytes_of(l->f.q), .k = bytes_of(l->f.k), .v = bytes_of(l->f.v),
		.o = bytes_of(l->f.o), .dout = bytes_of(l->dout),
		.lse = bytes_of(l->f.lse), .dlse = bytes_of(l->dlse),
		.dq = bytes_of(l->dq), .dk = bytes_of(l->dk),
		.dv = bytes_of(l->dv), .dparams = bytes_of(l->dparams),
	};

	return ape__op_error(ape__ref_backward(l, &io), q->dev, "attention_backward");
}

static int ref_synchronize(struct ape__queue *q)
{
	(void)q;
	return 0;
}

const struct ape__backend_ops ape__ref_ops = {
	.abi_version = APE__BACKEND_ABI,
	.name = "ref",
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
	.attention_diag = true,
	.attention_diag_views = true,
	/* no queue_wrap: the reference has no native queue; no native: no native objects */
};
