/* SPDX-License-Identifier: MIT */
/*
 * Chunk-level skipping: the order in which a query chunk visits key chunks (from the diagonal
 * outward), and the proof that the key chunks left in one direction carry negligible weight,
 * with the bound of docs/kernels.md applied to whole chunks. Pure functions on host data.
 */
#ifndef APE_RUNTIME_SKIP_H
#define APE_RUNTIME_SKIP_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* Largest key norm per (batch, kv head) and key chunk, as prefix and suffix maxima: "the
 * largest norm among all chunks left in this direction" is one load. NaN norms count as +inf,
 * so chunks holding a NaN or Inf key are never skipped. */
struct ape__kmax {
	int64_t nbg, nk;
	float *pre; /* [nbg][nk]: max over chunks 0..c */
	float *suf; /* [nbg][nk]: max over chunks c..nk-1 */
};

int ape__kmax_alloc(struct ape__kmax *km, int64_t nbg, int64_t nk);
void ape__kmax_free(struct ape__kmax *km);
/* pre[] holds each chunk's own maximum: turns pre and suf into the running maxima. */
void ape__kmax_scan(struct ape__kmax *km);
/* From host keys k (element strides ks) in chunks of ck rows: one pass over K. */
int ape__kmax_from_tensor(struct ape__kmax *km, const ape_tensor *k, const int64_t ks[4],
			  int64_t ck);

/* Euclidean norm of D floats, in double, rounded up to float; NaN gives +inf. */
float ape__norm(const float *x, int64_t D);

/* What holds for a whole call. */
struct ape__skip_ctx {
	int64_t B, H, Hkv, Lk, ck, k_start;
	bool causal;
	double abs_scale;
	const float *head_params; /* delta, beta, gamma, lambda per head */
	/* NULL, or the call's bias table's suffix maxima (struct ape__problem.bias_smax): the
	 * bound adds the largest entry at or beyond the nearest distance */
	const float *bias_smax;
	int64_t bias_len, bias_hstride;
	const struct ape__kmax *km;
	double tol; /* weight allowed per direction, relative to the computed weight */
};

/* One query chunk, with what has been merged of it so far. */
struct ape__skip_rows {
	int64_t n; /* rows per (b, h) */
	int64_t pos0; /* position of its row 0 */
	const float *qnorm; /* [B*H*n] */
	const double *m, *s; /* merged so far: LSE = m + ln s (m = -inf: nothing yet) */
};

/*
 * True when every row of the query chunk may leave out the key chunks remaining in direction
 * dir (-1: chunks 0..c, +1: chunks c..nk-1): for each row, count * exp(U - LSE) <= tol with U
 * the score bound at the nearest of those keys. Only valid when every head's decays are >= 0.
 */
bool ape__skip_tail(const struct ape__skip_ctx *c, const struct ape__skip_rows *r, int64_t chunk,
		    int dir);

/* The key chunks of one query chunk in the order they are computed. */
struct ape__walk {
	int64_t nk, diag;
	int64_t lo, hi; /* next chunk backward / forward */
	bool back, fwd; /* directions still open */
	bool started; /* the diagonal chunk was handed out */
	int turn; /* direction of the next chunk when both are open */
};

/* The walk of the query chunk with rows at positions [pos_first, pos_last]. A chunk no row can
 * see (causal) is left out, unless `keep_one`: then a walk that would be empty still hands out
 * the nearest chunk (a whole problem of one chunk pair launches as a one-shot call would). */
void ape__walk_init(struct ape__walk *w, int64_t pos_first, int64_t pos_last, int64_t Lk,
		    int64_t ck, int64_t k_start, bool causal, bool keep_one);
/* The next key chunk and its direction (0: the diagonal, never skipped); false when done. */
bool ape__walk_next(struct ape__walk *w, int64_t *chunk, int *dir);
/* Closes direction dir at `chunk` (just returned by ape__walk_next): that chunk and every one
 * beyond it are skipped. Returns how many chunks that is. */
int64_t ape__walk_close(struct ape__walk *w, int dir, int64_t chunk);

#pragma GCC visibility pop
#endif
