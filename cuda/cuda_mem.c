/* SPDX-License-Identifier: MIT */
/*
 * Buffers, queues (streams), copies, fills, events and host-memory pinning: each op is one or two
 * driver calls between cu_enter() and cu_leave().
 *
 * Queues are non-blocking streams, so they never wait for the legacy default stream an
 * application may use. Events are created with timing; event_timestamp measures from the
 * device's epoch event, so events of every queue of a device share one clock (float
 * milliseconds, 0.5 us resolution: enough for the traces of one call).
 *
 * The caller's own memory and streams (buf_wrap, queue_wrap): a wrapped buffer is a pointer
 * checked to lie inside one allocation of the device, never freed here; a wrapped queue is the
 * caller's CUstream (NULL: the legacy default stream), never synchronised or destroyed by
 * queue_destroy. Events recorded on a wrapped stream carry no timing (CU_EVENT_DISABLE_TIMING:
 * they only order work, at no cost to the caller's stream), so event_elapsed and
 * event_timestamp answer APE_ENOTSUP for them. Scratch memory of launches on a wrapped stream
 * is freed in stream order (ape__cu_scratch_free()).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cu.h"

#define DRV(dev) (ape__cu_dev(dev)->drv)

int ape__cu_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	struct ape_be_buf *b = ape_be_calloc(1, sizeof(*b));
	CUresult r;
	int ret;

	*out = NULL;
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer");
	ret = ape__cu_enter(dev);
	if (ret) {
		free(b);
		return ret;
	}
	r = DRV(dev)->p_cuMemAlloc(&b->ptr, bytes);
	ape__cu_leave(dev);
	if (r != CUDA_SUCCESS) {
		free(b);
		return ape__cu_error(r, dev, "cuMemAlloc (%zu bytes)", bytes);
	}
	b->size = bytes;
	*out = b;
	return 0;
}

void ape__cu_buf_free(struct ape_device *dev, struct ape_be_buf *buf)
{
	if (!buf)
		return;
	if (!buf->wrapped && !ape__cu_enter(dev)) {
		DRV(dev)->p_cuMemFree(buf->ptr);
		ape__cu_leave(dev);
	}
	free(buf);
}

int ape__cu_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	struct ape_be_queue *q = ape_be_calloc(1, sizeof(*q));
	CUresult r;
	int ret;

	*out = NULL;
	if (!q)
		return ape_be_error(APE_ENOMEM, "out of memory creating a queue");
	ret = ape__cu_enter(dev);
	if (ret) {
		free(q);
		return ret;
	}
	r = DRV(dev)->p_cuStreamCreate(&q->s, CU_STREAM_NON_BLOCKING);
	ape__cu_leave(dev);
	if (r != CUDA_SUCCESS) {
		free(q);
		return ape__cu_error(r, dev, "cuStreamCreate");
	}
	q->dev = dev;
	*out = q;
	return 0;
}

void ape__cu_queue_destroy(struct ape_be_queue *q)
{
	if (!q)
		return;
	/* the caller's stream: its work and ours stay ordered on it (backend.h, queue_wrap) */
	if (!q->wrapped && !ape__cu_enter(q->dev)) {
		/* buffers may be freed right after: nothing may still use them */
		DRV(q->dev)->p_cuStreamSynchronize(q->s);
		DRV(q->dev)->p_cuStreamDestroy(q->s);
		ape__cu_leave(q->dev);
	}
	free(q);
}

/* Leaves the device entered for one driver call and reports its result. */
static int __attribute__((format(printf, 3, 4)))
cu_done(struct ape_device *dev, CUresult r, const char *fmt, ...)
{
	char what[256];
	va_list ap;

	ape__cu_leave(dev);
	if (r == CUDA_SUCCESS)
		return 0;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	return ape__cu_error(r, dev, "%s", what);
}

int ape__cu_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
		     size_t n)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev, DRV(q->dev)->p_cuMemcpyHtoDAsync(dst->ptr + off, src, n, q->s),
		       "cuMemcpyHtoDAsync (%zu bytes)", n);
}

int ape__cu_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev, DRV(q->dev)->p_cuMemcpyDtoHAsync(dst, src->ptr + off, n, q->s),
		       "cuMemcpyDtoHAsync (%zu bytes)", n);
}

int ape__cu_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		     struct ape_be_buf *src, size_t src_off, size_t n)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev,
		       DRV(q->dev)->p_cuMemcpyDtoDAsync(dst->ptr + dst_off, src->ptr + src_off, n,
							q->s),
		       "cuMemcpyDtoDAsync (%zu bytes)", n);
}

int ape__cu_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		 size_t n)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev, DRV(q->dev)->p_cuMemsetD32Async(dst->ptr + off, pattern, n / 4, q->s),
		       "cuMemsetD32Async (%zu bytes)", n);
}

int ape__cu_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	const struct ape__cu_driver *drv = DRV(q->dev);
	struct ape_be_event *e = ape_be_calloc(1, sizeof(*e));
	CUresult r;
	int ret;

	*out = NULL;
	if (!e)
		return ape_be_error(APE_ENOMEM, "out of memory recording an event");
	ret = ape__cu_enter(q->dev);
	if (ret) {
		free(e);
		return ret;
	}
	e->timed = !q->wrapped;
	r = drv->p_cuEventCreate(&e->ev, e->timed ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING);
	if (r == CUDA_SUCCESS) {
		r = drv->p_cuEventRecord(e->ev, q->s);
		if (r != CUDA_SUCCESS)
			drv->p_cuEventDestroy(e->ev);
	}
	ape__cu_leave(q->dev);
	if (r != CUDA_SUCCESS) {
		free(e);
		return ape__cu_error(r, q->dev, "recording an event");
	}
	e->dev = q->dev;
	*out = e;
	return 0;
}

int ape__cu_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev, DRV(q->dev)->p_cuStreamWaitEvent(q->s, e->ev, 0),
		       "cuStreamWaitEvent");
}

static int cu_elapsed(struct ape_device *dev, CUevent a, CUevent b, double *ms)
{
	const struct ape__cu_driver *drv = DRV(dev);
	float f = 0;
	CUresult r;
	int ret = ape__cu_enter(dev);

	*ms = 0;
	if (ret)
		return ret;
	r = drv->p_cuEventSynchronize(b);
	if (r == CUDA_SUCCESS)
		r = drv->p_cuEventElapsedTime(&f, a, b);
	ape__cu_leave(dev);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuEventElapsedTime");
	*ms = f > 0 ? (double)f : 0.0;
	return 0;
}

static int untimed(double *ms)
{
	*ms = 0;
	return ape_be_error(APE_ENOTSUP,
			  "the event was recorded on a wrapped stream: such events carry no timing");
}

int ape__cu_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	if (!start->timed || !end->timed)
		return untimed(ms);
	return cu_elapsed(start->dev, start->ev, end->ev, ms);
}

int ape__cu_event_timestamp(struct ape_be_event *e, double *ms)
{
	if (!e->timed)
		return untimed(ms);
	return cu_elapsed(e->dev, ape__cu_dev(e->dev)->epoch, e->ev, ms);
}

void ape__cu_event_destroy(struct ape_be_event *e)
{
	if (!e)
		return;
	if (!ape__cu_enter(e->dev)) {
		DRV(e->dev)->p_cuEventDestroy(e->ev);
		ape__cu_leave(e->dev);
	}
	free(e);
}

int ape__cu_synchronize(struct ape_be_queue *q)
{
	int ret = ape__cu_enter(q->dev);

	if (ret)
		return ret;
	return cu_done(q->dev, DRV(q->dev)->p_cuStreamSynchronize(q->s), "cuStreamSynchronize");
}

int ape__cu_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle)
{
	const struct ape__cu_driver *drv = DRV(dev);
	CUresult r;
	int ret;

	*handle = NULL;
	if (!drv->pinning)
		return ape_be_error(APE_ENOTSUP, "the driver lacks cuMemHostRegister");
	ret = ape__cu_enter(dev);
	if (ret)
		return ret;
	r = drv->p_cuMemHostRegister(ptr, bytes, CU_MEMHOSTREGISTER_PORTABLE);
	ape__cu_leave(dev);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuMemHostRegister (%zu bytes)", bytes);
	*handle = ptr;
	return 0;
}

void ape__cu_host_unregister(struct ape_device *dev, void *handle)
{
	if (!DRV(dev)->pinning || ape__cu_enter(dev))
		return;
	DRV(dev)->p_cuMemHostUnregister(handle);
	ape__cu_leave(dev);
}

int ape__cu_scratch_alloc(struct ape_be_queue *q, size_t bytes, CUdeviceptr *out)
{
	const struct ape__cu_device *cd = ape__cu_dev(q->dev);
	CUresult r;

	if (cd->mempools)
		r = cd->drv->p_cuMemAllocAsync(out, bytes, q->s);
	else
		r = cd->drv->p_cuMemAlloc(out, bytes);
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, q->dev, "%s (%zu bytes of scratch)",
				     cd->mempools ? "cuMemAllocAsync" : "cuMemAlloc", bytes);
	return 0;
}

int ape__cu_scratch_free(struct ape_be_queue *q, CUdeviceptr p)
{
	const struct ape__cu_device *cd = ape__cu_dev(q->dev);
	CUresult r;

	if (cd->mempools) {
		r = cd->drv->p_cuMemFreeAsync(p, q->s);
	} else {
		/* without memory pools the launch must be over before the memory goes: the host
		 * waits for the stream, on a wrapped one for the caller's earlier work too (the
		 * attention call then returns once the launch has run: correct, not asynchronous) */
		r = cd->drv->p_cuStreamSynchronize(q->s);
		cd->drv->p_cuMemFree(p);
	}
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, q->dev, "freeing scratch");
	return 0;
}

static const char *mem_kind_name(int kind)
{
	return kind == APE_BE_MEM_HOST ? "host" : kind == APE_BE_MEM_OPENCL ? "OpenCL" : "unknown";
}

/* [ptr, ptr + bytes) inside one allocation of dev? 0, or APE_EINVAL / the driver's failure. The
 * device's context is current. */
static int check_range(struct ape_device *dev, CUdeviceptr ptr, size_t bytes)
{
	const struct ape__cu_device *cd = ape__cu_dev(dev);
	const struct ape__cu_driver *drv = cd->drv;
	CUdeviceptr base = 0;
	size_t size = 0;
	CUresult r;

	r = drv->p_cuMemGetAddressRange(&base, &size, ptr);
	if (r == CUDA_ERROR_NOT_FOUND || r == CUDA_ERROR_INVALID_VALUE)
		return ape_be_error(APE_EINVAL,
				  "cuda %s: 0x%llx is not device memory of any allocation (%s)",
				  dev->info.name, (unsigned long long)ptr,
				  ape__cu_err_name(drv, r, (char[48]){ 0 }, 48));
	if (r != CUDA_SUCCESS)
		return ape__cu_error(r, dev, "cuMemGetAddressRange (0x%llx)", (unsigned long long)ptr);
	if (bytes > size - (size_t)(ptr - base))
		return ape_be_error(APE_EINVAL,
				  "cuda %s: [0x%llx, 0x%llx) (%zu bytes) runs past its allocation "
				  "[0x%llx, 0x%llx) (%zu bytes)",
				  dev->info.name, (unsigned long long)ptr,
				  (unsigned long long)(ptr + bytes), bytes, (unsigned long long)base,
				  (unsigned long long)(base + size), size);
	if (drv->p_cuPointerGetAttribute) {
		int ordinal = -1;

		r = drv->p_cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
		if (r == CUDA_SUCCESS && ordinal != cd->ordinal)
			return ape_be_error(APE_EINVAL,
					  "cuda %s: 0x%llx is memory of CUDA device %d, not of "
					  "device %d",
					  dev->info.name, (unsigned long long)ptr, ordinal, cd->ordinal);
	}
	return 0;
}

int ape__cu_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
		     struct ape_be_buf **out, size_t *bytes_out)
{
	const CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)handle;
	struct ape_be_buf *b;
	int ret;

	*out = NULL;
	if (bytes_out)
		*bytes_out = 0;
	if (kind != APE_BE_MEM_CUDA)
		return ape_be_error(APE_ENOTSUP,
				  "cuda %s: cannot wrap %s memory (kind %d): CUDA devices wrap "
				  "CUDA device pointers only",
				  dev->info.name, mem_kind_name(kind), kind);
	if (!ptr || !bytes)
		return ape_be_error(APE_EINVAL, "cuda %s: wrapping %zu bytes at 0x%llx: %s",
				  dev->info.name, bytes, (unsigned long long)ptr,
				  ptr ? "no bytes" : "a NULL device pointer");
	if (!ape__cu_dev(dev)->drv->p_cuMemGetAddressRange)
		return ape_be_error(APE_ENOTSUP,
				  "cuda %s: the driver lacks cuMemGetAddressRange: device pointers "
				  "cannot be checked, so none is wrapped",
				  dev->info.name);
	b = ape_be_calloc(1, sizeof(*b));
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer");
	ret = ape__cu_enter(dev);
	if (!ret) {
		ret = check_range(dev, ptr, bytes);
		ape__cu_leave(dev);
	}
	if (ret) {
		free(b);
		return ret;
	}
	b->ptr = ptr;
	b->size = bytes;
	b->wrapped = true;
	*out = b;
	if (bytes_out)
		*bytes_out = bytes;
	return 0;
}

int ape__cu_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out)
{
	const struct ape__cu_device *cd = ape__cu_dev(dev);
	struct ape_be_queue *q;
	CUcontext sctx = NULL;
	CUresult r = CUDA_SUCCESS;
	int ret;

	*out = NULL;
	ret = ape__cu_enter(dev);
	if (ret)
		return ret;
	/* the legacy default stream belongs to whichever context is current: ours */
	if (handle && cd->drv->p_cuStreamGetCtx)
		r = cd->drv->p_cuStreamGetCtx((CUstream)handle, &sctx);
	ape__cu_leave(dev);
	if (r != CUDA_SUCCESS)
		return r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_VALUE ||
				       r == CUDA_ERROR_INVALID_CONTEXT
			       ? ape_be_error(APE_EINVAL, "cuda %s: stream %p is not a valid CUstream (%s)",
					    dev->info.name, handle,
					    ape__cu_err_name(cd->drv, r, (char[48]){ 0 }, 48))
			       : ape__cu_error(r, dev, "cuStreamGetCtx (stream %p)", handle);
	if (sctx && sctx != cd->ctx)
		return ape_be_error(APE_EINVAL,
				  "cuda %s: stream %p belongs to context %p, not to the device's "
				  "primary context %p",
				  dev->info.name, handle, (void *)sctx, (void *)cd->ctx);
	q = ape_be_calloc(1, sizeof(*q));
	if (!q)
		return ape_be_error(APE_ENOMEM, "out of memory wrapping a stream");
	q->dev = dev;
	q->s = (CUstream)handle;
	q->wrapped = true;
	*out = q;
	return 0;
}
