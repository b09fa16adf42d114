/* SPDX-License-Identifier: MIT */
/*
 * Ragged launches on the CUDA backend (struct ape_be_launch.segs; cuda/kernels/prefill.cu's
 * segment table) against the reference backend, with no GPU: the fake driver of tests/fake_cuda
 * built with the emulator (cuda/emu) runs every launch on the CPU (test_cuda_emu.c says what
 * that proves). Packed batches of many short sequences, empty ones (no query, no key), Lq < Lk
 * and Lq > Lk per sequence, causal or not, GQA, every storage type, both rope layouts, D = 64,
 * 128 and generic ones; each batch ONE launch (ape_stats.chunks) on the CUDA device, O and LSE
 * within the storage type's tolerance of the reference's (and of what skipping may add), no more
 * pairs computed than visible; long sequences with a real decay skip far keys per segment.
 * Ragged backward launches (ABI 1.2, APE_BE_CAP_BWD_SEGMENTS; cuda/kernels/backward.cu's
 * segment table): ape_attention_backward_varlen() of a packed batch in ONE launch on the CUDA
 * device, its dQ, dK, dV, dparams and distance-bias table gradient against the reference's
 * backward of the same batch (grads_tol()), the scratch one launch allocated within what the
 * backend declared for a ragged call.
 *
 * Fresh random inputs each run (APE_TEST_SEED replays one). Sizes are kept small for the
 * emulator's speed. With APE_TEST_CUDA_DEVICE=1 the same tests run on this machine's own driver
 * and GPU instead (tools/gpu-check.sh does that; the program exits 4 when there is no CUDA
 * device).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stdatomic.h>

#include "ape_test.h"
#include "common/bwdcase.h"
#include "common/problem.h"
#include "common/testutil.h"
#include "core/backend.h"

#ifdef APE_HAVE_CUDA
#include "cuda_emu_pair.h"

extern atomic_uint_fast64_t ape__cu_bwd_scratch_high;

/* One packed batch: q, k, v [total, H, D]; o and lse written by each device in turn. */
struct rbatch {
	int64_t S, H, Hkv, D, tq, tk;
	int64_t *cuq, *cuk;
	ape_dtype dt, odt;
	test_tensor q, k, v, o;
	float *lse;
	ape_attn_desc desc;
	float prm[4][8];
	float *table; /* NULL, or the distance-bias table desc points to (rbatch_table()) */
};

/* A batch of the sequences' lengths lq[s], lk[s] (s < S), random values and parameters. */
static int rbatch_make(struct rbatch *b, ape_rng *r, int64_t S, const int64_t *lq,
		       const int64_t *lk, int64_t H, int64_t Hkv, int64_t D, ape_dtype dt)
{
	memset(b, 0, sizeof(*b));
	b->S = S;
	b->H = H;
	b->Hkv = Hkv;
	b->D = D;
	b->dt = dt;
	b->odt = ape_rng_range(r, 0, 2) ? dt : APE_F32;
	b->cuq = calloc((size_t)S + 1, sizeof(int64_t));
	b->cuk = calloc((size_t)S + 1, sizeof(int64_t));
	if (!b->cuq || !b->cuk)
		return -1;
	for (int64_t s = 0; s < S; s++) {
		b->cuq[s + 1] = b->cuq[s] + lq[s];
		b->cuk[s + 1] = b->cuk[s] + lk[s];
	}
	b->tq = b->cuq[S];
	b->tk = b->cuk[S];
	b->lse = malloc(sizeof(float) * (size_t)(b->tq * H + 1));
	if (!b->lse || test_tensor_random(&b->q, r, dt, 1, b->tq, H, D, 1.0) ||
	    test_tensor_random(&b->k, r, dt, 1, b->tk, Hkv, D, 1.0) ||
	    test_tensor_random(&b->v, r, dt, 1, b->tk, Hkv, D, 1.0) ||
	    test_tensor_random(&b->o, r, b->odt, 1, b->tq, H, D, 1.0))
		return -1;
	ape_tensor_init_packed(&b->q.t, b->q.alloc, dt, b->tq, H, D);
	ape_tensor_init_packed(&b->k.t, b->k.alloc, dt, b->tk, Hkv, D);
	ape_tensor_init_packed(&b->v.t, b->v.alloc, dt, b->tk, Hkv, D);
	ape_tensor_init_packed(&b->o.t, b->o.alloc, b->odt, b->tq, H, D);
	ape_attn_desc_init(&b->desc);
	b->desc.causal = ape_rng_range(r, 0, 2) > 0;
	b->desc.layout = ape_rng_range(r, 0, 1) ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	test_random_head_params(&b->desc, b->prm, H, r);
	return 0;
}

static void rbatch_free(struct rbatch *b)
{
	free(b->table);
	free(b->cuq);
	free(b->cuk);
	free(b->lse);
	test_tensor_free(&b->q);
	test_tensor_free(&b->k);
	test_tensor_free(&b->v);
	test_tensor_free(&b->o);
}

/*
 * A distance-bias table of M entries for b, one row per head or one shared: N(0, 1) values
 * (jump 0), or 0 up to distance `jump`, then 45 (the keys past it outweigh the near ones under
 * the seed's decay, which only a skip bound with the table's suffix maxima sees). 0, or -1 out of
 * memory.
 */
static int rbatch_table(struct rbatch *b, ape_rng *r, int64_t M, bool shared, int64_t jump)
{
	const int64_t rows = shared ? 1 : b->H;

	b->table = malloc(sizeof(float) * (size_t)(rows * M));
	if (!b->table)
		return -1;
	for (int64_t e = 0; e < rows * M; e++)
		b->table[e] = jump ? (e % M < jump ? 0.0f : 45.0f) : (float)ape_rng_normal(r);
	b->desc.bias_table = b->table;
	b->desc.bias_table_len = M;
	b->desc.bias_table_heads = rows;
	return 0;
}

/* Runs b on dev: O into *o (a copy, as doubles [tq][H][D]), LSE into *lse, statistics into *st. */
static int rbatch_run(const struct rbatch *b, ape_device *dev, double **o, float **lse,
		      ape_stats *st)
{
	ape_varlen vl;
	size_t n = (size_t)(b->tq * b->H * b->D);

	ape_varlen_init(&vl);
	vl.num_seqs = b->S;
	vl.cu_seqlens_q = b->cuq;
	vl.cu_seqlens_k = b->cuk;
	test_tensor_poison((ape_tensor *)&b->o.t);
	ape_stats_init(st);
	if (ape_attention_forward_varlen(dev, &b->desc, &vl, &b->q.t, &b->k.t, &b->v.t,
					 (ape_tensor *)&b->o.t, b->lse, st))
		return -1;
	*o = malloc(sizeof(double) * (n + 1));
	*lse = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
	if (!*o || !*lse)
		return -1;
	for (int64_t i = 0; i < b->tq; i++)
		for (int64_t h = 0; h < b->H; h++)
			for (int64_t d = 0; d < b->D; d++)
				(*o)[(i * b->H + h) * b->D + d] =
					test_tensor_get(&b->o.t, 0, h, i, d);
	memcpy(*lse, b->lse, sizeof(float) * (size_t)(b->tq * b->H));
	return 0;
}

static void describe(const struct rbatch *b, char *buf, size_t n)
{
	snprintf(buf, n, "S %lld, totals %lld x %lld, H %lld/%lld, D %lld, %s -> %s, %s, %s",
		 (long long)b->S, (long long)b->tq, (long long)b->tk, (long long)b->H,
		 (long long)b->Hkv, (long long)b->D, ape_dtype_name(b->dt), ape_dtype_name(b->odt),
		 b->desc.causal ? "causal" : "not causal",
		 b->desc.layout == APE_ROPE_INTERLEAVED ? "interleaved" : "half");
}

/*
 * b on both devices: the CUDA device in ONE launch, O and LSE within the tolerance of the
 * reference's (O relative to max|V|) and of what skipping may add, no NaN where the reference
 * has none, the same visible pairs, no more computed; those two counts into pairs[0] and
 * pairs[1] (NULL: not wanted). 0, or -1 with the reason logged.
 */
static int rbatch_check(struct __test_metadata *_metadata, const struct pair_of_devices *d,
			struct rbatch *b, uint64_t *pairs)
{
	const double tol_o = test_tol_o(b->dt) + test_skip_tol_o(b->desc.skip_tol);
	const double tol_lse = test_tol_lse(b->dt) + test_skip_tol_lse(b->desc.skip_tol);
	const double vmax = fmax(test_tensor_maxabs(&b->v.t), 1e-30);
	double *oc = NULL, *orf = NULL, eo = 0, el = 0;
	float *lc = NULL, *lr = NULL;
	ape_stats sc, sr;
	char what[256];
	int ret = 0;

	describe(b, what, sizeof(what));
	if (rbatch_run(b, d->cuda, &oc, &lc, &sc)) {
		TH_LOG("%s: cuda: %s", what, ape_last_error());
		ret = -1;
	} else if (rbatch_run(b, d->ref, &orf, &lr, &sr)) {
		TH_LOG("%s: ref: %s", what, ape_last_error());
		ret = -1;
	}
	for (int64_t x = 0; !ret && x < b->tq * b->H; x++) {
		const double want = lr[x], got = lc[x];

		if (isinf(want) || isinf(got))
			el = fmax(el, want == got ? 0 : INFINITY);
		else
			el = fmax(el, fabs(got - want) / fmax(1, fabs(want)));
		if (isnan(got) && !isnan(want))
			el = INFINITY;
		for (int64_t e = 0; e < b->D; e++) {
			const double g = oc[x * b->D + e], w = orf[x * b->D + e];

			eo = fmax(eo, isnan(g) != isnan(w) ? INFINITY
				      : isnan(g)	 ? 0
							 : fabs(g - w) / vmax);
		}
	}
	if (!ret && (!(eo <= tol_o) || !(el <= tol_lse))) {
		TH_LOG("%s: O error %.3g of max|V|, LSE error %.3g", what, eo, el);
		ret = -1;
	}
	if (!ret && b->tq && b->tk && strcmp(sc.backend, "cuda")) {
		TH_LOG("%s: ran on \"%s\"", what, sc.backend);
		ret = -1;
	}
	if (!ret && b->tq && b->tk && sc.chunks != 1) {
		TH_LOG("%s: %llu launches, not one", what, (unsigned long long)sc.chunks);
		ret = -1;
	}
	if (!ret && (sc.pairs_visible != sr.pairs_visible ||
		     sc.pairs_computed > sc.pairs_visible)) {
		TH_LOG("%s: pairs visible %llu (ref %llu), computed %llu", what,
		       (unsigned long long)sc.pairs_visible, (unsigned long long)sr.pairs_visible,
		       (unsigned long long)sc.pairs_computed);
		ret = -1;
	}
	if (pairs) {
		pairs[0] = ret ? 0 : sc.pairs_visible;
		pairs[1] = ret ? 0 : sc.pairs_computed;
	}
	free(oc);
	free(orf);
	free(lc);
	free(lr);
	return ret;
}

static const ape_dtype all_types[] = { APE_F32, APE_F16, APE_BF16 };

/* Case c of a test, drawn from r into b: 0, or -1 out of memory. */
typedef int (*case_fn)(struct rbatch *b, ape_rng *r, int c);

/* Cases 0 .. cases-1 of make, each checked by rbatch_check(), the random stream named seed. */
static void run_cases(struct __test_metadata *_metadata, const char *seed, int cases,
		      case_fn make)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, seed);
	for (int c = 0; c < cases; c++) {
		struct rbatch b;

		ASSERT_EQ(0, make(&b, &rng, c));
		fails += rbatch_check(_metadata, &d, &b, NULL) != 0;
		rbatch_free(&b);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* 8 to 24 sequences of 1 to 6 rows and keys, some without queries or without keys, D = 64,
 * GQA in odd cases, the storage types in turn. */
static int short_case(struct rbatch *b, ape_rng *r, int c)
{
	int64_t lq[24], lk[24];
	const int64_t S = ape_rng_range(r, 8, 24), Hkv = 1 + c % 2;

	for (int64_t s = 0; s < S; s++) {
		const int64_t shape = ape_rng_range(r, 0, 6);

		lq[s] = shape == 0 ? 0 : ape_rng_range(r, 1, 6);
		lk[s] = shape == 1 ? 0 : ape_rng_range(r, 1, 6);
	}
	return rbatch_make(b, r, S, lq, lk, Hkv * (1 + c % 2), Hkv, 64, all_types[c % 3]);
}

/* Many short sequences in one launch: the decode-sized rows that take the prefill kernel's
 * segment table. */
TEST(many_short_sequences_in_one_launch)
{
	run_cases(_metadata, "cuda_emu_varlen_short", 6, short_case);
}

/* One sequence without queries, one shorter than its keys, one longer, one of one row; D = 128,
 * 40 (the g128 kernel), 64, 130 (g256) in turn, GQA in even cases, causal in even ones. */
static int tiles_case(struct rbatch *b, ape_rng *r, int c)
{
	static const int64_t dims[] = { 128, 40, 64, 130 };
	const int64_t lq[4] = { 0, ape_rng_range(r, 5, 40), ape_rng_range(r, 40, 80), 1 };
	const int64_t lk[4] = { ape_rng_range(r, 1, 9), ape_rng_range(r, 60, 100),
				ape_rng_range(r, 10, 40), ape_rng_range(r, 1, 70) };
	int ret = rbatch_make(b, r, 4, lq, lk, 2, c % 2 ? 1 : 2, dims[c % 4],
			      all_types[(1 + c) % 3]);

	b->desc.causal = c % 2 == 0;
	return ret;
}

/* Longer sequences across query tiles and key tiles: Lq < Lk and Lq > Lk per sequence. */
TEST(sequences_across_tiles)
{
	run_cases(_metadata, "cuda_emu_varlen_tiles", 4, tiles_case);
}

/* Sequences without keys beside one with (case 0), and a batch whose sequences have no key at
 * all (case 1: the launch's keys empty, O = 0 and LSE = -inf from the fills). */
static int nokeys_case(struct rbatch *b, ape_rng *r, int c)
{
	const int64_t lq[3] = { 3, 20, 2 }, lk[3] = { 0, c ? 0 : 17, 0 };

	return rbatch_make(b, r, 3, lq, lk, 2, 2, 64, c ? APE_F16 : APE_F32);
}

TEST(sequences_without_keys)
{
	run_cases(_metadata, "cuda_emu_varlen_nokeys", 2, nokeys_case);
}

/*
 * Skipping per segment: three sequences of 200 to 300 tokens, the seed's decay (delta =
 * 2^(-4/3), beta = gamma = delta / 10, lambda 0.1), the default skip_tol, causal (case 0) or
 * not (case 1): far keys of each sequence are left out (fewer pairs computed than visible),
 * within what skipping may add to the tolerance; with skip_tol 0 (case 2) every visible pair is
 * computed.
 */
TEST(far_keys_skipped_per_segment)
{
	const double delta = pow(2.0, -4.0 / 3.0);
	struct pair_of_devices d;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_varlen_skip");
	for (int c = 0; c < 3; c++) {
		const int64_t lq[3] = { ape_rng_range(&rng, 200, 300), ape_rng_range(&rng, 200, 300),
					ape_rng_range(&rng, 200, 300) };
		struct rbatch b;
		uint64_t pairs[2] = { 0, 0 };

		ASSERT_EQ(0, rbatch_make(&b, &rng, 3, lq, lq, 1, 1, 64, c == 1 ? APE_F16 : APE_F32));
		b.desc.causal = c != 1;
		b.desc.delta = (ape_param){ .value = (float)delta };
		b.desc.beta = b.desc.gamma = (ape_param){ .value = (float)(delta / 10) };
		b.desc.lambda = (ape_param){ .value = 0.1f };
		if (c == 2)
			b.desc.skip_tol = 0;
		EXPECT_EQ(0, rbatch_check(_metadata, &d, &b, pairs));
		TH_LOG("case %d: %llu of %llu visible pairs computed", c,
		       (unsigned long long)pairs[1], (unsigned long long)pairs[0]);
		if (c == 2) {
			EXPECT_EQ(pairs[0], pairs[1]);
		} else { /* rows reach about one tile past the diagonal's (each side) */
			EXPECT_LT(pairs[1], pairs[0] * 3 / 4);
		}
		rbatch_free(&b);
	}
	ape_context_destroy(d.ctx);
}

/*
 * Distance-bias tables on ragged launches, each distance measured within its segment: short
 * sequences (the decode's segments, case 0) and longer ones across tiles (the prefill's
 * segment table, case 1), random tables of 1, 7 or 300 entries, per head or shared; and the
 * seed's decay with skipping and a table that jumps up at distance 100 (case 2, causal; case
 * 3, not), which the per-segment bounds must keep: all within tolerance of the reference.
 */
TEST(tables_per_segment)
{
	const double delta = pow(2.0, -4.0 / 3.0);
	static const int64_t lens[] = { 1, 7, 300 };
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_varlen_table");
	for (int c = 0; c < 4; c++) {
		struct rbatch b;
		uint64_t pairs[2] = { 0, 0 };

		if (c >= 2) {
			const int64_t lq[3] = { ape_rng_range(&rng, 200, 300),
						ape_rng_range(&rng, 200, 300),
						ape_rng_range(&rng, 200, 300) };

			ASSERT_EQ(0, rbatch_make(&b, &rng, 3, lq, lq, 2, 1, 64,
						 c == 2 ? APE_F32 : APE_BF16));
			b.desc.causal = c == 2;
			b.desc.delta = (ape_param){ .value = (float)delta };
			b.desc.beta = b.desc.gamma = (ape_param){ .value = (float)(delta / 10) };
			b.desc.lambda = (ape_param){ .value = 0.1f };
			ASSERT_EQ(0, rbatch_table(&b, &rng, 400, c == 3, 100));
		} else {
			ASSERT_EQ(0, c ? tiles_case(&b, &rng, 2 + c) : short_case(&b, &rng, 1));
			ASSERT_EQ(0, rbatch_table(&b, &rng, lens[ape_rng_range(&rng, 0, 2)],
						  ape_rng_range(&rng, 0, 1), 0));
		}
		fails += rbatch_check(_metadata, &d, &b, pairs) != 0;
		TH_LOG("case %d: %llu of %llu visible pairs computed", c,
		       (unsigned long long)pairs[1], (unsigned long long)pairs[0]);
		rbatch_free(&b);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

/* ------------------------------------------------------------------ the backward */

/* max |a - b| over n floats relative to max |b| (a NaN in a: infinite) */
static double rel_err_f(const float *a, const float *b, size_t n)
{
	double m = 0, e = 0;

	for (size_t i = 0; i < n; i++) {
		m = fmax(m, fabs(b[i]));
		e = isnan(a[i]) ? INFINITY : fmax(e, fabs((double)a[i] - b[i]));
		if (isinf(e))
			break;
	}
	return e / fmax(m, 1e-30);
}

/* The gradients of one backward run of a batch: float32 [tq][H][D], [tk][Hkv][D], dparams, the
 * distance-bias table's (NULL without a table). */
struct rgrads {
	test_tensor dq, dk, dv;
	float dp[4 * 8], *db;
};

/*
 * The backward of b (its O and LSE the reference's forward) on dev with dout and dlse (NULL:
 * none), the gradients `frozen` leaves (frozen: only dparams and the table's) into g. 0, or the
 * call's code.
 */
static int rbatch_backward(const struct rbatch *b, ape_device *dev, const test_tensor *dout,
			   const float *dlse, bool frozen, struct rgrads *g, ape_stats *st)
{
	const size_t tn = b->table ? (size_t)(b->desc.bias_table_heads * b->desc.bias_table_len) : 0;
	ape_attn_desc desc = b->desc;
	ape_varlen vl;

	memset(g, 0, sizeof(*g));
	if (test_tensor_empty(&g->dq, APE_F32, 1, b->tq, b->H, b->D) ||
	    test_tensor_empty(&g->dk, APE_F32, 1, b->tk, b->Hkv, b->D) ||
	    test_tensor_empty(&g->dv, APE_F32, 1, b->tk, b->Hkv, b->D) ||
	    !(g->db = calloc(tn + 1, sizeof(float))))
		return APE_ENOMEM;
	ape_tensor_init_packed(&g->dq.t, g->dq.alloc, APE_F32, b->tq, b->H, b->D);
	ape_tensor_init_packed(&g->dk.t, g->dk.alloc, APE_F32, b->tk, b->Hkv, b->D);
	ape_tensor_init_packed(&g->dv.t, g->dv.alloc, APE_F32, b->tk, b->Hkv, b->D);
	memset(g->dq.alloc, 0, g->dq.alloc_bytes);
	memset(g->dk.alloc, 0, g->dk.alloc_bytes);
	memset(g->dv.alloc, 0, g->dv.alloc_bytes);
	desc.dbias_table = b->table ? g->db : NULL;
	ape_varlen_init(&vl);
	vl.num_seqs = b->S;
	vl.cu_seqlens_q = b->cuq;
	vl.cu_seqlens_k = b->cuk;
	ape_stats_init(st);
	return ape_attention_backward_varlen(&dev, 1, NULL, &desc, &vl, &b->q.t, &b->k.t, &b->v.t,
					     &b->o.t, b->lse, &dout->t, dlse,
					     frozen ? NULL : &g->dq.t, frozen ? NULL : &g->dk.t,
					     frozen ? NULL : &g->dv.t, g->dp, st);
}

/* What the CUDA backend declares (attention_backward_scratch) for a ragged call's launch of b's
 * rows and keys, of at most S segments (f.segs NULL, f.nseg S), its outputs wanted. */
static uint64_t declared_scratch(ape_device *dev, const struct rbatch *b, bool frozen)
{
	struct ape_be_bwd_launch l;

	memset(&l, 0, sizeof(l));
	l.f.B = 1;
	l.f.H = b->H;
	l.f.Hkv = b->Hkv;
	l.f.Lq = b->tq;
	l.f.Lk = b->tk;
	l.f.D = b->D;
	l.f.in_dtype = l.dout_dtype = b->dt;
	l.f.out_dtype = b->odt;
	l.f.causal = b->desc.causal;
	l.f.nseg = b->S;
	if (b->table) {
		l.f.bias_table = b->table;
		l.f.bias_len = b->desc.bias_table_len;
		l.f.bias_hstride = b->desc.bias_table_heads > 1 ? b->desc.bias_table_len : 0;
	}
	return dev->be->ops->attention_backward_scratch(
		dev, &l,
		APE_BE_BWD_DPARAMS | APE_BE_BWD_DLSE |
			(frozen ? 0u : APE_BE_BWD_DQ | APE_BE_BWD_DK | APE_BE_BWD_DV) |
			(b->table ? APE_BE_BWD_DBIAS : 0u));
}

static void rgrads_free(struct rgrads *g)
{
	test_tensor_free(&g->dq);
	test_tensor_free(&g->dk);
	test_tensor_free(&g->dv);
	free(g->db);
}

/*
 * The backward of b on both devices: the CUDA device in ONE launch (where some row sees a key;
 * none where none does), its gradients within grads_tol() of the reference's, the same visible
 * pairs, the scratch its launch allocated (ape__cu_bwd_scratch_high) within what the backend
 * declares for a ragged call's launch of those rows and keys (declared_scratch()). dLSE given with `with_dlse`; `frozen`:
 * only dparams (and the table's gradient) wanted. 0, or -1 with the reason logged.
 */
static int rbatch_bwd_check(struct __test_metadata *_metadata, const struct pair_of_devices *d,
			    struct rbatch *b, ape_rng *r, bool with_dlse, bool frozen)
{
	const double tol = grads_tol(b->dt);
	const size_t tn = b->table ? (size_t)(b->desc.bias_table_heads * b->desc.bias_table_len) : 0;
	float *dlse = malloc(sizeof(float) * (size_t)(b->tq * b->H + 1));
	double *o = NULL;
	float *lse = NULL;
	test_tensor dout;
	struct rgrads gc, gr;
	ape_stats sc, sr;
	char what[300];
	int ret = 0, rc;

	describe(b, what, sizeof(what));
	snprintf(what + strlen(what), sizeof(what) - strlen(what), ", %s%s%s",
		 with_dlse ? "dlse" : "no dlse", frozen ? ", frozen inputs" : "",
		 b->table ? ", table" : "");
	if (!dlse || rbatch_run(b, d->ref, &o, &lse, &sr) ||
	    test_tensor_random(&dout, r, b->dt, 1, b->tq, b->H, b->D, 1.0)) {
		TH_LOG("%s: setup: %s", what, ape_last_error());
		free(dlse);
		free(o);
		free(lse);
		return -1;
	}
	ape_tensor_init_packed(&dout.t, dout.alloc, b->dt, b->tq, b->H, b->D);
	for (int64_t i = 0; i < b->tq * b->H; i++)
		dlse[i] = (float)ape_rng_normal(r) * 0.25f;
	atomic_store(&ape__cu_bwd_scratch_high, 0);
	rc = rbatch_backward(b, d->cuda, &dout, with_dlse ? dlse : NULL, frozen, &gc, &sc);
	if (rc) {
		TH_LOG("%s: cuda: %s", what, ape_last_error());
		ret = -1;
	} else if (rbatch_backward(b, d->ref, &dout, with_dlse ? dlse : NULL, frozen, &gr, &sr)) {
		TH_LOG("%s: ref: %s", what, ape_last_error());
		ret = -1;
	}
	if (!ret) {
		const double e[5] = {
			frozen ? 0 : grads_rel_err(&gc.dq.t, &gr.dq.t),
			frozen ? 0 : grads_rel_err(&gc.dk.t, &gr.dk.t),
			frozen ? 0 : grads_rel_err(&gc.dv.t, &gr.dv.t),
			grads_rel_err_params(gc.dp, gr.dp, b->H),
			tn ? rel_err_f(gc.db, gr.db, tn) : 0,
		};

		TH_LOG("%s: %llu launch(es), %llu pairs, scratch %llu of %llu declared; errors dq "
		       "%.2g dk %.2g dv %.2g dparams %.2g dbias %.2g (tolerance %.2g)",
		       what, (unsigned long long)sc.chunks, (unsigned long long)sc.pairs_visible,
		       (unsigned long long)atomic_load(&ape__cu_bwd_scratch_high),
		       (unsigned long long)declared_scratch(d->cuda, b, frozen), e[0], e[1], e[2],
		       e[3], e[4], tol);
		for (int t = 0; t < 5; t++)
			if (!(e[t] <= tol)) {
				TH_LOG("%s: gradient %d (dq, dk, dv, dparams, dbias): error %.3g, "
				       "tolerance %.3g",
				       what, t, e[t], tol);
				ret = -1;
			}
		if (sc.pairs_visible && strcmp(sc.backend, "cuda")) {
			TH_LOG("%s: ran on \"%s\"", what, sc.backend);
			ret = -1;
		}
		if (sc.chunks != (sc.pairs_visible ? 1u : 0u)) {
			TH_LOG("%s: %llu launches for %llu visible pairs", what,
			       (unsigned long long)sc.chunks, (unsigned long long)sc.pairs_visible);
			ret = -1;
		}
		if (sc.pairs_visible != sr.pairs_visible) {
			TH_LOG("%s: pairs visible %llu (ref %llu)", what,
			       (unsigned long long)sc.pairs_visible,
			       (unsigned long long)sr.pairs_visible);
			ret = -1;
		}
		/* (one launch: its rows and keys are the batch's) */
		if (atomic_load(&ape__cu_bwd_scratch_high) > declared_scratch(d->cuda, b, frozen)) {
			TH_LOG("%s: the launch allocated %llu bytes of scratch, over the %llu "
			       "declared for a ragged call",
			       what, (unsigned long long)atomic_load(&ape__cu_bwd_scratch_high),
			       (unsigned long long)declared_scratch(d->cuda, b, frozen));
			ret = -1;
		}
	}
	if (!rc)
		rgrads_free(&gr);
	rgrads_free(&gc);
	test_tensor_free(&dout);
	free(dlse);
	free(o);
	free(lse);
	return ret;
}

/*
 * Ragged backward batches, each ONE launch on the CUDA device against the reference's backward
 * of the same batch: the awkward lengths (1, 5, 17, 33), sequences without keys or without
 * queries, Lq < Lk and Lq > Lk, GQA, the storage types, both layouts, causal or not, dLSE,
 * D = 64, 40 (generic) and 130 (g256); frozen inputs (only dparams); distance-bias tables per
 * head and shared, with their gradient; skipping within its bound; more key tiles than splits
 * (a split's tiles in several segments, and several of one segment: its slices fresh at the
 * first, added to at the next).
 */
static int bwd_case(struct rbatch *b, ape_rng *r, int c)
{
	static const int64_t lq[] = { 1, 5, 17, 0, 33, 3, 2 };
	static const int64_t lk[] = { 4, 0, 17, 6, 40, 1, 9 };
	static const int64_t dims[] = { 64, 40, 64, 130, 64, 64 };
	int ret;

	if (c >= 12) { /* more key tiles than splits (the emulated device's 4 multiprocessors
			* give 16 splits at most): a split meets several segments, and (case 13)
			* several tiles of one segment, 300 keys in tiles of 16 at D = 130 */
		int64_t rq[24], rk[24];
		const int64_t S = c == 12 ? 24 : 3;

		for (int64_t s = 0; s < S; s++) {
			rq[s] = c == 13 ? (s == 1 ? 300 : 1 + 4 * s) : ape_rng_range(r, 1, 40);
			rk[s] = c == 13 ? (s == 1 ? 300 : 3 + 14 * s) : ape_rng_range(r, 0, 40);
		}
		ret = rbatch_make(b, r, S, rq, rk, 2, 1, 130, all_types[c % 3]);
		for (int h = 0; c == 13 && h < 2; h++) /* a weak decay: far keys weigh */
			for (int p = 0; p < 3; p++)
				b->prm[p][h] *= 0.01f;
	} else if (c % 2) { /* random lengths */
		int64_t rq[12], rk[12];
		const int64_t S = ape_rng_range(r, 2, 12);

		for (int64_t s = 0; s < S; s++) {
			rq[s] = ape_rng_range(r, 0, 6) ? ape_rng_range(r, 1, 36) : 0;
			rk[s] = ape_rng_range(r, 0, 6) ? ape_rng_range(r, 1, 40) : 0;
		}
		ret = rbatch_make(b, r, S, rq, rk, 2, c % 4 == 1 ? 1 : 2, dims[c % 6],
				  all_types[c % 3]);
	} else {
		ret = rbatch_make(b, r, 7, lq, lk, 2, c % 4 == 0 ? 1 : 2, dims[c % 6],
				  all_types[c % 3]);
	}
	b->desc.causal = (c / 2) % 2 == 0;
	b->desc.layout = (c / 3) % 2 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	if (!ret && (c % 3 == 2 || c == 13))
		ret = rbatch_table(b, r, c % 2 ? 7 : 300, c % 4 == 2, 0);
	if (c % 5 == 4)
		b->desc.skip_tol = 1e-3;
	return ret;
}

TEST(ragged_backward_in_one_launch)
{
	struct pair_of_devices d;
	int fails = 0;
	ape_rng rng;

	open_devices(_metadata, &d);
	ape_rng_init(&rng, "cuda_emu_varlen_bwd");
	for (int c = 0; c < 14; c++) {
		struct rbatch b;

		ASSERT_EQ(0, bwd_case(&b, &rng, c));
		fails += rbatch_bwd_check(_metadata, &d, &b, &rng, c % 3 != 1, c == 5) != 0;
		rbatch_free(&b);
	}
	EXPECT_EQ(0, fails);
	ape_context_destroy(d.ctx);
}

CUDA_EMU_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
