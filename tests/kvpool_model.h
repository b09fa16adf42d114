/* SPDX-License-Identifier: MIT */
/*
 * The KV-pool tests' model (test_kvpool.c, and the fault-injection test): what every sequence
 * of a pool should hold, kept on the host beside the pool, the pool's calls made through it, and
 * an attend checked row by row against tests/common/naive.c at the rows' and keys' positions.
 * Include after the Kselftest harness.
 */
#ifndef APE_TEST_KVPOOL_MODEL_H
#define APE_TEST_KVPOOL_MODEL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/naive.h"
#include "common/positions.h"
#include "common/testutil.h"

struct mseq {
	bool live;
	int64_t id, k_start, n, cap;
	char *k, *v; /* [cap, Hkv, D] of the pool's dtype */
};

struct model {
	ape_kv_pool *pool;
	int64_t Hkv, H, D;
	ape_dtype dt;
	size_t esz;
	struct mseq *s;
	int64_t ns;
};

static int model_init(struct model *m, ape_device *dev, const ape_kv_pool_options *o)
{
	memset(m, 0, sizeof(*m));
	m->Hkv = o->Hkv;
	m->H = o->H ? o->H : o->Hkv;
	m->D = o->D;
	m->dt = o->dtype;
	m->esz = ape_dtype_size(o->dtype);
	m->s = calloc(4096, sizeof(*m->s));
	if (!m->s)
		return APE_ENOMEM;
	return ape_kv_pool_create(dev, o, &m->pool);
}

static void model_free(struct model *m)
{
	ape_kv_pool_destroy(m->pool);
	for (int64_t i = 0; i < m->ns; i++) {
		free(m->s[i].k);
		free(m->s[i].v);
	}
	free(m->s);
}

static size_t model_row(const struct model *m)
{
	return (size_t)(m->Hkv * m->D) * m->esz;
}

/* Room for n more tokens in sequence i's model. */
static int model_grow(struct model *m, struct mseq *s, int64_t n)
{
	int64_t cap = s->cap ? s->cap : 8;

	while (cap < s->n + n)
		cap *= 2;
	if (cap != s->cap) {
		char *k = realloc(s->k, (size_t)cap * model_row(m));
		char *v = k ? realloc(s->v, (size_t)cap * model_row(m)) : NULL;

		if (k)
			s->k = k;
		if (!k || !v)
			return APE_ENOMEM;
		s->v = v;
		s->cap = cap;
	}
	return 0;
}

/* A new sequence at k_start: its model's index, or -1 (the call's code in *ret). */
static int64_t model_add(struct model *m, int64_t k_start, int *ret)
{
	struct mseq *s = &m->s[m->ns];

	memset(s, 0, sizeof(*s));
	*ret = ape_kv_pool_add_sequence(m->pool, k_start, &s->id);
	if (*ret)
		return -1;
	s->live = true;
	s->k_start = k_start;
	return m->ns++;
}

/* n random tokens appended to sequence i; the call's code. */
static int model_append(struct model *m, ape_rng *r, int64_t i, int64_t n)
{
	struct mseq *s = &m->s[i];
	char *k = ape_rng_array(r, (size_t)(n * m->Hkv * m->D) + 1, m->dt, NULL);
	char *v = ape_rng_array(r, (size_t)(n * m->Hkv * m->D) + 1, m->dt, NULL);
	ape_tensor kt, vt;
	int ret = k && v ? model_grow(m, s, n) : APE_ENOMEM;

	if (!ret) {
		ape_tensor_init_packed(&kt, k, m->dt, n, m->Hkv, m->D);
		ape_tensor_init_packed(&vt, v, m->dt, n, m->Hkv, m->D);
		ret = ape_kv_pool_append(m->pool, s->id, &kt, &vt);
	}
	if (!ret) {
		memcpy(s->k + (size_t)s->n * model_row(m), k, (size_t)n * model_row(m));
		memcpy(s->v + (size_t)s->n * model_row(m), v, (size_t)n * model_row(m));
		s->n += n;
	}
	free(k);
	free(v);
	return ret;
}

/* One batch append: sequence idx[j] gets cnt[j] random tokens; the call's code. */
static __attribute__((unused)) int model_append_batch(struct model *m, ape_rng *r, int64_t nb,
						   const int64_t *idx,
			      const int64_t *cnt)
{
	int64_t *ids = malloc(sizeof(int64_t) * (size_t)(nb + 1));
	int64_t *cu = malloc(sizeof(int64_t) * (size_t)(nb + 1));
	int64_t total = 0;
	char *k = NULL, *v = NULL;
	ape_tensor kt, vt;
	int ret = ids && cu ? 0 : APE_ENOMEM;

	for (int64_t j = 0; j < nb && !ret; j++) {
		ids[j] = m->s[idx[j]].id;
		cu[j] = total;
		total += cnt[j];
		ret = model_grow(m, &m->s[idx[j]], cnt[j]);
	}
	if (!ret) {
		cu[nb] = total;
		k = ape_rng_array(r, (size_t)(total * m->Hkv * m->D) + 1, m->dt, NULL);
		v = ape_rng_array(r, (size_t)(total * m->Hkv * m->D) + 1, m->dt, NULL);
		ret = k && v ? 0 : APE_ENOMEM;
	}
	if (!ret) {
		ape_tensor_init_packed(&kt, k, m->dt, total, m->Hkv, m->D);
		ape_tensor_init_packed(&vt, v, m->dt, total, m->Hkv, m->D);
		ret = ape_kv_pool_append_batch(m->pool, nb, ids, cu, &kt, &vt);
	}
	for (int64_t j = 0; j < nb && !ret; j++) {
		struct mseq *s = &m->s[idx[j]];

		memcpy(s->k + (size_t)s->n * model_row(m), k + (size_t)cu[j] * model_row(m),
		       (size_t)cnt[j] * model_row(m));
		memcpy(s->v + (size_t)s->n * model_row(m), v + (size_t)cu[j] * model_row(m),
		       (size_t)cnt[j] * model_row(m));
		s->n += cnt[j];
	}
	free(ids);
	free(cu);
	free(k);
	free(v);
	return ret;
}

/* Sequence i forked: the new one's index, or -1 (the call's code in *ret). */
static int64_t model_fork(struct model *m, int64_t i, int *ret)
{
	struct mseq *f = &m->s[m->ns], *s = &m->s[i];

	memset(f, 0, sizeof(*f));
	*ret = ape_kv_pool_fork(m->pool, s->id, &f->id);
	if (*ret)
		return -1;
	if ((*ret = model_grow(m, f, s->n)))
		return -1;
	if (s->n) {
		memcpy(f->k, s->k, (size_t)s->n * model_row(m));
		memcpy(f->v, s->v, (size_t)s->n * model_row(m));
	}
	f->n = s->n;
	f->k_start = s->k_start;
	f->live = true;
	return m->ns++;
}

static __attribute__((unused)) int model_remove(struct model *m, int64_t i)
{
	int ret = ape_kv_pool_remove_sequence(m->pool, m->s[i].id);

	if (!ret)
		m->s[i].live = false;
	return ret;
}

/* An attend's batch: entry j is sequence idx[j] with lq[j] rows. */
struct mbatch {
	int64_t nb, tq;
	int64_t idx[64], ids[64], cu[65];
	int64_t *posq; /* tq, always materialised (the oracle's) */
	bool explicit_pos;
	test_tensor q, o;
	float *lse;
	float *ent, *md; /* NULL, or [tq, H] each: the diagnostics wanted (mbatch_want_diag()) */
	ape_attn_desc desc;
	float prm[4][8];
};

static void mbatch_free(struct mbatch *b)
{
	free(b->posq);
	free(b->lse);
	free(b->ent);
	free(b->md);
	test_tensor_free(&b->q);
	test_tensor_free(&b->o);
}

/* A batch over sequences idx[0..nb) with lq[j] rows each, positions of mode pm (POS_DEFAULT:
 * the pool's), random parameters; 0 or -1 (out of memory). */
static int mbatch_make(struct mbatch *b, const struct model *m, ape_rng *r, int64_t nb,
		       const int64_t *idx, const int64_t *lq, enum pos_mode pm)
{
	memset(b, 0, sizeof(*b));
	b->nb = nb;
	for (int64_t j = 0; j < nb; j++) {
		b->idx[j] = idx[j];
		b->ids[j] = m->s[idx[j]].id;
		b->cu[j + 1] = b->cu[j] + lq[j];
	}
	b->tq = b->cu[nb];
	b->posq = malloc(sizeof(int64_t) * (size_t)(b->tq + 1));
	b->lse = malloc(sizeof(float) * (size_t)(b->tq * m->H + 1));
	if (!b->posq || !b->lse)
		return -1;
	b->explicit_pos = pm != POS_DEFAULT;
	for (int64_t j = 0; j < nb; j++) {
		const struct mseq *s = &m->s[idx[j]];
		const int64_t base = s->k_start + s->n - lq[j];

		if (pm == POS_DEFAULT)
			for (int64_t i = 0; i < lq[j]; i++)
				b->posq[b->cu[j] + i] = base + i;
		else
			test_positions(r, pm, b->posq + b->cu[j], lq[j],
				       base + ape_rng_range(r, -3, 3));
	}
	if (test_tensor_random(&b->q, r, m->dt, 1, b->tq, m->H, m->D, 1.0) ||
	    test_tensor_random(&b->o, r, APE_F32, 1, b->tq, m->H, m->D, 1.0))
		return -1;
	ape_tensor_init_packed(&b->q.t, b->q.alloc, m->dt, b->tq, m->H, m->D);
	ape_tensor_init_packed(&b->o.t, b->o.alloc, APE_F32, b->tq, m->H, m->D);
	test_tensor_poison(&b->o.t);
	test_random_desc(r, &b->desc, b->prm, m->H);
	return 0;
}

/* The seed's decay (delta 0.4, beta 0.02, gamma 0.02, lambda 0.1) on every head of b, with
 * skip_tol `tol`. */
static __attribute__((unused)) void mbatch_seed_decay(const struct model *m, struct mbatch *b,
						      double tol)
{
	for (int64_t h = 0; h < m->H; h++) {
		b->prm[0][h] = 0.4f;
		b->prm[1][h] = 0.02f;
		b->prm[2][h] = 0.02f;
		b->prm[3][h] = 0.1f;
	}
	b->desc.skip_tol = tol;
}

/* The batch's attends also return both diagnostics; 0 or -1 (out of memory). */
static __attribute__((unused)) int mbatch_want_diag(const struct model *m, struct mbatch *b)
{
	b->ent = malloc(sizeof(float) * (size_t)(b->tq * m->H + 1));
	b->md = malloc(sizeof(float) * (size_t)(b->tq * m->H + 1));
	return b->ent && b->md ? 0 : -1;
}

static int mbatch_attend(const struct model *m, struct mbatch *b, ape_stats *st)
{
	if (b->ent || b->md)
		return ape_kv_pool_attend_diag(m->pool, &b->desc, b->nb, b->ids, b->cu,
					       b->explicit_pos ? b->posq : NULL, &b->q.t, &b->o.t,
					       b->lse, b->ent, b->md, st);
	return ape_kv_pool_attend(m->pool, &b->desc, b->nb, b->ids, b->cu,
				  b->explicit_pos ? b->posq : NULL, &b->q.t, &b->o.t, b->lse, st);
}

/*
 * Every row of b against naive_attention() over its sequence's keys at their positions: the
 * largest error of O over max|V| and of LSE (relative to max(1, |LSE|)) into *eo and *el, and
 * with b's diagnostics (b->ent, b->md) those of the entropy (as LSE's) and of the mean distance
 * (relative to max(1, the row's largest visible |n|)) into *ee and *em (each may be NULL);
 * -1 when the oracle runs out of memory.
 */
static int mbatch_check_diag(const struct model *m, const struct mbatch *b, double *eo,
			     double *el, double *ee, double *em)
{
	double ee_ = 0, em_ = 0;

	if (!ee)
		ee = &ee_;
	if (!em)
		em = &em_;
	*eo = *el = *ee = *em = 0;
	for (int64_t j = 0; j < b->nb; j++) {
		const struct mseq *s = &m->s[b->idx[j]];
		const int64_t q0 = b->cu[j], lq = b->cu[j + 1] - q0, n = s->n;
		double prm[4][8], *o, *lse, *dent, *dmd, *dmax, vmax = 1e-30;
		int64_t *posk = malloc(sizeof(int64_t) * (size_t)(n + 1));
		naive_params np = {
			.rope_base = b->desc.rope_base, .rope_scale = b->desc.rope_scale,
			.scale = NAN, .causal = b->desc.causal, .pos_q = b->posq + q0, .pos_k = posk,
		};
		ape_tensor kt, vt, qt = test_rows(&b->q.t, q0, lq);

		if (!lq) {
			free(posk);
			continue;
		}
		o = calloc((size_t)(m->H * lq * m->D) + 1, sizeof(double));
		lse = malloc(sizeof(double) * (size_t)(m->H * lq + 1));
		dent = calloc((size_t)(3 * m->H * lq) + 1, sizeof(double));
		if (!posk || !o || !lse || !dent)
			return -1;
		dmd = dent + m->H * lq;
		dmax = dmd + m->H * lq;
		for (int64_t t = 0; t < n; t++)
			posk[t] = s->k_start + t;
		for (int i = 0; i < 4; i++)
			for (int h = 0; h < m->H; h++)
				prm[i][h] = b->prm[i][h];
		np.delta = prm[0];
		np.beta = prm[1];
		np.gamma = prm[2];
		np.lambda = prm[3];
		ape_tensor_init_packed(&kt, s->k, m->dt, n, m->Hkv, m->D);
		ape_tensor_init_packed(&vt, s->v, m->dt, n, m->Hkv, m->D);
		if (n && naive_attention_diag(&np, &qt, &kt, &vt, o, lse, dent, dmd, dmax))
			return -1;
		for (int64_t r = 0; !n && r < m->H * lq; r++)
			lse[r] = -INFINITY;
		for (int64_t t = 0; t < n; t++)
			for (int64_t g = 0; g < m->Hkv; g++)
				for (int64_t d = 0; d < m->D; d++)
					vmax = fmax(vmax, fabs(test_tensor_get(&vt, 0, g, t, d)));
		for (int64_t h = 0; h < m->H; h++)
			for (int64_t i = 0; i < lq; i++) {
				const int64_t r = (q0 + i) * m->H + h, w = h * lq + i;
				const double se = fmax(1, isfinite(lse[w]) ? fabs(lse[w]) : 1);

				test_lse_err(b->lse[r], lse[w], el);
				if (b->ent)
					*ee = fmax(*ee, isnan(dent[w]) != isnan(b->ent[r])
								? INFINITY
								: isnan(dent[w]) ? 0
										 : fabs(b->ent[r] - dent[w]) / se);
				if (b->md)
					*em = fmax(*em, isnan(dmd[w]) != isnan(b->md[r])
								? INFINITY
								: isnan(dmd[w]) ? 0
										: fabs(b->md[r] - dmd[w]) /
											  fmax(1, dmax[w]));
				for (int64_t d = 0; d < m->D; d++) {
					const double x = test_tensor_get(&b->o.t, 0, h, q0 + i, d);
					const double e =
						fabs(x - o[(h * lq + i) * m->D + d]) / vmax;

					*eo = fmax(*eo, e != e ? INFINITY : e);
				}
			}
		free(posk);
		free(o);
		free(lse);
		free(dent);
	}
	return 0;
}

static int mbatch_check(const struct model *m, const struct mbatch *b, double *eo, double *el)
{
	return mbatch_check_diag(m, b, eo, el, NULL, NULL);
}

#endif
