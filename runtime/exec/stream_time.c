/* SPDX-License-Identifier: MIT */
/*
 * Device times of a run: every copy and launch between its two events adds to kernel_ms or
 * copy_ms; with event timestamps it also becomes an interval for the overlap figure (how long
 * copies and kernels ran at once) and a span of the trace.
 */
#include "exec/stream_impl.h"

#include <math.h>
#include <stdlib.h>

#include "core/alloc.h"

static void add_interval(struct ape__stream *s, double t0, double t1, bool kernel)
{
	if (s->niv == s->capiv) {
		size_t cap = s->capiv ? 2 * s->capiv : 64;
		struct interval *iv = ape__realloc(s->iv, cap * sizeof(*iv));

		if (!iv) /* only a statistic: stop measuring overlap */
			return;
		s->iv = iv;
		s->capiv = cap;
	}
	s->iv[s->niv++] = (struct interval){ t0, t1, kernel };
}

void ape__stream_reserve_intervals(struct ape__stream *s, size_t n)
{
	struct interval *iv;

	if (!ape_be_caps_have(&s->dev->caps, APE_BE_CAP_TIMESTAMPS) || n <= s->capiv)
		return;
	iv = ape__realloc(s->iv, n * sizeof(*iv));
	if (!iv)
		return;
	s->iv = iv;
	s->capiv = n;
}

int ape__stream_span(struct ape__stream *s, struct ape_be_event *e0, struct ape_be_event *e1,
		     int lane, const char *what, int64_t qc, int64_t kc, uint64_t bytes,
		     double host_t, double enq, double *end)
{
	const struct ape_backend_plugin *ops = s->ops;
	double ms = 0, t0 = host_t, t1;
	int ret = ops->event_elapsed(e0, e1, &ms);

	if (ret)
		return ret;
	if (lane == APE__LANE_KERNEL)
		s->st->kernel_ms += ms;
	else
		s->st->copy_ms += ms;
	t1 = host_t + ms;
	if (ape_be_caps_have(&s->dev->caps, APE_BE_CAP_TIMESTAMPS)) {
		/* the span's work ended at e1 and ran for ms: e0's own time would also count the
		 * wait for what the queue was told to wait for, and overlap would exceed the
		 * copies' and kernels' device times */
		if ((ret = ops->event_timestamp(e1, &t1)))
			return ret;
		t0 = t1 - ms;
		add_interval(s, t0, t1, lane == APE__LANE_KERNEL);
	}
	if (s->trace)
		ape__trace_add(s->trace, what, lane, t0, t1, enq, qc, kc, bytes);
	if (end)
		*end = t1;
	return 0;
}

static int cmp_interval(const void *a, const void *b)
{
	const struct interval *x = a, *y = b;

	return x->t0 < y->t0 ? -1 : x->t0 > y->t0;
}

/* Length of the union of the intervals that `pick` selects (0: copies, 1: kernels, 2: all);
 * the array is sorted by start. */
static double union_len(const struct interval *iv, size_t n, int pick)
{
	double total = 0, a = 0, b = -INFINITY;

	for (size_t i = 0; i < n; i++) {
		if (pick != 2 && iv[i].kernel != (pick == 1))
			continue;
		if (iv[i].t0 > b) {
			if (b > a)
				total += b - a;
			a = iv[i].t0;
			b = iv[i].t1;
		} else if (iv[i].t1 > b) {
			b = iv[i].t1;
		}
	}
	if (b > a)
		total += b - a;
	return total;
}

/* |copies| + |kernels| - |copies u kernels| */
double ape__stream_overlap_ms(struct ape__stream *s)
{
	if (!s->niv)
		return 0;
	qsort(s->iv, s->niv, sizeof(*s->iv), cmp_interval);
	return fmax(0.0, union_len(s->iv, s->niv, 0) + union_len(s->iv, s->niv, 1) -
			 union_len(s->iv, s->niv, 2));
}
