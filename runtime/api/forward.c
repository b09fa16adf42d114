/* SPDX-License-Identifier: MIT */
/*
 * The forward entry points: validate, handle the shapes that need no device, hand the rest to
 * the executor (runtime/exec/forward.c), report statistics (runtime/api/stats.c).
 *
 * There is one code path. A problem that fits one chunk pair is the executor's single-chunk
 * case: one query chunk, one key chunk, the same launch as a one-shot call, and its outputs are
 * written only once everything succeeded. On a device whose kernels read host memory the
 * executor reads the inputs where they lie, at any chunking.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/forward.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"
#include "exec/plan.h"
#include "api/forward.h"
#include "api/positions.h"
#include "api/stats.h"
#include "api/validate.h"
#include "api/varlen.h"

#define APE_REAL double
#include "ape/ape_math.h"
#include "core/verbose.h"

void ape_exec_options_init(ape_exec_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
}

/* ------------------------------------------------------------------ validation */

static int check_devices(const char *fn, ape_device *const *devs, int ndev)
{
	if (!devs)
		return ape__error(APE_EINVAL, "%s: devs = NULL", fn);
	if (ndev < 1 || ndev > APE_MAX_DEVICES)
		return ape__error(APE_EINVAL, "%s: ndev = %d: must be 1..%d", fn, ndev,
				  APE_MAX_DEVICES);
	for (int i = 0; i < ndev; i++)
		if (!devs[i])
			return ape__error(APE_EINVAL, "%s: devs[%d] = NULL", fn, i);
	return 0;
}

/* The trace file's directory must exist: found out before any work, not after. */
static int check_trace_path(const char *fn, const char *path)
{
	const char *slash;
	char dir[4096];
	struct stat st;

	if (!*path)
		return ape__error(APE_EINVAL, "%s: opts->trace_path = \"\": must name a file", fn);
	slash = strrchr(path, '/');
	if (!slash)
		return 0;
	snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path) + 1, path);
	if (stat(dir, &st) || !S_ISDIR(st.st_mode))
		return ape__error(APE_EINVAL,
				  "%s: opts->trace_path = \"%s\": directory %s does not exist", fn,
				  path, dir);
	if (slash[1] == '\0')
		return ape__error(APE_EINVAL, "%s: opts->trace_path = \"%s\": is a directory", fn,
				  path);
	return 0;
}

static int check_options(const char *fn, const ape_exec_options *o, int ndev)
{
	if (!o)
		return 0;
	if (o->struct_size != sizeof(*o))
		return ape__error(APE_EINVAL,
				  "%s: opts->struct_size = %zu: expected %zu (initialise with "
				  "ape_exec_options_init())",
				  fn, o->struct_size, sizeof(*o));
	if (o->chunk_q < 0 || o->chunk_k < 0)
		return ape__error(APE_EINVAL,
				  "%s: opts->%s = %" PRId64 ": must be >= 0 (0: %d rows)", fn,
				  o->chunk_q < 0 ? "chunk_q" : "chunk_k",
				  o->chunk_q < 0 ? o->chunk_q : o->chunk_k, APE__CHUNK_DEFAULT);
	if (o->pipeline_depth < 0 || o->pipeline_depth > APE__MAX_DEPTH)
		return ape__error(APE_EINVAL, "%s: opts->pipeline_depth = %d: must be 1..%d (0: %d)",
				  fn, o->pipeline_depth, APE__MAX_DEPTH, APE__DEFAULT_DEPTH);
	if (o->flags & ~(APE_EXEC_ATOMIC_OUTPUTS | APE_EXEC_COPY_INPUTS))
		return ape__error(APE_EINVAL, "%s: opts->flags = 0x%x: unknown flags 0x%x", fn,
				  o->flags,
				  o->flags & ~(APE_EXEC_ATOMIC_OUTPUTS | APE_EXEC_COPY_INPUTS));
	for (int i = 0; o->device_weights && i < ndev; i++)
		if (!isfinite(o->device_weights[i]) || !(o->device_weights[i] > 0))
			return ape__error(APE_EINVAL,
					  "%s: opts->device_weights[%d] = %g: must be finite and > 0",
					  fn, i, o->device_weights[i]);
	if (o->trace_path)
		return check_trace_path(fn, o->trace_path);
	return 0;
}

/* ------------------------------------------------------------------ shapes without a device */

/* Rows with no key at all (Lk = 0): O = 0, LSE = -inf, ENT = MD = 0. */
static void write_empty(const struct ape__problem *p, ape_tensor *o, float *lse,
			const struct ape__diag_req *dg)
{
	ape__store_empty_rows(o, p->os, lse, dg->ent, dg->md, p->Lq, 0, p->Lq);
}

int ape__diag_prepare(const char *fn, ape_device *const *devs, int ndev,
		      struct ape__problem *p, const struct ape__diag_req *dg)
{
	if (!dg->ent && !dg->md)
		return 0;
	return ape__diag_devices(fn, devs, ndev, false, p);
}

int ape__diag_devices(const char *fn, ape_device *const *devs, int ndev, bool on_device,
		      struct ape__problem *p)
{
	for (int i = 0; i < ndev; i++) {
		const struct ape_be_caps *caps = &devs[i]->caps;

		if (!ape_be_caps_have(caps, APE_BE_CAP_DIAG) ||
		    (on_device && !ape_be_caps_have(caps, APE_BE_CAP_DIAG_VIEWS)))
			return ape__error(APE_ENOTSUP,
					  "%s: %s:%d (%s) does not compute the diagnostics "
					  "(entropy, mean_distance)%s yet",
					  fn, devs[i]->info.backend, devs[i]->info.backend_index,
					  devs[i]->info.name,
					  ape_be_caps_have(caps, APE_BE_CAP_DIAG) ? " on device tensors" : "");
	}
	/* docs/diagnostics.md, "Skipping": the bound holds the diagnostics to the spec's
	 * tolerance at this skip_tol */
	if (p->skip_tol > APE_DIAG_SKIP_TOL)
		p->skip_tol = APE_DIAG_SKIP_TOL;
	return 0;
}

/* ------------------------------------------------------------------ the call */

/* Host copies of O, LSE and the diagnostics that the call writes, for
 * APE_EXEC_ATOMIC_OUTPUTS. */
struct staged {
	void *o;
	float *lse, *ent, *md;
	ape_tensor t;
	int64_t s[4];
};

static void unstage(struct staged *sg)
{
	free(sg->o);
	free(sg->lse);
	free(sg->ent);
	free(sg->md);
}

static int stage_outputs(const char *fn, const struct ape__problem *p, bool lse,
			 const struct ape__diag_req *dg, struct staged *sg)
{
	const size_t rows = (size_t)(p->B * p->H * p->Lq);

	memset(sg, 0, sizeof(*sg));
	sg->o = ape__malloc(rows * (size_t)p->D * ape_dtype_size(p->out_dtype) + 1);
	sg->lse = lse ? ape__malloc(rows * sizeof(float) + 1) : NULL;
	sg->ent = dg->ent ? ape__malloc(rows * sizeof(float) + 1) : NULL;
	sg->md = dg->md ? ape__malloc(rows * sizeof(float) + 1) : NULL;
	if (!sg->o || (lse && !sg->lse) || (dg->ent && !sg->ent) || (dg->md && !sg->md)) {
		unstage(sg);
		return ape__error(APE_ENOMEM, "%s: out of host memory staging the outputs", fn);
	}
	ape_tensor_init(&sg->t, sg->o, p->out_dtype, p->B, p->H, p->Lq, p->D);
	ape_tensor_strides(&sg->t, sg->s);
	return 0;
}

int ape__forward_call(const char *fn, ape_device *const *devs, int ndev,
		      const ape_exec_options *opts, const struct ape__problem *p,
		      const ape_tensor *q, const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
		      float *lse, const struct ape__diag_req *dg, bool want_pairs, bool staged,
		      struct ape__exec_result *res)
{
	const bool atomic_out = opts && (opts->flags & APE_EXEC_ATOMIC_OUTPUTS);
	struct ape__problem pp = *p;
	struct ape__fwd_req r = {
		.fn = fn,
		.devs = devs,
		.ndev = ndev,
		.chunk_q = opts && opts->chunk_q ? opts->chunk_q : APE__CHUNK_DEFAULT,
		.chunk_k = opts && opts->chunk_k ? opts->chunk_k : APE__CHUNK_DEFAULT,
		.budget = opts ? opts->max_device_bytes : 0,
		.depth = opts && opts->pipeline_depth ? opts->pipeline_depth : APE__DEFAULT_DEPTH,
		.weights = opts ? opts->device_weights : NULL,
		.trace_path = opts ? opts->trace_path : NULL,
		.copy_inputs = opts && (opts->flags & APE_EXEC_COPY_INPUTS),
		.p = &pp,
		.q = q,
		.k = k,
		.v = v,
		.o = o,
		.lse = lse,
		.ent = dg->ent,
		.md = dg->md,
		.want_pairs = want_pairs,
		.staged = staged,
	};
	struct staged sg;
	int ret;

	if (!atomic_out || staged)
		return ape__forward_run(&r, res);
	ret = stage_outputs(fn, p, lse != NULL, dg, &sg);
	if (ret)
		return ret;
	/* the executor writes the staging copy, laid out contiguously */
	memcpy(pp.os, sg.s, sizeof(pp.os));
	r.o = &sg.t;
	r.lse = sg.lse;
	r.ent = sg.ent;
	r.md = sg.md;
	r.staged = true;
	ret = ape__forward_run(&r, res);
	if (!ret) {
		const size_t fb = (size_t)(p->B * p->H * p->Lq) * sizeof(float);

		ape__unpack_rows(sg.o, o, p->os, 0, p->Lq);
		if (lse)
			memcpy(lse, sg.lse, fb);
		if (dg->ent)
			memcpy(dg->ent, sg.ent, fb);
		if (dg->md)
			memcpy(dg->md, sg.md, fb);
	}
	unstage(&sg);
	return ret;
}

static int forward(const char *fn, ape_device *const *devs, int ndev,
		   const ape_exec_options *opts, const ape_attn_desc *desc, const ape_tensor *q,
		   const ape_tensor *k, const ape_tensor *v, ape_tensor *o, float *lse,
		   const struct ape__diag_req *dg, ape_stats *stats)
{
	const double t0 = ape__now_ms();
	const bool logs = ape__call_logs(devs, ndev);
	struct ape__exec_result res;
	struct ape__problem p;
	uint64_t per_head;
	int ret;

	if ((ret = ape__stats_check(fn, stats)) || (ret = check_options(fn, opts, ndev)))
		return ret;
	if ((ret = ape__problem_init_pos(&p, fn, desc, q, k, v, o, lse)))
		return ret;
	if (p.pos_q && (dg->ent || dg->md))
		ret = ape__error(APE_EINVAL,
				 "%s: desc->pos_q = %p: the diagnostics take no explicit positions yet",
				 fn, (const void *)p.pos_q);
	if (ret || (ret = ape__check_diag_outputs(fn, &p, q, k, v, o, lse, dg->ent, dg->md)) ||
	    (ret = ape__diag_prepare(fn, devs, ndev, &p, dg)) ||
	    (ret = ape__problem_head_pairs(fn, &p, &per_head))) {
		ape__problem_fini(&p);
		return ret;
	}
	memset(&res, 0, sizeof(res));
	if (p.B * p.H * p.Lq == 0) {
		ret = 0; /* empty result: nothing to write */
	} else if (p.Lk == 0) {
		write_empty(&p, o, lse, dg);
	} else if (p.pos_q && !ape__varlen_devices_take(devs, ndev, true)) {
		/* explicit positions the kernels do not read: runs of consecutive ones */
		ret = ape__forward_positions(fn, devs, ndev, opts, desc, &p, q, k, v, o, lse, stats,
					     t0);
		ape__problem_fini(&p);
		return ret;
	} else {
		ret = ape__forward_call(fn, devs, ndev, opts, &p, q, k, v, o, lse, dg,
					stats != NULL, false, &res);
	}
	if (stats || logs) {
		const struct ape__call_report rep = {
			.fn = fn,
			.p = &p,
			.ret = ret,
			.pairs_uncounted = !stats && p.B * p.H * p.Lq > 0 && p.Lk > 0,
			.res = &res,
			.devs = devs,
			.ndev = ndev,
			.devices = p.B * p.H * p.Lq > 0 && p.Lk > 0 ? ndev : 0,
			.pairs_visible = per_head * (uint64_t)(p.B * p.H),
			.t0 = t0,
		};

		ape__call_done(stats, &rep);
	}
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_forward(ape_device *dev, const ape_attn_desc *desc, const ape_tensor *q,
			  const ape_tensor *k, const ape_tensor *v, ape_tensor *o, float *lse,
			  ape_stats *stats)
{
	APE__API_CALL("ape_attention_forward");
	static const char fn[] = "ape_attention_forward";

	const struct ape__diag_req none = { NULL, NULL };

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	return forward(fn, &dev, 1, NULL, desc, q, k, v, o, lse, &none, stats);
}

int ape_attention_forward_ex(ape_device *const *devs, int ndev, const ape_exec_options *opts,
			     const ape_attn_desc *desc, const ape_tensor *q, const ape_tensor *k,
			     const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats)
{
	APE__API_CALL("ape_attention_forward_ex");
	static const char fn[] = "ape_attention_forward_ex";
	const struct ape__diag_req none = { NULL, NULL };
	int ret = check_devices(fn, devs, ndev);

	if (ret)
		return ret;
	return forward(fn, devs, ndev, opts, desc, q, k, v, o, lse, &none, stats);
}

int ape_attention_forward_diag(ape_device *const *devs, int ndev, const ape_exec_options *opts,
			       const ape_attn_desc *desc, const ape_tensor *q,
			       const ape_tensor *k, const ape_tensor *v, ape_tensor *o,
			       float *lse, float *entropy, float *mean_distance,
			       ape_stats *stats)
{
	APE__API_CALL("ape_attention_forward_diag");
	static const char fn[] = "ape_attention_forward_diag";
	const struct ape__diag_req dg = { entropy, mean_distance };
	int ret = check_devices(fn, devs, ndev);

	if (ret)
		return ret;
	return forward(fn, devs, ndev, opts, desc, q, k, v, o, lse, &dg, stats);
}

/* ------------------------------------------------------------------ shared with api/backward.c */

int ape__check_exec_call(const char *fn, ape_device *const *devs, int ndev,
			 const ape_exec_options *opts, const ape_stats *stats)
{
	int ret = check_devices(fn, devs, ndev);

	if (!ret)
		ret = ape__stats_check(fn, stats);
	return ret ? ret : check_options(fn, opts, ndev);
}
