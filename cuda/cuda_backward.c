/* SPDX-License-Identifier: MIT */
/*
 * One backward launch (core/backend.h, struct ape_be_bwd_launch) on the queue's stream, in the
 * order of cuda/kernels/backward.cu: the row table (ape_bwd_rows), the fused sweep (dK and dV,
 * and per split of the key tiles the partial dQ, alpha path and row parameter sums), the
 * reduction of the splits in split order (ape_bwd_reduce: dQ and the per-block parameter sums;
 * only when dQ or dparams is wanted) and the per-head float64 reduction of those sums
 * (ape_bwd_params; only with dparams), then the distance-bias table's gradient (ape_bwd_dbias;
 * only with dbias). Frozen Q, K, V with only dparams wanted ("tune APE only") runs the same
 * kernels with the dK, dV and dQ work left out; likewise with only dbias wanted. A ragged launch
 * (ABI 1.2: f.segs, B = 1, disjoint key ranges) runs the same kernels once for all its
 * segments, over a segment table (kernels/bwd_args.h, APE_BW_SEGW; upload_segs()): each
 * segment's keys in key tiles of their own, the per-distance dS sums per segment; a dense launch
 * is the one segment with no table.
 *
 * Scratch, one stream-ordered allocation freed in stream order after the last kernel: the row
 * table (24 bytes per query row), the splits' slices (with dQ, nsplit * Lq * D floats; with dQ
 * or dparams, nsplit * Lq * APE_BW_RP_N doubles, per (batch, head); nsplit <=
 * APE_BW_SPLITS_MAX), the per-block parameter sums (32 bytes per block of APE_BW_RED_ROWS query
 * rows, with dparams only), the splits' per-distance dS sums (with dbias only, nsplit * (Lq + Lk
 * - 1) doubles per (batch, head); ragged: the segments' lq + lk - 1 each, at most that), the
 * distance-bias table (with one: its float entries, uploaded per launch from the core's host
 * copy), a ragged launch's segment table (56 bytes per segment) and, past APE_CU_INLINE_HEADS
 * heads, their parameters: O(nsplit * Lq * D), never O(Lq * Lk). bwd_scratch_size() sizes it,
 * for the launch and for attention_backward_scratch (core/backend.h; for a ragged call, with
 * f.nseg the bound of its segments), which the core counts against the budget of streamed
 * calls.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "cu.h"
#include "kernels/bwd_args.h"

/* Head-size variants, as the forward's (cuda_attention.c): D = 64 and 128 specialised, every
 * other even D up to 128 and up to 256 generic. */
static int bwd_variant(int64_t D, int *dmax)
{
	const int v = D == 64 ? APE__CU_V_D64 : D == 128 ? APE__CU_V_D128 : D <= 128 ? APE__CU_V_G128
											: APE__CU_V_G256;

	*dmax = v == APE__CU_V_D64 ? 64 : v == APE__CU_V_G256 ? 256 : 128;
	return v;
}

static int bwd_check(const struct ape_device *dev, const struct ape_be_bwd_launch *l)
{
	const struct ape_be_launch *f = &l->f;

	if (f->D < 2 || f->D > 256 || f->D % 2 || f->B < 1 || f->H < 1 || f->Hkv < 1 ||
	    f->H % f->Hkv || f->Lq < 0 || f->Lk < 0 || (unsigned)f->in_dtype > APE_BF16 ||
	    (f->out_dtype != f->in_dtype && f->out_dtype != APE_F32) ||
	    (l->dout_dtype != f->in_dtype && l->dout_dtype != APE_F32) || !f->lse || !f->o ||
	    !l->dout)
		return ape_be_error(APE_EINVAL,
				  "cuda %s: backward launch B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld "
				  "D=%lld (or its types, or a missing o, lse or dout) is not one the "
				  "kernels take",
				  dev->info.name, (long long)f->B, (long long)f->H, (long long)f->Hkv,
				  (long long)f->Lq, (long long)f->Lk, (long long)f->D);
	if (f->segs && (f->B != 1 || f->nseg < 1))
		return ape_be_error(APE_EINVAL,
				  "cuda %s: a ragged backward launch of B=%lld, %lld segments: it "
				  "takes B = 1 and at least one segment",
				  dev->info.name, (long long)f->B, (long long)f->nseg);
	if (f->Lq > INT32_MAX || f->Lk > INT32_MAX || f->B * f->H > INT32_MAX)
		return ape_be_error(APE_EINVAL,
				  "cuda %s: Lq=%lld, Lk=%lld: more rows than one launch takes "
				  "(2^31 - 1); use smaller chunks",
				  dev->info.name, (long long)f->Lq, (long long)f->Lk);
	return 0;
}

/* Key tiles of the fused sweep over Lk keys. */
static int64_t bwd_key_tiles(int64_t Lk, int dmax)
{
	return (Lk + APE_BW_ROWS(dmax) - 1) / APE_BW_ROWS(dmax);
}

/* Blocks of ape_bwd_reduce over Lq query rows. */
static int64_t bwd_row_blocks(int64_t Lq)
{
	return (Lq + APE_BW_RED_ROWS - 1) / APE_BW_RED_ROWS;
}

/*
 * The fused sweep's key tiles per (batch, kv head), *nkt, and the per-distance dS sums of a
 * (split, batch, head), *nd (kernels/bwd_args.h): dense, ceil(Lk / kblk) and Lq + Lk - 1; a
 * ragged launch (f->segs), its segments' ceil(lk / kblk) and lq + lk - 1 (those with keys); in
 * what attention_backward_scratch is asked for a ragged call (segs NULL, nseg its bound), their
 * bounds: at most one partial tile per segment, and sum (lq + lk - 1) <= Lq + Lk - 1.
 */
static void bwd_tiles(const struct ape_be_launch *f, int dmax, int64_t *nkt, int64_t *nd)
{
	*nkt = bwd_key_tiles(f->Lk, dmax);
	*nd = f->Lq + f->Lk - 1;
	if (!f->segs) {
		if (f->nseg > 0)
			*nkt += f->nseg;
		return;
	}
	*nkt = *nd = 0;
	for (int64_t e = 0; e < f->nseg; e++) {
		const struct ape_be_seg *g = &f->segs[e];

		*nkt += bwd_key_tiles(g->lk, dmax);
		*nd += g->lk > 0 ? g->lq + g->lk - 1 : 0;
	}
}

/* Is f ragged: its segments given, or (attention_backward_scratch) bounded */
static bool bwd_ragged(const struct ape_be_launch *f)
{
	return f->segs || f->nseg > 0;
}

/* Splits of each (batch, kv head)'s key tiles in the fused sweep: enough blocks for about four
 * per multiprocessor, at most one per key tile and at most APE_BW_SPLITS_MAX (each split has its
 * own slices: nsplit (Lq D floats + APE_BW_RP_N Lq doubles) per (batch, head)). The same device
 * and shape always give the same count, so the same sums, whatever outputs are wanted. */
static int bwd_nsplit(const struct ape_device *dev, const struct ape_be_launch *f)
{
	const int64_t cu = dev->info.compute_units > 0 ? dev->info.compute_units : 1;
	const int64_t bkv = f->B * f->Hkv > 0 ? f->B * f->Hkv : 1;
	int64_t n = (4 * cu + bkv - 1) / bkv, nkt, nd;
	int dmax;

	bwd_variant(f->D, &dmax);
	bwd_tiles(f, dmax, &nkt, &nd);
	if (n > APE_BW_SPLITS_MAX)
		n = APE_BW_SPLITS_MAX;
	if (n > nkt)
		n = nkt;
	return n > 0 ? (int)n : 1;
}

static uint64_t ptr_of(const struct ape_be_buf *b)
{
	return b ? (uint64_t)b->ptr : 0;
}

/*
 * The entries of each row of the distance-bias table's gradient that some pair of launch f
 * reaches, *m0 .. *m0 + *nm - 1 (ape_bwd_dbias's blocks per row): the table entries of the
 * launch's distances |n|, n from rel - (Lk - 1) to rel + Lq - 1 (ragged: of each segment with
 * keys, its lq, lk and rel).
 */
static void dbias_entries(const struct ape_be_launch *f, int64_t *m0, int64_t *nm)
{
	int64_t lo = INT64_MAX, hi = 0;

	for (int64_t e = 0; e < (f->segs ? f->nseg : 1); e++) {
		const int64_t lq = f->segs ? f->segs[e].lq : f->Lq;
		const int64_t lk = f->segs ? f->segs[e].lk : f->Lk;
		const int64_t rel = f->segs ? f->segs[e].q_start - f->segs[e].k_start
					    : f->q_start - f->k_start;
		/* real pairs' distances: they fit */
		const int64_t nmin = rel - (lk - 1), nmax = rel + (lq - 1);
		const int64_t a = ape_abs_dist(nmin), b = ape_abs_dist(nmax);

		if (lk < 1 || lq < 1)
			continue;
		if (ape_min_abs(nmin, nmax) < lo)
			lo = ape_min_abs(nmin, nmax);
		if ((a > b ? a : b) > hi)
			hi = a > b ? a : b;
	}
	if (lo > hi) { /* no pair (not launched: bwd_scratch_size() is 0 without keys) */
		*m0 = *nm = 0;
		return;
	}
	*m0 = ape_bias_index(lo, f->bias_len);
	*nm = ape_bias_index(hi, f->bias_len) - *m0 + 1;
}

/* The arguments every backward kernel takes, scratch offsets aside. */
static void bwd_args(const struct ape_be_bwd_launch *l, int dmax, int nsplit,
		     struct ape_cu_bwd_args *a)
{
	const struct ape_be_launch *f = &l->f;

	*a = (struct ape_cu_bwd_args){
		.q = ptr_of(f->q), .k = ptr_of(f->k), .v = ptr_of(f->v), .o = ptr_of(f->o),
		.lse = ptr_of(f->lse), .dout = ptr_of(l->dout), .dlse = ptr_of(l->dlse),
		.dq = ptr_of(l->dq), .dk = ptr_of(l->dk), .dv = ptr_of(l->dv),
		.dparams = ptr_of(l->dparams), .dbias = ptr_of(l->dbias),
		.Lq = f->Lq, .Lk = f->Lk, .rel = f->segs ? 0 : f->q_start - f->k_start,
		.nqt = bwd_row_blocks(f->Lq), .nseg = f->segs ? f->nseg : 0,
		.scale = f->scale,
		.B = (int32_t)f->B, .H = (int32_t)f->H, .Hkv = (int32_t)f->Hkv, .D = (int32_t)f->D,
		.dt_in = (int32_t)f->in_dtype, .dt_out = (int32_t)f->out_dtype,
		.dt_do = (int32_t)l->dout_dtype,
		.flags = (f->causal ? APE_CU_F_CAUSAL : 0) |
			 (f->layout == APE_ROPE_INTERLEAVED ? APE_CU_F_INTERLEAVED : 0) |
			 (l->dlse ? APE_BW_F_DLSE : 0) | (l->dq ? APE_BW_F_DQ : 0) |
			 (l->dk ? APE_BW_F_DK : 0) | (l->dv ? APE_BW_F_DV : 0) |
			 (l->dparams ? APE_BW_F_DP : 0) | (l->dbias ? APE_BW_F_DB : 0),
		.nsplit = nsplit, .kblk = APE_BW_ROWS(dmax),
	};
	bwd_tiles(f, dmax, &a->nkt, &a->nd);
	if (l->dbias) {
		dbias_entries(f, &a->db_m0, &a->db_nm);
		a->db_len = f->bias_len;
	}
	memcpy(a->omega, f->omega, (size_t)(f->D / 2) * sizeof(double));
	if (f->H <= APE_CU_INLINE_HEADS)
		memcpy(a->hp, f->head_params, (size_t)f->H * 4 * sizeof(float));
}

static size_t align256(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

atomic_uint_fast64_t ape__cu_bwd_scratch_high;

/* Where the pieces of a launch's scratch lie: the row table at 0, the splits' dQ slices at
 * dqp_off (with dQ), their row sums at rp_off (with dQ or dparams), the block sums at part_off
 * (with dparams), the splits' per-distance dS sums at dbp_off (with dbias), the distance-bias
 * table at bias_off (with one), a ragged launch's segment table at seg_off, the heads'
 * parameters at hp_off (0: inline in the arguments). */
struct bwd_scratch {
	size_t dqp_off, rp_off, part_off, dbp_off, bias_off, seg_off, hp_off, total;
	int64_t tlen; /* the distance-bias table's entries per row uploaded */
};

/*
 * The one sizing of a launch's scratch, for the launch and for attention_backward_scratch:
 * fills s, returns s->total. parts: APE_BE_BWD_* bits; nsplit: bwd_nsplit()'s; positions: f's
 * positions are the launch's (the table's entries it reads), not attention_backward_scratch's
 * shape alone (every entry). A launch with nothing to do allocates nothing (total 0).
 */
static size_t bwd_scratch_size(const struct ape_be_launch *f, unsigned parts, int nsplit,
			       bool positions, struct bwd_scratch *s)
{
	const unsigned outs = APE_BE_BWD_DQ | APE_BE_BWD_DK | APE_BE_BWD_DV | APE_BE_BWD_DPARAMS |
			      APE_BE_BWD_DBIAS;
	const size_t bh = (size_t)(f->B * f->H), rows = bh * (size_t)f->Lq;
	int64_t nkt, nd;
	int dmax;

	memset(s, 0, sizeof(*s));
	if (!(parts & outs) || rows == 0 || f->Lk == 0)
		return 0;
	bwd_variant(f->D, &dmax);
	bwd_tiles(f, dmax, &nkt, &nd);
	s->dqp_off = align256(rows * APE_BW_RI_N * sizeof(double));
	s->rp_off = s->dqp_off;
	if (parts & APE_BE_BWD_DQ)
		s->rp_off += align256((size_t)nsplit * rows * (size_t)f->D * sizeof(float));
	s->part_off = s->rp_off;
	if (parts & (APE_BE_BWD_DQ | APE_BE_BWD_DPARAMS))
		s->part_off += align256((size_t)nsplit * rows * APE_BW_RP_N * sizeof(double));
	s->dbp_off = s->part_off;
	if (parts & APE_BE_BWD_DPARAMS)
		s->dbp_off += align256(bh * (size_t)bwd_row_blocks(f->Lq) * 4 * sizeof(double));
	s->bias_off = s->dbp_off;
	if (parts & APE_BE_BWD_DBIAS)
		s->bias_off += align256((size_t)nsplit * bh * (size_t)nd * sizeof(double));
	s->seg_off = s->bias_off;
	if (f->bias_table) { /* the entries it reads (nothing skips: no suffix maxima) */
		s->tlen = ape__cu_bias_entries(f, positions);
		s->seg_off += align256(ape__cu_bias_bytes(f, s->tlen, false));
	}
	s->hp_off = s->seg_off;
	if (bwd_ragged(f))
		s->hp_off += align256((size_t)f->nseg * APE_BW_SEGW * sizeof(int64_t));
	s->total = s->hp_off + (f->H > APE_CU_INLINE_HEADS ? (size_t)f->H * 4 * sizeof(float) : 0);
	if (f->H <= APE_CU_INLINE_HEADS)
		s->hp_off = 0;
	return s->total;
}

/* A ragged launch's segment table (kernels/bwd_args.h, APE_BW_SEGW) to dst, kblk keys a tile. */
static int upload_segs(struct ape_be_queue *q, const struct ape_be_launch *f, int64_t kblk,
		       CUdeviceptr dst)
{
	const size_t bytes = (size_t)f->nseg * APE_BW_SEGW * sizeof(int64_t);
	int64_t *t = ape_be_malloc(bytes), kt0 = 0, db0 = 0;

	if (!t)
		return ape_be_error(APE_ENOMEM, "out of host memory for a table of %lld segments",
				    (long long)f->nseg);
	for (int64_t e = 0; e < f->nseg; e++) {
		const struct ape_be_seg *g = &f->segs[e];
		int64_t *r = t + e * APE_BW_SEGW;

		r[APE_BW_SEG_Q0] = g->q0;
		r[APE_BW_SEG_LQ] = g->lq;
		r[APE_BW_SEG_K0] = g->k0;
		r[APE_BW_SEG_LK] = g->lk;
		r[APE_BW_SEG_REL] = g->lk > 0 ? g->q_start - g->k_start : 0;
		r[APE_BW_SEG_KT0] = kt0;
		r[APE_BW_SEG_DB0] = db0;
		kt0 += (g->lk + kblk - 1) / kblk;
		db0 += g->lk > 0 ? g->lq + g->lk - 1 : 0;
	}
	return ape__cu_upload_owned(q, dst, t, bytes, "backward segment table");
}

/* The kernels, in order, on the queue; the scratch's pieces at s's offsets. */
static int bwd_run(struct ape_be_queue *q, const struct ape_be_bwd_launch *l, int variant, int dmax,
		   struct ape_cu_bwd_args *a, CUdeviceptr scratch, const struct bwd_scratch *s)
{
	const struct ape_be_launch *f = &l->f;
	const int64_t rows = f->B * f->H * f->Lq;
	int ret = 0;

	a->rinfo = scratch;
	a->part = l->dparams ? scratch + s->part_off : 0;
	a->dqp = l->dq ? scratch + s->dqp_off : 0;
	a->rp = l->dq || l->dparams ? scratch + s->rp_off : 0;
	a->hparams = s->hp_off ? ape__cu_head_params_at(f, scratch + s->hp_off) : 0;
	a->dbp = l->dbias ? scratch + s->dbp_off : 0;
	a->segt = f->segs ? scratch + s->seg_off : 0;
	if (f->bias_table)
		a->bias = ape__cu_bias_at(f, s->tlen, false, scratch + s->bias_off);
	if (s->hp_off && !f->params[1])
		ret = ape__cu_upload_head_params(q, f, scratch + s->hp_off);
	if (!ret && f->bias_table)
		ret = ape__cu_upload_bias(q, f, s->tlen, false, scratch + s->bias_off);
	if (!ret && f->segs)
		ret = upload_segs(q, f, a->kblk, scratch + s->seg_off);
	if (!ret)
		ret = ape__cu_launch(q, APE__CU_K_BWD_ROWS,
				     (rows + APE_BW_ROWS_PER_BLOCK - 1) / APE_BW_ROWS_PER_BLOCK, 0, a,
				     "ape_bwd_rows");
	if (!ret)
		ret = ape__cu_launch(q, APE__CU_K_BWD_FUSED + variant,
				     (int64_t)a->nsplit * f->B * f->Hkv, APE_BW_SMEM(dmax), a,
				     "backward fused sweep");
	if (!ret && (l->dq || l->dparams))
		ret = ape__cu_launch(q, APE__CU_K_BWD_REDUCE, a->nqt * f->B * f->H, APE_BW_RED_SMEM,
				     a, "ape_bwd_reduce");
	if (!ret && l->dparams)
		ret = ape__cu_launch(q, APE__CU_K_BWD_PARAMS,
				     (f->H + APE_CU_THREADS - 1) / APE_CU_THREADS, 0, a,
				     "ape_bwd_params");
	if (!ret && l->dbias && a->db_nm) /* (0: a ragged launch whose segments have no key) */
		ret = ape__cu_launch(q, APE__CU_K_BWD_DBIAS,
				     (f->bias_hstride ? f->H : 1) * a->db_nm, APE_BW_DB_SMEM, a,
				     "ape_bwd_dbias");
	return ret;
}

uint64_t ape__cu_attention_backward_scratch(struct ape_device *dev,
					    const struct ape_be_bwd_launch *l, unsigned parts)
{
	struct bwd_scratch s;

	return bwd_scratch_size(&l->f, parts, bwd_nsplit(dev, &l->f), false, &s);
}

int ape__cu_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	const struct ape_be_launch *f = &l->f;
	struct ape_cu_bwd_args a;
	struct bwd_scratch s;
	CUdeviceptr scratch = 0;
	uint_fast64_t high;
	int variant, dmax, nsplit, ret, ret2;

	ret = bwd_check(q->dev, l);
	if (ret)
		return ret;
	nsplit = bwd_nsplit(q->dev, f);
	if (!bwd_scratch_size(f, ape_be_bwd_parts(l), nsplit, true, &s))
		return 0; /* no row sees a key, or nothing wanted: nothing to add */
	variant = bwd_variant(f->D, &dmax);
	bwd_args(l, dmax, nsplit, &a);
	ape_be_path_note(f->path, APE_BE_PATH_BACKWARD, "the fused sweep, keys outer");

	ret = ape__cu_enter(q->dev);
	if (ret)
		return ret;
	ret = ape__cu_module(q->dev);
	if (!ret)
		ret = ape__cu_scratch_alloc(q, s.total, &scratch);
	if (ret)
		goto out_leave;
	/* what this launch allocated, for the tests' comparison with the declared figure */
	high = atomic_load(&ape__cu_bwd_scratch_high);
	while (s.total > high &&
	       !atomic_compare_exchange_weak(&ape__cu_bwd_scratch_high, &high, s.total))
		;
	ret = bwd_run(q, l, variant, dmax, &a, scratch, &s);
	ret2 = ape__cu_scratch_free(q, scratch);
	ret = ret ? ret : ret2;
out_leave:
	ape__cu_leave(q->dev);
	return ret;
}

/* ------------------------------------------------------------------ the caller's memory */

/* Queue-ordered buffers (core/backend.h, ABI 10): the launches' own stream-ordered scratch. */
int ape__cu_scratch_buf_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out)
{
	struct ape_be_buf *b = ape_be_calloc(1, sizeof(*b));
	int ret;

	*out = NULL;
	if (!b)
		return ape_be_error(APE_ENOMEM, "out of host memory for a buffer");
	ret = ape__cu_enter(q->dev);
	if (!ret) {
		ret = ape__cu_scratch_alloc(q, bytes, &b->ptr);
		ape__cu_leave(q->dev);
	}
	if (ret) {
		free(b);
		return ret;
	}
	b->size = bytes;
	*out = b;
	return 0;
}

int ape__cu_scratch_buf_free(struct ape_be_queue *q, struct ape_be_buf *buf)
{
	int ret;

	if (!buf)
		return 0;
	ret = ape__cu_enter(q->dev);
	if (!ret) {
		ret = ape__cu_scratch_free(q, buf->ptr);
		ape__cu_leave(q->dev);
	}
	free(buf);
	return ret;
}

int ape__cu_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c)
{
	const struct ape_cu_copy_args a = {
		.dst = c->dst->ptr, .src = c->src->ptr,
		.doff = c->dv.off, .dsb = c->dv.sb, .dsh = c->dv.sh, .dsl = c->dv.sl,
		.soff = c->sv.off, .ssb = c->sv.sb, .ssh = c->sv.sh, .ssl = c->sv.sl,
		.H = c->H, .L = c->L, .D = c->D, .n = c->B * c->H * c->L * c->D,
		.dt_dst = c->dst_type, .dt_src = c->src_type,
	};

	return ape__cu_run_threads(q, APE__CU_K_COPY_VIEW, a.n, (void *)&a, "copy_view");
}
