// SPDX-License-Identifier: MIT
/*
 * The tools over MPI (issue 17, item 5): ape-run --mpi against the single-process ape-run on
 * the same .npy files, its bad input and statistics, ape-bench --mpi. Without mpirun every test
 * says SKIP and why. (The library itself: test_mpi.c, test_mpi_backward.c.)
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

/* ---------------------------------------------------------------- the tools (item 5) */

/* Runs a command in dir (under timeout), output (stdout and stderr) into out; returns its exit
 * status. */
static int shell(const char *dir, const char *cmd, char *out)
{
	char full[4096];

	snprintf(full, sizeof(full), "cd '%s' && timeout 300 %s 2>&1", dir, cmd);
	return capture(full, out);
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

/*
 * APE_TRACE over MPI (docs/profiling.md, "Traces"): each rank writes its own session trace
 * ("%p": its process id), with its MPI steps as ranges named after the rank around the calls
 * they make, and ape-trace merge puts the ranks on one timeline, each on tracks of its own.
 */
TEST(ape_run_mpi_trace_per_rank_merges)
{
	char dir[] = "/tmp/ape-mpi-trace-XXXXXX", *out = malloc(OUT_CAP), cmd[2048], pre[512];
	uint64_t state = 7;
	const int np = 2;

	NEED_MPIRUN();
	ASSERT_NE(NULL, out);
	ASSERT_NE(NULL, mkdtemp(dir));
	save_random(_metadata, dir, "q.npy", APE_F32, 1, 2, 40, 8, &state);
	save_random(_metadata, dir, "k.npy", APE_F32, 1, 2, 40, 8, &state);
	save_random(_metadata, dir, "v.npy", APE_F32, 1, 2, 40, 8, &state);
	mpirun_prefix(pre, sizeof(pre), np);
	snprintf(cmd, sizeof(cmd), "%s -x APE_TRACE='%s/rank.%%p.json' %s/bin/ape-run --mpi -q q.npy "
		 "-k k.npy -v v.npy -o o.npy --backend ref", pre, dir, APE_BUILD_DIR);
	ASSERT_EQ(0, shell(dir, cmd, out)) TH_LOG("%s\n%s", cmd, out);
	ASSERT_EQ(0, shell(dir, "sh -c 'ls rank.*.json | wc -l'", out));
	ASSERT_EQ(np, atoi(out));
	snprintf(cmd, sizeof(cmd), "%s/bin/ape-trace merge -o all.json rank.*.json", APE_BUILD_DIR);
	ASSERT_EQ(0, shell(dir, cmd, out)) TH_LOG("%s", out);
	ASSERT_EQ(0, shell(dir, "cat all.json", out));
	for (int r = 0; r < np; r++) {
		char want[128];

		snprintf(want, sizeof(want), "\"name\":\"ape_mpi exchange and compute (rank %d of %d)\"",
			 r, np);
		EXPECT_EQ(1, count(out, want)) TH_LOG("%s", want);
		snprintf(want, sizeof(want), "\"name\":\"ape_mpi forward (rank %d of %d)\"", r, np);
		EXPECT_EQ(1, count(out, want)) TH_LOG("%s", want);
	}
	/* every rank's local computations are calls in its own file, on its own tracks */
	EXPECT_LE(np, count(out, "\"cat\":\"call\""));
	EXPECT_EQ(1, count(out, "\"pid\":0,\"args\":{\"name\":\"rank."));
	EXPECT_EQ(1, count(out, "\"pid\":1000,\"args\":{\"name\":\"rank."));
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
