// SPDX-License-Identifier: MIT
/*
 * libape_mpi (issue 17). The shard arithmetic and the refusal without MPI_Init run here; every
 * distributed case runs the driver (build/bin/ape-mpi-run) under `mpirun --oversubscribe -np N`,
 * which compares each rank's rows with the single-process call over the whole sequence and
 * prints one line per rank; these tests read those lines. A run that hangs is killed by
 * `timeout` and fails. Without mpirun every such test says SKIP and why.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"
#include "ape/ape_mpi.h"
#include "common/naive.h"
#include "common/npy.h"
#include "mpi_internal.h"

#define OUT_CAP (1 << 20)

static const char *mpirun(void)
{
	const char *m = getenv("APE_MPIRUN");

	return m && *m ? m : "mpirun";
}

static bool have_mpirun(void)
{
	char cmd[512];

	snprintf(cmd, sizeof(cmd), "command -v '%s' >/dev/null 2>&1", mpirun());
	return system(cmd) == 0;
}

#define NEED_MPIRUN()                                                                              \
	do {                                                                                       \
		if (!have_mpirun())                                                                \
			SKIP(return, "mpirun not found (Debian: openmpi-bin; or set APE_MPIRUN)"); \
	} while (0)

/* Runs the driver on np ranks with args; returns its exit status (124: timed out) and its
 * output in out (OUT_CAP bytes). */
static int drive(int np, const char *args, char *out)
{
	char cmd[2048];
	size_t n = 0;
	FILE *f;
	int st;

	snprintf(cmd, sizeof(cmd),
		 "timeout 300 '%s' %s--oversubscribe -np %d '%s/bin/ape-mpi-run' %s 2>&1",
		 mpirun(), geteuid() == 0 ? "--allow-run-as-root " : "", np, APE_BUILD_DIR, args);
	out[0] = 0;
	f = popen(cmd, "r");
	if (!f)
		return -1;
	while (n < OUT_CAP - 1) {
		size_t got = fread(out + n, 1, OUT_CAP - 1 - n, f);

		if (!got)
			break;
		n += got;
	}
	out[n] = 0;
	st = pclose(f);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The line of rank r ("  rank=R ..."), copied into line; false when absent. */
static bool rank_line(const char *out, int r, char *line, size_t cap)
{
	char key[32];
	const char *p, *e;

	snprintf(key, sizeof(key), "  rank=%d ", r);
	p = strstr(out, key);
	if (!p)
		return false;
	e = strchr(p, '\n');
	snprintf(line, cap, "%.*s", (int)(e ? e - p : (ptrdiff_t)strlen(p)), p);
	return true;
}

/* The value of key=NUMBER in a line; -1 when absent. */
static double field(const char *line, const char *key)
{
	char k[64];
	const char *p;

	snprintf(k, sizeof(k), " %s=", key);
	p = strstr(line, k);
	return p ? strtod(p + strlen(k), NULL) : -1;
}

/* The quoted value of key="..." in a line, copied into buf. */
static void quoted(const char *line, const char *key, char *buf, size_t cap)
{
	char k[64];
	const char *p, *e;

	snprintf(k, sizeof(k), " %s=\"", key);
	p = strstr(line, k);
	buf[0] = 0;
	if (!p)
		return;
	p += strlen(k);
	e = strchr(p, '"');
	snprintf(buf, cap, "%.*s", (int)(e ? e - p : 0), p);
}

/* ---------------------------------------------------------------- no MPI needed */

TEST(shard_covers_every_row_once)
{
	static const int64_t Ls[] = { 0, 1, 2, 5, 7, 8, 61, 1000, 262144 };

	for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]); li++)
		for (int n = 1; n <= 7; n++)
			for (int kind = 0; kind < 2; kind++) {
				const int64_t L = Ls[li];
				int64_t seen = 0, lo = INT64_MAX, hi = 0, expect_next = 0;
				char *hit = calloc((size_t)L + 1, 1);

				ASSERT_NE(NULL, hit);
				for (int r = 0; r < n; r++) {
					ape_mpi_shard_info sh;

					ASSERT_EQ(0, ape_mpi_shard(L, n, r, (ape_mpi_shard_kind)kind,
								   &sh));
					ASSERT_EQ(kind ? 2 : 1, sh.nblocks);
					ASSERT_EQ(sh.count[0] + sh.count[1], sh.rows);
					for (int b = 0; b < sh.nblocks; b++) {
						for (int64_t i = 0; i < sh.count[b]; i++) {
							ASSERT_EQ(0, hit[sh.start[b] + i]);
							hit[sh.start[b] + i] = 1;
						}
						seen += sh.count[b];
						lo = sh.count[b] < lo ? sh.count[b] : lo;
						hi = sh.count[b] > hi ? sh.count[b] : hi;
					}
					/* rank r's first block is part r of the split, so the
					 * first blocks tile the start of the sequence in rank
					 * order; a zigzag's second block mirrors it from the end */
					ASSERT_EQ(expect_next, sh.start[0]);
					expect_next = sh.start[0] + sh.count[0];
					/* a zigzag's second block is part 2n-1-r: it ends where
					 * rank r-1's second block (part 2n-r) starts */
					if (kind && r > 0) {
						ape_mpi_shard_info prev;

						ASSERT_EQ(0, ape_mpi_shard(L, n, r - 1,
									   APE_MPI_SHARD_ZIGZAG,
									   &prev));
						ASSERT_EQ(prev.start[1], sh.start[1] + sh.count[1]);
					}
				}
				ASSERT_EQ(L, seen);
				/* nearly equal: the parts differ by at most one row */
				ASSERT_LE(hi - lo, 1);
				free(hit);
			}
}

TEST(shard_refuses_bad_arguments)
{
	ape_mpi_shard_info sh;

	ASSERT_EQ(APE_EINVAL, ape_mpi_shard(-1, 2, 0, APE_MPI_SHARD_CONTIGUOUS, &sh));
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "L = -1"));
	ASSERT_EQ(APE_EINVAL, ape_mpi_shard(10, 0, 0, APE_MPI_SHARD_CONTIGUOUS, &sh));
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "nranks = 0"));
	ASSERT_EQ(APE_EINVAL, ape_mpi_shard(10, 2, 2, APE_MPI_SHARD_ZIGZAG, &sh));
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "rank = 2"));
	ASSERT_EQ(APE_EINVAL, ape_mpi_shard(10, 2, 0, (ape_mpi_shard_kind)7, &sh));
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "kind = 7"));
	ASSERT_EQ(APE_EINVAL, ape_mpi_shard(10, 2, 0, APE_MPI_SHARD_ZIGZAG, NULL));
}

TEST(forward_refuses_without_mpi_init)
{
	ape_mpi_shard_info sh;
	int ret;

	ASSERT_EQ(0, ape_mpi_shard(4, 1, 0, APE_MPI_SHARD_CONTIGUOUS, &sh));
	ret = ape_mpi_attention_forward(MPI_COMM_WORLD, NULL, NULL, NULL, &sh, NULL, NULL, NULL,
					NULL, NULL, NULL);
	ASSERT_EQ(APE_EINVAL, ret);
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "MPI is not initialised"));
}

/*
 * The plan's proof, checked against an independent evaluation (tests/common/naive.c, long
 * double): for every query block, the keys outside the rows [lo, hi) the plan says it needs
 * weigh at most the plan's share of skip_tol relative to the keys inside, in every row. The
 * cases are chosen so that the plan does leave keys out (else the check would prove nothing).
 */
static void plan_case(struct __test_metadata *_metadata, bool causal, int64_t q0, int64_t k0,
		      double delta, double tol, int *cut)
{
	enum { L = 240, NR = 3, B = 1, H = 2, HKV = 1, D = 16 };
	const int nb = 2 * NR, nbg = B * HKV;
	double dl[H], bt[H], gm[H], lm[H], qmax[B * H], lse_lb[B * H];
	double *lse_all = malloc(sizeof(double) * B * H * L), *lse_in = NULL, *o = NULL;
	float prm[4 * H], kmax[2 * NR * B * HKV];
	struct ape__mpi_geom g = { .L = L, .B = B, .H = H, .Hkv = HKV, .D = D, .nranks = NR,
				   .nblocks = nb, .kind = APE_MPI_SHARD_ZIGZAG, .q0 = q0, .k0 = k0,
				   .causal = causal, .abs_scale = 1 / sqrt(D), .prm = prm,
				   .can_skip = true, .tol_plan = tol };
	naive_params np = { .delta = dl, .beta = bt, .gamma = gm, .lambda = lm, .rope_base = 1e4,
			    .scale = NAN, .causal = causal, .q_start = q0, .k_start = k0 };
	test_tensor q, k, v;
	ape_rng rng;

	ape_rng_init(&rng, "mpi_plan");
	ASSERT_EQ(0, test_tensor_random(&q, &rng, APE_F32, B, H, L, D, 1.0));
	ASSERT_EQ(0, test_tensor_random(&k, &rng, APE_F32, B, HKV, L, D, 1.0));
	ASSERT_EQ(0, test_tensor_random(&v, &rng, APE_F32, B, HKV, L, D, 1.0));
	for (int h = 0; h < H; h++) {
		dl[h] = prm[4 * h] = (float)(delta * (1 + h)); /* per head */
		bt[h] = prm[4 * h + 1] = (float)(delta / 10);
		gm[h] = prm[4 * h + 2] = (float)(delta / 10);
		lm[h] = prm[4 * h + 3] = 0.1f;
		/* the naive evaluation gets the float values the plan sees */
		dl[h] = prm[4 * h], bt[h] = prm[4 * h + 1], gm[h] = prm[4 * h + 2];
		lm[h] = prm[4 * h + 3];
	}
	for (int b = 0; b < nb; b++) {
		int64_t s, c;
		int owner, lb;

		ape__mpi_block(&g, b, &s, &c, &owner, &lb);
		ape__mpi_key_max(&g, &k.t, s, c, kmax + b * nbg);
	}
	ASSERT_NE(NULL, lse_all);
	o = malloc(sizeof(double) * B * H * L * D);
	lse_in = malloc(sizeof(double) * B * H * L);
	ASSERT_NE(NULL, o);
	ASSERT_NE(NULL, lse_in);
	ASSERT_EQ(0, naive_attention(&np, &q.t, &k.t, &v.t, o, lse_all));
	for (int b = 0; b < nb; b++) {
		int64_t s, c, lo, hi;
		int owner, lb;
		ape_tensor qv, kv, vv;
		naive_params npb = np;

		ape__mpi_block(&g, b, &s, &c, &owner, &lb);
		ape__mpi_query_summary(&g, &q.t, &k.t, s, c, qmax, lse_lb);
		ape__mpi_needed(&g, kmax, qmax, lse_lb, s, c, &lo, &hi);
		ASSERT_LE(0, lo);
		ASSERT_LE(lo, hi);
		ASSERT_LE(hi, L);
		*cut += lo > 0 || (!causal && hi < L);
		if (hi == lo)
			continue; /* nothing visible (queries before every key) */
		qv = test_rows(&q.t, s, c);
		kv = test_rows(&k.t, lo, hi - lo);
		vv = test_rows(&v.t, lo, hi - lo);
		npb.q_start = q0 + s;
		npb.k_start = k0 + lo;
		ASSERT_EQ(0, naive_attention(&npb, &qv, &kv, &vv, o, lse_in));
		for (int64_t bh = 0; bh < B * H; bh++)
			for (int64_t i = 0; i < c; i++) {
				double all = lse_all[bh * L + s + i], in = lse_in[bh * c + i];

				if (all == -INFINITY) /* no visible key: none to leave out */
					continue;
				/* skipped / computed = exp(all - in) - 1 */
				ASSERT_LE(expm1(all - in), tol);
			}
	}
	test_tensor_free(&q);
	test_tensor_free(&k);
	test_tensor_free(&v);
	free(lse_all);
	free(lse_in);
	free(o);
}

TEST(plan_leaves_out_at_most_its_share)
{
	int cut = 0;

	plan_case(_metadata, true, 0, 0, 1.0, 0x1p-25, &cut);
	plan_case(_metadata, true, 100, 90, 1.0, 0x1p-25, &cut);
	plan_case(_metadata, false, 0, 0, 1.5, 0x1p-26, &cut);
	plan_case(_metadata, false, -7, 5, 0.7, 1e-3, &cut);
	plan_case(_metadata, true, 0, 0, 0.3, 1e-3, &cut);
	ASSERT_GT(cut, 0);
}

/* ---------------------------------------------------------------- under mpirun */

/* The built-in cases (both shard kinds, causal or not, GQA, every dtype, lengths not divisible
 * by the rank count, ranks and blocks without rows, offsets, strides, zero and negative decay)
 * plus random ones, each equal to the single-process call within the spec's tolerance. */
/* The driver's suite on np ranks (extra: more driver options, e.g. --backward): every case
 * passes, the named ones included. */
static void suite(struct __test_metadata *_metadata, int np, const char *extra)
{
	static const char *const names[] = { "contiguous-causal", "zigzag-causal-gqa",
					     "contiguous-noncausal-f16", "zigzag-noncausal-bf16",
					     "ranks-without-rows", "offsets", "zero-decay",
					     "strong-decay-noncausal" };
	char *out = malloc(OUT_CAP), tail[64], args[128];
	int rc, passed = -1, total = -2;
	const char *p;

	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args), "--suite 12 %s", extra);
	rc = drive(np, args, out);
	if (rc)
		TH_LOG("%s", out);
	ASSERT_EQ(0, rc);
	ASSERT_EQ(NULL, strstr(out, "FAIL "));
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(tail, sizeof(tail), "pass %s ", names[i]);
		ASSERT_NE(NULL, strstr(out, tail));
	}
	p = strstr(out, "# ");
	p = p ? strstr(p + 1, "\n# ") : NULL;
	ASSERT_NE(NULL, p);
	ASSERT_EQ(2, sscanf(p, "\n# %d of %d cases passed", &passed, &total));
	ASSERT_EQ(total, passed);
	ASSERT_GE(total, 12 + (int)(sizeof(names) / sizeof(names[0])));
	if (strstr(extra, "--backward")) /* the driver ran the backward in every case */
		ASSERT_NE(NULL, strstr(out, " backward ndev="));
	free(out);
}

TEST(suite_1_rank)
{
	NEED_MPIRUN();
	suite(_metadata, 1, "");
}

TEST(suite_2_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 2, "");
}

TEST(suite_3_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 3, "");
}

TEST(suite_4_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 4, "");
}

/* One rank passes something different or invalid (the driver's --corrupt) on np ranks. */
struct mismatch {
	const char *corrupt, *names; /* what is corrupted; what the message must name */
	int np, rank;
};

/* Each case fails cleanly: every rank returns the same APE_EINVAL with the same message, from
 * fn, naming that rank and the field, and nothing hangs. extra: more driver options. */
static void mismatches(struct __test_metadata *_metadata, const struct mismatch *cases, size_t n,
		       const char *extra, const char *fn)
{
	char *out = malloc(OUT_CAP), args[256], line[2048], msg[1024], first[1024], want[32];

	ASSERT_NE(NULL, out);
	for (size_t i = 0; i < n; i++) {
		snprintf(args, sizeof(args), "-L 40 --check %s --corrupt %s --corrupt-rank %d",
			 extra, cases[i].corrupt, cases[i].rank);
		ASSERT_EQ(1, drive(cases[i].np, args, out)); /* 1: the case failed, cleanly */
		snprintf(want, sizeof(want), "rank %d: ", cases[i].rank);
		for (int r = 0; r < cases[i].np; r++) {
			ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
			ASSERT_NE(NULL, strstr(line, " ret=APE_EINVAL "));
			quoted(line, "msg", msg, sizeof(msg));
			if (!strstr(msg, want) || !strstr(msg, cases[i].names))
				TH_LOG("%s on rank %d: %s", cases[i].corrupt, cases[i].rank, msg);
			ASSERT_NE(NULL, strstr(msg, fn));
			ASSERT_NE(NULL, strstr(msg, want));
			ASSERT_NE(NULL, strstr(msg, cases[i].names));
			if (r == 0)
				snprintf(first, sizeof(first), "%s", msg);
			ASSERT_STREQ(first, msg);
		}
	}
	free(out);
}

/* One rank passes something different or invalid: every rank returns the same APE_EINVAL with
 * the same message, naming that rank and the field, and nothing hangs. */
TEST(mismatch_on_one_rank)
{
	static const struct mismatch cases[] = {
		{ "delta", "desc->delta", 3, 2 },
		{ "causal", "desc->causal", 4, 1 },
		{ "k_start", "desc->k_start", 2, 1 },
		{ "kind", "shard->kind", 4, 3 },
		{ "rank", "shard->rank", 3, 0 },
		{ "L", "shard: not what ape_mpi_shard", 4, 2 },
		{ "stride", "k->strides[2] = -1", 4, 1 },
		{ "null", "q->data = NULL", 3, 1 },
		{ "delta", "desc->delta", 3, 0 }, /* rank 0 is the odd one out */
	};

	NEED_MPIRUN();
	mismatches(_metadata, cases, sizeof(cases) / sizeof(cases[0]), "",
		   "ape_mpi_attention_forward: ");
}

/* Arguments valid everywhere, but one rank's computation fails (a device budget too small for
 * any chunk, which only a device with a memory budget enforces: OpenCL here). Every rank returns
 * that rank's error, after the exchange completed, and none hangs. */
TEST(computation_fails_on_one_rank)
{
	char *out = malloc(OUT_CAP), line[2048], msg[1024], first[1024];
	const int np = 3;
	int rc;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	rc = drive(np, "-L 40 --backend opencl --corrupt budget --corrupt-rank 1", out);
	if (rc == 3) {
		free(out);
		SKIP(return, "no OpenCL device for the driver (it enforces the budget)");
	}
	ASSERT_EQ(1, rc);
	for (int r = 0; r < np; r++) {
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		ASSERT_NE(NULL, strstr(line, " ret=APE_ENOMEM "));
		quoted(line, "msg", msg, sizeof(msg));
		ASSERT_NE(NULL, strstr(msg, "rank 1: "));
		ASSERT_NE(NULL, strstr(msg, "budget 1000 bytes"));
		if (r == 0)
			snprintf(first, sizeof(first), "%s", msg);
		ASSERT_STREQ(first, msg);
	}
	free(out);
}

/* The target's shape at a size the reference backend finishes quickly: 4 ranks, zigzag, causal,
 * the seed's parameters. Every rank is within tolerance, sends at most two key blocks' worth of
 * K and V (a ring would send N - 1 blocks), and some visible rows were proved negligible. */
TEST(seed_decay_sends_at_most_two_blocks)
{
	const int np = 4;
	const int64_t L = 2048, H = 2, D = 64, row_bytes = 2 * H * D * (int64_t)sizeof(float);
	char *out = malloc(OUT_CAP), line[2048], args[256];

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args),
		 "-L %" PRId64 " -H %" PRId64 " -D %" PRId64 " --shard zigzag --check", L, H, D);
	ASSERT_EQ(0, drive(np, args, out));
	for (int r = 0; r < np; r++) {
		ape_mpi_shard_info sh;
		int64_t biggest;

		ASSERT_EQ(0, ape_mpi_shard(L, np, r, APE_MPI_SHARD_ZIGZAG, &sh));
		biggest = sh.count[0] > sh.count[1] ? sh.count[0] : sh.count[1];
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		TH_LOG("%s", line);
		ASSERT_EQ(1, field(line, "ok"));
		ASSERT_LE(field(line, "bytes_sent"), 2.0 * (double)(biggest * row_bytes));
		ASSERT_EQ(field(line, "bytes_sent"), field(line, "rows_sent") * (double)row_bytes);
		ASSERT_LE(field(line, "blocks_sent"), 2);
		ASSERT_GT(field(line, "rows_unneeded"), 0);
		ASSERT_EQ(0, field(line, "full_exchange"));
	}
	free(out);
}

/* Bytes per rank do not grow with L under the seed's decay: only rows near block borders move. */
TEST(seed_decay_bytes_flat_in_L)
{
	const int np = 4;
	double most[2] = { 0, 0 }, blocks[2];
	char *out = malloc(OUT_CAP), line[2048], args[256];
	const int64_t Ls[2] = { 1024, 4096 };

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	for (int i = 0; i < 2; i++) {
		snprintf(args, sizeof(args), "-L %" PRId64 " -H 2 -D 64 --shard zigzag", Ls[i]);
		ASSERT_EQ(0, drive(np, args, out));
		for (int r = 0; r < np; r++) {
			ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
			most[i] = fmax(most[i], field(line, "bytes_sent"));
		}
		blocks[i] = 2.0 * (double)(Ls[i] / (2 * np)) * 2 * 2 * 64 * sizeof(float);
		TH_LOG("L = %" PRId64 ": most bytes sent by a rank %.0f (two blocks: %.0f)", Ls[i],
		       most[i], blocks[i]);
		ASSERT_GT(most[i], 0);
	}
	/* four times the length, four times the block: the bytes stay (nearly) where they were */
	ASSERT_LT(most[1], 1.5 * most[0]);
	ASSERT_LT(most[1], blocks[1] / 4);
	free(out);
}

/* With every decay parameter 0 nothing can be proved negligible: the plan falls back to the
 * full exchange and says so. Non-causal contiguous: each rank sends its block to the N - 1
 * others, the ring's traffic. */
TEST(zero_decay_full_exchange)
{
	const int np = 3;
	const int64_t L = 61, H = 2, D = 16, row_bytes = 2 * H * D * (int64_t)sizeof(float);
	char *out = malloc(OUT_CAP), line[2048], note[256], args[256];

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args),
		 "-L %" PRId64 " -H %" PRId64 " -D %" PRId64 " --decay zero --noncausal --check", L,
		 H, D);
	ASSERT_EQ(0, drive(np, args, out));
	for (int r = 0; r < np; r++) {
		ape_mpi_shard_info sh;

		ASSERT_EQ(0, ape_mpi_shard(L, np, r, APE_MPI_SHARD_CONTIGUOUS, &sh));
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		ASSERT_EQ(1, field(line, "full_exchange"));
		quoted(line, "note", note, sizeof(note));
		ASSERT_NE(NULL, strstr(note, "full exchange"));
		ASSERT_EQ((double)((np - 1) * sh.rows * row_bytes), field(line, "bytes_sent"));
		ASSERT_EQ(np - 1, field(line, "messages_sent"));
		ASSERT_EQ(0, field(line, "rows_unneeded"));
	}
	free(out);
}

/* ---------------------------------------------------------------- the backward (item 3) */

/* The suite with ape_mpi_attention_backward() after each forward: every case's dQ, dK, dV and
 * dparams equal the single-process ape_attention_backward() of the whole sequence (on the same
 * O and LSE) within APE-SPEC.md's gradient tolerances, dparams bit-identical on every rank (the
 * driver's ok needs both); both shard kinds, causal and not, GQA, every dtype, lengths not
 * divisible by the rank count, ranks and blocks without rows, offsets, strided tensors, with
 * and without dLSE, the plan leaving rows out (strong decay) and the full exchange. */
TEST(backward_suite_1_rank)
{
	NEED_MPIRUN();
	suite(_metadata, 1, "--backward");
}

TEST(backward_suite_2_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 2, "--backward");
}

TEST(backward_suite_3_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 3, "--backward");
}

TEST(backward_suite_4_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 4, "--backward");
}

/* The backward in sub-blocks of 8 query rows (--chunk 8), each with its own cut: the suite
 * still passes everywhere. */
TEST(backward_suite_sub_blocks_3_ranks)
{
	NEED_MPIRUN();
	suite(_metadata, 3, "--backward --chunk 8");
}

/* Sub-blocks leave far keys of a large block out (fewer pairs than one piece per block), within
 * the tolerance: L = 2048 on 4 ranks, the seed's decay, 64-row sub-blocks. */
TEST(backward_sub_blocks_cut_far_keys)
{
	char *out = malloc(OUT_CAP), line[2048];
	const char *args[2] = { "-L 2048 -H 2 -D 64 --shard zigzag --check --backward --seed 4",
				"-L 2048 -H 2 -D 64 --shard zigzag --check --backward --seed 4 "
				"--chunk 64" };
	double pairs[2] = { 0, 0 };
	const int np = 4;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	for (int i = 0; i < 2; i++) {
		ASSERT_EQ(0, drive(np, args[i], out));
		for (int r = 0; r < np; r++) {
			ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
			ASSERT_EQ(1, field(line, "ok"));
			ASSERT_LE(field(line, "err_dk"), 1);
			ASSERT_LE(field(line, "err_dp"), 1);
			pairs[i] += field(line, "pairs_computed");
		}
	}
	TH_LOG("pairs computed by the backward: %.0f in whole blocks, %.0f in sub-blocks", pairs[0],
	       pairs[1]);
	ASSERT_LT(pairs[1], 0.75 * pairs[0]);
	free(out);
}

/* Every rank checks the gradients and dparams agree bit for bit, in every case of a suite. */
TEST(backward_dparams_identical_on_every_rank)
{
	char *out = malloc(OUT_CAP), line[2048], args[128];
	const int np = 4;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args), "-L 203 --decay 1.5 --noncausal --check --backward --dlse");
	ASSERT_EQ(0, drive(np, args, out));
	for (int r = 0; r < np; r++) {
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		ASSERT_EQ(1, field(line, "dp_same"));
		ASSERT_GT(field(line, "rows_unneeded"), 0); /* the plan did leave rows out */
		ASSERT_LE(field(line, "err_dp"), 1);
		ASSERT_LE(field(line, "err_dk"), 1);
	}
	free(out);
}

/* Two runs of the same problem give bit-identical dparams (and on every rank). */
TEST(backward_deterministic_across_runs)
{
	char *out = malloc(OUT_CAP), line[2048];
	const char *args = "-L 300 -H 4 --hkv 2 --shard zigzag --backward --dlse --seed 5";
	char hash[3][4][32];
	const int np = 3;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	for (int run = 0; run < 2; run++) {
		ASSERT_EQ(0, drive(np, args, out));
		for (int r = 0; r < np; r++) {
			const char *p;

			ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
			ASSERT_EQ(1, field(line, "dp_same"));
			p = strstr(line, " dp_hash=");
			ASSERT_NE(NULL, p);
			snprintf(hash[run][r], sizeof(hash[run][r]), "%.20s", p + 9);
			hash[run][r][strcspn(hash[run][r], " ")] = 0;
			ASSERT_STREQ(hash[0][0], hash[run][r]);
		}
	}
	free(out);
}

/* The seed's decay at the target's shape (smaller L): the backward moves K and V exactly as the
 * forward's plan does (at most two blocks' worth), and sends back the gradients of exactly the
 * rows it received: grad_bytes_sent = bytes_received, grad_bytes_received = bytes_sent (f32
 * inputs, float32 dK and dV). */
TEST(backward_returns_gradients_of_planned_rows_only)
{
	const int np = 4;
	const int64_t L = 2048, H = 2, D = 64, row_bytes = 2 * H * D * (int64_t)sizeof(float);
	char *out = malloc(OUT_CAP), line[2048], args[256];

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args),
		 "-L %" PRId64 " -H %" PRId64 " -D %" PRId64 " --shard zigzag --check --backward",
		 L, H, D);
	ASSERT_EQ(0, drive(np, args, out));
	for (int r = 0; r < np; r++) {
		ape_mpi_shard_info sh;
		int64_t biggest;

		ASSERT_EQ(0, ape_mpi_shard(L, np, r, APE_MPI_SHARD_ZIGZAG, &sh));
		biggest = sh.count[0] > sh.count[1] ? sh.count[0] : sh.count[1];
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		TH_LOG("%s", line);
		ASSERT_EQ(1, field(line, "ok"));
		ASSERT_LE(field(line, "bytes_sent"), 2.0 * (double)(biggest * row_bytes));
		ASSERT_EQ(field(line, "grad_bytes_sent"), field(line, "bytes_received"));
		ASSERT_EQ(field(line, "grad_bytes_received"), field(line, "bytes_sent"));
		ASSERT_GT(field(line, "rows_unneeded"), 0);
	}
	free(out);
}

/* Arguments of the backward wrong or different on one rank (after a forward that succeeded):
 * every rank returns the same APE_EINVAL naming that rank and the field; nothing hangs. */
TEST(backward_mismatch_on_one_rank)
{
	static const struct mismatch cases[] = {
		{ "bwd-delta", "desc->delta", 3, 2 },
		{ "bwd-dout", "dout", 4, 1 },
		{ "bwd-want", "the gradients wanted", 2, 1 },
		{ "bwd-want", "the gradients wanted", 3, 0 }, /* rank 0 is the odd one out */
	};

	NEED_MPIRUN();
	mismatches(_metadata, cases, sizeof(cases) / sizeof(cases[0]), "--backward",
		   "ape_mpi_attention_backward: ");
}

TEST(backward_refuses_without_mpi_init)
{
	ape_mpi_shard_info sh;
	int ret;

	ASSERT_EQ(0, ape_mpi_shard(4, 1, 0, APE_MPI_SHARD_CONTIGUOUS, &sh));
	ret = ape_mpi_attention_backward(MPI_COMM_WORLD, NULL, NULL, NULL, &sh, NULL, NULL, NULL,
					 NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
	ASSERT_EQ(APE_EINVAL, ret);
	ASSERT_NE(NULL, strstr(ape_mpi_last_error(), "ape_mpi_attention_backward: MPI is not "
						     "initialised"));
}

/* ---------------------------------------------------------------- several devices per rank */

/* ape_mpi_attention_forward_ex() with the same device twice per rank: the suite passes. */
TEST(forward_two_devices_per_rank)
{
	NEED_MPIRUN();
	suite(_metadata, 3, "--ndev 2");
}

/* Two OpenCL devices (the same one twice) per rank: each local piece is split over both by
 * ape_attention_forward_ex(); the result equals the single-process call. */
TEST(forward_two_opencl_devices_per_rank)
{
	char *out = malloc(OUT_CAP), line[2048];
	const int np = 2;
	int rc;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	rc = drive(np, "-L 300 --check --ndev 2 --backend opencl --shard zigzag", out);
	if (rc == 3) {
		free(out);
		SKIP(return, "no OpenCL device for the driver");
	}
	ASSERT_EQ(0, rc);
	for (int r = 0; r < np; r++) {
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		ASSERT_EQ(1, field(line, "ok"));
	}
	ASSERT_NE(NULL, strstr(out, " ndev=2"));
	free(out);
}
/* ---------------------------------------------------------------- the tools (item 5) */

/* Runs a command in dir (under timeout), output (stdout and stderr) into out; returns its exit
 * status. */
static int shell(const char *dir, const char *cmd, char *out)
{
	char full[4096];
	size_t n = 0;
	FILE *f;
	int st;

	snprintf(full, sizeof(full), "cd '%s' && timeout 300 %s 2>&1", dir, cmd);
	out[0] = 0;
	f = popen(full, "r");
	if (!f)
		return -1;
	while (n < OUT_CAP - 1) {
		size_t got = fread(out + n, 1, OUT_CAP - 1 - n, f);

		if (!got)
			break;
		n += got;
	}
	out[n] = 0;
	st = pclose(f);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void mpirun_prefix(char *buf, size_t cap, int np)
{
	snprintf(buf, cap, "'%s' %s--oversubscribe -np %d", mpirun(),
		 geteuid() == 0 ? "--allow-run-as-root " : "", np);
}

static int count(const char *hay, const char *needle)
{
	int n = 0;

	for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

/* A random [B, H, L, D] (or [H, L, D] when B == 0) array of dt saved at dir/name. */
static void save_random(struct __test_metadata *_metadata, const char *dir, const char *name,
			ape_dtype dt, int64_t B, int64_t H, int64_t L, int64_t D, uint64_t *state)
{
	const int64_t shape4[4] = { B, H, L, D }, shape3[3] = { H, L, D };
	const size_t n = (size_t)((B ? B : 1) * H * L * D);
	float *f = malloc(n * sizeof(float) + 1);
	uint16_t *h = malloc(n * sizeof(uint16_t) + 1);
	char path[512], err[256];

	ASSERT_TRUE(f && h);
	for (size_t i = 0; i < n; i++) {
		*state = *state * 6364136223846793005ull + 1442695040888963407ull;
		f[i] = (float)((double)(*state >> 11) / 9007199254740992.0 * 4 - 2);
	}
	if (dt != APE_F32)
		ape_convert(h, dt, f, APE_F32, n);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	ASSERT_EQ(0, npy_save(path, dt, B ? 4 : 3, B ? shape4 : shape3,
			      dt == APE_F32 ? (void *)f : (void *)h, err, sizeof(err)));
	free(f);
	free(h);
}

/* max |a - b| / max |a| over two .npy files of the same shape (a the reference). */
static double npy_rel(struct __test_metadata *_metadata, const char *dir, const char *fa,
		      const char *fb)
{
	struct npy_array a, b;
	char pa[512], pb[512], err[256];
	double M = 0, e = 0;

	snprintf(pa, sizeof(pa), "%s/%s", dir, fa);
	snprintf(pb, sizeof(pb), "%s/%s", dir, fb);
	if (npy_load(pa, &a, err, sizeof(err)) || npy_load(pb, &b, err, sizeof(err))) {
		TH_LOG("%s", err);
		return INFINITY;
	}
	if (a.info.count != b.info.count || a.info.dtype != b.info.dtype ||
	    a.info.ndim != b.info.ndim ||
	    memcmp(a.info.shape, b.info.shape, sizeof(int64_t) * (size_t)a.info.ndim))
		e = INFINITY;
	for (uint64_t i = 0; e == 0 && i < a.info.count; i++) {
		float x;

		ape_convert(&x, APE_F32, (char *)a.data + i * ape_dtype_size(a.info.dtype),
			    a.info.dtype, 1);
		M = fmax(M, fabs(x));
	}
	for (uint64_t i = 0; e != INFINITY && i < a.info.count; i++) {
		float x, y;

		ape_convert(&x, APE_F32, (char *)a.data + i * ape_dtype_size(a.info.dtype),
			    a.info.dtype, 1);
		ape_convert(&y, APE_F32, (char *)b.data + i * ape_dtype_size(b.info.dtype),
			    b.info.dtype, 1);
		e = fmax(e, x == y ? 0 : fabs((double)x - y) / fmax(M, 1e-30));
		if (e != e)
			e = INFINITY;
	}
	npy_free(&a);
	npy_free(&b);
	return e;
}

/*
 * `mpirun ape-run --mpi` equals `ape-run` on the same files: O, LSE and, with --backward, dQ,
 * dK, dV and dparams, on 1..4 ranks, both shard kinds, causal and not, GQA, f32 and f16, 3-D
 * and 4-D files, a length no rank count divides (and 3 rows on 4 ranks: ranks without rows).
 */
TEST(ape_run_mpi_equals_single_process)
{
	static const struct {
		ape_dtype dt;
		int64_t B, H, Hkv, L, D;
		const char *extra, *shard; /* options of both runs; --mpi's shard */
		int np;
	} cases[] = {
		{ APE_F32, 2, 4, 2, 37, 16, "", "", 3 },
		{ APE_F32, 1, 2, 2, 53, 8, "--no-causal", "", 4 },
		{ APE_F32, 0, 2, 1, 41, 8, "--delta 0.5,0.25", "--shard contiguous", 2 },
		{ APE_F16, 1, 2, 2, 45, 16, "--no-causal", "--shard zigzag", 3 },
		{ APE_F32, 1, 2, 2, 3, 8, "", "", 4 },
		{ APE_F32, 1, 2, 2, 29, 8, "--k-start 5 --q-start 9", "", 1 },
	};
	static const char *const outs[][2] = { { "o1.npy", "o2.npy" },	 { "l1.npy", "l2.npy" },
					       { "dq1.npy", "dq2.npy" }, { "dk1.npy", "dk2.npy" },
					       { "dv1.npy", "dv2.npy" }, { "dp1.npy", "dp2.npy" } };
	char dir[] = "/tmp/ape-mpi-run-XXXXXX", *out = malloc(OUT_CAP), cmd[3072], pre[512];
	uint64_t state = 12345;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	ASSERT_NE(NULL, mkdtemp(dir));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const char *files = "-q q.npy -k k.npy -v v.npy --backward do.npy";
		const double tol = cases[c].dt == APE_F32 ? 1e-4 : 1e-2;

		save_random(_metadata, dir, "q.npy", cases[c].dt, cases[c].B, cases[c].H,
			    cases[c].L, cases[c].D, &state);
		save_random(_metadata, dir, "k.npy", cases[c].dt, cases[c].B, cases[c].Hkv,
			    cases[c].L, cases[c].D, &state);
		save_random(_metadata, dir, "v.npy", cases[c].dt, cases[c].B, cases[c].Hkv,
			    cases[c].L, cases[c].D, &state);
		save_random(_metadata, dir, "do.npy", cases[c].dt, cases[c].B, cases[c].H,
			    cases[c].L, cases[c].D, &state);
		snprintf(cmd, sizeof(cmd),
			 "%s/bin/ape-run %s --backend ref %s -o o1.npy --lse l1.npy "
			 "--dq dq1.npy --dk dk1.npy --dv dv1.npy --dparams dp1.npy",
			 APE_BUILD_DIR, files, cases[c].extra);
		if (shell(dir, cmd, out))
			TH_LOG("%s\n%s", cmd, out);
		ASSERT_EQ(0, shell(dir, cmd, out));
		mpirun_prefix(pre, sizeof(pre), cases[c].np);
		snprintf(cmd, sizeof(cmd),
			 "%s %s/bin/ape-run --mpi %s --backend ref %s %s -o o2.npy --lse l2.npy "
			 "--dq dq2.npy --dk dk2.npy --dv dv2.npy --dparams dp2.npy",
			 pre, APE_BUILD_DIR, files, cases[c].extra, cases[c].shard);
		if (shell(dir, cmd, out))
			TH_LOG("%s\n%s", cmd, out);
		ASSERT_EQ(0, shell(dir, cmd, out));
		for (size_t i = 0; i < sizeof(outs) / sizeof(outs[0]); i++) {
			double e = npy_rel(_metadata, dir, outs[i][0], outs[i][1]);

			if (e > (i < 2 ? tol : 10 * tol))
				TH_LOG("case %zu (%d ranks %s): %s: %g", c, cases[c].np,
				       cases[c].extra, outs[i][0], e);
			ASSERT_LE(e, i < 2 ? tol : 10 * tol);
		}
	}
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	ASSERT_EQ(0, system(cmd));
	free(out);
}

/* Bad input: every rank exits with 2 and says why; no output file, no temporary file left. The
 * --stats lines name every rank, with the plan's counts. */
TEST(ape_run_mpi_bad_input_and_stats)
{
	char dir[] = "/tmp/ape-mpi-bad-XXXXXX", *out = malloc(OUT_CAP), cmd[2048], pre[512];
	uint64_t state = 99;
	const int np = 3;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	ASSERT_NE(NULL, mkdtemp(dir));
	save_random(_metadata, dir, "q.npy", APE_F32, 1, 2, 40, 8, &state);
	save_random(_metadata, dir, "k.npy", APE_F32, 1, 2, 40, 8, &state);
	save_random(_metadata, dir, "v.npy", APE_F32, 1, 2, 40, 8, &state);
	save_random(_metadata, dir, "short.npy", APE_F32, 1, 2, 39, 8, &state);
	mpirun_prefix(pre, sizeof(pre), np);
	/* a truncated file, a file of another length, a parameter the library refuses, an
	 * option --mpi does not take */
	static const struct {
		const char *setup, *args, *says;
	} bad[] = {
		{ "head -c 300 k.npy > cut.npy", "-q q.npy -k cut.npy -v v.npy", "cut.npy: " },
		{ "true", "-q q.npy -k short.npy -v v.npy", "--mpi shards one sequence" },
		{ "true", "-q q.npy -k k.npy -v v.npy --lambda -1", "lambda" },
		{ "true", "-q q.npy -k k.npy -v v.npy --kv-cache 1", "--kv-cache: not taken" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ASSERT_EQ(0, shell(dir, bad[i].setup, out));
		snprintf(cmd, sizeof(cmd), "%s %s/bin/ape-run --mpi %s -o o.npy --lse l.npy", pre,
			 APE_BUILD_DIR, bad[i].args);
		ASSERT_EQ(2, shell(dir, cmd, out));
		if (count(out, "ape-run --mpi: ") != np || !strstr(out, bad[i].says))
			TH_LOG("%s\n%s", cmd, out);
		ASSERT_EQ(np, count(out, "ape-run --mpi: "));
		ASSERT_NE(NULL, strstr(out, bad[i].says));
		shell(dir, "sh -c \"ls -A | grep -c 'o.npy\\|l.npy\\|ape-mpi-'\"", out);
		ASSERT_EQ(0, atoi(out));
	}
	snprintf(cmd, sizeof(cmd), "%s %s/bin/ape-run --mpi -q q.npy -k k.npy -v v.npy -o o.npy "
		 "--stats --backend ref", pre, APE_BUILD_DIR);
	ASSERT_EQ(0, shell(dir, cmd, out));
	for (int r = 0; r < np; r++) {
		char want[64];

		snprintf(want, sizeof(want), "ape-run --mpi: forward: rank %d: rows ", r);
		ASSERT_NE(NULL, strstr(out, want));
	}
	ASSERT_EQ(np, count(out, ", blocks proved unneeded "));
	ASSERT_EQ(np, count(out, ", bytes sent "));
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	ASSERT_EQ(0, system(cmd));
	free(out);
}

/* ape-bench --mpi: generated inputs under ape-bench's option names, a line per rank with the
 * bytes and blocks; bad input exits 2 with a message from every rank. */
TEST(ape_bench_mpi)
{
	char *out = malloc(OUT_CAP), cmd[2048], pre[512], line[2048];
	const int np = 4;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	mpirun_prefix(pre, sizeof(pre), np);
	snprintf(cmd, sizeof(cmd), "%s %s/bin/ape-bench --mpi --len 2048 --heads 2 --head-dim 64 "
		 "--shard zigzag --check", pre, APE_BUILD_DIR);
	ASSERT_EQ(0, shell("/", cmd, out));
	for (int r = 0; r < np; r++) {
		ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
		ASSERT_EQ(1, field(line, "ok"));
		ASSERT_GT(field(line, "bytes_sent"), 0);
		ASSERT_GE(field(line, "blocks_unneeded"), 0);
		ASSERT_GT(field(line, "rows_unneeded"), 0);
	}
	ASSERT_NE(NULL, strstr(out, "L=2048 B=1 H=2 Hkv=2 D=64"));
	snprintf(cmd, sizeof(cmd), "%s %s/bin/ape-bench --mpi --len 64 --heads 3 --kv-heads 2",
		 pre, APE_BUILD_DIR);
	ASSERT_EQ(2, shell("/", cmd, out));
	ASSERT_EQ(np, count(out, "ape-bench --mpi: rank "));
	ASSERT_NE(NULL, strstr(out, "not divisible by Hkv"));
	snprintf(cmd, sizeof(cmd), "%s %s/bin/ape-bench --mpi --len x", pre, APE_BUILD_DIR);
	ASSERT_EQ(2, shell("/", cmd, out));
	ASSERT_EQ(np, count(out, "ape-bench --mpi: "));
	free(out);
}

TEST_HARNESS_MAIN
