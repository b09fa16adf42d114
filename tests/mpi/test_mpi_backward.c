// SPDX-License-Identifier: MIT
/*
 * libape_mpi's backward (issue 17, item 3) under `mpirun --oversubscribe -np N` through the
 * driver (build/bin/ape-mpi-run), which compares each rank's gradients with the single-process
 * call over the whole sequence and prints one line per rank; these tests read those lines.
 * Without mpirun every such test says SKIP and why. (The forward: test_mpi.c.)
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

TEST_HARNESS_MAIN
