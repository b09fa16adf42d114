/* SPDX-License-Identifier: MIT */
/*
 * Paged attention over the caller's pages (ape_paged_kv_*, include/ape/ape.h), on every
 * backend. The sequences are made in a KV pool (tests/kvpool_model.h keeps their tokens on the
 * host), then laid by the test into its own page buffers, in scrambled page order, forks
 * sharing their prefix's full pages, in three layouts (HND; vLLM's NHD; FlashInfer's K and V
 * halves of one buffer), and attended through a CSR table and a block table. Checked: every row
 * against tests/common/naive.c at the rows' and keys' positions; the same bits as the pool's
 * attend over the same sequences where the pool leaves no key out; CSR, block table and every
 * layout the same bits; one plan run by two layers of different pages and parameters; the
 * decode of many sequences read in place on OpenCL; validation naming the argument, index and
 * value, with the outputs untouched; ape_paged_kv_run_dlpack() over kDLCPU pages of every layout,
 * the same bits as the run over device tensors, and its refusals.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"
#include "ape_test.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"

#include "kvpool_model.h"

BACKEND_FIXTURE(paged)

enum layout { L_HND, L_NHD, L_FI, L_COUNT };
static const char *const layout_names[L_COUNT] = { "HND", "NHD", "FlashInfer" };

/* The caller's pages: every sequence's page list (CSR: indptr, indices, last_page_len; also
 * as a block table of `stride` columns, padded with garbage) and the host image of the two
 * page buffers in one layout, uploaded to `buf`. */
struct cpages {
	int64_t np, P, nseq, stride;
	int64_t indptr[65], *indices, last[64], lens[64], kstart[64], *btab;
	ape_buffer *buf;
	ape_dtensor k, v;
	char *img; /* the host image uploaded to buf */
	size_t img_bytes;
};

static void cpages_free(struct cpages *c)
{
	free(c->indices);
	free(c->btab);
	free(c->img);
	ape_buffer_free(c->buf);
	memset(c, 0, sizeof(*c));
}

/* Element offset of (page, head, row) of K (v: of V) in layout l, and each tensor's strides. */
static int64_t elem_of(enum layout l, const struct model *m, int64_t np, int64_t P, bool v,
		       int64_t pg, int64_t g, int64_t r)
{
	const int64_t hd = m->Hkv * m->D, half = np * P * hd;

	switch (l) {
	case L_HND:
		return (v ? half : 0) + ((pg * m->Hkv + g) * P + r) * m->D;
	case L_NHD:
		return (v ? half : 0) + (pg * P + r) * hd + g * m->D;
	default:
		return ((pg * 2 + v) * P + r) * hd + g * m->D;
	}
}

/*
 * The pages of model sequences idx[0..nb) (table order = batch order), in layout l on dev:
 * pages numbered by a random permutation of np, entry j sharing the first share[j] full pages
 * of entry j - 1 when share[j] > 0 (their tokens must be equal: forks). Unused pages hold
 * random values.
 */
static int cpages_make(struct cpages *c, const struct model *m, ape_device *dev, ape_rng *r,
		       enum layout l, int64_t P, int64_t np, int64_t nb, const int64_t *idx,
		       const int64_t *share)
{
	const size_t esz = m->esz;
	const int64_t total = 2 * np * P * m->Hkv * m->D;
	int64_t *perm = malloc(sizeof(int64_t) * (size_t)np), next = 0, most = 0;
	char *img = ape_rng_array(r, (size_t)total, m->dt, NULL);
	ape_queue *q = NULL;
	int ret = perm && img ? 0 : APE_ENOMEM;

	memset(c, 0, sizeof(*c));
	c->np = np;
	c->P = P;
	c->nseq = nb;
	for (int64_t i = 0; i < np && perm; i++)
		perm[i] = i;
	for (int64_t i = np - 1; i > 0 && perm; i--) {
		const int64_t j = ape_rng_range(r, 0, (int)i), t = perm[i];

		perm[i] = perm[j];
		perm[j] = t;
	}
	for (int64_t j = 0; j < nb; j++) {
		const int64_t n = m->s[idx[j]].n;

		c->indptr[j + 1] = c->indptr[j] + (n + P - 1) / P;
		c->last[j] = n ? n - (n - 1) / P * P : 0;
		c->lens[j] = n;
		c->kstart[j] = m->s[idx[j]].k_start;
		most = (n + P - 1) / P > most ? (n + P - 1) / P : most;
	}
	c->stride = most + 2;
	c->indices = malloc(sizeof(int64_t) * (size_t)(c->indptr[nb] + 1));
	c->btab = malloc(sizeof(int64_t) * (size_t)(nb * c->stride + 1));
	if (!c->indices || !c->btab)
		ret = APE_ENOMEM;
	for (int64_t j = 0; j < nb && !ret; j++) {
		const struct mseq *s = &m->s[idx[j]];

		for (int64_t i = 0; i < c->stride; i++) /* garbage past the sequence's pages */
			c->btab[j * c->stride + i] = -12345 - i;
		for (int64_t p = 0; p < c->indptr[j + 1] - c->indptr[j]; p++) {
			int64_t pg;

			if (j && p < share[j])
				pg = c->indices[c->indptr[j - 1] + p];
			else if (next < np)
				pg = perm[next++];
			else
				return APE_ENOMEM; /* the test asked for too few pages */
			c->indices[c->indptr[j] + p] = pg;
			c->btab[j * c->stride + p] = pg;
			for (int64_t t = p * P; t < (p + 1) * P && t < s->n; t++)
				for (int64_t g = 0; g < m->Hkv; g++)
					for (int v = 0; v < 2; v++)
						memcpy(img + (size_t)elem_of(l, m, np, P, v, pg, g,
									     t - p * P) *
								     esz,
						       (v ? s->v : s->k) +
							       ((size_t)(t * m->Hkv + g) * m->D) * esz,
						       (size_t)m->D * esz);
		}
	}
	if (!ret)
		ret = ape_buffer_alloc(dev, (size_t)total * esz, &c->buf);
	if (!ret)
		ret = ape_queue_create(dev, &q);
	if (!ret)
		ret = ape_buffer_write(q, c->buf, 0, img, (size_t)total * esz);
	if (!ret)
		ret = ape_queue_synchronize(q);
	ape_queue_destroy(q);
	if (!ret) {
		const int64_t hd = m->Hkv * m->D;

		ape_dtensor_init(&c->k, c->buf, 0, m->dt, np, m->Hkv, P, m->D);
		c->v = c->k;
		c->v.byte_offset = (uint64_t)(elem_of(l, m, np, P, true, 0, 0, 0) * (int64_t)esz);
		if (l != L_HND) {
			const int64_t sp = l == L_NHD ? P * hd : 2 * P * hd;

			c->k.strides[0] = c->v.strides[0] = sp;
			c->k.strides[1] = c->v.strides[1] = m->D;
			c->k.strides[2] = c->v.strides[2] = hd;
			c->k.strides[3] = c->v.strides[3] = 1;
		}
	}
	free(perm);
	c->img = img;
	c->img_bytes = (size_t)total * esz;
	return ret;
}

/* The table of c, CSR or block table. */
static ape_page_table table_of(const struct cpages *c, bool csr)
{
	ape_page_table pt;

	ape_page_table_init(&pt);
	pt.nseq = c->nseq;
	pt.k_start = c->kstart;
	if (csr) {
		pt.indptr = c->indptr;
		pt.indices = c->indices;
		pt.last_page_len = c->last;
	} else {
		pt.block_table = c->btab;
		pt.block_table_stride = c->stride;
		pt.seq_lens = c->lens;
	}
	return pt;
}

static ape_paged_kv_options paged_options(const struct model *m, int64_t P, int64_t np)
{
	ape_paged_kv_options o;

	ape_paged_kv_options_init(&o);
	o.Hkv = m->Hkv;
	o.H = m->H;
	o.D = m->D;
	o.dtype = m->dt;
	o.page_tokens = P;
	o.num_pages = np;
	o.max_batch_tokens = 64;
	return o;
}

/* b's rows run through pk over c (the plan made here), outputs into o2/lse2. */
static int paged_run(ape_paged_kv *pk, const struct cpages *c, bool csr, const struct mbatch *b,
		     ape_tensor *o2, float *lse2, ape_stats *st)
{
	const ape_page_table pt = table_of(c, csr);
	int ret = ape_paged_kv_plan(pk, &pt, b->cu, b->explicit_pos ? b->posq : NULL);

	return ret ? ret : ape_paged_kv_run(pk, &b->desc, &c->k, &c->v, &b->q.t, o2, lse2, st);
}

/* b with its outputs swapped for o2/lse2 against the oracle. */
static void check_outputs(struct __test_metadata *_metadata, const struct model *m,
			  struct mbatch *b, test_tensor *o2, float *lse2, const char *what)
{
	struct mbatch x = *b;
	double eo, el;

	x.o = *o2;
	x.lse = lse2;
	ASSERT_EQ(0, mbatch_check(m, &x, &eo, &el));
	EXPECT_LE(eo, test_tol_o(m->dt) + test_skip_tol_o(b->desc.skip_tol))
	TH_LOG("%s: O error %g", what, eo);
	EXPECT_LE(el, test_tol_lse(m->dt) + test_skip_tol_lse(b->desc.skip_tol))
	TH_LOG("%s: LSE error %g", what, el);
}

/* Sequences for the tests: `ns` of random lengths up to maxlen, entry j > 0 a fork of entry
 * j - 1 (then both appended to) when j % 3 == 2; share[j] the full pages entry j may share. */
static void make_sequences(struct __test_metadata *_metadata, struct model *m, ape_rng *r,
			   int64_t ns, int64_t maxlen, int64_t P, int64_t *idx, int64_t *share)
{
	int ret;

	for (int64_t j = 0; j < ns; j++) {
		share[j] = 0;
		if (j % 3 == 2) {
			const int64_t n0 = m->s[idx[j - 1]].n;

			ASSERT_LE(0, (idx[j] = model_fork(m, idx[j - 1], &ret)))
			TH_LOG("%s", ape_last_error());
			share[j] = n0 / P;
			ASSERT_EQ(0, model_append(m, r, idx[j], ape_rng_range(r, 1, 9)));
			continue;
		}
		ASSERT_LE(0, (idx[j] = model_add(m, ape_rng_range(r, -500, 500), &ret)));
		if (j % 5 != 4) /* some sequences hold nothing */
			ASSERT_EQ(0, model_append(m, r, idx[j], ape_rng_range(r, 1, (int)maxlen)))
			TH_LOG("%s", ape_last_error());
	}
}

/*
 * Mixed batches (decode rows, prefill chunks, sequences without keys or rows, explicit
 * positions) over pages of 1, 5 and 16 tokens, every layout, CSR and block table, three
 * storage types: each against the oracle, and the same bits as the pool's attend with
 * skip_tol 0 (the pool then leaves no key out either), every layout and form the same bits.
 */
TEST_F(paged, equals_the_oracle_and_the_pool)
{
	static const struct {
		int64_t P;
		ape_dtype dt;
	} cases[] = { { 16, APE_F32 }, { 5, APE_F16 }, { 1, APE_BF16 } };

	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		const int64_t P = cases[ci].P, Hkv = 2, H = P == 5 ? 2 : 4, D = self->emu ? 16 : 32;
		ape_kv_pool_options o;
		struct model m;
		ape_rng rng;
		int64_t idx[9], share[9], lq[9];
		char what[96];

		snprintf(what, sizeof(what), "pages of %lld, %s", (long long)P,
			 ape_dtype_name(cases[ci].dt));
		ape_rng_init(&rng, what);
		ape_kv_pool_options_init(&o);
		o.Hkv = Hkv;
		o.H = H;
		o.D = D;
		o.dtype = cases[ci].dt;
		o.page_tokens = P;
		o.capacity_tokens = 2000;
		o.max_batch_tokens = 64;
		o.attend_chunk = 96;
		ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
		make_sequences(_metadata, &m, &rng, 9, self->emu ? 60 : 180, P, idx, share);
		for (int round = 0; round < 4; round++) {
			const enum pos_mode pm = round < 2 ? POS_DEFAULT : round == 2 ? POS_GAPS
										    : POS_REPEATS;
			ape_paged_kv_options po = paged_options(&m, P, 2000 / P + 40);
			ape_paged_kv *pk = NULL;
			struct mbatch b;
			test_tensor o2[2 * L_COUNT];
			float *lse2[2 * L_COUNT];

			for (int j = 0; j < 9; j++) /* decode rows, some chunks, one without rows */
				lq[j] = j == 3 ? 0 : round % 2 && j % 4 == 1 ? ape_rng_range(&rng, 2, 7)
									     : 1;
			ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 9, idx, lq, pm));
			if (round == 1)
				b.desc.causal = false;
			b.desc.skip_tol = 0;
			po.attend_chunk = 96;
			ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk))
			TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, mbatch_attend(&m, &b, NULL)) TH_LOG("%s", ape_last_error());
			for (int t = 0; t < 2 * L_COUNT; t++) {
				const enum layout l = (enum layout)(t / 2);
				struct cpages c;
				ape_stats st;

				snprintf(what, sizeof(what), "pages of %lld, %s, %s, %s, round %d",
					 (long long)P, ape_dtype_name(cases[ci].dt), layout_names[l],
					 t % 2 ? "block table" : "CSR", round);
				ASSERT_EQ(0, test_tensor_random(&o2[t], &rng, APE_F32, 1, b.tq, H, D,
								1.0));
				ape_tensor_init_packed(&o2[t].t, o2[t].alloc, APE_F32, b.tq, H, D);
				lse2[t] = malloc(sizeof(float) * (size_t)(b.tq * H + 1));
				ASSERT_NE(NULL, lse2[t]);
				ASSERT_EQ(0, cpages_make(&c, &m, self->dev, &rng, l, P, po.num_pages,
							 9, idx, share))
				TH_LOG("%s: %s", what, ape_last_error());
				ape_stats_init(&st);
				ASSERT_EQ(0, paged_run(pk, &c, t % 2 == 0, &b, &o2[t].t, lse2[t], &st))
				TH_LOG("%s: %s", what, ape_last_error());
				EXPECT_GE(st.pairs_visible, st.pairs_computed);
				check_outputs(_metadata, &m, &b, &o2[t], lse2[t], what);
				EXPECT_EQ(0, memcmp(o2[t].t.data, b.o.t.data,
						    (size_t)(b.tq * H * D) * sizeof(float)))
				TH_LOG("%s: O differs from the pool's", what);
				EXPECT_EQ(0, memcmp(lse2[t], b.lse, (size_t)(b.tq * H) * sizeof(float)))
				TH_LOG("%s: LSE differs from the pool's", what);
				cpages_free(&c);
			}
			for (int t = 0; t < 2 * L_COUNT; t++) {
				test_tensor_free(&o2[t]);
				free(lse2[t]);
			}
			ape_paged_kv_destroy(pk);
			mbatch_free(&b);
		}
		model_free(&m);
	}
}

/* With the seed's decay and skipping: the kernels skip (no window is cut: the caller's pages
 * carry no norm maxima), every row within the spec's skip tolerance of the oracle; the
 * diagnostics against their definitions. */
TEST_F(paged, decay_with_skipping)
{
	const int64_t P = 16, D = self->emu ? 16 : 64;
	ape_kv_pool_options o;
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL;
	struct model m;
	struct mbatch b;
	struct cpages c;
	test_tensor o2;
	float *lse2;
	ape_rng rng;
	ape_stats st;
	int64_t idx[6], share[6], lq[6] = { 1, 1, 3, 1, 1, 2 };

	ape_rng_init(&rng, _metadata->name);
	ape_kv_pool_options_init(&o);
	o.Hkv = 1;
	o.H = 2;
	o.D = D;
	o.dtype = APE_F32;
	o.page_tokens = P;
	o.capacity_tokens = 4096;
	o.max_batch_tokens = 64;
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	make_sequences(_metadata, &m, &rng, 6, self->emu ? 200 : 600, P, idx, share);
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 6, idx, lq, POS_DEFAULT));
	for (int h = 0; h < 2; h++) {
		b.prm[0][h] = 0.4f;
		b.prm[1][h] = 0.02f;
		b.prm[2][h] = 0.02f;
		b.prm[3][h] = h ? 0.1f : 0;
	}
	b.desc.skip_tol = ldexp(1, -24);
	po = paged_options(&m, P, 4096 / P + 8);
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, cpages_make(&c, &m, self->dev, &rng, L_NHD, P, po.num_pages, 6, idx, share));
	ASSERT_EQ(0, test_tensor_random(&o2, &rng, APE_F32, 1, b.tq, 2, D, 1.0));
	ape_tensor_init_packed(&o2.t, o2.alloc, APE_F32, b.tq, 2, D);
	lse2 = malloc(sizeof(float) * (size_t)(b.tq * 2));
	ASSERT_NE(NULL, lse2);
	ape_stats_init(&st);
	ASSERT_EQ(0, paged_run(pk, &c, true, &b, &o2.t, lse2, &st)) TH_LOG("%s", ape_last_error());
	check_outputs(_metadata, &m, &b, &o2, lse2, "decay, skipping");
	EXPECT_GE(st.pairs_visible, st.pairs_computed);
	if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG)) { /* the diagnostics, against the definitions */
		struct mbatch x = b;
		double eo, el, ee, em;

		ASSERT_EQ(0, mbatch_want_diag(&m, &b));
		ASSERT_EQ(0, ape_paged_kv_run_diag(pk, &b.desc, &c.k, &c.v, &b.q.t, &o2.t, lse2,
						   b.ent, b.md, NULL))
		TH_LOG("%s", ape_last_error());
		x = b;
		x.o = o2;
		x.lse = lse2;
		ASSERT_EQ(0, mbatch_check_diag(&m, &x, &eo, &el, &ee, &em));
		EXPECT_LE(eo, test_tol_o(APE_F32) + test_skip_tol_o(b.desc.skip_tol));
		EXPECT_LE(ee, test_tol_lse(APE_F32)) TH_LOG("entropy error %g", ee);
		EXPECT_LE(em, test_tol_lse(APE_F32)) TH_LOG("distance error %g", em);
	}
	test_tensor_free(&o2);
	free(lse2);
	cpages_free(&c);
	ape_paged_kv_destroy(pk);
	mbatch_free(&b);
	model_free(&m);
}

/* One plan, two layers: different pages (the same page table) and parameters, each against
 * the oracle; the first layer run again gives the same bits. */
TEST_F(paged, one_plan_serves_every_layer)
{
	const int64_t P = 8, D = self->emu ? 16 : 32;
	ape_kv_pool_options o;
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL;
	struct model m[2];
	struct mbatch b[2];
	struct cpages c[2];
	test_tensor o2[3];
	float *lse2[3];
	ape_rng rng;
	int64_t idx[2][7], share[7], lq[7] = { 1, 4, 1, 1, 2, 1, 1 };
	ape_page_table pt;
	uint64_t seeds[2];
	int ret;

	ape_rng_init(&rng, _metadata->name);
	seeds[0] = ape_rng_next(&rng);
	seeds[1] = ape_rng_next(&rng);
	ape_kv_pool_options_init(&o);
	o.Hkv = 2;
	o.H = 4;
	o.D = D;
	o.dtype = APE_F16;
	o.page_tokens = P;
	o.capacity_tokens = 1024;
	o.max_batch_tokens = 64;
	for (int l = 0; l < 2; l++) { /* the same lengths and positions, other tokens */
		ape_rng lr;

		ape_rng_seed(&lr, seeds[0]);
		ASSERT_EQ(0, model_init(&m[l], self->dev, &o)) TH_LOG("%s", ape_last_error());
		for (int j = 0; j < 7; j++) {
			ASSERT_LE(0, (idx[l][j] = model_add(&m[l], 3 * j, &ret)));
			ASSERT_EQ(0, model_append(&m[l], &rng, idx[l][j], ape_rng_range(&lr, 1, 90)));
			share[j] = 0;
		}
		ASSERT_EQ(0, mbatch_make(&b[l], &m[l], &rng, 7, idx[l], lq, POS_DEFAULT));
		b[l].desc.skip_tol = 0;
	}
	po = paged_options(&m[0], P, 1024 / P);
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());
	for (int l = 0; l < 2; l++) {
		ape_rng pr;

		ape_rng_seed(&pr, seeds[1]); /* the same page numbers in both layers */
		ASSERT_EQ(0, cpages_make(&c[l], &m[l], self->dev, &pr, l ? L_HND : L_NHD, P,
					 po.num_pages, 7, idx[l], share));
	}
	EXPECT_EQ(0, memcmp(c[0].indices, c[1].indices, sizeof(int64_t) * (size_t)c[0].indptr[7]));
	pt = table_of(&c[0], true);
	ASSERT_EQ(0, ape_paged_kv_plan(pk, &pt, b[0].cu, NULL)) TH_LOG("%s", ape_last_error());
	for (int t = 0; t < 3; t++) {
		const int l = t == 1;
		char what[32];

		ASSERT_EQ(0, test_tensor_random(&o2[t], &rng, APE_F32, 1, b[0].tq, 4, D, 1.0));
		ape_tensor_init_packed(&o2[t].t, o2[t].alloc, APE_F32, b[0].tq, 4, D);
		lse2[t] = malloc(sizeof(float) * (size_t)(b[0].tq * 4));
		ASSERT_NE(NULL, lse2[t]);
		ASSERT_EQ(0, ape_paged_kv_run(pk, &b[l].desc, &c[l].k, &c[l].v, &b[l].q.t, &o2[t].t,
					      lse2[t], NULL))
		TH_LOG("%s", ape_last_error());
		snprintf(what, sizeof(what), "layer %d, run %d", l, t);
		check_outputs(_metadata, &m[l], &b[l], &o2[t], lse2[t], what);
	}
	EXPECT_EQ(0, memcmp(o2[0].t.data, o2[2].t.data, (size_t)(b[0].tq * 4 * D) * sizeof(float)));
	EXPECT_EQ(0, memcmp(lse2[0], lse2[2], (size_t)(b[0].tq * 4) * sizeof(float)));
	for (int t = 0; t < 3; t++) {
		test_tensor_free(&o2[t]);
		free(lse2[t]);
	}
	for (int l = 0; l < 2; l++) {
		cpages_free(&c[l]);
		mbatch_free(&b[l]);
		model_free(&m[l]);
	}
	ape_paged_kv_destroy(pk);
}

/* A decode step of many sequences over the caller's pages in NHD layout is one launch reading
 * them in place on OpenCL (nothing copied on the device); gathered elsewhere. */
TEST_F(paged, a_decode_step_reads_the_callers_pages_in_place)
{
	const char *shape = getenv("APE_OCL_DEC_SHAPE"); /* the GPU shape takes no ragged launch */
	const bool in_place = self->dev->be->ops->attention_pages != NULL &&
			      !(shape && !strcmp(shape, "gpu"));
	const int64_t P = 16, D = 32;
	ape_kv_pool_options o;
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL;
	struct model m;
	struct mbatch b;
	struct cpages c;
	test_tensor o2;
	float *lse2;
	ape_rng rng;
	ape_stats st;
	int64_t idx[20], share[20], lq[20];

	ape_rng_init(&rng, _metadata->name);
	ape_kv_pool_options_init(&o);
	o.Hkv = 2;
	o.H = 4;
	o.D = D;
	o.dtype = APE_F16;
	o.page_tokens = P;
	o.capacity_tokens = 4096;
	o.max_batch_tokens = 64;
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	make_sequences(_metadata, &m, &rng, 20, self->emu ? 40 : 150, P, idx, share);
	for (int j = 0; j < 20; j++)
		lq[j] = 1;
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 20, idx, lq, POS_DEFAULT));
	b.desc.skip_tol = 0;
	po = paged_options(&m, P, 4096 / P);
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, cpages_make(&c, &m, self->dev, &rng, L_NHD, P, po.num_pages, 20, idx, share));
	ASSERT_EQ(0, test_tensor_random(&o2, &rng, APE_F32, 1, b.tq, 4, D, 1.0));
	ape_tensor_init_packed(&o2.t, o2.alloc, APE_F32, b.tq, 4, D);
	lse2 = malloc(sizeof(float) * (size_t)(b.tq * 4));
	ASSERT_NE(NULL, lse2);
	ape_stats_init(&st);
	ASSERT_EQ(0, paged_run(pk, &c, false, &b, &o2.t, lse2, &st)) TH_LOG("%s", ape_last_error());
	check_outputs(_metadata, &m, &b, &o2, lse2, "decode step");
	EXPECT_EQ(st.pairs_visible, st.pairs_computed);
	if (in_place) {
		EXPECT_EQ(1, st.chunks) TH_LOG("%llu launches", (unsigned long long)st.chunks);
		EXPECT_STREQ("decode-in-place", st.path);
		EXPECT_EQ(0, st.bytes_device_to_device);
	} else {
		EXPECT_NE(0, st.bytes_device_to_device) TH_LOG("path %s", st.path);
	}
	test_tensor_free(&o2);
	free(lse2);
	cpages_free(&c);
	ape_paged_kv_destroy(pk);
	mbatch_free(&b);
	model_free(&m);
}

/* A plan that fails names its argument, index and value, and leaves no plan. */
static void expect_plan_error(struct __test_metadata *_metadata, ape_paged_kv *pk,
			      const ape_page_table *pt, const int64_t *cu, int code,
			      const char *needle)
{
	EXPECT_EQ(code, ape_paged_kv_plan(pk, pt, cu, NULL)) TH_LOG("wanted %s", needle);
	EXPECT_NE(NULL, strstr(ape_last_error(), needle))
	TH_LOG("wanted \"%s\" in: %s", needle, ape_last_error());
}

/* Bad options, tables, batches and tensors: errors naming them; nothing written. */
TEST_F(paged, validation_names_the_argument)
{
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL, *x = NULL;
	int64_t indptr[3] = { 0, 2, 3 }, indices[3] = { 4, 1, 7 }, last[2] = { 3, 4 };
	int64_t btab[4] = { 4, 1, 7, 0 }, lens[2] = { 7, 4 }, cu[3] = { 0, 1, 2 };
	int64_t kstart[2] = { 0, 0 };
	ape_page_table pt, good;
	ape_buffer *buf = NULL, *small = NULL;
	ape_dtensor k, v;
	ape_attn_desc desc;
	float q[2 * 2 * 8], o[2 * 2 * 8], lse[4], poison;
	ape_tensor qt, ot;

	memset(&poison, 0xa5, sizeof(poison));
	for (int i = 0; i < 32; i++)
		q[i] = (float)i / 32;
	ape_paged_kv_options_init(&po);
	po.Hkv = 1;
	po.H = 2;
	po.D = 8;
	po.dtype = APE_F32;
	po.page_tokens = 4;
	po.num_pages = 8;
	/* options */
	x = (ape_paged_kv *)1;
	po.page_tokens = 0;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_create(self->dev, &po, &x));
	EXPECT_EQ(NULL, x);
	EXPECT_NE(NULL, strstr(ape_last_error(), "page_tokens = 0")) TH_LOG("%s", ape_last_error());
	po.page_tokens = 4;
	po.num_pages = 0;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_create(self->dev, &po, &x));
	EXPECT_NE(NULL, strstr(ape_last_error(), "num_pages = 0")) TH_LOG("%s", ape_last_error());
	po.num_pages = 8;
	po.D = 7;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_create(self->dev, &po, &x));
	EXPECT_NE(NULL, strstr(ape_last_error(), "opts->D")) TH_LOG("%s", ape_last_error());
	po.D = 8;
	po.struct_size--;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_create(self->dev, &po, &x));
	po.struct_size++;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_create(NULL, &po, &x));
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());

	/* tables */
	ape_page_table_init(&good);
	good.nseq = 2;
	good.indptr = indptr;
	good.indices = indices;
	good.last_page_len = last;
	good.k_start = kstart;
	ASSERT_EQ(0, ape_paged_kv_plan(pk, &good, cu, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_plan(pk, NULL, cu, NULL));
	pt = good;
	pt.block_table = btab;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "give one");
	pt = good;
	pt.indptr = NULL;
	pt.indices = NULL;
	pt.last_page_len = NULL;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "no table");
	pt = good;
	pt.struct_size = 1;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "struct_size");
	indptr[0] = 1;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->indptr[0] = 1");
	indptr[0] = 0;
	indptr[1] = 4;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->indptr[2] = 3 < pt->indptr[1] = 4");
	indptr[1] = 2;
	indices[2] = 8;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->indices[2] = 8: no such page");
	indices[2] = -1;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->indices[2] = -1");
	indices[2] = 7;
	indices[1] = 4;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "holds page 4 twice");
	indices[1] = 1;
	indices[2] = 4; /* another sequence sharing page 4: allowed */
	EXPECT_EQ(0, ape_paged_kv_plan(pk, &good, cu, NULL)) TH_LOG("%s", ape_last_error());
	indices[2] = 7;
	last[0] = 0;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->last_page_len[0] = 0");
	last[0] = 5;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->last_page_len[0] = 5");
	last[0] = 3;
	indptr[2] = 2;
	last[1] = 1;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "pt->last_page_len[1] = 1: must be 0");
	indptr[2] = 3;
	last[1] = 4;
	kstart[1] = INT64_MAX;
	expect_plan_error(_metadata, pk, &good, cu, APE_EOVERFLOW, "pt->k_start[1]");
	kstart[1] = 0;
	cu[1] = 3;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 3");
	cu[1] = 1;
	cu[2] = 300;
	expect_plan_error(_metadata, pk, &good, cu, APE_EINVAL, "max_batch_tokens");
	cu[2] = 2;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_plan(pk, &good, NULL, NULL));
	ape_page_table_init(&pt);
	pt.nseq = 2;
	pt.block_table = btab;
	pt.block_table_stride = 2;
	pt.seq_lens = lens;
	pt.k_start = kstart;
	EXPECT_EQ(0, ape_paged_kv_plan(pk, &pt, cu, NULL)) TH_LOG("%s", ape_last_error());
	lens[1] = 9;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "needs 3 pages");
	lens[1] = -1;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "pt->seq_lens[1] = -1");
	lens[1] = 4;
	pt.block_table_stride = -1;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "block_table_stride = -1");
	pt.block_table_stride = 2;
	btab[2] = 9;
	expect_plan_error(_metadata, pk, &pt, cu, APE_EINVAL, "pt->block_table[2] = 9");
	btab[2] = 7;

	/* runs: no plan (the failed plan above left none), then bad tensors */
	ape_tensor_init_packed(&qt, q, APE_F32, 2, 2, 8);
	ape_tensor_init_packed(&ot, o, APE_F32, 2, 2, 8);
	ape_attn_desc_init(&desc);
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, 2 * 8 * 4 * 8 * sizeof(float), &buf));
	ASSERT_EQ(0, ape_buffer_alloc(self->dev, 64, &small));
	ape_dtensor_init(&k, buf, 0, APE_F32, 8, 1, 4, 8);
	ape_dtensor_init(&v, buf, 8 * 4 * 8 * sizeof(float), APE_F32, 8, 1, 4, 8);
	for (int i = 0; i < 32; i++)
		o[i] = poison;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &k, &v, &qt, &ot, lse, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "no plan")) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_paged_kv_plan(pk, &good, cu, NULL)) TH_LOG("%s", ape_last_error());
	{
		ape_dtensor bad = k;

		bad.shape[0] = 7;
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &bad, &v, &qt, &ot, lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "k_pages")) TH_LOG("%s", ape_last_error());
		bad = k;
		bad.dtype = APE_F16;
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &bad, &v, &qt, &ot, lse, NULL));
		bad = v;
		bad.buf = small;
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &k, &bad, &qt, &ot, lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "v_pages")) TH_LOG("%s", ape_last_error());
		bad = v; /* valid (one head: its stride unused), but not k_pages's strides */
		bad.strides[0] = 32;
		bad.strides[1] = 0;
		bad.strides[2] = 8;
		bad.strides[3] = 1;
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &k, &bad, &qt, &ot, lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "differ from k_pages")) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, NULL, &v, &qt, &ot, lse, NULL));
	}
	{
		ape_tensor q3, o3;

		ape_tensor_init_packed(&q3, q, APE_F32, 1, 2, 8);
		ape_tensor_init_packed(&o3, o, APE_F32, 1, 2, 8);
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &k, &v, &q3, &o3, lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "the plan has 2 query rows"))
		TH_LOG("%s", ape_last_error());
	}
	desc.k_start = 3;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(pk, &desc, &k, &v, &qt, &ot, lse, NULL));
	desc.k_start = 0;
	EXPECT_EQ(APE_EINVAL, ape_paged_kv_run(NULL, &desc, &k, &v, &qt, &ot, lse, NULL));
	for (int i = 0; i < 32; i++) {
		EXPECT_EQ(0, memcmp(&o[i], &poison, sizeof(poison))) TH_LOG("o[%d] written", i);
	}
	ape_buffer_free(buf);
	ape_buffer_free(small);
	ape_paged_kv_destroy(pk);
	ape_paged_kv_destroy(NULL);
}

/* The pages of c (layout l) as kDLCPU DLTensors [num_pages, page_tokens, Hkv, D] over its host
 * image (shape and strides in sh, st: [2][4]). */
static void dl_pages(const struct cpages *c, const struct model *m, enum layout l, DLTensor t[2],
		     int64_t sh[2][4], int64_t st[2][4])
{
	const int64_t hd = m->Hkv * m->D;

	for (int v = 0; v < 2; v++) {
		sh[v][0] = c->np;
		sh[v][1] = c->P;
		sh[v][2] = m->Hkv;
		sh[v][3] = m->D;
		st[v][0] = l == L_HND ? hd * c->P : l == L_NHD ? c->P * hd : 2 * c->P * hd;
		st[v][1] = l == L_HND ? m->D : hd;
		st[v][2] = l == L_HND ? c->P * m->D : m->D;
		st[v][3] = 1;
		t[v] = (DLTensor){ .data = c->img, .device = { kDLCPU, 0 }, .ndim = 4,
				   .dtype = test_dl_dtype(m->dt), .shape = sh[v], .strides = st[v],
				   .byte_offset = (uint64_t)(elem_of(l, m, c->np, c->P, v, 0, 0, 0) *
							     (int64_t)m->esz) };
	}
}

/*
 * ape_paged_kv_run_dlpack(): kDLCPU pages in every layout (HND as its permuted view,
 * FlashInfer's halves slices of one memory), q, o, lse as [total_q, H, D] / [total_q, H]
 * DLTensors: the same bits as ape_paged_kv_run() over the same pages on the device. Refusals
 * name the tensor and write nothing: a page shape that is not the object's (named in the view's
 * axes), strides that differ between K and V, queries on a device, no pk. (kDLCPU pages need a
 * device that reads host memory: the reference and OpenCL CPU devices.)
 */
TEST_F(paged, dlpack_pages_equal_the_device_tensors)
{
	const int64_t P = 5, D = 16;
	ape_kv_pool_options o;
	ape_paged_kv_options po;
	ape_paged_kv *pk = NULL;
	struct model m;
	struct mbatch b;
	ape_rng rng;
	int64_t idx[6], share[6], lq[6] = { 1, 3, 0, 1, 7, 2 };

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_HOST_MEMORY))
		SKIP(return, "%s reads no host memory: kDLCPU pages are not its",
		     self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	ape_kv_pool_options_init(&o);
	o.Hkv = 2;
	o.H = 4;
	o.D = D;
	o.dtype = APE_F16;
	o.page_tokens = P;
	o.capacity_tokens = 600;
	o.max_batch_tokens = 64;
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	make_sequences(_metadata, &m, &rng, 6, 60, P, idx, share);
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 6, idx, lq, POS_DEFAULT));
	po = paged_options(&m, P, 600 / P + 20);
	ASSERT_EQ(0, ape_paged_kv_create(self->dev, &po, &pk)) TH_LOG("%s", ape_last_error());
	for (int l = 0; l < L_COUNT; l++) {
		const size_t no = (size_t)(b.tq * 4 * D) * sizeof(float), nl = (size_t)(b.tq * 4) * 4;
		struct cpages c;
		test_tensor o1, o2;
		float *lse1 = malloc(nl + 4), *lse2 = malloc(nl + 4);
		int64_t sh[2][4], st[2][4], qs[3], os[3], ls[2];
		DLTensor pg[2], q, od, ld;
		ape_page_table pt;

		ASSERT_TRUE(lse1 && lse2);
		ASSERT_EQ(0, cpages_make(&c, &m, self->dev, &rng, (enum layout)l, P, po.num_pages, 6,
					 idx, share))
		TH_LOG("%s", ape_last_error());
		pt = table_of(&c, l != 1);
		ASSERT_EQ(0, test_tensor_random(&o1, &rng, APE_F32, 1, b.tq, 4, D, 1.0));
		ASSERT_EQ(0, test_tensor_random(&o2, &rng, APE_F32, 1, b.tq, 4, D, 1.0));
		ape_tensor_init_packed(&o1.t, o1.alloc, APE_F32, b.tq, 4, D);
		ape_tensor_init_packed(&o2.t, o2.alloc, APE_F32, b.tq, 4, D);
		memset(o2.alloc, 0x5a, no);
		memset(lse2, 0x5a, nl);
		ASSERT_EQ(0, ape_paged_kv_plan(pk, &pt, b.cu, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_paged_kv_run(pk, &b.desc, &c.k, &c.v, &b.q.t, &o1.t, lse1, NULL))
		TH_LOG("%s", ape_last_error());
		dl_pages(&c, &m, (enum layout)l, pg, sh, st);
		qs[0] = os[0] = b.tq;
		qs[1] = os[1] = ls[1] = 4;
		qs[2] = os[2] = D;
		ls[0] = b.tq;
		q = (DLTensor){ .data = b.q.t.data, .device = { kDLCPU, 0 }, .ndim = 3,
				.dtype = test_dl_dtype(m.dt), .shape = qs };
		od = (DLTensor){ .data = o2.alloc, .device = { kDLCPU, 0 }, .ndim = 3,
				 .dtype = test_dl_dtype(APE_F32), .shape = os };
		ld = (DLTensor){ .data = lse2, .device = { kDLCPU, 0 }, .ndim = 2,
				 .dtype = test_dl_dtype(APE_F32), .shape = ls };
		/* refusals first: nothing written */
		sh[0][2] = 3; /* Hkv 3 */
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run_dlpack(pk, &b.desc, &pg[0], &pg[1], &q, &od,
							      &ld));
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_paged_kv_run_dlpack: k_pages->shape[1]"))
		TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "1 is Hkv")) TH_LOG("%s", ape_last_error());
		sh[0][2] = m.Hkv;
		st[1][0] += 1; /* V's pages apart by one more element than K's */
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run_dlpack(pk, &b.desc, &pg[0], &pg[1], &q, &od,
							      &ld));
		EXPECT_NE(NULL, strstr(ape_last_error(), "v_pages: strides")) TH_LOG("%s",
										    ape_last_error());
		st[1][0] -= 1;
		q.device = (DLDevice){ kDLCUDA, 0 };
		EXPECT_NE(0, ape_paged_kv_run_dlpack(pk, &b.desc, &pg[0], &pg[1], &q, &od, &ld));
		EXPECT_NE(NULL, strstr(ape_last_error(), "q->device")) TH_LOG("%s", ape_last_error());
		q.device = (DLDevice){ kDLCPU, 0 };
		EXPECT_EQ(APE_EINVAL, ape_paged_kv_run_dlpack(NULL, &b.desc, &pg[0], &pg[1], &q, &od,
							      &ld));
		EXPECT_NE(NULL, strstr(ape_last_error(), "pk = NULL"));
		for (size_t i = 0; i < no; i++)
			ASSERT_EQ(0x5a, ((unsigned char *)o2.alloc)[i]) TH_LOG("o written");
		for (size_t i = 0; i < nl; i++)
			ASSERT_EQ(0x5a, ((unsigned char *)lse2)[i]) TH_LOG("lse written");
		/* and the run: the device tensors' bits */
		ASSERT_EQ(0, ape_paged_kv_run_dlpack(pk, &b.desc, &pg[0], &pg[1], &q, &od, &ld))
		TH_LOG("%s: %s", layout_names[l], ape_last_error());
		EXPECT_EQ(0, memcmp(o1.alloc, o2.alloc, no)) TH_LOG("%s: O differs", layout_names[l]);
		EXPECT_EQ(0, memcmp(lse1, lse2, nl)) TH_LOG("%s: LSE differs", layout_names[l]);
		check_outputs(_metadata, &m, &b, &o2, lse2, layout_names[l]);
		test_tensor_free(&o1);
		test_tensor_free(&o2);
		free(lse1);
		free(lse2);
		cpages_free(&c);
	}
	ape_paged_kv_destroy(pk);
	mbatch_free(&b);
	model_free(&m);
}

TEST_HARNESS_MAIN
