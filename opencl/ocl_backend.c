/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's entry in the registry (runtime/api/registry.c): every op, and where it
 * lives. The ops that can fail pass through here, the backend's boundary: whatever failed below
 * (a driver call, a host allocation, the program build), the message names the device and the
 * op (core/backend.h), once, in one place.
 */
#include "core/error.h"
#include "ocl.h"
#include "ocl_fast.h"

static int ocl_buf_alloc(struct ape_device *dev, size_t bytes, struct ape__buf **out)
{
	return ape__op_error(ape__ocl_buf_alloc(dev, bytes, out), dev, "buf_alloc");
}

static int ocl_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
			struct ape__buf **out, size_t *bytes_out)
{
	return ape__op_error(ape__ocl_buf_wrap(dev, kind, handle, bytes, out, bytes_out), dev,
			     "buf_wrap");
}

static int ocl_queue_wrap(struct ape_device *dev, void *handle, struct ape__queue **out)
{
	return ape__op_error(ape__ocl_queue_wrap(dev, handle, out), dev, "queue_wrap");
}

static int ocl_queue_create(struct ape_device *dev, struct ape__queue **out)
{
	return ape__op_error(ape__ocl_queue_create(dev, out), dev, "queue_create");
}

static int ocl_copy_h2d(struct ape__queue *q, struct ape__buf *dst, size_t off, const void *src,
			size_t n)
{
	return ape__op_error(ape__ocl_copy_h2d(q, dst, off, src, n), q->dev, "copy_h2d");
}

static int ocl_copy_d2h(struct ape__queue *q, void *dst, struct ape__buf *src, size_t off,
			size_t n)
{
	return ape__op_error(ape__ocl_copy_d2h(q, dst, src, off, n), q->dev, "copy_d2h");
}

static int ocl_copy_d2d(struct ape__queue *q, struct ape__buf *dst, size_t dst_off,
			struct ape__buf *src, size_t src_off, size_t n)
{
	return ape__op_error(ape__ocl_copy_d2d(q, dst, dst_off, src, src_off, n), q->dev,
			     "copy_d2d");
}

static int ocl_fill(struct ape__queue *q, struct ape__buf *dst, size_t off, uint32_t pattern,
		    size_t n)
{
	return ape__op_error(ape__ocl_fill(q, dst, off, pattern, n), q->dev, "fill");
}

static int ocl_event_record(struct ape__queue *q, struct ape__event **out)
{
	return ape__op_error(ape__ocl_event_record(q, out), q->dev, "event_record");
}

static int ocl_event_wait(struct ape__queue *q, struct ape__event *e)
{
	return ape__op_error(ape__ocl_event_wait(q, e), q->dev, "event_wait");
}

static int ocl_event_elapsed(struct ape__event *start, struct ape__event *end, double *ms)
{
	return ape__op_error(ape__ocl_event_elapsed(start, end, ms), start->dev, "event_elapsed");
}

static int ocl_event_timestamp(struct ape__event *e, double *ms)
{
	return ape__op_error(ape__ocl_event_timestamp(e, ms), e->dev, "event_timestamp");
}

static int ocl_attention(struct ape__queue *q, const struct ape__launch *l)
{
	return ape__op_error(ape__ocl_attention(q, l), q->dev, "attention");
}

static int ocl_attention_backward(struct ape__queue *q, const struct ape__bwd_launch *l)
{
	return ape__op_error(ape__ocl_attention_backward(q, l), q->dev, "attention_backward");
}

static int ocl_synchronize(struct ape__queue *q)
{
	return ape__op_error(ape__ocl_synchronize(q), q->dev, "synchronize");
}

const struct ape__backend_ops ape__opencl_ops = {
	.abi_version = APE__BACKEND_ABI,
	.name = "opencl",
	.probe = ape__ocl_probe, /* ocl_device.c */
	.device_release = ape__ocl_device_release,
	.buf_alloc = ocl_buf_alloc, /* ocl_mem.c */
	.buf_free = ape__ocl_buf_free,
	.queue_create = ocl_queue_create,
	.queue_destroy = ape__ocl_queue_destroy,
	.copy_h2d = ocl_copy_h2d,
	.copy_d2h = ocl_copy_d2h,
	.fill = ocl_fill,
	.event_record = ocl_event_record,
	.event_wait = ocl_event_wait,
	.event_elapsed = ocl_event_elapsed,
	.event_destroy = ape__ocl_event_destroy,
	.attention = ocl_attention, /* ocl_attention.c */
	.synchronize = ocl_synchronize, /* ocl_mem.c */
	.copy_d2d = ocl_copy_d2d,
	.event_timestamp = ocl_event_timestamp,
	.max_alloc = ape__ocl_max_alloc,
	.attention_scratch = ape__ocl_attention_scratch, /* ocl_decode.c */
	.attention_backward = ocl_attention_backward, /* ocl_backward.c */
	.attention_backward_scratch = ape__ocl_attention_backward_scratch,
	.buf_wrap = ocl_buf_wrap, /* ocl_mem.c */
	.queue_wrap = ocl_queue_wrap,
	.native = ape__ocl_native,
	.attention_diag = true, /* ENT and MD behind F_DIAG (kernels/attention.cl) */
	.attention_diag_views = true, /* strided, each optional (ABI 8) */
	.attention_pages = ape__ocl_decode_pages, /* ocl_decode.c */
};
