/* SPDX-License-Identifier: MIT */
#include "wrapops.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context.h"
#include "core/error.h"
#include "core/ops.h"

/* Test-only global state: the ops struct has no user pointer, and one wrapper is enough. */
static struct {
	pthread_mutex_t lock;
	struct ape_backend *be;
	const struct ape_backend_plugin *orig; /* the backend's own table: orig_copy */
	/* a copy of be->raw as it was: binding a table rewrites the core's copy be->raw points at */
	struct ape_backend_plugin orig_copy;
	struct ape_backend_plugin ops; /* the wrapper's, which the core's table now calls */
	struct wrap_counts c;
	int fail_op; /* -1: none */
	uint64_t fail_at; /* c.calls[fail_op] value that fails */
	uint64_t total; /* fallible calls since install, for wrap_lose_device() */
	uint64_t lost_at; /* 0: the device works */
	struct sized {
		struct ape_be_buf *b;
		size_t n;
	} *bufs;
	size_t nbufs, cap;
	/* the queues with backward launches in flight, and the scratch those declared */
	struct held {
		const struct ape_be_queue *q;
		uint64_t scratch;
	} *held;
	size_t nheld, held_cap;
	/* events recorded after backward launches, and the scratch of those: held until a queue
	 * that waited for the event (or the event's own queue) is synchronised */
	struct ev_held {
		const struct ape_be_event *e;
		const struct ape_be_queue *q, *waiter;
		uint64_t scratch;
	} *evs;
	size_t nevs, evs_cap;
	/* every device of the backend, with its capabilities as the backend stated them */
	struct own_caps {
		struct ape_device *dev;
		struct ape_be_caps caps;
		uint64_t mem; /* info.global_mem_bytes */
	} *devs;
	size_t ndevs;
	uint64_t rows; /* wrap_rows_per_launch(); 0: none */
} w = { .lock = PTHREAD_MUTEX_INITIALIZER, .fail_op = -1 };

static const char *const op_names[WRAP_NOPS] = {
	[WRAP_BUF_ALLOC] = "buf_alloc",
	[WRAP_QUEUE_CREATE] = "queue_create",
	[WRAP_COPY_H2D] = "copy_h2d",
	[WRAP_COPY_D2H] = "copy_d2h",
	[WRAP_COPY_D2D] = "copy_d2d",
	[WRAP_FILL] = "fill",
	[WRAP_EVENT_RECORD] = "event_record",
	[WRAP_EVENT_WAIT] = "event_wait",
	[WRAP_EVENT_ELAPSED] = "event_elapsed",
	[WRAP_EVENT_TIMESTAMP] = "event_timestamp",
	[WRAP_ATTENTION] = "attention",
	[WRAP_SYNCHRONIZE] = "synchronize",
	[WRAP_HOST_REGISTER] = "host_register",
	[WRAP_BUF_WRAP] = "buf_wrap",
	[WRAP_QUEUE_WRAP] = "queue_wrap",
	[WRAP_ATTENTION_BACKWARD] = "attention_backward",
	[WRAP_SCRATCH_ALLOC] = "scratch_alloc",
	[WRAP_COPY_VIEW] = "copy_view",
	[WRAP_ATTENTION_MERGE] = "attention_merge",
};

const char *wrap_op_name(enum wrap_op op)
{
	return op < WRAP_NOPS ? op_names[op] : "?";
}

/* Scratch of a launch on queue q, held until q is synchronised or destroyed. */
static void scratch_hold(const struct ape_be_queue *q, uint64_t bytes)
{
	size_t i;

	pthread_mutex_lock(&w.lock);
	for (i = 0; i < w.nheld && w.held[i].q != q; i++)
		;
	if (i == w.nheld) {
		if (w.nheld == w.held_cap) {
			w.held_cap = w.held_cap ? 2 * w.held_cap : 16;
			w.held = realloc(w.held, w.held_cap * sizeof(*w.held));
			if (!w.held)
				abort();
		}
		w.held[w.nheld++] = (struct held){ q, 0 };
	}
	w.held[i].scratch += bytes;
	w.c.live_bytes += bytes;
	if (w.c.live_bytes > w.c.peak_bytes)
		w.c.peak_bytes = w.c.live_bytes;
	if (bytes > w.c.bwd_scratch_max)
		w.c.bwd_scratch_max = bytes;
	pthread_mutex_unlock(&w.lock);
}

/* q's launches have completed, and so have those before every event q was told to wait for:
 * their scratch is gone. */
static void scratch_release(const struct ape_be_queue *q)
{
	pthread_mutex_lock(&w.lock);
	for (size_t i = 0; i < w.nheld; i++)
		if (w.held[i].q == q) {
			w.c.live_bytes -= w.held[i].scratch;
			w.held[i] = w.held[--w.nheld];
			break;
		}
	for (size_t i = 0; i < w.nevs; i++)
		if (w.evs[i].q == q || w.evs[i].waiter == q) {
			w.c.live_bytes -= w.evs[i].scratch;
			w.evs[i].scratch = 0;
		}
	pthread_mutex_unlock(&w.lock);
}

/* Event e was recorded on q: the scratch of q's launches so far is held until e completes
 * (a pipelined executor never synchronises its compute queue while launches are in flight,
 * but waits for an event recorded after them on another queue). */
static void scratch_to_event(const struct ape_be_queue *q, const struct ape_be_event *e)
{
	pthread_mutex_lock(&w.lock);
	for (size_t i = 0; i < w.nheld; i++)
		if (w.held[i].q == q) {
			if (w.nevs == w.evs_cap) {
				w.evs_cap = w.evs_cap ? 2 * w.evs_cap : 16;
				w.evs = realloc(w.evs, w.evs_cap * sizeof(*w.evs));
				if (!w.evs)
					abort();
			}
			w.evs[w.nevs++] = (struct ev_held){ e, q, NULL, w.held[i].scratch };
			w.held[i] = w.held[--w.nheld];
			break;
		}
	pthread_mutex_unlock(&w.lock);
}

/* Queue q is told to wait for event e: once q is synchronised, e has completed. */
static void event_waited(const struct ape_be_queue *q, const struct ape_be_event *e)
{
	pthread_mutex_lock(&w.lock);
	for (size_t i = 0; i < w.nevs; i++)
		if (w.evs[i].e == e)
			w.evs[i].waiter = q;
	pthread_mutex_unlock(&w.lock);
}

/* Event e goes: what it still holds goes back to its queue (until that is synchronised). */
static void event_gone(const struct ape_be_event *e)
{
	const struct ape_be_queue *q = NULL;
	uint64_t bytes = 0;

	pthread_mutex_lock(&w.lock);
	for (size_t i = 0; i < w.nevs; i++)
		if (w.evs[i].e == e) {
			q = w.evs[i].q;
			bytes = w.evs[i].scratch;
			w.evs[i] = w.evs[--w.nevs];
			break;
		}
	w.c.live_bytes -= bytes; /* scratch_hold() counts it again, on its queue */
	pthread_mutex_unlock(&w.lock);
	if (bytes)
		scratch_hold(q, bytes);
}

/*
 * Counts one call of op and decides whether it fails. A failure reads like a backend's own: the
 * reason only, which the core's table puts behind the device and the op (core/backend.h).
 */
static int inject(enum wrap_op op)
{
	uint64_t n;
	bool lost, fail;
	int ret;

	pthread_mutex_lock(&w.lock);
	n = ++w.c.calls[op];
	w.total++;
	lost = w.lost_at && w.total >= w.lost_at;
	fail = lost || ((int)op == w.fail_op && n == w.fail_at);
	w.c.failed += fail;
	pthread_mutex_unlock(&w.lock);
	if (!fail)
		return 0;
	ret = lost || (op != WRAP_BUF_ALLOC && op != WRAP_BUF_WRAP && op != WRAP_SCRATCH_ALLOC)
		      ? APE_EDEVLOST
		      : APE_ENOMEM;
	return ape__error(ret, "wrapped backend: %s call %llu fails on purpose%s", op_names[op],
			  (unsigned long long)n, lost ? ": device lost" : "");
}

/* A buffer made (ret 0) or not: counted, and held until freed. */
static void count_alloc(int ret, struct ape_be_buf *b, size_t bytes)
{
	pthread_mutex_lock(&w.lock);
	w.c.allocs++;
	if (!ret) {
		if (w.nbufs == w.cap) {
			w.cap = w.cap ? 2 * w.cap : 256;
			w.bufs = realloc(w.bufs, w.cap * sizeof(*w.bufs));
			if (!w.bufs)
				abort();
		}
		w.bufs[w.nbufs++] = (struct sized){ b, bytes };
		w.c.live_bytes += bytes;
		if (w.c.live_bytes > w.c.peak_bytes)
			w.c.peak_bytes = w.c.live_bytes;
	}
	pthread_mutex_unlock(&w.lock);
}

static int w_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	int ret = inject(WRAP_BUF_ALLOC);

	if (ret) {
		*out = NULL;
		return ret;
	}
	ret = w.orig->buf_alloc(dev, bytes, out);
	count_alloc(ret, *out, bytes);
	return ret;
}

/* A wrapper of the caller's memory: counted and failed like an op, not as device memory held. */
static int w_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
		      struct ape_be_buf **out, size_t *bytes_out)
{
	int ret = inject(WRAP_BUF_WRAP);

	if (!ret && kind == APE_BE_MEM_HOST && bytes > dev->caps.max_alloc)
		/* as a backend refuses host memory past its largest buffer (OpenCL does), at the
		 * figure wrap_max_alloc() set */
		ret = ape_be_error(APE_EINVAL, "host memory of %zu bytes: more than the device's "
				   "largest buffer (%llu bytes, the test wrapper's)", bytes,
				   (unsigned long long)dev->caps.max_alloc);
	if (ret) {
		*out = NULL;
		*bytes_out = 0;
		return ret;
	}
	return w.orig->buf_wrap(dev, kind, handle, bytes, out, bytes_out);
}

static void count_free(struct ape_be_buf *b)
{
	pthread_mutex_lock(&w.lock);
	if (b) {
		/* a buffer buf_alloc made: buf_wrap's are neither counted nor held */
		for (size_t i = 0; i < w.nbufs; i++)
			if (w.bufs[i].b == b) {
				w.c.frees++;
				w.c.live_bytes -= w.bufs[i].n;
				w.bufs[i] = w.bufs[--w.nbufs];
				break;
			}
	}
	pthread_mutex_unlock(&w.lock);
}

static void w_free(struct ape_device *dev, struct ape_be_buf *b)
{
	count_free(b);
	w.orig->buf_free(dev, b);
}

/* Queue-ordered scratch (ABI 10): counted and held like buffers, freed by scratch_free. */
static int w_scratch_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out)
{
	int ret = inject(WRAP_SCRATCH_ALLOC);

	if (ret) {
		*out = NULL;
		return ret;
	}
	ret = w.orig->scratch_alloc(q, bytes, out);
	count_alloc(ret, *out, bytes);
	return ret;
}

static int w_scratch_free(struct ape_be_queue *q, struct ape_be_buf *b)
{
	count_free(b);
	return w.orig->scratch_free(q, b);
}

static int w_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c)
{
	int ret = inject(WRAP_COPY_VIEW);

	return ret ? ret : w.orig->copy_view(q, c);
}

static void bump(uint64_t *n)
{
	pthread_mutex_lock(&w.lock);
	(*n)++;
	pthread_mutex_unlock(&w.lock);
}

/* The pairs a finished launch with an lse_prior computed, into the counts. */
static int count_prior_pairs(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	const size_t rows = (size_t)(l->B * l->H * l->Lq);
	uint64_t *p, sum = 0;
	int ret;

	p = malloc(rows * sizeof(*p) + 1);
	if (!p)
		return APE_ENOMEM;
	ret = w.orig->synchronize(q);
	if (!ret)
		ret = w.orig->copy_d2h(q, p, l->pairs, 0, rows * sizeof(*p));
	if (!ret)
		ret = w.orig->synchronize(q);
	for (size_t r = 0; !ret && r < rows; r++)
		sum += p[r];
	free(p);
	if (!ret) {
		pthread_mutex_lock(&w.lock);
		w.c.prior_launches++;
		w.c.prior_pairs += sum;
		pthread_mutex_unlock(&w.lock);
	}
	return ret;
}

static int w_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	int ret = inject(WRAP_ATTENTION);

	bump(&w.c.attention_calls);
	if (!ret)
		ret = w.orig->attention(q, l);
	if (!ret && l->lse_prior && l->pairs)
		ret = count_prior_pairs(q, l);
	return ret;
}

static int w_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	int ret = inject(WRAP_ATTENTION_BACKWARD);

	if (ret)
		return ret;
	if (w.orig->attention_backward_scratch)
		scratch_hold(q, w.orig->attention_backward_scratch(ape_be_queue_dev(q), l,
								    ape_be_bwd_parts(l)));
	return w.orig->attention_backward(q, l);
}

static int w_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src, size_t n)
{
	int ret = inject(WRAP_COPY_H2D);

	bump(&w.c.h2d_calls);
	return ret ? ret : w.orig->copy_h2d(q, dst, off, src, n);
}

static int w_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off, size_t n)
{
	int ret = inject(WRAP_COPY_D2H);

	bump(&w.c.d2h_calls);
	return ret ? ret : w.orig->copy_d2h(q, dst, src, off, n);
}

static int w_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t doff, struct ape_be_buf *src,
		 size_t soff, size_t n)
{
	int ret = inject(WRAP_COPY_D2D);

	bump(&w.c.d2d_calls);
	return ret ? ret : w.orig->copy_d2d(q, dst, doff, src, soff, n);
}

static int w_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	int ret = inject(WRAP_QUEUE_CREATE);

	if (ret) {
		*out = NULL;
		return ret;
	}
	return w.orig->queue_create(dev, out);
}

static int w_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out)
{
	int ret = inject(WRAP_QUEUE_WRAP);

	if (ret) {
		*out = NULL;
		return ret;
	}
	return w.orig->queue_wrap(dev, handle, out);
}

static void w_queue_destroy(struct ape_be_queue *q)
{
	/* before the handle goes (another thread may get its address next): queue_destroy waits
	 * for the work, and nothing is allocated on q meanwhile */
	scratch_release(q);
	w.orig->queue_destroy(q);
}

static int w_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		  size_t n)
{
	int ret = inject(WRAP_FILL);

	return ret ? ret : w.orig->fill(q, dst, off, pattern, n);
}

static int w_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	int ret = inject(WRAP_EVENT_RECORD);

	if (ret) {
		*out = NULL;
		return ret;
	}
	ret = w.orig->event_record(q, out);
	if (!ret)
		scratch_to_event(q, *out);
	return ret;
}

static void w_event_destroy(struct ape_be_event *e)
{
	if (e)
		event_gone(e); /* before the handle goes: its address may come back */
	w.orig->event_destroy(e);
}

static int w_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	int ret = inject(WRAP_EVENT_WAIT);

	if (!ret)
		ret = w.orig->event_wait(q, e);
	if (!ret)
		event_waited(q, e);
	return ret;
}

static int w_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m)
{
	int ret = inject(WRAP_ATTENTION_MERGE);

	return ret ? ret : w.orig->attention_merge(q, m);
}

static int w_event_elapsed(struct ape_be_event *a, struct ape_be_event *b, double *ms)
{
	int ret = inject(WRAP_EVENT_ELAPSED);

	if (ret) {
		*ms = 0;
		return ret;
	}
	return w.orig->event_elapsed(a, b, ms);
}

static int w_event_timestamp(struct ape_be_event *e, double *ms)
{
	int ret = inject(WRAP_EVENT_TIMESTAMP);

	if (ret) {
		*ms = 0;
		return ret;
	}
	return w.orig->event_timestamp(e, ms);
}

static int w_synchronize(struct ape_be_queue *q)
{
	int ret = inject(WRAP_SYNCHRONIZE);

	/* a failed synchronisation still leaves the queue drained, as a real lost device's does
	 * once the driver gives up: the core may then free buffers the queue was using */
	if (ret) {
		w.orig->synchronize(q);
		scratch_release(q);
		return ret;
	}
	ret = w.orig->synchronize(q);
	scratch_release(q); /* failed or not, nothing of q is still running */
	return ret;
}

static int w_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle)
{
	int ret = inject(WRAP_HOST_REGISTER);

	if (ret) {
		*handle = NULL;
		return ret;
	}
	return w.orig->host_register(dev, ptr, bytes, handle);
}

/* Keeps every device of w.be with its capabilities as stated, and takes from each what a hidden
 * op takes with it. */
static void caps_hide(unsigned flags)
{
	struct ape_context *ctx = w.be->ctx;

	w.devs = calloc((size_t)ctx->ndevices + 1, sizeof(*w.devs));
	if (!w.devs)
		abort();
	w.ndevs = 0;
	for (int i = 0; i < ctx->ndevices; i++) {
		struct ape_device *d = ctx->devices[i];

		if (d->be != w.be)
			continue;
		w.devs[w.ndevs++] = (struct own_caps){ d, d->caps, d->info.global_mem_bytes };
		if (flags & WRAP_NO_TIMESTAMP)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_TIMESTAMPS;
		if (flags & (WRAP_NO_BUF_WRAP | WRAP_NO_HOST_MEMORY))
			d->caps.features &= ~(uint64_t)APE_BE_CAP_HOST_MEMORY;
		if (flags & (WRAP_NO_DIAG_VIEWS | WRAP_NO_DIAG))
			d->caps.features &= ~(uint64_t)APE_BE_CAP_DIAG_VIEWS;
		if (flags & WRAP_NO_DIAG)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_DIAG;
		if (flags & WRAP_NO_RESIDENT_BWD)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_RESIDENT_BACKWARD;
		if (flags & WRAP_NO_POSITIONS)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_POSITIONS;
		if (flags & WRAP_NO_BWD_SEGMENTS)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_BWD_SEGMENTS;
		if (flags & WRAP_NO_BWD_VIEWS)
			d->caps.features &= ~(uint64_t)APE_BE_CAP_BWD_VIEWS;
	}
}

void wrap_max_alloc(uint64_t bytes)
{
	for (size_t i = 0; i < w.ndevs; i++) {
		const uint64_t own = w.devs[i].caps.max_alloc;

		w.devs[i].dev->caps.max_alloc = bytes && bytes < own ? bytes : own;
	}
}

/* Makes t the table the core's calls go to, checked as any backend's. */
static void bind_table(const struct ape_backend_plugin *t)
{
	char why[256];

	if (ape__backend_bind(w.be, t, why, sizeof(why))) {
		fprintf(stderr, "wrapops: %s\n", why);
		abort();
	}
}

/* The device memory wrap_rows_per_launch() makes each device say it has, and what of the
 * default budget (three quarters of it) it leaves to the backend's own scratch. */
#define ROWS_MEM ((uint64_t)1 << 40)
#define ROWS_OWN ((uint64_t)1 << 30)

/* The backend's own scratch, and (budget - ROWS_OWN) / w.rows more per query row: the budget
 * holds w.rows rows (the backend's own under ROWS_OWN), never one more (w.rows < 700). */
static uint64_t w_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	const uint64_t own = w.orig->attention_scratch ? w.orig->attention_scratch(dev, l) : 0;

	return own + (uint64_t)l->Lq * ((ROWS_MEM / 4 * 3 - ROWS_OWN) / w.rows);
}

void wrap_rows_per_launch(uint64_t rows)
{
	w.rows = rows;
	w.ops.attention_scratch = rows ? w_attention_scratch : w.orig->attention_scratch;
	for (size_t i = 0; i < w.ndevs; i++)
		w.devs[i].dev->info.global_mem_bytes = rows ? ROWS_MEM : w.devs[i].mem;
	bind_table(&w.ops);
}

void wrap_install(ape_device *dev, unsigned flags)
{
	w.be = dev->be;
	w.orig_copy = *dev->be->raw;
	w.orig = &w.orig_copy;
	w.ops = *w.orig;
	w.ops.buf_alloc = w_alloc;
	w.ops.buf_free = w_free;
	w.ops.queue_create = w_queue_create;
	w.ops.queue_destroy = w_queue_destroy;
	w.ops.attention = w_attention;
	w.ops.copy_h2d = w_h2d;
	w.ops.copy_d2h = w_d2h;
	w.ops.copy_d2d = w.orig->copy_d2d ? w_d2d : NULL;
	w.ops.fill = w_fill;
	w.ops.event_record = w_event_record;
	w.ops.event_wait = w_event_wait;
	w.ops.event_elapsed = w_event_elapsed;
	w.ops.event_timestamp = w.orig->event_timestamp ? w_event_timestamp : NULL;
	w.ops.synchronize = w_synchronize;
	w.ops.host_register = w.orig->host_register ? w_host_register : NULL;
	w.ops.buf_wrap = w.orig->buf_wrap ? w_buf_wrap : NULL;
	w.ops.queue_wrap = w.orig->queue_wrap ? w_queue_wrap : NULL;
	w.ops.attention_backward = w.orig->attention_backward ? w_attention_backward : NULL;
	w.ops.scratch_alloc = w.orig->scratch_alloc ? w_scratch_alloc : NULL;
	w.ops.scratch_free = w.orig->scratch_free ? w_scratch_free : NULL;
	w.ops.copy_view = w.orig->copy_view ? w_copy_view : NULL;
	w.ops.event_destroy = w_event_destroy;
	w.ops.attention_merge = w.orig->attention_merge ? w_attention_merge : NULL;
	if (flags & WRAP_NO_MERGE)
		w.ops.attention_merge = NULL;
	if (flags & WRAP_NO_BWD_SCRATCH)
		w.ops.attention_backward_scratch = NULL;
	if (flags & WRAP_NO_BUF_WRAP)
		w.ops.buf_wrap = NULL;
	if (flags & WRAP_NO_COPY_D2D)
		w.ops.copy_d2d = NULL;
	if (flags & WRAP_NO_TIMESTAMP)
		w.ops.event_timestamp = NULL;
	if (flags & WRAP_NO_SCRATCH)
		w.ops.attention_scratch = NULL;
	if (flags & WRAP_NO_PAGES)
		w.ops.attention_pages = NULL;
	memset(&w.c, 0, sizeof(w.c));
	w.fail_op = -1;
	w.fail_at = w.total = w.lost_at = 0;
	caps_hide(flags);
	bind_table(&w.ops);
}

void wrap_remove(void)
{
	if (w.be)
		bind_table(w.orig);
	for (size_t i = 0; i < w.ndevs; i++) {
		w.devs[i].dev->caps = w.devs[i].caps;
		w.devs[i].dev->info.global_mem_bytes = w.devs[i].mem;
	}
	w.rows = 0;
	w.be = NULL;
	free(w.devs);
	w.devs = NULL;
	w.ndevs = 0;
	free(w.bufs);
	w.bufs = NULL;
	w.nbufs = w.cap = 0;
	free(w.held);
	free(w.evs);
	w.evs = NULL;
	w.nevs = w.evs_cap = 0;
	w.held = NULL;
	w.nheld = w.held_cap = 0;
}

struct wrap_counts wrap_get(void)
{
	struct wrap_counts c;

	pthread_mutex_lock(&w.lock);
	c = w.c;
	pthread_mutex_unlock(&w.lock);
	return c;
}

void wrap_reset(void)
{
	pthread_mutex_lock(&w.lock);
	w.c.allocs = w.c.frees = w.c.attention_calls = 0;
	w.c.prior_launches = w.c.prior_pairs = 0;
	w.c.h2d_calls = w.c.d2h_calls = w.c.d2d_calls = 0;
	memset(w.c.calls, 0, sizeof(w.c.calls));
	w.c.failed = 0;
	w.c.bwd_scratch_max = 0;
	w.c.peak_bytes = w.c.live_bytes;
	pthread_mutex_unlock(&w.lock);
}

void wrap_fail_op(enum wrap_op op, uint64_t n)
{
	pthread_mutex_lock(&w.lock);
	w.fail_op = n ? (int)op : -1;
	w.fail_at = n ? w.c.calls[op] + n : 0;
	pthread_mutex_unlock(&w.lock);
}

void wrap_fail_attention(uint64_t n)
{
	wrap_fail_op(WRAP_ATTENTION, n);
}

void wrap_lose_device(uint64_t k)
{
	pthread_mutex_lock(&w.lock);
	w.lost_at = k ? w.total + k : 0;
	pthread_mutex_unlock(&w.lock);
}
