/* SPDX-License-Identifier: MIT */
/*
 * The distributed calls' pieces (ape_mpi_attention_forward() and _backward()), what crosses
 * their files: mpi/forward.c (the call: agreement, plan, the results written, the public entry
 * points), mpi/check.c (each rank's own arguments, checked by libape), mpi/exchange.c (the
 * non-blocking exchange of key rows, and of the backward's gradients going back) and
 * mpi/compute.c (the local pieces, the forward's merge by LSE and the backward's sums).
 */
#ifndef APE_MPI_CALL_H
#define APE_MPI_CALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "mpi_internal.h"

#pragma GCC visibility push(hidden)

/* A key block of one rank as this rank holds it: rows [c0, c1) of the global sequence. */
struct kv_block {
	int64_t c0, c1;
	ape_tensor k, v; /* [B, Hkv, c1 - c0, D], local views or a received buffer */
	void *buf; /* received rows (K then V), or NULL for local ones */
	int pieces_left;
	/* the backward: where dK and dV of these rows are summed, [B, Hkv, grows, D] each, row
	 * c0 at row goff */
	double *gk, *gv;
	int64_t grows, goff;
};

struct call {
	MPI_Comm comm;
	int rank, size;
	struct ape__mpi_geom g;
	const ape_mpi_shard_info *sh;
	ape_device *const *devs;
	int ndev;
	const ape_exec_options *opts;
	ape_attn_desc dglob; /* q_start resolved and set */
	const ape_tensor *q, *k;
	size_t esize;
	int64_t need[2][2]; /* this rank's query blocks: key rows [lo, hi) they need */
	int64_t *needs; /* [size][4]: every rank's */
	float *kall, *kglob; /* key-norm bounds: [size][2][B Hkv] gathered, [nblocks][B Hkv] */
	float *prm; /* delta, beta, gamma, lambda per head */
	double *qsum; /* one query block's largest |q| and log-denominator bound, [2][B H] */
	/* the merge: per local row (b, h, i), running max, sum and accumulator */
	double *m, *s;
	float *acc;
	float *oc, *lc; /* one piece's output */
	ape_mpi_stats st;
	uint64_t vis_remote; /* key rows of other ranks visible to this rank's rows */
	int err; /* first local failure; its message is in msg */
	char msg[APE__MPI_MSG];
	/* the backward (bwd false in the forward) */
	bool bwd;
	int want; /* APE__MPI_WANT_* */
	const ape_tensor *o, *dout;
	const float *lse, *dlse;
	double *gq; /* dQ of this rank's rows, [B, H, rows, D] */
	double *gk, *gv; /* dK, dV of this rank's key rows, [B, Hkv, rows, D] */
	double *gp; /* this rank's share of the parameter gradients, 4 H */
	float *pq, *pk, *pv, *pp, *pdl; /* one piece's gradients, and its rows of dLSE */
	int64_t pk_rows; /* rows pk and pv hold */
};

/* What a call writes on success: the forward's O and LSE, or the backward's gradients. */
struct outputs {
	ape_tensor *o;
	float *lse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
};

static inline double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Where local block lb of a shard starts among the rank's rows. */
static inline int64_t block_off(const ape_mpi_shard_info *sh, int lb)
{
	return lb == 0 ? 0 : sh->count[0];
}

/* ---- check.c: each returns 0 or a code with the message set (ape__mpi_error) */

/* Every argument of this rank, checked by libape itself; sets c->dglob (q_start resolved). */
int ape__mpi_check_local(struct call *c, const ape_attn_desc *desc, const ape_mpi_shard_info *sh,
			 const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
			 const ape_tensor *o, float *lse, const ape_mpi_stats *stats);
/* The backward's own arguments (after ape__mpi_check_local()). */
int ape__mpi_check_local_bwd(struct call *c, const ape_tensor *q, const ape_tensor *k,
			     const ape_tensor *v, const ape_tensor *o, const float *lse,
			     const ape_tensor *dout, const float *dlse, const struct outputs *out);

/* ---- exchange.c */

/* The exchange of key rows k, v after the plan, every block computed as it comes (and the
 * backward's gradients returned): 0, APE_ENOMEM (agreed by every rank before anything moves)
 * or an MPI failure. A local computation's failure is kept in c->err and c->msg for the
 * agreement that follows. */
int ape__mpi_exchange(struct call *c, const ape_tensor *k, const ape_tensor *v);

/* ---- compute.c */

/* Computes every query block of this rank against the rows of kb it needs: the forward merges
 * each piece into c's running max, sum and accumulator, the backward adds its gradients. */
void ape__mpi_compute_block(struct call *c, const struct kv_block *kb);
/* Adds n rows of src (float32 [B, nh, n, D]) into rows [off, off + n) of dst ([B, nh, rows, D]
 * in float64): the one order every sum of pieces takes. */
void ape__mpi_add_rows(const struct call *c, int64_t nh, const float *src, int64_t n, double *dst,
		       int64_t rows, int64_t off);

#pragma GCC visibility pop

#endif
