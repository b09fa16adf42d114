/* SPDX-License-Identifier: MIT */
/*
 * Device memory, queues and the forward pass on device tensors (include/ape/ape.h, "Device
 * memory, queues and device-resident tensors"): the public objects over the backend's buffers
 * and queues, the validation of device tensors, and ape_attention_enqueue(), which hands a
 * validated call to the executor's resident path (runtime/exec/resident.c).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/limits.h"
#include "core/verbose.h"
#include "exec/resident.h"
#include "api/stats.h"
#include "api/forward.h"
#include "api/resident.h"
#include "api/validate.h"

/* ------------------------------------------------------------------ buffers */

static int check_dev(const char *fn, const ape_device *dev, const void *out)
{
	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if (!out)
		return ape__error(APE_EINVAL, "%s: out = NULL", fn);
	return 0;
}

static int new_buffer(const char *fn, ape_device *dev, struct ape_be_buf *b, size_t size,
		      bool wrapped, ape_buffer **out)
{
	ape_buffer *buf = ape__calloc(1, sizeof(*buf));

	if (!buf) {
		dev->be->ops->buf_free(dev, b);
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	}
	buf->dev = dev;
	buf->b = b;
	buf->size = size;
	buf->wrapped = wrapped;
	*out = buf;
	return 0;
}

int ape_buffer_alloc(ape_device *dev, size_t bytes, ape_buffer **out)
{
	APE__API_CALL("ape_buffer_alloc");
	static const char fn[] = "ape_buffer_alloc";
	struct ape_be_buf *b;
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if (!bytes)
		return ape__error(APE_EINVAL, "%s: bytes = 0: must be >= 1", fn);
	if ((ret = dev->be->ops->buf_alloc(dev, bytes, &b)))
		return ape__error_prefix(ret, fn);
	return new_buffer(fn, dev, b, bytes, false, out);
}

int ape__buffer_wrap(const char *fn, ape_device *dev, int kind, void *handle, size_t bytes,
		     ape_buffer **out)
{
	static const char *const kinds[] = { "", "host", "OpenCL", "CUDA" };
	struct ape_be_buf *b;
	size_t size;
	int ret;

	*out = NULL;
	if (!dev->be->ops->buf_wrap)
		return ape__error_on(ape__error(APE_ENOTSUP, "%s: the %s backend wraps no %s memory",
						fn, dev->info.backend, kinds[kind]),
				     dev);
	if ((ret = dev->be->ops->buf_wrap(dev, kind, handle, bytes, &b, &size)))
		return ape__error_prefix(ret, fn);
	return new_buffer(fn, dev, b, size, true, out);
}

int ape_buffer_wrap_host(ape_device *dev, void *ptr, size_t bytes, ape_buffer **out)
{
	APE__API_CALL("ape_buffer_wrap_host");
	static const char fn[] = "ape_buffer_wrap_host";
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if (!ptr)
		return ape__error(APE_EINVAL, "%s: ptr = NULL", fn);
	if (!bytes)
		return ape__error(APE_EINVAL, "%s: bytes = 0: must be >= 1", fn);
	return ape__buffer_wrap(fn, dev, APE_BE_MEM_HOST, ptr, bytes, out);
}

int ape_buffer_wrap_opencl(ape_device *dev, void *cl_mem, ape_buffer **out)
{
	APE__API_CALL("ape_buffer_wrap_opencl");
	static const char fn[] = "ape_buffer_wrap_opencl";
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if (!cl_mem)
		return ape__error(APE_EINVAL, "%s: cl_mem = NULL", fn);
	return ape__buffer_wrap(fn, dev, APE_BE_MEM_OPENCL, cl_mem, 0, out);
}

int ape_buffer_wrap_cuda(ape_device *dev, uint64_t dptr, size_t bytes, ape_buffer **out)
{
	APE__API_CALL("ape_buffer_wrap_cuda");
	static const char fn[] = "ape_buffer_wrap_cuda";
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if (!dptr)
		return ape__error(APE_EINVAL, "%s: dptr = 0", fn);
	if (!bytes)
		return ape__error(APE_EINVAL, "%s: bytes = 0: must be >= 1", fn);
	if (dptr > UINTPTR_MAX)
		return ape__error(APE_EINVAL, "%s: dptr = 0x%" PRIx64 ": wider than a pointer", fn,
				  dptr);
	return ape__buffer_wrap(fn, dev, APE_BE_MEM_CUDA, (void *)(uintptr_t)dptr, bytes, out);
}

void ape_buffer_free(ape_buffer *buf)
{
	if (!buf)
		return;
	buf->dev->be->ops->buf_free(buf->dev, buf->b);
	free(buf);
}

size_t ape_buffer_size(const ape_buffer *buf)
{
	return buf ? buf->size : 0;
}

ape_device *ape_buffer_device(const ape_buffer *buf)
{
	return buf ? buf->dev : NULL;
}

/* A byte range [offset, offset + bytes) of buf, for a copy enqueued on queue. */
static int check_copy(const char *fn, const ape_queue *queue, const ape_buffer *buf,
		      const char *bufname, size_t offset, const void *host, const char *hostname,
		      size_t bytes)
{
	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	if (!buf)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, bufname);
	if (!host)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, hostname);
	if (buf->dev != queue->dev)
		return ape__error(APE_EINVAL, "%s: %s is a buffer of %s:%d, the queue of %s:%d", fn,
				  bufname, buf->dev->info.backend, buf->dev->info.backend_index,
				  queue->dev->info.backend, queue->dev->info.backend_index);
	if (offset > buf->size || bytes > buf->size - offset)
		return ape__error(APE_EINVAL,
				  "%s: offset = %zu, bytes = %zu: beyond the %zu bytes of %s", fn,
				  offset, bytes, buf->size, bufname);
	return 0;
}

void ape__queue_note_call(ape_queue *queue, const char *fn)
{
	queue->calls++;
	snprintf(queue->last_call, sizeof(queue->last_call), "%s #%" PRIu64, fn, queue->calls);
}

int ape_buffer_write(ape_queue *queue, ape_buffer *dst, size_t offset, const void *src,
		     size_t bytes)
{
	APE__API_CALL("ape_buffer_write");
	static const char fn[] = "ape_buffer_write";
	int ret = check_copy(fn, queue, dst, "dst", offset, src, "src", bytes);

	if (ret || !bytes)
		return ret;
	ape__queue_note_call(queue, fn);
	ret = queue->dev->be->ops->copy_h2d(queue->q, dst->b, offset, src, bytes);
	return ret ? ape__error_prefix(ret, fn) : 0;
}

int ape_buffer_read(ape_queue *queue, void *dst, ape_buffer *src, size_t offset, size_t bytes)
{
	APE__API_CALL("ape_buffer_read");
	static const char fn[] = "ape_buffer_read";
	int ret = check_copy(fn, queue, src, "src", offset, dst, "dst", bytes);

	if (ret || !bytes)
		return ret;
	ape__queue_note_call(queue, fn);
	ret = queue->dev->be->ops->copy_d2h(queue->q, dst, src->b, offset, bytes);
	return ret ? ape__error_prefix(ret, fn) : 0;
}

/* ------------------------------------------------------------------ queues */

static int new_queue(const char *fn, ape_device *dev, struct ape_be_queue *q, bool wrapped,
		     ape_queue **out)
{
	ape_queue *queue = ape__calloc(1, sizeof(*queue));

	if (!queue) {
		dev->be->ops->queue_destroy(q);
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	}
	queue->dev = dev;
	queue->q = q;
	queue->wrapped = wrapped;
	*out = queue;
	return 0;
}

int ape_queue_create(ape_device *dev, ape_queue **out)
{
	APE__API_CALL("ape_queue_create");
	static const char fn[] = "ape_queue_create";
	struct ape_be_queue *q;
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if ((ret = dev->be->ops->queue_create(dev, &q)))
		return ape__error_prefix(ret, fn);
	return new_queue(fn, dev, q, false, out);
}

int ape__queue_wrap(const char *fn, ape_device *dev, const char *api, void *handle,
		    ape_queue **out)
{
	struct ape_be_queue *q;
	int ret;

	*out = NULL;
	if (!dev->be->ops->queue_wrap || strcmp(dev->info.backend, api))
		return ape__error_on(ape__error(APE_ENOTSUP, "%s: not a%s %s device", fn,
						api[0] == 'o' ? "n" : "",
						api[0] == 'o' ? "OpenCL" : "CUDA"),
				     dev);
	if ((ret = dev->be->ops->queue_wrap(dev, handle, &q)))
		return ape__error_prefix(ret, fn);
	return new_queue(fn, dev, q, true, out);
}

int ape_queue_wrap_opencl(ape_device *dev, void *cl_command_queue, ape_queue **out)
{
	APE__API_CALL("ape_queue_wrap_opencl");
	static const char fn[] = "ape_queue_wrap_opencl";
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	*out = NULL;
	if (!cl_command_queue)
		return ape__error(APE_EINVAL, "%s: cl_command_queue = NULL", fn);
	return ape__queue_wrap(fn, dev, "opencl", cl_command_queue, out);
}

int ape_queue_wrap_cuda(ape_device *dev, void *cu_stream, ape_queue **out)
{
	APE__API_CALL("ape_queue_wrap_cuda");
	static const char fn[] = "ape_queue_wrap_cuda";
	int ret = check_dev(fn, dev, out);

	if (ret)
		return ret;
	return ape__queue_wrap(fn, dev, "cuda", cu_stream, out);
}

void ape_queue_destroy(ape_queue *queue)
{
	if (!queue)
		return;
	queue->dev->be->ops->queue_destroy(queue->q);
	free(queue);
}

int ape_queue_synchronize(ape_queue *queue)
{
	APE__API_CALL("ape_queue_synchronize");
	static const char fn[] = "ape_queue_synchronize";
	int ret;

	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	ret = queue->dev->be->ops->synchronize(queue->q);
	if (ret && queue->last_call[0]) {
		char what[160];

		snprintf(what, sizeof(what), "%s (work enqueued up to %s)", fn, queue->last_call);
		return ape__error_prefix(ret, what);
	}
	return ret ? ape__error_prefix(ret, fn) : 0;
}

ape_device *ape_queue_device(const ape_queue *queue)
{
	return queue ? queue->dev : NULL;
}

int ape_device_native(const ape_device *dev, void **context, void **device)
{
	APE__API_CALL("ape_device_native");
	void *c = NULL, *d = NULL;

	if (!dev)
		return ape__error(APE_EINVAL, "ape_device_native: dev = NULL");
	if (dev->be->ops->native)
		dev->be->ops->native((struct ape_device *)dev, &c, &d);
	if (context)
		*context = c;
	if (device)
		*device = d;
	return 0;
}

/* ------------------------------------------------------------------ device tensors */

void ape_dtensor_init(ape_dtensor *t, ape_buffer *buf, uint64_t byte_offset, ape_dtype dtype,
		      int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
	if (!t)
		return;
	memset(t, 0, sizeof(*t));
	t->buf = buf;
	t->byte_offset = byte_offset;
	t->dtype = dtype;
	t->shape[0] = d0;
	t->shape[1] = d1;
	t->shape[2] = d2;
	t->shape[3] = d3;
}

/* Synthetic addresses: each buffer of a call gets 2^44 bytes of its own, so that the host
 * validation's overlap rules apply within a buffer and never across two. */
#define SLOT_SHIFT 44

int ape__dtensor_host(const char *fn, const char *name, const ape_dtensor *t,
		      const ape_device *dev, const ape_buffer *const *bufs, ape_tensor *host)
{
	const size_t esz = ape_dtype_size(t->dtype);
	bool contiguous = true;
	int slot = 0;

	if (!t->buf)
		return ape__error(APE_EINVAL, "%s: %s->buf = NULL", fn, name);
	if (t->buf->dev != dev)
		return ape__error(APE_EINVAL, "%s: %s->buf is a buffer of %s:%d, the queue of %s:%d",
				  fn, name, t->buf->dev->info.backend,
				  t->buf->dev->info.backend_index, dev->info.backend,
				  dev->info.backend_index);
	if (!esz)
		return ape__error(APE_EINVAL, "%s: %s->dtype = %d: not a libape storage type", fn,
				  name, (int)t->dtype);
	if (t->byte_offset % esz)
		return ape__error(APE_EINVAL,
				  "%s: %s->byte_offset = %" PRIu64
				  ": not a multiple of the %zu-byte %s element",
				  fn, name, t->byte_offset, esz, ape_dtype_name(t->dtype));
	if (t->byte_offset > t->buf->size)
		return ape__error(APE_EINVAL,
				  "%s: %s->byte_offset = %" PRIu64 ": beyond the buffer's %zu bytes",
				  fn, name, t->byte_offset, t->buf->size);
	if (t->buf->size >= (size_t)1 << (SLOT_SHIFT - 1))
		return ape__error(APE_EOVERFLOW, "%s: %s->buf: %zu bytes: larger than libape handles",
				  fn, name, t->buf->size);
	for (int d = 0; d < 4; d++)
		contiguous &= t->strides[d] == 0;
	if (!contiguous && t->strides[3] != 1 && t->shape[3] > 1)
		return ape__error(APE_EINVAL,
				  "%s: %s->strides[3] = %" PRId64 ": the D axis must be contiguous (1)",
				  fn, name, t->strides[3]);
	while (bufs[slot] != t->buf) /* the first tensor of the call in this buffer */
		slot++;
	host->data = (void *)(((uintptr_t)(slot + 1) << SLOT_SHIFT) + (uintptr_t)t->byte_offset);
	host->dtype = t->dtype;
	memcpy(host->shape, t->shape, sizeof(host->shape));
	memcpy(host->strides, t->strides, sizeof(host->strides));
	return 0;
}

int ape__dtensor_view(const char *fn, const char *name, const ape_dtensor *t, const int64_t s[4],
		      struct ape_be_view *v)
{
	const size_t esz = ape_dtype_size(t->dtype);
	uint64_t last = 0; /* element offset of the last element, from element 0 */

	v->off = (int64_t)(t->byte_offset / esz);
	v->sb = s[0];
	v->sh = s[1];
	v->sl = s[2];
	for (int d = 0; d < 4; d++) {
		if (!t->shape[d])
			return 0; /* empty: addresses nothing */
		last += (uint64_t)(t->shape[d] - 1) * (uint64_t)s[d]; /* bounded: checked span */
	}
	if ((last + 1) * esz > t->buf->size - t->byte_offset)
		return ape__error(APE_EINVAL,
				  "%s: %s: offset %" PRIu64 " + %" PRIu64
				  " bytes addressed by its shape and strides: beyond the buffer's "
				  "%zu bytes",
				  fn, name, t->byte_offset, (last + 1) * esz, t->buf->size);
	return 0;
}

int ape__check_dtensor(const char *fn, const char *name, const ape_dtensor *t,
		       const ape_device *dev, ape_dtype dtype, const int64_t want[4],
		       const char *const dims[4], struct ape_be_view *v)
{
	const ape_buffer *bufs[APE_BE_T_COUNT] = { 0 };
	ape_tensor host;
	int64_t s[4];
	int ret;

	if (!t)
		return ape__error(APE_EINVAL, "%s: %s = NULL", fn, name);
	bufs[0] = t->buf;
	if ((ret = ape__dtensor_host(fn, name, t, dev, bufs, &host)) ||
	    (ret = ape__check_tensor(fn, name, &host, dtype, want, dims, s)))
		return ret;
	return ape__dtensor_view(fn, name, t, s, v);
}

/*
 * An output of one float per row ([B, H, Lq, 1] float32: lse, entropy, mean_distance; t, and h
 * its synthetic host tensor from ape__dtensor_host()) of a call whose tensors host[0..n), named
 * names[], are validated: its dtype, shape and strides, no two rows at one address, inside its
 * buffer (its element view in *v), and no byte shared with any of them.
 */
static int check_row_output(const char *fn, const char *name, const ape_dtensor *t,
			    const ape_tensor *h, const struct ape__problem *p,
			    const char *const names[], const ape_tensor *host, int n,
			    struct ape_be_view *v)
{
	static const char *const ldims[4] = { "B", "H", "Lq", "1" };
	static const int64_t any[4] = { -1, -1, -1, -1 };
	const int64_t want[4] = { p->B, p->H, p->Lq, 1 };
	uintptr_t rl[2];
	int64_t ls[4];
	int ret;

	if ((ret = ape__check_tensor_span(fn, name, h, APE_F32, false, want, ldims, true, ls,
					  rl)) ||
	    (ret = ape__dtensor_view(fn, name, t, ls, v)))
		return ret;
	for (int i = 0; i < n; i++) {
		int64_t s2[4];
		uintptr_t r[2];

		if ((ret = ape__check_tensor_span(fn, names[i], &host[i], host[i].dtype, true, any,
						  ldims, false, s2, r)) ||
		    (ret = ape__check_disjoint(fn, name, rl, names[i], r)))
			return ret;
	}
	return 0;
}

int ape__check_resident(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			const ape_dtensor *o, const ape_dtensor *lse, struct ape__problem *p,
			struct ape_be_buf *buf[APE_BE_T_COUNT], struct ape_be_view view[APE_BE_T_COUNT])
{
	static const char *const names[APE_BE_T_COUNT] = { "q", "k", "v", "o", "lse" };
	const ape_dtensor *t[APE_BE_T_COUNT] = { q, k, v, o, lse };
	const ape_buffer *bufs[APE_BE_T_COUNT];
	ape_tensor host[APE_BE_T_COUNT];
	int ret;

	memset(p, 0, sizeof(*p));
	for (int i = 0; i < APE_BE_T_COUNT; i++) {
		if (!t[i] && i != APE_BE_T_LSE)
			return ape__error(APE_EINVAL, "%s: %s = NULL", fn, names[i]);
		bufs[i] = t[i] ? t[i]->buf : NULL;
	}
	for (int i = 0; i < APE_BE_T_COUNT; i++)
		if (t[i] && (ret = ape__dtensor_host(fn, names[i], t[i], dev, bufs, &host[i])))
			return ret;
	if ((ret = ape__problem_init(p, fn, desc, &host[APE_BE_T_Q], &host[APE_BE_T_K],
				     &host[APE_BE_T_V], &host[APE_BE_T_O], NULL)))
		return ret;
	if ((ret = ape__dtensor_view(fn, "q", q, p->qs, &view[APE_BE_T_Q])) ||
	    (ret = ape__dtensor_view(fn, "k", k, p->ks, &view[APE_BE_T_K])) ||
	    (ret = ape__dtensor_view(fn, "v", v, p->vs, &view[APE_BE_T_V])) ||
	    (ret = ape__dtensor_view(fn, "o", o, p->os, &view[APE_BE_T_O])))
		goto fail;
	memset(&view[APE_BE_T_LSE], 0, sizeof(view[APE_BE_T_LSE]));
	if (lse && (ret = check_row_output(fn, "lse", lse, &host[APE_BE_T_LSE], p, names, host,
					   APE_BE_T_LSE, &view[APE_BE_T_LSE])))
		goto fail;
	for (int i = 0; i < APE_BE_T_COUNT; i++)
		buf[i] = t[i] ? t[i]->buf->b : NULL;
	return 0;
fail:
	ape__problem_fini(p);
	return ret;
}

/* Rows with no key at all (Lk = 0) on a device without copy_view: O = 0 and LSE = -inf, row by
 * row, from constant memory (the copies are asynchronous: their sources must outlive the
 * call). */
static int write_empty_rows(ape_queue *queue, const struct ape__problem *p,
			    struct ape_be_buf *const buf[APE_BE_T_COUNT],
			    const struct ape_be_view view[APE_BE_T_COUNT])
{
	static const float zeros[APE_MAX_D];
	static const float neg_inf = -INFINITY;
	const struct ape_backend_plugin *ops = queue->dev->be->ops;
	const size_t osz = ape_dtype_size(p->out_dtype);

	for (int64_t b = 0; b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < p->Lq; i++) {
				const struct ape_be_view *o = &view[APE_BE_T_O], *l = &view[APE_BE_T_LSE];
				const int64_t oe = o->off + b * o->sb + h * o->sh + i * o->sl;
				int ret = ops->copy_h2d(queue->q, buf[APE_BE_T_O], (size_t)oe * osz,
							zeros, (size_t)p->D * osz);

				if (!ret && buf[APE_BE_T_LSE])
					ret = ops->copy_h2d(queue->q, buf[APE_BE_T_LSE],
							    (size_t)(l->off + b * l->sb + h * l->sh +
								     i * l->sl) * 4,
							    &neg_inf, 4);
				if (ret)
					return ret;
			}
	return 0;
}

int ape_attention_enqueue(ape_queue *queue, const ape_attn_desc *desc, const ape_dtensor *q,
			  const ape_dtensor *k, const ape_dtensor *v, const ape_dtensor *o,
			  const ape_dtensor *lse)
{
	APE__API_CALL("ape_attention_enqueue");
	return ape__attention_enqueue("ape_attention_enqueue", queue, desc, q, k, v, o, lse);
}

int ape__attention_enqueue(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
			   const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			   const ape_dtensor *o, const ape_dtensor *lse)
{
	return ape__attention_enqueue_diag(fn, queue, desc, q, k, v, o, lse, NULL, NULL);
}

/* ------------------------------------------------------------------ diagnostics, device tensors */

int ape__check_resident_diag(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			     const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
			     const ape_dtensor *o, const ape_dtensor *lse, const ape_dtensor *ent,
			     const ape_dtensor *md, struct ape__problem *p,
			     struct ape_be_buf *buf[APE_BE_T_COUNT], struct ape_be_view view[APE_BE_T_COUNT],
			     struct ape_be_buf *dbuf[2], struct ape_be_view dview[2])
{
	enum { N = APE_BE_T_COUNT + 2 };
	static const char *const names[N] = { "q",   "k",       "v",	   "o",
					       "lse", "entropy", "mean_distance" };
	const ape_dtensor *t[N] = { q, k, v, o, lse, ent, md };
	const ape_buffer *bufs[N];
	const char *on[N];
	ape_tensor host[N], others[N];
	int n = 0, ret;

	memset(dview, 0, 2 * sizeof(*dview));
	dbuf[0] = dbuf[1] = NULL;
	if ((ret = ape__check_resident(fn, dev, desc, q, k, v, o, lse, p, buf, view)))
		return ret;
	for (int i = 0; i < N; i++)
		bufs[i] = t[i] ? t[i]->buf : NULL;
	/* every tensor's synthetic address again, now with the diagnostics' buffers among the
	 * slots (those of q .. lse do not move: a buffer's slot is its first tensor's) */
	for (int i = 0; i < N; i++) {
		if (!t[i])
			continue;
		if ((ret = ape__dtensor_host(fn, names[i], t[i], dev, bufs, &host[i])))
			goto fail;
		if (i >= APE_BE_T_COUNT &&
		    (ret = check_row_output(fn, names[i], t[i], &host[i], p, on, others, n,
					    &dview[i - APE_BE_T_COUNT])))
			goto fail;
		on[n] = names[i];
		others[n++] = host[i];
	}
	for (int d = 0; d < 2; d++)
		dbuf[d] = t[APE_BE_T_COUNT + d] ? t[APE_BE_T_COUNT + d]->buf->b : NULL;
	return 0;
fail:
	ape__problem_fini(p);
	return ret;
}

/* ENT = MD = 0 in every row of an output of the diagnostics ([B,H,Lq] float at v), for a call
 * without keys (Lk = 0), row by row likewise. */
static int zero_rows(ape_queue *queue, const struct ape__problem *p, struct ape_be_buf *b,
		     const struct ape_be_view *v)
{
	int ret = 0;

	for (int64_t bb = 0; bb < p->B && !ret; bb++)
		for (int64_t h = 0; h < p->H && !ret; h++)
			for (int64_t i = 0; i < p->Lq && !ret; i++)
				ret = queue->dev->be->ops->fill(
					queue->q, b,
					(size_t)(v->off + bb * v->sb + h * v->sh + i * v->sl) * 4, 0,
					4);
	return ret;
}

/*
 * The values of an empty call, in a scratch of the queue's: EMPTY_ZEROS floats 0 (as many as
 * a row of O holds at most: D <= APE_MAX_D, api/validate.c), then -inf. copy_view reads it with
 * strides 0, so that each output takes one strided command whatever its rows.
 */
enum { EMPTY_ZEROS = APE_MAX_D, EMPTY_NEG_INF = EMPTY_ZEROS, EMPTY_FLOATS = EMPTY_ZEROS + 1 };

/* Every [B, H, Lq, d] element of dst where v says (d = D for O, 1 for the rows' outputs), from
 * element `from` of the values (struct ape_be_copy). */
static int copy_value(ape_queue *queue, const struct ape__problem *p, struct ape_be_buf *values,
		      int64_t from, struct ape_be_buf *dst, int dst_type, const struct ape_be_view *v,
		      int64_t d)
{
	const struct ape_be_copy c = {
		.B = p->B, .H = p->H, .L = p->Lq, .D = d,
		.dst = dst, .dst_type = dst_type, .dv = *v,
		.src = values, .src_type = APE_BE_E_F32, .sv = { from, 0, 0, 0 },
		.head_D = p->D,
	};

	return queue->dev->be->ops->copy_view(queue->q, &c);
}

/* The outputs of a call without keys (api/resident.h); the one-command path is taken where the
 * capability resident_backward says the device has queue-ordered scratch and copy_view. */
int ape__resident_write_empty(ape_queue *queue, const struct ape__problem *p,
			      const struct ape__resident_req *r)
{
	const struct ape_backend_plugin *ops = queue->dev->be->ops;
	const float neg_inf = -INFINITY;
	struct ape_be_buf *values = NULL;
	uint32_t bits;
	int ret = 0;

	if (!ape_be_caps_have(&queue->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD)) {
		ret = write_empty_rows(queue, p, r->buf, r->view);
		for (int d = 0; d < 2 && !ret; d++)
			if (r->diag[d])
				ret = zero_rows(queue, p, r->diag[d], &r->diag_view[d]);
		return ret;
	}
	memcpy(&bits, &neg_inf, sizeof(bits));
	ret = ops->scratch_alloc(queue->q, EMPTY_FLOATS * sizeof(float), &values);
	if (!ret)
		ret = ops->fill(queue->q, values, 0, 0, EMPTY_ZEROS * sizeof(float));
	if (!ret)
		ret = ops->fill(queue->q, values, EMPTY_NEG_INF * sizeof(float), bits, sizeof(float));
	if (!ret)
		ret = copy_value(queue, p, values, 0, r->buf[APE_BE_T_O], (int)p->out_dtype,
				 &r->view[APE_BE_T_O], p->D);
	if (!ret && r->buf[APE_BE_T_LSE])
		ret = copy_value(queue, p, values, EMPTY_NEG_INF, r->buf[APE_BE_T_LSE], APE_BE_E_F32,
				 &r->view[APE_BE_T_LSE], 1);
	for (int d = 0; d < 2 && !ret; d++)
		if (r->diag[d])
			ret = copy_value(queue, p, values, 0, r->diag[d], APE_BE_E_F32,
					 &r->diag_view[d], 1);
	if (values) {
		const int fret = ops->scratch_free(queue->q, values);

		ret = ret ? ret : fret;
	}
	return ret;
}

int ape_attention_enqueue_diag(ape_queue *queue, const ape_attn_desc *desc, const ape_dtensor *q,
			       const ape_dtensor *k, const ape_dtensor *v, const ape_dtensor *o,
			       const ape_dtensor *lse, const ape_dtensor *entropy,
			       const ape_dtensor *mean_distance)
{
	APE__API_CALL("ape_attention_enqueue_diag");
	return ape__attention_enqueue_diag("ape_attention_enqueue_diag", queue, desc, q, k, v, o,
					   lse, entropy, mean_distance);
}

int ape__attention_enqueue_diag(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
				const ape_dtensor *o, const ape_dtensor *lse,
				const ape_dtensor *ent, const ape_dtensor *md)
{
	const double t0 = ape__now_ms();
	struct ape__resident_req r;
	struct ape_be_path_log paths = { { 0 }, { 0 } };
	struct ape__problem p;
	int64_t rows;
	int ret;

	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	memset(&r, 0, sizeof(r));
	if ((ret = ape__check_resident_diag(fn, queue->dev, desc, q, k, v, o, lse, ent, md, &p,
					    r.buf, r.view, r.diag, r.diag_view)))
		return ret;
	/* the diagnostics' device check and skip tolerance (docs/diagnostics.md), before any work */
	if ((ent || md) && (ret = ape__diag_devices(fn, &queue->dev, 1, true, &p))) {
		ape__problem_fini(&p);
		return ret;
	}
	r.fn = fn;
	r.dev = queue->dev;
	r.q = queue->q;
	r.p = &p;
	r.paths = &paths;
	if (p.B * p.H * p.Lq == 0) {
		ape__problem_fini(&p);
		return 0;
	}
	ape__queue_note_call(queue, fn);
	if (p.Lk == 0)
		ret = ape__resident_write_empty(queue, &p, &r);
	else if (!(ret = ape__resident_plan(&r, &rows)))
		ret = ape__resident_enqueue(&r, rows);
	ret = ret ? ape__error_prefix(ret, fn) : 0;
	ape__call_log_async(fn, queue->dev, &p, ret, &paths, t0);
	ape__problem_fini(&p);
	return ret;
}
