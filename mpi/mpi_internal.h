/* SPDX-License-Identifier: MIT */
/*
 * libape_mpi's internals: the error message, the agreement between ranks and the transfer plan.
 * Everything here is built on libape's public API only (libape itself knows nothing of MPI).
 */
#ifndef APE_MPI_INTERNAL_H
#define APE_MPI_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape_mpi.h"

#pragma GCC visibility push(hidden)

/* The public function being called on this thread ("ape_mpi_attention_forward" or
 * "ape_mpi_attention_backward"): every message starts with it. */
extern _Thread_local const char *ape__mpi_fn;
#define APE__MPI_FN ape__mpi_fn

/* Sets the per-thread message (printf format) and returns err. */
int ape__mpi_error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The message buffer itself, for copying messages between ranks. */
char *ape__mpi_msgbuf(size_t *cap);
/* An MPI failure: "WHAT: <MPI's error string>", APE_EIO. */
int ape__mpi_fail(int mpi_err, const char *what);

/* Rows [start, start + count) of part i when L rows are cut into m nearly equal parts. */
void ape__mpi_part(int64_t L, int64_t m, int64_t i, int64_t *start, int64_t *count);

/* ---- agreement (agree.c) */
#define APE__MPI_MSG 320

/* What one rank contributes: its local status and message, and the fields all ranks must share. */
struct ape__mpi_digest {
	int32_t status;
	int32_t rank;
	int64_t field[22];
	char msg[APE__MPI_MSG];
};

/* The gradients a backward call wants (a digest field; 0 for the forward). */
enum { APE__MPI_WANT_DQ = 1, APE__MPI_WANT_DK = 2, APE__MPI_WANT_DV = 4, APE__MPI_WANT_DP = 8 };

/* Fills the digest's fields from this rank's arguments (already validated locally); want: the
 * gradients a backward call wants, 0 for the forward. */
void ape__mpi_digest_fill(struct ape__mpi_digest *dg, const ape_attn_desc *desc,
			  const ape_mpi_shard_info *sh, const ape_tensor *q, const ape_tensor *k,
			  const ape_tensor *o, int want);
/* Given every rank's digest: 0 when all are fine and agree; otherwise the same code and message
 * (set with ape__mpi_error) on every rank that looks at the same array. */
int ape__mpi_verdict(const struct ape__mpi_digest *all, int n);

/* ---- the plan (plan.c) */

/* Everything the plan needs to know about the call, the same on every rank. */
struct ape__mpi_geom {
	int64_t L, B, H, Hkv, D;
	int nranks, nblocks; /* nblocks: blocks of the whole sequence (nranks or 2 nranks) */
	ape_mpi_shard_kind kind;
	int64_t q0, k0; /* positions of global query row 0 and key row 0 */
	bool causal;
	double abs_scale;
	const float *prm; /* delta, beta, gamma, lambda per head (4 H floats) */
	bool can_skip; /* every head's delta, beta, gamma >= 0 and skip_tol > 0 */
	double tol_plan; /* the share of skip_tol the plan may spend per row */
};

/* Global block b: its rows, its owner and the owner's local block index. */
void ape__mpi_block(const struct ape__mpi_geom *g, int b, int64_t *start, int64_t *count,
		    int *owner, int *lb);
/* The global block index of local block lb of rank r. */
int ape__mpi_block_of(const struct ape__mpi_geom *g, int r, int lb);

/*
 * Per-row summaries of this rank's query block: the largest |q| and the smallest lower bound of
 * the row's log-denominator (from its own key at the same global row), per (batch, head).
 * q, k: this rank's tensors; rows [off, off + n) of them are the block at global row g0.
 */
int ape__mpi_query_summary(const struct ape__mpi_geom *g, const ape_tensor *q,
			   const ape_tensor *k, int64_t off, int64_t n, double *qmax,
			   double *lse_lb);
/* Largest |k| per (batch, kv head) over rows [off, off + n) of k; NaN or Inf gives +inf. */
int ape__mpi_key_max(const struct ape__mpi_geom *g, const ape_tensor *k, int64_t off, int64_t n,
		     float *kmax);

/* The end of the keys [0, end) that query rows [a, a + n) of g see, by the mask alone
 * (ape/ape_math.h's ape_visible_keys() of the last row; 0 for no rows). */
int64_t ape__mpi_visible_end(const struct ape__mpi_geom *g, int64_t a, int64_t n);
/*
 * The key rows [*lo, *hi) a query block of global rows [a, a + n) needs: everything else is
 * invisible (causal) or proved negligible. kmax: [nblocks][B * Hkv] of every block; qmax, lse_lb
 * from ape__mpi_query_summary(). An empty result has *lo == *hi.
 */
void ape__mpi_needed(const struct ape__mpi_geom *g, const float *kmax, const double *qmax,
		     const double *lse_lb, int64_t a, int64_t n, int64_t *lo, int64_t *hi);

#pragma GCC visibility pop

#endif
