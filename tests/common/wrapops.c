/* SPDX-License-Identifier: MIT */
#include "wrapops.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

/* Test-only global state: the ops struct has no user pointer, and one wrapper is enough. */
static struct {
	pthread_mutex_t lock;
	struct ape__backend *be;
	const struct ape__backend_ops *orig;
	struct ape__backend_ops ops;
	struct wrap_counts c;
	uint64_t fail_at;
	struct sized {
		struct ape__buf *b;
		size_t n;
	} *bufs;
	size_t nbufs, cap;
} w = { .lock = PTHREAD_MUTEX_INITIALIZER };

static int w_alloc(struct ape_device *dev, size_t bytes, struct ape__buf **out)
{
	int ret = w.orig->buf_alloc(dev, bytes, out);

	pthread_mutex_lock(&w.lock);
	w.c.allocs++;
	if (!ret) {
		if (w.nbufs == w.cap) {
			w.cap = w.cap ? 2 * w.cap : 256;
			w.bufs = realloc(w.bufs, w.cap * sizeof(*w.bufs));
			if (!w.bufs)
				abort();
		}
		w.bufs[w.nbufs++] = (struct sized){ *out, bytes };
		w.c.live_bytes += bytes;
		if (w.c.live_bytes > w.c.peak_bytes)
			w.c.peak_bytes = w.c.live_bytes;
	}
	pthread_mutex_unlock(&w.lock);
	return ret;
}

static void w_free(struct ape_device *dev, struct ape__buf *b)
{
	pthread_mutex_lock(&w.lock);
	if (b) {
		w.c.frees++;
		for (size_t i = 0; i < w.nbufs; i++)
			if (w.bufs[i].b == b) {
				w.c.live_bytes -= w.bufs[i].n;
				w.bufs[i] = w.bufs[--w.nbufs];
				break;
			}
	}
	pthread_mutex_unlock(&w.lock);
	w.orig->buf_free(dev, b);
}

static int w_attention(struct ape__queue *q, const struct ape__launch *l)
{
	bool fail;

	pthread_mutex_lock(&w.lock);
	w.c.attention_calls++;
	fail = w.fail_at && w.c.attention_calls == w.fail_at;
	pthread_mutex_unlock(&w.lock);
	if (fail)
		return ape__error(APE_EDEVLOST, "wrapped backend: launch %llu fails on purpose",
				  (unsigned long long)w.fail_at);
	return w.orig->attention(q, l);
}

static void bump(uint64_t *n)
{
	pthread_mutex_lock(&w.lock);
	(*n)++;
	pthread_mutex_unlock(&w.lock);
}

static int w_h2d(struct ape__queue *q, struct ape__buf *dst, size_t off, const void *src, size_t n)
{
	bump(&w.c.h2d_calls);
	return w.orig->copy_h2d(q, dst, off, src, n);
}

static int w_d2h(struct ape__queue *q, void *dst, struct ape__buf *src, size_t off, size_t n)
{
	bump(&w.c.d2h_calls);
	return w.orig->copy_d2h(q, dst, src, off, n);
}

static int w_d2d(struct ape__queue *q, struct ape__buf *dst, size_t doff, struct ape__buf *src,
		 size_t soff, size_t n)
{
	bump(&w.c.d2d_calls);
	return w.orig->copy_d2d(q, dst, doff, src, soff, n);
}

void wrap_install(ape_device *dev, unsigned flags)
{
	w.be = dev->be;
	w.orig = dev->be->ops;
	w.ops = *w.orig;
	w.ops.buf_alloc = w_alloc;
	w.ops.buf_free = w_free;
	w.ops.attention = w_attention;
	w.ops.copy_h2d = w_h2d;
	w.ops.copy_d2h = w_d2h;
	w.ops.copy_d2d = w.orig->copy_d2d ? w_d2d : NULL;
	if (flags & WRAP_NO_COPY_D2D)
		w.ops.copy_d2d = NULL;
	if (flags & WRAP_NO_TIMESTAMP)
		w.ops.event_timestamp = NULL;
	if (flags & WRAP_NO_SCRATCH)
		w.ops.attention_scratch = NULL;
	memset(&w.c, 0, sizeof(w.c));
	w.fail_at = 0;
	dev->be->ops = &w.ops;
}

void wrap_remove(void)
{
	if (w.be)
		w.be->ops = w.orig;
	w.be = NULL;
	free(w.bufs);
	w.bufs = NULL;
	w.nbufs = w.cap = 0;
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
	w.c.h2d_calls = w.c.d2h_calls = w.c.d2d_calls = 0;
	w.c.peak_bytes = w.c.live_bytes;
	pthread_mutex_unlock(&w.lock);
}

void wrap_fail_attention(uint64_t n)
{
	pthread_mutex_lock(&w.lock);
	w.fail_at = n ? w.c.attention_calls + n : 0;
	pthread_mutex_unlock(&w.lock);
}
