/* SPDX-License-Identifier: MIT */
/*
 * Ragged batches (ape_attention_forward_varlen*, include/ape/ape.h "Ragged batches"), on every
 * backend: fresh random batches (empty sequences, length 1, decode rows, Lq < Lk and Lq > Lk,
 * GQA, causal or not, every storage type, packed [total, H, D] and [1, H, total, D] layouts) with
 * default positions, contiguous runs starting anywhere, gaps, repeats, shuffled and decreasing positions,
 * each sequence against tests/common/naive.c's independent evaluation at its explicit
 * positions; a one-sequence batch against the dense call bit for bit; thousands of tiny
 * sequences; positions at the int64 ends; validation naming the argument, with the outputs
 * untouched. The backward of ragged batches (host tensors and device tensors) against the
 * reference per sequence and against each other.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "core/backend.h"
#include "core/error.h"
#include "api/resident.h"
#include "api/validate.h"
#include "api/varlen.h"
#include "exec/resident_bwd.h"
#include "common/backend_fixture.h"
#include "common/bwdcase.h"
#include "common/naive.h"
#include "common/positions.h"
#include "common/testutil.h"

BACKEND_FIXTURE(dev)

struct batch {
	int64_t S, H, Hkv, D, tq, tk;
	int64_t *cuq, *cuk, *posq, *posk; /* positions always materialised (the oracle's) */
	bool explicit_pos; /* passed to the library (else its defaults must equal posq, posk) */
	ape_dtype dt, odt;
	bool packed;
	test_tensor q, k, v, o;
	float *lse;
	ape_attn_desc desc;
	float prm[4][8];
};

/* A packed tensor [total, H, D] (or [1, H, total, D]) of random values. */
static int packed_tensor(test_tensor *tt, ape_rng *r, ape_dtype dt, int64_t total, int64_t H,
			 int64_t D, bool packed)
{
	if (test_tensor_random(tt, r, dt, 1, total, H, D, 1.0))
		return -1;
	if (packed)
		ape_tensor_init_packed(&tt->t, tt->alloc, dt, total, H, D);
	else
		ape_tensor_init(&tt->t, tt->alloc, dt, 1, H, total, D); /* other values, same shape */
	return 0;
}

static int batch_make(struct batch *b, ape_rng *r, int64_t S, int64_t maxq, int64_t maxk,
		      enum pos_mode m)
{
	static const ape_dtype dts[3] = { APE_F32, APE_F16, APE_BF16 };
	static const int64_t Ds[3] = { 8, 16, 32 };

	memset(b, 0, sizeof(*b));
	b->S = S;
	b->Hkv = ape_rng_range(r, 1, 2);
	b->H = b->Hkv * ape_rng_range(r, 1, 3);
	b->D = Ds[ape_rng_range(r, 0, 2)];
	b->dt = dts[ape_rng_range(r, 0, 2)];
	b->odt = ape_rng_range(r, 0, 1) ? APE_F32 : b->dt;
	b->packed = ape_rng_range(r, 0, 2) > 0;
	b->cuq = calloc((size_t)S + 1, sizeof(int64_t));
	b->cuk = calloc((size_t)S + 1, sizeof(int64_t));
	if (!b->cuq || !b->cuk)
		return -1;
	for (int64_t s = 0; s < S; s++) {
		const int64_t shape = ape_rng_range(r, 0, 5);
		int64_t lq = ape_rng_range(r, 0, maxq), lk = ape_rng_range(r, 0, maxk);

		if (shape == 0)
			lq = 1; /* a decode row */
		else if (shape == 1)
			lq = 0; /* nothing asked */
		else if (shape == 2)
			lk = 0; /* nothing to see */
		b->cuq[s + 1] = b->cuq[s] + lq;
		b->cuk[s + 1] = b->cuk[s] + lk;
	}
	b->tq = b->cuq[S];
	b->tk = b->cuk[S];
	b->posq = malloc(sizeof(int64_t) * (size_t)(b->tq + 1));
	b->posk = malloc(sizeof(int64_t) * (size_t)(b->tk + 1));
	b->lse = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
	if (!b->posq || !b->posk || !b->lse)
		return -1;
	b->explicit_pos = m != POS_DEFAULT;
	for (int64_t s = 0; s < S; s++) {
		const int64_t lq = b->cuq[s + 1] - b->cuq[s], lk = b->cuk[s + 1] - b->cuk[s];
		const int64_t base = m == POS_DEFAULT ? 0 : ape_rng_range(r, -1000, 1000);

		test_positions(r, m, b->posk + b->cuk[s], lk, base);
		/* queries around the keys' end: some see every key, some few, some none */
		test_positions(r, m, b->posq + b->cuq[s], lq,
			  m == POS_DEFAULT ? lk - lq : base + lk - lq + ape_rng_range(r, -3, 3));
	}
	if (packed_tensor(&b->q, r, b->dt, b->tq, b->H, b->D, b->packed) ||
	    packed_tensor(&b->k, r, b->dt, b->tk, b->Hkv, b->D, b->packed) ||
	    packed_tensor(&b->v, r, b->dt, b->tk, b->Hkv, b->D, b->packed) ||
	    test_tensor_random(&b->o, r, b->odt, 1, b->tq, b->H, b->D, 1.0))
		return -1;
	if (b->packed)
		ape_tensor_init_packed(&b->o.t, b->o.alloc, b->odt, b->tq, b->H, b->D);
	else
		ape_tensor_init(&b->o.t, b->o.alloc, b->odt, 1, b->H, b->tq, b->D);
	test_tensor_poison(&b->o.t);
	test_random_desc(r, &b->desc, b->prm, b->H);
	return 0;
}

static void batch_free(struct batch *b)
{
	free(b->cuq);
	free(b->cuk);
	free(b->posq);
	free(b->posk);
	free(b->lse);
	test_tensor_free(&b->q);
	test_tensor_free(&b->k);
	test_tensor_free(&b->v);
	test_tensor_free(&b->o);
}

static void batch_varlen(const struct batch *b, ape_varlen *vl)
{
	ape_varlen_init(vl);
	vl->num_seqs = b->S;
	vl->cu_seqlens_q = b->cuq;
	vl->cu_seqlens_k = b->cuk;
	vl->pos_q = b->explicit_pos ? b->posq : NULL;
	vl->pos_k = b->explicit_pos ? b->posk : NULL;
}

/* Sequence s of the batch by naive_attention() at its positions: o [H, lq, D] and lse [H, lq]
 * (malloc'ed, the caller frees them; zeros and -inf without keys); -1 out of memory. */
static int seq_naive(const struct batch *b, int64_t s, double **o, double **lse)
{
	double prm[4][8];
	const int64_t q0 = b->cuq[s], lq = b->cuq[s + 1] - q0;
	const int64_t k0 = b->cuk[s], lk = b->cuk[s + 1] - k0;
	naive_params np = {
		.rope_base = b->desc.rope_base, .rope_scale = b->desc.rope_scale, .scale = NAN,
		.causal = b->desc.causal, .pos_q = b->posq + q0, .pos_k = b->posk + k0,
	};

	for (int i = 0; i < 4; i++)
		for (int h = 0; h < b->H; h++)
			prm[i][h] = b->prm[i][h];
	np.delta = prm[0];
	np.beta = prm[1];
	np.gamma = prm[2];
	np.lambda = prm[3];
	*o = calloc((size_t)(b->H * lq * b->D) + 1, sizeof(double));
	*lse = malloc(sizeof(double) * (size_t)(b->H * lq + 1));
	if (!*o || !*lse)
		goto fail;
	if (lk) {
		const ape_tensor qs = test_rows(&b->q.t, q0, lq), ks = test_rows(&b->k.t, k0, lk);
		const ape_tensor vs = test_rows(&b->v.t, k0, lk);

		if (naive_attention(&np, &qs, &ks, &vs, *o, *lse))
			goto fail;
	} else {
		for (int64_t r = 0; r < b->H * lq; r++)
			(*lse)[r] = -INFINITY;
	}
	return 0;
fail:
	free(*o);
	free(*lse);
	return -1;
}

/*
 * Every sequence against naive_attention() at its explicit positions: the largest error of O
 * over max|V|, and of LSE relative to max(1, |LSE|), into *eo and *el; the visible pairs into
 * *pairs. -1 when the oracle ran out of memory.
 */
static int batch_check(const struct batch *b, double *eo, double *el, uint64_t *pairs)
{
	const double vmax = test_tensor_maxabs(&b->v.t);

	*eo = *el = 0;
	*pairs = 0;
	for (int64_t s = 0; s < b->S; s++) {
		const int64_t q0 = b->cuq[s], lq = b->cuq[s + 1] - q0;
		const int64_t k0 = b->cuk[s], lk = b->cuk[s + 1] - k0;
		double *o, *lse;

		if (!lq)
			continue;
		if (seq_naive(b, s, &o, &lse))
			return -1;
		for (int64_t h = 0; h < b->H; h++)
			for (int64_t i = 0; i < lq; i++) {
				test_lse_err(b->lse[(q0 + i) * b->H + h], lse[h * lq + i], el);
				for (int64_t d = 0; d < b->D; d++) {
					const double x = test_tensor_get(&b->o.t, 0, h, q0 + i, d);
					const double w = o[(h * lq + i) * b->D + d];
					const double e = fabs(x - w) / fmax(vmax, 1e-30);

					*eo = fmax(*eo, e != e ? INFINITY : e);
				}
				for (int64_t j = 0; j < lk; j++)
					*pairs += !b->desc.causal ||
						  b->posk[k0 + j] <= b->posq[q0 + i];
			}
		free(o);
		free(lse);
	}
	return 0;
}

/* O and LSE, as the last call wrote them into b, against the oracle within the spec's
 * tolerances for b's storage type and skip_tol (named `what` in the log); the visible pairs in
 * *pairs. False when the oracle could not run (out of memory). */
static bool oracle_checked(struct __test_metadata *_metadata, const struct batch *b,
			   const char *what, uint64_t *pairs)
{
	double eo, el;

	if (batch_check(b, &eo, &el, pairs))
		return false;
	EXPECT_LE(eo, test_tol_o(b->dt) + test_skip_tol_o(b->desc.skip_tol))
	TH_LOG("%s: O error %g of max|V|", what, eo);
	EXPECT_LE(el, test_tol_lse(b->dt) + test_skip_tol_lse(b->desc.skip_tol))
	TH_LOG("%s: LSE error %g", what, el);
	return true;
}

static void describe(const struct batch *b, enum pos_mode m, char *buf, size_t n)
{
	snprintf(buf, n,
		 "S %lld, totals %lld x %lld, H %lld/%lld, D %lld, %s -> %s, %s, %s, positions %s, "
		 "skip_tol %g",
		 (long long)b->S, (long long)b->tq, (long long)b->tk, (long long)b->H,
		 (long long)b->Hkv, (long long)b->D, ape_dtype_name(b->dt), ape_dtype_name(b->odt),
		 b->packed ? "packed [total, H, D]" : "[1, H, total, D]",
		 b->desc.causal ? "causal" : "not causal", pos_mode_names[m], b->desc.skip_tol);
}

/* Batch b (its positions of mode m) through ape_attention_forward_varlen_ex() on dev with
 * opts, the statistics into *st, every sequence against the oracle within the tolerances. */
static void run_checked(struct __test_metadata *_metadata, ape_device *dev,
			const ape_exec_options *opts, struct batch *b, enum pos_mode m,
			ape_stats *st)
{
	ape_varlen vl;
	char what[256];
	uint64_t pairs;

	describe(b, m, what, sizeof(what));
	batch_varlen(b, &vl);
	ape_stats_init(st);
	ASSERT_EQ(0, ape_attention_forward_varlen_ex(&dev, 1, opts, &b->desc, &vl, &b->q.t,
						     &b->k.t, &b->v.t, &b->o.t, b->lse, st))
	TH_LOG("%s: %s", what, ape_last_error());
	ASSERT_TRUE(oracle_checked(_metadata, b, what, &pairs));
	EXPECT_EQ(pairs, st->pairs_visible) TH_LOG("%s", what);
	if (ape_be_dev_has(dev, APE_BE_CAP_HOST_MEMORY | APE_BE_CAP_SEGMENTS)) {
		/* one run over the caller's O and the call's LSE staging, which the launches
		 * write in place (exec/pass.h): the same bits as from launches whose outputs are
		 * copied back, and O and LSE not copied (all of their rows, with one key chunk
		 * and one query chunk: the default chunking of these small batches) */
		const uint64_t back = (uint64_t)(b->tq * b->H) *
				      ((uint64_t)b->D * ape_dtype_size(b->odt) + 4);
		float *lc = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
		ape_exec_options xo;
		test_tensor oc;
		ape_stats sc;

		ASSERT_NE(NULL, lc);
		ASSERT_EQ(0, test_tensor_empty(&oc, b->odt, 1, b->tq, b->H, b->D));
		oc.t = b->o.t;
		oc.t.data = oc.alloc;
		/* inputs copied as a discrete device needs them (outputs back from the device),
		 * then the staging published on success (APE_EXEC_ATOMIC_OUTPUTS, written in place
		 * like the caller's O above): the same bits either way */
		for (int atomic = 0; atomic < 2; atomic++) {
			if (opts)
				xo = *opts;
			else
				ape_exec_options_init(&xo);
			xo.flags |= atomic ? APE_EXEC_ATOMIC_OUTPUTS : APE_EXEC_COPY_INPUTS;
			test_tensor_poison(&oc.t);
			for (int64_t i = 0; i < b->tq * b->H; i++)
				lc[i] = NAN;
			ape_stats_init(&sc);
			ASSERT_EQ(0, ape_attention_forward_varlen_ex(&dev, 1, &xo, &b->desc, &vl,
								     &b->q.t, &b->k.t, &b->v.t,
								     &oc.t, lc, &sc))
			TH_LOG("%s: %s", what, ape_last_error());
			EXPECT_TRUE(same_bits(&b->o, &oc)) TH_LOG("%s: O (atomic %d)", what, atomic);
			EXPECT_EQ(0, memcmp(b->lse, lc, sizeof(float) * (size_t)(b->tq * b->H)))
			TH_LOG("%s: LSE (atomic %d)", what, atomic);
			if (atomic) { /* nothing more copied back than in place */
				EXPECT_EQ(st->bytes_from_device, sc.bytes_from_device)
				TH_LOG("%s", what);
				continue;
			}
			if (!opts && st->pairs_visible)
				EXPECT_EQ(back, sc.bytes_from_device - st->bytes_from_device)
			TH_LOG("%s: %llu bytes back in place, %llu with copies", what,
			       (unsigned long long)st->bytes_from_device,
			       (unsigned long long)sc.bytes_from_device);
			EXPECT_LE(st->bytes_from_device, sc.bytes_from_device) TH_LOG("%s", what);
		}
		test_tensor_free(&oc);
		free(lc);
	}
}

static void run_batches(struct __test_metadata *_metadata, ape_device *dev, int cases, int64_t S,
			int64_t maxq, int64_t maxk, const ape_exec_options *opts)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < cases; c++) {
		const enum pos_mode m = (enum pos_mode)(c % POS_MODES);
		struct batch b;
		ape_stats st;

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 1, S), maxq, maxk, m));
		run_checked(_metadata, dev, opts, &b, m, &st);
		batch_free(&b);
	}
}

/* The query rows of a batch that see at least one key (positions shared by the heads). */
static uint64_t rows_seeing_keys(const struct batch *b)
{
	uint64_t n = 0;

	for (int64_t s = 0; s < b->S; s++)
		for (int64_t i = b->cuq[s]; i < b->cuq[s + 1]; i++)
			for (int64_t j = b->cuk[s]; j < b->cuk[s + 1]; j++)
				if (!b->desc.causal || b->posk[j] <= b->posq[i]) {
					n++;
					break;
				}
	return n;
}

/*
 * A staging or an input larger than the device's largest buffer (its caps' max_alloc, lowered
 * by the test wrapper, whose buf_wrap then refuses more as OpenCL's does) is not wrapped where it
 * lies but goes through chunk buffers: the call still succeeds, equals the oracle, and O comes
 * back by copies.
 */
TEST_F(dev, tensors_past_the_largest_buffer_go_through_chunks)
{
	ape_rng rng;

	if (!ape_be_dev_has(self->dev, APE_BE_CAP_HOST_MEMORY))
		SKIP(return, "%s reads no host memory: nothing is wrapped", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 6; c++) {
		struct batch b;
		ape_varlen vl;
		ape_stats st, sw;
		char what[64];
		uint64_t pairs, ospan, inspan, most;

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 2, 6), 200, 250, POS_DEFAULT));
		batch_varlen(&b, &vl);
		ospan = (uint64_t)(b.tq * b.H * b.D) * ape_dtype_size(b.odt);
		inspan = (uint64_t)(b.tq * b.H * b.D) * ape_dtype_size(b.dt);
		/* below O's staging, every other case below q's span too; room for the chunk
		 * buffers of a few rows either way */
		most = c % 2 ? ospan - 1 : inspan / 2;
		most = most > 8192 ? most : 8192;
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_attention_forward_varlen_ex(&self->dev, 1, NULL, &b.desc, &vl,
							     &b.q.t, &b.k.t, &b.v.t, &b.o.t, b.lse,
							     &st))
		TH_LOG("%s", ape_last_error());
		wrap_install(self->dev, 0);
		wrap_max_alloc(most);
		ape_stats_init(&sw);
		test_tensor_poison(&b.o.t);
		ASSERT_EQ(0, ape_attention_forward_varlen_ex(&self->dev, 1, NULL, &b.desc, &vl,
							     &b.q.t, &b.k.t, &b.v.t, &b.o.t, b.lse,
							     &sw))
		TH_LOG("case %d, largest buffer %llu: %s", c, (unsigned long long)most,
		       ape_last_error());
		wrap_remove();
		snprintf(what, sizeof(what), "case %d, largest buffer %llu", c,
			 (unsigned long long)most);
		ASSERT_TRUE(oracle_checked(_metadata, &b, what, &pairs));
		if (st.pairs_visible && ospan > most) {
			/* O could not be wrapped: every row that sees a key came back through a
			 * copy (a fewer-bytes-than-wrapped check failed for batches whose rows
			 * mostly see nothing, the wrapped call's LSE copies then outweighing them) */
			const uint64_t need = rows_seeing_keys(&b) * (uint64_t)(b.H * b.D) *
					      ape_dtype_size(b.odt);

			EXPECT_GE(sw.bytes_from_device, need)
			TH_LOG("case %d: %llu bytes back past the largest buffer, O's rows that "
			       "see keys %llu (wrapped: %llu)", c,
			       (unsigned long long)sw.bytes_from_device, (unsigned long long)need,
			       (unsigned long long)st.bytes_from_device);
			EXPECT_LT(0, need);
		}
		if (st.pairs_visible && inspan > most)
			EXPECT_LT(st.bytes_to_device, sw.bytes_to_device) TH_LOG("case %d", c);
		batch_free(&b);
	}
}

/* Random batches of every kind, each sequence against the independent evaluation. */
TEST_F(dev, every_sequence_equals_the_oracle_at_its_positions)
{
	run_batches(_metadata, self->dev, self->emu ? 10 : 40, 6, 40, 50, NULL);
}

/* The same in chunks of a few rows and keys: a ragged launch per chunk pair, its segments cut
 * to the chunk's rows and keys (exec/launch.h, ape__segs_clip()), the chunks' partial results
 * merged; sequences straddle chunks both ways. */
TEST_F(dev, ragged_batches_in_small_chunks)
{
	ape_exec_options opts;

	ape_exec_options_init(&opts);
	opts.chunk_q = 23;
	opts.chunk_k = 37;
	run_batches(_metadata, self->dev, self->emu ? 5 : 25, 6, 40, 50, &opts);
}

/* Sequences longer than a chunk: the dense executor streams each piece. */
TEST_F(dev, long_sequences_streamed)
{
	if (self->emu)
		SKIP(return, "the emulated CUDA device: long sequences take minutes there");
	run_batches(_metadata, self->dev, 5, 3, 700, 900, NULL);
}

/* A one-sequence batch with default positions is the dense call, bit for bit (LSE transposed
 * to [total_q, H]). */
TEST_F(dev, one_sequence_is_the_dense_call_bit_for_bit)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 6; c++) {
		struct batch b;
		ape_varlen vl;
		test_tensor o2;
		float *lse2;
		ape_attn_desc d;

		ASSERT_EQ(0, batch_make(&b, &rng, 1, 60, 80, POS_DEFAULT));
		if (!b.tq || !b.tk) {
			batch_free(&b);
			continue;
		}
		batch_varlen(&b, &vl);
		ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &b.desc, &vl, &b.q.t, &b.k.t,
							  &b.v.t, &b.o.t, b.lse, NULL))
		TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_tensor_empty(&o2, b.odt, 1, b.H, b.tq, b.D));
		lse2 = malloc(sizeof(float) * (size_t)(b.H * b.tq));
		ASSERT_NE(NULL, lse2);
		d = b.desc;
		ASSERT_EQ(0, ape_attention_forward(self->dev, &d, &b.q.t, &b.k.t, &b.v.t, &o2.t, lse2,
						   NULL))
		TH_LOG("%s", ape_last_error());
		for (int64_t h = 0; h < b.H; h++)
			for (int64_t i = 0; i < b.tq; i++) {
				ASSERT_EQ(0, memcmp(&lse2[h * b.tq + i], &b.lse[i * b.H + h],
						    sizeof(float)))
				TH_LOG("case %d: LSE of head %lld row %lld", c, (long long)h,
				       (long long)i);
				for (int64_t dd = 0; dd < b.D; dd++)
					ASSERT_EQ(test_tensor_get(&o2.t, 0, h, i, dd),
						  test_tensor_get(&b.o.t, 0, h, i, dd))
					TH_LOG("case %d: O of head %lld row %lld", c, (long long)h,
					       (long long)i);
			}
		free(lse2);
		test_tensor_free(&o2);
		batch_free(&b);
	}
}

/* Thousands of sequences of 1 to 4 tokens in one call: one launch for all of them on a device
 * that takes ragged launches (struct ape_be_ape_be_caps_have(&caps, APE_BE_CAP_SEGMENTS)), one per sequence elsewhere. */
TEST_F(dev, thousands_of_tiny_sequences)
{
	ape_rng rng;
	struct batch b;
	ape_varlen vl;
	ape_stats st;
	uint64_t pairs;
	int64_t with_keys = 0;
	const int64_t S = self->emu ? 200 : 2000;

	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, batch_make(&b, &rng, S, 4, 4, POS_DEFAULT));
	batch_varlen(&b, &vl);
	ape_stats_init(&st);
	ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &b.desc, &vl, &b.q.t, &b.k.t, &b.v.t,
						  &b.o.t, b.lse, &st))
	TH_LOG("%s", ape_last_error());
	ASSERT_TRUE(oracle_checked(_metadata, &b, "thousands of tiny sequences", &pairs));
	EXPECT_EQ(pairs, st.pairs_visible);
	for (int64_t s = 0; s < b.S; s++)
		with_keys += b.cuq[s + 1] > b.cuq[s] && b.cuk[s + 1] > b.cuk[s];
	if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_SEGMENTS)) {
		EXPECT_EQ(1, st.chunks) TH_LOG("%lld sequences: launches", (long long)b.S);
	} else {
		EXPECT_GE(st.chunks, (uint64_t)with_keys) TH_LOG("launches");
	}
	batch_free(&b);
}

/* Sequence s's positions made arbitrary: its keys a random permutation of base, base + 1, ...
 * with a gap after some and some repeated, its queries drawn over the same range (repeats
 * among them, any order): no run structure at all. */
static void arbitrary_positions(struct batch *b, ape_rng *r, int64_t s)
{
	const int64_t k0 = b->cuk[s], lk = b->cuk[s + 1] - k0;
	const int64_t q0 = b->cuq[s], lq = b->cuq[s + 1] - q0;
	const int64_t base = ape_rng_range(r, -1000, 1000);
	int64_t *pk = b->posk + k0, x = base;

	for (int64_t j = 0; j < lk; j++) {
		x += ape_rng_range(r, 0, 3) ? 1 : ape_rng_range(r, 0, 1) ? 0 : ape_rng_range(r, 2, 30);
		pk[j] = x;
	}
	for (int64_t j = lk - 1; j > 0; j--) {
		const int64_t t = ape_rng_range(r, 0, j), y = pk[j];

		pk[j] = pk[t];
		pk[t] = y;
	}
	for (int64_t i = 0; i < lq; i++)
		b->posq[q0 + i] = base + ape_rng_range(r, -3, x - base + 3);
	b->explicit_pos = true;
}

/*
 * Arbitrary positions (permuted, repeated, with gaps: no run of consecutive positions to cut
 * the batch into) take ONE launch on a device that reads explicit positions (struct
 * ape_be_ape_be_caps_have(&caps, APE_BE_CAP_POSITIONS): the reference, OpenCL's ape_attention_pos), decomposed into runs
 * elsewhere; every sequence equals the oracle, in chunks of a few rows and keys too.
 */
TEST_F(dev, arbitrary_positions_in_one_launch)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 4 : 16); c++) {
		struct batch b;
		ape_stats st;
		ape_exec_options opts;
		const bool chunked = c % 4 == 3;

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 2, 8), 40, 60, POS_SHUFFLED));
		for (int64_t s = 0; s < b.S; s++)
			arbitrary_positions(&b, &rng, s);
		ape_exec_options_init(&opts);
		if (chunked) {
			opts.chunk_q = 23;
			opts.chunk_k = 37;
		}
		run_checked(_metadata, self->dev, &opts, &b, POS_SHUFFLED, &st);
		if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS) && !chunked && b.tq > 0 && b.tk > 0) {
			EXPECT_EQ(1, st.chunks) TH_LOG("case %d: launches", c);
		}
		batch_free(&b);
	}
}

/*
 * Skipping with explicit positions: long sequences whose keys come in runs far apart (gaps of
 * hundreds) and out of order, the seed's decay, skip_tol 1e-3: the far-key bound taken per key
 * tile from its position range leaves pairs out (proven by the pair counts), within the spec's
 * tolerance of the oracle.
 */
TEST_F(dev, skipping_with_gapped_positions)
{
	ape_rng rng;
	struct batch b;
	ape_stats st;

	if (self->emu)
		SKIP(return, "the emulated CUDA device: long sequences take minutes there");
	ape_rng_init(&rng, _metadata->name);
	/* a sequence with enough rows and keys for far runs (the lengths are drawn at random;
	 * totals alone are not enough: one sequence's rows may have no keys, another's keys no
	 * rows, and then nothing is visible at all) */
	for (int tries = 0;; tries++) {
		bool long_one = false;

		ASSERT_EQ(0, batch_make(&b, &rng, 3, 300, 700, POS_GAPS));
		for (int64_t s = 0; s < b.S; s++)
			long_one |= b.cuq[s + 1] - b.cuq[s] >= 32 && b.cuk[s + 1] - b.cuk[s] >= 512;
		ASSERT_LT(tries, 200) TH_LOG("no batch with a long sequence in 200 draws");
		if (long_one)
			break;
		batch_free(&b);
	}
	for (int64_t s = 0; s < b.S; s++) {
		const int64_t k0 = b.cuk[s], lk = b.cuk[s + 1] - k0;
		const int64_t q0 = b.cuq[s], lq = b.cuq[s + 1] - q0;
		const int64_t runs = 1 + lk / 64;

		/* run r of 64 keys at r * 1000 ..., the runs in a shuffled order */
		for (int64_t j = 0; j < lk; j++)
			b.posk[k0 + j] = ((j / 64) * 7919 % runs) * 1000 + j % 64;
		for (int64_t i = 0; i < lq; i++)
			b.posq[q0 + i] = ape_rng_range(&rng, 0, runs * 1000);
	}
	b.explicit_pos = true;
	b.desc.skip_tol = 1e-3;
	for (int h = 0; h < b.H; h++) {
		b.prm[0][h] = 0.39685f;
		b.prm[1][h] = b.prm[2][h] = 0.039685f;
		b.prm[3][h] = 0.1f;
	}
	run_checked(_metadata, self->dev, NULL, &b, POS_GAPS, &st);
	/* the reference computes every pair (it skips nothing); a kernel that reads the
	 * positions must prove that it skips here */
	if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS) && strcmp(variant->backend, "ref")) {
		EXPECT_GT(st.pairs_visible, st.pairs_computed)
		TH_LOG("%llu visible pairs, %llu computed: nothing skipped",
		       (unsigned long long)st.pairs_visible, (unsigned long long)st.pairs_computed);
	}
	if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS)) {
		EXPECT_EQ(1, st.chunks) TH_LOG("launches");
	}
	batch_free(&b);
}

/* Positions at the int64 ends: keys just below INT64_MAX and a query at INT64_MAX (causal), a
 * query at INT64_MIN against keys after it (not causal); V constant, so O is V wherever a key
 * is seen. A distance past int64 is refused, naming the sequence. */
TEST_F(dev, positions_at_the_int64_ends)
{
	enum { H = 1, D = 8 };
	float q[2 * D], k[3 * D], v[3 * D], o[2 * D], lse[2];
	int64_t cuq[3] = { 0, 1, 2 }, cuk[3] = { 0, 2, 3 };
	int64_t posq[2] = { INT64_MAX, INT64_MIN + 5 };
	int64_t posk[3] = { INT64_MAX - 3, INT64_MAX - 1, INT64_MIN + 9 };
	ape_tensor tq, tk, tv, to;
	ape_attn_desc d;
	ape_varlen vl;

	for (int i = 0; i < 2 * D; i++)
		q[i] = (float)((i % 5) - 2) / 4;
	for (int i = 0; i < 3 * D; i++) {
		k[i] = (float)((i % 3) - 1) / 2;
		v[i] = 1.5f;
	}
	ape_tensor_init_packed(&tq, q, APE_F32, 2, H, D);
	ape_tensor_init_packed(&tk, k, APE_F32, 3, H, D);
	ape_tensor_init_packed(&tv, v, APE_F32, 3, H, D);
	ape_tensor_init_packed(&to, o, APE_F32, 2, H, D);
	ape_attn_desc_init(&d);
	d.delta.value = 0.4f;
	d.lambda.value = 0.1f;
	ape_varlen_init(&vl);
	vl.num_seqs = 2;
	vl.cu_seqlens_q = cuq;
	vl.cu_seqlens_k = cuk;
	vl.pos_q = posq;
	vl.pos_k = posk;
	for (int causal = 0; causal < 2; causal++) {
		d.causal = causal;
		ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &d, &vl, &tq, &tk, &tv, &to, lse,
							  NULL))
		TH_LOG("%s", ape_last_error());
		/* row 0 merges two runs of keys: 1.5 to the merge's float32 rounding */
		for (int i = 0; i < D; i++) {
			EXPECT_GE(1e-6, fabs(o[i] - 1.5))
			TH_LOG("causal %d: row 0 [%d] = %.9g", causal, i, o[i]);
		}
		for (int i = 0; i < D; i++) { /* the key is after the query: seen only non-causal */
			EXPECT_EQ(causal ? 0.0f : 1.5f, o[D + i]) TH_LOG("causal %d [%d]", causal, i);
		}
		EXPECT_TRUE(causal ? isinf(lse[1]) && lse[1] < 0 : isfinite(lse[1]));
	}
	/* sequence 1: INT64_MIN + 5 - INT64_MAX does not fit */
	posk[2] = INT64_MAX;
	memset(o, 0x7f, sizeof(o));
	EXPECT_EQ(APE_EOVERFLOW,
		  ape_attention_forward_varlen(self->dev, &d, &vl, &tq, &tk, &tv, &to, lse, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "sequence 1")) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < 2 * D; i++)
		ASSERT_EQ(0x7f7f7f7fu, ((uint32_t *)o)[i]) TH_LOG("a refused call wrote O");
}

/* Each refusal names the argument and leaves the outputs untouched. */
TEST_F(dev, validation_names_the_argument_and_writes_nothing)
{
	enum { H = 2, D = 8, TQ = 5, TK = 7 };
	static float q[TQ * H * D], k[TK * H * D], v[TK * H * D], o[TQ * H * D], lse[TQ * H];
	ape_tensor tq, tk, tv, to, bad;
	ape_attn_desc d;
	ape_exec_options opts;
	ape_varlen vl;
	int64_t cuq[3] = { 0, 2, TQ }, cuk[3] = { 0, 3, TK };
	struct {
		const char *what, *needle;
		int expect;
	} cases[] = {
		{ "vl NULL", "vl = NULL", APE_EINVAL },
		{ "struct_size", "vl->struct_size", APE_EINVAL },
		{ "num_seqs < 0", "vl->num_seqs = -1", APE_EINVAL },
		{ "cu_seqlens_q NULL", "vl->cu_seqlens_q = NULL", APE_EINVAL },
		{ "cu_seqlens_q[0] != 0", "vl->cu_seqlens_q[0] = 1", APE_EINVAL },
		{ "decreasing", "vl->cu_seqlens_k[2] = 7 < vl->cu_seqlens_k[1] = 8", APE_EINVAL },
		{ "short of the total", "vl->cu_seqlens_q[2] = 4", APE_EINVAL },
		{ "past the total", "vl->cu_seqlens_k[2] = 8", APE_EINVAL },
		{ "q_start_set", "desc->q_start", APE_EINVAL },
		{ "k_start", "desc->k_start = 3", APE_EINVAL },
		{ "two batches", "q->shape[0] = 2", APE_EINVAL },
		{ "trace", "opts->trace_path", APE_EINVAL },
		{ "H of o", "o", APE_EINVAL },
	};

	for (int i = 0; i < TQ * H * D; i++)
		q[i] = (float)i / 100;
	ape_tensor_init_packed(&tq, q, APE_F32, TQ, H, D);
	ape_tensor_init_packed(&tk, k, APE_F32, TK, H, D);
	ape_tensor_init_packed(&tv, v, APE_F32, TK, H, D);
	ape_tensor_init_packed(&to, o, APE_F32, TQ, H, D);
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const ape_tensor *pq = &tq, *po = &to;
		const ape_exec_options *popts = NULL;
		int ret;

		ape_attn_desc_init(&d);
		ape_varlen_init(&vl);
		vl.num_seqs = 2;
		vl.cu_seqlens_q = cuq;
		vl.cu_seqlens_k = cuk;
		cuq[0] = 0;
		cuq[2] = TQ;
		cuk[0] = 0;
		cuk[1] = 3;
		cuk[2] = TK;
		switch (c) {
		case 1:
			vl.struct_size--;
			break;
		case 2:
			vl.num_seqs = -1;
			break;
		case 3:
			vl.cu_seqlens_q = NULL;
			break;
		case 4:
			cuq[0] = 1;
			break;
		case 5:
			cuk[1] = 8;
			break;
		case 6:
			cuq[2] = 4;
			break;
		case 7:
			cuk[2] = 8;
			break;
		case 8:
			d.q_start_set = true;
			break;
		case 9:
			d.k_start = 3;
			break;
		case 10:
			bad = tq;
			bad.shape[0] = 2;
			pq = &bad;
			break;
		case 11:
			ape_exec_options_init(&opts);
			opts.trace_path = "/tmp/x.json";
			popts = &opts;
			break;
		case 12:
			bad = to;
			bad.shape[1] = 1;
			po = &bad;
			break;
		}
		memset(o, 0x55, sizeof(o));
		memset(lse, 0x55, sizeof(lse));
		ret = ape_attention_forward_varlen_ex(&self->dev, 1, popts, &d, c == 0 ? NULL : &vl,
						      pq, &tk, &tv, (ape_tensor *)po, lse, NULL);
		EXPECT_EQ(cases[c].expect, ret) TH_LOG("%s", cases[c].what);
		EXPECT_NE(NULL, strstr(ape_last_error(), cases[c].needle))
		TH_LOG("%s: %s", cases[c].what, ape_last_error());
		EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_forward_varlen_ex"))
		TH_LOG("%s: %s", cases[c].what, ape_last_error());
		for (size_t i = 0; i < sizeof(o) / sizeof(o[0]); i++)
			ASSERT_EQ(0x55555555u, ((uint32_t *)o)[i]) TH_LOG("%s wrote O", cases[c].what);
		for (size_t i = 0; i < sizeof(lse) / sizeof(lse[0]); i++)
			ASSERT_EQ(0x55555555u, ((uint32_t *)lse)[i])
			TH_LOG("%s wrote LSE", cases[c].what);
	}
}

/* ---------------------------------------------------------------- the backward */

/* The loss sum dO . O + sum dLSE . LSE of the batch, every sequence by naive_attention() at its
 * positions (rows with no visible key left out: their LSE is -inf and depends on nothing). */
static long double batch_loss(const struct batch *b, const float *dout, const float *dlse)
{
	long double sum = 0;

	for (int64_t s = 0; s < b->S; s++) {
		const int64_t q0 = b->cuq[s], lq = b->cuq[s + 1] - q0;
		double *o, *lse;

		if (!lq || b->cuk[s] == b->cuk[s + 1])
			continue;
		if (seq_naive(b, s, &o, &lse))
			abort();
		for (int64_t h = 0; h < b->H; h++)
			for (int64_t i = 0; i < lq; i++) {
				if (isinf(lse[h * lq + i]))
					continue;
				sum += (long double)dlse[(q0 + i) * b->H + h] * lse[h * lq + i];
				for (int64_t d = 0; d < b->D; d++)
					sum += (long double)dout[((q0 + i) * b->H + h) * b->D + d] *
					       o[(h * lq + i) * b->D + d];
			}
		free(o);
		free(lse);
	}
	return sum;
}

/* batch_loss() as test_fd_param() calls it. */
struct loss_at {
	const struct batch *b;
	const float *dout, *dlse;
};

static long double batch_loss_at(const void *ctx)
{
	const struct loss_at *at = ctx;

	return batch_loss(at->b, at->dout, at->dlse);
}

/*
 * Every gradient of a ragged batch against central differences of the independent forward
 * along a random direction: for q, k and v the direction is +-1 step on every element (exact in
 * float32), for each parameter of each head test_fd_param(); <G, u> must match within 1e-3 of its
 * scale. Default, gapped, repeated and shuffled positions, causal and not, GQA, with dLSE.
 */
TEST_F(dev, backward_against_finite_differences)
{
	ape_rng rng;
	int ran = 0;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 3 : 10); c++) {
		const enum pos_mode m = (enum pos_mode)(c % POS_MODES);
		struct batch b;
		ape_varlen vl;
		test_tensor dq, dk, dv, dout;
		float dparams[32], *dlse, *u[3];
		char what[256];
		int ret;

		do { /* float32 throughout: the differences need exact steps */
			ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 1, 4), 6, 8, m));
			if (b.dt == APE_F32 && b.odt == APE_F32 && b.tq && b.tk)
				break;
			batch_free(&b);
		} while (1);
		b.desc.skip_tol = 0;
		test_quantize_inputs(&b.q.t, &b.k.t, &b.v.t, b.prm, b.H);
		describe(&b, m, what, sizeof(what));
		batch_varlen(&b, &vl);
		ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &b.desc, &vl, &b.q.t, &b.k.t,
							  &b.v.t, &b.o.t, b.lse, NULL))
		TH_LOG("%s: %s", what, ape_last_error());
		ASSERT_EQ(0, test_tensor_random(&dout, &rng, APE_F32, 1, b.tq, b.H, b.D, 1.0));
		ape_tensor_init_packed(&dout.t, dout.alloc, APE_F32, b.tq, b.H, b.D);
		ASSERT_EQ(0, test_tensor_empty(&dq, APE_F32, 1, b.H, b.tq, b.D));
		ASSERT_EQ(0, test_tensor_empty(&dk, APE_F32, 1, b.Hkv, b.tk, b.D));
		ASSERT_EQ(0, test_tensor_empty(&dv, APE_F32, 1, b.Hkv, b.tk, b.D));
		dlse = malloc(sizeof(float) * (size_t)(b.tq * b.H));
		ASSERT_NE(NULL, dlse);
		for (int64_t i = 0; i < b.tq * b.H; i++)
			dlse[i] = (float)ape_rng_normal(&rng);
		ret = ape_attention_backward_varlen(&self->dev, 1, NULL, &b.desc, &vl, &b.q.t, &b.k.t,
						    &b.v.t, &b.o.t, b.lse, &dout.t, dlse, &dq.t,
						    &dk.t, &dv.t, dparams, NULL);
		if (ret == APE_ENOTSUP) {
			ksft_print_msg("%s\n", ape_last_error());
			test_tensor_free(&dq);
			test_tensor_free(&dk);
			test_tensor_free(&dv);
			test_tensor_free(&dout);
			free(dlse);
			batch_free(&b);
			break;
		}
		ASSERT_EQ(0, ret) TH_LOG("%s: %s", what, ape_last_error());
		ran++;
		{
			const ape_tensor *in[3] = { &b.q.t, &b.k.t, &b.v.t };
			const ape_tensor *g[3] = { &dq.t, &dk.t, &dv.t };
			const char *names[3] = { "dq", "dk", "dv" };

			for (int t = 0; t < 3; t++) {
				const int64_t Ht = in[t]->shape[1], L = in[t]->shape[2];
				long double dot = 0, scale = 0, lp = 0, lm = 0;
				int64_t n = 0;

				u[t] = malloc(sizeof(float) * (size_t)(Ht * L * b.D));
				ASSERT_NE(NULL, u[t]);
				for (int64_t h = 0; h < Ht; h++)
					for (int64_t l = 0; l < L; l++)
						for (int64_t d = 0; d < b.D; d++, n++) {
							const double gv = test_tensor_get(g[t], 0, h, l, d);

							u[t][n] = ape_rng_range(&rng, 0, 1) ? 1.0f : -1.0f;
							dot += gv * u[t][n];
							scale += fabsl((long double)gv);
						}
				for (int sign = 1; sign >= -1; sign -= 2) {
					n = 0;
					for (int64_t h = 0; h < Ht; h++)
						for (int64_t l = 0; l < L; l++)
							for (int64_t d = 0; d < b.D; d++, n++)
								test_tensor_set(
									(ape_tensor *)in[t], 0, h, l, d,
									test_tensor_get(in[t], 0, h, l, d) +
										sign * 0x1p-10 * u[t][n]);
					if (sign > 0)
						lp = batch_loss(&b, dout.alloc, dlse);
					else
						lm = batch_loss(&b, dout.alloc, dlse);
					n = 0;
					for (int64_t h = 0; h < Ht; h++) /* back to the point */
						for (int64_t l = 0; l < L; l++)
							for (int64_t d = 0; d < b.D; d++, n++)
								test_tensor_set(
									(ape_tensor *)in[t], 0, h, l, d,
									test_tensor_get(in[t], 0, h, l, d) -
										sign * 0x1p-10 * u[t][n]);
				}
				EXPECT_LE(fabsl((lp - lm) / (2 * 0x1p-10L) - dot),
					  1e-3L * fmaxl(scale, 1e-3L))
				TH_LOG("%s: %s: finite difference %Lg, gradient %Lg", what, names[t],
				       (lp - lm) / (2 * 0x1p-10L), dot);
				free(u[t]);
			}
			for (int i = 0; i < 4; i++)
				for (int h = 0; h < b.H; h++) {
					const struct loss_at at = { &b, dout.alloc, dlse };
					const long double fd =
						test_fd_param(&b.prm[i][h], batch_loss_at, &at);

					EXPECT_LE(fabsl(fd - dparams[4 * h + i]),
						  1e-3L * fmaxl(fabsl(fd), 1e-2L))
					TH_LOG("%s: dparams[%d] of head %d: finite difference %Lg, "
					       "gradient %g",
					       what, i, h, fd, dparams[4 * h + i]);
				}
		}
		test_tensor_free(&dq);
		test_tensor_free(&dk);
		test_tensor_free(&dv);
		test_tensor_free(&dout);
		free(dlse);
		batch_free(&b);
	}
	if (!ran)
		SKIP(return, "this device has no backward pass (the message above says why)");
}

/* A one-sequence batch of default positions: the dense backward's gradients (float32). */
TEST_F(dev, backward_of_one_sequence_is_the_dense_backward)
{
	ape_rng rng;
	struct batch b;
	ape_varlen vl;
	test_tensor g[6], dout;
	float dp[2][32];
	int ret;

	ape_rng_init(&rng, _metadata->name);
	do {
		ASSERT_EQ(0, batch_make(&b, &rng, 1, 40, 50, POS_DEFAULT));
		if (b.dt == APE_F32 && b.odt == APE_F32 && b.tq && b.tk)
			break;
		batch_free(&b);
	} while (1);
	batch_varlen(&b, &vl);
	ASSERT_EQ(0, ape_attention_forward_varlen(self->dev, &b.desc, &vl, &b.q.t, &b.k.t, &b.v.t,
						  &b.o.t, b.lse, NULL));
	ASSERT_EQ(0, test_tensor_random(&dout, &rng, APE_F32, 1, b.H, b.tq, b.D, 1.0));
	if (b.packed)
		ape_tensor_init_packed(&dout.t, dout.alloc, APE_F32, b.tq, b.H, b.D);
	for (int i = 0; i < 6; i++)
		ASSERT_EQ(0, test_tensor_empty(&g[i], APE_F32, 1, i % 3 ? b.Hkv : b.H,
					       i % 3 ? b.tk : b.tq, b.D));
	ret = ape_attention_backward_varlen(&self->dev, 1, NULL, &b.desc, &vl, &b.q.t, &b.k.t,
					    &b.v.t, &b.o.t, b.lse, &dout.t, NULL, &g[0].t, &g[1].t,
					    &g[2].t, dp[0], NULL);
	if (ret != APE_ENOTSUP) {
		float *lse_d = malloc(sizeof(float) * (size_t)(b.H * b.tq));

		ASSERT_EQ(0, ret) TH_LOG("%s", ape_last_error());
		ASSERT_NE(NULL, lse_d);
		for (int64_t h = 0; h < b.H; h++)
			for (int64_t i = 0; i < b.tq; i++)
				lse_d[h * b.tq + i] = b.lse[i * b.H + h];
		ASSERT_EQ(0, ape_attention_backward(self->dev, &b.desc, &b.q.t, &b.k.t, &b.v.t,
						    &b.o.t, lse_d, &dout.t, NULL, &g[3].t,
						    &g[4].t, &g[5].t, dp[1], NULL))
		TH_LOG("%s", ape_last_error());
		for (int t = 0; t < 3; t++) {
			EXPECT_EQ(0.0, test_max_err_o(&g[t].t, &g[t + 3].t)) TH_LOG("gradient %d", t);
		}
		for (int i = 0; i < 4 * b.H; i++) {
			EXPECT_EQ(dp[1][i], dp[0][i]) TH_LOG("dparams[%d]", i);
		}
		free(lse_d);
	}
	for (int i = 0; i < 6; i++)
		test_tensor_free(&g[i]);
	test_tensor_free(&dout);
	batch_free(&b);
	if (ret == APE_ENOTSUP)
		SKIP(return, "%s", ape_last_error());
}

/*
 * The gradients of batch b (forward already run on dev: b->o, b->lse) through
 * ape_attention_backward_varlen_ex() on dev, against the reference backend's backward of each
 * sequence on its own (a one-sequence batch over its rows), at the spec's tolerances for the
 * storage type; *st gets dev's statistics. Returns false (after logging) where dev has no
 * backward pass.
 */
static bool backward_checked(struct __test_metadata *_metadata, ape_device *dev, ape_device *ref,
			     struct batch *b, enum pos_mode m, ape_rng *rng, ape_stats *st)
{
	test_tensor g[6], dout;
	float dp[2][32], *dlse = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
	ape_varlen vl;
	char what[256];
	int ret;

	describe(b, m, what, sizeof(what));
	batch_varlen(b, &vl);
	ASSERT_NE(NULL, dlse);
	ASSERT_EQ(0, ape_attention_forward_varlen(dev, &b->desc, &vl, &b->q.t, &b->k.t, &b->v.t,
						  &b->o.t, b->lse, NULL))
	TH_LOG("%s: %s", what, ape_last_error());
	ASSERT_EQ(0, test_tensor_random(&dout, rng, b->dt, 1, b->tq, b->H, b->D, 1.0));
	ape_tensor_init_packed(&dout.t, dout.alloc, b->dt, b->tq, b->H, b->D);
	for (int64_t i = 0; i < b->tq * b->H; i++)
		dlse[i] = (float)ape_rng_normal(rng) * 0.25f;
	for (int i = 0; i < 6; i++) {
		const int64_t heads = i % 3 ? b->Hkv : b->H, rows = i % 3 ? b->tk : b->tq;

		ASSERT_EQ(0, test_tensor_empty(&g[i], i < 3 ? b->dt : APE_F32, 1, rows, heads, b->D));
		ape_tensor_init_packed(&g[i].t, g[i].alloc, i < 3 ? b->dt : APE_F32, rows, heads, b->D);
	}
	memset(dp, 0, sizeof(dp));
	ape_stats_init(st);
	ret = ape_attention_backward_varlen(&dev, 1, NULL, &b->desc, &vl, &b->q.t, &b->k.t,
					       &b->v.t, &b->o.t, b->lse, &dout.t, dlse, &g[0].t,
					       &g[1].t, &g[2].t, dp[0], st);
	if (ret == APE_ENOTSUP) {
		ksft_print_msg("%s\n", ape_last_error());
	} else {
		ASSERT_EQ(0, ret) TH_LOG("%s: %s", what, ape_last_error());
		if (ape_be_dev_has(dev, APE_BE_CAP_BWD_VIEWS | APE_BE_CAP_HOST_MEMORY)) {
			/* it read the token-major tensors where they lie: the same bits as from
			 * copies packed for it, and less copied; by at least their bytes where
			 * every row is in a launch (one run per sequence, nothing skipped) */
			const uint64_t esz = ape_dtype_size(b->dt), osz = ape_dtype_size(b->odt);
			const uint64_t in = (uint64_t)b->D * ((uint64_t)(2 * b->tq * b->H) * esz +
							      (uint64_t)(b->tq * b->H) * osz +
							      (uint64_t)(2 * b->tk * b->Hkv) * esz);
			const bool whole = b->desc.skip_tol == 0 &&
					   (m == POS_DEFAULT || m == POS_SHIFTED);
			test_tensor gc[3];
			ape_exec_options eo;
			ape_stats sc;

			for (int i = 0; i < 3; i++) {
				ASSERT_EQ(0, test_tensor_empty(&gc[i], b->dt, 1, g[i].t.shape[1],
							       g[i].t.shape[2], b->D));
				gc[i].t = g[i].t;
				gc[i].t.data = gc[i].alloc;
			}
			ape_exec_options_init(&eo);
			eo.flags = APE_EXEC_COPY_INPUTS;
			ape_stats_init(&sc);
			ASSERT_EQ(0, ape_attention_backward_varlen(
					     &dev, 1, &eo, &b->desc, &vl, &b->q.t, &b->k.t, &b->v.t,
					     &b->o.t, b->lse, &dout.t, dlse, &gc[0].t, &gc[1].t,
					     &gc[2].t, dp[1], &sc))
			TH_LOG("%s: %s", what, ape_last_error());
			for (int x = 0; x < 3; x++) {
				EXPECT_TRUE(same_bits(&g[x], &gc[x])) TH_LOG("%s: gradient %d", what, x);
				test_tensor_free(&gc[x]);
			}
			EXPECT_EQ(0, memcmp(dp[0], dp[1], sizeof(float) * (size_t)(4 * b->H)))
			TH_LOG("%s: dparams", what);
			if (st->pairs_visible) { /* (no launch: nothing copied either way) */
				EXPECT_LE(st->bytes_to_device + (whole ? in : 1), sc.bytes_to_device)
				TH_LOG("%s: %llu bytes copied in place, %llu with copies", what,
				       (unsigned long long)st->bytes_to_device,
				       (unsigned long long)sc.bytes_to_device);
			}
			memset(dp[1], 0, sizeof(dp[1]));
		}
		/* the oracle: the reference's backward of each sequence alone (zeros without
		 * keys or rows), gathered into g[3..5] */
		for (int i = 3; i < 6; i++)
			memset(g[i].alloc, 0, g[i].alloc_bytes);
		for (int64_t s = 0; s < b->S; s++) {
			const int64_t q0 = b->cuq[s], lq = b->cuq[s + 1] - q0;
			const int64_t k0 = b->cuk[s], lk = b->cuk[s + 1] - k0;
			const int64_t cq[2] = { 0, lq }, ck[2] = { 0, lk };
			ape_tensor q = test_rows(&b->q.t, q0, lq), k = test_rows(&b->k.t, k0, lk);
			ape_tensor v = test_rows(&b->v.t, k0, lk), o = test_rows(&b->o.t, q0, lq);
			ape_tensor dov = test_rows(&dout.t, q0, lq), dq = test_rows(&g[3].t, q0, lq);
			ape_tensor dk = test_rows(&g[4].t, k0, lk), dv = test_rows(&g[5].t, k0, lk);
			float one[32];
			ape_varlen sv;

			if (!lq || !lk)
				continue;
			ape_varlen_init(&sv);
			sv.num_seqs = 1;
			sv.cu_seqlens_q = cq;
			sv.cu_seqlens_k = ck;
			sv.pos_q = b->posq + q0;
			sv.pos_k = b->posk + k0;
			ASSERT_EQ(0, ape_attention_backward_varlen(
					     &ref, 1, NULL, &b->desc, &sv, &q, &k, &v, &o,
					     b->lse + q0 * b->H, &dov, dlse + q0 * b->H, &dq, &dk,
					     &dv, one, NULL))
			TH_LOG("%s: sequence %lld on the reference: %s", what, (long long)s,
			       ape_last_error());
			for (int i = 0; i < 4 * b->H; i++)
				dp[1][i] += one[i];
		}
		for (int t = 0; t < 3; t++) {
			EXPECT_LE(grads_rel_err(&g[t].t, &g[t + 3].t), grads_tol(b->dt))
			TH_LOG("%s: gradient %d", what, t);
		}
		EXPECT_LE(grads_rel_err_params(dp[0], dp[1], b->H), grads_tol(b->dt))
		TH_LOG("%s: dparams", what);
	}
	for (int i = 0; i < 6; i++)
		test_tensor_free(&g[i]);
	test_tensor_free(&dout);
	free(dlse);
	return ret != APE_ENOTSUP;
}

/*
 * Ragged batches' gradients against the reference per sequence: every storage type and
 * position mode, GQA, causal or not, empty sequences, decode rows; where the device takes
 * ragged backward launches (APE_BE_CAP_BWD_SEGMENTS) and the positions are runs, a small batch
 * is one launch however many sequences it has (the statistics' chunks), and thousands of tiny
 * sequences take one launch per query chunk.
 */
TEST_F(dev, backward_of_a_ragged_batch_against_the_reference)
{
	const bool segs = ape_be_dev_has(self->dev, APE_BE_CAP_SEGMENTS | APE_BE_CAP_BWD_SEGMENTS);
	ape_rng rng;
	bool ran = false;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 4 : 12); c++) {
		const enum pos_mode m = (enum pos_mode)(c % POS_MODES);
		struct batch b;
		ape_stats st;
		char what[256];

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 1, 9), 24, 30, m));
		b.desc.skip_tol = c % 4 == 3 ? 1e-3 : 0; /* skipping within its bound, sometimes */
		describe(&b, m, what, sizeof(what));
		ran = backward_checked(_metadata, self->dev, self->ref, &b, m, &rng, &st);
		if (ran && segs && (m == POS_DEFAULT || m == POS_SHIFTED)) {
			/* none where no row sees a key (causal rows before every key) */
			EXPECT_EQ(st.pairs_visible ? 1u : 0u, st.chunks)
			TH_LOG("%s: one ragged launch", what);
		}
		batch_free(&b);
		if (!ran)
			break;
	}
	if (ran && !self->emu) { /* thousands of tiny sequences, one launch */
		struct batch b;
		ape_stats st;

		memset(&b, 0, sizeof(b));
		do {
			batch_free(&b);
			ASSERT_EQ(0, batch_make(&b, &rng, 2000, 6, 6, POS_DEFAULT));
		} while (!b.tq || !b.tk);
		ran = backward_checked(_metadata, self->dev, self->ref, &b, POS_DEFAULT, &rng, &st);
		if (segs) { /* a launch per query chunk, not per sequence */
			EXPECT_EQ((uint64_t)((b.tq + st.chunk_q - 1) / st.chunk_q), st.chunks)
			TH_LOG("2000 sequences, %lld rows, chunks of %lld", (long long)b.tq,
			       (long long)st.chunk_q);
		}
		batch_free(&b);
	}
	if (!ran)
		SKIP(return, "this device has no backward pass (the message above says why)");
}

/* ------------------------------------------------------------------ on device tensors */

/* Bytes of the tensors' allocations, rounded for the next one's alignment. */
static size_t round16(size_t n)
{
	return (n + 15) & ~(size_t)15;
}

/* A host tensor of b as a device tensor at `off` bytes of buf (its strides kept). */
static void as_dtensor(ape_dtensor *d, ape_buffer *buf, size_t off, const test_tensor *t)
{
	memset(d, 0, sizeof(*d));
	d->buf = buf;
	d->byte_offset = off + (size_t)((char *)t->t.data - (char *)t->alloc);
	d->dtype = t->t.dtype;
	memcpy(d->shape, t->t.shape, sizeof(d->shape));
	memcpy(d->strides, t->t.strides, sizeof(d->strides));
}

/*
 * b through ape_attention_enqueue_varlen() on dev: q, k and v in one device buffer, `pad` bytes
 * in; O in a buffer of its own laid out like b->o (whose poisoned bytes it starts from), LSE
 * token-major [total_q, H] in another, NaN-poisoned. On success O is read back into b->o and
 * LSE into b->lse; either way *o_moved says whether the device's O differs from its poison.
 * vl NULL: the dense ape_attention_enqueue() of the same [1, H, total, D] tensors instead.
 * Returns the call's code (or the first failing setup step's).
 */
static int run_resident_batch(struct batch *b, ape_device *dev, const ape_varlen *vl,
			      size_t pad, bool *o_moved)
{
	const size_t nq = b->q.alloc_bytes, nk = b->k.alloc_bytes, nv = b->v.alloc_bytes;
	const size_t no = b->o.alloc_bytes, nl = (size_t)(b->tq * b->H + 1) * 4;
	const size_t kin = pad + round16(nq), vin = kin + round16(nk), nin = vin + nv + 16;
	unsigned char *in = malloc(nin), *poison = malloc(no + 1), *back = malloc(no + 1);
	float *lpoison = malloc(nl);
	ape_buffer *bi = NULL, *bo = NULL, *bl = NULL;
	ape_queue *qu = NULL;
	ape_dtensor q, k, v, o, l;
	int ret = -1;

	*o_moved = false;
	if (!in || !poison || !back || !lpoison)
		goto out;
	memset(in, 0, nin);
	memcpy(in + pad, b->q.alloc, nq);
	memcpy(in + kin, b->k.alloc, nk);
	memcpy(in + vin, b->v.alloc, nv);
	memcpy(poison, b->o.alloc, no);
	for (size_t i = 0; i < nl / 4; i++)
		lpoison[i] = NAN;
	if ((ret = ape_queue_create(dev, &qu)) || (ret = ape_buffer_alloc(dev, nin, &bi)) ||
	    (ret = ape_buffer_alloc(dev, no + 16, &bo)) || (ret = ape_buffer_alloc(dev, nl, &bl)) ||
	    (ret = ape_buffer_write(qu, bi, 0, in, nin)) ||
	    (no && (ret = ape_buffer_write(qu, bo, 0, poison, no))) ||
	    (ret = ape_buffer_write(qu, bl, 0, lpoison, nl)))
		goto out;
	as_dtensor(&q, bi, pad, &b->q);
	as_dtensor(&k, bi, kin, &b->k);
	as_dtensor(&v, bi, vin, &b->v);
	as_dtensor(&o, bo, 0, &b->o);
	ape_dtensor_init(&l, bl, 0, APE_F32, 1, b->H, b->tq, 1);
	l.strides[1] = 1; /* [total_q, H], token-major */
	l.strides[2] = b->H;
	l.strides[3] = 1;
	ret = vl ? ape_attention_enqueue_varlen(qu, &b->desc, vl, &q, &k, &v, &o, &l)
		 : ape_attention_enqueue(qu, &b->desc, &q, &k, &v, &o, &l);
	{
		char msg[512];
		int sret;

		snprintf(msg, sizeof(msg), "%s", ape_last_error());
		sret = no ? ape_buffer_read(qu, back, bo, 0, no) : 0;
		if (!sret)
			sret = ape_queue_synchronize(qu);
		if (!sret) {
			*o_moved = memcmp(back, poison, no) != 0;
			if (!ret) {
				memcpy(b->o.alloc, back, no);
				sret = b->tq ? ape_buffer_read(qu, b->lse, bl, 0,
							       (size_t)(b->tq * b->H) * 4)
					     : 0;
				if (!sret)
					sret = ape_queue_synchronize(qu);
			}
		}
		ret = ret ? ret : sret;
		if (ret)
			ape__error(ret, "%s", msg); /* the call's message, not the read-back's */
	}
out:
	ape_queue_destroy(qu);
	ape_buffer_free(bi);
	ape_buffer_free(bo);
	ape_buffer_free(bl);
	free(in);
	free(poison);
	free(back);
	free(lpoison);
	return ret;
}

/* Random batches (default and shifted positions, every storage type, both layouts) on device
 * tensors against the oracle; one launch for the batch where the device takes ragged launches,
 * a launch per sequence with keys elsewhere. */
TEST_F(dev, device_tensors_equal_the_oracle)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 6 : 30); c++) {
		const enum pos_mode m = c % 2 ? POS_SHIFTED : POS_DEFAULT;
		struct batch b;
		ape_varlen vl;
		char what[256];
		uint64_t pairs;
		int64_t with_keys = 0;
		bool moved;
		struct wrap_counts wc;

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 1, 8), 40, 50, m));
		describe(&b, m, what, sizeof(what));
		batch_varlen(&b, &vl);
		wrap_install(self->dev, 0);
		wrap_reset();
		ASSERT_EQ(0, run_resident_batch(&b, self->dev, &vl, 16 * (size_t)(c % 3), &moved))
		TH_LOG("%s: %s", what, ape_last_error());
		wc = wrap_get();
		wrap_remove();
		ASSERT_TRUE(oracle_checked(_metadata, &b, what, &pairs));
		for (int64_t s = 0; s < b.S; s++)
			with_keys += b.cuq[s + 1] > b.cuq[s] && b.cuk[s + 1] > b.cuk[s];
		if (ape_be_caps_have(&self->dev->caps, APE_BE_CAP_SEGMENTS) && b.tk > 0 && b.tq > 0) {
			EXPECT_EQ(1, wc.attention_calls) TH_LOG("%s: launches", what);
		} else {
			EXPECT_GE(wc.attention_calls, (uint64_t)with_keys) TH_LOG("%s", what);
		}
		batch_free(&b);
	}
}

/* A one-sequence batch of default positions is ape_attention_enqueue() itself, bit for bit. */
TEST_F(dev, device_tensors_one_sequence_is_enqueue_bit_for_bit)
{
	ape_rng rng;

	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 4; c++) {
		struct batch b;
		ape_varlen vl;
		bool moved;
		void *o1;
		float *l1;

		do {
			ASSERT_EQ(0, batch_make(&b, &rng, 1, 60, 70, POS_DEFAULT));
		} while (b.tq == 0 && (batch_free(&b), 1));
		batch_varlen(&b, &vl);
		o1 = malloc(b.o.alloc_bytes);
		l1 = malloc((size_t)(b.tq * b.H) * 4);
		ASSERT_TRUE(o1 && l1);
		ASSERT_EQ(0, run_resident_batch(&b, self->dev, &vl, 0, &moved))
		TH_LOG("%s", ape_last_error());
		memcpy(o1, b.o.alloc, b.o.alloc_bytes);
		memcpy(l1, b.lse, (size_t)(b.tq * b.H) * 4);
		test_tensor_poison(&b.o.t);
		ASSERT_EQ(0, run_resident_batch(&b, self->dev, NULL, 0, &moved))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, memcmp(o1, b.o.alloc, b.o.alloc_bytes)) TH_LOG("O differs");
		EXPECT_EQ(0, memcmp(l1, b.lse, (size_t)(b.tq * b.H) * 4)) TH_LOG("LSE differs");
		free(o1);
		free(l1);
		batch_free(&b);
	}
}

/* Refusals on device tensors name the argument and enqueue nothing: the host call's checks,
 * and positions whose key runs a query run sees are several on a device that reads no explicit
 * positions (APE_ENOTSUP, naming vl->pos_k; the capability hidden on those that do). */
TEST_F(dev, device_tensors_refusals_write_nothing)
{
	ape_rng rng;
	struct batch b;
	ape_varlen vl;
	bool moved;
	int64_t saved;

	ape_rng_init(&rng, _metadata->name);
	do {
		ASSERT_EQ(0, batch_make(&b, &rng, 4, 20, 20, POS_GAPS));
	} while ((b.cuq[1] == 0 || b.cuk[1] < 3) && (batch_free(&b), 1));
	/* gaps among every key run: the first sequence with keys and queries sees two runs */
	for (int64_t s = 0; s < b.S; s++)
		for (int64_t j = b.cuk[s]; j < b.cuk[s + 1]; j++)
			b.posk[j] = 2 * (j - b.cuk[s]);
	for (int64_t s = 0; s < b.S; s++)
		for (int64_t i = b.cuq[s]; i < b.cuq[s + 1]; i++)
			b.posq[i] = 4 * (b.cuk[s + 1] - b.cuk[s]) + (i - b.cuq[s]);
	batch_varlen(&b, &vl);
	wrap_install(self->dev, WRAP_NO_POSITIONS);
	EXPECT_EQ(APE_ENOTSUP, run_resident_batch(&b, self->dev, &vl, 0, &moved));
	wrap_remove();
	EXPECT_NE(NULL, strstr(ape_last_error(), "ape_attention_enqueue_varlen: vl->pos_k"))
	TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), "reads no explicit positions"))
	TH_LOG("%s", ape_last_error());
	EXPECT_FALSE(moved);
	/* the host call's checks, the same messages */
	vl.pos_q = vl.pos_k = NULL;
	saved = b.cuq[1];
	b.cuq[1] = b.cuq[2] + 1;
	EXPECT_EQ(APE_EINVAL, run_resident_batch(&b, self->dev, &vl, 0, &moved));
	EXPECT_NE(NULL, strstr(ape_last_error(), "vl->cu_seqlens_q[2] = ")) TH_LOG("%s",
									     ape_last_error());
	EXPECT_FALSE(moved);
	b.cuq[1] = saved;
	b.desc.k_start = 3;
	EXPECT_EQ(APE_EINVAL, run_resident_batch(&b, self->dev, &vl, 0, &moved));
	EXPECT_NE(NULL, strstr(ape_last_error(), "desc->k_start = 3")) TH_LOG("%s",
									   ape_last_error());
	EXPECT_FALSE(moved);
	b.desc.k_start = 0;
	EXPECT_EQ(APE_EINVAL, ape_attention_enqueue_varlen(NULL, &b.desc, &vl, NULL, NULL, NULL,
							   NULL, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "queue = NULL"));
	/* and it works once the batch is right */
	EXPECT_EQ(0, run_resident_batch(&b, self->dev, &vl, 0, &moved)) TH_LOG("%s",
									      ape_last_error());
	batch_free(&b);
}

/*
 * b (positions of mode m) through ape_attention_enqueue_varlen() on dev, under the wrapper (at
 * most `rows` query rows a launch: common/wrapops.h, wrap_rows_per_launch(); 0: the device's own
 * budget): every sequence against the oracle, and the whole against the host call
 * ape_attention_forward_varlen() on the same device (within the spec's tolerance; bit for bit
 * on the reference, which computes each row alone). The launches into *launches.
 */
static void resident_checked(struct __test_metadata *_metadata, ape_device *dev, bool ref,
			     struct batch *b, enum pos_mode m, uint64_t rows, uint64_t *launches)
{
	const size_t no = b->o.alloc_bytes, nl = (size_t)(b->tq * b->H) * sizeof(float);
	const double to = test_tol_o(b->dt) + test_skip_tol_o(b->desc.skip_tol);
	const double tl = test_tol_lse(b->dt) + test_skip_tol_lse(b->desc.skip_tol);
	unsigned char *host_o = malloc(no + 1);
	float *host_l = malloc(nl + 1);
	double eo, el, vmax;
	struct wrap_counts wc;
	ape_tensor ht;
	uint64_t pairs;
	ape_varlen vl;
	char what[256];
	bool moved;

	ASSERT_TRUE(host_o && host_l);
	describe(b, m, what, sizeof(what));
	batch_varlen(b, &vl);
	ASSERT_EQ(0, ape_attention_forward_varlen(dev, &b->desc, &vl, &b->q.t, &b->k.t, &b->v.t,
						  &b->o.t, b->lse, NULL))
	TH_LOG("%s: the host call: %s", what, ape_last_error());
	memcpy(host_o, b->o.alloc, no);
	memcpy(host_l, b->lse, nl);
	test_tensor_poison(&b->o.t);
	wrap_install(dev, 0);
	if (rows)
		wrap_rows_per_launch(rows);
	wrap_reset();
	ASSERT_EQ(0, run_resident_batch(b, dev, &vl, 16, &moved))
	TH_LOG("%s: %s", what, ape_last_error());
	wc = wrap_get();
	wrap_remove();
	*launches = wc.attention_calls;
	ASSERT_EQ(0, batch_check(b, &eo, &el, &pairs));
	EXPECT_LE(eo, to)
	TH_LOG("%s, %llu launches: O error %g of max|V|", what, (unsigned long long)*launches, eo);
	EXPECT_LE(el, tl)
	TH_LOG("%s, %llu launches: LSE error %g", what, (unsigned long long)*launches, el);
	if (ref) {
		EXPECT_EQ(0, memcmp(host_o, b->o.alloc, no)) TH_LOG("%s: O differs", what);
		EXPECT_EQ(0, memcmp(host_l, b->lse, nl)) TH_LOG("%s: LSE differs", what);
	}
	/* against the host call: both within the oracle's tolerance, so within twice that */
	vmax = fmax(test_tensor_maxabs(&b->v.t), 1e-30);
	ht = b->o.t;
	ht.data = host_o + ((unsigned char *)b->o.t.data - (unsigned char *)b->o.alloc);
	for (int64_t h = 0; h < b->H; h++)
		for (int64_t i = 0; i < b->tq; i++) {
			const double x = b->lse[i * b->H + h], y = host_l[i * b->H + h];

			ASSERT_TRUE(x == y || fabs(x - y) <= 2 * tl * fmax(1, fabs(y)))
			TH_LOG("%s: LSE of head %lld row %lld: %g, the host call %g", what,
			       (long long)h, (long long)i, x, y);
			for (int64_t d = 0; d < b->D; d++) {
				const double u = test_tensor_get(&b->o.t, 0, h, i, d);
				const double w = test_tensor_get(&ht, 0, h, i, d);

				ASSERT_LE(fabs(u - w) / vmax, 2 * to)
				TH_LOG("%s: O of head %lld row %lld: %g, the host call %g", what,
				       (long long)h, (long long)i, u, w);
			}
		}
	free(host_o);
	free(host_l);
}

/*
 * Arbitrary positions on device tensors (gaps, repeats, shuffled; the permuted, repeated keys
 * of arbitrary_positions()): ONE resident call on a device that reads explicit positions (the
 * reference, OpenCL), a segment per sequence, one launch; equal to the oracle and to the host
 * call. Refused elsewhere (device_tensors_refusals_write_nothing).
 */
TEST_F(dev, device_tensors_arbitrary_positions)
{
	static const enum pos_mode modes[3] = { POS_GAPS, POS_REPEATS, POS_SHUFFLED };
	const bool ref = !strcmp(variant->backend, "ref");
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_SEGMENTS) || !ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS))
		SKIP(return, "%s reads no explicit positions", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 16; c++) {
		const enum pos_mode m = modes[c % 3];
		struct batch b;
		uint64_t launches;

		ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 1, 8), 40, 50, m));
		if (c % 4 == 3)
			for (int64_t s = 0; s < b.S; s++)
				arbitrary_positions(&b, &rng, s);
		resident_checked(_metadata, self->dev, ref, &b, m, 0, &launches);
		if (b.tq > 0 && b.tk > 0) {
			EXPECT_EQ(1, launches) TH_LOG("case %d", c);
		}
		batch_free(&b);
	}
}

/*
 * Query rows split under a small budget (at most a few rows a launch): each launch takes the
 * segments of its rows and, with explicit positions, the positions of its rows (pos_q moved
 * by its first row) and of every key; sequences straddle launches. Runs of consecutive
 * positions on every device that takes ragged launches, arbitrary positions where the device
 * reads them; equal to the oracle and to the host call.
 */
TEST_F(dev, device_tensors_rows_split_into_launches)
{
	const bool ref = !strcmp(variant->backend, "ref");
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_SEGMENTS))
		SKIP(return, "%s takes no ragged launches", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 15; c++) {
		const enum pos_mode m = (enum pos_mode)(c % POS_MODES);
		const bool runs = m == POS_DEFAULT || m == POS_SHIFTED;
		const uint64_t rows = (uint64_t)ape_rng_range(&rng, 1, 9);
		struct batch b;
		uint64_t launches;

		if (!runs && !ape_be_caps_have(&self->dev->caps, APE_BE_CAP_POSITIONS))
			continue;
		do {
			ASSERT_EQ(0, batch_make(&b, &rng, ape_rng_range(&rng, 2, 6), 40, 50, m));
		} while ((b.tq <= 2 * (int64_t)rows || b.tk == 0) && (batch_free(&b), 1));
		if (c % 5 == 4)
			for (int64_t s = 0; s < b.S; s++)
				arbitrary_positions(&b, &rng, s);
		resident_checked(_metadata, self->dev, ref, &b, m, rows, &launches);
		EXPECT_GE(launches, (uint64_t)(b.tq + (int64_t)rows - 1) / rows)
		TH_LOG("case %d: %lld rows, at most %llu a launch", c, (long long)b.tq,
		       (unsigned long long)rows);
		batch_free(&b);
	}
}

/* ------------------------------------------------------------------ backward on device tensors */

/* A ragged backward call's tensors on one device (enum ape__rb_tensor order), each in a buffer of
 * its own: q, k, v, o (b's layouts), lse and dlse token-major [total_q, H], dout packed, the
 * gradients packed [total, heads, D] and dparams [H, 4], NaN-poisoned. */
struct rbx {
	ape_queue *qu;
	ape_buffer *buf[APE__RB_COUNT];
	ape_dtensor d[APE__RB_COUNT];
	const ape_dtensor *t[APE__RB_COUNT];
	size_t bytes[APE__RB_COUNT];
};

static void rbx_free(struct rbx *x)
{
	for (int i = 0; i < APE__RB_COUNT; i++)
		ape_buffer_free(x->buf[i]);
	ape_queue_destroy(x->qu);
	memset(x, 0, sizeof(*x));
}

/* Host memory of tensor i of the call (its bytes in *n): b's inputs, dout, dlse (NULL: not
 * given), the gradients g[0..2] and dp (NULL: not wanted). */
static const void *rbx_host(const struct batch *b, const test_tensor *dout, const float *dlse,
			    test_tensor *const g[3], const float *dp, int i, size_t *n)
{
	const test_tensor *tt[APE__RB_COUNT] = { &b->q, &b->k,	&b->v, &b->o, NULL, dout,
						 NULL,	g[0],	g[1],	g[2], NULL };

	*n = tt[i] ? tt[i]->alloc_bytes : 0;
	if (tt[i])
		return tt[i]->alloc;
	if (i == APE__RB_LSE || i == APE__RB_DLSE) {
		*n = (size_t)(b->tq * b->H) * sizeof(float);
		return i == APE__RB_LSE ? b->lse : dlse;
	}
	*n = (size_t)(4 * b->H) * sizeof(float);
	return dp;
}

static int rbx_up(struct rbx *x, ape_device *dev, const struct batch *b, const test_tensor *dout,
		  const float *dlse, test_tensor *const g[3], const float *dp)
{
	int ret;

	memset(x, 0, sizeof(*x));
	if ((ret = ape_queue_create(dev, &x->qu)))
		return ret;
	for (int i = 0; i < APE__RB_COUNT; i++) {
		size_t n;
		const void *h = rbx_host(b, dout, dlse, g, dp, i, &n);

		if (!h)
			continue;
		x->bytes[i] = n;
		if ((ret = ape_buffer_alloc(dev, n + 16, &x->buf[i])) ||
		    (n && (ret = ape_buffer_write(x->qu, x->buf[i], 0, h, n))))
			return ret;
		if (i == APE__RB_LSE || i == APE__RB_DLSE) {
			ape_dtensor_init(&x->d[i], x->buf[i], 0, APE_F32, 1, b->H, b->tq, 1);
			x->d[i].strides[1] = 1; /* [total_q, H], token-major */
			x->d[i].strides[2] = b->H;
			x->d[i].strides[3] = 1;
		} else if (i == APE__RB_DPARAMS) {
			ape_dtensor_init(&x->d[i], x->buf[i], 0, APE_F32, 1, 1, b->H, 4);
		} else {
			const test_tensor *tt[APE__RB_COUNT] = { &b->q, &b->k, &b->v, &b->o, NULL,
								 dout,	NULL,  g[0],  g[1],  g[2] };

			as_dtensor(&x->d[i], x->buf[i], 0, tt[i]);
		}
		x->t[i] = &x->d[i];
	}
	return ape_queue_synchronize(x->qu);
}

/* The gradients back into g[0..2] and dp (those the call has). */
static int rbx_down(struct rbx *x, const struct batch *b, test_tensor *const g[3], float *dp)
{
	int ret = 0;

	for (int i = APE__RB_DQ; i < APE__RB_COUNT && !ret; i++) {
		void *h = i == APE__RB_DPARAMS ? (void *)dp : g[i - APE__RB_DQ] ? g[i - APE__RB_DQ]->alloc : NULL;

		if (x->buf[i] && h && x->bytes[i])
			ret = ape_buffer_read(x->qu, h, x->buf[i], 0, x->bytes[i]);
	}
	(void)b;
	return ret ? ret : ape_queue_synchronize(x->qu);
}

/* A ragged backward case: a batch (made by the caller) with its forward run on a device (b.o,
 * b.lse), dout (b's storage type, packed), dlse (N(0, 1/16)) and six poisoned gradient tensors:
 * g[0..2] dq, dk, dv of one call, g[3..5] of another. */
struct rbcase {
	struct batch b;
	ape_varlen vl;
	test_tensor g[6], dout;
	float *dlse;
};

static void rbcase_ready(struct __test_metadata *_metadata, struct rbcase *c, ape_device *dev,
			 ape_rng *rng)
{
	struct batch *b = &c->b;

	batch_varlen(b, &c->vl);
	c->dlse = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
	ASSERT_NE(NULL, c->dlse);
	ASSERT_EQ(0, ape_attention_forward_varlen(dev, &b->desc, &c->vl, &b->q.t, &b->k.t, &b->v.t,
						  &b->o.t, b->lse, NULL))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, test_tensor_random(&c->dout, rng, b->dt, 1, b->tq, b->H, b->D, 1.0));
	ape_tensor_init_packed(&c->dout.t, c->dout.alloc, b->dt, b->tq, b->H, b->D);
	for (int64_t i = 0; i < b->tq * b->H; i++)
		c->dlse[i] = (float)ape_rng_normal(rng) * 0.25f;
	for (int i = 0; i < 6; i++) {
		const int64_t heads = i % 3 ? b->Hkv : b->H, rows = i % 3 ? b->tk : b->tq;

		ASSERT_EQ(0, test_tensor_empty(&c->g[i], b->dt, 1, rows, heads, b->D));
		ape_tensor_init_packed(&c->g[i].t, c->g[i].alloc, b->dt, rows, heads, b->D);
		test_tensor_poison(&c->g[i].t);
	}
}

static void rbcase_free(struct rbcase *c)
{
	for (int i = 0; i < 6; i++)
		test_tensor_free(&c->g[i]);
	test_tensor_free(&c->dout);
	free(c->dlse);
	batch_free(&c->b);
	memset(c, 0, sizeof(*c));
}

/* ape_attention_backward_enqueue_varlen() of b (forward run: b->o, b->lse) into g[0..2] and dp;
 * the backward launches it made into *launches (the wrapper counts them). */
static int rb_device(ape_device *dev, const struct batch *b, const ape_varlen *vl,
		     const test_tensor *dout, const float *dlse, test_tensor *const g[3], float *dp,
		     uint64_t *launches)
{
	struct rbx x;
	int ret;

	wrap_install(dev, 0);
	if (!(ret = rbx_up(&x, dev, b, dout, dlse, g, dp))) {
		wrap_reset();
		ret = ape_attention_backward_enqueue_varlen(x.qu, &b->desc, vl, x.t[0], x.t[1],
							    x.t[2], x.t[3], x.t[4], x.t[5], x.t[6],
							    x.t[7], x.t[8], x.t[9], x.t[10]);
		*launches = wrap_get().calls[WRAP_ATTENTION_BACKWARD];
		if (!ret) {
			ret = rbx_down(&x, b, g, dp);
		} else {
			char msg[512];

			snprintf(msg, sizeof(msg), "%s", ape_last_error());
			rbx_down(&x, b, g, dp); /* what the device holds after a refusal */
			ape__error(ret, "%s", msg);
		}
	}
	rbx_free(&x);
	wrap_remove();
	return ret;
}

/*
 * Random ragged batches (default and shifted positions: one key run per query run; every
 * storage type, GQA, causal or not, empty sequences, decode rows, dLSE or not, dparams or not)
 * through ape_attention_backward_enqueue_varlen(): equal to the host call
 * ape_attention_backward_varlen() on the same device within the spec's tolerance (both are
 * checked against the reference per sequence: backward_of_a_ragged_batch_against_the_reference),
 * bit for bit on the reference; one backward launch for the batch.
 */
TEST_F(dev, backward_on_device_tensors_equals_the_host_call)
{
	const bool ref = !strcmp(variant->backend, "ref");
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD))
		SKIP(return, "%s has no backward pass on device tensors", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 4 : 16); c++) {
		const enum pos_mode m = c % 2 ? POS_SHIFTED : POS_DEFAULT;
		const bool with_dlse = c % 3 != 1, with_dp = c % 4 != 2;
		struct rbcase x;
		struct batch *const b = &x.b;
		test_tensor *const g = x.g, *gd[3] = { &x.g[3], &x.g[4], &x.g[5] };
		float dp[2][32];
		uint64_t launches = 0;
		char what[256];

		ASSERT_EQ(0, batch_make(b, &rng, ape_rng_range(&rng, 1, 8), 30, 40, m));
		describe(b, m, what, sizeof(what));
		rbcase_ready(_metadata, &x, self->dev, &rng);
		for (int i = 0; i < 32; i++)
			dp[0][i] = dp[1][i] = NAN;
		ASSERT_EQ(0, ape_attention_backward_varlen(&self->dev, 1, NULL, &b->desc, &x.vl,
							   &b->q.t, &b->k.t, &b->v.t, &b->o.t, b->lse,
							   &x.dout.t, with_dlse ? x.dlse : NULL, &g[0].t,
							   &g[1].t, &g[2].t, with_dp ? dp[0] : NULL, NULL))
		TH_LOG("%s: the host call: %s", what, ape_last_error());
		ASSERT_EQ(0, rb_device(self->dev, b, &x.vl, &x.dout, with_dlse ? x.dlse : NULL, gd,
				       with_dp ? dp[1] : NULL, &launches))
		TH_LOG("%s: %s", what, ape_last_error());
		for (int t = 0; t < 3; t++) {
			if (ref) {
				EXPECT_TRUE(same_bits(&g[t], &g[t + 3])) TH_LOG("%s: gradient %d", what, t);
			} else {
				EXPECT_LE(grads_rel_err(&g[t + 3].t, &g[t].t), 2 * grads_tol(b->dt))
				TH_LOG("%s: gradient %d", what, t);
			}
		}
		if (with_dp) {
			EXPECT_LE(grads_rel_err_params(dp[1], dp[0], b->H), ref ? 0 : 2 * grads_tol(b->dt))
			TH_LOG("%s: dparams", what);
		} else {
			EXPECT_TRUE(isnan(dp[1][0])) TH_LOG("%s: dparams written", what);
		}
		if (ape_be_dev_has(self->dev, APE_BE_CAP_SEGMENTS | APE_BE_CAP_BWD_SEGMENTS) &&
		    b->tq && b->tk) {
			EXPECT_GE(1u, launches) TH_LOG("%s: launches", what);
		}
		rbcase_free(&x);
	}
}

/* A one-sequence batch over every key is ape_attention_backward_enqueue() of the same tensors,
 * bit for bit. */
TEST_F(dev, backward_on_device_tensors_one_sequence_is_the_dense_call)
{
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD))
		SKIP(return, "%s has no backward pass on device tensors", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < 3; c++) {
		struct rbcase y;
		struct batch *const b = &y.b;
		test_tensor *g0[3] = { &y.g[0], &y.g[1], &y.g[2] };
		test_tensor *g1[3] = { &y.g[3], &y.g[4], &y.g[5] };
		float dp[2][32];
		uint64_t launches;
		struct rbx x;

		do {
			ASSERT_EQ(0, batch_make(b, &rng, 1, 40, 50, POS_DEFAULT));
		} while ((!b->tq || !b->tk) && (batch_free(b), 1));
		rbcase_ready(_metadata, &y, self->dev, &rng);
		ASSERT_EQ(0, rb_device(self->dev, b, &y.vl, &y.dout, y.dlse, g0, dp[0], &launches))
		TH_LOG("%s", ape_last_error());
		/* the dense call on the same [1, H, total, D] tensors, queries end-aligned */
		ASSERT_EQ(0, rbx_up(&x, self->dev, b, &y.dout, y.dlse, g1, dp[1]));
		ASSERT_EQ(0, ape_attention_backward_enqueue(x.qu, &b->desc, x.t[0], x.t[1], x.t[2],
							    x.t[3], x.t[4], x.t[5], x.t[6], x.t[7],
							    x.t[8], x.t[9], x.t[10]))
		TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, rbx_down(&x, b, g1, dp[1]));
		rbx_free(&x);
		for (int t = 0; t < 3; t++) {
			EXPECT_TRUE(same_bits(&y.g[t], &y.g[t + 3])) TH_LOG("gradient %d", t);
		}
		EXPECT_EQ(0, memcmp(dp[0], dp[1], sizeof(float) * (size_t)(4 * b->H)));
		rbcase_free(&y);
	}
}

/*
 * Query rows split into launches of a few rows (the resident backward's executor driven with n
 * rows a launch: exec/resident_bwd.h): each launch takes the segments of its rows, sequences
 * straddling launches; the gradients within the spec's tolerance of one launch's and two runs
 * bit for bit the same.
 */
TEST_F(dev, backward_on_device_tensors_rows_split_into_launches)
{
	ape_rng rng;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD) ||
	    !ape_be_dev_has(self->dev, APE_BE_CAP_SEGMENTS | APE_BE_CAP_BWD_SEGMENTS))
		SKIP(return, "%s has no ragged backward on device tensors", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	for (int c = 0; c < (self->emu ? 2 : 6); c++) {
		const enum pos_mode m = c % 2 ? POS_SHIFTED : POS_DEFAULT;
		struct rbcase y;
		struct batch *const b = &y.b;
		test_tensor *const g = y.g, again[3];
		test_tensor *g0[3] = { &g[0], &g[1], &g[2] }, *g1[3] = { &g[3], &g[4], &g[5] };
		test_tensor *g2[3] = { &again[0], &again[1], &again[2] };
		float dp[3][32];
		struct ape__resident_bwd_req r;
		struct ape__problem p;
		struct ape_be_seg *sg = NULL;
		int64_t n = 0, rows = 0;
		uint64_t launches;
		char what[256];
		struct rbx x;

		do {
			ASSERT_EQ(0, batch_make(b, &rng, ape_rng_range(&rng, 2, 6), 30, 40, m));
		} while ((b->tq < 8 || !b->tk) && (batch_free(b), 1));
		describe(b, m, what, sizeof(what));
		rbcase_ready(_metadata, &y, self->dev, &rng);
		for (int i = 0; i < 3; i++) {
			ASSERT_EQ(0, test_tensor_empty(&again[i], b->dt, 1, i ? b->tk : b->tq,
						       i ? b->Hkv : b->H, b->D));
			ape_tensor_init_packed(&again[i].t, again[i].alloc, b->dt, i ? b->tk : b->tq,
					       i ? b->Hkv : b->H, b->D);
		}
		ASSERT_EQ(0, rb_device(self->dev, b, &y.vl, &y.dout, y.dlse, g0, dp[0], &launches))
		TH_LOG("%s: %s", what, ape_last_error());
		/* the same call's problem and segments, run with n rows a launch */
		ASSERT_EQ(0, rbx_up(&x, self->dev, b, &y.dout, y.dlse, g1, dp[1]));
		memset(&r, 0, sizeof(r));
		ASSERT_EQ(0, ape__check_resident_bwd("test", x.qu, &b->desc, x.t, &p, &r))
		TH_LOG("%s", ape_last_error());
		ASSERT_EQ(1, ape__varlen_segments("test", &y.vl, p.causal, &sg, &n));
		p.segs = sg;
		p.nseg = n;
		r.fn = "test";
		r.dev = self->dev;
		r.q = x.qu->q;
		r.p = &p;
		ASSERT_EQ(0, ape__resident_bwd_plan(&r, &rows));
		EXPECT_EQ(b->tq, rows) TH_LOG("%s: a small batch is one launch", what);
		for (int64_t per = 1; per < b->tq; per = per * 3 + 2) {
			ASSERT_EQ(0, ape__resident_bwd_enqueue(&r, per)) TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, rbx_down(&x, b, g1, dp[1]));
			ASSERT_EQ(0, ape__resident_bwd_enqueue(&r, per)) TH_LOG("%s", ape_last_error());
			ASSERT_EQ(0, rbx_down(&x, b, g2, dp[2]));
			for (int t = 0; t < 3; t++) {
				EXPECT_TRUE(same_bits(&g[t + 3], &again[t]))
				TH_LOG("%s, %lld rows a launch: runs differ", what, (long long)per);
				EXPECT_LE(grads_rel_err(&g[t + 3].t, &g[t].t), grads_tol(b->dt))
				TH_LOG("%s, %lld rows a launch: gradient %d", what, (long long)per, t);
			}
			EXPECT_LE(grads_rel_err_params(dp[1], dp[0], b->H), grads_tol(b->dt))
			TH_LOG("%s, %lld rows a launch: dparams", what, (long long)per);
		}
		p.segs = NULL;
		p.nseg = 0;
		free(sg);
		ape__problem_fini(&p);
		rbx_free(&x);
		for (int i = 0; i < 3; i++)
			test_tensor_free(&again[i]);
		rbcase_free(&y);
	}
}

/* Whether every element of g[0..2] ([1, heads, rows, D]) and dp[0 .. 4H) is still the NaN
 * poison. */
static bool rb_untouched(test_tensor *const g[3], const float *dp, int64_t H)
{
	for (int t = 0; t < 3; t++) {
		const ape_tensor *x = &g[t]->t;

		for (int64_t h = 0; h < x->shape[1]; h++)
			for (int64_t i = 0; i < x->shape[2]; i++)
				for (int64_t d = 0; d < x->shape[3]; d++)
					if (!isnan(test_tensor_get(x, 0, h, i, d)))
						return false;
	}
	for (int64_t i = 0; i < 4 * H; i++)
		if (!isnan(dp[i]))
			return false;
	return true;
}

/* Refusals on device tensors name the argument and write nothing: the host call's batch
 * checks, positions that need pieces (gaps among a sequence's keys; one sequence's query runs
 * sharing keys), a device without ragged backward launches, desc->dbias_table, no LSE, no
 * gradient wanted, no queue. */
TEST_F(dev, backward_on_device_tensors_refusals_write_nothing)
{
	ape_rng rng;
	struct rbcase y;
	struct batch *const b = &y.b;
	test_tensor *gd[3] = { &y.g[0], &y.g[1], &y.g[2] };
	float dp[32], table[8];
	uint64_t launches;
	ape_varlen vl;
	int64_t saved;

	if (!ape_be_caps_have(&self->dev->caps, APE_BE_CAP_RESIDENT_BACKWARD))
		SKIP(return, "%s has no backward pass on device tensors", self->dev->info.name);
	ape_rng_init(&rng, _metadata->name);
	do {
		ASSERT_EQ(0, batch_make(b, &rng, 4, 20, 20, POS_DEFAULT));
	} while ((b->cuq[1] < 2 || b->cuk[1] < 3 || b->H > 8) && (batch_free(b), 1));
	/* O and LSE of a forward of the default positions: any values do for refusals */
	rbcase_ready(_metadata, &y, self->dev, &rng);
	b->explicit_pos = true;
	batch_varlen(b, &vl);
	for (int i = 0; i < 32; i++)
		dp[i] = NAN;
#define EXPECT_REFUSED(code, text)                                                                 \
	do {                                                                                       \
		EXPECT_EQ(code, rb_device(self->dev, b, &vl, &y.dout, y.dlse, gd, dp, &launches));    \
		EXPECT_NE(NULL, strstr(ape_last_error(), text)) TH_LOG("%s", ape_last_error());   \
		EXPECT_TRUE(rb_untouched(gd, dp, b->H));              \
		EXPECT_EQ(0u, launches);                                                           \
	} while (0)
	/* gaps among every key run: the first sequence's queries see two runs */
	for (int64_t s = 0; s < b->S; s++)
		for (int64_t j = b->cuk[s]; j < b->cuk[s + 1]; j++)
			b->posk[j] = 2 * (j - b->cuk[s]);
	for (int64_t s = 0; s < b->S; s++)
		for (int64_t i = b->cuq[s]; i < b->cuq[s + 1]; i++)
			b->posq[i] = 4 * (b->cuk[s + 1] - b->cuk[s]) + (i - b->cuq[s]);
	batch_varlen(b, &vl);
	EXPECT_REFUSED(APE_ENOTSUP, "ape_attention_backward_enqueue_varlen: vl->pos_k: a query run");
	/* keys in one run, the first sequence's queries in two runs that both see them */
	for (int64_t s = 0; s < b->S; s++) {
		for (int64_t j = b->cuk[s]; j < b->cuk[s + 1]; j++)
			b->posk[j] = j - b->cuk[s];
		for (int64_t i = b->cuq[s]; i < b->cuq[s + 1]; i++)
			b->posq[i] = 100 + 2 * (i - b->cuq[s]);
	}
	EXPECT_REFUSED(APE_ENOTSUP, "vl->pos_q: two query runs of one sequence");
	/* the host call's batch checks, the same messages */
	vl.pos_q = vl.pos_k = NULL;
	saved = b->cuq[1];
	b->cuq[1] = b->cuq[2] + 1;
	EXPECT_REFUSED(APE_EINVAL, "vl->cu_seqlens_q[2] = ");
	b->cuq[1] = saved;
	b->desc.k_start = 3;
	EXPECT_REFUSED(APE_EINVAL, "desc->k_start = 3");
	b->desc.k_start = 0;
	b->desc.dbias_table = table;
	EXPECT_REFUSED(APE_EINVAL, "desc->dbias_table");
	b->desc.dbias_table = NULL;
	/* several sequences on a device without ragged backward launches */
	{
		struct rbx x;

		wrap_install(self->dev, WRAP_NO_BWD_SEGMENTS);
		ASSERT_EQ(0, rbx_up(&x, self->dev, b, &y.dout, y.dlse, gd, dp));
		EXPECT_EQ(APE_ENOTSUP, ape_attention_backward_enqueue_varlen(
					       x.qu, &b->desc, &vl, x.t[0], x.t[1], x.t[2], x.t[3],
					       x.t[4], x.t[5], x.t[6], x.t[7], x.t[8], x.t[9],
					       x.t[10]));
		EXPECT_NE(NULL, strstr(ape_last_error(), "takes no ragged backward launches"))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue_varlen(
					      x.qu, &b->desc, &vl, x.t[0], x.t[1], x.t[2], x.t[3],
					      NULL, x.t[5], x.t[6], x.t[7], x.t[8], x.t[9], x.t[10]));
		EXPECT_NE(NULL, strstr(ape_last_error(), "lse = NULL")) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue_varlen(
					      x.qu, &b->desc, &vl, x.t[0], x.t[1], x.t[2], x.t[3],
					      x.t[4], x.t[5], x.t[6], NULL, NULL, NULL, NULL));
		EXPECT_NE(NULL, strstr(ape_last_error(), "no gradient is wanted"))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(APE_EINVAL, ape_attention_backward_enqueue_varlen(
					      NULL, &b->desc, &vl, x.t[0], x.t[1], x.t[2], x.t[3],
					      x.t[4], x.t[5], x.t[6], x.t[7], x.t[8], x.t[9], x.t[10]));
		EXPECT_NE(NULL, strstr(ape_last_error(), "queue = NULL"));
		ASSERT_EQ(0, rbx_down(&x, b, gd, dp));
		EXPECT_TRUE(rb_untouched(gd, dp, b->H));
		rbx_free(&x);
		wrap_remove();
	}
	/* and it works once the batch is right */
	EXPECT_EQ(0, rb_device(self->dev, b, &vl, &y.dout, y.dlse, gd, dp, &launches))
	TH_LOG("%s", ape_last_error());
	EXPECT_FALSE(rb_untouched(gd, dp, b->H));
#undef EXPECT_REFUSED
	rbcase_free(&y);
}

TEST_HARNESS_MAIN
