/* SPDX-License-Identifier: MIT */
/*
 * Split-K decode (kernels/decode.cl): a few query rows against many keys. The keys of each
 * (batch, kv head) are cut into chunks of whole 64-key tiles, enough of them to keep every
 * compute unit busy; one work-item per chunk serves all the rows of the query heads sharing the
 * kv head, so K and V are read once; ape_decode_merge combines the chunks by LSE in a fixed
 * order. Devices other than CPUs (and a CPU under APE_OCL_DEC_SHAPE=gpu) take the work-group
 * shape instead: a group of 64 work-items per chunk, the same partials and merge (dec_wg()).
 * Also the fast paths' shared pieces: parameters, views as arguments, flags, and the backend's
 * attention_scratch op.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "ocl_fast.h"

#define DEC_TILE 64 /* kernels/decode.cl */
#define DEC_MAX_ROWS 8 /* query rows per launch row (Lq) the decode takes */
#define DEC_GNWI 64 /* the work-group shape's work-items per group (kernels/decode.cl) */
#define DEC_GRED 65 /* its floats of local memory per work-item for the partial dots */

/*
 * The work-group shape (ape_decode_wg_<RM>: a chunk's pairs spread over a group of DEC_GNWI
 * work-items, partial dot products reduced through local memory) for devices other than CPUs;
 * APE_OCL_DEC_SHAPE=gpu gives it to a CPU device too, so that the tests run it on PoCL (as
 * APE_OCL_SEP_SHAPE does for the separable path). Read at each launch; no rebuild.
 */
static bool dec_wg(const struct ape__ocl_device *od)
{
	const char *e = getenv("APE_OCL_DEC_SHAPE");

	return !(od->type & CL_DEVICE_TYPE_CPU) || (e && !strcmp(e, "gpu"));
}

/* Key streams (chunks) per group of the work-group shape: 64 / min(D / 2, 64). */
static int64_t dec_wg_streams(int64_t D)
{
	return DEC_GNWI / (D / 2 < DEC_GNWI ? D / 2 : DEC_GNWI);
}

/* Local memory the work-group shape takes for D with up to 16 rows: the partial dots, scores
 * and weights, the rows' maxima, their 1 / alpha (float64 at most). */
static uint64_t dec_wg_local(int64_t D)
{
	const uint64_t ks = (uint64_t)dec_wg_streams(D);

	return 4 * (DEC_GNWI * DEC_GRED + 2 * ks * 64 + 16 * ks) + 8 * 16;
}

/* Rows one work-item holds (kernels/decode.cl's DEC_RMAX): the specialised programs size their
 * arrays for D, the generic one for 256. */
static int64_t dec_rows_max(int64_t D)
{
	return D == 64 || D == 128 ? 16 : 8;
}

/* A ragged launch's most rows and keys of one segment (rows 0: no segment). */
static void dec_seg_max(const struct ape_be_launch *l, int64_t *lq, int64_t *lk)
{
	*lq = *lk = 0;
	for (int64_t e = 0; e < l->nseg; e++) {
		*lq = l->segs[e].lq > *lq ? l->segs[e].lq : *lq;
		*lk = l->segs[e].lk > *lk ? l->segs[e].lk : *lk;
	}
}

/* The launches the decode kernel can compute: a few rows (of each segment, in a ragged launch:
 * the plain shape only), D a multiple of 32, O, LSE, pairs; in the work-group shape, on a
 * device that holds its group and local memory. */
static bool dec_shape(struct ape_device *dev, const struct ape_be_launch *l)
{
	const struct ape__ocl_device *od = ape__ocl_dev(dev);
	int64_t rows = l->Lq, keys = l->Lk;

	/* the work-group shape needs a group of DEC_GNWI and its local memory */
	if (dec_wg(od) && (od->max_wg < DEC_GNWI || dec_wg_local(l->D) > od->local_mem))
		return false;
	if (l->segs) { /* ragged: each segment's rows; the work-group shape takes none */
		if (dec_wg(od) || l->nseg < 1)
			return false;
		dec_seg_max(l, &rows, &keys);
	}
	return ape__ocl_fast_outputs(l) && rows >= 1 && rows <= DEC_MAX_ROWS && l->D % 32 == 0 &&
	       l->D <= APE_MAX_D && l->H % l->Hkv == 0 && keys >= 1 &&
	       (l->H / l->Hkv) * rows <= dec_rows_max(l->D);
}

bool ape__ocl_decode_applies(struct ape_device *dev, const struct ape_be_launch *l)
{
	bool decays = false;

	if (!dec_shape(dev, l))
		return false;
	for (int64_t h = 0; h < l->H; h++)
		decays |= l->head_params[4 * h] != 0 || l->head_params[4 * h + 1] != 0 ||
			  l->head_params[4 * h + 2] != 0;
	/* the decode skips nothing: it takes launches where skipping is off, or where no head
	 * has a decay to skip by (the bound then almost never holds) */
	return !(l->skip_tol > 0 && l->decay_nonneg && decays);
}

/* In place, skipping allowed or not (skipping nothing is exact): the alternative is a gather
 * of every key chunk the chunk-level bound keeps, then the general kernel (docs/kernels.md). */
bool ape__ocl_decode_pages(struct ape_device *dev, const struct ape_be_launch *l)
{
	return l->pages && dec_shape(dev, l);
}

/* Keys per chunk: whole tiles (at least 4), about 512 work-items per compute unit over the
 * launch: PoCL balances many small work-groups better than few (bench/RESULTS.md, 2026-12-01).
 * The work-group shape: whole tiles (at least 1), about 4 groups per compute unit (a guess: no
 * GPU has timed it). */
static int64_t dec_chunk_of(struct ape_device *dev, int64_t D, int64_t bkv, int64_t Lk)
{
	const int64_t cu = dev->info.compute_units > 0 ? dev->info.compute_units : 1;
	/* the work-group shape: about 4 groups (of dec_wg_streams() chunks) per compute unit */
	const int64_t items = dec_wg(ape__ocl_dev(dev)) ? 4 * cu * dec_wg_streams(D) : 512 * cu;
	int64_t nsplit = (items + bkv - 1) / bkv, chunk;

	if (nsplit < 1)
		nsplit = 1;
	chunk = (Lk + nsplit - 1) / nsplit;
	chunk = (chunk + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
	if (dec_wg(ape__ocl_dev(dev))) /* any whole number of tiles: the group is the unit */
		return chunk;
	return chunk < 4 * DEC_TILE ? 4 * DEC_TILE : chunk;
}

/* A dense launch's chunk. */
static int64_t dec_chunk(struct ape_device *dev, const struct ape_be_launch *l)
{
	return dec_chunk_of(dev, l->D, l->B * l->Hkv, l->Lk);
}

/*
 * A ragged launch's segment table (kernels/decode.cl, dec_seg()) into t (8 per segment): each
 * segment cut into chunks as a dense launch of it alone (B = 1) would be, its partials after the
 * previous segment's; then the nseg + 1 first work-items of the segments' chunks in the one
 * dimension of the kernel's grid (dec_flat(); the last one the total, in *items). Returns the
 * partial rows of all of them; *most the most chunks of one.
 */
static int64_t dec_segs(struct ape_device *dev, const struct ape_be_launch *l, cl_long *t,
			int64_t *most, int64_t *items)
{
	int64_t off = 0;

	*most = 1;
	*items = 0;
	for (int64_t e = 0; e < l->nseg; e++) {
		const struct ape_be_seg *g = &l->segs[e];
		const int64_t chunk = dec_chunk_of(dev, l->D, l->Hkv, g->lk > 0 ? g->lk : 1);
		const int64_t ns = (g->lk + chunk - 1) / chunk;

		if (t) {
			t[8 * e] = g->q0;
			t[8 * e + 1] = g->lq;
			t[8 * e + 2] = g->k0;
			t[8 * e + 3] = g->lk;
			t[8 * e + 4] = g->q_start - g->k_start;
			t[8 * e + 5] = chunk;
			t[8 * e + 6] = ns;
			t[8 * e + 7] = off;
			t[8 * l->nseg + e] = *items;
		}
		*items += l->Hkv * ns;
		off += l->H * g->lq * ns;
		*most = ns > *most ? ns : *most;
	}
	if (t)
		t[9 * l->nseg] = *items;
	return off;
}

uint64_t ape__ocl_decode_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	const int64_t chunk = dec_chunk(dev, l), nsplit = (l->Lk + chunk - 1) / chunk;
	const uint64_t fixed = 8 * (uint64_t)(l->D / 2 + 4 * l->H);
	int64_t rows = l->B * l->H * l->Lq * nsplit, most, items;

	if (l->segs && l->nseg > 0) {
		rows = dec_segs(dev, l, NULL, &most, &items);
	} else if (l->nseg) {
		/* a ragged launch, segments unknown: each segment's chunks are at most those of
		 * a dense launch's split (s) and one per 256 keys, its rows at most DEC_MAX_ROWS */
		const int64_t cu = dev->info.compute_units > 0 ? dev->info.compute_units : 1;
		const int64_t s = (512 * cu + l->Hkv - 1) / l->Hkv;
		const int64_t a = l->Lq * s, b = DEC_MAX_ROWS * ((l->Lk + 255) / 256 + l->Lq);

		rows = l->H * (a < b ? a : b);
	}
	return (uint64_t)rows * (uint64_t)(l->D + 2) * sizeof(float) + fixed;
}

cl_mem ape__ocl_fast_params(struct ape_be_queue *q, const struct ape_be_launch *l, cl_int *err)
{
	const struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const size_t P = (size_t)l->D / 2, n = P + 4 * (size_t)l->H;
	const struct ape_be_buf *up = l->params[od->fp64 ? 0 : 1];
	double *dv;
	float *fv;
	cl_mem mem;

	if (up) { /* the call's table, uploaded once by the core: this launch's reference */
		*err = clRetainMemObject(up->mem);
		return *err == CL_SUCCESS ? up->mem : NULL;
	}
	dv = od->fp64 ? ape_be_malloc(n * sizeof(double)) : NULL;
	fv = od->fp64 ? NULL : ape_be_malloc(n * sizeof(float));
	if (!dv && !fv) {
		*err = CL_OUT_OF_HOST_MEMORY;
		return NULL;
	}
	for (size_t i = 0; i < n; i++) {
		const double x = i < P ? l->omega[i] : (double)l->head_params[i - P];

		if (dv)
			dv[i] = x;
		else
			fv[i] = (float)x;
	}
	mem = ape__ocl_scratch(q, n * (dv ? sizeof(double) : sizeof(float)),
			       dv ? (void *)dv : (void *)fv, err);
	free(dv);
	free(fv);
	return mem;
}

int ape__ocl_bias_upload(struct ape_be_queue *q, const struct ape_be_launch *l, bool smax,
			 cl_mem tab[2], cl_long *len, cl_long *hs)
{
	/* the launch's heads' rows (ape_be_launch_heads() moved the pointers), or the one row; of
	 * each, the entries up to the launch's farthest distance (a long table's tail, never
	 * read, stays on the host: the kernels then clamp to the last entry uploaded, which the
	 * distances they use never pass) */
	const int64_t rows = l->bias_hstride ? l->H : 1, M = ape_be_bias_entries(l);
	const size_t bytes = (size_t)(rows * M) * sizeof(float);
	float *cut = NULL;
	cl_int err = CL_SUCCESS;

	tab[0] = tab[1] = NULL;
	*len = *hs = 0;
	if (!l->bias_table)
		return 0;
	if (M < l->bias_len && rows > 1 && !(cut = ape_be_malloc(bytes)))
		return ape_be_error(APE_ENOMEM, "out of host memory for a distance-bias table");
	for (int i = 0; i < 1 + smax && (i == 0 || tab[0]); i++) {
		const float *src = i ? l->bias_smax : l->bias_table;

		for (int64_t h = 0; cut && h < rows; h++) /* rows M apart */
			memcpy(cut + h * M, src + h * l->bias_len, (size_t)M * sizeof(float));
		tab[i] = ape__ocl_scratch(q, bytes, cut ? cut : (void *)(uintptr_t)src, &err);
	}
	free(cut);
	if (!tab[0] || (smax && !tab[1])) {
		if (tab[0])
			clReleaseMemObject(tab[0]);
		tab[0] = NULL;
		return ape__ocl_error(err, "clCreateBuffer (a distance-bias table of %lld entries)",
				      (long long)M);
	}
	*len = M;
	*hs = l->bias_hstride ? M : 0;
	return 0;
}

uint64_t ape__ocl_bias_scratch(const struct ape_be_launch *l)
{
	/* the table and its suffix maxima, a row per head (a shared table's runs take one each),
	 * whole: the planner asks with a launch's shape alone, not its distances */
	return l->bias_table ? 2 * (uint64_t)l->H * (uint64_t)l->bias_len * sizeof(float) : 0;
}

void ape__ocl_arg_view(struct ape__ocl_args *a, const struct ape_be_launch *l, int t)
{
	const struct ape_be_view v = ape_be_launch_view(l, t);
	const cl_long x[4] = { v.off, v.sb, v.sh, v.sl };

	for (int i = 0; i < 4; i++)
		ape__ocl_arg(a, sizeof(cl_long), &x[i]);
}

int ape__ocl_fast_launch(struct ape_be_queue *q, struct ape__ocl_args *a, const char *what,
			 size_t n0, size_t l0, size_t n1)
{
	int ret = a->err != CL_SUCCESS ? ape__ocl_error(a->err, "setting up %s", what)
				       : ape__ocl_enqueue(q, a->k, n0, l0, n1, what);

	if (a->k)
		clReleaseKernel(a->k);
	memset(a, 0, sizeof(*a));
	return ret;
}

cl_int ape__ocl_fast_flags(const struct ape_be_launch *l)
{
	return (cl_int)l->in_dtype | (cl_int)l->out_dtype << 2 | (l->causal ? APE__FD_CAUSAL : 0) |
	       (l->layout == APE_ROPE_INTERLEAVED ? APE__FD_INTERLEAVED : 0) |
	       (l->lse ? APE__FD_LSE : 0) | (l->pairs ? APE__FD_PAIRS : 0);
}

/*
 * The work-group shape's launch of a->k (its arguments but the local ones set): the local
 * memory, then groups of DEC_GNWI over the chunks (dec_wg_streams() to a group) and B * Hkv.
 * Fails with APE_ENOTSUP (the decode runs nothing) when the compiled kernel allows fewer
 * work-items (a GPU short of registers for it: not seen, no GPU has run it).
 */
static int dec_wg_launch(struct ape_be_queue *q, struct ape__ocl_args *a, const struct ape_be_launch *l,
			 cl_int nsplit)
{
	const int64_t ks = dec_wg_streams(l->D);
	const size_t real = ape__ocl_real_size(ape__ocl_dev(q->dev));
	size_t kwg = 0;

	/* asked of other devices only: PoCL compiles a work-group function to answer (seconds),
	 * and a CPU device allows thousands */
	if (a->k && !(ape__ocl_dev(q->dev)->type & CL_DEVICE_TYPE_CPU) &&
	    clGetKernelWorkGroupInfo(a->k, ape__ocl_dev(q->dev)->id,
					     CL_KERNEL_WORK_GROUP_SIZE, sizeof(kwg), &kwg,
					     NULL) == CL_SUCCESS && kwg < DEC_GNWI) {
		clReleaseKernel(a->k);
		memset(a, 0, sizeof(*a));
		return ape_be_error(APE_ENOTSUP, "ape_decode_wg: the device runs %zu work-items of it "
				  "to a group, it needs %d", kwg, DEC_GNWI);
	}
	ape__ocl_arg(a, DEC_GNWI * DEC_GRED * sizeof(cl_float), NULL);
	ape__ocl_arg(a, (size_t)(2 * ks * 64) * sizeof(cl_float), NULL);
	ape__ocl_arg(a, (size_t)(16 * ks) * sizeof(cl_float), NULL);
	ape__ocl_arg(a, 16 * real, NULL);
	return ape__ocl_fast_launch(q, a, "ape_decode_wg",
				    (size_t)((nsplit + ks - 1) / ks * DEC_GNWI), DEC_GNWI,
				    (size_t)(l->B * l->Hkv));
}

int ape__ocl_decode(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	const struct ape__ocl_program *pr;
	const int64_t chunk = l->segs ? 0 : dec_chunk(q->dev, l);
	const cl_int D = (cl_int)l->D, H = (cl_int)l->H, group = (cl_int)(l->H / l->Hkv);
	int64_t seg_lq = l->Lq, seg_lk = l->Lk, prow_n = 0, most = 1, items = 0;
	cl_int nsplit, flags = ape__ocl_fast_flags(l);
	const cl_long Lq = l->Lq, Lk = l->Lk, rel = l->q_start - l->k_start, ch = chunk;
	const cl_float scale = (cl_float)l->scale;
	const size_t rows = (size_t)(l->B * l->H * l->Lq);
	const struct ape_be_kv_pages *pg = l->pages;
	/* the pages (bt 0: none), and K and V as views of one block when there are pages */
	const cl_long pbt = pg ? pg->block_tokens : 0, pnb = pg ? pg->nblocks : 0,
		      pfirst = pg ? pg->first_block : 0, prow = pg ? pg->first_row : 0;
	/* where the blocks' rows lie (struct ape_be_kv_pages): K's and V's views from their offsets */
	const cl_long pblk = pg ? pg->s_block : 0;
	const cl_long pview[2][4] = { { pg ? pg->k_off : 0, pg ? pg->s_b : 0, pg ? pg->s_h : 0,
					pg ? pg->s_row : 0 },
				      { pg ? pg->v_off : 0, pg ? pg->s_b : 0, pg ? pg->s_h : 0,
					pg ? pg->s_row : 0 } };
	cl_mem ptab = pg && pg->table ? pg->table->mem : NULL;
	struct ape__ocl_args a = { 0 };
	cl_mem prm, part = NULL, none = NULL, sg = NULL, bias[2] = { NULL, NULL };
	cl_long blen = 0, bhs = 0;
	/* a ragged launch's segments for the kernel's one-dimensional grid (0: dense, or the
	 * work-group shape, which takes no ragged launch) */
	const cl_long nseg = l->segs && !dec_wg(ape__ocl_dev(q->dev)) ? (cl_long)l->nseg : 0;
	/* the merge's grid: a row per segment (or batch) and head */
	const size_t nb = (size_t)(l->segs ? l->nseg : l->B);
	int64_t nr;
	int rm = 1;
	char name[32];
	cl_int err;
	int ret;

	if (l->segs) { /* grid: every segment's chunks; partials as dec_segs() lays them */
		dec_seg_max(l, &seg_lq, &seg_lk);
		prow_n = dec_segs(q->dev, l, NULL, &most, &items);
		nsplit = (cl_int)most;
	} else {
		nsplit = (cl_int)((l->Lk + chunk - 1) / chunk);
	}
	nr = l->H / l->Hkv * seg_lq;

	ape_be_path_note(l->path, pg ? APE_BE_PATH_PAGES : APE_BE_PATH_DECODE,
		       pg ? "keys read where the KV cache keeps them"
			  : "a few query rows: keys split over the device, merged by LSE");
	while (rm < nr)
		rm *= 2; /* the kernel for up to rm rows per work-item: decode.cl */
	ret = ape__ocl_program_get(q->dev, l->D, &pr);
	if (ret)
		return ret;
	prm = ape__ocl_fast_params(q, l, &err);
	if (prm)
		part = ape__ocl_scratch(q, (l->segs ? (size_t)(prow_n ? prow_n : 1)
						   : rows * (size_t)nsplit) *
						   (size_t)(D + 2) * sizeof(float),
					NULL, &err);
	if (part && l->segs) {
		const size_t n = (size_t)l->nseg * 9 + 1;
		cl_long *t = ape_be_malloc(n * sizeof(*t));

		if (!t) {
			ret = ape_be_error(APE_ENOMEM, "out of host memory for the decode's segments");
			goto out;
		}
		dec_segs(q->dev, l, t, &most, &items);
		sg = ape__ocl_scratch(q, n * sizeof(*t), t, &err);
		free(t);
		if (!sg) {
			clReleaseMemObject(part);
			part = NULL;
		}
	}
	if (!part) {
		ret = ape__ocl_error(err, "clCreateBuffer (decode scratch)");
		goto out;
	}
	/* the distance-bias table (the decode skips nothing: no suffix maxima) */
	ret = ape__ocl_bias_upload(q, l, false, bias, &blen, &bhs);
	if (ret)
		goto out;

	snprintf(name, sizeof(name), dec_wg(ape__ocl_dev(q->dev)) ? "ape_decode_wg_%d"
								     : "ape_decode_%d", rm);
	a.k = clCreateKernel(pr->prog, name, &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->q->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->k->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->v->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(cl_mem), &part);
	ape__ocl_arg_view(&a, l, APE_BE_T_Q);
	for (int t = APE_BE_T_K; t <= APE_BE_T_V; t++) {
		if (!pg)
			ape__ocl_arg_view(&a, l, t);
		for (int i = 0; pg && i < 4; i++)
			ape__ocl_arg(&a, sizeof(cl_long), &pview[t - APE_BE_T_K][i]);
	}
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(group), &group);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(ch), &ch);
	ape__ocl_arg(&a, sizeof(nsplit), &nsplit);
	ape__ocl_arg(&a, sizeof(pbt), &pbt);
	ape__ocl_arg(&a, sizeof(pnb), &pnb);
	ape__ocl_arg(&a, sizeof(pfirst), &pfirst);
	ape__ocl_arg(&a, sizeof(prow), &prow);
	ape__ocl_arg(&a, sizeof(pblk), &pblk);
	ape__ocl_arg(&a, sizeof(cl_mem), &ptab);
	ape__ocl_arg(&a, sizeof(cl_mem), &sg);
	ape__ocl_arg(&a, sizeof(cl_mem), &bias[0]);
	ape__ocl_arg(&a, sizeof(blen), &blen);
	ape__ocl_arg(&a, sizeof(bhs), &bhs);
	ape__ocl_arg(&a, sizeof(nseg), &nseg);
	if (dec_wg(ape__ocl_dev(q->dev)))
		ret = dec_wg_launch(q, &a, l, nsplit);
	else if (l->segs) /* one dimension over every segment's chunks (dec_flat()) */
		ret = ape__ocl_fast_launch(q, &a, "ape_decode", (size_t)(items > 0 ? items : 1), 1,
					   1);
	else
		ret = ape__ocl_fast_launch(q, &a, "ape_decode", (size_t)nsplit, 1,
					   nb * (size_t)l->Hkv);
	if (ret)
		goto out;

	a.k = clCreateKernel(pr->prog, "ape_decode_merge", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &part);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->lse ? &l->lse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->pairs ? &l->pairs->mem : &none);
	ape__ocl_arg_view(&a, l, APE_BE_T_O);
	ape__ocl_arg_view(&a, l, APE_BE_T_LSE);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(nsplit), &nsplit);
	ape__ocl_arg(&a, sizeof(cl_mem), &sg);
	ret = ape__ocl_fast_launch(q, &a, "ape_decode_merge", (size_t)seg_lq, 1,
				   nb * (size_t)l->H);
out:
	if (prm)
		clReleaseMemObject(prm);
	if (part)
		clReleaseMemObject(part);
	if (sg)
		clReleaseMemObject(sg);
	if (bias[0])
		clReleaseMemObject(bias[0]);
	return ret;
}

/* What ocl_attention.c allocates for the general kernel: float32 copies of K and V, per-tile
 * key norms with prefix and suffix maxima, the parameters, explicit positions. */
static uint64_t general_scratch(const struct ape_be_launch *l)
{
	/* ntk bounded by one key per tile (the tile can shrink to fit local memory) */
	const uint64_t kv = (uint64_t)(l->B * l->Hkv), ntk = (uint64_t)l->Lk;

	/* explicit positions (counted always: the planner asks with a launch's shape alone):
	 * each row's and key's, and each tile's range */
	const uint64_t pos = 8 * (uint64_t)(l->Lq + l->Lk) + 16 * ntk + 48;

	return 2 * kv * (uint64_t)(l->Lk * l->D) * 4 + 4 * kv * (3 * ntk + 2) +
	       8 * (uint64_t)(l->D / 2 + 4 * l->H) + 4096 + pos;
}

uint64_t ape__ocl_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	/* shape-only: head_params are not known here, so each path that might run counts; a
	 * launch with pages runs the decode only (attention_pages) */
	if (l->pages)
		return ape__ocl_decode_scratch(dev, l) + ape__ocl_bias_scratch(l);
	uint64_t s = general_scratch(l), d = ape__ocl_decode_scratch(dev, l),
		 p = ape__ocl_separable_scratch(dev, l);

	s = s > d ? s : d;
	/* each path uploads the distance-bias table alike */
	return (s > p ? s : p) + ape__ocl_bias_scratch(l);
}
