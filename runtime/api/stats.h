/* SPDX-License-Identifier: MIT */
/*
 * ape_stats, filled in one place for every kind of call (a forward call on one device or
 * several, a KV-cache attend), so that each reports every field the same way.
 */
#ifndef APE_RUNTIME_API_STATS_H
#define APE_RUNTIME_API_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "exec/multidev.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/* What a call has to report. */
struct ape__call_report {
	const char *fn; /* the public call (the call log's line; may be NULL for stats only) */
	const struct ape__problem *p; /* its validated problem, or NULL (failed before one) */
	int ret; /* what the call returns: 0, or the code whose message is set */
	/* the launches did not count the pairs they computed (a call without statistics: counting
	 * them would change the kernel path a log line describes) */
	bool pairs_uncounted;
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

/* Does a call on these devices log a line (APE_VERBOSE, the context's option)? Then it builds
 * its report even when the caller wants no statistics. */
bool ape__call_logs(ape_device *const *devs, int ndev);

/* One line of the call log: a call's figures, as its statistics say them. */
struct ape__call_log {
	const char *fn;
	ape_device *const *devs;
	int ndev;
	const struct ape__problem *p; /* NULL: no shape to say */
	int ret; /* 0, or the failure whose message is set */
	const ape_stats *st; /* its statistics (a full ape_stats), when ret is 0 */
	const struct ape_be_path_log *paths; /* NULL: st->path names the paths, without counts */
	bool async; /* enqueued on a queue: st holds the host's time only (total_ms) */
	bool pairs_uncounted; /* st->pairs_computed is not known */
	const int64_t *shares; /* NULL, or each device's outer chunks (level 2 says them) */
};

/* Logs the line when the devices' level says so (a call nested in another public call only at
 * level 2); a failure's line marks the error as logged (core/verbose.h). */
void ape__call_log(const struct ape__call_log *r);

/* The line of an asynchronous call on dev (enqueued on a queue, running after it returns):
 * its problem, the kernel paths its launches took, the host's time since t0. */
void ape__call_log_async(const char *fn, ape_device *dev, const struct ape__problem *p,
			 int ret, const struct ape_be_path_log *paths, double t0);

/* The end of a call: fills *stats when it succeeded and stats is not NULL (as
 * ape__stats_report()), and logs its line (docs/profiling.md) when ape__call_logs(). */
void ape__call_done(ape_stats *stats, const struct ape__call_report *r);

#pragma GCC visibility pop
#endif
