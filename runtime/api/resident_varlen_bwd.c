/* SPDX-License-Identifier: MIT */
/*
 * The gradients of a ragged batch on device tensors (ape_attention_backward_enqueue_varlen(),
 * include/ape/ape.h): the device-resident twin of ape_attention_backward_varlen(), by the same
 * batch rules (api/varlen.h) and the same segments as its one executor run (api/varlen_bwd.c).
 *
 * The tensors are checked as ape_attention_backward_enqueue()'s (the packed arrays as the
 * [1, H, total, D] problem), the batch as the host call's; the batch becomes segments (each
 * query run with the one key run it sees), and the problem with them runs the resident
 * backward path (exec/resident_bwd.c), whose launches take ragged backward launches
 * (APE_BE_CAP_BWD_SEGMENTS). A one-sequence batch over every key is the dense problem itself.
 * Positions whose pieces would need partial gradients summed (a query run seeing several key
 * runs, or two query runs sharing keys) are refused: the host call sums such pieces in host
 * memory; no device-side piece sum exists.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/resident_bwd.h"
#include "api/resident.h"
#include "api/stats.h"
#include "api/validate.h"
#include "api/varlen.h"

/* The batch as segments for the resident run: 0 with *sg and *n set (sg NULL: the problem is
 * p's dense one, q_start and k_start set), or the refusal's code. */
static int batch_segments(const char *fn, const ape_varlen *vl, const ape_device *dev,
			  struct ape__problem *p, struct ape_be_seg **sg, int64_t *n)
{
	uint64_t visible = 0;
	int ret = ape__varlen_segments(fn, vl, p->causal, sg, n);

	if (ret < 0)
		return ret;
	if (ret == 0)
		return ape__error(APE_ENOTSUP,
				  "%s: vl->pos_k: a query run of the batch sees several runs of "
				  "consecutive key positions (gaps or repeats among a sequence's keys); "
				  "on device tensors each query run must see one (the host call "
				  "ape_attention_backward_varlen() takes any positions)",
				  fn);
	ret = ape__varlen_keys_disjoint(fn, *sg, *n);
	if (ret <= 0)
		return ret < 0 ? ret
			       : ape__error(APE_ENOTSUP,
					    "%s: vl->pos_q: two query runs of one sequence see the "
					    "same keys (positions that are not one run per "
					    "sequence); on device tensors each key must have one "
					    "owner (the host call ape_attention_backward_varlen() "
					    "takes any positions)",
					    fn);
	if (ape__segs_visible(p, *sg, *n, &visible))
		return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
	if (*n == 1 && (*sg)[0].k0 == 0 && (*sg)[0].lk == p->Lk) {
		/* one sequence over every key: the dense problem, as the host call runs it */
		p->q_start = (*sg)[0].q_start;
		p->k_start = (*sg)[0].k_start;
		free(*sg);
		*sg = NULL;
		return 0;
	}
	if (!ape_be_dev_has(dev, APE_BE_CAP_SEGMENTS | APE_BE_CAP_BWD_SEGMENTS))
		return ape__error(APE_ENOTSUP,
				  "%s: %s:%d %s takes no ragged backward launches (capability "
				  "bwd_segments): a batch of several sequences on its tensors needs "
				  "them (the host call ape_attention_backward_varlen() runs it)",
				  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
	return 0;
}

int ape__attention_backward_enqueue_varlen(const char *fn, ape_queue *queue,
					   const ape_attn_desc *desc, const ape_varlen *vl,
					   const ape_dtensor *const t[APE__RB_COUNT])
{
	const double t0 = ape__now_ms();
	struct ape_be_path_log paths = { { 0 }, { 0 } };
	struct ape__resident_bwd_req r;
	struct ape__problem p;
	struct ape_be_seg *sg = NULL;
	int64_t n = 0, rows = 1;
	int ret;

	if (!queue)
		return ape__error(APE_EINVAL, "%s: queue = NULL", fn);
	if ((ret = ape__varlen_check_desc(fn, desc, vl)))
		return ret;
	memset(&r, 0, sizeof(r));
	if ((ret = ape__check_resident_bwd(fn, queue, desc, t, &p, &r)))
		return ret;
	if ((ret = ape__varlen_check_batch(fn, vl, &p, "q")))
		goto out;
	r.fn = fn;
	r.dev = queue->dev;
	r.q = queue->q;
	r.p = &p;
	if (p.H * p.Lq > 0 && p.Lk > 0) { /* else every gradient is zero (written below) */
		if ((ret = batch_segments(fn, vl, queue->dev, &p, &sg, &n)))
			goto out;
		p.segs = sg;
		p.nseg = sg ? n : 0;
		if ((ret = ape__resident_bwd_plan(&r, &rows)))
			goto out;
	}
	ape__queue_note_call(queue, fn);
	r.paths = &paths;
	ret = ape__resident_bwd_enqueue(&r, rows);
	ret = ret ? ape__error_prefix(ret, fn) : 0;
	ape__call_log_async(fn, queue->dev, &p, ret, &paths, t0);
out:
	p.segs = NULL; /* ours, not the problem's */
	p.nseg = 0;
	free(sg);
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_backward_enqueue_varlen(ape_queue *queue, const ape_attn_desc *desc,
					  const ape_varlen *vl, const ape_dtensor *q,
					  const ape_dtensor *k, const ape_dtensor *v,
					  const ape_dtensor *o, const ape_dtensor *lse,
					  const ape_dtensor *dout, const ape_dtensor *dlse,
					  const ape_dtensor *dq, const ape_dtensor *dk,
					  const ape_dtensor *dv, const ape_dtensor *dparams)
{
	APE__API_CALL("ape_attention_backward_enqueue_varlen");
	const ape_dtensor *const t[APE__RB_COUNT] = { q, k, v, o, lse, dout, dlse,
						      dq, dk, dv, dparams };

	return ape__attention_backward_enqueue_varlen("ape_attention_backward_enqueue_varlen",
						      queue, desc, vl, t);
}
