/* SPDX-License-Identifier: MIT */
/*
 * The separable path (docs/kernels.md, "Decode and the separable path"), OpenCL C 1.2.
 *
 * For launches whose every head has lambda = 0 (alpha = 1, temp = 1) and no decay but delta
 * (plain RoPE, ALiBi-style): the rotation by n = (rel + i) - j separates into the query's at
 * rel + i and the key's at j, so Q and K are rotated once (ape_sep_rot_q, ape_sep_rot_k: O(L D)
 * into scratch, Q scaled, K transposed to [D][keys] so that 16 keys are one vector), and the
 * scores are a plain matrix product plus -delta (|n| - |n_anchor|). ape_sep_attn gives one
 * work-item a block of SEP_BQ queries and walks key tiles of SEP_BK keys: SEP_BQ score vectors
 * (one per query, lanes = keys) stay in registers over the D loop, then one online-softmax
 * update per row and tile, then P V over D in 16-wide chunks. Causal launches walk from the
 * diagonal backward and, when skipping is allowed, stop once every row of the block has proved
 * the rest negligible (ape_may_skip, with per-tile key norms from ape_sep_rot_k).
 * Built after attention.cl and decode.cl in one program (ld(), st(), dec_ld16(), dec_seed16()).
 */

#define SEP_BQ 16 /* query rows per work-item (ocl_separable.c mirrors it) */
#define SEP_BK 16 /* keys per tile: one float16 */
#define SEP_NCMAX (DEC_DMAX / 16)

#define FS_SKIP 256 /* ocl_fast.h */

__constant int sep_iota[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };

KFN float sep_hmax(float16 x) /* fmax: a NaN lane is ignored, as '>' does in attention.cl */
{
	const float8 a = fmax(x.lo, x.hi);
	const float4 b = fmax(a.lo, a.hi);
	const float2 c = fmax(b.lo, b.hi);

	return fmax(c.x, c.y);
}

/*
 * exp on 16 lanes for the weights (arguments <= 0; what is below -87 or -inf the caller zeroes):
 * 2^n e^r with n = rint(x log2 e), r reduced with a two-part ln 2, e^r by its degree-6 Taylor
 * polynomial (|r| <= ln2 / 2: relative error below 2e-7). PoCL's own vector exp cost more than
 * the whole dot product of the tile (bench/RESULTS.md). A NaN stays NaN.
 */
KFN float16 sep_exp16(float16 x)
{
	const float16 n = rint(x * 1.44269504088896341f);
	const float16 r = fma(n, -1.42860677e-6f, fma(n, -0.693145752f, x));
	float16 p = fma(r, 1.0f / 720, 1.0f / 120);

	p = fma(p, r, 1.0f / 24);
	p = fma(p, r, 1.0f / 6);
	p = fma(p, r, 0.5f);
	p = fma(p, r, 1.0f);
	p = fma(p, r, 1.0f);
	p *= as_float16((convert_int16(fmax(n, -126.0f)) + 127) << 23);
	return select(p, x, isnan(x));
}

/* One query row per work-item (rows past Lq: zeros), rotated at its position rel + i, times
 * scale, pairs in the half layout; and |q| rounded up (a bound, for skipping). */
__kernel void ape_sep_rot_q(__global const void *Q, __global const APE_REAL *prm, long qoff,
			    long qsb, long qsh, long qsl, int D, long Lq, long Lqp, int H, long rel,
			    float scale, int flags, __global float *Qr, __global float *qn)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	__global float *out = Qr + (bh * Lqp + i) * DEC_DIM;

	if (i >= Lqp)
		return;
	if (i >= Lq) {
		for (int d = 0; d < DEC_DIM; d++)
			out[d] = 0.0f;
		return;
	}
	{
		const long base = qoff + bh / H * qsb + bh % H * qsh + i * qsl;
		APE_REAL ss = 0;

		for (int c = 0; c < C; c++) {
			float16 x, y, co, si = dec_seed16(prm, c, (APE_REAL)(rel + i), 1, &co);

			dec_pairs(Q, base, c, P, inter, FD_DT_IN(flags), &x, &y);
			ss += (APE_REAL)dec_hsum(x * x) + (APE_REAL)dec_hsum(y * y);
			vstore16(scale * (x * co - y * si), 0, out + 16 * c);
			vstore16(scale * (x * si + y * co), 0, out + P + 16 * c);
		}
		qn[bh * Lqp + i] = (float)ape_norm_bound(ss);
	}
}

/* One key tile per work-item: its keys rotated at their positions j into Kt[bkv][d][j] (keys past
 * Lk: zeros), and the tile's largest key norm, rounded up (+inf when the tile's K or V holds a
 * NaN or Inf, so that it is never skipped). */
__kernel void ape_sep_rot_k(__global const void *K, __global const void *V,
			    __global const APE_REAL *prm, long koff, long ksb, long ksh, long ksl,
			    long voff, long vsb, long vsh, long vsl, int D, long Lk, long Lkp,
			    int Hkv, int flags, __global float *Kt, __global float *ktile)
{
	const long t = get_global_id(0), bkv = get_global_id(1), ntk = Lkp / SEP_BK;
	const int P = DEC_DIM / 2, C = P / 16, inter = (flags & FD_INTERLEAVED) != 0;
	const int dt = FD_DT_IN(flags);
	__global float *kt = Kt + bkv * DEC_DIM * Lkp;
	float mx = 0.0f;

	if (t >= ntk)
		return;
	for (long j = t * SEP_BK; j < (t + 1) * SEP_BK; j++) {
		if (j >= Lk) {
			for (int d = 0; d < DEC_DIM; d++)
				kt[d * Lkp + j] = 0.0f;
			continue;
		}
		{
			const long kb = koff + bkv / Hkv * ksb + bkv % Hkv * ksh + j * ksl;
			const long vb = voff + bkv / Hkv * vsb + bkv % Hkv * vsh + j * vsl;
			float s = 0.0f, vs = 0.0f;

			for (int c = 0; c < C; c++) {
				float16 x, y, co, si = dec_seed16(prm, c, (APE_REAL)j, 1, &co);
				float xr[16], yr[16];

				dec_pairs(K, kb, c, P, inter, dt, &x, &y);
				vstore16(x * co - y * si, 0, xr);
				vstore16(x * si + y * co, 0, yr);
				s += dec_hsum(x * x + y * y);
				for (int k = 0; k < 16; k++) {
					kt[(16 * c + k) * Lkp + j] = xr[k];
					kt[(P + 16 * c + k) * Lkp + j] = yr[k];
				}
			}
			for (int c = 0; c < 2 * C; c++)
				vs += dec_hsum(0.0f * dec_ld16(V, vb + 16 * c, dt)); /* NaN for NaN/Inf */
			s = sqrt(s) + vs;
			if (!(s <= mx))
				mx = isnan(s) ? INFINITY : s;
		}
	}
	ktile[bkv * ntk + t] = ape_norm_bound_f(mx);
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

/* acc[r][c] += sum over keys j < len of p[r][j] V[j][16c ..], for the rows r that see j */
KFN void sep_pv(__global const void *V, long vb, long vsl, int D, int dt, int len, int masked,
		int causal, const long *diag, long k0, float p[SEP_BQ][SEP_BK],
		float16 acc[SEP_BQ][SEP_NCMAX])
{
	NOUNROLL
	for (int c = 0; c < DEC_DIM / 16; c++) {
		float16 a[SEP_BQ];

#pragma unroll
		for (int r = 0; r < SEP_BQ; r++)
			a[r] = acc[r][c];
		if (!masked) {
			NOUNROLL
			for (int j = 0; j < SEP_BK; j++) {
				const float16 v = dec_ld16(V, vb + j * vsl + 16 * c, dt);

#pragma unroll
				for (int r = 0; r < SEP_BQ; r++)
					a[r] = fma((float16)p[r][j], v, a[r]);
			}
		} else {
			/* a masked key adds nothing at all, not 0 * V (V may hold a NaN) */
			NOUNROLL
			for (int j = 0; j < len; j++) {
				const float16 v = dec_ld16(V, vb + j * vsl + 16 * c, dt);

#pragma unroll
				for (int r = 0; r < SEP_BQ; r++)
					if (!causal || k0 + j <= diag[r])
						a[r] = fma((float16)p[r][j], v, a[r]);
			}
		}
#pragma unroll
		for (int r = 0; r < SEP_BQ; r++)
			acc[r][c] = a[r];
	}
}

__kernel void ape_sep_attn(__global const float *Qr, __global const float *Kt,
			   __global const void *V, __global void *O, __global float *LSE,
			   __global ulong *PAIRS, __global const APE_REAL *prm,
			   __global const float *qn, __global const float *kpre, long voff, long vsb,
			   long vsh, long vsl, long ooff, long osb, long osh, long osl, long loff,
			   long lsb, long lsh, long lsl, int D, long Lq, long Lqp, long Lk, long Lkp,
			   int H, int group, long rel, float scale, float tol, int flags)
{
	/* the heaviest causal blocks (the last ones) are handed out first */
	const long qb = (long)get_num_groups(0) - 1 - (long)get_group_id(0);
	const long bh = get_global_id(1), b = bh / H, i0 = qb * SEP_BQ;
	const int h = (int)(bh % H), P = DEC_DIM / 2, dt = FD_DT_IN(flags);
	const int causal = (flags & FD_CAUSAL) != 0, skip = causal && (flags & FS_SKIP) != 0;
	const long bkv = b * (H / group) + h / group, ntk = Lkp / SEP_BK;
	const long nrow = min((long)SEP_BQ, Lq - i0), vb = voff + b * vsb + (h / group) * vsh;
	__global const float *qr = Qr + (bh * Lqp + i0) * DEC_DIM;
	__global const float *kt = Kt + bkv * DEC_DIM * Lkp;
	const float delta = (float)prm[P + 4 * h];
	const int16 iota = vload16(0, sep_iota);
	float16 acc[SEP_BQ][SEP_NCMAX];
	float m[SEP_BQ], l[SEP_BQ], p[SEP_BQ][SEP_BK];
	long diag[SEP_BQ];
	int d0[SEP_BQ]; /* the anchor key: |n| - |n_anchor| = |d0 - j| for every visible key */
	APE_REAL crow[SEP_BQ];
	long tstart, tend, tlo, thi;

	if (nrow <= 0)
		return;
#pragma unroll
	for (int r = 0; r < SEP_BQ; r++) {
		diag[r] = rel + i0 + r;
		d0[r] = (int)clamp(diag[r], 0L, Lk - 1);
		crow[r] = ape_bias((APE_REAL)prm[P + 4 * h], 0, 0,
				   (APE_REAL)ape_anchor_distance(diag[r], Lk, causal));
		m[r] = -INFINITY;
		l[r] = 0.0f;
		for (int c = 0; c < DEC_DIM / 16; c++)
			acc[r][c] = (float16)0.0f;
	}
	/* tiles: causal from the last row's diagonal backward, else all of them in order */
	if (causal) {
		const long dl = diag[0] + nrow - 1;

		tstart = dl < 0 ? -1 : min(dl, Lk - 1) / SEP_BK;
		tend = -1;
	} else {
		tstart = 0;
		tend = ntk;
	}
	tlo = thi = tstart;
	for (long t = tstart; t != tend; t += causal ? -1 : 1) {
		const long k0 = t * SEP_BK;
		const int len = (int)min((long)SEP_BK, Lk - k0);
		const int masked = len < SEP_BK || (causal && k0 + SEP_BK - 1 > diag[0]);
		float16 S[SEP_BQ];

#pragma unroll
		for (int r = 0; r < SEP_BQ; r++)
			S[r] = (float16)0.0f;
		/* the scores: SEP_BQ x SEP_BK, one key vector per d */
		NOUNROLL
		for (int d = 0; d < DEC_DIM; d++) {
			const float16 kv = vload16(0, kt + d * Lkp + k0);

#pragma unroll
			for (int r = 0; r < SEP_BQ; r++)
				S[r] = fma((float16)qr[r * DEC_DIM + d], kv, S[r]);
		}
		/* bias, masks, one online-softmax update per row */
#pragma unroll
		for (int r = 0; r < SEP_BQ; r++) {
			const int16 j = (int)k0 + iota;
			float16 s = S[r];
			float mt, corr;

			if (delta != 0.0f)
				s -= delta * convert_float16(abs(d0[r] - j)); /* ape_bias_diff_f, beta = gamma = 0 */
			/* a NaN or Inf input must not vanish: a non-finite dot makes the score NaN */
			s = select((float16)NAN, s, isfinite(S[r]));
			if (masked) { /* past the end, or after the row's diagonal */
				const int lim = causal ? (int)clamp(diag[r], -1L, k0 + SEP_BK)
						       : (int)k0 + SEP_BK;

				s = select(s, (float16)(-INFINITY), j >= (int)k0 + len || j > lim);
			}
			mt = fmax(m[r], sep_hmax(s));
			corr = m[r] == mt ? 1.0f : m[r] - mt < -87.0f ? 0.0f : exp(m[r] - mt);
			{
				const float16 dd = s - mt;
				const float16 pv = select(sep_exp16(dd), (float16)0.0f,
							  dd < -87.0f || s == (float16)(-INFINITY));

				vstore16(pv, 0, p[r]);
				l[r] = l[r] * corr + dec_hsum(pv);
			}
			m[r] = mt;
			if (corr != 1.0f)
				for (int c = 0; c < DEC_DIM / 16; c++)
					acc[r][c] *= corr;
		}
		sep_pv(V, vb + k0 * vsl, vsl, D, dt, len, masked, causal, diag, k0, p, acc);
		tlo = min(tlo, t);
		thi = max(thi, t);

		/* far keys (causal, walking backward): stop once every row may leave out the
		 * keys before this tile */
		if (skip && t > 0) {
			const APE_REAL kb = kpre[bkv * (ntk + 1) + t];
			int stop = 1;

			for (int r = 0; r < nrow && stop; r++) {
				const long cnt = min(k0, diag[r] + 1);

				if (cnt <= 0)
					continue;
				stop = ape_may_skip(0, prm[P + 4 * h], 0, 0, fabs((APE_REAL)scale),
						    qn[bh * Lqp + i0 + r], kb,
						    ape_min_abs(diag[r] - cnt + 1, diag[r]), cnt,
						    crow[r], m[r], l[r], -INFINITY, tol);
			}
			if (stop)
				break;
		}
	}

	/* outputs: O = acc / l (0 with no key), LSE = c_row + m + ln l, the pairs computed */
	for (int r = 0; r < nrow; r++) {
		const long i = i0 + r;
		const float inv = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
		const long ob = ooff + b * osb + h * osh + i * osl;

		for (int c = 0; c < DEC_DIM / 16; c++) {
			float o[16];

			vstore16(acc[r][c] * inv, 0, o);
			for (int k = 0; k < 16; k++)
				st(O, ob + 16 * c + k, o[k], FD_DT_OUT(flags));
		}
		if (flags & FD_LSE)
			LSE[loff + b * lsb + h * lsh + i * lsl] =
				l[r] > 0.0f ? (float)(crow[r] + (APE_REAL)m[r] + log((APE_REAL)l[r]))
				: l[r] == 0.0f ? -INFINITY
					       : NAN;
		if (flags & FD_PAIRS) {
			const long jb = tstart < 0 ? 0 : tlo * SEP_BK;
			const long je = tstart < 0 ? 0 : min((thi + 1) * SEP_BK, Lk);

			PAIRS[bh * Lq + i] =
				(ulong)max(0L, (causal ? min(je, diag[r] + 1) : je) - jb);
		}
	}
}
