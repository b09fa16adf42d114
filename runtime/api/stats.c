/* SPDX-License-Identifier: MIT */
/* ape_stats: its initialiser, its check and its one builder (api/stats.h). */
#include "api/stats.h"

#include <stdio.h>
#include <string.h>

#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"

void ape_stats_init(ape_stats *st)
{
	if (!st)
		return;
	memset(st, 0, sizeof(*st));
	st->struct_size = sizeof(*st);
}

int ape__stats_check(const char *fn, const ape_stats *stats)
{
	if (stats && stats->struct_size != sizeof(*stats) &&
	    stats->struct_size != APE_STATS_V1_SIZE)
		return ape__error(APE_EINVAL,
				  "%s: stats->struct_size = %zu: expected %zu (initialise with "
				  "ape_stats_init())",
				  fn, stats->struct_size, sizeof(*stats));
	return 0;
}

/* Backends and device names, each once, in device order. */
static void names(ape_stats *st, ape_device *const *devs, int ndev)
{
	size_t nb = 0, nd = 0;

	st->backend[0] = st->device[0] = '\0';
	for (int i = 0; i < ndev; i++) {
		bool seen_be = false, seen_dev = false;

		for (int j = 0; j < i; j++) {
			seen_be |= !strcmp(devs[j]->info.backend, devs[i]->info.backend);
			seen_dev |= devs[j] == devs[i];
		}
		if (!seen_be && nb < sizeof(st->backend))
			nb += (size_t)snprintf(st->backend + nb, sizeof(st->backend) - nb, "%s%s",
					       nb ? "+" : "", devs[i]->info.backend);
		if (!seen_dev && nd < sizeof(st->device))
			nd += (size_t)snprintf(st->device + nd, sizeof(st->device) - nd, "%s%s",
					       nd ? " + " : "", devs[i]->info.name);
	}
}

void ape__stats_report(ape_stats *stats, const struct ape__call_report *r)
{
	const struct ape__exec_result *res = r->res;
	ape_stats st;

	ape_stats_init(&st);
	st.pairs_visible = r->pairs_visible;
	st.pairs_computed = res->pairs_computed;
	st.kernel_ms = res->st.kernel_ms;
	st.bytes_to_device = res->st.h2d;
	st.bytes_from_device = res->st.d2h;
	st.bytes_device_to_device = res->st.d2d;
	names(&st, r->devs, r->ndev);
	st.chunks = res->st.chunks;
	st.chunks_skipped = res->chunks_skipped;
	st.chunk_q = res->cq;
	st.chunk_k = res->ck;
	st.pipeline_depth = res->depth;
	st.devices = r->devices;
	st.device_budget = res->budget;
	st.peak_device_bytes = res->st.peak_bytes;
	st.copy_ms = res->st.copy_ms;
	st.overlap_ms = res->st.overlap_ms;
	st.total_ms = ape__now_ms() - r->t0;
	/* what the caller's version of ape_stats has room for */
	st.struct_size = stats->struct_size;
	memcpy(stats, &st, stats->struct_size);
}
