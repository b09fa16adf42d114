/* SPDX-License-Identifier: MIT */
/*
 * ape-run: APE attention on NumPy .npy files, the way users run libape on their own data.
 *
 * Exit status: 0 success; 2 bad arguments or input files (and parameters or shapes the library
 * refuses); 3 the backend or device asked for is not available (or, with --backward, has no
 * backward pass); 1 anything else. Outputs (O, LSE, the diagnostics, the gradients, the trace)
 * are written to temporary files and renamed into place only once all of them are complete, so
 * a failing run never leaves a partial or stale-looking output behind.
 *
 * This file holds the arguments, devices, files and the one-call mode; tools/run/ the --kv-cache
 * mode and the statistics (tools/run/run.h).
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape/ape.h"
#include "common/cli.h"
#include "common/mpi_exec.h"
#include "common/npy.h"
#include "run/run.h"

/* The initial values the APE seed suggests for training (README.md, "Tools"; --help says so
 * too): delta = 2^(-4/3), ALiBi's slope, beta = gamma = delta / 10, lambda = 0.1.
 * ape_attn_desc_init() has no preference: 0. */
#define SEED_DELTA 0.3968502629920499
#define SEED_LAMBDA 0.1

enum {
	OPT_Q = 1, OPT_K, OPT_V, OPT_O, OPT_LSE, OPT_BACKEND, OPT_DEVICE,
	OPT_DELTA, OPT_BETA, OPT_GAMMA, OPT_LAMBDA, /* in this order: they index run_args.param */
	OPT_ROPE_BASE, OPT_SCALE, OPT_NO_CAUSAL, OPT_LAYOUT, OPT_Q_START, OPT_K_START,
	OPT_SKIP_TOL, OPT_DTYPE, OPT_STATS, OPT_CHUNK, OPT_MAX_MEM, OPT_TRACE, OPT_DEVICES,
	OPT_KV_CACHE, OPT_KV_BLOCK, OPT_KV_CAPACITY, OPT_KV_RELEASE,
	OPT_BACKWARD, OPT_DLSE, OPT_DQ, OPT_DK, OPT_DV, OPT_DPARAMS, OPT_HELP,
	OPT_ENTROPY, OPT_MEAN_DISTANCE,
};


static const struct cli_option options[] = {
	{ "-q", NULL, true, OPT_Q },
	{ "-k", NULL, true, OPT_K },
	{ "-v", NULL, true, OPT_V },
	{ "-o", NULL, true, OPT_O },
	{ "--lse", NULL, true, OPT_LSE },
	{ "--entropy", NULL, true, OPT_ENTROPY },
	{ "--mean-distance", NULL, true, OPT_MEAN_DISTANCE },
	{ "--backend", NULL, true, OPT_BACKEND },
	{ "--device", NULL, true, OPT_DEVICE },
	{ "--delta", NULL, true, OPT_DELTA },
	{ "--beta", NULL, true, OPT_BETA },
	{ "--gamma", NULL, true, OPT_GAMMA },
	{ "--lambda", NULL, true, OPT_LAMBDA },
	{ "--rope-base", NULL, true, OPT_ROPE_BASE },
	{ "--scale", NULL, true, OPT_SCALE },
	{ "--no-causal", NULL, false, OPT_NO_CAUSAL },
	{ "--layout", NULL, true, OPT_LAYOUT },
	{ "--q-start", NULL, true, OPT_Q_START },
	{ "--k-start", NULL, true, OPT_K_START },
	{ "--skip-tol", NULL, true, OPT_SKIP_TOL },
	{ "--dtype", NULL, true, OPT_DTYPE },
	{ "--stats", NULL, false, OPT_STATS },
	{ "--chunk", NULL, true, OPT_CHUNK },
	{ "--max-device-mem", NULL, true, OPT_MAX_MEM },
	{ "--trace", NULL, true, OPT_TRACE },
	{ "--devices", NULL, true, OPT_DEVICES },
	{ "--kv-cache", NULL, true, OPT_KV_CACHE },
	{ "--kv-block", NULL, true, OPT_KV_BLOCK },
	{ "--kv-capacity", NULL, true, OPT_KV_CAPACITY },
	{ "--kv-release", NULL, false, OPT_KV_RELEASE },
	{ "--backward", NULL, true, OPT_BACKWARD },
	{ "--dlse", NULL, true, OPT_DLSE },
	{ "--dq", NULL, true, OPT_DQ },
	{ "--dk", NULL, true, OPT_DK },
	{ "--dv", NULL, true, OPT_DV },
	{ "--dparams", NULL, true, OPT_DPARAMS },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

static void usage(void)
{
	printf("usage: ape-run -q Q.npy -k K.npy -v V.npy -o O.npy [--lse LSE.npy] [options]\n"
	       "       ape-run ... --backward DO.npy [--dq DQ.npy] [--dk DK.npy] [--dv DV.npy]\n"
	       "               [--dparams DP.npy] [--dlse DLSE.npy]\n"
	       "\n"
	       "APE attention, O = softmax(S) V (see docs/ape.md), on NumPy .npy files.\n"
	       "\n"
	       "Files: '<f4' (float32) or '<f2' (float16); Q, K and V of the same dtype.\n"
	       "  -q FILE        queries [B, H, Lq, D]; a 3-D [H, Lq, D] file means B = 1\n"
	       "  -k FILE        keys [B, Hkv, Lk, D] (3-D likewise); H a multiple of Hkv\n"
	       "  -v FILE        values, the shape of K\n"
	       "  -o FILE        output O: Q's shape, Q's dtype\n"
	       "  --lse FILE     also write LSE, ln of each row's softmax denominator:\n"
	       "                 '<f4', [B, H, Lq] ([H, Lq] for 3-D input)\n"
	       "  --entropy FILE also write each row's attention entropy -sum_j P ln P\n"
	       "                 (docs/diagnostics.md), shaped like LSE\n"
	       "  --mean-distance FILE\n"
	       "                 also write each row's mean attention distance\n"
	       "                 sum_j P |pos_q - pos_k|, shaped like LSE\n"
	       "  Outputs appear complete and together, or not at all.\n"
	       "\n"
	       "APE parameters: one value for every head, or H comma-separated values.\n"
	       "  --delta X      linear decay (default 2^(-4/3) = %.16g)\n"
	       "  --beta X       log decay (default delta/10 = %.16g)\n"
	       "  --gamma X      square-root decay (default delta/10 = %.16g)\n"
	       "  --lambda X     rotation and temperature adaptivity, >= 0 (default %g)\n"
	       "  These defaults are the initial values the APE seed suggests for training.\n"
	       "  The library's differ: ape_attn_desc_init() sets all four to 0, which is\n"
	       "  plain RoPE attention.\n"
	       "\n"
	       "Other parameters:\n"
	       "  --rope-base X  RoPE base (default 10000)\n"
	       "  --scale X      score scale (default 1/sqrt(D))\n"
	       "  --no-causal    every query sees every key (default: causal)\n"
	       "  --layout L     rotary pairs: half, (p, p + D/2), the default, or\n"
	       "                 interleaved, (2p, 2p + 1)\n"
	       "  --q-start N    position of query row 0 (default k-start + Lk - Lq)\n"
	       "  --k-start N    position of key row 0 (default 0)\n"
	       "  --skip-tol X   far-key skipping tolerance (default 2^-24; 0: never skip)\n"
	       "\n"
	       "Computation:\n"
	       "  --dtype T      storage type to compute in: f32, f16 or bf16 (default: the\n"
	       "                 input's). Inputs are converted, rounding to nearest even.\n"
	       "                 O keeps the input's dtype; as npy has no bf16, '<f4' input\n"
	       "                 with --dtype bf16 gives a '<f4' O.\n"
	       "  --backend B    auto (the default), ref, opencl or cuda. auto honours the\n"
	       "                 APE_BACKEND environment variable, and says so on stderr\n"
	       "                 when it passes over a preferred backend.\n"
	       "  --device N     device index within the backend, or with auto among all\n"
	       "                 devices, most preferred first (default: the first); or a\n"
	       "                 PCI address (0000:03:00.0, see ape-info), run through its\n"
	       "                 default backend or the one --backend names\n"
	       "  --devices LIST several devices at once, comma-separated, each as --device\n"
	       "                 takes it with a backend (opencl:0,opencl:1,ref); the query\n"
	       "                 chunks are shared out by each device's speed\n"
	       "  --stats        print device, times, (query, key) pair counts, chunks, bytes\n"
	       "                 copied and peak device memory to stderr\n"
	       "\n"
	       "Long sequences: inputs of any length are streamed through the device in\n"
	       "chunks, copies overlapping kernels, results merged by their LSE.\n"
	       "  --chunk N      most tokens per chunk, queries and keys (default 4096)\n"
	       "  --max-device-mem BYTES\n"
	       "                 device memory the call may hold (e.g. 268435456 or 256M;\n"
	       "                 default 3/4 of the device's); chunks shrink to fit\n"
	       "  --trace FILE   write every chunk's copies and kernels as Chrome trace-event\n"
	       "                 JSON (open in https://ui.perfetto.dev or chrome://tracing)\n"
	       "\n"
	       "KV cache: compute through ape_kv_cache the way a decoder does, causal only.\n"
	       "  --kv-cache N   N query rows per attend (1: token by token); the keys up to\n"
	       "                 each step's last query are appended just before it\n"
	       "  --kv-block N   tokens per cache block (default 256)\n"
	       "  --kv-capacity N  tokens the cache holds (default: all of K)\n"
	       "  --kv-release   let the cache drop blocks the skip bound proves no later\n"
	       "                 query can reach (needs delta > 0; the query norm bound is\n"
	       "                 taken from Q)\n"
	       "\n"
	       "Training: the backward pass, after the forward, in the same call.\n"
	       "  --backward FILE  dL/dO, Q's shape, '<f4' or '<f2'; then give one or more of:\n"
	       "  --dq FILE      dL/dQ: Q's shape and dtype\n"
	       "  --dk FILE      dL/dK: K's shape and dtype (GQA: summed over the query heads\n"
	       "                 sharing each kv head)\n"
	       "  --dv FILE      dL/dV: V's shape and dtype\n"
	       "  --dparams FILE dL/d(delta, beta, gamma, lambda): '<f4' [H, 4], one row per\n"
	       "                 head (a value given once for all heads: sum the column)\n"
	       "  --dlse FILE    dL/dLSE, '<f4', LSE's shape (default: zero)\n"
	       "  -o and --lse are written as without --backward; with --stats the backward\n"
	       "  call's statistics follow the forward's. No --kv-cache; the backward takes\n"
	       "  the forward's parameters, --device or --devices (key chunks split over\n"
	       "  them), --chunk, --max-device-mem; --trace traces the forward only.\n"
	       "  A backend with no backward pass exits with 3.\n"
	       "\n"
	       "  --mpi          under mpirun: the sequence sharded over the ranks (each reads\n"
	       "                 and writes only its rows), by ape-mpi-run; `ape-run --mpi\n"
	       "                 --help` lists its options (docs/distributed.md); exits 3\n"
	       "                 where libape_mpi is not built\n"
	       "  -h, --help     print this text\n"
	       "  --version      print the libape version and exit\n"
	       "\n"
	       "Exit status: 0 success; 2 bad arguments or input files; 3 the backend or\n"
	       "device is not available (with --backward: or has no backward pass); 1 any\n"
	       "other failure. A failed run leaves no output file, gradients included.\n",
	       SEED_DELTA, SEED_DELTA / 10, SEED_DELTA / 10, SEED_LAMBDA);
}

/* ------------------------------------------------------------------ arguments */

static int head_param(struct head_param *p, const char *val, char *msg, size_t len)
{
	free(p->vals);
	p->vals = NULL;
	return cli_parse_float_list(p->flag, val, &p->vals, &p->n, msg, len) ? RUN_USAGE : 0;
}

/* Where an option that is just a string goes; NULL for the others. */
static const char **string_slot(struct run_args *a, int id)
{
	switch (id) {
	case OPT_Q:
		return &a->q;
	case OPT_K:
		return &a->k;
	case OPT_V:
		return &a->v;
	case OPT_O:
		return &a->o;
	case OPT_LSE:
		return &a->lse;
	case OPT_ENTROPY:
		return &a->ent;
	case OPT_MEAN_DISTANCE:
		return &a->md;
	case OPT_BACKEND:
		return &a->backend;
	case OPT_TRACE:
		return &a->trace;
	case OPT_DEVICES:
		return &a->devices;
	case OPT_BACKWARD:
		return &a->dout;
	case OPT_DLSE:
		return &a->dlse;
	case OPT_DQ:
		return &a->dq;
	case OPT_DK:
		return &a->dk;
	case OPT_DV:
		return &a->dv;
	case OPT_DPARAMS:
		return &a->dparams;
	}
	return NULL;
}

/* Options whose value is a number or a word from a list. */
static int parse_value(struct run_args *a, int id, const char *val, char *msg, size_t len)
{
	ape_attn_desc *d = &a->desc;
	int64_t n = 0;
	int word = 0;

	switch (id) {
	case OPT_ROPE_BASE:
		return cli_parse_finite("--rope-base", val, &d->rope_base, msg, len);
	case OPT_SKIP_TOL:
		return cli_parse_finite("--skip-tol", val, &d->skip_tol, msg, len);
	case OPT_SCALE:
		d->scale_set = true;
		return cli_parse_finite("--scale", val, &d->scale, msg, len);
	case OPT_Q_START:
		d->q_start_set = true;
		return cli_parse_int64("--q-start", val, INT64_MIN, INT64_MAX, &d->q_start, msg,
				       len);
	case OPT_K_START:
		return cli_parse_int64("--k-start", val, INT64_MIN, INT64_MAX, &d->k_start, msg,
				       len);
	case OPT_DEVICE:
		/* a PCI address or "opencl:1" goes to ape_device_select_spec() as it is */
		if (strchr(val, ':')) {
			a->device_spec = val;
			return 0;
		}
		if (cli_parse_int64("--device", val, 0, INT_MAX, &n, msg, len))
			return APE_EINVAL;
		a->device = (int)n;
		return 0;
	case OPT_CHUNK:
		return cli_parse_int64("--chunk", val, 1, (int64_t)1 << 40, &a->chunk, msg, len);
	case OPT_MAX_MEM:
		return cli_parse_bytes("--max-device-mem", val, &a->max_mem, msg, len);
	case OPT_KV_CACHE:
		return cli_parse_int64("--kv-cache", val, 1, 1 << 20, &a->kv_step, msg, len);
	case OPT_KV_BLOCK:
		return cli_parse_int64("--kv-block", val, 1, 1 << 24, &a->kv_block, msg, len);
	case OPT_KV_CAPACITY:
		return cli_parse_int64("--kv-capacity", val, 1, (int64_t)1 << 40, &a->kv_capacity,
				       msg, len);
	case OPT_LAYOUT:
		if (cli_parse_name("--layout", val, ape_rope_layout_from_name, &word, msg, len))
			return APE_EINVAL;
		d->layout = (ape_rope_layout)word;
		return 0;
	case OPT_DTYPE:
		return cli_parse_name("--dtype", val, ape_dtype_from_name, &a->dtype, msg, len);
	}
	return 0;
}

static int parse_option(struct run_args *a, int id, const char *val, char *msg, size_t len)
{
	const char **slot = string_slot(a, id);

	if (slot) {
		*slot = val;
		return 0;
	}
	switch (id) {
	case OPT_HELP:
		return RUN_HELP;
	case OPT_STATS:
		a->stats = true;
		return 0;
	case OPT_NO_CAUSAL:
		a->desc.causal = false;
		return 0;
	case OPT_KV_RELEASE:
		a->kv_release = true;
		return 0;
	case OPT_DELTA:
	case OPT_BETA:
	case OPT_GAMMA:
	case OPT_LAMBDA:
		return head_param(&a->param[id - OPT_DELTA], val, msg, len);
	}
	return parse_value(a, id, val, msg, len) ? RUN_USAGE : 0;
}

static void args_init(struct run_args *a)
{
	static const char *const flags[4] = { "--delta", "--beta", "--gamma", "--lambda" };
	static const float defs[4] = { (float)SEED_DELTA, (float)(SEED_DELTA / 10),
				       (float)(SEED_DELTA / 10), (float)SEED_LAMBDA };

	memset(a, 0, sizeof(*a));
	a->backend = "auto";
	a->device = -1;
	a->dtype = -1;
	a->kv_block = 0;
	for (int i = 0; i < 4; i++) {
		a->param[i].flag = flags[i];
		a->param[i].def = defs[i];
	}
	ape_attn_desc_init(&a->desc);
}

static void args_free(struct run_args *a)
{
	for (int i = 0; i < 4; i++)
		free(a->param[i].vals);
}

/* --backward and its outputs: each output needs it, and it needs one of them. */
static int check_backward_args(const struct run_args *a, char *msg, size_t len)
{
	const char *const flags[5] = { "--dq", "--dk", "--dv", "--dparams", "--dlse" };
	const char *const vals[5] = { a->dq, a->dk, a->dv, a->dparams, a->dlse };

	if (!a->dout) {
		for (int i = 0; i < 5; i++)
			if (vals[i]) {
				snprintf(msg, len, "%s %s needs --backward DO.npy (dL/dO)", flags[i],
					 vals[i]);
				return RUN_USAGE;
			}
		return 0;
	}
	if (!a->dq && !a->dk && !a->dv && !a->dparams) {
		snprintf(msg, len, "--backward %s: name the gradients wanted: one or more of --dq, "
			 "--dk, --dv, --dparams", a->dout);
		return RUN_USAGE;
	}
	if (a->kv_step) {
		snprintf(msg, len, "--backward %s runs without a KV cache (drop --kv-cache)", a->dout);
		return RUN_USAGE;
	}
	return 0;
}

static int parse_args(int argc, char **argv, struct run_args *a, char *msg, size_t len)
{
	const char *val;
	int i = 1, id, ret;

	while ((id = cli_next(argc, argv, &i, options, &val, msg, len)) != 0) {
		if (id < 0)
			return RUN_USAGE;
		ret = parse_option(a, id, val, msg, len);
		if (ret)
			return ret;
	}
	if (!a->q || !a->k || !a->v || !a->o) {
		snprintf(msg, len, "missing %s (see --help)",
			 !a->q ? "-q Q.npy" : !a->k ? "-k K.npy" : !a->v ? "-v V.npy" : "-o O.npy");
		return RUN_USAGE;
	}
	if (a->devices && (a->device >= 0 || a->device_spec)) {
		snprintf(msg, len, "--device and --devices: give one of them");
		return RUN_USAGE;
	}
	if (a->kv_step && !a->desc.causal) {
		snprintf(msg, len, "--kv-cache: a KV cache computes causal attention (drop "
			 "--no-causal)");
		return RUN_USAGE;
	}
	if (a->kv_step && (a->devices || a->trace)) {
		snprintf(msg, len, "--kv-cache runs on one device and writes no trace (drop %s)",
			 a->devices ? "--devices" : "--trace");
		return RUN_USAGE;
	}
	if (!a->kv_step && (a->kv_block || a->kv_capacity || a->kv_release)) {
		snprintf(msg, len, "%s needs --kv-cache",
			 a->kv_block ? "--kv-block" : a->kv_capacity ? "--kv-capacity" : "--kv-release");
		return RUN_USAGE;
	}
	return check_backward_args(a, msg, len);
}

/* ------------------------------------------------------------------ device */

int run_exit_code(int err)
{
	switch (err) {
	case 0:
		return RUN_OK;
	case APE_EINVAL:
	case APE_EOVERFLOW:
	case APE_EFORMAT:
		return RUN_USAGE;
	case APE_ENOBACKEND:
	case APE_ENODEV:
		return RUN_NODEV;
	default:
		return RUN_FAIL;
	}
}

/* Each comma-separated spec of --devices, through ape_device_select_spec(). */
static int select_list(const struct run_args *a, ape_context *ctx, ape_device **devs, int *ndev,
		       char *msg, size_t len)
{
	const char *p = a->devices;

	*ndev = 0;
	while (*p) {
		const char *comma = strchr(p, ',');
		int n = comma ? (int)(comma - p) : (int)strlen(p);
		ape_selection sel;
		char spec[128];
		int ret;

		if (n && *ndev == APE_MAX_DEVICES) {
			snprintf(msg, len, "--devices %s: more than %d devices", a->devices,
				 APE_MAX_DEVICES);
			return RUN_USAGE;
		}
		if (!n || n >= (int)sizeof(spec)) {
			snprintf(msg, len, "--devices %s: %s", a->devices,
				 !n ? "an empty entry" : "an entry too long");
			return RUN_USAGE;
		}
		snprintf(spec, sizeof(spec), "%.*s", n, p);
		ret = ape_device_select_spec(ctx, spec, &sel);
		if (ret) {
			snprintf(msg, len, "--devices: %s", ape_last_error());
			return run_exit_code(ret);
		}
		devs[(*ndev)++] = sel.device;
		if (a->stats)
			fprintf(stderr, "ape-run: device %d: %s\n", *ndev - 1, sel.note);
		p += n + (comma ? 1 : 0);
	}
	if (!*ndev) {
		snprintf(msg, len, "--devices: no device given");
		return RUN_USAGE;
	}
	return 0;
}

static int open_devices(const struct run_args *a, ape_context **ctx, ape_device **devs,
			int *ndev, char *msg, size_t len)
{
	ape_context_options opts;
	ape_selection sel;
	int ret;

	ape_context_options_init(&opts);
	/* A named backend is the only one probed: `--backend ref` need not start GPU drivers. */
	if (strcmp(a->backend, "auto"))
		opts.backends = a->backend;
	ret = ape_context_create(ctx, &opts);
	if (ret) {
		snprintf(msg, len, "--backend %s: %s", a->backend, ape_last_error());
		return run_exit_code(ret);
	}
	if (a->devices) {
		ret = select_list(a, *ctx, devs, ndev, msg, len);
		if (ret) {
			ape_context_destroy(*ctx);
			*ctx = NULL;
		}
		return ret;
	}
	if (a->device_spec) {
		char spec[128];

		/* "--backend opencl --device 0000:03:00.0": that GPU through OpenCL */
		snprintf(spec, sizeof(spec), "%s%s%s", strcmp(a->backend, "auto") ? a->backend : "",
			 strcmp(a->backend, "auto") ? ":" : "", a->device_spec);
		ret = ape_device_select_spec(*ctx, spec, &sel);
	} else {
		ret = ape_device_select(*ctx, a->backend, a->device, &sel);
	}
	if (ret) {
		snprintf(msg, len, "%s", ape_last_error());
		ape_context_destroy(*ctx);
		*ctx = NULL;
		return run_exit_code(ret);
	}
	/* auto never falls back silently */
	if (a->stats || sel.passed_over)
		fprintf(stderr, "ape-run: device: %s\n", sel.note);
	devs[0] = sel.device;
	*ndev = 1;
	return 0;
}

/* ------------------------------------------------------------------ inputs */

/* Reads one file; `dims` names its last three dimensions for messages ("H, Lq, D"). */
static int load_input(struct input *in, const char *what, const char *dims, char *msg,
		      size_t len)
{
	struct npy_array arr;
	char shp[256];
	int ret;

	ret = npy_load(in->path, &arr, msg, len);
	if (ret)
		return ret == APE_ENOMEM ? RUN_FAIL : RUN_USAGE;
	in->file_dtype = arr.info.dtype;
	in->ndim = arr.info.ndim;
	in->count = arr.info.count;
	in->data = arr.data;
	if (in->ndim != 3 && in->ndim != 4) {
		npy_format_shape(arr.info.shape, arr.info.ndim, shp, sizeof(shp));
		snprintf(msg, len, "%s: shape %s: %s must be 4-D [B, %s] or 3-D [%s]", in->path,
			 shp, what, dims, dims);
		return RUN_USAGE;
	}
	memcpy(in->shape, arr.info.shape, sizeof(in->shape));
	in->t.shape[0] = 1; /* a 3-D file is one batch */
	for (int i = 0; i < in->ndim; i++)
		in->t.shape[4 - in->ndim + i] = arr.info.shape[i];
	return 0;
}

/* Q, K, V and, with --backward, dO as in[3]. */
static int load_inputs(const struct run_args *a, struct input in[4], char *msg, size_t len)
{
	static const char *const what[4] = { "Q", "K", "V", "dO" };
	static const char *const dims[4] = { "H, Lq, D", "Hkv, Lk, D", "Hkv, Lk, D", "H, Lq, D" };
	int ret;

	in[0].path = a->q;
	in[1].path = a->k;
	in[2].path = a->v;
	in[3].path = a->dout;
	for (int i = 0; i < (a->dout ? 4 : 3); i++) {
		ret = load_input(&in[i], what[i], dims[i], msg, len);
		if (ret)
			return ret;
	}
	return 0;
}

static const char *npy_descr(ape_dtype dt)
{
	return dt == APE_F16 ? "'<f2' (float16)" : "'<f4' (float32)";
}

static int mismatch(char *msg, size_t len, const struct input *x, const struct input *y,
		    const char *what, int dim)
{
	snprintf(msg, len, "%s: %s = %" PRId64 " differs from %s's %s = %" PRId64, x->path, what,
		 x->t.shape[dim], y->path, what, y->t.shape[dim]);
	return RUN_USAGE;
}

/* The checks whose failure is best explained in terms of the files; the library checks the rest
 * (sizes, D in 2..256, every parameter) and says so in its own words. */
static int check_inputs(const struct input in[4], char *msg, size_t len)
{
	const struct input *q = &in[0], *k = &in[1], *v = &in[2], *dout = &in[3];
	const int64_t H = q->t.shape[1], Hkv = k->t.shape[1];
	char got[256], want[256];

	for (int i = 1; i < 3; i++)
		if (in[i].file_dtype != q->file_dtype) {
			snprintf(msg, len,
				 "%s: dtype %s differs from %s's %s: Q, K and V must have the same "
				 "dtype", in[i].path, npy_descr(in[i].file_dtype), q->path,
				 npy_descr(q->file_dtype));
			return RUN_USAGE;
		}
	if (k->t.shape[0] != q->t.shape[0])
		return mismatch(msg, len, k, q, "batch size B", 0);
	if (k->t.shape[3] != q->t.shape[3])
		return mismatch(msg, len, k, q, "head dimension D", 3);
	for (int i = 0; i < 4; i++)
		if (v->t.shape[i] != k->t.shape[i])
			return mismatch(msg, len, v, k, i == 0 ? "B" : i == 1 ? "Hkv" :
					i == 2 ? "Lk" : "D", i);
	if (q->t.shape[3] % 2) {
		snprintf(msg, len, "%s: head dimension D = %" PRId64 " is odd: rotary pairs need "
			 "an even D", q->path, q->t.shape[3]);
		return RUN_USAGE;
	}
	if (Hkv > 0 && H % Hkv) {
		snprintf(msg, len,
			 "%s has H = %" PRId64 " heads and %s has Hkv = %" PRId64 ": H must be a "
			 "multiple of Hkv", q->path, H, k->path, Hkv);
		return RUN_USAGE;
	}
	if (dout->path && (dout->ndim != q->ndim ||
			   memcmp(dout->shape, q->shape, sizeof(int64_t) * (size_t)q->ndim))) {
		npy_format_shape(dout->shape, dout->ndim, got, sizeof(got));
		npy_format_shape(q->shape, q->ndim, want, sizeof(want));
		snprintf(msg, len, "--backward %s: shape %s differs from %s's %s: dL/dO has Q's "
			 "shape", dout->path, got, q->path, want);
		return RUN_USAGE;
	}
	return 0;
}

/* Converts every input (dO too, when given) to the computation's storage type. */
static int stage_inputs(struct input in[4], ape_dtype storage, char *msg, size_t len)
{
	for (int i = 0; i < (in[3].path ? 4 : 3); i++) {
		const int64_t *s = in[i].t.shape;
		void *conv;

		if (in[i].file_dtype != storage) {
			conv = malloc(in[i].count ? in[i].count * ape_dtype_size(storage) : 1);
			if (!conv) {
				snprintf(msg, len, "%s: out of memory converting to %s", in[i].path,
					 ape_dtype_name(storage));
				return RUN_FAIL;
			}
			ape_convert(conv, storage, in[i].data, in[i].file_dtype, in[i].count);
			free(in[i].data);
			in[i].data = conv;
		}
		ape_tensor_init(&in[i].t, in[i].data, storage, s[0], s[1], s[2], s[3]);
	}
	return 0;
}

static int set_head_params(struct run_args *a, const struct input *q, char *msg, size_t len)
{
	ape_param *dst[4] = { &a->desc.delta, &a->desc.beta, &a->desc.gamma, &a->desc.lambda };
	const int64_t H = q->t.shape[1];

	for (int i = 0; i < 4; i++) {
		const struct head_param *p = &a->param[i];

		dst[i]->per_head = NULL;
		dst[i]->value = p->vals ? p->vals[0] : p->def;
		if (!p->vals || p->n == 1)
			continue;
		if ((int64_t)p->n != H) {
			snprintf(msg, len,
				 "%s: %zu values given, but %s has H = %" PRId64 " heads: give "
				 "one value or exactly %" PRId64, p->flag, p->n, q->path, H, H);
			return RUN_USAGE;
		}
		dst[i]->per_head = p->vals;
	}
	return 0;
}

/* ------------------------------------------------------------------ outputs */

/*
 * Refuses an output path that cannot work before any time is spent computing, and so that a
 * rename cannot fail after the other output has been renamed into place: the path must not be a
 * directory, and must lie in an existing directory under a name the system accepts.
 */
static int check_output(const char *flag, const char *path, char *msg, size_t len)
{
	const char *slash = strrchr(path, '/');
	int dirlen = slash ? (int)(slash - path + 1) : 1;
	const char *dir = slash ? path : ".";
	char dirbuf[PATH_MAX];
	struct stat st;

	if (!stat(path, &st)) {
		if (!S_ISDIR(st.st_mode))
			return 0;
		snprintf(msg, len, "%s %s: is a directory", flag, path);
		return RUN_USAGE;
	}
	if (errno != ENOENT) {
		snprintf(msg, len, "%s %s: %s", flag, path, strerror(errno));
		return RUN_USAGE;
	}
	snprintf(dirbuf, sizeof(dirbuf), "%.*s", dirlen, dir);
	if (stat(dirbuf, &st) || !S_ISDIR(st.st_mode)) {
		snprintf(msg, len, "%s %s: directory %.*s does not exist", flag, path, dirlen, dir);
		return RUN_USAGE;
	}
	return 0;
}

/* Every file the run writes, by its option; unused entries have a NULL path. */
#define NOUT 9

static void output_names(const struct run_args *a, const char *flag[NOUT],
			 const char *path[NOUT])
{
	static const char *const flags[NOUT] = { "-o", "--lse", "--entropy", "--mean-distance",
						 "--dq", "--dk", "--dv", "--dparams", "--trace" };
	const char *const paths[NOUT] = { a->o, a->lse, a->ent, a->md, a->dq, a->dk, a->dv,
					   a->dparams, a->trace };

	for (int i = 0; i < NOUT; i++) {
		flag[i] = flags[i];
		path[i] = paths[i];
	}
}

static int check_outputs(const struct run_args *a, char *msg, size_t len)
{
	const char *flag[NOUT], *path[NOUT];
	int ret = 0;

	output_names(a, flag, path);
	for (int i = 0; i < NOUT; i++)
		for (int j = i + 1; path[i] && j < NOUT; j++)
			if (path[j] && !strcmp(path[i], path[j])) {
				snprintf(msg, len, "%s and %s both name %s: each output needs a "
					 "file of its own", flag[i], flag[j], path[i]);
				return RUN_USAGE;
			}
	for (int i = 0; !ret && i < NOUT; i++)
		if (path[i])
			ret = check_output(flag[i], path[i], msg, len);
	return ret;
}

/* One .npy output: float32 data, written in `dtype` (float16 rounded once from it). */
struct out_file {
	const char *path;
	ape_dtype dtype;
	int ndim;
	int64_t shape[4];
	const float *data;
	uint64_t count;
};

static void out_like(struct out_file *f, const char *path, const struct input *in,
		     const float *data)
{
	f->path = path;
	f->dtype = in->file_dtype;
	f->ndim = in->ndim;
	memcpy(f->shape, in->shape, sizeof(f->shape));
	f->data = data;
	f->count = in->count;
}

/* Writes f to a temporary file; *conv holds its float16 copy, if any, until the caller frees. */
static int write_pending(struct npy_pending *p, const struct out_file *f, void **conv, char *msg,
			 size_t len)
{
	const void *data = f->data;

	if (f->dtype == APE_F16) {
		*conv = malloc(f->count ? f->count * 2 : 1);
		if (!*conv) {
			snprintf(msg, len, "%s: out of memory", f->path);
			return APE_ENOMEM;
		}
		ape_convert(*conv, APE_F16, f->data, APE_F32, f->count);
		data = *conv;
	}
	return npy_write_pending(p, f->path, f->dtype, f->ndim, f->shape, data, 0, msg, len);
}

/*
 * Writes every output to a temporary file, then renames them all. Should a rename fail despite
 * check_outputs(), the outputs already renamed are removed again: O without its LSE, or O
 * without the gradients asked for, would look like the result of a complete run.
 */
static int write_all(struct out_file *f, int n, char *msg, size_t len)
{
	struct npy_pending p[NOUT];
	int ret = 0, i, done;

	memset(p, 0, sizeof(p));
	for (i = 0; !ret && i < n; i++) {
		void *conv = NULL;

		ret = write_pending(&p[i], &f[i], &conv, msg, len);
		free(conv);
	}
	for (done = 0; !ret && done < n; done++)
		ret = npy_commit(&p[done], msg, len);
	if (ret) {
		for (i = 0; i < done - 1; i++) /* p[done - 1] failed: npy_commit() removed it */
			unlink(f[i].path);
		for (i = 0; i < n; i++)
			npy_discard(&p[i]);
	}
	return run_exit_code(ret);
}

/* A per-row output ([B, H, Lq] float32: LSE, the diagnostics) shaped after O's file f0 */
static void out_rows(struct out_file *f, const struct out_file *f0, const char *path,
		     const struct input *q, const float *data)
{
	*f = *f0;
	f->path = path;
	f->dtype = APE_F32;
	f->ndim = q->ndim - 1;
	f->data = data;
	f->count = q->count / (uint64_t)q->t.shape[3];
}

static int write_outputs(const struct run_args *a, const struct input in[4], const float *o,
			 const float *lse, const float *ent, const float *md,
			 const struct run_grads *g, char *msg, size_t len)
{
	struct out_file f[NOUT];
	int n = 0;

	memset(f, 0, sizeof(f));
	out_like(&f[n++], a->o, &in[0], o);
	if (a->lse)
		out_rows(&f[n++], &f[0], a->lse, &in[0], lse);
	if (a->ent)
		out_rows(&f[n++], &f[0], a->ent, &in[0], ent);
	if (a->md)
		out_rows(&f[n++], &f[0], a->md, &in[0], md);
	if (a->dq)
		out_like(&f[n++], a->dq, &in[0], g->dq);
	if (a->dk)
		out_like(&f[n++], a->dk, &in[1], g->dk);
	if (a->dv)
		out_like(&f[n++], a->dv, &in[2], g->dv);
	if (a->dparams) {
		f[n].path = a->dparams;
		f[n].dtype = APE_F32;
		f[n].ndim = 2;
		f[n].shape[0] = in[0].t.shape[1];
		f[n].shape[1] = 4;
		f[n].data = g->dparams;
		f[n++].count = (uint64_t)in[0].t.shape[1] * 4;
	}
	return write_all(f, n, msg, len);
}

static int compute(const struct run_args *a, ape_device *const *devs, int ndev,
		   const struct input in[4], struct run_grads *g, char *msg, size_t len)
{
	const int64_t *s = in[0].t.shape;
	size_t rows = (size_t)(s[0] * s[1] * s[2]);
	ape_exec_options eo;
	ape_tensor ot;
	ape_stats st;
	float *o, *lse = NULL, *ent = NULL, *md = NULL;
	int ret;

	o = malloc(in[0].count ? in[0].count * sizeof(float) : 1);
	if (!o) {
		snprintf(msg, len, "out of memory for O (%" PRIu64 " floats)", in[0].count);
		return RUN_FAIL;
	}
	if (a->lse || a->dout) { /* the backward needs the forward's LSE */
		lse = malloc(rows ? rows * sizeof(float) : 1);
		if (!lse) {
			snprintf(msg, len, "out of memory for LSE (%zu floats)", rows);
			ret = RUN_FAIL;
			goto out_free;
		}
	}
	if ((a->ent && !(ent = malloc(rows ? rows * sizeof(float) : 1))) ||
	    (a->md && !(md = malloc(rows ? rows * sizeof(float) : 1)))) {
		snprintf(msg, len, "out of memory for the diagnostics (%zu floats)", rows);
		ret = RUN_FAIL;
		goto out_free;
	}
	/* O in float32 whatever the storage, which the library allows for every type, so that one
	 * path serves all: write_outputs() rounds it to f16 for an '<f2' file, just as a backend
	 * asked for an f16 O rounds its float32 result */
	ape_tensor_init(&ot, o, APE_F32, s[0], s[1], s[2], s[3]);
	ape_stats_init(&st);
	if (a->kv_step) {
		ret = run_kv(a, devs[0], in, &ot, lse, ent, md, &st, msg, len);
		if (ret)
			goto out_free;
	} else {
		ape_exec_options_init(&eo);
		eo.chunk_q = eo.chunk_k = a->chunk;
		eo.max_device_bytes = a->max_mem;
		eo.trace_path = a->trace;
		ret = ent || md ? ape_attention_forward_diag(devs, ndev, &eo, &a->desc, &in[0].t,
							     &in[1].t, &in[2].t, &ot, lse, ent, md,
							     &st)
				: ape_attention_forward_ex(devs, ndev, &eo, &a->desc, &in[0].t,
							   &in[1].t, &in[2].t, &ot, lse, &st);
		if (ret) {
			snprintf(msg, len, "%s", ape_last_error());
			ret = run_exit_code(ret);
			goto out_free;
		}
	}
	if (a->stats)
		run_stats_print(&st, "");
	ret = a->dout ? run_backward(a, devs, ndev, in, &ot, lse, g, msg, len) : 0;
	if (!ret)
		ret = write_outputs(a, in, o, lse, ent, md, g, msg, len);
	if (ret && a->trace)
		unlink(a->trace); /* no output without the others */
out_free:
	free(ent);
	free(md);
	free(lse);
	free(o);
	return ret;
}

/* ------------------------------------------------------------------ main */

static int run(struct run_args *a, char *msg, size_t len)
{
	ape_device *devs[APE_MAX_DEVICES];
	struct input in[4]; /* Q, K, V, dO */
	struct run_grads g;
	ape_context *ctx = NULL;
	int ret, ndev = 0;

	memset(in, 0, sizeof(in));
	memset(&g, 0, sizeof(g));
	ret = check_outputs(a, msg, len);
	if (ret)
		return ret;
	ret = open_devices(a, &ctx, devs, &ndev, msg, len);
	if (ret)
		return ret;
	ret = load_inputs(a, in, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = check_inputs(in, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = set_head_params(a, &in[0], msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_load_dlse(a, &in[0], &g, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = stage_inputs(in, a->dtype < 0 ? in[0].file_dtype : (ape_dtype)a->dtype, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = compute(a, devs, ndev, in, &g, msg, len);
out_free_inputs:
	for (int i = 0; i < 4; i++)
		free(in[i].data);
	run_grads_free(&g);
	ape_context_destroy(ctx);
	return ret;
}

int main(int argc, char **argv)
{
	struct run_args a;
	char msg[2048] = "";
	int ret;

	/* --mpi: the sequence sharded over MPI ranks, by ape-mpi-run (docs/distributed.md) */
	if ((ret = tools_mpi_exec("ape-run", argc, argv, "--files")) >= 0)
		return ret;
	args_init(&a);
	ret = parse_args(argc, argv, &a, msg, sizeof(msg));
	if (ret == RUN_HELP) {
		usage();
		ret = fflush(stdout) ? RUN_FAIL : RUN_OK;
		goto out;
	}
	if (!ret)
		ret = run(&a, msg, sizeof(msg));
	if (ret)
		fprintf(stderr, "ape-run: %s\n", msg);
out:
	args_free(&a);
	return ret;
}
