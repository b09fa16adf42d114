/* SPDX-License-Identifier: MIT */
/*
 * ape-curve: the seed's experiment. For one or more parameter sets over a list of lengths, one
 * causal forward call with the diagnostics per (set, length) (ape_attention_forward_diag(),
 * docs/diagnostics.md), and per head the mean entropy over the rows, the entropy of the last
 * row and the mean attention distance over the rows: as a table, CSV or JSON on stdout, with
 * progress on stderr. A set may carry a distance-bias table from a .npy file (--bias-table):
 * the curve of T5's buckets, a Gaussian mask, any learned relative bias. Inputs are random
 * N(0,1) Q, K, V (seeded; each length takes the first L rows of the longest), or the first L
 * rows of the .npy files given.
 *
 * Exit status: 0; 2 for a bad argument or input file (nothing is computed); 3 the backend or
 * device asked for is not available; 1 anything else.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape.h"
#include "common/bias_table.h"
#include "common/cli.h"
#include "common/json.h"
#include "common/npy.h"
#include "common/rng.h"
#include "common/seed.h"

#define MAX_SETS 16
#define MAX_LENGTHS 64

enum { CURVE_OK = 0, CURVE_FAIL = 1, CURVE_USAGE = 2, CURVE_NODEV = 3 };

enum {
	OPT_PARAMS = 1, OPT_LENGTHS, OPT_HEADS, OPT_DIM, OPT_SEED, OPT_Q, OPT_K, OPT_V,
	OPT_BACKEND, OPT_DEVICE, OPT_CSV, OPT_JSON, OPT_SKIP_TOL, OPT_NO_CAUSAL, OPT_QUIET,
	OPT_HELP, OPT_BIAS_TABLE, OPT_ROPE_SCALE,
};

static const struct cli_option options[] = {
	{ "--params", "-p", true, OPT_PARAMS },
	{ "--bias-table", "-b", true, OPT_BIAS_TABLE },
	{ "--rope-scale", NULL, true, OPT_ROPE_SCALE },
	{ "--lengths", "-L", true, OPT_LENGTHS },
	{ "--heads", "-H", true, OPT_HEADS },
	{ "--dim", "-D", true, OPT_DIM },
	{ "--seed", NULL, true, OPT_SEED },
	{ "-q", NULL, true, OPT_Q },
	{ "-k", NULL, true, OPT_K },
	{ "-v", NULL, true, OPT_V },
	{ "--backend", NULL, true, OPT_BACKEND },
	{ "--device", NULL, true, OPT_DEVICE },
	{ "--csv", NULL, false, OPT_CSV },
	{ "--json", NULL, false, OPT_JSON },
	{ "--skip-tol", NULL, true, OPT_SKIP_TOL },
	{ "--no-causal", NULL, false, OPT_NO_CAUSAL },
	{ "--quiet", NULL, false, OPT_QUIET },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

static void usage(void)
{
	printf("usage: ape-curve [options]\n"
	       "\n"
	       "Attention entropy and distance against sequence length, per parameter set and\n"
	       "head (docs/diagnostics.md): for each set and length L, one causal forward pass\n"
	       "over L tokens computes every row's entropy ENT_i = -sum_j P_ij ln P_ij and mean\n"
	       "distance MD_i = sum_j P_ij |i - j| in the same pass, and reports per head\n"
	       "  ent_mean  ENT averaged over the L rows\n"
	       "  ent_last  ENT of the last row (it sees all L keys)\n"
	       "  md_mean   MD averaged over the L rows\n"
	       "\n"
	       "  -p, --params SET  a parameter set, repeatable (default: rope, alibi, ape):\n"
	       "                    rope   delta = beta = gamma = lambda = 0 (plain RoPE)\n"
	       "                    alibi  delta = 2^(-4/3) = %.16g only (ALiBi-like\n"
	       "                           linear bias)\n"
	       "                    ape    the seed's: delta = 2^(-4/3), beta = gamma = delta/10,\n"
	       "                           lambda = %g\n"
	       "                    D,B,G,L  any other: delta,beta,gamma,lambda (4 numbers)\n"
	       "  -b, --bias-table FILE  a distance-bias table, '<f4' [H, M] or [1, M]:\n"
	       "                    every score of head h gets T[h][min(|n|, M - 1)] added\n"
	       "                    (T5's buckets, a Gaussian -lambda n^2, a learned bias;\n"
	       "                    docs/ape.md). Right after a --params, that set gets it\n"
	       "                    (named SET+FILE); else it adds a set of its own, plain\n"
	       "                    RoPE plus the table (named after FILE). Repeatable\n"
	       "  --rope-scale X    position interpolation for every set: the rotation\n"
	       "                    turns by n / X (default 1; finite, > 0)\n"
	       "  -L, --lengths LIST  comma-separated lengths (default 64,128,...,16384)\n"
	       "  -H, --heads N     heads of the random inputs (default 4)\n"
	       "  -D, --dim N       head dimension of the random inputs, even, 2..256 (default 64)\n"
	       "  --seed N          seed of the random N(0,1) Q, K, V (default 1); each length\n"
	       "                    takes the first L rows of the longest, so lengths nest, and\n"
	       "                    a length's figures do not depend on the others listed\n"
	       "  -q/-k/-v FILE     instead: Q [B, H, L, D], K and V [B, Hkv, L, D] '<f4' or\n"
	       "                    '<f2' .npy files (3-D: B = 1); each length takes the first L\n"
	       "                    rows of each (default lengths: the files' own L, once)\n"
	       "  --skip-tol X      far-key skipping tolerance (default 2^-24; the call runs\n"
	       "                    under min(X, 2^-24): docs/diagnostics.md, \"Skipping\")\n"
	       "  --no-causal       every query sees every key (default: causal)\n"
	       "  --backend B       auto (the default), ref, opencl or cuda; auto honours\n"
	       "                    APE_BACKEND and never falls back silently\n"
	       "  --device SPEC     device index within the backend, or as ape-run --device\n"
	       "                    (a PCI address, BACKEND:N)\n"
	       "  --csv             CSV on stdout: set,delta,beta,gamma,lambda,L,head,ent_mean,\n"
	       "                    ent_last,md_mean\n"
	       "  --json            JSON on stdout (an object with \"device\" and \"rows\")\n"
	       "  --quiet           no progress on stderr\n"
	       "  -h, --help        print this text\n"
	       "  --version         print the libape version and exit\n"
	       "\n"
	       "Exit status: 0; 2 bad argument or input (nothing computed); 3 backend or device\n"
	       "not available; 1 anything else.\n",
	       SEED_DELTA, SEED_LAMBDA);
}

struct set {
	char name[128];
	double p[4]; /* delta, beta, gamma, lambda */
	const char *table_path; /* --bias-table; NULL: none */
	struct bias_table_file table; /* read once the inputs give H */
};

struct args {
	struct set sets[MAX_SETS];
	int nsets;
	int64_t lengths[MAX_LENGTHS];
	int nlengths;
	int64_t H, D;
	uint64_t seed;
	const char *q, *k, *v;
	const char *backend, *device;
	bool csv, json, causal, quiet;
	double skip_tol, rope_scale;
};

/* ------------------------------------------------------------------ arguments */

static int parse_set(const char *val, struct set *s, char *err, size_t len)
{
	char *copy, *tok, *save = NULL;
	int n = 0;

	memset(s, 0, sizeof(*s));
	if (!strcmp(val, "rope") || !strcmp(val, "alibi") || !strcmp(val, "ape")) {
		snprintf(s->name, sizeof(s->name), "%s", val);
		if (strcmp(val, "rope"))
			s->p[0] = SEED_DELTA;
		if (!strcmp(val, "ape")) {
			s->p[1] = SEED_BETA;
			s->p[2] = SEED_GAMMA;
			s->p[3] = SEED_LAMBDA;
		}
		return 0;
	}
	copy = strdup(val);
	if (!copy) {
		snprintf(err, len, "out of memory");
		return CURVE_FAIL;
	}
	for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (n == 4 || cli_parse_finite("--params", tok, &s->p[n], err, len)) {
			if (n == 4)
				snprintf(err, len,
					 "--params %s: rope, alibi, ape, or four numbers "
					 "delta,beta,gamma,lambda",
					 val);
			free(copy);
			return CURVE_USAGE;
		}
		n++;
	}
	free(copy);
	if (n != 4) {
		snprintf(err, len, "--params %s: rope, alibi, ape, or four numbers delta,beta,gamma,lambda",
			 val);
		return CURVE_USAGE;
	}
	if (s->p[3] < 0) {
		snprintf(err, len, "--params %s: lambda = %g: must be >= 0", val, s->p[3]);
		return CURVE_USAGE;
	}
	snprintf(s->name, sizeof(s->name), "%g,%g,%g,%g", s->p[0], s->p[1], s->p[2], s->p[3]);
	return 0;
}

/* A table's name in a set's: its file's name without the folder and ".npy". */
static void table_name(const char *path, char *out, size_t cap)
{
	const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
	size_t n = strlen(base);

	if (n > 4 && !strcmp(base + n - 4, ".npy"))
		n -= 4;
	snprintf(out, cap, "%.*s", (int)n, base);
}

/*
 * --bias-table: the set of the --params just before it gets the table (previous names that
 * option; the set has none yet), else a new set of plain RoPE plus the table.
 */
static int add_table(struct args *a, int previous, const char *path, char *err, size_t len)
{
	struct set *s = a->nsets ? &a->sets[a->nsets - 1] : NULL;
	char name[80];

	table_name(path, name, sizeof(name));
	if (previous != OPT_PARAMS || !s || s->table_path) {
		if (a->nsets == MAX_SETS) {
			snprintf(err, len, "--bias-table %s: more than %d sets", path, MAX_SETS);
			return CURVE_USAGE;
		}
		s = &a->sets[a->nsets++];
		memset(s, 0, sizeof(*s));
		snprintf(s->name, sizeof(s->name), "%s", name);
	} else {
		char set[sizeof(s->name)];

		snprintf(set, sizeof(set), "%s", s->name);
		snprintf(s->name, sizeof(s->name), "%.40s+%s", set, name);
	}
	s->table_path = path;
	return 0;
}

static int parse_lengths(struct args *a, const char *val, char *err, size_t len)
{
	const char *p = val;

	a->nlengths = 0;
	for (;;) {
		const char *comma = strchr(p, ',');
		char word[32];
		int64_t x;

		if ((comma ? (size_t)(comma - p) : strlen(p)) >= sizeof(word) || p == comma || !*p) {
			snprintf(err, len, "--lengths %s: comma-separated lengths >= 1", val);
			return CURVE_USAGE;
		}
		snprintf(word, sizeof(word), "%.*s", (int)(comma ? comma - p : (long)strlen(p)), p);
		if (cli_parse_int64("--lengths", word, 1, (int64_t)1 << 30, &x, err, len))
			return CURVE_USAGE;
		if (a->nlengths == MAX_LENGTHS) {
			snprintf(err, len, "--lengths: more than %d lengths", MAX_LENGTHS);
			return CURVE_USAGE;
		}
		a->lengths[a->nlengths++] = x;
		if (!comma)
			return 0;
		p = comma + 1;
	}
}

static int parse_args(int argc, char **argv, struct args *a, char *err, size_t len)
{
	int idx = 1, id, previous = 0;
	const char *val;
	int64_t x;

	memset(a, 0, sizeof(*a));
	a->H = 4;
	a->D = 64;
	a->seed = 1;
	a->causal = true;
	a->skip_tol = 0x1p-24;
	a->rope_scale = 1.0;
	a->backend = "auto";
	for (; (id = cli_next(argc, argv, &idx, options, &val, err, len)) > 0; previous = id) {
		switch (id) {
		case OPT_PARAMS:
			if (a->nsets == MAX_SETS) {
				snprintf(err, len, "--params: more than %d sets", MAX_SETS);
				return CURVE_USAGE;
			}
			if (parse_set(val, &a->sets[a->nsets], err, len))
				return CURVE_USAGE;
			a->nsets++;
			break;
		case OPT_BIAS_TABLE:
			if (add_table(a, previous, val, err, len))
				return CURVE_USAGE;
			break;
		case OPT_ROPE_SCALE:
			if (cli_parse_finite("--rope-scale", val, &a->rope_scale, err, len))
				return CURVE_USAGE;
			if (!(a->rope_scale > 0)) {
				snprintf(err, len, "--rope-scale %s: must be > 0", val);
				return CURVE_USAGE;
			}
			break;
		case OPT_LENGTHS:
			if (parse_lengths(a, val, err, len))
				return CURVE_USAGE;
			break;
		case OPT_HEADS:
			if (cli_parse_int64("--heads", val, 1, 4096, &a->H, err, len))
				return CURVE_USAGE;
			break;
		case OPT_DIM:
			if (cli_parse_int64("--dim", val, 2, APE_MAX_D, &a->D, err, len))
				return CURVE_USAGE;
			if (a->D % 2) {
				snprintf(err, len, "--dim %s: must be even", val);
				return CURVE_USAGE;
			}
			break;
		case OPT_SEED:
			if (cli_parse_int64("--seed", val, 0, INT64_MAX, &x, err, len))
				return CURVE_USAGE;
			a->seed = (uint64_t)x;
			break;
		case OPT_Q:
			a->q = val;
			break;
		case OPT_K:
			a->k = val;
			break;
		case OPT_V:
			a->v = val;
			break;
		case OPT_BACKEND:
			a->backend = val;
			break;
		case OPT_DEVICE:
			a->device = val;
			break;
		case OPT_CSV:
			a->csv = true;
			break;
		case OPT_JSON:
			a->json = true;
			break;
		case OPT_SKIP_TOL:
			if (cli_parse_finite("--skip-tol", val, &a->skip_tol, err, len))
				return CURVE_USAGE;
			if (a->skip_tol < 0) {
				snprintf(err, len, "--skip-tol %s: must be >= 0", val);
				return CURVE_USAGE;
			}
			break;
		case OPT_NO_CAUSAL:
			a->causal = false;
			break;
		case OPT_QUIET:
			a->quiet = true;
			break;
		case OPT_HELP:
			usage();
			return fflush(stdout) ? -CURVE_FAIL : -1;
		}
	}
	if (id < 0)
		return CURVE_USAGE;
	if (a->csv && a->json) {
		snprintf(err, len, "--csv and --json: give one of them");
		return CURVE_USAGE;
	}
	if ((a->q || a->k || a->v) && !(a->q && a->k && a->v)) {
		snprintf(err, len, "-q, -k and -v go together (missing %s)",
			 !a->q ? "-q" : !a->k ? "-k" : "-v");
		return CURVE_USAGE;
	}
	if (!a->nsets) {
		parse_set("rope", &a->sets[0], err, len);
		parse_set("alibi", &a->sets[1], err, len);
		parse_set("ape", &a->sets[2], err, len);
		a->nsets = 3;
	}
	if (!a->nlengths && !a->q)
		for (int64_t L = 64; L <= 16384; L *= 2)
			a->lengths[a->nlengths++] = L;
	return 0;
}

/* ------------------------------------------------------------------ inputs */

struct inputs {
	struct npy_array arr[3]; /* from files */
	float *rnd[3]; /* random: [1, H, Lmax, D] float32 each */
	ape_tensor t[3]; /* the whole tensors */
};

static int load_file(const char *flag, const char *path, struct npy_array *arr, ape_tensor *t,
		     char *err, size_t len)
{
	const int64_t *s;
	int off;

	if (npy_load(path, arr, err, len))
		return CURVE_USAGE;
	if (arr->info.ndim != 3 && arr->info.ndim != 4) {
		snprintf(err, len, "%s %s: %d dimensions: expected [B, H, L, D] or [H, L, D]", flag,
			 path, arr->info.ndim);
		return CURVE_USAGE;
	}
	s = arr->info.shape;
	off = arr->info.ndim == 3 ? -1 : 0;
	ape_tensor_init(t, arr->data, arr->info.dtype, off ? 1 : s[0], s[1 + off], s[2 + off],
			s[3 + off]);
	return 0;
}

static int make_inputs(struct args *a, struct inputs *in, char *err, size_t len)
{
	memset(in, 0, sizeof(*in));
	if (a->q) {
		const char *const flags[3] = { "-q", "-k", "-v" }, *paths[3] = { a->q, a->k, a->v };
		int64_t L;

		for (int i = 0; i < 3; i++)
			if (load_file(flags[i], paths[i], &in->arr[i], &in->t[i], err, len))
				return CURVE_USAGE;
		L = in->t[0].shape[2];
		if (in->t[1].shape[2] != L || in->t[2].shape[2] != L) {
			snprintf(err, len, "-q, -k, -v: lengths %" PRId64 ", %" PRId64 ", %" PRId64
				 ": ape-curve takes as many keys as queries",
				 L, in->t[1].shape[2], in->t[2].shape[2]);
			return CURVE_USAGE;
		}
		if (!a->nlengths)
			a->lengths[a->nlengths++] = L;
		for (int i = 0; i < a->nlengths; i++)
			if (a->lengths[i] > L) {
				snprintf(err, len, "--lengths: %" PRId64 " is longer than the files (%"
					 PRId64 " rows)", a->lengths[i], L);
				return CURVE_USAGE;
			}
		return 0;
	}
	{
		int64_t Lmax = 0;
		ape_rng rng;

		for (int i = 0; i < a->nlengths; i++)
			Lmax = a->lengths[i] > Lmax ? a->lengths[i] : Lmax;
		for (int i = 0; i < 3; i++) {
			const size_t n = (size_t)(a->H * Lmax * a->D), per_head = n / (size_t)a->H;

			in->rnd[i] = malloc(n * sizeof(float));
			if (!in->rnd[i]) {
				snprintf(err, len, "out of memory for the inputs (%zu floats)", 3 * n);
				return CURVE_FAIL;
			}
			/* one stream per tensor and head, its rows in order: the first L rows are the
			 * same whatever the other lengths asked for */
			for (int64_t h = 0; h < a->H; h++) {
				ape_rng_seed(&rng, a->seed * 0x9e3779b97f4a7c15ull + (uint64_t)(i * 4096 + h));
				for (size_t j = 0; j < per_head; j++)
					in->rnd[i][(size_t)h * per_head + j] = (float)ape_rng_normal(&rng);
			}
			ape_tensor_init(&in->t[i], in->rnd[i], APE_F32, 1, a->H, Lmax, a->D);
		}
	}
	return 0;
}

static void free_inputs(struct inputs *in)
{
	for (int i = 0; i < 3; i++) {
		npy_free(&in->arr[i]);
		free(in->rnd[i]);
	}
}

/* Every set's --bias-table, for the inputs' H heads: exit status 2 for a file that is not such
 * a table (nothing computed). */
static int load_tables(struct args *a, int64_t H, char *err, size_t len)
{
	for (int si = 0; si < a->nsets; si++) {
		struct set *s = &a->sets[si];
		int ret;

		if (!s->table_path)
			continue;
		ret = bias_table_load("--bias-table", s->table_path, H, &s->table, err, len);
		if (ret)
			return ret == APE_ENOMEM ? CURVE_FAIL : CURVE_USAGE;
	}
	return 0;
}

/* ------------------------------------------------------------------ device */

/* The exit status of a libape error code */
static int exit_code(int err)
{
	return err == APE_EINVAL			  ? CURVE_USAGE
	       : err == APE_ENOBACKEND || err == APE_ENODEV || err == APE_ENOTSUP ? CURVE_NODEV
										: CURVE_FAIL;
}

static int open_device(const struct args *a, ape_context **ctx, ape_device **dev, char *err,
		       size_t len)
{
	ape_context_options co;
	ape_selection sel;
	int ret;

	ape_context_options_init(&co);
	if (strcmp(a->backend, "auto"))
		co.backends = a->backend; /* probe only the backend named */
	ret = ape_context_create(ctx, &co);
	if (ret) {
		snprintf(err, len, "--backend %s: %s", a->backend, ape_last_error());
		return exit_code(ret);
	}
	if (a->device && strcmp(a->backend, "auto")) {
		int64_t idx;
		char buf[96];

		if (!cli_parse_int64("--device", a->device, 0, INT32_MAX, &idx, NULL, 0))
			ret = ape_device_select(*ctx, a->backend, (int)idx, &sel);
		else {
			snprintf(buf, sizeof(buf), "%s:%s", a->backend, a->device);
			ret = ape_device_select_spec(*ctx, buf, &sel);
		}
	} else if (a->device) {
		ret = ape_device_select_spec(*ctx, a->device, &sel);
	} else {
		ret = ape_device_select(*ctx, a->backend, -1, &sel);
	}
	if (ret) {
		snprintf(err, len, "%s: %s", a->device ? "--device" : "--backend", ape_last_error());
		return exit_code(ret);
	}
	*dev = sel.device;
	if (sel.passed_over && !a->quiet)
		fprintf(stderr, "ape-curve: %s\n", sel.note);
	return 0;
}

/* ------------------------------------------------------------------ the curve */

struct point {
	int set;
	int64_t L, head;
	double ent_mean, ent_last, md_mean;
};

static double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One (set, length): one forward call with the diagnostics, then the per-head figures. */
static int one_point(const struct args *a, ape_device *dev, const struct inputs *in, int si,
		     int64_t L, struct point *out, char *err, size_t len)
{
	const ape_tensor *q = &in->t[0];
	const int64_t B = q->shape[0], H = q->shape[1], D = q->shape[3], rows = B * H * L;
	ape_tensor qt, kt, vt, ot;
	ape_attn_desc desc;
	float *o, *ent, *md;
	int ret;

	o = malloc((size_t)(rows * D) * sizeof(float) + 1);
	ent = malloc((size_t)rows * sizeof(float) + 1);
	md = malloc((size_t)rows * sizeof(float) + 1);
	ret = !o || !ent || !md ? APE_ENOMEM : 0;
	if (ret)
		snprintf(err, len, "out of memory at L = %" PRId64, L);
	if (!ret)
		ret = ape_tensor_rows(&in->t[0], 0, L, &qt);
	if (!ret)
		ret = ape_tensor_rows(&in->t[1], 0, L, &kt);
	if (!ret)
		ret = ape_tensor_rows(&in->t[2], 0, L, &vt);
	if (!ret) {
		ape_attn_desc_init(&desc);
		desc.delta.value = (float)a->sets[si].p[0];
		desc.beta.value = (float)a->sets[si].p[1];
		desc.gamma.value = (float)a->sets[si].p[2];
		desc.lambda.value = (float)a->sets[si].p[3];
		desc.causal = a->causal;
		desc.skip_tol = a->skip_tol;
		desc.rope_scale = a->rope_scale;
		if (a->sets[si].table_path)
			bias_table_set(&a->sets[si].table, &desc);
		ape_tensor_init(&ot, o, APE_F32, B, H, L, D);
		ret = ape_attention_forward_diag(&dev, 1, NULL, &desc, &qt, &kt, &vt, &ot, NULL,
						 ent, md, NULL);
		if (ret)
			snprintf(err, len, "%s at L = %" PRId64 ": %s", a->sets[si].name, L,
				 ape_last_error());
	}
	for (int64_t h = 0; !ret && h < H; h++) {
		double se = 0, sm = 0;

		/* a head's figures over its rows, every batch (random inputs: B = 1) */
		for (int64_t b = 0; b < B; b++)
			for (int64_t i = 0; i < L; i++) {
				se += ent[(b * H + h) * L + i];
				sm += md[(b * H + h) * L + i];
			}
		out[h].set = si;
		out[h].L = L;
		out[h].head = h;
		out[h].ent_mean = se / (double)(B * L);
		out[h].md_mean = sm / (double)(B * L);
		out[h].ent_last = 0;
		for (int64_t b = 0; b < B; b++)
			out[h].ent_last += ent[(b * H + h) * L + L - 1] / (double)B;
	}
	free(o);
	free(ent);
	free(md);
	return ret;
}

static void print_points(const struct args *a, const ape_device_info *info,
			 const struct point *pts, size_t n, double wall)
{
	if (a->csv) {
		printf("set,delta,beta,gamma,lambda,L,head,ent_mean,ent_last,md_mean\n");
		for (size_t i = 0; i < n; i++) {
			const struct set *s = &a->sets[pts[i].set];

			printf("\"%s\",%.9g,%.9g,%.9g,%.9g,%" PRId64 ",%" PRId64 ",%.9g,%.9g,%.9g\n",
			       s->name, s->p[0], s->p[1], s->p[2], s->p[3], pts[i].L, pts[i].head,
			       pts[i].ent_mean, pts[i].ent_last, pts[i].md_mean);
		}
		return;
	}
	if (a->json) {
		printf("{\"device\": {\"backend\": \"%s\", \"index\": %d, \"name\": \"%s\"}, "
		       "\"wall_s\": %.3f, \"causal\": %s, \"rows\": [",
		       info->backend, info->backend_index, info->name, wall,
		       a->causal ? "true" : "false");
		for (size_t i = 0; i < n; i++) {
			const struct set *s = &a->sets[pts[i].set];

			printf("%s\n  {\"set\": ", i ? "," : "");
			json_string(stdout, s->name);
			printf(", \"delta\": %.9g, \"beta\": %.9g, \"gamma\": %.9g, \"lambda\": "
			       "%.9g, \"bias_table\": ", s->p[0], s->p[1], s->p[2], s->p[3]);
			json_string(stdout, s->table_path);
			printf(", \"L\": %" PRId64 ", \"head\": %" PRId64 ", \"ent_mean\": %.9g, "
			       "\"ent_last\": %.9g, \"md_mean\": %.9g}", pts[i].L, pts[i].head,
			       pts[i].ent_mean, pts[i].ent_last, pts[i].md_mean);
		}
		printf("\n]}\n");
		return;
	}
	printf("ape-curve: %s:%d %s, %s, %.1f s (ln L: the entropy of uniform attention)\n",
	       info->backend, info->backend_index, info->name,
	       a->causal ? "causal" : "not causal", wall);
	printf("%-24s %7s %4s %9s %9s %9s %7s\n", "set", "L", "head", "ent_mean", "ent_last",
	       "md_mean", "ln L");
	for (size_t i = 0; i < n; i++)
		printf("%-24s %7" PRId64 " %4" PRId64 " %9.4f %9.4f %9.2f %7.3f\n",
		       a->sets[pts[i].set].name, pts[i].L, pts[i].head, pts[i].ent_mean,
		       pts[i].ent_last, pts[i].md_mean, log((double)pts[i].L));
}

static int run(struct args *a, char *err, size_t len)
{
	ape_context *ctx = NULL;
	ape_device *dev = NULL;
	ape_device_info info;
	struct inputs in;
	struct point *pts = NULL;
	size_t n = 0;
	double t0;
	int ret, done = 0;

	ret = make_inputs(a, &in, err, len);
	if (!ret)
		ret = load_tables(a, in.t[0].shape[1], err, len);
	if (!ret)
		ret = open_device(a, &ctx, &dev, err, len);
	if (!ret) {
		pts = calloc((size_t)(a->nsets * a->nlengths) * (size_t)in.t[0].shape[1], sizeof(*pts));
		if (!pts) {
			snprintf(err, len, "out of memory");
			ret = CURVE_FAIL;
		}
	}
	t0 = now_s();
	for (int si = 0; !ret && si < a->nsets; si++)
		for (int li = 0; !ret && li < a->nlengths; li++) {
			const double t1 = now_s();

			ret = one_point(a, dev, &in, si, a->lengths[li], pts + n, err, len);
			if (ret) {
				ret = exit_code(ret);
				break;
			}
			n += (size_t)in.t[0].shape[1];
			if (!a->quiet)
				fprintf(stderr, "ape-curve: [%d/%d] %s L = %" PRId64 ": %.2f s\n",
					++done, a->nsets * a->nlengths, a->sets[si].name,
					a->lengths[li], now_s() - t1);
		}
	if (!ret) {
		ape_device_get_info(dev, &info);
		print_points(a, &info, pts, n, now_s() - t0);
		if (fflush(stdout)) {
			snprintf(err, len, "cannot write the output");
			ret = CURVE_FAIL;
		}
	}
	free(pts);
	free_inputs(&in);
	for (int si = 0; si < a->nsets; si++)
		bias_table_free(&a->sets[si].table);
	ape_context_destroy(ctx);
	return ret;
}

int main(int argc, char **argv)
{
	struct args a;
	char err[2048] = "";
	int ret = parse_args(argc, argv, &a, err, sizeof(err));

	if (ret < 0)
		return ret == -1 ? CURVE_OK : CURVE_FAIL;
	if (!ret)
		ret = run(&a, err, sizeof(err));
	if (ret)
		fprintf(stderr, "ape-curve: %s\n", err);
	return ret;
}
