/* SPDX-License-Identifier: MIT */
#include "problem.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "naive.h"

/* The row padding of strided layouts: a test that reads or writes it sees NaN or a changed byte. */
#define PAD 3

/* Stores `dense` as is, or relaid out as padded [B, L, H, D] when strided; takes ownership. */
static int place_tensor(test_tensor *tt, test_tensor *dense, bool strided)
{
	int ret = 0;

	if (!strided) {
		*tt = *dense;
		return 0;
	}
	if (test_tensor_relayout(tt, dense, PAD))
		ret = -1;
	test_tensor_free(dense);
	return ret;
}

/* An output: NaN everywhere it will be written, 0xff bytes in its padding. */
static int alloc_tensor(test_tensor *tt, ape_dtype dt, const int64_t s[4], bool strided)
{
	test_tensor dense;

	if (test_tensor_empty(&dense, dt, s[0], s[1], s[2], s[3]))
		return -1;
	return place_tensor(tt, &dense, strided);
}

static int random_tensor(test_tensor *tt, ape_rng *r, ape_dtype dt, const int64_t s[4],
			 bool strided, double sd)
{
	test_tensor dense;

	if (test_tensor_random(&dense, r, dt, s[0], s[1], s[2], s[3], sd))
		return -1;
	return place_tensor(tt, &dense, strided);
}

static void point_params(test_problem *tp)
{
	const int64_t H = tp->q.t.shape[1];

	tp->desc.delta.per_head = tp->params;
	tp->desc.beta.per_head = tp->params + H;
	tp->desc.gamma.per_head = tp->params + 2 * H;
	tp->desc.lambda.per_head = tp->params + 3 * H;
}

int test_problem_make(test_problem *tp, ape_rng *r, const test_problem_shape *sh, ape_dtype dt,
		      bool strided)
{
	const int64_t qs[4] = { sh->B, sh->H, sh->Lq, sh->D };
	const int64_t ks[4] = { sh->B, sh->Hkv, sh->Lk, sh->D };
	/* sometimes peaky softmaxes; with the scale below, |scale| |q| |k| stays under ~200, the
	 * range where float32 kernels keep the spec's tolerance (docs/ape.md, "Storage and
	 * accuracy") */
	double sd = ape_rng_uniform(r) < 0.2 ? 2.5 : 1.0;

	memset(tp, 0, sizeof(*tp));
	tp->strided = strided;
	tp->rows = (size_t)(sh->B * sh->H * sh->Lq);
	ape_attn_desc_init(&tp->desc);
	tp->params = calloc((size_t)(4 * sh->H), sizeof(float));
	tp->lse = malloc(sizeof(float) * (tp->rows + 1));
	if (!tp->params || !tp->lse || random_tensor(&tp->q, r, dt, qs, strided, sd) ||
	    random_tensor(&tp->k, r, dt, ks, strided, sd) ||
	    random_tensor(&tp->v, r, dt, ks, strided, 1.0) ||
	    alloc_tensor(&tp->o, dt, qs, strided)) {
		test_problem_free(tp);
		return -1;
	}
	point_params(tp);
	return 0;
}

void test_problem_set_params(test_problem *tp, double delta, double beta, double gamma,
			     double lambda)
{
	const int64_t H = tp->q.t.shape[1];

	for (int64_t h = 0; h < H; h++) {
		tp->params[h] = (float)delta;
		tp->params[H + h] = (float)beta;
		tp->params[2 * H + h] = (float)gamma;
		tp->params[3 * H + h] = (float)lambda;
	}
	tp->desc.delta.value = (float)delta; /* for problems using the scalar form */
	tp->desc.beta.value = (float)beta;
	tp->desc.gamma.value = (float)gamma;
	tp->desc.lambda.value = (float)lambda;
}

void test_problem_random_params(test_problem *tp, ape_rng *r)
{
	static const double bases[] = { 10000, 500000, 100, 2.5 };
	/* position interpolation (and extrapolation) in a third of the problems */
	static const double rope_scales[] = { 1, 1, 1, 1, 1, 1, 0.5, 3, 16 };
	const int64_t H = tp->q.t.shape[1];
	bool per_head = ape_rng_uniform(r) < 0.5;

	for (int64_t h = 0; h < H; h++) {
		bool fresh = per_head || h == 0;

		/* decays mostly >= 0 (the models' case), sometimes negative (no skipping allowed) */
		tp->params[h] = fresh ? (float)(ape_rng_uniform(r) * 1.3 - 0.3) : tp->params[0];
		tp->params[H + h] = fresh ? (float)(ape_rng_uniform(r) * 1.5 - 0.5) : tp->params[H];
		tp->params[2 * H + h] =
			fresh ? (float)(ape_rng_uniform(r) * 1.5 - 0.5) : tp->params[2 * H];
		tp->params[3 * H + h] = fresh ? (float)(ape_rng_uniform(r) * 2) : tp->params[3 * H];
	}
	if (!per_head) { /* exercise the scalar form too */
		tp->desc.delta = (ape_param){ tp->params[0], NULL };
		tp->desc.beta = (ape_param){ tp->params[H], NULL };
		tp->desc.gamma = (ape_param){ tp->params[2 * H], NULL };
		tp->desc.lambda = (ape_param){ tp->params[3 * H], NULL };
	}
	tp->desc.rope_base = bases[ape_rng_range(r, 0, 3)];
	tp->desc.rope_scale = rope_scales[ape_rng_range(r, 0, 8)];
	tp->desc.scale_set = ape_rng_uniform(r) < 0.4;
	tp->desc.scale = (ape_rng_uniform(r) * 4 - 2) / sqrt((double)tp->q.t.shape[3]);
	tp->desc.causal = ape_rng_uniform(r) < 0.7;
	tp->desc.layout = ape_rng_uniform(r) < 0.5 ? APE_ROPE_HALF : APE_ROPE_INTERLEAVED;
	tp->desc.k_start = ape_rng_range(r, -50, 50);
	tp->desc.q_start_set = ape_rng_uniform(r) < 0.6;
	tp->desc.q_start = tp->desc.k_start + ape_rng_range(r, -20, 120);
}

/* Sizes that are not multiples of anything: the edges of every tile. */
static int64_t awkward_length(ape_rng *r)
{
	static const int64_t lens[] = { 0, 1, 2, 3, 7, 16, 17, 31, 33, 63, 64, 65, 100 };

	return lens[ape_rng_range(r, 0, (int64_t)(sizeof(lens) / sizeof(lens[0])) - 1)];
}

int test_problem_random(test_problem *tp, ape_rng *r, unsigned flags)
{
	static const int64_t dims[] = { 2, 4, 6, 8, 12, 16, 32, 64, 66, 128, 256 };
	static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };
	test_problem_shape sh;
	int64_t group;

	do { /* keep the long-double evaluation affordable */
		sh.B = ape_rng_range(r, 1, 2);
		sh.Hkv = ape_rng_range(r, 1, 3);
		group = ape_rng_range(r, 1, 3);
		sh.H = sh.Hkv * group;
		sh.Lq = awkward_length(r);
		sh.Lk = ape_rng_uniform(r) < 0.5 ? sh.Lq : awkward_length(r);
		sh.D = dims[ape_rng_range(r, 0, 10)];
	} while (sh.B * sh.H * sh.Lq * sh.Lk * sh.D > 400000);

	if (test_problem_make(tp, r, &sh, types[ape_rng_range(r, 0, 2)], ape_rng_uniform(r) < 0.3))
		return -1;
	test_problem_random_params(tp, r);
	if (!(flags & TEST_PROBLEM_SMALL_POSITIONS) && ape_rng_uniform(r) < 0.2) {
		/* far from the origin; distances stay small so float64 angles stay exact */
		int64_t shift = ((int64_t)1 << 40) - ape_rng_range(r, 0, 1000);

		tp->desc.k_start += shift;
		tp->desc.q_start += shift;
	}
	if (ape_rng_uniform(r) < 0.3 && test_problem_set_out_dtype(tp, APE_F32))
		return -1;
	if (!(flags & TEST_PROBLEM_NO_LSE_NULL) && ape_rng_uniform(r) < 0.1) {
		free(tp->lse);
		tp->lse = NULL;
	}
	return 0;
}

int test_problem_set_out_dtype(test_problem *tp, ape_dtype dt)
{
	test_tensor o;

	if (alloc_tensor(&o, dt, tp->q.t.shape, tp->strided))
		return -1;
	test_tensor_free(&tp->o);
	tp->o = o;
	return 0;
}

static int clone_tensor(test_tensor *dst, const test_tensor *src)
{
	*dst = *src;
	dst->alloc = malloc(src->alloc_bytes ? src->alloc_bytes : 1);
	if (!dst->alloc)
		return -1;
	memcpy(dst->alloc, src->alloc, src->alloc_bytes);
	dst->t.data = (char *)dst->alloc + ((char *)src->t.data - (char *)src->alloc);
	return 0;
}

int test_problem_clone(test_problem *dst, const test_problem *src)
{
	const int64_t H = src->q.t.shape[1];

	*dst = *src;
	dst->q.alloc = dst->k.alloc = dst->v.alloc = dst->o.alloc = NULL;
	dst->naive_o = dst->naive_lse = NULL;
	dst->naive_ent = dst->naive_md = dst->naive_mdmax = NULL;
	dst->bias_table = NULL;
	dst->params = malloc(sizeof(float) * (size_t)(4 * H));
	dst->lse = src->lse ? malloc(sizeof(float) * (src->rows + 1)) : NULL;
	if (!dst->params || (src->lse && !dst->lse) || clone_tensor(&dst->q, &src->q) ||
	    clone_tensor(&dst->k, &src->k) || clone_tensor(&dst->v, &src->v) ||
	    clone_tensor(&dst->o, &src->o)) {
		test_problem_free(dst);
		return -1;
	}
	memcpy(dst->params, src->params, sizeof(float) * (size_t)(4 * H));
	if (src->desc.delta.per_head) /* all four are per-head or none is */
		point_params(dst);
	if (src->bias_table) { /* a copy of its own, for the desc to point to */
		const size_t n = (size_t)(src->desc.bias_table_heads * src->desc.bias_table_len);

		dst->bias_table = malloc(sizeof(float) * n);
		if (!dst->bias_table) {
			test_problem_free(dst);
			return -1;
		}
		memcpy(dst->bias_table, src->bias_table, sizeof(float) * n);
		dst->desc.bias_table = dst->bias_table;
	}
	return 0;
}

void test_problem_free(test_problem *tp)
{
	test_tensor_free(&tp->q);
	test_tensor_free(&tp->k);
	test_tensor_free(&tp->v);
	test_tensor_free(&tp->o);
	free(tp->lse);
	free(tp->params);
	free(tp->naive_o);
	free(tp->naive_lse);
	free(tp->naive_ent);
	free(tp->naive_md);
	free(tp->naive_mdmax);
	free(tp->bias_table);
	memset(tp, 0, sizeof(*tp));
}

void test_problem_no_table(test_problem *tp)
{
	free(tp->bias_table);
	tp->bias_table = NULL;
	tp->desc.bias_table = NULL;
	tp->desc.bias_table_len = 0;
	tp->desc.bias_table_heads = 0;
}

int test_problem_random_table(test_problem *tp, ape_rng *r)
{
	const int64_t H = tp->q.t.shape[1], Lq = tp->q.t.shape[2], Lk = tp->k.t.shape[2];
	const int64_t far = Lq + Lk + 2, kind = ape_rng_range(r, 0, 3);
	const int64_t lens[] = { 1, 2, 1 + far / 3, far, 2 * far + 5 };
	const int64_t M = lens[ape_rng_range(r, 0, 4)];
	const int64_t rows = ape_rng_uniform(r) < 0.3 ? 1 : H;
	float *t = malloc(sizeof(float) * (size_t)(rows * M));

	if (!t)
		return -1;
	for (int64_t h = 0; h < rows; h++) {
		const double c = 0.5 + ape_rng_uniform(r); /* a head's own size */

		for (int64_t m = 0; m < M; m++) {
			double x;

			switch (kind) {
			case 0: { /* T5: exact up to 8, then log-spaced buckets to 128 */
				const int64_t b = m < 8 ? m : 8 + (int64_t)(log((double)m / 8) / log(16) * 8);
				x = c * sin(1.7 * (double)(b < 15 ? b : 15) + (double)h);
				break;
			}
			case 1: /* the Gaussian "dynamic mask": -c n^2 over the whole length */
				x = -c * 1e-3 * (double)m * (double)m;
				break;
			case 2: /* falls, then rises again far away: the bound must take the max */
				x = m < M / 2 ? -0.2 * (double)m : -0.2 * (double)(M - m) + c;
				break;
			default:
				x = ape_rng_normal(r);
				break;
			}
			t[h * M + m] = (float)x;
		}
	}
	free(tp->bias_table);
	tp->bias_table = t;
	tp->desc.bias_table = t;
	tp->desc.bias_table_len = M;
	tp->desc.bias_table_heads = rows;
	return 0;
}

void test_problem_describe(const test_problem *tp, char *buf, size_t len)
{
	const int64_t *s = tp->q.t.shape;

	snprintf(buf, len,
		 "B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " Lq=%" PRId64 " Lk=%" PRId64
		 " D=%" PRId64 " %s->%s%s %s %s q_start=%" PRId64 " k_start=%" PRId64
		 " delta=%g beta=%g gamma=%g lambda=%g%s base=%g rope_scale=%g scale=%s%g",
		 s[0], s[1], tp->k.t.shape[1], s[2], tp->k.t.shape[2], s[3],
		 ape_dtype_name(tp->q.t.dtype), ape_dtype_name(tp->o.t.dtype),
		 tp->strided ? " strided" : "", tp->desc.causal ? "causal" : "non-causal",
		 tp->desc.layout == APE_ROPE_HALF ? "half" : "interleaved", tp->q_start,
		 tp->desc.k_start, (double)tp->params[0], (double)tp->params[s[1]],
		 (double)tp->params[2 * s[1]], (double)tp->params[3 * s[1]],
		 tp->desc.delta.per_head ? " (head 0)" : "", tp->desc.rope_base,
		 tp->desc.rope_scale, tp->desc.scale_set ? "" : "default/", tp->desc.scale_set ? tp->desc.scale : 0.0);
}

static void resolve_q_start(test_problem *tp)
{
	tp->q_start = tp->desc.q_start_set ? tp->desc.q_start
					   : tp->desc.k_start + tp->k.t.shape[2] - tp->q.t.shape[2];
}

int test_problem_run_stats(test_problem *tp, ape_device *dev, ape_stats *st)
{
	test_tensor_poison(&tp->o.t);
	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		tp->lse[i] = NAN;
	resolve_q_start(tp);
	return ape_attention_forward(dev, &tp->desc, &tp->q.t, &tp->k.t, &tp->v.t, &tp->o.t,
				     tp->lse, st);
}

int test_problem_run(test_problem *tp, ape_device *dev)
{
	return test_problem_run_stats(tp, dev, NULL);
}

int test_problem_naive(test_problem *tp)
{
	const int64_t H = tp->q.t.shape[1];
	double *prm = malloc(sizeof(double) * (size_t)(4 * H));
	naive_params np = { 0 };
	int ret;

	resolve_q_start(tp);
	free(tp->naive_o);
	free(tp->naive_lse);
	free(tp->naive_ent);
	free(tp->naive_md);
	free(tp->naive_mdmax);
	tp->naive_o = malloc(sizeof(double) * (tp->rows * (size_t)tp->q.t.shape[3] + 1));
	tp->naive_lse = malloc(sizeof(double) * (tp->rows + 1));
	tp->naive_ent = malloc(sizeof(double) * (tp->rows + 1));
	tp->naive_md = malloc(sizeof(double) * (tp->rows + 1));
	tp->naive_mdmax = malloc(sizeof(double) * (tp->rows + 1));
	if (!prm || !tp->naive_o || !tp->naive_lse || !tp->naive_ent || !tp->naive_md ||
	    !tp->naive_mdmax) {
		free(prm);
		return -1;
	}
	for (int64_t h = 0; h < H; h++) {
		const ape_param *ps[4] = { &tp->desc.delta, &tp->desc.beta, &tp->desc.gamma,
					   &tp->desc.lambda };

		for (int k = 0; k < 4; k++)
			prm[k * H + h] = ps[k]->per_head ? ps[k]->per_head[h] : ps[k]->value;
	}
	np.delta = prm;
	np.beta = prm + H;
	np.gamma = prm + 2 * H;
	np.lambda = prm + 3 * H;
	np.rope_base = tp->desc.rope_base;
	np.rope_scale = tp->desc.rope_scale;
	np.scale = tp->desc.scale_set ? tp->desc.scale : NAN;
	np.causal = tp->desc.causal;
	np.interleaved = tp->desc.layout == APE_ROPE_INTERLEAVED;
	np.q_start = tp->q_start;
	np.k_start = tp->desc.k_start;
	np.bias_table = tp->desc.bias_table;
	np.bias_len = tp->desc.bias_table_len;
	np.bias_hstride = tp->desc.bias_table_heads == 1 ? 0 : tp->desc.bias_table_len;
	ret = naive_attention_diag(&np, &tp->q.t, &tp->k.t, &tp->v.t, tp->naive_o, tp->naive_lse,
				   tp->naive_ent, tp->naive_md, tp->naive_mdmax);
	free(prm);
	return ret;
}

static double abs_diff(double a, double b)
{
	if (isnan(a) || isnan(b))
		return isnan(a) && isnan(b) ? 0 : INFINITY; /* NaN must match NaN */
	return a == b ? 0 : fabs(a - b);
}

double test_problem_err_o_vs(const test_problem *tp, const double *o)
{
	const int64_t *s = tp->q.t.shape;
	double m = 0;

	for (int64_t b = 0; b < s[0]; b++)
		for (int64_t h = 0; h < s[1]; h++)
			for (int64_t i = 0; i < s[2]; i++)
				for (int64_t d = 0; d < s[3]; d++)
					m = fmax(m, abs_diff(test_tensor_get(&tp->o.t, b, h, i, d),
							     o[((b * s[1] + h) * s[2] + i) * s[3] + d]));
	return m;
}

double test_problem_rel_err_lse_vs(const test_problem *tp, const double *lse)
{
	double m = 0;

	for (size_t i = 0; tp->lse && i < tp->rows; i++)
		m = fmax(m, abs_diff(tp->lse[i], lse[i]) / fmax(1.0, isfinite(lse[i]) ? fabs(lse[i]) : 1));
	return m;
}

double test_problem_err_o(const test_problem *tp)
{
	return test_problem_err_o_vs(tp, tp->naive_o);
}

double test_problem_rel_err_lse(const test_problem *tp)
{
	return test_problem_rel_err_lse_vs(tp, tp->naive_lse);
}

int test_problem_split_keys(const test_problem *tp, ape_device *dev, int64_t chunk, double *err_o,
			    double *err_lse)
{
	const int64_t *s = tp->q.t.shape, Lk = tp->k.t.shape[2];
	const size_t rows = tp->rows, D = (size_t)s[3];
	/* per row: running max m of the chunks' LSE, sum = sum exp(LSE_c - m),
	 * acc = sum exp(LSE_c - m) O_c; finally O = acc / sum, LSE = m + ln sum */
	double *m = malloc(sizeof(double) * (rows + 1));
	double *sum = calloc(rows + 1, sizeof(double));
	double *acc = calloc(rows * D + 1, sizeof(double));
	float *lse_c = malloc(sizeof(float) * (rows + 1));
	test_tensor oc;
	int ret = -1;

	if (!m || !sum || !acc || !lse_c || test_tensor_empty(&oc, APE_F32, s[0], s[1], s[2], s[3]))
		goto out_free;
	for (size_t r = 0; r < rows; r++)
		m[r] = -INFINITY;
	for (int64_t j0 = 0; j0 < Lk; j0 += chunk) {
		int64_t n = j0 + chunk > Lk ? Lk - j0 : chunk;
		ape_tensor kc = test_rows(&tp->k.t, j0, n), vc = test_rows(&tp->v.t, j0, n);
		const float *o = oc.t.data;
		ape_attn_desc d = tp->desc;

		d.k_start = tp->desc.k_start + j0;
		d.q_start = tp->q_start;
		d.q_start_set = true;
		ret = ape_attention_forward(dev, &d, &tp->q.t, &kc, &vc, &oc.t, lse_c, NULL);
		if (ret)
			goto out_free;
		for (size_t r = 0; r < rows; r++) {
			double l = lse_c[r], mn = fmax(m[r], l), c_old, c_new;

			if (mn == -INFINITY)
				continue; /* no key for this row yet */
			c_old = m[r] == -INFINITY ? 0 : exp(m[r] - mn);
			c_new = exp(l - mn);
			for (size_t d2 = 0; d2 < D; d2++)
				acc[r * D + d2] = acc[r * D + d2] * c_old + o[r * D + d2] * c_new;
			sum[r] = sum[r] * c_old + c_new;
			m[r] = mn;
		}
	}
	for (size_t r = 0; r < rows; r++) {
		for (size_t d2 = 0; d2 < D; d2++)
			acc[r * D + d2] = sum[r] > 0 ? acc[r * D + d2] / sum[r] : 0;
		m[r] = sum[r] > 0 ? m[r] + log(sum[r]) : -INFINITY;
	}
	*err_o = test_problem_err_o_vs(tp, acc) / fmax(1.0, test_tensor_maxabs(&tp->v.t));
	*err_lse = test_problem_rel_err_lse_vs(tp, m);
	ret = 0;
out_free:
	test_tensor_free(&oc);
	free(m);
	free(sum);
	free(acc);
	free(lse_c);
	return ret;
}

int test_problem_split_queries(const test_problem *tp, ape_device *dev, int64_t chunk,
			       double *err_o)
{
	const int64_t *s = tp->q.t.shape;
	test_tensor out;
	int ret = -1;

	if (alloc_tensor(&out, tp->o.t.dtype, s, tp->strided))
		return -1;
	for (int64_t i0 = 0; i0 < s[2]; i0 += chunk) {
		int64_t n = i0 + chunk > s[2] ? s[2] - i0 : chunk;
		ape_tensor qc = test_rows(&tp->q.t, i0, n), oc = test_rows(&out.t, i0, n);
		ape_attn_desc d = tp->desc;

		d.q_start = tp->q_start + i0;
		d.q_start_set = true;
		ret = ape_attention_forward(dev, &d, &qc, &tp->k.t, &tp->v.t, &oc, NULL, NULL);
		if (ret)
			goto out_free;
	}
	*err_o = test_max_err_o(&out.t, &tp->o.t);
	ret = 0;
out_free:
	test_tensor_free(&out);
	return ret;
}

int test_problem_padding_intact(const test_problem *tp)
{
	const ape_tensor *t = &tp->o.t;
	const size_t esz = ape_dtype_size(t->dtype);
	const unsigned char *base = tp->o.alloc;

	if (!tp->strided)
		return 0;
	/* every row is D elements followed by PAD elements that relayout filled with 0xff */
	for (size_t row = 0; row < tp->rows; row++)
		for (size_t p = 0; p < PAD * esz; p++)
			if (base[(row * (size_t)(t->shape[3] + PAD) + (size_t)t->shape[3]) * esz + p] !=
			    0xff)
				return -1;
	return 0;
}

void test_problem_seed_params(test_problem *tp)
{
	const double delta = pow(2.0, -4.0 / 3.0);

	test_problem_set_params(tp, delta, delta / 10, delta / 10, 0.1);
}

int test_problem_make_dims(test_problem *tp, ape_rng *r, int64_t B, int64_t H, int64_t Hkv,
			   int64_t Lq, int64_t Lk, int64_t D, ape_dtype dt)
{
	const test_problem_shape sh = { B, H, Hkv, Lq, Lk, D };

	return test_problem_make(tp, r, &sh, dt, false);
}
