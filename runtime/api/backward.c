/* SPDX-License-Identifier: MIT */
/*
 * The backward entry points (include/ape/ape.h, "Training: the backward pass"): validate with
 * the forward's rules (api/validate.c) plus the gradients' own, handle the shapes that need no
 * device, hand the rest to the executor (exec/backward.c), report statistics.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "api/forward.h"
#include "api/positions.h"
#include "api/stats.h"
#include "api/validate.h"
#include "api/backward.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/backward.h"
#include "exec/pack.h"

/* Every argument of a backward call beyond the forward's, resolved. */
struct bwd_args {
	const ape_tensor *dout;
	const float *dlse;
	ape_tensor *dq, *dk, *dv;
	float *dparams;
	int64_t dout_s[4], dq_s[4], dk_s[4], dv_s[4];
};

int ape__check_backward_tensors(const char *fn, const struct ape__problem *p,
				const ape_tensor *q, const ape_tensor *k, const ape_tensor *v,
				const ape_tensor *o, const struct ape__bwd_tensors *t,
				struct ape__bwd_strides *s)
{
	static const char *const qdims[4] = { "B", "H", "Lq", "D" };
	static const char *const kdims[4] = { "B", "Hkv", "Lk", "D" };
	static const char *const ldims[4] = { "B", "H", "Lq", "1" };
	static const char *const pdims[4] = { "1", "1", "H", "4" };
	const char *in_names[7] = { "q", "k", "v", "o", "lse", "dout", "dlse" };
	const char *out_names[4] = { "dq", "dk", "dv", "dparams" };
	const int64_t lshape[4] = { p->B, p->H, p->Lq, 1 }, pshape[4] = { 1, 1, p->H, 4 };
	uintptr_t in[7][2], out[4][2] = { { 0, 0 }, { 0, 0 }, { 0, 0 }, { 0, 0 } };
	int64_t any[4];
	int ret;

	memset(s, 0, sizeof(*s));
	in[6][0] = in[6][1] = 0;
	/* q, k, v, o already valid: only their byte ranges are wanted */
	if ((ret = ape__check_tensor_span(fn, "q", q, p->in_dtype, false, q->shape, qdims, false,
					  any, in[0])) ||
	    (ret = ape__check_tensor_span(fn, "k", k, p->in_dtype, false, k->shape, kdims, false,
					  any, in[1])) ||
	    (ret = ape__check_tensor_span(fn, "v", v, p->in_dtype, false, k->shape, kdims, false,
					  any, in[2])) ||
	    (ret = ape__check_tensor_span(fn, "o", o, p->out_dtype, false, q->shape, qdims, false,
					  any, in[3])) ||
	    (ret = ape__check_tensor_span(fn, "lse", t->lse, APE_F32, false, lshape, ldims, false,
					  s->lse, in[4])) ||
	    (ret = ape__check_tensor_span(fn, "dout", t->dout, p->in_dtype, true, q->shape, qdims,
					  false, s->dout, in[5])) ||
	    (t->dlse && (ret = ape__check_tensor_span(fn, "dlse", t->dlse, APE_F32, false, lshape,
						      ldims, false, s->dlse, in[6]))))
		return ret;
	if ((t->dq && (ret = ape__check_tensor_span(fn, "dq", t->dq, p->in_dtype, true, q->shape,
						    qdims, true, s->dq, out[0]))) ||
	    (t->dk && (ret = ape__check_tensor_span(fn, "dk", t->dk, p->in_dtype, true, k->shape,
						    kdims, true, s->dk, out[1]))) ||
	    (t->dv && (ret = ape__check_tensor_span(fn, "dv", t->dv, p->in_dtype, true, k->shape,
						    kdims, true, s->dv, out[2]))) ||
	    (t->dparams && (ret = ape__check_tensor_span(fn, "dparams", t->dparams, APE_F32, false,
							 pshape, pdims, true, s->dparams,
							 out[3]))))
		return ret;
	for (int i = 0; i < 4; i++) {
		for (int j = 0; j < 7; j++)
			if ((ret = ape__check_disjoint(fn, out_names[i], out[i], in_names[j], in[j])))
				return ret;
		for (int j = 0; j < i; j++)
			if ((ret = ape__check_disjoint(fn, out_names[i], out[i], out_names[j],
						       out[j])))
				return ret;
	}
	return 0;
}

/*
 * dout, dq, dk, dv and dparams against the validated forward problem; then no output may
 * overlap an input (q, k, v, o, lse, dout, dlse) or an output checked before it. lse, dlse and
 * dparams are contiguous float arrays here.
 */
static int check_gradients(const char *fn, const struct ape__problem *p, const ape_tensor *q,
			   const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
			   const float *lse, struct bwd_args *a)
{
	ape_tensor lse_t, dlse_t, dp_t;
	struct ape__bwd_tensors t = { .lse = &lse_t, .dout = a->dout,
				      .dlse = a->dlse ? &dlse_t : NULL,
				      .dq = a->dq, .dk = a->dk, .dv = a->dv,
				      .dparams = a->dparams ? &dp_t : NULL };
	struct ape__bwd_strides s;
	int ret;

	ape_tensor_init(&lse_t, (void *)lse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_init(&dlse_t, (void *)a->dlse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_init(&dp_t, a->dparams, APE_F32, 1, 1, p->H, 4);
	if ((ret = ape__check_backward_tensors(fn, p, q, k, v, o, &t, &s)))
		return ret;
	memcpy(a->dout_s, s.dout, sizeof(s.dout));
	memcpy(a->dq_s, s.dq, sizeof(s.dq));
	memcpy(a->dk_s, s.dk, sizeof(s.dk));
	memcpy(a->dv_s, s.dv, sizeof(s.dv));
	return 0;
}

/* No key (Lk = 0) or no query row (Lq = 0): every wanted gradient is 0, no device needed. */
static void write_zeros(const struct ape__problem *p, const struct bwd_args *a)
{
	static const unsigned char zero_row[256 * 4]; /* D <= 256 elements of at most 4 bytes */
	ape_tensor *ts[3] = { a->dq, a->dk, a->dv };
	const int64_t *ss[3] = { a->dq_s, a->dk_s, a->dv_s };

	for (int t = 0; t < 3; t++)
		for (int64_t bh = 0; ts[t] && bh < ts[t]->shape[0] * ts[t]->shape[1]; bh++)
			for (int64_t l = 0; l < ts[t]->shape[2]; l++)
				ape__store_row(ts[t], ss[t], bh / ts[t]->shape[1],
					       bh % ts[t]->shape[1], l, zero_row);
	if (a->dparams)
		memset(a->dparams, 0, sizeof(float) * 4 * (size_t)p->H);
	if (p->dbias_table)
		memset(p->dbias_table, 0, sizeof(float) * (size_t)(ape__bias_rows(p) * p->bias_len));
}

void ape__bwd_call_done(const char *fn, ape_device *const *devs, int ndev,
			const struct ape__problem *p, int ret, const struct ape__bwd_result *res,
			uint64_t pairs_visible, double t0, ape_stats *stats)
{
	/* in the executor's terms, for the one statistics builder (api/stats.c) */
	struct ape__exec_result er;
	const struct ape__call_report rep = {
		.fn = fn, .p = p, .ret = ret, .res = &er, .devs = devs, .ndev = ndev,
		.devices = res ? res->devices : 0, .pairs_visible = pairs_visible, .t0 = t0,
	};

	if (!stats && !ape__call_logs(devs, ndev))
		return;
	memset(&er, 0, sizeof(er));
	if (res) {
		/* counted by the launches when they could skip keys; else every visible pair */
		er.pairs_computed = res->pairs_counted ? res->pairs_computed : pairs_visible;
		er.st.kernel_ms = res->kernel_ms;
		er.st.copy_ms = res->copy_ms;
		er.st.h2d = res->h2d;
		er.st.d2h = res->d2h;
		er.st.chunks = res->launches;
		er.st.peak_bytes = res->peak;
		er.cq = res->cq;
		er.ck = res->ck;
		er.depth = res->depth;
		er.budget = res->budget;
		er.paths = res->paths;
	}
	ape__call_done(stats, &rep);
}

static int backward(const char *fn, ape_device *const *devs, int ndev,
		    const ape_exec_options *opts, const ape_attn_desc *desc, const ape_tensor *q,
		    const ape_tensor *k, const ape_tensor *v, const ape_tensor *o, const float *lse,
		    struct bwd_args *a, ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__bwd_result res;
	struct ape__problem p;
	uint64_t per_head;
	bool on_device;
	int ret;

	if ((ret = ape__check_exec_call(fn, devs, ndev, opts, stats)))
		return ret;
	if (!lse)
		return ape__error(APE_EINVAL, "%s: lse = NULL: the backward pass needs the "
					      "forward's LSE", fn);
	if (!a->dq && !a->dk && !a->dv && !a->dparams && !ape__desc_wants_dbias(desc))
		return ape__error(APE_EINVAL,
				  "%s: dq, dk, dv, dparams and desc->dbias_table are all NULL: no "
				  "gradient is wanted",
				  fn);
	if ((ret = ape__problem_init_pos(&p, fn, desc, q, k, v, o, lse)))
		return ret;
	if ((ret = check_gradients(fn, &p, q, k, v, o, lse, a)) ||
	    (ret = ape__problem_head_pairs(fn, &p, &per_head)))
		goto out_fini;
	for (int d = 0; d < ndev; d++)
		if ((ret = ape__backward_supported(fn, devs[d])))
			goto out_fini;

	memset(&res, 0, sizeof(res));
	on_device = p.Lq > 0 && p.Lk > 0;
	if (on_device && p.pos_q) {
		/* explicit positions (the backward's kernels read none): runs of consecutive ones */
		const struct ape__pos_grads g = {
			.dout = a->dout, .dlse = a->dlse, .dq = a->dq, .dk = a->dk, .dv = a->dv,
			.dparams = a->dparams, .dout_s = a->dout_s, .dq_s = a->dq_s,
			.dk_s = a->dk_s, .dv_s = a->dv_s,
		};

		ret = ape__backward_positions(fn, devs, ndev, opts, desc, &p, q, k, v, o, lse, &g,
					      stats, t0);
		goto out_fini;
	}
	if (on_device) {
		const struct ape__bwd_req r = {
			.fn = fn, .devs = devs, .ndev = ndev,
			.weights = opts ? opts->device_weights : NULL,
			.trace_path = opts ? opts->trace_path : NULL,
			.budget = opts ? opts->max_device_bytes : 0,
			.chunk_q = opts ? opts->chunk_q : 0, .chunk_k = opts ? opts->chunk_k : 0,
			.depth = opts ? opts->pipeline_depth : 0,
			.copy_inputs = opts && (opts->flags & APE_EXEC_COPY_INPUTS),
			.p = &p, .q = q, .k = k, .v = v, .o = o, .dout = a->dout,
			.dout_s = a->dout_s, .lse = lse, .dlse = a->dlse,
			.dq = a->dq, .dk = a->dk, .dv = a->dv,
			.dq_s = a->dq_s, .dk_s = a->dk_s, .dv_s = a->dv_s,
			.dparams = a->dparams,
		};

		ret = ape__exec_backward(&r, &res);
	} else {
		write_zeros(&p, a);
	}
	ape__bwd_call_done(fn, devs, ndev, &p, ret, on_device ? &res : NULL,
			   per_head * (uint64_t)(p.B * p.H), t0, stats);
out_fini:
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_backward(ape_device *dev, const ape_attn_desc *desc, const ape_tensor *q,
			   const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
			   const float *lse, const ape_tensor *dout, const float *dlse,
			   ape_tensor *dq, ape_tensor *dk, ape_tensor *dv, float *dparams,
			   ape_stats *stats)
{
	APE__API_CALL("ape_attention_backward");
	static const char fn[] = "ape_attention_backward";
	struct bwd_args a = { .dout = dout, .dlse = dlse, .dq = dq, .dk = dk, .dv = dv,
			      .dparams = dparams };

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	return backward(fn, &dev, 1, NULL, desc, q, k, v, o, lse, &a, stats);
}

int ape_attention_backward_ex(ape_device *const *devs, int ndev, const ape_exec_options *opts,
			      const ape_attn_desc *desc, const ape_tensor *q, const ape_tensor *k,
			      const ape_tensor *v, const ape_tensor *o, const float *lse,
			      const ape_tensor *dout, const float *dlse, ape_tensor *dq,
			      ape_tensor *dk, ape_tensor *dv, float *dparams, ape_stats *stats)
{
	APE__API_CALL("ape_attention_backward_ex");
	static const char fn[] = "ape_attention_backward_ex";
	struct bwd_args a = { .dout = dout, .dlse = dlse, .dq = dq, .dk = dk, .dv = dv,
			      .dparams = dparams };

	return backward(fn, devs, ndev, opts, desc, q, k, v, o, lse, &a, stats);
}
