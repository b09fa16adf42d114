/* SPDX-License-Identifier: MIT */
/*
 * ape_stats, filled in one place for every kind of call (a forward call on one device or
 * several, a KV-cache attend), so that each reports every field the same way.
 */
#ifndef APE_RUNTIME_API_STATS_H
#define APE_RUNTIME_API_STATS_H

#include <stdint.h>

#include "exec/multidev.h"

#pragma GCC visibility push(hidden)

/* What a call has to report. */
struct ape__call_report {
	const struct ape__exec_result *res; /* the executor's figures (zeros when nothing ran) */
	ape_device *const *devs; /* the devices named in backend and device */
	int ndev;
	int devices; /* devices that took part */
	uint64_t pairs_visible; /* all batches and heads */
	double t0; /* ape__now_ms() when the call began */
};

/* APE_EINVAL naming stats->struct_size unless stats is NULL or of a size this libape knows. */
int ape__stats_check(const char *fn, const ape_stats *stats);

/* Fills *stats (its caller's struct_size, checked by ape__stats_check()) from what the call
 * reports; total_ms runs until now. */
void ape__stats_report(ape_stats *stats, const struct ape__call_report *r);

#pragma GCC visibility pop
#endif
