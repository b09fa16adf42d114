/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL backend's internal state, shared by its files (and by no one else).
 *
 * One OpenCL context per device (the caller's own for the device it names in
 * ape_context_options.opencl_context/opencl_device, retained); in-order profiling queues, one
 * per ape_be_queue (the core makes one per forward call), or the caller's own queue, retained
 * (queue_wrap: in order, timing only when the caller enabled profiling). Programs are built lazily per (device, D specialisation) under the
 * device's mutex (the cached one used last is loaded at device open, ape__ocl_program_preload())
 * and kept for the context's life; kernel objects are made per launch, because
 * clSetKernelArg on a shared cl_kernel is not thread-safe.
 */
#ifndef APE_OPENCL_OCL_H
#define APE_OPENCL_OCL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "ape/ape_backend.h"
#include "ocl_api.h" /* <CL/cl.h>, every call through the loaded table */
#include "ocl_debug.h"

#pragma GCC visibility push(hidden)

/* Program variants: D = 64 and D = 128 specialised, every other even D <= 256 generic. */
enum { APE__OCL_D64, APE__OCL_D128, APE__OCL_DGEN, APE__OCL_NVARIANTS };

/* Compile-time shape of a variant's kernel (see kernels/attention.cl). */
struct ape__ocl_tuning {
	int rw; /* query rows per row vector (vector lanes) */
	int rg; /* row vectors per work-item */
	int nwi; /* work-items per work-group */
	int bk; /* keys per key tile */
	int sb; /* keys per score sub-block */
};

struct ape__ocl_program {
	pthread_mutex_t lock; /* held while building, so that each variant is built once */
	cl_program prog; /* NULL until built; never changes afterwards */
	struct ape__ocl_tuning t;
	/* the preload (ape__ocl_program_preload) found this variant's cache entry unusable (and
	 * counted it in cache_rejects): the first build goes straight to the source */
	bool cache_refused;
};

struct ape__ocl_device {
	cl_platform_id platform;
	cl_device_id id;
	cl_context ctx; /* ours, or the caller's (imported): retained either way */
	bool imported; /* ctx is the caller's (ape_context_options.opencl_context) */
	cl_device_type type;
	char name[128];
	char platform_name[128];
	char platform_version[128];
	char driver[64];
	int fp64; /* cl_khr_fp64 */
	size_t max_wg; /* CL_DEVICE_MAX_WORK_GROUP_SIZE */
	cl_ulong local_mem; /* CL_DEVICE_LOCAL_MEM_SIZE */
	cl_ulong max_alloc; /* CL_DEVICE_MAX_MEM_ALLOC_SIZE */
	cl_uint vec_float; /* CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT */
	struct ape__ocl_program progs[APE__OCL_NVARIANTS];
	pthread_mutex_t lock; /* guards counters (builds of two variants may run at once) and kernels */
	struct ape__ocl_debug_counters counters;
	char kernels[1024]; /* the names of the kernels enqueued since the tests last read them */
	atomic_bool kernels_on; /* a test asked for them (ape__ocl_debug_kernels()): recorded */
};

/*
 * Every command enqueued on a queue, in order, for profiling and error reporting. Shared by the
 * queue and the events recorded on it, so that either may be released first. A long-lived queue
 * (the caller's, or one of the public API's) would hold every command's event forever: while no
 * event of the queue is alive, commands that completed are dropped from the front
 * (ocl_mem.c, tl_prune), a failure among them kept in `failed` for the next synchronize.
 */
struct ape__ocl_timeline {
	atomic_int refs;
	size_t n, cap, checked; /* checked: commands whose status was read (synchronize, prune) */
	cl_event *ev;
	cl_int failed; /* CL_SUCCESS, or the status of a failed command already dropped */
	size_t failed_idx; /* that command's number in the queue */
	size_t dropped; /* commands dropped from the front: ev[0] is command number `dropped` */
};

struct ape_be_buf {
	cl_mem mem;
	size_t size;
};

struct ape_be_queue {
	struct ape_device *dev; /* first, as every backend's (core/backend.h, "Objects") */
	cl_command_queue cq;
	struct ape__ocl_timeline *tl;
	bool wrapped; /* the caller's queue (queue_wrap): released without waiting */
	bool timed; /* CL_QUEUE_PROFILING_ENABLE: event_elapsed and event_timestamp work */
	/* a barrier (event_wait) enqueued after the last tracked command: that command's event no
	 * longer stands for the queue's end (ape__ocl_event_record) */
	bool fenced;
};

struct ape_be_event {
	struct ape_device *dev; /* first, likewise */
	/* for event_wait on other queues, and timing across queues: a marker, or the event of the
	 * queue's last command where that stands for the same point (ape__ocl_event_record) */
	cl_event marker;
	struct ape__ocl_timeline *tl;
	size_t idx; /* commands of tl enqueued before this event */
	bool timed; /* recorded on a queue with profiling (struct ape_be_queue.timed) */
};

_Static_assert(offsetof(struct ape_be_queue, dev) == 0 && offsetof(struct ape_be_event, dev) == 0,
	       "core/backend.h: queues and events begin with their device");

static inline struct ape__ocl_device *ape__ocl_dev(const struct ape_device *dev)
{
	return dev->priv;
}

/* A view (struct ape_be_view) as the kernels take it (kernels/attention.cl, VIEW_ROW): x = the
 * offset, y, z, w = the B, H, L strides, in elements. */
static inline cl_long4 ape__ocl_view4(struct ape_be_view v)
{
	cl_long4 r;

	r.s[0] = v.off;
	r.s[1] = v.sb;
	r.s[2] = v.sh;
	r.s[3] = v.sl;
	return r;
}

/* Bytes of the programs' APE_REAL (ocl_program.c): float64 with cl_khr_fp64, else float32 */
static inline size_t ape__ocl_real_size(const struct ape__ocl_device *od)
{
	return od->fp64 ? sizeof(cl_double) : sizeof(cl_float);
}

/* ---- ocl_errors.c */
const char *ape__ocl_err_name(cl_int err);
/* The libape code for an OpenCL error (ENOMEM, EBUILD, ENODEV or EBACKEND). */
int ape__ocl_err_code(cl_int err);
/* Sets the message "<what>: CL_NAME (code)" and returns the mapped code; the core's table
 * names the op that failed and the device around it (core/backend.h, "Failure"). */
int ape__ocl_error(cl_int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- ocl_device.c */
int ape__ocl_probe(struct ape_backend *be, struct ape_be_probe_result *res);
void ape__ocl_device_release(struct ape_device *dev);

/* ---- ocl_mem.c */
int ape__ocl_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out);
void ape__ocl_buf_free(struct ape_device *dev, struct ape_be_buf *buf);
int ape__ocl_queue_create(struct ape_device *dev, struct ape_be_queue **out);
void ape__ocl_queue_destroy(struct ape_be_queue *q);
int ape__ocl_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
		      size_t n);
int ape__ocl_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n);
int ape__ocl_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		  size_t n);
int ape__ocl_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		      struct ape_be_buf *src, size_t src_off, size_t n);
/* buf_wrap, queue_wrap and native (core/backend.h, ABI 5): the caller's memory and queues. */
int ape__ocl_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
		      struct ape_be_buf **out, size_t *bytes_out);
int ape__ocl_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out);
void ape__ocl_native(struct ape_device *dev, void **context, void **device);
int ape__ocl_event_timestamp(struct ape_be_event *e, double *ms);
int ape__ocl_event_record(struct ape_be_queue *q, struct ape_be_event **out);
int ape__ocl_event_wait(struct ape_be_queue *q, struct ape_be_event *e);
int ape__ocl_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms);
void ape__ocl_event_destroy(struct ape_be_event *e);
int ape__ocl_synchronize(struct ape_be_queue *q);
/* Records a command just enqueued on q (takes over the reference to ev). */
int ape__ocl_track(struct ape_be_queue *q, cl_event ev);

/* ---- ocl_program.c */
/*
 * At device open (ape_context_create): loads from the program cache, never compiling, the
 * variant whose entry was used last (each load renews its entry's time), so that a process's
 * first call does not pay for the driver's binary load (about 45 ms for PoCL on a CPU).
 * APE_OCL_PRELOAD: unset or "1" that one, "all" every cached variant, "64,128" the variants of
 * those head dimensions, "0" none. Nothing fails: a variant not loaded here is built on first
 * use as before.
 */
void ape__ocl_program_preload(struct ape__ocl_device *od);
/* The built program for head dimension D, building it on first use. */
int ape__ocl_program_get(struct ape_device *dev, int64_t D, const struct ape__ocl_program **out);

/* ---- ocl_attention.c */
int ape__ocl_attention(struct ape_be_queue *q, const struct ape_be_launch *l);
/* attention_merge (ocl_merge.c) */
int ape__ocl_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m);
/* Kernel arguments set in order; the first failure sticks in err (checked once, after all). */
struct ape__ocl_args {
	cl_kernel k;
	cl_uint n;
	cl_int err;
};
void ape__ocl_arg(struct ape__ocl_args *a, size_t size, const void *v);
/* Enqueues k over (n0, n1) with local size (l0, 1) (the driver's choice when l0 is 0),
 * splitting dimension 1 into chunks through the global offset; tracks each command. */
int ape__ocl_enqueue(struct ape_be_queue *q, cl_kernel k, size_t n0, size_t l0, size_t n1,
		     const char *what);
/* A buffer of the launch's own (read-only copy of init when init is not NULL). */
cl_mem ape__ocl_scratch(struct ape_be_queue *q, size_t bytes, void *init, cl_int *err);

/* ---- ocl_backward.c */
int ape__ocl_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l);
/* ABI 10 (ocl_backward.c): queue-ordered scratch and copy_view. */
int ape__ocl_scratch_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out);
int ape__ocl_scratch_free(struct ape_be_queue *q, struct ape_be_buf *buf);
int ape__ocl_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c);
uint64_t ape__ocl_attention_backward_scratch(struct ape_device *dev,
					     const struct ape_be_bwd_launch *l, unsigned parts);
/* The most scratch bytes one backward launch of this process allocated: tests compare it with
 * attention_backward_scratch. */
extern atomic_uint_fast64_t ape__ocl_bwd_scratch_high;

/* ---- kernels_embed.S: NUL-terminated sources embedded at build time */
extern const char ape__ocl_src_attention[];
extern const char ape__ocl_src_math[];
extern const char ape__ocl_src_bwd_layout[];
extern const char ape__ocl_src_backward[];

#pragma GCC visibility pop
#endif
