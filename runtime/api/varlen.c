/* SPDX-License-Identifier: MIT */
/*
 * Ragged batches (include/ape/ape.h, "Ragged batches"; docs/ape.md): many sequences over packed
 * tensors, each pair at its true distance n = pos_q - pos_k.
 *
 * Validation first, of everything, before any work. Then each sequence is cut into runs of
 * consecutive positions (one run of queries and one of keys for default positions, and for
 * position_ids that restart per document): a query run against a key run is exactly a dense
 * problem (q_start, k_start the runs' first positions).
 *
 * When every query run sees one key run and every device takes ragged launches (struct
 * ape_be_ape_be_caps_have(&caps, APE_BE_CAP_SEGMENTS)), the whole batch is one run of the dense executor over the packed
 * tensors, its runs the segments (struct ape_be_seg) of every launch: the same planner, chunking,
 * devices and merges, each launch serving every sequence of its rows (one_run()). When a query
 * run sees several key runs (gaps, repeats, any order) and every device also reads explicit
 * positions (.positions), it is still one run: one segment per sequence, the positions of
 * every row and key passed along (struct ape_be_launch.pos_q, .pos_k). Otherwise each query run
 * is one dense call per key run it sees, their partial results merged by LSE on the host
 * (exec/lse_merge.h). Either way everything is written to host staging and published once
 * the whole call succeeded.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/verbose.h"
#include "exec/launch.h"
#include "exec/lse_merge.h"
#include "exec/pack.h"
#include "exec/problem.h"
#include "api/forward.h"
#include "api/stats.h"
#include "api/validate.h"
#include "api/varlen.h"

typedef __int128 i128;

void ape_varlen_init(ape_varlen *vl)
{
	if (!vl)
		return;
	memset(vl, 0, sizeof(*vl));
	vl->struct_size = sizeof(*vl);
}

void ape_tensor_init_packed(ape_tensor *t, void *data, ape_dtype dtype, int64_t total, int64_t H,
			    int64_t D)
{
	if (!t)
		return;
	ape_tensor_init(t, data, dtype, 1, H, total, D);
	/* [total, H, D] row-major: a head steps D, a token H * D */
	t->strides[0] = total * H * D;
	t->strides[1] = D;
	t->strides[2] = H * D;
	t->strides[3] = 1;
}

/* ------------------------------------------------------------------ validation */

static int check_offsets(const char *fn, const char *name, const int64_t *cu, int64_t S,
			 int64_t total)
{
	if (!cu)
		return ape__error(APE_EINVAL, "%s: vl->%s = NULL: needs num_seqs + 1 = %" PRId64
				  " offsets", fn, name, S + 1);
	if (cu[0] != 0)
		return ape__error(APE_EINVAL, "%s: vl->%s[0] = %" PRId64 ": must be 0", fn, name,
				  cu[0]);
	for (int64_t s = 1; s <= S; s++)
		if (cu[s] < cu[s - 1])
			return ape__error(APE_EINVAL,
					  "%s: vl->%s[%" PRId64 "] = %" PRId64 " < vl->%s[%" PRId64
					  "] = %" PRId64 ": must be non-decreasing",
					  fn, name, s, cu[s], name, s - 1, cu[s - 1]);
	if (cu[S] != total)
		return ape__error(APE_EINVAL,
				  "%s: vl->%s[%" PRId64 "] = %" PRId64 ": must be the packed "
				  "tensors' %" PRId64 " rows",
				  fn, name, S, cu[S], total);
	return 0;
}

/* The position of query row i (sequence s) or key row j. */
int64_t ape__varlen_qpos(const ape_varlen *vl, int64_t s, int64_t i)
{
	if (vl->pos_q)
		return vl->pos_q[i];
	/* end-aligned: Lk_s - Lq_s + (i - cu_q[s]); fits, both are row counts */
	return (vl->cu_seqlens_k[s + 1] - vl->cu_seqlens_k[s]) -
	       (vl->cu_seqlens_q[s + 1] - vl->cu_seqlens_q[s]) + (i - vl->cu_seqlens_q[s]);
}

int64_t ape__varlen_kpos(const ape_varlen *vl, int64_t s, int64_t j)
{
	return vl->pos_k ? vl->pos_k[j] : j - vl->cu_seqlens_k[s];
}

/* Every pair's n of every sequence fits in int64 (the dense call's own rule). */
static int check_distances(const char *fn, const ape_varlen *vl)
{
	for (int64_t s = 0; s < vl->num_seqs; s++) {
		const int64_t q0 = vl->cu_seqlens_q[s], q1 = vl->cu_seqlens_q[s + 1];
		const int64_t k0 = vl->cu_seqlens_k[s], k1 = vl->cu_seqlens_k[s + 1];
		int64_t qlo = INT64_MAX, qhi = INT64_MIN, klo = INT64_MAX, khi = INT64_MIN;

		if (q0 == q1 || k0 == k1)
			continue;
		for (int64_t i = q0; i < q1; i++) {
			const int64_t x = ape__varlen_qpos(vl, s, i);

			qlo = x < qlo ? x : qlo;
			qhi = x > qhi ? x : qhi;
		}
		for (int64_t j = k0; j < k1; j++) {
			const int64_t x = ape__varlen_kpos(vl, s, j);

			klo = x < klo ? x : klo;
			khi = x > khi ? x : khi;
		}
		if ((i128)qhi - klo > INT64_MAX || (i128)qlo - khi < INT64_MIN)
			return ape__error(APE_EOVERFLOW,
					  "%s: sequence %" PRId64 ": query positions %" PRId64
					  "..%" PRId64 " and key positions %" PRId64 "..%" PRId64
					  ": a distance pos_q - pos_k does not fit in 64 bits",
					  fn, s, qlo, qhi, klo, khi);
	}
	return 0;
}

int ape__varlen_check_desc(const char *fn, const ape_attn_desc *desc, const ape_varlen *vl)
{
	const int64_t *pq, *pk;

	if (!vl)
		return ape__error(APE_EINVAL, "%s: vl = NULL", fn);
	if (vl->struct_size != sizeof(*vl))
		return ape__error(APE_EINVAL,
				  "%s: vl->struct_size = %zu: expected %zu (initialise with "
				  "ape_varlen_init())",
				  fn, vl->struct_size, sizeof(*vl));
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	ape__desc_positions(desc, &pq, &pk);
	if (pq || pk)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %p: a ragged batch takes its explicit positions "
				  "from vl->pos_q and vl->pos_k",
				  fn, pq ? "pos_q" : "pos_k", pq ? (const void *)pq : (const void *)pk);
	if (desc->q_start_set || desc->k_start != 0)
		return ape__error(APE_EINVAL,
				  "%s: desc->%s = %" PRId64 ": a ragged batch takes its positions "
				  "from vl (pos_q, pos_k or the per-sequence defaults)",
				  fn, desc->q_start_set ? "q_start" : "k_start",
				  desc->q_start_set ? desc->q_start : desc->k_start);
	return 0;
}

int ape__varlen_check_batch(const char *fn, const ape_varlen *vl, const struct ape__problem *p,
			    const char *q_name)
{
	int ret;

	if (p->B != 1)
		return ape__error(APE_EINVAL,
				  "%s: %s->shape[0] = %" PRId64 ": a ragged batch is one "
				  "packed [1, H, total, D] tensor (ape_tensor_init_packed())",
				  fn, q_name, p->B);
	if (vl->num_seqs < 0)
		return ape__error(APE_EINVAL, "%s: vl->num_seqs = %" PRId64 ": must be >= 0", fn,
				  vl->num_seqs);
	if ((ret = check_offsets(fn, "cu_seqlens_q", vl->cu_seqlens_q, vl->num_seqs, p->Lq)) ||
	    (ret = check_offsets(fn, "cu_seqlens_k", vl->cu_seqlens_k, vl->num_seqs, p->Lk)))
		return ret;
	return check_distances(fn, vl);
}

int ape__varlen_check(const char *fn, const ape_attn_desc *desc, const ape_varlen *vl,
		      const ape_exec_options *opts, const ape_tensor *q, const ape_tensor *k,
		      const ape_tensor *v, const ape_tensor *o, const float *lse,
		      struct ape__problem *p)
{
	int ret;

	if ((ret = ape__varlen_check_desc(fn, desc, vl)))
		return ret;
	if (opts && opts->trace_path)
		return ape__error(APE_EINVAL,
				  "%s: opts->trace_path = \"%s\": ragged calls write no trace yet",
				  fn, opts->trace_path);
	for (int t = 0; t < 4; t++) {
		const ape_tensor *x = t == 0 ? q : t == 1 ? k : t == 2 ? v : o;
		static const char *const names[4] = { "q", "k", "v", "o" };

		if (x && x->shape[0] != 1)
			return ape__error(APE_EINVAL,
					  "%s: %s->shape[0] = %" PRId64 ": a ragged batch is one "
					  "packed [1, H, total, D] tensor (ape_tensor_init_packed())",
					  fn, names[t], x->shape[0]);
	}
	/* the packed tensors as one dense problem: shapes, types, strides, overlaps, params */
	if ((ret = ape__problem_init(p, fn, desc, q, k, v, o, lse)))
		return ret;
	if ((ret = ape__varlen_check_batch(fn, vl, p, "q")))
		ape__problem_fini(p);
	return ret;
}

/* ------------------------------------------------------------------ the pieces */

struct vcall {
	const char *fn;
	ape_device *const *devs;
	int ndev;
	ape_exec_options opts; /* the caller's, without atomic outputs (staging is ours) */
	const ape_attn_desc *desc;
	const ape_varlen *vl;
	const ape_tensor *q, *k, *v;
	ape_tensor *o; /* the caller's */
	const struct ape__problem *p;
	bool atomic; /* APE_EXEC_ATOMIC_OUTPUTS: o untouched unless the call succeeds */
	bool o_done; /* one ragged run wrote o itself (in place, or from its buffers) */
	ape_tensor so; /* staged O, [1, H, total_q, D] token-major (packed), of o's type */
	int64_t sos[4];
	float *slse; /* staged LSE, [H, total_q] */
	float *tlse; /* one piece's LSE, [H, rows] */
	float *to; /* one piece's O when merging, float32 [H, rows, D] */
	struct ape__acc acc;
	int64_t maxrows; /* the longest query run: what tlse, to and acc hold */
	ape_stats st; /* the pieces' statistics, summed */
	bool have_st;
	bool rep_done; /* one run reported the call's statistics itself */
};

/* The end of the run of consecutive positions that starts at row a (ends before `end`). */
int64_t ape__varlen_run_end(const ape_varlen *vl, bool query, int64_t s, int64_t a,
			     int64_t end)
{
	int64_t b = a + 1;

	for (; b < end; b++) {
		const int64_t prev = query ? ape__varlen_qpos(vl, s, b - 1)
					   : ape__varlen_kpos(vl, s, b - 1);
		const int64_t cur = query ? ape__varlen_qpos(vl, s, b) : ape__varlen_kpos(vl, s, b);

		if (prev == INT64_MAX || cur != prev + 1)
			break;
	}
	return b;
}

void ape__varlen_add_stats(ape_stats *t, bool *have, const ape_stats *x)
{
	if (!*have) {
		*t = *x;
		*have = true;
		return;
	}
	t->pairs_visible += x->pairs_visible;
	t->pairs_computed += x->pairs_computed;
	t->kernel_ms += x->kernel_ms;
	t->bytes_to_device += x->bytes_to_device;
	t->bytes_from_device += x->bytes_from_device;
	t->chunks += x->chunks;
	t->chunks_skipped += x->chunks_skipped;
	t->bytes_device_to_device += x->bytes_device_to_device;
	t->copy_ms += x->copy_ms;
	t->overlap_ms += x->overlap_ms;
	t->devices = x->devices > t->devices ? x->devices : t->devices;
	/* the paths: each once (a path's name is never a part of another's) */
	for (const char *a = x->path; *a;) {
		const char *e = strchr(a, '+');
		const size_t n = e ? (size_t)(e - a) : strlen(a), have_n = strlen(t->path);
		bool seen = false;

		for (const char *b = t->path; *b && !seen;) {
			const char *f = strchr(b, '+');
			const size_t m = f ? (size_t)(f - b) : strlen(b);

			seen = m == n && !strncmp(a, b, n);
			b += m + (f ? 1 : 0);
		}
		if (!seen && have_n + n + 2 <= sizeof(t->path))
			snprintf(t->path + have_n, sizeof(t->path) - have_n, "%s%.*s",
				 have_n ? "+" : "", (int)n, a);
		a += n + (e ? 1 : 0);
	}
	if (x->peak_device_bytes > t->peak_device_bytes)
		t->peak_device_bytes = x->peak_device_bytes;
}

void ape__varlen_report(const char *fn, ape_device *const *devs, int ndev,
			const struct ape__problem *p, int ret, ape_stats *stats, ape_stats *sum,
			bool have, double t0)
{
	const struct ape__call_log lg = {
		.fn = fn, .devs = devs, .ndev = ndev, .p = p, .ret = ret, .st = sum,
		.pairs_uncounted = !have,
	};

	if (!have)
		ape_stats_init(sum);
	sum->total_ms = ape__now_ms() - t0;
	ape__call_log(&lg);
	if (!ret && stats) {
		const size_t keep = stats->struct_size;

		sum->struct_size = keep;
		memcpy(stats, sum, keep);
		sum->struct_size = sizeof(*sum);
	}
}

/* Query rows [a, b) against key rows [kc, kd) of sequence s, as one dense call writing o (a
 * [1, H, b - a, D] view) and c->tlse. */
static int piece(struct vcall *c, int64_t s, int64_t a, int64_t b, int64_t kc, int64_t kd,
		 ape_tensor *o)
{
	ape_attn_desc d;
	ape_tensor qv, kv, vv;
	ape_stats st;
	int ret;

	ape__desc_copy(&d, c->desc);
	d.q_start_set = true;
	d.q_start = ape__varlen_qpos(c->vl, s, a);
	d.k_start = ape__varlen_kpos(c->vl, s, kc);
	ape_stats_init(&st);
	if ((ret = ape_tensor_rows(c->q, a, b - a, &qv)) ||
	    (ret = ape_tensor_rows(c->k, kc, kd - kc, &kv)) ||
	    (ret = ape_tensor_rows(c->v, kc, kd - kc, &vv)))
		return ret; /* validated: not reached */
	ret = ape_attention_forward_ex(c->devs, c->ndev, &c->opts, &d, &qv, &kv, &vv, o, c->tlse,
				       &st);
	if (ret)
		return ape__error(ret, "%s: sequence %" PRId64 " (query rows %" PRId64 "..%" PRId64
				  ", key rows %" PRId64 "..%" PRId64 "): %s",
				  c->fn, s, a, b - 1, kc, kd - 1, ape_last_error());
	ape__varlen_add_stats(&c->st, &c->have_st, &st);
	return 0;
}

bool ape__varlen_run_visible(const ape_varlen *vl, bool causal, int64_t s, int64_t a, int64_t b,
			     int64_t kc)
{
	int64_t last = INT64_MIN;

	/* a run is consecutive, so its first key is its earliest */
	if (!causal)
		return true;
	for (int64_t i = a; i < b; i++) {
		const int64_t x = ape__varlen_qpos(vl, s, i);

		last = x > last ? x : last;
	}
	return ape__varlen_kpos(vl, s, kc) <= last;
}

/* The piece's LSE [H, n] into the staged [H, total_q] at row a. */
static void stage_lse(struct vcall *c, const float *l, int64_t a, int64_t n)
{
	for (int64_t h = 0; h < c->p->H; h++)
		memcpy(c->slse + h * c->p->Lq + a, l + h * n, (size_t)n * sizeof(float));
}

/* Query run [a, b) of sequence s against every key run of it. */
static int query_run(struct vcall *c, int64_t s, int64_t a, int64_t b)
{
	const int64_t k0 = c->vl->cu_seqlens_k[s], k1 = c->vl->cu_seqlens_k[s + 1];
	const int64_t n = b - a, H = c->p->H, D = c->p->D;
	int64_t runs = 0, only = -1, only_end = -1;
	ape_tensor ov;
	int ret;

	for (int64_t kc = k0, kd; kc < k1; kc = kd) {
		kd = ape__varlen_run_end(c->vl, false, s, kc, k1);
		if (ape__varlen_run_visible(c->vl, c->p->causal, s, a, b, kc)) {
			if (!runs++) {
				only = kc;
				only_end = kd;
			}
		}
	}
	if (runs == 0)
		return 0; /* no key visible: the staging's zeros and -inf stand */
	if (runs == 1) { /* the dense call itself, into the staged rows */
		if ((ret = ape_tensor_rows(&c->so, a, n, &ov)))
			return ret;
		if ((ret = piece(c, s, a, b, only, only_end, &ov)))
			return ret;
		stage_lse(c, c->tlse, a, n);
		return 0;
	}
	/* several runs: float32 pieces merged by their LSE */
	ape_tensor_init(&ov, c->to, APE_F32, 1, H, n, D);
	ape__acc_reset(&c->acc, H * n);
	for (int64_t kc = k0, kd; kc < k1; kc = kd) {
		kd = ape__varlen_run_end(c->vl, false, s, kc, k1);
		if (!ape__varlen_run_visible(c->vl, c->p->causal, s, a, b, kc))
			continue;
		if ((ret = piece(c, s, a, b, kc, kd, &ov)))
			return ret;
		ape__acc_add(&c->acc, c->to, c->tlse, NULL, NULL);
	}
	ape__acc_store(&c->acc, &c->so, c->sos, c->slse, NULL, NULL, c->p->Lq, a, n);
	return 0;
}

/* The longest run of consecutive query positions over the batch: what the buffers hold. */
static int64_t longest_query_run(const ape_varlen *vl)
{
	int64_t most = 0;

	for (int64_t s = 0; s < vl->num_seqs; s++) {
		const int64_t q1 = vl->cu_seqlens_q[s + 1];

		if (vl->cu_seqlens_k[s] == vl->cu_seqlens_k[s + 1])
			continue;
		for (int64_t a = vl->cu_seqlens_q[s], b; a < q1; a = b) {
			b = ape__varlen_run_end(vl, true, s, a, q1);
			most = b - a > most ? b - a : most;
		}
	}
	return most;
}

static void vcall_free(struct vcall *c)
{
	free(c->so.data);
	free(c->slse);
	free(c->tlse);
	free(c->to);
	ape__acc_free(&c->acc);
}

static int vcall_alloc(struct vcall *c)
{
	const struct ape__problem *p = c->p;
	const size_t rows = (size_t)(p->H * p->Lq);

	c->maxrows = longest_query_run(c->vl);
	c->slse = ape__malloc(rows * sizeof(float) + 1);
	c->tlse = ape__malloc((size_t)(p->H * c->maxrows) * sizeof(float) + 1);
	c->to = ape__malloc((size_t)(p->H * c->maxrows * p->D) * sizeof(float) + 1);
	if (!c->slse || !c->tlse || !c->to ||
	    ape__acc_alloc(&c->acc, p->H * c->maxrows, p->D, false)) {
		vcall_free(c);
		return ape__error(APE_ENOMEM, "%s: out of host memory staging %" PRId64
				  " rows of LSE", c->fn, p->Lq);
	}
	for (size_t r = 0; r < rows; r++)
		c->slse[r] = -INFINITY;
	return 0;
}

/* The staging of O, when the call writes o only on success. */
static int stage_o(struct vcall *c)
{
	const struct ape__problem *p = c->p;

	/* zero bits are 0.0 in every storage type: rows that see no key are ready */
	c->so.data = ape__calloc((size_t)(p->H * p->Lq * p->D) + 1, ape_dtype_size(p->out_dtype));
	if (!c->so.data)
		return ape__error(APE_ENOMEM, "%s: out of host memory staging %" PRId64
				  " rows of O", c->fn, p->Lq);
	/* token-major, as packed outputs are: the publication is then one copy */
	ape_tensor_init_packed(&c->so, c->so.data, p->out_dtype, p->Lq, p->H, p->D);
	ape_tensor_strides(&c->so, c->sos);
	return 0;
}

/* Publishes the staging: O through o's strides, LSE transposed to [total_q, H]. */
static void publish(struct vcall *c, ape_tensor *o, float *lse)
{
	const struct ape__problem *p = c->p;

	if (!c->o_done)
		ape__copy_rows(o, p->os, &c->so, c->sos, 0, p->Lq);
	if (lse)
		for (int64_t i = 0; i < p->Lq; i++)
			for (int64_t h = 0; h < p->H; h++)
				lse[i * p->H + h] = c->slse[h * p->Lq + i];
}

/* ------------------------------------------------------------------ one ragged launch */

/* The batch as segments (api/varlen.h). */
int ape__varlen_segments(const char *fn, const ape_varlen *vl, bool causal,
			 struct ape_be_seg **out, int64_t *nout)
{
	int64_t n = 0, cap = vl->num_seqs + 16;
	struct ape_be_seg *sg = ape__malloc((size_t)cap * sizeof(*sg));

	for (int64_t s = 0; sg && s < vl->num_seqs; s++) {
		const int64_t q1 = vl->cu_seqlens_q[s + 1];
		const int64_t k0 = vl->cu_seqlens_k[s], k1 = vl->cu_seqlens_k[s + 1];

		for (int64_t a = vl->cu_seqlens_q[s], b; a < q1; a = b) {
			struct ape_be_seg x = { .q0 = a, .k0 = k0, .k_start = 0 };

			b = ape__varlen_run_end(vl, true, s, a, q1);
			x.lq = b - a;
			x.q_start = ape__varlen_qpos(vl, s, a);
			for (int64_t kc = k0, kd; kc < k1; kc = kd) {
				kd = ape__varlen_run_end(vl, false, s, kc, k1);
				if (!ape__varlen_run_visible(vl, causal, s, a, b, kc))
					continue;
				if (x.lk) { /* a second key run */
					free(sg);
					return 0;
				}
				x.k0 = kc;
				x.lk = kd - kc;
				x.k_start = ape__varlen_kpos(vl, s, kc);
			}
			if (n == cap) {
				struct ape_be_seg *g = ape__realloc(sg, (size_t)(cap *= 2) * sizeof(*sg));

				if (!g) {
					free(sg);
					sg = NULL;
					break;
				}
				sg = g;
			}
			sg[n++] = x;
		}
	}
	if (!sg)
		return ape__error(APE_ENOMEM, "%s: out of host memory for the batch's segments", fn);
	*out = sg;
	*nout = n;
	return 1;
}

int ape__varlen_keys_disjoint(const char *fn, const struct ape_be_seg *sg, int64_t n)
{
	int64_t (*r)[2] = ape__malloc((size_t)n * sizeof(*r) + 1), m = 0;
	int ok = 1;

	if (!r)
		return ape__error(APE_ENOMEM, "%s: out of host memory for %" PRId64 " segments",
				  fn, n);
	for (int64_t s = 0; s < n; s++)
		if (sg[s].lk) {
			int64_t x = m++;

			/* insertion by k0: the segments come in sequence order, so the keys are
			 * nearly sorted already (only runs of one sequence can be out of order) */
			for (; x > 0 && r[x - 1][0] > sg[s].k0; x--) {
				r[x][0] = r[x - 1][0];
				r[x][1] = r[x - 1][1];
			}
			r[x][0] = sg[s].k0;
			r[x][1] = sg[s].k0 + sg[s].lk;
		}
	for (int64_t x = 1; x < m && ok; x++)
		ok = r[x][0] >= r[x - 1][1];
	free(r);
	return ok;
}

bool ape__varlen_devices_take(ape_device *const *devs, int ndev, bool positions)
{
	for (int d = 0; d < ndev; d++)
		if (!ape_be_caps_have(&devs[d]->caps, APE_BE_CAP_SEGMENTS) || (positions && !ape_be_caps_have(&devs[d]->caps, APE_BE_CAP_POSITIONS)))
			return false;
	return true;
}

void ape__varlen_pos_free(struct ape__varlen_pos *x)
{
	free(x->own_q);
	free(x->own_k);
}

/* The batch as one segment per sequence with query rows, with every row's and key's positions
 * (api/varlen.h). */
int ape__varlen_build_positions(const char *fn, const ape_varlen *vl, struct ape_be_seg **out,
				int64_t *nout, struct ape__varlen_pos *pos)
{
	const int64_t tq = vl->cu_seqlens_q[vl->num_seqs], tk = vl->cu_seqlens_k[vl->num_seqs];
	struct ape_be_seg *sg = ape__malloc((size_t)vl->num_seqs * sizeof(*sg) + 1);
	int64_t n = 0;

	memset(pos, 0, sizeof(*pos));
	pos->q = vl->pos_q;
	pos->k = vl->pos_k;
	if (!pos->q)
		pos->q = pos->own_q = ape__malloc((size_t)tq * sizeof(int64_t) + 1);
	if (!pos->k)
		pos->k = pos->own_k = ape__malloc((size_t)tk * sizeof(int64_t) + 1);
	if (!sg || !pos->q || !pos->k) {
		free(sg);
		ape__varlen_pos_free(pos);
		return ape__error(APE_ENOMEM, "%s: out of host memory for the batch's positions", fn);
	}
	for (int64_t s = 0; s < vl->num_seqs; s++) {
		const int64_t q0 = vl->cu_seqlens_q[s], q1 = vl->cu_seqlens_q[s + 1];
		const int64_t k0 = vl->cu_seqlens_k[s], k1 = vl->cu_seqlens_k[s + 1];

		for (int64_t i = q0; pos->own_q && i < q1; i++)
			pos->own_q[i] = ape__varlen_qpos(vl, s, i);
		for (int64_t j = k0; pos->own_k && j < k1; j++)
			pos->own_k[j] = ape__varlen_kpos(vl, s, j);
		if (q1 > q0) /* the segments partition the query rows: none for a sequence without */
			sg[n++] = (struct ape_be_seg){ .q0 = q0, .lq = q1 - q0, .k0 = k0, .lk = k1 - k0 };
	}
	*out = sg;
	*nout = n;
	return 0;
}

/* The visible pairs of every segment at explicit positions, all heads; -1 on overflow or out
 * of memory (then the message is set). */
static int positions_visible(const char *fn, const struct ape__problem *p,
			     const struct ape_be_seg *sg, int64_t n,
			     const struct ape__varlen_pos *pos, uint64_t *out)
{
	uint64_t sum = 0;

	for (int64_t s = 0; s < n; s++) {
		uint64_t x;
		const int r = ape__pos_visible_pairs(pos->q + sg[s].q0, sg[s].lq, pos->k + sg[s].k0,
						     sg[s].lk, p->causal, &x);

		if (r == APE_ENOMEM)
			return ape__error(r, "%s: out of host memory counting pairs", fn);
		if (r || x > (UINT64_MAX - sum) / (uint64_t)p->H)
			return ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", fn);
		sum += x * (uint64_t)p->H;
	}
	*out = sum;
	return 0;
}

/*
 * The whole batch as one executor run over the packed tensors, each launch ragged, into the
 * staging: 1 done (or failed: *ret), 0 not applicable (the pieces serve it).
 */
static int one_run(struct vcall *c, struct ape__problem *p, ape_stats *stats, double t0,
		   int *ret)
{
	const struct ape__diag_req none = { NULL, NULL };
	struct ape__exec_result res;
	struct ape__problem pp = *p;
	ape_exec_options eo;
	struct ape_be_seg *sg = NULL;
	struct ape__varlen_pos pos = { 0 };
	int64_t n = 0;
	uint64_t visible = 0;
	int r;

	*ret = 0;
	if (!ape__varlen_devices_take(c->devs, c->ndev, false) || p->Lk == 0)
		return 0;
	r = ape__varlen_segments(c->fn, c->vl, p->causal, &sg, &n);
	if (r < 0) {
		*ret = r;
		return 1;
	}
	if (r == 0) {
		/* positions that are not runs: one launch still, where every device reads them */
		if (!ape__varlen_devices_take(c->devs, c->ndev, true))
			return 0;
		if ((*ret = ape__varlen_build_positions(c->fn, c->vl, &sg, &n, &pos)))
			return 1;
		if ((*ret = positions_visible(c->fn, p, sg, n, &pos, &visible))) {
			free(sg);
			ape__varlen_pos_free(&pos);
			return 1;
		}
		pp.segs = sg;
		pp.nseg = n;
		pp.pos_q = pos.q;
		pp.pos_k = pos.k;
	} else if (ape__segs_visible(p, sg, n, &visible)) {
		free(sg);
		*ret = ape__error(APE_EOVERFLOW, "%s: pair count overflows 64 bits", c->fn);
		return 1;
	} else if (n == 1 && sg[0].k0 == 0 && sg[0].lk == p->Lk) {
		/* one sequence over every key: the dense problem itself, so that every fast path
		 * (the decode kernel's too) serves it as the dense call, bit for bit */
		pp.q_start = sg[0].q_start;
		pp.k_start = sg[0].k_start;
	} else {
		pp.segs = sg;
		pp.nseg = n;
	}
	if (c->atomic) { /* into the staging */
		if ((*ret = stage_o(c))) {
			free(sg);
			ape__varlen_pos_free(&pos);
			return 1;
		}
		memcpy(pp.os, c->sos, sizeof(pp.os));
	}
	memset(&res, 0, sizeof(res));
	eo = c->opts;
	if (pp.segs && !eo.chunk_k)
		/* a query chunk's launch sees only its own sequences' keys: the default is one key
		 * chunk of every key (no partial results to merge; the planner halves it when the
		 * budget says so) rather than key chunks that cut through its sequences */
		eo.chunk_k = p->Lk;
	/* o itself unless atomic: on a device that reads host memory the launches write it in
	 * place, every row (those that see no key too: zeros), and a failure says so */
	*ret = ape__forward_call(c->fn, c->devs, c->ndev, &eo, &pp, c->q, c->k, c->v,
				 c->atomic ? &c->so : c->o, c->slse, &none, stats != NULL,
				 c->atomic, &res);
	c->o_done = !c->atomic;
	if (*ret)
		*ret = ape__error(*ret, "%s: %" PRId64 " sequences in ragged launches: %s", c->fn,
				  c->vl->num_seqs, ape_last_error());
	{
		const struct ape__call_report rep = {
			.fn = c->fn, .p = p, .ret = *ret, .pairs_uncounted = !stats,
			.res = &res, .devs = c->devs, .ndev = c->ndev, .devices = c->ndev,
			.pairs_visible = visible, .t0 = t0,
		};

		c->rep_done = true;
		ape__call_done(stats, &rep);
	}
	free(sg);
	ape__varlen_pos_free(&pos);
	return 1;
}

int ape__attention_forward_varlen(const char *fn, ape_device *const *devs, int ndev,
				  const ape_exec_options *opts, const ape_attn_desc *desc,
				  const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				  const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats)
{
	const double t0 = ape__now_ms();
	struct ape__problem p;
	struct vcall c;
	int ret;

	if ((ret = ape__check_exec_call(fn, devs, ndev, opts, stats)) ||
	    (ret = ape__varlen_check(fn, desc, vl, opts, q, k, v, o, lse, &p)))
		return ret;
	memset(&c, 0, sizeof(c));
	c.fn = fn;
	c.devs = devs;
	c.ndev = ndev;
	if (opts)
		c.opts = *opts;
	else
		ape_exec_options_init(&c.opts);
	c.atomic = c.opts.flags & APE_EXEC_ATOMIC_OUTPUTS;
	c.opts.flags &= ~APE_EXEC_ATOMIC_OUTPUTS; /* the staging, when there is one, is ours */
	c.desc = desc;
	c.vl = vl;
	c.q = q;
	c.k = k;
	c.v = v;
	c.o = o;
	c.p = &p;
	if (p.H * p.Lq == 0 || (ret = vcall_alloc(&c))) {
		ape__problem_fini(&p);
		return ret; /* 0: nothing to compute, nothing to write */
	}
	if (one_run(&c, &p, stats, t0, &ret))
		goto out;
	/* the pieces: each sequence's dense calls into the staging, published on success */
	if (!c.so.data && (ret = stage_o(&c)))
		goto out;
	for (int64_t s = 0; s < vl->num_seqs && !ret; s++) {
		const int64_t q1 = vl->cu_seqlens_q[s + 1];

		if (vl->cu_seqlens_k[s] == vl->cu_seqlens_k[s + 1])
			continue; /* no keys: zeros and -inf */
		for (int64_t a = vl->cu_seqlens_q[s], b; a < q1 && !ret; a = b) {
			b = ape__varlen_run_end(vl, true, s, a, q1);
			ret = query_run(&c, s, a, b);
		}
	}
out:
	if (!ret)
		publish(&c, o, lse);
	if (!c.rep_done)
		ape__varlen_report(fn, devs, ndev, &p, ret, stats, &c.st, c.have_st, t0);
	vcall_free(&c);
	ape__problem_fini(&p);
	return ret;
}

int ape_attention_forward_varlen_ex(ape_device *const *devs, int ndev,
				    const ape_exec_options *opts, const ape_attn_desc *desc,
				    const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				    const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats)
{
	APE__API_CALL("ape_attention_forward_varlen_ex");
	return ape__attention_forward_varlen("ape_attention_forward_varlen_ex", devs, ndev, opts,
					     desc, vl, q, k, v, o, lse, stats);
}

int ape_attention_forward_varlen(ape_device *dev, const ape_attn_desc *desc,
				 const ape_varlen *vl, const ape_tensor *q, const ape_tensor *k,
				 const ape_tensor *v, ape_tensor *o, float *lse, ape_stats *stats)
{
	APE__API_CALL("ape_attention_forward_varlen");
	static const char fn[] = "ape_attention_forward_varlen";

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	return ape__attention_forward_varlen(fn, &dev, 1, NULL, desc, vl, q, k, v, o, lse, stats);
}
