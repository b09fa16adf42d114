/* SPDX-License-Identifier: MIT */
/*
 * One attention launch: the skip pre-pass (when skipping is allowed) and the fused kernel. Q, K,
 * V, O and LSE are read and written where the launch's views say (core/backend.h, struct
 * ape_be_view): each kernel takes them as element offsets and strides, never as cl_mem
 * sub-buffers (whose origins must be aligned to CL_DEVICE_MEM_BASE_ADDR_ALIGN).
 * Kernel objects are created per launch (clSetKernelArg on a shared kernel is not thread-safe);
 * the small parameter and scratch buffers are released right after they are enqueued, which
 * OpenCL allows: the commands that use them keep them alive.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "ocl.h"
#include "ocl_fast.h"

/* Launch flags, mirrored in kernels/attention.cl. */
#define F_CAUSAL 16
#define F_INTERLEAVED 32
#define F_LSE 64
#define F_PAIRS 128
#define F_SKIP 256
#define F_KV_F32 512
#define F_PRIOR 1024
#define F_DIAG 2048
#define F_SEGS 4096
#define F_POS 8192
#define F_TABLE 16384
#define SEGT_W 8 /* kernels/attention.cl */

/* Heads per enqueue along dimension 1: GPU drivers bound a grid dimension (65535 on some). */
#define OCL_MAX_DIM1 65535

void ape__ocl_arg(struct ape__ocl_args *a, size_t size, const void *v)
{
	if (a->err == CL_SUCCESS)
		a->err = clSetKernelArg(a->k, a->n, size, v);
	a->n++;
}

/* The kernels enqueued, for the tests (ocl_debug.h, ape__ocl_debug_kernels()): a relaxed load
 * and nothing else until a test asks for them. */
static void note_kernel(struct ape__ocl_device *od, const char *what)
{
	size_t n;

	if (!atomic_load_explicit(&od->kernels_on, memory_order_relaxed))
		return;
	pthread_mutex_lock(&od->lock);
	n = strlen(od->kernels);
	if (n + strlen(what) + 2 < sizeof(od->kernels))
		snprintf(od->kernels + n, sizeof(od->kernels) - n, "%s%s", n ? " " : "", what);
	pthread_mutex_unlock(&od->lock);
}

/* Enqueues k over (n0, n1) with local size (l0, 1) (or the driver's choice when l0 is 0),
 * splitting dimension 1 into chunks through the global offset. */
int ape__ocl_enqueue(struct ape_be_queue *q, cl_kernel k, size_t n0, size_t l0, size_t n1,
		     const char *what)
{
	for (size_t off = 0; off < n1; off += OCL_MAX_DIM1) {
		const size_t goff[2] = { 0, off };
		const size_t gsz[2] = { n0, n1 - off < OCL_MAX_DIM1 ? n1 - off : OCL_MAX_DIM1 };
		const size_t lsz[2] = { l0, 1 };
		cl_event ev;
		cl_int err = clEnqueueNDRangeKernel(q->cq, k, 2, goff, gsz, l0 ? lsz : NULL, 0,
						    NULL, &ev);
		int ret;

		if (err != CL_SUCCESS)
			return ape__ocl_error(err, "clEnqueueNDRangeKernel (%s)", what);
		if (off == 0)
			note_kernel(ape__ocl_dev(q->dev), what);
		ret = ape__ocl_track(q, ev);
		if (ret)
			return ret;
	}
	return 0;
}

cl_mem ape__ocl_scratch(struct ape_be_queue *q, size_t bytes, void *init, cl_int *err)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);

	const cl_mem_flags flags =
		init ? CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR : CL_MEM_READ_WRITE;

	return clCreateBuffer(od->ctx, flags, bytes, init, err);
}


/*
 * Where tensor t (enum ape_be_tensor) of l lies, as the kernels take it (kernels/attention.cl,
 * VIEW_ROW): offset and the B, H, L strides in elements. dense: where it would lie contiguous
 * at offset 0, as in the float32 copies ape_kv_prep makes.
 */
static cl_long4 ocl_view(const struct ape_be_launch *l, int t, bool dense)
{
	struct ape_be_view v;

	if (dense && l->strided) {
		struct ape_be_launch c = *l;

		c.strided = false;
		v = ape_be_launch_view(&c, t);
	} else {
		v = ape_be_launch_view(l, t);
	}
	return ape__ocl_view4(v);
}

/* Where ent (which 0) or md (1) of l lies, as the kernel takes it (ape_be_launch_diag_view()). */
static cl_long4 ocl_diag_view(const struct ape_be_launch *l, int which)
{
	return ape__ocl_view4(ape_be_launch_diag_view(l, which));
}

/*
 * K and V in the kernel's preferred form (float32, K pair-ordered in the half layout), made once
 * per call by ape_kv_prep when the input is not already so. Sets *k, *v to the buffers the
 * kernels should read (the inputs themselves when nothing needs converting) and kv[0], kv[1] to
 * their views (the inputs' own, or contiguous for the copies), and returns 1 when they are in
 * that form; 0 leaves the conversion to the attention kernel, when the float32 copy would not
 * fit in one allocation.
 */
static int ocl_kv_prep(struct ape_be_queue *q, const struct ape__ocl_program *pr,
		       const struct ape_be_launch *l, cl_mem *kp, cl_mem *vf, cl_mem *k, cl_mem *v,
		       cl_long4 kv[2], int *ret)
{
	struct ape__ocl_device *od = ape__ocl_dev(q->dev);
	const cl_long rows = l->B * l->Hkv * l->Lk;
	const size_t bytes = (size_t)rows * (size_t)l->D * sizeof(float);
	const cl_int D = (cl_int)l->D, dt = (cl_int)l->in_dtype, Hkv = (cl_int)l->Hkv;
	const cl_long Lk = l->Lk;
	const cl_int inter = l->layout == APE_ROPE_INTERLEAVED, do_v = l->in_dtype != APE_F32;
	const cl_long4 vk = ocl_view(l, APE_BE_T_K, false), vv = ocl_view(l, APE_BE_T_V, false);
	const size_t local = od->max_wg >= 64 ? 64 : 1;
	struct ape__ocl_args a = { 0 };
	cl_int err;

	*ret = 0;
	*k = l->k->mem;
	*v = l->v->mem;
	kv[0] = vk;
	kv[1] = vv;
	if (l->in_dtype == APE_F32 && !inter)
		return 1;
	if (bytes > od->max_alloc)
		return 0;
	*kp = ape__ocl_scratch(q, bytes, NULL, &err);
	if (*kp && do_v)
		*vf = ape__ocl_scratch(q, bytes, NULL, &err);
	if (!*kp || (do_v && !*vf))
		return 0;
	a.k = clCreateKernel(pr->prog, "ape_kv_prep", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->k->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->v->mem);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(rows), &rows);
	ape__ocl_arg(&a, sizeof(dt), &dt);
	ape__ocl_arg(&a, sizeof(inter), &inter);
	ape__ocl_arg(&a, sizeof(do_v), &do_v);
	ape__ocl_arg(&a, sizeof(cl_mem), kp);
	ape__ocl_arg(&a, sizeof(cl_mem), do_v ? vf : &l->v->mem);
	ape__ocl_arg(&a, sizeof(Hkv), &Hkv);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(vk), &vk);
	ape__ocl_arg(&a, sizeof(vv), &vv);
	if (a.err != CL_SUCCESS)
		*ret = ape__ocl_error(a.err, "setting up ape_kv_prep");
	else /* rows rounded up: the kernel ignores the excess; PoCL wants whole work-groups */
		*ret = ape__ocl_enqueue(q, a.k, ((size_t)rows + local - 1) / local * local, local, 1,
				   "ape_kv_prep");
	if (a.k)
		clReleaseKernel(a.k);
	if (*ret)
		return 0;
	*k = *kp;
	kv[0] = ocl_view(l, APE_BE_T_K, true);
	if (do_v) {
		*v = *vf;
		kv[1] = ocl_view(l, APE_BE_T_V, true);
	}
	return 1;
}

/*
 * A ragged launch's tables (core/backend.h, struct ape_be_launch.segs; kernels/attention.cl): the
 * work-groups' (segment, query tile) entries, heaviest first; each segment's key tiles (kt, 2
 * longs each: first key, end) and its first tile and tile count (st, 2 longs each); with
 * explicit positions, each key tile's smallest and largest key position (tp, 2 longs each).
 * On the host; uploaded with the launch.
 */
struct seg_tables {
	cl_long *wg, *kt, *st, *tp;
	size_t nwg;
	cl_long ntk; /* key tiles of every segment */
	cl_long kpt; /* the scans' values per kv head: ntk + nseg */
};

static void seg_tables_free(struct seg_tables *t)
{
	free(t->wg);
	free(t->kt);
	free(t->st);
	free(t->tp);
}

/* Sorts work-group entries by their last field's cost, largest first (then by position). */
static int wg_heavier(const void *a, const void *b)
{
	const cl_long *x = a, *y = b;

	if (x[SEGT_W - 1] != y[SEGT_W - 1])
		return x[SEGT_W - 1] > y[SEGT_W - 1] ? -1 : 1;
	return x[0] + x[5] < y[0] + y[5] ? -1 : x[0] + x[5] > y[0] + y[5];
}

static int seg_tables_make(const struct ape_be_launch *l, int64_t bq, int64_t bk,
			   struct seg_tables *t)
{
	size_t nwg = 0, ntk = 0, w = 0, k = 0;

	memset(t, 0, sizeof(*t));
	for (int64_t s = 0; s < l->nseg; s++) {
		nwg += (size_t)((l->segs[s].lq + bq - 1) / bq);
		ntk += (size_t)((l->segs[s].lk + bk - 1) / bk);
	}
	t->wg = ape_be_malloc(nwg * SEGT_W * sizeof(cl_long) + 1);
	/* + 2: ocl_prepass() uploads 16 bytes past the table (a launch with no key tile) */
	t->kt = ape_be_calloc(ntk * 2 + 2, sizeof(cl_long));
	t->st = ape_be_malloc((size_t)l->nseg * 2 * sizeof(cl_long) + 1);
	if (l->pos_k)
		t->tp = ape_be_malloc(ntk * 2 * sizeof(cl_long) + 1);
	if (!t->wg || !t->kt || !t->st || (l->pos_k && !t->tp)) {
		seg_tables_free(t);
		return ape_be_error(APE_ENOMEM, "out of host memory for the tables of %lld segments",
				  (long long)l->nseg);
	}
	for (int64_t s = 0; s < l->nseg; s++) {
		const struct ape_be_seg *g = &l->segs[s];
		/* rel: the distance of (row q0, key k0), one pair's (it fits); any without keys */
		const cl_long rel = g->lk ? g->q_start - g->k_start : 0;

		t->st[2 * s] = (cl_long)k;
		t->st[2 * s + 1] = (g->lk + bk - 1) / bk;
		for (int64_t j = 0; j < g->lk; j += bk, k++) {
			t->kt[2 * k] = g->k0 + j;
			t->kt[2 * k + 1] = g->k0 + (j + bk < g->lk ? j + bk : g->lk);
			for (int64_t x = t->kt[2 * k]; t->tp && x < t->kt[2 * k + 1]; x++) {
				const int64_t y = l->pos_k[x];

				t->tp[2 * k] = x == t->kt[2 * k] || y < t->tp[2 * k] ? y : t->tp[2 * k];
				t->tp[2 * k + 1] =
					x == t->kt[2 * k] || y > t->tp[2 * k + 1] ? y : t->tp[2 * k + 1];
			}
		}
		for (int64_t i0 = 0; i0 < g->lq; i0 += bq, w++) {
			cl_long *e = t->wg + w * SEGT_W;
			const int64_t last = (i0 + bq < g->lq ? i0 + bq : g->lq) - 1;
			/* the keys its last row sees (causal: up to its diagonal), ape_math.h's rule;
			 * with explicit positions, the segment's keys */
			const int64_t cost = l->causal && !l->pos_q
						     ? ape_visible_keys(ape_sat_add(rel, last), g->lk, 1)
						     : g->lk;

			e[0] = g->q0;
			e[1] = g->lq;
			e[2] = g->k0;
			e[3] = g->lk;
			e[4] = rel;
			e[5] = i0;
			/* explicit positions: the per-tile norms themselves, no scans */
			e[6] = t->st[2 * s] + (l->pos_q ? 0 : s);
			e[7] = cost;
		}
	}
	qsort(t->wg, nwg, SEGT_W * sizeof(cl_long), wg_heavier);
	t->nwg = nwg;
	t->ntk = (cl_long)ntk;
	t->kpt = (cl_long)ntk + l->nseg;
	return 0;
}

/* The skip pre-pass: per key tile the largest key norm, then prefix and suffix maxima; with
 * explicit positions the per-tile norms alone, in *pre (the bound is per tile). */
static int ocl_prepass(struct ape_be_queue *q, const struct ape__ocl_program *pr,
		       const struct ape_be_launch *l, cl_mem k, cl_mem v, const cl_long4 kv[2],
		       cl_int dt, cl_long ntk, const struct seg_tables *sg, cl_mem *pre,
		       cl_mem *suf)
{
	const cl_long nst = l->segs ? l->nseg : 0;
	const cl_int segs = l->segs != NULL;
	const bool pos = l->pos_q != NULL;
	const size_t bkv = (size_t)(l->B * l->Hkv);
	const size_t scan = bkv * (size_t)(segs ? sg->kpt : ntk + 1) * sizeof(float);
	const cl_int D = (cl_int)l->D, Hkv = (cl_int)l->Hkv;
	const cl_long Lk = l->Lk;
	cl_mem tiles, kt = NULL, st = NULL;
	cl_int err = CL_SUCCESS;
	struct ape__ocl_args a = { 0 };
	int ret = 0;

	/* + 1: a ragged launch whose segments have no key at all has no tile */
	tiles = ape__ocl_scratch(q, bkv * (size_t)ntk * sizeof(float) + 4, NULL, &err);
	if (tiles && !pos)
		*pre = ape__ocl_scratch(q, scan, NULL, &err);
	if (*pre)
		*suf = ape__ocl_scratch(q, scan, NULL, &err);
	if ((*suf || (pos && tiles)) && segs) {
		kt = ape__ocl_scratch(q, (size_t)ntk * 2 * sizeof(cl_long) + 16, sg->kt, &err);
		if (kt)
			st = ape__ocl_scratch(q, (size_t)nst * 2 * sizeof(cl_long), sg->st, &err);
	}
	if (!(*suf || (pos && tiles)) || (segs && !st)) {
		ret = ape__ocl_error(err, "clCreateBuffer (skip pre-pass)");
		goto out_release;
	}

	a.k = clCreateKernel(pr->prog, "ape_kmax", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &k);
	ape__ocl_arg(&a, sizeof(cl_mem), &v);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(dt), &dt);
	ape__ocl_arg(&a, sizeof(ntk), &ntk);
	ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
	ape__ocl_arg(&a, sizeof(Hkv), &Hkv);
	ape__ocl_arg(&a, sizeof(kv[0]), &kv[0]);
	ape__ocl_arg(&a, sizeof(kv[1]), &kv[1]);
	ape__ocl_arg(&a, sizeof(cl_mem), &kt);
	ape__ocl_arg(&a, sizeof(segs), &segs);
	if (a.err != CL_SUCCESS)
		ret = ape__ocl_error(a.err, "setting up ape_kmax");
	else if (ntk)
		ret = ape__ocl_enqueue(q, a.k, (size_t)ntk, 0, bkv, "ape_kmax");
	if (a.k)
		clReleaseKernel(a.k);
	if (ret)
		goto out_release;
	if (pos) { /* the per-tile norms are the table */
		*pre = tiles;
		tiles = NULL;
		goto out_release;
	}

	memset(&a, 0, sizeof(a));
	a.k = clCreateKernel(pr->prog, "ape_kscan", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &tiles);
	ape__ocl_arg(&a, sizeof(ntk), &ntk);
	ape__ocl_arg(&a, sizeof(cl_mem), pre);
	ape__ocl_arg(&a, sizeof(cl_mem), suf);
	ape__ocl_arg(&a, sizeof(cl_mem), &st);
	ape__ocl_arg(&a, sizeof(nst), &nst);
	if (a.err != CL_SUCCESS)
		ret = ape__ocl_error(a.err, "setting up ape_kscan");
	else
		ret = ape__ocl_enqueue(q, a.k, bkv, 0, segs ? (size_t)nst : 1, "ape_kscan");
	if (a.k)
		clReleaseKernel(a.k);
out_release:
	if (tiles)
		clReleaseMemObject(tiles);
	if (kt)
		clReleaseMemObject(kt);
	if (st)
		clReleaseMemObject(st);
	return ret;
}

/* A host array uploaded for the kernels, padded to at least 16 bytes (a table may be empty,
 * a launch one row). */
static cl_mem upload(struct ape_be_queue *q, const void *host, size_t bytes, cl_int *err)
{
	cl_long pad[2] = { 0, 0 };

	if (bytes >= sizeof(pad))
		return ape__ocl_scratch(q, bytes, (void *)(uintptr_t)host, err);
	if (bytes)
		memcpy(pad, host, bytes);
	return ape__ocl_scratch(q, sizeof(pad), pad, err);
}

/* A launch with explicit positions (l->pos_q, l->pos_k) as ape_attention_pos takes it: always
 * ragged, one segment (*one) of every row and key when l->segs is NULL (in *x). */
static const struct ape_be_launch *as_ragged(const struct ape_be_launch *l, struct ape_be_launch *x,
					   struct ape_be_seg *one)
{
	if (!l->pos_q || l->segs)
		return l;
	*x = *l;
	*one = (struct ape_be_seg){ .q0 = 0, .lq = l->Lq, .k0 = 0, .lk = l->Lk };
	x->segs = one;
	x->nseg = 1;
	return x;
}

/* Explicit positions and the tiles' position ranges uploaded into pos[0..2] (the caller
 * releases them): 0 or a failure (its message set). */
static int pos_upload(struct ape_be_queue *q, const struct ape_be_launch *l,
		      const struct seg_tables *sg, cl_mem pos[3])
{
	cl_int err = CL_SUCCESS;

	pos[0] = upload(q, l->pos_q, (size_t)l->Lq * sizeof(cl_long), &err);
	if (pos[0])
		pos[1] = upload(q, l->pos_k, (size_t)l->Lk * sizeof(cl_long), &err);
	if (pos[1])
		pos[2] = upload(q, sg->tp, (size_t)sg->ntk * 2 * sizeof(cl_long), &err);
	if (!pos[2])
		return ape__ocl_error(err, "clCreateBuffer (%lld positions)",
				      (long long)(l->Lq + l->Lk));
	return 0;
}

int ape__ocl_attention(struct ape_be_queue *q, const struct ape_be_launch *launch)
{
	struct ape_be_launch rag;
	struct ape_be_seg one;
	const struct ape_be_launch *l = as_ragged(launch, &rag, &one);
	const bool pos = l->pos_q != NULL;
	const struct ape__ocl_program *pr;
	const cl_int D = (cl_int)l->D, H = (cl_int)l->H, group = (cl_int)(l->H / l->Hkv);
	const cl_long Lq = l->Lq, Lk = l->Lk, rel = l->q_start - l->k_start;
	const cl_float scale = (cl_float)l->scale, tol = (cl_float)l->skip_tol,
		       prior_tol = (cl_float)l->prior_tol;
	cl_int flags = (cl_int)l->in_dtype | (cl_int)l->out_dtype << 2;
	cl_mem prm = NULL, pre = NULL, suf = NULL, none = NULL, kp = NULL, vf = NULL, kbuf, vbuf;
	cl_mem segt = NULL, posb[3] = { NULL, NULL, NULL }, bias[2] = { NULL, NULL };
	cl_long blen, bhs;
	struct seg_tables sg = { 0 };
	struct ape__ocl_args a = { 0 };
	const cl_long4 vq = ocl_view(l, APE_BE_T_Q, false), vo = ocl_view(l, APE_BE_T_O, false),
		       vl = ocl_view(l, APE_BE_T_LSE, false), ve = ocl_diag_view(l, 0),
		       vm = ocl_diag_view(l, 1);
	cl_long4 kv[2];
	size_t bq, nqt;
	cl_long ntk;
	cl_int err;
	int ret;

	/* fast paths: ocl_fast.h; a launch with pages was accepted by the decode; explicit
	 * positions take the general kernel's ape_attention_pos only */
	if (!pos && (l->pages || ape__ocl_decode_applies(q->dev, l)))
		return ape__ocl_decode(q, l);
	if (!pos && ape__ocl_separable_applies(q->dev, l))
		return ape__ocl_separable(q, l);
	if (!pos && ape__ocl_split_applies(q->dev, l)) {
		ape_be_path_note(l->path, APE_BE_PATH_SPLIT,
			       "lambda = 0 on some heads only: runs of heads, each on its path");
		return ape__ocl_split(q, l);
	}
	if (pos)
		ape_be_path_note(l->path, APE_BE_PATH_POSITIONS, "explicit positions");
	else if (l->segs)
		ape_be_path_note(l->path, APE_BE_PATH_RAGGED, "a ragged batch: one segment table");
	else
		ape_be_path_note(l->path, APE_BE_PATH_GENERAL, ape_be_launch_general_why(l));
	ret = ape__ocl_program_get(q->dev, l->D, &pr);
	if (ret)
		return ret;
	bq = (size_t)(pr->t.rw * pr->t.rg * pr->t.nwi);
	nqt = ((size_t)l->Lq + bq - 1) / bq;
	ntk = (l->Lk + pr->t.bk - 1) / pr->t.bk;
	if (l->segs) { /* a ragged launch: one work-group per (segment, query tile) */
		ret = seg_tables_make(l, (int64_t)bq, pr->t.bk, &sg);
		if (ret)
			return ret;
		nqt = sg.nwg;
		ntk = sg.ntk;
		flags |= F_SEGS | (pos ? F_POS : 0);
		if (pos) /* the per-tile norms: ntk per kv head */
			sg.kpt = sg.ntk;
	}
	flags |= (l->causal ? F_CAUSAL : 0) | (l->lse ? F_LSE : 0) | (l->pairs ? F_PAIRS : 0);
	flags |= l->layout == APE_ROPE_INTERLEAVED ? F_INTERLEAVED : 0;
	/* both or neither, except on the resident call's launches (attention_diag_views) */
	flags |= l->ent || l->md ? F_DIAG : 0;
	/* the far-key bound needs decays >= 0; the core passes skip_tol = 0 otherwise */
	if (l->skip_tol > 0 && l->decay_nonneg && tol > 0 && (l->segs || pos || ntk > 1))
		flags |= F_SKIP | (l->lse_prior && prior_tol > 0 ? F_PRIOR : 0);

	prm = ape__ocl_fast_params(q, l, &err);
	if (prm && l->segs)
		segt = ape__ocl_scratch(q, sg.nwg * SEGT_W * sizeof(cl_long), sg.wg, &err);
	if (!prm || (l->segs && !segt)) {
		ret = ape__ocl_error(err, "clCreateBuffer (%s)", prm ? "segments" : "parameters");
		goto out_release;
	}
	if (pos && (ret = pos_upload(q, l, &sg, posb)))
		goto out_release;
	/* the table, and its suffix maxima for the far-key bounds */
	if ((ret = ape__ocl_bias_upload(q, l, (flags & F_SKIP) != 0, bias, &blen, &bhs)))
		goto out_release;
	flags |= l->bias_table ? F_TABLE : 0;
	if (ocl_kv_prep(q, pr, l, &kp, &vf, &kbuf, &vbuf, kv, &ret))
		flags |= F_KV_F32;
	if (ret)
		goto out_release;
	if ((flags & F_SKIP) &&
	    (ret = ocl_prepass(q, pr, l, kbuf, vbuf, kv,
			       (flags & F_KV_F32) ? (cl_int)APE_F32 : (cl_int)l->in_dtype, ntk,
			       &sg, &pre, &suf)))
		goto out_release;

	a.k = clCreateKernel(pr->prog, pos ? "ape_attention_pos" : "ape_attention", &a.err);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->q->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), &kbuf);
	ape__ocl_arg(&a, sizeof(cl_mem), &vbuf);
	ape__ocl_arg(&a, sizeof(cl_mem), &l->o->mem);
	ape__ocl_arg(&a, sizeof(cl_mem), l->lse ? &l->lse->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->pairs ? &l->pairs->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), (flags & F_PRIOR) ? &l->lse_prior->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), &prm);
	ape__ocl_arg(&a, sizeof(cl_mem), &pre);
	ape__ocl_arg(&a, sizeof(cl_mem), &suf);
	ape__ocl_arg(&a, sizeof(D), &D);
	ape__ocl_arg(&a, sizeof(Lq), &Lq);
	ape__ocl_arg(&a, sizeof(Lk), &Lk);
	ape__ocl_arg(&a, sizeof(H), &H);
	ape__ocl_arg(&a, sizeof(group), &group);
	ape__ocl_arg(&a, sizeof(rel), &rel);
	ape__ocl_arg(&a, sizeof(scale), &scale);
	ape__ocl_arg(&a, sizeof(tol), &tol);
	ape__ocl_arg(&a, sizeof(prior_tol), &prior_tol);
	ape__ocl_arg(&a, sizeof(flags), &flags);
	ape__ocl_arg(&a, sizeof(vq), &vq);
	ape__ocl_arg(&a, sizeof(kv[0]), &kv[0]);
	ape__ocl_arg(&a, sizeof(kv[1]), &kv[1]);
	ape__ocl_arg(&a, sizeof(vo), &vo);
	ape__ocl_arg(&a, sizeof(vl), &vl);
	ape__ocl_arg(&a, sizeof(cl_mem), l->ent ? &l->ent->mem : &none);
	ape__ocl_arg(&a, sizeof(cl_mem), l->md ? &l->md->mem : &none);
	ape__ocl_arg(&a, sizeof(ve), &ve);
	ape__ocl_arg(&a, sizeof(vm), &vm);
	ape__ocl_arg(&a, sizeof(cl_mem), &segt);
	ape__ocl_arg(&a, sizeof(sg.kpt), &sg.kpt);
	ape__ocl_arg(&a, sizeof(cl_mem), &bias[0]);
	ape__ocl_arg(&a, sizeof(cl_mem), &bias[1]);
	ape__ocl_arg(&a, sizeof(blen), &blen);
	ape__ocl_arg(&a, sizeof(bhs), &bhs);
	for (int i = 0; pos && i < 3; i++) /* POSQ, POSK, TPOS */
		ape__ocl_arg(&a, sizeof(cl_mem), &posb[i]);
	if (a.err != CL_SUCCESS)
		ret = ape__ocl_error(a.err, "setting up %s",
				     pos ? "ape_attention_pos" : "ape_attention");
	else
		ret = ape__ocl_enqueue(q, a.k, nqt * (size_t)pr->t.nwi, (size_t)pr->t.nwi,
				  (size_t)(l->B * l->H), pos ? "ape_attention_pos" : "ape_attention");
	if (a.k)
		clReleaseKernel(a.k);
out_release:
	if (prm)
		clReleaseMemObject(prm);
	if (segt)
		clReleaseMemObject(segt);
	for (int i = 0; i < 3; i++)
		if (posb[i])
			clReleaseMemObject(posb[i]);
	for (int i = 0; i < 2; i++)
		if (bias[i])
			clReleaseMemObject(bias[i]);
	seg_tables_free(&sg);
	if (kp)
		clReleaseMemObject(kp);
	if (vf)
		clReleaseMemObject(vf);
	if (pre)
		clReleaseMemObject(pre);
	if (suf)
		clReleaseMemObject(suf);
	return ret;
}
