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
 */
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape.h"
#include "common/cli.h"
#include "common/mpi_exec.h"
#include "common/numa_bench.h"
#include "common/refcheck.h"
#include "common/rng.h"

#define MAX_LIST 16

struct bench_opts {
	const char *backend;
	int device;
	int64_t B, H, Hkv, D, Lq; /* Lq 0: Lq = L */
	int64_t L[MAX_LIST];
	int nL;
	double skip[MAX_LIST];
	int nskip;
	ape_dtype dtype;
	bool causal;
	float delta, beta, gamma, lambda;
	int warmup, repeats, check_rows;
	bool json;
	uint64_t seed;
	bool seeded;
	bool numa; /* --numa: copy bandwidth per NUMA node instead of attention */
	int64_t copy_mib;
	bool backward; /* --backward: time ape_attention_backward() after each forward */
	bool stream; /* --stream: chunked execution under a budget, overlap and peak memory */
	bool resident; /* --resident: ape_attention_enqueue on device buffers beside the host call */
	bool serial; /* --stream: also time copies and kernels back to back (--no-serial: not) */
	int64_t chunk;
	uint64_t max_mem;
	bool warmup_set, repeats_set, check_set, L_set, skip_set;
};

struct bench_row {
	int64_t L, Lq;
	double skip_tol;
	double median_ms, min_ms, max_ms, kernel_ms;
	uint64_t pairs_visible, pairs_computed;
	struct refcheck_result check;
	/* --backward: the same statistics of the backward call, and the median over the rounds
	 * of each round's backward / forward wall time (a round's two calls run back to back, so
	 * their ratio varies less on a shared machine than either time) */
	double bwd_median_ms, bwd_min_ms, bwd_max_ms, bwd_kernel_ms, ratio;
	uint64_t bwd_pairs_computed;
};

enum {
	OPT_BACKEND = 1,
	OPT_DEVICE,
	OPT_B,
	OPT_H,
	OPT_HKV,
	OPT_D,
	OPT_L,
	OPT_LQ,
	OPT_DTYPE,
	OPT_NO_CAUSAL,
	OPT_SKIP,
	OPT_DELTA,
	OPT_BETA,
	OPT_GAMMA,
	OPT_LAMBDA,
	OPT_WARMUP,
	OPT_REPEATS,
	OPT_CHECK,
	OPT_JSON,
	OPT_SEED,
	OPT_NUMA,
	OPT_COPY_MIB,
	OPT_STREAM,
	OPT_CHUNK,
	OPT_MAX_MEM,
	OPT_NO_SERIAL,
	OPT_RESIDENT,
	OPT_BACKWARD,
	OPT_HELP,
};

static const struct cli_option options[] = {
	{ "--backend", NULL, true, OPT_BACKEND }, { "--device", NULL, true, OPT_DEVICE },
	{ "--batch", "-B", true, OPT_B },	  { "--heads", "-H", true, OPT_H },
	{ "--kv-heads", NULL, true, OPT_HKV },	  { "--head-dim", "-D", true, OPT_D },
	{ "--len", "-L", true, OPT_L },		  { "--lq", NULL, true, OPT_LQ },
	{ "--dtype", NULL, true, OPT_DTYPE },	  { "--no-causal", NULL, false, OPT_NO_CAUSAL },
	{ "--skip-tol", NULL, true, OPT_SKIP },	  { "--delta", NULL, true, OPT_DELTA },
	{ "--beta", NULL, true, OPT_BETA },	  { "--gamma", NULL, true, OPT_GAMMA },
	{ "--lambda", NULL, true, OPT_LAMBDA },	  { "--warmup", NULL, true, OPT_WARMUP },
	{ "--repeats", NULL, true, OPT_REPEATS }, { "--check-rows", NULL, true, OPT_CHECK },
	{ "--json", NULL, false, OPT_JSON },	  { "--seed", NULL, true, OPT_SEED },
	{ "--numa", NULL, false, OPT_NUMA },	  { "--copy-mib", NULL, true, OPT_COPY_MIB },
	{ "--stream", NULL, false, OPT_STREAM },  { "--chunk", NULL, true, OPT_CHUNK },
	{ "--max-device-mem", NULL, true, OPT_MAX_MEM },
	{ "--no-serial", NULL, false, OPT_NO_SERIAL },
	{ "--resident", NULL, false, OPT_RESIDENT },
	{ "--backward", NULL, false, OPT_BACKWARD },
	{ "--help", "-h", false, OPT_HELP },	  { NULL, NULL, false, 0 },
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: ape-bench [options]\n"
		"  --backend auto|ref|opencl|cuda   device to time (default auto; APE_BACKEND too)\n"
		"  --device N                       index among that backend's devices\n"
		"  -B N -H N --kv-heads N -D N      shape (default 1, 6, H, 64: the seed's model)\n"
		"  -L N[,N...]                      key lengths (default 1024,4096,16384)\n"
		"  --lq N                           query rows (default: L, queries end-aligned)\n"
		"  --dtype f32|f16|bf16             storage type (default f32)\n"
		"  --no-causal                      attend to every key (default causal)\n"
		"  --skip-tol X[,X...]              far-key skipping tolerances (default 2^-24,0)\n"
		"  --delta --beta --gamma --lambda  APE parameters (default the seed's: 2^(-4/3),\n"
		"                                   delta/10, delta/10, 0.1)\n"
		"  --warmup N --repeats N           untimed and timed calls (default 1, 5)\n"
		"  --check-rows N                   rows checked against the reference (default 16;\n"
		"                                   0 = no check)\n"
		"  --seed N                         inputs' random seed (default: fresh)\n"
		"  --json                           one JSON object instead of the table\n"
		"  --backward                       also time the backward pass after each forward\n"
		"                                   (random dO, no dLSE, every gradient: dQ, dK, dV\n"
		"                                   and the parameters'): both times and the median\n"
		"                                   of each repeat's backward/forward ratio; the\n"
		"                                   check stays the forward's (ape-check checks the\n"
		"                                   gradients)\n"
		"  --numa                           instead: host-to-device copy bandwidth from\n"
		"                                   staging buffers on the device's NUMA node and\n"
		"                                   on every other node (needs two or more nodes)\n"
		"  --copy-mib N                     --numa buffer size (default 256)\n"
		"  --stream                         instead: long sequences streamed in chunks\n"
		"                                   under a device-memory budget; reports tokens/s,\n"
		"                                   chunks, bytes copied, peak device memory and\n"
		"                                   overlap efficiency (time with copies overlapping\n"
		"                                   kernels against the same run back to back).\n"
		"                                   Defaults: -L 65536,262144,1048576, skip-tol\n"
		"                                   2^-24, 1 repeat, 2 rows checked\n"
		"  --chunk N                        --stream: most tokens per chunk (default 4096)\n"
		"  --max-device-mem BYTES           --stream: device budget (default 256M)\n"
		"  --no-serial                      --stream: skip the back-to-back run\n"
		"  --resident                       instead: inputs already in device buffers\n"
		"                                   (written once), each call ape_attention_enqueue\n"
		"                                   + ape_queue_synchronize, beside the host call on\n"
		"                                   the same inputs: wall time, bytes copied per call\n"
		"                                   and overhead (wall time minus the kernel time\n"
		"                                   the host call's ape_stats reports)\n"
		"  --mpi                            instead, under mpirun: generated inputs\n"
		"                                   sharded over the ranks (ape-mpi-run): bytes\n"
		"                                   and messages per rank; `ape-bench --mpi --help`\n"
		"                                   lists its options\n"
		"  -h, --help                       print this text\n"
		"  --version                        print the libape version and exit\n"
		"Throughput counts visible (query, key) pairs; dense-equivalent GFLOP/s counts 4*D\n"
		"FLOPs per visible pair even when skipping computed fewer.\n");
}

/*
 * A comma-separated list of at most MAX_LIST values: whole numbers >= 1 for -L ("1024,4096",
 * into ints), finite numbers for --skip-tol ("5.96e-8,0", into reals).
 */
static int parse_list(const char *flag, const char *text, int64_t *ints, double *reals, int *n,
		      char *err, size_t errlen)
{
	char *copy = strdup(text), *save = NULL, *tok;
	int ret = 0;

	if (!copy)
		return APE_ENOMEM;
	*n = 0;
	for (tok = strtok_r(copy, ",", &save); tok && !ret; tok = strtok_r(NULL, ",", &save)) {
		if (*n == MAX_LIST) {
			snprintf(err, errlen, "%s: at most %d values", flag, MAX_LIST);
			ret = APE_EINVAL;
		} else if (ints) {
			ret = cli_parse_int64(flag, tok, 1, (int64_t)1 << 40, &ints[(*n)++], err,
					      errlen);
		} else {
			ret = cli_parse_finite(flag, tok, &reals[(*n)++], err, errlen);
		}
	}
	if (!ret && *n == 0) {
		snprintf(err, errlen, "%s: no value", flag);
		ret = APE_EINVAL;
	}
	free(copy);
	return ret;
}

static int parse_param(const char *flag, const char *text, float *out, char *err, size_t errlen)
{
	double x;
	int ret = cli_parse_finite(flag, text, &x, err, errlen);

	*out = (float)x;
	return ret;
}

static int parse_args(int argc, char **argv, struct bench_opts *o, char *err, size_t errlen)
{
	const char *val;
	int idx = 1, id, ret = 0, ch;
	int64_t x;

	while ((id = cli_next(argc, argv, &idx, options, &val, err, errlen)) > 0 && !ret) {
		switch (id) {
		case OPT_BACKEND:
			o->backend = val;
			break;
		case OPT_DEVICE:
			ret = cli_parse_int64("--device", val, 0, 1 << 20, &x, err, errlen);
			o->device = (int)x;
			break;
		case OPT_B:
			ret = cli_parse_int64("-B", val, 1, 1 << 20, &o->B, err, errlen);
			break;
		case OPT_H:
			ret = cli_parse_int64("-H", val, 1, 1 << 20, &o->H, err, errlen);
			break;
		case OPT_HKV:
			ret = cli_parse_int64("--kv-heads", val, 1, 1 << 20, &o->Hkv, err, errlen);
			break;
		case OPT_D:
			ret = cli_parse_int64("-D", val, 2, 256, &o->D, err, errlen);
			break;
		case OPT_L:
			ret = parse_list("-L", val, o->L, NULL, &o->nL, err, errlen);
			o->L_set = true;
			break;
		case OPT_LQ:
			ret = cli_parse_int64("--lq", val, 1, (int64_t)1 << 30, &o->Lq, err, errlen);
			break;
		case OPT_DTYPE:
			ret = cli_parse_name("--dtype", val, ape_dtype_from_name, &ch, err, errlen);
			o->dtype = ret ? o->dtype : (ape_dtype)ch;
			break;
		case OPT_NO_CAUSAL:
			o->causal = false;
			break;
		case OPT_SKIP:
			ret = parse_list("--skip-tol", val, NULL, o->skip, &o->nskip, err, errlen);
			o->skip_set = true;
			break;
		case OPT_DELTA:
			ret = parse_param("--delta", val, &o->delta, err, errlen);
			break;
		case OPT_BETA:
			ret = parse_param("--beta", val, &o->beta, err, errlen);
			break;
		case OPT_GAMMA:
			ret = parse_param("--gamma", val, &o->gamma, err, errlen);
			break;
		case OPT_LAMBDA:
			ret = parse_param("--lambda", val, &o->lambda, err, errlen);
			break;
		case OPT_WARMUP:
			ret = cli_parse_int64("--warmup", val, 0, 1000, &x, err, errlen);
			o->warmup = (int)x;
			o->warmup_set = true;
			break;
		case OPT_REPEATS:
			ret = cli_parse_int64("--repeats", val, 1, 100000, &x, err, errlen);
			o->repeats = (int)x;
			o->repeats_set = true;
			break;
		case OPT_CHECK:
			ret = cli_parse_int64("--check-rows", val, 0, 1 << 20, &x, err, errlen);
			o->check_rows = (int)x;
			o->check_set = true;
			break;
		case OPT_JSON:
			o->json = true;
			break;
		case OPT_NUMA:
			o->numa = true;
			break;
		case OPT_STREAM:
			o->stream = true;
			break;
		case OPT_BACKWARD:
			o->backward = true;
			break;
		case OPT_NO_SERIAL:
			o->serial = false;
			break;
		case OPT_RESIDENT:
			o->resident = true;
			break;
		case OPT_CHUNK:
			ret = cli_parse_int64("--chunk", val, 1, (int64_t)1 << 40, &o->chunk, err,
					      errlen);
			break;
		case OPT_MAX_MEM:
			ret = cli_parse_bytes("--max-device-mem", val, &o->max_mem, err, errlen);
			break;
		case OPT_COPY_MIB:
			ret = cli_parse_int64("--copy-mib", val, 1, 1 << 20, &o->copy_mib, err,
					      errlen);
			break;
		case OPT_SEED:
			ret = cli_parse_int64("--seed", val, 0, INT64_MAX, &x, err, errlen);
			o->seed = (uint64_t)x;
			o->seeded = true;
			break;
		case OPT_HELP:
			usage(stdout);
			exit(0);
		}
	}
	if (id < 0)
		return id;
	if (ret)
		return ret;
	if (o->resident + o->stream + o->numa > 1) {
		snprintf(err, errlen, "--resident, --stream and --numa: one at a time");
		return APE_EINVAL;
	}
	if (o->backward && (o->stream || o->numa || o->resident)) {
		snprintf(err, errlen, "--backward times the one-call forward and backward: drop %s",
			 o->stream ? "--stream" : o->numa ? "--numa" : "--resident");
		return APE_EINVAL;
	}
	if (o->D % 2) {
		snprintf(err, errlen, "-D %" PRId64 ": the head dimension must be even", o->D);
		return APE_EINVAL;
	}
	if (!o->Hkv)
		o->Hkv = o->H;
	if (o->H % o->Hkv) {
		snprintf(err, errlen, "--kv-heads %" PRId64 ": must divide -H %" PRId64, o->Hkv, o->H);
		return APE_EINVAL;
	}
	return 0;
}

static double median(double *x, int n)
{
	for (int i = 1; i < n; i++) /* insertion sort: n is small */
		for (int j = i; j > 0 && x[j - 1] > x[j]; j--) {
			double t = x[j];

			x[j] = x[j - 1];
			x[j - 1] = t;
		}
	return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

struct inputs {
	void *q, *k, *v, *o;
	float *lse;
	ape_tensor tq, tk, tv, to;
	/* --backward: dO and the gradients, in the storage type; NULL otherwise */
	void *dout, *dq, *dk, *dv;
	float *dparams;
	ape_tensor tdout, tdq, tdk, tdv;
};

static void free_inputs(struct inputs *in)
{
	free(in->q);
	free(in->k);
	free(in->v);
	free(in->o);
	free(in->lse);
	free(in->dout);
	free(in->dq);
	free(in->dk);
	free(in->dv);
	free(in->dparams);
}

static int fill_random(void *dst, ape_dtype dt, size_t n, ape_rng *rng)
{
	float buf[1024];

	for (size_t i = 0; i < n; i += 1024) {
		size_t m = n - i < 1024 ? n - i : 1024;

		for (size_t j = 0; j < m; j++)
			buf[j] = (float)ape_rng_normal(rng);
		if (ape_convert((char *)dst + i * ape_dtype_size(dt), dt, buf, APE_F32, m))
			return -1;
	}
	return 0;
}

/* A [B, heads, L, D] tensor of the storage type, uninitialised; NULL data when out of memory. */
static void *new_tensor(ape_tensor *t, const struct bench_opts *o, int64_t heads, int64_t L)
{
	void *p = malloc((size_t)(o->B * heads * L * o->D) * ape_dtype_size(o->dtype) + 1);

	ape_tensor_init(t, p, o->dtype, o->B, heads, L, o->D);
	return p;
}

static int fill_tensor(const ape_tensor *t, ape_rng *rng)
{
	const int64_t *s = t->shape;

	return fill_random(t->data, t->dtype, (size_t)(s[0] * s[1] * s[2] * s[3]), rng);
}

/* --backward: a random dO and room for every gradient. */
static int make_grads(const struct bench_opts *o, int64_t L, int64_t Lq, ape_rng *rng,
		      struct inputs *in)
{
	in->dout = new_tensor(&in->tdout, o, o->H, Lq);
	in->dq = new_tensor(&in->tdq, o, o->H, Lq);
	in->dk = new_tensor(&in->tdk, o, o->Hkv, L);
	in->dv = new_tensor(&in->tdv, o, o->Hkv, L);
	in->dparams = malloc(sizeof(float) * 4 * (size_t)o->H);
	if (!in->dout || !in->dq || !in->dk || !in->dv || !in->dparams ||
	    fill_tensor(&in->tdout, rng)) {
		free_inputs(in);
		return APE_ENOMEM;
	}
	return 0;
}

static int make_inputs(const struct bench_opts *o, int64_t L, int64_t Lq, ape_rng *rng,
		       struct inputs *in)
{
	memset(in, 0, sizeof(*in));
	in->q = new_tensor(&in->tq, o, o->H, Lq);
	in->k = new_tensor(&in->tk, o, o->Hkv, L);
	in->v = new_tensor(&in->tv, o, o->Hkv, L);
	in->o = new_tensor(&in->to, o, o->H, Lq);
	in->lse = malloc(sizeof(float) * (size_t)(o->B * o->H * Lq) + 1);
	if (!in->q || !in->k || !in->v || !in->o || !in->lse || fill_tensor(&in->tq, rng) ||
	    fill_tensor(&in->tk, rng) || fill_tensor(&in->tv, rng)) {
		free_inputs(in);
		return APE_ENOMEM;
	}
	return o->backward ? make_grads(o, L, Lq, rng, in) : 0;
}

/* Times one (L, skip_tol) configuration. */
/* The call every row times: the options' parameters and causality, this row's skip_tol. */
static void bench_desc(const struct bench_opts *o, double skip_tol, ape_attn_desc *desc)
{
	ape_attn_desc_init(desc);
	desc->delta.value = o->delta;
	desc->beta.value = o->beta;
	desc->gamma.value = o->gamma;
	desc->lambda.value = o->lambda;
	desc->causal = o->causal;
	desc->skip_tol = skip_tol;
}

/* One (L, skip_tol) row of a mode, into *out (the mode's own row struct). */
typedef int (*row_fn)(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
		      double skip_tol, ape_rng *rng, void *out);

/*
 * Every (L, skip_tol) of o in order through `one`, into rows of `size` bytes each whose
 * refcheck_result lies at byte `check_at`; *bad counts the rows out of tolerance; `done` (or
 * NULL) sees each row as it comes. 0, or the first failure (*n rows done before it).
 */
static int run_rows(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng,
		    row_fn one, void *rows, size_t size, size_t check_at,
		    void (*done)(const struct bench_opts *o, const void *row), int *n, int *bad)
{
	int ret = 0;

	*n = *bad = 0;
	for (int i = 0; i < o->nL && !ret; i++)
		for (int j = 0; j < o->nskip && !ret; j++) {
			char *row = (char *)rows + (size_t)*n * size;
			const struct refcheck_result *c = (const void *)(row + check_at);

			ret = one(dev, ref, o, o->L[i], o->skip[j], rng, row);
			if (ret)
				break;
			*bad += c->rows_checked && !c->within_tol;
			if (done)
				done(o, row);
			(*n)++;
		}
	return ret;
}

/* Wall-time figures of n timed calls: median, fastest, slowest (t is sorted). */
static void summarize(double *t, int n, double *med, double *min, double *max)
{
	*med = median(t, n);
	*min = t[0];
	*max = t[n - 1];
}

/* Host calls of one configuration: o->warmup untimed, then o->repeats (at most 1024) timed. */
struct host_times {
	double median_ms, min_ms, max_ms, kernel_ms; /* wall time, and the kernels' (medians) */
	ape_stats last; /* the last call's statistics */
	/* --backward: the same of the backward call run after each forward, and the median of
	 * each round's backward / forward wall time */
	double bwd_median_ms, bwd_min_ms, bwd_max_ms, bwd_kernel_ms, ratio;
	ape_stats bwd_last;
};

static int time_host_calls(ape_device *dev, const struct bench_opts *o, const ape_attn_desc *desc,
			   struct inputs *in, struct host_times *ht)
{
	const int n = o->repeats > 1024 ? 1024 : o->repeats;
	double times[1024], kernel[1024], btimes[1024], bkernel[1024], ratio[1024];
	int ret = 0;

	memset(ht, 0, sizeof(*ht));
	for (int i = 0; i < o->warmup + n && !ret; i++) {
		ape_stats_init(&ht->last);
		ape_stats_init(&ht->bwd_last);
		ret = ape_attention_forward(dev, desc, &in->tq, &in->tk, &in->tv, &in->to, in->lse,
					    &ht->last);
		if (!ret && o->backward)
			ret = ape_attention_backward(dev, desc, &in->tq, &in->tk, &in->tv, &in->to,
						     in->lse, &in->tdout, NULL, &in->tdq, &in->tdk,
						     &in->tdv, in->dparams, &ht->bwd_last);
		if (!ret && i >= o->warmup) {
			times[i - o->warmup] = ht->last.total_ms;
			kernel[i - o->warmup] = ht->last.kernel_ms;
			btimes[i - o->warmup] = ht->bwd_last.total_ms;
			bkernel[i - o->warmup] = ht->bwd_last.kernel_ms;
			ratio[i - o->warmup] = ht->last.total_ms > 0
						       ? ht->bwd_last.total_ms / ht->last.total_ms
						       : 0;
		}
	}
	if (ret)
		return ret;
	summarize(times, n, &ht->median_ms, &ht->min_ms, &ht->max_ms);
	ht->kernel_ms = median(kernel, n);
	if (o->backward) {
		summarize(btimes, n, &ht->bwd_median_ms, &ht->bwd_min_ms, &ht->bwd_max_ms);
		ht->bwd_kernel_ms = median(bkernel, n);
		ht->ratio = median(ratio, n);
	}
	return 0;
}

/* What a row of the host call and of --resident start from: fresh inputs of the row's shape,
 * its desc, and the host calls timed on them (inputs freed on failure). */
static int host_row(ape_device *dev, const struct bench_opts *o, int64_t L, int64_t Lq,
		    double skip_tol, ape_rng *rng, struct inputs *in, ape_attn_desc *desc,
		    struct host_times *ht)
{
	int ret = make_inputs(o, L, Lq, rng, in);

	if (ret)
		return ret;
	bench_desc(o, skip_tol, desc);
	ret = time_host_calls(dev, o, desc, in, ht);
	if (ret)
		free_inputs(in);
	return ret;
}

static int bench_one(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
		     double skip_tol, ape_rng *rng, void *out)
{
	struct bench_row *row = out;
	struct host_times ht;
	struct inputs in;
	ape_attn_desc desc;
	int64_t Lq = o->Lq && o->Lq < L ? o->Lq : L;
	int ret;

	memset(row, 0, sizeof(*row));
	row->L = L;
	row->Lq = Lq;
	row->skip_tol = skip_tol;
	if ((ret = host_row(dev, o, L, Lq, skip_tol, rng, &in, &desc, &ht)))
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
	free_inputs(&in);
	return ret;
}

/* What every mode's JSON starts with: the device and the shape. */
static void json_head(const ape_device_info *info, const struct bench_opts *o)
{
	printf("{\"device\": {\"backend\": \"%s\", \"index\": %d, \"name\": \"%s\", \"driver\": "
	       "\"%s\"},\n",
	       info->backend, info->backend_index, info->name, info->driver_version);
	printf(" \"shape\": {\"B\": %" PRId64 ", \"H\": %" PRId64 ", \"Hkv\": %" PRId64
	       ", \"D\": %" PRId64 ", \"dtype\": \"%s\", \"causal\": %s},\n",
	       o->B, o->H, o->Hkv, o->D, ape_dtype_name(o->dtype), o->causal ? "true" : "false");
}

/* The table's columns err_O and err_LSE, each `width` wide. */
static void print_check(const struct refcheck_result *c, int width)
{
	if (c->rows_checked)
		printf(" %*.2e %*.2e", width, c->max_err_o, width, c->max_err_lse);
	else
		printf(" %*s %*s", width, "-", width, "-");
}

/* What ends a table's line: a warning when the sampled rows were out of tolerance. */
static const char *tol_note(const struct refcheck_result *c)
{
	return !c->rows_checked || c->within_tol ? "" : "  OUT OF TOLERANCE";
}

/* "true" when the sampled rows were within tolerance, or none was checked. */
static const char *json_within_tol(const struct refcheck_result *c)
{
	return c->within_tol || !c->rows_checked ? "true" : "false";
}

/* A mode that failed: the message, and the exit status (2: bad arguments; 3: the device cannot,
 * e.g. --backward on a backend without a backward pass; 1: the rest). */
static int bench_failed(int ret)
{
	fprintf(stderr, "ape-bench: %s\n", ape_last_error());
	return ret == APE_EINVAL || ret == APE_EOVERFLOW ? 2 : ret == APE_ENOTSUP ? 3 : 1;
}

static void print_table(const ape_device_info *info, const struct bench_opts *o,
			const struct bench_row *rows, int n)
{
	printf("ape-bench: %s:%d %s (%s)\n", info->backend, info->backend_index, info->name,
	       info->driver_version);
	printf("shape B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64
	       " %s %s; delta=%g beta=%g gamma=%g lambda=%g; %d repeats\n",
	       o->B, o->H, o->Hkv, o->D, ape_dtype_name(o->dtype),
	       o->causal ? "causal" : "non-causal", (double)o->delta, (double)o->beta,
	       (double)o->gamma, (double)o->lambda, o->repeats);
	printf("%8s %10s %10s %8s %11s %9s %9s %9s %10s %10s", "L", "skip_tol", "median_ms",
	       "spread", "kernel_ms", "Mpairs/s", "GFLOP/s", "computed", "err_O", "err_LSE");
	if (o->backward)
		printf(" %10s %8s %11s %9s %8s", "bwd_ms", "spread", "bwd_kernel", "computed",
		       "bwd/fwd");
	printf("\n");
	for (int i = 0; i < n; i++) {
		const struct bench_row *r = &rows[i];
		double sec = r->median_ms * 1e-3;
		double pps = sec > 0 ? (double)r->pairs_visible / sec : 0;

		printf("%8" PRId64 " %10.3g %10.2f %7.1f%% %11.2f %9.1f %9.1f %8.2f%%", r->L,
		       r->skip_tol, r->median_ms,
		       r->median_ms > 0 ? 100 * (r->max_ms - r->min_ms) / r->median_ms : 0,
		       r->kernel_ms, pps * 1e-6, pps * 4.0 * (double)o->D * 1e-9,
		       r->pairs_visible ? 100.0 * (double)r->pairs_computed / (double)r->pairs_visible
					: 0);
		print_check(&r->check, 10);
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
		printf("%s\n", tol_note(&r->check));
	}
	if (o->backward)
		printf("bwd/fwd: the median over the repeats of each repeat's backward / forward "
		       "wall time\n");
}

static void print_json(const ape_device_info *info, const struct bench_opts *o,
		       const struct bench_row *rows, int n)
{
	json_head(info, o);
	printf(" \"params\": {\"delta\": %.9g, \"beta\": %.9g, \"gamma\": %.9g, \"lambda\": %.9g},\n",
	       (double)o->delta, (double)o->beta, (double)o->gamma, (double)o->lambda);
	printf(" \"results\": [");
	for (int i = 0; i < n; i++) {
		const struct bench_row *r = &rows[i];
		double sec = r->median_ms * 1e-3;
		double pps = sec > 0 ? (double)r->pairs_visible / sec : 0;

		printf("%s\n  {\"L\": %" PRId64 ", \"Lq\": %" PRId64 ", \"skip_tol\": %.9g, "
		       "\"median_ms\": %.6g, \"min_ms\": %.6g, \"max_ms\": %.6g, \"kernel_ms\": %.6g, "
		       "\"pairs_visible\": %" PRIu64 ", \"pairs_computed\": %" PRIu64
		       ", \"pairs_per_s\": %.6g, \"dense_gflops\": %.6g, \"rows_checked\": %d, "
		       "\"max_err_o\": %.6g, \"max_err_lse\": %.6g, \"within_tol\": %s",
		       i ? "," : "", r->L, r->Lq, r->skip_tol, r->median_ms, r->min_ms, r->max_ms,
		       r->kernel_ms, r->pairs_visible, r->pairs_computed, pps,
		       pps * 4.0 * (double)o->D * 1e-9, r->check.rows_checked, r->check.max_err_o,
		       r->check.max_err_lse, json_within_tol(&r->check));
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

/* ------------------------------------------------------------------ --resident */

struct resident_row {
	int64_t L, Lq;
	double skip_tol;
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
	int64_t Lq = o->Lq && o->Lq < L ? o->Lq : L;
	int ret;

	memset(row, 0, sizeof(*row));
	row->L = L;
	row->Lq = Lq;
	row->skip_tol = skip_tol;
	/* the host call on the same inputs as the resident one: wall time, kernel time, copies */
	if ((ret = host_row(dev, o, L, Lq, skip_tol, rng, &in, &desc, &ht)))
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
		summarize(times, n, &row->res_ms, &row->res_min_ms, &row->res_max_ms);
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
	free_inputs(&in);
	return ret;
}

static void resident_print(const ape_device_info *info, const struct bench_opts *o,
			   const struct resident_row *rows, int n)
{
	printf("ape-bench --resident: %s:%d %s (%s)\n", info->backend, info->backend_index,
	       info->name, info->driver_version);
	printf("shape B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64
	       " %s %s; %d repeats; medians\n",
	       o->B, o->H, o->Hkv, o->D, ape_dtype_name(o->dtype),
	       o->causal ? "causal" : "non-causal", o->repeats);
	printf("%8s %9s %10s %11s %10s %11s %11s %10s %9s %11s %9s %9s\n", "L", "skip_tol",
	       "kernel_ms", "host_ms", "host_MiB", "host_ovh_ms", "resident_ms", "spread",
	       "res_MiB", "res_ovh_ms", "err_O", "err_LSE");
	for (int i = 0; i < n; i++) {
		const struct resident_row *r = &rows[i];

		printf("%8" PRId64 " %9.3g %10.3f %11.3f %10.2f %11.3f %11.3f %9.1f%% %9.2f %11.3f", r->L,
		       r->skip_tol, r->host_kernel_ms, r->host_ms,
		       (double)r->host_bytes / (1 << 20), r->host_ms - r->host_kernel_ms, r->res_ms,
		       r->res_ms > 0 ? 100 * (r->res_max_ms - r->res_min_ms) / r->res_ms : 0, 0.0,
		       r->res_ms - r->host_kernel_ms);
		print_check(&r->check, 9);
		printf("%s\n", tol_note(&r->check));
	}
	printf("kernel_ms: the host call's ape_stats.kernel_ms (same problem); *_MiB: bytes copied "
	       "per call\n(resident: none, the timed loop enqueues no copy); *_ovh_ms: wall time "
	       "minus kernel_ms\n");
}

static void resident_json(const ape_device_info *info, const struct bench_opts *o,
			  const struct resident_row *rows, int n)
{
	json_head(info, o);
	printf(" \"results\": [");
	for (int i = 0; i < n; i++) {
		const struct resident_row *r = &rows[i];

		printf("%s\n  {\"L\": %" PRId64 ", \"Lq\": %" PRId64 ", \"skip_tol\": %.9g, "
		       "\"kernel_ms\": %.6g, \"host_ms\": %.6g, \"host_bytes_copied\": %" PRIu64
		       ", \"host_overhead_ms\": %.6g, \"resident_ms\": %.6g, "
		       "\"resident_min_ms\": %.6g, \"resident_max_ms\": %.6g, "
		       "\"resident_bytes_copied\": 0, \"resident_overhead_ms\": %.6g, "
		       "\"rows_checked\": %d, \"max_err_o\": %.6g, \"max_err_lse\": %.6g, "
		       "\"within_tol\": %s}",
		       i ? "," : "", r->L, r->Lq, r->skip_tol, r->host_kernel_ms, r->host_ms,
		       r->host_bytes, r->host_ms - r->host_kernel_ms, r->res_ms, r->res_min_ms,
		       r->res_max_ms, r->res_ms - r->host_kernel_ms, r->check.rows_checked,
		       r->check.max_err_o, r->check.max_err_lse,
		       json_within_tol(&r->check));
	}
	printf("\n ]}\n");
}

static int resident_bench(ape_device *dev, ape_device *ref, const struct bench_opts *o,
			  ape_rng *rng)
{
	struct resident_row rows[MAX_LIST * MAX_LIST];
	ape_device_info info;
	int n, bad, ret;

	ape_device_get_info(dev, &info);
	ret = run_rows(dev, ref, o, rng, resident_one, rows, sizeof(rows[0]),
		       offsetof(struct resident_row, check), NULL, &n, &bad);
	if (ret)
		return bench_failed(ret);
	if (o->json)
		resident_json(&info, o, rows, n);
	else
		resident_print(&info, o, rows, n);
	return bad ? 1 : 0;
}

/* ------------------------------------------------------------------ --stream */

struct stream_row {
	int64_t L;
	double skip_tol;
	double ms, serial_ms; /* wall time overlapped, and back to back (0: not run) */
	ape_stats st, st_serial;
	struct refcheck_result check;
};

/* What --stream measures unless told otherwise: long sequences, skipping on, one repeat. */
static void stream_defaults(struct bench_opts *o)
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
	if (!o->repeats_set)
		o->repeats = 1;
	if (!o->warmup_set)
		o->warmup = 0;
	if (!o->check_set)
		o->check_rows = 2;
	if (!o->max_mem)
		o->max_mem = 256u << 20;
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
		*ms = median(t, n);
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
	ret = make_inputs(o, L, L, rng, &in);
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
	free_inputs(&in);
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
			 const struct stream_row *rows, int n)
{
	printf("ape-bench --stream: %s:%d %s (%s)\n", info->backend, info->backend_index,
	       info->name, info->driver_version);
	printf("shape B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64
	       " %s %s; delta=%g beta=%g gamma=%g lambda=%g; chunk %" PRId64
	       ", budget %" PRIu64 " bytes; %d repeat%s\n",
	       o->B, o->H, o->Hkv, o->D, ape_dtype_name(o->dtype),
	       o->causal ? "causal" : "non-causal", (double)o->delta, (double)o->beta,
	       (double)o->gamma, (double)o->lambda, rows[0].st.chunk_q, o->max_mem, o->repeats,
	       o->repeats == 1 ? "" : "s");
	printf("%8s %9s %10s %10s %7s %11s %9s %8s %7s %7s %9s %10s %9s %8s %9s %9s\n", "L",
	       "skip_tol", "ms", "serial_ms", "eff", "tokens/s", "Mpairs/s", "computed",
	       "chunks", "skipped", "h2d_MiB", "peak_MiB", "kernel_ms", "copy_ms", "err_O",
	       "err_LSE");
	for (int i = 0; i < n; i++) {
		const struct stream_row *r = &rows[i];
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
		print_check(&r->check, 9);
		printf("%s\n", tol_note(&r->check));
	}
	printf("eff: (serial_ms - ms) / (serial_ms - max(copy, kernel)), device times of the serial "
	       "run:\n     the share of the time overlap could save that it saved\n");
}

static void stream_json(const ape_device_info *info, const struct bench_opts *o,
			const struct stream_row *rows, int n)
{
	json_head(info, o);
	printf(" \"budget_bytes\": %" PRIu64 ",\n \"results\": [", o->max_mem);
	for (int i = 0; i < n; i++) {
		const struct stream_row *r = &rows[i];
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
		       json_within_tol(&r->check));
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

static int stream_bench(ape_device *dev, ape_device *ref, const struct bench_opts *o,
			ape_rng *rng)
{
	struct stream_row rows[MAX_LIST * MAX_LIST];
	ape_device_info info;
	int n = 0, bad = 0, ret = 0;

	ape_device_get_info(dev, &info);
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
	if (!ret)
		ret = run_rows(dev, ref, o, rng, stream_one, rows, sizeof(rows[0]),
			       offsetof(struct stream_row, check), o->json ? NULL : stream_done, &n,
			       &bad);
	if (ret)
		return bench_failed(ret);
	if (o->json)
		stream_json(&info, o, rows, n);
	else
		stream_print(&info, o, rows, n);
	return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	struct bench_opts o = {
		.backend = "auto", .device = -1, .B = 1, .H = 6, .D = 64,
		.L = { 1024, 4096, 16384 }, .nL = 3, .skip = { 0x1p-24, 0 }, .nskip = 2,
		.dtype = APE_F32, .causal = true, .warmup = 1, .repeats = 5, .check_rows = 16,
		.copy_mib = 256, .serial = true,
	};
	struct bench_row rows[MAX_LIST * MAX_LIST];
	ape_context *ctx = NULL;
	ape_selection sel, refsel;
	ape_device_info info;
	ape_rng rng;
	char err[512] = "";
	int ret, nrows = 0, bad = 0;

	/* --mpi: generated inputs sharded over MPI ranks, by ape-mpi-run (docs/distributed.md) */
	if ((ret = tools_mpi_exec("ape-bench", argc, argv, "--bench")) >= 0)
		return ret;
	o.delta = (float)pow(2.0, -4.0 / 3.0);
	o.beta = o.gamma = o.delta / 10;
	o.lambda = 0.1f;
	ret = parse_args(argc, argv, &o, err, sizeof(err));
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
		ret = resident_bench(sel.device, refsel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	if (o.stream) {
		stream_defaults(&o);
		ret = stream_bench(sel.device, refsel.device, &o, &rng);
		ape_context_destroy(ctx);
		return ret;
	}
	ape_device_get_info(sel.device, &info);
	ret = run_rows(sel.device, refsel.device, &o, &rng, bench_one, rows, sizeof(rows[0]),
		       offsetof(struct bench_row, check), NULL, &nrows, &bad);
	if (ret) {
		ape_context_destroy(ctx);
		return bench_failed(ret);
	}
	if (o.json)
		print_json(&info, &o, rows, nrows);
	else
		print_table(&info, &o, rows, nrows);
	ape_context_destroy(ctx);
	return bad ? 1 : 0;
}
