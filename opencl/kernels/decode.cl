/* SPDX-License-Identifier: MIT */
/*
 * Split-K decode (docs/kernels.md, "Decode and the separable path"), OpenCL C 1.2.
 *
 * For launches with a few query rows and many keys (a decode step against a KV cache): the keys
 * of each (batch, kv head) are split into chunks of whole 64-key tiles, one work-item per chunk
 * (work-groups of one work-item: no barrier). A work-item serves every query row of every query
 * head sharing its kv head (GQA), so it streams its K and V range once, as float16 vectors along
 * D (f16 through vload_half16, bf16 by a shift), and keeps per row a partial O, maximum and sum.
 * ape_decode_merge then combines the chunks of each row by LSE, in chunk order (deterministic),
 * and writes O, LSE and the pairs computed.
 *
 * The score is the forward kernel's: the query walks the keys by the rotation recurrence,
 * reseeded with ape_seed_sincos at every tile start; temperature and bias from ape_math.h's
 * float32 distance terms in the row's frame c_row (the bias at its anchor distance), plus the
 * distance-bias table's entry where the launch has one (BT, blen > 0); one
 * online-softmax update per row and block of 16 keys, on a float16 of scores. With float32
 * rows (any rows where the compiler has __builtin_prefetch) each block first requests its
 * value rows, and the key rows of the next block before its P V (dec_touch; a distance
 * measured best: further ahead was slower, bench/RESULTS.md):
 * the loads of the rows that follow then find them on their way. Nothing is
 * skipped: the host sends here only launches where skipping is off or has nothing to gain.
 * Built after attention.cl in one program: ld(), st(), KFN, CAT and the DT_ values are its.
 * Needs D % 32 == 0 (whole float16 chunks of pairs in both layouts).
 */

#if APE_D
#define DEC_DMAX APE_D
#define DEC_DIM APE_D
#else
#define DEC_DMAX APE_MAX_D
#define DEC_DIM D
#endif
#define DEC_CMAX (DEC_DMAX / 32) /* float16 chunks of pairs per half */
#define DEC_RMAX (DEC_DMAX <= 128 ? 16 : 8) /* rows per work-item (ocl_decode.c mirrors it) */
#define DEC_TILE 64 /* keys per seed of the rotation recurrence */
#define DEC_BLK 16 /* keys per online-softmax update */

/* launch flags (ocl_fast.h) */
#define FD_DT_IN(f) ((f) & 3)
#define FD_DT_OUT(f) (((f) >> 2) & 3)
#define FD_CAUSAL 16
#define FD_INTERLEAVED 32
#define FD_LSE 64
#define FD_PAIRS 128

#if APE_RW == 1
#define DEC_VLR(p) (*(p))
#define DEC_VSF(v, p) (*(p) = (v))
#else
#define DEC_VLR(p) CAT(vload, APE_RW)(0, (p))
#define DEC_VSF(v, p) CAT(vstore, APE_RW)((v), 0, (p))
#endif

/* 16 consecutive elements from element index i, as float */
KFN float16 dec_ld16(__global const void *p, long i, int dt)
{
	if (dt == DT_F16)
		return vload_half16(0, (__global const half *)((__global const ushort *)p + i));
	if (dt == DT_BF16)
		return as_float16(convert_uint16(vload16(0, (__global const ushort *)p + i)) << 16);
	return vload16(0, (__global const float *)p + i);
}

/* Pairs 16c .. 16c+15 of the row at element base: first components u, second w. */
KFN void dec_pairs(__global const void *X, long base, int c, int P, int inter, int dt,
		   float16 *u, float16 *w)
{
	if (inter) {
		const float16 a = dec_ld16(X, base + 32 * c, dt);
		const float16 b = dec_ld16(X, base + 32 * c + 16, dt);

		*u = (float16)(a.even, b.even);
		*w = (float16)(a.odd, b.odd);
	} else {
		*u = dec_ld16(X, base + 16 * c, dt);
		*w = dec_ld16(X, base + P + 16 * c, dt);
	}
}

KFN float dec_hsum(float16 x)
{
	const float8 a = x.lo + x.hi;
	const float4 b = a.lo + a.hi;
	const float2 c = b.lo + b.hi;

	return c.x + c.y;
}

/*
 * exp on 16 lanes for the weights (arguments <= 0; what is below -87 or -inf the caller zeroes):
 * 2^n e^r with n = rint(x log2 e), r reduced with a two-part ln 2, e^r by its degree-6 Taylor
 * polynomial (|r| <= ln2 / 2: relative error below 2e-7); arguments below -100 are clamped (the
 * caller zeroes every weight below e^-87). PoCL's own vector exp rounds with a
 * dozen instructions where this takes two (bench/RESULTS.md). A NaN stays NaN.
 */
KFN float16 dec_exp16(float16 x)
{
	/* n = rint(x log2 e) by the 1.5 * 2^23 shift. For x >= APE_EXP_CUTOFF (-87) or NaN only:
	 * every caller replaces the lanes below (-inf included) by zeros, so they go unclamped here
	 * (their values are garbage), and a NaN propagates through the FMAs and the product. */
	const float16 t = fma(x, 1.44269504088896341f, 12582912.0f);
	const float16 n = t - 12582912.0f;
	const float16 r = fma(n, -1.42860677e-6f, fma(n, -0.693145752f, x));
	float16 p = fma(r, 1.0f / 720, 1.0f / 120);

	p = fma(p, r, 1.0f / 24);
	p = fma(p, r, 1.0f / 6);
	p = fma(p, r, 0.5f);
	p = fma(p, r, 1.0f);
	p = fma(p, r, 1.0f);
	/* 2^n from the shifted value's low bits: as_int(t) - as_int(1.5 * 2^23) = n */
	return p * as_float16((as_int16(t) - 0x4b400000 + 127) << 23);
}

KFN float dec_hmax(float16 x) /* fmax: a NaN lane is ignored, as '>' is in attention.cl */
{
	const float8 a = fmax(x.lo, x.hi);
	const float4 b = fmax(a.lo, a.hi);
	const float2 c = fmax(b.lo, b.hi);

	return fmax(c.x, c.y);
}

/* sin and cos of ang * omega_p for the pairs 16c .. 16c+15 (ape_seed_sincos, APE_RW lanes at
 * a time); ang = n / alpha (float64 when the device has it). */
KFN float16 dec_seed16(__global const APE_REAL *omega, int c, APE_REAL n, APE_REAL ia,
		       float16 *cosine)
{
	float s[16], co[16];

	for (int k = 0; k < 16; k += APE_RW) {
		ape_vfloat cv, sv = ape_seed_sincos((ape_vreal)n * (DEC_VLR(omega + 16 * c + k) *
								    (ape_vreal)ia),
						    &cv);

		DEC_VSF(sv, s + k);
		DEC_VSF(cv, co + k);
	}
	*cosine = vload16(0, co);
	return vload16(0, s);
}

/* The work of one chunk for at most RM rows (a constant in each kernel below, so that the rows'
 * arrays stay in registers once the row loops are unrolled). */
#define DEC_ARGS                                                                                   \
	__global const void *Q, __global const void *K, __global const void *V,                     \
		__global const APE_REAL *prm, __global float *part, long qoff, long qsb, long qsh, \
		long qsl, long koff, long ksb, long ksh, long ksl, long voff, long vsb, long vsh,  \
		long vsl, int D, long Lq, long Lk, int H, int group, long rel, float scale,       \
		int flags, long chunk, int nsplit, long pbt, long pnb, long pfirst, long prow,     \
		long pblk, __global const long *ptab, __global const long *sg,                     \
		__global const float *BT, long blen, long bhs, long nseg
#define DEC_NAMES                                                                                  \
	Q, K, V, prm, part, qoff, qsb, qsh, qsl, koff, ksb, ksh, ksl, voff, vsb, vsh, vsl, D, Lq,  \
		Lk, H, group, rel, scale, flags, chunk, nsplit, pbt, pnb, pfirst, prow, pblk, ptab, \
		sg, BT, blen, bhs, nseg

/*
 * Where keys bb .. bb + len - 1 start, relative to their (batch, kv head) base: j * ksl and
 * j * vsl, or with pages (pbt > 0: a KV cache's blocks read in place, struct ape_be_kv_pages)
 * key j is token prow + j from the start of physical block pfirst, the blocks a ring of pnb,
 * each pblk elements apart, or (ptab not NULL: a page table) logical block lb is physical
 * block ptab[pfirst + lb]; K and V share the geometry there (ksl = vsl: the pages' row
 * stride). One division per 16 keys.
 */
KFN long dec_block(long pfirst, long lb, long pnb, __global const long *ptab)
{
	return ptab ? ptab[pfirst + lb] : (pfirst + lb) % pnb;
}

KFN void dec_rows(long bb, int len, long ksl, long vsl, long pbt, long pnb, long pfirst,
		  long prow, long pblk, __global const long *ptab, long *rk, long *rv)
{
	if (!pbt) {
		for (int jj = 0; jj < len; jj++) {
			rk[jj] = (bb + jj) * ksl;
			rv[jj] = (bb + jj) * vsl;
		}
		return;
	}
	const long t = prow + bb;
	long lb = t / pbt, r = t - lb * pbt, base = dec_block(pfirst, lb, pnb, ptab) * pblk;

	for (int jj = 0; jj < len; jj++) {
		rk[jj] = rv[jj] = base + r * ksl;
		if (++r == pbt) {
			r = 0;
			lb++;
			base = dec_block(pfirst, lb, pnb, ptab) * pblk;
		}
	}
}

/* Clang's __builtin_prefetch (PoCL compiles OpenCL's prefetch() to nothing, but this to
 * prefetcht0 on x86); other compilers touch a byte of the line instead. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_prefetch)
#define DEC_PREFETCH 1
#endif
#endif

/* Requests every 64-byte line of len rows of n elements at base + off[jj] (inside the rows,
 * whatever their alignment): the lines a later pass reads then have their misses in flight
 * together, instead of a row at a time inside the pass. With the prefetch instruction nothing
 * is loaded; without it one byte of each line is read and OR-ed into *acc. */
KFN void dec_touch(__global const void *X, long base, const long *off, int len, int n, int dt,
		   uint *acc)
{
	const int bytes = n * (dt == DT_F16 || dt == DT_BF16 ? 2 : 4);
	uint a = *acc;

	for (int jj = 0; jj < len; jj++) {
		__global const uchar *p = (__global const uchar *)X + (base + off[jj]) * (bytes / n);

		for (int o = 0; o < bytes; o += 64)
#ifdef DEC_PREFETCH
			__builtin_prefetch(p + o, 0, 3);
#else
			a |= p[o];
#endif
	}
	*acc = a;
}

/*
 * ape_decode_<RM>'s ragged grid (nseg > 0 segments): one dimension over the chunks of every
 * segment and kv head, no work-item idle (a 2-D grid of the most chunks of one segment by the
 * segments' kv heads left most of its work-items nothing to do: a thousand tiny segments beside
 * a long one, bench/RESULTS.md). The nseg + 1 longs after the segment table (sg + 8 nseg) are
 * where each segment's work-items start (its kv heads' chunks, the last one the total): work-item
 * g of segment e (the last start <= g, by bisection) is chunk (g - start) % nsplit of kv head
 * (g - start) / nsplit, so consecutive work-items take a head's chunks in order as before.
 * Returns 0 for a work-item past the total (a grid of one for none).
 */
KFN int dec_flat(__global const long *sg, long nseg, int Hkv, long *s, long *bkv)
{
	__global const long *st = sg + 8 * nseg;
	const long g = *s;
	long lo = 0, hi = nseg - 1; /* st[lo] <= g < st[hi + 1] */

	if (g >= st[nseg]) /* past the last (the grid has at least one work-item) */
		return 0;
	while (lo < hi) {
		const long mid = (lo + hi + 1) / 2;

		if (st[mid] <= g)
			lo = mid;
		else
			hi = mid - 1;
	}
	const long loc = g - st[lo], ns = sg[8 * lo + 6];

	*bkv = lo * Hkv + loc / ns;
	*s = loc % ns;
	return 1;
}

/*
 * A ragged launch (sg not NULL, the plain shape only): a work-item's segment e and kv head
 * come from dec_flat() in ape_decode_<RM>, from dimension 1 in the merge (segment e's heads
 * instead of the batch's); e's eight longs at sg + 8 e are its first query row q0, its rows
 * lq, its first key row k0, its keys lk, its rows' distance to its first key (q_start -
 * k_start), its chunk, its chunks (nsplit) and where its partials start (poff: row h * lq + i
 * of the segment at partial row poff + (h * lq + i) * nsplit). Each segment is cut into chunks
 * as a dense launch of it alone would be (the host chooses them so), so that its arithmetic is
 * the same, bit for bit, whatever other segments share its launch. dec_seg() gives a
 * work-item its segment's values.
 */
KFN void dec_seg(__global const long *sg, long e, long *b, long *q0, long *lq, long *k0, long *lk,
		 long *rel, long *chunk, int *nsplit, long *poff)
{
	if (!sg)
		return;
	sg += 8 * e;
	*b = 0;
	*q0 = sg[0];
	*lq = sg[1];
	*k0 = sg[2];
	*lk = sg[3];
	*rel = sg[4];
	*chunk = sg[5];
	*nsplit = (int)sg[6];
	*poff = sg[7];
}

KFN void dec_body(DEC_ARGS, const int RM)
{
	const int P = DEC_DIM / 2, C = P / 16, dt = FD_DT_IN(flags);
	const int inter = (flags & FD_INTERLEAVED) != 0, causal = (flags & FD_CAUSAL) != 0;
	const int Hkv = H / group;
	long s = get_global_id(0), bkv = get_global_id(1);

	if (nseg > 0 && !dec_flat(sg, nseg, Hkv, &s, &bkv))
		return;
	const int kvh = (int)(bkv % Hkv);
	long b = bkv / Hkv, q0 = 0, k0 = 0, Lqs = Lq, poff = -1;

	dec_seg(sg, bkv / Hkv, &b, &q0, &Lqs, &k0, &Lk, &rel, &chunk, &nsplit, &poff);
	const int nr = group * (int)Lqs;
	const long j0 = s * chunk, j1 = max(j0, min(j0 + chunk, Lk));
	__global const APE_REAL *omega = prm;

	float16 X[DEC_RMAX][DEC_CMAX], Y[DEC_RMAX][DEC_CMAX]; /* the rotated query, as pairs */
	float16 X0[DEC_RMAX][DEC_CMAX], Y0[DEC_RMAX][DEC_CMAX]; /* the query */
	float16 CW[DEC_RMAX][DEC_CMAX], SW[DEC_RMAX][DEC_CMAX]; /* cos, sin of the per-key step */
	float16 ACC[DEC_RMAX][2 * DEC_CMAX];
	float M[DEC_RMAX], L[DEC_RMAX], sc[DEC_RMAX][DEC_BLK];
	float rdelta[DEC_RMAX], rbeta[DEC_RMAX], rgamma[DEC_RMAX], rlambda[DEC_RMAX];
	long diag[DEC_RMAX], aref[DEC_RMAX], jend[DEC_RMAX];
	long toff[DEC_RMAX]; /* blen > 0: where the row's head's table row starts in BT */
	APE_REAL ia[DEC_RMAX];
	int decay[DEC_RMAX];
	long kend = j0;
	uint touched = 0; /* dec_touch()'s loads, kept by the volatile store at the end */
	/* requesting ahead pays for every type with prefetches; byte touches cost f16 and bf16 rows
	 * (half the bytes) more than they save (bench/RESULTS.md) */
#ifdef DEC_PREFETCH
	const int touch = 1;
#else
	const int touch = dt != DT_F16 && dt != DT_BF16;
#endif

	if (s >= nsplit)
		return;
#pragma unroll
	for (int r = 0; r < RM; r++) {
		const int g = r / (int)Lqs, h = kvh * group + g;
		const long i = r % Lqs;

		if (r >= nr)
			break;
		const long qb = qoff + b * qsb + h * qsh + (q0 + i) * qsl;
		APE_REAL sum = 0, ss = 0, mean;

		for (int c = 0; c < C; c++) {
			float16 x, y;

			dec_pairs(Q, qb, c, P, inter, dt, &x, &y);
			X0[r][c] = x;
			Y0[r][c] = y;
			sum += (APE_REAL)dec_hsum(x) + (APE_REAL)dec_hsum(y);
		}
		/* sigma in two passes, in APE_REAL (ape_sigma()) */
		mean = sum / (APE_REAL)DEC_DIM;
		for (int c = 0; c < C; c++) {
			float xs[16], ys[16];

			vstore16(X0[r][c], 0, xs);
			vstore16(Y0[r][c], 0, ys);
			for (int k = 0; k < 16; k++)
				ss += ((APE_REAL)xs[k] - mean) * ((APE_REAL)xs[k] - mean) +
				      ((APE_REAL)ys[k] - mean) * ((APE_REAL)ys[k] - mean);
		}
		rdelta[r] = (float)prm[P + 4 * h];
		rbeta[r] = (float)prm[P + 4 * h + 1];
		rgamma[r] = (float)prm[P + 4 * h + 2];
		rlambda[r] = (float)prm[P + 4 * h + 3];
		decay[r] = rdelta[r] != 0.0f || rbeta[r] != 0.0f || rgamma[r] != 0.0f;
		toff[r] = h * bhs;
		ia[r] = ape_inv_alpha(prm[P + 4 * h + 3], ss, DEC_DIM);
		diag[r] = rel + i;
		aref[r] = ape_anchor_distance(diag[r], Lk, causal);
		jend[r] = j0 + ape_row_visible_pairs(diag[r], j0, j1, causal);
		kend = max(kend, jend[r]);
		for (int c = 0; c < C; c++)
			SW[r][c] = dec_seed16(omega, c, (APE_REAL)1, ia[r], &CW[r][c]);
		for (int c = 0; c < 2 * C; c++)
			ACC[r][c] = (float16)0.0f;
		M[r] = -INFINITY;
		L[r] = 0.0f;
	}

	for (long t0 = j0; t0 < kend; t0 += DEC_TILE) {
#pragma unroll
		for (int r = 0; r < RM; r++)
			for (int c = 0; c < C && r < nr; c++) {
				float16 co, si = dec_seed16(omega, c, (APE_REAL)(diag[r] - t0), ia[r],
							    &co);

				X[r][c] = X0[r][c] * co - Y0[r][c] * si;
				Y[r][c] = X0[r][c] * si + Y0[r][c] * co;
			}
		for (long bb = t0; bb < min(t0 + DEC_TILE, kend); bb += DEC_BLK) {
			const int len = (int)min((long)DEC_BLK, kend - bb);
			long rk[DEC_BLK], rv[DEC_BLK];

			dec_rows(k0 + bb, len, ksl, vsl, pbt, pnb, pfirst, prow, pblk, ptab, rk, rv);
			if (touch)
				dec_touch(V, voff + b * vsb + kvh * vsh, rv, len, DEC_DIM, dt, &touched);

			if (len < DEC_BLK)
				for (int r = 0; r < nr; r++)
					for (int jj = len; jj < DEC_BLK; jj++)
						sc[r][jj] = -INFINITY;
			/* scores: each key row is loaded once for every query row */
			for (int jj = 0; jj < len; jj++) {
				const long j = bb + jj, kb = koff + b * ksb + kvh * ksh + rk[jj];
				float16 u[DEC_CMAX], w[DEC_CMAX];

#pragma unroll
				for (int c = 0; c < C; c++)
					dec_pairs(K, kb, c, P, inter, dt, &u[c], &w[c]);
#pragma unroll
				for (int r = 0; r < RM; r++) {
					if (r >= nr)
						break;
					float16 acc = (float16)0.0f;
					const long n = diag[r] - j, an = ape_abs_dist(n);
					float dot, sv;

#pragma unroll
					for (int c = 0; c < C; c++) {
						const float16 x = X[r][c], y = Y[r][c];

						acc = fma(x, u[c], fma(y, w[c], acc));
						X[r][c] = fma(x, CW[r][c], y * SW[r][c]);
						Y[r][c] = fma(y, CW[r][c], -(x * SW[r][c]));
					}
					dot = dec_hsum(acc);
					sv = (rlambda[r] == 0.0f ? scale : ape_temp_f(scale, rlambda[r], an)) * dot;
					if (decay[r])
						sv += ape_bias_diff_f(rdelta[r], rbeta[r], rgamma[r],
								      an, aref[r]);
					if (blen) /* the distance-bias table's entry */
						sv += BT[toff[r] + ape_bias_index(an, blen)];
					/* a non-finite dot product makes the score NaN (attention.cl) */
					sv = isfinite(dot) ? sv : NAN;
					sc[r][jj] = j < jend[r] ? sv : -INFINITY;
				}
			}
			/* one online-softmax update per row for the block ('>' ignores NaN, exp keeps
			 * it; weights below e^-87 are exact zeros, as in attention.cl) */
#pragma unroll
			for (int r = 0; r < RM; r++) {
				if (r >= nr)
					break;
				const float16 sv = vload16(0, sc[r]);
				const float mt = fmax(M[r], dec_hmax(sv));
				const float corr = M[r] == mt ? 1.0f
						   : M[r] - mt < APE_EXP_CUTOFF ? 0.0f
									: exp(M[r] - mt);
				const float16 dd = sv - mt;
				const float16 pv = select(dec_exp16(dd), (float16)0.0f,
							  dd < APE_EXP_CUTOFF ||
								  sv == (float16)(-INFINITY));
				const float lsum = dec_hsum(pv);

				vstore16(pv, 0, sc[r]);
				L[r] = L[r] * corr + lsum;
				M[r] = mt;
				if (corr != 1.0f) {
#pragma unroll
					for (int c = 0; c < 2 * C; c++)
						ACC[r][c] *= corr;
				}
			}
			/* the next block's keys, requested while this one's values are summed */
			if (touch && bb + DEC_BLK < kend) {
				const int len2 = (int)min((long)DEC_BLK, kend - bb - DEC_BLK);
				long nk[DEC_BLK], nv[DEC_BLK];

				dec_rows(k0 + bb + DEC_BLK, len2, ksl, vsl, pbt, pnb, pfirst, prow, pblk,
					 ptab, nk, nv);
				dec_touch(K, koff + b * ksb + kvh * ksh, nk, len2, DEC_DIM, dt,
					  &touched);
			}
			/* P V: a masked key adds nothing at all (its V may hold a NaN) */
			for (int jj = 0; jj < len; jj++) {
				const long j = bb + jj, vb = voff + b * vsb + kvh * vsh + rv[jj];
				float16 v[2 * DEC_CMAX];

#pragma unroll
				for (int c = 0; c < 2 * C; c++)
					v[c] = dec_ld16(V, vb + 16 * c, dt);
#pragma unroll
				for (int r = 0; r < RM; r++) {
					if (r >= nr)
						break;
					const float p = sc[r][jj];

					if (j >= jend[r])
						continue;
#pragma unroll
					for (int c = 0; c < 2 * C; c++)
						ACC[r][c] = fma((float16)p, v[c], ACC[r][c]);
				}
			}
		}
	}

	{
		volatile uint sink = touched;

		(void)sink;
	}
	/* partials: [row][split][D + 2] = acc, max, sum (rows: (b*H + h)*Lq + i) */
#pragma unroll
	for (int r = 0; r < RM; r++) {
		if (r >= nr)
			break;
		const int g = r / (int)Lqs, h = kvh * group + g;
		const long row = poff >= 0 ? poff + (h * Lqs + r % Lqs) * nsplit
					   : ((b * H + h) * Lq + r % Lqs) * nsplit;
		__global float *pp = part + (row + s) * (DEC_DIM + 2);

		for (int c = 0; c < 2 * C; c++)
			vstore16(ACC[r][c], 0, pp + 16 * c);
		pp[DEC_DIM] = M[r];
		pp[DEC_DIM + 1] = L[r];
	}
}

/* ape_decode_<RM>: chunks of launches with up to RM rows per work-item (group * Lq) */
#define DEC_KERNEL(RM)                                                                             \
	__kernel void ape_decode_##RM(DEC_ARGS)                                                    \
	{                                                                                          \
		dec_body(DEC_NAMES, RM);                                                           \
	}
DEC_KERNEL(1)
DEC_KERNEL(2)
DEC_KERNEL(4)
DEC_KERNEL(8)
#if DEC_RMAX >= 16
DEC_KERNEL(16)
#endif

/* One work-item per query row (dimension 0: i, dimension 1: b*H + h): the chunks' partials
 * merged by LSE in chunk order (ape_merge_factor), then O, LSE and the pairs computed (every
 * visible key: the decode skips nothing). */
__kernel void ape_decode_merge(__global const float *part, __global const APE_REAL *prm,
			       __global void *O, __global float *LSE, __global ulong *PAIRS,
			       long ooff, long osb, long osh, long osl, long loff, long lsb,
			       long lsh, long lsl, int D, long Lq, long Lk, int H, long rel,
			       int flags, int nsplit, __global const long *sg)
{
	const long i = get_global_id(0), bh = get_global_id(1);
	long b = bh / H, q0 = 0, k0, Lqs = Lq, chunk = 0, poff = -1;
	const int h = (int)(bh % H), P = DEC_DIM / 2, causal = (flags & FD_CAUSAL) != 0;

	/* a ragged launch: dimension 1 is segment e's heads, row i of its lq (dec_seg()) */
	dec_seg(sg, bh / H, &b, &q0, &Lqs, &k0, &Lk, &rel, &chunk, &nsplit, &poff);
	const long diag = rel + i, row = (b * H + h) * Lq + q0 + i;
	__global const float *pp =
		part + (poff >= 0 ? poff + (h * Lqs + i) * nsplit : row * nsplit) * (DEC_DIM + 2);
	APE_REAL mx = -INFINITY, sum = 0;
	float acc[DEC_DMAX];

	(void)k0;
	(void)chunk;
	if (i >= Lqs)
		return;
	for (int s = 0; s < nsplit; s++)
		mx = ape_merge_max(mx, (APE_REAL)pp[s * (DEC_DIM + 2) + DEC_DIM]);
	for (int d = 0; d < DEC_DIM; d++)
		acc[d] = 0.0f;
	for (int s = 0; s < nsplit; s++) {
		__global const float *ps = pp + s * (DEC_DIM + 2);
		const APE_REAL f = ape_merge_factor((APE_REAL)ps[DEC_DIM], mx);

		/* no shortcut for f == 0: a chunk's NaN must reach the row (NaN * 0) */
		sum += (APE_REAL)ps[DEC_DIM + 1] * f;
		for (int d = 0; d < DEC_DIM; d++)
			acc[d] = fma((float)f, ps[d], acc[d]);
	}
	{
		const float inv = sum == 0 ? 0.0f : (float)(1 / sum);
		const long ob = ooff + b * osb + h * osh + (q0 + i) * osl;

		for (int d = 0; d < DEC_DIM; d++)
			st(O, ob + d, acc[d] * inv, FD_DT_OUT(flags));
	}
	if (flags & FD_LSE) {
		const APE_REAL crow = ape_bias(prm[P + 4 * h], prm[P + 4 * h + 1], prm[P + 4 * h + 2],
					       (APE_REAL)ape_anchor_distance(diag, Lk, causal));

		LSE[loff + b * lsb + h * lsh + (q0 + i) * lsl] =
			sum > 0 ? (float)(crow + mx + log(sum)) : sum == 0 ? -INFINITY : NAN;
	}
	if (flags & FD_PAIRS)
		PAIRS[row] = (ulong)ape_visible_keys(diag, Lk, causal);
}

/*
 * The work-group shape (devices other than CPUs, or any device under APE_OCL_DEC_SHAPE=gpu:
 * ocl_decode.c): the same chunks, partials and merge, but a chunk is served by a group of
 * DEC_GNWI work-items instead of one. The P pairs of a row are spread over PL = min(P, 64)
 * lanes (pair pl, pl + 64; output columns pl, pl + PL, ...), so that a key row is read by
 * adjacent work-items at adjacent addresses; where P < 64 the group holds KS = 64 / PL key
 * streams, each a chunk of its own (chunk g * KS + ks: the partial layout and the merge are the
 * plain decode's). Per block of 64 / RM keys (RM rows times the block: 64 scores):
 *   1. each lane runs its pairs' rotation recurrence (reseeded with ape_seed_sincos at every
 *      64-key tile start, as dec_body) and writes each (row, key)'s partial dot product to
 *      local memory;
 *   2. one work-item per score sums the lanes' partials in lane order and makes the score
 *      (temperature, bias difference at the anchor distance, NaN for a non-finite dot, -inf
 *      where masked);
 *   3. one work-item per score takes its weight against the row's new maximum;
 *   4. every lane rescales its columns and adds P V (a key its row does not see adds nothing).
 * Three barriers a block; every work-item keeps the rows' m and l alike (same values, same
 * order), lane 0 writes them. Fixed orders throughout: the same bits on every run.
 */
#define DEC_GNWI 64 /* work-items per group (ocl_decode.c mirrors it) */
#define DEC_GRED (DEC_TILE + 1) /* a lane's partials in red: 64, one float apart (banks) */
#define DEC_GWP (DEC_DMAX > 128 ? 2 : 1) /* pairs per lane: P <= 128 over PL = min(P, 64) */

/* sin and cos of the angle a for one pair: ape_seed_sincos on APE_RW lanes, lane 0 kept (the
 * GPU programs have APE_RW 1). */
KFN float dec_seed1(APE_REAL a, float *cosine)
{
	float s[APE_RW], co[APE_RW];
	ape_vfloat cv, sv = ape_seed_sincos((ape_vreal)a, &cv);

	DEC_VSF(sv, s);
	DEC_VSF(cv, co);
	*cosine = co[0];
	return s[0];
}

/* Where chunk s's keys end for the group's rows: j1, or causal, past the last row's diagonal. */
KFN long dec_wg_kend(long s, long chunk, long Lk, long Lq, long rel, int causal, long *j0)
{
	const long a = min(s * chunk, Lk), e = min(a + chunk, Lk);

	*j0 = a;
	return a + ape_row_visible_pairs(rel + (Lq - 1), a, e, causal);
}

KFN void dec_wg_body(DEC_ARGS, __local float *red, __local float *sc, __local float *lm,
		     __local APE_REAL *lia, const int RM)
{
	const int BLK = DEC_TILE / RM; /* keys per update */
	const int P = DEC_DIM / 2, dt = FD_DT_IN(flags);
	const int inter = (flags & FD_INTERLEAVED) != 0, causal = (flags & FD_CAUSAL) != 0;
	const int lid = (int)get_local_id(0), PL = min(P, DEC_GNWI), KS = DEC_GNWI / PL;
	const int ks = lid / PL, pl = lid % PL, lane = ks < KS;
	const long bkv = get_global_id(1), g0 = (long)get_group_id(0) * KS, s = g0 + ks;
	const int Hkv = H / group, kvh = (int)(bkv % Hkv), nr = group * (int)Lq;
	const long b = bkv / Hkv;
	const long kb0 = koff + b * ksb + kvh * ksh, vb0 = voff + b * vsb + kvh * vsh;
	__global const APE_REAL *omega = prm;
	__local float *pw = sc + KS * DEC_TILE; /* the weights, as sc holds the scores */
	float X[DEC_RMAX][DEC_GWP], Y[DEC_RMAX][DEC_GWP], X0[DEC_RMAX][DEC_GWP];
	float Y0[DEC_RMAX][DEC_GWP], CW[DEC_RMAX][DEC_GWP], SW[DEC_RMAX][DEC_GWP];
	float ACC[DEC_RMAX][2 * DEC_GWP], M[DEC_RMAX], L[DEC_RMAX];
	long jend[DEC_RMAX], j0, nb = 0;
	const long kend = dec_wg_kend(s, chunk, Lk, Lq, rel, causal, &j0);

	/* the blocks of the group's longest stream: every work-item meets every barrier */
	for (int k = 0; k < KS; k++) {
		long a;
		const long e = dec_wg_kend(g0 + k, chunk, Lk, Lq, rel, causal, &a);

		nb = max(nb, (e - a + BLK - 1) / BLK);
	}
	/* each row's 1 / alpha from its sigma (two passes in APE_REAL, ape_sigma()) */
	for (int r = lid; r < nr; r += DEC_GNWI) {
		const int h = kvh * group + r / (int)Lq;
		const long qb = qoff + b * qsb + h * qsh + (r % Lq) * qsl;
		APE_REAL sum = 0, ss = 0, mean;

		for (int d = 0; d < DEC_DIM; d++)
			sum += (APE_REAL)ld(Q, qb + d, dt);
		mean = sum / (APE_REAL)DEC_DIM;
		for (int d = 0; d < DEC_DIM; d++) {
			const APE_REAL x = (APE_REAL)ld(Q, qb + d, dt) - mean;

			ss += x * x;
		}
		lia[r] = ape_inv_alpha(prm[P + 4 * h + 3], ss, DEC_DIM);
	}
	for (int e = lid; e < KS * RM; e += DEC_GNWI)
		lm[e] = -INFINITY;
	barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
	for (int r = 0; r < RM; r++) {
		if (r >= nr)
			break;
		const int h = kvh * group + r / (int)Lq;
		const long i = r % Lq, qb = qoff + b * qsb + h * qsh + i * qsl, diag = rel + i;

		for (int k = 0; k < DEC_GWP; k++) {
			const int p = pl + DEC_GNWI * k;

			X0[r][k] = Y0[r][k] = 0.0f;
			SW[r][k] = CW[r][k] = 0.0f;
			if (lane && p < P) {
				X0[r][k] = ld(Q, qb + (inter ? 2 * p : p), dt);
				Y0[r][k] = ld(Q, qb + (inter ? 2 * p + 1 : P + p), dt);
				SW[r][k] = dec_seed1((APE_REAL)1 * (omega[p] * lia[r]), &CW[r][k]);
			}
		}
		for (int k = 0; k < 2 * DEC_GWP; k++)
			ACC[r][k] = 0.0f;
		M[r] = -INFINITY;
		L[r] = 0.0f;
		jend[r] = j0 + ape_row_visible_pairs(diag, j0, kend, causal);
	}

	for (long blk = 0; blk < nb; blk++) {
		const long bb = j0 + blk * BLK;
		const int len = lane ? (int)clamp(kend - bb, 0L, (long)BLK) : 0;

		/* 1. the partial dot products of this lane's pairs */
		if (len > 0 && blk * BLK % DEC_TILE == 0) {
#pragma unroll
			for (int r = 0; r < RM; r++) {
				if (r >= nr)
					break;
				const APE_REAL n = (APE_REAL)(rel + r % Lq - bb);

				for (int k = 0; k < DEC_GWP; k++) {
					const int p = min(pl + DEC_GNWI * k, P - 1);
					float co, si = dec_seed1(n * (omega[p] * lia[r]), &co);

					X[r][k] = X0[r][k] * co - Y0[r][k] * si;
					Y[r][k] = X0[r][k] * si + Y0[r][k] * co;
				}
			}
		}
		for (int jj = 0; jj < len; jj++) {
			long rk, rv;
			float u[DEC_GWP], w[DEC_GWP];

			dec_rows(bb + jj, 1, ksl, vsl, pbt, pnb, pfirst, prow, pblk, ptab, &rk, &rv);
			for (int k = 0; k < DEC_GWP; k++) {
				const int p = pl + DEC_GNWI * k;

				u[k] = w[k] = 0.0f;
				if (p < P) {
					u[k] = ld(K, kb0 + rk + (inter ? 2 * p : p), dt);
					w[k] = ld(K, kb0 + rk + (inter ? 2 * p + 1 : P + p), dt);
				}
			}
#pragma unroll
			for (int r = 0; r < RM; r++) {
				if (r >= nr)
					break;
				float acc = 0.0f;

				for (int k = 0; k < DEC_GWP; k++) {
					const float x = X[r][k], y = Y[r][k];

					acc = fma(x, u[k], fma(y, w[k], acc));
					X[r][k] = fma(x, CW[r][k], y * SW[r][k]);
					Y[r][k] = fma(y, CW[r][k], -(x * SW[r][k]));
				}
				red[lid * DEC_GRED + r * BLK + jj] = acc;
			}
		}
		barrier(CLK_LOCAL_MEM_FENCE);

		/* 2. the scores: one work-item each, the lanes' partials summed in lane order */
		for (int e = lid; e < KS * DEC_TILE; e += DEC_GNWI) {
			const int k2 = e / DEC_TILE, e2 = e % DEC_TILE, r = e2 / BLK;
			long a;
			const long e2end = dec_wg_kend(g0 + k2, chunk, Lk, Lq, rel, causal, &a);
			const long j = a + blk * BLK + e2 % BLK, i = r % Lq, diag = rel + i;
			float sv = -INFINITY;

			if (r < nr && j < e2end && (!causal || j <= diag)) {
				const int h = kvh * group + r / (int)Lq;
				const float rdelta = (float)prm[P + 4 * h], rbeta = (float)prm[P + 4 * h + 1];
				const float rgamma = (float)prm[P + 4 * h + 2];
				const float rlambda = (float)prm[P + 4 * h + 3];
				const long n = diag - j, an = ape_abs_dist(n);
				float dot = 0.0f;

				for (int l = 0; l < PL; l++)
					dot += red[(k2 * PL + l) * DEC_GRED + e2];
				sv = (rlambda == 0.0f ? scale : ape_temp_f(scale, rlambda, an)) * dot;
				if (rdelta != 0.0f || rbeta != 0.0f || rgamma != 0.0f)
					sv += ape_bias_diff_f(rdelta, rbeta, rgamma, an,
							      ape_anchor_distance(diag, Lk, causal));
				if (blen) /* the distance-bias table's entry */
					sv += BT[h * bhs + ape_bias_index(an, blen)];
				/* a non-finite dot product makes the score NaN (attention.cl) */
				sv = isfinite(dot) ? sv : NAN;
			}
			sc[e] = sv;
		}
		barrier(CLK_LOCAL_MEM_FENCE);

		/* 3. the weights against the row's new maximum ('>' and fmax ignore NaN, exp keeps
		 * it; below e^APE_EXP_CUTOFF an exact zero, as in dec_body) */
		for (int e = lid; e < KS * DEC_TILE; e += DEC_GNWI) {
			const int k2 = e / DEC_TILE, r = e % DEC_TILE / BLK;
			const float sv = sc[e];
			float mt = r < nr ? lm[k2 * RM + r] : -INFINITY, dd;

			for (int jj = 0; jj < BLK && r < nr; jj++)
				mt = fmax(mt, sc[k2 * DEC_TILE + r * BLK + jj]);
			dd = sv - mt;
			pw[e] = dd < APE_EXP_CUTOFF || sv == -INFINITY ? 0.0f : exp(dd);
		}
		barrier(CLK_LOCAL_MEM_FENCE);

		/* 4. each lane: the rows' m and l, its columns rescaled, then P V */
		if (len > 0) {
#pragma unroll
			for (int r = 0; r < RM; r++) {
				if (r >= nr)
					break;
				__local const float *sr = sc + ks * DEC_TILE + r * BLK;
				__local const float *pr = pw + ks * DEC_TILE + r * BLK;
				float mt = M[r], lsum = 0.0f, corr;

				for (int jj = 0; jj < BLK; jj++) {
					mt = fmax(mt, sr[jj]);
					lsum += pr[jj];
				}
				corr = M[r] == mt		     ? 1.0f
				       : M[r] - mt < APE_EXP_CUTOFF ? 0.0f
								    : exp(M[r] - mt);
				L[r] = L[r] * corr + lsum;
				M[r] = mt;
				if (pl == 0)
					lm[ks * RM + r] = mt;
				if (corr != 1.0f)
					for (int k = 0; k < 2 * DEC_GWP; k++)
						ACC[r][k] *= corr;
			}
			/* a masked key adds nothing at all (its V may hold a NaN) */
			for (int jj = 0; jj < len; jj++) {
				const long j = bb + jj;
				long rk, rv;
				float v[2 * DEC_GWP];

				dec_rows(j, 1, ksl, vsl, pbt, pnb, pfirst, prow, pblk, ptab, &rk, &rv);
				for (int k = 0; k < 2 * DEC_GWP; k++) {
					const int d = pl + PL * k;

					v[k] = d < DEC_DIM ? ld(V, vb0 + rv + d, dt) : 0.0f;
				}
#pragma unroll
				for (int r = 0; r < RM; r++) {
					if (r >= nr)
						break;
					const float p = pw[ks * DEC_TILE + r * BLK + jj];

					if (j >= jend[r])
						continue;
					for (int k = 0; k < 2 * DEC_GWP; k++)
						ACC[r][k] = fma(p, v[k], ACC[r][k]);
				}
			}
		}
	}

	/* partials, as dec_body writes them: [row][split][D + 2] = acc, max, sum */
	if (!lane || s * chunk >= Lk)
		return;
#pragma unroll
	for (int r = 0; r < RM; r++) {
		if (r >= nr)
			break;
		const int h = kvh * group + r / (int)Lq;
		const long row = (b * H + h) * Lq + r % Lq;
		__global float *pp = part + (row * nsplit + s) * (DEC_DIM + 2);

		for (int k = 0; k < 2 * DEC_GWP; k++)
			if (pl + PL * k < DEC_DIM)
				pp[pl + PL * k] = ACC[r][k];
		if (pl == 0) {
			pp[DEC_DIM] = M[r];
			pp[DEC_DIM + 1] = L[r];
		}
	}
}

/* ape_decode_wg_<RM>: the work-group shape for up to RM rows (group * Lq), local size
 * DEC_GNWI; local memory from the host: red DEC_GNWI * DEC_GRED floats, sc 2 * KS * 64 floats,
 * lm KS * RM floats, lia RM APE_REALs (KS = 64 / min(P, 64)). */
#define DEC_WG_KERNEL(RM)                                                                          \
	__kernel void ape_decode_wg_##RM(DEC_ARGS, __local float *red, __local float *sc,          \
					 __local float *lm, __local APE_REAL *lia)                 \
	{                                                                                          \
		dec_wg_body(DEC_NAMES, red, sc, lm, lia, RM);                                      \
	}
DEC_WG_KERNEL(1)
DEC_WG_KERNEL(2)
DEC_WG_KERNEL(4)
DEC_WG_KERNEL(8)
#if DEC_RMAX >= 16
DEC_WG_KERNEL(16)
#endif
