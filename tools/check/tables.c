/* SPDX-License-Identifier: MIT */
/*
 * ape-check's distance-bias table cells (tools/check/check.h; docs/ape.md, "Distance-bias
 * tables"): calls with desc->bias_table on each device against the same call on the reference,
 * on fresh random data, every output compared at the spec's tolerances:
 *
 * - the dense forward with a per-head table of T5's buckets shorter than the distances (f32,
 *   and f16 not causal with keys on both sides of the queries), a shared [1, M] table of random
 *   values longer than the distances (bf16), and a Gaussian -c n^2 over one long row whose far
 *   band rises above the decay, with skipping on: a far-key bound that left out the table's
 *   largest value beyond a tile would drop the keys that dominate the last rows;
 * - a KV cache's chunked attend and decode steps, and a ragged batch, with a table;
 * - the backward (dq, dk, dv, dparams and dbias_table) against the reference's at the spec's
 *   "Gradients" tolerance, per-head and shared tables, and the same backward twice: the same
 *   bits, the table's gradient included.
 *
 * A device whose backend does not compute tables answers APE_ENOTSUP naming the device: not
 * claimed; one that states APE_BE_CAP_BIAS_TABLE (check_cell_needs()) and refuses fails.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check/check.h"
#include "common/refcheck.h"

/* ------------------------------------------------------------------ the tables */

enum tkind {
	T5, /* T5's buckets: exact to 8, log-spaced to 128, a random weight per bucket and head */
	NORMAL, /* independent normal values */
	GAUSS_BAND, /* -c n^2, but for a band far away that rises faster than the decay falls */
};

/* The bucket of distance m in T5's scheme of 16 buckets reaching 128. */
static int64_t t5_bucket(int64_t m)
{
	const int64_t b = m < 8 ? m : 8 + (int64_t)(log((double)m / 8) / log(16) * 8);

	return b < 15 ? b : 15;
}

/*
 * A new table of `rows` rows of M entries (free()), NULL when out of memory. GAUSS_BAND is for
 * a decay of slope `delta` (the desc's): its band [3M/4, 7M/8) rises at delta + 0.005 per step
 * and 3 above it, so that a key in the band outweighs the row's nearest by e^5 and more from
 * distance 3M/4 on (M of 1000 or more, the seed's beta and gamma), and the Gaussian resumes
 * after the band, where tiles far enough are left out again.
 */
static float *table_make(ape_rng *rng, enum tkind kind, int64_t rows, int64_t M, double delta)
{
	float *t = malloc(sizeof(float) * (size_t)(rows * M));

	for (int64_t h = 0; t && h < rows; h++) {
		double w[16];

		for (int b = 0; b < 16; b++)
			w[b] = ape_rng_normal(rng);
		for (int64_t m = 0; m < M; m++) {
			const double x = (double)m;

			if (kind == T5)
				t[h * M + m] = (float)w[t5_bucket(m)];
			else if (kind == NORMAL)
				t[h * M + m] = (float)ape_rng_normal(rng);
			else if (m >= M * 3 / 4 && m < M * 7 / 8)
				t[h * M + m] = (float)((delta + 0.005) * x + 3);
			else
				t[h * M + m] = (float)(-1e-4 * x * x);
		}
	}
	return t;
}

static void table_set(ape_attn_desc *desc, const float *t, int64_t rows, int64_t M)
{
	desc->bias_table = t;
	desc->bias_table_len = M;
	desc->bias_table_heads = rows;
}

/* ------------------------------------------------------------------ the dense forward */

struct fcase {
	const char *name;
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dtype;
	bool causal, interleaved;
	int64_t q_offset; /* q_start - (Lk - Lq) */
	enum tkind kind;
	int64_t M;
	bool shared; /* one row for every head */
	float delta; /* 0: the seed's */
	int long_row; /* 0: every run; 1: with the long cases alone; 2: without them alone */
	/* > 0: the device also runs the call in chunks of this many query and key rows, which
	 * the executor's own far-key bound (a chunk pair's) leaves out or not */
	int64_t chunk;
};

static const struct fcase fcases[] = {
	{ "table_t5_gqa_causal_f32", 2, 4, 2, 200, 200, 64, APE_F32, true, false, 0, T5, 128,
	  false, 0, 0, 0 },
	{ "table_t5_noncausal_both_sides_f16", 1, 4, 1, 37, 180, 64, APE_F16, false, true, -60, T5,
	  128, false, 0, 0, 0 },
	{ "table_shared_longer_bf16", 1, 4, 2, 100, 100, 128, APE_BF16, true, false, 0, NORMAL, 300,
	  true, 0, 0, 0 },
	/* one row, 16 x 16 chunks; about 1.5 s a call on the reference at 2048 rows: without
	 * the long cases (--quick, --plugin), half the row, a quarter of the cost */
	{ "table_gauss_far_band_l2048_f32", 1, 1, 1, 2048, 2048, 64, APE_F32, true, false, 0,
	  GAUSS_BAND, 2048, false, 0.05f, 1, 128 },
	{ "table_gauss_far_band_l1024_f32", 1, 1, 1, 1024, 1024, 64, APE_F32, true, false, 0,
	  GAUSS_BAND, 1024, false, 0.05f, 2, 64 },
};

#define NFCASES ((int)(sizeof(fcases) / sizeof(fcases[0])))

/* O (float32) and LSE of one dense call, NaN before it. */
struct fout {
	float *o, *lse;
	ape_tensor to;
};

static void fout_free(struct fout *f)
{
	free(f->o);
	free(f->lse);
}

static int fout_make(struct fout *f, const struct check_qkv *x)
{
	const size_t rows = (size_t)(x->B * x->H * x->Lq);

	f->o = check_nan_floats(rows * (size_t)x->D);
	f->lse = check_nan_floats(rows);
	ape_tensor_init(&f->to, f->o, APE_F32, x->B, x->H, x->Lq, x->D);
	return f->o && f->lse ? 0 : APE_ENOMEM;
}

/* The device's call: in one, or in chunks of `chunk` query and key rows (0: one call). */
static int forward(ape_device *dev, const ape_attn_desc *desc, struct check_qkv *x,
		   struct fout *f, int64_t chunk)
{
	ape_exec_options opts;

	if (!chunk)
		return ape_attention_forward(dev, desc, &x->tq, &x->tk, &x->tv, &f->to, f->lse,
					     NULL);
	ape_exec_options_init(&opts);
	opts.chunk_q = opts.chunk_k = chunk;
	return ape_attention_forward_ex(&dev, 1, &opts, desc, &x->tq, &x->tk, &x->tv, &f->to,
					f->lse, NULL);
}

static int forward_case(const struct check_env *env, const struct fcase *c)
{
	static const char *const labels[] = { "O", "LSE", "O_chunked", "LSE_chunked" };
	const int64_t rows = c->shared ? 1 : c->H;
	const size_t nrows = (size_t)(c->B * c->H * c->Lq);
	const size_t nv = (size_t)(c->B * c->Hkv * c->Lk * c->D);
	const double tol[4] = { refcheck_tol_o(c->dtype), refcheck_tol_lse(c->dtype),
				refcheck_tol_o(c->dtype), refcheck_tol_lse(c->dtype) };
	struct fout want = { 0 };
	struct check_qkv x;
	ape_attn_desc desc;
	float *t = NULL;
	int ret = check_qkv_make(&x, env->rng, c->dtype, c->B, c->H, c->Hkv, c->Lq, c->Lk, c->D);

	check_seed_desc(&desc);
	if (c->delta)
		desc.delta.value = c->delta;
	desc.causal = c->causal;
	desc.layout = c->interleaved ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	desc.q_start = c->Lk - c->Lq + c->q_offset;
	desc.q_start_set = true;
	if (!ret && !(t = table_make(env->rng, c->kind, rows, c->M, desc.delta.value)))
		ret = APE_ENOMEM;
	table_set(&desc, t, rows, c->M);
	if (!ret)
		ret = fout_make(&want, &x);
	if (!ret && (ret = forward(env->ref, &desc, &x, &want, 0)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", c->name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		double err[4];
		int r = 0, n = 0;

		for (int pass = 0; pass < (c->chunk ? 2 : 1) && !r; pass++) {
			struct fout got = { 0 };

			if ((ret = fout_make(&got, &x))) {
				fout_free(&got);
				break;
			}
			r = forward(env->devs[d], &desc, &x, &got, pass ? c->chunk : 0);
			if (!r) {
				err[n++] = check_err_abs(got.o, want.o, nrows * (size_t)c->D,
							 check_max_abs(x.vf, nv));
				err[n++] = check_err_rel(got.lse, want.lse, nrows);
			}
			fout_free(&got);
		}
		if (ret)
			break;
		if (r)
			check_add_error(CHECK_TABLES, c->name, d, env->devs[d], r, true);
		else
			check_add_errors(CHECK_TABLES, c->name, d, n, labels, err, tol);
	}
	fout_free(&want);
	free(t);
	check_qkv_free(&x);
	return ret;
}

/* ------------------------------------------------------------------ the KV cache */

#define KT_B 2
#define KT_HKV 2
#define KT_H 4
#define KT_D 64
#define KT_PREFILL 200 /* tokens appended at once, then KT_STEPS decode steps */
#define KT_CHUNK 8 /* the prefill's last rows, attended as a chunk */
#define KT_STEPS 3
#define KT_T (KT_PREFILL + KT_STEPS)

/* The chunk's attend into out[0], then each decode step's (its token appended first) into
 * out[1 ..]; each out[s] holds O then LSE. Returns the first failure. */
static int kt_run(ape_device *dev, const ape_attn_desc *desc, const ape_tensor *k,
		  const ape_tensor *v, void *const *qs, float *const *out)
{
	const ape_dtype dt = k->dtype;
	ape_kv_cache_options opts;
	ape_kv_cache *cache;
	ape_tensor kr, vr, q, o;
	int ret;

	ape_kv_cache_options_init(&opts);
	opts.B = KT_B;
	opts.Hkv = KT_HKV;
	opts.H = KT_H;
	opts.D = KT_D;
	opts.dtype = dt;
	opts.block_tokens = 32;
	opts.capacity_tokens = 256;
	opts.attend_chunk = 64; /* the keys in four launches */
	if ((ret = ape_kv_cache_create(dev, &opts, &cache)))
		return ret;
	ret = ape_tensor_rows(k, 0, KT_PREFILL, &kr) || ape_tensor_rows(v, 0, KT_PREFILL, &vr)
		      ? APE_EINVAL
		      : ape_kv_cache_append(cache, &kr, &vr);
	for (int s = 0; s <= KT_STEPS && !ret; s++) {
		const int64_t rows = s ? 1 : KT_CHUNK, n = KT_B * KT_H * rows;

		if (s)
			ret = ape_tensor_rows(k, KT_PREFILL + s - 1, 1, &kr) ||
					      ape_tensor_rows(v, KT_PREFILL + s - 1, 1, &vr)
				      ? APE_EINVAL
				      : ape_kv_cache_append(cache, &kr, &vr);
		if (ret)
			break;
		ape_tensor_init(&q, qs[s], dt, KT_B, KT_H, rows, KT_D);
		ape_tensor_init(&o, out[s], APE_F32, KT_B, KT_H, rows, KT_D);
		ret = ape_kv_cache_attend(cache, desc, &q, &o, out[s] + n * KT_D, NULL);
	}
	ape_kv_cache_destroy(cache);
	return ret;
}

static int kv_cache_case(const struct check_env *env)
{
	static const char name[] = "table_kv_cache_decode_f16";
	static const char *const labels[] = { "O", "LSE" };
	const ape_dtype dt = APE_F16;
	const size_t nk = (size_t)KT_B * KT_HKV * KT_T * KT_D;
	float *want[KT_STEPS + 1] = { 0 }, *got[KT_STEPS + 1] = { 0 }, *vf = NULL;
	void *qs[KT_STEPS + 1] = { 0 }, *kd = ape_rng_array(env->rng, nk, dt, NULL);
	void *vd = ape_rng_array(env->rng, nk, dt, NULL);
	float *t = table_make(env->rng, T5, KT_H, 128, 0); /* shorter than the cache */
	ape_attn_desc desc;
	ape_tensor k, v;
	int ret = kd && vd && t && (vf = check_to_f32(vd, dt, nk)) ? 0 : APE_ENOMEM;

	for (int s = 0; s <= KT_STEPS && !ret; s++) {
		const size_t n = (size_t)(KT_B * KT_H * (s ? 1 : KT_CHUNK));

		qs[s] = ape_rng_array(env->rng, n * KT_D, dt, NULL);
		want[s] = check_nan_floats(n * (KT_D + 1));
		got[s] = check_nan_floats(n * (KT_D + 1));
		if (!qs[s] || !want[s] || !got[s])
			ret = APE_ENOMEM;
	}
	check_seed_desc(&desc);
	desc.causal = true;
	table_set(&desc, t, KT_H, 128);
	ape_tensor_init(&k, kd, dt, KT_B, KT_HKV, KT_T, KT_D);
	ape_tensor_init(&v, vd, dt, KT_B, KT_HKV, KT_T, KT_D);
	if (!ret && (ret = kt_run(env->ref, &desc, &k, &v, qs, want)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		const double tol[2] = { refcheck_tol_o(dt), refcheck_tol_lse(dt) };
		const double vmax = check_max_abs(vf, nk);
		double err[2] = { 0 };
		int r;

		for (int s = 0; s <= KT_STEPS; s++) { /* NaN again: unwritten stays visible */
			const size_t n = (size_t)(KT_B * KT_H * (s ? 1 : KT_CHUNK));

			for (size_t i = 0; i < n * (KT_D + 1); i++)
				got[s][i] = NAN;
		}
		r = kt_run(env->devs[d], &desc, &k, &v, qs, got);
		if (r) {
			check_add_error(CHECK_TABLES, name, d, env->devs[d], r, true);
			continue;
		}
		for (int s = 0; s <= KT_STEPS; s++) {
			const size_t n = (size_t)(KT_B * KT_H * (s ? 1 : KT_CHUNK));

			err[0] = fmax(err[0], check_err_abs(got[s], want[s], n * KT_D, vmax));
			err[1] = fmax(err[1], check_err_rel(got[s] + n * KT_D, want[s] + n * KT_D, n));
		}
		check_add_errors(CHECK_TABLES, name, d, 2, labels, err, tol);
	}
	for (int s = 0; s <= KT_STEPS; s++) {
		free(qs[s]);
		free(want[s]);
		free(got[s]);
	}
	free(kd);
	free(vd);
	free(vf);
	free(t);
	return ret;
}

/* ------------------------------------------------------------------ a ragged batch */

static int ragged_case(const struct check_env *env)
{
	static const char name[] = "table_ragged_t5_f32";
	static const char *const labels[] = { "O", "LSE" };
	/* a prefill, a sequence without queries, decode-like rows over 160 keys, a long one */
	static const int64_t cuq[5] = { 0, 40, 40, 47, 147 }, cuk[5] = { 0, 40, 90, 250, 350 };
	const ape_dtype dt = APE_F32;
	const int64_t H = 4, Hkv = 2, D = 64, tq = cuq[4], tk = cuk[4], M = 128;
	const size_t nq = (size_t)(tq * H * D), nk = (size_t)(tk * Hkv * D), rows = (size_t)(tq * H);
	double vmax = 0;
	void *q = ape_rng_array(env->rng, nq, dt, NULL), *k = ape_rng_array(env->rng, nk, dt, NULL);
	float *v = ape_rng_array(env->rng, nk, dt, NULL);
	float *t = table_make(env->rng, T5, H, M, 0);
	float *want = check_nan_floats(nq + rows), *got = check_nan_floats(nq + rows);
	ape_tensor hq, hk, hv, o;
	ape_attn_desc desc;
	ape_varlen vl;
	int ret = q && k && v && t && want && got ? 0 : APE_ENOMEM;

	check_seed_desc(&desc);
	desc.causal = true;
	table_set(&desc, t, H, M);
	ape_varlen_init(&vl);
	vl.num_seqs = 4;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	ape_tensor_init_packed(&hq, q, dt, tq, H, D);
	ape_tensor_init_packed(&hk, k, dt, tk, Hkv, D);
	ape_tensor_init_packed(&hv, v, dt, tk, Hkv, D);
	ape_tensor_init_packed(&o, want, APE_F32, tq, H, D);
	if (!ret && (ret = ape_attention_forward_varlen(env->ref, &desc, &vl, &hq, &hk, &hv, &o,
							want + nq, NULL)))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", name, ape_last_error());
	if (!ret)
		vmax = check_max_abs(v, nk);
	for (int d = 0; d < env->ndev && !ret; d++) {
		const double tol[2] = { refcheck_tol_o(dt), refcheck_tol_lse(dt) };
		double err[2];
		int r;

		for (size_t i = 0; i < nq + rows; i++)
			got[i] = NAN;
		ape_tensor_init_packed(&o, got, APE_F32, tq, H, D);
		r = ape_attention_forward_varlen(env->devs[d], &desc, &vl, &hq, &hk, &hv, &o,
						 got + nq, NULL);
		if (r) {
			check_add_error(CHECK_TABLES, name, d, env->devs[d], r, true);
			continue;
		}
		err[0] = check_err_abs(got, want, nq, vmax);
		err[1] = check_err_rel(got + nq, want + nq, rows);
		check_add_errors(CHECK_TABLES, name, d, 2, labels, err, tol);
	}
	free(q);
	free(k);
	free(v);
	free(t);
	free(want);
	free(got);
	return ret;
}

/* ------------------------------------------------------------------ the backward */

struct bcase {
	const char *name;
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dtype;
	bool causal, dlse;
	int64_t q_offset; /* q_start - (Lk - Lq) */
	enum tkind kind;
	int64_t M;
	bool shared;
	/* NULL, or the cell of the same backward run twice on the device: the same bits */
	const char *twice;
};

static const struct bcase bcases[] = {
	{ "table_backward_t5_gqa_f32", 2, 4, 2, 64, 64, 32, APE_F32, true, true, 0, T5, 24, false,
	  NULL },
	{ "table_backward_shared_f16", 1, 4, 1, 40, 90, 64, APE_F16, false, false, -20, NORMAL, 200,
	  true, "same_bits_backward_table_f16" },
};

#define NBCASES ((int)(sizeof(bcases) / sizeof(bcases[0])))

enum { G_DQ, G_DK, G_DV, G_DP, G_DT, NG };

/* Every gradient of one backward call, float32, NaN before it. */
struct grads {
	float *g[NG];
	size_t n[NG];
	ape_tensor t[3];
};

static void grads_free(struct grads *g)
{
	for (int i = 0; i < NG; i++)
		free(g->g[i]);
}

static int grads_make(struct grads *g, const struct check_qkv *x, int64_t table_entries)
{
	g->n[G_DQ] = (size_t)(x->B * x->H * x->Lq * x->D);
	g->n[G_DK] = g->n[G_DV] = (size_t)(x->B * x->Hkv * x->Lk * x->D);
	g->n[G_DP] = (size_t)(4 * x->H);
	g->n[G_DT] = (size_t)table_entries;
	for (int i = 0; i < NG; i++)
		if (!(g->g[i] = check_nan_floats(g->n[i])))
			return APE_ENOMEM;
	ape_tensor_init(&g->t[0], g->g[G_DQ], APE_F32, x->B, x->H, x->Lq, x->D);
	ape_tensor_init(&g->t[1], g->g[G_DK], APE_F32, x->B, x->Hkv, x->Lk, x->D);
	ape_tensor_init(&g->t[2], g->g[G_DV], APE_F32, x->B, x->Hkv, x->Lk, x->D);
	return 0;
}

/* The inputs of one backward: O and LSE (the reference's forward), dO, dLSE or NULL. */
struct bin {
	void *o, *dout;
	float *lse, *dlse;
	ape_tensor to, tdo;
};

static int backward(ape_device *dev, ape_attn_desc desc, struct check_qkv *x,
		    const struct bin *in, struct grads *g)
{
	desc.dbias_table = g->g[G_DT];
	return ape_attention_backward(dev, &desc, &x->tq, &x->tk, &x->tv, &in->to, in->lse,
				      &in->tdo, in->dlse, &g->t[0], &g->t[1], &g->t[2],
				      g->g[G_DP], NULL);
}

/* The cell of the device's second run b against its first a: the same bits. */
static void same_bits(const char *name, int d, const struct grads *a, const struct grads *b)
{
	static const char *const labels[NG] = { "dQ", "dK", "dV", "dparams", "dbias_table" };

	for (int i = 0; i < NG; i++) {
		if (memcmp(a->g[i], b->g[i], a->n[i] * sizeof(float))) {
			size_t at = 0;

			while (!memcmp(&a->g[i][at], &b->g[i][at], sizeof(float)))
				at++;
			check_add(CHECK_TABLES, name, d, CHECK_FAIL, NAN, NAN,
				  "%s differs between two identical calls (first at value %zu of %zu)",
				  labels[i], at, a->n[i]);
			return;
		}
	}
	check_add(CHECK_TABLES, name, d, CHECK_PASS, NAN, NAN,
		  "two identical calls gave the same bits, dbias_table included");
}

static int backward_case(const struct check_env *env, const struct bcase *c)
{
	static const char *const labels[NG] = { "dQ", "dK", "dV", "dP", "dT" };
	const int64_t rows = c->shared ? 1 : c->H;
	const size_t nq = (size_t)(c->B * c->H * c->Lq * c->D), nr = (size_t)(c->B * c->H * c->Lq);
	const size_t esz = ape_dtype_size(c->dtype);
	struct grads want = { 0 }, got = { 0 }, again = { 0 };
	struct bin in = { 0 };
	struct check_qkv x;
	ape_attn_desc desc;
	float *t = NULL;
	int ret = check_qkv_make(&x, env->rng, c->dtype, c->B, c->H, c->Hkv, c->Lq, c->Lk, c->D);

	check_seed_desc(&desc);
	desc.causal = c->causal;
	desc.q_start = c->Lk - c->Lq + c->q_offset;
	desc.q_start_set = true;
	in.o = malloc(nq * esz);
	in.lse = malloc(nr * sizeof(float));
	in.dout = ape_rng_array(env->rng, nq, c->dtype, NULL);
	in.dlse = c->dlse ? malloc(nr * sizeof(float)) : NULL;
	t = table_make(env->rng, c->kind, rows, c->M, 0);
	if (!ret && (!in.o || !in.lse || !in.dout || (c->dlse && !in.dlse) || !t))
		ret = APE_ENOMEM;
	for (size_t i = 0; !ret && in.dlse && i < nr; i++)
		in.dlse[i] = (float)ape_rng_normal(env->rng);
	table_set(&desc, t, rows, c->M);
	ape_tensor_init(&in.to, in.o, c->dtype, c->B, c->H, c->Lq, c->D);
	ape_tensor_init(&in.tdo, in.dout, c->dtype, c->B, c->H, c->Lq, c->D);
	if (!ret)
		ret = grads_make(&want, &x, rows * c->M);
	if (!ret && ((ret = ape_attention_forward(env->ref, &desc, &x.tq, &x.tk, &x.tv, &in.to,
						  in.lse, NULL)) ||
		     (ret = backward(env->ref, desc, &x, &in, &want))))
		fprintf(stderr, "ape-check: %s on the reference: %s\n", c->name, ape_last_error());
	for (int d = 0; d < env->ndev && !ret; d++) {
		const double tol = refcheck_tol_grad(c->dtype);
		const double tols[NG] = { tol, tol, tol, tol, tol };
		double err[NG];
		int r;

		grads_free(&got);
		grads_free(&again);
		memset(&got, 0, sizeof(got));
		memset(&again, 0, sizeof(again));
		if ((ret = grads_make(&got, &x, rows * c->M)) ||
		    (c->twice && (ret = grads_make(&again, &x, rows * c->M))))
			break;
		r = backward(env->devs[d], desc, &x, &in, &got);
		if (r) {
			check_add_error(CHECK_TABLES, c->name, d, env->devs[d], r, true);
		} else {
			for (int i = 0; i < NG; i++)
				err[i] = check_err_grad(got.g[i], want.g[i], got.n[i]);
			check_add_errors(CHECK_TABLES, c->name, d, NG, labels, err, tols);
		}
		if (!c->twice)
			continue;
		if (!r) /* else the first call's failure, still ape_last_error() */
			r = backward(env->devs[d], desc, &x, &in, &again);
		if (r)
			check_add_error(CHECK_TABLES, c->twice, d, env->devs[d], r, true);
		else
			same_bits(c->twice, d, &got, &again);
	}
	grads_free(&want);
	grads_free(&got);
	grads_free(&again);
	free(in.o);
	free(in.lse);
	free(in.dout);
	free(in.dlse);
	free(t);
	check_qkv_free(&x);
	return ret;
}

int check_tables(const struct check_env *env)
{
	int ret = 0;

	for (int i = 0; i < NFCASES && !ret; i++)
		if (!fcases[i].long_row || fcases[i].long_row == 2 - env->long_cases)
			ret = forward_case(env, &fcases[i]);
	if (!ret)
		ret = kv_cache_case(env);
	if (!ret)
		ret = ragged_case(env);
	for (int i = 0; i < NBCASES && !ret; i++)
		ret = backward_case(env, &bcases[i]);
	if (ret == APE_ENOMEM)
		fprintf(stderr, "ape-check: out of memory\n");
	return ret;
}
