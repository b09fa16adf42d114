/* SPDX-License-Identifier: MIT */
/*
 * A forward call on tensors already in device memory (runtime/exec/resident.c): the path of
 * ape_attention_enqueue() and of the DLPack call. Launches are enqueued on one queue on strided
 * views of the caller's buffers: no staging, no copy, no wait. (Host calls on devices that
 * compute on host memory take the streaming executor, which reads their inputs in place.)
 */
#ifndef APE_RUNTIME_RESIDENT_H
#define APE_RUNTIME_RESIDENT_H

#include "core/backend.h"
#include "exec/problem.h"

#pragma GCC visibility push(hidden)

struct ape__resident_req {
	const char *fn; /* for messages */
	struct ape_device *dev;
	struct ape_be_queue *q; /* a queue of dev */
	const struct ape__problem *p; /* validated; B*H*Lq >= 1 and Lk >= 1 */
	struct ape_be_buf *buf[APE_BE_T_COUNT]; /* q, k, v, o, and lse or NULL */
	struct ape_be_view view[APE_BE_T_COUNT]; /* where each lies in its buffer, validated */
	struct ape_be_buf *pairs; /* NULL, or [B,H,Lq] uint64, contiguous (statistics) */
	uint64_t budget; /* device bytes the launches' scratch may take; 0: the device's default */
	/* the diagnostics, entropy [0] and mean distance [1] ([B,H,Lq] float), each NULL or where
	 * diag_view says; only for a backend that declares attention_diag_views */
	struct ape_be_buf *diag[2];
	struct ape_be_view diag_view[2];
	struct ape_be_path_log *paths; /* NULL, or where the launches note their kernel paths */
};

/*
 * The query rows per launch, by the one planner (exec/plan.h): all of them (one launch) when
 * the backend's scratch for the whole call fits the budget, else halved until it fits.
 * APE_ENOMEM (message naming the call, the device and what one row needs) when not even one
 * row fits. Never fails otherwise; enqueues nothing.
 */
int ape__resident_plan(const struct ape__resident_req *r, int64_t *rows_per_launch);

/*
 * Enqueues the call as launches of `rows` query rows each (from ape__resident_plan()) on r->q,
 * in row order, and returns without waiting. r->pairs must be NULL unless rows == p->Lq. A
 * ragged problem (p->segs, on a device with ape_be_ape_be_caps_have(&caps, APE_BE_CAP_SEGMENTS)) gives each launch the
 * segments of its rows (ape__segs_clip()); APE_ENOMEM when their host table cannot be had.
 * Explicit positions (p->pos_q, p->pos_k, on a device with .positions) give each launch the
 * positions of its rows (p->pos_q + its first row) and of every key (p->pos_k: each launch sees
 * them all).
 * Returns 0, or a negative code from the backend (message set, naming the device): launches
 * enqueued before the failure may still run; the outputs are then unspecified.
 */
int ape__resident_enqueue(const struct ape__resident_req *r, int64_t rows);

#pragma GCC visibility pop
#endif
