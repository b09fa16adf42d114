/* SPDX-License-Identifier: MIT */
/*
 * ape-mpi-run's pieces (the driver of ape_mpi_attention_forward() and _backward() for the tests
 * and the measurements): mpi/ape-mpi-run.c (main), mpi/driver/args.c (the options, --help),
 * mpi/driver/inputs.c (the generated inputs, the same rows whatever the rank count),
 * mpi/driver/case.c (one case on every rank, checked against the single-process call),
 * mpi/driver/backward.c (a case's distributed backward, checked likewise) and
 * mpi/driver/suite.c (a case's defaults, the built-in and the random cases). Linked into
 * ape-mpi-run alone, with mpi/mpi-files.c (--files).
 */
#ifndef APE_MPI_DRIVER_H
#define APE_MPI_DRIVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ape/ape_mpi.h"

/* One case: the problem, its sharding and what to check. */
struct cfg {
	int64_t L, B, H, Hkv, D;
	ape_dtype dt, odt;
	ape_mpi_shard_kind kind;
	bool causal, per_head, strided, check;
	bool backward, with_dlse; /* --backward: the distributed backward after the forward */
	int ndev; /* devices per rank: the selected one, ndev times */
	int64_t chunk; /* --chunk: opts->chunk_q and chunk_k (0: libape's default) */
	double delta, beta, gamma, lambda, skip_tol;
	bool q_start_set;
	int64_t q_start, k_start;
	uint64_t seed;
	const char *what;
};

/* A case on this rank: its shard, its tensors (this rank's rows) and the call's desc. */
struct run {
	ape_mpi_shard_info sh;
	void *q, *k, *v, *o;
	float *lse, *params;
	ape_tensor tq, tk, tv, to;
	ape_attn_desc desc;
};

/* What the command line says besides the case. */
struct args {
	int suite, corrupt_rank;
	const char *backend, *corrupt_what;
	bool quiet, help;
};

/* This process's rank and the rank count in MPI_COMM_WORLD (set by main() after MPI_Init). */
extern int driver_rank, driver_nranks;
/* The last case's return code (the same on every rank). */
extern int driver_last_ret;
/* Run as ape-bench --mpi (ape-mpi-run --bench ARGS). */
extern bool driver_bench;

/* ---- args.c */

void driver_usage(FILE *f);
/* Every option into c and a (--version answered by the tools' walker). 0, or APE_EINVAL with
 * the message in err. */
int driver_parse(int argc, char **argv, struct cfg *c, struct args *a, char *err, size_t len);

/* ---- inputs.c */

/* A 64-bit mix (splitmix64's finaliser): the hash the inputs and the random cases come from. */
uint64_t driver_mix(uint64_t x);
/* N(0, 1) for element (b, h, l, d) of tensor t: the same on every rank for a global row l. */
float driver_gen(uint64_t seed, int t, int64_t b, int64_t h, int64_t l, int64_t d);
/* The global row of this rank's local row i. */
int64_t driver_global_row(const ape_mpi_shard_info *sh, int64_t i);
/* Element (b, h, l, d) of t as a double, through its strides and type; and stored from x. */
double driver_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d);
void driver_set(ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d, float x);
/* [B, H, L, D], or stored as [B, L, H, D] when strided; NULL data for no memory. */
void *driver_alloc_tensor(ape_tensor *t, ape_dtype dt, int64_t B, int64_t H, int64_t L,
			  int64_t D, bool strided);
/* Tensor id's generated values into t: the rows of sh, or every row of the sequence (NULL). */
void driver_fill(const struct cfg *c, ape_tensor *t, int id, const ape_mpi_shard_info *sh);
/* This rank's shard, inputs, outputs and desc for case c: 0 or a libape code. */
int driver_setup(const struct cfg *c, struct run *r);
void driver_teardown(struct run *r);

/* ---- backward.c */

/* The distributed backward of this rank's rows after its forward (mpi/driver/backward.c). */
int driver_backward_case(const struct cfg *c, struct run *r, ape_device *dev,
			 const ape_exec_options *eo, const char *corrupt_what, ape_mpi_stats *st,
			 double err[4], int *same, uint64_t *hash);

/* ---- case.c */

/* One case on every rank; 1 when it passed on every rank (mpi/driver/case.c). */
int driver_run_case(const struct cfg *c, ape_device *dev, const char *corrupt_what,
		    int corrupt_rank, bool print_ranks);

/* ---- suite.c */

/* A case's defaults (the seed's parameters: common/seed.h), its inputs from seed. */
struct cfg driver_base(uint64_t seed);
/* The cases every rank count runs into out (room for 32); their count. */
int driver_builtin(uint64_t seed, struct cfg *out);
/* Random case i of the suite of seed. */
struct cfg driver_random_case(uint64_t seed, int i);

#endif
