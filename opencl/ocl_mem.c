/* SPDX-License-Identifier: MIT */
/*
 * Buffers, queues, copies, fills and events.
 *
 * Timing: an event stands for a point in its queue. The time between two points is measured
 * from the start of the first command after the first point to the end of the last command
 * before the second, from the commands' own profiling timestamps. Markers alone would not do:
 * a marker "ends" when the work before it is done, which can be long before the next command
 * starts (the driver may compile a kernel for its work-group size just then).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ocl.h"

static struct ape__ocl_timeline *tl_get(struct ape__ocl_timeline *tl)
{
	atomic_fetch_add(&tl->refs, 1);
	return tl;
}

static void tl_put(struct ape__ocl_timeline *tl)
{
	if (!tl || atomic_fetch_sub(&tl->refs, 1) != 1)
		return;
	for (size_t i = 0; i < tl->n; i++)
		clReleaseEvent(tl->ev[i]);
	free(tl->ev);
	free(tl);
}

/*
 * Drops the commands at the front of tl that have completed (or failed: the first failure is
 * kept in tl->failed for the next synchronize), so that a queue living for thousands of calls
 * holds only the events of commands still in flight. Only while no event of the queue is alive
 * (tl->refs == 1): an event's idx points into tl->ev. Never waits.
 */
static void tl_prune(struct ape__ocl_timeline *tl)
{
	size_t k = tl->checked;

	if (atomic_load(&tl->refs) != 1)
		return;
	for (; k < tl->n; k++) {
		cl_int st = CL_QUEUED;

		if (clGetEventInfo(tl->ev[k], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(st), &st,
				   NULL) != CL_SUCCESS ||
		    st > CL_COMPLETE)
			break; /* still in flight (or unknown: synchronize will ask again) */
		if (st < 0 && tl->failed == CL_SUCCESS) {
			tl->failed = st;
			tl->failed_idx = tl->dropped + k;
		}
	}
	for (size_t i = 0; i < k; i++)
		clReleaseEvent(tl->ev[i]);
	if (k < tl->n) /* (tl->ev may be NULL when nothing is tracked) */
		memmove(tl->ev, tl->ev + k, (tl->n - k) * sizeof(*tl->ev));
	tl->n -= k;
	tl->checked = 0;
	tl->dropped += k;
}

int ape__ocl_track(struct ape_be_queue *q, cl_event ev)
{
	struct ape__ocl_timeline *tl = q->tl;

	if (tl->n == tl->cap && tl->cap >= 64)
		tl_prune(tl);
	if (tl->n == tl->cap) {
		size_t cap = tl->cap ? 2 * tl->cap : 16;
		cl_event *e = ape_be_realloc(tl->ev, cap * sizeof(*e));

		if (e) {
			tl->ev = e;
			tl->cap = cap;
		} else if (tl->cap && clFinish(q->cq) == CL_SUCCESS) {
			/* no memory to track more: the queue drained, what completed is dropped (its
			 * failures kept) and this command takes the room that leaves; the call goes on
			 * (a failure here could come after it wrote some outputs) */
			tl_prune(tl);
		}
		if (tl->n == tl->cap) {
			/* keep the command's own reference alive until the queue is done */
			clWaitForEvents(1, &ev);
			clReleaseEvent(ev);
			return ape_be_error(APE_ENOMEM, "out of memory tracking a command");
		}
	}
	tl->ev[tl->n++] = ev;
	q->fenced = false;
	return 0;
}

#define HUGE_PAGE ((size_t)2 << 20)

/* Frees a huge_buffer's memory once OpenCL has destroyed the buffer over it. */
static void CL_CALLBACK huge_free(cl_mem mem, void *host)
{
	(void)mem;
	free(host);
}

/*
 * On a CPU device, a buffer of at least HUGE_PAGE bytes over host memory advised for huge pages
 * (MADV_HUGEPAGE: the kernel backs it with 2 MiB pages where it can, at most one more huge page
 * per buffer for the stagger below), so that a kernel streaming it, the decode over a KV cache's blocks, misses the TLB once per 2 MiB
 * instead of once per 4 KiB; bench/RESULTS.md). PoCL computes in place on CL_MEM_USE_HOST_PTR
 * (ape__ocl_buf_wrap). APE_OCL_HUGE=0 in the environment turns it off (an A/B). 0 with *mem
 * NULL where this does not apply or the driver refuses: the caller then asks it as usual;
 * APE_ENOMEM when the host memory is not there.
 */
static int huge_buffer(const struct ape__ocl_device *od, size_t bytes, cl_mem *mem)
{
	const size_t span = (bytes + 4095) / 4096 * 4096; /* what madvise takes */
	const char *ev = getenv("APE_OCL_HUGE");
	void *host = NULL;
	cl_int err;

	*mem = NULL;
	if ((ev && ev[0] == '0') || !(od->type & CL_DEVICE_TYPE_CPU) || bytes < HUGE_PAGE)
		return 0;
	/* staggered: buffers made one after another (a cache's K and V slabs) start at different
	 * offsets modulo a huge page, so that rows read together do not share cache sets (at the
	 * same offset the decode ran 15% slower than on 4 KiB pages; bench/RESULTS.md) */
	static atomic_uint turn;
	const size_t shift = (size_t)(atomic_fetch_add(&turn, 1) % 8) * (HUGE_PAGE / 8 + 4096 + 64);

	if (ape_be_posix_memalign(&host, HUGE_PAGE, span + HUGE_PAGE))
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer of %zu bytes", bytes);
	(void)madvise(host, span + HUGE_PAGE, MADV_HUGEPAGE);
	*mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes,
			      (char *)host + shift, &err);
	if (*mem && clSetMemObjectDestructorCallback(*mem, huge_free, host) != CL_SUCCESS) {
		clReleaseMemObject(*mem); /* never used: nothing in flight */
		*mem = NULL;
	}
	if (!*mem)
		free(host);
	return 0;
}

int ape__ocl_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape_be_buf *b;
	cl_int err;
	int ret;

	*out = NULL;
	/* checked here, not left to the driver: some allocate lazily and fail only at first use */
	if (bytes > od->max_alloc)
		return ape_be_error(APE_ENOMEM,
				  "clCreateBuffer (%zu bytes): CL_INVALID_BUFFER_SIZE: more than "
				  "CL_DEVICE_MAX_MEM_ALLOC_SIZE (%llu bytes)",
				  bytes, (unsigned long long)od->max_alloc);
	b = ape_be_calloc(1, sizeof(*b));
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer");
	if ((ret = huge_buffer(od, bytes, &b->mem))) {
		free(b);
		return ret;
	}
	if (!b->mem)
		b->mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
	if (!b->mem) {
		free(b);
		if (err == CL_INVALID_BUFFER_SIZE) /* too large for this device: it does not fit */
			return ape_be_error(APE_ENOMEM, "clCreateBuffer (%zu bytes): %s", bytes,
					  ape__ocl_err_name(err));
		return ape__ocl_error(err, "clCreateBuffer (%zu bytes)", bytes);
	}
	b->size = bytes;
	*out = b;
	return 0;
}

/*
 * The checks of a caller's OpenCL object (`what`, "cl_mem" or "cl_command_queue", at obj):
 * err, the status of the clGet*Info calls (`fn`) that read its context c, must be CL_SUCCESS,
 * and c the device's context. 0, or APE_EINVAL naming the object and both contexts.
 */
static int ocl_check_object(const struct ape__ocl_device *od, const char *what, const void *obj,
			    const char *fn, cl_int err, cl_context c)
{
	if (err != CL_SUCCESS)
		return ape_be_error(APE_EINVAL, "the %s %p: %s: %s (%d)", what, obj, fn,
				  ape__ocl_err_name(err), (int)err);
	if (c != od->ctx)
		return ape_be_error(APE_EINVAL,
				  "the %s %p belongs to cl_context %p, not to the device's "
				  "cl_context %p (build the device on it with "
				  "ape_context_options.opencl_context)",
				  what, obj, (void *)c, (void *)od->ctx);
	return 0;
}

/*
 * buf_wrap (core/backend.h). Host memory only on CPU devices: clCreateBuffer with
 * CL_MEM_USE_HOST_PTR, on which PoCL (3.1, measured) computes in place: creating the buffer
 * over 256 MiB takes 0.01 ms, a kernel's writes are in host memory after clFinish with no map
 * or read, and the host's writes are seen by the next kernel; that holds for pointers at any
 * 4-byte alignment (shifted by 4 and 64 bytes from a 4096-byte boundary: the same kernel time,
 * no copy). A GPU driver would copy behind USE_HOST_PTR, which is why other device types get
 * APE_ENOTSUP. A cl_mem is retained, after checking that it is a buffer of the device's
 * context. buf_free releases either; OpenCL keeps the object alive for commands in flight.
 */
int ape__ocl_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
		      struct ape_be_buf **out, size_t *bytes_out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape_be_buf *b;
	cl_mem mem = NULL;
	cl_int err;

	*out = NULL;
	*bytes_out = 0;
	if (kind == APE_BE_MEM_HOST) {
		if (!(od->type & CL_DEVICE_TYPE_CPU))
			return ape_be_error(APE_ENOTSUP,
					  "host memory cannot be wrapped: not a CPU device, so its "
					  "kernels do not read host memory in place");
		if (!handle || !bytes)
			return ape_be_error(APE_EINVAL, "host memory %p of %zu bytes: %s", handle,
					  bytes, !handle ? "NULL pointer" : "0 bytes");
		if (bytes > od->max_alloc)
			return ape_be_error(APE_EINVAL,
					  "host memory of %zu bytes: more than the device's "
					  "largest buffer (CL_DEVICE_MAX_MEM_ALLOC_SIZE, %llu bytes)",
					  bytes, (unsigned long long)od->max_alloc);
		mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes,
				     handle, &err);
		if (!mem)
			return ape__ocl_error(err, "clCreateBuffer (CL_MEM_USE_HOST_PTR, %zu bytes)",
					      bytes);
	} else if (kind == APE_BE_MEM_OPENCL) {
		cl_context c = NULL;
		cl_mem_object_type type = 0;
		size_t size = 0;
		int ret;

		if (!handle)
			return ape_be_error(APE_EINVAL, "the cl_mem is NULL");
		err = clGetMemObjectInfo(handle, CL_MEM_CONTEXT, sizeof(c), &c, NULL);
		if (err == CL_SUCCESS)
			err = clGetMemObjectInfo(handle, CL_MEM_TYPE, sizeof(type), &type, NULL);
		if (err == CL_SUCCESS)
			err = clGetMemObjectInfo(handle, CL_MEM_SIZE, sizeof(size), &size, NULL);
		ret = ocl_check_object(od, "cl_mem", handle, "clGetMemObjectInfo", err, c);
		if (ret)
			return ret;
		if (type != CL_MEM_OBJECT_BUFFER)
			return ape_be_error(APE_EINVAL,
					  "the cl_mem %p is not a buffer (CL_MEM_TYPE 0x%x)", handle,
					  (unsigned)type);
		if (bytes > size)
			return ape_be_error(APE_EINVAL,
					  "%zu bytes of the cl_mem %p, which has only %zu", bytes,
					  handle, size);
		mem = handle;
		err = clRetainMemObject(mem);
		if (err != CL_SUCCESS)
			return ape__ocl_error(err, "clRetainMemObject");
		bytes = bytes ? bytes : size;
	} else {
		return ape_be_error(APE_ENOTSUP, "cannot wrap %s: an OpenCL device takes host "
					       "memory (CPU devices) and cl_mem objects only",
				  kind == APE_BE_MEM_CUDA ? "CUDA device memory (APE_BE_MEM_CUDA)"
							: "memory of an unknown kind");
	}
	b = ape_be_calloc(1, sizeof(*b));
	if (!b) {
		clReleaseMemObject(mem);
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer");
	}
	b->mem = mem;
	b->size = bytes;
	*out = b;
	*bytes_out = bytes;
	return 0;
}

/* The device's cl_context and cl_device_id (the native op, core/backend.h). */
void ape__ocl_native(struct ape_device *dev, void **context, void **device)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);

	if (context)
		*context = od->ctx;
	if (device)
		*device = od->id;
}

/* Allocated or wrapped: releasing the cl_mem frees ours (idle) and drops the hold on the
 * caller's, which OpenCL keeps alive for the commands still using it. */
void ape__ocl_buf_free(struct ape_device *dev, struct ape_be_buf *buf)
{
	(void)dev;
	if (!buf)
		return;
	clReleaseMemObject(buf->mem);
	free(buf);
}

int ape__ocl_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape_be_queue *q;
	cl_int err;

	*out = NULL;
	q = ape_be_calloc(1, sizeof(*q));
	if (!q)
		return ape_be_error(APE_ENOMEM, "out of memory creating a queue");
	q->tl = ape_be_calloc(1, sizeof(*q->tl));
	if (!q->tl) {
		free(q);
		return ape_be_error(APE_ENOMEM, "out of memory creating a queue");
	}
	atomic_init(&q->tl->refs, 1);
	q->dev = dev;
	q->timed = true;
	q->cq = clCreateCommandQueue(od->ctx, od->id, CL_QUEUE_PROFILING_ENABLE, &err);
	if (!q->cq) {
		tl_put(q->tl);
		free(q);
		return ape__ocl_error(err, "clCreateCommandQueue");
	}
	*out = q;
	return 0;
}

/*
 * queue_wrap (core/backend.h): the caller's cl_command_queue, retained, once it is known to be
 * of the device's context and device and in order. Timing follows the caller's choice of
 * CL_QUEUE_PROFILING_ENABLE (without it event_elapsed and event_timestamp fail with
 * APE_ENOTSUP). Commands are tracked as on a queue of ours (synchronize reports a failed one);
 * the caller's own commands are not, but a failure clFinish reports still comes back.
 */
int ape__ocl_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	cl_command_queue cq = handle;
	cl_context c = NULL;
	cl_device_id d = NULL;
	cl_command_queue_properties props = 0;
	struct ape_be_queue *q;
	cl_int err;
	int ret;

	*out = NULL;
	if (!cq)
		return ape_be_error(APE_EINVAL, "the cl_command_queue is NULL");
	err = clGetCommandQueueInfo(cq, CL_QUEUE_CONTEXT, sizeof(c), &c, NULL);
	if (err == CL_SUCCESS)
		err = clGetCommandQueueInfo(cq, CL_QUEUE_DEVICE, sizeof(d), &d, NULL);
	if (err == CL_SUCCESS)
		err = clGetCommandQueueInfo(cq, CL_QUEUE_PROPERTIES, sizeof(props), &props, NULL);
	ret = ocl_check_object(od, "cl_command_queue", handle, "clGetCommandQueueInfo", err, c);
	if (ret)
		return ret;
	if (d != od->id)
		return ape_be_error(APE_EINVAL,
				  "the cl_command_queue %p is for cl_device_id %p, not for this "
				  "device's %p",
				  handle, (void *)d, (void *)od->id);
	if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE)
		return ape_be_error(APE_EINVAL,
				  "the cl_command_queue %p is out of order "
				  "(CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE): libape orders its "
				  "work by the queue's order, so it needs an in-order queue",
				  handle);
	q = ape_be_calloc(1, sizeof(*q));
	if (q)
		q->tl = ape_be_calloc(1, sizeof(*q->tl));
	if (!q || !q->tl) {
		free(q);
		return ape_be_error(APE_ENOMEM, "out of memory wrapping a queue");
	}
	err = clRetainCommandQueue(cq);
	if (err != CL_SUCCESS) {
		free(q->tl);
		free(q);
		return ape__ocl_error(err, "clRetainCommandQueue");
	}
	atomic_init(&q->tl->refs, 1);
	q->dev = dev;
	q->cq = cq;
	q->wrapped = true;
	q->timed = (props & CL_QUEUE_PROFILING_ENABLE) != 0;
	*out = q;
	return 0;
}

/* Ours: waits first. The caller's: only drops the hold, without waiting; what libape enqueued
 * there keeps its scratch alive by OpenCL's reference counts, and stays ordered with the
 * caller's work. */
void ape__ocl_queue_destroy(struct ape_be_queue *q)
{
	if (!q)
		return;
	if (!q->wrapped)
		clFinish(q->cq); /* buffers may be freed right after: nothing may still use them */
	clReleaseCommandQueue(q->cq);
	tl_put(q->tl);
	free(q);
}

int ape__ocl_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
		      size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueWriteBuffer(q->cq, dst->mem, CL_FALSE, off, n, src, 0, NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueWriteBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueReadBuffer(q->cq, src->mem, CL_FALSE, off, n, dst, 0, NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueReadBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		  size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueFillBuffer(q->cq, dst->mem, &pattern, sizeof(pattern), off, n, 0,
					 NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueFillBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		      struct ape_be_buf *src, size_t src_off, size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueCopyBuffer(q->cq, src->mem, dst->mem, src_off, dst_off, n, 0, NULL,
					 &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueCopyBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

/*
 * An event stands for the current end of q. Our queues are in order, so where the queue's last
 * command is tracked (and no barrier came after it) that command's own event is the same point:
 * it completes when everything before it has, and its end is when that was (what a marker's end
 * would say, without a marker's own wait behind the work). Retaining it enqueues nothing, where
 * a marker is one more command for the driver to allocate, schedule and retire (PoCL wakes its
 * worker threads for each). A marker where that does not hold: nothing tracked (an idle queue),
 * a barrier since, or the caller's queue (whose own commands libape does not see).
 */
int ape__ocl_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	struct ape_be_event *e = ape_be_calloc(1, sizeof(*e));
	const struct ape__ocl_timeline *tl = q->tl;
	cl_int err;

	*out = NULL;
	if (!e)
		return ape_be_error(APE_ENOMEM, "out of memory recording an event");
	if (tl->n && !q->fenced && !q->wrapped) {
		e->marker = tl->ev[tl->n - 1];
		err = clRetainEvent(e->marker);
		if (err != CL_SUCCESS) {
			free(e);
			return ape__ocl_error(err, "clRetainEvent");
		}
	} else {
		err = clEnqueueMarkerWithWaitList(q->cq, 0, NULL, &e->marker);
		if (err != CL_SUCCESS) {
			free(e);
			return ape__ocl_error(err, "clEnqueueMarkerWithWaitList");
		}
	}
	e->dev = q->dev;
	e->timed = q->timed;
	e->tl = tl_get(q->tl);
	e->idx = q->tl->n;
	*out = e;
	return 0;
}

/* Nothing to enqueue where q already waits for e: an event of q itself (in order), or one that
 * has completed. Else a barrier, after which q's last command no longer stands for its end. */
int ape__ocl_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	cl_int st = CL_QUEUED, err;

	if (e->tl == q->tl)
		return 0;
	if (clGetEventInfo(e->marker, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(st), &st, NULL) ==
		    CL_SUCCESS &&
	    st == CL_COMPLETE)
		return 0;
	err = clEnqueueBarrierWithWaitList(q->cq, 1, &e->marker, NULL);
	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueBarrierWithWaitList");
	q->fenced = true;
	return 0;
}

static cl_int ocl_stamp(cl_event ev, cl_profiling_info what, cl_ulong *ns)
{
	cl_int err = clWaitForEvents(1, &ev);

	if (err == CL_SUCCESS)
		err = clGetEventProfilingInfo(ev, what, sizeof(*ns), ns, NULL);
	return err;
}

int ape__ocl_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	cl_ulong t0 = 0, t1 = 0;
	cl_int err;

	*ms = 0;
	if (!start->timed || !end->timed)
		return ape_be_error(APE_ENOTSUP, "no timing: the caller's queue was created without "
					       "CL_QUEUE_PROFILING_ENABLE");
	if (start->tl == end->tl) {
		const struct ape__ocl_timeline *tl = start->tl;

		if (end->idx <= start->idx)
			return 0; /* no command in between */
		err = ocl_stamp(tl->ev[start->idx], CL_PROFILING_COMMAND_START, &t0);
		if (err == CL_SUCCESS)
			err = ocl_stamp(tl->ev[end->idx - 1], CL_PROFILING_COMMAND_END, &t1);
	} else {
		err = ocl_stamp(start->marker, CL_PROFILING_COMMAND_END, &t0);
		if (err == CL_SUCCESS)
			err = ocl_stamp(end->marker, CL_PROFILING_COMMAND_END, &t1);
	}
	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "reading event timestamps");
	*ms = t1 > t0 ? (double)(t1 - t0) * 1e-6 : 0.0;
	return 0;
}

/* The device clock when the marker completed: every queue of a device shares it (OpenCL's
 * profiling counter is per device), which is what traces need to show overlap. */
int ape__ocl_event_timestamp(struct ape_be_event *e, double *ms)
{
	cl_ulong t = 0;
	cl_int err;

	*ms = 0;
	if (!e->timed)
		return ape_be_error(APE_ENOTSUP, "no timing: the caller's queue was created without "
					       "CL_QUEUE_PROFILING_ENABLE");
	err = ocl_stamp(e->marker, CL_PROFILING_COMMAND_END, &t);
	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "reading an event timestamp");
	*ms = (double)t * 1e-6;
	return 0;
}

void ape__ocl_event_destroy(struct ape_be_event *e)
{
	if (!e)
		return;
	clReleaseEvent(e->marker);
	tl_put(e->tl);
	free(e);
}

int ape__ocl_synchronize(struct ape_be_queue *q)
{
	struct ape__ocl_timeline *tl = q->tl;
	cl_int err = clFinish(q->cq);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clFinish");
	if (tl->failed != CL_SUCCESS) /* found by tl_prune; reported again each time, like the
				       * others (the queue may be unusable) */
		return ape__ocl_error(tl->failed, "command %zu of the queue failed",
				      tl->failed_idx);
	/* a command that failed while running says so only in its status */
	for (; tl->checked < tl->n; tl->checked++) {
		cl_int st = CL_COMPLETE;

		err = clGetEventInfo(tl->ev[tl->checked], CL_EVENT_COMMAND_EXECUTION_STATUS,
				     sizeof(st), &st, NULL);
		if (err != CL_SUCCESS)
			return ape__ocl_error(err, "clGetEventInfo");
		if (st < 0)
			return ape__ocl_error(st, "command %zu of the queue failed",
					      tl->dropped + tl->checked);
	}
	tl_prune(tl); /* everything completed: a queue without live events holds nothing */
	return 0;
}

unsigned long ape__ocl_debug_tracked(const struct ape_be_queue *q)
{
	return (unsigned long)q->tl->n;
}
