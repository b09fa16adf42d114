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
 * decay, else from a per-distance table (ape_sep_btab: bias(|n|) in APE_REAL, each tile taking
 * its 31 distances relative to its own reference, as the general kernel's tile tables do).
 * ape_sep_attn gives one work-item a block of SEP_BQ = 16 query
 * rows (the lanes) and walks key tiles of SEP_BK = 16 keys: the 16 score vectors of a tile stay
 * in registers over the D loop (one Q vector load, 16 FMAs with a broadcast key element per
 * d), then the online softmax runs lane-wise (no horizontal reduction, one rescale per tile),
 * then P V in chunks of 16 output columns held in registers. Causal launches walk from the
 * diagonal backward and, when skipping is allowed, stop once every row of the block has proved
 * the rest negligible (ape_may_skip, with per-tile key norms from ape_sep_rot_k).
 * Built after attention.cl and decode.cl in one program (ld(), st(), dec_ld16(), dec_seed16()).
 */

#define SEP_BQ 16 /* query rows per work-item (ocl_separable.c mirrors it) */
#define SEP_BK 16 /* keys per tile: one float16 */
#define SEP_NB 4 /* row blocks per work-item, sharing each key tile (ocl_separable.c) */

#define FS_SKIP 256 /* ocl_fast.h */
#define FS_BIAS 512 /* a head has beta or gamma != 0: the bias comes from ape_sep_btab's table */

__constant int sep_iota[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };

/* Query rows, 16 to a block, rotated at their positions rel + i, times scale, transposed:
 * Qt[bh][block][d][16] (rows past Lq: zeros); and |q| rounded up (a bound, for skipping). */
__kernel void ape_sep_rot_q(__global const void *Q, __global const APE_REAL *prm, long qoff,
			    long qsb, long qsh, long qsl, int D, long Lq, long Lqp, int H, long rel,
			    float scale, int flags, __global float *Qt, __global float *qn)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	__global float *out = Qt + (bh * Lqp + i / SEP_BQ * SEP_BQ) * DEC_DIM + i % SEP_BQ;

	if (i >= Lqp)
		return;
	if (i >= Lq) {
		for (int d = 0; d < DEC_DIM; d++)
			out[d * SEP_BQ] = 0.0f;
		qn[bh * Lqp + i] = 0.0f;
		return;
	}
	{
		const long base = qoff + bh / H * qsb + bh % H * qsh + i * qsl;
		APE_REAL ss = 0;

		for (int c = 0; c < C; c++) {
			float16 x, y, co, si = dec_seed16(prm, c, (APE_REAL)(rel + i), 1, &co);
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

/* One key tile per work-item: its keys rotated at their positions j into Kr[bkv][j][D] (pair-
 * split order, as Qt) and V as float32 into Vf[bkv][j][D] (keys past Lk: zeros); the tile's
 * largest key norm, rounded up (+inf when its K or V holds a NaN or Inf: never skipped). */
__kernel void ape_sep_rot_k(__global const void *K, __global const void *V,
			    __global const APE_REAL *prm, long koff, long ksb, long ksh, long ksl,
			    long voff, long vsb, long vsh, long vsl, int D, long Lk, long Lkp,
			    int Hkv, int flags, __global float *Kr, __global float *Vf,
			    __global float *ktile)
{
	const long t = get_global_id(0), bkv = get_global_id(1), ntk = Lkp / SEP_BK;
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	const int dt = FD_DT_IN(flags);
	float mx = 0.0f;

	if (t >= ntk)
		return;
	for (long j = t * SEP_BK; j < (t + 1) * SEP_BK; j++) {
		__global float *kr = Kr + (bkv * Lkp + j) * DEC_DIM;
		__global float *vf = Vf + (bkv * Lkp + j) * DEC_DIM;

		if (j >= Lk) {
			for (int d = 0; d < DEC_DIM; d++)
				kr[d] = vf[d] = 0.0f;
			continue;
		}
		{
			const long kb = koff + bkv / Hkv * ksb + bkv % Hkv * ksh + j * ksl;
			const long vb = voff + bkv / Hkv * vsb + bkv % Hkv * vsh + j * vsl;
			float s = 0.0f, vs = 0.0f;

			for (int c = 0; c < C; c++) {
				float16 x, y, co, si = dec_seed16(prm, c, (APE_REAL)j, 1, &co);

				dec_pairs(K, kb, c, P, inter, dt, &x, &y);
				vstore16(x * co - y * si, 0, kr + 16 * c);
				vstore16(x * si + y * co, 0, kr + P + 16 * c);
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
		}
	}
	ktile[bkv * ntk + t] = ape_norm_bound_f(mx);
}

/* The bias per distance, for launches with beta or gamma != 0: tab[h][e] = bias(|n|) in APE_REAL
 * (as the general kernel's tile tables hold it) at n = rel + e - (Lkp - 1), e over the
 * Lqp + Lkp - 1 distances that rows 0..Lqp-1 and keys 0..Lkp-1 (padding included) span. */
__kernel void ape_sep_btab(__global const APE_REAL *prm, int D, long ne, long Lkp, long rel,
			   __global APE_REAL *tab)
{
	const long e = get_global_id(0);
	const int h = (int)get_global_id(1), P = D / 2;
	const long n = ape_sat_add(rel, e - (Lkp - 1)); /* padding: saturated, never used */

	if (e < ne)
		tab[h * ne + e] = ape_bias(prm[P + 4 * h], prm[P + 4 * h + 1], prm[P + 4 * h + 2],
					   (APE_REAL)ape_abs_dist(n));
}

/* Prefix maxima of the tile norms: pre[t] over tiles < t (one work-item per kv head). */
__kernel void ape_sep_kscan(__global const float *ktile, long ntk, __global float *pre)
{
	const long bkv = get_global_id(0);
	float run = 0.0f;

	pre[bkv * (ntk + 1)] = 0.0f;
	for (long t = 0; t < ntk; t++) {
		run = fmax(run, ktile[bkv * ntk + t]);
		pre[bkv * (ntk + 1) + t + 1] = run;
	}
}

/* acc[d] = acc[d] * corr + sum over the tile's keys j of p[j] V[j][d], 16 columns at a time in
 * registers. masked: lanes (rows) that do not see key j take nothing from it, not 0 * V (V may
 * hold a NaN); vis[j] says which do. */
KFN void sep_pv(__global const float *vf, int D, int masked, const float16 corr,
		const float16 *p, const int16 *vis, float16 *acc)
{
	NOUNROLL
	for (int c = 0; c < DEC_DIM; c += 16) {
		float16 a[16];

#pragma unroll
		for (int dd = 0; dd < 16; dd++)
			a[dd] = acc[c + dd] * corr;
		if (!masked) {
			NOUNROLL
			for (int j = 0; j < SEP_BK; j++) {
				const float16 pj = p[j];
				__global const float *v = vf + j * DEC_DIM + c;

#pragma unroll
				for (int dd = 0; dd < 16; dd++)
					a[dd] = fma(pj, (float16)v[dd], a[dd]);
			}
		} else {
			NOUNROLL
			for (int j = 0; j < SEP_BK; j++) {
				const float16 pj = p[j];
				const int16 vj = vis[j];
				__global const float *v = vf + j * DEC_DIM + c;

#pragma unroll
				for (int dd = 0; dd < 16; dd++)
					a[dd] = fma(pj, select((float16)0.0f, (float16)v[dd], vj), a[dd]);
			}
		}
#pragma unroll
		for (int dd = 0; dd < 16; dd++)
			acc[c + dd] = a[dd];
	}
}

__kernel void ape_sep_attn(__global const float *Qt, __global const float *Kr,
			   __global const float *Vf, __global void *O, __global float *LSE,
			   __global ulong *PAIRS, __global const APE_REAL *prm,
			   __global const float *qn, __global const float *kpre,
			   __global const APE_REAL *btab, long ooff, long osb,
			   long osh, long osl, long loff, long lsb, long lsh, long lsl, int D,
			   long Lq, long Lqp, long Lk, long Lkp, int H, int group, long rel,
			   float scale, float tol, int flags)
{
	/* the heaviest causal blocks (the last ones) are handed out first */
	const long wg = (long)get_num_groups(0) - 1 - (long)get_group_id(0);
	const long bh = get_global_id(1), b = bh / H;
	const int h = (int)(bh % H), P = DEC_DIM / 2;
	const int causal = (flags & FD_CAUSAL) != 0, skip = causal && (flags & FS_SKIP) != 0;
	const long bkv = b * (H / group) + h / group, ntk = Lkp / SEP_BK;
	__global const float *kr = Kr + bkv * Lkp * DEC_DIM;
	__global const float *vf = Vf + bkv * Lkp * DEC_DIM;
	const float delta = (float)prm[P + 4 * h];
	const APE_REAL beta = prm[P + 4 * h + 1], gamma = prm[P + 4 * h + 2];
	const int tabbed = (flags & FS_BIAS) != 0;
	const long ne = Lqp + Lkp - 1; /* the bias table's length per head */
	const int16 iota = vload16(0, sep_iota);
	/* per row block g of the work-item: rows i0[g] .. i0[g] + 15 in the lanes */
	float16 acc[SEP_NB][DEC_DMAX], m[SEP_NB], l[SEP_NB];
	int16 d0[SEP_NB]; /* lane r: the anchor key (|n| - |n_anchor| = |d0 - j| when visible) */
	long i0[SEP_NB], nrow[SEP_NB], tstart[SEP_NB], tlo[SEP_NB], thi[SEP_NB];
	int done[SEP_NB];
	APE_REAL crow[SEP_NB][SEP_BQ];
	float16 p[SEP_BK];
	int16 vis[SEP_BK];
	float ms[SEP_BQ], ls[SEP_BQ];
	long tfirst = -1, tend;

	for (int g = 0; g < SEP_NB; g++) {
		i0[g] = (wg * SEP_NB + g) * SEP_BQ;
		nrow[g] = clamp(Lq - i0[g], 0L, (long)SEP_BQ);
		/* add_sat: ape_sat_add() on vectors (padding rows may pass INT64_MAX) */
		d0[g] = convert_int16(clamp(add_sat(convert_long16(iota),
						    (long16)ape_sat_add(rel, i0[g])),
					    0L, Lk - 1));
		for (int r = 0; r < SEP_BQ; r++)
			crow[g][r] = ape_bias((APE_REAL)prm[P + 4 * h], beta, gamma,
					      (APE_REAL)ape_anchor_distance(
						      ape_sat_add(rel, i0[g] + r), Lk, causal));
		for (int d = 0; d < DEC_DIM; d++)
			acc[g][d] = (float16)0.0f;
		m[g] = (float16)(-INFINITY);
		l[g] = (float16)0.0f;
		/* tiles: causal from the block's last diagonal backward, else all in order */
		if (causal) {
			const long dl = ape_sat_add(rel, i0[g] + nrow[g] - 1);

			tstart[g] = nrow[g] <= 0 || dl < 0 ? -1 : min(dl, Lk - 1) / SEP_BK;
		} else {
			tstart[g] = nrow[g] <= 0 ? -1 : 0;
		}
		tlo[g] = thi[g] = tstart[g];
		done[g] = tstart[g] < 0;
		tfirst = max(tfirst, tstart[g]);
	}
	/* every block of the work-item takes a key tile while it is in L1 (no tile at all when no
	 * row sees a key: the outputs below are still written) */
	tend = causal || tfirst < 0 ? -1 : ntk;
	for (long t = tfirst < 0 ? -1 : causal ? tfirst : 0; t != tend; t += causal ? -1 : 1) {
		const long k0 = t * SEP_BK;
		const int len = (int)min((long)SEP_BK, Lk - k0);
		int all_done = 1;

		for (int g = 0; g < SEP_NB; g++) {
			__global const float *qt = Qt + (bh * Lqp + i0[g]) * DEC_DIM;
			const int masked = len < SEP_BK ||
					   (causal && k0 + SEP_BK - 1 > ape_sat_add(rel, i0[g]));
			float16 S[SEP_BK], mt, corr, cr, lsum = (float16)0.0f;
			float bt[SEP_BQ + SEP_BK - 1];

			if (done[g] || (causal && t > tstart[g]))
				continue;
#pragma unroll
			for (int j = 0; j < SEP_BK; j++)
				S[j] = (float16)0.0f;
			/* the scores: 16 rows (lanes) x 16 keys, one query vector per d */
			NOUNROLL
			for (int d = 0; d < DEC_DIM; d++) {
				const float16 qv = vload16(0, qt + d * SEP_BQ);

#pragma unroll
				for (int j = 0; j < SEP_BK; j++)
					S[j] = fma(qv, (float16)kr[(k0 + j) * DEC_DIM + d], S[j]);
			}
			/* the table's bias at the tile's 31 distances n = rel + i0 - k0 + e - 15,
			 * relative to the one at e = 15 (bref: the general kernel's frame for a
			 * block, float32 keeps the fine differences), and bref - c_row per lane */
			if (tabbed) {
				__global const APE_REAL *tb =
					btab + h * ne + (i0[g] - k0 + Lkp - 1) - (SEP_BK - 1);
				const APE_REAL bref = tb[SEP_BK - 1];
				float c[SEP_BQ];

#pragma unroll
				for (int e = 0; e < SEP_BQ + SEP_BK - 1; e++)
					bt[e] = (float)(tb[e] - bref);
#pragma unroll
				for (int r = 0; r < SEP_BQ; r++)
					c[r] = (float)(bref - crow[g][r]);
				cr = vload16(0, c);
			}
			/* bias, masks, then one online-softmax update for the tile, lane-wise ('>'
			 * and fmax ignore NaN, exp keeps it; a non-finite dot makes the score NaN) */
			mt = m[g];
#pragma unroll
			for (int j = 0; j < SEP_BK; j++) {
				float16 s = S[j];

				if (tabbed) /* lane r: distance e = r - j + 15 */
					s += vload16(0, bt + (SEP_BK - 1 - j)) + cr;
				else if (delta != 0.0f) /* ape_bias_diff_f with beta = gamma = 0 */
					s -= delta * convert_float16(abs(d0[g] - ((int)k0 + j)));
				s = select((float16)NAN, s, isfinite(S[j]));
				if (masked) {
					/* lane r sees key k0 + j iff rel + i0 + r >= k0 + j */
					const long need = k0 + j - (rel + i0[g]);
					const int16 v = j >= len		   ? (int16)0
							: !causal || need <= 0 ? (int16)(-1)
							: need < SEP_BQ	   ? iota >= (int16)(int)need
									   : (int16)0;

					vis[j] = v;
					s = select((float16)(-INFINITY), s, v);
				}
				S[j] = s;
				mt = fmax(mt, s);
			}
			corr = select(select(dec_exp16(m[g] - mt), (float16)0.0f,
					     m[g] - mt < APE_EXP_CUTOFF),
				      (float16)1.0f, m[g] == mt);
#pragma unroll
			for (int j = 0; j < SEP_BK; j++) {
				const float16 dd = S[j] - mt;

				p[j] = select(dec_exp16(dd), (float16)0.0f,
					      dd < APE_EXP_CUTOFF || S[j] == (float16)(-INFINITY));
				lsum += p[j];
			}
			l[g] = l[g] * corr + lsum;
			m[g] = mt;
			sep_pv(vf + k0 * DEC_DIM, D, masked, corr, p, vis, acc[g]);
			tlo[g] = min(tlo[g], t);
			thi[g] = max(thi[g], t);

			/* far keys (causal, walking backward): the block stops once every row may
			 * leave out the keys before this tile */
			if (skip && t > 0) {
				const APE_REAL kb = kpre[bkv * (ntk + 1) + t];
				int stop = 1;

				vstore16(m[g], 0, ms);
				vstore16(l[g], 0, ls);
				for (int r = 0; r < nrow[g] && stop; r++) {
					const long diag = rel + (i0[g] + r);
					const long cnt = ape_visible_keys(diag, k0, causal);

					if (cnt <= 0)
						continue;
					stop = ape_may_skip(0, prm[P + 4 * h], beta, gamma,
							    fabs((APE_REAL)scale),
							    qn[bh * Lqp + i0[g] + r], kb,
							    ape_keys_min_abs(diag, 0, cnt), cnt,
							    crow[g][r], ms[r], ls[r], -INFINITY, tol);
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
				st(O, ooff + b * osb + h * osh + (i0[g] + r) * osl + d, o[r],
				   FD_DT_OUT(flags));
		}
		for (int r = 0; r < nrow[g]; r++) {
			const long i = i0[g] + r, diag = rel + i; /* a real row: fits */

			if (flags & FD_LSE)
				LSE[loff + b * lsb + h * lsh + i * lsl] =
					ls[r] > 0.0f ? (float)(crow[g][r] + (APE_REAL)ms[r] +
							       log((APE_REAL)ls[r]))
					: ls[r] == 0.0f ? -INFINITY
							: NAN;
			if (flags & FD_PAIRS) {
				const long jb = tstart[g] < 0 ? 0 : tlo[g] * SEP_BK;
				const long je = tstart[g] < 0 ? 0 : min((thi[g] + 1) * SEP_BK, Lk);

				PAIRS[bh * Lq + i] =
					(ulong)ape_row_visible_pairs(diag, jb, je, causal);
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
			      long osl, long loff, long lsb, long lsh, long lsl, int D, long Lq,
			      long Lqp, long Lk, long Lkp, int H, int group, long rel, float scale,
			      float tol, int flags, __local float *kl, __local float *vl)
{
	/* kl, vl: SEP_GBK * D floats each, sized by the host (no local array sized for the
	 * program's largest D: a device with little local memory still builds the program) */
	__local int lstop;
	const int lid = (int)get_local_id(0), nwi = (int)get_local_size(0);
	/* the heaviest causal groups (the last ones) are handed out first */
	const long i0 = ((long)get_num_groups(0) - 1 - (long)get_group_id(0)) * nwi, i = i0 + lid;
	const long bh = get_global_id(1), b = bh / H, diag = ape_sat_add(rel, i);
	const int h = (int)(bh % H), P = DEC_DIM / 2, live = i < Lq;
	const int causal = (flags & FD_CAUSAL) != 0, skip = causal && (flags & FS_SKIP) != 0;
	const long bkv = b * (H / group) + h / group, ntk = Lkp / SEP_GBK;
	__global const float *kr = Kr + bkv * Lkp * DEC_DIM;
	__global const float *vf = Vf + bkv * Lkp * DEC_DIM;
	const float delta = (float)prm[P + 4 * h];
	const APE_REAL beta = prm[P + 4 * h + 1], gamma = prm[P + 4 * h + 2];
	const int tabbed = (flags & FS_BIAS) != 0;
	const long ne = Lqp + Lkp - 1; /* the bias table's length per head */
	const long nlive = clamp(Lq - i0, 0L, (long)nwi);
	/* the anchor key (|n| - |n_anchor| = |d0 - j| when visible) and the row's bias there */
	const int d0 = (int)clamp(diag, 0L, Lk - 1);
	const APE_REAL crow =
		live ? ape_bias((APE_REAL)prm[P + 4 * h], beta, gamma,
				(APE_REAL)ape_anchor_distance(diag, Lk, causal))
		     : (APE_REAL)0;
	float q[DEC_DMAX], acc[DEC_DMAX], m = -INFINITY, lsum = 0.0f;
	long tlast, tlo = -1, thi = -1;

	/* tiles: causal from the group's last diagonal backward, else all in order */
	if (nlive <= 0)
		tlast = -1;
	else if (causal)
		tlast = rel + (i0 + nlive - 1) < 0 ? -1
						    : min(rel + (i0 + nlive - 1), Lk - 1) / SEP_GBK;
	else
		tlast = ntk - 1;
	for (int d = 0; d < DEC_DIM; d++) {
		q[d] = live ? Qt[(bh * Lqp + i / SEP_BQ * SEP_BQ) * DEC_DIM + d * SEP_BQ + i % SEP_BQ]
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
					x += (float)(btab[h * ne + (i - (k0 + j) + Lkp - 1)] - crow);
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

				if (cnt > 0)
					stop = ape_may_skip(0, prm[P + 4 * h], beta, gamma,
							    fabs((APE_REAL)scale), qn[bh * Lqp + i],
							    kpre[bkv * (ntk + 1) + t],
							    ape_keys_min_abs(diag, 0, cnt), cnt,
							    crow, m, lsum, -INFINITY, tol);
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
			st(O, ooff + b * osb + h * osh + i * osl + d, acc[d] * inv, FD_DT_OUT(flags));
		if (flags & FD_LSE)
			LSE[loff + b * lsb + h * lsh + i * lsl] =
				lsum > 0.0f ? (float)(crow + (APE_REAL)m + log((APE_REAL)lsum))
				: lsum == 0.0f ? -INFINITY
					       : NAN;
		if (flags & FD_PAIRS) {
			const long jb = tlo < 0 ? 0 : tlo * SEP_GBK;
			const long je = tlo < 0 ? 0 : min((thi + 1) * SEP_GBK, Lk);

			PAIRS[bh * Lq + i] = (ulong)ape_row_visible_pairs(diag, jb, je, causal);
		}
	}
}
