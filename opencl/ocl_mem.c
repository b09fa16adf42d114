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
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/alloc.h"
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

int ape__ocl_track(struct ape__queue *q, cl_event ev)
{
	struct ape__ocl_timeline *tl = q->tl;

	if (tl->n == tl->cap) {
		size_t cap = tl->cap ? 2 * tl->cap : 16;
		cl_event *e = ape__realloc(tl->ev, cap * sizeof(*e));

		if (!e) {
			/* keep the command's own reference alive until the queue is done */
			clWaitForEvents(1, &ev);
			clReleaseEvent(ev);
			return ape__error(APE_ENOMEM, "out of memory tracking a command");
		}
		tl->ev = e;
		tl->cap = cap;
	}
	tl->ev[tl->n++] = ev;
	return 0;
}

int ape__ocl_buf_alloc(struct ape_device *dev, size_t bytes, struct ape__buf **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape__buf *b;
	cl_int err;

	*out = NULL;
	/* checked here, not left to the driver: some allocate lazily and fail only at first use */
	if (bytes > od->max_alloc)
		return ape__error(APE_ENOMEM,
				  "clCreateBuffer (%zu bytes): CL_INVALID_BUFFER_SIZE: more than "
				  "CL_DEVICE_MAX_MEM_ALLOC_SIZE (%llu bytes)",
				  bytes, (unsigned long long)od->max_alloc);
	b = ape__calloc(1, sizeof(*b));
	if (!b)
		return ape__error(APE_ENOMEM, "out of host memory for a buffer");
	b->mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
	if (!b->mem) {
		free(b);
		if (err == CL_INVALID_BUFFER_SIZE) /* too large for this device: it does not fit */
			return ape__error(APE_ENOMEM, "clCreateBuffer (%zu bytes): %s", bytes,
					  ape__ocl_err_name(err));
		return ape__ocl_error(err, "clCreateBuffer (%zu bytes)", bytes);
	}
	b->size = bytes;
	*out = b;
	return 0;
}

void ape__ocl_buf_free(struct ape_device *dev, struct ape__buf *buf)
{
	(void)dev;
	if (!buf)
		return;
	clReleaseMemObject(buf->mem);
	free(buf);
}

int ape__ocl_queue_create(struct ape_device *dev, struct ape__queue **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape__queue *q;
	cl_int err;

	*out = NULL;
	q = ape__calloc(1, sizeof(*q));
	if (!q)
		return ape__error(APE_ENOMEM, "out of memory creating a queue");
	q->tl = ape__calloc(1, sizeof(*q->tl));
	if (!q->tl) {
		free(q);
		return ape__error(APE_ENOMEM, "out of memory creating a queue");
	}
	atomic_init(&q->tl->refs, 1);
	q->dev = dev;
	q->cq = clCreateCommandQueue(od->ctx, od->id, CL_QUEUE_PROFILING_ENABLE, &err);
	if (!q->cq) {
		tl_put(q->tl);
		free(q);
		return ape__ocl_error(err, "clCreateCommandQueue");
	}
	*out = q;
	return 0;
}

void ape__ocl_queue_destroy(struct ape__queue *q)
{
	if (!q)
		return;
	clFinish(q->cq); /* buffers may be freed right after: nothing may still use them */
	clReleaseCommandQueue(q->cq);
	tl_put(q->tl);
	free(q);
}

int ape__ocl_copy_h2d(struct ape__queue *q, struct ape__buf *dst, size_t off, const void *src,
		      size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueWriteBuffer(q->cq, dst->mem, CL_FALSE, off, n, src, 0, NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueWriteBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_copy_d2h(struct ape__queue *q, void *dst, struct ape__buf *src, size_t off, size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueReadBuffer(q->cq, src->mem, CL_FALSE, off, n, dst, 0, NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueReadBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_fill(struct ape__queue *q, struct ape__buf *dst, size_t off, uint32_t pattern,
		  size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueFillBuffer(q->cq, dst->mem, &pattern, sizeof(pattern), off, n, 0,
					 NULL, &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueFillBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

int ape__ocl_copy_d2d(struct ape__queue *q, struct ape__buf *dst, size_t dst_off,
		      struct ape__buf *src, size_t src_off, size_t n)
{
	cl_event ev;
	cl_int err = clEnqueueCopyBuffer(q->cq, src->mem, dst->mem, src_off, dst_off, n, 0, NULL,
					 &ev);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueCopyBuffer (%zu bytes)", n);
	return ape__ocl_track(q, ev);
}

uint64_t ape__ocl_max_alloc(struct ape_device *dev)
{
	return ape__ocl_dev(dev)->max_alloc;
}

int ape__ocl_event_record(struct ape__queue *q, struct ape__event **out)
{
	struct ape__event *e = ape__calloc(1, sizeof(*e));
	cl_int err;

	*out = NULL;
	if (!e)
		return ape__error(APE_ENOMEM, "out of memory recording an event");
	err = clEnqueueMarkerWithWaitList(q->cq, 0, NULL, &e->marker);
	if (err != CL_SUCCESS) {
		free(e);
		return ape__ocl_error(err, "clEnqueueMarkerWithWaitList");
	}
	e->dev = q->dev;
	e->tl = tl_get(q->tl);
	e->idx = q->tl->n;
	*out = e;
	return 0;
}

int ape__ocl_event_wait(struct ape__queue *q, struct ape__event *e)
{
	cl_int err = clEnqueueBarrierWithWaitList(q->cq, 1, &e->marker, NULL);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clEnqueueBarrierWithWaitList");
	return 0;
}

static cl_int ocl_stamp(cl_event ev, cl_profiling_info what, cl_ulong *ns)
{
	cl_int err = clWaitForEvents(1, &ev);

	if (err == CL_SUCCESS)
		err = clGetEventProfilingInfo(ev, what, sizeof(*ns), ns, NULL);
	return err;
}

int ape__ocl_event_elapsed(struct ape__event *start, struct ape__event *end, double *ms)
{
	cl_ulong t0 = 0, t1 = 0;
	cl_int err;

	*ms = 0;
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
int ape__ocl_event_timestamp(struct ape__event *e, double *ms)
{
	cl_ulong t = 0;
	cl_int err = ocl_stamp(e->marker, CL_PROFILING_COMMAND_END, &t);

	*ms = 0;
	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "reading an event timestamp");
	*ms = (double)t * 1e-6;
	return 0;
}

void ape__ocl_event_destroy(struct ape__event *e)
{
	if (!e)
		return;
	clReleaseEvent(e->marker);
	tl_put(e->tl);
	free(e);
}

int ape__ocl_synchronize(struct ape__queue *q)
{
	struct ape__ocl_timeline *tl = q->tl;
	cl_int err = clFinish(q->cq);

	if (err != CL_SUCCESS)
		return ape__ocl_error(err, "clFinish");
	/* a command that failed while running says so only in its status */
	for (; tl->checked < tl->n; tl->checked++) {
		cl_int st = CL_COMPLETE;

		err = clGetEventInfo(tl->ev[tl->checked], CL_EVENT_COMMAND_EXECUTION_STATUS,
				     sizeof(st), &st, NULL);
		if (err != CL_SUCCESS)
			return ape__ocl_error(err, "clGetEventInfo");
		if (st < 0)
			return ape__ocl_error(st, "command %zu of the queue failed",
					      tl->checked);
	}
	return 0;
}
