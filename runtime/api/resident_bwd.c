/* SPDX-License-Identifier: MIT */
/*
 * ape_attention_backward_enqueue() (include/ape/ape.h): the backward pass on device tensors.
 * Validation is the host call's (api/backward.h, on the tensors at synthetic addresses, as
 * api/resident.c does for the forward) plus the device tensors' own; the work is the
 * executor's resident backward path (exec/resident_bwd.c).
 */
#include <string.h>

#include "api/backward.h"
#include "api/resident.h"
#include "api/stats.h"
#include "api/validate.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/backward.h"
#include "exec/resident_bwd.h"

static const char *const names[APE__RB_COUNT] = { "q",	  "k",	"v",  "o",  "lse",    "dout",
						  "dlse", "dq", "dk", "dv", "dparams" };

/* The device runs the backward pass on the caller's memory (struct ape_be_caps)? */
static int check_backend(const char *fn, const struct ape_device *dev)
{
	int ret = ape__backward_supported(fn, dev);

	if (ret)
		return ret;
	if (!ape_be_caps_have(&dev->caps, APE_BE_CAP_RESIDENT_BACKWARD))
		return ape__error(APE_ENOTSUP,
				  "%s: %s:%d %s: the backward pass on device tensors is not "
				  "implemented on this backend",
				  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
	return 0;
}

int ape__check_bwd_present(const char *fn, const void *const t[APE__RB_COUNT])
{
	for (int i = 0; i <= APE__RB_DOUT; i++)
		if (!t[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL%s", fn, names[i],
					  i == APE__RB_LSE ? ": the backward pass needs the "
							     "forward's LSE"
							   : "");
	if (!t[APE__RB_DQ] && !t[APE__RB_DK] && !t[APE__RB_DV] && !t[APE__RB_DPARAMS])
		return ape__error(APE_EINVAL,
				  "%s: dq, dk, dv and dparams are all NULL: no gradient is wanted", fn);
	return 0;
}

int ape__check_resident_bwd(const char *fn, const ape_queue *queue, const ape_attn_desc *desc,
		      const ape_dtensor *const t[APE__RB_COUNT], struct ape__problem *p,
		      struct ape__resident_bwd_req *r)
{
	const ape_buffer *bufs[APE__RB_COUNT];
	ape_tensor host[APE__RB_COUNT];
	struct ape__bwd_tensors bt;
	struct ape__bwd_strides s;
	const int64_t *st[APE__RB_COUNT];
	uint64_t per_head;
	int ret;

	memset(p, 0, sizeof(*p));
	if ((ret = ape__check_bwd_present(fn, (const void *const *)t)))
		return ret;
	for (int i = 0; i < APE__RB_COUNT; i++)
		bufs[i] = t[i] ? t[i]->buf : NULL;
	for (int i = 0; i < APE__RB_COUNT; i++)
		if (t[i] && (ret = ape__dtensor_host(fn, names[i], t[i], queue->dev, bufs, &host[i])))
			return ret;
	if ((ret = ape__problem_init(p, fn, desc, &host[APE__RB_Q], &host[APE__RB_K],
				     &host[APE__RB_V], &host[APE__RB_O], NULL)))
		return ret;
	if (p->dbias_table) {
		ret = ape__error(APE_EINVAL,
				 "%s: desc->dbias_table = %p: the backward pass on device tensors does "
				 "not return the bias table's gradient; ape_attention_backward() does",
				 fn, (void *)p->dbias_table);
		goto fail;
	}
	bt = (struct ape__bwd_tensors){
		.lse = &host[APE__RB_LSE], .dout = &host[APE__RB_DOUT],
		.dlse = t[APE__RB_DLSE] ? &host[APE__RB_DLSE] : NULL,
		.dq = t[APE__RB_DQ] ? &host[APE__RB_DQ] : NULL,
		.dk = t[APE__RB_DK] ? &host[APE__RB_DK] : NULL,
		.dv = t[APE__RB_DV] ? &host[APE__RB_DV] : NULL,
		.dparams = t[APE__RB_DPARAMS] ? &host[APE__RB_DPARAMS] : NULL,
	};
	if ((ret = ape__check_backward_tensors(fn, p, &host[APE__RB_Q], &host[APE__RB_K],
					       &host[APE__RB_V], &host[APE__RB_O], &bt, &s)))
		goto fail;
	st[APE__RB_Q] = p->qs;
	st[APE__RB_K] = p->ks;
	st[APE__RB_V] = p->vs;
	st[APE__RB_O] = p->os;
	st[APE__RB_LSE] = s.lse;
	st[APE__RB_DOUT] = s.dout;
	st[APE__RB_DLSE] = s.dlse;
	st[APE__RB_DQ] = s.dq;
	st[APE__RB_DK] = s.dk;
	st[APE__RB_DV] = s.dv;
	st[APE__RB_DPARAMS] = s.dparams;
	for (int i = 0; i < APE__RB_COUNT; i++) {
		if (!t[i])
			continue;
		if ((ret = ape__dtensor_view(fn, names[i], t[i], st[i], &r->view[i])))
			goto fail;
		r->buf[i] = t[i]->buf->b;
		r->dtype[i] = t[i]->dtype;
	}
	if (ape__head_visible_pairs(p, &per_head)) {
		ret = ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
		goto fail;
	}
	if ((ret = check_backend(fn, queue->dev)))
		goto fail;
	return 0;
fail:
	ape__problem_fini(p);
	return ret;
}

int ape_attention_backward_enqueue(ape_queue *queue, const ape_attn_desc *desc,
				   const ape_dtensor *q, const ape_dtensor *k, const ape_dtensor *v,
				   const ape_dtensor *o, const ape_dtensor *lse,
				   const ape_dtensor *dout, const ape_dtensor *dlse,
				   const ape_dtensor *dq, const ape_dtensor *dk, const ape_dtensor *dv,
				   const ape_dtensor *dparams)
{
	APE__API_CALL("ape_attention_backward_enqueue");
	const ape_dtensor *const t[APE__RB_COUNT] = { q, k, v, o, lse, dout, dlse,
						      dq, dk, dv, dparams };

	return ape__attention_backward_enqueue("ape_attention_backward_enqueue", queue, desc, t);
}

int ape__attention_backward_enqueue(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				    const ape_dtensor *const t[APE__RB_COUNT])
{
	const double t0 = ape__now_ms();
	struct ape_be_path_log paths = { { 0 }, { 0 } };
	struct ape__resident_bwd_req r;
	struct ape__problem p;
	int64_t rows = 1;
	int ret;

	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	memset(&r, 0, sizeof(r));
	if ((ret = ape__check_resident_bwd(fn, queue, desc, t, &p, &r)))
		return ret;
	r.fn = fn;
	r.dev = queue->dev;
	r.q = queue->q;
	r.p = &p;
	if (p.B * p.H * p.Lq > 0 && p.Lk > 0 && (ret = ape__resident_bwd_plan(&r, &rows))) {
		ape__problem_fini(&p);
		return ret;
	}
	ape__queue_note_call(queue, fn);
	r.paths = &paths;
	ret = ape__resident_bwd_enqueue(&r, rows);
	ret = ret ? ape__error_prefix(ret, fn) : 0;
	ape__call_log_async(fn, queue->dev, &p, ret, &paths, t0);
	ape__problem_fini(&p);
	return ret;
}
