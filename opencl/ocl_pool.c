/* SPDX-License-Identifier: MIT */
/*
 * A launch's scratch buffers, and the device's pool of idle ones.
 *
 * Every kernel launch makes its own scratch (the backward's prepared rows and partial sums, the
 * separable path's rotated rows, the skip pre-pass's tiles ...) and drops it when the launch is
 * enqueued. Made fresh each time, a buffer costs the driver's allocation and, on a CPU device,
 * the kernel's zeroing of every page at its first touch: a training step's backward at L = 1024
 * made about 15 MB of scratch per call, and a small call's dozen buffers cost more than its
 * kernels. So a launch's plain read-write scratch is taken from, and given back to, a pool:
 *
 *   ape__ocl_scratch(q, bytes, NULL)   a buffer of exactly `bytes`: one this queue gave back
 *                                      (an in-order queue runs its later commands after the
 *                                      earlier ones that used it), else an idle one of the
 *                                      device's pool, else a new one;
 *   ape__ocl_scratch_put(q, mem)       the launch is done enqueueing with it: kept on the queue
 *                                      (q->pend) until the queue is known to be idle;
 *   ape__ocl_pool_idle(q)              the queue has finished every command (its synchronize,
 *                                      or its destruction, which waits): its kept buffers join
 *                                      the device's pool, usable by any queue.
 *
 * Ownership: the pool holds one reference to each buffer it keeps; a buffer taken from it is the
 * launch's, as a new one would be, until it is put back. Only our own queues keep buffers: on
 * the caller's queue (queue_wrap), which libape never waits for, a put buffer is released at
 * once and OpenCL keeps it alive for its commands, as before. A buffer made with initial
 * contents (CL_MEM_COPY_HOST_PTR) or read-only is never kept.
 *
 * Bounds: at most `limit` bytes idle in the device's pool (oldest given back first released)
 * and at most `limit` bytes kept on one queue (beyond that a put releases); APE_OCL_POOL_MB
 * sets the limit in MiB (0: no pool, every buffer made and released as before); by default the
 * smaller of 512 MiB and a sixteenth of the device's memory. A new buffer that fails for lack of
 * memory releases the pool's idle buffers and is tried once more, so that idle ones never cause
 * an APE_ENOMEM. The pool is released with the device.
 *
 * Scratch contents are unspecified, as a new buffer's are; APE_OCL_POOL_POISON=1 fills every
 * reused buffer with all-ones bits (a NaN in float32 and float64) before the launch sees it, so
 * that a kernel reading scratch it did not write shows up in tests (tests/test_opencl_pool.c).
 */
#include <stdlib.h>
#include <string.h>

#include "ocl.h"

/* Default pool limit: the smaller of this and a sixteenth of the device's memory. */
#define POOL_DEFAULT_MAX ((size_t)512 << 20)

static bool no_memory(cl_int err)
{
	return err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_RESOURCES ||
	       err == CL_OUT_OF_HOST_MEMORY;
}

void ape__ocl_pool_init(struct ape__ocl_pool *p, cl_ulong global_mem)
{
	const char *e = getenv("APE_OCL_POOL_MB");
	const char *poison = getenv("APE_OCL_POOL_POISON");
	size_t limit = global_mem / 16 < POOL_DEFAULT_MAX ? (size_t)(global_mem / 16)
							    : POOL_DEFAULT_MAX;

	if (e && *e) {
		char *end;
		const unsigned long long mb = strtoull(e, &end, 10);

		if (*end == '\0' && mb <= ((size_t)-1 >> 20))
			limit = (size_t)mb << 20;
	}
	memset(&p->c, 0, sizeof(p->c));
	p->e = NULL;
	p->n = p->cap = 0;
	p->bytes = 0;
	p->limit = limit;
	p->poison = poison && strcmp(poison, "1") == 0;
}

/* Releases every idle buffer; the caller holds the device's lock (or is its last user). */
static void pool_drain_locked(struct ape__ocl_pool *p)
{
	for (size_t i = 0; i < p->n; i++)
		clReleaseMemObject(p->e[i].mem);
	p->c.released += p->n;
	p->n = 0;
	p->bytes = 0;
}

void ape__ocl_pool_free(struct ape__ocl_pool *p)
{
	pool_drain_locked(p);
	free(p->e);
	p->e = NULL;
	p->cap = 0;
}

/* Index of an entry of exactly `bytes` in e[0..n), the newest first; -1 when none. */
static long find_exact(const struct ape__ocl_pooled *e, size_t n, size_t bytes)
{
	for (size_t i = n; i-- > 0;)
		if (e[i].bytes == bytes)
			return (long)i;
	return -1;
}

static cl_mem take_at(struct ape__ocl_pooled *e, size_t *n, size_t *total, long i)
{
	const cl_mem mem = e[i].mem;

	*total -= e[i].bytes;
	memmove(e + i, e + i + 1, (*n - (size_t)i - 1) * sizeof(*e));
	(*n)--;
	return mem;
}

/* Appends (mem, bytes) to a list growing by doubling; false when out of memory. */
static bool list_push(struct ape__ocl_pooled **e, size_t *n, size_t *cap, cl_mem mem, size_t bytes)
{
	if (*n == *cap) {
		const size_t nc = *cap ? 2 * *cap : 16;
		struct ape__ocl_pooled *ne = ape_be_realloc(*e, nc * sizeof(*ne));

		if (!ne)
			return false;
		*e = ne;
		*cap = nc;
	}
	(*e)[(*n)++] = (struct ape__ocl_pooled){ mem, bytes };
	return true;
}

/* A reused buffer poisoned for the tests (APE_OCL_POOL_POISON=1), ordered before the launch's
 * commands on q. */
static cl_int poison(struct ape_be_queue *q, cl_mem mem, size_t bytes)
{
	const cl_uint ones = 0xffffffffu;
	cl_event ev;
	cl_int err;

	if (bytes % sizeof(ones))
		return CL_SUCCESS; /* (every scratch size here is a multiple of 4) */
	err = clEnqueueFillBuffer(q->cq, mem, &ones, sizeof(ones), 0, bytes, 0, NULL, &ev);
	if (err == CL_SUCCESS && ape__ocl_track(q, ev))
		err = CL_OUT_OF_HOST_MEMORY;
	return err;
}

cl_mem ape__ocl_scratch(struct ape_be_queue *q, size_t bytes, void *init, cl_int *err)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	struct ape__ocl_pool *p = &od->pool;
	cl_mem mem = NULL;
	long i;

	if (init)
		return clCreateBuffer(od->ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, bytes, init,
				      err);
	if (p->limit) {
		if ((i = find_exact(q->pend, q->npend, bytes)) >= 0)
			mem = take_at(q->pend, &q->npend, &q->pend_bytes, i);
		pthread_mutex_lock(&od->lock);
		if (mem) {
			p->c.hits++;
		} else if ((i = find_exact(p->e, p->n, bytes)) >= 0) {
			mem = take_at(p->e, &p->n, &p->bytes, i);
			p->c.hits++;
		} else {
			p->c.misses++;
		}
		pthread_mutex_unlock(&od->lock);
		if (mem) {
			*err = p->poison ? poison(q, mem, bytes) : CL_SUCCESS;
			if (*err == CL_SUCCESS)
				return mem;
			clReleaseMemObject(mem);
			return NULL;
		}
	}
	mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE, bytes, NULL, err);
	if (!mem && no_memory(*err)) {
		/* the idle buffers go first (this queue's kept ones too: OpenCL keeps them for
		 * their commands), then one more try */
		for (size_t k = 0; k < q->npend; k++)
			clReleaseMemObject(q->pend[k].mem);
		q->npend = 0;
		q->pend_bytes = 0;
		pthread_mutex_lock(&od->lock);
		pool_drain_locked(p);
		pthread_mutex_unlock(&od->lock);
		mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE, bytes, NULL, err);
	}
	return mem;
}

void ape__ocl_scratch_put(struct ape_be_queue *q, cl_mem mem)
{
	struct ape__ocl_device *od;
	cl_mem_flags flags = 0;
	size_t bytes = 0;

	if (!mem)
		return;
	od = ape__ocl_dev(q->dev);
	if (q->wrapped || !od->pool.limit ||
	    clGetMemObjectInfo(mem, CL_MEM_FLAGS, sizeof(flags), &flags, NULL) != CL_SUCCESS ||
	    flags != CL_MEM_READ_WRITE ||
	    clGetMemObjectInfo(mem, CL_MEM_SIZE, sizeof(bytes), &bytes, NULL) != CL_SUCCESS ||
	    q->pend_bytes + bytes > od->pool.limit ||
	    !list_push(&q->pend, &q->npend, &q->cappend, mem, bytes)) {
		clReleaseMemObject(mem);
		return;
	}
	q->pend_bytes += bytes;
}

void ape__ocl_pool_idle(struct ape_be_queue *q)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	struct ape__ocl_pool *p = &od->pool;
	size_t k = 0;

	if (!q->npend)
		return;
	pthread_mutex_lock(&od->lock);
	for (; k < q->npend; k++) {
		const struct ape__ocl_pooled *x = &q->pend[k];

		if (x->bytes > p->limit || !list_push(&p->e, &p->n, &p->cap, x->mem, x->bytes))
			break;
		p->bytes += x->bytes;
		/* the oldest idle buffers make room */
		while (p->bytes > p->limit) {
			p->c.released++;
			clReleaseMemObject(take_at(p->e, &p->n, &p->bytes, 0));
		}
	}
	pthread_mutex_unlock(&od->lock);
	for (; k < q->npend; k++) /* past the limit, or no memory for the list */
		clReleaseMemObject(q->pend[k].mem);
	q->npend = 0;
	q->pend_bytes = 0;
}

void ape__ocl_pool_queue_free(struct ape_be_queue *q)
{
	for (size_t k = 0; k < q->npend; k++)
		clReleaseMemObject(q->pend[k].mem);
	free(q->pend);
	q->pend = NULL;
	q->npend = q->cappend = 0;
	q->pend_bytes = 0;
}

int ape__ocl_debug_pool(const struct ape_device *dev, struct ape__ocl_debug_pool *out)
{
	struct ape__ocl_device *od;

	if (!dev || strcmp(dev->info.backend, "opencl"))
		return -1;
	od = ape__ocl_dev(dev);
	pthread_mutex_lock(&od->lock);
	*out = od->pool.c;
	out->idle_buffers = od->pool.n;
	out->idle_bytes = od->pool.bytes;
	out->limit = od->pool.limit;
	pthread_mutex_unlock(&od->lock);
	return 0;
}
