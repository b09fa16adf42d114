/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: paged attention over the caller's pages (ape_paged_kv_*, include/ape/ape.h
 * "Paged attention over the caller's pages") on the reference device and, where the library
 * has the OpenCL backend and the machine a device, on OpenCL (a bit of the input picks it). The
 * input is an object's options (Hkv, H, D, dtype, page_tokens, num_pages, max_batch_tokens,
 * attend_chunk, max_device_bytes, sometimes a wrong struct_size) and then a sequence of calls:
 *
 * - ape_paged_kv_plan() of fuzzed page tables: FlashInfer's CSR form (indptr, indices,
 *   last_page_len) or a vLLM block table (block_table, block_table_stride, seq_lens), both or
 *   neither or parts of one; pages distinct, shared as a prefix with the sequence before,
 *   repeated within a sequence, out of range or raw int64; last_page_len 0 or past the page;
 *   decreasing or raw indptr; strides one short, raw or huge (the table then over memory not
 *   mapped: nothing may be read); negative or raw seq_lens; k_start absent, at +-2^62 and
 *   around or raw; cu_seqlens_q from counts, raw, NULL; pos_q absent, near the keys (gaps,
 *   repeats) or raw int64 (distances that overflow); a wrong struct_size, pt NULL, nseq < 0;
 * - ape_paged_kv_run() of the plan with fuzzed page tensors: [num_pages, Hkv, page_tokens, D]
 *   contiguous, vLLM's [num_pages, page_tokens, Hkv, D], FlashInfer's K and V halves of one
 *   [num_pages, 2, ...] buffer (HND and NHD), padded rows, heads and pages, raw strides, v's
 *   strides other than k's, a raw shape entry, a wrong dtype, byte offsets small or raw, a
 *   buffer a few bytes short of what the tensor addresses, NULL tensors and buffers; q with the
 *   plan's rows or not; O of the dtype or float32, LSE and stats wanted or not, a fuzzed desc
 *   (causal, decay, lambda, skip_tol, q_start_set, k_start, struct_size);
 * - after each accepted run (without the diagnostics), ape_paged_kv_run_dlpack() of the same
 *   tensors as kDLCPU DLTensors over the pages' host images ([num_pages, page_tokens, Hkv, D]
 *   with the run's strides permuted), q, o and lse: accepted (where the device reads host
 *   memory), O and LSE the run's bit for bit;
 * - the calls with NULL arguments.
 *
 * Promises checked:
 * - every call returns 0 or one of its documented codes (APE_EINVAL, APE_EOVERFLOW; ENOMEM at
 *   create only) with a message naming the function, and never crashes, reads outside its
 *   arrays or buffers (ASan: every array is a block exactly as large as the table's form
 *   says, the reference's device buffers are exact heap blocks, and a table too large to back
 *   lies over memory not mapped, which must never be read) or overflows (UBSan);
 * - a failed create leaves *out NULL;
 * - a plan is accepted exactly when the table, the rows and the k_start values follow the
 *   header's rules (an independent check here; positions near the keys are always valid, raw
 *   ones may be refused); after a refused plan every run is refused until a plan succeeds;
 * - a run is refused when it must be (no plan, q's rows not the plan's, tensors outside their
 *   buffers, ...) and accepted when everything is valid; a refused run writes no byte of O or
 *   LSE;
 * - an accepted run writes every row: O finite, within max |V| of the page buffer (a convex
 *   combination), 0 and LSE -inf exactly for rows that see no key, LSE finite for the others;
 *   and where cheap, and every distance within 2^24 (beyond, float64 keeps no digit of the
 *   rotation's angle and each path's seeding of its sines gives its own), O and LSE agree with
 *   ape_attention_forward_varlen() on the reference over the same keys gathered from the pages
 *   by the harness (within the storage's rounding and what skipping may move).
 *
 * The OpenCL device is there in the FUZZ_OPENCL=yes build only (tests/fuzz/module.mk).
 * FUZZ_TRACE=1 prints each call and its outcome (what an input does).
 */
#define FUZZ_NAME "fuzz_kvpaged"
#define FUZZ_BACKENDS "ref,opencl"
#include "fuzz_input.h"

#include <math.h>
#include <stdarg.h>

#include <stdbool.h>
#include <string.h>

#include "ape/ape_dlpack.h"
#include "common/testutil.h"

enum { MAXOPS = 32, MAXS = 8, MAXROWS = 6 };

/* Every tensor an object fuzzed here may accept holds at most LIMIT elements (the options are
 * filtered so), and no valid table has more than LIMIT entries; larger ones lie over memory not
 * mapped. */
#define LIMIT (1u << 16)
#define UNBACKED ((void *)(uintptr_t)0x7f0000000000ull)
#define P62 ((int64_t)1 << 62)

static ape_device *devs[2]; /* the reference, and OpenCL when present */
static ape_queue *queues[2];
static int ndevs;
static ape_device *dev; /* this input's */
static ape_queue *queue;
static ape_paged_kv_options opt; /* as created, H resolved */

/* The plan in force, as the harness knows it (only plans it knows valid are accepted). */
struct pseq {
	int64_t n, k_start, np, q0, lq;
	const int64_t *pages; /* into plan.pages */
};

static struct {
	bool planned;
	int64_t nseq, total_q;
	struct pseq s[MAXS];
	int64_t *pages; /* every sequence's pages */
	int64_t *pos; /* total_q positions, materialised (the default ones too) */
} plan;

static void forget_plan(void)
{
	free(plan.pages);
	free(plan.pos);
	memset(&plan, 0, sizeof(plan));
}


/* ret is 0 or one of the codes `fn` may refuse with, naming it. */
static void refused_or_done(int ret, const char *fn, bool nomem_ok)
{
	char what[160];

	if (!ret)
		return;
	snprintf(what, sizeof(what), "%s returns 0, EINVAL, EOVERFLOW%s", fn,
		 nomem_ok ? ", ENOMEM" : "");
	check(ret == APE_EINVAL || ret == APE_EOVERFLOW || (nomem_ok && ret == APE_ENOMEM), what);
	snprintf(what, sizeof(what), "the message names %s", fn);
	check(strstr(ape_last_error(), fn) != NULL, what);
}

/* An exact heap block of n int64 (n may be 0), or UNBACKED beyond LIMIT or when negative. */
static int64_t *i64s(int64_t n)
{
	int64_t *p;

	if (n < 0 || n > (int64_t)LIMIT)
		return UNBACKED;
	p = malloc(sizeof(int64_t) * (size_t)n + (n ? 0 : 1));
	check(p != NULL, "malloc");
	return p;
}

static void free_i64s(int64_t *p)
{
	if (p != UNBACKED)
		free(p);
}

/* ---------------------------------------------------------------- the plan */

/* Pages of a sequence's table, one of four modes (see op_plan()), `g` of them into pg. */
static void take_pages(struct in *in, int64_t *pg, int64_t g, const int64_t *prev, int64_t gprev)
{
	const unsigned m = (unsigned)take(in, 1);
	const int64_t NP = opt.num_pages;
	const int64_t start = (int64_t)take(in, 1), step = (int64_t)(m >> 2) % 4 + 1;

	for (int64_t i = 0; i < g; i++) {
		switch (m & 3) {
		case 0: /* from a start, `step` apart (repeats where step and num_pages share a
			 * factor and the sequence wraps) */
			pg[i] = (start + i * step) % NP;
			break;
		case 1: /* the previous sequence's first pages, then on from its last */
			pg[i] = i < gprev ? prev[i]
					  : (int64_t)(((uint64_t)(gprev ? prev[gprev - 1] : start) + 1 +
						       (uint64_t)i) %
						      (uint64_t)NP);
			break;
		case 2: /* any page, num_pages itself (one past the last) now and then */
			pg[i] = (int64_t)(take(in, 1) % (uint64_t)(NP + 1));
			break;
		default:
			pg[i] = take_int(in);
		}
	}
}

/*
 * The header's rules for a plan, checked here independently of the library: 1 valid, 0
 * refused (the table, the rows or a k_start break a rule). Reads only what the rules say
 * exists (so never an unbacked array of a valid table).
 */
static int plan_valid(const ape_page_table *pt, const int64_t *cu)
{
	const bool csr = pt->indptr || pt->indices || pt->last_page_len;
	const bool bt = pt->block_table || pt->seq_lens;
	const int64_t NP = opt.num_pages, P = opt.page_tokens;
	int64_t total_q;

	if (pt->struct_size != sizeof(*pt) || pt->nseq < 0 || (csr && bt) ||
	    (pt->nseq && !csr && !bt) || (csr && (!pt->indptr || !pt->last_page_len)) ||
	    (bt && !pt->seq_lens) || (bt && pt->block_table_stride < 0) || (pt->nseq && !cu))
		return 0;
	total_q = pt->nseq ? cu[pt->nseq] : 0;
	if (total_q < 0 || total_q > opt.max_batch_tokens)
		return 0;
	if (csr && pt->nseq && pt->indptr[0] != 0)
		return 0;
	for (int64_t s = 0; s < pt->nseq; s++) {
		int64_t np;

		if (csr) {
			const int64_t a = pt->indptr[s], b = pt->indptr[s + 1];
			const int64_t last = pt->last_page_len[s];

			if (b < a || b - a > NP || (b == a ? last != 0 : last < 1 || last > P))
				return 0;
			np = b - a;
		} else {
			if (pt->seq_lens[s] < 0 || pt->seq_lens[s] > NP * P)
				return 0;
			np = (pt->seq_lens[s] + P - 1) / P;
			if (np > pt->block_table_stride)
				return 0;
		}
		if (pt->k_start && (pt->k_start[s] < -P62 || pt->k_start[s] >= P62))
			return 0;
		if (np && !(csr ? pt->indices : pt->block_table))
			return 0;
	}
	/* every sequence's pages: in range, none twice in one sequence (any across them) */
	for (int64_t s = 0; s < pt->nseq; s++) {
		const int64_t np = csr ? pt->indptr[s + 1] - pt->indptr[s]
				       : (pt->seq_lens[s] + P - 1) / P;
		const int64_t *src = csr ? pt->indices : pt->block_table;
		/* a row of a block table holding pages lies in the array: s * stride fits */
		const int64_t base = csr ? pt->indptr[s] : np ? s * pt->block_table_stride : 0;

		for (int64_t i = 0; i < np; i++) {
			if (src[base + i] < 0 || src[base + i] >= NP)
				return 0;
			for (int64_t j = 0; j < i; j++)
				if (src[base + j] == src[base + i])
					return 0;
		}
	}
	if (pt->nseq && cu[0] != 0)
		return 0;
	for (int64_t s = 0; s < pt->nseq; s++)
		if (cu[s + 1] < cu[s])
			return 0;
	return 1;
}

/* The accepted plan into the harness's record (the table and rows known valid). */
static void record_plan(const ape_page_table *pt, const int64_t *cu, const int64_t *pos_q)
{
	const bool csr = pt->indptr != NULL;
	const int64_t P = opt.page_tokens;
	int64_t total = 0;

	forget_plan();
	plan.nseq = pt->nseq;
	plan.total_q = pt->nseq ? cu[pt->nseq] : 0;
	for (int64_t s = 0; s < pt->nseq; s++)
		total += csr ? pt->indptr[s + 1] - pt->indptr[s] : (pt->seq_lens[s] + P - 1) / P;
	plan.pages = malloc(sizeof(int64_t) * (size_t)(total + 1));
	plan.pos = malloc(sizeof(int64_t) * (size_t)(plan.total_q + 1));
	check(plan.pages && plan.pos, "malloc");
	total = 0;
	for (int64_t s = 0; s < pt->nseq; s++) {
		struct pseq *q = &plan.s[s];
		const int64_t base = csr ? pt->indptr[s] : 0;

		q->np = csr ? pt->indptr[s + 1] - base : (pt->seq_lens[s] + P - 1) / P;
		q->n = csr ? (q->np ? (q->np - 1) * P + pt->last_page_len[s] : 0) : pt->seq_lens[s];
		q->k_start = pt->k_start ? pt->k_start[s] : 0;
		q->q0 = cu[s];
		q->lq = cu[s + 1] - cu[s];
		if (q->np) /* a row of a block table holding pages lies in it: s * stride fits */
			memcpy(plan.pages + total,
			       (csr ? pt->indices + base : pt->block_table + s * pt->block_table_stride),
			       sizeof(int64_t) * (size_t)q->np);
		q->pages = plan.pages + total;
		total += q->np;
		for (int64_t i = 0; i < q->lq; i++)
			plan.pos[q->q0 + i] = pos_q ? pos_q[q->q0 + i] : q->k_start + q->n - q->lq + i;
	}
	plan.planned = true;
}

/* A sequence's tokens in the table of form `form` (0: CSR, n its count before the table was
 * made; else seq_lens), within 0 .. num_pages * page_tokens + 1. */
static int64_t tokens(unsigned form, int64_t n, int64_t len)
{
	const int64_t most = opt.num_pages * opt.page_tokens + 1, t = form ? len : n;

	return t < 0 ? 0 : t > most ? most : t;
}

/*
 * A plan. Bytes: f (bits 0-1 the form: CSR, block table, both, neither or a part of one; 4:
 * k_start given; 8: pos_q given; 16: raw positions; 32: raw cu_seqlens_q; 64: one field
 * broken; 128: a NULL or a wrong struct_size), nseq, then per sequence its tokens (take_int),
 * its pages (take_pages()), its rows and (4) its k_start; the block table's stride; then what
 * f asks for.
 */
static void op_plan(struct in *in, ape_paged_kv *pk)
{
	static const char fn[] = "ape_paged_kv_plan";
	const unsigned f = (unsigned)take(in, 1);
	const int64_t P = opt.page_tokens, NP = opt.num_pages;
	const int64_t ns = (int64_t)(take(in, 1) % (MAXS + 1)); /* the arrays' count */
	int64_t nseq = ns; /* the table's (perhaps broken) */
	int64_t n[MAXS], np[MAXS], g[MAXS], lq[MAXS], ks[MAXS], *pg[MAXS];
	int64_t *indptr, *indices, *last, *bt, *lens, *kst, *cu, *pos = NULL;
	int64_t stride, most = 0, cnt, total_q;
	uint64_t acc = 0;
	ape_page_table pt;
	bool pos_raw = false;
	int valid, ret;

	for (int64_t s = 0; s < ns; s++) {
		n[s] = take_int(in);
		/* the pages the tokens need; materialised up to one past num_pages (a sequence of
		 * more is refused before any page is read) */
		np[s] = n[s] > 0 ? (n[s] - 1) / P + 1 : 0;
		g[s] = np[s] <= NP + 1 ? np[s] : NP + 1;
		pg[s] = malloc(sizeof(int64_t) * (size_t)(g[s] + 1));
		check(pg[s] != NULL, "malloc");
		take_pages(in, pg[s], g[s], s ? pg[s - 1] : NULL, s ? g[s - 1] : 0);
		lq[s] = (int64_t)(take(in, 1) % (MAXROWS + 1));
		ks[s] = 0;
		if (f & 4) {
			const unsigned c = (unsigned)take(in, 1);

			ks[s] = c & 1 ? (c & 2 ? P62 : -P62) + (int64_t)(int8_t)take(in, 1)
				      : take_int(in);
		}
		most = g[s] > most ? g[s] : most;
	}
	/* CSR: indptr from the page counts (in uint64: absurd counts wrap), last_page_len */
	indptr = i64s(ns + 1);
	last = i64s(ns);
	indptr[0] = 0;
	for (int64_t s = 0; s < ns; s++) {
		acc += (uint64_t)np[s];
		indptr[s + 1] = (int64_t)acc;
		last[s] = n[s] > 0 ? n[s] - (np[s] - 1) * P : 0;
	}
	/* a block table's stride: the most pages a sequence holds, one less, one more, or raw */
	{
		const unsigned c = (unsigned)take(in, 1);

		stride = c >= 0xf0 ? take_int(in) : most + (int64_t)(c % 3) - 1;
		if (stride < 0 && c < 0xf0)
			stride = 0;
	}
	lens = i64s(ns);
	kst = i64s(ns);
	cu = i64s(ns + 1);
	cu[0] = 0;
	for (int64_t s = 0; s < ns; s++) {
		lens[s] = n[s];
		kst[s] = ks[s];
		cu[s + 1] = f & 32 ? take_int(in) : cu[s] + lq[s];
	}
	if (f & 32 && take(in, 1) & 1)
		cu[0] = take_int(in);
	if (f & 64) { /* one field broken */
		const unsigned c = (unsigned)take(in, 1);
		const int64_t j = ns ? (int64_t)(take(in, 1) % (uint64_t)ns) : 0;
		const int64_t j1 = ns && c & 8 ? j + 1 : j; /* an offset array's entry */

		switch (c % 8) {
		case 0: /* indptr: raw (decreasing, past the pages, not from 0) */
			indptr[j1] = take_int(in);
			break;
		case 1: /* last_page_len: 0, past the page, raw */
			if (ns)
				last[j] = c & 16 ? 0 : c & 32 ? P + 1 : take_int(in);
			break;
		case 2: /* seq_lens: negative, raw */
			if (ns)
				lens[j] = c & 16 ? -1 - (int64_t)(c >> 5) : take_int(in);
			break;
		case 3: /* a stride one short of a sequence's pages */
			if (ns)
				stride = np[j] > 0 ? np[j] - 1 : 0;
			break;
		case 4: /* cu_seqlens_q: raw */
			cu[j1] = take_int(in);
			break;
		case 5: /* k_start just outside [-2^62, 2^62), or raw */
			if (ns)
				kst[j] = c & 16 ? (c & 32 ? P62 : -P62 - 1) : take_int(in);
			break;
		case 6: /* a negative count */
			nseq = -1 - (int64_t)(c >> 3);
			break;
		default: /* a sequence holds a page twice */
			if (ns && g[j] > 1)
				pg[j][g[j] - 1] = pg[j][(int64_t)(c >> 3) % (g[j] - 1)];
		}
	}
	/* indices over the (perhaps broken) indptr: exactly indptr[nseq] entries where that is a
	 * size (a valid table's is: at most MAXS * num_pages), each sequence's pages where indptr
	 * puts them, the rest a pattern no valid plan reads */
	cnt = indptr[ns];
	indices = i64s(cnt);
	for (int64_t i = 0; indices != UNBACKED && i < cnt; i++)
		indices[i] = (i * 7) % (NP + 2) - 1;
	for (int64_t s = 0; indices != UNBACKED && s < ns; s++)
		for (int64_t i = 0; i < g[s] && indptr[s] >= 0 && i < cnt - indptr[s]; i++)
			indices[indptr[s] + i] = pg[s][i];
	/* the block table: ns rows of `stride`, the rest of each row never read; a table too large
	 * to back lies over memory not mapped, and its sequences then need no page (nothing may
	 * be read) */
	if (stride >= 0 && stride <= (int64_t)LIMIT && ns * stride <= (int64_t)LIMIT) {
		bt = i64s(ns * stride);
		for (int64_t s = 0; s < ns; s++)
			for (int64_t i = 0; i < stride; i++)
				bt[s * stride + i] = i < g[s] ? pg[s][i] : INT64_MIN + i;
	} else {
		bt = UNBACKED;
		for (int64_t s = 0; s < ns; s++)
			if (lens[s] > 0 && lens[s] <= NP * P)
				lens[s] = 0;
	}
	/* the rows' positions: exactly cu[nseq] where that is a size */
	total_q = ns ? cu[ns] : 0;
	if (f & 8) {
		pos_raw = f & 16;
		pos = i64s(total_q);
		for (int64_t i = 0, s = 0; pos != UNBACKED && i < total_q; i++) {
			while (s < ns && cu[s + 1] <= i)
				s++;
			if (pos_raw)
				pos[i] = take_int(in);
			else /* near the sequence's keys: before, among, after; gaps and repeats
			      * (tokens past the pages: refused anyway) */
				pos[i] = (int64_t)((uint64_t)(s < ns && f & 4 ? kst[s] : 0) +
						   (uint64_t)(s < ns ? tokens(f & 3, n[s], lens[s])
								     : 0) -
						   8 + take(in, 1) % 12);
		}
	}
	ape_page_table_init(&pt);
	pt.nseq = nseq;
	pt.k_start = f & 4 ? kst : NULL;
	switch (f & 3) {
	case 0:
		pt.indptr = indptr, pt.indices = indices, pt.last_page_len = last;
		break;
	case 1:
		pt.block_table = bt, pt.block_table_stride = stride, pt.seq_lens = lens;
		break;
	case 2: /* both: refused */
		pt.indptr = indptr, pt.indices = indices, pt.last_page_len = last;
		pt.block_table = bt, pt.block_table_stride = stride, pt.seq_lens = lens;
		break;
	default: { /* neither, or a part of one: refused unless there is no sequence */
		const unsigned c = (unsigned)(take(in, 1) % 6);

		pt.indptr = c == 1 || c == 5 ? indptr : NULL;
		pt.last_page_len = c == 2 ? last : NULL;
		pt.indices = c == 3 || c == 5 ? indices : NULL;
		pt.block_table = c == 4 ? bt : NULL;
		pt.block_table_stride = stride;
	}
	}
	if (f & 128) {
		switch (take(in, 1) % 5) {
		case 0:
			pt.struct_size = (size_t)take(in, 1);
			break;
		case 1: /* no cu_seqlens_q (valid for no sequence) */
			free_i64s(cu);
			cu = NULL;
			break;
		case 2: /* no indices, no block table (valid where no sequence holds a page) */
			pt.indices = NULL;
			pt.block_table = NULL;
			break;
		case 3:
			ret = ape_paged_kv_plan(pk, NULL, cu, pos);
			refused_or_done(ret, fn, false);
			check(ret == APE_EINVAL, "a plan of no table is refused");
			plan.planned = false;
			goto out;
		default:
			ret = ape_paged_kv_plan(NULL, &pt, cu, pos);
			refused_or_done(ret, fn, false);
			check(ret == APE_EINVAL, "a plan of no object is refused");
			goto out; /* pk's plan untouched */
		}
	}
	valid = plan_valid(&pt, cu);
	ret = ape_paged_kv_plan(pk, &pt, cu, pos);
	trace("plan (form %u, nseq %lld, valid %d): %d %s", f & 3, (long long)nseq, valid, ret,
	      ret ? ape_last_error() : "");
	refused_or_done(ret, fn, false);
	if (ret && valid && !pos_raw)
		fprintf(stderr, FUZZ_NAME ": valid plan refused: %s\n", ape_last_error());
	check(valid || ret, "a plan breaking the table's, the rows' or k_start's rules is refused");
	check(!valid || pos_raw || !ret, "a valid plan (positions near the keys) is accepted");
	if (ret)
		plan.planned = false; /* a failed plan leaves none */
	else
		record_plan(&pt, cu, pos);
out:
	for (int64_t s = 0; s < ns; s++)
		free(pg[s]);
	free_i64s(indptr);
	free_i64s(indices);
	free_i64s(last);
	free_i64s(bt);
	free_i64s(lens);
	free_i64s(kst);
	if (cu)
		free_i64s(cu);
	if (pos)
		free_i64s(pos);
}

/* ---------------------------------------------------------------- the run */

/* The page buffers of a run and where the pages lie in them (elements). */
struct layout {
	ape_buffer *buf[2]; /* k's, v's: the same one for FlashInfer's halves */
	uint8_t *host[2]; /* their contents */
	size_t bytes[2];
	bool one;
	int64_t koff, voff; /* element offsets */
	int64_t ks[4], vs[4]; /* the tensors' strides as given */
	int64_t sp, sh, sr; /* k's and v's effective strides (when both are the layout's) */
	float vmax; /* the largest |value| in v's buffer */
};

static float page_value(uint64_t i, unsigned seed)
{
	return (float)((int)((i * 37 + seed * 11) % 33) - 16) / 8;
}

/* A device buffer of `bytes` with values from the seed, its copy kept in *host. */
static ape_buffer *page_buffer(size_t bytes, unsigned seed, uint8_t **host, float *vmax)
{
	const size_t esz = ape_dtype_size(opt.dtype);
	const size_t n = bytes / esz;
	float *f = malloc(sizeof(float) * (n + 1));
	ape_buffer *b = NULL;

	*host = malloc(bytes);
	check(f && *host, "malloc");
	for (size_t i = 0; i < n; i++) {
		f[i] = page_value(i, seed);
		*vmax = fmaxf(*vmax, fabsf(f[i]));
	}
	memset(*host, 0, bytes);
	check(ape_convert(*host, opt.dtype, f, APE_F32, n) == 0, "ape_convert");
	free(f);
	check(ape_buffer_alloc(dev, bytes, &b) == 0, "ape_buffer_alloc");
	check(ape_buffer_write(queue, b, 0, *host, bytes) == 0, "ape_buffer_write");
	check(ape_queue_synchronize(queue) == 0, "ape_queue_synchronize");
	return b;
}

static void free_layout(struct layout *l)
{
	ape_buffer_free(l->buf[0]);
	if (!l->one)
		ape_buffer_free(l->buf[1]);
	free(l->host[0]);
	if (!l->one)
		free(l->host[1]);
}

/* Element (page p, head g, row r, component 0) of the layout, k's (0) or v's (1). */
static int64_t elem_at(const struct layout *l, int which, int64_t p, int64_t g, int64_t r)
{
	return (which ? l->voff : l->koff) + p * l->sp + g * l->sh + r * l->sr;
}

/*
 * Is every row of the run as promised? O finite and within max |V|, 0 and LSE -inf exactly
 * where a row sees no key, LSE finite elsewhere; and, where cheap, O and LSE those of
 * ape_attention_forward_varlen() on the reference over the keys gathered here.
 */
static void check_rows(const struct layout *l, const ape_attn_desc *desc, const ape_tensor *q,
		       const ape_tensor *o, const float *lse)
{
	const int64_t H = opt.H, Hkv = opt.Hkv, D = opt.D, P = opt.page_tokens;
	const size_t esz = ape_dtype_size(opt.dtype), row = (size_t)D * esz;
	const bool skip = desc->skip_tol > 0;
	const double eps = o->dtype == APE_F32 ? 1e-6 : o->dtype == APE_F16 ? 0x1p-10 : 0x1p-7;
	const double tol_o = 2 * eps + 1e-5 + (skip ? 4 * desc->skip_tol : 0);
	int64_t total_k = 0, pairs = 0;
	bool near = true; /* every distance within 2^24: the rotation's angle exact enough to
			   * compare two paths (far beyond, n * omega in float64 keeps no digit of
			   * the angle, and each path's seeding of its sines gives its own) */
	float *o32 = malloc(sizeof(float) * (size_t)(plan.total_q * H * D + 1));

	check(o32 != NULL, "malloc");
	ape_convert(o32, APE_F32, o->data, o->dtype, (size_t)(plan.total_q * H * D));
	for (int64_t s = 0; s < plan.nseq; s++) {
		const struct pseq *q_ = &plan.s[s];

		total_k += q_->n;
		pairs += q_->n * q_->lq;
		for (int64_t i = q_->q0; i < q_->q0 + q_->lq; i++) {
			const int64_t p = plan.pos[i];
			const int64_t far = (int64_t)1 << 24;
			const bool seen = q_->n > 0 && (!desc->causal || p >= q_->k_start);

			near &= !q_->n || (p >= q_->k_start - far && p <= q_->k_start + far &&
					   p - q_->k_start - q_->n <= far);
			for (int64_t h = 0; h < H; h++) {
				const float x = lse ? lse[i * H + h] : 0;

				check(!lse || (seen ? isfinite(x) : isinf(x) && x < 0),
				      "LSE finite where a key is seen, -inf elsewhere");
				for (int64_t d = 0; d < D; d++) {
					const float y = o32[(i * H + h) * D + d];

					check(isfinite(y) && fabsf(y) <= l->vmax * (1 + 1e-3f) + 1e-4f,
					      "O a convex combination of the pages' V");
					check(seen || y == 0, "O = 0 where no key is seen");
				}
			}
		}
	}
	/* the oracle: the keys gathered from the host copies, one ragged call on the reference */
	if (near && total_k <= 4096 && pairs * H * D <= (1 << 20) &&
	    desc->struct_size == sizeof(*desc)) {
		uint8_t *kk = malloc(row * (size_t)(Hkv * total_k) + 1);
		uint8_t *vv = malloc(row * (size_t)(Hkv * total_k) + 1);
		int64_t *cq = malloc(sizeof(int64_t) * (size_t)(plan.nseq + 1));
		int64_t *ck = malloc(sizeof(int64_t) * (size_t)(plan.nseq + 1));
		int64_t *pk = malloc(sizeof(int64_t) * (size_t)(total_k + 1));
		float *o2 = malloc(sizeof(float) * (size_t)(plan.total_q * H * D + 1));
		float *l2 = malloc(sizeof(float) * (size_t)(plan.total_q * H + 1));
		const uint8_t *hk = l->host[0], *hv = l->host[l->one ? 0 : 1];
		ape_tensor kt, vt, ot;
		ape_varlen vl;
		int64_t j = 0;
		int ret;

		check(kk && vv && cq && ck && pk && o2 && l2, "malloc");
		cq[0] = ck[0] = 0;
		for (int64_t s = 0; s < plan.nseq; s++) {
			const struct pseq *q_ = &plan.s[s];

			for (int64_t t = 0; t < q_->n; t++, j++) {
				pk[j] = q_->k_start + t;
				for (int64_t g = 0; g < Hkv; g++) {
					const int64_t pg = q_->pages[t / P];

					memcpy(kk + (size_t)(j * Hkv + g) * row,
					       hk + (size_t)elem_at(l, 0, pg, g, t % P) * esz, row);
					memcpy(vv + (size_t)(j * Hkv + g) * row,
					       hv + (size_t)elem_at(l, 1, pg, g, t % P) * esz, row);
				}
			}
			cq[s + 1] = q_->q0 + q_->lq;
			ck[s + 1] = j;
		}
		ape_varlen_init(&vl);
		vl.num_seqs = plan.nseq;
		vl.cu_seqlens_q = cq;
		vl.cu_seqlens_k = ck;
		vl.pos_q = plan.pos;
		vl.pos_k = pk;
		ape_tensor_init_packed(&kt, kk, opt.dtype, total_k, Hkv, D);
		ape_tensor_init_packed(&vt, vv, opt.dtype, total_k, Hkv, D);
		ape_tensor_init_packed(&ot, o2, APE_F32, plan.total_q, H, D);
		ret = ape_attention_forward_varlen(devs[0], desc, &vl, q, &kt, &vt, &ot, l2, NULL);
		trace("  compared with the ragged call over %lld gathered keys", (long long)total_k);
		if (ret)
			fprintf(stderr, FUZZ_NAME ": the oracle refused: %s\n", ape_last_error());
		check(ret == 0, "the ragged call over the gathered keys takes what the run took");
		for (int64_t i = 0; i < plan.total_q * H; i++) {
			const double a = lse ? lse[i] : 0, b = l2[i];

			if (lse && !(isinf(a) && isinf(b) && a == b) &&
			    !(fabs(a - b) <= 1e-4 * fmax(1, fabs(b)) + (skip ? 4 * desc->skip_tol : 0)))
				fprintf(stderr, FUZZ_NAME ": row %lld head %lld: LSE %.9g, the oracle's "
						"%.9g\n", (long long)(i / H), (long long)(i % H), a, b);
			check(!lse || (isinf(a) && isinf(b) && a == b) ||
				      fabs(a - b) <= 1e-4 * fmax(1, fabs(b)) +
							     (skip ? 4 * desc->skip_tol : 0),
			      "LSE that of the ragged call over the gathered keys");
			/* plus what merging the run's key chunks by their float32 LSEs adds
			 * where the row's keys are all far away under the decay */
			const double tol_r = tol_o + (isfinite(b) ? test_merge_tol_o(b) : 0);

			for (int64_t d = 0; d < D; d++) {
				const double x = o32[i * D + d], y = o2[i * D + d];

				if (!(fabs(x - y) <= tol_r * l->vmax))
					fprintf(stderr, FUZZ_NAME ": row %lld head %lld d %lld: O %.9g, "
							"the oracle's %.9g\n", (long long)(i / H),
						(long long)(i % H), (long long)d, x, y);
				check(fabs(x - y) <= tol_r * l->vmax,
				      "O that of the ragged call over the gathered keys");
			}
		}
		free(kk);
		free(vv);
		free(cq);
		free(ck);
		free(pk);
		free(o2);
		free(l2);
	}
	free(o32);
}

/*
 * The layer's page buffers in layout mode m (see op_run()), values from the seed: *clean stays
 * true only when k and v are the object's tensors over them, *refuse is set when they must be
 * refused.
 */
static void take_layout(struct in *in, unsigned m, unsigned seed, struct layout *l,
			ape_dtensor *k, ape_dtensor *v, bool *clean, bool *refuse)
{
	const int64_t NP = opt.num_pages, Hkv = opt.Hkv, P = opt.page_tokens, D = opt.D;
	const size_t esz = ape_dtype_size(opt.dtype);
	const int64_t shape[4] = { NP, Hkv, P, D };
	const int64_t page = Hkv * P * D;
	uint64_t span;
	bool cut = false, raw_off = false;
	float vdummy = 0;

	memset(l, 0, sizeof(*l));
	l->sp = page, l->sh = P * D, l->sr = D; /* contiguous: all strides 0 */
	switch (m & 7) {
	case 0: /* [num_pages, Hkv, page_tokens, D] contiguous */
	case 7: /* the same, a shape entry raw (below) */
		break;
	case 1: /* vLLM: [num_pages, page_tokens, Hkv, D] */
	case 6: /* the same for k, v contiguous: strides that differ */
		l->sp = page, l->sh = D, l->sr = Hkv * D;
		break;
	case 2: /* FlashInfer HND: K and V halves of [num_pages, 2, Hkv, page_tokens, D] */
		l->one = true;
		l->sp = 2 * page, l->sh = P * D, l->sr = D, l->voff = page;
		break;
	case 3: /* FlashInfer NHD: [num_pages, 2, page_tokens, Hkv, D] */
		l->one = true;
		l->sp = 2 * page, l->sh = D, l->sr = Hkv * D, l->voff = page;
		break;
	case 4: { /* padded rows, heads, pages */
		const int64_t a = (int64_t)(take(in, 1) % 3), b = (int64_t)(take(in, 1) % 3);
		const int64_t c = (int64_t)(take(in, 1) % 5);

		l->sr = D + a, l->sh = P * l->sr + b, l->sp = Hkv * l->sh + c;
		break;
	}
	default: /* raw strides, k's and v's the same */
		for (int i = 0; i < 4; i++)
			l->ks[i] = take_int(in);
		if (l->ks[0] || l->ks[1] || l->ks[2] || l->ks[3])
			l->sp = l->ks[0], l->sh = l->ks[1], l->sr = l->ks[2];
		*clean = false;
	}
	if ((m & 7) >= 1 && (m & 7) <= 6 && (m & 7) != 5) {
		l->ks[0] = l->sp, l->ks[1] = l->sh, l->ks[2] = l->sr, l->ks[3] = 1;
	}
	memcpy(l->vs, l->ks, sizeof(l->ks));
	if ((m & 7) == 6) { /* v contiguous: refused unless the strides coincide */
		memset(l->vs, 0, sizeof(l->vs));
		*clean = false;
		*refuse |= !(P == 1 && Hkv == 1);
	}
	/* what one tensor addresses; raw strides beyond 4 LIMIT elements over 16 (refused) */
	if ((m & 7) == 5) {
		span = l->ks[0] || l->ks[1] || l->ks[2] || l->ks[3] ? span_elems(shape, l->ks, 4)
								    : (uint64_t)NP * (uint64_t)page;
		if (!span || span > 4 * LIMIT) {
			span = 16;
			*refuse = true;
		}
	} else {
		span = (uint64_t)((NP - 1) * l->sp + (Hkv - 1) * l->sh + (P - 1) * l->sr + D);
	}
	if (m & 16 && take(in, 1) & 1) { /* a few elements of byte offset */
		l->koff += (int64_t)(take(in, 1) % 8);
		l->voff += (int64_t)(take(in, 1) % 8);
	}
	/* the buffers: exactly what the tensors address (k and v in one for FlashInfer's) */
	if (l->one) {
		l->bytes[0] = (size_t)((uint64_t)(l->koff > l->voff ? l->koff : l->voff) + span) * esz;
	} else {
		l->bytes[0] = (size_t)((uint64_t)l->koff + span) * esz;
		l->bytes[1] = (size_t)((uint64_t)l->voff + span) * esz;
	}
	if (m & 8) { /* a buffer a few bytes short of what its tensor addresses */
		const int b = l->one ? 0 : (int)(take(in, 1) & 1);
		const size_t c = 1 + take(in, 1) % 8;

		l->bytes[b] -= c < l->bytes[b] ? c : l->bytes[b] - 1;
		cut = true;
	}
	l->buf[0] = page_buffer(l->bytes[0], seed, &l->host[0], l->one ? &l->vmax : &vdummy);
	if (l->one) {
		l->buf[1] = l->buf[0];
		l->host[1] = l->host[0];
		l->bytes[1] = l->bytes[0];
	} else {
		l->buf[1] = page_buffer(l->bytes[1], seed + 1, &l->host[1], &l->vmax);
	}
	ape_dtensor_init(k, l->buf[0], (uint64_t)l->koff * esz, opt.dtype, NP, Hkv, P, D);
	ape_dtensor_init(v, l->buf[1], (uint64_t)l->voff * esz, opt.dtype, NP, Hkv, P, D);
	memcpy(k->strides, l->ks, sizeof(l->ks));
	memcpy(v->strides, l->vs, sizeof(l->vs));
	if (m & 16 && !(take(in, 1) & 3)) { /* a raw byte offset, k's or v's */
		(take(in, 1) & 1 ? k : v)->byte_offset = (uint64_t)take_int(in);
		raw_off = true;
		*clean = false;
	}
	if (cut) {
		*clean = false;
		*refuse |= !raw_off && (m & 7) != 5;
	}
	if ((m & 7) == 7) { /* a raw shape entry, k's or v's */
		const unsigned c = (unsigned)take(in, 1);
		ape_dtensor *t = c & 4 ? v : k;

		t->shape[c & 3] = take_int(in);
		*clean = false;
		*refuse |= t->shape[c & 3] != shape[c & 3];
	}
	if (m & 32) { /* a storage type, k's or v's */
		const unsigned c = (unsigned)take(in, 1);

		(c & 1 ? v : k)->dtype = (ape_dtype)((c >> 1) % 4);
		*clean &= (c >> 1) % 4 == (unsigned)opt.dtype;
		*refuse |= (c >> 1) % 4 != (unsigned)opt.dtype;
	}
	/* where the elements are, for an accepted run */
	l->koff = (int64_t)(k->byte_offset / esz);
	l->voff = (int64_t)(v->byte_offset / esz);
}

/* A kDLCPU DLTensor over host memory p: `nd` axes sh, strides st (NULL: compact). */
static DLTensor dl_host(void *p, uint64_t off, ape_dtype dt, int nd, int64_t *sh, int64_t *st)
{
	static const DLDataType types[3] = { { kDLFloat, 32, 1 }, { kDLFloat, 16, 1 },
					     { kDLBfloat, 16, 1 } };

	return (DLTensor){ .data = p, .device = { kDLCPU, 0 }, .ndim = nd, .dtype = types[dt],
			   .shape = sh, .strides = st, .byte_offset = off };
}

/*
 * An accepted run (its k, v over l's buffers, q, o, lse) again through
 * ape_paged_kv_run_dlpack(): the pages as [num_pages, page_tokens, Hkv, D] DLTensors over l's
 * host images (k's strides permuted; contiguous ones made explicit), q, o (a fresh block) and
 * lse as [rows, H, D] and [rows, H]: accepted where the device reads host memory (APE_ENOTSUP
 * elsewhere), its O and LSE the run's bit for bit.
 */
static void run_dlpack_same(ape_paged_kv *pk, const ape_attn_desc *desc, const struct layout *l,
			    const ape_dtensor *k, const ape_dtensor *v, const ape_tensor *q,
			    const ape_tensor *o, const float *lse, size_t ob_bytes,
			    size_t lse_bytes)
{
	const int64_t rows = q->shape[2], H = opt.H, D = opt.D;
	const ape_dtensor *t[2] = { k, v };
	int64_t sh[2][4], st[2][4], qs[3] = { rows, H, D }, ls[2] = { rows, H };
	uint8_t *o2 = malloc(ob_bytes + 1);
	float *l2 = lse ? malloc(lse_bytes + 1) : NULL;
	DLTensor pg[2], qt, ot, lt;
	int ret;

	check(o2 && (!lse || l2), "malloc");
	memset(o2, 0x5a, ob_bytes + 1);
	for (int i = 0; i < 2; i++) {
		const int64_t *s = t[i]->strides, *n = t[i]->shape;
		const bool compact = !s[0] && !s[1] && !s[2] && !s[3];
		const int64_t c[4] = { n[1] * n[2] * n[3], n[2] * n[3], n[3], 1 };
		const int64_t *e = compact ? c : s;

		sh[i][0] = n[0], sh[i][1] = n[2], sh[i][2] = n[1], sh[i][3] = n[3];
		st[i][0] = e[0], st[i][1] = e[2], st[i][2] = e[1], st[i][3] = e[3];
		pg[i] = dl_host(l->host[i], t[i]->byte_offset, t[i]->dtype, 4, sh[i], st[i]);
	}
	qt = dl_host(q->data, 0, q->dtype, 3, qs, NULL);
	ot = dl_host(o2, 0, o->dtype, 3, qs, NULL);
	lt = dl_host(l2, 0, APE_F32, 2, ls, NULL);
	ret = ape_paged_kv_run_dlpack(pk, desc, &pg[0], &pg[1], &qt, &ot, lse ? &lt : NULL);
	trace("run_dlpack: %d %s", ret, ret ? ape_last_error() : "");
	check(ret == 0 || (ret == APE_ENOTSUP && strstr(ape_last_error(), "ape_paged_kv_run_dlpack")),
	      "the DLPack run of an accepted run's tensors is accepted");
	if (!ret)
		check(!memcmp(o2, o->data, ob_bytes) && o2[ob_bytes] == 0x5a &&
			      (!lse || !memcmp(l2, lse, lse_bytes)),
		      "the DLPack run's O and LSE are the run's, bit for bit");
	free(o2);
	free(l2);
}

/*
 * A run. Bytes: m (bits 0-2 the pages' layout: contiguous, vLLM, FlashInfer HND and NHD in one
 * buffer, padded, raw strides, v's strides other than k's, a raw shape entry; 8: a buffer
 * short; 16: byte offsets; 32: a storage type; 64: q's rows not the plan's; 128: a NULL), g
 * (1: O float32; 2: causal; 4: decay 0.3; 8: lambda 0.2; 16: skip_tol 0; 32: LSE; 64: stats;
 * 128: a field refused), a seed for the values (its low bit: the diagnostics too, through
 * ape_paged_kv_run_diag()), then what those ask for.
 */
static void op_run(struct in *in, ape_paged_kv *pk)
{
	static const char fn[] = "ape_paged_kv_run";
	const unsigned m = (unsigned)take(in, 1), g = (unsigned)take(in, 1);
	const unsigned seed = (unsigned)take(in, 1);
	const int64_t H = opt.H, D = opt.D;
	bool clean = plan.planned, refuse = !plan.planned;
	struct layout l;
	ape_dtensor k, v;
	ape_tensor q, o;
	ape_attn_desc desc;
	ape_stats st;
	int64_t rows = plan.total_q;
	ape_dtype ot = g & 1 ? APE_F32 : opt.dtype;
	const ape_dtensor *kp = &k, *vp = &v;
	const ape_tensor *qp = &q;
	ape_tensor *op = &o;
	const ape_attn_desc *dp = &desc;
	void *qb = NULL, *ob = NULL;
	float *lse = NULL, *ent = NULL, *md = NULL;
	size_t ob_bytes = 0, lse_bytes = 0, diag_bytes = 0;
	int ret;

	take_layout(in, m, seed, &l, &k, &v, &clean, &refuse);
	if (m & 64) { /* q's rows: one off the plan's, or raw */
		const unsigned c = (unsigned)take(in, 1);

		rows = c & 1 ? take_int(in) : plan.total_q + (int64_t)((c >> 1) % 3) - 1;
		clean &= rows == plan.total_q;
		refuse |= rows != plan.total_q;
	}
	ape_attn_desc_init(&desc);
	desc.causal = g & 2;
	desc.delta.value = g & 4 ? 0.3f : 0.0f;
	desc.lambda.value = g & 8 ? 0.2f : 0.0f;
	if (g & 16)
		desc.skip_tol = 0;
	ape_stats_init(&st);
	if (g & 128) {
		switch (take(in, 1) % 4) {
		case 0:
			desc.q_start_set = true;
			desc.q_start = take_int(in);
			clean = false;
			refuse = true;
			break;
		case 1:
			desc.k_start = take_int(in);
			clean &= desc.k_start == 0;
			refuse |= desc.k_start != 0;
			break;
		case 2:
			desc.struct_size = (size_t)take(in, 1);
			clean = false;
			break;
		default:
			st.struct_size = 3;
			clean = false;
			refuse |= (g & 64) != 0;
		}
	}
	/* q and o: packed [rows, H, D], exact blocks; too many rows to back: memory not mapped */
	if (rows >= 0 && rows <= (int64_t)LIMIT / (H * D)) {
		const size_t n = (size_t)(rows * H * D);
		float *f = malloc(sizeof(float) * (n + 1));

		qb = malloc(n * ape_dtype_size(opt.dtype) + 1);
		ob_bytes = n * ape_dtype_size(ot);
		ob = malloc(ob_bytes + 1);
		check(f && qb && ob, "malloc");
		for (size_t i = 0; i < n; i++)
			f[i] = (float)((int)((i * 29 + seed * 7) % 17) - 8) / 8;
		check(ape_convert(qb, opt.dtype, f, APE_F32, n) == 0, "ape_convert");
		free(f);
		memset(ob, 0x5a, ob_bytes + 1);
		ape_tensor_init_packed(&q, qb, opt.dtype, rows, H, D);
		ape_tensor_init_packed(&o, ob, ot, rows, H, D);
		if (g & 32) {
			lse_bytes = sizeof(float) * (size_t)(rows * H);
			lse = malloc(lse_bytes + 1);
			check(lse != NULL, "malloc");
			memset(lse, 0x5a, lse_bytes + 1);
		}
	} else {
		/* packed [rows, H, D] (ape_tensor_init_packed() computes rows * H * D in int64,
		 * which raw rows overflow) */
		ape_tensor_init(&q, UNBACKED, opt.dtype, 1, H, rows, D);
		q.strides[0] = 0;
		q.strides[1] = D;
		q.strides[2] = H * D;
		q.strides[3] = 1;
		o = q;
		o.dtype = ot;
		if (g & 32)
			lse = UNBACKED;
		clean = false;
		refuse = true;
	}
	if (m & 128) { /* a NULL: refused */
		switch (take(in, 1) % 6) {
		case 0:
			kp = NULL;
			break;
		case 1:
			vp = NULL;
			break;
		case 2:
			k.buf = NULL;
			break;
		case 3:
			qp = NULL;
			break;
		case 4:
			op = NULL;
			break;
		default:
			dp = NULL;
		}
		clean = false;
		refuse = true;
	}
	if (seed & 1 && !(m & 128) && rows >= 0 && rows <= LIMIT && rows * H <= LIMIT) {
		/* with the diagnostics: ape_paged_kv_run_diag(), poisoned to see what is written */
		diag_bytes = sizeof(float) * (size_t)(rows * H) + 1;
		ent = malloc(diag_bytes);
		md = malloc(diag_bytes);
		check(ent && md, "malloc");
		memset(ent, 0x5a, diag_bytes);
		memset(md, 0x5a, diag_bytes);
		ret = ape_paged_kv_run_diag(pk, dp, kp, vp, qp, op, lse, ent, md,
					    g & 64 ? &st : NULL);
	} else {
		ret = ape_paged_kv_run(pk, dp, kp, vp, qp, op, lse, g & 64 ? &st : NULL);
	}
	trace("run (layout %u, flags %#x): %d %s", m & 7, g, ret, ret ? ape_last_error() : "");
	refused_or_done(ret, fn, false);
	if (ret && clean)
		fprintf(stderr, FUZZ_NAME ": valid run refused: %s\n", ape_last_error());
	check(!clean || !ret, "a valid run is accepted");
	check(!refuse || ret, "a run breaking the rules is refused");
	check(!ret || plan.planned || ret == APE_EINVAL, "a run without a plan is refused");
	if (ret) {
		for (size_t i = 0; ob && i <= ob_bytes; i++)
			check(((uint8_t *)ob)[i] == 0x5a, "a refused run writes no O");
		for (size_t i = 0; lse && lse != UNBACKED && i <= lse_bytes; i++)
			check(((uint8_t *)lse)[i] == 0x5a, "a refused run writes no LSE");
		for (size_t i = 0; ent && i < diag_bytes; i++)
			check(((uint8_t *)ent)[i] == 0x5a && ((uint8_t *)md)[i] == 0x5a,
			      "a refused run writes no diagnostics");
	} else {
		check(plan.planned && rows == plan.total_q && ob != NULL,
		      "an accepted run has a plan and its rows");
		check(((uint8_t *)ob)[ob_bytes] == 0x5a && (!lse || ((uint8_t *)lse)[lse_bytes] == 0x5a),
		      "an accepted run writes nothing past O and LSE");
		check(!(g & 64) || st.pairs_computed <= st.pairs_visible,
		      "pairs computed are visible pairs");
		check_rows(&l, &desc, &q, &o, lse);
		if (!ent)
			run_dlpack_same(pk, &desc, &l, &k, &v, &q, &o, lse, ob_bytes, lse_bytes);
		for (int64_t i = 0; ent && i < rows * H; i++)
			check(isfinite(ent[i]) && ent[i] >= -1e-3f && isfinite(md[i]) && md[i] >= 0,
			      "the diagnostics are finite, entropy and distance >= 0");
	}
	free(ent);
	free(md);
	free_layout(&l);
	free(qb);
	free(ob);
	if (lse != UNBACKED)
		free(lse);
}

/* ---------------------------------------------------------------- NULL arguments */

static void op_nulls(ape_paged_kv *pk)
{
	ape_paged_kv *out = (ape_paged_kv *)(uintptr_t)1;
	ape_paged_kv_options o = opt;
	ape_attn_desc desc;
	int ret;

	ape_paged_kv_options_init(NULL);
	ape_page_table_init(NULL);
	ape_paged_kv_destroy(NULL);
	ape_attn_desc_init(&desc);
	ret = ape_paged_kv_create(NULL, &o, &out);
	refused_or_done(ret, "ape_paged_kv_create", false);
	check(ret == APE_EINVAL && out == NULL, "create without a device: EINVAL, *out NULL");
	out = (ape_paged_kv *)(uintptr_t)1;
	ret = ape_paged_kv_create(dev, NULL, &out);
	refused_or_done(ret, "ape_paged_kv_create", false);
	check(ret == APE_EINVAL && out == NULL, "create without options: EINVAL, *out NULL");
	check(ape_paged_kv_create(dev, &o, NULL) == APE_EINVAL, "create without out: EINVAL");
	ret = ape_paged_kv_run(NULL, &desc, NULL, NULL, NULL, NULL, NULL, NULL);
	refused_or_done(ret, "ape_paged_kv_run", false);
	check(ret == APE_EINVAL, "a run of no object is refused");
	(void)pk;
}

/* ---------------------------------------------------------------- the object */

/* Options whose objects keep every tensor a call may accept within LIMIT elements and every
 * valid table within LIMIT entries, and the host and device memory of a create small; options
 * refused before anything is allocated pass too. */
static bool small_enough(const ape_paged_kv_options *o)
{
	const int64_t mb = o->max_batch_tokens ? o->max_batch_tokens : 256;
	const int64_t H = o->H > 0 ? o->H : o->Hkv;
	int64_t d[4];

	if (o->Hkv < 1 || o->D < 2 || o->page_tokens < 1 || o->page_tokens > 65536 ||
	    o->num_pages < 1 || o->num_pages > ((int64_t)1 << 40) / o->page_tokens ||
	    o->max_batch_tokens < 0 || o->max_batch_tokens > (1 << 20) || o->attend_chunk < 0 ||
	    H < 1 || o->struct_size != sizeof(*o))
		return true; /* refused before anything is allocated */
	if (o->num_pages > 4096 || o->attend_chunk > 4096)
		return false;
	for (int i = 0; i < 4; i++)
		d[i] = i == 0 ? o->num_pages : i == 1 ? o->page_tokens : i == 2 ? o->Hkv : o->D;
	if (d[2] > (1 << 16) || d[3] > (1 << 16) ||
	    (uint64_t)d[0] * (uint64_t)d[1] > LIMIT ||
	    (uint64_t)d[0] * (uint64_t)d[1] * (uint64_t)d[2] * (uint64_t)d[3] > LIMIT)
		return false;
	return H <= (1 << 16) && (uint64_t)mb * (uint64_t)H * (uint64_t)o->D <= LIMIT;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static bool ready;
	struct in in = { data, size };
	const unsigned f = (unsigned)take(&in, 1);
	ape_paged_kv *pk = (ape_paged_kv *)(uintptr_t)1; /* must be NULL after a failure */
	ape_paged_kv_options o;
	int ret;

	if (!ready) { /* the devices: the reference, and OpenCL where built in and present */
		ape_selection sel;

		devs[ndevs++] = ref;
		if (ape_device_select(ctx, "opencl", -1, &sel) == 0)
			devs[ndevs++] = sel.device;
		for (int i = 0; i < ndevs; i++)
			check(ape_queue_create(devs[i], &queues[i]) == 0, "ape_queue_create");
		ready = true;
	}
	dev = devs[f & 128 && ndevs > 1 ? 1 : 0];
	queue = queues[dev == devs[0] ? 0 : 1];
	ape_paged_kv_options_init(&o);
	o.Hkv = take_int(&in);
	o.H = f & 1 ? take_int(&in) : 0;
	o.D = (int64_t)((uint64_t)take_int(&in) * 2);
	o.dtype = (ape_dtype)(take(&in, 1) % 4); /* 3: not a type */
	o.page_tokens = f & 2 ? take_int(&in) : (int64_t)(take(&in, 1) % 9);
	o.num_pages = take_int(&in);
	o.max_batch_tokens = f & 4 ? take_int(&in) : (int64_t)(take(&in, 1) % 40);
	o.attend_chunk = f & 8 ? take_int(&in) : (int64_t)(take(&in, 1) % 80);
	o.max_device_bytes = f & 16 ? take(&in, 3) % (8u << 20) : 0;
	if (f & 32)
		o.struct_size = (size_t)take(&in, 1);
	if (!small_enough(&o))
		return 0;
	ret = ape_paged_kv_create(dev, &o, &pk);
	trace("create on %s (Hkv %lld, H %lld, D %lld, dtype %d, page_tokens %lld, num_pages %lld, "
	      "max_batch_tokens %lld, attend_chunk %lld): %d %s", dev == devs[0] ? "ref" : "opencl",
	      (long long)o.Hkv, (long long)o.H, (long long)o.D, (int)o.dtype,
	      (long long)o.page_tokens, (long long)o.num_pages, (long long)o.max_batch_tokens,
	      (long long)o.attend_chunk, ret, ret ? ape_last_error() : "");
	refused_or_done(ret, "ape_paged_kv_create", true);
	if (ret) {
		check(pk == NULL, "a failed create leaves *out NULL");
		return 0;
	}
	opt = o;
	opt.H = o.H ? o.H : o.Hkv;
	opt.max_batch_tokens = o.max_batch_tokens ? o.max_batch_tokens : 256;
	forget_plan();
	for (int i = 0; i < MAXOPS && in.n; i++) {
		switch (take(&in, 1) % 8) {
		case 0:
		case 1:
		case 2:
			op_plan(&in, pk);
			break;
		case 7:
			op_nulls(pk);
			break;
		default:
			op_run(&in, pk);
		}
	}
	ape_paged_kv_destroy(pk);
	forget_plan();
	return 0;
}
