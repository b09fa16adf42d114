/* SPDX-License-Identifier: MIT */
/*
 * ape-bench: times the forward pass on chosen shapes and backends (with --backward, the forward
 * and the backward pass on the same inputs, side by side).
 *
 * For every (sequence length, skip tolerance) it runs warm-up calls, then timed repeats, and
 * reports the median and spread of the wall time, visible pairs per second, dense-equivalent
 * GFLOP/s (4 * D FLOPs per visible pair, the FlashAttention convention), the pairs actually
 * computed after skipping, and the largest error against the float64 reference on sampled rows.
 *
 * --resident times the device-resident call instead, beside the host call on the same inputs:
 * the tensors are written to device buffers once (ape_buffer_alloc, ape_buffer_write), then
 * each timed call is ape_attention_enqueue() + ape_queue_synchronize().
 *
 * This file holds main and the host call's mode; the options, the inputs and the other modes
 * live in tools/bench/ (bench.h says which file holds what).
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "bench/bench.h"
#include "common/mpi_exec.h"
#include "common/numa_bench.h"
#include "common/refcheck.h"
#include "common/rng.h"
#include "common/seed.h"

struct bench_row {
	struct row_key key;
	double median_ms, min_ms, max_ms, kernel_ms;
	uint64_t pairs_visible, pairs_computed;
	struct refcheck_result check;
	/* --backward: the same statistics of the backward call, and the median over the rounds
	 * of each round's backward / forward wall time (a round's two calls run back to back, so
	 * their ratio varies less on a shared machine than either time) */
	double bwd_median_ms, bwd_min_ms, bwd_max_ms, bwd_kernel_ms, ratio;
	uint64_t bwd_pairs_computed;
};

static int bench_one(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
		     double skip_tol, ape_rng *rng, void *out)
{
	struct bench_row *row = out;
	struct host_times ht;
	struct inputs in;
	ape_attn_desc desc;
	int ret;

	memset(row, 0, sizeof(*row));
	if ((ret = bench_host_row(dev, o, L, skip_tol, rng, &row->key, &in, &desc, &ht)))
		return ret;
	row->pairs_visible = ht.last.pairs_visible;
	row->pairs_computed = ht.last.pairs_computed;
	row->median_ms = ht.median_ms;
	row->min_ms = ht.min_ms;
	row->max_ms = ht.max_ms;
	row->kernel_ms = ht.kernel_ms;
	row->bwd_pairs_computed = ht.bwd_last.pairs_computed;
	row->bwd_median_ms = ht.bwd_median_ms;
	row->bwd_min_ms = ht.bwd_min_ms;
	row->bwd_max_ms = ht.bwd_max_ms;
	row->bwd_kernel_ms = ht.bwd_kernel_ms;
	row->ratio = ht.ratio;
	if (o->check_rows > 0)
		ret = refcheck_sampled(ref, &desc, &in.tq, &in.tk, &in.tv, &in.to, in.lse,
				       o->check_rows, rng, &row->check);
	bench_free_inputs(&in);
	return ret;
}

static void print_table(const ape_device_info *info, const struct bench_opts *o,
			const void *table, int n)
{
	bench_table_head("", info, o);
	printf("; delta=%g beta=%g gamma=%g lambda=%g; %d repeats\n", (double)o->delta,
	       (double)o->beta, (double)o->gamma, (double)o->lambda, o->repeats);
	printf("%8s %10s %10s %8s %11s %9s %9s %9s %10s %10s", "L", "skip_tol", "median_ms",
	       "spread", "kernel_ms", "Mpairs/s", "GFLOP/s", "computed", "err_O", "err_LSE");
	if (o->backward)
		printf(" %10s %8s %11s %9s %8s", "bwd_ms", "spread", "bwd_kernel", "computed",
		       "bwd/fwd");
	printf("\n");
	for (int i = 0; i < n; i++) {
		const struct bench_row *r = (const struct bench_row *)table + i;
		double sec = r->median_ms * 1e-3;
		double pps = sec > 0 ? (double)r->pairs_visible / sec : 0;

		printf("%8" PRId64 " %10.3g %10.2f %7.1f%% %11.2f %9.1f %9.1f %8.2f%%", r->key.L,
		       r->key.skip_tol, r->median_ms,
		       r->median_ms > 0 ? 100 * (r->max_ms - r->min_ms) / r->median_ms : 0,
		       r->kernel_ms, pps * 1e-6, pps * 4.0 * (double)o->D * 1e-9,
		       r->pairs_visible ? 100.0 * (double)r->pairs_computed / (double)r->pairs_visible
					: 0);
		bench_print_check(&r->check, 10);
		if (o->backward)
			printf(" %10.2f %7.1f%% %11.2f %8.2f%% %8.2f", r->bwd_median_ms,
			       r->bwd_median_ms > 0 ? 100 * (r->bwd_max_ms - r->bwd_min_ms) /
							     r->bwd_median_ms
						    : 0,
			       r->bwd_kernel_ms,
			       r->pairs_visible ? 100.0 * (double)r->bwd_pairs_computed /
							  (double)r->pairs_visible
						: 0,
			       r->ratio);
		printf("%s\n", bench_tol_note(&r->check));
	}
	if (o->backward)
		printf("bwd/fwd: the median over the repeats of each repeat's backward / forward "
		       "wall time\n");
}

static void print_json(const ape_device_info *info, const struct bench_opts *o,
		       const void *table, int n)
{
	bench_json_head(info, o);
	printf(" \"params\": {\"delta\": %.9g, \"beta\": %.9g, \"gamma\": %.9g, \"lambda\": %.9g},\n",
	       (double)o->delta, (double)o->beta, (double)o->gamma, (double)o->lambda);
	printf(" \"results\": [");
	for (int i = 0; i < n; i++) {
		const struct bench_row *r = (const struct bench_row *)table + i;
		double sec = r->median_ms * 1e-3;
		double pps = sec > 0 ? (double)r->pairs_visible / sec : 0;

		printf("%s\n  {\"L\": %" PRId64 ", \"Lq\": %" PRId64 ", \"skip_tol\": %.9g, "
		       "\"median_ms\": %.6g, \"min_ms\": %.6g, \"max_ms\": %.6g, \"kernel_ms\": %.6g, "
		       "\"pairs_visible\": %" PRIu64 ", \"pairs_computed\": %" PRIu64
		       ", \"pairs_per_s\": %.6g, \"dense_gflops\": %.6g, \"rows_checked\": %d, "
		       "\"max_err_o\": %.6g, \"max_err_lse\": %.6g, \"within_tol\": %s",
		       i ? "," : "", r->key.L, r->key.Lq, r->key.skip_tol, r->median_ms, r->min_ms,
		       r->max_ms,
		       r->kernel_ms, r->pairs_visible, r->pairs_computed, pps,
		       pps * 4.0 * (double)o->D * 1e-9, r->check.rows_checked, r->check.max_err_o,
		       r->check.max_err_lse, bench_json_within_tol(&r->check));
		if (o->backward)
			printf(", \"backward\": {\"median_ms\": %.6g, \"min_ms\": %.6g, "
			       "\"max_ms\": %.6g, \"kernel_ms\": %.6g, \"pairs_computed\": %" PRIu64
			       ", \"ratio_to_forward\": %.6g}",
			       r->bwd_median_ms, r->bwd_min_ms, r->bwd_max_ms, r->bwd_kernel_ms,
			       r->bwd_pairs_computed, r->ratio);
		printf("}");
	}
	printf("\n ]}\n");
}

/* The host call's mode: the default. */
static const struct bench_mode host_mode = { .one = bench_one,
					     .row_size = sizeof(struct bench_row),
					     .check_at = offsetof(struct bench_row, check),
					     .table = print_table, .json = print_json };

int main(int argc, char **argv)
{
	struct bench_opts o = {
		.backend = "auto", .device = -1, .B = 1, .H = 6, .D = 64,
		.L = { 1024, 4096, 16384 }, .nL = 3, .skip = { 0x1p-24, 0 }, .nskip = 2,
		.dtype = APE_F32, .causal = true, .warmup = 1, .repeats = 5, .check_rows = 16,
		.copy_mib = 256, .serial = true, .delta = (float)SEED_DELTA, .beta = (float)SEED_BETA,
		.gamma = (float)SEED_GAMMA, .lambda = (float)SEED_LAMBDA,
	};
	struct bench_row rows[MAX_LIST * MAX_LIST];
	ape_context *ctx = NULL;
	ape_selection sel, refsel;
	ape_rng rng;
	char err[512] = "";
	int ret;

	/* --mpi: generated inputs sharded over MPI ranks, by ape-mpi-run (docs/distributed.md) */
	if ((ret = tools_mpi_exec("ape-bench", argc, argv, "--bench")) >= 0)
		return ret;
	ret = bench_parse_args(argc, argv, &o, err, sizeof(err));
	if (ret) {
		fprintf(stderr, "ape-bench: %s\n", err[0] ? err : ape_strerror(ret));
		return 2;
	}
	if (o.seeded)
		ape_rng_seed(&rng, o.seed);
	else
		ape_rng_init(&rng, "ape-bench");
	if (ape_context_create(&ctx, NULL)) {
		fprintf(stderr, "ape-bench: %s\n", ape_last_error());
		return 1;
	}
	ret = ape_device_select(ctx, o.backend, o.device, &sel);
	if (!ret)
		ret = ape_device_select(ctx, "ref", 0, &refsel);
	if (ret) {
		fprintf(stderr, "ape-bench: %s\n", ape_last_error());
		ape_context_destroy(ctx);
		return ret == APE_EINVAL ? 2 : 3;
	}
	if (sel.passed_over || !o.json)
		fprintf(stderr, "ape-bench: ran on %s\n", sel.note);
	if (o.numa) {
		ret = numa_bench(ctx, sel.device, o.copy_mib << 20, o.repeats, o.json);
		ape_context_destroy(ctx);
		return ret;
	}
	if (o.resident) {
		ret = bench_resident(sel.device, refsel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	if (o.varlen) {
		ret = bench_varlen(sel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	if (o.pool) {
		ret = bench_pool(sel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	if (o.stream) {
		bench_stream_defaults(&o);
		ret = bench_stream(sel.device, refsel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	ret = bench_mode_run(sel.device, refsel.device, &o, &rng, &host_mode, rows);
	ape_context_destroy(ctx);
	return ret;
}
