/* SPDX-License-Identifier: MIT */
/*
 * One backward launch (core/backend.h, struct ape_be_bwd_launch): the pre-passes (Q with dO and
 * K with V as float32 rows, the per-distance table, the per-row table), the fused sweep (dK,
 * dV, and per split of the key blocks the partial dQ, alpha path and per-row parameter sums),
 * the reduction of the splits in split order (dQ, per-row parameter sums) and the per-head
 * float64 reduction of those sums, then for a distance-bias table's gradient its two
 * reductions (bwd_dbias()), all in kernels/backward.cl, in that order on the launch's queue.
 * The sweep computes only the wanted outputs; the reductions run only for dQ, dparams or dbias.
 * A distance-bias table (struct ape_be_launch.bias_table) enters the per-distance table's bias
 * term, so that it costs the sweep nothing per pair, and its suffix maxima the skip bound.
 * Where every head has lambda = 0 (bwd_separable()) the separable sweep, ape_bwd_sep, runs
 * instead of ape_bwd_fused, on Q and K rotated once by their positions (the rows kernel and
 * K's prep); the other kernels are the same. A ragged launch (ABI 1.2, f.segs) runs the same
 * kernels once for all its segments, on its segment tables (bwd_space(), bwd_tables(),
 * docs/kernels.md "The backward kernels"); one of short segments only (bwd_short()) runs
 * ape_bwd_short (or _sep) instead of the preps, the rows kernel, the sweep and the reduction,
 * each segment whole in one work-item's small slots (bwd_short_run()).
 *
 * Scratch, released right after it is enqueued (the commands keep it alive), like the
 * forward's: the parameters, float32 copies of Q+dO and K+V (Q's rows padded to whole row
 * vectors), the row table (RI_N APE_REAL per query row), the per-row steps (2 floats per pair
 * and row), the distance table (TB_N per head and distance, H (Lq + Lk - 1)), the per-row
 * parameter sums (4 per row, with dparams only), the sweep's per-split partials (nsplit slices
 * of Lq D floats for dQ and of RP_N APE_REAL per row for the rows' sums, nsplit <=
 * BWD_SPLITS_MAX), with skipping one key norm per (batch, kv head), with a table its rows (and
 * with skipping their suffix maxima) as far as the launch's distances reach, and for its
 * gradient the sweep's dS sums by distance (nsplit slices of B H (Lq + Lk - 1) APE_REAL) and
 * their sum per table row, and for a ragged launch its segment tables (kernels/bwd_layout.h):
 * the size of the inputs, never O(Lq * Lk). bwd_scratch_size() sizes every buffer;
 * APE_REAL is float64 with cl_khr_fp64, float32 without (ocl_program.c), and the sums (the
 * per-row parameter sums, the split slices of the rows' sums and of dS by distance, and their
 * sum per table row) take 8 bytes either way: a float64, or a compensated float32 pair
 * (kernels/backward.cl, BSUM), whose per-head and per-entry totals the host finishes in
 * float64 (bwd_host_add()). The launch allocates exactly those sizes, and
 * attention_backward_scratch reports their sum (core/backend.h), which the core counts against
 * the budget of streamed calls.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "kernels/bwd_layout.h"
#include "ocl.h"

/* Keys per block of the fused sweep, as kernels/backward.cl's BWD_KT for the program variant
 * of D (ocl_program.c: 64 and 128 specialised, every other D up to 256 generic) */
static size_t bwd_kt(int64_t D)
{
	return D == 64 || D == 128 ? 16 : 8;
}

/* Splits of each (batch, kv head)'s nkb key blocks in the fused sweep: enough work-items for about
 * four per compute unit, at most one per key block and at most BWD_SPLITS_MAX (each split has
 * its own slice of the dQ and row-sum partials: nsplit (Lq D floats + 5 Lq APE_REAL) per
 * (batch, head)). The same device and shape always give the same count, so the same sums. */
#define BWD_SPLITS_MAX 8

static size_t bwd_nsplit(const struct ape_device *dev, const struct ape_be_launch *f, size_t nkb)
{
	const size_t cu = dev->info.compute_units > 0 ? (size_t)dev->info.compute_units : 1;
	const size_t bkv = (size_t)(f->B * f->Hkv) > 0 ? (size_t)(f->B * f->Hkv) : 1;
	size_t n = (4 * cu + bkv - 1) / bkv;

	if (n > BWD_SPLITS_MAX)
		n = BWD_SPLITS_MAX;
	if (n > nkb)
		n = nkb;
	return n > 0 ? n : 1;
}

/* Work-items per work-group of the pre-passes: whole groups, the excess returns at once. */
#define BWD_LOCAL 16

/* The largest APE_RW a program takes (ocl_program.c: 1, 2, 4, 8 or 16). No size of
 * bwd_scratch_size() shrinks as rw grows (a multiple of 16 is one of 8, of 4, ...), so the
 * figure declared without the program at hand, sized with this, bounds every launch's. */
#define BWD_RW_MAX 16

atomic_uint_fast64_t ape__ocl_bwd_scratch_high;

static size_t round_up(size_t n, size_t m)
{
	return (n + m - 1) / m * m;
}

/* The bytes of each scratch buffer of one launch (0: not allocated). */
struct bwd_scratch {
	size_t prm, kmax, rinfo, step, tab, part, qp, kp, dqp, rp, bt, bsm, dbp, dbd, sg, rvs, kbs;
};

/*
 * The row and key spaces of a launch (kernels/bwd_layout.h, SG_*) and its distance table's
 * range: a dense launch's, a ragged launch's from its segments, or (f.segs NULL, f.nseg >= 1:
 * what attention_backward_scratch is asked for a ragged call) a bound on those of any launch of
 * up to nseg segments. A ragged launch's distance range is the hull of its segments' (those with
 * keys), at most Lq + Lk - 1 long (ape__ocl_attention_backward() splits a launch whose hull is
 * longer), so that the bound is the dense figure.
 */
struct bwd_space {
	size_t qrows; /* query rows per (batch, head), padded to row vectors per segment */
	size_t nkb; /* key blocks per (batch, kv head) */
	size_t nkp; /* prepared keys per (batch, kv head): Lk, or a ragged launch's blocks' */
	int64_t nmin, ndist; /* the distances nmin .. nmin + ndist - 1 (ndist 0: no key) */
	size_t nseg, nrv; /* a ragged launch's table: segments, row vectors (0: dense) */
	bool bound; /* the bound for up to nseg segments */
};

static bool bwd_ragged(const struct ape_be_launch *f)
{
	return f->segs || f->nseg >= 1;
}

static void bwd_space(const struct ape_be_launch *f, size_t rw, struct bwd_space *sp)
{
	const size_t kt = bwd_kt(f->D), Lq = (size_t)f->Lq, Lk = (size_t)f->Lk;
	int64_t nmax = INT64_MIN;

	memset(sp, 0, sizeof(*sp));
	sp->nmin = INT64_MAX;
	if (!bwd_ragged(f)) {
		sp->qrows = round_up(Lq, rw); /* whole row vectors */
		sp->nkb = (Lk + kt - 1) / kt;
		sp->nkp = Lk;
		sp->nmin = ape_sat_sub(f->q_start - f->k_start, f->Lk - 1);
		sp->ndist = f->Lq + f->Lk - 1;
		return;
	}
	sp->nseg = (size_t)f->nseg;
	if (!f->segs) { /* each segment adds at most rw - 1 rows of padding and one key block */
		sp->bound = true;
		sp->qrows = round_up(Lq + sp->nseg * (rw - 1), rw);
		sp->nkb = (Lk + kt - 1) / kt + sp->nseg;
		sp->nkp = Lk + sp->nseg * (kt - 1); /* the segments' keys are disjoint */
		sp->nrv = Lq; /* at rw = 1 */
		sp->ndist = f->Lq + f->Lk - 1;
		return;
	}
	for (size_t s = 0; s < sp->nseg; s++) {
		const struct ape_be_seg *g = &f->segs[s];
		const int64_t rel = g->q_start - g->k_start;

		sp->nrv += ((size_t)g->lq + rw - 1) / rw;
		sp->nkb += ((size_t)g->lk + kt - 1) / kt;
		if (g->lk > 0) {
			sp->nmin = rel - (g->lk - 1) < sp->nmin ? rel - (g->lk - 1) : sp->nmin;
			nmax = rel + g->lq - 1 > nmax ? rel + g->lq - 1 : nmax;
		}
	}
	sp->qrows = sp->nrv * rw;
	sp->nkp = sp->nkb * kt;
	sp->ndist = nmax >= sp->nmin ? nmax - sp->nmin + 1 : 0;
	if (!sp->ndist)
		sp->nmin = 0;
}

/* The smallest and the largest |n| over the distances nmin .. nmin + ndist - 1 */
static void bwd_abs_range(int64_t nmin, int64_t ndist, int64_t *near, int64_t *far)
{
	const int64_t lo = nmin, hi = ape_sat_add(nmin, ndist - 1);

	*near = ape_min_abs(lo, hi);
	*far = ape_abs_dist(lo) > ape_abs_dist(hi) ? ape_abs_dist(lo) : ape_abs_dist(hi);
}

/*
 * The separable sweep (kernels/backward.cl, ape_bwd_sep): every head of the launch has lambda =
 * 0 exactly, so that Q and K are rotated once by their positions and the sweep turns nothing.
 * APE_OCL_BWD_SEP=0 in the environment keeps such launches on the general sweep (for
 * comparisons: docs/kernels.md). One home for the rule: the scratch's sizing and the launch.
 */
static bool bwd_separable(const struct ape_be_launch *f)
{
	const char *e = getenv("APE_OCL_BWD_SEP");

	if (e && !strcmp(e, "0"))
		return false;
	for (int64_t h = 0; h < f->H; h++)
		if (f->head_params[4 * h + 3] != 0)
			return false;
	return true;
}

/*
 * The short-segment kernel (kernels/backward.cl, ape_bwd_short): a ragged launch whose every
 * segment has at most BWD_SHORT_ROWS rows and BWD_SHORT_KEYS keys runs in one kernel that
 * prepares, sweeps and reduces each segment whole in its work-item's own small slots, instead of
 * the prep, rows, sweep and reduce kernels over launch-sized scratch (many short documents: with
 * 16-token segments the scratch's fresh pages and the passes over it cost more than the sweep).
 * Returns the row vectors of rw rows of the launch's largest segment (each work-item's slot per
 * query head), or 0: the general kernels (a dense launch, a long segment, or APE_OCL_BWD_SHORT=0
 * in the environment, for comparisons: docs/kernels.md).
 */
#define BWD_SHORT_ROWS 64
#define BWD_SHORT_KEYS 64
/* its note in the call's paths (the tests look for it) */
#define BWD_SHORT_WHY "short segments: each whole in one work-item (ape_bwd_short)"

static size_t bwd_short(const struct ape_be_launch *f, size_t rw)
{
	const char *e = getenv("APE_OCL_BWD_SHORT");
	size_t m = 1;

	if (!f->segs || (e && !strcmp(e, "0")))
		return 0;
	for (int64_t s = 0; s < f->nseg; s++) {
		const struct ape_be_seg *g = &f->segs[s];
		const size_t rv = ((size_t)g->lq + rw - 1) / rw;

		if (g->lq > BWD_SHORT_ROWS || g->lk > BWD_SHORT_KEYS)
			return 0;
		m = rv > m ? rv : m;
	}
	return m;
}

/* Rows of the table's gradient: one per head, or one shared */
static int64_t bwd_table_rows(const struct ape_be_launch *f)
{
	return f->bias_hstride ? f->H : 1;
}

/*
 * The one sizing of a launch's scratch, for the launch (rw of its program) and for
 * attention_backward_scratch (BWD_RW_MAX): fills s and returns the sum. parts: APE_BE_BWD_* bits.
 * A launch with nothing to do allocates nothing. srv: 0, or ape_bwd_short's slot row vectors per
 * query head (bwd_short()): then the prepared rows, their tables and the partials are one slot
 * per work-item (nsplit per (batch, kv head)) and query head of srv row vectors, the prepared keys
 * one key block per work-item, one slice of the partials; no skipping.
 */
static uint64_t bwd_scratch_size(const struct ape_be_launch *f, unsigned parts, size_t rw,
				 const struct bwd_space *sp, size_t nsplit, size_t real, size_t srv,
				 struct bwd_scratch *s)
{
	const unsigned outs = APE_BE_BWD_DQ | APE_BE_BWD_DK | APE_BE_BWD_DV | APE_BE_BWD_DPARAMS |
			      APE_BE_BWD_DBIAS;
	const size_t bh = (size_t)(f->B * f->H), bkv = (size_t)(f->B * f->Hkv);
	const size_t ndist = (size_t)sp->ndist;
	const size_t npad = round_up((size_t)f->D / 2, rw), dpad = round_up((size_t)f->D, rw);
	/* whole row vectors (per segment); ape_bwd_short: its slots' */
	const size_t qrows = srv ? nsplit * srv * rw : sp->qrows;
	const size_t nkp = srv ? nsplit * bwd_kt(f->D) : sp->nkp, nsl = srv ? 1 : nsplit;

	memset(s, 0, sizeof(*s));
	if (!(parts & outs) || bh * (size_t)f->Lq == 0 || f->Lk == 0 || ndist == 0)
		return 0;
	/* a ragged launch's segments, the segment of each row vector and of each key block */
	s->sg = sp->nseg * SG_N * sizeof(int64_t);
	s->rvs = sp->nseg ? sp->nrv * sizeof(cl_int) : 0;
	s->kbs = sp->nseg ? sp->nkb * sizeof(cl_int) : 0;
	/* omega_p padded to npad, then delta, beta, gamma, lambda per head, in APE_REAL (real
	 * bytes); the sums in 8 bytes (a float64 or a compensated float32 pair) */
	s->prm = (npad + 4 * (size_t)f->H) * real;
	s->kmax = !srv && f->skip_tol > 0 && f->decay_nonneg ? bkv * sizeof(int) : 0;
	s->rinfo = bh * qrows * RI_N * real;
	/* per row vector: cos, then sin, of each pair's step */
	s->step = bh * qrows * 2 * npad * sizeof(float);
	/* a row vector's load of the last distances reaches rw - 1 past them */
	s->tab = ((size_t)f->H * ndist * TB_N + rw) * real;
	s->part = parts & APE_BE_BWD_DPARAMS ? bh * (size_t)f->Lq * 4 * sizeof(double) : 0;
	/* ape_bwd_prep's float32 rows: Q with dO in blocks of rw rows, K with V (and omega_p
	 * times K's pairs; separable: the cos and sin of each key's angles) one by one */
	s->qp = bh * qrows * (2 * npad + dpad) * sizeof(float);
	s->kp = bkv * nkp * ((bwd_separable(f) ? 6 : 4) * npad + dpad) * sizeof(float);
	/* ape_bwd_fused's per-split slices: dQ in row vectors, the rows' five sums */
	s->dqp = parts & APE_BE_BWD_DQ ? nsl * bh * qrows * (size_t)f->D * sizeof(float) : 0;
	s->rp = parts & (APE_BE_BWD_DQ | APE_BE_BWD_DPARAMS) ? nsl * bh * qrows * RP_N * sizeof(double)
							   : 0;
	if (f->bias_table) { /* the table's rows as far as the launch reads, their suffix maxima
			      * for the skip bound */
		/* (the bound: the whole table; a ragged launch's segments are not known) */
		const int64_t ent = sp->bound ? f->bias_len : ape_be_bias_entries(f);
		const size_t rows = (size_t)(bwd_table_rows(f) * ent) * sizeof(float);

		s->bt = rows;
		s->bsm = s->kmax ? rows : 0;
	}
	/* the table's gradient: per split and (batch, head) dS by distance, then per table row */
	if (f->bias_table && (parts & APE_BE_BWD_DBIAS)) {
		s->dbp = nsplit * bh * ndist * sizeof(double);
		s->dbd = (size_t)bwd_table_rows(f) * ndist * sizeof(double);
	}
	return (uint64_t)s->prm + s->kmax + s->rinfo + s->step + s->tab + s->part + s->qp + s->kp +
	       s->dqp + s->rp + s->bt + s->bsm + s->dbp + s->dbd + s->sg + s->rvs + s->kbs;
}

/*
 * A dense launch of one short problem (B = 1, at most BWD_SHORT_ROWS rows and BWD_SHORT_KEYS
 * keys: a training step of a small model, a fine-tune at L 64) as the one-segment ragged launch
 * it is (its q_start and k_start the segment's), so that ape_bwd_short takes it whole: one
 * kernel where the general path runs seven, each a hand-off to the driver's threads that costs
 * more than such a problem's pairs (bench/RESULTS.md). Anything else, or APE_OCL_BWD_SHORT=0:
 * l itself. x and one hold the copy.
 */
static const struct ape_be_bwd_launch *bwd_dense_short(const struct ape_be_bwd_launch *l,
						       struct ape_be_bwd_launch *x,
						       struct ape_be_seg *one)
{
	const struct ape_be_launch *f = &l->f;
	const char *e = getenv("APE_OCL_BWD_SHORT");

	/* bwd_ragged(): a ragged launch, or the bound asked for a ragged call (segs NULL, nseg
	 * >= 1: taken for a dense one, it declared one segment's scratch for a call of several) */
	if (bwd_ragged(f) || f->pos_q || f->B != 1 || f->Lq < 1 || f->Lq > BWD_SHORT_ROWS ||
	    f->Lk < 1 || f->Lk > BWD_SHORT_KEYS || (e && !strcmp(e, "0")))
		return l;
	*one = (struct ape_be_seg){ .q0 = 0, .lq = f->Lq, .k0 = 0, .lk = f->Lk,
				    .q_start = f->q_start, .k_start = f->k_start };
	*x = *l;
	x->f.segs = one;
	x->f.nseg = 1;
	return x;
}

uint64_t ape__ocl_attention_backward_scratch(struct ape_device *dev,
					     const struct ape_be_bwd_launch *l, unsigned parts)
{
	struct bwd_scratch s;
	struct bwd_space sp;
	struct ape_be_bwd_launch x;
	struct ape_be_seg one;

	l = bwd_dense_short(l, &x, &one); /* as the launch will run it */
	bwd_space(&l->f, BWD_RW_MAX, &sp);
	return bwd_scratch_size(&l->f, parts, BWD_RW_MAX, &sp, bwd_nsplit(dev, &l->f, sp.nkb),
				ape__ocl_real_size(ape__ocl_dev(dev)), 0, &s);
}

/* One scratch buffer of the launch, of a size bwd_scratch_size() gave, added to *held. */
static cl_mem bwd_take(struct ape_be_queue *q, size_t bytes, void *init, uint64_t *held, cl_int *err)
{
	cl_mem mem = ape__ocl_scratch(q, bytes, init, err);

	if (mem)
		*held += bytes;
	return mem;
}

/* omega_p (padded with zeros to npad, whole lane vectors), then delta, beta, gamma, lambda per
 * head, in APE_REAL (real bytes: float64, or float32 without cl_khr_fp64), in `bytes`. */
static cl_mem bwd_params(struct ape_be_queue *q, const struct ape_be_launch *f, int npad, size_t bytes,
			 size_t real, uint64_t *held, cl_int *err)
{
	const size_t n = bytes / real;
	void *host = ape_be_malloc(bytes);
	cl_mem mem;

	if (!host) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	for (size_t i = 0; i < n; i++) {
		const double v = i < (size_t)npad ? (i < (size_t)f->D / 2 ? f->omega[i] : 0.0)
						  : (double)f->head_params[i - (size_t)npad];

		if (real == sizeof(double))
			((double *)host)[i] = v;
		else
			((float *)host)[i] = (float)v;
	}
	mem = bwd_take(q, bytes, host, held, err);
	free(host);
	return mem;
}

/* Head rows of a distance-bias table (the table or its suffix maxima, rows hstride apart, 0 when
 * shared), each cut to its first bytes / (sizeof(float) rows) entries (ape_be_bias_entries()), in
 * `bytes`. */
static cl_mem bwd_table(struct ape_be_queue *q, const float *t, int64_t hstride, int64_t rows,
			size_t bytes, uint64_t *held, cl_int *err)
{
	const size_t len = bytes / sizeof(float) / (size_t)rows;
	float *host = ape_be_malloc(bytes);
	cl_mem mem;

	if (!host) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	for (int64_t r = 0; r < rows; r++)
		memcpy(host + (size_t)r * len, t + r * hstride, len * sizeof(float));
	mem = bwd_take(q, bytes, host, held, err);
	free(host);
	return mem;
}

/* `bytes` of zeros made at creation as a copy of host zeros (no command on a queue), added to
 * *held. */
static cl_mem bwd_host_zeros(const struct ape__ocl_device *od, size_t bytes, uint64_t *held,
			     cl_int *err)
{
	void *zero = ape_be_calloc(bytes, 1);
	cl_mem mem;

	if (!zero) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	mem = clCreateBuffer(od->ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes, zero, err);
	free(zero);
	if (mem)
		*held += bytes;
	return mem;
}

/* Per (batch, kv head): the largest key norm bound, as float bits, zero until ape_bwd_prep
 * raises it (an atomic max: the result does not depend on the order), in `bytes`. */
static cl_mem bwd_kmax(const struct ape__ocl_device *od, size_t bytes, uint64_t *held, cl_int *err)
{
	return bwd_host_zeros(od, bytes, held, err);
}

/* Scratch up to this size on a CPU device starts as a copy of host zeros: one command fewer
 * than a fill on the queue, which costs a wake-up of the driver's threads (a few microseconds
 * each; a backward call of a small problem ran six fills, bench/RESULTS.md). */
#define BWD_ZEROS_COPIED ((size_t)1 << 20)

/* A scratch buffer of `bytes` (bwd_scratch_size()) filled with zeros (on the queue, or copied
 * at creation on a CPU device when small), added to *held (the fused sweep's per-split
 * partials: a split adds only to the rows it visits). */
static cl_mem bwd_zeros(struct ape_be_queue *q, size_t bytes, uint64_t *held, cl_int *err)
{
	const struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const cl_uint zero = 0;
	cl_mem mem;
	cl_event ev;

	if ((od->type & CL_DEVICE_TYPE_CPU) && bytes <= BWD_ZEROS_COPIED)
		return bwd_host_zeros(od, bytes, held, err);
	mem = bwd_take(q, bytes, NULL, held, err);
	if (!mem)
		return NULL;
	*err = clEnqueueFillBuffer(q->cq, mem, &zero, sizeof(zero), 0, bytes, 0, NULL, &ev);
	if (*err == CL_SUCCESS && ape__ocl_track(q, ev) == 0)
		return mem;
	if (*err == CL_SUCCESS) /* the fill is done, but the tracking had no memory */
		*err = CL_OUT_OF_HOST_MEMORY;
	clReleaseMemObject(mem);
	*held -= bytes;
	return NULL;
}

/* Enqueues one kernel of the program with its arguments already set in a, then releases it. */
static int bwd_run(struct ape_be_queue *q, struct ape__ocl_args *a, size_t n0, size_t l0, size_t n1,
		   const char *name)
{
	int ret;

	if (a->err != CL_SUCCESS)
		ret = ape__ocl_error(a->err, "setting up %s", name);
	else
		ret = ape__ocl_enqueue(q, a->k, n0, l0, n1, name);
	if (a->k)
		clReleaseKernel(a->k);
	return ret;
}

/* The arguments the sweep takes first, in kernels/backward.cl's order (BWD_SWEEP_ARGS). */
struct bwd_sweep {
	cl_mem qp, kp, prm, rinfo, step, tab;
	cl_int npad, D, H, group, flags;
	cl_long Lq, Lk, rel;
	cl_float scale;
	cl_long nmin, ndist, nblk, nkb;
	cl_mem sg, kbs;
};

/* What every sweep kernel writes, after the sweep's arguments (BWD_OUT_ARGS): dK and dV (NULL:
 * not wanted), the per-row dQ partials and parameter sums, the splits, the row vectors, the
 * bias table's partial sums. */
struct bwd_out {
	cl_mem dk, dv, dqp, rp;
	cl_int ns;
	cl_long nrv;
	cl_mem dbp;
};

static void bwd_out_args(struct ape__ocl_args *a, const struct bwd_out *o)
{
	ape__ocl_arg(a, sizeof(cl_mem), &o->dk);
	ape__ocl_arg(a, sizeof(cl_mem), &o->dv);
	ape__ocl_arg(a, sizeof(cl_mem), &o->dqp);
	ape__ocl_arg(a, sizeof(cl_mem), &o->rp);
	ape__ocl_arg(a, sizeof(o->ns), &o->ns);
	ape__ocl_arg(a, sizeof(o->nrv), &o->nrv);
	ape__ocl_arg(a, sizeof(cl_mem), &o->dbp);
}

static void bwd_sweep_args(struct ape__ocl_args *a, const struct bwd_sweep *w)
{
	ape__ocl_arg(a, sizeof(cl_mem), &w->qp);
	ape__ocl_arg(a, sizeof(cl_mem), &w->kp);
	ape__ocl_arg(a, sizeof(cl_mem), &w->prm);
	ape__ocl_arg(a, sizeof(w->npad), &w->npad);
	ape__ocl_arg(a, sizeof(cl_mem), &w->rinfo);
	ape__ocl_arg(a, sizeof(cl_mem), &w->step);
	ape__ocl_arg(a, sizeof(cl_mem), &w->tab);
	ape__ocl_arg(a, sizeof(w->D), &w->D);
	ape__ocl_arg(a, sizeof(w->H), &w->H);
	ape__ocl_arg(a, sizeof(w->group), &w->group);
	ape__ocl_arg(a, sizeof(w->Lq), &w->Lq);
	ape__ocl_arg(a, sizeof(w->Lk), &w->Lk);
	ape__ocl_arg(a, sizeof(w->rel), &w->rel);
	ape__ocl_arg(a, sizeof(w->scale), &w->scale);
	ape__ocl_arg(a, sizeof(w->flags), &w->flags);
	ape__ocl_arg(a, sizeof(w->nmin), &w->nmin);
	ape__ocl_arg(a, sizeof(w->ndist), &w->ndist);
	ape__ocl_arg(a, sizeof(w->nblk), &w->nblk);
	ape__ocl_arg(a, sizeof(w->nkb), &w->nkb);
	ape__ocl_arg(a, sizeof(cl_mem), &w->sg);
	ape__ocl_arg(a, sizeof(cl_mem), &w->kbs);
}

/* One of ape_bwd_prep's float32 copies, of `bytes` (bwd_scratch_size()): pairs of a (first then
 * second components), then b (then, with om, omega_p times a's pairs; with rot as well, a's
 * pairs rotated by their positions, and the angles' cos and sin after), for nbh (batch, head)
 * pairs of L rows each, in blocks of `lanes` rows (kernels/backward.cl); `padded` work-items per
 * (batch, head): the rows rounded up to lanes, or in a ragged launch (sg) the padded row space
 * (map: the segment of each row vector, unit = lanes) or the key blocks (map: the segment of
 * each, unit = their keys). */
static int bwd_prep(struct ape_be_queue *q, const struct ape__ocl_program *pr, cl_mem a, cl_int dt_a,
		    cl_mem b, cl_int dt_b, size_t nbh, cl_long L, cl_int lanes, cl_int D,
		    cl_int npad, cl_int dpad, cl_int inter, size_t local, cl_mem kmax, cl_mem om,
		    cl_int rot, size_t bytes, uint64_t *held, cl_mem *out, size_t padded, cl_mem sg,
		    cl_mem map, cl_int unit, struct ape_be_view va, struct ape_be_view vb, cl_int nh)
{
	const cl_long4 va4 = ape__ocl_view4(va), vb4 = ape__ocl_view4(vb);
	const cl_long np = (cl_long)padded;
	struct ape__ocl_args args = { 0 };
	cl_int err;

	*out = bwd_take(q, bytes, NULL, held, &err);
	if (!*out)
		return ape__ocl_error(err, "clCreateBuffer (backward rows of %lld)",
				      (long long)(nbh * padded));
	args.k = clCreateKernel(pr->prog, "ape_bwd_prep", &args.err);
	ape__ocl_arg(&args, sizeof(cl_mem), &a);
	ape__ocl_arg(&args, sizeof(dt_a), &dt_a);
	ape__ocl_arg(&args, sizeof(cl_mem), &b);
	ape__ocl_arg(&args, sizeof(dt_b), &dt_b);
	ape__ocl_arg(&args, sizeof(L), &L);
	ape__ocl_arg(&args, sizeof(lanes), &lanes);
	ape__ocl_arg(&args, sizeof(D), &D);
	ape__ocl_arg(&args, sizeof(npad), &npad);
	ape__ocl_arg(&args, sizeof(dpad), &dpad);
	ape__ocl_arg(&args, sizeof(inter), &inter);
	ape__ocl_arg(&args, sizeof(cl_mem), out);
	ape__ocl_arg(&args, sizeof(cl_mem), &kmax);
	ape__ocl_arg(&args, sizeof(cl_mem), &om);
	ape__ocl_arg(&args, sizeof(rot), &rot);
	ape__ocl_arg(&args, sizeof(np), &np);
	ape__ocl_arg(&args, sizeof(cl_mem), &sg);
	ape__ocl_arg(&args, sizeof(cl_mem), &map);
	ape__ocl_arg(&args, sizeof(unit), &unit);
	ape__ocl_arg(&args, sizeof(va4), &va4);
	ape__ocl_arg(&args, sizeof(vb4), &vb4);
	ape__ocl_arg(&args, sizeof(nh), &nh);
	return bwd_run(q, &args, round_up(padded, local), local, nbh, "ape_bwd_prep");
}

/*
 * A ragged launch's tables (kernels/bwd_layout.h, SG_*), of s's sizes: its segments, the segment
 * of each row vector of rw rows and of each key block of kt keys, in order.
 */
static cl_int bwd_tables(struct ape_be_queue *q, const struct ape_be_launch *f, size_t rw,
			 size_t kt, const struct bwd_scratch *s, uint64_t *held, cl_mem *sg,
			 cl_mem *rvs, cl_mem *kbs)
{
	int64_t *tg = ape_be_malloc(s->sg);
	cl_int *tr = ape_be_malloc(s->rvs), *tk = ape_be_malloc(s->kbs);
	cl_int err = tg && tr && tk ? CL_SUCCESS : CL_OUT_OF_HOST_MEMORY;
	size_t rv = 0, kb = 0;

	for (int64_t i = 0; err == CL_SUCCESS && i < f->nseg; i++) {
		const struct ape_be_seg *g = &f->segs[i];
		int64_t *t = tg + i * SG_N;

		t[SG_Q0] = g->q0;
		t[SG_LQ] = g->lq;
		t[SG_K0] = g->k0;
		t[SG_LK] = g->lk;
		t[SG_REL] = g->q_start - g->k_start;
		t[SG_RV0] = (int64_t)rv;
		t[SG_KB0] = (int64_t)kb;
		for (size_t n = ((size_t)g->lq + rw - 1) / rw; n > 0; n--)
			tr[rv++] = (cl_int)i;
		for (size_t n = ((size_t)g->lk + kt - 1) / kt; n > 0; n--)
			tk[kb++] = (cl_int)i;
	}
	if (err == CL_SUCCESS)
		*sg = bwd_take(q, s->sg, tg, held, &err);
	if (*sg)
		*rvs = bwd_take(q, s->rvs, tr, held, &err);
	if (*rvs)
		*kbs = bwd_take(q, s->kbs, tk, held, &err);
	free(tg);
	free(tr);
	free(tk);
	return err;
}

/*
 * Without float64 on the device: the totals a kernel left as compensated float32 pairs (sum,
 * error term) in src, `rows` rows of n pairs, each added in float64 to the float64 accumulator
 * dst[off + r stride + i] (dparams, dbias), as the float64 kernels add theirs. Blocking reads
 * and writes on the launch's queue (in order: after the kernels): the host is the one place
 * with float64 arithmetic. Deterministic: one owner per value, a fixed order.
 */
static int bwd_host_add(struct ape_be_queue *q, cl_mem src, size_t rows, size_t n, cl_mem dst,
			size_t off, size_t stride)
{
	float *pr = ape_be_malloc(rows * n * 2 * sizeof(float));
	double *acc = ape_be_malloc(n * sizeof(double));
	cl_int err = pr && acc ? CL_SUCCESS : CL_OUT_OF_HOST_MEMORY;

	if (err == CL_SUCCESS)
		err = clEnqueueReadBuffer(q->cq, src, CL_TRUE, 0, rows * n * 2 * sizeof(float), pr,
					  0, NULL, NULL);
	for (size_t r = 0; r < rows && err == CL_SUCCESS; r++) {
		const size_t at = (off + r * stride) * sizeof(double);

		err = clEnqueueReadBuffer(q->cq, dst, CL_TRUE, at, n * sizeof(double), acc, 0, NULL,
					  NULL);
		for (size_t i = 0; i < n && err == CL_SUCCESS; i++) {
			const double hi = pr[(r * n + i) * 2], lo = pr[(r * n + i) * 2 + 1];

			/* an infinite or NaN sum is itself (its error term is NaN) */
			acc[i] += isfinite(hi) ? hi + lo : hi;
		}
		if (err == CL_SUCCESS)
			err = clEnqueueWriteBuffer(q->cq, dst, CL_TRUE, at, n * sizeof(double), acc,
						   0, NULL, NULL);
	}
	free(pr);
	free(acc);
	return err == CL_SUCCESS ? 0 : ape__ocl_error(err, "the backward's float64 totals");
}

/*
 * The table's gradient from the sweep's per-split sums by distance (dbp; the distances nmin
 * onwards): per table row and distance over batch, heads and splits (ape_bwd_dbias_dist, into
 * dbd), then per entry over the distances that read it, added to l->dbias (ape_bwd_dbias): only
 * the entries the launch's distances reach. Without float64, ape_bwd_dbias leaves its pairs in
 * dbp (done with, and at least as large: nm <= ndist) for bwd_host_add().
 */
static int bwd_dbias(struct ape_be_queue *q, const struct ape__ocl_program *pr,
		     const struct ape_be_bwd_launch *l, cl_int ns, size_t local, cl_long nmin,
		     cl_long ndist, cl_mem dbp, cl_mem dbd)
{
	const struct ape_be_launch *f = &l->f;
	const cl_int H = (cl_int)f->H, shared = f->bias_hstride == 0;
	const cl_long B = f->B, M = f->bias_len;
	const size_t brows = (size_t)bwd_table_rows(f);
	struct ape__ocl_args a;
	int64_t near, far;
	cl_long m0, nm;
	int ret;

	bwd_abs_range(nmin, ndist, &near, &far);
	m0 = ape_bias_index(near, M);
	nm = ape_bias_index(far, M) - m0 + 1;
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_dbias_dist", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &dbp);
	ape__ocl_arg(&a, sizeof(ns), &ns);
	ape__ocl_arg(&a, sizeof(B), &B);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(shared), &shared);
	ape__ocl_arg(&a, sizeof(ndist), &ndist);
	ape__ocl_arg(&a, sizeof(cl_mem), &dbd);
	ret = bwd_run(q, &a, round_up((size_t)ndist, local), local, brows, "ape_bwd_dbias_dist");
	if (ret)
		return ret;
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_dbias", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &dbd);
	ape__ocl_arg(&a, sizeof(nmin), &nmin);
	ape__ocl_arg(&a, sizeof(ndist), &ndist);
	ape__ocl_arg(&a, sizeof(M), &M);
	ape__ocl_arg(&a, sizeof(m0), &m0);
	ape__ocl_arg(&a, sizeof(nm), &nm);
	ape__ocl_arg(&a, sizeof(cl_mem), ape__ocl_dev(q->dev)->fp64 ? &l->dbias->mem : &dbp);
	ret = bwd_run(q, &a, round_up((size_t)nm, local), local, brows, "ape_bwd_dbias");
	if (ret || ape__ocl_dev(q->dev)->fp64)
		return ret;
	return bwd_host_add(q, dbp, brows, (size_t)nm, l->dbias->mem, (size_t)m0, (size_t)M);
}

/* ape_bwd_short's slots of prepared rows and keys, of s's sizes (bwd_scratch_size()) */
static int bwd_short_slots(struct ape_be_queue *q, const struct bwd_scratch *s, uint64_t *held,
			   cl_mem *qp, cl_mem *kp)
{
	cl_int err;

	*qp = bwd_take(q, s->qp, NULL, held, &err);
	if (*qp)
		*kp = bwd_take(q, s->kp, NULL, held, &err);
	return *qp && *kp ? 0 : ape__ocl_error(err, "clCreateBuffer (backward slots)");
}

/* ape_bwd_short (or _sep) on a ragged launch of short segments (bwd_short(): srv row vectors per
 * slot), nsplit work-items per (batch, kv head), on the buffers bwd_launch() made for it. */
static int bwd_short_run(struct ape_be_queue *q, const struct ape__ocl_program *pr,
			 const struct ape_be_bwd_launch *l, cl_int sep, size_t nsplit, size_t srv,
			 cl_mem prm, cl_mem rinfo, cl_mem step, cl_mem tab, cl_mem qp, cl_mem kp,
			 cl_mem dqp, cl_mem rp, cl_mem dbp, cl_mem part, cl_mem sg, cl_mem kbs,
			 cl_long nmin, cl_long ndist, cl_int flags)
{
	const struct ape_be_launch *f = &l->f;
	const cl_int ns = (cl_int)nsplit;
	/* its DBP slices are per (batch, head) as the sweep's: nrv / nblk of them */
	const cl_long nrv = f->B * f->H, nseg = f->nseg, nrvs = (cl_long)srv;
	const char *name = sep ? "ape_bwd_short_sep" : "ape_bwd_short";
	/* where the kernel reads Q, dO, K, V and O, in its arguments' order */
	const cl_long4 views[5] = {
		ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_Q)),
		ape__ocl_view4(ape_be_bwd_dout_view(l)),
		ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_K)),
		ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_V)),
		ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_O)),
	};
	const cl_mem none = NULL;
	struct ape__ocl_args a;
	struct bwd_sweep w;

	w = (struct bwd_sweep){ .qp = qp, .kp = kp, .prm = prm, .rinfo = rinfo, .step = step,
				.tab = tab, .npad = (cl_int)round_up((size_t)f->D / 2, pr->t.rw),
				.D = (cl_int)f->D, .H = (cl_int)f->H,
				.group = (cl_int)(f->H / f->Hkv), .flags = flags, .Lq = f->Lq,
				.Lk = f->Lk, .rel = f->q_start - f->k_start,
				.scale = (cl_float)f->scale, .nmin = nmin, .ndist = ndist, .nblk = 1,
				.nkb = 0, .sg = sg, .kbs = kbs };
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, name, &a.err);
	bwd_sweep_args(&a, &w);
	bwd_out_args(&a, &(struct bwd_out){ .dk = l->dk ? l->dk->mem : none,
					    .dv = l->dv ? l->dv->mem : none, .dqp = dqp, .rp = rp,
					    .ns = ns, .nrv = nrv, .dbp = dbp });
	ape__ocl_arg(&a, sizeof(cl_mem), &f->q->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->dout->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->k->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->v->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->lse->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->dlse ? &l->dlse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), f->pairs ? &f->pairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->dq ? &l->dq->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->dparams ? &part : &none);
	ape__ocl_arg(&a, sizeof(nseg), &nseg);
	ape__ocl_arg(&a, sizeof(nrvs), &nrvs);
	for (int t = 0; t < 5; t++)
		ape__ocl_arg(&a, sizeof(views[t]), &views[t]);
	/* one work-item per split of a (batch, kv head), as the sweep */
	return bwd_run(q, &a, nsplit, 1, (size_t)(f->B * f->Hkv), name);
}

/* One launch (dense, or ragged with its segments' distances at most Lq + Lk - 1 apart:
 * bwd_space()), in one set of kernel launches */
static int bwd_launch(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const struct ape_be_launch *f = &l->f;
	const struct ape__ocl_program *pr;
	const cl_int D = (cl_int)f->D, H = (cl_int)f->H, group = (cl_int)(f->H / f->Hkv);
	const cl_long Lq = f->Lq, Lk = f->Lk, B = f->B, rel = f->q_start - f->k_start;
	const cl_float scale = (cl_float)f->scale;
	const size_t rows = (size_t)(f->B * f->H * f->Lq);
	const size_t local = od->max_wg >= BWD_LOCAL ? BWD_LOCAL : 1;
	cl_int flags = B_DTYPES((cl_int)f->in_dtype, (cl_int)f->out_dtype, (cl_int)l->dout_dtype);
	/* where ape_bwd_reduce reads Q and ape_bwd_rows O (strided: APE_BE_CAP_BWD_VIEWS) */
	const cl_long4 vq = ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_Q));
	const cl_long4 vo = ape__ocl_view4(ape_be_launch_view(f, APE_BE_T_O));
	const cl_int inter = f->layout == APE_ROPE_INTERLEAVED;
	cl_mem prm = NULL, rinfo = NULL, step = NULL, part = NULL, tab = NULL, qp = NULL, kp = NULL;
	cl_mem none = NULL, kmax = NULL, dqp = NULL, rp = NULL, bt = NULL, bsm = NULL, dbp = NULL;
	cl_mem dbd = NULL, sg = NULL, rvs = NULL, kbs = NULL;
	/* a ragged launch's rows: the first and the count of its segments' (the params' sums) */
	const cl_long r0 = f->segs ? f->segs[0].q0 : 0;
	const cl_long nr = f->segs ? f->segs[f->nseg - 1].q0 + f->segs[f->nseg - 1].lq - r0 : Lq;
	const cl_int kt = (cl_int)bwd_kt(f->D);
	struct bwd_space sp;
	cl_long nmin, ndist, nkb;
	/* the distance-bias table: entries per row, rows apart (0: shared), rows */
	const cl_long bM = f->bias_table ? ape_be_bias_entries(f) : 0;
	const cl_long bstride = f->bias_hstride ? bM : 0;
	const cl_int brows = (cl_int)bwd_table_rows(f);
	cl_float tol = 0;
	struct ape__ocl_args a;
	struct bwd_sweep w;
	struct bwd_scratch s;
	const cl_int sep = bwd_separable(f);
	cl_int npad, dpad, rw, err;
	uint64_t held = 0, high, general;
	size_t nblk, nsplit;
	cl_long nrv, nb;
	cl_int ns;
	size_t srv; /* ape_bwd_short: its slots' row vectors per query head (0: not short) */
	int ret;

	if (!(l->dq || l->dk || l->dv || l->dparams || l->dbias) || rows == 0 || f->Lk == 0)
		return 0;
	ret = ape__ocl_program_get(q->dev, f->D, &pr);
	if (ret)
		return ret;
	rw = (cl_int)pr->t.rw; /* query rows per row vector (APE_RW) */
	bwd_space(f, (size_t)rw, &sp);
	if (sp.ndist == 0) /* a ragged launch whose rows see no key */
		return 0;
	nmin = sp.nmin;
	ndist = sp.ndist;
	nkb = (cl_long)sp.nkb;
	srv = bwd_short(f, (size_t)rw);
	ape_be_path_note(f->path, APE_BE_PATH_BACKWARD,
			 srv ? BWD_SHORT_WHY : "the fused sweep, keys outer");
	if (sep) /* the call's path: "separable+backward" */
		ape_be_path_note(f->path, APE_BE_PATH_SEPARABLE,
				 "lambda = 0 on every head: the backward sweep on rotated rows");
	npad = (cl_int)round_up((size_t)f->D / 2, (size_t)rw);
	dpad = (cl_int)round_up((size_t)f->D, (size_t)rw);
	nblk = sp.qrows / (size_t)rw; /* row vectors per (batch, head) */
	nb = (cl_long)nblk;
	nsplit = bwd_nsplit(q->dev, f, sp.nkb);
	general = bwd_scratch_size(f, ape_be_bwd_parts(l), (size_t)rw, &sp, nsplit,
				   ape__ocl_real_size(od), 0, &s);
	if (srv) {
		/* as many splits as the general kernels take, fewer where its slots would need
		 * more scratch than they (the figure declared for a ragged call bounds theirs) */
		size_t n = bwd_nsplit(q->dev, f, (size_t)f->nseg);

		while (n > 1 && bwd_scratch_size(f, ape_be_bwd_parts(l), (size_t)rw, &sp, n,
						 ape__ocl_real_size(od), srv, &s) > general)
			n--;
		nsplit = n;
		bwd_scratch_size(f, ape_be_bwd_parts(l), (size_t)rw, &sp, nsplit,
				 ape__ocl_real_size(od), srv, &s);
	}
	flags |= (f->causal ? B_CAUSAL : 0) | (f->layout == APE_ROPE_INTERLEAVED ? B_INTERLEAVED : 0);
	flags |= (l->dlse ? B_DLSE : 0) | (l->dq ? B_DQ : 0) | (l->dk ? B_DK : 0) |
		 (l->dv ? B_DV : 0) | (l->dparams ? B_DP : 0) | (f->pairs ? B_PAIRS : 0) |
		 (l->dbias ? B_DBIAS : 0) | (sep ? B_SEP : 0);
	/* the skip bound of docs/kernels.md: only with every decay >= 0 (not ape_bwd_short) */
	if (!srv && f->skip_tol > 0 && f->decay_nonneg) {
		flags |= B_SKIP;
		tol = (cl_float)f->skip_tol;
		kmax = bwd_kmax(od, s.kmax, &held, &err);
		if (!kmax) {
			ret = ape__ocl_error(err, "clCreateBuffer (backward key norms)");
			goto out_release;
		}
	}

	if (f->segs) {
		err = bwd_tables(q, f, (size_t)rw, (size_t)kt, &s, &held, &sg, &rvs, &kbs);
		if (err != CL_SUCCESS) {
			ret = ape__ocl_error(err, "clCreateBuffer (backward segment tables)");
			goto out_release;
		}
	}
	prm = bwd_params(q, f, npad, s.prm, ape__ocl_real_size(od), &held, &err);
	if (prm)
		rinfo = bwd_take(q, s.rinfo, NULL, &held, &err);
	if (rinfo)
		step = bwd_take(q, s.step, NULL, &held, &err);
	if (step)
		tab = bwd_take(q, s.tab, NULL, &held, &err);
	if (tab && l->dparams)
		part = bwd_take(q, s.part, NULL, &held, &err);
	/* (ape_bwd_short clears its slots itself) */
	if (tab && (!l->dparams || part) && s.dqp)
		dqp = srv ? bwd_take(q, s.dqp, NULL, &held, &err) : bwd_zeros(q, s.dqp, &held, &err);
	if (tab && (!l->dparams || part) && (!s.dqp || dqp) && s.rp)
		rp = srv ? bwd_take(q, s.rp, NULL, &held, &err) : bwd_zeros(q, s.rp, &held, &err);
	if (!tab || (l->dparams && !part) || (s.dqp && !dqp) || (s.rp && !rp)) {
		ret = ape__ocl_error(err, "clCreateBuffer (backward scratch)");
		goto out_release;
	}
	if (s.bt)
		bt = bwd_table(q, f->bias_table, f->bias_hstride, brows, s.bt, &held, &err);
	if (s.bsm && bt)
		bsm = bwd_table(q, f->bias_smax, f->bias_hstride, brows, s.bsm, &held, &err);
	if (s.dbp && (!s.bt || bt) && (!s.bsm || bsm)) /* (a failure before keeps its error) */
		dbp = bwd_zeros(q, s.dbp, &held, &err);
	if (s.dbd && dbp)
		dbd = bwd_take(q, s.dbd, NULL, &held, &err);
	if ((s.bt && !bt) || (s.bsm && !bsm) || (s.dbp && !dbp) || (s.dbd && !dbd)) {
		ret = ape__ocl_error(err, "clCreateBuffer (backward distance-bias table)");
		goto out_release;
	}
	if (srv) /* ape_bwd_short's slots: it prepares the rows and keys itself */
		ret = bwd_short_slots(q, &s, &held, &qp, &kp);
	else
		ret = bwd_prep(q, pr, f->q->mem, (cl_int)f->in_dtype, l->dout->mem,
			       (cl_int)l->dout_dtype, (size_t)(B * H), Lq, rw, D, npad, dpad, inter,
			       local, none, none, 0, s.qp, &held, &qp, sp.qrows, sg, rvs, rw,
			       ape_be_launch_view(f, APE_BE_T_Q), ape_be_bwd_dout_view(l), H);
	if (!ret && !srv) /* keys: one by one, or a ragged launch's key blocks */
		ret = bwd_prep(q, pr, f->k->mem, (cl_int)f->in_dtype, f->v->mem,
			       (cl_int)f->in_dtype, (size_t)(B * f->Hkv), Lk, 1, D, npad, dpad,
			       inter, local, kmax, prm, sep, s.kp, &held, &kp,
			       sp.nkp, sg, kbs, kt, ape_be_launch_view(f, APE_BE_T_K),
			       ape_be_launch_view(f, APE_BE_T_V), (cl_int)f->Hkv);
	if (ret)
		goto out_release;

	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_dist", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(npad), &npad);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(nmin), &nmin);
	ape__ocl_arg(&a, sizeof(ndist), &ndist);
	ape__ocl_arg(&a, sizeof(cl_mem), &bt);
	ape__ocl_arg(&a, sizeof(bstride), &bstride);
	ape__ocl_arg(&a, sizeof(bM), &bM);
	ape__ocl_arg(&a, sizeof(cl_mem), &tab);
	ret = bwd_run(q, &a, round_up((size_t)ndist, local), local, (size_t)H, "ape_bwd_dist");
	if (ret)
		goto out_release;
	if (srv) {
		ret = bwd_short_run(q, pr, l, sep, nsplit, srv, prm, rinfo, step, tab, qp, kp, dqp,
				    rp, dbp, part, sg, kbs, nmin, ndist, flags);
		if (ret)
			goto out_release;
		ns = (cl_int)nsplit;
		goto out_rest;
	}

	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_bwd_rows", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &qp);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &f->lse->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->dlse ? &l->dlse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(npad), &npad);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(cl_mem), &rinfo);
	ape__ocl_arg(&a, sizeof(cl_mem), &step);
	ape__ocl_arg(&a, sizeof(cl_mem), &kmax);
	ape__ocl_arg(&a, sizeof(group), &group);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(tol), &tol);
	ape__ocl_arg(&a, sizeof(cl_mem), f->pairs ? &f->pairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &bsm);
	ape__ocl_arg(&a, sizeof(bstride), &bstride);
	ape__ocl_arg(&a, sizeof(bM), &bM);
	ape__ocl_arg(&a, sizeof(nb), &nb);
	ape__ocl_arg(&a, sizeof(cl_mem), &sg);
	ape__ocl_arg(&a, sizeof(cl_mem), &rvs);
	ape__ocl_arg(&a, sizeof(vo), &vo);
	/* one work-item per row vector */
	ret = bwd_run(q, &a, nblk, 1, (size_t)(B * H), "ape_bwd_rows");
	if (ret)
		goto out_release;

	w = (struct bwd_sweep){ .qp = qp, .kp = kp, .prm = prm, .rinfo = rinfo, .step = step,
				.tab = tab,
				.npad = npad, .D = D, .H = H, .group = group, .flags = flags,
				.Lq = Lq, .Lk = Lk, .rel = rel, .scale = scale,
				.nmin = nmin, .ndist = ndist, .nblk = nb, .nkb = nkb, .sg = sg,
				.kbs = kbs };
	/* one work-item per split of a (batch, kv head): its accumulators are large
	 * (kernels/backward.cl) */
	ns = (cl_int)nsplit;
	nrv = (cl_long)((size_t)(B * H) * nblk);
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, sep ? "ape_bwd_sep" : "ape_bwd_fused", &a.err);
	bwd_sweep_args(&a, &w);
	bwd_out_args(&a, &(struct bwd_out){ .dk = l->dk ? l->dk->mem : none,
					    .dv = l->dv ? l->dv->mem : none, .dqp = dqp, .rp = rp,
					    .ns = ns, .nrv = nrv, .dbp = dbp });
	ret = bwd_run(q, &a, nsplit, 1, (size_t)(B * f->Hkv),
		      sep ? "ape_bwd_sep" : "ape_bwd_fused");
	if (ret)
		goto out_release;

	if (l->dq || l->dparams) {
		memset(&a, 0, sizeof(a));
		a.k = clCreateKernel(pr->prog, "ape_bwd_reduce", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg(&a, sizeof(npad), &npad);
		ape__ocl_arg(&a, sizeof(cl_mem), &rinfo);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(H), &H);
		ape__ocl_arg(&a, sizeof(Lq), &Lq);
		ape__ocl_arg(&a, sizeof(Lk), &Lk);
		ape__ocl_arg(&a, sizeof(rel), &rel);
		ape__ocl_arg(&a, sizeof(flags), &flags);
		ape__ocl_arg(&a, sizeof(cl_mem), &dqp);
		ape__ocl_arg(&a, sizeof(cl_mem), &rp);
		ape__ocl_arg(&a, sizeof(ns), &ns);
		ape__ocl_arg(&a, sizeof(nrv), &nrv);
		ape__ocl_arg(&a, sizeof(cl_mem), &f->q->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dq ? &l->dq->mem : &none);
		ape__ocl_arg(&a, sizeof(cl_mem), l->dparams ? &part : &none);
		ape__ocl_arg(&a, sizeof(nb), &nb);
		ape__ocl_arg(&a, sizeof(cl_mem), &sg);
		ape__ocl_arg(&a, sizeof(cl_mem), &rvs);
		ape__ocl_arg(&a, sizeof(vq), &vq);
		/* one work-item per row vector */
		ret = bwd_run(q, &a, nblk, 1, (size_t)(B * H), "ape_bwd_reduce");
		if (ret)
			goto out_release;
	}

out_rest: /* the parameters' and the table's reductions */
	if (l->dparams) {
		memset(&a, 0, sizeof(a));
		a.k = clCreateKernel(pr->prog, "ape_bwd_params", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &part);
		ape__ocl_arg(&a, sizeof(B), &B);
		ape__ocl_arg(&a, sizeof(H), &H);
		ape__ocl_arg(&a, sizeof(Lq), &Lq);
		/* without float64, the per-head pairs to rp (done with; 8 bytes per row and sum,
		 * at least 5 H) for the host's float64 */
		ape__ocl_arg(&a, sizeof(cl_mem), od->fp64 ? &l->dparams->mem : &rp);
		ape__ocl_arg(&a, sizeof(r0), &r0);
		ape__ocl_arg(&a, sizeof(nr), &nr);
		ret = bwd_run(q, &a, (size_t)H, 0, 1, "ape_bwd_params");
		if (!ret && !od->fp64)
			ret = bwd_host_add(q, rp, 1, 4 * (size_t)H, l->dparams->mem, 0, 0);
		if (ret)
			goto out_release;
	}

	if (l->dbias)
		ret = bwd_dbias(q, pr, l, ns, local, nmin, ndist, dbp, dbd);
out_release:
	/* what this launch allocated, for the tests' comparison with the declared figure */
	high = atomic_load(&ape__ocl_bwd_scratch_high);
	while (held > high && !atomic_compare_exchange_weak(&ape__ocl_bwd_scratch_high, &high, held))
		;
	if (prm)
		clReleaseMemObject(prm);
	if (rinfo)
		clReleaseMemObject(rinfo);
	if (step)
		clReleaseMemObject(step);
	if (kmax)
		clReleaseMemObject(kmax);
	if (part)
		clReleaseMemObject(part);
	if (dqp)
		clReleaseMemObject(dqp);
	if (rp)
		clReleaseMemObject(rp);
	if (tab)
		clReleaseMemObject(tab);
	if (qp)
		clReleaseMemObject(qp);
	if (kp)
		clReleaseMemObject(kp);
	if (bt)
		clReleaseMemObject(bt);
	if (bsm)
		clReleaseMemObject(bsm);
	if (dbp)
		clReleaseMemObject(dbp);
	if (dbd)
		clReleaseMemObject(dbd);
	if (sg)
		clReleaseMemObject(sg);
	if (rvs)
		clReleaseMemObject(rvs);
	if (kbs)
		clReleaseMemObject(kbs);
	return ret;
}

/*
 * A launch, in one set of kernel launches; a ragged launch whose segments' distances lie more
 * than Lq + Lk - 1 apart (positions far from each other: the distance table would outgrow the
 * scratch declared, bwd_space()) in runs of consecutive segments that fit, one after the other.
 */
int ape__ocl_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	const struct ape_be_launch *f = &l->f;
	const int64_t span = f->Lq + f->Lk - 1;
	struct ape_be_bwd_launch part;
	int64_t a = 0;

	if (!f->segs) {
		struct ape_be_seg one;

		return bwd_launch(q, bwd_dense_short(l, &part, &one));
	}
	while (a < f->nseg) {
		int64_t lo = INT64_MAX, hi = INT64_MIN, b = a;
		int ret;

		for (; b < f->nseg; b++) { /* the hull of a .. b, segments with keys */
			const struct ape_be_seg *g = &f->segs[b];
			const int64_t rel = g->q_start - g->k_start;
			int64_t nlo = lo, nhi = hi;

			if (g->lk > 0) {
				nlo = rel - (g->lk - 1) < lo ? rel - (g->lk - 1) : lo;
				nhi = rel + g->lq - 1 > hi ? rel + g->lq - 1 : hi;
			}
			/* (one segment's distances alone: lq + lk - 1 <= span) */
			if (b > a && nhi >= nlo && (uint64_t)nhi - (uint64_t)nlo >= (uint64_t)span)
				break;
			lo = nlo;
			hi = nhi;
		}
		part = *l;
		part.f.segs = f->segs + a;
		part.f.nseg = b - a;
		ret = bwd_launch(q, &part);
		if (ret)
			return ret;
		a = b;
	}
	return 0;
}

/* ------------------------------------------------------------------ the caller's memory */

int ape__ocl_scratch_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out)
{
	/* OpenCL keeps a released buffer alive for the commands using it: buf_free is ordered */
	return ape__ocl_buf_alloc(q->dev, bytes, out);
}

int ape__ocl_scratch_free(struct ape_be_queue *q, struct ape_be_buf *buf)
{
	ape__ocl_buf_free(q->dev, buf);
	return 0;
}

/* kernels/backward.cl's ape_copy_view, from the program of the call's head size (float64 to
 * float32 by the bits where the device has no float64). */
int ape__ocl_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c)
{
	const cl_int dt = c->dst_type, st = c->src_type;
	const cl_long H = c->H, L = c->L, D = c->D;
	const size_t rows = (size_t)(c->B * c->H * c->L);
	const struct ape__ocl_program *pr;
	struct ape__ocl_args a;
	int ret;

	if (!rows || !c->D)
		return 0;
	if ((ret = ape__ocl_program_get(q->dev, c->head_D, &pr)))
		return ret;
	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_copy_view", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &c->dst->mem);
	ape__ocl_arg(&a, sizeof(dt), &dt);
	ape__ocl_arg(&a, sizeof(cl_long), &c->dv.off);
	ape__ocl_arg(&a, sizeof(cl_long), &c->dv.sb);
	ape__ocl_arg(&a, sizeof(cl_long), &c->dv.sh);
	ape__ocl_arg(&a, sizeof(cl_long), &c->dv.sl);
	ape__ocl_arg(&a, sizeof(cl_mem), &c->src->mem);
	ape__ocl_arg(&a, sizeof(st), &st);
	ape__ocl_arg(&a, sizeof(cl_long), &c->sv.off);
	ape__ocl_arg(&a, sizeof(cl_long), &c->sv.sb);
	ape__ocl_arg(&a, sizeof(cl_long), &c->sv.sh);
	ape__ocl_arg(&a, sizeof(cl_long), &c->sv.sl);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(L), &L);
	ape__ocl_arg(&a, sizeof(D), &D);
	return bwd_run(q, &a, (size_t)c->D, 0, rows, "ape_copy_view");
}
