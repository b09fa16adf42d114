/* SPDX-License-Identifier: MIT */
/*
 * The gradients of a ragged batch (ape_attention_backward_varlen(), include/ape/ape.h).
 *
 * Where every device takes ragged backward launches (APE_BE_CAP_BWD_SEGMENTS) and every query
 * run sees one key run of its own (default positions; position_ids restarting per document),
 * the whole batch is one run of the backward executor over the packed tensors, one segment per
 * query run (one_run()): the same planner, chunks, devices and merges as the dense call, each
 * launch serving every sequence of its rows.
 *
 * Otherwise each sequence is cut into runs of consecutive positions as the forward cuts it
 * (api/varlen.c); a query run against a key run is the dense backward of those rows, given
 * the rows' O and LSE of the whole forward call (so P_ij = exp(s_ij - LSE_i) and
 * D_i = dO_i . O_i are the full row's, and every piece's gradients are exact parts of the
 * whole). dQ sums over a query
 * run's key runs, dK and dV over a key run's query runs, dparams over all, in a fixed order:
 * deterministic. Everything is staged in float32 host memory and written on success.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/backward.h"
#include "exec/launch.h"
#include "exec/lse_merge.h"
#include "api/backward.h"
#include "api/forward.h"
#include "api/validate.h"
#include "api/varlen.h"

struct bcall {
	const char *fn;
	ape_device *const *devs;
	int ndev;
	ape_exec_options opts;
	const ape_attn_desc *desc;
	const ape_varlen *vl;
	const struct ape__problem *p;
	const ape_tensor *q, *k, *v, *o, *dout;
	const float *lse, *dlse;
	bool want_dq, want_dk, want_dv, want_dp, want_db;
	float *sdq, *sdk, *sdv; /* staged float32 [1, H or Hkv, total, D], zeroed */
	double *sdp; /* 4H */
	float *tdq, *tdk, *tdv, *tdp; /* one piece's, [1, H or Hkv, rows, D] and 4H */
	float *tlse, *tdlse; /* one query run's LSE and dLSE, [H, rows] */
	double *sdb; /* the bias table's gradient, [rows][M] (ape__bias_rows()) */
	float *tdb; /* one piece's */
	int64_t maxq, maxk; /* the longest query and key runs */
	ape_stats st;
	bool have_st;
};

/* The longest run of consecutive positions of the queries (query) or keys of sequences that
 * have both. */
static int64_t longest_run(const ape_varlen *vl, bool query)
{
	const int64_t *cu = query ? vl->cu_seqlens_q : vl->cu_seqlens_k;
	int64_t most = 0;

	for (int64_t s = 0; s < vl->num_seqs; s++) {
		if (vl->cu_seqlens_q[s] == vl->cu_seqlens_q[s + 1] ||
		    vl->cu_seqlens_k[s] == vl->cu_seqlens_k[s + 1])
			continue;
		for (int64_t a = cu[s], b; a < cu[s + 1]; a = b) {
			b = ape__varlen_run_end(vl, query, s, a, cu[s + 1]);
			most = b - a > most ? b - a : most;
		}
	}
	return most;
}

static void bcall_free(struct bcall *c)
{
	free(c->sdq);
	free(c->sdk);
	free(c->sdv);
	free(c->sdp);
	free(c->tdp);
	free(c->tdq);
	free(c->tdk);
	free(c->tdv);
	free(c->tlse);
	free(c->tdlse);
	free(c->sdb);
	free(c->tdb);
}

static int bcall_alloc(struct bcall *c)
{
	const struct ape__problem *p = c->p;
	const size_t D = (size_t)p->D;

	c->maxq = longest_run(c->vl, true);
	c->maxk = longest_run(c->vl, false);
	if (c->want_dq) {
		c->sdq = ape__calloc((size_t)(p->H * p->Lq) * D + 1, sizeof(float));
		c->tdq = ape__malloc((size_t)(p->H * c->maxq) * D * sizeof(float) + 1);
	}
	if (c->want_dk) {
		c->sdk = ape__calloc((size_t)(p->Hkv * p->Lk) * D + 1, sizeof(float));
		c->tdk = ape__malloc((size_t)(p->Hkv * c->maxk) * D * sizeof(float) + 1);
	}
	if (c->want_dv) {
		c->sdv = ape__calloc((size_t)(p->Hkv * p->Lk) * D + 1, sizeof(float));
		c->tdv = ape__malloc((size_t)(p->Hkv * c->maxk) * D * sizeof(float) + 1);
	}
	if (c->want_dp) {
		c->sdp = ape__calloc((size_t)(4 * p->H), sizeof(double));
		c->tdp = ape__malloc((size_t)(4 * p->H) * sizeof(float));
	}
	if (c->want_db) {
		c->sdb = ape__calloc((size_t)(ape__bias_rows(p) * p->bias_len), sizeof(double));
		c->tdb = ape__malloc((size_t)(ape__bias_rows(p) * p->bias_len) * sizeof(float));
	}
	c->tlse = ape__malloc((size_t)(p->H * c->maxq) * sizeof(float) + 1);
	if (c->dlse)
		c->tdlse = ape__malloc((size_t)(p->H * c->maxq) * sizeof(float) + 1);
	if ((c->want_dq && (!c->sdq || !c->tdq)) || (c->want_dk && (!c->sdk || !c->tdk)) ||
	    (c->want_dv && (!c->sdv || !c->tdv)) || (c->want_dp && (!c->sdp || !c->tdp)) ||
	    (c->want_db && (!c->sdb || !c->tdb)) ||
	    !c->tlse ||
	    (c->dlse && !c->tdlse)) {
		bcall_free(c);
		return ape__error(APE_ENOMEM, "%s: out of host memory staging the gradients", c->fn);
	}
	return 0;
}

/* rows [l0, l0 + n) of the staged [1, heads, total, D] += a piece's [1, heads, n, D] */
static void add_rows(float *staged, const float *piece, int64_t heads, int64_t total,
		     int64_t l0, int64_t n, int64_t D)
{
	for (int64_t h = 0; h < heads; h++)
		for (int64_t i = 0; i < n * D; i++)
			staged[(h * total + l0) * D + i] += piece[h * n * D + i];
}

/* Query rows [a, b) against key rows [kc, kd) of sequence s: the dense backward, added to the
 * staging. */
static int piece(struct bcall *c, int64_t s, int64_t a, int64_t b, int64_t kc, int64_t kd)
{
	const struct ape__problem *p = c->p;
	const int64_t n = b - a, m = kd - kc, D = p->D;
	ape_attn_desc d;
	ape_tensor qv, kv, vv, ov, dov, tdq, tdk, tdv;
	ape_stats st;
	int ret;

	ape__desc_copy(&d, c->desc);
	d.q_start_set = true;
	d.q_start = ape__varlen_qpos(c->vl, s, a);
	d.k_start = ape__varlen_kpos(c->vl, s, kc);
	d.dbias_table = c->want_db ? c->tdb : NULL; /* the piece's, summed below */
	if ((ret = ape_tensor_rows(c->q, a, n, &qv)) || (ret = ape_tensor_rows(c->o, a, n, &ov)) ||
	    (ret = ape_tensor_rows(c->dout, a, n, &dov)) ||
	    (ret = ape_tensor_rows(c->k, kc, m, &kv)) || (ret = ape_tensor_rows(c->v, kc, m, &vv)))
		return ret; /* validated: not reached */
	ape_tensor_init(&tdq, c->tdq, APE_F32, 1, p->H, n, D);
	ape_tensor_init(&tdk, c->tdk, APE_F32, 1, p->Hkv, m, D);
	ape_tensor_init(&tdv, c->tdv, APE_F32, 1, p->Hkv, m, D);
	ape_stats_init(&st);
	ret = ape_attention_backward_ex(c->devs, c->ndev, &c->opts, &d, &qv, &kv, &vv, &ov,
					c->tlse, &dov, c->dlse ? c->tdlse : NULL,
					c->want_dq ? &tdq : NULL, c->want_dk ? &tdk : NULL,
					c->want_dv ? &tdv : NULL, c->want_dp ? c->tdp : NULL, &st);
	if (ret)
		return ape__error(ret, "%s: sequence %" PRId64 " (query rows %" PRId64 "..%" PRId64
				  ", key rows %" PRId64 "..%" PRId64 "): %s",
				  c->fn, s, a, b - 1, kc, kd - 1, ape_last_error());
	ape__varlen_add_stats(&c->st, &c->have_st, &st);
	if (c->want_dq)
		add_rows(c->sdq, c->tdq, p->H, p->Lq, a, n, D);
	if (c->want_dk)
		add_rows(c->sdk, c->tdk, p->Hkv, p->Lk, kc, m, D);
	if (c->want_dv)
		add_rows(c->sdv, c->tdv, p->Hkv, p->Lk, kc, m, D);
	for (int64_t i = 0; c->want_dp && i < 4 * p->H; i++)
		c->sdp[i] += c->tdp[i];
	for (int64_t i = 0; c->want_db && i < ape__bias_rows(p) * p->bias_len; i++)
		c->sdb[i] += c->tdb[i];
	return 0;
}

/* Query run [a, b) of sequence s: its LSE (and dLSE) as [H, n], then every visible key run. */
static int query_run(struct bcall *c, int64_t s, int64_t a, int64_t b)
{
	const int64_t k1 = c->vl->cu_seqlens_k[s + 1], n = b - a, H = c->p->H;
	int ret = 0;

	for (int64_t h = 0; h < H; h++)
		for (int64_t i = 0; i < n; i++) {
			c->tlse[h * n + i] = c->lse[(a + i) * H + h];
			if (c->dlse)
				c->tdlse[h * n + i] = c->dlse[(a + i) * H + h];
		}
	for (int64_t kc = c->vl->cu_seqlens_k[s], kd; kc < k1 && !ret; kc = kd) {
		kd = ape__varlen_run_end(c->vl, false, s, kc, k1);
		if (ape__varlen_run_visible(c->vl, c->p->causal, s, a, b, kc))
			ret = piece(c, s, a, b, kc, kd);
	}
	return ret;
}

static void publish(struct bcall *c, ape_tensor *dq, ape_tensor *dk, ape_tensor *dv,
		    float *dparams)
{
	int64_t st[4];

	if (c->want_dq) {
		ape_tensor_strides(dq, st);
		ape__store_rows_f32(c->sdq, dq, st, 0, c->p->Lq);
	}
	if (c->want_dk) {
		ape_tensor_strides(dk, st);
		ape__store_rows_f32(c->sdk, dk, st, 0, c->p->Lk);
	}
	if (c->want_dv) {
		ape_tensor_strides(dv, st);
		ape__store_rows_f32(c->sdv, dv, st, 0, c->p->Lk);
	}
	for (int64_t i = 0; c->want_dp && i < 4 * c->p->H; i++)
		dparams[i] = (float)c->sdp[i];
	for (int64_t i = 0; c->want_db && i < ape__bias_rows(c->p) * c->p->bias_len; i++)
		c->p->dbias_table[i] = (float)c->sdb[i];
}

/* The gradient tensors against the validated packed problem: LSE and dLSE [total_q, H]; their
 * strides into *s. */
static int check_grads(const char *fn, const struct ape__problem *p, const ape_tensor *q,
		       const ape_tensor *k, const ape_tensor *v, const ape_tensor *o,
		       const float *lse, const ape_tensor *dout, const float *dlse,
		       const ape_tensor *dq, const ape_tensor *dk, const ape_tensor *dv,
		       float *dparams, struct ape__bwd_strides *s)
{
	ape_tensor lse_t, dlse_t, dp_t;
	const struct ape__bwd_tensors t = { .lse = &lse_t, .dout = dout,
					    .dlse = dlse ? &dlse_t : NULL, .dq = dq, .dk = dk,
					    .dv = dv, .dparams = dparams ? &dp_t : NULL };

	if (!dout)
		return ape__error(APE_EINVAL, "%s: dout = NULL", fn);
	/* [total_q, H] as the [1, H, total_q, 1] tensor the rules take */
	ape_tensor_init(&lse_t, (void *)lse, APE_F32, 1, p->H, p->Lq, 1);
	lse_t.strides[0] = p->H * p->Lq;
	lse_t.strides[1] = 1;
	lse_t.strides[2] = p->H;
	lse_t.strides[3] = 1;
	dlse_t = lse_t;
	dlse_t.data = (void *)dlse;
	ape_tensor_init(&dp_t, dparams, APE_F32, 1, 1, p->H, 4);
	return ape__check_backward_tensors(fn, p, q, k, v, o, &t, s);
}

/*
 * The whole batch as one backward run of the executor over the packed tensors (exec/backward.c),
 * its launches ragged (struct ape_be_bwd_launch, "Ragged"), where every device takes them and
 * every query run sees one key run of its own (default positions, position_ids restarting per
 * document): 1 done (or failed: *ret, nothing written), 0 not applicable (the pieces serve it).
 * A batch of one sequence over every key is the dense problem itself, bit for bit the dense
 * call's.
 */
static int one_run(struct bcall *c, const struct ape__bwd_strides *s, ape_tensor *dq,
		   ape_tensor *dk, ape_tensor *dv, float *dparams, ape_stats *stats, double t0,
		   int *ret)
{
	const struct ape__problem *p = c->p;
	/* [total_q, H] as the executor's [1, H, total_q, 1] */
	const int64_t lse_s[4] = { p->H * p->Lq, 1, p->H, 1 };
	struct ape__problem pp = *p;
	struct ape__bwd_result res;
	struct ape_be_seg *sg = NULL;
	int64_t n = 0;
	uint64_t visible = 0;
	int r;

	*ret = 0;
	for (int d = 0; d < c->ndev; d++)
		if (!ape_be_dev_has(c->devs[d], APE_BE_CAP_SEGMENTS | APE_BE_CAP_BWD_SEGMENTS))
			return 0;
	if (p->Lq == 0 || p->Lk == 0)
		return 0;
	r = ape__varlen_segments(c->fn, c->vl, p->causal, &sg, &n);
	if (r <= 0) { /* an error, or a query run that sees several key runs */
		*ret = r;
		return r < 0;
	}
	r = ape__varlen_keys_disjoint(c->fn, sg, n);
	if (r <= 0) { /* query runs of one sequence sharing keys: the pieces */
		free(sg);
		*ret = r;
		return r < 0;
	}
	if (ape__segs_visible(p, sg, n, &visible)) {
		free(sg);
		*ret = ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", c->fn);
		return 1;
	}
	if (n == 1 && sg[0].k0 == 0 && sg[0].lk == p->Lk) {
		pp.q_start = sg[0].q_start;
		pp.k_start = sg[0].k_start;
	} else {
		pp.segs = sg;
		pp.nseg = n;
	}
	memset(&res, 0, sizeof(res));
	{
		const ape_exec_options *o = &c->opts;
		const struct ape__bwd_req req = {
			.fn = c->fn, .devs = c->devs, .ndev = c->ndev,
			.weights = o->device_weights, .trace_path = o->trace_path,
			.budget = o->max_device_bytes, .chunk_q = o->chunk_q,
			/* a launch sees only its own sequences' keys: one key chunk of every key by
			 * default (the planner halves it when the budget says so), as the forward */
			.chunk_k = o->chunk_k ? o->chunk_k : pp.segs ? p->Lk : 0,
			.depth = o->pipeline_depth,
			.copy_inputs = (o->flags & APE_EXEC_COPY_INPUTS) != 0,
			.p = &pp, .q = c->q, .k = c->k, .v = c->v, .o = c->o, .dout = c->dout,
			.dout_s = s->dout, .lse = c->lse, .dlse = c->dlse, .lse_s = lse_s,
			.dq = dq, .dk = dk, .dv = dv, .dq_s = s->dq, .dk_s = s->dk, .dv_s = s->dv,
			.dparams = dparams,
		};

		*ret = ape__exec_backward(&req, &res);
	}
	if (*ret)
		*ret = ape__error(*ret, "%s: %" PRId64 " sequences in ragged launches: %s", c->fn,
				  c->vl->num_seqs, ape_last_error());
	ape__bwd_call_done(c->fn, c->devs, c->ndev, p, *ret, &res, visible, t0, stats);
	free(sg);
	return 1;
}

int ape__attention_backward_varlen(const char *fn, ape_device *const *devs, int ndev,
				   const ape_exec_options *opts, const ape_attn_desc *desc,
				   const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				   const ape_tensor *v, const ape_tensor *o, const float *lse,
				   const ape_tensor *dout, const float *dlse, ape_tensor *dq,
				   ape_tensor *dk, ape_tensor *dv, float *dparams, ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__bwd_strides gs;
	struct ape__problem p;
	struct bcall c;
	int ret;

	if ((ret = ape__check_exec_call(fn, devs, ndev, opts, stats)))
		return ret;
	if (!lse)
		return ape__error(APE_EINVAL, "%s: lse = NULL: the backward pass needs the "
					      "forward's LSE",
				  fn);
	if (!dq && !dk && !dv && !dparams && !ape__desc_wants_dbias(desc))
		return ape__error(APE_EINVAL,
				  "%s: dq, dk, dv, dparams and desc->dbias_table are all NULL: no "
				  "gradient is wanted",
				  fn);
	if ((ret = ape__varlen_check(fn, desc, vl, opts, q, k, v, o, lse, &p)))
		return ret;
	if ((ret = check_grads(fn, &p, q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams, &gs)))
		goto out_fini;
	for (int d = 0; d < ndev; d++)
		if ((ret = ape__backward_supported(fn, devs[d])))
			goto out_fini;
	memset(&c, 0, sizeof(c));
	c.fn = fn;
	c.devs = devs;
	c.ndev = ndev;
	if (opts)
		c.opts = *opts;
	else
		ape_exec_options_init(&c.opts);
	c.desc = desc;
	c.vl = vl;
	c.p = &p;
	c.q = q;
	c.k = k;
	c.v = v;
	c.o = o;
	c.dout = dout;
	c.lse = lse;
	c.dlse = dlse;
	c.want_dq = dq;
	c.want_dk = dk;
	c.want_dv = dv;
	c.want_dp = dparams;
	c.want_db = p.dbias_table;
	if (one_run(&c, &gs, dq, dk, dv, dparams, stats, t0, &ret))
		goto out_fini;
	if ((ret = bcall_alloc(&c)))
		goto out_fini;
	for (int64_t s = 0; s < vl->num_seqs && !ret; s++) {
		const int64_t q1 = vl->cu_seqlens_q[s + 1];

		if (vl->cu_seqlens_k[s] == vl->cu_seqlens_k[s + 1])
			continue; /* no keys: no gradient */
		for (int64_t a = vl->cu_seqlens_q[s], b; a < q1 && !ret; a = b) {
			b = ape__varlen_run_end(vl, true, s, a, q1);
			ret = query_run(&c, s, a, b);
		}
	}
	if (!ret)
		publish(&c, dq, dk, dv, dparams);
	ape__varlen_report(fn, devs, ndev, &p, ret, stats, &c.st, c.have_st, t0);
	bcall_free(&c);
out_fini:
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_backward_varlen(ape_device *const *devs, int ndev,
				  const ape_exec_options *opts, const ape_attn_desc *desc,
				  const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				  const ape_tensor *v, const ape_tensor *o, const float *lse,
				  const ape_tensor *dout, const float *dlse, ape_tensor *dq,
				  ape_tensor *dk, ape_tensor *dv, float *dparams, ape_stats *stats)
{
	APE__API_CALL("ape_attention_backward_varlen");
	return ape__attention_backward_varlen("ape_attention_backward_varlen", devs, ndev, opts,
					      desc, vl, q, k, v, o, lse, dout, dlse, dq, dk, dv,
					      dparams, stats);
}
