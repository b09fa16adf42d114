/* SPDX-License-Identifier: MIT */
/*
 * A ragged batch on device tensors (ape_attention_enqueue_varlen(), include/ape/ape.h): the
 * device-resident twin of ape_attention_forward_varlen(), by the same rules (api/varlen.h) and
 * the same segments.
 *
 * On a device that takes ragged launches (ape_be_ape_be_caps_have(&caps, APE_BE_CAP_SEGMENTS)) the batch is one resident
 * call (exec/resident.h) over the packed tensors, its segments those of every launch, query rows
 * split under the budget by the one planner; on another, each segment is a resident call of its
 * own on views of the packed tensors moved to its rows and keys (a launch per run, in row
 * order). Positions that give a query run several key runs (gaps, repeats, any order) are one
 * resident call too where the device also reads explicit positions (.positions): a segment per
 * sequence, every row's and key's position passed along (struct ape__problem.pos_q, .pos_k),
 * as the host call's one launch takes them. Elsewhere they are refused: they need the partial
 * results merged by LSE (the host call does it in host memory; no device merge exists yet).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/verbose.h"
#include "exec/resident.h"
#include "api/resident.h"
#include "api/validate.h"
#include "api/varlen.h"

/* One resident call of problem p (whole, or one segment's) with r's buffers and views. */
static int run_one(ape_queue *queue, struct ape__resident_req *r, const struct ape__problem *p)
{
	int64_t rows;
	int ret;

	r->p = p;
	if (p->Lk == 0)
		return ape__resident_write_empty(queue, p, r);
	if ((ret = ape__resident_plan(r, &rows)))
		return ret;
	return ape__resident_enqueue(r, rows);
}

/* Each segment as a dense resident call on views moved to its rows and keys. */
static int per_segment(ape_queue *queue, const struct ape__resident_req *whole,
		       const struct ape__problem *p, const struct ape_be_seg *sg, int64_t n)
{
	int ret = 0;

	for (int64_t s = 0; s < n && !ret; s++) {
		struct ape__resident_req r = *whole;
		struct ape__problem one = *p;
		static const int rowt[3] = { APE_BE_T_Q, APE_BE_T_O, APE_BE_T_LSE };

		one.segs = NULL;
		one.nseg = 0;
		one.Lq = sg[s].lq;
		one.Lk = sg[s].lk;
		one.q_start = sg[s].q_start;
		one.k_start = sg[s].k_start;
		for (int t = 0; t < 3; t++)
			r.view[rowt[t]].off += sg[s].q0 * r.view[rowt[t]].sl;
		r.view[APE_BE_T_K].off += sg[s].k0 * r.view[APE_BE_T_K].sl;
		r.view[APE_BE_T_V].off += sg[s].k0 * r.view[APE_BE_T_V].sl;
		ret = run_one(queue, &r, &one);
		if (ret)
			ret = ape__error(ret, "query rows %" PRId64 "..%" PRId64 ": %s", sg[s].q0,
					 sg[s].q0 + sg[s].lq - 1, ape_last_error());
	}
	return ret;
}

int ape__attention_enqueue_varlen(const char *fn, ape_queue *queue, const ape_attn_desc *desc,
				  const ape_varlen *vl, const ape_dtensor *q, const ape_dtensor *k,
				  const ape_dtensor *v, const ape_dtensor *o, const ape_dtensor *lse)
{
	struct ape__resident_req r;
	struct ape__problem p;
	struct ape_be_seg *sg = NULL;
	struct ape__varlen_pos pos = { 0 };
	bool explicit = false;
	int64_t n = 0;
	int ret;

	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	if ((ret = ape__varlen_check_desc(fn, desc, vl)))
		return ret;
	memset(&r, 0, sizeof(r));
	if ((ret = ape__check_resident(fn, queue->dev, desc, q, k, v, o, lse, &p, r.buf, r.view)))
		return ret;
	if ((ret = ape__varlen_check_batch(fn, vl, &p, "q")) || p.H * p.Lq == 0)
		goto out; /* an error, or nothing to compute and nothing to write */
	ret = ape__varlen_segments(fn, vl, p.causal, &sg, &n);
	if (ret < 0)
		goto out;
	if (ret == 0 && !ape__varlen_devices_take(&queue->dev, 1, true)) {
		ret = ape__error(APE_ENOTSUP,
				 "%s: vl->pos_k: a query run of the batch sees several runs of "
				 "consecutive key positions (gaps or repeats among a sequence's "
				 "keys); %s reads no explicit positions, so on its tensors each "
				 "query run must see one (the host call "
				 "ape_attention_forward_varlen() takes any positions)",
				 fn, queue->dev->info.name);
		goto out;
	}
	if (ret == 0) { /* one ragged call at explicit positions, a segment per sequence */
		explicit = true;
		if ((ret = ape__varlen_build_positions(fn, vl, &sg, &n, &pos)))
			goto out;
	}
	r.fn = fn;
	r.dev = queue->dev;
	r.q = queue->q;
	ape__queue_note_call(queue, fn);
	if (p.Lk == 0) {
		ret = run_one(queue, &r, &p); /* no keys at all: zeros and -inf */
	} else if (explicit) {
		p.segs = sg;
		p.nseg = n;
		p.pos_q = pos.q;
		p.pos_k = pos.k;
		ret = run_one(queue, &r, &p);
		p.segs = NULL;
		p.nseg = 0;
		p.pos_q = p.pos_k = NULL;
	} else if (n == 1 && sg[0].k0 == 0 && sg[0].lk == p.Lk) {
		/* one sequence over every key: the dense problem itself, as the host call runs it */
		p.q_start = sg[0].q_start;
		p.k_start = sg[0].k_start;
		ret = run_one(queue, &r, &p);
	} else if (ape_be_caps_have(&queue->dev->caps, APE_BE_CAP_SEGMENTS)) {
		p.segs = sg;
		p.nseg = n;
		ret = run_one(queue, &r, &p);
		p.segs = NULL;
		p.nseg = 0;
	} else {
		ret = per_segment(queue, &r, &p, sg, n);
	}
	if (ret)
		ret = ape__error_prefix(ret, fn);
out:
	free(sg);
	ape__varlen_pos_free(&pos);
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_enqueue_varlen(ape_queue *queue, const ape_attn_desc *desc,
				 const ape_varlen *vl, const ape_dtensor *q, const ape_dtensor *k,
				 const ape_dtensor *v, const ape_dtensor *o, const ape_dtensor *lse)
{
	APE__API_CALL("ape_attention_enqueue_varlen");
	return ape__attention_enqueue_varlen("ape_attention_enqueue_varlen", queue, desc, vl, q, k,
					     v, o, lse);
}
