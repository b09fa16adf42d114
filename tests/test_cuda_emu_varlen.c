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

#include "ape_test.h"
#include "common/problem.h"
#include "common/testutil.h"

#ifdef APE_HAVE_CUDA
#include "cuda_emu_pair.h"

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

CUDA_EMU_MAIN
#else
APE_TEST_MAIN_SKIP_UNLESS(0, "the CUDA backend is not built into this libape")
#endif /* APE_HAVE_CUDA */
