/* SPDX-License-Identifier: MIT */
/*
 * KV-pool attends (api/kvpool.h): a ragged batch of query rows, each run of rows against the
 * keys of its own sequence, as one run of the attend session (api/kv_session.h).
 *
 * Everything is checked first (ids, offsets, tensors, desc, positions). Then each sequence's
 * window: the oldest keys its pages' norm maxima prove negligible for its rows are left out,
 * unread (ape__kv_window_cut()). The keys the batch reads are laid end to end as one virtual
 * key axis (struct ape__kvp_krun: a run of a sequence's tokens each), and every run of query
 * rows at consecutive positions is a segment (struct ape_be_seg) against its sequence's run: the
 * executor's ragged launches, key chunks gathered from the pages on the device by the loader
 * below (one copy per head and run of consecutive slots), or read in place (below).
 *
 * The batch runs as groups, each one run of the session, chosen per sequence by the sequence
 * alone (run_groups()): a sequence the backend's decode reads in place joins the decode group
 * of its neighbours (one ragged decode launch over every key, each sequence chunked as it would
 * be alone); any other sequence whose window passes one key chunk of the plan runs by itself
 * (the dense problem, chunked from its own first key); the rest are packed in order into ragged
 * groups of at most one key chunk, each sequence whole in it. So no key chunk cuts a sequence
 * at a place that depends on the others, every sequence takes the same kernels whatever shares
 * its batch, and its rows come out bit for bit the same whatever other sequences share the
 * batch and in what order. Forks share pages, so a batch's keys may also outnumber the pool's
 * slots: the groups cover that too.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/lse_merge.h"
#include "exec/skip_budget.h"
#include "api/kvpool.h"
#include "api/stats.h"
#include "api/validate.h"
#include "api/varlen.h"

/* ------------------------------------------------------------------ the loader */

/* The key run holding virtual key j of the current group (runs sorted by j0). */
static const struct ape__kvp_krun *krun_of(const struct ape__kvp_krun *kr, int64_t n, int64_t j)
{
	int64_t lo = 0, hi = n - 1;

	while (lo < hi) {
		const int64_t mid = (lo + hi + 1) / 2;

		if (kr[mid].j0 <= j)
			lo = mid;
		else
			hi = mid - 1;
	}
	return &kr[lo];
}

/* Gathers virtual key rows [j0, j0 + n) into dk, dv ([1, Hkv, n, D]). */
static int pool_load(void *arg, struct ape_be_queue *q, int lane, int64_t j0, int64_t n,
		     struct ape_be_buf *dk, struct ape_be_buf *dv, uint64_t *h2d, uint64_t *d2h,
		     uint64_t *d2d)
{
	struct ape_kv_pool *pl = arg;
	const size_t row = (size_t)pl->o.D * pl->esz;
	const struct ape__kvp_krun *kr = pl->kr + pl->cur_kr, *end = kr + pl->cur_nkr;
	int ret = ape__kvp_wait(pl, q);

	(void)lane;
	(void)h2d;
	(void)d2h;
	for (const struct ape__kvp_krun *r = krun_of(kr, pl->cur_nkr, j0); !ret && r < end &&
									    r->j0 < j0 + n;
	     r++) {
		const int64_t a = r->j0 > j0 ? r->j0 : j0;
		const int64_t b = r->j0 + r->n < j0 + n ? r->j0 + r->n : j0 + n;

		for (int64_t j = a; j < b && !ret;) {
			const int64_t t = r->t0 + (j - r->j0);
			const int64_t m = ape__kvp_contig(pl, r->s, t, b - j);
			const int64_t e = ape__kvp_elem(pl, r->s, t);

			if (pl->g.sr == pl->o.D) { /* rows one run per head: plain copies */
				for (int64_t g = 0; g < pl->o.Hkv && !ret; g++) {
					const size_t dst = (size_t)(g * n + (j - j0)) * row;

					ret = pl->ops->copy_d2d(q, dk, dst, pl->k,
								(size_t)(pl->g.koff + g * pl->g.sh + e) *
									pl->esz,
								(size_t)m * row);
					if (!ret)
						ret = pl->ops->copy_d2d(
							q, dv, dst, pl->v,
							(size_t)(pl->g.voff + g * pl->g.sh + e) * pl->esz,
							(size_t)m * row);
				}
			} else { /* a caller's rows apart (heads interleaved): strided copies */
				struct ape_be_copy c = {
					.B = 1, .H = pl->o.Hkv, .L = m, .D = pl->o.D, .dst = dk,
					.src = pl->k, .dst_type = (int)pl->o.dtype,
					.src_type = (int)pl->o.dtype,
					.dv = { (j - j0) * pl->o.D, 0, n * pl->o.D, pl->o.D },
					.sv = { pl->g.koff + e, 0, pl->g.sh, pl->g.sr },
					.head_D = pl->o.D,
				};

				ret = pl->ops->copy_view(q, &c);
				c.dst = dv;
				c.src = pl->v;
				c.sv.off = pl->g.voff + e;
				if (!ret)
					ret = pl->ops->copy_view(q, &c);
			}
			*d2d += 2 * (uint64_t)(pl->o.Hkv * m) * row;
			j += m;
		}
	}
	return ret;
}

/* In place: the keys [j0, j0 + n) of a group of one sequence's keys (the dense problem, or a
 * ragged launch of its rows alone: a decode group of one). When their rows are one run, the
 * page buffers are one block read from the run's first row; else pages addressed through the
 * group's page table (run_group() made it, pool_wait() writes it before the launch). The table
 * of a ragged group of several sequences holds the element offset of every key row (blocks of
 * one token). */
static bool pool_pages(void *arg, int64_t j0, int64_t n, struct ape_be_buf **k, struct ape_be_buf **v,
		       struct ape_be_kv_pages *pg)
{
	const struct ape_kv_pool *pl = arg;
	const struct ape__kvp_krun *r = pl->kr + pl->cur_kr;
	int64_t t;

	*k = pl->k;
	*v = pl->v;
	memset(pg, 0, sizeof(*pg));
	pg->k_off = pl->g.koff;
	pg->v_off = pl->g.voff;
	pg->s_h = pl->g.sh;
	pg->s_row = pl->g.sr;
	if (pl->cur_ragged && pl->cur_nkr != 1) { /* the group's element offset of every key row */
		pg->block_tokens = 1;
		pg->nblocks = pl->nslots;
		pg->first_block = j0;
		pg->s_block = 1;
		pg->table = pl->tab;
		return true;
	}
	if (pl->cur_nkr != 1)
		return false;
	t = r->t0 + (j0 - r->j0);
	if (ape__kvp_contig(pl, r->s, t, n) == n) { /* one run of rows sr apart, from t's */
		pg->block_tokens = pl->nslots;
		pg->nblocks = 1;
		pg->k_off += ape__kvp_elem(pl, r->s, t);
		pg->v_off += ape__kvp_elem(pl, r->s, t);
		return true;
	}
	if (t / pl->P < pl->tab_first)
		return false; /* not the group's table (cannot happen: the table starts there) */
	pg->block_tokens = pl->P;
	pg->nblocks = pl->npages;
	pg->first_block = t / pl->P - pl->tab_first;
	pg->first_row = t % pl->P;
	pg->s_block = pl->g.sp;
	pg->table = pl->tab;
	return true;
}

/* Before a launch in place: after the appends, and the group's page table written. */
static int pool_wait(void *arg, struct ape_be_queue *q)
{
	struct ape_kv_pool *pl = arg;
	int ret = ape__kvp_wait(pl, q);

	if (!ret && pl->tab_pending) {
		ret = pl->ops->copy_h2d(q, pl->tab, 0, pl->tab_host,
					(size_t)pl->tab_n * sizeof(*pl->tab_host));
		pl->tab_pending = false;
	}
	return ret;
}

/* ------------------------------------------------------------------ checks */

/* The problem: desc checked as a forward call over zero keys (positions from the pool). */
int ape__kvp_attend_problem(struct ape_kv_pool *pl, const char *fn, const ape_attn_desc *desc,
			    const ape_tensor *q, const ape_tensor *o, const float *lse,
			    const struct ape__diag_req *dg, struct ape__problem *p)
{
	static const char *const dims[4] = { "B", "H", "total_q", "D" };
	const int64_t want[4] = { 1, pl->o.H, -1, pl->o.D };
	ape_tensor none;
	int64_t s[4];
	int ret;

	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	if ((ret = ape__check_tensor(fn, "q", q, pl->o.dtype, want, dims, s)))
		return ret;
	if (q->shape[2] > pl->o.max_batch_tokens)
		return ape__error(APE_EINVAL,
				  "%s: q->shape[2] = %" PRId64 ": more than max_batch_tokens = %" PRId64,
				  fn, q->shape[2], pl->o.max_batch_tokens);
	if (ape__desc_size_ok(desc) && (desc->q_start_set || desc->k_start))
		return ape__error(APE_EINVAL,
				  "%s: desc->%s: positions come from the pool (each sequence's "
				  "k_start, and pos_q): q_start_set must be false and k_start 0",
				  fn, desc->q_start_set ? "q_start_set = true" : "k_start != 0");
	ape_tensor_init(&none, NULL, pl->o.dtype, 1, pl->o.Hkv, 0, pl->o.D);
	if ((ret = ape__problem_init(p, fn, desc, q, &none, &none, o, lse)))
		return ret;
	ret = ape__check_diag_outputs(fn, p, q, NULL, NULL, o, lse, dg->ent, dg->md);
	if (!ret) /* tightens skip_tol (the diagnostics' bound) before any window is cut */
		ret = ape__diag_prepare(fn, &pl->dev, 1, p, dg);
	if (ret)
		ape__problem_fini(p);
	return ret;
}

/* ------------------------------------------------------------------ the batch */

struct norms_arg {
	const struct ape_kv_pool *pl;
	const struct ape__kvp_seq *s;
};

/* Page lb of a sequence: its key-norm maxima per head (struct ape__kv_keys.norms). */
static const float *page_norms(const void *arg, int64_t lb)
{
	const struct norms_arg *na = arg;

	return na->pl->pnorm + na->s->pages[lb] * na->pl->o.Hkv;
}

/* The running maxima of a sequence through its page lb (struct ape__kv_keys.prefix). */
static const float *page_prefix(const void *arg, int64_t lb)
{
	const struct norms_arg *na = arg;

	return na->s->pre + lb * na->pl->o.Hkv;
}

/* Room for n more segments and key runs. */
static int grow(struct ape_kv_pool *pl, const char *fn, int64_t nseg, int64_t nkr)
{
	if (nseg > pl->segs_cap) {
		const int64_t cap = nseg > 2 * pl->segs_cap ? nseg : 2 * pl->segs_cap;
		struct ape_be_seg *g = ape__realloc(pl->segs, (size_t)cap * sizeof(*g));

		if (!g)
			return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
		pl->segs = g;
		g = ape__realloc(pl->full, (size_t)cap * sizeof(*g));
		if (!g)
			return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
		pl->full = g;
		pl->segs_cap = cap;
	}
	if (nkr > pl->kr_cap) {
		const int64_t cap = nkr > 2 * pl->kr_cap ? nkr : 2 * pl->kr_cap;
		struct ape__kvp_krun *g = ape__realloc(pl->kr, (size_t)cap * sizeof(*g));

		if (!g)
			return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
		pl->kr = g;
		pl->kr_cap = cap;
	}
	return 0;
}

/*
 * The segments and key runs of the batch into pl->segs, pl->kr (the virtual key axis: each
 * sequence's window after the one before), each sequence's window cut with a share `wtol` of
 * skip_tol when p and q are given and the pool keeps norm maxima; the same segments uncut
 * into pl->full (the pairs visible count every key).
 */
int ape__kvp_plan(struct ape_kv_pool *pl, const char *fn, const struct ape__problem *p,
		  const ape_tensor *q, int64_t nseq, const int64_t *seq_ids, const int64_t *cu,
		  const int64_t *pos_q, double wtol)
{
	int64_t nsg = 0, nkr = 0, lk_total = 0;
	int ret;

	for (int64_t i = 0; i < nseq; i++) {
		const struct ape__kvp_seq *s = &pl->seq[seq_ids[i]];
		const int64_t q0 = cu[i], lq = cu[i + 1] - cu[i];
		const struct norms_arg na = { pl, s };
		const struct ape__kv_keys kk = {
			.first = s->first, .t_end = s->n, .k_start = s->k_start, .bt = pl->P,
			.nbg = pl->o.Hkv, .norms = page_norms, .prefix = page_prefix, .arg = &na,
		};
		int64_t qmin, w = s->first, lk; /* w: the tokens left out, released or cut */

		if (!lq)
			continue;
		if ((ret = grow(pl, fn, nsg + lq, nkr + 1)))
			return ret;
		qmin = s->k_start + s->n - lq;
		for (int64_t r = q0; pos_q && r < q0 + lq; r++)
			qmin = r == q0 || pos_q[r] < qmin ? pos_q[r] : qmin;
		if (s->n && p && q && !pl->ext)
			w += ape__kv_window_cut(&kk, p, q, q0, lq, qmin, wtol);
		lk = s->n - w;
		if (lk)
			pl->kr[nkr++] = (struct ape__kvp_krun){ .j0 = lk_total, .n = lk, .t0 = w, .s = s };
		/* the rows in runs of consecutive positions, each a segment */
		for (int64_t a = q0, b; a < q0 + lq; a = b) {
			const int64_t qs = pos_q ? pos_q[a] : s->k_start + s->n - lq;

			for (b = a + 1; pos_q && b < q0 + lq && pos_q[b - 1] != INT64_MAX &&
					pos_q[b] == pos_q[b - 1] + 1;
			     b++)
				;
			if (!pos_q)
				b = q0 + lq;
			if ((ret = ape__check_positions(fn, qs, b - a, s->k_start, s->n))) {
				char where[80];

				snprintf(where, sizeof(where),
					 " (batch entry %" PRId64 ", sequence %" PRId64 ")", i,
					 seq_ids[i]);
				return ape__error_suffix(ret, where);
			}
			pl->full[nsg] = (struct ape_be_seg){ .q0 = a, .lq = b - a,
							   .lk = s->n - s->first, .q_start = qs,
							   .k_start = s->k_start + s->first };
			pl->segs[nsg++] = (struct ape_be_seg){ .q0 = a, .lq = b - a, .k0 = lk_total,
							     .lk = lk, .q_start = qs,
							     .k_start = s->k_start + w };
		}
		lk_total += lk;
	}
	pl->nsg = nsg;
	pl->nkr = nkr;
	pl->lk_total = lk_total;
	return 0;
}

/*
 * Runs segments [s0, s1) (query rows [qa, qb), key runs [r0, r1), virtual keys [ka, kb)) as
 * one executor run of a problem over those rows and keys, ragged launches or (dense: one
 * segment) the dense problem; LSE into pl->lse_stage ([H][qb - qa]) when wanted. Adds to *res.
 */
static int run_group(struct ape_kv_pool *pl, const char *fn, const struct ape__problem *p,
		     const ape_tensor *q, ape_tensor *o, bool want_lse, const struct ape__diag_req *dg,
		     bool want_pairs, bool dense, int64_t s0, int64_t s1, int64_t r0, int64_t r1,
		     struct ape__exec_result *res)
{
	/* the diagnostics wanted, staged like LSE ([H][rows]) */
	const struct ape__diag_req dgs = { dg->ent ? pl->diag_stage : NULL,
					   dg->md ? pl->diag_stage + pl->o.H * pl->o.max_batch_tokens
						  : NULL };
	const int64_t qa = pl->segs[s0].q0, qb = pl->segs[s1 - 1].q0 + pl->segs[s1 - 1].lq;
	const int64_t ka = r0 < r1 ? pl->kr[r0].j0 : 0;
	const int64_t kb = r0 < r1 ? pl->kr[r1 - 1].j0 + pl->kr[r1 - 1].n : 0;
	struct ape__problem g = *p;
	ape_tensor qg = *q, og = *o;
	struct ape__kv_run run;
	int ret;

	qg.data = (char *)q->data + (size_t)(qa * p->qs[2]) * ape_dtype_size(q->dtype);
	qg.shape[2] = qb - qa;
	og.data = (char *)o->data + (size_t)(qa * p->os[2]) * ape_dtype_size(o->dtype);
	og.shape[2] = qb - qa;
	g.Lq = qb - qa;
	g.Lk = kb - ka;
	if (g.Lk == 0) {
		ape__store_empty_rows(&og, p->os, want_lse ? pl->lse_stage : NULL, dgs.ent, dgs.md,
				      g.Lq, 0, g.Lq);
		return 0;
	}
	if (!dense && !ape_be_caps_have(&pl->dev->caps, APE_BE_CAP_SEGMENTS)) /* before the axes move: a plan is reused */
		return ape__error_on(ape__error(APE_ENOTSUP,
						"%s: %s:%d takes no ragged launches (a batch of "
						"several sequences needs them)",
						fn, pl->dev->info.backend, pl->dev->info.backend_index),
				     pl->dev);
	for (int64_t s = s0; s < s1; s++) { /* the group's own axes */
		pl->segs[s].q0 -= qa;
		pl->segs[s].k0 -= ka;
	}
	for (int64_t r = r0; r < r1; r++)
		pl->kr[r].j0 -= ka;
	pl->cur_kr = r0;
	pl->cur_nkr = r1 - r0;
	pl->cur_ragged = !dense; /* dense: one segment over all the group's rows and keys */
	if (pl->cur_ragged) {
		g.segs = pl->segs + s0;
		g.nseg = s1 - s0;
	} else { /* one sequence over all its keys: the dense problem, every fast path */
		g.q_start = pl->segs[s0].q_start;
		g.k_start = pl->segs[s0].k_start;
	}
	if (r1 - r0 == 1) {
		/* one sequence's keys (the dense problem, or a ragged launch of its rows alone):
		 * its page table from its window's first page, for a launch in place (pool_pages()
		 * reads it, or one run of slots where the pages lie in order) */
		const struct ape__kvp_krun *r = pl->kr + r0;

		pl->tab_first = r->t0 / pl->P;
		pl->tab_n = r->s->npages - pl->tab_first;
		/* (none where its window lies in one run of slots: every launch reads that; none
		 * for a backend that reads no pages in place) */
		pl->tab_pending = pl->ops->attention_pages &&
				  ape__kvp_contig(pl, r->s, r->t0, r->n) < r->n;
		if (pl->tab_pending)
			memcpy(pl->tab_host, r->s->pages + pl->tab_first,
			       (size_t)pl->tab_n * sizeof(*pl->tab_host));
	} else {
		/* several sequences: every key row's slot, for launches that read them in place */
		pl->tab_n = 0;
		for (int64_t r = r0; pl->ops->attention_pages && r < r1; r++)
			for (int64_t j = 0; j < pl->kr[r].n; j++)
				pl->tab_host[pl->tab_n++] =
					ape__kvp_elem(pl, pl->kr[r].s, pl->kr[r].t0 + j);
		pl->tab_pending = pl->tab_n > 0;
	}
	run = (struct ape__kv_run){
		.p = &g, .q = &qg, .o = &og, .lse = want_lse ? pl->lse_stage : NULL, .dg = &dgs,
		.want_pairs = want_pairs, .release = pl->o.max_query_norm > 0, .loader = &pl->loader,
	};
	ret = ape__kv_session_run(&pl->ks, fn, &run, res);
	for (int64_t s = s0; s < s1; s++) {
		pl->segs[s].q0 += qa;
		pl->segs[s].k0 += ka;
	}
	for (int64_t r = r0; r < r1; r++)
		pl->kr[r].j0 += ka;
	return ret;
}

/* Runs segments [s0, s1) and key runs [r0, r1) as one group (run_group()), LSE and the
 * diagnostics transposed into lse, ent, md ([total_q, H] each). */
static int flush(struct ape_kv_pool *pl, const char *fn, const struct ape__problem *p,
		 const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		 bool want_pairs, bool dense, int64_t s0, int64_t s1, int64_t r0, int64_t r1,
		 struct ape__exec_result *res)
{
	const int64_t stage = pl->o.H * pl->o.max_batch_tokens;
	float *const out[3] = { lse, dg->ent, dg->md };
	const float *const from[3] = { pl->lse_stage, pl->diag_stage, pl->diag_stage + stage };
	int64_t qa, n;
	int ret;

	if (s0 == s1)
		return 0;
	qa = pl->segs[s0].q0;
	n = pl->segs[s1 - 1].q0 + pl->segs[s1 - 1].lq - qa;
	ret = run_group(pl, fn, p, q, o, lse != NULL, dg, want_pairs, dense, s0, s1, r0, r1, res);
	for (int x = 0; x < 3; x++)
		for (int64_t h = 0; !ret && out[x] && h < p->H; h++)
			for (int64_t i = 0; i < n; i++)
				out[x][(qa + i) * p->H + h] = from[x][h * n + i];
	return ret;
}

/*
 * On a backend without the in-place decode (attention_pages: the reference), a decode-shaped
 * sequence (one run of at most ALONE_ROWS rows) over at least ALONE_KEYS keys runs by itself
 * too: ragged launches without a decode kernel spend a whole tile of 64 rows on each decode row
 * (on OpenCL before its ragged decode, a step of 8 decode rows over 640 keys each took 10.8 ms
 * of kernel that way, against about 0.25 ms a sequence by itself; bench/RESULTS.md). OpenCL's
 * and CUDA's decodes take ragged launches, reading every sequence's pages in place through the
 * group's slot table.
 */
#define ALONE_ROWS 16
#define ALONE_KEYS 128

/*
 * Runs the batch's segments in groups (see the file's comment). A sequence is a unit: its
 * segments (consecutive, one key run). A unit whose keys pass one key chunk of the plan, or a
 * decode-shaped one (above), runs alone, as the dense problem when it is one segment (every fast
 * path, the pages read in place where the backend can); the others are packed in order into
 * ragged groups of at most one key chunk. Which of these a sequence gets depends on it alone.
 */
/* Whether the backend reads segment sg of p (a unit of one segment) in place, in a ragged
 * launch: the decode's shape (a few rows; on OpenCL's plain shape, on CUDA at most 16). A
 * property of the sequence and the pool alone. */
static bool decodes_in_place(const struct ape_kv_pool *pl, const struct ape__problem *p,
			     const struct ape_be_seg *sg)
{
	struct ape_be_seg one = *sg;
	struct ape_be_kv_pages pg = { .block_tokens = 1, .nblocks = pl->nslots, .s_block = 1,
				    .s_h = pl->g.sh, .s_row = pl->g.sr, .table = pl->tab };
	struct ape_be_launch l;

	if (!pl->ops->attention_pages || sg->lk < 1)
		return false;
	one.q0 = one.k0 = 0;
	ape__launch_init(&l, p, APE_F32, 0);
	l.Lq = one.lq;
	l.Lk = one.lk;
	l.segs = &one;
	l.nseg = 1;
	l.pages = &pg;
	return pl->ops->attention_pages(pl->dev, &l);
}

static int run_groups(struct ape_kv_pool *pl, const char *fn, const struct ape__problem *p,
		      const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		      bool want_pairs, struct ape__exec_result *res)
{
	const int64_t most = pl->ks.geom.plan.ci; /* one key chunk */
	int64_t g0 = 0, gr0 = 0, keys = 0, r = 0;
	bool in_dec = false; /* the open group is a decode group */
	int ret = 0;

	for (int64_t u0 = 0, u1; u0 < pl->nsg && !ret; u0 = u1) {
		const int64_t k0 = pl->segs[u0].k0, lk = pl->segs[u0].lk;
		bool dec;

		for (u1 = u0 + 1; lk && u1 < pl->nsg && pl->segs[u1].k0 == k0 && pl->segs[u1].lk == lk;
		     u1++)
			;
		if (!lk && in_dec && u1 - u0 == 1) { /* no key: joins the decode group when the
							 * decode would take its rows */
			struct ape_be_seg one = pl->segs[u0];

			one.lk = 1;
			if (decodes_in_place(pl, p, &one))
				continue;
		}
		dec = u1 - u0 == 1 && decodes_in_place(pl, p, &pl->segs[u0]);
		if (dec) { /* a decode group: any keys, every one read in place in one launch */
			if (!in_dec || keys + lk > pl->nslots) {
				ret = flush(pl, fn, p, q, o, lse, dg, want_pairs, false, g0, u0, gr0, r,
					    res);
				g0 = u0;
				gr0 = r;
				keys = 0;
			}
			in_dec = true;
			keys += lk;
			r++;
			continue;
		}
		if (lk > most || (!pl->ops->attention_pages && u1 - u0 == 1 &&
				  pl->segs[u0].lq <= ALONE_ROWS && lk >= ALONE_KEYS)) { /* alone */
			ret = flush(pl, fn, p, q, o, lse, dg, want_pairs, false, g0, u0, gr0, r, res);
			if (!ret)
				ret = flush(pl, fn, p, q, o, lse, dg, want_pairs, u1 - u0 == 1, u0, u1, r,
					    r + 1, res);
			g0 = u1;
			gr0 = ++r;
			keys = 0;
			in_dec = false;
			continue;
		}
		if (in_dec || keys + lk > most) {
			ret = flush(pl, fn, p, q, o, lse, dg, want_pairs, false, g0, u0, gr0, r, res);
			g0 = u0;
			gr0 = r;
			keys = 0;
			in_dec = false;
		}
		keys += lk;
		r += lk > 0;
	}
	if (!ret)
		ret = flush(pl, fn, p, q, o, lse, dg, want_pairs, false, g0, pl->nsg, gr0, r, res);
	return ret;
}

/* The planned batch (ape__kvp_plan()) on the session, and the call's report. p->Lq > 0 unless
 * the batch has no row. */
int ape__kvp_run(struct ape_kv_pool *pl, const char *fn, struct ape__problem *p,
		 const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		 ape_stats *stats, double t0)
{
	struct ape__exec_result res;
	uint64_t visible = 0;
	int ret = 0;

	memset(&res, 0, sizeof(res));
	if ((ret = ape__launch_supported(fn, pl->dev, p)))
		return ret;
	if (p->Lq > 0) {
		if (ape__segs_visible(p, pl->full, pl->nsg, &visible))
			return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
		ret = run_groups(pl, fn, p, q, o, lse, dg, stats != NULL, &res);
		p->Lk = pl->lk_total; /* the call log's shape: the keys the batch read */
	}
	if (stats || ape__call_logs(&pl->dev, 1)) {
		const struct ape__call_report rep = {
			.fn = fn, .p = p, .ret = ret, .pairs_uncounted = !stats && p->Lq > 0,
			.res = &res, .devs = &pl->dev, .ndev = 1, .devices = 1,
			.pairs_visible = visible, .t0 = t0,
		};

		res.budget = pl->o.max_device_bytes ? pl->o.max_device_bytes : UINT64_MAX;
		res.st.peak_bytes += pl->mem.cur;
		ape__call_done(stats, &rep);
	}
	return ret;
}

static int attend(ape_kv_pool *pl, const char *fn, const ape_attn_desc *desc, int64_t nseq,
		  const int64_t *seq_ids, const int64_t *cu_seqlens_q, const int64_t *pos_q,
		  const ape_tensor *q, ape_tensor *o, float *lse, const struct ape__diag_req *dg,
		  ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__problem p;
	double wtol = 0, rest = 0;
	int ret;

	if (!pl)
		return ape__error(APE_EINVAL, "%s: pool = NULL", fn);
	if ((ret = ape__stats_check(fn, stats)))
		return ret;
	if ((ret = ape__kvp_attend_problem(pl, fn, desc, q, o, lse, dg, &p)))
		return ret;
	if ((ret = ape__kvp_check_batch(pl, fn, nseq, seq_ids, cu_seqlens_q, "cu_seqlens_q", p.Lq,
					"q->shape[2]")) ||
	    (ret = ape__kvp_check_terms(pl, fn, &p, q, nseq, seq_ids, cu_seqlens_q, pos_q)))
		goto out;
	/* with release allowed, a share of skip_tol stays for it (as the KV cache keeps) */
	ape__skip_window(p.skip_tol, pl->o.max_query_norm > 0, &wtol, &rest);
	pl->nsg = pl->nkr = pl->lk_total = 0;
	if (p.Lq > 0 && (ret = ape__kvp_plan(pl, fn, &p, q, nseq, seq_ids, cu_seqlens_q, pos_q,
					     wtol)))
		goto out; /* a check failed: nothing written, nothing to report */
	/* whether or not any window was cut, so that a sequence's launches skip by the same
	 * tolerance whatever else shares the batch */
	if (ape__skip_allowed(&p))
		p.skip_tol = rest;
	ret = ape__kvp_run(pl, fn, &p, q, o, lse, dg, stats, t0);
out:
	ape__problem_fini(&p);
	return ret;
}

int ape_kv_pool_attend(ape_kv_pool *pl, const ape_attn_desc *desc, int64_t nseq,
		       const int64_t *seq_ids, const int64_t *cu_seqlens_q, const int64_t *pos_q,
		       const ape_tensor *q, ape_tensor *o, float *lse, ape_stats *stats)
{
	APE__API_CALL("ape_kv_pool_attend");
	static const struct ape__diag_req none = { NULL, NULL };

	return attend(pl, "ape_kv_pool_attend", desc, nseq, seq_ids, cu_seqlens_q, pos_q, q, o,
		      lse, &none, stats);
}

int ape_kv_pool_attend_diag(ape_kv_pool *pl, const ape_attn_desc *desc, int64_t nseq,
			    const int64_t *seq_ids, const int64_t *cu_seqlens_q,
			    const int64_t *pos_q, const ape_tensor *q, ape_tensor *o, float *lse,
			    float *entropy, float *mean_distance, ape_stats *stats)
{
	APE__API_CALL("ape_kv_pool_attend_diag");
	const struct ape__diag_req dg = { entropy, mean_distance };

	return attend(pl, "ape_kv_pool_attend_diag", desc, nseq, seq_ids, cu_seqlens_q, pos_q, q,
		      o, lse, &dg, stats);
}

/* The loader the pool's session runs with (kvpool.c sets it at creation). */
void ape__kvp_loader(struct ape_kv_pool *pl)
{
	pl->loader = (struct ape__kv_loader){
		.load = pool_load, .arg = pl, .pages = pool_pages, .wait = pool_wait,
	};
}
