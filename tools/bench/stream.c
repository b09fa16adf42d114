/* SPDX-License-Identifier: MIT */
/*
 * ape-bench --stream (tools/bench/bench.h): long sequences streamed in chunks under a device
 * budget, overlapped and back to back: tokens/s, chunks, bytes, peak memory, overlap efficiency.
 */
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"

struct stream_row {
	int64_t L;
	double skip_tol;
	double ms, serial_ms; /* wall time overlapped, and back to back (0: not run) */
	ape_stats st, st_serial;
	struct refcheck_result check;
};

/* What --stream measures unless told otherwise: long sequences, skipping on, one repeat. */
void bench_stream_defaults(struct bench_opts *o)
{
	if (!o->L_set) {
		o->L[0] = 65536;
		o->L[1] = 262144;
		o->L[2] = 1048576;
		o->nL = 3;
	}
	if (!o->skip_set) {
		o->skip[0] = 0x1p-24;
		o->nskip = 1;
	}
	o->repeats = o->repeats_set ? o->repeats : 1;
	o->warmup = o->warmup_set ? o->warmup : 0;
	o->check_rows = o->check_set ? o->check_rows : 2;
	o->max_mem = o->max_mem ? o->max_mem : 256u << 20;
}

/* Median wall time of `repeats` calls at one pipeline depth; stats of the last. */
static int stream_time(ape_device *dev, const struct bench_opts *o, const ape_attn_desc *desc,
		       struct inputs *in, int depth, double *ms, ape_stats *st)
{
	double t[1024];
	int n = o->repeats > 1024 ? 1024 : o->repeats, ret = 0;
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = o->chunk;
	eo.max_device_bytes = o->max_mem;
	eo.pipeline_depth = depth;
	for (int i = 0; i < o->warmup + n && !ret; i++) {
		ape_stats_init(st);
		ret = ape_attention_forward_ex(&dev, 1, &eo, desc, &in->tq, &in->tk, &in->tv,
					       &in->to, in->lse, st);
		if (i >= o->warmup)
			t[i - o->warmup] = st->total_ms;
	}
	if (!ret)
		*ms = bench_median(t, n);
	return ret;
}

static int stream_one(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
		      double skip_tol, ape_rng *rng, void *out)
{
	struct stream_row *row = out;
	struct inputs in;
	ape_attn_desc desc;
	int ret;

	memset(row, 0, sizeof(*row));
	row->L = L;
	row->skip_tol = skip_tol;
	ret = bench_make_inputs(o, L, L, rng, &in);
	if (ret)
		return ret;
	bench_desc(o, skip_tol, &desc);
	if (o->serial)
		ret = stream_time(dev, o, &desc, &in, 1, &row->serial_ms, &row->st_serial);
	if (!ret)
		ret = stream_time(dev, o, &desc, &in, 3, &row->ms, &row->st);
	if (!ret && o->check_rows > 0)
		ret = refcheck_sampled(ref, &desc, &in.tq, &in.tk, &in.tv, &in.to, in.lse,
				       o->check_rows, rng, &row->check);
	bench_free_inputs(&in);
	return ret;
}

/*
 * Overlap efficiency: how much of the time that overlap could save it did save. Back to back, a
 * run costs copies + kernels + host work (packing, merging); perfectly overlapped, only the
 * longest of them remains, and no run can beat the kernels' or the copies' own device time.
 * Efficiency = (back to back - overlapped) / (back to back - max(copies, kernels)), device times
 * from the back-to-back run: 0 when nothing was hidden, 1 when the run is down to its longest
 * part. NAN when there is no serial run or nothing to hide.
 */
static double efficiency(const struct stream_row *r)
{
	double hideable = r->serial_ms - fmax(r->st_serial.copy_ms, r->st_serial.kernel_ms);

	if (!r->serial_ms || !(hideable > 0))
		return NAN;
	return (r->serial_ms - r->ms) / hideable;
}

static void stream_print(const ape_device_info *info, const struct bench_opts *o,
			 const void *table, int n)
{
	bench_table_head(" --stream", info, o);
	printf("; delta=%g beta=%g gamma=%g lambda=%g; chunk %" PRId64 ", budget %" PRIu64
	       " bytes; %d repeat%s\n",
	       (double)o->delta, (double)o->beta, (double)o->gamma, (double)o->lambda,
	       ((const struct stream_row *)table)->st.chunk_q, o->max_mem, o->repeats,
	       o->repeats == 1 ? "" : "s");
	printf("%8s %9s %10s %10s %7s %11s %9s %8s %7s %7s %9s %10s %9s %8s %9s %9s\n", "L",
	       "skip_tol", "ms", "serial_ms", "eff", "tokens/s", "Mpairs/s", "computed",
	       "chunks", "skipped", "h2d_MiB", "peak_MiB", "kernel_ms", "copy_ms", "err_O",
	       "err_LSE");
	for (int i = 0; i < n; i++) {
		const struct stream_row *r = (const struct stream_row *)table + i;
		const double sec = r->ms * 1e-3, eff = efficiency(r);

		printf("%8" PRId64 " %9.3g %10.1f %10.1f %6.0f%% %11.4g %9.1f %7.2f%% %7" PRIu64
		       " %7" PRIu64 " %9.1f %10.2f %9.1f %8.1f",
		       r->L, r->skip_tol, r->ms, r->serial_ms, isnan(eff) ? 0.0 : 100 * eff,
		       sec > 0 ? (double)r->L / sec : 0,
		       sec > 0 ? (double)r->st.pairs_visible / sec * 1e-6 : 0,
		       r->st.pairs_visible ? 100.0 * (double)r->st.pairs_computed /
						     (double)r->st.pairs_visible
					   : 0,
		       r->st.chunks, r->st.chunks_skipped,
		       (double)r->st.bytes_to_device / (1 << 20),
		       (double)r->st.peak_device_bytes / (1 << 20), r->st.kernel_ms, r->st.copy_ms);
		bench_print_check(&r->check, 9);
		printf("%s\n", bench_tol_note(&r->check));
	}
	printf("eff: (serial_ms - ms) / (serial_ms - max(copy, kernel)), device times of the serial "
	       "run:\n     the share of the time overlap could save that it saved\n");
}

static void stream_json(const ape_device_info *info, const struct bench_opts *o,
			const void *table, int n)
{
	bench_json_head(info, o);
	printf(" \"budget_bytes\": %" PRIu64 ",\n \"results\": [", o->max_mem);
	for (int i = 0; i < n; i++) {
		const struct stream_row *r = (const struct stream_row *)table + i;
		const double eff = efficiency(r), sec = r->ms * 1e-3;

		printf("%s\n  {\"L\": %" PRId64 ", \"skip_tol\": %.9g, \"ms\": %.6g, "
		       "\"serial_ms\": %.6g, \"overlap_efficiency\": %.4g, \"tokens_per_s\": %.6g, "
		       "\"pairs_visible\": %" PRIu64 ", \"pairs_computed\": %" PRIu64
		       ", \"chunk\": %" PRId64 ", \"chunks\": %" PRIu64
		       ", \"chunks_skipped\": %" PRIu64 ", \"bytes_to_device\": %" PRIu64
		       ", \"bytes_from_device\": %" PRIu64 ", \"peak_device_bytes\": %" PRIu64
		       ", \"kernel_ms\": %.6g, \"copy_ms\": %.6g, \"device_overlap_ms\": %.6g, "
		       "\"rows_checked\": %d, \"max_err_o\": %.6g, \"max_err_lse\": %.6g, "
		       "\"within_tol\": %s}",
		       i ? "," : "", r->L, r->skip_tol, r->ms, r->serial_ms, isnan(eff) ? -1 : eff,
		       sec > 0 ? (double)r->L / sec : 0, r->st.pairs_visible, r->st.pairs_computed,
		       r->st.chunk_q, r->st.chunks, r->st.chunks_skipped, r->st.bytes_to_device,
		       r->st.bytes_from_device, r->st.peak_device_bytes, r->st.kernel_ms,
		       r->st.copy_ms, r->st.overlap_ms, r->check.rows_checked, r->check.max_err_o,
		       r->check.max_err_lse,
		       bench_json_within_tol(&r->check));
	}
	printf("\n ]}\n");
}

/* Long runs: each row shown as it comes. */
static void stream_done(const struct bench_opts *o, const void *row)
{
	const struct stream_row *r = row;

	(void)o;
	fprintf(stderr, "ape-bench: L=%" PRId64 " done in %.1f ms\n", r->L, r->ms);
}

int bench_stream(ape_device *dev, ape_device *ref, const struct bench_opts *o,
		 ape_rng *rng)
{
	static const struct bench_mode mode = { .one = stream_one,
						.row_size = sizeof(struct stream_row),
						.check_at = offsetof(struct stream_row, check),
						.done = stream_done, .table = stream_print,
						.json = stream_json };
	struct stream_row rows[MAX_LIST * MAX_LIST];
	int ret;

	/* build the kernels before anything is timed */
	{
		struct bench_opts w = *o;
		struct stream_row tmp;

		w.repeats = 1;
		w.warmup = 0;
		w.check_rows = 0;
		w.serial = false;
		ret = stream_one(dev, ref, &w, 256, o->skip[0], rng, &tmp);
	}
	if (ret)
		return bench_failed(ret);
	return bench_mode_run(dev, ref, o, rng, &mode, rows);
}
