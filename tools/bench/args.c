/* SPDX-License-Identifier: MIT */
/* ape-bench's command line (tools/bench/bench.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/cli.h"
#include "common/seed.h"

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
	OPT_VARLEN,
	OPT_POOL,
	OPT_PAGE_TOKENS,
	OPT_SPREAD,
	OPT_MEMBW,
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
	{ "--varlen", NULL, true, OPT_VARLEN },
	{ "--pool", NULL, true, OPT_POOL },	  { "--page-tokens", NULL, true, OPT_PAGE_TOKENS },
	{ "--spread", NULL, true, OPT_SPREAD },	  { "--membw", NULL, true, OPT_MEMBW },
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
		"  --delta --beta --gamma --lambda  APE parameters (default the seed's: 2^(-4/3)\n"
		"                                   = %.16g, delta/10, delta/10, %g)\n"
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
		"  --varlen S                       instead: ragged batches of S sequences of -L\n"
		"                                   tokens each (-B 1): one\n"
		"                                   ape_attention_forward_varlen call against a\n"
		"                                   dense call per sequence and one dense call of\n"
		"                                   about the same pairs, alternating rounds: times,\n"
		"                                   pairs/s, launches, and the ragged result's\n"
		"                                   largest difference from the per-sequence calls\n"
		"  --pool S                         instead: one decode step of S sequences held in\n"
		"                                   one ape_kv_pool (-B 1), lengths from 256 (or -L\n"
		"                                   when shorter) to -L, one query row each, one\n"
		"                                   ape_kv_pool_attend call, against the same step as\n"
		"                                   S ape_kv_cache attends (one cache per sequence),\n"
		"                                   alternating rounds: median step time, tokens/s\n"
		"                                   (S / step), the K/V bytes the step reads (2 x\n"
		"                                   keys computed x Hkv x D x dtype size: keys out of\n"
		"                                   reach under decay not counted), GB/s read, device\n"
		"                                   memory held, and the pool's largest difference\n"
		"                                   from the caches'. The seed's decay unless told\n"
		"                                   (plain decode: --delta 0 --beta 0 --gamma 0\n"
		"                                   --lambda 0 --skip-tol 0)\n"
		"  --page-tokens N                  --pool: tokens per page (default 16)\n"
		"  --spread geometric|even          --pool: lengths in geometric (default) or even\n"
		"                                   steps\n"
		"  --membw GBPS                     --pool: the memory read bandwidth to compare with\n"
		"                                   (e.g. make bench-membw's); GB/s read is also\n"
		"                                   given as a share of it\n"
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
		"FLOPs per visible pair even when skipping computed fewer.\n",
		SEED_DELTA, SEED_LAMBDA);
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

/* --delta, --beta, --gamma or --lambda (id, in that order from OPT_DELTA) into its field. */
static int parse_param(int id, const char *text, struct bench_opts *o, char *err, size_t errlen)
{
	static const char *const flags[] = { "--delta", "--beta", "--gamma", "--lambda" };
	float *const field[] = { &o->delta, &o->beta, &o->gamma, &o->lambda };
	double x;
	int ret = cli_parse_finite(flags[id - OPT_DELTA], text, &x, err, errlen);

	*field[id - OPT_DELTA] = (float)x;
	return ret;
}

/* --spread: the name into o->spread_even. */
static int parse_spread(const char *text, struct bench_opts *o, char *err, size_t errlen)
{
	if (!strcmp(text, "geometric") || !strcmp(text, "even")) {
		o->spread_even = !strcmp(text, "even");
		o->spread_set = true;
		return 0;
	}
	snprintf(err, errlen, "--spread: '%s' is not geometric or even", text);
	return APE_EINVAL;
}

int bench_parse_args(int argc, char **argv, struct bench_opts *o, char *err, size_t errlen)
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
			ret = cli_parse_int64("-D", val, 2, APE_MAX_D, &o->D, err, errlen);
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
		case OPT_BETA:
		case OPT_GAMMA:
		case OPT_LAMBDA:
			ret = parse_param(id, val, o, err, errlen);
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
		case OPT_VARLEN:
			ret = cli_parse_int64("--varlen", val, 1, 1 << 24, &o->varlen, err, errlen);
			break;
		case OPT_POOL:
			ret = cli_parse_int64("--pool", val, 1, 1 << 20, &o->pool, err, errlen);
			break;
		case OPT_PAGE_TOKENS:
			ret = cli_parse_int64("--page-tokens", val, 1, 65536, &o->page_tokens, err,
					      errlen);
			break;
		case OPT_SPREAD:
			ret = parse_spread(val, o, err, errlen);
			break;
		case OPT_MEMBW:
			ret = cli_parse_finite("--membw", val, &o->membw, err, errlen);
			if (!ret && !(o->membw > 0)) {
				snprintf(err, errlen, "--membw %s: must be > 0 (GB/s)", val);
				ret = APE_EINVAL;
			}
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
	if (o->resident + o->stream + o->numa + (o->varlen > 0) + (o->pool > 0) > 1) {
		snprintf(err, errlen,
			 "--resident, --stream, --numa, --varlen and --pool: one at a time");
		return APE_EINVAL;
	}
	if (o->backward && (o->stream || o->numa || o->resident || o->varlen || o->pool)) {
		snprintf(err, errlen, "--backward times the one-call forward and backward: drop %s",
			 o->stream ? "--stream" : o->numa ? "--numa" : o->varlen ? "--varlen"
							 : o->pool ? "--pool" : "--resident");
		return APE_EINVAL;
	}
	if (o->varlen && (o->B != 1 || o->Lq)) {
		snprintf(err, errlen, "--varlen: a ragged batch is its own batch: drop %s",
			 o->Lq ? "--lq" : "-B");
		return APE_EINVAL;
	}
	if (o->pool && (o->B != 1 || o->Lq)) {
		snprintf(err, errlen, "--pool: one query row per sequence, each its own: drop %s",
			 o->Lq ? "--lq" : "-B");
		return APE_EINVAL;
	}
	if (!o->pool && (o->page_tokens || o->spread_set || o->membw > 0)) {
		snprintf(err, errlen, "%s: only with --pool",
			 o->page_tokens ? "--page-tokens" : o->spread_set ? "--spread" : "--membw");
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
