/* SPDX-License-Identifier: MIT */
/* ape-run's command line: the options, --help, the checks between options (tools/run/run.h). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/seed.h"
#include "run/run.h"

enum {
	OPT_Q = 1, OPT_K, OPT_V, OPT_O, OPT_LSE, OPT_BACKEND, OPT_DEVICE,
	OPT_DELTA, OPT_BETA, OPT_GAMMA, OPT_LAMBDA, /* in this order: they index run_args.param */
	OPT_ROPE_BASE, OPT_ROPE_SCALE, OPT_SCALE, OPT_NO_CAUSAL, OPT_LAYOUT, OPT_Q_START, OPT_K_START,
	OPT_SKIP_TOL, OPT_DTYPE, OPT_STATS, OPT_CHUNK, OPT_MAX_MEM, OPT_TRACE, OPT_DEVICES,
	OPT_KV_CACHE, OPT_KV_BLOCK, OPT_KV_CAPACITY, OPT_KV_RELEASE,
	OPT_BACKWARD, OPT_DLSE, OPT_DQ, OPT_DK, OPT_DV, OPT_DPARAMS, OPT_HELP,
	OPT_ENTROPY, OPT_MEAN_DISTANCE,
	OPT_CU_Q, OPT_CU_K, OPT_POS_Q, OPT_POS_K, OPT_BIAS_TABLE, OPT_DBIAS_TABLE,
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
	{ "--rope-scale", NULL, true, OPT_ROPE_SCALE },
	{ "--bias-table", NULL, true, OPT_BIAS_TABLE },
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
	{ "--dbias-table", NULL, true, OPT_DBIAS_TABLE },
	{ "--cu-seqlens-q", NULL, true, OPT_CU_Q },
	{ "--cu-seqlens-k", NULL, true, OPT_CU_K },
	{ "--positions-q", NULL, true, OPT_POS_Q },
	{ "--positions-k", NULL, true, OPT_POS_K },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

void run_usage(void)
{
	printf("usage: ape-run -q Q.npy -k K.npy -v V.npy -o O.npy [--lse LSE.npy] [options]\n"
	       "       ape-run ... --backward DO.npy [--dq DQ.npy] [--dk DK.npy] [--dv DV.npy]\n"
	       "               [--dparams DP.npy] [--dbias-table DT.npy] [--dlse DLSE.npy]\n"
	       "       ape-run ... --cu-seqlens-q CUQ.npy [--cu-seqlens-k CUK.npy]\n"
	       "               [--positions-q PQ.npy] [--positions-k PK.npy]\n"
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
	       "  --rope-scale X position interpolation: the rotation turns by n / X, the\n"
	       "                 bias and temperature keep n (default 1; finite, > 0)\n"
	       "  --bias-table FILE\n"
	       "                 a distance-bias table, '<f4' [H, M] (a row per head) or\n"
	       "                 [1, M] (one for every head): every score of head h gets\n"
	       "                 T[h][min(|n|, M - 1)] added beside the decay bias (T5's\n"
	       "                 buckets, a Gaussian -lambda n^2, a learned relative bias;\n"
	       "                 docs/ape.md). A device that does not compute tables exits 3\n"
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
	       "  --dbias-table FILE\n"
	       "                 dL/dT of --bias-table's table: '<f4', the table's shape\n"
	       "                 ([1, M]: summed over the heads)\n"
	       "  --dlse FILE    dL/dLSE, '<f4', LSE's shape (default: zero)\n"
	       "  -o and --lse are written as without --backward; with --stats the backward\n"
	       "  call's statistics follow the forward's. No --kv-cache; the backward takes\n"
	       "  the forward's parameters, --device or --devices (key chunks split over\n"
	       "  them), --chunk, --max-device-mem; --trace traces the forward only.\n"
	       "  A backend with no backward pass exits with 3.\n"
	       "\n"
	       "Ragged batches: many sequences in one call, each query seeing the keys of\n"
	       "its own sequence only (ape_attention_forward_varlen_ex(), docs/ape.md).\n"
	       "  --cu-seqlens-q FILE\n"
	       "                 S + 1 query row offsets, '<i8' or '<i4': sequence s has the\n"
	       "                 rows [cu[s], cu[s + 1]) of -q; from 0 to total_q, never\n"
	       "                 decreasing (empty sequences allowed). -q, -k, -v (and\n"
	       "                 --backward) are then packed 3-D files: Q [total_q, H, D],\n"
	       "                 K and V [total_k, Hkv, D]; O is Q's shape, LSE (and --dlse)\n"
	       "                 [total_q, H]\n"
	       "  --cu-seqlens-k FILE\n"
	       "                 S + 1 key row offsets, likewise, to total_k. Either option\n"
	       "                 alone stands for both (the same sequences of queries and\n"
	       "                 keys: a packed batch of documents)\n"
	       "  --positions-q FILE\n"
	       "                 total_q query positions, '<i8' (default: each sequence's\n"
	       "                 queries end-aligned to its keys, Lk - Lq, ..., Lk - 1)\n"
	       "  --positions-k FILE\n"
	       "                 total_k key positions, '<i8' (default: 0, 1, ... in each\n"
	       "                 sequence). A side not given takes its default, whatever\n"
	       "                 the other. Causal: a query sees its sequence's keys at or\n"
	       "                 before its position.\n"
	       "  The parameters, --dtype, the devices, --stats, --chunk, --max-device-mem\n"
	       "  and --backward (with its gradients) work as for one sequence; --q-start,\n"
	       "  --k-start (use the positions), --kv-cache, --trace, --entropy and\n"
	       "  --mean-distance do not, and are refused.\n"
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
	       SEED_DELTA, SEED_BETA, SEED_GAMMA, SEED_LAMBDA);
}

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
	case OPT_CU_Q:
		return &a->cu_q;
	case OPT_CU_K:
		return &a->cu_k;
	case OPT_POS_Q:
		return &a->pos_q;
	case OPT_POS_K:
		return &a->pos_k;
	case OPT_BIAS_TABLE:
		return &a->bias_table;
	case OPT_DBIAS_TABLE:
		return &a->dbias_table;
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
	case OPT_ROPE_SCALE:
		return cli_parse_finite("--rope-scale", val, &d->rope_scale, msg, len);
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
		a->k_start_set = true;
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

void run_args_init(struct run_args *a)
{
	static const char *const flags[4] = { "--delta", "--beta", "--gamma", "--lambda" };
	static const float defs[4] = SEED_PARAMS;

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

void run_args_free(struct run_args *a)
{
	for (int i = 0; i < 4; i++)
		free(a->param[i].vals);
	bias_table_free(&a->table);
}

/* --backward and its outputs: each output needs it, and it needs one of them. */
static int check_backward_args(const struct run_args *a, char *msg, size_t len)
{
	const char *const flags[6] = { "--dq", "--dk", "--dv", "--dparams", "--dbias-table",
				       "--dlse" };
	const char *const vals[6] = { a->dq, a->dk, a->dv, a->dparams, a->dbias_table, a->dlse };

	if (!a->dout) {
		for (int i = 0; i < 6; i++)
			if (vals[i]) {
				snprintf(msg, len, "%s %s needs --backward DO.npy (dL/dO)", flags[i],
					 vals[i]);
				return RUN_USAGE;
			}
		return 0;
	}
	if (a->dbias_table && !a->bias_table) {
		snprintf(msg, len, "--dbias-table %s needs --bias-table FILE (the table it is the "
			 "gradient of)", a->dbias_table);
		return RUN_USAGE;
	}
	if (!a->dq && !a->dk && !a->dv && !a->dparams && !a->dbias_table) {
		snprintf(msg, len, "--backward %s: name the gradients wanted: one or more of --dq, "
			 "--dk, --dv, --dparams, --dbias-table", a->dout);
		return RUN_USAGE;
	}
	if (a->kv_step) {
		snprintf(msg, len, "--backward %s runs without a KV cache (drop --kv-cache)", a->dout);
		return RUN_USAGE;
	}
	return 0;
}

/*
 * The ragged call: one --cu-seqlens-* stands for both (the same sequences of queries and keys,
 * as a packed batch of documents); positions need offsets; the options the ragged call has no
 * use for are refused by name.
 */
static int check_ragged_args(struct run_args *a, char *msg, size_t len)
{
	const char *const flags[6] = { "--entropy", "--mean-distance", "--trace", "--kv-cache",
				       "--q-start", "--k-start" };
	const bool given[6] = { a->ent, a->md, a->trace, a->kv_step, a->desc.q_start_set,
				a->k_start_set };
	static const char *const why[6] = {
		"the ragged call has no diagnostics", "the ragged call has no diagnostics",
		"the ragged call writes no trace", "a KV cache holds one sequence",
		"the positions come from --positions-q", "the positions come from --positions-k",
	};

	if (!a->cu_q && !a->cu_k) {
		if (a->pos_q || a->pos_k) {
			snprintf(msg, len, "%s %s needs --cu-seqlens-q (and --cu-seqlens-k): "
				 "positions are the ragged call's", a->pos_q ? "--positions-q" :
				 "--positions-k", a->pos_q ? a->pos_q : a->pos_k);
			return RUN_USAGE;
		}
		return 0;
	}
	a->cu_q = a->cu_q ? a->cu_q : a->cu_k;
	a->cu_k = a->cu_k ? a->cu_k : a->cu_q;
	for (int i = 0; i < 6; i++)
		if (given[i]) {
			snprintf(msg, len, "%s with --cu-seqlens-q/-k: %s (drop %s)", flags[i], why[i],
				 flags[i]);
			return RUN_USAGE;
		}
	return 0;
}

int run_parse_args(int argc, char **argv, struct run_args *a, char *msg, size_t len)
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
	ret = check_ragged_args(a, msg, len);
	return ret ? ret : check_backward_args(a, msg, len);
}
