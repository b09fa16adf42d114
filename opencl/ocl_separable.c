/* SPDX-License-Identifier: MIT */
/*
 * The separable path (kernels/separable.cl): launches whose every head has lambda = 0 (any
 * delta, beta, gamma; with beta or gamma != 0, or with the caller's distance-bias table, the
 * bias per distance comes from a table of its own, the caller's added in). Q and
 * K are rotated once into scratch (Q transposed per block of 16 rows, the rows then being the
 * lanes of a vector; V copied as float32), key-tile norms and their prefix maxima are taken for
 * skipping, then ape_sep_attn (ape_sep_attn_wg in the work-group shape) runs the GEMM-shaped
 * blocks. Scratch: the rotated Q and K, V in float32, the norms, the tables below
 * (ape__ocl_separable_scratch counts them for the executor's budget).
 *
 * Ragged launches (core/backend.h, struct ape_be_launch.segs) run in the same handful of kernel
 * launches as a dense one, whatever their number of segments: the host builds a segment table
 * (sep_plan_make(): each segment's rows, keys, distance and places in the scratch, where its
 * rows are padded to whole blocks and its keys to whole tiles, so that none straddles two
 * segments) and an index table (each block's and tile's segment, the attention's work units
 * heaviest first), uploaded with the launch; every kernel reads its entry and runs the dense
 * code on that segment. A dense launch is the one-segment case of the same code (its B batches
 * alike), bit for bit what it was. In a ragged launch the rotations take their sines and
 * cosines from a table per position (ape_sep_trig, the same values as the per-row seeds), and
 * on CPU devices the segments of at most one key tile go to ape_sep_small instead, which
 * computes them without scratch (thousands of tiny sequences: no padded scratch to fill and
 * read back).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "ocl_fast.h"

#define SEP_BQ 16 /* kernels/separable.cl */
#define SEP_BK 16
#define SEP_NB 4
#define SEP_GBK 16 /* the work-group shape's keys per tile (ape_sep_attn_wg) */
#define SEP_GNWI 64 /* its work-items (rows) per work-group, at most */
#define SEP_QPRIV 8192 /* ape_sep_rot_q's private floats: SEP_QPRIV / (16 D) heads at most */

/*
 * The work-group shape (ape_sep_attn_wg: rows shared over a work-group, K and V tiles in local
 * memory between barriers) for devices other than CPUs; APE_OCL_SEP_SHAPE=gpu gives it to a CPU
 * device too, so that the tests run it on PoCL (as APE_OCL_TUNE does for the general kernel).
 * Returns its work-items per group (the largest power of two up to SEP_GNWI that the device
 * allows), 0 when the device's local memory cannot hold a K and a V tile (the launch then goes
 * to the general kernel), -1 when the device takes the CPU shape (ape_sep_attn).
 */
static int sep_wg_shape(const struct ape__ocl_device *od, int64_t D)
{
	const char *e = getenv("APE_OCL_SEP_SHAPE");
	int nwi = SEP_GNWI;

	if ((od->type & CL_DEVICE_TYPE_CPU) && !(e && !strcmp(e, "gpu")))
		return -1;
	while ((size_t)nwi > od->max_wg && nwi > 1)
		nwi /= 2;
	return (uint64_t)(2 * SEP_GBK * D * 4 + 64) <= od->local_mem ? nwi : 0;
}

static int64_t round_up(int64_t x, int64_t m)
{
	return (x + m - 1) / m * m;
}

/* A head has beta or gamma != 0, or the launch has a distance-bias table: the kernel takes its
 * bias from the per-distance table (ape_sep_btab adds the caller's table into it). */
static bool sep_tabbed(const struct ape_be_launch *l)
{
	if (l->bias_table)
		return true;
	for (int64_t h = 0; h < l->H; h++)
		if (l->head_params[4 * h + 1] != 0 || l->head_params[4 * h + 2] != 0)
			return true;
	return false;
}

/* The segment table's fields, SEP_SW cl_longs per segment (kernels/separable.cl, SG_*). */
enum { SG_Q0, SG_LQ, SG_QP, SG_K0, SG_LK, SG_TP, SG_REL, SG_BE, SG_TQ, SG_TK, SG_NT, SEP_SW };

#define SEP_FS_TRIG 1024 /* kernels/separable.cl FS_TRIG: rotations from the trig table */

/*
 * A launch as the kernels see it: its segments (a dense launch: one, the same in each of its B
 * batches), each padded to whole row blocks and key tiles in the scratch, except the small ones
 * of a ragged launch (sep_small()), which ape_sep_small computes without scratch. Without the
 * tables (sep_dims()), the sizes alone; ntrig is then a bound (the rows the trig table may
 * take).
 */
struct sep_plan {
	int64_t nseg; /* segments in the table */
	int64_t Lqp, Lkp; /* padded rows and keys in the scratch (multiples of 16) */
	int64_t ne; /* the bias table's entries per head (every segment with keys) */
	int64_t nwork; /* work-items (ape_sep_attn) or work-groups (ape_sep_attn_wg) */
	int64_t nsmall; /* ape_sep_small's work-items: row blocks of the small segments */
	int64_t ntrig; /* rows of the trig table (ragged launches; 0: rotations seeded per row) */
	/* nseg * SEP_SW segment fields, then ntrig positions (the trig table's) */
	cl_long *sg;
	/* Lqp / 16 blocks' segments, Lkp / 16 tiles' segments (from ixt), the attention's nwork
	 * (segment, first row block or first row) pairs (from ixw), then ape_sep_small's nsmall
	 * (segment, row block) pairs (from ixs) */
	cl_int *ix;
	int64_t ixt, ixw, ixs;
};

/* The shape of l's segments (l->segs NULL: one, rows 0..Lq-1 against keys 0..Lk-1). */
static struct ape_be_seg sep_seg(const struct ape_be_launch *l, int64_t s)
{
	const struct ape_be_seg d = { 0, l->Lq, 0, l->Lk, l->q_start, l->k_start };

	return l->segs ? l->segs[s] : d;
}

/* A segment ape_sep_small computes (no scratch), in the CPU shape (nwi 0, sep_units()): one of
 * several in a ragged launch (a single one stays the dense launch it is), with at most one key
 * tile. */
static bool sep_small(const struct ape_be_launch *l, const struct ape_be_seg *g, int nwi)
{
	return nwi == 0 && l->segs && l->nseg > 1 && g->lk <= SEP_BK;
}

/* The attention's work units of a segment of lq rows: work-items of SEP_NB row blocks (nwi 0,
 * ape_sep_attn), or work-groups of nwi rows (ape_sep_attn_wg). */
static int64_t sep_units(int64_t lq, int nwi)
{
	return nwi > 0 ? (lq + nwi - 1) / nwi : (round_up(lq, SEP_BQ) / SEP_BQ + SEP_NB - 1) / SEP_NB;
}

/* The sizes of pl for l (nwi as sep_units() takes it; -1: a bound for any shape, every segment
 * in the scratch), no table. */
static void sep_dims(const struct ape_be_launch *l, int nwi, struct sep_plan *pl)
{
	int64_t maxlk = 0;

	memset(pl, 0, sizeof(*pl));
	pl->nseg = l->segs ? l->nseg : 1;
	for (int64_t s = 0; s < pl->nseg; s++) {
		const struct ape_be_seg g = sep_seg(l, s);

		pl->ne += g.lk ? round_up(g.lq, SEP_BQ) + round_up(g.lk, SEP_BK) - 1 : 0;
		maxlk = g.lk > maxlk ? g.lk : maxlk;
		if (sep_small(l, &g, nwi)) {
			pl->nsmall += round_up(g.lq, SEP_BQ) / SEP_BQ;
			continue;
		}
		pl->Lqp += round_up(g.lq, SEP_BQ);
		pl->Lkp += round_up(g.lk, SEP_BK);
		/* a bound for every shape: one unit per row */
		pl->nwork += nwi < 0 ? g.lq : sep_units(g.lq, nwi);
	}
	/* at most every query row's position and every key's (0 .. maxlk - 1) */
	pl->ntrig = l->segs ? l->Lq + maxlk : 0;
}

/* Rotated Q (transposed per block), rotated K and float32 V (each kt bytes), the query norms,
 * tile norms and their prefix maxima, per segment (a dense launch's: as before segments). */
static void sep_sizes(const struct ape_be_launch *l, const struct sep_plan *pl, size_t *qr,
		      size_t *kt, size_t *qn, size_t *tiles, size_t *pre)
{
	const int64_t bkv = l->B * l->Hkv, ntk = pl->Lkp / SEP_BK;

	*qr = (size_t)(l->B * l->H * pl->Lqp * l->D) * sizeof(float);
	*kt = (size_t)(bkv * pl->Lkp * l->D) * sizeof(float);
	*qn = (size_t)(l->B * l->H * pl->Lqp) * sizeof(float);
	*tiles = (size_t)(bkv * ntk) * sizeof(float);
	*pre = (size_t)(bkv * (ntk + pl->nseg)) * sizeof(float);
}

/* The segment table's and index table's bytes. */
static size_t sep_sg_bytes(const struct sep_plan *pl)
{
	return (size_t)(pl->nseg * SEP_SW + pl->ntrig) * sizeof(cl_long);
}

static size_t sep_ix_bytes(const struct sep_plan *pl)
{
	return (size_t)(pl->Lqp / SEP_BQ + pl->Lkp / SEP_BK + 2 * (pl->nwork + pl->nsmall)) *
	       sizeof(cl_int);
}

/* One work unit of the attention, for ordering them: its segment, first block or row, and
 * cost (the key tiles its blocks walk; the rows count for the outputs). */
struct sep_unit {
	int64_t cost;
	cl_int s, first;
};

static int sep_unit_heavier(const void *a, const void *b)
{
	const struct sep_unit *x = a, *y = b;

	if (x->cost != y->cost)
		return x->cost > y->cost ? -1 : 1;
	if (x->s != y->s)
		return x->s < y->s ? -1 : 1;
	return x->first < y->first ? -1 : x->first > y->first;
}

/* Key tiles a row block walks: rows i0 .. i0 + n - 1 of segment g (causal: up to the diagonal
 * of its last row). */
static int64_t sep_tiles_walked(const struct ape_be_launch *l, const struct ape_be_seg *g, int64_t i0,
				int64_t n)
{
	const int64_t rel = g->q_start - g->k_start, ntk = round_up(g->lk, SEP_BK) / SEP_BK;

	if (n <= 0 || g->lk <= 0)
		return 0;
	if (!l->causal)
		return ntk;
	{
		const int64_t dl = ape_sat_add(rel, i0 + n - 1);

		return dl < 0 ? 0 : (dl < g->lk - 1 ? dl : g->lk - 1) / SEP_BK + 1;
	}
}

static int sep_iv_before(const void *a, const void *b)
{
	const int64_t *x = a, *y = b;

	return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* The merged interval of iv[0 .. n-1] (sorted, disjoint) that holds position x. */
static const int64_t *sep_iv_find(int64_t (*iv)[3], int64_t n, int64_t x)
{
	int64_t lo = 0, hi = n - 1;

	while (lo < hi) {
		const int64_t mid = lo + (hi - lo + 1) / 2;

		if (iv[mid][0] <= x)
			lo = mid;
		else
			hi = mid - 1;
	}
	return iv[lo];
}

/*
 * The trig table of a ragged launch: the query intervals iv[0 .. nint-1] (first and last
 * position of each segment with keys; room for one more) and the keys' 0 .. maxlk - 1, sorted
 * and merged where they overlap or touch, their positions after pl's segment fields, and each
 * segment's SG_TQ and SG_TK rows in it. Returns the table's rows.
 */
static int64_t sep_trig_table(const struct ape_be_launch *l, struct sep_plan *pl,
			      int64_t (*iv)[3], int64_t nint, int64_t maxlk)
{
	cl_long *pos = pl->sg + pl->nseg * SEP_SW;
	int64_t m = 0, rows = 0;

	if (!nint)
		return 0;
	iv[nint][0] = 0;
	iv[nint++][1] = maxlk - 1; /* maxlk >= 1: a segment has keys */
	qsort(iv, (size_t)nint, sizeof(*iv), sep_iv_before);
	for (int64_t k = 1; k < nint; k++) {
		/* overlapping or adjacent (unsigned: the difference of any two int64 fits) */
		if (iv[k][0] <= iv[m][1] || (uint64_t)iv[k][0] - (uint64_t)iv[m][1] == 1) {
			if (iv[k][1] > iv[m][1])
				iv[m][1] = iv[k][1];
		} else {
			iv[++m][0] = iv[k][0];
			iv[m][1] = iv[k][1];
		}
	}
	nint = m + 1;
	for (int64_t k = 0; k < nint; k++) {
		/* a merged interval holds at most Lq + maxlk positions: its length fits */
		const int64_t len = iv[k][1] - iv[k][0] + 1;

		iv[k][2] = rows;
		for (int64_t j = 0; j < len; j++)
			pos[rows + j] = iv[k][0] + j;
		rows += len;
	}
	for (int64_t s = 0; s < pl->nseg; s++) {
		cl_long *e = pl->sg + s * SEP_SW;

		if (!l->segs[s].lk)
			continue;
		{
			const int64_t *q = sep_iv_find(iv, nint, e[SG_REL]);
			const int64_t *k = sep_iv_find(iv, nint, 0);

			e[SG_TQ] = q[2] + (e[SG_REL] - q[0]);
			e[SG_TK] = k[2] - k[0];
		}
	}
	return rows;
}

/*
 * The tables of pl for l (sep_dims() first), for the attention's shape nwi (sep_units()):
 * segments padded in order; a ragged launch's trig table over the positions its rows and keys
 * take (the union of each segment's query positions rel .. rel + lq - 1 and of the keys'
 * 0 .. maxlk - 1, merged where they meet); the attention's units heaviest first (a dense
 * launch's: its last blocks first, as the units grow heavier along a causal launch).
 */
static int sep_plan_make(const struct ape_be_launch *l, int nwi, struct sep_plan *pl)
{
	const bool ragged = l->segs != NULL;
	int64_t qp = 0, tp = 0, be = 0, b = 0, t = 0, w = 0, sm = 0, maxlk = 0, nint = 0;
	struct sep_unit *u = NULL;
	int64_t(*iv)[3] = NULL; /* trig intervals: first, last position, table row of first */

	sep_dims(l, nwi, pl);
	pl->ixt = pl->Lqp / SEP_BQ;
	pl->ixw = pl->ixt + pl->Lkp / SEP_BK;
	pl->ixs = pl->ixw + 2 * pl->nwork;
	pl->sg = ape_be_malloc(sep_sg_bytes(pl));
	pl->ix = ape_be_malloc(sep_ix_bytes(pl) + sizeof(cl_int));
	if (ragged) {
		u = ape_be_malloc((size_t)pl->nwork * sizeof(*u) + 1);
		iv = ape_be_malloc((size_t)(pl->nseg + 1) * sizeof(*iv));
	}
	if (!pl->sg || !pl->ix || (ragged && (!u || !iv))) {
		free(u);
		free(iv);
		free(pl->sg);
		free(pl->ix);
		pl->sg = NULL;
		pl->ix = NULL;
		return ape_be_error(APE_ENOMEM, "out of host memory for the separable path's tables "
				  "(%lld segments)", (long long)pl->nseg);
	}
	for (int64_t s = 0; s < pl->nseg; s++) {
		const struct ape_be_seg g = sep_seg(l, s);
		cl_long *e = pl->sg + s * SEP_SW;
		const bool small = sep_small(l, &g, nwi);
		const int64_t units = small ? 0 : sep_units(g.lq, nwi);
		const int64_t nb = small ? 0 : round_up(g.lq, SEP_BQ) / SEP_BQ;
		const int64_t nt = small ? 0 : round_up(g.lk, SEP_BK) / SEP_BK;

		e[SG_Q0] = g.q0;
		e[SG_LQ] = g.lq;
		e[SG_QP] = qp;
		e[SG_K0] = g.k0;
		e[SG_LK] = g.lk;
		e[SG_TP] = tp;
		/* one pair's distance (it fits); any, for a segment without keys */
		e[SG_REL] = g.lk ? g.q_start - g.k_start : 0;
		e[SG_BE] = be;
		e[SG_TQ] = e[SG_TK] = 0;
		e[SG_NT] = nt;
		for (int64_t k = 0; k < nb; k++)
			pl->ix[b++] = (cl_int)s;
		for (int64_t k = 0; k < nt; k++)
			pl->ix[pl->ixt + t++] = (cl_int)s;
		for (int64_t k = 0; small && k < round_up(g.lq, SEP_BQ) / SEP_BQ; k++, sm++) {
			pl->ix[pl->ixs + 2 * sm] = (cl_int)s;
			pl->ix[pl->ixs + 2 * sm + 1] = (cl_int)k;
		}
		for (int64_t k = 0; k < units; k++, w++) {
			/* a dense launch: the last units first */
			cl_int *x = pl->ix + pl->ixw + 2 * (ragged ? w : units - 1 - k);
			const int64_t first = nwi > 0 ? k * nwi : k * SEP_NB;

			x[0] = (cl_int)s;
			x[1] = (cl_int)first;
			if (ragged) {
				int64_t c = 0;

				if (nwi > 0) {
					c = sep_tiles_walked(l, &g, first, g.lq - first < nwi
									? g.lq - first : nwi);
				} else {
					for (int64_t j = first; j < first + SEP_NB; j++)
						c += sep_tiles_walked(l, &g, j * SEP_BQ,
								      g.lq - j * SEP_BQ < SEP_BQ
									      ? g.lq - j * SEP_BQ
									      : SEP_BQ) + 1;
				}
				u[w] = (struct sep_unit){ c, (cl_int)s, (cl_int)first };
			}
		}
		if (ragged && g.lk) {
			iv[nint][0] = e[SG_REL];
			iv[nint++][1] = e[SG_REL] + (g.lq - 1); /* a row's position: fits */
		}
		maxlk = g.lk > maxlk ? g.lk : maxlk;
		qp += nb * SEP_BQ;
		tp += nt;
		be += g.lk ? round_up(g.lq, SEP_BQ) + round_up(g.lk, SEP_BK) - 1 : 0;
	}
	if (ragged) {
		qsort(u, (size_t)pl->nwork, sizeof(*u), sep_unit_heavier);
		for (int64_t k = 0; k < pl->nwork; k++) {
			pl->ix[pl->ixw + 2 * k] = u[k].s;
			pl->ix[pl->ixw + 2 * k + 1] = u[k].first;
		}
		pl->ntrig = sep_trig_table(l, pl, iv, nint, maxlk);
	}
	free(u);
	free(iv);
	return 0;
}
uint64_t ape__ocl_separable_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	struct sep_plan pl;
	size_t qr, kt, qn, tiles, pre;

	(void)dev;
	if (l->D % 32 || l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1)
		return 0;
	sep_dims(l, -1, &pl);
	sep_sizes(l, &pl, &qr, &kt, &qn, &tiles, &pre);
	return (uint64_t)(qr + 2 * kt + qn + tiles + pre) + 8 * (uint64_t)(l->D / 2 + 4 * l->H) +
	       8 * (uint64_t)(l->H * pl.ne) + /* the bias table, when tabbed */
	       (uint64_t)(sep_sg_bytes(&pl) + sep_ix_bytes(&pl)) +
	       (uint64_t)(pl.ntrig * l->D) * sizeof(float) + 64; /* the trig table; minima */
}

bool ape__ocl_separable_applies(struct ape_device *dev, const struct ape_be_launch *l)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct sep_plan pl;
	size_t qr, kt, qn, tiles, pre;

	if (!sep_wg_shape(od, l->D) || !ape__ocl_fast_outputs(l) || l->D % 32 ||
	    l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1 || l->H % l->Hkv ||
	    l->Lk > ((int64_t)1 << 30) || l->Lq > INT32_MAX / 2)
		return false;
	for (int64_t h = 0; h < l->H; h++) /* lambda = 0: every head */
		if (l->head_params[4 * h + 3] != 0)
			return false;
	sep_dims(l, -1, &pl);
	if (pl.Lqp > INT32_MAX || pl.nseg > INT32_MAX)
		return false; /* the index table's entries are cl_int */
	sep_sizes(l, &pl, &qr, &kt, &qn, &tiles, &pre);
	return qr <= od->max_alloc && kt <= od->max_alloc &&
	       (uint64_t)(l->H * pl.ne) * 8 <= od->max_alloc &&
	       (uint64_t)(pl.ntrig * l->D) * sizeof(float) <= od->max_alloc;
}

/* A scratch buffer of at least 16 bytes (a launch whose segments have no key has no tile). */
static cl_mem sep_scratch(struct ape_be_queue *q, size_t bytes, void *init, cl_int *err)
{
	return ape__ocl_scratch(q, bytes < 16 ? 16 : bytes, init, err);
}

int ape__ocl_separable(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	const struct ape__ocl_program *pr;
	const cl_int D = (cl_int)l->D, H = (cl_int)l->H, Hkv = (cl_int)l->Hkv,
		     group = (cl_int)(l->H / l->Hkv);
	/* ape_sep_rot_q's heads per work-item: its private rows (SEP_QPRIV floats) */
	const cl_int hb = SEP_QPRIV / (SEP_BQ * D) < H ? SEP_QPRIV / (SEP_BQ * D) : H;
	/* ape_sep_small's kv heads per work-item: their keys and values (SEP_QPRIV floats each) */
	const cl_int hkp = SEP_QPRIV / (SEP_BK * D * group),
		     hk = hkp < 1 ? 1 : hkp < Hkv ? hkp : Hkv;
	cl_int hkr = Hkv; /* ape_sep_rot_k's kv heads per work-item: every one in the CPU shape */
	const cl_float scale = (cl_float)l->scale, tol = (cl_float)l->skip_tol;
	cl_int flags = ape__ocl_fast_flags(l);
	size_t sqr, skt, sqn, stiles, spre;
	const size_t real = ape__ocl_real_size(ape__ocl_dev(q->dev));
	cl_mem prm = NULL, qr = NULL, kt = NULL, vf = NULL, qn = NULL, tiles = NULL, pre = NULL;
	cl_mem none = NULL;
	cl_mem tab = NULL, sgb = NULL, ixb = NULL, trig = NULL, bias[2] = { NULL, NULL };
	cl_long blen = 0, bhs = 0;
	int nwi = sep_wg_shape(ape__ocl_dev(q->dev), l->D);
	struct ape__ocl_args a = { 0 }, at = { 0 };
	struct sep_plan pl = { 0 };
	cl_long Lqa = l->Lq, Lqp, Lkp, ntk, ne, nseg, ixt, ixw, ixs, po, ntrig;
	cl_int err;
	int ret;

	ape_be_path_note(l->path, APE_BE_PATH_SEPARABLE, "lambda = 0 on every head");
	/* the far-key bound needs decays >= 0; the core passes skip_tol = 0 otherwise */
	if (l->skip_tol > 0 && l->decay_nonneg && tol > 0 && l->causal)
		flags |= APE__FD_SKIP;
	ret = ape__ocl_program_get(q->dev, l->D, &pr);
	if (ret)
		return ret;
	/* the attention kernel first: its work-items per group shape the plan */
	at.k = clCreateKernel(pr->prog, nwi > 0 ? "ape_sep_attn_wg" : "ape_sep_attn", &at.err);
	if (nwi > 0 && at.k) { /* the compiled kernel may allow fewer work-items than the device */
		size_t kwg = 0;

		if (clGetKernelWorkGroupInfo(at.k, ape__ocl_dev(q->dev)->id,
					     CL_KERNEL_WORK_GROUP_SIZE, sizeof(kwg), &kwg,
					     NULL) == CL_SUCCESS && kwg > 0)
			while ((size_t)nwi > kwg && nwi > 1)
				nwi /= 2;
	}
	if (nwi > 0)
		hkr = 1;
	ret = sep_plan_make(l, nwi > 0 ? nwi : 0, &pl);
	if (ret)
		goto out;
	Lqp = pl.Lqp;
	Lkp = pl.Lkp;
	ntk = pl.Lkp / SEP_BK;
	ne = pl.ne;
	nseg = pl.nseg;
	ixt = pl.ixt;
	ixw = pl.ixw;
	ixs = pl.ixs;
	po = pl.nseg * SEP_SW;
	ntrig = pl.ntrig;
	if (ntrig)
		flags |= SEP_FS_TRIG;
	sep_sizes(l, &pl, &sqr, &skt, &sqn, &stiles, &spre);
	prm = ape__ocl_fast_params(q, l, &err);
	if (prm)
		sgb = ape__ocl_scratch(q, sep_sg_bytes(&pl), pl.sg, &err);
	if (sgb)
		ixb = ape__ocl_scratch(q, sep_ix_bytes(&pl), pl.ix, &err);
	if (ixb)
		qr = sep_scratch(q, sqr, NULL, &err);
	if (qr)
		kt = sep_scratch(q, skt, NULL, &err);
	if (kt)
		vf = sep_scratch(q, skt, NULL, &err);
	if (vf)
		qn = sep_scratch(q, sqn, NULL, &err);
	if (qn)
		tiles = sep_scratch(q, stiles, NULL, &err);
	if (tiles)
		pre = sep_scratch(q, spre, NULL, &err);
	if (pre && ntrig)
		trig = ape__ocl_scratch(q, (size_t)(ntrig * D) * sizeof(float), NULL, &err);
	if (pre && (!ntrig || trig) && sep_tabbed(l)) {
		flags |= APE__FD_BIAS;
		tab = sep_scratch(q, (size_t)(l->H * ne) * real, NULL, &err);
	}
	if (!pre || (ntrig && !trig) || ((flags & APE__FD_BIAS) && !tab)) {
		ret = ape__ocl_error(err, "clCreateBuffer (separable scratch)");
		goto out;
	}
	/* the caller's table (into ape_sep_btab's), its suffix maxima for the far-key bound */
	ret = ape__ocl_bias_upload(q, l, (flags & APE__FD_SKIP) != 0, bias, &blen, &bhs);
	if (ret)
		goto out;

	if (trig) { /* a ragged launch: the rotations' sines and cosines per position, once */
		a.k = clCreateKernel(pr->prog, "ape_sep_trig", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(po), &po);
		ape__ocl_arg(&a, sizeof(ntrig), &ntrig);
		ape__ocl_arg(&a, sizeof(cl_mem), &trig);
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_trig", (size_t)round_up(ntrig, 16), 16,
					   1);
		if (ret)
			goto out;
	}

	if (Lqp) {
		a.k = clCreateKernel(pr->prog, nwi > 0 ? "ape_sep_rot_q1" : "ape_sep_rot_q", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->q->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg_view(&a, l, APE_BE_T_Q);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(Lqp), &Lqp);
		ape__ocl_arg(&a, sizeof(H), &H);
		ape__ocl_arg(&a, sizeof(hb), &hb);
		ape__ocl_arg(&a, sizeof(scale), &scale);
		ape__ocl_arg(&a, sizeof(flags), &flags);
		ape__ocl_arg(&a, sizeof(cl_mem), &qr);
		ape__ocl_arg(&a, sizeof(cl_mem), &qn);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(cl_mem), &ixb);
		ape__ocl_arg(&a, sizeof(cl_mem), trig ? &trig : &none);
		/* the CPU shape: hb heads by blocks; the work-group shape: rows by heads */
		if (nwi > 0)
			ret = ape__ocl_fast_launch(q, &a, "ape_sep_rot_q1", (size_t)Lqp, 16,
						   (size_t)(l->B * l->H));
		else
			ret = ape__ocl_fast_launch(q, &a, "ape_sep_rot_q",
						   (size_t)(l->B * ((H + hb - 1) / hb)), 1,
						   (size_t)(Lqp / SEP_BQ));
		if (ret)
			goto out;
	}

	if (ntk) {
		a.k = clCreateKernel(pr->prog, "ape_sep_rot_k", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->k->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->v->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg_view(&a, l, APE_BE_T_K);
		ape__ocl_arg_view(&a, l, APE_BE_T_V);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(Lkp), &Lkp);
		ape__ocl_arg(&a, sizeof(Hkv), &Hkv);
		ape__ocl_arg(&a, sizeof(hkr), &hkr);
		ape__ocl_arg(&a, sizeof(flags), &flags);
		ape__ocl_arg(&a, sizeof(cl_mem), &kt);
		ape__ocl_arg(&a, sizeof(cl_mem), &vf);
		ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(cl_mem), &ixb);
		ape__ocl_arg(&a, sizeof(ixt), &ixt);
		ape__ocl_arg(&a, sizeof(cl_mem), trig ? &trig : &none);
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_rot_k",
					   (size_t)(l->B * ((Hkv + hkr - 1) / hkr)), 1, (size_t)ntk);
		if (ret)
			goto out;
	}

	if (pl.nwork) {
		a.k = clCreateKernel(pr->prog, "ape_sep_kscan", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
		ape__ocl_arg(&a, sizeof(ntk), &ntk);
		ape__ocl_arg(&a, sizeof(nseg), &nseg);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(cl_mem), &pre);
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_kscan", (size_t)nseg, 1,
					   (size_t)(l->B * l->Hkv));
		if (ret)
			goto out;
	}

	if (tab && ne) {
		a.k = clCreateKernel(pr->prog, "ape_sep_btab", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(ne), &ne);
		ape__ocl_arg(&a, sizeof(nseg), &nseg);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(cl_mem), &tab);
		ape__ocl_arg(&a, sizeof(cl_mem), &bias[0]);
		ape__ocl_arg(&a, sizeof(blen), &blen);
		ape__ocl_arg(&a, sizeof(bhs), &bhs);
		/* work-groups of 64 (PoCL's cost per group dwarfs one log1p) */
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_btab", (size_t)round_up(ne, 64), 64,
					   (size_t)l->H);
		if (ret)
			goto out;
	}

	if (pl.nsmall) { /* the segments of at most one key tile, without scratch */
		a.k = clCreateKernel(pr->prog, "ape_sep_small", &a.err);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->q->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->k->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->v->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), &l->o->mem);
		ape__ocl_arg(&a, sizeof(cl_mem), l->lse ? &l->lse->mem : &none);
		ape__ocl_arg(&a, sizeof(cl_mem), l->pairs ? &l->pairs->mem : &none);
		ape__ocl_arg(&a, sizeof(cl_mem), &prm);
		ape__ocl_arg(&a, sizeof(cl_mem), tab ? &tab : &none);
		ape__ocl_arg_view(&a, l, APE_BE_T_Q);
		ape__ocl_arg_view(&a, l, APE_BE_T_K);
		ape__ocl_arg_view(&a, l, APE_BE_T_V);
		ape__ocl_arg_view(&a, l, APE_BE_T_O);
		ape__ocl_arg_view(&a, l, APE_BE_T_LSE);
		ape__ocl_arg(&a, sizeof(D), &D);
		ape__ocl_arg(&a, sizeof(Lqa), &Lqa);
		ape__ocl_arg(&a, sizeof(ne), &ne);
		ape__ocl_arg(&a, sizeof(H), &H);
		ape__ocl_arg(&a, sizeof(group), &group);
		ape__ocl_arg(&a, sizeof(hk), &hk);
		ape__ocl_arg(&a, sizeof(scale), &scale);
		ape__ocl_arg(&a, sizeof(flags), &flags);
		ape__ocl_arg(&a, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&a, sizeof(cl_mem), &ixb);
		ape__ocl_arg(&a, sizeof(ixs), &ixs);
		ape__ocl_arg(&a, sizeof(cl_mem), trig ? &trig : &none);
		ret = ape__ocl_fast_launch(q, &a, "ape_sep_small", (size_t)pl.nsmall, 1,
					   (size_t)(l->B * ((Hkv + hk - 1) / hk)));
		if (ret)
			goto out;
	}

	if (pl.nwork) {
		ape__ocl_arg(&at, sizeof(cl_mem), &qr);
		ape__ocl_arg(&at, sizeof(cl_mem), &kt);
		ape__ocl_arg(&at, sizeof(cl_mem), &vf);
		ape__ocl_arg(&at, sizeof(cl_mem), &l->o->mem);
		ape__ocl_arg(&at, sizeof(cl_mem), l->lse ? &l->lse->mem : &none);
		ape__ocl_arg(&at, sizeof(cl_mem), l->pairs ? &l->pairs->mem : &none);
		ape__ocl_arg(&at, sizeof(cl_mem), &prm);
		ape__ocl_arg(&at, sizeof(cl_mem), &qn);
		ape__ocl_arg(&at, sizeof(cl_mem), &pre);
		ape__ocl_arg(&at, sizeof(cl_mem), tab ? &tab : &none);
		ape__ocl_arg_view(&at, l, APE_BE_T_O);
		ape__ocl_arg_view(&at, l, APE_BE_T_LSE);
		ape__ocl_arg(&at, sizeof(D), &D);
		ape__ocl_arg(&at, sizeof(Lqa), &Lqa);
		ape__ocl_arg(&at, sizeof(Lqp), &Lqp);
		ape__ocl_arg(&at, sizeof(Lkp), &Lkp);
		ape__ocl_arg(&at, sizeof(ne), &ne);
		ape__ocl_arg(&at, sizeof(nseg), &nseg);
		ape__ocl_arg(&at, sizeof(H), &H);
		ape__ocl_arg(&at, sizeof(group), &group);
		ape__ocl_arg(&at, sizeof(scale), &scale);
		ape__ocl_arg(&at, sizeof(tol), &tol);
		ape__ocl_arg(&at, sizeof(flags), &flags);
		ape__ocl_arg(&at, sizeof(cl_mem), &sgb);
		ape__ocl_arg(&at, sizeof(cl_mem), &ixb);
		ape__ocl_arg(&at, sizeof(ixw), &ixw);
		ape__ocl_arg(&at, sizeof(cl_mem), &bias[1]);
		ape__ocl_arg(&at, sizeof(blen), &blen);
		ape__ocl_arg(&at, sizeof(bhs), &bhs);
		if (nwi > 0) { /* the work-group shape's K and V tiles in local memory */
			ape__ocl_arg(&at, (size_t)(SEP_GBK * D) * sizeof(float), NULL);
			ape__ocl_arg(&at, (size_t)(SEP_GBK * D) * sizeof(float), NULL);
		}
		if (nwi > 0) /* the work-group shape: nwi rows per group */
			ret = ape__ocl_fast_launch(q, &at, "ape_sep_attn_wg", (size_t)(pl.nwork * nwi),
						   (size_t)nwi, (size_t)(l->B * l->H));
		else
			ret = ape__ocl_fast_launch(q, &at, "ape_sep_attn", (size_t)pl.nwork, 1,
						   (size_t)(l->B * l->H));
	}

out:
	if (at.k)
		clReleaseKernel(at.k);
	if (prm)
		clReleaseMemObject(prm);
	if (sgb)
		clReleaseMemObject(sgb);
	if (ixb)
		clReleaseMemObject(ixb);
	if (trig)
		clReleaseMemObject(trig);
	if (qr)
		clReleaseMemObject(qr);
	if (kt)
		clReleaseMemObject(kt);
	if (vf)
		clReleaseMemObject(vf);
	if (qn)
		clReleaseMemObject(qn);
	if (tiles)
		clReleaseMemObject(tiles);
	if (pre)
		clReleaseMemObject(pre);
	if (tab)
		clReleaseMemObject(tab);
	for (int i = 0; i < 2; i++)
		if (bias[i])
			clReleaseMemObject(bias[i]);
	free(pl.sg);
	free(pl.ix);
	return ret;
}

bool ape__ocl_split_applies(struct ape_device *dev, const struct ape_be_launch *l)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);

	/* pairs and lse_prior are contiguous [B, H, Lq]: no view cuts a run of heads out of them;
	 * ragged launches (l->segs) take the general kernel when they mix */
	if (!sep_wg_shape(od, l->D) || !ape__ocl_fast_outputs(l) || l->pairs || l->segs ||
	    l->lse_prior || l->D % 32 ||
	    l->D > APE_MAX_D || l->Lq < 1 || l->Lk < 1 || l->Hkv < 1 || l->H % l->Hkv ||
	    l->Lk > ((int64_t)1 << 30))
		return false;
	return ape_be_launch_mixes_separable(l);
}

/* A homogeneous run: the separable path, or whatever the rest takes. */
static int split_run(struct ape_be_queue *q, const struct ape_be_launch *sub, bool separable)
{
	return separable ? ape__ocl_separable(q, sub) : ape__ocl_attention(q, sub);
}

int ape__ocl_split(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	return ape_be_launch_split_runs(q, l, split_run);
}
