/* SPDX-License-Identifier: MIT */
/*
 * ape-check: the portability test, and the conformance suite that certifies a backend. Runs the
 * same fresh random cases (awkward sizes, GQA, both rope layouts, causal and not, offsets,
 * decode rows, lambda = 0 and not, every storage type, strided layouts, skipping on and off) on
 * every available device (or a backend's, or a plugin's: --plugin FILE.so loads one shared
 * object and checks its devices alone), compares each result with the float64 reference, and
 * prints a matrix of the largest errors against the spec's tolerances. Then the backward pass:
 * on every case small enough for the reference to recompute every gradient, a random dO (and
 * on every other case a random dLSE) through ape_attention_backward() into outputs of the
 * storage type, laid out like the inputs, each gradient against the reference's at the spec's
 * "Gradients" tolerances. Then the other groups (tools/check/): ragged batches (the forward,
 * then the backward of the same batch, every row and gradient against the reference's ragged
 * calls), the diagnostics, the KV cache, pool and caller's pages, the device-resident calls,
 * distance-bias tables, determinism and failure behaviour. A call a backend does not do
 * (APE_ENOTSUP naming the device) is "not claimed", no failure, but for the dense forward,
 * which every backend must compute. Every cell is recorded (tools/check/report.c) for the
 * summary table and the JSON. Exits 0 when every cell claimed passed, 1 when one failed (a
 * device failing a call, a plugin refused), 2 on bad usage, 3 when --backend names a backend
 * with no device here.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "ape/ape.h"
#include "ape/ape_backend.h"
#include "common/cli.h"
#include "common/json.h"
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
	int lambda0; /* 0: the seed's lambda; 1: lambda = 0 on every head; 2: on every other head */
	/* > 0: through ape_attention_forward_ex() in chunks of this many query and key rows, whose
	 * partial results merge by their LSE (and no backward cell); 0: ape_attention_forward() */
	int64_t chunk;
};

static const struct case_spec cases[] = {
	/* name, B, H, Hkv, Lq, Lk, D, dtype, causal, interleaved, strided, per_head,
	 * negative_decay, q_offset, shift, skip_tol, check_rows, lambda0, chunk */
	{ "one_row_d64_f32", 1, 1, 1, 1, 1, 64, APE_F32, true, false, false, false, false, 0, 0, -1, 0, 0, 0 },
	{ "l7_gqa_interleaved_f16", 2, 4, 2, 7, 7, 64, APE_F16, true, true, false, true, false, 0, 0, -1, 0, 0, 0 },
	{ "l63_noncausal_bf16", 1, 3, 1, 63, 63, 128, APE_BF16, false, false, false, false, false, 0, 0, -1, 0, 0, 0 },
	{ "l100_d2_strided_f32", 1, 2, 2, 100, 100, 2, APE_F32, true, false, true, true, false, 0, 0, -1, 0, 0, 0 },
	{ "l65_d66_generic_f16", 1, 2, 1, 65, 65, 66, APE_F16, true, true, false, false, false, 0, 0, -1, 0, 0, 0 },
	{ "l33_d256_bf16", 1, 2, 2, 33, 33, 256, APE_BF16, true, false, true, false, false, 0, 0, -1, 0, 0, 0 },
	{ "decode_16_of_3000", 1, 4, 1, 16, 3000, 128, APE_F32, true, false, false, true, false, 0, 0, -1, 0, 0, 0 },
	{ "offset_2p40_f32", 1, 2, 1, 64, 64, 64, APE_F32, true, true, false, false, false, 0, (int64_t)1 << 40, -1, 0, 0, 0 },
	{ "queries_before_keys", 1, 2, 2, 40, 40, 64, APE_F32, true, false, false, false, false, -20, 0, -1, 0, 0, 0 },
	{ "noncausal_far_apart", 1, 2, 1, 31, 77, 64, APE_F16, false, false, false, true, false, 100000, 0, -1, 0, 0, 0 },
	{ "negative_decay_f32", 1, 3, 3, 200, 200, 64, APE_F32, true, false, false, true, true, 0, 0, -1, 0, 0, 0 },
	{ "l4097_skip_f32", 1, 2, 1, 4097, 4097, 64, APE_F32, true, false, false, false, false, 0, 0, -1, 24, 0, 0 },
	{ "l4097_dense_f32", 1, 2, 1, 4097, 4097, 64, APE_F32, true, false, false, false, false, 0, 0, 0, 24, 0, 0 },
	{ "l4097_skip_bf16_d128", 1, 2, 2, 4097, 4097, 128, APE_BF16, true, true, true, false, false, 0, 0, -1, 24, 0, 0 },
	{ "decode1_of_257_lambda0_bf16", 2, 4, 1, 1, 257, 32, APE_BF16, true, false, false, true, false, 0, 0, -1, 0, 1, 0 },
	{ "l48_lambda0_mixed_f16", 1, 4, 2, 48, 48, 64, APE_F16, false, true, false, true, false, 0, 0, -1, 0, 2, 0 },
	{ "l4100_by_24_noncausal_f16", 1, 2, 1, 4100, 24, 32, APE_F16, false, false, false, true, false, 0, 0, -1, 32, 0, 0 },
	{ "decode5_of_4100_skip_bf16", 1, 2, 2, 5, 4100, 64, APE_BF16, true, true, false, false, false, 0, 0, -1, 0, 0, 0 },
	{ "l600_chunks128_skip_f32", 1, 2, 1, 600, 600, 64, APE_F32, true, false, false, true, false, 0, 0, -1, 48, 0, 128 },
	{ "l600_chunks128_dense_f16", 1, 2, 2, 600, 600, 64, APE_F16, true, false, true, false, false, 0, 0, 0, 48, 2, 128 },
};

#define NCASES ((int)(sizeof(cases) / sizeof(cases[0])))

/* The backward is checked where the reference can recompute every gradient quickly: at most
 * this many (query, key) pairs over all heads, visible or not. Cases of more pairs are "long"
 * (the three of 4097 rows): more than a minute on a plain-C device such as the reference, so
 * --quick and --plugin leave them out; the cases of 4100 rows and of small chunks cover the
 * same chunk boundaries and merges at a fraction of the cost. */
#define BWD_MAX_PAIRS ((int64_t)1 << 20)

struct cell {
	bool ran;
	int err; /* the forward call's code when it failed */
	struct refcheck_result res;
	uint64_t pairs_visible, pairs_computed;
	char msg[256]; /* the forward's failure */
	/* the backward: not run (too large, or the forward failed), run, or not claimed */
	bool bwd_ran;
	int bwd_err; /* the backward call's code */
	bool bwd_not_claimed; /* APE_ENOTSUP naming the device: the backend has no backward */
	struct refcheck_grads grads;
	char bwd_msg[256]; /* the backward's failure */
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

static bool is_long(const struct case_spec *s)
{
	return s->B * s->H * s->Lq * s->Lk > BWD_MAX_PAIRS;
}

static bool has_backward_cell(const struct case_spec *s)
{
	return !is_long(s) && !s->chunk;
}

/* --quick: only the small cases; no_long: not the long ones (--quick, --plugin) */
static bool quick, no_long;

static bool selected(const struct case_spec *s)
{
	return !no_long || !is_long(s);
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
		if (s->lambda0 == 1 || (s->lambda0 == 2 && h % 2 == 0))
			c->params[3 * s->H + h] = 0; /* plain RoPE rotation: the separable path */
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
	if (s->chunk) {
		ape_exec_options opts;

		ape_exec_options_init(&opts);
		opts.chunk_q = opts.chunk_k = s->chunk;
		cell->err = ape_attention_forward_ex(&dev, 1, &opts, &c->desc, &c->t[0], &c->t[1],
						     &c->t[2], &c->t[3], c->lse, &st);
	} else {
		cell->err = ape_attention_forward(dev, &c->desc, &c->t[0], &c->t[1], &c->t[2],
						  &c->t[3], c->lse, &st);
	}
	if (!cell->err) {
		cell->pairs_visible = st.pairs_visible;
		cell->pairs_computed = st.pairs_computed;
		cell->err = refcheck_sampled(ref, &c->desc, &c->t[0], &c->t[1], &c->t[2], &c->t[3],
					     c->lse, s->check_rows ? s->check_rows : (int)rows, rng,
					     &cell->res);
	}
	if (cell->err)
		snprintf(cell->msg, sizeof(cell->msg), "%s", ape_last_error());
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
	if (cell->bwd_err) {
		cell->bwd_not_claimed = check_not_claimed(dev, cell->bwd_err, ape_last_error(),
							   APE_BE_CAP_BACKWARD);
	} else {
		cell->bwd_err = refcheck_backward(ref, &c->desc, &t[T_Q], &t[T_K], &t[T_V], &t[T_O],
						  c->lse, &t[T_DO], c->dlse, &t[T_DQ], &t[T_DK],
						  &t[T_DV], c->dparams, &cell->grads);
	}
	if (cell->bwd_err)
		snprintf(cell->bwd_msg, sizeof(cell->bwd_msg), "%s", ape_last_error());
}

static bool cell_ok(const struct cell *c)
{
	return !c->err && c->res.within_tol;
}

/* The largest gradient error over the tolerance. */
static double worst_grad(const struct cell *c)
{
	double w = 0;

	for (int g = 0; g < REFCHECK_NGRADS; g++)
		w = fmax(w, c->grads.err[g] / c->grads.tol);
	return w;
}

/* The records of a dense case's cells on device d: its forward, and its backward if it has
 * one. */
static void record(const struct case_spec *s, const struct cell *c, int d)
{
	static const char *const fwd[] = { "O", "LSE" }, *const bwd[] = { "dQ", "dK", "dV", "dP" };
	const double err[2] = { c->res.max_err_o, c->res.max_err_lse };
	const double tol[2] = { c->res.tol_o, c->res.tol_lse };
	const double gtol[4] = { c->grads.tol, c->grads.tol, c->grads.tol, c->grads.tol };

	if (c->err)
		check_add(CHECK_FORWARD, s->name, d, CHECK_FAIL, NAN, NAN, "%s: %s",
			  ape_err_name(c->err), c->msg);
	else
		check_add_errors(CHECK_FORWARD, s->name, d, 2, fwd, err, tol);
	if (!c->bwd_ran)
		return;
	if (c->bwd_not_claimed)
		check_add(CHECK_BACKWARD, s->name, d, CHECK_NOT_CLAIMED, NAN, NAN, "%s", c->bwd_msg);
	else if (c->bwd_err)
		check_add(CHECK_BACKWARD, s->name, d, CHECK_FAIL, NAN, NAN, "%s: %s",
			  ape_err_name(c->bwd_err), c->bwd_msg);
	else
		check_add_errors(CHECK_BACKWARD, s->name, d, 4, bwd, c->grads.err, gtol);
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
			else if (c->bwd_not_claimed)
				snprintf(txt, sizeof(txt), "not claimed");
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
static void print_bwd_json(FILE *f, const struct cell *c)
{
	static const char *const names[REFCHECK_NGRADS] = { "dq", "dk", "dv", "dparams" };

	if (!c->bwd_ran) {
		fprintf(f, "}");
		return;
	}
	fprintf(f, ", \"backward\": {\"status\": \"%s\", \"error\": \"%s\"",
		c->bwd_not_claimed ? "not_claimed"
		: c->bwd_err	   ? "fail"
		: c->grads.within_tol ? "ok"
				      : "bad",
		c->bwd_err ? ape_err_name(c->bwd_err) : "");
	if (!c->bwd_err) {
		fprintf(f, ", \"tol\": %g", c->grads.tol);
		for (int g = 0; g < REFCHECK_NGRADS; g++)
			fprintf(f, ", \"max_err_%s\": %.6g", names[g], c->grads.err[g]);
	}
	fprintf(f, "}}");
}

/* A ragged cell's backward in the matrix: dQ/dK/dV/dP, each max error over tolerance. */
static void vcell_bwd_text(const struct vcell *c, char *buf, size_t len)
{
	const double *g = c->max_err_grad, t = c->tol_grad;

	if (c->bwd_not_claimed)
		snprintf(buf, len, "bwd not claimed");
	else if (c->bwd_err)
		snprintf(buf, len, "bwd ERROR %s", ape_err_name(c->bwd_err));
	else
		snprintf(buf, len, "%.2g/%.2g/%.2g/%.2g", g[REFCHECK_DQ] / t, g[REFCHECK_DK] / t,
			 g[REFCHECK_DV] / t, g[REFCHECK_DPARAMS] / t);
}

/* The ragged cells' matrix (tools/check/varlen.c). */
static void print_vmatrix(int ndev, struct vcell (*v)[MAX_DEVICES], int nv)
{
	if (!nv)
		return;
	printf("\nragged batches (ape_attention_forward_varlen, then ape_attention_backward_varlen of "
	       "the same batch, every row and gradient against the reference's ragged calls)\n"
	       "cells: O/LSE dQ/dK/dV/dP max error over the spec's tolerance (the gradients' "
	       "relative to max |G_ref|), then the forward's + the backward's launches\n");
	for (int i = 0; i < nv; i++) {
		printf("%-34s %-5s", v[i][0].name, ape_dtype_name(v[i][0].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct vcell *c = &v[i][d];
			char buf[128], bwd[48];

			vcell_bwd_text(c, bwd, sizeof(bwd));
			if (c->err)
				snprintf(buf, sizeof(buf), "ERROR %s", ape_err_name(c->err));
			else if (c->bwd_ran && !c->bwd_err)
				snprintf(buf, sizeof(buf), "%.2g/%.2g %s %s (%" PRIu64 "+%" PRIu64
					 " launches)", c->max_err_o / c->tol_o,
					 c->max_err_lse / c->tol_lse, bwd, c->ok ? "ok" : "BAD",
					 c->launches, c->bwd_launches);
			else
				snprintf(buf, sizeof(buf), "%.2g/%.2g %s %s (%" PRIu64 " launch%s)",
					 c->max_err_o / c->tol_o, c->max_err_lse / c->tol_lse, bwd,
					 c->ok ? "ok" : "BAD", c->launches, c->launches == 1 ? "" : "es");
			printf(" | %-58s", buf);
		}
		printf("\n");
	}
}

/* The rest of a ragged cell's JSON object: its backward, fields prefixed bwd_ (status "ok",
 * "bad", "fail", "not_claimed", or "not_run" after a failed forward). */
static void print_vbwd_json(FILE *f, const struct vcell *c)
{
	static const char *const names[REFCHECK_NGRADS] = { "dq", "dk", "dv", "dparams" };
	bool within = true;

	for (int g = 0; g < REFCHECK_NGRADS; g++)
		within &= c->max_err_grad[g] <= c->tol_grad;
	fprintf(f, ", \"bwd_status\": \"%s\", \"bwd_error\": \"%s\", \"bwd_message\": ",
		!c->bwd_ran	       ? "not_run"
		: c->bwd_not_claimed ? "not_claimed"
		: c->bwd_err	       ? "fail"
		: within	       ? "ok"
				       : "bad",
		c->bwd_err ? ape_err_name(c->bwd_err) : "");
	json_string(f, c->bwd_msg);
	if (c->bwd_ran && !c->bwd_err) {
		fprintf(f, ", \"bwd_tol\": %g", c->tol_grad);
		for (int g = 0; g < REFCHECK_NGRADS; g++)
			fprintf(f, ", \"bwd_max_err_%s\": %.6g", names[g], c->max_err_grad[g]);
		fprintf(f, ", \"bwd_launches\": %" PRIu64, c->bwd_launches);
	}
	fprintf(f, "}");
}

static void print_vjson(FILE *f, int ndev, struct vcell (*v)[MAX_DEVICES], int nv)
{
	fprintf(f, ",\n \"ragged\": [");
	for (int i = 0; i < nv; i++) {
		fprintf(f, "%s\n  {\"name\": \"%s\", \"dtype\": \"%s\", \"results\": [", i ? "," : "",
			v[i][0].name, ape_dtype_name(v[i][0].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct vcell *c = &v[i][d];

			fprintf(f, "%s{\"error\": \"%s\", \"rows_checked\": %" PRId64
				", \"max_err_o\": %.6g, \"max_err_lse\": %.6g, \"tol_o\": %g, "
				"\"tol_lse\": %g, \"launches\": %" PRIu64 ", \"ok\": %s",
				d ? ", " : "", c->err ? ape_err_name(c->err) : "", c->rows,
				c->max_err_o, c->max_err_lse, c->tol_o, c->tol_lse, c->launches,
				c->ok ? "true" : "false");
			print_vbwd_json(f, c);
		}
		fprintf(f, "]}");
	}
	fprintf(f, "\n ]");
}

/* What the run checked, for the JSON's head. */
struct run_info {
	uint64_t seed;
	bool quick, long_cases;
	const char *plugin; /* --plugin's FILE, or NULL */
	bool plugin_found;
	ape_plugin_info pi; /* when plugin_found */
};

static void print_plugin_json(FILE *f, const struct run_info *ri)
{
	fprintf(f, ",\n \"plugin\": ");
	if (!ri->plugin) {
		fprintf(f, "null");
		return;
	}
	fprintf(f, "{\"path\": ");
	json_string(f, ri->plugin_found ? ri->pi.path : ri->plugin);
	fprintf(f, ", \"name\": ");
	json_string(f, ri->plugin_found ? ri->pi.name : "");
	fprintf(f, ", \"loaded\": %s, \"abi_major\": %u, \"abi_minor\": %u, \"devices\": %d",
		ri->plugin_found && ri->pi.loaded ? "true" : "false",
		ri->plugin_found ? ri->pi.abi_major : 0, ri->plugin_found ? ri->pi.abi_minor : 0,
		ri->plugin_found ? ri->pi.device_count : 0);
	fprintf(f, ", \"reason\": ");
	json_string(f, ri->plugin_found ? ri->pi.reason : "the context lists no plugin");
	fprintf(f, "}");
}

static void print_json(FILE *f, ape_device **devs, int ndev, struct cell (*cells)[MAX_DEVICES],
		       struct vcell (*v)[MAX_DEVICES], int nv, const struct run_info *ri)
{
	ape_device_info info;

	fprintf(f, "{\"ok\": %s, \"libape\": \"%s\", \"seed\": %" PRIu64 ", \"quick\": %s, "
		"\"long_cases\": %s", check_all_passed() ? "true" : "false", ape_version_string(),
		ri->seed, ri->quick ? "true" : "false", ri->long_cases ? "true" : "false");
	print_plugin_json(f, ri);
	fprintf(f, ",\n \"devices\": [");
	for (int d = 0; d < ndev; d++) {
		ape_device_get_info(devs[d], &info);
		fprintf(f, "%s{\"backend\": ", d ? ", " : "");
		json_string(f, info.backend);
		fprintf(f, ", \"index\": %d, \"name\": ", info.backend_index);
		json_string(f, info.name);
		fprintf(f, "}");
	}
	fprintf(f, "],\n \"cases\": [");
	for (int i = 0, shown = 0; i < NCASES && ndev; i++) {
		if (!selected(&cases[i]))
			continue;
		fprintf(f, "%s\n  {\"name\": \"%s\", \"dtype\": \"%s\", \"results\": [",
			shown++ ? "," : "", cases[i].name, ape_dtype_name(cases[i].dtype));
		for (int d = 0; d < ndev; d++) {
			const struct cell *c = &cells[i][d];

			fprintf(f, "%s{\"error\": \"%s\", \"rows_checked\": %d, \"max_err_o\": %.6g, "
				"\"max_err_lse\": %.6g, \"tol_o\": %g, \"tol_lse\": %g, "
				"\"pairs_visible\": %" PRIu64 ", \"pairs_computed\": %" PRIu64
				", \"ok\": %s",
				d ? ", " : "", c->err ? ape_err_name(c->err) : "",
				c->res.rows_checked, c->res.max_err_o, c->res.max_err_lse,
				c->res.tol_o, c->res.tol_lse, c->pairs_visible, c->pairs_computed,
				cell_ok(c) ? "true" : "false");
			print_bwd_json(f, c);
		}
		fprintf(f, "]}");
	}
	fprintf(f, "\n ]");
	print_vjson(f, ndev, v, nv);
	check_json_cells(f, devs);
	fprintf(f, "}\n");
}

/* Writes the JSON report to `path` through a temporary file renamed into place: the file is
 * complete or absent. Returns 0, or 1 with a message. */
static int write_report(const char *path, ape_device **devs, int ndev,
			struct cell (*cells)[MAX_DEVICES], struct vcell (*v)[MAX_DEVICES], int nv,
			const struct run_info *ri)
{
	const size_t len = strlen(path) + 32;
	char *tmp = malloc(len);
	FILE *f;
	int ret = 0;

	if (!tmp) {
		fprintf(stderr, "ape-check: out of memory\n");
		return 1;
	}
	snprintf(tmp, len, "%s.tmp-%d", path, (int)getpid());
	f = fopen(tmp, "w");
	if (!f) {
		fprintf(stderr, "ape-check: --report %s: %s\n", path, strerror(errno));
		free(tmp);
		return 1;
	}
	print_json(f, devs, ndev, cells, v, nv, ri);
	if (ferror(f) | fclose(f)) {
		fprintf(stderr, "ape-check: --report %s: writing %s: %s\n", path, tmp,
			strerror(errno));
		ret = 1;
	} else if (rename(tmp, path)) {
		fprintf(stderr, "ape-check: --report %s: %s\n", path, strerror(errno));
		ret = 1;
	}
	if (ret)
		unlink(tmp);
	free(tmp);
	return ret;
}

enum { OPT_JSON = 1, OPT_SEED, OPT_BACKEND, OPT_PLUGIN, OPT_REPORT, OPT_QUICK, OPT_HELP };

static const struct cli_option options[] = {
	{ "--json", NULL, false, OPT_JSON },
	{ "--seed", NULL, true, OPT_SEED },
	{ "--backend", NULL, true, OPT_BACKEND },
	{ "--plugin", NULL, true, OPT_PLUGIN },
	{ "--report", NULL, true, OPT_REPORT },
	{ "--quick", NULL, false, OPT_QUICK },
	{ "--help", "-h", false, OPT_HELP },
	{ NULL, NULL, false, 0 },
};

static void usage(void)
{
	printf("usage: ape-check [--plugin FILE.so | --backend B] [--json] [--report FILE]\n"
	       "                 [--seed N] [--quick] [--version]\n"
	       "The conformance suite: runs the same random cases on every available device (or\n"
	       "the devices of one backend, or of one plugin) against the float64 reference at\n"
	       "the spec's tolerances, in groups: forward (every storage type, both rope layouts,\n"
	       "GQA and MHA, causal or not, offsets, decode rows, lambda = 0 and not, skipping on\n"
	       "and off, strided tensors), backward (every gradient, on the cases small enough for\n"
	       "the reference to recompute them all), ragged batches (the forward, then the\n"
	       "backward's gradients of the same batch), diagnostics, kv (a KV cache,\n"
	       "a KV pool's pages, the caller's pages), resident (calls on device tensors),\n"
	       "tables (distance-bias tables: the forward, a KV cache, a ragged batch, the\n"
	       "backward with the table's gradient; skipping with a table that rises far away),\n"
	       "determinism (the same call twice: the same bits) and failures (bad arguments\n"
	       "refused with a message naming the call and the argument and nothing written; a\n"
	       "failing device op named with its device). A call the device's backend does not\n"
	       "do (APE_ENOTSUP naming the device) is \"not claimed\", no failure, but for the\n"
	       "dense forward and the ops every backend must have. Prints a matrix per group,\n"
	       "then a summary table: cells passed, failed, not claimed per group.\n"
	       "Exits 0 when every cell claimed passed, 1 when one failed or the plugin was\n"
	       "refused, 2 on bad usage, 3 when --backend has no device here.\n"
	       "  --plugin FILE  certify one backend plugin: load FILE alone (no plugin folder,\n"
	       "                 not APE_BACKEND_PATH) and check its devices, every case but\n"
	       "                 the three long ones (4097 rows: APE_BACKEND_PATH=FILE\n"
	       "                 ape-check --backend NAME runs them too); a plugin that is not\n"
	       "                 loaded fails, with the reason\n"
	       "  --backend B    check only the devices of backend B (ref, opencl, cuda, a\n"
	       "                 plugin's name); ref checks the reference against itself\n"
	       "  --json         one JSON object on stdout instead of the tables: every cell\n"
	       "                 (group, cell, device, status, max_err, tol, message) and the\n"
	       "                 summary, besides the matrices' details\n"
	       "  --report FILE  also write that JSON object to FILE (complete or not at all)\n"
	       "  --seed N       the cases' random seed (default: fresh, printed on stderr)\n"
	       "  --quick        only the small cases: not the three long ones, nor the ragged\n"
	       "                 batch of 1000 sequences; the tables' long row has 1024 rows,\n"
	       "                 not 2048 (as with --plugin)\n"
	       "  --version      print the libape version and exit\n");
}

/* A failed backward says why; a backward not claimed says it once per device. */
static void report_bwd(ape_device *dev, const struct case_spec *s, const struct cell *c,
		       bool *said)
{
	ape_device_info info;

	if (!c->bwd_ran || !c->bwd_err || (c->bwd_not_claimed && *said))
		return;
	ape_device_get_info(dev, &info);
	if (c->bwd_not_claimed) {
		fprintf(stderr, "ape-check: backward on %s:%d not claimed: %s\n", info.backend,
			info.backend_index, c->bwd_msg);
		*said = true;
	} else {
		fprintf(stderr, "ape-check: %s: backward on %s:%d: %s\n", s->name, info.backend,
			info.backend_index, c->bwd_msg);
	}
}

/*
 * The plugin --plugin named, among those the context found: records the "load" cell (passed:
 * loaded with devices; failed: refused, with the reason, also on stderr). Returns whether it
 * loaded.
 */
static bool find_plugin(ape_context *ctx, struct run_info *ri)
{
	static const char name[] = "plugin_loads";
	const int n = ape_plugin_get_info(ctx, 0, NULL);
	char want[PATH_MAX], got[PATH_MAX];

	if (!realpath(ri->plugin, want))
		snprintf(want, sizeof(want), "%s", ri->plugin);
	for (int i = 0; i < n && !ri->plugin_found; i++) {
		if (ape_plugin_get_info(ctx, i, &ri->pi))
			continue;
		if (!realpath(ri->pi.path, got))
			snprintf(got, sizeof(got), "%s", ri->pi.path);
		ri->plugin_found = !strcmp(got, want) || n == 1;
	}
	if (!ri->plugin_found) {
		fprintf(stderr, "ape-check: --plugin %s: the context lists no such plugin\n",
			ri->plugin);
		check_add(CHECK_LOAD, name, -1, CHECK_FAIL, NAN, NAN,
			  "the context lists no plugin %s", ri->plugin);
		return false;
	}
	if (!ri->pi.loaded) {
		fprintf(stderr, "ape-check: --plugin %s: not loaded: %s\n", ri->plugin,
			ri->pi.reason);
		check_add(CHECK_LOAD, name, -1, CHECK_FAIL, NAN, NAN, "not loaded: %s",
			  ri->pi.reason);
		return false;
	}
	check_add(CHECK_LOAD, name, -1, CHECK_PASS, NAN, NAN,
		  "backend %s, backend ABI %u.%u, %d device%s", ri->pi.name, ri->pi.abi_major,
		  ri->pi.abi_minor, ri->pi.device_count, ri->pi.device_count == 1 ? "" : "s");
	return true;
}

/* Checks --plugin's and --report's paths before anything runs: a usage error (2) names the
 * option and the path. Returns 0 or 2. */
static int check_paths(const char *plugin, const char *report)
{
	struct stat st;

	if (plugin && stat(plugin, &st)) {
		fprintf(stderr, "ape-check: --plugin %s: %s\n", plugin, strerror(errno));
		return 2;
	}
	if (plugin && S_ISDIR(st.st_mode)) {
		fprintf(stderr, "ape-check: --plugin %s: a folder: name one shared object (a folder "
			"of plugins goes in APE_BACKEND_PATH)\n", plugin);
		return 2;
	}
	if (report) {
		const char *slash = strrchr(report, '/');
		char dir[PATH_MAX];

		snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - report) + 1 : 1,
			 slash ? report : ".");
		if (!*report || (slash && !slash[1]) || access(dir, W_OK)) {
			fprintf(stderr, "ape-check: --report %s: %s\n", report,
				!*report || (slash && !slash[1]) ? "not a file name" : strerror(errno));
			return 2;
		}
	}
	return 0;
}

/* The dense cases on every device: the forward, then the backward. Returns 0 or 1 (out of
 * memory). */
static int run_dense(ape_device **devs, int ndev, ape_device *ref, ape_rng *rng,
		     struct cell (*cells)[MAX_DEVICES])
{
	bool said[MAX_DEVICES] = { false };

	for (int i = 0; i < NCASES && ndev; i++) {
		struct case_data c;

		if (!selected(&cases[i]))
			continue;
		if (make_case(&c, &cases[i], i, rng)) {
			fprintf(stderr, "ape-check: out of memory\n");
			free_case(&c);
			return 1;
		}
		for (int d = 0; d < ndev; d++) {
			ape_device_info info;

			run_cell(devs[d], ref, &cases[i], &c, rng, &cells[i][d]);
			if (cells[i][d].err) {
				ape_device_get_info(devs[d], &info);
				fprintf(stderr, "ape-check: %s on %s:%d: %s\n", cases[i].name,
					info.backend, info.backend_index, cells[i][d].msg);
			}
			run_bwd_cell(devs[d], ref, &cases[i], &c, &cells[i][d]);
			report_bwd(devs[d], &cases[i], &cells[i][d], &said[d]);
			record(&cases[i], &cells[i][d], d);
		}
		free_case(&c);
	}
	return 0;
}

/* Every group after the dense and ragged ones. Returns 0, or 1 when the reference or the host
 * failed (said on stderr). */
static int run_groups(const struct check_env *env)
{
	int (*const groups[])(const struct check_env *) = {
		check_diag, check_kv, check_resident, check_tables, check_determinism,
		check_failures,
	};

	for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]) && env->ndev; g++)
		if (groups[g](env))
			return 1;
	return 0;
}

int main(int argc, char **argv)
{
	static struct cell cells[NCASES][MAX_DEVICES];
	static struct vcell vcells[CHECK_MAX_VCASES][MAX_DEVICES];
	struct run_info ri = { 0 };
	ape_device *all[MAX_DEVICES], *devs[MAX_DEVICES], *ref = NULL;
	ape_context_options opts;
	ape_context *ctx;
	bool json = false, loaded = true;
	const char *val, *backend = NULL, *report = NULL;
	char err[256];
	int idx = 1, id, n, ndev = 0, nv = 0, ret;
	int64_t seed = -1;
	ape_rng rng;

	while ((id = cli_next(argc, argv, &idx, options, &val, err, sizeof(err))) > 0) {
		if (id == OPT_JSON) {
			json = true;
		} else if (id == OPT_QUICK) {
			quick = no_long = true;
		} else if (id == OPT_BACKEND) {
			backend = val;
		} else if (id == OPT_PLUGIN) {
			ri.plugin = val;
		} else if (id == OPT_REPORT) {
			report = val;
		} else if (id == OPT_SEED) {
			if (cli_parse_int64("--seed", val, 0, INT64_MAX, &seed, err, sizeof(err)))
				break;
		} else {
			usage();
			return 0;
		}
	}
	if (id == 0 && backend && ri.plugin) {
		snprintf(err, sizeof(err), "--plugin %s and --backend %s: give one of them",
			 ri.plugin, backend);
		id = -1;
	}
	if (id != 0) {
		fprintf(stderr, "ape-check: %s\n", err);
		return 2;
	}
	if ((ret = check_paths(ri.plugin, report)))
		return ret;
	no_long |= ri.plugin != NULL;
	if (seed >= 0)
		ape_rng_seed(&rng, (uint64_t)seed);
	else
		ape_rng_init(&rng, "ape-check");
	ri.seed = rng.s;
	ri.quick = quick;
	ri.long_cases = !no_long;
	ape_context_options_init(&opts);
	if (ri.plugin) { /* this plugin alone */
		opts.backend_path = ri.plugin;
		opts.flags |= APE_CONTEXT_NO_PLUGIN_DIR;
	}
	if (ape_context_create(&ctx, &opts)) {
		fprintf(stderr, "ape-check: %s\n", ape_last_error());
		return 1;
	}
	if (ri.plugin)
		loaded = find_plugin(ctx, &ri);
	n = ape_device_list(ctx, all, MAX_DEVICES);
	for (int d = 0; d < n; d++) {
		ape_device_info info;
		bool is_ref;

		ape_device_get_info(all[d], &info);
		is_ref = info.kind == APE_DEVICE_HOST_REFERENCE && !strcmp(info.backend, "ref");
		if (is_ref)
			ref = all[d]; /* the oracle */
		if (ri.plugin ? loaded && !strcmp(info.backend, ri.pi.name)
		    : backend ? !strcmp(backend, info.backend)
			      : !is_ref)
			devs[ndev++] = all[d];
	}
	if (backend && !ndev) {
		fprintf(stderr, "ape-check: --backend %s: no device of that backend here\n", backend);
		ape_context_destroy(ctx);
		return 3;
	}
	for (int b = 0, nb = ape_backend_get_info(ctx, 0, NULL); b < nb && !ri.plugin; b++) {
		ape_backend_info bi;

		ape_backend_get_info(ctx, b, &bi);
		if (!bi.available && (!backend || !strcmp(backend, bi.name)))
			fprintf(stderr, "ape-check: %s not checked: %s\n", bi.name, bi.reason);
	}
	if (!ref) {
		fprintf(stderr, "ape-check: no reference device\n");
		ape_context_destroy(ctx);
		return 1;
	}
	if (!ndev && !ri.plugin)
		fprintf(stderr, "ape-check: no device besides the reference: nothing to check\n");
	if (ri.plugin && loaded && !ndev) {
		fprintf(stderr, "ape-check: --plugin %s: no device of backend %s\n", ri.plugin,
			ri.pi.name);
		check_add(CHECK_LOAD, "plugin_has_devices", -1, CHECK_FAIL, NAN, NAN,
			  "no device of backend %s in the context", ri.pi.name);
	}
	ret = run_dense(devs, ndev, ref, &rng, cells);
	if (!ret && ndev && check_varlen(devs, ndev, ref, &rng, quick, vcells, &nv))
		ret = 1;
	if (!ret) {
		const struct check_env env = { devs, ndev, ref, &rng, quick, !no_long };

		ret = run_groups(&env);
	}
	if (ret) {
		ape_context_destroy(ctx);
		return 1;
	}
	if (json) {
		print_json(stdout, devs, ndev, cells, vcells, nv, &ri);
	} else {
		if (ndev) {
			print_matrix(devs, ndev, cells);
			print_vmatrix(ndev, vcells, nv);
			check_print_cells(devs, ndev, CHECK_DIAG, CHECK_FAILURES);
		}
		check_print_summary(ndev);
	}
	if (report && write_report(report, devs, ndev, cells, vcells, nv, &ri))
		ret = 1;
	ape_context_destroy(ctx);
	return ret || !check_all_passed() ? 1 : 0;
}
