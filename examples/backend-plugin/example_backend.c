/* SPDX-License-Identifier: MIT */
/*
 * An example out-of-tree backend for libape: the starting point for a vendor's plugin
 * (docs/backends.md walks through it). It registers the backend name "example", with one CPU
 * "device" that runs the forward and the backward pass in plain C (example_kernels.c). The
 * point is the ABI, not speed: every op below shows what ape/ape_backend.h asks of it.
 *
 * The device is the host. Its memory is host memory (aligned_alloc), counted against a fixed
 * size as a driver's would be; a queue runs each command when it is enqueued, on the calling
 * thread, so a command has completed when its op returns; an event records the CLOCK_MONOTONIC
 * time. A real backend replaces the body of each op by its driver's call (the comments say
 * which kind) and keeps the rules around it (ape/ape_backend.h, "Failure"): on failure, clear
 * the out-parameters, leave nothing half made, and say what failed below the op with
 * ape_be_error(), never the device or the op (the core's table adds both).
 *
 * Configuration (read by probe; the example's own variables, for trying the core's paths):
 *   APE_EXAMPLE_DEVICES  how many devices, 0 to 4 (default 1): with 0 the backend loads and
 *                        reports why it has no device, as a backend without its driver does
 *   APE_EXAMPLE_MEM      each device's memory in bytes (default: half the host's): the core
 *                        plans its chunks within three quarters of it, and buf_alloc refuses
 *                        what goes beyond it with APE_ENOMEM
 *
 * Built by `make plugin-example` (or this folder's Makefile against an installed libape) into
 * libape-backend-example.so; loaded by naming it in APE_BACKEND_PATH.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime(), sysconf() */

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "example.h"

/* The ABI this file was written against: a new major fails the build here until the changes
 * of ape/ape_backend.h's contract have been reviewed (a new minor only appends). */
_Static_assert(APE_BACKEND_ABI_MAJOR == 1, "example: written for backend ABI 1.x");

#define EXAMPLE_VERSION "1.0"
#define EXAMPLE_MAX_DEVICES 4
/*
 * The devices' rank (ape/ape_backend.h, "Device ranks"): where "auto" places them among every
 * device. Plain C on the host belongs with the reference, at 0; ties go to the built-in
 * backends, probed first, so "auto" never picks the example over them. A vendor's GPU plugin
 * states a rank in its range instead (300 and up for a vendor's own API).
 */
#define EXAMPLE_RANK 0

/*
 * The backend's objects. Queues and events begin with their device: the core finds the
 * device of any queue or event by reading that first member (ape_be_queue_dev()).
 */
struct ape_be_queue {
	struct ape_device *dev;
	/* a real backend: its driver's queue or stream */
};

struct ape_be_event {
	struct ape_device *dev; /* its queue's */
	double ms; /* the device time when everything enqueued before it had completed */
};

_Static_assert(offsetof(struct ape_be_queue, dev) == 0 && offsetof(struct ape_be_event, dev) == 0,
	       "queues and events begin with their device");

/* A device's own state (dev->priv): created by probe, freed by device_release. */
struct example_device {
	uint64_t capacity; /* its memory, in bytes */
	/* bytes allocated now: buf_alloc and buf_free run on several threads at once, so the
	 * backend keeps its shared state safe itself (the core holds no lock around an op) */
	_Atomic uint64_t in_use;
};

/* The device clock: milliseconds from an arbitrary origin, one for every queue. */
static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- Devices */

/* The variable `name` as a number in [lo, hi], `def` when unset; -1 when malformed. */
static int64_t env_number(const char *name, int64_t def, int64_t lo, int64_t hi)
{
	const char *s = getenv(name);
	char *end;
	long long v;

	if (!s || !*s)
		return def;
	v = strtoll(s, &end, 10);
	return *end || v < lo || v > hi ? -1 : (int64_t)v;
}

static uint64_t host_memory(void)
{
	const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);

	return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : (uint64_t)1 << 32;
}

/*
 * Called once per context, from the thread creating it, before any other op. A real backend
 * loads its driver here (dlopen, so that a machine without it still runs libape: then it adds
 * no device and says why in res->reason) and adds each device it can drive. Only a failure
 * that must fail the whole context (memory) returns an error.
 */
static int ex_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	/* what each device can do: the backward pass, and device times on its events; not the
	 * diagnostics, ragged batches, explicit positions or host memory in place (each calls
	 * for more of the launch struct: ape/ape_backend.h, enum ape_be_cap) */
	static const struct ape_be_caps caps = {
		.features = APE_BE_CAP_BACKWARD | APE_BE_CAP_TIMESTAMPS | APE_BE_CAP_BIAS_TABLE,
		.max_alloc = UINT64_MAX, /* one allocation may take all of the device's memory */
	};
	const int64_t ndev = env_number("APE_EXAMPLE_DEVICES", 1, 0, EXAMPLE_MAX_DEVICES);
	const int64_t mem = env_number("APE_EXAMPLE_MEM", (int64_t)(host_memory() / 2), 1,
				       INT64_MAX);

	if (ndev <= 0 || mem < 0) {
		snprintf(res->reason, sizeof(res->reason), "%s",
			 ndev == 0 ? "APE_EXAMPLE_DEVICES=0: no device"
			 : ndev < 0 ? "APE_EXAMPLE_DEVICES: expected 0 to 4"
				    : "APE_EXAMPLE_MEM: expected a size in bytes");
		return 0;
	}
	for (int64_t i = 0; i < ndev; i++) {
		struct example_device *ed = calloc(1, sizeof(*ed));
		struct ape_device_info info;
		int err;

		if (!ed)
			return ape_be_error(APE_ENOMEM, "example: out of host memory");
		ed->capacity = (uint64_t)mem;
		memset(&info, 0, sizeof(info));
		snprintf(info.name, sizeof(info.name), "host CPU (plain C, float64)");
		snprintf(info.vendor, sizeof(info.vendor), "libape example plugin");
		snprintf(info.driver_version, sizeof(info.driver_version), "%s", EXAMPLE_VERSION);
		info.kind = APE_DEVICE_CPU;
		info.compute_units = 1;
		info.global_mem_bytes = ed->capacity;
		/* info.pci_address stays "": no PCI device behind it */
		err = ape_be_device_add(be, &info, &caps, EXAMPLE_RANK, ed);
		if (err) { /* the devices added before are released by the core as usual */
			free(ed);
			return err;
		}
	}
	return 0;
}

/* Once per device, after everything created on it was released (and before teardown). */
static void ex_device_release(struct ape_device *dev)
{
	free(dev->priv);
}

/* ---- Memory */

/* Counts `bytes` against the device's memory; false when they do not fit. */
static bool reserve(struct example_device *ed, uint64_t bytes)
{
	uint64_t used = atomic_load(&ed->in_use);

	do {
		if (bytes > ed->capacity - used)
			return false;
	} while (!atomic_compare_exchange_weak(&ed->in_use, &used, used + bytes));
	return true;
}

/* A real backend: clCreateBuffer, cuMemAlloc. Contents are left undefined. */
static int ex_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	struct example_device *ed = dev->priv;
	const size_t held = (bytes + 63) / 64 * 64;
	struct ape_be_buf *b;

	*out = NULL;
	if (bytes > SIZE_MAX - 63 || !reserve(ed, held))
		return ape_be_error(APE_ENOMEM,
				    "%zu bytes do not fit: %" PRIu64 " of the device's %" PRIu64
				    " bytes are in use",
				    bytes, atomic_load(&ed->in_use), ed->capacity);
	b = malloc(sizeof(*b));
	if (b)
		b->data = aligned_alloc(64, held);
	if (!b || !b->data) {
		free(b);
		atomic_fetch_sub(&ed->in_use, held);
		return ape_be_error(APE_ENOMEM, "out of host memory for %zu bytes", bytes);
	}
	b->size = bytes;
	b->held = held;
	*out = b;
	return 0;
}

/* NULL is accepted; the buffer is idle (every queue that used it was synchronised). */
static void ex_buf_free(struct ape_device *dev, struct ape_be_buf *buf)
{
	struct example_device *ed = dev->priv;

	if (!buf)
		return;
	atomic_fetch_sub(&ed->in_use, buf->held);
	free(buf->data);
	free(buf);
}

/* ---- Queues, copies and events. A real backend enqueues each command and returns at once;
 * here each runs now, so synchronize has nothing to wait for. */

static int ex_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	struct ape_be_queue *q = calloc(1, sizeof(*q));

	*out = NULL;
	if (!q)
		return ape_be_error(APE_ENOMEM, "out of host memory for a queue");
	q->dev = dev;
	*out = q;
	return 0;
}

/* NULL is accepted. A real backend waits for the queue's work first, ignoring its failures. */
static void ex_queue_destroy(struct ape_be_queue *q)
{
	free(q);
}

/* Reports what failed asynchronously (a kernel fault, a lost device); none can here. */
static int ex_synchronize(struct ape_be_queue *q)
{
	(void)q;
	return 0;
}

static int ex_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		       const void *src, size_t n)
{
	(void)q;
	memcpy((char *)dst->data + dst_off, src, n);
	return 0;
}

static int ex_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t src_off,
		       size_t n)
{
	(void)q;
	memcpy(dst, (const char *)src->data + src_off, n);
	return 0;
}

/* Optional (without it the core bounces through the host): the KV cache's gathers use it. */
static int ex_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		       struct ape_be_buf *src, size_t src_off, size_t n)
{
	(void)q;
	memcpy((char *)dst->data + dst_off, (const char *)src->data + src_off, n);
	return 0;
}

/* The core zeroes accumulators and poisons outputs with it. */
static int ex_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
		   uint32_t pattern, size_t n)
{
	(void)q;
	for (size_t i = 0; i < n; i += 4)
		memcpy((char *)dst->data + dst_off + i, &pattern, 4);
	return 0;
}

static int ex_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	struct ape_be_event *e = malloc(sizeof(*e));

	*out = NULL;
	if (!e)
		return ape_be_error(APE_ENOMEM, "out of host memory for an event");
	e->dev = q->dev;
	e->ms = now_ms(); /* every command before it has completed already */
	*out = e;
	return 0;
}

/* Later work on q waits for e: nothing to do when every command completes as it is enqueued. */
static int ex_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	(void)q;
	(void)e;
	return 0;
}

static int ex_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	*ms = end->ms - start->ms;
	return 0;
}

/* Needed by APE_BE_CAP_TIMESTAMPS: the device time of e, on one clock for all the device's
 * queues. */
static int ex_event_timestamp(struct ape_be_event *e, double *ms)
{
	*ms = e->ms;
	return 0;
}

static void ex_event_destroy(struct ape_be_event *e)
{
	free(e);
}

/* ---- Attention and backward: the kernels run on the calling thread (example_kernels.c). */

static int ex_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	(void)q;
	example_attention(l);
	return 0;
}

/* Device memory the attention op allocates beyond its launch's buffers: none. Without this op
 * the core would assume float32 copies of K and V, and plan smaller chunks than it need. */
static uint64_t ex_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	(void)dev;
	(void)l;
	return 0;
}

/* Adds the launch's gradients to the accumulators. No attention_backward_scratch op: it
 * allocates nothing, which is what the core assumes without it. */
static int ex_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	(void)q;
	example_attention_backward(l);
	return 0;
}

/* ---- Extras by name */

/* An extra of the example's own: its version. A program reaches it through libape with
 * ape_backend_get_proc(ctx, "example", "example_version"). */
static const char *example_version(void)
{
	return EXAMPLE_VERSION;
}

/* Any thread, even before probe; never fails. */
static void *ex_proc_address(const char *name)
{
	if (!strcmp(name, "example_version"))
		return (void *)(uintptr_t)example_version; /* as dlsym() hands out functions */
	return NULL;
}

/* ---- The table */

static const struct ape_backend_plugin example_plugin = {
	APE_BACKEND_PLUGIN_HEAD("example"), /* this header's ABI, the table's size, the name */
	/* devices */
	.probe = ex_probe,
	.device_release = ex_device_release,
	/* memory */
	.buf_alloc = ex_buf_alloc,
	.buf_free = ex_buf_free,
	/* queues, copies and events */
	.queue_create = ex_queue_create,
	.queue_destroy = ex_queue_destroy,
	.synchronize = ex_synchronize,
	.copy_h2d = ex_copy_h2d,
	.copy_d2h = ex_copy_d2h,
	.copy_d2d = ex_copy_d2d,
	.fill = ex_fill,
	.event_record = ex_event_record,
	.event_wait = ex_event_wait,
	.event_elapsed = ex_event_elapsed,
	.event_timestamp = ex_event_timestamp,
	.event_destroy = ex_event_destroy,
	/* attention and backward */
	.attention = ex_attention,
	.attention_scratch = ex_attention_scratch,
	.attention_backward = ex_attention_backward,
	/* extras */
	.proc_address = ex_proc_address,
	/*
	 * Left out, each with the core's fallback (ape/ape_backend.h): teardown (no backend-wide
	 * state; one set with ape_be_set_priv() in probe is released there), native, buf_wrap,
	 * host_register/host_unregister, queue_wrap, attention_merge (partial results merged on
	 * the host), attention_backward_scratch, scratch_alloc/scratch_free/copy_view (the
	 * backward pass on device tensors), attention_pages.
	 */
};

/* The one symbol libape looks up (dlsym) in a plugin. */
APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin(void)
{
	return &example_plugin;
}
