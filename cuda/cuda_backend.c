/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's entry in the registry (runtime/api/registry.c): every op, and where it
 * lives. The ops that can fail pass through here, the backend's boundary: whatever failed below
 * (a driver call, the context or the modules on first use, a host allocation), the message
 * names the device and the op (core/backend.h), once, in one place.
 */
#include "core/error.h"
#include "cu.h"

static int cuda_buf_alloc(struct ape_device *dev, size_t bytes, struct ape__buf **out)
{
	return ape__op_error(ape__cu_buf_alloc(dev, bytes, out), dev, "buf_alloc");
}

static int cuda_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
			 struct ape__buf **out, size_t *bytes_out)
{
	return ape__op_error(ape__cu_buf_wrap(dev, kind, handle, bytes, out, bytes_out), dev,
			     "buf_wrap");
}

static int cuda_queue_wrap(struct ape_device *dev, void *handle, struct ape__queue **out)
{
	return ape__op_error(ape__cu_queue_wrap(dev, handle, out), dev, "queue_wrap");
}

static int cuda_queue_create(struct ape_device *dev, struct ape__queue **out)
{
	return ape__op_error(ape__cu_queue_create(dev, out), dev, "queue_create");
}

static int cuda_copy_h2d(struct ape__queue *q, struct ape__buf *dst, size_t off, const void *src,
			 size_t n)
{
	return ape__op_error(ape__cu_copy_h2d(q, dst, off, src, n), q->dev, "copy_h2d");
}

static int cuda_copy_d2h(struct ape__queue *q, void *dst, struct ape__buf *src, size_t off,
			 size_t n)
{
	return ape__op_error(ape__cu_copy_d2h(q, dst, src, off, n), q->dev, "copy_d2h");
}

static int cuda_copy_d2d(struct ape__queue *q, struct ape__buf *dst, size_t dst_off,
			 struct ape__buf *src, size_t src_off, size_t n)
{
	return ape__op_error(ape__cu_copy_d2d(q, dst, dst_off, src, src_off, n), q->dev,
			     "copy_d2d");
}

static int cuda_fill(struct ape__queue *q, struct ape__buf *dst, size_t off, uint32_t pattern,
		     size_t n)
{
	return ape__op_error(ape__cu_fill(q, dst, off, pattern, n), q->dev, "fill");
}

static int cuda_event_record(struct ape__queue *q, struct ape__event **out)
{
	return ape__op_error(ape__cu_event_record(q, out), q->dev, "event_record");
}

static int cuda_event_wait(struct ape__queue *q, struct ape__event *e)
{
	return ape__op_error(ape__cu_event_wait(q, e), q->dev, "event_wait");
}

static int cuda_event_elapsed(struct ape__event *start, struct ape__event *end, double *ms)
{
	return ape__op_error(ape__cu_event_elapsed(start, end, ms), start->dev, "event_elapsed");
}

static int cuda_event_timestamp(struct ape__event *e, double *ms)
{
	return ape__op_error(ape__cu_event_timestamp(e, ms), e->dev, "event_timestamp");
}

static int cuda_attention(struct ape__queue *q, const struct ape__launch *l)
{
	return ape__op_error(ape__cu_attention(q, l), q->dev, "attention");
}

static int cuda_attention_backward(struct ape__queue *q, const struct ape__bwd_launch *l)
{
	return ape__op_error(ape__cu_attention_backward(q, l), q->dev, "attention_backward");
}

static int cuda_synchronize(struct ape__queue *q)
{
	return ape__op_error(ape__cu_synchronize(q), q->dev, "synchronize");
}

static int cuda_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle)
{
	return ape__op_error(ape__cu_host_register(dev, ptr, bytes, handle), dev, "host_register");
}

static int cuda_scratch_alloc(struct ape__queue *q, size_t bytes, struct ape__buf **out)
{
	return ape__op_error(ape__cu_scratch_buf_alloc(q, bytes, out), q->dev, "scratch_alloc");
}

static int cuda_scratch_free(struct ape__queue *q, struct ape__buf *buf)
{
	return ape__op_error(ape__cu_scratch_buf_free(q, buf), q->dev, "scratch_free");
}

static int cuda_copy_view(struct ape__queue *q, const struct ape__copy *c)
{
	return ape__op_error(ape__cu_copy_view(q, c), q->dev, "copy_view");
}

const struct ape__backend_ops ape__cuda_ops = {
	.abi_version = APE__BACKEND_ABI,
	.name = "cuda",
	.probe = ape__cu_probe, /* cuda_device.c */
	.teardown = ape__cu_teardown,
	.device_release = ape__cu_device_release,
	.buf_alloc = cuda_buf_alloc, /* cuda_mem.c */
	.buf_free = ape__cu_buf_free,
	.queue_create = cuda_queue_create,
	.queue_destroy = ape__cu_queue_destroy,
	.copy_h2d = cuda_copy_h2d,
	.copy_d2h = cuda_copy_d2h,
	.fill = cuda_fill,
	.event_record = cuda_event_record,
	.event_wait = cuda_event_wait,
	.event_elapsed = cuda_event_elapsed,
	.event_destroy = ape__cu_event_destroy,
	.attention = cuda_attention, /* cuda_attention.c */
	.synchronize = cuda_synchronize, /* cuda_mem.c */
	.host_register = cuda_host_register,
	.host_unregister = ape__cu_host_unregister,
	.copy_d2d = cuda_copy_d2d,
	.event_timestamp = cuda_event_timestamp,
	.attention_scratch = ape__cu_attention_scratch, /* cuda_attention.c */
	.max_alloc = ape__cu_max_alloc, /* cuda_mem.c */
	.attention_backward = cuda_attention_backward, /* cuda_backward.c */
	.attention_backward_scratch = ape__cu_attention_backward_scratch,
	.buf_wrap = cuda_buf_wrap, /* cuda_mem.c */
	.queue_wrap = cuda_queue_wrap,
	.native = ape__cu_native, /* cuda_device.c */
	.scratch_alloc = cuda_scratch_alloc, /* cuda_backward.c */
	.scratch_free = cuda_scratch_free,
	.copy_view = cuda_copy_view,
	.attention_diag = true, /* ENT and MD: the _diag kernels (cuda_attention.c) */
	.attention_diag_views = true, /* ... strided, each optional (ABI 8) */
};
