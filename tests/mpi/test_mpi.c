// SPDX-License-Identifier: MIT
/*
 * libape_mpi (issue 17). The shard arithmetic and the refusal without MPI_Init run here; every
 * distributed case runs the driver (build/bin/ape-mpi-run) under `mpirun --oversubscribe -np N`,
 * which compares each rank's rows with the single-process call over the whole sequence and
 * prints one line per rank; these tests read those lines. A run that hangs is killed by
 * `timeout` and fails. Without mpirun every such test says SKIP and why.
 * The backward under mpirun: test_mpi_backward.c; the tools' --mpi: test_mpi_tools.c.
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
#include "mpitest.h"
#include "mpi_suite.h"

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
		{ "table", "desc->bias_table", 3, 2 }, /* not taken by the distributed call */
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
TEST_HARNESS_MAIN
