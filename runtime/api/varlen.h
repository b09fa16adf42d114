/* SPDX-License-Identifier: MIT */
/* What the ragged-batch calls (api/varlen.c forward, api/varlen_bwd.c backward,
 * api/resident_varlen.c on device tensors) share: the batch's validation, its positions, runs
 * and segments, and the pieces' statistics. */
#ifndef APE_RUNTIME_API_VARLEN_H
#define APE_RUNTIME_API_VARLEN_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

/*
 * The call's arguments before any work: vl (struct_size, num_seqs, both offset arrays named
 * with index and value), desc (no q_start_set, k_start 0: positions come from vl), opts
 * (no trace), the packed tensors as one dense problem of B = 1 (shapes, types, strides,
 * overlaps, parameters: *p, which the caller frees with ape__problem_fini() on success), and
 * every sequence's distances (APE_EOVERFLOW naming the sequence). lse may be NULL.
 */
/* The parts of ape__varlen_check() the device-resident call shares: vl and desc (before the
 * tensors), then the batch against the packed tensors' problem *p (B = 1, naming q_name's
 * shape[0] otherwise; the offsets against p's totals; the distances). */
int ape__varlen_check_desc(const char *fn, const ape_attn_desc *desc, const ape_varlen *vl);
int ape__varlen_check_batch(const char *fn, const ape_varlen *vl, const struct ape__problem *p,
			    const char *q_name);
int ape__varlen_check(const char *fn, const ape_attn_desc *desc, const ape_varlen *vl,
		      const ape_exec_options *opts, const ape_tensor *q, const ape_tensor *k,
		      const ape_tensor *v, const ape_tensor *o, const float *lse,
		      struct ape__problem *p);

/* ape_attention_forward_varlen_ex() and ape_attention_backward_varlen(), their messages
 * starting with fn (the DLPack forms, api/dlpack.c, call them on kDLCPU tensors). */
int ape__attention_forward_varlen(const char *fn, ape_device *const *devs, int ndev,
				  const ape_exec_options *opts, const ape_attn_desc *desc,
				  const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				  const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats);
int ape__attention_backward_varlen(const char *fn, ape_device *const *devs, int ndev,
				   const ape_exec_options *opts, const ape_attn_desc *desc,
				   const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				   const ape_tensor *v, const ape_tensor *o, const float *lse,
				   const ape_tensor *dout, const float *dlse, ape_tensor *dq,
				   ape_tensor *dk, ape_tensor *dv, float *dparams, ape_stats *stats);

/* The position of query row i, key row j (packed indices) of sequence s: vl's, or the
 * defaults (keys 0.., queries end-aligned). */
int64_t ape__varlen_qpos(const ape_varlen *vl, int64_t s, int64_t i);
int64_t ape__varlen_kpos(const ape_varlen *vl, int64_t s, int64_t j);
/* The end of the run of consecutive positions (steps of +1) of sequence s's query (query
 * true) or key rows that starts at row a, at most `end`. */
int64_t ape__varlen_run_end(const ape_varlen *vl, bool query, int64_t s, int64_t a,
			    int64_t end);
/* Whether a query of rows [a, b) of sequence s can see the key run starting at kc. */
bool ape__varlen_run_visible(const ape_varlen *vl, bool causal, int64_t s, int64_t a, int64_t b,
			     int64_t kc);

/*
 * A validated batch as segments (struct ape_be_seg: each query run with the one key run it sees,
 * lk = 0 for a run that sees no key), in row order, into *out (malloc'd, owned by the caller)
 * and *nout: returns 1; 0 when some query run sees several key runs (positions with gaps or
 * repeats among a sequence's keys), *out untouched; or APE_ENOMEM (message naming fn).
 */
int ape__varlen_segments(const char *fn, const ape_varlen *vl, bool causal,
			 struct ape_be_seg **out, int64_t *nout);

/* Whether the key ranges of segments sg[0 .. n-1] that have keys are pairwise disjoint (what a
 * ragged backward launch requires: core/backend.h, struct ape_be_bwd_launch): 1 or 0; -1 out
 * of host memory (the message names fn). */
int ape__varlen_keys_disjoint(const char *fn, const struct ape_be_seg *sg, int64_t n);

/* Do all of devs run a ragged batch in one launch (struct ape_be_ape_be_caps_have(&caps, APE_BE_CAP_SEGMENTS)), and with
 * `positions`, one whose positions are explicit (.positions)? */
bool ape__varlen_devices_take(ape_device *const *devs, int ndev, bool positions);

/* One ragged launch's explicit positions: every query row's (q, total_q entries) and key row's
 * (k, total_k entries), the caller's arrays or the defaults materialised (owned: the own_*
 * ones, freed by ape__varlen_pos_free()). */
struct ape__varlen_pos {
	const int64_t *q, *k;
	int64_t *own_q, *own_k;
};

void ape__varlen_pos_free(struct ape__varlen_pos *x);

/*
 * A validated batch as one segment per sequence with query rows (its rows against all its
 * keys; q_start and k_start unused) into *out (malloc'd, owned by the caller) and *nout, and
 * the positions of every row and key into *pos (struct ape__problem.pos_q and .pos_k), for
 * devices that read explicit positions (ape__varlen_devices_take(.., true)): positions that
 * are not runs (gaps, repeats, any order) are still one launch. 0, or APE_ENOMEM (message
 * naming fn; nothing to free).
 */
int ape__varlen_build_positions(const char *fn, const ape_varlen *vl, struct ape_be_seg **out,
				int64_t *nout, struct ape__varlen_pos *pos);

/* The pieces' statistics: x added to *t (the first taken whole; paths joined); at the end of
 * call fn (ret: what it returns, p its problem), the sum reported into the caller's stats
 * (NULL, or its struct_size kept; only when ret is 0) with the call's wall time since t0,
 * and the call's line logged (api/stats.h). */
void ape__varlen_add_stats(ape_stats *t, bool *have, const ape_stats *x);
void ape__varlen_report(const char *fn, ape_device *const *devs, int ndev,
			const struct ape__problem *p, int ret, ape_stats *stats, ape_stats *sum,
			bool have, double t0);

#pragma GCC visibility pop
#endif
