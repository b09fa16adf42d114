/* SPDX-License-Identifier: MIT */
/*
 * ape-check: the portability test. Runs the same fresh random cases (awkward sizes, GQA, both
 * rope layouts, causal and not, offsets, every storage type, strided layouts, skipping on and
 * off) on every available device, compares each result with the float64 reference, and prints a
 * matrix of the largest errors against the spec's tolerances. Then the backward pass: on every
 * case small enough for the reference to recompute every gradient, a random dO (and on every
 * other case a random dLSE) through ape_attention_backward() into outputs of the storage type,
 * laid out like the inputs, each gradient against the reference's at the spec's "Gradients"
 * tolerances. A backend without a backward pass (APE_ENOTSUP) shows SKIP and says why on
 * stderr; it is no failure. Exits 1 if any cell is out of tolerance (or a device fails a
 * call), 0 otherwise.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape.h"
#include "common/cli.h"
#include "common/refcheck.h"
#include "common/rng.h"
#include "common/seed.h"
#include "check/check.h"

#define MAX_DEVICES CHECK_MAX_DEVICES

/* One kind of case; the data is fresh random each run. */
struct case_spec {
	const char *name;
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dtype;
	bool causal, interleaved, strided, per_head, negative_decay;
	int64_t q_offset; /* q_start - k_start - (Lk - Lq): 0 = end-aligned */
	int64_t shift; /* added to both q_start and k_start */
	double skip_tol; /* < 0: the default 2^-24 */
	int check_rows; /* 0: every row */
};

static const struct case_spec cases[] = {
	/* name, B, H, Hkv, Lq, Lk, D, dtype, causal, interleaved, strided, per_head,
	 * negative_decay, q_offset, shift, skip_tol, check_rows */
	{ "one_row_d64_f32", 1, 1, 1, 1, 1, 64, APE_F32, true, false, false, false, false, 0, 0, -1, 0 },
	{ "l7_gqa_interleaved_f16", 2, 4, 2, 7, 7, 64, APE_F16, true, true, false, true, false, 0, 0, -1, 0 },
	{ "l63_noncausal_bf16", 1, 3, 1, 63, 63, 128, APE_BF16, false, false, false, false, false, 0, 0, -1, 0 },
	{ "l100_d2_strided_f32", 1, 2, 2, 100, 100, 2, APE_F32, true, false, true, true, false, 0, 0, -1, 0 },
	{ "l65_d66_generic_f16", 1, 2, 1, 65, 65, 66, APE_F16, true, true, false, false, false, 0, 0, -1, 0 },
	{ "l33_d256_bf16", 1, 2, 2, 33, 33, 256, APE_BF16, true, false, true, false, false, 0, 0, -1, 0 },
	{ "decode_16_of_3000", 1, 4, 1, 16, 3000, 128, APE_F32, true, false, false, true, false, 0, 0, -1, 0 },
	{ "offset_2p40_f32", 1, 2, 1, 64, 64, 64, APE_F32, true, true, false, false, false, 0, (int64_t)1 << 40, -1, 0 },
	{ "queries_before_keys", 1, 2, 2, 40, 40, 64, APE_F32, true, false, false, false, false, -20, 0, -1, 0 },
	{ "noncausal_far_apart", 1, 2, 1, 31, 77, 64, APE_F16, false, false, false, true, false, 100000, 0, -1, 0 },
	{ "negative_decay_f32", 1, 3, 3, 200, 200, 64, APE_F32, true, false, false, true, true, 0, 0, -1, 0 },
	{ "l4097_skip_f32", 1, 2, 1, 4097, 4097, 64, APE_F32, true, false, false, false, false, 0, 0, -1, 24 },
	{ "l4097_dense_f32", 1, 2, 1, 4097, 4097, 64, APE_F32, true, false, false, false, false, 0, 0, 0, 24 },
	{ "l4097_skip_bf16_d128", 1, 2, 2, 4097, 4097, 128, APE_BF16, true, true, true, false, false, 0, 0, -1, 24 },
};

#define NCASES ((int)(sizeof(cases) / sizeof(cases[0])))

/* The backward is checked where the reference can recompute every gradient quickly: at most
 * this many (query, key) pairs over all heads, visible or not. */
#define BWD_MAX_PAIRS ((int64_t)1 << 20)

struct cell {
	bool ran;
	int err; /* the forward call's code when it failed */
	struct refcheck_result res;
	uint64_t pairs_visible, pairs_computed;
	/* the backward: not run (too large, or the forward failed), run, or skipped */
	bool bwd_ran;
	int bwd_err; /* the backward call's code; APE_ENOTSUP: SKIP */
	struct refcheck_grads grads;
};

/* Tensors of a case, in the order of case_data.t. */
enum { T_Q, T_K, T_V, T_O, T_DO, T_DQ, T_DK, T_DV, NT };

/* Host buffers of one case: Q, K, V, O, dO and the gradients (strided layouts get padded
 * rows), LSE and dLSE. */
struct case_data {
	void *buf[NT];
	ape_tensor t[NT];
	float *lse, *dlse; /* dlse NULL: dL/dLSE = 0 */
	float *params; /* 4 * H */
	float *dparams; /* [H, 4] */
	ape_attn_desc desc;
};

static void free_case(struct case_data *c)
{
	for (int i = 0; i < NT; i++)
		free(c->buf[i]);
	free(c->lse);
	free(c->dlse);
	free(c->params);
	free(c->dparams);
}

static bool has_backward_cell(const struct case_spec *s)
{
	return s->B * s->H * s->Lq * s->Lk <= BWD_MAX_PAIRS;
}

/* --quick: only the cases with a backward cell (the small ones) */
static bool quick;

static bool selected(const struct case_spec *s)
{
	return !quick || has_backward_cell(s);
}

/* A [B, heads, L, D] tensor, stored contiguously or as [B, L, heads, D + 3] with padding. */
static int make_tensor(struct case_data *c, int i, const struct case_spec *s, int64_t heads,
		       int64_t L, ape_rng *rng)
{
	const int64_t row = s->strided ? s->D + 3 : s->D;
	const size_t n = (size_t)(s->B * heads * L * row), esz = ape_dtype_size(s->dtype);
	float x;

	c->buf[i] = malloc(n * esz + 1);
	if (!c->buf[i])
		return -1;
	ape_tensor_init(&c->t[i], c->buf[i], s->dtype, s->B, heads, L, s->D);
	if (s->strided) {
		c->t[i].strides[3] = 1;
		c->t[i].strides[1] = row;
		c->t[i].strides[2] = heads * row;
		c->t[i].strides[0] = L * heads * row;
	}
	for (size_t e = 0; e < n; e++) { /* outputs are overwritten; padding is never read */
		x = i == T_O || i >= T_DQ ? NAN : (float)ape_rng_normal(rng);
		ape_convert((char *)c->buf[i] + e * esz, s->dtype, &x, APE_F32, 1);
	}
	return 0;
}

/* dO, dLSE (every other case) and the gradients' buffers, for the backward cells. */
static int make_backward(struct case_data *c, const struct case_spec *s, int index,
			 ape_rng *rng)
{
	const size_t rows = (size_t)(s->B * s->H * s->Lq);

	c->dparams = malloc(sizeof(float) * (size_t)(4 * s->H));
	if (index % 2) {
		c->dlse = malloc(sizeof(float) * rows + 1);
		if (!c->dlse)
			return -1;
		for (size_t i = 0; i < rows; i++)
			c->dlse[i] = (float)ape_rng_normal(rng);
	}
	return !c->dparams || make_tensor(c, T_DO, s, s->H, s->Lq, rng) ||
			       make_tensor(c, T_DQ, s, s->H, s->Lq, rng) ||
			       make_tensor(c, T_DK, s, s->Hkv, s->Lk, rng) ||
			       make_tensor(c, T_DV, s, s->Hkv, s->Lk, rng)
		       ? -1
		       : 0;
}

static int make_case(struct case_data *c, const struct case_spec *s, int index, ape_rng *rng)
{
	memset(c, 0, sizeof(*c));
	c->lse = malloc(sizeof(float) * (size_t)(s->B * s->H * s->Lq) + 1);
	c->params = malloc(sizeof(float) * (size_t)(4 * s->H));
	if (!c->lse || !c->params || make_tensor(c, T_Q, s, s->H, s->Lq, rng) ||
	    make_tensor(c, T_K, s, s->Hkv, s->Lk, rng) ||
	    make_tensor(c, T_V, s, s->Hkv, s->Lk, rng) || make_tensor(c, T_O, s, s->H, s->Lq, rng) ||
	    (has_backward_cell(s) && make_backward(c, s, index, rng)))
		return -1;
	ape_attn_desc_init(&c->desc);
	for (int64_t h = 0; h < s->H; h++) { /* the seed's values, varied per head when asked */
		double f = s->per_head ? 0.5 + ape_rng_uniform(rng) : 1.0;

		c->params[h] = (float)(SEED_DELTA * f);
		c->params[s->H + h] = (float)(SEED_BETA * f);
		c->params[2 * s->H + h] = (float)(SEED_GAMMA * f);
		c->params[3 * s->H + h] = (float)(SEED_LAMBDA * f);
	}
	if (s->negative_decay)
		c->params[s->H - 1] = -0.05f; /* one head: skipping must switch off everywhere */
	c->desc.delta.per_head = c->params;
	c->desc.beta.per_head = c->params + s->H;
	c->desc.gamma.per_head = c->params + 2 * s->H;
	c->desc.lambda.per_head = c->params + 3 * s->H;
	c->desc.causal = s->causal;
	c->desc.layout = s->interleaved ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	c->desc.k_start = s->shift;
	c->desc.q_start = s->shift + s->Lk - s->Lq + s->q_offset;
	c->desc.q_start_set = true;
	if (s->skip_tol >= 0)
		c->desc.skip_tol = s->skip_tol;
	return 0;
}

static void run_cell(ape_device *dev, ape_device *ref, const struct case_spec *s,
		     struct case_data *c, ape_rng *rng, struct cell *cell)
{
	ape_stats st;
	int64_t rows = s->B * s->H * s->Lq;

	memset(cell, 0, sizeof(*cell));
	cell->ran = true;
	ape_stats_init(&st);
	cell->err = ape_attention_forward(dev, &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3],
					  c->lse, &st);
	if (cell->err)
		return;
	cell->pairs_visible = st.pairs_visible;
	cell->pairs_computed = st.pairs_computed;
	cell->err = refcheck_sampled(ref, &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3], c->lse,
				     s->check_rows ? s->check_rows : (int)rows, rng, &cell->res);
}

/* The backward from the device's own O and LSE, every gradient, against the reference's. */
static void run_bwd_cell(ape_device *dev, ape_device *ref, const struct case_spec *s,
			 struct case_data *c, struct cell *cell)
{
	const ape_tensor *t = c->t;

	if (!has_backward_cell(s) || cell->err)
		return;
	cell->bwd_ran = true;
	cell->bwd_err = ape_attention_backward(dev, &c->desc, &t[T_Q], &t[T_K], &t[T_V], &t[T_O],
					       c->lse, &t[T_DO], c->dlse, &c->t[T_DQ],
					       &c->t[T_DK], &c->t[T_DV], c->dparams, NULL);
	if (cell->bwd_err)
		return;
	cell->bwd_err = refcheck_backward(ref, &c->desc, &t[T_Q], &t[T_K], &t[T_V], &t[T_O], c->lse,
					  &t[T_DO], c->dlse, &t[T_DQ], &t[T_DK], &t[T_DV],
					  c->dparams, &cell->grads);
}

static bool bwd_skipped(const struct cell *c)
{
	return c->bwd_ran && c->bwd_err == APE_ENOTSUP;
}

static bool cell_ok(const struct cell *c)
{
	if (!c->ran)
		return true;
	if (c->err || !c->res.within_tol)
		return false;
	return !c->bwd_ran || bwd_skipped(c) || (!c->bwd_err && c->grads.within_tol);
}

/* The largest gradient error over the tolerance. */
static double worst_grad(const struct cell *c)
{
	double w = 0;

	for (int g = 0; g < REFCHECK_NGRADS; g++)
		w = fmax(w, c->grads.err[g] / c->grads.tol);
	return w;
}

/* A matrix's first line: its title, then each device's backend:index. */
static void print_header(const char *title, ape_device **devs, int ndev)
{
	ape_device_info info;

	printf("%-28s", title);
	for (int d = 0; d < ndev; d++) {
		char name[32];

		ape_device_get_info(devs[d], &info);
		snprintf(name, sizeof(name), "%s:%d", info.backend, info.backend_index);
		printf(" %22s", name);
	}
	printf("\n");
}

static void print_bwd_matrix(ape_device **devs, int ndev, struct cell (*cells)[MAX_DEVICES])
{
	printf("\n");
	print_header("backward (max error / tol)", devs, ndev);
	for (int i = 0; i < NCASES && ndev; i++) {
		if (!has_backward_cell(&cases[i]))
			continue;
		printf("%-28s", cases[i].name);
		for (int d = 0; d < ndev; d++) {
			const struct cell *c = &cells[i][d];
			char txt[40];

			if (!c->bwd_ran)
				snprintf(txt, sizeof(txt), "-");
			else if (bwd_skipped(c))
				snprintf(txt, sizeof(txt), "SKIP no backward");
			else if (c->bwd_err)
				snprintf(txt, sizeof(txt), "FAIL %s", ape_err_name(c->bwd_err));
			else
				snprintf(txt, sizeof(txt), "dQ dK dV dP %.0e %s", worst_grad(c),
					 c->grads.within_tol ? "ok" : "BAD");
			printf(" %22s", txt);
		}
		printf("\n");
	}
	printf("backward cells: the largest of the four gradients' max error over the spec's "
	       "tolerance times max |G|; \"-\": the forward failed; cases of more than %" PRId64
	       " pairs have none\n", BWD_MAX_PAIRS);
}

static void print_matrix(ape_device **devs, int ndev, struct cell (*cells)[MAX_DEVICES])
{
	print_header("case (max error / tolerance)", devs, ndev);
	for (int i = 0; i < NCASES && ndev; i++) {
		if (!selected(&cases[i]))
			continue;
		printf("%-28s", cases[i].name);
		for (int d = 0; d < ndev; d++) {
			const struct cell *c = &cells[i][d];
			char txt[40];

			if (c->err)
				snprintf(txt, sizeof(txt), "FAIL %s", ape_err_name(c->err));
			else
				snprintf(txt, sizeof(txt), "O %.0e LSE %.0e %s",
					 c->res.max_err_o / c->res.tol_o,
					 c->res.max_err_lse / c->res.tol_lse, cell_ok(c) ? "ok" : "BAD");
			printf(" %22s", txt);
		}
		printf("\n");
	}
	printf("cells show max error divided by the spec's tolerance for the storage type: "
	       "ok <= 1\n");
	print_bwd_matrix(devs, ndev, cells);
}

/* The rest of a cell's JSON object: its backward, if it has one. */
static void print_bwd_json(const struct cell *c)
{
	static const char *const names[REFCHECK_NGRADS] = { "dq", "dk", "dv", "dparams" };

	if (!c->bwd_ran) {
		printf("}");
		return;
	}
	printf(", \"backward\": {\"status\": \"%s\", \"error\": \"%s\"",
	       bwd_skipped(c) ? "skip" : c->bwd_err ? "fail" : c->grads.within_tol ? "ok" : "bad",
	       c->bwd_err ? ape_err_name(c->bwd_err) : "");
	if (!c->bwd_err) {
		printf(", \"tol\": %g", c->grads.tol);
		for (int g = 0; g < REFCHECK_NGRADS; g++)
			printf(", \"max_err_%s\": %.6g", names[g], c->grads.err[g]);
	}
	printf("}}");
}

/* The ragged cells' matrix (tools/check/varlen.c). */
static void print_vmatrix(ape_device **devs, int ndev, struct vcell (*v)[MAX_DEVICES], int nv)
{
	if (!nv)
		return;
	printf("\nragged batches (ape_attention_forward_varlen, every row against the reference's "
	       "ragged call)\n");
	for (int i = 0; i < nv; i++) {
		printf("%-34s %-5s", v[i][0].name, ape_dtype_name(v[i][0].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct vcell *c = &v[i][d];
			char buf[64];

			if (c->err)
				snprintf(buf, sizeof(buf), "ERROR %s", ape_err_name(c->err));
			else
				snprintf(buf, sizeof(buf), "%.2f/%.2f %s (%" PRIu64 " launch%s)",
					 c->max_err_o / c->tol_o, c->max_err_lse / c->tol_lse,
					 c->ok ? "ok" : "BAD", c->launches, c->launches == 1 ? "" : "es");
			printf(" | %-30s", buf);
		}
		printf("\n");
	}
	(void)devs;
}

static void print_vjson(int ndev, struct vcell (*v)[MAX_DEVICES], int nv)
{
	printf(",\n \"ragged\": [");
	for (int i = 0; i < nv; i++) {
		printf("%s\n  {\"name\": \"%s\", \"dtype\": \"%s\", \"results\": [", i ? "," : "",
		       v[i][0].name, ape_dtype_name(v[i][0].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct vcell *c = &v[i][d];

			printf("%s{\"error\": \"%s\", \"rows_checked\": %" PRId64
			       ", \"max_err_o\": %.6g, \"max_err_lse\": %.6g, \"tol_o\": %g, "
			       "\"tol_lse\": %g, \"launches\": %" PRIu64 ", \"ok\": %s}",
			       d ? ", " : "", c->err ? ape_err_name(c->err) : "", c->rows, c->max_err_o,
			       c->max_err_lse, c->tol_o, c->tol_lse, c->launches,
			       c->ok ? "true" : "false");
		}
		printf("]}");
	}
	printf("\n ]");
}

static void print_json(ape_device **devs, int ndev, struct cell (*cells)[MAX_DEVICES], bool ok,
		       struct vcell (*v)[MAX_DEVICES], int nv)
{
	ape_device_info info;

	printf("{\"ok\": %s, \"devices\": [", ok ? "true" : "false");
	for (int d = 0; d < ndev; d++) {
		ape_device_get_info(devs[d], &info);
		printf("%s{\"backend\": \"%s\", \"index\": %d, \"name\": \"%s\"}", d ? ", " : "",
		       info.backend, info.backend_index, info.name);
	}
	printf("],\n \"cases\": [");
	for (int i = 0, shown = 0; i < NCASES && ndev; i++) {
		if (!selected(&cases[i]))
			continue;
		printf("%s\n  {\"name\": \"%s\", \"dtype\": \"%s\", \"results\": [",
		       shown++ ? "," : "", cases[i].name, ape_dtype_name(cases[i].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct cell *c = &cells[i][d];

			printf("%s{\"error\": \"%s\", \"rows_checked\": %d, \"max_err_o\": %.6g, "
			       "\"max_err_lse\": %.6g, \"tol_o\": %g, \"tol_lse\": %g, "
			       "\"pairs_visible\": %" PRIu64 ", \"pairs_computed\": %" PRIu64
			       ", \"ok\": %s",
			       d ? ", " : "", c->err ? ape_err_name(c->err) : "", c->res.rows_checked,
			       c->res.max_err_o, c->res.max_err_lse, c->res.tol_o, c->res.tol_lse,
			       c->pairs_visible, c->pairs_computed, cell_ok(c) ? "true" : "false");
			print_bwd_json(c);
		}
		printf("]}");
	}
	printf("\n ]");
	print_vjson(ndev, v, nv);
	printf("}\n");
}

enum { OPT_JSON = 1, OPT_SEED, OPT_BACKEND, OPT_QUICK, OPT_HELP };

static const struct cli_option options[] = {
	{ "--json", NULL, false, OPT_JSON },
	{ "--seed", NULL, true, OPT_SEED },
	{ "--backend", NULL, true, OPT_BACKEND },
	{ "--quick", NULL, false, OPT_QUICK },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

/* A failed backward says why; a skipped one says it once per device. */
static void report_bwd(ape_device *dev, const struct case_spec *s, const struct cell *c,
		       bool *skip_said)
{
	ape_device_info info;

	if (!c->bwd_ran || !c->bwd_err || (bwd_skipped(c) && *skip_said))
		return;
	ape_device_get_info(dev, &info);
	if (bwd_skipped(c)) {
		fprintf(stderr, "ape-check: backward on %s:%d skipped (SKIP): %s\n", info.backend,
			info.backend_index, ape_last_error());
		*skip_said = true;
	} else {
		fprintf(stderr, "ape-check: %s: backward on %s:%d: %s\n", s->name, info.backend,
			info.backend_index, ape_last_error());
	}
}

int main(int argc, char **argv)
{
	static struct cell cells[NCASES][MAX_DEVICES];
	static struct vcell vcells[CHECK_MAX_VCASES][MAX_DEVICES];
	int nv = 0;
	bool skip_said[MAX_DEVICES] = { false };
	ape_device *all[MAX_DEVICES], *devs[MAX_DEVICES], *ref = NULL;
	ape_context *ctx;
	bool json = false, ok = true;
	const char *val, *backend = NULL;
	char err[256];
	int idx = 1, id, n, ndev = 0;
	int64_t seed = -1;
	ape_rng rng;

	while ((id = cli_next(argc, argv, &idx, options, &val, err, sizeof(err))) > 0) {
		if (id == OPT_JSON) {
			json = true;
		} else if (id == OPT_QUICK) {
			quick = true;
		} else if (id == OPT_BACKEND) {
			backend = val;
			if (!strcmp(val, "ref")) {
				snprintf(err, sizeof(err), "--backend ref: the reference is the "
					 "oracle every device is checked against, not checked itself");
				break;
			}
		} else if (id == OPT_SEED) {
			if (cli_parse_int64("--seed", val, 0, INT64_MAX, &seed, err, sizeof(err)))
				break;
		} else {
			printf("usage: ape-check [--json] [--seed N] [--backend B] [--quick] [--version]\n"
			       "Runs the same random cases on every available device and compares each\n"
			       "with the float64 reference, the forward pass and then the backward pass\n"
			       "(every gradient, on the cases small enough for the reference to recompute\n"
			       "them all); exits 1 if any result is out of tolerance. A backend with no\n"
			       "backward pass shows SKIP in the backward cells, with the reason on\n"
			       "stderr, and does not fail.\n"
			       "  --json       one JSON object instead of the matrices\n"
			       "  --seed N     the cases' random seed (default: fresh)\n"
			       "  --backend B  check only the devices of backend B (opencl, cuda); exits 3\n"
			       "               when it has none\n"
			       "  --quick      only the small cases, those with a backward cell\n"
			       "  --version    print the libape version and exit\n");
			return 0;
		}
	}
	if (id != 0) {
		fprintf(stderr, "ape-check: %s\n", err);
		return 2;
	}
	if (seed >= 0)
		ape_rng_seed(&rng, (uint64_t)seed);
	else
		ape_rng_init(&rng, "ape-check");
	if (ape_context_create(&ctx, NULL)) {
		fprintf(stderr, "ape-check: %s\n", ape_last_error());
		return 1;
	}
	n = ape_device_list(ctx, all, MAX_DEVICES);
	for (int d = 0; d < n; d++) {
		ape_device_info info;

		ape_device_get_info(all[d], &info);
		if (info.kind == APE_DEVICE_HOST_REFERENCE)
			ref = all[d]; /* the oracle: not checked against itself */
		else if (!backend || !strcmp(backend, info.backend))
			devs[ndev++] = all[d];
	}
	if (backend && !ndev) {
		fprintf(stderr, "ape-check: --backend %s: no device of that backend here\n", backend);
		ape_context_destroy(ctx);
		return 3;
	}
	for (int b = 0, nb = ape_backend_get_info(ctx, 0, NULL); b < nb; b++) {
		ape_backend_info bi;

		ape_backend_get_info(ctx, b, &bi);
		if (!bi.available)
			fprintf(stderr, "ape-check: %s not checked: %s\n", bi.name, bi.reason);
	}
	if (!ref) {
		fprintf(stderr, "ape-check: no reference device\n");
		ape_context_destroy(ctx);
		return 1;
	}
	if (!ndev)
		fprintf(stderr, "ape-check: no device besides the reference: nothing to check\n");
	for (int i = 0; i < NCASES && ndev; i++) {
		struct case_data c;

		if (!selected(&cases[i]))
			continue;
		if (make_case(&c, &cases[i], i, &rng)) {
			fprintf(stderr, "ape-check: out of memory\n");
			free_case(&c);
			ape_context_destroy(ctx);
			return 1;
		}
		for (int d = 0; d < ndev; d++) {
			run_cell(devs[d], ref, &cases[i], &c, &rng, &cells[i][d]);
			if (cells[i][d].err)
				fprintf(stderr, "ape-check: %s: %s\n", cases[i].name, ape_last_error());
			run_bwd_cell(devs[d], ref, &cases[i], &c, &cells[i][d]);
			report_bwd(devs[d], &cases[i], &cells[i][d], &skip_said[d]);
			ok &= cell_ok(&cells[i][d]);
		}
		free_case(&c);
	}
	if (ndev && check_varlen(devs, ndev, ref, &rng, quick, vcells, &nv)) {
		ape_context_destroy(ctx);
		return 1;
	}
	for (int i = 0; i < nv; i++)
		for (int d = 0; d < ndev; d++)
			ok &= vcells[i][d].ok;
	if (json) {
		print_json(devs, ndev, cells, ok, vcells, nv);
	} else {
		print_matrix(devs, ndev, cells);
		print_vmatrix(devs, ndev, vcells, nv);
	}
	ape_context_destroy(ctx);
	return ok ? 0 : 1;
}
