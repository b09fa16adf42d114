/* SPDX-License-Identifier: MIT */
/* What the forward entry points (api/forward.c) share with the other calls on host tensors
 * (api/backward.c): the checks of devices, options and statistics. */
#ifndef APE_RUNTIME_API_FORWARD_H
#define APE_RUNTIME_API_FORWARD_H

#include <stdbool.h>

#include "ape/ape.h"

#pragma GCC visibility push(hidden)

/* devs (1..APE_MAX_DEVICES, none NULL), stats->struct_size and every field of opts (NULL:
 * defaults), as ape_attention_forward_ex() checks them; messages start with fn and name the
 * argument. */
int ape__check_exec_call(const char *fn, ape_device *const *devs, int ndev,
			 const ape_exec_options *opts, const ape_stats *stats);

/* The diagnostics a call wants (docs/diagnostics.md): each NULL, or B*H*Lq floats. */
struct ape__diag_req {
	float *ent, *md;
};

/* With diagnostics wanted: every device's capabilities say diag (else APE_ENOTSUP
 * naming the first that does not), and p->skip_tol is tightened to APE_DIAG_SKIP_TOL (the skip
 * bound of docs/diagnostics.md). Without: nothing. Shared with api/kvcache_attend.c. */
struct ape__problem;
int ape__diag_prepare(const char *fn, ape_device *const *devs, int ndev,
		      struct ape__problem *p, const struct ape__diag_req *dg);
/* What ape__diag_prepare() does when diagnostics are wanted; on_device: for device-resident
 * tensors (ape_attention_enqueue_diag()), where they must also say diag_views. */
int ape__diag_devices(const char *fn, ape_device *const *devs, int ndev, bool on_device,
		      struct ape__problem *p);

/*
 * The executor's run of a validated problem p (Lq, Lk >= 1; a ragged one too, p->segs) on
 * devs, options opts checked: O through p->os into o, LSE [B, H, Lq] into lse (or NULL), the
 * diagnostics dg, the pair counts when want_pairs; APE_EXEC_ATOMIC_OUTPUTS staged here.
 * staged: o and lse are already the caller's own staging (a ragged call's). On a device that
 * reads host memory, launches with one key chunk write o and lse in place (a failure then
 * leaves the rows of unfinished query chunks unspecified, and the message says so unless
 * staged). The executor's figures in *res. Returns 0 or a negative code with the message set.
 */
struct ape__exec_result;
int ape__forward_call(const char *fn, ape_device *const *devs, int ndev,
		      const ape_exec_options *opts, const struct ape__problem *p,
		      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
		      float *lse, const struct ape__diag_req *dg, bool want_pairs, bool staged,
		      struct ape__exec_result *res);

#pragma GCC visibility pop
#endif
