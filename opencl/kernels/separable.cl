/* SPDX-License-Identifier: MIT */
/*
 * The separable path (docs/kernels.md, "Decode and the separable path"), OpenCL C 1.2.
 *
 * For launches whose every head has lambda = 0 (alpha = 1, temp = 1): plain RoPE, ALiBi-style,
 * or any decays delta, beta, gamma: the rotation by n = (rel + i) - j separates into the query's at
 * rel + i and the key's at j, so Q and K are rotated once (ape_sep_rot_q, ape_sep_rot_k: O(L D)
 * into scratch: Q scaled and transposed per block of 16 rows so that the rows are the lanes of
 * one float16, K in pair-split order, V as float32), and the scores are a plain matrix product
 * plus the bias relative to the row's anchor: -delta (|n| - |n_anchor|) when delta is the only
 * decay, else from a per-distance table (ape_sep_btab: bias(|n|) in APE_REAL, the caller's
 * distance-bias table added in, each tile taking its 31 distances relative to its own
 * reference, as the general kernel's tile tables do; the skip bound adds the caller's table's
 * suffix maximum).
 * ape_sep_attn gives one work-item SEP_NB blocks of SEP_BQ = 16 query
 * rows (the lanes) and walks steps of SEP_SK = 32 keys (two key tiles of SEP_BK = 16): the 16
 * score vectors of a tile stay in registers over the D loop (one Q vector load, 16 FMAs with a
 * broadcast key element per d; sep_tile(), without masks nor finiteness tests except on masked
 * steps or after an infinite score), then the online softmax runs lane-wise (no horizontal
 * reduction, one rescale per step, none where no lane's maximum moved), then P V in chunks of
 * 16 output columns held in registers. Causal launches walk from the
 * diagonal backward and, when skipping is allowed, stop once every row of the block has proved
 * the rest negligible (ape_may_skip, with per-tile key norms from ape_sep_rot_k).
 * Built after attention.cl and decode.cl in one program (ld(), st(), dec_ld16(), dec_seed16()).
 *
 * Segments (ragged launches, core/backend.h struct ape_be_seg): every kernel reads its segment's
 * entry in a table the host builds (ocl_separable.c; a dense launch is one segment, the same in
 * each of its B batches) and then runs the dense code with that segment's rows, keys and rel.
 * The scratch rows of each segment are padded to SEP_BQ and its keys to SEP_BK, so that no row
 * block nor key tile straddles two segments; the tile norms' prefix maxima and the bias table
 * are per segment too. A ragged launch's rotations take their sines and cosines from a table
 * per position (FS_TRIG, ape_sep_trig: the values the per-row seeds give), and in the CPU shape
 * its segments of at most one key tile skip the scratch: ape_sep_small rotates and computes
 * them in private memory. The CPU shape's rotation kernels (and ape_sep_small) sweep a block's
 * rows token by token across several heads: in packed [total, H, D] tensors a token's heads
 * lie together, and one head's rows apart (read head by head, their misses came one at a time).
 */

#define SEP_BQ 16 /* query rows per work-item (ocl_separable.c mirrors it) */
#define SEP_BK 16 /* keys per tile: one float16 */
#define SEP_NB 4 /* row blocks per work-item, sharing each key tile (ocl_separable.c) */
#define SEP_KS 2 /* key tiles per step of ape_sep_attn (one online-softmax update) */
#define SEP_SK (SEP_KS * SEP_BK) /* keys per step */

#define FS_SKIP 256 /* ocl_fast.h */
/* a head has beta or gamma != 0, or the launch a distance-bias table: the bias comes from
 * ape_sep_btab's table */
#define FS_BIAS 512
#define FS_TRIG 1024 /* the rotation's sines and cosines from ape_sep_trig's table per position */

/* The segment table (ocl_separable.c, sep_plan_make()): SEP_SW longs per segment. */
#define SG_Q0 0 /* its first query row in the launch */
#define SG_LQ 1 /* its query rows (>= 1) */
#define SG_QP 2 /* its first row in the padded scratch rows (Qt, qn): a multiple of SEP_BQ */
#define SG_K0 3 /* its first key in the launch */
#define SG_LK 4 /* its keys (0: its rows see none) */
#define SG_TP 5 /* its first tile in the padded scratch keys (Kr, Vf, ktile); kpre's at TP + s */
#define SG_REL 6 /* q_start - k_start: its query row i lies at rel + i, its key j at j */
#define SG_BE 7 /* its first entry in the bias table (FS_BIAS) */
#define SG_TQ 8 /* FS_TRIG: the trig table's row of its query row 0 (position rel) */
#define SG_TK 9 /* FS_TRIG: the trig table's row of its key 0 (position 0) */
#define SG_NT 10 /* its tiles in the scratch: 0 for a segment ape_sep_small computes */
#define SEP_SW 11

/* The padded length of n rows or keys (SEP_BQ = SEP_BK). */
#define SEP_PAD(n) (((n) + SEP_BK - 1) / SEP_BK * SEP_BK)

__constant int sep_iota[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };

/* ape_bias(), the same value exactly, without its log1p and sqrt where beta and gamma are 0 (a
 * row's c_row costs one multiply then). */
KFN APE_REAL sep_bias(APE_REAL delta, APE_REAL beta, APE_REAL gamma, APE_REAL an)
{
	return beta == 0 && gamma == 0 ? -delta * an : ape_bias(delta, beta, gamma, an);
}

/* The far-key bound's frame for a row of head h (ape_may_skip()'s crow argument, as
 * attention.cl's bound_frame()): c_row lowered by the distance-bias table's suffix maximum at the
 * keys' nearest distance an (BSM: [heads][blen], head stride bhs), c_row itself without a table
 * (blen 0). */
KFN APE_REAL sep_bound_frame(__global const float *BSM, long blen, long bhs, int h, APE_REAL crow,
			     long an)
{
	return blen ? crow - (APE_REAL)BSM[h * bhs + ape_bias_index(an, blen)] : crow;
}

/* In place: m[0..15], the rows of a 16 x 16 matrix, become its columns (four rounds of
 * two-vector shuffles, swapping blocks of 8, 4, 2, then 1 lanes across the diagonal). */
KFN void sep_tr16(float16 *m)
{
	const uint16 lo[4] = { (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
			       (uint16)(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
			       (uint16)(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
			       (uint16)(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) };
	const uint16 hi[4] = { (uint16)(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
			       (uint16)(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31),
			       (uint16)(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
			       (uint16)(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31) };

#pragma unroll
	for (int r = 0; r < 4; r++) {
		const int k = 8 >> r;

#pragma unroll
		for (int i = 0; i < 16; i++)
			if (!(i & k)) {
				const float16 a = m[i], b = m[i + k];

				m[i] = shuffle2(a, b, lo[r]);
				m[i + k] = shuffle2(a, b, hi[r]);
			}
	}
}

/* 16 values of an output row at element i of O, in its storage type (st() 16 times). */
KFN void sep_st16(__global void *p, long i, float16 x, int dt)
{
	if (dt == DT_F16) {
		vstore_half16_rte(x, 0, (__global half *)p + i);
	} else if (dt == DT_BF16) {
		float t[16];

		vstore16(x, 0, t);
		for (int k = 0; k < 16; k++)
			((__global ushort *)p)[i + k] = to_bf16(t[k]);
	} else {
		vstore16(x, 0, (__global float *)p + i);
	}
}

/* sin and cos of the angle of position pos (dense launches: seeded here) or of the trig table's
 * row tr (FS_TRIG: the same values, ape_sep_trig seeded them), for the pairs 16c .. 16c+15. */
KFN float16 sep_sincos(__global const APE_REAL *prm, __global const float *trig, int D, int flags,
		       int c, long pos, long tr, float16 *co)
{
	if (flags & FS_TRIG) {
		*co = vload16(0, trig + tr * DEC_DIM + 16 * c);
		return vload16(0, trig + tr * DEC_DIM + DEC_DIM / 2 + 16 * c);
	}
	return dec_seed16(prm, c, (APE_REAL)pos, 1, co);
}

/* The trig table (ragged launches): row r holds the cosines, then the sines, of the D / 2 pairs
 * at position sgt[po + r], exactly as dec_seed16 gives them where a dense launch seeds each
 * row. */
__kernel void ape_sep_trig(__global const APE_REAL *prm, int D, __global const long *sgt,
			   long po, long ntrig, __global float *trig)
{
	const long r = get_global_id(0);
	const int C = DEC_DIM / 32;

	if (r >= ntrig)
		return;
	for (int c = 0; c < C; c++) {
		float16 co, si = dec_seed16(prm, c, (APE_REAL)sgt[po + r], 1, &co);

		vstore16(co, 0, trig + r * DEC_DIM + 16 * c);
		vstore16(si, 0, trig + r * DEC_DIM + DEC_DIM / 2 + 16 * c);
	}
}

/* ape_sep_rot_q for the work-group shape (ocl_separable.c; its arguments, hb unused): one
 * scratch row i (of Lqp; ix[i / SEP_BQ] its segment) of head bh per work-item, in work-groups of
 * 16 (a block), written transposed in place; the same values. */
__kernel void ape_sep_rot_q1(__global const void *Q, __global const APE_REAL *prm, long qoff,
			     long qsb, long qsh, long qsl, int D, long Lqp, int H, int hb,
			     float scale, int flags, __global float *Qt, __global float *qn,
			     __global const long *sgt, __global const int *ix,
			     __global const float *trig)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	__global float *out = Qt + (bh * Lqp + i / SEP_BQ * SEP_BQ) * DEC_DIM + i % SEP_BQ;

	if (i >= Lqp)
		return;
	{
		__global const long *sg = sgt + SEP_SW * ix[i / SEP_BQ];
		const long il = i - sg[SG_QP], rel = sg[SG_REL], tq = sg[SG_TQ] + il;

		if (il >= sg[SG_LQ] || sg[SG_LK] == 0) {
			for (int d = 0; d < DEC_DIM; d++)
				out[d * SEP_BQ] = 0.0f;
			qn[bh * Lqp + i] = 0.0f;
			return;
		}
		{
			const long base = qoff + bh / H * qsb + bh % H * qsh + (sg[SG_Q0] + il) * qsl;
			APE_REAL ss = 0;

			for (int c = 0; c < C; c++) {
				float16 x, y, co, si = sep_sincos(prm, trig, D, flags, c, rel + il, tq, &co);
				float xr[16], yr[16];

				dec_pairs(Q, base, c, P, inter, FD_DT_IN(flags), &x, &y);
				ss += (APE_REAL)dec_hsum(x * x) + (APE_REAL)dec_hsum(y * y);
				vstore16(scale * (x * co - y * si), 0, xr);
				vstore16(scale * (x * si + y * co), 0, yr);
				for (int k = 0; k < 16; k++) {
					out[(16 * c + k) * SEP_BQ] = xr[k];
					out[(P + 16 * c + k) * SEP_BQ] = yr[k];
				}
			}
			qn[bh * Lqp + i] = (float)ape_norm_bound(ss);
		}
	}
}

/* Private floats for a work-item's rotated rows in ape_sep_rot_q: hb heads of 16 rows each,
 * hb = SEP_QPRIV / (16 D) at most (ocl_separable.c mirrors it). */
#define SEP_QPRIV 8192

/* Scratch block t (of Lqp / SEP_BQ: the segments' padded rows one after another; ix[t] its
 * segment) for hb heads h0 .. of batch b per work-item: each of its rows i, the segment's query
 * row il = i - qp, rotated at its position rel + il, times scale, transposed: Qt[bh][t][d][16]
 * (padding rows, and the rows of a segment without keys: zeros); and |q| rounded up (a bound,
 * for skipping). Row by row across the heads (the rows of one token lie together in packed
 * tensors: one sweep reads them), each row's sines and cosines once; the heads' blocks are
 * transposed in private memory and written out one float16 per d. */
__kernel void ape_sep_rot_q(__global const void *Q, __global const APE_REAL *prm, long qoff,
			    long qsb, long qsh, long qsl, int D, long Lqp, int H, int hb,
			    float scale, int flags, __global float *Qt, __global float *qn,
			    __global const long *sgt, __global const int *ix,
			    __global const float *trig)
{
	const int nhg = (H + hb - 1) / hb;
	const long t = get_global_id(1), b = get_global_id(0) / nhg;
	const int h0 = (int)(get_global_id(0) % nhg) * hb, nh = min(hb, H - h0);
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	float qr[SEP_QPRIV], nb[SEP_QPRIV / 32]; /* nb: hb * 16 norms, D >= 32 */

	if (t >= Lqp / SEP_BQ)
		return;
	{
		__global const long *sg = sgt + SEP_SW * ix[t];
		const long il0 = t * SEP_BQ - sg[SG_QP], rel = sg[SG_REL], lq = sg[SG_LQ];
		const int nr = sg[SG_LK] == 0 ? 0 : (int)clamp(lq - il0, 0L, (long)SEP_BQ);

		for (int r = 0; r < SEP_BQ; r++) {
			const long il = il0 + r, tq = sg[SG_TQ] + il;
			float16 co[DEC_CMAX], si[DEC_CMAX];

			for (int c = 0; c < C && r < nr; c++)
				si[c] = sep_sincos(prm, trig, D, flags, c, rel + il, tq, &co[c]);
			for (int hh = 0; hh < nh; hh++) {
				const long base = qoff + b * qsb + (h0 + hh) * qsh + (sg[SG_Q0] + il) * qsl;
				float *row = qr + (hh * SEP_BQ + r) * DEC_DIM;
				APE_REAL ss = 0;

				for (int c = 0; c < C; c++) {
					float16 x = (float16)0.0f, y = x, u = x, w = x;

					if (r < nr) {
						dec_pairs(Q, base, c, P, inter, FD_DT_IN(flags), &x, &y);
						ss += (APE_REAL)dec_hsum(x * x) + (APE_REAL)dec_hsum(y * y);
						u = scale * (x * co[c] - y * si[c]);
						w = scale * (x * si[c] + y * co[c]);
					}
					vstore16(u, 0, row + 16 * c);
					vstore16(w, 0, row + P + 16 * c);
				}
				nb[hh * SEP_BQ + r] = r < nr ? (float)ape_norm_bound(ss) : 0.0f;
			}
		}
		for (int hh = 0; hh < nh; hh++) {
			const long bh = b * H + h0 + hh;
			__global float *out = Qt + (bh * Lqp + t * SEP_BQ) * DEC_DIM;

			for (int c = 0; c < DEC_DIM; c += 16) {
				float16 m[16];

				for (int r = 0; r < SEP_BQ; r++)
					m[r] = vload16(0, qr + (hh * SEP_BQ + r) * DEC_DIM + c);
				sep_tr16(m);
				for (int dd = 0; dd < 16; dd++)
					vstore16(m[dd], c + dd, out);
			}
			vstore16(vload16(hh, nb), 0, qn + bh * Lqp + t * SEP_BQ);
		}
	}
}

/* One scratch key tile t (of ntk, the segments' padded tiles one after another; ix[ixt + t] its
 * segment) of batch b and kv heads g0 .. g0 + hk - 1 per work-item: the segment's keys j (from
 * its tile t - tp) rotated at their positions j into Kr[bkv][16 t + ...][D] (pair-split order,
 * as Qt) and V as float32 into Vf likewise (padding keys: zeros); each tile's largest key norm,
 * rounded up (+inf when its K or V holds a NaN or Inf: never skipped). Key by key across the
 * heads (the CPU shape takes every head in one work-item, as ape_sep_rot_q reads its rows),
 * each key's sines and cosines once. */
__kernel void ape_sep_rot_k(__global const void *K, __global const void *V,
			    __global const APE_REAL *prm, long koff, long ksb, long ksh, long ksl,
			    long voff, long vsb, long vsh, long vsl, int D, long Lkp, int Hkv,
			    int hk, int flags, __global float *Kr, __global float *Vf,
			    __global float *ktile, __global const long *sgt,
			    __global const int *ix, long ixt, __global const float *trig)
{
	const int nkg = (Hkv + hk - 1) / hk;
	const long t = get_global_id(1), b = get_global_id(0) / nkg, ntk = Lkp / SEP_BK;
	const int g0 = (int)(get_global_id(0) % nkg) * hk, g1 = min(g0 + hk, Hkv);
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	const int dt = FD_DT_IN(flags);

	if (t >= ntk)
		return;
	{
		__global const long *sg = sgt + SEP_SW * ix[ixt + t];
		const long j0 = (t - sg[SG_TP]) * SEP_BK, Lk = sg[SG_LK], k0 = sg[SG_K0];

		for (int g = g0; g < g1; g++)
			ktile[(b * Hkv + g) * ntk + t] = 0.0f;
		for (long j = j0; j < j0 + SEP_BK; j++) {
			const long tk = sg[SG_TK] + j;
			float16 co[DEC_CMAX], si[DEC_CMAX];

			for (int c = 0; c < C && j < Lk; c++)
				si[c] = sep_sincos(prm, trig, D, flags, c, j, tk, &co[c]);
			for (int g = g0; g < g1; g++) {
				const long bkv = b * Hkv + g;
				__global float *kr = Kr + (bkv * Lkp + t * SEP_BK + (j - j0)) * DEC_DIM;
				__global float *vf = Vf + (bkv * Lkp + t * SEP_BK + (j - j0)) * DEC_DIM;

				if (j >= Lk) {
					for (int c = 0; c < 2 * C; c++) {
						vstore16((float16)0.0f, c, kr);
						vstore16((float16)0.0f, c, vf);
					}
					continue;
				}
				{
					const long kb = koff + b * ksb + g * ksh + (k0 + j) * ksl;
					const long vb = voff + b * vsb + g * vsh + (k0 + j) * vsl;
					float s = 0.0f, vs = 0.0f, mx = ktile[bkv * ntk + t];

					for (int c = 0; c < C; c++) {
						float16 x, y;

						dec_pairs(K, kb, c, P, inter, dt, &x, &y);
						vstore16(x * co[c] - y * si[c], 0, kr + 16 * c);
						vstore16(x * si[c] + y * co[c], 0, kr + P + 16 * c);
						s += dec_hsum(x * x + y * y);
					}
					for (int c = 0; c < 2 * C; c++) {
						const float16 v = dec_ld16(V, vb + 16 * c, dt);

						vstore16(v, 0, vf + 16 * c);
						vs += dec_hsum(0.0f * v); /* NaN for any NaN or Inf */
					}
					s = sqrt(s) + vs;
					if (!(s <= mx))
						mx = isnan(s) ? INFINITY : s;
					ktile[bkv * ntk + t] = mx;
				}
			}
		}
		for (int g = g0; g < g1; g++)
			ktile[(b * Hkv + g) * ntk + t] = ape_norm_bound_f(ktile[(b * Hkv + g) * ntk + t]);
	}
}

/* The bias per distance, for launches with beta or gamma != 0 or a distance-bias table:
 * tab[h][be + e] = bias(|n|) in APE_REAL (as the general kernel's tile tables hold it) plus the
 * table's entry (BT: [heads][blen], head stride bhs; blen 0: none), for each segment at
 * n = rel + e - (lkp - 1), e over the lqp + lkp - 1 distances that its padded rows and keys
 * span (lqp, lkp: its rows and keys padded; none for a segment without keys). Entry e's
 * segment: the last whose table starts at or before e (a binary search over the nseg
 * segments). */
__kernel void ape_sep_btab(__global const APE_REAL *prm, int D, long ne, long nseg,
			   __global const long *sgt, __global APE_REAL *tab, __global const float *BT,
			   long blen, long bhs)
{
	const long e = get_global_id(0);
	const int h = (int)get_global_id(1), P = D / 2;
	long lo = 0, hi = nseg - 1;

	if (e >= ne)
		return;
	while (lo < hi) {
		const long mid = lo + (hi - lo + 1) / 2;

		if (sgt[SEP_SW * mid + SG_BE] <= e)
			lo = mid;
		else
			hi = mid - 1;
	}
	{
		__global const long *sg = sgt + SEP_SW * lo;
		const long lkp = SEP_PAD(sg[SG_LK]);
		/* padding: saturated, never used */
		const long n = ape_sat_add(sg[SG_REL], e - sg[SG_BE] - (lkp - 1));
		const long an = ape_abs_dist(n);

		tab[h * ne + e] = ape_bias(prm[P + 4 * h], prm[P + 4 * h + 1], prm[P + 4 * h + 2],
					   (APE_REAL)an) +
				  (blen ? (APE_REAL)BT[h * bhs + ape_bias_index(an, blen)] : 0);
	}
}

/* Prefix maxima of each segment's tile norms (one work-item per segment and kv head): its
 * pre[t] over its tiles < t, at pre[bkv][tp + s + t] (ntk + nseg values per kv head). */
__kernel void ape_sep_kscan(__global const float *ktile, long ntk, long nseg,
			    __global const long *sgt, __global float *pre)
{
	const long s = get_global_id(0), bkv = get_global_id(1);
	__global const long *sg = sgt + SEP_SW * s;
	const long tp = sg[SG_TP], n = sg[SG_NT];
	__global float *p = pre + bkv * (ntk + nseg) + tp + s;
	float run = 0.0f;

	p[0] = 0.0f;
	for (long t = 0; t < n; t++) {
		run = fmax(run, ktile[bkv * ntk + tp + t]);
		p[t + 1] = run;
	}
}

/*
 * A row block's distance-bias table frame for one 16-key tile (ape_sep_attn's sep_tile() and
 * ape_sep_small): tb points at the table entry of lane 0's distance to the tile's last key
 * (the tile's 31 distances e = 0 .. 30 ahead of it), bref = tb[15] is the tile's reference (the
 * general kernel's frame for a block: float32 keeps the fine differences); bt[e] gets tb[e] -
 * bref, and the result is bref - crow[r] in lane r.
 */
KFN float16 sep_tab_frame(__global const APE_REAL *tb, const APE_REAL *crow, float *bt)
{
	const APE_REAL bref = tb[SEP_BK - 1];
	float c[SEP_BQ];

#pragma unroll
	for (int e = 0; e < SEP_BQ + SEP_BK - 1; e++)
		bt[e] = (float)(tb[e] - bref);
#pragma unroll
	for (int r = 0; r < SEP_BQ; r++)
		c[r] = (float)(bref - crow[r]);
	return vload16(0, c);
}

/*
 * One key tile of a step of ape_sep_attn: the scores of a row block (its 16 rows i0 .. in the
 * lanes; qt: its Qt block) against the tile's 16 keys kt .. kt + 15 (kr: theirs in the scratch),
 * their bias (the per-distance table btb of the segment, lkp its padded keys, relative to the
 * tile's own reference as the general kernel's tile tables; or -delta (|n| - |n_anchor|)), into
 * s[0..15]; *mt and *mn take the lane-wise maximum and minimum ('>' and fmax ignore NaN).
 * careful (a constant at each call): a non-finite dot makes the score NaN, and when masked,
 * keys that a lane does not see (past Lk, past its diagonal) score -inf, vis[j] saying which
 * lanes see key j (*mn is left alone). Not careful: the scores as they come, without masks:
 * the same as the careful ones unless a score is infinite (an infinite dot, or bias; a NaN
 * stays NaN either way), which the caller sees in *mt or *mn and then redoes the step
 * carefully.
 */
KFN void sep_tile(__global const float *qt, __global const float *kr, int D,
		  __global const APE_REAL *btb, long lkp, int tabbed, float delta, long i0, long kt,
		  long rel, long Lk, int causal, const APE_REAL *crow, int16 d0, int16 iota,
		  const int careful, int masked, float16 *s, int16 *vis, float16 *mt, float16 *mn)
{
	float16 S[SEP_BK], cr;
	float bt[SEP_BQ + SEP_BK - 1];

#pragma unroll
	for (int j = 0; j < SEP_BK; j++)
		S[j] = (float16)0.0f;
	/* 16 rows (lanes) x 16 keys, one query vector per d */
	NOUNROLL
	for (int d = 0; d < DEC_DIM; d++) {
		const float16 qv = vload16(0, qt + d * SEP_BQ);

#pragma unroll
		for (int j = 0; j < SEP_BK; j++)
			S[j] = fma(qv, (float16)kr[j * DEC_DIM + d], S[j]);
	}
	/* the table's bias at the tile's 31 distances n = rel + i0 - kt + e - 15, relative to the
	 * one at e = 15 (bref: the general kernel's frame for a block, float32 keeps the fine
	 * differences), and bref - c_row per lane */
	if (tabbed)
		cr = sep_tab_frame(btb + (i0 - kt + lkp - 1) - (SEP_BK - 1), crow, bt);
#pragma unroll
	for (int j = 0; j < SEP_BK; j++) {
		float16 x = S[j];

		if (tabbed) /* lane r: distance e = r - j + 15 */
			x += vload16(0, bt + (SEP_BK - 1 - j)) + cr;
		else if (delta != 0.0f) /* ape_bias_diff_f with beta = gamma = 0 */
			x -= delta * convert_float16(abs(d0 - ((int)kt + j)));
		if (careful) {
			x = select((float16)NAN, x, isfinite(S[j]));
			if (masked) {
				/* lane r sees key kt + j iff rel + i0 + r >= kt + j */
				const long need = kt + j - (rel + i0);
				const int16 v = kt + j >= Lk		 ? (int16)0
						: !causal || need <= 0 ? (int16)(-1)
						: need < SEP_BQ	 ? iota >= (int16)(int)need
								 : (int16)0;

				vis[j] = v;
				x = select((float16)(-INFINITY), x, v);
			}
		} else {
			*mn = fmin(*mn, x);
		}
		s[j] = x;
		*mt = fmax(*mt, x);
	}
}

/* acc[d] = acc[d] * corr + sum over the nk keys j of p[j] V[j][d], 16 columns at a time in
 * registers (acc not multiplied where corr is 1 in every lane: the same values, 64 multiplies
 * fewer; once the rows' maxima settle, most tiles leave them unchanged). masked: lanes (rows) that do not see key j take nothing from it, not 0 * V (V may
 * hold a NaN); vis[j] says which do. V in the address space AS (sep_pv: the scratch, sep_pv_p: a
 * work-item's private copy). */
#define SEP_PV(name, AS)                                                                           \
KFN void name(AS const float *vf, int D, int nk, int masked, const float16 corr, const float16 *p, \
	      const int16 *vis, float16 *acc)                                                      \
{                                                                                                  \
	const int rescale = any(corr != (float16)1.0f);                                            \
                                                                                                   \
	NOUNROLL                                                                                   \
	for (int c = 0; c < DEC_DIM; c += 16) {                                                    \
		float16 a[16];                                                                     \
                                                                                                   \
		if (rescale) {                                                                     \
_Pragma("unroll")                                                                                  \
			for (int dd = 0; dd < 16; dd++)                                            \
				a[dd] = acc[c + dd] * corr;                                        \
		} else {                                                                           \
_Pragma("unroll")                                                                                  \
			for (int dd = 0; dd < 16; dd++)                                            \
				a[dd] = acc[c + dd];                                               \
		}                                                                                  \
		if (!masked) {                                                                     \
			NOUNROLL                                                                   \
			for (int j = 0; j < nk; j++) {                                             \
				const float16 pj = p[j];                                           \
				AS const float *v = vf + j * DEC_DIM + c;                          \
                                                                                                   \
_Pragma("unroll")                                                                                  \
				for (int dd = 0; dd < 16; dd++)                                    \
					a[dd] = fma(pj, (float16)v[dd], a[dd]);                    \
			}                                                                          \
		} else {                                                                           \
			NOUNROLL                                                                   \
			for (int j = 0; j < nk; j++) {                                             \
				const float16 pj = p[j];                                           \
				const int16 vj = vis[j];                                           \
				AS const float *v = vf + j * DEC_DIM + c;                          \
                                                                                                   \
_Pragma("unroll")                                                                                  \
				for (int dd = 0; dd < 16; dd++)                                    \
					a[dd] = fma(pj, select((float16)0.0f, (float16)v[dd], vj), a[dd]); \
			}                                                                          \
		}                                                                                  \
_Pragma("unroll")                                                                                  \
		for (int dd = 0; dd < 16; dd++)                                                    \
			acc[c + dd] = a[dd];                                                       \
	}                                                                                          \
}
SEP_PV(sep_pv, __global)
SEP_PV(sep_pv_p, __private)

__kernel void ape_sep_attn(__global const float *Qt, __global const float *Kr,
			   __global const float *Vf, __global void *O, __global float *LSE,
			   __global ulong *PAIRS, __global const APE_REAL *prm,
			   __global const float *qn, __global const float *kpre,
			   __global const APE_REAL *btab, long ooff, long osb,
			   long osh, long osl, long loff, long lsb, long lsh, long lsl, int D,
			   long Lqa, long Lqp, long Lkp, long ne, long nseg, int H, int group,
			   float scale, float tol, int flags, __global const long *sgt,
			   __global const int *ix, long ixw, __global const float *BSM, long blen,
			   long bhs)
{
	/* the work-item's segment and first row block (the host orders them heaviest first) */
	__global const int *wk = ix + ixw + 2 * get_group_id(0);
	const long s = wk[0];
	__global const long *sg = sgt + SEP_SW * s;
	/* the segment's rows, keys (padded: lkp, ntk) and distance, its place in the scratch */
	const long Lq = sg[SG_LQ], Lk = sg[SG_LK], rel = sg[SG_REL], q0 = sg[SG_Q0];
	const long lkp = SEP_PAD(Lk), ntk = lkp / SEP_BK, tp = sg[SG_TP];
	const long bh = get_global_id(1), b = bh / H;
	const int h = (int)(bh % H), P = DEC_DIM / 2;
	const int causal = (flags & FD_CAUSAL) != 0, skip = causal && (flags & FS_SKIP) != 0;
	const long bkv = b * (H / group) + h / group;
	__global const float *kr = Kr + (bkv * Lkp + tp * SEP_BK) * DEC_DIM;
	__global const float *vf = Vf + (bkv * Lkp + tp * SEP_BK) * DEC_DIM;
	__global const float *qrow = qn + bh * Lqp + sg[SG_QP];
	__global const float *kp = kpre + bkv * (Lkp / SEP_BK + nseg) + tp + s;
	/* the segment's bias table (ne: the launch's per head) */
	__global const APE_REAL *btb = btab + h * ne + sg[SG_BE];
	const float delta = (float)prm[P + 4 * h];
	const APE_REAL beta = prm[P + 4 * h + 1], gamma = prm[P + 4 * h + 2];
	const int tabbed = (flags & FS_BIAS) != 0;
	const int16 iota = vload16(0, sep_iota);
	/* per row block g of the work-item: rows i0[g] .. i0[g] + 15 in the lanes */
	float16 acc[SEP_NB][DEC_DMAX], m[SEP_NB], l[SEP_NB];
	int16 d0[SEP_NB]; /* lane r: the anchor key (|n| - |n_anchor| = |d0 - j| when visible) */
	long i0[SEP_NB], nrow[SEP_NB], tstart[SEP_NB], tlo[SEP_NB], thi[SEP_NB];
	int done[SEP_NB];
	APE_REAL crow[SEP_NB][SEP_BQ];
	float16 p[SEP_SK];
	int16 vis[SEP_SK];
	float ms[SEP_BQ], ls[SEP_BQ];
	long tfirst = -1, tend;

	for (int g = 0; g < SEP_NB; g++) {
		i0[g] = (wk[1] + g) * SEP_BQ;
		nrow[g] = clamp(Lq - i0[g], 0L, (long)SEP_BQ);
		/* add_sat: ape_sat_add() on vectors (padding rows may pass INT64_MAX) */
		d0[g] = convert_int16(clamp(add_sat(convert_long16(iota),
						    (long16)ape_sat_add(rel, i0[g])),
					    0L, max(Lk - 1, 0L)));
		for (int r = 0; r < SEP_BQ; r++)
			crow[g][r] = sep_bias((APE_REAL)prm[P + 4 * h], beta, gamma,
					      (APE_REAL)ape_anchor_distance(
						      ape_sat_add(rel, i0[g] + r), Lk, causal));
		for (int d = 0; d < DEC_DIM; d++)
			acc[g][d] = (float16)0.0f;
		m[g] = (float16)(-INFINITY);
		l[g] = (float16)0.0f;
		/* steps: causal from the block's last diagonal backward, else all in order */
		if (causal) {
			const long dl = ape_sat_add(rel, i0[g] + nrow[g] - 1);

			tstart[g] = nrow[g] <= 0 || dl < 0 || Lk <= 0 ? -1
								      : min(dl, Lk - 1) / SEP_SK;
		} else {
			tstart[g] = nrow[g] <= 0 || Lk <= 0 ? -1 : 0;
		}
		tlo[g] = thi[g] = tstart[g];
		done[g] = tstart[g] < 0;
		tfirst = max(tfirst, tstart[g]);
	}
	/* every block of the work-item takes a step's keys while they are in L1 (no step at all
	 * when no row sees a key: the outputs below are still written) */
	tend = causal || tfirst < 0 ? -1 : (ntk + SEP_KS - 1) / SEP_KS;
	for (long t = tfirst < 0 ? -1 : causal ? tfirst : 0; t != tend; t += causal ? -1 : 1) {
		const long k0 = t * SEP_SK;
		const int len = (int)min((long)SEP_SK, Lk - k0);
		/* the step's tiles in the scratch (the segment's last step may have one) */
		const int nt = (int)min((long)SEP_KS, ntk - t * SEP_KS);
		int all_done = 1;

		for (int g = 0; g < SEP_NB; g++) {
			__global const float *qt = Qt + (bh * Lqp + sg[SG_QP] + i0[g]) * DEC_DIM;
			const int masked = len < SEP_SK ||
					   (causal && k0 + SEP_SK - 1 > ape_sat_add(rel, i0[g]));
			/* the step's tiles for this block: causal, not a tile past its last row's
			 * diagonal (every score -inf, p 0: leaving it out changes no bit; such a
			 * step is masked, and an unmasked one has all SEP_KS tiles) */
			const int ntg = causal && k0 + SEP_BK > ape_sat_add(rel, i0[g] + nrow[g] - 1)
						? 1
						: nt;
			float16 mt, mn, corr, lsum = (float16)0.0f;
			int careful = masked;

			if (done[g] || (causal && t > tstart[g]))
				continue;
			/* the scores, their bias and masks: at once where no key is masked, again
			 * carefully should an infinite score turn up (a NaN, an infinite dot or bias) */
			for (;;) {
				mt = m[g];
				mn = (float16)INFINITY;
				if (careful) {
					for (int u = 0; u < ntg; u++)
						sep_tile(qt, kr + (k0 + u * SEP_BK) * DEC_DIM, D, btb, lkp,
							 tabbed, delta, i0[g], k0 + u * SEP_BK, rel, Lk,
							 causal, crow[g], d0[g], iota, 1, masked,
							 p + u * SEP_BK, vis + u * SEP_BK, &mt, &mn);
					break;
				}
#pragma unroll
				for (int u = 0; u < SEP_KS; u++)
					sep_tile(qt, kr + (k0 + u * SEP_BK) * DEC_DIM, D, btb, lkp, tabbed,
						 delta, i0[g], k0 + u * SEP_BK, rel, Lk, causal, crow[g],
						 d0[g], iota, 0, 0, p + u * SEP_BK, vis + u * SEP_BK, &mt,
						 &mn);
				if (!any(mt == (float16)INFINITY || mn == (float16)(-INFINITY)))
					break;
				careful = 1;
			}
			/* one online-softmax update for the step, lane-wise ('>' and fmax ignore NaN,
			 * exp keeps it) */
			corr = select(select(dec_exp16(m[g] - mt), (float16)0.0f,
					     m[g] - mt < APE_EXP_CUTOFF),
				      (float16)1.0f, m[g] == mt);
			if (careful) {
				for (int j = 0; j < ntg * SEP_BK; j++) {
					const float16 dd = p[j] - mt;

					p[j] = select(dec_exp16(dd), (float16)0.0f,
						      dd < APE_EXP_CUTOFF || p[j] == (float16)(-INFINITY));
					lsum += p[j];
				}
			} else { /* no score is -inf */
#pragma unroll
				for (int j = 0; j < SEP_SK; j++) {
					const float16 dd = p[j] - mt;

					p[j] = select(dec_exp16(dd), (float16)0.0f, dd < APE_EXP_CUTOFF);
					lsum += p[j];
				}
			}
			l[g] = l[g] * corr + lsum;
			m[g] = mt;
			sep_pv(vf + k0 * DEC_DIM, D, ntg * SEP_BK, masked, corr, p, vis, acc[g]);
			tlo[g] = min(tlo[g], t);
			thi[g] = max(thi[g], t);

			/* far keys (causal, walking backward): the block stops once every row may
			 * leave out the keys before this step */
			if (skip && t > 0) {
				const APE_REAL kb = kp[k0 / SEP_BK];
				int stop = 1;

				vstore16(m[g], 0, ms);
				vstore16(l[g], 0, ls);
				for (int r = 0; r < nrow[g] && stop; r++) {
					const long diag = rel + (i0[g] + r);
					const long cnt = ape_visible_keys(diag, k0, causal);
					const long an = ape_keys_min_abs(diag, 0, cnt);

					if (cnt <= 0)
						continue;
					stop = ape_may_skip(0, prm[P + 4 * h], beta, gamma,
							    fabs((APE_REAL)scale),
							    qrow[i0[g] + r], kb, an, cnt,
							    sep_bound_frame(BSM, blen, bhs, h,
									    crow[g][r], an),
							    ms[r], ls[r], -INFINITY, tol);
				}
				done[g] = stop;
			}
			all_done &= done[g];
		}
		if (skip && all_done)
			break;
	}
	/* outputs: O = acc / l (0 with no key), LSE = c_row + m + ln l, the pairs computed */
	for (int g = 0; g < SEP_NB; g++) {
		const float16 inv = select((float16)1.0f / l[g], (float16)0.0f, l[g] == (float16)0.0f);
		float o[SEP_BQ];

		vstore16(m[g], 0, ms);
		vstore16(l[g], 0, ls);
		for (int d = 0; d < DEC_DIM; d++) {
			vstore16(acc[g][d] * inv, 0, o);
			for (int r = 0; r < nrow[g]; r++)
				st(O, ooff + b * osb + h * osh + (q0 + i0[g] + r) * osl + d, o[r],
				   FD_DT_OUT(flags));
		}
		for (int r = 0; r < nrow[g]; r++) {
			const long i = i0[g] + r, diag = rel + i; /* a real row: fits */

			if (flags & FD_LSE)
				LSE[loff + b * lsb + h * lsh + (q0 + i) * lsl] =
					ls[r] > 0.0f ? (float)(crow[g][r] + (APE_REAL)ms[r] +
							       log((APE_REAL)ls[r]))
					: ls[r] == 0.0f ? -INFINITY
							: NAN;
			if (flags & FD_PAIRS) {
				const long jb = tstart[g] < 0 ? 0 : tlo[g] * SEP_SK;
				const long je = tstart[g] < 0 ? 0 : min((thi[g] + 1) * SEP_SK, Lk);

				PAIRS[bh * Lqa + q0 + i] =
					(ulong)ape_row_visible_pairs(diag, jb, je, causal);
			}
		}
	}
}

/*
 * Segments of at most SEP_BK keys (ragged launches: ocl_separable.c sends them here, not through
 * the scratch), one work-item per row block of such a segment, batch and run of hk kv heads
 * (hk = SEP_QPRIV / (16 D group) at least 1, at most Hkv; ocl_separable.c mirrors it): it
 * rotates the segment's keys of those heads (from the trig table) into private memory, V as
 * float32, then the block's rows of their query heads (at most SEP_QPRIV / (16 D) at a time),
 * scaled, and computes each head's block against its one tile as ape_sep_attn does (rows
 * transposed into the lanes; the same bias, masks and online-softmax step, from the anchor
 * frame), writing O, LSE and the pairs. Rows and keys are read token by token across the heads
 * (the rows of one token lie together in packed tensors: one sweep reads them). Nothing to
 * skip: the tile holds every key the rows see. A segment without keys gets O = 0, LSE = -inf,
 * pairs 0. ix[ixs + 2w]: unit w's segment and block.
 */
__kernel void ape_sep_small(__global const void *Q, __global const void *K, __global const void *V,
			    __global void *O, __global float *LSE, __global ulong *PAIRS,
			    __global const APE_REAL *prm, __global const APE_REAL *btab, long qoff,
			    long qsb, long qsh, long qsl, long koff, long ksb, long ksh, long ksl,
			    long voff, long vsb, long vsh, long vsl, long ooff, long osb, long osh,
			    long osl, long loff, long lsb, long lsh, long lsl, int D, long Lqa,
			    long ne, int H, int group, int hk, float scale, int flags,
			    __global const long *sgt, __global const int *ix, long ixs,
			    __global const float *trig)
{
	__global const int *wk = ix + ixs + 2 * get_group_id(0);
	const long s = wk[0], i0 = (long)wk[1] * SEP_BQ;
	__global const long *sg = sgt + SEP_SW * s;
	const long Lq = sg[SG_LQ], Lk = sg[SG_LK], rel = sg[SG_REL], q0 = sg[SG_Q0];
	const int P = DEC_DIM / 2, C = P / 16, Hkv = H / group, nkg = (Hkv + hk - 1) / hk;
	const long b = get_global_id(1) / nkg;
	const int g0 = (int)(get_global_id(1) % nkg) * hk, ng = min(hk, Hkv - g0);
	/* query heads per pass: their rows fill qr */
	const int hq = max(1, SEP_QPRIV / (SEP_BQ * DEC_DIM));
	const int causal = (flags & FD_CAUSAL) != 0, inter = (flags & FD_INTERLEAVED) != 0;
	const int dt = FD_DT_IN(flags), tabbed = (flags & FS_BIAS) != 0;
	const long nrow = min(Lq - i0, (long)SEP_BQ);
	const int16 iota = vload16(0, sep_iota);
	/* the tile: causal, only when the block's last row sees key 0 */
	const int live = Lk > 0 && (!causal || ape_sat_add(rel, i0 + nrow - 1) >= 0);
	const int masked = Lk < SEP_BK || (causal && SEP_BK - 1 > ape_sat_add(rel, i0));
	/* the anchor keys (lane r: |n| - |n_anchor| = |d0 - j| when visible) */
	const int16 d0 = convert_int16(clamp(add_sat(convert_long16(iota),
						      (long16)ape_sat_add(rel, i0)),
					      0L, max(Lk - 1, 0L)));
	/* keys and values of the ng kv heads, rows of up to hq query heads (row-major), the rows
	 * of one head transposed (qt[d]: element d of the 16 rows) */
	float kr[SEP_QPRIV], vv[SEP_QPRIV], qr[SEP_QPRIV];
	float16 qt[DEC_DMAX], acc[DEC_DMAX], co[DEC_CMAX], si[DEC_CMAX];
	APE_REAL crow[SEP_BQ];
	float ms[SEP_BQ], ls[SEP_BQ];

	/* the keys (past Lk: zeros, masked below) */
	for (int j = 0; j < SEP_BK && live; j++) {
		for (int c = 0; c < C && j < Lk; c++)
			si[c] = sep_sincos(prm, trig, D, flags, c, j, sg[SG_TK] + j, &co[c]);
		for (int gg = 0; gg < ng; gg++) {
			const long kb = koff + b * ksb + (g0 + gg) * ksh + (sg[SG_K0] + j) * ksl;
			const long vb = voff + b * vsb + (g0 + gg) * vsh + (sg[SG_K0] + j) * vsl;
			float *kj = kr + (gg * SEP_BK + j) * DEC_DIM, *vj = vv + (gg * SEP_BK + j) * DEC_DIM;

			for (int c = 0; c < C; c++) {
				float16 x = (float16)0.0f, y = x, u = x, w = x;

				if (j < Lk) {
					dec_pairs(K, kb, c, P, inter, dt, &x, &y);
					u = x * co[c] - y * si[c];
					w = x * si[c] + y * co[c];
				}
				vstore16(u, 0, kj + 16 * c);
				vstore16(w, 0, kj + P + 16 * c);
			}
			for (int c = 0; c < 2 * C; c++)
				vstore16(j < Lk ? dec_ld16(V, vb + 16 * c, dt) : (float16)0.0f, c, vj);
		}
	}
	for (int h1 = g0 * group; h1 < (g0 + ng) * group; h1 += hq) {
		const int nh = min(hq, (g0 + ng) * group - h1);

		/* the rows of query heads h1 .. h1 + nh - 1 (past nrow: zeros) */
		for (int r = 0; r < SEP_BQ && live; r++) {
			const long il = i0 + r;

			for (int c = 0; c < C && r < nrow; c++)
				si[c] = sep_sincos(prm, trig, D, flags, c, rel + il, sg[SG_TQ] + il,
						   &co[c]);
			for (int hh = 0; hh < nh; hh++) {
				const long qb = qoff + b * qsb + (h1 + hh) * qsh + (q0 + il) * qsl;
				float *qi = qr + (hh * SEP_BQ + r) * DEC_DIM;

				for (int c = 0; c < C; c++) {
					float16 x = (float16)0.0f, y = x, u = x, w = x;

					if (r < nrow) {
						dec_pairs(Q, qb, c, P, inter, dt, &x, &y);
						u = scale * (x * co[c] - y * si[c]);
						w = scale * (x * si[c] + y * co[c]);
					}
					vstore16(u, 0, qi + 16 * c);
					vstore16(w, 0, qi + P + 16 * c);
				}
			}
		}
		for (int hh = 0; hh < nh; hh++) {
			const int h = h1 + hh, gg = h / group - g0;
			const long bh = b * H + h;
			const float delta = (float)prm[P + 4 * h];
			const APE_REAL beta = prm[P + 4 * h + 1], gamma = prm[P + 4 * h + 2];
			float16 m = (float16)(-INFINITY), l = (float16)0.0f, inv;

			for (int r = 0; r < SEP_BQ; r++)
				crow[r] = sep_bias((APE_REAL)prm[P + 4 * h], beta, gamma,
						   (APE_REAL)ape_anchor_distance(ape_sat_add(rel, i0 + r),
										 Lk, causal));
			if (live) {
				const float *kg = kr + gg * SEP_BK * DEC_DIM;
				float16 S[SEP_BK], p[SEP_BK], mt, corr, cr, lsum = (float16)0.0f;
				int16 vis[SEP_BK];
				float bt[SEP_BQ + SEP_BK - 1];

				for (int c = 0; c < DEC_DIM; c += 16) {
					float16 t[16];

					for (int r = 0; r < SEP_BQ; r++)
						t[r] = vload16(0, qr + (hh * SEP_BQ + r) * DEC_DIM + c);
					sep_tr16(t);
					for (int dd = 0; dd < 16; dd++)
						qt[c + dd] = t[dd];
				}
				for (int d = 0; d < DEC_DIM; d++)
					acc[d] = (float16)0.0f;
				/* the scores, bias and masks, one online-softmax step: as ape_sep_attn
				 * for k0 = 0 */
#pragma unroll
				for (int j = 0; j < SEP_BK; j++)
					S[j] = (float16)0.0f;
				NOUNROLL
				for (int d = 0; d < DEC_DIM; d++) {
					const float16 qv = qt[d];

#pragma unroll
					for (int j = 0; j < SEP_BK; j++)
						S[j] = fma(qv, (float16)kg[j * DEC_DIM + d], S[j]);
				}
				if (tabbed)
					cr = sep_tab_frame(btab + h * ne + sg[SG_BE] + i0, crow, bt);
				mt = m;
#pragma unroll
				for (int j = 0; j < SEP_BK; j++) {
					float16 x = S[j];

					if (tabbed)
						x += vload16(0, bt + (SEP_BK - 1 - j)) + cr;
					else if (delta != 0.0f)
						x -= delta * convert_float16(abs(d0 - j));
					x = select((float16)NAN, x, isfinite(S[j]));
					if (masked) {
						const long need = j - (rel + i0);
						const int16 v = j >= Lk ? (int16)0
								: !causal || need <= 0 ? (int16)(-1)
								: need < SEP_BQ ? iota >= (int16)(int)need
										: (int16)0;

						vis[j] = v;
						x = select((float16)(-INFINITY), x, v);
					}
					S[j] = x;
					mt = fmax(mt, x);
				}
				corr = select(select(dec_exp16(m - mt), (float16)0.0f,
						     m - mt < APE_EXP_CUTOFF),
					      (float16)1.0f, m == mt);
#pragma unroll
				for (int j = 0; j < SEP_BK; j++) {
					const float16 dd = S[j] - mt;

					p[j] = select(dec_exp16(dd), (float16)0.0f,
						      dd < APE_EXP_CUTOFF || S[j] == (float16)(-INFINITY));
					lsum += p[j];
				}
				l = l * corr + lsum;
				m = mt;
				sep_pv_p(vv + gg * SEP_BK * DEC_DIM, D, SEP_BK, masked, corr, p, vis, acc);
			}

			/* outputs: O = acc / l (0 with no key; back to rows 16 columns at a time),
			 * LSE = c_row + m + ln l, the pairs computed */
			inv = select((float16)1.0f / l, (float16)0.0f, l == (float16)0.0f);
			for (int c = 0; c < DEC_DIM; c += 16) {
				float16 t[16];

				for (int dd = 0; dd < 16; dd++)
					t[dd] = live ? acc[c + dd] * inv : (float16)0.0f;
				sep_tr16(t);
				for (int r = 0; r < nrow; r++)
					sep_st16(O, ooff + b * osb + h * osh + (q0 + i0 + r) * osl + c,
						 t[r], FD_DT_OUT(flags));
			}
			vstore16(m, 0, ms);
			vstore16(l, 0, ls);
			for (int r = 0; r < nrow; r++) {
				const long i = i0 + r, diag = rel + i; /* a real row: fits */

				if (flags & FD_LSE)
					LSE[loff + b * lsb + h * lsh + (q0 + i) * lsl] =
						ls[r] > 0.0f ? (float)(crow[r] + (APE_REAL)ms[r] +
								       log((APE_REAL)ls[r]))
						: ls[r] == 0.0f ? -INFINITY
								: NAN;
				if (flags & FD_PAIRS)
					PAIRS[bh * Lqa + q0 + i] =
						live ? (ulong)ape_row_visible_pairs(diag, 0, Lk, causal)
						     : 0;
			}
		}
	}
}

/*
 * The work-group shape (GPU devices, or any device under APE_OCL_SEP_SHAPE=gpu: ocl_separable.c):
 * a work-group of nwi work-items (64, or fewer where the device allows fewer) takes nwi
 * consecutive query rows, one row per work-item (its rotated, scaled query and its output row in
 * registers), and walks key tiles of SEP_GBK keys which its work-items load together into local
 * memory (K and V, float32, from ape_sep_rot_k's scratch) between barriers; each work-item then
 * scores its row against the tile's keys (SEP_GBK dot products, the tile's keys read by every
 * work-item alike), adds the bias as ape_sep_attn does (the per-distance table, or -delta (|n| -
 * |n_anchor|)), and takes one online-softmax update per tile. Causal launches walk from the
 * group's last diagonal tile backward and, when skipping is allowed, stop once every row of the
 * group has proved the rest negligible (ape_may_skip, one vote per row through local memory).
 * Same arguments and outputs as ape_sep_attn.
 */
#define SEP_GBK 16 /* keys per tile (ocl_separable.c mirrors it) */
#if SEP_GBK != SEP_BK
#error "ape_sep_attn_wg reads ape_sep_rot_k's padding and tile norms: its tiles must be theirs"
#endif

__kernel void ape_sep_attn_wg(__global const float *Qt, __global const float *Kr,
			      __global const float *Vf, __global void *O, __global float *LSE,
			      __global ulong *PAIRS, __global const APE_REAL *prm,
			      __global const float *qn, __global const float *kpre,
			      __global const APE_REAL *btab, long ooff, long osb, long osh,
			      long osl, long loff, long lsb, long lsh, long lsl, int D, long Lqa,
			      long Lqp, long Lkp, long ne, long nseg, int H, int group, float scale,
			      float tol, int flags, __global const long *sgt,
			      __global const int *ix, long ixw, __global const float *BSM,
			      long blen, long bhs, __local float *kl, __local float *vl)
{
	/* kl, vl: SEP_GBK * D floats each, sized by the host (no local array sized for the
	 * program's largest D: a device with little local memory still builds the program) */
	__local int lstop;
	const int lid = (int)get_local_id(0), nwi = (int)get_local_size(0);
	/* the group's segment and first row (the host orders them heaviest first) */
	__global const int *wk = ix + ixw + 2 * get_group_id(0);
	const long s = wk[0];
	__global const long *sg = sgt + SEP_SW * s;
	/* the segment's rows, keys (padded: lkp, ntk) and distance, its place in the scratch */
	const long Lq = sg[SG_LQ], Lk = sg[SG_LK], rel = sg[SG_REL], q0 = sg[SG_Q0];
	const long lkp = SEP_PAD(Lk), ntk = lkp / SEP_GBK, tp = sg[SG_TP];
	const long i0 = wk[1], i = i0 + lid;
	const long bh = get_global_id(1), b = bh / H, diag = ape_sat_add(rel, i);
	const int h = (int)(bh % H), P = DEC_DIM / 2, live = i < Lq;
	const int causal = (flags & FD_CAUSAL) != 0, skip = causal && (flags & FS_SKIP) != 0;
	const long bkv = b * (H / group) + h / group;
	__global const float *kr = Kr + (bkv * Lkp + tp * SEP_GBK) * DEC_DIM;
	__global const float *vf = Vf + (bkv * Lkp + tp * SEP_GBK) * DEC_DIM;
	__global const float *kp = kpre + bkv * (Lkp / SEP_GBK + nseg) + tp + s;
	/* the segment's bias table (ne: the launch's per head) */
	__global const APE_REAL *btb = btab + h * ne + sg[SG_BE];
	const float delta = (float)prm[P + 4 * h];
	const APE_REAL beta = prm[P + 4 * h + 1], gamma = prm[P + 4 * h + 2];
	const int tabbed = (flags & FS_BIAS) != 0;
	const long nlive = clamp(Lq - i0, 0L, (long)nwi);
	/* the anchor key (|n| - |n_anchor| = |d0 - j| when visible) and the row's bias there */
	const int d0 = (int)clamp(diag, 0L, max(Lk - 1, 0L));
	const APE_REAL crow =
		live ? sep_bias((APE_REAL)prm[P + 4 * h], beta, gamma,
				(APE_REAL)ape_anchor_distance(diag, Lk, causal))
		     : (APE_REAL)0;
	float q[DEC_DMAX], acc[DEC_DMAX], m = -INFINITY, lsum = 0.0f;
	long tlast, tlo = -1, thi = -1;

	/* tiles: causal from the group's last diagonal backward, else all in order */
	if (nlive <= 0 || Lk <= 0)
		tlast = -1;
	else if (causal)
		tlast = rel + (i0 + nlive - 1) < 0 ? -1
						    : min(rel + (i0 + nlive - 1), Lk - 1) / SEP_GBK;
	else
		tlast = ntk - 1;
	for (int d = 0; d < DEC_DIM; d++) {
		q[d] = live ? Qt[(bh * Lqp + sg[SG_QP] + i / SEP_BQ * SEP_BQ) * DEC_DIM +
				 d * SEP_BQ + i % SEP_BQ]
			    : 0.0f;
		acc[d] = 0.0f;
	}
	for (long k = 0; k <= tlast; k++) {
		const long t = causal ? tlast - k : k, k0 = t * SEP_GBK;
		const int len = (int)min((long)SEP_GBK, Lk - k0);

		barrier(CLK_LOCAL_MEM_FENCE); /* the previous tile is read */
		for (int x = lid; x < SEP_GBK * DEC_DIM; x += nwi) {
			kl[x] = kr[k0 * DEC_DIM + x];
			vl[x] = vf[k0 * DEC_DIM + x];
		}
		if (lid == 0)
			lstop = 1;
		barrier(CLK_LOCAL_MEM_FENCE);
		tlo = min(tlo < 0 ? t : tlo, t);
		thi = max(thi, t);
		if (live && (!causal || diag >= k0)) {
			float s[SEP_GBK], p[SEP_GBK], mt = m, corr, ps = 0.0f;
			uint vis = 0;

			for (int j = 0; j < SEP_GBK; j++)
				s[j] = 0.0f;
			NOUNROLL
			for (int d = 0; d < DEC_DIM; d++) {
				const float qd = q[d];

#pragma unroll
				for (int j = 0; j < SEP_GBK; j++)
					s[j] = fma(qd, kl[j * DEC_DIM + d], s[j]);
			}
			/* bias, masks ('>' and fmax ignore NaN, exp keeps it; a non-finite dot makes
			 * the score NaN) */
			for (int j = 0; j < SEP_GBK; j++) {
				float x = s[j];

				if (tabbed)
					x += (float)(btb[i - (k0 + j) + lkp - 1] - crow);
				else if (delta != 0.0f)
					x -= delta * (float)abs(d0 - (int)(k0 + j));
				x = isfinite(s[j]) ? x : NAN;
				if (j < len && (!causal || k0 + j <= diag))
					vis |= 1u << j;
				else
					x = -INFINITY;
				s[j] = x;
				mt = fmax(mt, x);
			}
			corr = m == mt ? 1.0f : m - mt < APE_EXP_CUTOFF ? 0.0f : exp(m - mt);
			for (int j = 0; j < SEP_GBK; j++) {
				const float dd = s[j] - mt;

				p[j] = dd < APE_EXP_CUTOFF || s[j] == -INFINITY ? 0.0f : exp(dd);
				ps += p[j];
			}
			lsum = lsum * corr + ps;
			m = mt;
			/* keys the row does not see give nothing, not 0 * V (V may hold a NaN) */
			NOUNROLL
			for (int d = 0; d < DEC_DIM; d++) {
				float a = acc[d] * corr;

				for (int j = 0; j < SEP_GBK; j++)
					if (vis >> j & 1u)
						a = fma(p[j], vl[j * DEC_DIM + d], a);
				acc[d] = a;
			}
		}
		/* far keys (causal, walking backward): the group stops once every row may leave
		 * out the keys before this tile */
		if (skip && t > 0) {
			int stop = 1;

			if (live) {
				const long cnt = ape_visible_keys(diag, k0, causal);
				const long an = ape_keys_min_abs(diag, 0, cnt);

				if (cnt > 0)
					stop = ape_may_skip(0, prm[P + 4 * h], beta, gamma,
							    fabs((APE_REAL)scale),
							    qn[bh * Lqp + sg[SG_QP] + i], kp[t], an,
							    cnt,
							    sep_bound_frame(BSM, blen, bhs, h, crow,
									    an),
							    m, lsum, -INFINITY, tol);
			}
			if (!stop)
				lstop = 0;
			barrier(CLK_LOCAL_MEM_FENCE);
			if (lstop)
				break;
		}
	}
	if (!live)
		return;

	/* outputs: O = acc / l (0 with no key), LSE = c_row + m + ln l, the pairs computed */
	{
		const float inv = lsum == 0.0f ? 0.0f : 1.0f / lsum;

		for (int d = 0; d < DEC_DIM; d++)
			st(O, ooff + b * osb + h * osh + (q0 + i) * osl + d, acc[d] * inv,
			   FD_DT_OUT(flags));
		if (flags & FD_LSE)
			LSE[loff + b * lsb + h * lsh + (q0 + i) * lsl] =
				lsum > 0.0f ? (float)(crow + (APE_REAL)m + log((APE_REAL)lsum))
				: lsum == 0.0f ? -INFINITY
					       : NAN;
		if (flags & FD_PAIRS) {
			const long jb = tlo < 0 ? 0 : tlo * SEP_GBK;
			const long je = tlo < 0 ? 0 : min((thi + 1) * SEP_GBK, Lk);

			PAIRS[bh * Lqa + q0 + i] = (ulong)ape_row_visible_pairs(diag, jb, je, causal);
		}
	}
}
