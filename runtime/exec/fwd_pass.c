/* SPDX-License-Identifier: MIT */
/* The forward pass of one device (exec/fwd_pass.h). */
#include "exec/fwd_pass.h"

#include <math.h>
#include <string.h>

#include "core/alloc.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/launch.h"
#include "exec/pack.h"
#include "exec/stream.h"

#define NEG_INF_F32 0xff800000u /* -inf as a fill pattern */

int ape__fwd_mode_of(const struct ape__fwd_call *c, struct ape_device *dev, int64_t nk)
{
	if (nk == 1 && !c->force_merge)
		return APE__FWD_DIRECT;
	return dev->be->ops->attention_merge ? APE__FWD_DEVICE_MERGE : APE__FWD_HOST_MERGE;
}

static bool want_diag(const struct ape__fwd_call *c)
{
	return c->diag;
}

/* ------------------------------------------------------------------ the tensors */

static void set(struct ape__pass *p, int t, const char *name, enum ape__role role,
		enum ape__axis axis, uint64_t row_bytes, bool back)
{
	p->t[t] = (struct ape__pass_tensor){
		.name = name, .role = role, .axis = axis, .row_bytes = row_bytes, .back = back,
	};
}

/* The merged pair counts in 32 bits: every row's count fits. */
static bool pairs32(const struct ape__problem *p)
{
	return p->Lk < ((int64_t)1 << 32);
}

static void shape(void *self, struct ape_device *dev, int64_t no, int64_t ni)
{
	struct ape__fwd *f = self;
	const struct ape__fwd_call *c = f->c;
	const struct ape__problem *p = c->p;
	struct ape__pass *x = &f->pass;
	const int mode = ape__fwd_mode_of(c, dev, ni);
	const bool dm = mode == APE__FWD_DEVICE_MERGE, diag = want_diag(c);
	const uint64_t bh = (uint64_t)(p->B * p->H), bkv = (uint64_t)(p->B * p->Hkv);
	const uint64_t D = (uint64_t)p->D, esz = ape_dtype_size(p->in_dtype);
	const uint64_t oesz = mode == APE__FWD_DIRECT ? ape_dtype_size(p->out_dtype) : 4;

	(void)no;
	f->mode = mode;
	x->nt = APE__F_COUNT;
	set(x, APE__F_Q, "q", APE__ROLE_OUTER_IN, APE__AXIS_Q, bh * D * esz, false);
	set(x, APE__F_K, "k", APE__ROLE_INNER_IN, APE__AXIS_K, bkv * D * esz, false);
	set(x, APE__F_V, "v", APE__ROLE_INNER_IN, APE__AXIS_K, bkv * D * esz, false);
	x->t[APE__F_Q].host = c->q;
	x->t[APE__F_Q].s = p->qs;
	x->t[APE__F_K].host = c->k;
	x->t[APE__F_K].s = p->ks;
	x->t[APE__F_V].host = c->v;
	x->t[APE__F_V].s = p->vs;
	/* launches take strided views of q, k and v, with D contiguous */
	for (int t = APE__F_Q; t <= APE__F_V; t++)
		x->t[t].views = x->t[t].host && x->t[t].s[3] == 1;
	/* a launch's own outputs: back after it unless the device merges them, where only the
	 * LSE comes back, and only for the host's chunk-level skip test; final rows of an LSE
	 * the caller does not want (DIRECT, lse NULL) stay on the device */
	set(x, APE__F_O, "partial O", APE__ROLE_JOB_OUT, APE__AXIS_Q, bh * D * oesz, !dm);
	set(x, APE__F_LSE, "partial LSE", APE__ROLE_JOB_OUT, APE__AXIS_Q, bh * 4,
	    (mode == APE__FWD_DIRECT ? c->lse != NULL : !dm) || c->kmax);
	set(x, APE__F_PAIRS, "pair counts", APE__ROLE_JOB_OUT, APE__AXIS_Q,
	    c->want_pairs ? bh * 8 : 0, !dm);
	set(x, APE__F_ENT, "entropies", APE__ROLE_JOB_OUT, APE__AXIS_Q, diag ? bh * 4 : 0, !dm);
	set(x, APE__F_MD, "distances", APE__ROLE_JOB_OUT, APE__AXIS_Q, diag ? bh * 4 : 0, !dm);
	/* a query chunk's running result on the device, back once */
	set(x, APE__F_AO, "merged O", APE__ROLE_OUTER_ACC, APE__AXIS_Q, dm ? bh * D * 4 : 0, true);
	set(x, APE__F_ALSE, "merged LSE", APE__ROLE_OUTER_ACC, APE__AXIS_Q, dm ? bh * 4 : 0, true);
	/* a row's pairs fit 32 bits below 2^32 keys: half the bytes back */
	set(x, APE__F_APAIRS, "merged pair counts", APE__ROLE_OUTER_ACC, APE__AXIS_Q,
	    dm && c->want_pairs ? bh * (pairs32(p) ? 4 : 8) : 0, true);
	set(x, APE__F_AENT, "merged entropies", APE__ROLE_OUTER_ACC, APE__AXIS_Q,
	    dm && diag ? bh * 4 : 0, true);
	set(x, APE__F_AMD, "merged distances", APE__ROLE_OUTER_ACC, APE__AXIS_Q,
	    dm && diag ? bh * 4 : 0, true);
	x->t[APE__F_ALSE].init = NEG_INF_F32; /* nothing merged yet: the merge's identity */
	if (mode == APE__FWD_DIRECT && c->in_place) {
		/* final rows, written in place where the device reads host memory (exec/pass.h),
		 * O at its strides and LSE [B, H, Lq] */
		if (c->o && p->os[3] == 1) {
			x->t[APE__F_O].host = c->o;
			x->t[APE__F_O].s = p->os;
		}
		if (c->lse) {
			ape_tensor_init(&f->lse_t, c->lse, APE_F32, p->B, p->H, p->Lq, 1);
			ape_tensor_strides(&f->lse_t, f->lse_s);
			x->t[APE__F_LSE].host = &f->lse_t;
			x->t[APE__F_LSE].s = f->lse_s;
		}
	}
	for (int w = 0; w < 2; w++)
		x->t[APE__F_PRM64 + w] = (struct ape__pass_tensor){
			.name = w ? "parameters (float32)" : "parameters (float64)",
			.role = APE__ROLE_CALL_IN, .axis = APE__AXIS_NONE,
			.bytes = ape__params_bytes(p, w),
		};
}

static void call_input(void *self, int t, void *host, size_t bytes)
{
	const struct ape__fwd *f = self;

	(void)bytes;
	ape__params_fill(&f->tmpl, t == APE__F_PRM32, host);
}

/* ------------------------------------------------------------------ launches */

/* The launch of job j (without the merge), in *l. */
static void launch_of(struct ape__fwd *f, const struct ape__pass_job *j,
		      struct ape_be_launch *l)
{
	const struct ape__problem *p = f->c->p;
	const struct ape__pass *x = &f->pass;

	*l = f->tmpl;
	l->Lq = j->on;
	l->Lk = j->in;
	if (p->pos_q) { /* explicit positions: the slice of the job's rows and of its keys */
		l->pos_q = p->pos_q + j->o0;
		l->pos_k = p->pos_k + j->i0;
	}
	if (p->segs) { /* a ragged call: the segments of the job's rows and keys */
		l->segs = f->segs;
		l->nseg = ape__segs_clip(p->segs, p->nseg, j->o0, j->on, j->i0, j->in, f->segs);
	} else if (!p->pos_q) {
		l->q_start = p->q_start + j->o0; /* validated: positions of every row fit */
		l->k_start = p->k_start + j->i0;
	}
	l->q = j->buf[APE__F_Q];
	l->k = j->buf[APE__F_K];
	l->v = j->buf[APE__F_V];
	l->o = j->buf[APE__F_O];
	l->lse = j->buf[APE__F_LSE];
	l->pairs = j->buf[APE__F_PAIRS];
	l->ent = j->buf[APE__F_ENT];
	l->md = j->buf[APE__F_MD];
	l->pages = j->pages;
	l->params[0] = j->buf[APE__F_PRM64];
	l->params[1] = j->buf[APE__F_PRM32];
	l->strided = j->wrapped[APE__F_Q] || j->wrapped[APE__F_K] || j->wrapped[APE__F_V] ||
		     j->wrapped[APE__F_O] || j->wrapped[APE__F_LSE];
	if (l->strided) {
		l->view[APE_BE_T_Q] = ape__pass_view(x, j, APE__F_Q, p->H, p->D);
		l->view[APE_BE_T_K] = ape__pass_view(x, j, APE__F_K, p->Hkv, p->D);
		l->view[APE_BE_T_V] = ape__pass_view(x, j, APE__F_V, p->Hkv, p->D);
		l->view[APE_BE_T_O] = ape__pass_view(x, j, APE__F_O, p->H, p->D);
		l->view[APE_BE_T_LSE] = ape__pass_view(x, j, APE__F_LSE, p->H, 1);
		/* the diagnostics are always the job's own buffers */
		l->diag_view[0] = l->diag_view[1] =
			(struct ape_be_view){ 0, p->H * j->on, j->on, 1 };
	}
	if (f->prior && j->nth > 0) {
		/* the b-th chunk from the diagonal tests against 2^-b of its share: the whole
		 * direction stays within it however many chunks it has */
		const int64_t diag = f->slot[j->slot].walk.diag;
		const int64_t b = j->ic > diag ? j->ic - diag : diag - j->ic;

		l->lse_prior = j->buf[APE__F_ALSE];
		l->prior_tol = ape__skip_prior_tol(l->skip_tol, b);
	}
}

static int launch(void *self, struct ape_be_queue *q, const struct ape__pass_job *j)
{
	struct ape__fwd *f = self;
	const struct ape_backend_plugin *ops = f->dev->be->ops;
	struct ape_be_launch l;
	int ret;

	launch_of(f, j, &l);
	l.path = &f->paths;
	ret = ops->attention(q, &l);
	f->slot[j->slot].jobs++;
	if (!ret && f->mode == APE__FWD_DEVICE_MERGE) {
		const struct ape_be_merge m = {
			.rows = f->c->p->B * f->c->p->H * j->on, .D = f->c->p->D,
			.pairs32 = pairs32(f->c->p),
			.o = j->buf[APE__F_AO], .lse = j->buf[APE__F_ALSE],
			.pairs = j->buf[APE__F_APAIRS], .ent = j->buf[APE__F_AENT],
			.md = j->buf[APE__F_AMD],
			.po = j->buf[APE__F_O], .plse = j->buf[APE__F_LSE],
			.ppairs = j->buf[APE__F_PAIRS], .pent = j->buf[APE__F_ENT],
			.pmd = j->buf[APE__F_MD],
		};

		ret = ops->attention_merge(q, &m);
	}
	return ret;
}

static bool in_pages(void *self, const struct ape__pass_job *j)
{
	struct ape__fwd *f = self;
	struct ape_be_launch l;

	if (!f->dev->be->ops->attention_pages)
		return false;
	launch_of(f, j, &l);
	return f->dev->be->ops->attention_pages(f->dev, &l);
}

static uint64_t scratch(void *self, struct ape_device *dev, int64_t on, int64_t in)
{
	struct ape__fwd *f = self;
	struct ape_be_launch l = f->tmpl;

	l.Lq = on;
	l.Lk = in;
	l.nseg = f->c->p->segs ? -1 : 0; /* ragged launches, segments unknown (core/backend.h) */
	return ape__scratch_of(dev, &l);
}

/* ------------------------------------------------------------------ the walk */

static int outer_begin(void *self, int slot, int64_t oc, int64_t o0, int64_t n)
{
	struct ape__fwd *f = self;
	const struct ape__fwd_call *c = f->c;
	const struct ape__problem *p = c->p;
	struct ape__fwd_slot *fs = &f->slot[slot];
	float row[APE_MAX_D];

	(void)oc;
	if (fs->acc.m)
		ape__acc_reset(&fs->acc, p->B * p->H * n);
	for (int64_t b = 0; c->kmax && b < p->B; b++)
		for (int64_t h = 0; h < p->H; h++)
			for (int64_t i = 0; i < n; i++) {
				ape__load_row_f32(c->q, p->qs, b, h, o0 + i, row);
				fs->qnorm[(b * p->H + h) * n + i] = ape__norm(row, p->D);
			}
	if (p->segs || p->pos_q) {
		/* a ragged call, or explicit positions: from the last key the rows see back to the
		 * first (every chunk between holds some; the kernels apply each segment's causal
		 * rule, by positions when they are explicit: key chunks are never pruned by their
		 * index then, only by the segments' key rows) */
		fs->klo = 0;
		fs->khi = p->Lk;
		if (p->segs)
			ape__segs_keys(p->segs, p->nseg, o0, n, &fs->klo, &fs->khi);
		ape__walk_init(&fs->walk, 0, fs->klo < fs->khi ? fs->khi - 1 : -1, p->Lk, f->ck, 0,
			       true, f->nq == 1 && f->nk == 1);
	} else {
		ape__walk_init(&fs->walk, p->q_start + o0, p->q_start + o0 + (n - 1), p->Lk, f->ck,
			       p->k_start, p->causal, f->nq == 1 && f->nk == 1);
	}
	fs->o0 = o0;
	fs->n = n;
	fs->held = false;
	fs->jobs = 0;
	return 0;
}

/* Is the rest of the walk of slot fs in direction dir, from chunk on, provably negligible? */
static bool negligible(const struct ape__fwd *f, const struct ape__fwd_slot *fs, int64_t o0,
		       int64_t n, int64_t chunk, int dir)
{
	const struct ape__skip_rows rows = {
		.n = n,
		.pos0 = f->c->p->q_start + o0,
		.qnorm = fs->qnorm,
		.m = fs->acc.m,
		.s = fs->acc.s,
	};

	return ape__skip_tail(&f->skip, &rows, chunk, dir);
}

static int next(void *self, int slot, int pending, int issued, int64_t *ic, int *dir)
{
	struct ape__fwd *f = self;
	struct ape__fwd_slot *fs = &f->slot[slot];

	for (;;) {
		if (!fs->held) {
			if (!ape__walk_next(&fs->walk, &fs->chunk, &fs->dir))
				return APE__WALK_DONE;
			fs->held = true;
		}
		if (fs->dir < 0 && (f->c->p->segs || f->c->p->pos_q) &&
		    (fs->chunk + 1) * f->ck <= fs->klo) {
			/* a ragged call: no row of the chunk sees these keys (not a skip) */
			ape__walk_close(&fs->walk, fs->dir, fs->chunk);
			fs->held = false;
			continue;
		}
		if (fs->dir && f->c->kmax) {
			if (negligible(f, fs, fs->o0, fs->n, fs->chunk, fs->dir)) {
				f->chunks_skipped +=
					(uint64_t)ape__walk_close(&fs->walk, fs->dir, fs->chunk);
				if (fs->dir < 0)
					f->pass.dead_lo = fs->chunk;
				else
					f->pass.dead_hi = fs->chunk;
				fs->held = false;
				continue;
			}
			/*
			 * Results of this query chunk are still on their way and may well prove the
			 * rest negligible: wait for them rather than copy what may be skipped. The
			 * diagonal chunk and its first neighbour are nearly always needed, so they
			 * go out back to back.
			 */
			if (pending && issued >= 2)
				return APE__WALK_WAIT;
		}
		fs->held = false;
		*ic = fs->chunk;
		*dir = fs->dir;
		return APE__WALK_NEXT;
	}
}

/* ------------------------------------------------------------------ results */

/* A job's [B*H, n] rows of one per-row output into the call's [B, H, Lq] array. */
static void put_rows(const struct ape__fwd *f, float *dst, const float *src, int64_t o0,
		     int64_t n)
{
	const struct ape__problem *p = f->c->p;

	for (int64_t i = 0; dst && src && i < p->B * p->H; i++)
		memcpy(dst + i * p->Lq + o0, src + i * n, (size_t)n * sizeof(float));
}

/* The pair counts of a job's rows, uint32 or uint64 each. Read through memcpy: the host copy
 * may follow the float32 outputs in one staging area, 4-byte aligned only. */
static void count_pairs(struct ape__fwd *f, const void *host, int64_t rows, bool p32)
{
	const unsigned char *b = host;

	for (int64_t i = 0; host && i < rows; i++) {
		if (p32) {
			uint32_t x;

			memcpy(&x, b + 4 * i, sizeof(x));
			f->pairs_computed += x;
		} else {
			uint64_t x;

			memcpy(&x, b + 8 * i, sizeof(x));
			f->pairs_computed += x;
		}
	}
}

static void consume(void *self, const struct ape__pass_job *j)
{
	struct ape__fwd *f = self;
	const struct ape__fwd_call *c = f->c;
	struct ape__fwd_slot *fs = &f->slot[j->slot];
	const int64_t rows = c->p->B * c->p->H * j->on;
	const float *lse = j->host[APE__F_LSE], *ent = j->host[APE__F_ENT];
	const float *md = j->host[APE__F_MD];

	switch (f->mode) {
	case APE__FWD_DIRECT: /* O and LSE wrapped: the kernels wrote them in place */
		if (!j->wrapped[APE__F_O])
			ape__unpack_rows(j->host[APE__F_O], c->o, c->p->os, j->o0, j->on);
		if (!j->wrapped[APE__F_LSE])
			put_rows(f, c->lse, lse, j->o0, j->on);
		if (want_diag(c)) {
			put_rows(f, c->ent, ent, j->o0, j->on);
			put_rows(f, c->md, md, j->o0, j->on);
		}
		break;
	case APE__FWD_HOST_MERGE:
		ape__acc_add(&fs->acc, j->host[APE__F_O], lse, want_diag(c) ? ent : NULL,
			     want_diag(c) ? md : NULL);
		break;
	default: /* the LSE alone, for the skip test */
		if (lse)
			ape__acc_add(&fs->acc, NULL, lse, NULL, NULL);
		break;
	}
	count_pairs(f, j->host[APE__F_PAIRS], rows, false);
}

static void outer_done(void *self, int slot, int64_t oc, int64_t o0, int64_t n,
		       const void *const *host)
{
	struct ape__fwd *f = self;
	const struct ape__fwd_call *c = f->c;
	const struct ape__problem *p = c->p;
	struct ape__fwd_slot *fs = &f->slot[slot];

	(void)oc;
	if (f->mode == APE__FWD_HOST_MERGE) {
		ape__acc_store(&fs->acc, c->o, p->os, c->lse, c->ent, c->md, p->Lq, o0, n);
	} else if (!fs->jobs) {
		/* no launch: no row of the chunk sees a key */
		ape__store_empty_rows(c->o, p->os, c->lse, c->ent, c->md, p->Lq, o0, n);
	} else if (f->mode == APE__FWD_DEVICE_MERGE) {
		ape__store_rows_f32(host[APE__F_AO], c->o, p->os, o0, n);
		put_rows(f, c->lse, host[APE__F_ALSE], o0, n);
		put_rows(f, c->ent, host[APE__F_AENT], o0, n);
		put_rows(f, c->md, host[APE__F_AMD], o0, n);
		count_pairs(f, host[APE__F_APAIRS], p->B * p->H * n, pairs32(p));
	}
}

static const struct ape__pass_ops fwd_ops = {
	.shape = shape,
	.scratch = scratch,
	.outer_begin = outer_begin,
	.next = next,
	.call_input = call_input,
	.in_pages = in_pages,
	.launch = launch,
	.consume = consume,
	.outer_done = outer_done,
	.span = { "h2d Q", "h2d K/V", "attention", "d2h O/LSE", "d2h O/LSE merged" },
};

/* ------------------------------------------------------------------ set-up */

static void set_template(struct ape__fwd *f, int64_t nk)
{
	const struct ape__fwd_call *c = f->c;
	struct ape__skip_budget tol;

	/* the kernels' share of skip_tol; with several key chunks before the plan is known, as
	 * there (a launch with skipping needs the most scratch) */
	if (nk)
		tol = c->tol;
	else
		ape__skip_budget(c->p->skip_tol, c->p->causal, 2, c->release, &tol);
	ape__launch_init(&f->tmpl, c->p, f->mode == APE__FWD_DIRECT ? c->p->out_dtype : APE_F32,
			 ape__skip_launch_tol(&tol, f->prior));
}

void ape__fwd_init(struct ape__fwd *f, const struct ape__fwd_call *c, struct ape_device *dev)
{
	memset(f, 0, sizeof(*f));
	f->c = c;
	f->dev = dev;
	f->pass.ops = &fwd_ops;
	f->pass.paths = &f->paths;
	f->pass.self = f;
	f->pass.outer = APE__AXIS_Q;
	f->pass.early_back = true;
	f->mode = APE__FWD_HOST_MERGE;
	set_template(f, 0);
	shape(f, dev, 1, 2);
}

int ape__fwd_prepare(struct ape__fwd *f, int64_t cq, int64_t ck, int64_t nq, int64_t nk,
		     int o_slots)
{
	const struct ape__fwd_call *c = f->c;
	const struct ape__problem *p = c->p;
	const int64_t rows = p->B * p->H * cq;
	int ret;

	f->cq = cq;
	f->ck = ck;
	f->nq = nq;
	f->nk = nk;
	shape(f, f->dev, nq, nk);
	f->prior = f->mode == APE__FWD_DEVICE_MERGE && ape__skip_allowed(p) && nk > 1 && !p->segs &&
		   !p->pos_q;
	set_template(f, nk);
	f->skip = (struct ape__skip_ctx){
		.B = p->B, .H = p->H, .Hkv = p->Hkv, .Lk = p->Lk, .ck = ck, .k_start = p->k_start,
		.causal = p->causal, .abs_scale = fabs(p->scale), .head_params = p->head_params,
		.bias_smax = p->bias_smax, .bias_len = p->bias_len, .bias_hstride = p->bias_hstride,
		.km = c->kmax, .tol = c->tol.chunk,
	};
	if (p->segs && !(f->segs = ape__malloc((size_t)p->nseg * sizeof(*f->segs))))
		return ape__error(APE_ENOMEM, "out of memory for %lld segments", (long long)p->nseg);
	for (int i = 0; i < o_slots; i++) {
		struct ape__fwd_slot *fs = &f->slot[i];

		if (f->mode == APE__FWD_HOST_MERGE)
			ret = ape__acc_alloc(&fs->acc, rows, p->D, want_diag(c));
		else if (f->mode == APE__FWD_DEVICE_MERGE && c->kmax)
			ret = ape__acc_alloc(&fs->acc, rows, 0, false);
		else
			ret = 0;
		if (!ret && c->kmax && !(fs->qnorm = ape__malloc((size_t)rows * sizeof(float) + 1)))
			ret = ape__error(APE_ENOMEM, "out of memory for query norms");
		if (ret) {
			ape__fwd_fini(f);
			return ret;
		}
	}
	return 0;
}

void ape__fwd_fini(struct ape__fwd *f)
{
	free(f->segs);
	f->segs = NULL;
	for (int i = 0; i < APE__MAX_DEPTH; i++) {
		ape__acc_free(&f->slot[i].acc);
		free(f->slot[i].qnorm);
		f->slot[i].qnorm = NULL;
	}
}
