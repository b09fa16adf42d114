/* SPDX-License-Identifier: MIT */
/* ape-run --stats: the report, and the sum a KV-cache run makes of its steps' statistics. */
#include <inttypes.h>
#include <stdio.h>

#include "run/run.h"

void run_stats_add(ape_stats *tot, const ape_stats *st)
{
	tot->pairs_visible += st->pairs_visible;
	tot->pairs_computed += st->pairs_computed;
	tot->kernel_ms += st->kernel_ms;
	tot->bytes_to_device += st->bytes_to_device;
	tot->bytes_from_device += st->bytes_from_device;
	tot->bytes_device_to_device += st->bytes_device_to_device;
	tot->chunks += st->chunks;
	tot->chunks_skipped += st->chunks_skipped;
	tot->copy_ms += st->copy_ms;
	tot->chunk_q = st->chunk_q;
	tot->chunk_k = st->chunk_k;
	tot->pipeline_depth = st->pipeline_depth;
	tot->devices = st->devices;
	tot->device_budget = st->device_budget;
	if (st->peak_device_bytes > tot->peak_device_bytes)
		tot->peak_device_bytes = st->peak_device_bytes;
	snprintf(tot->backend, sizeof(tot->backend), "%s", st->backend);
	snprintf(tot->device, sizeof(tot->device), "%s", st->device);
	snprintf(tot->path, sizeof(tot->path), "%s", st->path);
}

static void print_budget(uint64_t budget, char *buf, size_t len)
{
	if (budget == UINT64_MAX)
		snprintf(buf, len, "no budget");
	else
		snprintf(buf, len, "a budget of %" PRIu64 " bytes", budget);
}

void run_stats_print(const ape_stats *st, const char *label)
{
	double secs = st->total_ms / 1e3;
	char budget[64];

	fprintf(stderr, "ape-run: %sbackend %s, device %s\n", label, st->backend, st->device);
	fprintf(stderr, "ape-run: %stime total_ms %.3f, kernel_ms %.3f\n", label, st->total_ms,
		st->kernel_ms);
	fprintf(stderr,
		"ape-run: %spairs visible %" PRIu64 ", computed %" PRIu64 ", %.4g visible pairs/s "
		"(over total_ms)\n", label, st->pairs_visible, st->pairs_computed,
		secs > 0 ? (double)st->pairs_visible / secs : 0.0);
	fprintf(stderr,
		"ape-run: %schunks computed %" PRIu64 ", skipped %" PRIu64 " (%" PRId64 " x %" PRId64
		" rows, %d in flight, %d device%s)\n",
		label, st->chunks, st->chunks_skipped, st->chunk_q, st->chunk_k, st->pipeline_depth,
		st->devices, st->devices == 1 ? "" : "s");
	fprintf(stderr,
		"ape-run: %sbytes copied to device %" PRIu64 ", from device %" PRIu64
		", within device %" PRIu64 "\n",
		label, st->bytes_to_device, st->bytes_from_device, st->bytes_device_to_device);
	print_budget(st->device_budget, budget, sizeof(budget));
	fprintf(stderr, "ape-run: %speak device memory %" PRIu64 " bytes (%s)\n", label,
		st->peak_device_bytes, budget);
	fprintf(stderr,
		"ape-run: %scopies %.3f ms of device time, %.3f ms overlapped with kernels\n",
		label, st->copy_ms, st->overlap_ms);
	fprintf(stderr, "ape-run: %skernel path %s (docs/profiling.md)\n", label,
		st->path[0] ? st->path : "none");
}
