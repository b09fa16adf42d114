/* SPDX-License-Identifier: MIT */
/*
 * ape-bench --resident (tools/bench/bench.h): the device-resident call on inputs written to
 * device buffers once, each timed call ape_attention_enqueue() + ape_queue_synchronize(),
 * beside the host call on the same inputs.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "bench/bench.h"

struct resident_row {
	struct row_key key;
	double host_ms, host_kernel_ms; /* host call: median wall time, median kernel time */
	uint64_t host_bytes; /* host call: bytes copied to and from the device, per call */
	double res_ms, res_min_ms, res_max_ms; /* enqueue + synchronize: median, spread */
	struct refcheck_result check;
};

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Device buffers holding in's tensors (written once, waited for), and their views. */
struct resident_bufs {
	ape_buffer *b[5];
	ape_dtensor t[5];
};

static void resident_free(struct resident_bufs *r)
{
	for (int i = 0; i < 5; i++)
		ape_buffer_free(r->b[i]);
}

static int resident_make(ape_queue *q, const struct inputs *in, struct resident_bufs *r)
{
	const ape_tensor *t[4] = { &in->tq, &in->tk, &in->tv, &in->to };
	ape_device *dev = ape_queue_device(q);
	int ret = 0;

	memset(r, 0, sizeof(*r));
	for (int i = 0; i < 5 && !ret; i++) {
		const int64_t *d = i < 4 ? t[i]->shape : in->to.shape;
		const ape_dtype dt = i < 4 ? t[i]->dtype : APE_F32;
		const size_t bytes = (size_t)(d[0] * d[1] * d[2] * (i < 4 ? d[3] : 1)) *
				     ape_dtype_size(dt);

		ret = ape_buffer_alloc(dev, bytes, &r->b[i]);
		if (!ret)
			ape_dtensor_init(&r->t[i], r->b[i], 0, dt, d[0], d[1], d[2],
					 i < 4 ? d[3] : 1);
		if (!ret && i < 3)
			ret = ape_buffer_write(q, r->b[i], 0, t[i]->data, bytes);
	}
	if (!ret)
		ret = ape_queue_synchronize(q);
	if (ret)
		resident_free(r);
	return ret;
}

static int resident_one(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
			double skip_tol, ape_rng *rng, void *out)
{
	struct resident_row *row = out;
	const int n = o->repeats > 1024 ? 1024 : o->repeats;
	double times[1024];
	struct host_times ht;
	struct resident_bufs rb;
	struct inputs in;
	ape_attn_desc desc;
	ape_queue *q = NULL;
	int ret;

	memset(row, 0, sizeof(*row));
	/* the host call on the same inputs as the resident one: wall time, kernel time, copies */
	if ((ret = bench_host_row(dev, o, L, skip_tol, rng, &row->key, &in, &desc, &ht)))
		return ret;
	row->host_ms = ht.median_ms;
	row->host_kernel_ms = ht.kernel_ms;
	row->host_bytes = ht.last.bytes_to_device + ht.last.bytes_from_device;
	/* the resident call: inputs on the device once, then enqueue + synchronize */
	if ((ret = ape_queue_create(dev, &q)))
		goto out_free;
	if ((ret = resident_make(q, &in, &rb)))
		goto out_queue;
	for (int i = 0; i < o->warmup + n && !ret; i++) {
		double t0 = now_ms();

		ret = ape_attention_enqueue(q, &desc, &rb.t[0], &rb.t[1], &rb.t[2], &rb.t[3],
					    &rb.t[4]);
		if (!ret)
			ret = ape_queue_synchronize(q);
		if (!ret && i >= o->warmup)
			times[i - o->warmup] = now_ms() - t0;
	}
	if (!ret) {
		bench_summarize(times, n, &row->res_ms, &row->res_min_ms, &row->res_max_ms);
		/* the resident call's own O and LSE, read back after the timing, are checked */
		ret = ape_buffer_read(q, in.o, rb.b[3], 0, ape_buffer_size(rb.b[3]));
		if (!ret)
			ret = ape_buffer_read(q, in.lse, rb.b[4], 0, ape_buffer_size(rb.b[4]));
		if (!ret)
			ret = ape_queue_synchronize(q);
	}
	if (!ret && o->check_rows > 0)
		ret = refcheck_sampled(ref, &desc, &in.tq, &in.tk, &in.tv, &in.to, in.lse,
				       o->check_rows, rng, &row->check);
	resident_free(&rb);
out_queue:
	ape_queue_destroy(q);
out_free:
	bench_free_inputs(&in);
	return ret;
}

static void resident_print(const ape_device_info *info, const struct bench_opts *o,
			   const void *table, int n)
{
	bench_table_head(" --resident", info, o);
	printf("; %d repeats; medians\n", o->repeats);
	printf("%8s %9s %10s %11s %10s %11s %11s %10s %9s %11s %9s %9s\n", "L", "skip_tol",
	       "kernel_ms", "host_ms", "host_MiB", "host_ovh_ms", "resident_ms", "spread",
	       "res_MiB", "res_ovh_ms", "err_O", "err_LSE");
	for (int i = 0; i < n; i++) {
		const struct resident_row *r = (const struct resident_row *)table + i;

		printf("%8" PRId64 " %9.3g %10.3f %11.3f %10.2f %11.3f %11.3f %9.1f%% %9.2f %11.3f",
		       r->key.L, r->key.skip_tol, r->host_kernel_ms, r->host_ms,
		       (double)r->host_bytes / (1 << 20), r->host_ms - r->host_kernel_ms, r->res_ms,
		       r->res_ms > 0 ? 100 * (r->res_max_ms - r->res_min_ms) / r->res_ms : 0, 0.0,
		       r->res_ms - r->host_kernel_ms);
		bench_print_check(&r->check, 9);
		printf("%s\n", bench_tol_note(&r->check));
	}
	printf("kernel_ms: the host call's ape_stats.kernel_ms (same problem); *_MiB: bytes copied "
	       "per call\n(resident: none, the timed loop enqueues no copy); *_ovh_ms: wall time "
	       "minus kernel_ms\n");
}

static void resident_json(const ape_device_info *info, const struct bench_opts *o,
			  const void *table, int n)
{
	bench_json_head(info, o);
	printf(" \"results\": [");
	for (int i = 0; i < n; i++) {
		const struct resident_row *r = (const struct resident_row *)table + i;

		printf("%s\n  {\"L\": %" PRId64 ", \"Lq\": %" PRId64 ", \"skip_tol\": %.9g, "
		       "\"kernel_ms\": %.6g, \"host_ms\": %.6g, \"host_bytes_copied\": %" PRIu64
		       ", \"host_overhead_ms\": %.6g, \"resident_ms\": %.6g, "
		       "\"resident_min_ms\": %.6g, \"resident_max_ms\": %.6g, "
		       "\"resident_bytes_copied\": 0, \"resident_overhead_ms\": %.6g, "
		       "\"rows_checked\": %d, \"max_err_o\": %.6g, \"max_err_lse\": %.6g, "
		       "\"within_tol\": %s}",
		       i ? "," : "", r->key.L, r->key.Lq, r->key.skip_tol, r->host_kernel_ms,
		       r->host_ms, r->host_bytes, r->host_ms - r->host_kernel_ms, r->res_ms, r->res_min_ms,
		       r->res_max_ms, r->res_ms - r->host_kernel_ms, r->check.rows_checked,
		       r->check.max_err_o, r->check.max_err_lse,
		       bench_json_within_tol(&r->check));
	}
	printf("\n ]}\n");
}

int bench_resident(ape_device *dev, ape_device *ref, const struct bench_opts *o,
		   ape_rng *rng)
{
	static const struct bench_mode mode = { .one = resident_one,
						.row_size = sizeof(struct resident_row),
						.check_at = offsetof(struct resident_row, check),
						.table = resident_print, .json = resident_json };
	struct resident_row rows[MAX_LIST * MAX_LIST];

	return bench_mode_run(dev, ref, o, rng, &mode, rows);
}
