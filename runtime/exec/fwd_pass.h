/* SPDX-License-Identifier: MIT */
/*
 * The forward pass (exec/pass.h) of one device: query chunks outer, key chunks walked from the
 * diagonal outward, a direction closed as soon as the skip bound proves the rest of it
 * negligible; partial results merged by their LSE on the device (attention_merge) and read back
 * once per query chunk, or on the host where the backend cannot merge, or written as they are
 * when one key chunk covers every key.
 */
#ifndef APE_RUNTIME_FWD_PASS_H
#define APE_RUNTIME_FWD_PASS_H

#include "core/limits.h"
#include "exec/lse_merge.h"
#include "exec/pass.h"
#include "exec/problem.h"
#include "exec/skip.h"
#include "exec/skip_budget.h"

#pragma GCC visibility push(hidden)

/* One forward call, read-only: the devices' passes share it. */
struct ape__fwd_call {
	const struct ape__problem *p;
	const ape_tensor *q, *k, *v; /* k, v: NULL with a loader (the KV cache) */
	ape_tensor *o; /* rows of finished query chunks are written here (strides p->os) ... */
	float *lse; /* ... and here ([B, H, Lq]); NULL: not wanted */
	/* ... and the diagnostics here ([B, H, Lq] each; NULL: not wanted; only on devices whose
	 * backend computes them) */
	float *ent, *md;
	bool diag; /* the launches compute the diagnostics (ent, md; the KV cache's session plans
		    * room for them without a call that wants them) */
	bool want_pairs; /* count the pairs computed (statistics) */
	bool force_merge; /* partial results in float32 even with one key chunk (the KV cache's
			   * session, planned once for any later length) */
	const struct ape__kmax *kmax; /* NULL: no chunk-level skipping */
	struct ape__skip_budget tol; /* the shares of skip_tol (exec/skip_budget.h) */
	bool release; /* the call is a KV cache's that may release blocks (tol's release share) */
	/* on a device that reads host memory, launches with one key chunk write their rows of o
	 * and lse in place (the call's own staging, or the caller's outputs, which a failure then
	 * leaves unspecified: struct ape__stream_stats.in_place says whether a job had them) */
	bool in_place;
};

enum ape__fwd_mode {
	APE__FWD_DIRECT, /* one key chunk: O in the caller's type, written as it comes */
	APE__FWD_HOST_MERGE, /* partial results back per job, merged on the host */
	APE__FWD_DEVICE_MERGE, /* merged on the device, back once per query chunk */
};

/* The pass's tensors. */
enum {
	APE__F_Q, APE__F_K, APE__F_V, /* inputs */
	APE__F_O, APE__F_LSE, APE__F_PAIRS, APE__F_ENT, APE__F_MD, /* one launch's outputs */
	APE__F_AO, APE__F_ALSE, APE__F_APAIRS, APE__F_AENT, APE__F_AMD, /* a query chunk's merge */
	APE__F_PRM64, APE__F_PRM32, /* the parameter tables (struct ape_be_launch.params) */
	APE__F_COUNT
};

struct ape__fwd_slot {
	struct ape__acc acc; /* the host merge, or (device merge with skipping) the LSE alone */
	float *qnorm; /* [B*H*cq] for the skip bound */
	struct ape__walk walk;
	int64_t o0, n; /* its query chunk's rows */
	int64_t chunk; /* the walk's next key chunk, handed out but not yet issued */
	int dir;
	bool held; /* chunk and dir hold it */
	int jobs; /* launches issued */
	int64_t klo, khi; /* a ragged call: the keys the chunk's rows see, [klo, khi) */
};

struct ape__fwd {
	struct ape__pass pass;
	const struct ape__fwd_call *c;
	struct ape_device *dev;
	int mode; /* enum ape__fwd_mode */
	int64_t cq, ck, nq, nk; /* the chunking */
	bool prior; /* launches after a chunk's first test against its merged LSE (lse_prior) */
	struct ape_be_launch tmpl; /* what every launch shares */
	struct ape__skip_ctx skip;
	struct ape__fwd_slot slot[APE__MAX_DEPTH];
	/* a ragged call: one launch's segments, clipped (p->nseg at most; launches of a pass
	 * are issued by one thread) */
	struct ape_be_seg *segs;
	/* the pass's own figures */
	uint64_t pairs_computed, chunks_skipped;
	struct ape_be_path_log paths; /* the kernel paths its launches took */
	/* the LSE ([B, H, Lq] floats) as a tensor, for writing it in place */
	ape_tensor lse_t;
	int64_t lse_s[4];
};

/* The pass of one device for call c, before any plan (its shape() serves the planner). */
void ape__fwd_init(struct ape__fwd *f, const struct ape__fwd_call *c, struct ape_device *dev);
/*
 * After planning: the chunking of this call (cq x ck rows, nq x nk chunks) and o_slots outer
 * slots: sets the tensors, the launch template and the host memory of each slot. APE_ENOMEM
 * (message set) when host memory runs out.
 */
int ape__fwd_prepare(struct ape__fwd *f, int64_t cq, int64_t ck, int64_t nq, int64_t nk,
		     int o_slots);
/* Frees what prepare allocated. Accepts a pass never prepared. */
void ape__fwd_fini(struct ape__fwd *f);

/* The merge mode of a call with nk key chunks on dev. */
int ape__fwd_mode_of(const struct ape__fwd_call *c, struct ape_device *dev, int64_t nk);

#pragma GCC visibility pop
#endif
