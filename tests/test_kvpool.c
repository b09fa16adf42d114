/* SPDX-License-Identifier: MIT */
/*
 * The KV pool (ape_kv_pool_*, include/ape/ape.h "KV pool"), on every backend: random serving
 * steps (sequences added, appended to one by one and in batches, forked, removed, their pages
 * reused in scrambled order; attends of mixed prefill and decode rows, sequences without keys,
 * explicit positions with gaps, repeats and any order, GQA, causal or not, decay with skipping)
 * against tests/common/naive.c's evaluation at every row's and key's position, for pages of 1,
 * 5 and 16 tokens and both 16-bit and 32-bit storage; a fork's shared page copied exactly once;
 * a full pool appending nothing; results bit for bit the same whatever other sequences share a
 * batch and in what order; a sequence longer than a key chunk, and forks whose keys outnumber
 * the pool's slots; a one-sequence decode reading the pages in place; validation naming the
 * argument, with the outputs untouched.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/backend_fixture.h"
#include "api/kv_session.h"
#include "api/validate.h"

#include "kvpool_model.h"

BACKEND_FIXTURE(pool)

static ape_kv_pool_options pool_options(int64_t Hkv, int64_t H, int64_t D, ape_dtype dt,
					int64_t page, int64_t cap)
{
	ape_kv_pool_options o;

	ape_kv_pool_options_init(&o);
	o.Hkv = Hkv;
	o.H = H;
	o.D = D;
	o.dtype = dt;
	o.page_tokens = page;
	o.capacity_tokens = cap;
	o.max_batch_tokens = 64;
	return o;
}

/* Attends a batch of m's sequences idx[0..nb) (lq[j] rows each, positions of mode pm) and
 * checks it against the oracle. */
static void attend_checked(struct __test_metadata *_metadata, const struct model *m,
			   ape_rng *r, int64_t nb, const int64_t *idx, const int64_t *lq,
			   enum pos_mode pm, const char *what)
{
	struct mbatch b;
	ape_stats st;
	double eo, el;

	ASSERT_EQ(0, mbatch_make(&b, m, r, nb, idx, lq, pm));
	ape_stats_init(&st);
	ASSERT_EQ(0, mbatch_attend(m, &b, &st)) TH_LOG("%s: %s", what, ape_last_error());
	ASSERT_EQ(0, mbatch_check(m, &b, &eo, &el));
	EXPECT_LE(eo, test_tol_o(m->dt) + test_skip_tol_o(b.desc.skip_tol))
	TH_LOG("%s: %lld sequences, %lld rows, positions %s, %s, skip_tol %g: O error %g", what,
	       (long long)nb, (long long)b.tq, pos_mode_names[pm],
	       b.desc.causal ? "causal" : "not causal", b.desc.skip_tol, eo);
	EXPECT_LE(el, test_tol_lse(m->dt) + test_skip_tol_lse(b.desc.skip_tol))
	TH_LOG("%s: positions %s: LSE error %g", what, pos_mode_names[pm], el);
	EXPECT_GE(st.pairs_visible, st.pairs_computed);
	mbatch_free(&b);
}

/* Random serving steps on a pool of pages of `page` tokens. */
static void serve_randomly(struct __test_metadata *_metadata, ape_device *dev, bool emu,
			   int64_t page, ape_dtype dt, int steps)
{
	const int64_t Hkv = 2, H = page % 2 ? 2 : 4, D = emu ? 16 : 32;
	ape_kv_pool_options o = pool_options(Hkv, H, D, dt, page, 600);
	struct model m;
	ape_rng rng;
	char what[64];
	int ret;

	snprintf(what, sizeof(what), "pages of %lld, %s", (long long)page, ape_dtype_name(dt));
	ape_rng_init(&rng, what);
	o.attend_chunk = 96; /* several key chunks for the longest sequences */
	ASSERT_EQ(0, model_init(&m, dev, &o)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 4; i++)
		ASSERT_LE(0, model_add(&m, ape_rng_range(&rng, -1000, 1000), &ret));
	for (int step = 0; step < steps; step++) {
		int64_t live[64], nl = 0;

		for (int64_t i = 0; i < m.ns && nl < 64; i++)
			if (m.s[i].live)
				live[nl++] = i;
		switch (ape_rng_range(&rng, 0, 9)) {
		case 0: /* a request joins */
			if (nl < 12)
				ASSERT_LE(0, model_add(&m, ape_rng_range(&rng, -1000, 1000), &ret));
			break;
		case 1: /* one finishes */
			if (nl > 2)
				ASSERT_EQ(0, model_remove(&m, live[ape_rng_range(&rng, 0, nl - 1)]));
			break;
		case 2: /* parallel sampling */
			if (nl && nl < 12 && ape_kv_pool_fork(m.pool, -1, NULL) == APE_EINVAL)
				ASSERT_LE(0, model_fork(&m, live[ape_rng_range(&rng, 0, nl - 1)], &ret))
				TH_LOG("%s", ape_last_error());
			break;
		case 3: /* a prefill chunk */
		case 4:
			if (nl) {
				ret = model_append(&m, &rng, live[ape_rng_range(&rng, 0, nl - 1)],
						   ape_rng_range(&rng, 1, 70));
				ASSERT_TRUE(ret == 0 || ret == APE_ENOMEM)
				TH_LOG("%s", ape_last_error());
			}
			break;
		default: { /* a decode step of several sequences, then their attend */
			int64_t idx[12], cnt[12], lq[12], nb = 0;
			const enum pos_mode pm =
				ape_rng_range(&rng, 0, 2) ? POS_DEFAULT
							  : (enum pos_mode)ape_rng_range(&rng, 1, 5);

			for (int64_t j = 0; j < nl && nb < 12; j++)
				if (ape_rng_range(&rng, 0, 2)) {
					idx[nb] = live[j];
					cnt[nb] = ape_rng_range(&rng, 0, 3);
					lq[nb++] = ape_rng_range(&rng, 0, 2) ? 1
									     : ape_rng_range(&rng, 0, 5);
				}
			ret = model_append_batch(&m, &rng, nb, idx, cnt);
			ASSERT_TRUE(ret == 0 || ret == APE_ENOMEM) TH_LOG("%s", ape_last_error());
			attend_checked(_metadata, &m, &rng, nb, idx, lq, pm, what);
		}
		}
	}
	model_free(&m);
}

TEST_F(pool, serving_steps_equal_the_oracle)
{
	const int steps = ape_test_slow() ? 12 : self->emu ? 25 : 60;

	serve_randomly(_metadata, self->dev, self->emu, 16, APE_F32, steps);
	serve_randomly(_metadata, self->dev, self->emu, 5, APE_F16, steps);
	serve_randomly(_metadata, self->dev, self->emu, 1, APE_BF16, steps / 2);
}

/* A fork shares every page; the first append into a shared, partly filled page copies it once,
 * the other branch's next append copies nothing more; both branches stay right. */
TEST_F(pool, fork_copies_a_shared_page_once)
{
	ape_kv_pool_options o = pool_options(2, 2, 16, APE_F32, 8, 256);
	struct model m;
	ape_kv_pool_info in;
	ape_rng rng;
	int64_t a, b, idx[2], lq[2] = { 3, 1 };
	int ret;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_LE(0, (a = model_add(&m, 40, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, a, 21)); /* pages 8 + 8 + 5 */
	ASSERT_LE(0, (b = model_fork(&m, a, &ret)));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &in));
	EXPECT_EQ(3, in.pages_used);
	EXPECT_EQ(3, in.pages_shared);
	EXPECT_EQ(0, in.pages_copied);
	EXPECT_EQ(42, in.tokens);
	ASSERT_EQ(0, model_append(&m, &rng, a, 2));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &in));
	EXPECT_EQ(1, in.pages_copied);
	EXPECT_EQ(4, in.pages_used);
	ASSERT_EQ(0, model_append(&m, &rng, b, 4)); /* into its shared page: a copied it */
	ASSERT_EQ(0, model_append(&m, &rng, a, 9));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &in));
	EXPECT_EQ(1, in.pages_copied);
	EXPECT_EQ(2, in.pages_shared);
	idx[0] = a;
	idx[1] = b;
	attend_checked(_metadata, &m, &rng, 2, idx, lq, POS_DEFAULT, "after the fork");
	ASSERT_EQ(0, model_remove(&m, a));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &in));
	EXPECT_EQ(0, in.pages_shared);
	EXPECT_EQ(4, in.pages_used); /* b's 25 tokens */
	EXPECT_EQ(1, in.sequences);
	attend_checked(_metadata, &m, &rng, 1, &b, lq, POS_DEFAULT, "the fork alone");
	model_free(&m);
}

/* A full pool says so and appends nothing, one sequence or a batch. */
TEST_F(pool, a_full_pool_appends_nothing)
{
	ape_kv_pool_options o = pool_options(1, 1, 8, APE_F32, 4, 20); /* 5 pages */
	struct model m;
	ape_kv_pool_info before, after;
	ape_rng rng;
	int64_t a, b, tokens, idx[2], cnt[2] = { 2, 5 };
	int ret;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_LE(0, (a = model_add(&m, 0, &ret)));
	ASSERT_LE(0, (b = model_add(&m, 0, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, a, 13)); /* 4 pages */
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &before));
	EXPECT_EQ(APE_ENOMEM, model_append(&m, &rng, b, 5));
	EXPECT_NE(NULL, strstr(ape_last_error(), "free pages")) TH_LOG("%s", ape_last_error());
	idx[0] = a;
	idx[1] = b;
	EXPECT_EQ(APE_ENOMEM, model_append_batch(&m, &rng, 2, idx, cnt));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &after));
	EXPECT_EQ(before.pages_used, after.pages_used);
	EXPECT_EQ(before.tokens, after.tokens);
	ASSERT_EQ(0, ape_kv_pool_sequence_info(m.pool, m.s[b].id, &tokens, NULL));
	EXPECT_EQ(0, tokens);
	/* what fits still does: 3 into a's last page, 4 into the last free one */
	cnt[0] = 3;
	cnt[1] = 4;
	ASSERT_EQ(0, model_append_batch(&m, &rng, 2, idx, cnt)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &after));
	EXPECT_EQ(0, after.pages_free);
	attend_checked(_metadata, &m, &rng, 2, idx, cnt, POS_DEFAULT, "a full pool");
	model_free(&m);
}

/* A sequence's rows come out the same bit for bit whatever other sequences share the batch
 * and in what order (batches of several sequences), and alone. */
TEST_F(pool, results_do_not_depend_on_the_batch)
{
	ape_kv_pool_options o = pool_options(2, 4, 32, APE_F32, 16, 2048);
	struct model m;
	struct mbatch x, y;
	ape_rng rng;
	int64_t idx[4], lq[4] = { 1, 4, 1, 2 }, ridx[4], rlq[4];
	const int64_t len[4] = { 300, 37, 129, 16 };
	int ret;

	ape_rng_init(&rng, _metadata->name);
	o.attend_chunk = 256; /* the first sequence in two key chunks, the rest grouped */
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 4; i++) {
		ASSERT_LE(0, (idx[i] = model_add(&m, 100 * i, &ret)));
		ASSERT_EQ(0, model_append(&m, &rng, idx[i], len[i]));
		ridx[3 - i] = idx[i];
		rlq[3 - i] = lq[i];
	}
	for (int pass = 0; pass < 2; pass++) {
		ASSERT_EQ(0, mbatch_make(&x, &m, &rng, 4, idx, lq, POS_DEFAULT));
		if (pass) { /* the seed's decay, skipping */
			mbatch_seed_decay(&m, &x, ldexp(1, -24));
		}
		ASSERT_EQ(0, mbatch_make(&y, &m, &rng, 4, ridx, rlq, POS_DEFAULT));
		/* y: x's rows in the reverse order of sequences, x's parameters */
		y.desc = x.desc;
		memcpy(y.prm, x.prm, sizeof(x.prm));
		for (int j = 0; j < 4; j++)
			for (int64_t i = 0; i < lq[j]; i++)
				for (int64_t h = 0; h < 4; h++)
					for (int64_t d = 0; d < 32; d++)
						test_tensor_set(&y.q.t, 0, h, y.cu[3 - j] + i, d,
								test_tensor_get(&x.q.t, 0, h,
										x.cu[j] + i, d));
		ASSERT_EQ(0, mbatch_attend(&m, &x, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, mbatch_attend(&m, &y, NULL)) TH_LOG("%s", ape_last_error());
		for (int j = 0; j < 4; j++)
			for (int64_t i = 0; i < lq[j]; i++)
				for (int64_t h = 0; h < 4; h++) {
					EXPECT_EQ(0, memcmp((float *)x.o.t.data +
								    ((x.cu[j] + i) * 4 + h) * 32,
							    (float *)y.o.t.data +
								    ((y.cu[3 - j] + i) * 4 + h) * 32,
							    32 * sizeof(float)))
					TH_LOG("pass %d, sequence %d, row %lld, head %lld", pass, j,
					       (long long)i, (long long)h);
					EXPECT_EQ(x.lse[(x.cu[j] + i) * 4 + h],
						  y.lse[(y.cu[3 - j] + i) * 4 + h]);
				}
		/* and each sequence alone: a decode step of one sequence is the same launch (the
		 * pages read through its page table rather than the group's slot table) */
		for (int j = 0; j < 4; j++) {
			struct mbatch z;

			ASSERT_EQ(0, mbatch_make(&z, &m, &rng, 1, &idx[j], &lq[j], POS_DEFAULT));
			z.desc = x.desc;
			memcpy(z.prm, x.prm, sizeof(x.prm));
			for (int64_t i = 0; i < lq[j]; i++)
				for (int64_t h = 0; h < 4; h++)
					for (int64_t d = 0; d < 32; d++)
						test_tensor_set(&z.q.t, 0, h, i, d,
								test_tensor_get(&x.q.t, 0, h,
										x.cu[j] + i, d));
			ASSERT_EQ(0, mbatch_attend(&m, &z, NULL)) TH_LOG("%s", ape_last_error());
			for (int64_t i = 0; i < lq[j]; i++)
				for (int64_t h = 0; h < 4; h++) {
					EXPECT_EQ(0, memcmp((float *)x.o.t.data +
								    ((x.cu[j] + i) * 4 + h) * 32,
							    (float *)z.o.t.data + (i * 4 + h) * 32,
							    32 * sizeof(float)))
					TH_LOG("pass %d, sequence %d alone, row %lld, head %lld", pass,
					       j, (long long)i, (long long)h);
					EXPECT_EQ(x.lse[(x.cu[j] + i) * 4 + h], z.lse[i * 4 + h]);
				}
			mbatch_free(&z);
		}
		mbatch_free(&x);
		mbatch_free(&y);
	}
	model_free(&m);
}

/* Forks of one long sequence attended together: their keys outnumber the pool's slots. */
TEST_F(pool, forks_may_outnumber_the_slots)
{
	ape_kv_pool_options o = pool_options(1, 2, 16, APE_F32, 16, 160);
	struct model m;
	ape_rng rng;
	int64_t idx[4], lq[4] = { 1, 2, 1, 3 };
	int ret;

	ape_rng_init(&rng, _metadata->name);
	o.attend_chunk = 64;
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_LE(0, (idx[0] = model_add(&m, -7, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, idx[0], 100));
	for (int i = 1; i < 4; i++) {
		ASSERT_LE(0, (idx[i] = model_fork(&m, idx[0], &ret)));
		ASSERT_EQ(0, model_append(&m, &rng, idx[i], i));
	}
	attend_checked(_metadata, &m, &rng, 4, idx, lq, POS_DEFAULT, "four forks");
	attend_checked(_metadata, &m, &rng, 4, idx, lq, POS_GAPS, "four forks, gaps");
	model_free(&m);
}

/* A sequence longer than one key chunk is decoded reading its pages where they are on devices
 * with the in-place decode (OpenCL, CUDA): one run of slots as a ring, pages out of order through a
 * page table (also from a window's first page on, under decay); other devices gather it in key
 * chunks. Every result against the oracle. */
TEST_F(pool, one_sequence_decode_reads_pages_in_place)
{
	ape_kv_pool_options o = pool_options(2, 4, 64, APE_F32, 16, 4096);
	const bool in_place = self->dev->be->ops->attention_pages != NULL;
	struct model m;
	struct mbatch b;
	ape_stats st;
	ape_rng rng;
	int64_t a, x, lq = 1;
	double eo, el;
	int ret;

	ape_rng_init(&rng, _metadata->name);
	o.attend_chunk = 32; /* a sequence longer than one key chunk runs by itself */
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_LE(0, (a = model_add(&m, 0, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, a, 200));
	for (int pass = 0; pass < 4; pass++) {
		ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 1, &a, &lq, POS_DEFAULT));
		if (pass == 3) { /* the seed's decay: a window from a later page on */
			mbatch_seed_decay(&m, &b, ldexp(1, -24));
		}
		ape_stats_init(&st);
		ASSERT_EQ(0, mbatch_attend(&m, &b, &st)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, mbatch_check(&m, &b, &eo, &el));
		EXPECT_LE(eo, test_tol_o(APE_F32) + test_skip_tol_o(b.desc.skip_tol))
		TH_LOG("pass %d: O error %g", pass, eo);
		EXPECT_LE(el, test_tol_lse(APE_F32) + test_skip_tol_lse(b.desc.skip_tol))
		TH_LOG("pass %d: LSE error %g", pass, el);
		if (in_place) {
			EXPECT_STREQ("decode-in-place", st.path) TH_LOG("pass %d", pass);
			EXPECT_EQ(0, st.bytes_device_to_device) TH_LOG("pass %d", pass);
		} else {
			EXPECT_NE(0, st.bytes_device_to_device) TH_LOG("pass %d: path %s", pass,
								       st.path);
		}
		if (pass == 3)
			EXPECT_LT(st.pairs_computed, st.pairs_visible / 2)
			TH_LOG("%llu of %llu pairs", (unsigned long long)st.pairs_computed,
			       (unsigned long long)st.pairs_visible);
		mbatch_free(&b);
		/* another sequence takes the next page: a's next pages come from elsewhere */
		ASSERT_LE(0, (x = model_add(&m, 0, &ret)));
		ASSERT_EQ(0, model_append(&m, &rng, x, 1));
		ASSERT_EQ(0, model_append(&m, &rng, a, 20 + 300 * (pass == 1)));
	}
	model_free(&m);
}

/* A decode step of many sequences is one ragged launch: on OpenCL and CUDA the decode kernel
 * reads every sequence's pages in place through the group's slot table (nothing gathered),
 * elsewhere the keys are gathered; every row against the oracle, pages scrambled by removals
 * first. Sequences of 1 to 1500 keys (up to 6 of the OpenCL decode's 256-key chunks: its grid
 * maps work-items to segments of different chunk counts) and one without keys. */
TEST_F(pool, a_decode_step_of_many_sequences_reads_pages_in_place)
{
	ape_kv_pool_options o = pool_options(2, 4, 32, APE_F16, 16, 16384);
	const char *shape = getenv("APE_OCL_DEC_SHAPE"); /* the GPU shape takes no ragged launch */
	const bool in_place = self->dev->be->ops->attention_pages != NULL &&
			      !(shape && !strcmp(shape, "gpu"));
	struct model m;
	struct mbatch b;
	ape_stats st;
	ape_rng rng;
	int64_t idx[32], lq[32], nb = 0;
	double eo, el;
	int ret;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 36; i++) {
		const int64_t n = self->emu      ? ape_rng_range(&rng, 1, 40)
				  : i % 4 == 0 ? ape_rng_range(&rng, 300, 1500)
					       : ape_rng_range(&rng, 1, 150);

		ASSERT_LE(0, model_add(&m, ape_rng_range(&rng, -100, 100), &ret));
		ASSERT_EQ(0, model_append(&m, &rng, i, n));
	}
	for (int i = 0; i < 36; i++) { /* every third goes: the others' next pages scatter */
		if (i % 3 == 1) {
			ASSERT_EQ(0, model_remove(&m, i));
		} else {
			ASSERT_EQ(0, model_append(&m, &rng, i, ape_rng_range(&rng, 1, 40)));
		}
	}
	for (int i = 0; i < 36; i++)
		if (i % 3 != 1) {
			idx[nb] = i;
			lq[nb++] = 1 + (i % 5 == 0); /* decode rows, some two at once */
			if (nb == 9) { /* a sequence without keys among them */
				ASSERT_LE(0, (idx[nb] = model_add(&m, 0, &ret)));
				lq[nb++] = 1;
			}
		}
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, nb, idx, lq, POS_DEFAULT));
	b.desc.skip_tol = 0;
	ape_stats_init(&st);
	ASSERT_EQ(0, mbatch_attend(&m, &b, &st)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, mbatch_check(&m, &b, &eo, &el));
	EXPECT_LE(eo, test_tol_o(APE_F16)) TH_LOG("O error %g", eo);
	EXPECT_LE(el, test_tol_lse(APE_F16)) TH_LOG("LSE error %g", el);
	EXPECT_EQ(st.pairs_visible, st.pairs_computed);
	if (in_place) {
		EXPECT_EQ(1, st.chunks) TH_LOG("%lld sequences in %llu launches", (long long)nb,
					       (unsigned long long)st.chunks);
		EXPECT_STREQ("decode-in-place", st.path);
		EXPECT_EQ(0, st.bytes_device_to_device);
	}
	mbatch_free(&b);
	model_free(&m);
}

/* The diagnostics of a mixed batch (decode rows, a prefill chunk, a sequence without keys,
 * explicit positions, decay with skipping): entropy and mean distance of every row against the
 * definitions, at the LSE tolerance of the storage type; only one of them asked for; a plain
 * attend afterwards still reads in place. */
TEST_F(pool, diagnostics_of_a_mixed_batch)
{
	ape_kv_pool_options o = pool_options(2, 4, 32, APE_F16, 16, 4096);
	struct model m;
	ape_rng rng;
	int64_t idx[6], lq[6] = { 1, 5, 1, 2, 1, 1 };
	int ret;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_DIAG))
		SKIP(return, "%s has no diagnostics", variant->backend);
	ape_rng_init(&rng, _metadata->name);
	o.attend_chunk = 128; /* the longest sequence by itself, in key chunks */
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	for (int j = 0; j < 6; j++) {
		ASSERT_LE(0, (idx[j] = model_add(&m, ape_rng_range(&rng, -50, 50), &ret)));
		if (j != 4) /* sequence 4 holds nothing */
			ASSERT_EQ(0, model_append(&m, &rng, idx[j],
						  j == 1 ? 300 : ape_rng_range(&rng, 1, 90)));
	}
	for (int pass = 0; pass < 3; pass++) {
		struct mbatch b;
		double eo, el, ee, em;

		ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 6, idx, lq, pass == 1 ? POS_GAPS
									     : POS_DEFAULT));
		ASSERT_EQ(0, mbatch_want_diag(&m, &b));
		if (pass == 2) { /* the seed's decay, a loose skip_tol the call tightens */
			mbatch_seed_decay(&m, &b, 1e-3);
		}
		ASSERT_EQ(0, mbatch_attend(&m, &b, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, mbatch_check_diag(&m, &b, &eo, &el, &ee, &em));
		EXPECT_LE(eo, test_tol_o(APE_F16)) TH_LOG("pass %d: O error %g", pass, eo);
		EXPECT_LE(el, test_tol_lse(APE_F16)) TH_LOG("pass %d: LSE error %g", pass, el);
		EXPECT_LE(ee, test_tol_lse(APE_F16)) TH_LOG("pass %d: entropy error %g", pass, ee);
		EXPECT_LE(em, test_tol_lse(APE_F16)) TH_LOG("pass %d: distance error %g", pass, em);
		if (pass == 0) { /* an output overlapping another: refused, naming both */
			EXPECT_EQ(APE_EINVAL,
				  ape_kv_pool_attend_diag(m.pool, &b.desc, b.nb, b.ids, b.cu, NULL,
							  &b.q.t, &b.o.t, b.lse, b.lse, NULL, NULL));
			EXPECT_NE(NULL, strstr(ape_last_error(), "entropy overlaps"))
			TH_LOG("%s", ape_last_error());
		}
		free(b.ent); /* the mean distance alone */
		b.ent = NULL;
		ASSERT_EQ(0, mbatch_attend(&m, &b, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, mbatch_check_diag(&m, &b, &eo, &el, NULL, &em));
		EXPECT_LE(em, test_tol_lse(APE_F16)) TH_LOG("pass %d: distance error %g", pass, em);
		mbatch_free(&b);
	}
	model_free(&m);
}

/* A release gives the sequence's oldest pages the proof covers back to the pool; its decodes
 * still match the oracle over every token it ever held; attends that break the release's terms
 * are refused naming them (an earlier position, a weaker decay, a smaller skip_tol, a larger
 * query norm); a fork inherits them; removal returns every page. */
TEST_F(pool, release_unreachable_returns_pages)
{
	ape_kv_pool_options o = pool_options(1, 2, 32, APE_F32, 16, 4096);
	ape_kv_pool_info before, after;
	struct model m;
	struct mbatch b;
	ape_rng rng;
	int64_t a, f, lq = 1, rel = -1, pos;
	double eo, el;
	int ret;

	ape_rng_init(&rng, _metadata->name);
	o.max_query_norm = 12;
	ASSERT_EQ(0, model_init(&m, self->dev, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_LE(0, (a = model_add(&m, -40, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, a, self->emu ? 700 : 2000));
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 1, &a, &lq, POS_DEFAULT));
	mbatch_seed_decay(&m, &b, ldexp(1, -24));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &before));
	ASSERT_EQ(0, ape_kv_pool_release_unreachable(m.pool, m.s[a].id, &b.desc, &rel))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &after));
	EXPECT_GT(rel, 0);
	EXPECT_EQ(0, rel % 16);
	EXPECT_EQ(after.pages_free, before.pages_free + rel / 16);
	EXPECT_EQ(after.tokens, before.tokens - rel);
	TH_LOG("released %lld of %lld tokens", (long long)rel, (long long)m.s[a].n);
	/* decodes go on, right over every token, the positions kept */
	for (int step = 0; step < 3; step++) {
		ASSERT_EQ(0, mbatch_attend(&m, &b, NULL)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, mbatch_check(&m, &b, &eo, &el));
		EXPECT_LE(eo, test_tol_o(APE_F32) + test_skip_tol_o(b.desc.skip_tol))
		TH_LOG("step %d: O error %g", step, eo);
		EXPECT_LE(el, test_tol_lse(APE_F32) + test_skip_tol_lse(b.desc.skip_tol))
		TH_LOG("step %d: LSE error %g", step, el);
		ASSERT_EQ(0, model_append(&m, &rng, a, 1));
		mbatch_free(&b);
		ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 1, &a, &lq, POS_DEFAULT));
		mbatch_seed_decay(&m, &b, ldexp(1, -24));
	}
	/* what breaks the terms is refused */
	pos = m.s[a].k_start + 10;
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, 1, &m.s[a].id, b.cu, &pos,
						 &b.q.t, &b.o.t, b.lse, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "released for queries at positions"))
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "batch entry 0")) TH_LOG("%s", ape_last_error());
	b.prm[0][1] = 0.1f;
	EXPECT_EQ(APE_EINVAL, mbatch_attend(&m, &b, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "assuming delta >=")) TH_LOG("%s", ape_last_error());
	b.prm[0][1] = 0.4f;
	b.desc.skip_tol = 0;
	EXPECT_EQ(APE_EINVAL, mbatch_attend(&m, &b, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "skip_tol")) TH_LOG("%s", ape_last_error());
	b.desc.skip_tol = ldexp(1, -24);
	for (int64_t d = 0; d < 32; d++)
		test_tensor_set(&b.q.t, 0, 1, 0, d, 3.0);
	EXPECT_EQ(APE_EINVAL, mbatch_attend(&m, &b, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "max_query_norm")) TH_LOG("%s", ape_last_error());
	mbatch_free(&b);
	/* a fork inherits the release: its decodes right, its terms the same */
	ASSERT_LE(0, (f = model_fork(&m, a, &ret))) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, model_append(&m, &rng, f, 3));
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 1, &f, &lq, POS_DEFAULT));
	mbatch_seed_decay(&m, &b, ldexp(1, -24));
	ASSERT_EQ(0, mbatch_attend(&m, &b, NULL)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, mbatch_check(&m, &b, &eo, &el));
	EXPECT_LE(eo, test_tol_o(APE_F32) + test_skip_tol_o(b.desc.skip_tol));
	b.prm[0][0] = 0.2f;
	EXPECT_EQ(APE_EINVAL, mbatch_attend(&m, &b, NULL));
	mbatch_free(&b);
	/* removal returns every page */
	ASSERT_EQ(0, model_remove(&m, a));
	ASSERT_EQ(0, model_remove(&m, f));
	ASSERT_EQ(0, ape_kv_pool_get_info(m.pool, &after));
	EXPECT_EQ(after.pages_free, after.pages_total);
	EXPECT_EQ(0, after.tokens);
	model_free(&m);
	/* a pool without max_query_norm releases nothing */
	o.max_query_norm = 0;
	ASSERT_EQ(0, model_init(&m, self->dev, &o));
	ASSERT_LE(0, (a = model_add(&m, 0, &ret)));
	ape_attn_desc_init(&b.desc);
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_release_unreachable(m.pool, m.s[a].id, &b.desc, &rel));
	EXPECT_NE(NULL, strstr(ape_last_error(), "max_query_norm")) TH_LOG("%s", ape_last_error());
	o.max_query_norm = NAN;
	{
		ape_kv_pool *x = NULL;

		EXPECT_EQ(APE_EINVAL, ape_kv_pool_create(self->dev, &o, &x));
		EXPECT_NE(NULL, strstr(ape_last_error(), "max_query_norm"));
	}
	model_free(&m);
}

/* Bad arguments: an error naming them, nothing written, the pool unchanged. */
TEST_F(pool, validation_names_the_argument)
{
	ape_kv_pool_options o = pool_options(2, 4, 16, APE_F32, 16, 64);
	struct model m;
	ape_kv_pool *p = NULL;
	struct mbatch b;
	ape_rng rng;
	int64_t a, c, id, lq[2] = { 1, 2 }, idx[2];
	ape_tensor kt;
	float buf[64] = { 0 };
	int ret;
	static const struct {
		const char *field;
		int64_t value;
	} bad[] = { { "Hkv", 0 }, { "H", 3 }, { "D", 3 }, { "page_tokens", 70000 },
		    { "capacity_tokens", 0 }, { "max_batch_tokens", -1 } };

	ape_rng_init(&rng, _metadata->name);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ape_kv_pool_options x = o;

		if (!strcmp(bad[i].field, "Hkv"))
			x.Hkv = bad[i].value;
		else if (!strcmp(bad[i].field, "H"))
			x.H = bad[i].value;
		else if (!strcmp(bad[i].field, "D"))
			x.D = bad[i].value;
		else if (!strcmp(bad[i].field, "page_tokens"))
			x.page_tokens = bad[i].value;
		else if (!strcmp(bad[i].field, "capacity_tokens"))
			x.capacity_tokens = bad[i].value;
		else
			x.max_batch_tokens = bad[i].value;
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_create(self->dev, &x, &p));
		EXPECT_EQ(NULL, p);
		EXPECT_NE(NULL, strstr(ape_last_error(), bad[i].field)) TH_LOG("%s", ape_last_error());
	}
	o.struct_size--;
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_create(self->dev, &o, &p));
	o.struct_size++;
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_create(NULL, &o, &p));
	ASSERT_EQ(0, model_init(&m, self->dev, &o));
	ASSERT_LE(0, (a = model_add(&m, 0, &ret)));
	ASSERT_LE(0, (c = model_add(&m, 0, &ret)));
	ASSERT_EQ(0, model_append(&m, &rng, a, 5));
	EXPECT_EQ(APE_EOVERFLOW, ape_kv_pool_add_sequence(m.pool, INT64_MAX, &id));
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_remove_sequence(m.pool, 99));
	EXPECT_NE(NULL, strstr(ape_last_error(), "seq_id = 99")) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_fork(m.pool, -1, &id));
	ape_tensor_init_packed(&kt, buf, APE_F16, 1, 2, 16);
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_append(m.pool, m.s[a].id, &kt, &kt));
	ape_tensor_init_packed(&kt, buf, APE_F32, 1, 1, 16);
	EXPECT_EQ(APE_EINVAL, ape_kv_pool_append(m.pool, m.s[a].id, &kt, &kt));
	EXPECT_NE(NULL, strstr(ape_last_error(), "Hkv")) TH_LOG("%s", ape_last_error());
	/* attends */
	idx[0] = a;
	idx[1] = c;
	ASSERT_EQ(0, mbatch_make(&b, &m, &rng, 2, idx, lq, POS_DEFAULT));
	{
		int64_t ids[2] = { b.ids[0], b.ids[0] }, cu[3] = { 0, 2, 1 }, bad_id[2] = { 7, 1 };
		ape_attn_desc d = b.desc;

		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, 2, ids, b.cu, NULL,
							 &b.q.t, &b.o.t, b.lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "named twice")) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, 2, b.ids, cu, NULL, &b.q.t,
							 &b.o.t, b.lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "cu_seqlens_q[2] = 1"))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, 2, bad_id, b.cu, NULL,
							 &b.q.t, &b.o.t, b.lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "seq_ids[0] = 7"))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, -1, b.ids, b.cu, NULL,
							 &b.q.t, &b.o.t, b.lse, NULL));
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, NULL, 2, b.ids, b.cu, NULL, &b.q.t,
							 &b.o.t, b.lse, NULL));
		d.q_start_set = true;
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &d, 2, b.ids, b.cu, NULL, &b.q.t,
							 &b.o.t, b.lse, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "q_start_set")) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_kv_pool_attend(m.pool, &b.desc, 2, b.ids, b.cu, NULL,
							 &b.q.t, &b.q.t, b.lse, NULL));
		/* a position whose distance to a key passes int64 */
		b.posq[0] = INT64_MIN + 2;
		EXPECT_EQ(APE_EOVERFLOW, ape_kv_pool_attend(m.pool, &b.desc, 2, b.ids, b.cu, b.posq,
							    &b.q.t, &b.o.t, b.lse, NULL))
		TH_LOG("%s", ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "batch entry 0")) TH_LOG("%s", ape_last_error());
	}
	/* nothing was written */
	for (int64_t i = 0; i < b.tq * 4 * 16; i++)
		ASSERT_TRUE(isnan(((float *)b.o.t.data)[i]));
	mbatch_free(&b);
	model_free(&m);
}

/* ---- the window proof: bisection over running maxima finds the walk's cut */

struct norms_tab {
	const float *blk, *pre;
	int64_t nbg;
};

static const float *tab_norms(const void *arg, int64_t lb)
{
	const struct norms_tab *t = arg;

	return t->blk + lb * t->nbg;
}

static const float *tab_prefix(const void *arg, int64_t lb)
{
	const struct norms_tab *t = arg;

	return t->pre + lb * t->nbg;
}

TEST(window_cut_by_bisection_equals_the_walk)
{
	ape_rng rng;
	int cut = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 300; c++) {
		const int64_t Hkv = ape_rng_range(&rng, 1, 2), H = Hkv * ape_rng_range(&rng, 1, 2);
		const int64_t D = 16, bt = ape_rng_range(&rng, 1, 20), n = ape_rng_range(&rng, 1, 900);
		const int64_t nb = (n + bt - 1) / bt, lq = ape_rng_range(&rng, 1, 3);
		float *blk = malloc(sizeof(float) * (size_t)(nb * Hkv)), prm[4][8];
		float *pre = malloc(sizeof(float) * (size_t)(nb * Hkv));
		test_tensor q, o;
		ape_tensor none;
		ape_attn_desc d;
		struct ape__problem p;
		struct norms_tab t = { blk, pre, Hkv };
		struct ape__kv_keys kk = { .first = 0, .t_end = n, .k_start = ape_rng_range(&rng, -50, 50),
					   .bt = bt, .nbg = Hkv, .norms = tab_norms, .arg = &t };
		int64_t walk, bis, qs;

		ASSERT_NE(NULL, blk);
		ASSERT_NE(NULL, pre);
		for (int64_t i = 0; i < nb * Hkv; i++) /* norms that mostly grow, sometimes jump */
			blk[i] = (float)(4 + 3 * ape_rng_uniform(&rng) +
					 (ape_rng_range(&rng, 0, 30) ? 0 : 40 * ape_rng_uniform(&rng)));
		for (int64_t lb = 0; lb < nb; lb++)
			for (int64_t g = 0; g < Hkv; g++)
				pre[lb * Hkv + g] = lb ? fmaxf(pre[(lb - 1) * Hkv + g], blk[lb * Hkv + g])
						       : blk[g];
		ASSERT_EQ(0, test_tensor_random(&q, &rng, APE_F32, 1, H, lq, D, 1.0 + 3 * ape_rng_uniform(&rng)));
		ASSERT_EQ(0, test_tensor_random(&o, &rng, APE_F32, 1, H, lq, D, 1.0));
		ape_tensor_init(&none, NULL, APE_F32, 1, Hkv, 0, D);
		ape_attn_desc_init(&d);
		test_random_head_params(&d, prm, H, &rng);
		for (int64_t h = 0; h < H; h++) /* decay on every head, sometimes steep */
			prm[0][h] = (float)(ape_rng_range(&rng, 0, 3) ? 0.05 + ape_rng_uniform(&rng) : 2.0);
		d.causal = true;
		ASSERT_EQ(0, ape__problem_init(&p, "test", &d, &q.t, &none, &none, &o.t, NULL))
		TH_LOG("%s", ape_last_error());
		qs = kk.k_start + n - lq + ape_rng_range(&rng, -2, 0);
		walk = ape__kv_window_cut(&kk, &p, &q.t, 0, lq, qs, ldexp(1, -26));
		kk.prefix = tab_prefix;
		bis = ape__kv_window_cut(&kk, &p, &q.t, 0, lq, qs, ldexp(1, -26));
		EXPECT_EQ(walk, bis) TH_LOG("case %d: %lld keys in blocks of %lld", c, (long long)n,
					    (long long)bt);
		cut += walk > 0;
		ape__problem_fini(&p);
		test_tensor_free(&q);
		test_tensor_free(&o);
		free(blk);
		free(pre);
	}
	EXPECT_GT(cut, 100); /* most cases cut something: the comparison means something */
}

TEST_HARNESS_MAIN
