/* SPDX-License-Identifier: MIT */
/* The work queue of outer chunks shared by the workers of one call (exec/workq.h). */
#include "exec/workq.h"

#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"

void ape__workq_init(struct ape__workq *w)
{
	memset(w, 0, sizeof(*w));
	pthread_mutex_init(&w->lock, NULL);
}

void ape__workq_fini(struct ape__workq *w)
{
	pthread_mutex_destroy(&w->lock);
}

int ape__workq_create(struct ape__workq **out)
{
	struct ape__workq *w = ape__calloc(1, sizeof(*w));

	*out = w;
	if (!w)
		return ape__error(APE_ENOMEM, "out of memory for a work queue");
	ape__workq_init(w);
	return 0;
}

void ape__workq_destroy(struct ape__workq *w)
{
	if (!w)
		return;
	ape__workq_fini(w);
	free(w);
}

void ape__workq_set(struct ape__workq *w, int n, const int64_t *bounds, bool steal)
{
	w->n = n;
	w->steal = steal;
	for (int i = 0; i < n; i++) {
		w->begin[i] = bounds[i];
		w->end[i] = bounds[i + 1];
	}
}

void ape__workq_single(struct ape__workq *w, int64_t nq)
{
	const int64_t bounds[2] = { 0, nq };

	ape__workq_set(w, 1, bounds, false);
}

int64_t ape__workq_next(struct ape__workq *w, int who)
{
	int64_t qc = -1;
	int victim = -1;

	pthread_mutex_lock(&w->lock);
	if (w->begin[who] < w->end[who]) {
		qc = w->begin[who]++;
	} else if (w->steal) {
		for (int d = 0; d < w->n; d++)
			if (w->end[d] > w->begin[d] &&
			    (victim < 0 ||
			     w->end[d] - w->begin[d] > w->end[victim] - w->begin[victim]))
				victim = d;
		/* the far end of its range: the victim keeps the chunks next to its own */
		if (victim >= 0)
			qc = --w->end[victim];
	}
	pthread_mutex_unlock(&w->lock);
	return qc;
}
