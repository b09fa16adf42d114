/* SPDX-License-Identifier: MIT */
/*
 * The backward pass on one device or several (exec/backward.h), on the executor every pass
 * runs on (exec/pass.h, exec/stream.h, exec/multidev.h): the same pipelining of copies with
 * kernels, the same budget and planner, the same traces and the same clean-up after a failure
 * as the forward.
 *
 * Key chunks are the outer axis, query chunks the inner one:
 * - a key chunk's K and V go to the device once, with zeroed dK and dV accumulators that every
 *   query chunk's launch adds to (the op accumulates: core/backend.h); when its last query
 *   chunk is done they come back into host copies of the whole dK and dV (or, on a device that
 *   reads host memory with one key chunk, accumulate in those host copies in place);
 * - a query chunk's Q, O, dO, LSE and dLSE rows go to the device per launch, or stay resident
 *   for the next key chunk while the budget allows; its dQ partial comes back after each launch
 *   and is added, in float64 and in key-chunk order, to the device's host accumulator;
 * - the parameter gradients accumulate on the device, in float64, over the whole run.
 * Each device takes a contiguous range of key chunks, fixed by the weights (equal shares
 * without them) and each chunk's visible pairs, with no stealing at the tail, so that the same
 * devices with the same options compute the same chunks and give the same bits. On the
 * calling thread, the devices' dQ accumulators and parameter sums are then added in float64 in
 * device order (key-chunk order: the ranges are contiguous); dK and dV of a key chunk come from
 * its one device. Two calls on the same devices give the same bits whatever the pipeline's
 * depth (launches retire in the order they were issued); another device set (or split) groups
 * the float64 sums differently, within rounding. A (query chunk, key chunk) pair the causal
 * mask hides entirely is never launched.
 *
 * The caller's outputs are written only after every device's last launch succeeded, from
 * those host copies: a failure on any device stops the others and writes nothing.
 */
#include "exec/backward.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#define APE_REAL double
#include "ape/ape_math.h"
#include "core/error.h"
#include "exec/launch.h"
#include "exec/multidev.h"
#include "exec/pack.h"
#include "exec/skip_budget.h"

/* The pass's tensors. */
enum {
	B_K, B_V, B_DK, B_DV, /* the key side: outer */
	B_Q, B_O, B_DOUT, B_LSE, B_DLSE, /* the query side: inner */
	B_DQ, B_PAIRS, B_DPARAMS, B_DBIAS, /* outputs */
	B_PRM64, B_PRM32, /* the parameter tables (struct ape_be_launch.params) */
	NBUF
};

/* What the devices of a call share. */
struct bwd_call {
	const struct ape__bwd_req *r;
	ape_tensor lse_t, dlse_t; /* lse and dlse as [B, H, Lq, 1] float tensors */
	int64_t lse_s[4];
	float *dk_all, *dv_all; /* [B, Hkv, Lk, D]: each device writes its key chunks' rows */
	int64_t ck, nk; /* the chunking of the keys */
	struct ape_be_seg *cost_segs; /* a ragged call: key_cost()'s clipped segments */
};

/* One device's backward pass. */
struct bwd_pass {
	struct ape__pass pass;
	const struct bwd_call *c;
	struct ape_device *dev;
	int64_t cq, nq; /* the chunking of the queries */
	int64_t next_qc[APE__MAX_DEPTH]; /* per outer slot: the walk's next query chunk */
	int64_t k0[APE__MAX_DEPTH]; /* per outer slot: its key chunk's first row */
	int jobs[APE__MAX_DEPTH]; /* per outer slot: launches of its key chunk */
	double *dq_acc; /* [B, H, Lq, D]: the sum of dQ over its key chunks */
	float *dq32; /* instead, where every row gets one partial (one device, one key chunk): dQ */
	double *dparams; /* [H][4] */
	double *dbias; /* [rows][M]: the bias table's gradient (ape__bias_rows()) */
	uint64_t pairs_computed;
	bool pairs_counted; /* the launches could skip keys and counted what they computed */
	bool worked; /* it had key chunks */
	struct ape_be_path_log paths; /* the kernel paths its launches took */
	/* a ragged call (p->segs): the segments of one job, clipped to its rows and keys
	 * (ape__segs_clip(); p->nseg at most), for its launch, its pair counts and the walk, all
	 * on the device's one thread */
	struct ape_be_seg *segs;
};

int ape__backward_supported(const char *fn, const struct ape_device *dev)
{
	if (ape_be_caps_have(&dev->caps, APE_BE_CAP_BACKWARD))
		return 0;
	return ape__error(APE_ENOTSUP,
			  "%s: %s:%d %s: the backward pass is not implemented on this backend yet",
			  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
}

void ape__bwd_launch_shape(const struct ape__problem *p, ape_dtype dout_dtype, int64_t nkc,
			   struct ape_be_bwd_launch *l, int64_t i0, int64_t nq, int64_t j0, int64_t nk)
{
	memset(l, 0, sizeof(*l));
	/* skip_tol shared by the nkc key chunks a row meets: launch tests of t / (1 + t) each add
	 * up to skip_tol / (1 + skip_tol) of the row's weight with t = skip_tol / (nk + skip_tol
	 * (nk - 1)) (docs/kernels.md, "Skipping in the backward pass"); 0 when the decays do not
	 * allow skipping */
	ape__launch_init(&l->f, p, p->out_dtype,
			 ape__skip_allowed(p)
				 ? p->skip_tol / ((double)nkc + p->skip_tol * ((double)nkc - 1))
				 : 0.0);
	l->f.Lq = nq;
	l->f.Lk = nk;
	l->f.q_start = p->q_start + i0; /* validated: positions of every row fit */
	l->f.k_start = p->k_start + j0;
	l->dout_dtype = dout_dtype;
}

/* ------------------------------------------------------------------ the tensors */

/* Whether t (strides s) lies in memory as its chunk buffer would hold all its rows. */
static bool packed(const ape_tensor *t, const int64_t s[4])
{
	const int64_t H = t->shape[1], L = t->shape[2], D = t->shape[3];

	return s[3] == 1 && (L == 1 || s[2] == D) && (H == 1 || s[1] == L * D) &&
	       (t->shape[0] == 1 || s[0] == H * L * D);
}

static void set_in(struct ape__pass *ps, int t, const char *name, enum ape__role role,
		   enum ape__axis axis, uint64_t row_bytes, const ape_tensor *host,
		   const int64_t *s)
{
	ps->t[t] = (struct ape__pass_tensor){
		.name = name, .role = role, .axis = axis, .row_bytes = host ? row_bytes : 0,
		.host = host, .s = s, .packed = host && packed(host, s),
	};
}

static void set_out(struct ape__pass *ps, int t, const char *name, enum ape__role role,
		    enum ape__axis axis, uint64_t row_bytes, bool wanted)
{
	ps->t[t] = (struct ape__pass_tensor){
		.name = name, .role = role, .axis = axis, .row_bytes = wanted ? row_bytes : 0,
		.back = true, .init_each = role == APE__ROLE_JOB_OUT,
	};
}

static void shape(void *self, struct ape_device *dev, int64_t no, int64_t ni)
{
	struct bwd_pass *b = self;
	const struct bwd_call *c = b->c;
	const struct ape__bwd_req *r = c->r;
	const struct ape__problem *p = r->p;
	struct ape__pass *ps = &b->pass;
	const uint64_t bh = (uint64_t)(p->B * p->H), bkv = (uint64_t)(p->B * p->Hkv);
	const uint64_t D = (uint64_t)p->D, esz = ape_dtype_size(p->in_dtype);

	(void)no;
	(void)ni;
	ps->nt = NBUF;
	set_in(ps, B_K, "k", APE__ROLE_OUTER_IN, APE__AXIS_K, bkv * D * esz, r->k, p->ks);
	set_in(ps, B_V, "v", APE__ROLE_OUTER_IN, APE__AXIS_K, bkv * D * esz, r->v, p->vs);
	set_out(ps, B_DK, "dk", APE__ROLE_OUTER_ACC, APE__AXIS_K, bkv * D * 4, r->dk != NULL);
	set_out(ps, B_DV, "dv", APE__ROLE_OUTER_ACC, APE__AXIS_K, bkv * D * 4, r->dv != NULL);
	ps->t[B_DK].dest = c->dk_all;
	ps->t[B_DV].dest = c->dv_all;
	set_in(ps, B_Q, "q", APE__ROLE_INNER_IN, APE__AXIS_Q, bh * D * esz, r->q, p->qs);
	set_in(ps, B_O, "o", APE__ROLE_INNER_IN, APE__AXIS_Q,
	       bh * D * ape_dtype_size(p->out_dtype), r->o, p->os);
	set_in(ps, B_DOUT, "dout", APE__ROLE_INNER_IN, APE__AXIS_Q,
	       bh * D * ape_dtype_size(r->dout->dtype), r->dout, r->dout_s);
	set_in(ps, B_LSE, "lse", APE__ROLE_INNER_IN, APE__AXIS_Q, bh * 4, &c->lse_t, c->lse_s);
	set_in(ps, B_DLSE, "dlse", APE__ROLE_INNER_IN, APE__AXIS_Q, bh * 4,
	       r->dlse ? &c->dlse_t : NULL, c->lse_s);
	/* a device that takes strided backward launches reads the inputs where they lie (on a
	 * device that reads host memory) instead of in chunk buffers packed for it */
	if (ape_be_dev_has(dev, APE_BE_CAP_BWD_VIEWS)) {
		static const int viewed[] = { B_K, B_V, B_Q, B_O, B_DOUT };

		for (size_t i = 0; i < sizeof(viewed) / sizeof(viewed[0]); i++) {
			struct ape__pass_tensor *x = &ps->t[viewed[i]];

			x->views = x->host && x->s[3] == 1; /* D contiguous */
		}
	}
	set_out(ps, B_DQ, "dq", APE__ROLE_JOB_OUT, APE__AXIS_Q, bh * D * 4, r->dq != NULL);
	/* each row's pairs: the visible ones in, the computed ones out, when launches may skip */
	set_out(ps, B_PAIRS, "pair counts", APE__ROLE_JOB_IN, APE__AXIS_Q, bh * 8,
		ape__skip_allowed(p));
	ps->t[B_DPARAMS] = (struct ape__pass_tensor){
		.name = "dparams", .role = APE__ROLE_CALL_ACC, .axis = APE__AXIS_NONE,
		.bytes = r->dparams ? (uint64_t)p->H * 4 * sizeof(double) : 0, .back = true,
	};
	ps->t[B_DBIAS] = (struct ape__pass_tensor){
		.name = "dbias_table", .role = APE__ROLE_CALL_ACC, .axis = APE__AXIS_NONE,
		.bytes = p->dbias_table ? (uint64_t)(ape__bias_rows(p) * p->bias_len) * sizeof(double)
					: 0,
		.back = true,
	};
	for (int w = 0; w < 2; w++)
		ps->t[B_PRM64 + w] = (struct ape__pass_tensor){
			.name = w ? "parameters (float32)" : "parameters (float64)",
			.role = APE__ROLE_CALL_IN, .axis = APE__AXIS_NONE,
			.bytes = ape__params_bytes(p, w),
		};
}

static void call_input(void *self, int t, void *host, size_t bytes)
{
	const struct bwd_pass *b = self;
	struct ape_be_bwd_launch l;

	(void)bytes;
	ape__bwd_launch_shape(b->c->r->p, b->c->r->dout->dtype, 1, &l, 0, 0, 0, 0);
	ape__params_fill(&l.f, t == B_PRM32, host);
}

/* ------------------------------------------------------------------ launches */

/* The APE_BE_BWD_* parts of every launch of the call. */
static unsigned parts_of(const struct bwd_pass *b)
{
	const struct ape__pass_tensor *t = b->pass.t;

	return (t[B_DQ].row_bytes ? APE_BE_BWD_DQ : 0u) | (t[B_DK].row_bytes ? APE_BE_BWD_DK : 0u) |
	       (t[B_DV].row_bytes ? APE_BE_BWD_DV : 0u) | (t[B_DPARAMS].bytes ? APE_BE_BWD_DPARAMS : 0u) |
	       (t[B_DLSE].row_bytes ? APE_BE_BWD_DLSE : 0u) |
	       (t[B_PAIRS].row_bytes ? APE_BE_BWD_PAIRS : 0u) |
	       (t[B_DBIAS].bytes ? APE_BE_BWD_DBIAS : 0u);
}

/* Key chunks of the call (for the skip shares): before the plan, as many as the default
 * chunking gives. */
static int64_t key_chunks(const struct bwd_pass *b)
{
	const int64_t Lk = b->c->r->p->Lk;

	return b->c->nk ? b->c->nk : (Lk + APE__CHUNK_DEFAULT - 1) / APE__CHUNK_DEFAULT;
}

static uint64_t scratch(void *self, struct ape_device *dev, int64_t on, int64_t in)
{
	struct bwd_pass *b = self;
	struct ape_be_bwd_launch l;

	if (!dev->be->ops->attention_backward_scratch)
		return 0;
	ape__bwd_launch_shape(b->c->r->p, b->c->r->dout->dtype, key_chunks(b), &l, 0, in, 0, on);
	/* a ragged call: segments not known yet, at most the call's (core/backend.h) */
	l.f.nseg = b->c->r->p->segs ? b->c->r->p->nseg : 0;
	return dev->be->ops->attention_backward_scratch(dev, &l, parts_of(b));
}

static int launch(void *self, struct ape_be_queue *q, const struct ape__pass_job *j)
{
	struct bwd_pass *b = self;
	struct ape_be_bwd_launch l;

	/* outer: key rows [o0, o0 + on); inner: query rows [i0, i0 + in) */
	ape__bwd_launch_shape(b->c->r->p, b->c->r->dout->dtype, key_chunks(b), &l, j->i0, j->in,
			      j->o0, j->on);
	if (b->c->r->p->segs) { /* a ragged call: the segments of the job's rows and keys */
		l.f.segs = b->segs;
		l.f.nseg = ape__segs_clip(b->c->r->p->segs, b->c->r->p->nseg, j->i0, j->in, j->o0,
					  j->on, b->segs);
	}
	l.f.q = j->buf[B_Q];
	l.f.k = j->buf[B_K];
	l.f.v = j->buf[B_V];
	l.f.o = j->buf[B_O];
	l.f.lse = j->buf[B_LSE];
	l.f.pairs = j->buf[B_PAIRS];
	l.dout = j->buf[B_DOUT];
	l.dlse = j->buf[B_DLSE];
	l.dq = j->buf[B_DQ];
	l.dk = j->buf[B_DK];
	l.dv = j->buf[B_DV];
	l.dparams = j->buf[B_DPARAMS];
	l.dbias = j->buf[B_DBIAS];
	l.f.params[0] = j->buf[B_PRM64];
	l.f.params[1] = j->buf[B_PRM32];
	/* inputs in place (shape()), or packed ones wrapped whole, which are contiguous views: a
	 * device without APE_BE_CAP_BWD_VIEWS is told nothing (they lie as it expects) */
	l.f.strided = ape_be_dev_has(b->dev, APE_BE_CAP_BWD_VIEWS) &&
		      (j->wrapped[B_Q] || j->wrapped[B_K] || j->wrapped[B_V] || j->wrapped[B_O] ||
		       j->wrapped[B_DOUT]);
	if (l.f.strided) {
		const struct ape__pass *x = &b->pass;
		const struct ape__problem *p = b->c->r->p;

		l.f.view[APE_BE_T_Q] = ape__pass_view(x, j, B_Q, p->H, p->D);
		l.f.view[APE_BE_T_K] = ape__pass_view(x, j, B_K, p->Hkv, p->D);
		l.f.view[APE_BE_T_V] = ape__pass_view(x, j, B_V, p->Hkv, p->D);
		l.f.view[APE_BE_T_O] = ape__pass_view(x, j, B_O, p->H, p->D);
		l.dout_view = ape__pass_view(x, j, B_DOUT, p->H, p->D);
	}
	b->jobs[j->slot]++;
	l.f.path = &b->paths;
	return b->dev->be->ops->attention_backward(q, &l);
}

/* Each row's visible keys among the job's: what a backend that skips nothing computes (it may
 * leave the buffer as it is). */
static void job_input(void *self, const struct ape__pass_job *j, int t, void *host, size_t bytes)
{
	const struct bwd_pass *b = self;
	const struct ape__problem *p = b->c->r->p;
	uint64_t *h = host;

	(void)t;
	(void)bytes;
	if (p->segs) { /* a ragged call: each row against its segment's keys in the job */
		const int64_t n = ape__segs_clip(p->segs, p->nseg, j->i0, j->in, j->o0, j->on,
						 b->segs);

		for (int64_t s = 0; s < n; s++) {
			const struct ape_be_seg *x = &b->segs[s];

			for (int64_t i = 0; i < x->lq; i++) {
				const uint64_t vis = x->lk ? (uint64_t)ape_visible_keys(
								     x->q_start + i - x->k_start,
								     x->lk, p->causal)
							   : 0;

				for (int64_t bh = 0; bh < p->H; bh++) /* B = 1 */
					h[bh * j->in + x->q0 + i] = vis;
			}
		}
		return;
	}
	for (int64_t bh = 0; bh < p->B * p->H; bh++)
		for (int64_t i = 0; i < j->in; i++) {
			/* the row's distance to the job's first key (validated to fit) */
			const int64_t d = p->q_start + j->i0 + i - (p->k_start + j->o0);

			h[bh * j->in + i] = (uint64_t)ape_visible_keys(d, j->on, p->causal);
		}
}

/* ------------------------------------------------------------------ the walk */

static int outer_begin(void *self, int slot, int64_t oc, int64_t o0, int64_t n)
{
	struct bwd_pass *b = self;

	(void)oc;
	(void)n;
	b->next_qc[slot] = 0;
	b->k0[slot] = o0;
	b->jobs[slot] = 0;
	return 0;
}

/* Whether any query of rows [i0, i0 + nq) sees a key of the chunk from key row j0: the last
 * query against the first key; in a ragged call, some segment's (seg: room for p->nseg). */
static bool chunk_visible(const struct ape__problem *p, int64_t i0, int64_t nq, int64_t j0,
			  int64_t nk, struct ape_be_seg *seg)
{
	int64_t n;

	if (!p->segs) /* distances are validated to fit */
		return !p->causal || p->q_start + (i0 + nq - 1) - (p->k_start + j0) >= 0;
	n = ape__segs_clip(p->segs, p->nseg, i0, nq, j0, nk, seg);
	for (int64_t s = 0; s < n; s++)
		if (seg[s].lk &&
		    (!p->causal || seg[s].q_start + (seg[s].lq - 1) - seg[s].k_start >= 0))
			return true;
	return false;
}

static int next(void *self, int slot, int pending, int issued, int64_t *ic, int *dir)
{
	struct bwd_pass *b = self;
	const struct ape__problem *p = b->c->r->p;

	const int64_t j0 = b->k0[slot], nk = p->Lk - j0 < b->c->ck ? p->Lk - j0 : b->c->ck;

	(void)pending;
	for (int64_t qc = b->next_qc[slot]; qc < b->nq; qc++) {
		const int64_t i0 = qc * b->cq, nq = p->Lq - i0 < b->cq ? p->Lq - i0 : b->cq;

		if (chunk_visible(p, i0, nq, j0, nk, b->segs)) {
			b->next_qc[slot] = qc + 1;
			*ic = qc;
			*dir = issued ? 1 : 0;
			return APE__WALK_NEXT;
		}
	}
	b->next_qc[slot] = b->nq;
	return APE__WALK_DONE;
}

/* ------------------------------------------------------------------ results */

static void consume(void *self, const struct ape__pass_job *j)
{
	struct bwd_pass *b = self;
	const struct ape__problem *p = b->c->r->p;
	const float *part = j->host[B_DQ];
	const uint64_t *pairs = j->host[B_PAIRS];
	const int64_t D = p->D;

	/* a query chunk's dQ partial ([B, H, nq, D] float) into the accumulator, in issue order;
	 * or, the only partial its rows get, as it is: the float32 rounding of 0 + x in float64
	 * is x + 0.0f (-0 becoming +0 alike), so both give the same bits */
	for (int64_t bh = 0; part && bh < p->B * p->H; bh++) {
		const float *src = part + bh * j->in * D;
		const size_t at = (size_t)((bh * p->Lq + j->i0) * D), n = (size_t)(j->in * D);

		if (b->dq32)
			for (size_t x = 0; x < n; x++)
				b->dq32[at + x] = src[x] + 0.0f;
		else
			for (size_t x = 0; x < n; x++)
				b->dq_acc[at + x] += src[x];
	}
	for (int64_t r = 0; pairs && r < p->B * p->H * j->in; r++)
		b->pairs_computed += pairs[r];
	b->pairs_counted |= pairs != NULL;
}

/* A key chunk's finished dK or dV (staging, [B, Hkv, nk, D] float) into its host copy. */
static void place_dkv(const struct bwd_pass *b, const void *host, float *all, int64_t j0,
		      int64_t nk)
{
	const struct ape__problem *p = b->c->r->p;
	ape_tensor t;
	int64_t s[4];

	if (!host) /* not wanted, or accumulated there in place */
		return;
	ape_tensor_init(&t, all, APE_F32, p->B, p->Hkv, p->Lk, p->D);
	ape_tensor_strides(&t, s);
	ape__unpack_rows(host, &t, s, j0, nk);
}

static void outer_done(void *self, int slot, int64_t oc, int64_t o0, int64_t n,
		       const void *const *host)
{
	struct bwd_pass *b = self;

	(void)oc;
	b->worked = true;
	if (!b->jobs[slot]) /* no query sees the chunk: its rows stay the zeros they are */
		return;
	place_dkv(b, host[B_DK], b->c->dk_all, o0, n);
	place_dkv(b, host[B_DV], b->c->dv_all, o0, n);
}

static void call_done(void *self, const void *const *host)
{
	struct bwd_pass *b = self;

	if (host[B_DPARAMS])
		memcpy(b->dparams, host[B_DPARAMS], (size_t)b->pass.t[B_DPARAMS].bytes);
	if (host[B_DBIAS])
		memcpy(b->dbias, host[B_DBIAS], (size_t)b->pass.t[B_DBIAS].bytes);
}

static const struct ape__pass_ops bwd_ops = {
	.shape = shape,
	.scratch = scratch,
	.outer_begin = outer_begin,
	.next = next,
	.job_input = job_input,
	.call_input = call_input,
	.launch = launch,
	.consume = consume,
	.outer_done = outer_done,
	.call_done = call_done,
	.span = { "h2d K/V", "h2d Q/O/dO", "attention backward", "d2h dQ", "d2h dK/dV" },
};

/* ------------------------------------------------------------------ the call */

struct bwd_run {
	struct bwd_call call;
	struct ape__pass *passes[APE_MAX_DEVICES];
	int ndev;
	struct bwd_pass pass[]; /* one per device of the call */
};

/* Cost of a key chunk for the split: its visible pairs. */
static double key_cost(void *arg, int64_t j0, int64_t n)
{
	const struct bwd_run *run = arg;
	const struct ape__problem *p = run->call.r->p;
	struct ape__problem sub = *p;
	uint64_t pairs = 0;

	if (p->segs) { /* a ragged call: every segment's pairs among these keys, all heads */
		const int64_t ns = ape__segs_clip(p->segs, p->nseg, 0, p->Lq, j0, n,
						  run->call.cost_segs);

		if (ape__segs_visible(p, run->call.cost_segs, ns, &pairs))
			return (double)p->Lq * (double)n;
		return (double)pairs / (double)p->H + 1;
	}
	sub.k_start = p->k_start + j0;
	sub.Lk = n;
	if (ape__head_visible_pairs(&sub, &pairs))
		return (double)p->Lq * (double)n;
	return (double)pairs + 1;
}

/* The chunking is known: each device's host memory (zeros: query rows the causal mask hides
 * from all its keys get no launch). */
static int prepare(void *arg, const struct ape__plan *plan, int d)
{
	struct bwd_run *run = arg;
	struct bwd_pass *b = &run->pass[d];
	const struct ape__bwd_req *r = run->call.r;
	const struct ape__problem *p = r->p;
	const size_t qgrad = (size_t)(p->B * p->H * p->Lq * p->D);

	run->call.ck = plan->co;
	run->call.nk = plan->no;
	b->cq = plan->ci;
	b->nq = plan->ni;
	if (p->segs && !(b->segs = ape__malloc((size_t)p->nseg * sizeof(*b->segs))))
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " segments",
				  r->fn, p->nseg);
	/* one partial per row: dQ needs no float64 sum (half the memory, no conversion pass) */
	if (r->dq && run->ndev == 1 && plan->no == 1) {
		if (!(b->dq32 = ape__calloc(qgrad, sizeof(float))))
			return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward "
					  "pass", r->fn);
	} else if (r->dq && !(b->dq_acc = ape__calloc(qgrad, sizeof(double)))) {
		return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass",
				  r->fn);
	}
	if ((r->dparams && !(b->dparams = ape__calloc((size_t)(4 * p->H), sizeof(double)))) ||
	    (p->dbias_table &&
	     !(b->dbias = ape__calloc((size_t)(ape__bias_rows(p) * p->bias_len), sizeof(double)))))
		return ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass",
				  r->fn);
	return 0;
}

/*
 * Only after every launch succeeded: the float32 copies (dQ rounded from its float64 sum),
 * converted for 16-bit tensors, into the caller's layout. Every conversion buffer is taken
 * before the first byte is written, so that running out of memory here writes nothing too.
 */
static int write_outputs(const struct bwd_call *c, const double *dq_acc, const float *dq_f32,
			 const double *dparams, const double *dbias)
{
	const struct ape__bwd_req *r = c->r;
	const struct ape__problem *p = r->p;
	const size_t nq = (size_t)(p->B * p->H * p->Lq * p->D);
	ape_tensor *ts[3] = { r->dq, r->dk, r->dv };
	const int64_t *ss[3] = { r->dq_s, r->dk_s, r->dv_s };
	const float *all[3] = { NULL, c->dk_all, c->dv_all };
	float *dq32 = NULL;
	void *conv[3] = { NULL, NULL, NULL };
	int ret = 0;

	if (r->dq && dq_f32) {
		all[0] = dq_f32;
	} else if (r->dq) {
		dq32 = ape__malloc(nq * sizeof(float) + 1);
		if (!dq32)
			goto out_nomem;
		for (size_t i = 0; i < nq; i++)
			dq32[i] = (float)dq_acc[i];
		all[0] = dq32;
	}
	for (int i = 0; i < 3; i++) {
		size_t n;

		if (!ts[i] || ts[i]->dtype == APE_F32)
			continue;
		n = (size_t)(ts[i]->shape[0] * ts[i]->shape[1] * ts[i]->shape[2] * ts[i]->shape[3]);
		conv[i] = ape__malloc(n * ape_dtype_size(ts[i]->dtype) + 1);
		if (!conv[i])
			goto out_nomem;
		ape_convert(conv[i], ts[i]->dtype, all[i], APE_F32, n);
	}
	for (int i = 0; i < 3; i++)
		if (ts[i])
			ape__unpack_rows(conv[i] ? conv[i] : all[i], ts[i], ss[i], 0,
					 ts[i]->shape[2]);
	for (int64_t i = 0; r->dparams && i < 4 * p->H; i++)
		r->dparams[i] = (float)dparams[i];
	for (int64_t i = 0; p->dbias_table && i < ape__bias_rows(p) * p->bias_len; i++)
		p->dbias_table[i] = (float)dbias[i];
	goto out_free;
out_nomem:
	ret = ape__error(APE_ENOMEM, "%s: out of host memory converting the gradients", r->fn);
out_free:
	free(dq32);
	for (int i = 0; i < 3; i++)
		free(conv[i]);
	return ret;
}

/* The devices' dQ accumulators and parameter sums into the first one that had key chunks, in
 * device order, in float64; then the outputs. */
static int finish(struct bwd_run *run)
{
	const struct ape__problem *p = run->call.r->p;
	const size_t qgrad = (size_t)(p->B * p->H * p->Lq * p->D);
	struct bwd_pass *to = NULL;

	for (int d = 0; d < run->ndev; d++) {
		struct bwd_pass *b = &run->pass[d];

		if (!b->worked)
			continue;
		if (!to) {
			to = b;
			continue;
		}
		for (size_t i = 0; to->dq_acc && i < qgrad; i++)
			to->dq_acc[i] += b->dq_acc[i];
		for (int64_t i = 0; to->dparams && i < 4 * p->H; i++)
			to->dparams[i] += b->dparams[i];
		for (int64_t i = 0; to->dbias && i < ape__bias_rows(p) * p->bias_len; i++)
			to->dbias[i] += b->dbias[i];
	}
	if (!to)
		to = &run->pass[0];
	return write_outputs(&run->call, to->dq_acc, to->dq32, to->dparams, to->dbias);
}

int ape__exec_backward(const struct ape__bwd_req *r, struct ape__bwd_result *res)
{
	const struct ape__problem *p = r->p;
	const size_t kgrad = (size_t)(p->B * p->Hkv * p->Lk * p->D);
	struct ape__exec_result er;
	struct bwd_run *run;
	char what[128];
	int ret = 0;

	memset(res, 0, sizeof(*res));
	for (int d = 0; d < r->ndev; d++) {
		if ((ret = ape__backward_supported(r->fn, r->devs[d])) ||
		    (ret = ape__launch_supported(r->fn, r->devs[d], p)))
			return ret;
		if (p->segs && !ape_be_dev_has(r->devs[d], APE_BE_CAP_BWD_SEGMENTS))
			return ape__error(APE_ENOTSUP, "%s: %s:%d %s: no ragged backward launches",
					  r->fn, r->devs[d]->info.backend,
					  r->devs[d]->info.backend_index, r->devs[d]->info.name);
	}
	run = ape__calloc(1, sizeof(*run) + (size_t)r->ndev * sizeof(run->pass[0]));
	if (!run)
		return ape__error(APE_ENOMEM, "%s: out of host memory", r->fn);
	run->call.r = r;
	run->ndev = r->ndev;
	/* LSE rows are a [B, H, Lq, 1] tensor to the packer, where r->lse_s says */
	ape_tensor_init(&run->call.lse_t, (void *)r->lse, APE_F32, p->B, p->H, p->Lq, 1);
	ape_tensor_init(&run->call.dlse_t, (void *)r->dlse, APE_F32, p->B, p->H, p->Lq, 1);
	if (r->lse_s) {
		memcpy(run->call.lse_s, r->lse_s, sizeof(run->call.lse_s));
		memcpy(run->call.lse_t.strides, r->lse_s, sizeof(run->call.lse_t.strides));
		memcpy(run->call.dlse_t.strides, r->lse_s, sizeof(run->call.dlse_t.strides));
	} else {
		ape_tensor_strides(&run->call.lse_t, run->call.lse_s);
	}
	if (p->segs && !(run->call.cost_segs = ape__malloc((size_t)p->nseg * sizeof(struct ape_be_seg)))) {
		ret = ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " segments",
				 r->fn, p->nseg);
		goto out_free;
	}
	/* zeros: key rows no query sees get no launch */
	if ((r->dk && !(run->call.dk_all = ape__calloc(kgrad + 1, sizeof(float)))) ||
	    (r->dv && !(run->call.dv_all = ape__calloc(kgrad + 1, sizeof(float))))) {
		ret = ape__error(APE_ENOMEM, "%s: out of host memory staging the backward pass",
				 r->fn);
		goto out_free;
	}
	for (int d = 0; d < r->ndev; d++) {
		struct bwd_pass *b = &run->pass[d];

		b->c = &run->call;
		b->dev = r->devs[d];
		b->pass.ops = &bwd_ops;
		b->pass.paths = &b->paths;
		b->pass.self = b;
		b->pass.outer = APE__AXIS_K;
		shape(b, b->dev, 1, 1);
		run->passes[d] = &b->pass;
	}
	snprintf(what, sizeof(what), "B=%lld, H=%lld, Hkv=%lld, D=%lld, %s", (long long)p->B,
		 (long long)p->H, (long long)p->Hkv, (long long)p->D, ape_dtype_name(p->in_dtype));
	{
		const struct ape__exec_req er_req = {
			.fn = r->fn, .devs = r->devs, .ndev = r->ndev,
			.chunk_q = r->chunk_q ? r->chunk_q : APE__CHUNK_DEFAULT,
			.chunk_k = r->chunk_k ? r->chunk_k : APE__CHUNK_DEFAULT,
			.budget = r->budget, .depth = r->depth ? r->depth : APE__DEFAULT_DEPTH,
			.weights = r->weights, .fixed_split = true, .trace_path = r->trace_path,
			.copy_inputs = r->copy_inputs,
			.Lq = p->Lq, .Lk = p->Lk, .passes = run->passes, .cost = key_cost,
			.cost_arg = run, .prepare = prepare, .prepare_arg = run, .what = what,
			.chunk_name = "the backward pass's chunk",
		};

		ret = ape__exec_run(&er_req, &er);
	}
	if (!ret)
		ret = finish(run);
	res->h2d = er.st.h2d;
	res->d2h = er.st.d2h;
	res->peak = er.st.peak_bytes;
	res->budget = er.budget;
	res->kernel_ms = er.st.kernel_ms;
	res->copy_ms = er.st.copy_ms;
	res->devices = er.devices;
	res->launches = er.st.chunks;
	res->cq = er.cq;
	res->ck = er.ck;
	res->depth = er.depth;
	for (int d = 0; d < r->ndev; d++) {
		res->pairs_computed += run->pass[d].pairs_computed;
		res->pairs_counted |= run->pass[d].pairs_counted;
		ape__path_merge(&res->paths, &run->pass[d].paths);
	}
out_free:
	for (int d = 0; d < r->ndev; d++) {
		free(run->pass[d].dq_acc);
		free(run->pass[d].dq32);
		free(run->pass[d].dparams);
		free(run->pass[d].dbias);
		free(run->pass[d].segs);
	}
	free(run->call.cost_segs);
	free(run->call.dk_all);
	free(run->call.dv_all);
	free(run);
	return ret;
}
