/* SPDX-License-Identifier: MIT */
/*
 * Paged attention over the caller's pages (ape_paged_kv, include/ape/ape.h): a KV pool
 * (api/kvpool.h) in its external mode. It owns no page: its sequences are the plan's, read
 * from the caller's page table (CSR or block table), and its page buffers are the caller's,
 * lent to one run at a time with their layout (struct ape__kvp_geom). Everything else (the
 * segments, the groups, the in-place decode through the page table, the gathers, the
 * session) is the pool's attend, kvpool_attend.c: one code path for both.
 *
 * The plan checks the table and the batch once per step and builds the batch's segments and
 * key runs (no window is cut: the caller's pages carry no norm maxima); each run checks the
 * layer's tensors and parameters, lends the buffers and runs the planned groups.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "api/kvpool.h"
#include "api/resident.h"
#include "api/stats.h"
#include "api/validate.h"


struct ape_paged_kv {
	struct ape_kv_pool pl; /* first: the pool in its external mode */
	ape_paged_kv_options o;
	bool planned;
	int64_t nseq, total_q;
	int64_t *ids; /* 0 .. nseq - 1 */
	int64_t *cu; /* nseq + 1 */
	int64_t *pos; /* total_q, or NULL */
	int64_t *pages; /* every sequence's pages, in order (pl.seq[s].pages points here) */
	uint64_t *mark; /* [num_pages]: the stamp of the last sequence seen holding each page */
	uint64_t stamp; /* one per sequence read, over every plan */
	size_t cap_seq, cap_pages, cap_q;
};

void ape_paged_kv_options_init(ape_paged_kv_options *opts)
{
	if (!opts)
		return;
	memset(opts, 0, sizeof(*opts));
	opts->struct_size = sizeof(*opts);
	opts->max_batch_tokens = 256; /* the pool's defaults (ape_kv_pool_options_init()) */
	opts->attend_chunk = APE__CHUNK_DEFAULT;
}

void ape_page_table_init(ape_page_table *pt)
{
	if (!pt)
		return;
	memset(pt, 0, sizeof(*pt));
	pt->struct_size = sizeof(*pt);
}

/* ------------------------------------------------------------------ creation */

/* The object's options, then the pool's they give (its rules and messages: api/kvpool.c). */
static int check_options(const char *fn, const ape_paged_kv_options *o, ape_kv_pool_options *po)
{
	if (!o)
		return ape__error(APE_EINVAL, "%s: opts = NULL", fn);
	if (o->struct_size != sizeof(*o))
		return ape__error(APE_EINVAL,
				  "%s: opts->struct_size = %zu: expected %zu (initialise with "
				  "ape_paged_kv_options_init())",
				  fn, o->struct_size, sizeof(*o));
	if (o->page_tokens < 1 || o->page_tokens > 65536)
		return ape__error(APE_EINVAL,
				  "%s: opts->page_tokens = %" PRId64
				  ": must be in 1..65536 (the tokens of one of the caller's pages)",
				  fn, o->page_tokens);
	if (o->num_pages < 1 || o->num_pages > ((int64_t)1 << 40) / o->page_tokens)
		return ape__error(APE_EINVAL,
				  "%s: opts->num_pages = %" PRId64 ": must be >= 1, with num_pages * "
				  "page_tokens (%" PRId64 ") at most 2^40",
				  fn, o->num_pages, o->page_tokens);
	ape_kv_pool_options_init(po);
	po->Hkv = o->Hkv;
	po->H = o->H;
	po->D = o->D;
	po->dtype = o->dtype;
	po->page_tokens = o->page_tokens;
	po->capacity_tokens = o->num_pages * o->page_tokens;
	po->max_batch_tokens = o->max_batch_tokens;
	po->attend_chunk = o->attend_chunk;
	po->max_device_bytes = o->max_device_bytes;
	return ape__kvp_check_options(fn, po);
}

int ape_paged_kv_create(ape_device *dev, const ape_paged_kv_options *opts, ape_paged_kv **out)
{
	APE__API_CALL("ape_paged_kv_create");
	static const char fn[] = "ape_paged_kv_create";
	struct ape_kv_pool *pl;
	ape_kv_pool_options po;
	ape_paged_kv *pk;
	int ret;

	if (!out)
		return ape__error(APE_EINVAL, "%s: out = NULL", fn);
	*out = NULL;
	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if ((ret = check_options(fn, opts, &po)))
		return ret;
	if (!dev->be->ops->copy_d2d || !dev->be->ops->copy_view)
		return ape__error_on(ape__error(APE_ENOTSUP,
						"%s: the %s backend has no strided device-to-device "
						"copy (the keys of the caller's pages are gathered on "
						"the device)",
						fn, dev->info.backend),
				     dev);
	if ((ret = ape__kvp_create(dev, fn, &po, true, sizeof(*pk), &pl)))
		return ret;
	pk = (ape_paged_kv *)pl;
	pk->o = *opts;
	pk->mark = ape__calloc((size_t)opts->num_pages, sizeof(*pk->mark));
	if (!pk->mark) {
		ape_paged_kv_destroy(pk);
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " pages", fn,
				  opts->num_pages);
	}
	*out = pk;
	return 0;
}

void ape_paged_kv_destroy(ape_paged_kv *pk)
{
	if (!pk)
		return;
	free(pk->ids);
	free(pk->cu);
	free(pk->pos);
	free(pk->pages);
	free(pk->mark);
	ape_kv_pool_destroy(&pk->pl); /* frees pl.seq, not the pages it points into */
}

/* ------------------------------------------------------------------ the plan */

/* *p (holding *cap elements of sz bytes) made to hold n. */
static int reserve(const char *fn, void **p, size_t *cap, size_t n, size_t sz)
{
	void *g;

	if (n <= *cap)
		return 0;
	if (!(g = ape__realloc(*p, n * sz)))
		return ape__error(APE_ENOMEM, "%s: out of host memory", fn);
	*p = g;
	*cap = n;
	return 0;
}

/* Sequence s's page count and tokens from the table's form (the form checked). */
static int seq_shape(const ape_paged_kv *pk, const char *fn, const ape_page_table *pt, int64_t s,
		     int64_t *np, int64_t *n)
{
	const int64_t P = pk->o.page_tokens;

	if (pt->indptr) {
		const int64_t a = pt->indptr[s], b = pt->indptr[s + 1], last = pt->last_page_len[s];

		if (b < a)
			return ape__error(APE_EINVAL,
					  "%s: pt->indptr[%" PRId64 "] = %" PRId64
					  " < pt->indptr[%" PRId64 "] = %" PRId64,
					  fn, s + 1, b, s, a);
		if (b - a > pk->o.num_pages)
			return ape__error(APE_EINVAL,
					  "%s: pt->indptr: sequence %" PRId64 " holds %" PRId64
					  " pages, more than num_pages = %" PRId64,
					  fn, s, b - a, pk->o.num_pages);
		if (b == a ? last != 0 : last < 1 || last > P)
			return ape__error(APE_EINVAL,
					  "%s: pt->last_page_len[%" PRId64 "] = %" PRId64
					  ": must be %s for a sequence of %" PRId64 " pages",
					  fn, s, last, b == a ? "0" : "in 1..page_tokens", b - a);
		*np = b - a;
		*n = b == a ? 0 : (b - a - 1) * P + last;
		return 0;
	}
	if (pt->seq_lens[s] < 0 || pt->seq_lens[s] > pk->o.num_pages * P)
		return ape__error(APE_EINVAL,
				  "%s: pt->seq_lens[%" PRId64 "] = %" PRId64
				  ": must be in 0..num_pages * page_tokens = %" PRId64,
				  fn, s, pt->seq_lens[s], pk->o.num_pages * P);
	*n = pt->seq_lens[s];
	*np = (*n + P - 1) / P;
	if (*np > pt->block_table_stride)
		return ape__error(APE_EINVAL,
				  "%s: pt->seq_lens[%" PRId64 "] = %" PRId64 " needs %" PRId64
				  " pages: more than pt->block_table_stride = %" PRId64,
				  fn, s, *n, *np, pt->block_table_stride);
	return 0;
}

/* The table's form: exactly one of CSR and block table, each complete. */
static int check_form(const char *fn, const ape_page_table *pt)
{
	const bool csr = pt->indptr || pt->indices || pt->last_page_len;
	const bool bt = pt->block_table || pt->seq_lens;

	if (pt->struct_size != sizeof(*pt))
		return ape__error(APE_EINVAL,
				  "%s: pt->struct_size = %zu: expected %zu (initialise with "
				  "ape_page_table_init())",
				  fn, pt->struct_size, sizeof(*pt));
	if (pt->nseq < 0 || pt->nseq > ((int64_t)1 << 40))
		return ape__error(APE_EINVAL, "%s: pt->nseq = %" PRId64 ": must be in 0..2^40", fn,
				  pt->nseq);
	if (csr && bt)
		return ape__error(APE_EINVAL,
				  "%s: pt: both a CSR table (indptr, indices, last_page_len) and a "
				  "block table (block_table, seq_lens) given: give one",
				  fn);
	if (pt->nseq && !csr && !bt)
		return ape__error(APE_EINVAL,
				  "%s: pt: no table for nseq = %" PRId64 " (set indptr, indices and "
				  "last_page_len, or block_table and seq_lens)",
				  fn, pt->nseq);
	if (csr && (!pt->indptr || !pt->last_page_len))
		return ape__error(APE_EINVAL, "%s: pt->%s = NULL in a CSR table", fn,
				  !pt->indptr ? "indptr" : "last_page_len");
	if (bt && !pt->seq_lens)
		return ape__error(APE_EINVAL, "%s: pt->seq_lens = NULL in a block table", fn);
	if (bt && pt->block_table_stride < 0)
		return ape__error(APE_EINVAL, "%s: pt->block_table_stride = %" PRId64 ": must be >= 0",
				  fn, pt->block_table_stride);
	if (csr && pt->nseq && pt->indptr[0] != 0)
		return ape__error(APE_EINVAL, "%s: pt->indptr[0] = %" PRId64 ": must be 0", fn,
				  pt->indptr[0]);
	return 0;
}

/* Sequence s's pages into pk->pages + at, each checked: in range, not twice in s. */
static int seq_pages(ape_paged_kv *pk, const char *fn, const ape_page_table *pt, int64_t s,
		     int64_t np, int64_t at)
{
	const char *name = pt->indptr ? "indices" : "block_table";
	const int64_t *src = pt->indptr ? pt->indices : pt->block_table;
	int64_t base;

	pk->stamp++;
	if (!np) /* nothing read: the row of a sequence of no page may lie anywhere */
		return 0;
	if (!src)
		return ape__error(APE_EINVAL, "%s: pt->%s = NULL with sequence %" PRId64
				  " holding %" PRId64 " pages", fn, name, s, np);
	if (pt->indptr)
		base = pt->indptr[s];
	else if (__builtin_mul_overflow(s, pt->block_table_stride, &base) ||
		 base > INT64_MAX - np)
		return ape__error(APE_EINVAL,
				  "%s: pt->block_table_stride = %" PRId64 ": row %" PRId64
				  " of the block table lies past 2^63 entries",
				  fn, pt->block_table_stride, s);
	for (int64_t i = 0; i < np; i++) {
		const int64_t pg = src[base + i];

		if (pg < 0 || pg >= pk->o.num_pages)
			return ape__error(APE_EINVAL,
					  "%s: pt->%s[%" PRId64 "] = %" PRId64
					  ": no such page (sequence %" PRId64 "; num_pages = %" PRId64
					  ")",
					  fn, name, base + i, pg, s, pk->o.num_pages);
		if (pk->mark[pg] == pk->stamp)
			return ape__error(APE_EINVAL,
					  "%s: pt->%s[%" PRId64 "] = %" PRId64
					  ": sequence %" PRId64 " holds page %" PRId64 " twice",
					  fn, name, base + i, pg, s, pg);
		pk->mark[pg] = pk->stamp;
		pk->pages[at + i] = pg;
	}
	return 0;
}

/* The table into pk's sequences: pl.seq[s] for s < nseq, their pages in pk->pages. */
static int read_table(ape_paged_kv *pk, const char *fn, const ape_page_table *pt)
{
	struct ape_kv_pool *pl = &pk->pl;
	int64_t total = 0, np, n;
	size_t cap = (size_t)pl->seq_cap;
	int ret;

	for (int64_t s = 0; s < pt->nseq; s++) {
		if ((ret = seq_shape(pk, fn, pt, s, &np, &n)))
			return ret;
		if (pt->k_start && (pt->k_start[s] < -((int64_t)1 << 62) ||
				    pt->k_start[s] >= ((int64_t)1 << 62)))
			return ape__error(APE_EOVERFLOW,
					  "%s: pt->k_start[%" PRId64 "] = %" PRId64
					  ": must be in [-2^62, 2^62)",
					  fn, s, pt->k_start[s]);
		total += np;
	}
	if ((ret = reserve(fn, (void **)&pk->pages, &pk->cap_pages, (size_t)total + 1,
			   sizeof(*pk->pages))) ||
	    (ret = reserve(fn, (void **)&pl->seq, &cap, (size_t)pt->nseq + 1, sizeof(*pl->seq))) ||
	    (ret = reserve(fn, (void **)&pk->ids, &pk->cap_seq, (size_t)pt->nseq + 1,
			   sizeof(*pk->ids))))
		return ret;
	pl->seq_cap = (int64_t)cap;
	total = 0;
	for (int64_t s = 0; s < pt->nseq; s++) {
		seq_shape(pk, fn, pt, s, &np, &n);
		if ((ret = seq_pages(pk, fn, pt, s, np, total)))
			return ret;
		pl->seq[s] = (struct ape__kvp_seq){
			.live = true, .k_start = pt->k_start ? pt->k_start[s] : 0, .n = n,
			.npages = np, .cap = np, .pages = pk->pages + total,
		};
		pk->ids[s] = s;
		total += np;
	}
	pl->nseq = pl->live = pt->nseq;
	return 0;
}

int ape_paged_kv_plan(ape_paged_kv *pk, const ape_page_table *pt, const int64_t *cu_seqlens_q,
		      const int64_t *pos_q)
{
	APE__API_CALL("ape_paged_kv_plan");
	static const char fn[] = "ape_paged_kv_plan";
	struct ape_kv_pool *pl;
	int64_t total_q;
	int ret;

	if (!pk)
		return ape__error(APE_EINVAL, "%s: pk = NULL", fn);
	pl = &pk->pl;
	pk->planned = false;
	pl->nseq = pl->live = 0;
	if (!pt)
		return ape__error(APE_EINVAL, "%s: pt = NULL", fn);
	if ((ret = check_form(fn, pt)))
		return ret;
	if (pt->nseq && !cu_seqlens_q)
		return ape__error(APE_EINVAL, "%s: cu_seqlens_q = NULL with pt->nseq = %" PRId64, fn,
				  pt->nseq);
	total_q = pt->nseq ? cu_seqlens_q[pt->nseq] : 0;
	if (total_q < 0 || total_q > pl->o.max_batch_tokens)
		return ape__error(APE_EINVAL,
				  "%s: cu_seqlens_q[%" PRId64 "] = %" PRId64
				  ": the rows must number 0..max_batch_tokens = %" PRId64,
				  fn, pt->nseq, total_q, pl->o.max_batch_tokens);
	if ((ret = read_table(pk, fn, pt)) ||
	    (ret = ape__kvp_check_batch(pl, fn, pt->nseq, pk->ids, cu_seqlens_q, "cu_seqlens_q",
					total_q, "cu_seqlens_q[nseq]")))
		goto fail;
	if ((ret = reserve(fn, (void **)&pk->cu, &pk->cap_q, (size_t)pt->nseq + 1,
			   sizeof(*pk->cu))))
		goto fail;
	if (cu_seqlens_q)
		memcpy(pk->cu, cu_seqlens_q, (size_t)(pt->nseq + 1) * sizeof(*pk->cu));
	else /* no sequence: no offset to read */
		pk->cu[0] = 0;
	free(pk->pos);
	pk->pos = NULL;
	if (pos_q && total_q) {
		if (!(pk->pos = ape__malloc((size_t)total_q * sizeof(*pk->pos)))) {
			ret = ape__error(APE_ENOMEM, "%s: out of host memory", fn);
			goto fail;
		}
		memcpy(pk->pos, pos_q, (size_t)total_q * sizeof(*pk->pos));
	}
	pl->nsg = pl->nkr = pl->lk_total = 0;
	if (total_q && (ret = ape__kvp_plan(pl, fn, NULL, NULL, pt->nseq, pk->ids, pk->cu,
					    pk->pos, 0)))
		goto fail;
	pk->nseq = pt->nseq;
	pk->total_q = total_q;
	pk->planned = true;
	return 0;
fail:
	pl->nseq = pl->live = 0;
	return ret;
}

/* ------------------------------------------------------------------ the run */

/* The layer's pages: k and v device tensors of the object's shape, their buffers and layout
 * lent to the pool (the same strides for both). */
static int lend_pages(ape_paged_kv *pk, const char *fn, const ape_dtensor *k,
		      const ape_dtensor *v)
{
	static const char *const dims[4] = { "num_pages", "Hkv", "page_tokens", "D" };
	const int64_t want[4] = { pk->o.num_pages, pk->pl.o.Hkv, pk->o.page_tokens, pk->pl.o.D };
	struct ape_be_view kv, vv;
	int ret;

	if ((ret = ape__check_dtensor(fn, "k_pages", k, pk->pl.dev, pk->pl.o.dtype, want, dims,
				      &kv)) ||
	    (ret = ape__check_dtensor(fn, "v_pages", v, pk->pl.dev, pk->pl.o.dtype, want, dims,
				      &vv)))
		return ret;
	if (kv.sb != vv.sb || kv.sh != vv.sh || kv.sl != vv.sl)
		return ape__error(APE_EINVAL,
				  "%s: v_pages: strides {%" PRId64 ", %" PRId64 ", %" PRId64
				  "} differ from k_pages's {%" PRId64 ", %" PRId64 ", %" PRId64
				  "} (elements of pages, heads, rows): the pages' layout is one",
				  fn, vv.sb, vv.sh, vv.sl, kv.sb, kv.sh, kv.sl);
	pk->pl.k = k->buf->b;
	pk->pl.v = v->buf->b;
	pk->pl.g = (struct ape__kvp_geom){ .koff = kv.off, .voff = vv.off, .sp = kv.sb,
					   .sh = kv.sh, .sr = kv.sl };
	return 0;
}

static int run(ape_paged_kv *pk, const char *fn, const ape_attn_desc *desc,
	       const ape_dtensor *k_pages, const ape_dtensor *v_pages, const ape_tensor *q,
	       ape_tensor *o, float *lse, const struct ape__diag_req *dg, ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__problem p;
	int ret;

	if (!pk)
		return ape__error(APE_EINVAL, "%s: pk = NULL", fn);
	if ((ret = ape__stats_check(fn, stats)))
		return ret;
	if (!pk->planned)
		return ape__error(APE_EINVAL,
				  "%s: no plan (make one with ape_paged_kv_plan(); a failed plan "
				  "leaves none)",
				  fn);
	if ((ret = ape__kvp_attend_problem(&pk->pl, fn, desc, q, o, lse, dg, &p)))
		return ret;
	if (p.Lq != pk->total_q) {
		ret = ape__error(APE_EINVAL,
				 "%s: q->shape[2] = %" PRId64 ": the plan has %" PRId64 " query rows",
				 fn, p.Lq, pk->total_q);
		goto out;
	}
	if ((ret = lend_pages(pk, fn, k_pages, v_pages)))
		goto out;
	ret = ape__kvp_run(&pk->pl, fn, &p, q, o, lse, dg, stats, t0);
out:
	pk->pl.k = pk->pl.v = NULL;
	ape__problem_fini(&p);
	return ret;
}

struct ape_device *ape__paged_kv_device(const ape_paged_kv *pk)
{
	return pk->pl.dev;
}

int ape__paged_kv_run(ape_paged_kv *pk, const char *fn, const ape_attn_desc *desc,
		      const ape_dtensor *k_pages, const ape_dtensor *v_pages, const ape_tensor *q,
		      ape_tensor *o, float *lse)
{
	static const struct ape__diag_req none = { NULL, NULL };

	return run(pk, fn, desc, k_pages, v_pages, q, o, lse, &none, NULL);
}

int ape_paged_kv_run(ape_paged_kv *pk, const ape_attn_desc *desc, const ape_dtensor *k_pages,
		     const ape_dtensor *v_pages, const ape_tensor *q, ape_tensor *o, float *lse,
		     ape_stats *stats)
{
	APE__API_CALL("ape_paged_kv_run");
	static const struct ape__diag_req none = { NULL, NULL };

	return run(pk, "ape_paged_kv_run", desc, k_pages, v_pages, q, o, lse, &none, stats);
}

int ape_paged_kv_run_diag(ape_paged_kv *pk, const ape_attn_desc *desc,
			  const ape_dtensor *k_pages, const ape_dtensor *v_pages,
			  const ape_tensor *q, ape_tensor *o, float *lse, float *entropy,
			  float *mean_distance, ape_stats *stats)
{
	APE__API_CALL("ape_paged_kv_run_diag");
	const struct ape__diag_req dg = { entropy, mean_distance };

	return run(pk, "ape_paged_kv_run_diag", desc, k_pages, v_pages, q, o, lse, &dg, stats);
}
