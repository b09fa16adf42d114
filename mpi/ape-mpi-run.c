/* SPDX-License-Identifier: MIT */
/*
 * ape-mpi-run: drives ape_mpi_attention_forward() under mpirun, for the tests and the
 * measurements (ape-run --mpi and ape-bench --mpi come later). Inputs are generated from a
 * counter-based hash of (seed, tensor, b, h, global row, d), so every rank makes its own rows and
 * the same sequence whatever the rank count. With --check each rank also runs its rows as one
 * single-process ape_attention_forward() over the whole sequence and compares.
 *
 *   mpirun -np 4 ape-mpi-run -L 262144 -H 2 -D 64 --shard zigzag          # the target run
 *   mpirun -np 3 ape-mpi-run --suite 20                                    # the tests' suite
 *   mpirun -np 4 ape-mpi-run -L 64 --check --corrupt delta --corrupt-rank 2
 *
 * Rank 0 prints one line per rank (gathered, so lines never interleave): rank=R ret=NAME and
 * key=value statistics, and for --suite one line per case and a total.
 *
 * This file holds main(); mpi/driver/ the options, the inputs, a case, its backward and the
 * suite (mpi/driver/driver.h).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape/ape_mpi.h"
#include "driver/driver.h"
#include "mpi_files.h"

int driver_rank, driver_nranks;
int driver_last_ret;
bool driver_bench;

/* This process is rank 0 of its launch, as Open MPI's or a PMI launcher's environment says, or
 * was started without one. */
static bool first_rank(void)
{
	static const char *const vars[] = { "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK" };

	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
		if (getenv(vars[i]))
			return atoi(getenv(vars[i])) == 0;
	return true;
}

int main(int argc, char **argv)
{
	struct args a = { .suite = -1, .backend = "ref" };
	struct cfg c, cases[32];
	int pass = 0, total = 0, ret, bad;
	ape_context *ctx = NULL;
	ape_selection sel;
	uint64_t seed;
	char err[256];

	/* ape-run --mpi execs ape-mpi-run --files ARGS: ape-run's options on .npy files */
	if (argc > 1 && !strcmp(argv[1], "--files")) {
		argv[1] = argv[0];
		return ape_mpi_files_main(argc - 1, argv + 1);
	}
	/* ape-bench --mpi execs ape-mpi-run --bench ARGS: this driver, named as the tool, with
	 * a message about bad input on every rank and exit status 2 for a case the library
	 * refuses (bad input) */
	if (argc > 1 && !strcmp(argv[1], "--bench")) {
		argv[1] = argv[0];
		argc--;
		argv++;
		driver_bench = true;
	}
	/* Options are checked before MPI starts, so that --help and --version need no mpirun;
	 * they are read again below, over the defaults of the run's seed. */
	c = driver_base(0);
	bad = driver_parse(argc, argv, &c, &a, err, sizeof(err));
	if (!bad && a.help) {
		driver_usage(stdout);
		return 0;
	}
	if (bad && driver_bench) {
		/* ape-bench --mpi: every rank says it, so MPI starts first (mpirun ends the job at
		 * the first non-zero exit status: every rank prints before any exits) */
		MPI_Init(&argc, &argv);
		fprintf(stderr, "ape-bench --mpi: %s\n", err);
		MPI_Barrier(MPI_COMM_WORLD);
		MPI_Finalize();
		return 2;
	}
	if (bad) {
		/* before MPI starts (nothing to finalise, nothing of MPI's left behind); once, from
		 * the first rank as the launcher numbers them, or from a process started alone */
		if (first_rank())
			fprintf(stderr, "ape-mpi-run: %s\n", err);
		return 2;
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &driver_rank);
	MPI_Comm_size(MPI_COMM_WORLD, &driver_nranks);
	/* one seed for all ranks: rank 0's, from APE_TEST_SEED or the clock */
	seed = getenv("APE_TEST_SEED") ? strtoull(getenv("APE_TEST_SEED"), NULL, 0)
				       : (uint64_t)time(NULL);
	MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
	c = driver_base(seed);
	c.check = false;
	c.what = "run";
	a = (struct args){ .suite = -1, .backend = "ref" };
	driver_parse(argc, argv, &c, &a, err, sizeof(err)); /* accepted above */
	ret = ape_context_create(&ctx, NULL);
	if (!ret)
		ret = ape_device_select(ctx, a.backend, -1, &sel);
	if (ret) {
		if (driver_rank == 0)
			fprintf(stderr, "ape-mpi-run: %s: %s\n", ape_err_name(ret), ape_last_error());
		ape_context_destroy(ctx);
		MPI_Finalize();
		return 3;
	}
	if (driver_rank == 0)
		printf("# ape-mpi-run: %d ranks, seed %" PRIu64 ", %s\n", driver_nranks, seed,
		       sel.note);
	if (a.suite < 0) {
		total = 1;
		pass = driver_run_case(&c, sel.device, a.corrupt_what, a.corrupt_rank, !a.quiet);
	} else {
		int n = driver_builtin(seed, cases);

		for (int i = 0; i < n + a.suite; i++, total++) {
			struct cfg cc = i < n ? cases[i] : driver_random_case(seed, i);

			cc.backward = c.backward;
			cc.with_dlse = c.with_dlse || i % 2;
			cc.ndev = c.ndev;
			cc.chunk = c.chunk;

			pass += driver_run_case(&cc, sel.device, NULL, 0, false);
		}
	}
	if (driver_rank == 0)
		printf("# %d of %d cases passed on %d ranks\n", pass, total, driver_nranks);
	ape_context_destroy(ctx);
	MPI_Finalize();
	return pass == total ? 0 : driver_bench && driver_last_ret == APE_EINVAL ? 2 : 1;
}
