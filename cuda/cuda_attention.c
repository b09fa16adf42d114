/* SPDX-License-Identifier: MIT */
/*
 * One attention launch: choose prefill or decode, size the grids and the scratch, run the
 * pre-passes the launch needs, then the attention kernel(s), all on the queue's stream.
 *
 *   prefill (Lq > 16): [ape_prep: K as float32 pairs, V padded, key norms] [ape_kscan]
 *                      ape_prefill_<variant>_<type>: one block per (query tile, batch, head)
 *   decode (Lq <= 16): [ape_prep: key norms] [ape_kscan] [ape_dwindow: the proven key range]
 *                      ape_decode_<variant>_<type>: one block per (split, batch, kv head)
 *                      ape_dmerge: the splits merged by their LSE
 * (bracketed steps only when needed: ape_prep runs for the prefill unless K is already float32
 * in the half layout and D is 64 or 128, and for skipping.)
 *
 * Scratch is one stream-ordered allocation per launch, freed in stream order after the last
 * kernel: the memory is held from the attention call until the launch completes, which is what
 * attention_scratch() reports to the streaming executor.
 *
 * Strided launches (core/backend.h, struct ape_be_view): every kernel addresses Q, K, V, O and LSE
 * through the views in its argument struct (struct ape_cu_view, args.h), so a [B, L, H, D]
 * tensor or one slice of a packed QKV tensor is read and written where it is. Scalar loads take
 * any layout; what reads K or V rows with 16-byte cp.async (the prefill's K tiles when K is
 * float32 in the half layout, its V tiles, the decode kernels at D = 64 and 128) reads them in
 * place only when every row of the view is 16-byte aligned; otherwise ape_prep copies them to
 * contiguous scratch (prefill) or the decode runs its generic-D variant (scalar loads). O is
 * stored two elements at a time unless the view's pairs are misaligned (APE_CU_F_O_SCALAR).
 * A strided launch with no key writes O = 0 and LSE = -inf through ape_dmerge over zero splits
 * (fills only reach contiguous outputs).
 *
 * Ragged launches (l->segs, core/backend.h; docs/kernels.md, "Ragged launches") whose every
 * segment has a decode's rows (at most APE_DC_MAX_LQ) take the decode: a segment table
 * (upload_decode_segs(), kernels/args.h APE_DC_SEGW) gives each segment the splits of a dense
 * launch of it alone and its blocks, partial rows and merge; such a launch skips nothing. The
 * others take the prefill: the host's segment table (upload_seg_table(), in the scratch) gives
 * each block one query tile of one segment, heaviest first; ape_prep and ape_kscan run over the
 * launch's keys as for a dense launch, and the kernel reads their scans at its segment's tile
 * borders. Explicit positions (l->pos_q) are not read: the device does not say `positions`.
 *
 * Keys read in place (l->pages, attention_pages: ape__cu_attention_pages() below says which
 * launches): the decode, the prefill, ape_prep (the prefill's K conversion and V padding, the
 * key norms for skipping) and ape_dwindow address K and V rows through the pages (struct
 * ape_cu_pages in every argument struct's common part, key_at() and KeyWalk in
 * kernels/common.cuh) instead of the views; nothing else changes. (The prefill in place runs on
 * the CPU emulator in the tests; no GPU has run it yet.)
 *
 * Diagnostics (l->ent and l->md, docs/diagnostics.md): the same steps with the _diag twins of
 * the prefill, decode and merge kernels (a compile-time flag of the kernel templates, so that a
 * launch without them runs exactly the kernels it ran before), plus the decode splits' running
 * sums in scratch (part_sd). ENT and MD lie where ape_be_launch_diag_view() says (strided on the
 * device-resident call's launches, ABI 8), each optional; the core gives the streamed calls
 * both, contiguous.
 *
 * Distance-bias tables (l->bias_table, ABI 1.1): the core's host copy of the table and of its
 * suffix maxima (launches that skip) goes into the launch's scratch (ape__cu_upload_bias()), and
 * every kernel reads them through struct ape_cu_bias (kernels/args.h): the prefill and the
 * separable kernel fold the entries into their per-tile distance tables (no cost per pair), the
 * decode adds head h's entry per key (compiled in only for a launch with a table), ape_dwindow
 * into its anchor's scores; every skip bound adds the suffix maximum at the left-out keys' nearest
 * distance (may_stop() in kernels/common.cuh), which keeps it a proof whatever the table's shape.
 * Launches that skip nothing get no suffix maxima (may_stop() reads them only when skipping).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "cu.h"

/* The generic kernels for D above 128 (prefill.cu, decode.cu, backward.cu: "g256") are built
 * for every D up to the limit. */
_Static_assert(APE_MAX_D == 256, "the CUDA kernels' g256 variants cover D up to APE_MAX_D");

/* Decode splits: enough blocks to fill the GPU twice, each split at least this many keys. */
#define SPLIT_MIN_KEYS 256
/* ... and their partial results within this many bytes. */
#define SPLIT_MAX_BYTES (256u << 20)

struct cu_plan {
	bool decode, skip, exact, need_kp, need_vp, diag;
	int variant, dmax, vt;
	int64_t bk; /* keys per tile of the skip pre-pass */
	int64_t ntile; /* such tiles */
	int64_t nbkv, rows, splits;
	int64_t nseg_tiles; /* a ragged launch's query tiles (its segment table's entries) */
	/* a ragged decode: its grid's blocks and partial rows (every segment's splits) */
	int64_t dblocks, prows;
	int64_t tlen; /* the distance-bias table's entries per row uploaded (bias) */
	/* scratch layout: byte offsets, 0 when absent (offset 0 is never a region's) */
	size_t kp, vp, ktile, pre, suf, hp, win, po, pml, pp, psd, segt, bias;
	size_t total;
};

static size_t align_up(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

/* Reserves `bytes` in the scratch layout; returns the region's offset. */
static size_t take(struct cu_plan *p, size_t bytes)
{
	const size_t off = p->total;

	p->total += align_up(bytes);
	return off;
}

/*
 * Are all rows of tensor t of l aligned to `align` bytes in its buffer at `base` (strides of axes
 * of extent 1 do not count)? base == 0: the buffer is not known (attention_scratch): a strided
 * view is assumed misaligned, a contiguous one aligned like cuMemAlloc's memory.
 */
static bool view_aligned(const struct ape_be_launch *l, int t, CUdeviceptr base, size_t align)
{
	const struct ape_be_view v = ape_be_launch_view(l, t);
	const bool kv = t == APE_BE_T_K || t == APE_BE_T_V;
	const size_t esz = t == APE_BE_T_LSE ? 4 : ape_dtype_size(t == APE_BE_T_O ? l->out_dtype
									      : l->in_dtype);
	const int64_t heads = kv ? l->Hkv : l->H, rows = kv ? l->Lk : l->Lq;
	uint64_t bits = 0;

	if (!base)
		return !l->strided;
	bits |= (uint64_t)base + (uint64_t)v.off * esz;
	bits |= l->B > 1 ? (uint64_t)v.sb * esz : 0;
	bits |= heads > 1 ? (uint64_t)v.sh * esz : 0;
	bits |= rows > 1 ? (uint64_t)v.sl * esz : 0;
	return bits % align == 0;
}

/*
 * Keys read in place (l->pages): is every K and V row the launch addresses 16-byte aligned, as
 * far as the host can tell? Not with a page table whose entries, times the block stride, may
 * fall anywhere (a table of element offsets), nor before the buffers are known.
 */
static bool pages_aligned(const struct ape_be_launch *l, bool buffers)
{
	const struct ape_be_kv_pages *pg = l->pages;
	const uint64_t esz = ape_dtype_size(l->in_dtype);
	uint64_t bits = 0;

	if (!buffers)
		return false;
	bits |= (uint64_t)l->k->ptr + (uint64_t)pg->k_off * esz;
	bits |= (uint64_t)l->v->ptr + (uint64_t)pg->v_off * esz;
	bits |= l->B > 1 ? (uint64_t)pg->s_b * esz : 0;
	bits |= l->Hkv > 1 ? (uint64_t)pg->s_h * esz : 0;
	bits |= pg->block_tokens > 1 ? (uint64_t)pg->s_row * esz : 0;
	bits |= pg->table || pg->nblocks > 1 ? (uint64_t)pg->s_block * esz : 0;
	return bits % 16 == 0;
}

/*
 * K and V rows that cp.async may read in place (see the top of this file), or not known. Keys
 * read through pages always take the kernels of the same keys gathered (contiguous, aligned):
 * where pages_aligned() cannot prove their rows aligned, the decode and the prefill check each
 * row (APE_CU_F_KV_CHECK) and copy a misaligned one with plain loads (copy_row16() in
 * kernels/common.cuh).
 */
static void kv_aligned(const struct ape_be_launch *l, bool buffers, bool *k16, bool *v16)
{
	if (l->pages) {
		*k16 = *v16 = true;
		return;
	}
	*k16 = view_aligned(l, APE_BE_T_K, buffers ? l->k->ptr : 0, 16);
	*v16 = view_aligned(l, APE_BE_T_V, buffers ? l->v->ptr : 0, 16);
}

/* Is l ragged: its segments given (l->segs), or, in attention_scratch, said to come (nseg -1,
 * core/backend.h)? */
static bool ragged(const struct ape_be_launch *l)
{
	return l->segs || l->nseg < 0;
}

/* The query tiles of a ragged launch (struct ape_cu_prefill_args.segt): tiles of bq rows of one
 * segment each; without the segments (attention_scratch), at most one per row. */
static int64_t seg_tiles(const struct ape_be_launch *l, int64_t bq)
{
	int64_t n = 0;

	if (!l->segs)
		return l->Lq;
	for (int64_t s = 0; s < l->nseg; s++)
		n += (l->segs[s].lq + bq - 1) / bq;
	return n;
}

/*
 * Decode splits of a dense launch of nbkv (batch, kv head)s, `rows` query rows (B * H * Lq) of
 * D, whose last row sees `keys` keys: enough blocks to fill the GPU twice, each split at least
 * SPLIT_MIN_KEYS keys, their partials within SPLIT_MAX_BYTES; at least 1.
 */
static int64_t decode_splits(const struct ape__cu_device *cd, int64_t nbkv, int64_t rows,
			     int64_t keys, int64_t D)
{
	const size_t per_split = (size_t)rows * ((size_t)D + 4) * 4;
	int64_t s = (2 * (int64_t)cd->sm_count + nbkv - 1) / nbkv;

	if (s > (keys + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS)
		s = (keys + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS;
	if ((size_t)s * per_split > SPLIT_MAX_BYTES)
		s = (int64_t)(SPLIT_MAX_BYTES / per_split);
	return s < 1 ? 1 : s;
}

/* Segment g of a ragged launch as the decode splits it: as a dense launch of it alone (B = 1),
 * none without keys. */
static int64_t seg_splits(const struct ape__cu_device *cd, const struct ape_be_launch *l,
			  const struct ape_be_seg *g)
{
	if (g->lk < 1)
		return 0;
	const int64_t last = ape_sat_add(g->q_start - g->k_start, g->lq - 1);

	return decode_splits(cd, l->Hkv, l->H * g->lq, ape_visible_keys(last, g->lk, l->causal),
			     l->D);
}

/*
 * The most partial rows a ragged decode of l may hold: H * min(Lq * s, APE_DC_MAX_LQ *
 * (ceil(Lk / SPLIT_MIN_KEYS) + Lq)), s the most splits of one segment. The second term holds
 * for segments over disjoint keys (each segment's splits at most one per SPLIT_MIN_KEYS of its
 * keys, plus one); a launch whose segments share keys beyond it takes the prefill
 * (decode_ragged()), so that attention_scratch can bound a ragged launch by its shape alone.
 */
static int64_t ragged_prows_max(const struct ape__cu_device *cd, const struct ape_be_launch *l)
{
	const int64_t s = (2 * (int64_t)cd->sm_count + l->Hkv - 1) / l->Hkv;
	const int64_t a = l->Lq * s;
	const int64_t b = APE_DC_MAX_LQ * ((l->Lk + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS + l->Lq);

	return l->H * (a < b ? a : b);
}

/* Does the decode take ragged launch l (segments known): every segment at most
 * APE_DC_MAX_LQ rows, their partial rows within ragged_prows_max()? *prows, *blocks: those rows
 * and the grid's blocks. */
static bool decode_ragged(const struct ape__cu_device *cd, const struct ape_be_launch *l,
			  int64_t *prows, int64_t *blocks)
{
	int64_t r = 0, n = 0;

	if (!l->segs || l->nseg < 1)
		return false;
	for (int64_t e = 0; e < l->nseg; e++) {
		const int64_t sp = seg_splits(cd, l, &l->segs[e]);

		if (l->segs[e].lq > APE_DC_MAX_LQ)
			return false;
		r += l->H * l->segs[e].lq * sp;
		n += sp * l->Hkv;
	}
	*prows = r;
	*blocks = n;
	return r <= ragged_prows_max(cd, l);
}

/* positions: l's positions are those of the launch to run (not attention_scratch's shape) */
static void plan_launch(const struct ape__cu_device *cd, const struct ape_be_launch *l, bool k16,
			bool v16, bool diag, bool positions, struct cu_plan *p)
{
	const size_t esz = l->in_dtype == APE_F32 ? 4 : 2;

	memset(p, 0, sizeof(*p));
	p->total = 256; /* no region at offset 0 */
	p->vt = (int)l->in_dtype;
	/* a ragged launch takes the decode when each segment has a decode's rows (each segment
	 * split as if alone, skipping nothing), else the prefill kernel (docs/kernels.md, "Ragged
	 * launches") */
	p->decode = ragged(l) ? decode_ragged(cd, l, &p->prows, &p->dblocks)
			      : l->Lq <= APE_DC_MAX_LQ;
	p->diag = diag;
	p->skip = l->skip_tol > 0 && l->decay_nonneg && !(p->decode && ragged(l));
	p->variant = l->D == 64	   ? APE__CU_V_D64
		     : l->D == 128 ? APE__CU_V_D128
		     : l->D <= 128 ? APE__CU_V_G128
				   : APE__CU_V_G256;
	/* the decode kernels at D = 64 and 128 copy K and V rows with cp.async */
	if (p->decode && !(k16 && v16) && p->variant != APE__CU_V_G256)
		p->variant = APE__CU_V_G128;
	p->dmax = p->variant == APE__CU_V_D64 ? 64 : p->variant == APE__CU_V_G256 ? APE_MAX_D : 128;
	p->exact = l->D == p->dmax;
	p->nbkv = l->B * l->Hkv;
	p->rows = l->B * l->H * l->Lq;
	p->bk = p->decode ? APE_DC_NORM_TILE : APE_PF_BK(p->dmax);
	p->ntile = (l->Lk + p->bk - 1) / p->bk;
	if (l->Lk == 0) { /* strided, no key: ape_dmerge alone, and the heads' parameters */
		p->skip = false;
		if (l->H > APE_CU_INLINE_HEADS)
			p->hp = take(p, (size_t)l->H * 4 * sizeof(float));
		return;
	}
	if (l->bias_table) { /* the entries it reads, and the skip bounds' suffix maxima */
		p->tlen = ape__cu_bias_entries(l, positions);
		p->bias = take(p, ape__cu_bias_bytes(l, p->tlen, p->skip));
	}
	if (!p->decode) {
		p->need_kp = !(p->exact && l->in_dtype == APE_F32 && l->layout == APE_ROPE_HALF &&
			       k16);
		p->need_vp = !(p->exact && v16);
		if (p->need_kp)
			p->kp = take(p, (size_t)(p->nbkv * l->Lk) * (size_t)p->dmax * 4);
		if (p->need_vp)
			p->vp = take(p, (size_t)(p->nbkv * l->Lk) * (size_t)p->dmax * esz);
		if (ragged(l)) {
			p->nseg_tiles = seg_tiles(l, APE_PF_BQ(p->dmax));
			p->segt = take(p, (size_t)p->nseg_tiles * APE_PF_SEGW * sizeof(int64_t));
		}
	}
	if (p->skip) {
		p->ktile = take(p, (size_t)(p->nbkv * p->ntile) * 4);
		p->pre = take(p, (size_t)(p->nbkv * (p->ntile + 1)) * 4);
		p->suf = take(p, (size_t)(p->nbkv * (p->ntile + 1)) * 4);
	}
	if (l->H > APE_CU_INLINE_HEADS)
		p->hp = take(p, (size_t)l->H * 4 * sizeof(float));
	if (p->decode) {
		/* partial rows: every split's rows, or a ragged launch's segments' */
		size_t pr;

		if (ragged(l)) {
			pr = (size_t)p->prows;
			p->segt = take(p, (size_t)l->nseg * APE_DC_SEGW * sizeof(int64_t));
		} else {
			/* the keys the last row sees (the decode has rows) */
			p->splits = decode_splits(cd, p->nbkv, p->rows,
						  ape_visible_keys(l->q_start - l->k_start +
									   (l->Lq - 1),
								   l->Lk, l->causal),
						  l->D);
			pr = (size_t)p->splits * (size_t)p->rows;
		}
		if (p->skip)
			p->win = take(p, (size_t)p->nbkv * 2 * sizeof(int64_t));
		p->po = take(p, pr * (size_t)l->D * 4);
		p->pml = take(p, pr * 2 * 4);
		p->pp = take(p, pr * 8);
		if (p->diag)
			p->psd = take(p, pr * 2 * 4);
	}
}

/* What a ragged decode of l whose segments are not known yet (attention_scratch) may take:
 * ragged_prows_max()'s partial rows and a segment table of a segment per row. */
static uint64_t ragged_decode_scratch(const struct ape__cu_device *cd, const struct ape_be_launch *l)
{
	const size_t pr = (size_t)ragged_prows_max(cd, l);

	return 256 + align_up((size_t)l->Lq * APE_DC_SEGW * sizeof(int64_t)) +
	       (l->H > APE_CU_INLINE_HEADS ? align_up((size_t)l->H * 4 * sizeof(float)) : 0) +
	       (l->bias_table ? align_up(ape__cu_bias_bytes(l, l->bias_len, false)) : 0) +
	       align_up(pr * (size_t)l->D * 4) + align_up(pr * 2 * 4) + align_up(pr * 8) +
	       align_up(pr * 2 * 4);
}

uint64_t ape__cu_attention_scratch(struct ape_device *dev, const struct ape_be_launch *l)
{
	struct cu_plan p;
	bool k16, v16;

	if (l->B * l->H * l->Lq == 0 || (l->Lk == 0 && !l->strided))
		return 0;
	kv_aligned(l, false, &k16, &v16);
	/* the figure may not depend on the diagnostics (core/backend.h: only the shape, types,
	 * layout and skip_tol count): it includes the decode splits' diagnostic sums always */
	plan_launch(ape__cu_dev(dev), l, k16, v16, true, false, &p);
	/* a ragged launch whose segments are not known yet: the prefill's figure above, or the
	 * decode's, whichever is larger */
	if (ragged(l) && !l->segs && l->Lk > 0) {
		const uint64_t d = ragged_decode_scratch(ape__cu_dev(dev), l);

		p.total = d > p.total ? d : p.total;
	}
	/* shape-only: the separable path may take it (cuda_separable.c) */
	return p.total > ape__cu_separable_scratch(l) ? p.total : ape__cu_separable_scratch(l);
}

struct ape_cu_view ape__cu_view(const struct ape_be_launch *l, int t)
{
	const struct ape_be_view v = ape_be_launch_view(l, t);
	const struct ape_be_kv_pages *pg = l->pages;

	/* keys read in place: the views of the pages' (batch, kv head) bases and rows
	 * (struct ape_cu_pages, kernels/args.h) */
	if (pg && (t == APE_BE_T_K || t == APE_BE_T_V))
		return (struct ape_cu_view){ t == APE_BE_T_K ? pg->k_off : pg->v_off, pg->s_b,
					     pg->s_h, pg->s_row };
	return (struct ape_cu_view){ v.off, v.sb, v.sh, v.sl };
}

/* Where l's keys lie when read in place (bt 0: as their views say). */
static struct ape_cu_pages pages_of(const struct ape_be_launch *l)
{
	const struct ape_be_kv_pages *pg = l->pages;

	if (!pg)
		return (struct ape_cu_pages){ 0 };
	return (struct ape_cu_pages){ .table = pg->table ? pg->table->ptr : 0,
				      .bt = pg->block_tokens, .nblocks = pg->nblocks,
				      .first = pg->first_block, .row = pg->first_row,
				      .sblock = pg->s_block };
}

/* The rows of ape_prep's output in scratch: [B][Hkv][Lk][dmax]. */
static struct ape_cu_view scratch_view(const struct ape_be_launch *l, const struct cu_plan *p)
{
	return (struct ape_cu_view){ 0, l->Hkv * l->Lk * p->dmax, l->Lk * p->dmax, p->dmax };
}

/* What every kernel's ape_cu_common holds. */
static void fill_common(const struct ape_be_launch *l, const struct cu_plan *p, CUdeviceptr scratch,
			struct ape_cu_common *c)
{
	memset(c, 0, sizeof(*c));
	c->q = l->q->ptr;
	c->k = l->k->ptr;
	c->v = l->v->ptr;
	c->o = l->o->ptr;
	c->lse = l->lse ? l->lse->ptr : 0;
	c->pairs = l->pairs ? l->pairs->ptr : 0;
	c->ent = l->ent ? l->ent->ptr : 0;
	c->md = l->md ? l->md->ptr : 0;
	c->hparams = p->hp ? ape__cu_head_params_at(l, scratch + p->hp) : 0;
	c->Lq = l->Lq;
	c->Lk = l->Lk;
	c->rel = l->q_start - l->k_start;
	for (int i = 0; i < l->D / 2; i++)
		c->omega[i] = l->omega[i];
	c->scale = l->scale;
	/* the kernels split it between the two sides of the diagonal when not causal */
	c->tol = p->skip ? l->skip_tol : 0.0;
	/* earlier launches' LSE: rows may leave out the whole launch against it (skipping only) */
	if (p->skip && l->lse_prior && l->prior_tol > 0) {
		c->prior = l->lse_prior->ptr;
		c->prior_tol = l->prior_tol;
	}
	c->vq = ape__cu_view(l, APE_BE_T_Q);
	c->vk = ape__cu_view(l, APE_BE_T_K);
	c->vv = ape__cu_view(l, APE_BE_T_V);
	c->pg = pages_of(l);
	if (p->bias)
		c->bias = ape__cu_bias_at(l, p->tlen, p->skip, scratch + p->bias);
	c->vo = ape__cu_view(l, APE_BE_T_O);
	c->vlse = ape__cu_view(l, APE_BE_T_LSE);
	{
		const struct ape_be_view e = ape_be_launch_diag_view(l, 0), m = ape_be_launch_diag_view(l, 1);

		c->vent = (struct ape_cu_view){ e.off, e.sb, e.sh, e.sl };
		c->vmd = (struct ape_cu_view){ m.off, m.sb, m.sh, m.sl };
	}
	c->B = (int32_t)l->B;
	c->H = (int32_t)l->H;
	c->Hkv = (int32_t)l->Hkv;
	c->D = (int32_t)l->D;
	c->dt_in = (int32_t)l->in_dtype;
	c->dt_out = (int32_t)l->out_dtype;
	c->flags = (l->causal ? APE_CU_F_CAUSAL : 0) |
		   (l->layout == APE_ROPE_INTERLEAVED ? APE_CU_F_INTERLEAVED : 0) |
		   (l->lse ? APE_CU_F_LSE : 0) | (l->pairs ? APE_CU_F_PAIRS : 0) |
		   (p->skip ? APE_CU_F_SKIP : 0) |
		   (view_aligned(l, APE_BE_T_O, l->o->ptr, 2 * ape_dtype_size(l->out_dtype))
			    ? 0
			    : APE_CU_F_O_SCALAR) |
		   (l->pages && !pages_aligned(l, true) ? APE_CU_F_KV_CHECK : 0);
	if (l->H <= APE_CU_INLINE_HEADS)
		memcpy(c->hp, l->head_params, (size_t)l->H * 4 * sizeof(float));
}

static void CUDA_CB cu_free_host(void *p)
{
	free(p);
}

CUdeviceptr ape__cu_head_params_at(const struct ape_be_launch *l, CUdeviceptr slot)
{
	/* the call's float32 table (struct ape_be_launch.params): omega first, then the heads' */
	if (l->params[1])
		return l->params[1]->ptr + (CUdeviceptr)(l->D / 2) * sizeof(float);
	return slot;
}

/* Copies `bytes` of host memory at `copy` (ape_be_malloc()'ed: this takes it and frees it,
 * whatever happens) to dst on q's stream, which frees it once the copy has run. */
int ape__cu_upload_owned(struct ape_be_queue *q, CUdeviceptr dst, void *copy, size_t bytes,
			 const char *what)
{
	const struct ape__cu_driver *drv = ape__cu_dev(q->dev)->drv;
	CUresult r = drv->p_cuMemcpyHtoDAsync(dst, copy, bytes, q->s);

	if (r != CUDA_SUCCESS) {
		free(copy);
		return ape__cu_error(r, q->dev, "cuMemcpyHtoDAsync (%s)", what);
	}
	r = drv->p_cuLaunchHostFunc(q->s, cu_free_host, copy);
	if (r != CUDA_SUCCESS) {
		/* the copy may still read it: wait for it before freeing */
		drv->p_cuStreamSynchronize(q->s);
		free(copy);
		return ape__cu_error(r, q->dev, "cuLaunchHostFunc");
	}
	return 0;
}

/* More heads than the argument struct carries: their parameters go through the scratch, unless
 * the core uploaded the call's table (ape__cu_head_params_at()). */
int ape__cu_upload_head_params(struct ape_be_queue *q, const struct ape_be_launch *l, CUdeviceptr dst)
{
	const size_t bytes = (size_t)l->H * 4 * sizeof(float);
	void *copy = ape_be_malloc(bytes);

	if (!copy)
		return ape_be_error(APE_ENOMEM, "cuda: out of host memory for %lld heads' parameters",
				  (long long)l->H);
	memcpy(copy, l->head_params, bytes);
	return ape__cu_upload_owned(q, dst, copy, bytes, "head parameters");
}

/* The rows of l's distance-bias table: one per head, or one shared by all. */
static size_t bias_rows(const struct ape_be_launch *l)
{
	return l->bias_hstride ? (size_t)l->H : 1;
}

int64_t ape__cu_bias_entries(const struct ape_be_launch *l, bool positions)
{
	return positions ? ape_be_bias_entries(l) : l->bias_len;
}

size_t ape__cu_bias_bytes(const struct ape_be_launch *l, int64_t n, bool smax)
{
	return (smax ? 2 : 1) * bias_rows(l) * (size_t)n * sizeof(float);
}

struct ape_cu_bias ape__cu_bias_at(const struct ape_be_launch *l, int64_t n, bool smax,
				   CUdeviceptr dst)
{
	const size_t all = bias_rows(l) * (size_t)n;

	return (struct ape_cu_bias){ .tab = dst, .smax = smax ? dst + all * sizeof(float) : 0,
				     .len = n, .hstride = l->bias_hstride ? n : 0 };
}

int ape__cu_upload_bias(struct ape_be_queue *q, const struct ape_be_launch *l, int64_t n,
			bool smax, CUdeviceptr dst)
{
	const size_t rows = bias_rows(l), all = rows * (size_t)n;
	const size_t bytes = ape__cu_bias_bytes(l, n, smax);
	float *copy = ape_be_malloc(bytes);

	if (!copy)
		return ape_be_error(APE_ENOMEM, "cuda: out of host memory for a distance-bias table "
				  "of %zu entries", all);
	for (size_t h = 0; h < rows; h++) { /* each row's first n entries */
		memcpy(copy + h * (size_t)n, l->bias_table + h * (size_t)l->bias_hstride,
		       (size_t)n * sizeof(float));
		if (smax)
			memcpy(copy + all + h * (size_t)n, l->bias_smax + h * (size_t)l->bias_hstride,
			       (size_t)n * sizeof(float));
	}
	return ape__cu_upload_owned(q, dst, copy, bytes, "distance-bias table");
}

/* Sorts segment-table entries (APE_PF_SEGW values and their cost) by cost, largest first, then
 * by their first row. */
static int seg_heavier(const void *a, const void *b)
{
	const int64_t *x = a, *y = b;

	if (x[APE_PF_SEGW] != y[APE_PF_SEGW])
		return x[APE_PF_SEGW] > y[APE_PF_SEGW] ? -1 : 1;
	return x[0] + x[5] < y[0] + y[5] ? -1 : x[0] + x[5] > y[0] + y[5];
}

/*
 * A ragged launch's segment table (struct ape_cu_prefill_args.segt), p->nseg_tiles entries of
 * tiles of bq rows, uploaded to dst: the heaviest tiles first (causal: by the keys the tile's
 * last row sees, else the segment's keys), as the dense grid runs its last tiles first.
 */
static int upload_seg_table(struct ape_be_queue *q, const struct ape_be_launch *l,
			    const struct cu_plan *p, int64_t bq, CUdeviceptr dst)
{
	const size_t w = APE_PF_SEGW + 1, n = (size_t)p->nseg_tiles;
	int64_t *t = ape_be_malloc(n * w * sizeof(int64_t) + 1);
	size_t e = 0;

	if (!t)
		return ape_be_error(APE_ENOMEM, "cuda: out of host memory for the tables of %lld "
				  "segments", (long long)l->nseg);
	for (int64_t s = 0; s < l->nseg; s++) {
		const struct ape_be_seg *g = &l->segs[s];
		/* the distance of (row q0, key k0): one pair's, so it fits; any without keys */
		const int64_t rel = g->lk ? g->q_start - g->k_start : 0;

		for (int64_t i0 = 0; i0 < g->lq; i0 += bq, e++) {
			const int64_t last = (i0 + bq < g->lq ? i0 + bq : g->lq) - 1;
			const int64_t cost = l->causal ? ape_visible_keys(ape_sat_add(rel, last),
									 g->lk, 1)
						       : g->lk;
			const int64_t x[APE_PF_SEGW + 1] = { g->q0, g->lq, g->k0, g->lk,
							     rel, i0, cost };

			memcpy(t + e * w, x, sizeof(x));
		}
	}
	qsort(t, n, w * sizeof(int64_t), seg_heavier);
	for (size_t k = 1; k < n; k++) /* the costs dropped: APE_PF_SEGW values an entry */
		memmove(t + k * APE_PF_SEGW, t + k * w, APE_PF_SEGW * sizeof(int64_t));
	return ape__cu_upload_owned(q, dst, t, n * APE_PF_SEGW * sizeof(int64_t), "segment table");
}

/* A ragged decode's segment table (kernels/args.h, APE_DC_SEGW) to dst: each segment's rows,
 * keys, distance, splits (seg_splits()), partial rows and first block, in the launch's order. */
static int upload_decode_segs(struct ape_be_queue *q, const struct ape_be_launch *l, CUdeviceptr dst)
{
	const struct ape__cu_device *cd = ape__cu_dev(q->dev);
	int64_t *t = ape_be_malloc((size_t)l->nseg * APE_DC_SEGW * sizeof(int64_t));
	int64_t poff = 0, blk0 = 0;

	if (!t)
		return ape_be_error(APE_ENOMEM, "cuda: out of host memory for the table of %lld "
				  "segments", (long long)l->nseg);
	for (int64_t e = 0; e < l->nseg; e++) {
		const struct ape_be_seg *g = &l->segs[e];
		const int64_t sp = seg_splits(cd, l, g);
		/* the distance of (row q0, key k0): one pair's, so it fits; any without keys */
		const int64_t rel = g->lk ? g->q_start - g->k_start : 0;
		const int64_t x[APE_DC_SEGW] = { g->q0, g->lq, g->k0, g->lk, rel, sp, poff, blk0 };

		memcpy(t + e * APE_DC_SEGW, x, sizeof(x));
		poff += l->H * g->lq * sp;
		blk0 += sp * l->Hkv;
	}
	return ape__cu_upload_owned(q, dst, t, (size_t)l->nseg * APE_DC_SEGW * sizeof(int64_t),
			    "decode segment table");
}

/* The skip pre-pass and the prefill's K/V conversion. */
int ape__cu_prep_keys(struct ape_be_queue *q, const struct ape_be_launch *l,
		      const struct ape__cu_prep *p)
{
	const int64_t nbkv = l->B * l->Hkv;
	struct ape_cu_prep_args a;
	struct ape_cu_scan_args s;
	int ret;

	memset(&a, 0, sizeof(a));
	a.k = l->k->ptr;
	a.v = l->v->ptr;
	a.kp = p->kp;
	a.vp = p->vp;
	a.ktile = p->ktile;
	a.Lk = l->Lk;
	a.nbkv = nbkv;
	a.ntile = p->ntile;
	a.D = (int32_t)l->D;
	a.dmax = p->dmax;
	a.tile = (int32_t)p->tile;
	a.dt = (int32_t)l->in_dtype;
	a.interleaved = l->layout == APE_ROPE_INTERLEAVED;
	a.vk = ape__cu_view(l, APE_BE_T_K);
	a.vv = ape__cu_view(l, APE_BE_T_V);
	a.pg = pages_of(l);
	a.Hkv = (int32_t)l->Hkv;
	ret = ape__cu_launch(q, APE__CU_K_PREP, nbkv * p->ntile, APE_CU_PREP_SMEM, &a, "ape_prep");
	if (ret || !p->ktile)
		return ret;
	memset(&s, 0, sizeof(s));
	s.ktile = p->ktile;
	s.pre = p->pre;
	s.suf = p->suf;
	s.ntile = p->ntile;
	s.nbkv = nbkv;
	return ape__cu_launch(q, APE__CU_K_SCAN, (nbkv + APE_CU_THREADS - 1) / APE_CU_THREADS, 0, &s,
			      "ape_kscan");
}

static int run_prep(struct ape_be_queue *q, const struct ape_be_launch *l, const struct cu_plan *p,
		    CUdeviceptr scratch)
{
	const struct ape__cu_prep pp = {
		.kp = p->need_kp ? scratch + p->kp : 0,
		.vp = p->need_vp ? scratch + p->vp : 0,
		.ktile = p->skip ? scratch + p->ktile : 0,
		.pre = p->skip ? scratch + p->pre : 0,
		.suf = p->skip ? scratch + p->suf : 0,
		.ntile = p->ntile,
		.tile = p->bk,
		.dmax = p->dmax,
	};

	if (!p->need_kp && !p->need_vp && !p->skip)
		return 0;
	return ape__cu_prep_keys(q, l, &pp);
}

static int run_prefill(struct ape_be_queue *q, const struct ape_be_launch *l, const struct cu_plan *p,
		       CUdeviceptr scratch)
{
	struct ape_cu_prefill_args a;
	const int64_t bq = APE_PF_BQ(p->dmax);

	memset(&a, 0, sizeof(a));
	fill_common(l, p, scratch, &a.c);
	a.kp = p->need_kp ? scratch + p->kp : l->k->ptr;
	a.vp = p->need_vp ? scratch + p->vp : l->v->ptr;
	a.vkp = p->need_kp ? scratch_view(l, p) : ape__cu_view(l, APE_BE_T_K);
	a.vvp = p->need_vp ? scratch_view(l, p) : ape__cu_view(l, APE_BE_T_V);
	/* keys read in place: K and V rows the kernel reads itself, not ape_prep's copies of them
	 * (which ape_prep made through the pages), lie where the pages put them */
	if (l->pages)
		a.paged = (p->need_kp ? 0 : APE_PF_K_PAGES) | (p->need_vp ? 0 : APE_PF_V_PAGES);
	a.pre = p->skip ? scratch + p->pre : 0;
	a.suf = p->skip ? scratch + p->suf : 0;
	a.nqt = (l->Lq + bq - 1) / bq;
	a.ntk = (l->Lk + APE_PF_BK(p->dmax) - 1) / APE_PF_BK(p->dmax);
	if (l->segs) { /* a block per query tile of one segment */
		int ret = upload_seg_table(q, l, p, bq, scratch + p->segt);

		if (ret)
			return ret;
		a.segt = scratch + p->segt;
		a.nqt = p->nseg_tiles;
	}
	return ape__cu_launch(q, ape__cu_kernel_index(false, p->variant, p->vt, p->diag),
			      a.nqt * l->B * l->H, (unsigned)APE_PF_SMEM(p->dmax, p->vt), &a,
			      "prefill");
}

/* ape_dmerge over `splits` partial results in the scratch (0: none, every row has no key). */
static int run_merge(struct ape_be_queue *q, const struct ape_be_launch *l, const struct cu_plan *p,
		     CUdeviceptr scratch, int64_t splits)
{
	struct ape_cu_merge_args mg;

	memset(&mg, 0, sizeof(mg));
	fill_common(l, p, scratch, &mg.c);
	mg.part_o = splits ? scratch + p->po : 0;
	mg.part_ml = splits ? scratch + p->pml : 0;
	mg.part_pairs = splits ? scratch + p->pp : 0;
	mg.part_sd = splits && p->diag ? scratch + p->psd : 0;
	mg.splits = splits;
	mg.rows = p->rows;
	if (splits && p->segt && p->decode) { /* a ragged decode: each row's splits its segment's */
		mg.segt = scratch + p->segt;
		mg.nseg = l->nseg;
	}
	return ape__cu_launch(q, p->diag ? APE__CU_K_MERGE_DIAG : APE__CU_K_MERGE,
			      (p->rows + APE_CU_THREADS / 32 - 1) / (APE_CU_THREADS / 32), 0, &mg,
			      "ape_dmerge");
}

static int run_decode(struct ape_be_queue *q, const struct ape_be_launch *l, const struct cu_plan *p,
		      CUdeviceptr scratch)
{
	struct ape_cu_decode_args a;
	int ret;

	if (p->skip) {
		struct ape_cu_window_args w;

		memset(&w, 0, sizeof(w));
		fill_common(l, p, scratch, &w.c);
		w.pre = scratch + p->pre;
		w.suf = scratch + p->suf;
		w.window = scratch + p->win;
		w.ntile = p->ntile;
		ret = ape__cu_launch(q, APE__CU_K_WINDOW, p->nbkv, APE_DC_WINDOW_SMEM, &w,
				     "ape_dwindow");
		if (ret)
			return ret;
	}
	memset(&a, 0, sizeof(a));
	fill_common(l, p, scratch, &a.c);
	a.window = p->skip ? scratch + p->win : 0;
	a.part_o = scratch + p->po;
	a.part_ml = scratch + p->pml;
	a.part_pairs = scratch + p->pp;
	a.part_sd = p->diag ? scratch + p->psd : 0;
	a.splits = p->splits;
	if (l->segs) { /* ragged: a block per (segment, kv head, split), as the table says */
		ret = upload_decode_segs(q, l, scratch + p->segt);
		if (ret)
			return ret;
		a.segt = scratch + p->segt;
		a.nseg = l->nseg;
		a.splits = p->dblocks;
		if (!p->dblocks) /* no segment has a key: the merge alone writes every row */
			return run_merge(q, l, p, scratch, 1);
	}
	ret = ape__cu_launch(q, ape__cu_kernel_index(true, p->variant, p->vt, p->diag),
			     l->segs ? p->dblocks : p->splits * p->nbkv,
			     (unsigned)APE_DC_SMEM(p->dmax, p->vt, p->exact, p->diag), &a, "decode");
	if (ret)
		return ret;
	return run_merge(q, l, p, scratch, l->segs ? 1 : p->splits);
}

/* No key at all: O = 0, LSE = -inf, no pairs, ENT = MD = 0, by fills. */
static int run_empty(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	const size_t rows = (size_t)(l->B * l->H * l->Lq);
	const size_t ob = rows * (size_t)l->D * ape_dtype_size(l->out_dtype);
	int ret = ape__cu_fill(q, l->o, 0, 0u, ob & ~(size_t)3);

	/* an odd count of 16-bit elements leaves 2 bytes: O's size is even in elements (D is) */
	if (!ret && l->lse)
		ret = ape__cu_fill(q, l->lse, 0, 0xff800000u, rows * 4);
	if (!ret && l->pairs)
		ret = ape__cu_fill(q, l->pairs, 0, 0u, rows * 8);
	if (!ret && l->ent) /* contiguous: a strided launch goes through ape_dmerge_diag */
		ret = ape__cu_fill(q, l->ent, 0, 0u, rows * 4);
	if (!ret && l->md)
		ret = ape__cu_fill(q, l->md, 0, 0u, rows * 4);
	return ret;
}

static int check_launch(const struct ape_device *dev, const struct ape_be_launch *l)
{
	if (l->D < 2 || l->D > APE_MAX_D || l->D % 2 || l->B < 1 || l->H < 1 || l->Hkv < 1 ||
	    l->H % l->Hkv || l->Lq < 0 || l->Lk < 0 || (unsigned)l->in_dtype > APE_BF16 ||
	    (l->out_dtype != l->in_dtype && l->out_dtype != APE_F32))
		return ape_be_error(APE_EINVAL,
				  "cuda %s: launch B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld "
				  "is not one the kernels take",
				  dev->info.name, (long long)l->B, (long long)l->H, (long long)l->Hkv,
				  (long long)l->Lq, (long long)l->Lk, (long long)l->D);
	/* rows, keys and heads are 32-bit inside the kernels; no GPU holds more in one launch */
	if (l->Lq > INT32_MAX || l->Lk > INT32_MAX || l->B * l->H > INT32_MAX ||
	    (l->H / l->Hkv) * APE_DC_MAX_LQ > INT32_MAX)
		return ape_be_error(APE_EINVAL,
				  "cuda %s: Lq=%lld, Lk=%lld: more rows than one launch takes "
				  "(2^31 - 1); use smaller chunks",
				  dev->info.name, (long long)l->Lq, (long long)l->Lk);
	/* the caller's memory (wrapped buffers): each tensor at its elements' own alignment */
	for (int t = 0; t < APE_BE_T_COUNT; t++) {
		static const char *const names[APE_BE_T_COUNT] = { "q", "k", "v", "o", "lse" };
		const struct ape_be_buf *b = t == APE_BE_T_Q ? l->q : t == APE_BE_T_K ? l->k
					   : t == APE_BE_T_V ? l->v : t == APE_BE_T_O ? l->o : l->lse;
		const size_t esz = t == APE_BE_T_LSE ? 4 : ape_dtype_size(t == APE_BE_T_O ? l->out_dtype
										     : l->in_dtype);

		/* keys read in place: their views are the pages' (below) */
		if (l->pages && (t == APE_BE_T_K || t == APE_BE_T_V))
			continue;
		if (b && !view_aligned(l, t, b->ptr, esz))
			return ape_be_error(APE_EINVAL,
					  "cuda %s: %s at 0x%llx + %lld elements is not aligned to "
					  "its %zu-byte elements",
					  dev->info.name, names[t], (unsigned long long)b->ptr,
					  (long long)ape_be_launch_view(l, t).off, esz);
	}
	if (l->pages) {
		const uint64_t esz = ape_dtype_size(l->in_dtype);
		const struct ape_be_kv_pages *pg = l->pages;

		if (((uint64_t)l->k->ptr + (uint64_t)pg->k_off * esz) % esz ||
		    ((uint64_t)l->v->ptr + (uint64_t)pg->v_off * esz) % esz)
			return ape_be_error(APE_EINVAL,
					  "cuda %s: the pages of k or v are not aligned to their "
					  "%llu-byte elements",
					  dev->info.name, (unsigned long long)esz);
	}
	/* ent and md: float views (in elements), so the buffer's base decides */
	for (int w = 0; w < 2; w++) {
		const struct ape_be_buf *b = w ? l->md : l->ent;

		if (b && b->ptr % 4)
			return ape_be_error(APE_EINVAL,
					  "cuda %s: %s at 0x%llx is not aligned to its 4-byte elements",
					  dev->info.name, w ? "md" : "ent",
					  (unsigned long long)b->ptr);
	}
	return 0;
}

/*
 * attention_pages (core/backend.h, ABI 9): the decode and the prefill read keys in place,
 * through struct ape_be_kv_pages (the ring of blocks, a page table of block numbers or of
 * element offsets with blocks of one token, any strides: kernels/args.h, struct ape_cu_pages),
 * for
 *   - dense launches of 1 to APE_DC_MAX_LQ query rows (the decode), skipping as the same
 *     launch gathered would (ape_prep and ape_dwindow read the pages too), diagnostics or not;
 *   - dense launches of more rows (the prefill: ape_prep converts K and pads V through the
 *     pages where the gathered launch has it do so, the kernel reads the rest of K's and V's
 *     rows through them, APE_PF_K_PAGES and APE_PF_V_PAGES), skipping and diagnostics as
 *     gathered, unless the separable path may take the gathered launch (lambda = 0 on some
 *     head: cuda_separable.c reads no pages);
 *   - ragged launches (l->segs known) whose every segment has 1 to APE_DC_MAX_LQ rows and whose
 *     partials stay within ragged_prows_max() (segments over disjoint keys always do): one
 *     launch, each segment split as a dense launch of it alone; a ragged decode skips nothing,
 *     gathered or in place;
 * with at least one key, no explicit positions, a shape check_launch() takes. These are the
 * launches the decode and the prefill take gathered too, and they run the same kernel variant
 * on them (the cp.async copies, each misaligned row copied with plain loads instead: the same
 * bytes in shared memory), so a launch gives the same bits in place or gathered. Every other
 * launch: false (the core gathers). Reads the shape, segments, positions, options and the
 * heads' lambda only.
 */
bool ape__cu_attention_pages(struct ape_device *dev, const struct ape_be_launch *l)
{
	int64_t prows, blocks;

	if (!l->pages || l->pos_q || l->pos_k || l->Lk < 1 || l->Lq < 1 || l->D < 2 ||
	    l->D > APE_MAX_D || l->D % 2 || l->B < 1 || l->H < 1 || l->Hkv < 1 || l->H % l->Hkv ||
	    (unsigned)l->in_dtype > APE_BF16 ||
	    (l->out_dtype != l->in_dtype && l->out_dtype != APE_F32) || l->Lq > INT32_MAX ||
	    l->Lk > INT32_MAX || l->B * l->H > INT32_MAX ||
	    (l->H / l->Hkv) * APE_DC_MAX_LQ > INT32_MAX)
		return false;
	if (l->segs || l->nseg)
		return decode_ragged(ape__cu_dev(dev), l, &prows, &blocks);
	return l->Lq <= APE_DC_MAX_LQ || !ape__cu_separable_may_apply(l);
}

int ape__cu_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	struct ape__cu_device *cd = ape__cu_dev(q->dev);
	CUdeviceptr scratch = 0;
	struct cu_plan p;
	bool k16, v16;
	int ret, ret2;

	ret = check_launch(q->dev, l);
	if (ret || l->B * l->H * l->Lq == 0)
		return ret;
	ret = ape__cu_enter(q->dev);
	if (ret)
		return ret;
	if (l->Lk == 0 && !l->strided) {
		ape_be_path_note(l->path, APE_BE_PATH_EMPTY, "no key");
		ret = run_empty(q, l);
		goto out_leave;
	}
	ret = ape__cu_module(q->dev);
	if (ret)
		goto out_leave;
	/* (the separable path keeps no diagnostics: sep_shape() turns launches with them away, and
	 * they take the _diag kernels below; docs/diagnostics.md, "CUDA") */
	/* (neither takes a decode's rows, nor a launch with pages: ape__cu_attention_pages()) */
	if (l->Lk > 0 && !l->pages && ape__cu_separable_applies(l)) {
		ape_be_path_note(l->path, APE_BE_PATH_SEPARABLE, "lambda = 0 on every head");
		ret = ape__cu_separable(q, l,
					!view_aligned(l, APE_BE_T_O, l->o->ptr,
						      2 * ape_dtype_size(l->out_dtype)));
		goto out_leave;
	}
	/* by runs of kv groups, each as above */
	if (l->Lk > 0 && !l->pages && ape__cu_split_applies(l)) {
		ape_be_path_note(l->path, APE_BE_PATH_SPLIT,
			       "lambda = 0 on some heads only: runs of heads, each on its path");
		ret = ape__cu_split(q, l);
		goto out_leave;
	}
	kv_aligned(l, true, &k16, &v16);
	plan_launch(cd, l, k16, v16, l->ent || l->md, true, &p);
	if (l->Lk == 0)
		ape_be_path_note(l->path, APE_BE_PATH_EMPTY, "no key");
	else if (p.decode)
		ape_be_path_note(l->path, l->pages ? APE_BE_PATH_PAGES : APE_BE_PATH_DECODE,
			       l->pages ? "keys read where the KV cache keeps them"
					: "a few query rows: keys split over the device, merged by LSE");
	else if (l->segs)
		ape_be_path_note(l->path, APE_BE_PATH_RAGGED, "a ragged batch: one segment table");
	else
		ape_be_path_note(l->path, APE_BE_PATH_GENERAL, ape_be_launch_general_why(l));
	ret = ape__cu_scratch_alloc(q, p.total, &scratch);
	if (ret)
		goto out_leave;
	if (p.hp && !l->params[1])
		ret = ape__cu_upload_head_params(q, l, scratch + p.hp);
	if (!ret && p.bias)
		ret = ape__cu_upload_bias(q, l, p.tlen, p.skip, scratch + p.bias);
	if (!ret && l->Lk == 0)
		ret = run_merge(q, l, &p, scratch, 0);
	else if (!ret)
		ret = run_prep(q, l, &p, scratch);
	if (!ret && l->Lk > 0)
		ret = p.decode ? run_decode(q, l, &p, scratch) : run_prefill(q, l, &p, scratch);
	ret2 = ape__cu_scratch_free(q, scratch);
	ret = ret ? ret : ret2;
out_leave:
	ape__cu_leave(q->dev);
	return ret;
}
