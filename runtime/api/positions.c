/* SPDX-License-Identifier: MIT */
/*
 * The dense calls at explicit positions (desc->pos_q, desc->pos_k: include/ape/ape.h, docs/ape.md
 * "Explicit positions in the dense call"), the same mechanism as the ragged batches'.
 *
 * Where every device reads explicit positions in its launches (struct ape_be_ape_be_caps_have(&caps, APE_BE_CAP_POSITIONS),
 * the reference and OpenCL), the forward is one run of the executor with p->pos_q and p->pos_k
 * set (api/forward.c): every batch element's rows share the positions, each launch gets the
 * slice of its rows and keys. Elsewhere (CUDA), and for the backward (whose kernels read no
 * positions), each batch element b is a one-sequence ragged batch over slice b of the tensors
 * (a [1, H, L, D] view b * stride[0] elements in): api/varlen.c and api/varlen_bwd.c cut it
 * into runs of consecutive positions, one dense call per pair of runs, merged by LSE. The
 * elements' outputs are staged and written once all of them succeeded; LSE maps between the
 * dense [B, H, Lq] and the ragged [Lq, H].
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/context.h"
#include "core/error.h"
#include "exec/pack.h"
#include "api/positions.h"
#include "api/validate.h"
#include "api/varlen.h"

int ape__problem_head_pairs(const char *fn, const struct ape__problem *p, uint64_t *out)
{
	int ret;

	if (!p->pos_q)
		ret = ape__head_visible_pairs(p, out) ? APE_EOVERFLOW : 0;
	else
		ret = ape__pos_visible_pairs(p->pos_q, p->Lq, p->pos_k, p->Lk, p->causal, out);
	if (ret == APE_ENOMEM)
		return ape__error(ret, "%s: out of host memory counting pairs", fn);
	if (ret)
		return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
	return 0;
}

/* Batch element b of t (its resolved strides s) as a [1, H, L, D] tensor. */
static ape_tensor element(const ape_tensor *t, const int64_t s[4], int64_t b)
{
	ape_tensor x = *t;

	x.data = (unsigned char *)t->data + (size_t)(b * s[0]) * ape_dtype_size(t->dtype);
	x.shape[0] = 1;
	memcpy(x.strides, s, sizeof(x.strides));
	return x;
}

/* What every batch element's call shares: the one-sequence batch at the positions, desc
 * without them, the options. */
struct pcall {
	ape_attn_desc d;
	ape_varlen vl;
	int64_t cuq[2], cuk[2];
	ape_exec_options opts;
	ape_stats st, sum;
	bool have;
};

static int pcall_init(const char *fn, ape_device *const *devs, const ape_exec_options *opts,
		      const ape_attn_desc *desc, const struct ape__problem *p, struct pcall *c)
{
	if (opts && opts->trace_path)
		return ape__error(APE_EINVAL,
				  "%s: opts->trace_path = \"%s\": a call at explicit positions "
				  "(desc->pos_q) run in pieces (a backward, or on devices that do not "
				  "read them, as %s:%d) writes no trace yet",
				  fn, opts->trace_path, devs[0]->info.backend, devs[0]->info.backend_index);
	memset(c, 0, sizeof(*c));
	ape__desc_copy(&c->d, desc);
	c->d.pos_q = c->d.pos_k = NULL;
	c->cuq[1] = p->Lq;
	c->cuk[1] = p->Lk;
	ape_varlen_init(&c->vl);
	c->vl.num_seqs = 1;
	c->vl.cu_seqlens_q = c->cuq;
	c->vl.cu_seqlens_k = c->cuk;
	c->vl.pos_q = p->pos_q;
	c->vl.pos_k = p->pos_k;
	if (opts)
		c->opts = *opts;
	else
		ape_exec_options_init(&c->opts);
	c->opts.flags &= ~APE_EXEC_ATOMIC_OUTPUTS; /* the staging is ours */
	return 0;
}

/* Element b's call returned ret: its statistics added, or the failure named. */
static int pcall_done(const char *fn, struct pcall *c, int64_t b, int ret)
{
	if (ret)
		return ape__error(ret, "%s: batch element %" PRId64 " at explicit positions: %s", fn,
				  b, ape_last_error());
	ape__varlen_add_stats(&c->sum, &c->have, &c->st);
	return 0;
}

/* A contiguous [d0, d1, L, D] staging tensor of t's type, zeroed; NULL data out of memory. */
static ape_tensor staging(const ape_tensor *t, int64_t s[4])
{
	ape_tensor x;
	const size_t n = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]);

	ape_tensor_init(&x, ape__calloc(n + 1, ape_dtype_size(t->dtype)), t->dtype, t->shape[0],
			t->shape[1], t->shape[2], t->shape[3]);
	ape_tensor_strides(&x, s);
	return x;
}

/* Rows (b, h, 0..Lq) of a dense [B, H, Lq] LSE src into a ragged [Lq, H] dst (to_ragged), or
 * of a ragged src into a dense dst. */
static void lse_element(const float *src, float *dst, const struct ape__problem *p, int64_t b,
			bool to_ragged)
{
	for (int64_t h = 0; h < p->H; h++)
		for (int64_t i = 0; i < p->Lq; i++) {
			const int64_t dn = (b * p->H + h) * p->Lq + i, rg = i * p->H + h;

			dst[to_ragged ? rg : dn] = src[to_ragged ? dn : rg];
		}
}

int ape__forward_positions(const char *fn, ape_device *const *devs, int ndev,
			   const ape_exec_options *opts, const ape_attn_desc *desc,
			   const struct ape__problem *p, const ape_tensor *q, const ape_tensor *k,
			   const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats,
			   double t0)
{
	const size_t rows = (size_t)(p->B * p->H * p->Lq);
	struct pcall c;
	int64_t sos[4];
	ape_tensor so;
	float *slse, *tl;
	int ret;

	if ((ret = pcall_init(fn, devs, opts, desc, p, &c)))
		return ret;
	so = staging(o, sos);
	slse = ape__malloc(rows * sizeof(float) + 1);
	tl = ape__malloc((size_t)(p->H * p->Lq) * sizeof(float) + 1);
	if (!so.data || !slse || !tl) {
		ret = ape__error(APE_ENOMEM, "%s: out of host memory staging %" PRId64
				 " rows of O and LSE", fn, p->B * p->H * p->Lq);
		goto out;
	}
	for (int64_t b = 0; b < p->B && !ret; b++) {
		const ape_tensor qb = element(q, p->qs, b), kb = element(k, p->ks, b),
				 vb = element(v, p->vs, b);
		ape_tensor ob = element(&so, sos, b);

		ape_stats_init(&c.st);
		ret = pcall_done(fn, &c, b,
				 ape_attention_forward_varlen_ex(devs, ndev, &c.opts, &c.d, &c.vl,
								 &qb, &kb, &vb, &ob, tl,
								 stats ? &c.st : NULL));
		if (!ret)
			lse_element(tl, slse, p, b, false);
	}
	if (!ret) {
		ape__unpack_rows(so.data, o, p->os, 0, p->Lq);
		if (lse)
			memcpy(lse, slse, rows * sizeof(float));
	}
	ape__varlen_report(fn, devs, ndev, p, ret, stats, &c.sum, c.have, t0);
out:
	free(so.data);
	free(slse);
	free(tl);
	return ret;
}

int ape__backward_positions(const char *fn, ape_device *const *devs, int ndev,
			    const ape_exec_options *opts, const ape_attn_desc *desc,
			    const struct ape__problem *p, const ape_tensor *q, const ape_tensor *k,
			    const ape_tensor *v, const ape_tensor *o, const float *lse,
			    const struct ape__pos_grads *g, ape_stats *stats, double t0)
{
	const size_t rows = (size_t)(p->H * p->Lq);
	ape_tensor *const out[3] = { g->dq, g->dk, g->dv };
	const int64_t *const outs[3] = { g->dq_s, g->dk_s, g->dv_s };
	ape_tensor st[3] = { { 0 } };
	int64_t sts[3][4];
	double *sdp = ape__calloc((size_t)(4 * p->H) + 1, sizeof(double));
	float *tl = ape__malloc(rows * sizeof(float) + 1);
	float *tdl = g->dlse ? ape__malloc(rows * sizeof(float) + 1) : NULL;
	float *tdp = ape__malloc((size_t)(4 * p->H) * sizeof(float) + 1);
	const size_t nbias = (size_t)(ape__bias_rows(p) * p->bias_len);
	double *sdb = p->dbias_table ? ape__calloc(nbias, sizeof(double)) : NULL;
	float *tdb = p->dbias_table ? ape__malloc(nbias * sizeof(float)) : NULL;
	bool oom = !sdp || !tl || (g->dlse && !tdl) || !tdp || (p->dbias_table && (!sdb || !tdb));
	struct pcall c;
	int ret;

	for (int t = 0; t < 3; t++)
		if (out[t]) {
			st[t] = staging(out[t], sts[t]);
			oom |= !st[t].data;
		}
	if ((ret = pcall_init(fn, devs, opts, desc, p, &c)))
		goto out;
	c.d.dbias_table = tdb; /* each element's, summed below */
	if (oom) {
		ret = ape__error(APE_ENOMEM, "%s: out of host memory staging the gradients", fn);
		goto out;
	}
	for (int64_t b = 0; b < p->B && !ret; b++) {
		const ape_tensor qb = element(q, p->qs, b), kb = element(k, p->ks, b),
				 vb = element(v, p->vs, b), ob = element(o, p->os, b),
				 dob = element(g->dout, g->dout_s, b);
		ape_tensor gb[3];

		for (int t = 0; t < 3; t++)
			if (out[t])
				gb[t] = element(&st[t], sts[t], b);
		lse_element(lse, tl, p, b, true);
		if (tdl)
			lse_element(g->dlse, tdl, p, b, true);
		ape_stats_init(&c.st);
		ret = pcall_done(fn, &c, b,
				 ape_attention_backward_varlen(devs, ndev, &c.opts, &c.d, &c.vl, &qb,
							       &kb, &vb, &ob, tl, &dob, tdl,
							       out[0] ? &gb[0] : NULL,
							       out[1] ? &gb[1] : NULL,
							       out[2] ? &gb[2] : NULL,
							       g->dparams ? tdp : NULL,
							       stats ? &c.st : NULL));
		for (int64_t i = 0; !ret && g->dparams && i < 4 * p->H; i++)
			sdp[i] += tdp[i];
		for (size_t i = 0; !ret && sdb && i < nbias; i++)
			sdb[i] += tdb[i];
	}
	if (!ret) {
		for (int t = 0; t < 3; t++)
			if (out[t])
				ape__unpack_rows(st[t].data, out[t], outs[t], 0, out[t]->shape[2]);
		for (int64_t i = 0; g->dparams && i < 4 * p->H; i++)
			g->dparams[i] = (float)sdp[i];
		for (size_t i = 0; sdb && i < nbias; i++)
			p->dbias_table[i] = (float)sdb[i];
	}
	ape__varlen_report(fn, devs, ndev, p, ret, stats, &c.sum, c.have, t0);
out:
	for (int t = 0; t < 3; t++)
		free(st[t].data);
	free(sdp);
	free(tl);
	free(tdl);
	free(tdp);
	free(sdb);
	free(tdb);
	return ret;
}
