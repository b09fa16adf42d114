/* SPDX-License-Identifier: MIT */
/*
 * The fused APE attention kernel (docs/kernels.md), OpenCL C 1.2.
 *
 * The host builds this file behind a short prelude (APE_REAL, the float64 pragma) and
 * include/ape/ape_math.h, with these compile-time parameters:
 *   APE_D     64 or 128 (specialised: loop bounds known), or 0 (any even D <= 256, known at
 *             run time)
 *   APE_RW    query rows per row vector, carried in the lanes of a vector type: 16 on a CPU with
 *             AVX-512 (PoCL compiles float16 arithmetic straight to zmm registers), 1 on a GPU
 *   APE_RG    row vectors per work-item: 4 on a CPU (one work-item owns 64 rows and needs no
 *             barrier), 1 on a GPU
 *   APE_NWI   work-items per work-group (1 on a CPU, 64 on a GPU); a work-group owns
 *             BQ = APE_RW * APE_RG * APE_NWI query rows
 *   APE_BK    keys per key tile (<= 64: the rotation recurrence is reseeded at every tile start)
 *   APE_SB    keys per score sub-block: APE_SB score vectors stay in registers while the pair
 *             loop runs over them
 *   APE_FP64  1 when the device has cl_khr_fp64 (seeds, alpha and the bias tables in float64)
 *
 * A work-group owns a query tile of BQ rows of one (batch, head) and walks the key tiles from the
 * diagonal outward (backward only when causal, alternating sides otherwise). Per tile: K, V and
 * the tile's per-distance temperature and bias go to local memory; each row vector is seeded
 * at the tile's first key, scores the tile while rotating its query one key at a time, and
 * takes one online-softmax update. With skipping allowed, a row vector stops a side once it has
 * proved the rest of it negligible, and the work-group stops loading that side when all have.
 * A distance-bias table (F_TABLE) joins the bias there, per distance (per pair with explicit
 * positions); the far-key bounds add its suffix maximum at the keys' nearest distance.
 *
 * Everything per pair is float32. Scores live in a per-row shifted frame: c_row, the bias at the
 * row's nearest visible distance (its largest bias when the decays are >= 0), is subtracted in
 * float64, so that float32 keeps the differences between the scores that matter even when |n|
 * is large; LSE adds c_row back in float64.
 */

#if APE_D
#define APE_DMAX APE_D
#define DIM APE_D
#else
#define APE_DMAX APE_MAX_D /* ape/ape.h, a build option (ocl_program.c) */
#define DIM (R->D) /* every function reaches the run-time D through its struct run *R */
#endif
#define APE_PMAX (APE_DMAX / 2)
#define BQ (APE_RW * APE_RG * APE_NWI)

/* Barriers only where several work-items share a tile: PoCL replicates the code that follows
 * each barrier in a loop, which tripled this kernel's size and compile time on a CPU. */
#if APE_NWI > 1
#define WG_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#else
#define WG_BARRIER() ((void)0)
#endif

/* Local memory: K as two pair-ordered halves and V, reused at the end to transpose the outputs */
#define KV_TILE (2 * APE_BK * APE_DMAX)
#define STAGE (APE_RW > 1 ? BQ * APE_DMAX : 0)
#define KV_FLOATS (KV_TILE > STAGE ? KV_TILE : STAGE)

/* Loops stay rolled unless unrolling keeps an array in registers: PoCL inlines every builtin,
 * and fully unrolled loops made the work-group function take minutes to compile. */
#define NOUNROLL _Pragma("unroll 1")

/* Every helper is inlined: PoCL compiles with -Dinline=, and a helper left as a call passes its
 * float16/double16 arguments through memory (measured: a fifth slower when the seed sincos
 * stayed a call). */
#define KFN static inline __attribute__((always_inline))

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* vf: APE_RW query rows of one float quantity; vr: the same in APE_REAL (ape_math.h's lane
 * types). */
typedef ape_vfloat vf;
typedef ape_vint vi;
typedef ape_vreal vr;
#define TO_VF(x) APE_V_FLOAT(x)
#if APE_RW == 1
typedef long vlg; /* explicit positions (ape_attention_pos): one per row */
#define VL(p) (*(p))
#define VS(v, p) (*(p) = (v))
#define TO_VR(x) ((APE_REAL)(x))
#define AS_VLG(x) as_long(x)
#define AS_VULG(x) as_ulong(x)
#define VIS_OF(c) (c) /* a comparison's result as a select() condition */
#else
typedef CAT(long, APE_RW) vlg;
#define VL(p) CAT(vload, APE_RW)(0, (p))
#define VS(v, p) CAT(vstore, APE_RW)((v), 0, (p))
#define TO_VR(x) CAT(CAT(convert_, APE_REAL), APE_RW)(x)
#define AS_VLG(x) CAT(as_long, APE_RW)(x)
#define AS_VULG(x) CAT(as_ulong, APE_RW)(x)
#define VIS_OF(c) CAT(convert_int, APE_RW)(c)
#endif

__constant int ape_iota[16] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };
#if APE_RW == 1
#define IOTA 0
#else
#define IOTA VL(ape_iota) /* lane k holds k */
#endif

/* launch flags (ocl_attention.c) */
#define F_DT_IN(f) ((f) & 3)
#define F_DT_OUT(f) (((f) >> 2) & 3)
#define F_CAUSAL 16
#define F_INTERLEAVED 32
#define F_LSE 64
#define F_PAIRS 128
#define F_SKIP 256
#define F_KV_F32 512 /* K and V come from ape_kv_prep(): float32, K pair-ordered */
#define F_PRIOR 1024 /* PRIOR holds each row's LSE from earlier launches (for skipping) */
#define F_DIAG 2048 /* ENT and MDIST: the rows' entropy and mean distance (docs/diagnostics.md) */
#define F_SEGS 4096 /* a ragged launch: each work-group's segment and tile from SEGT (below) */
#define F_POS 8192 /* explicit positions (ape_attention_pos, always with F_SEGS) */
#define F_TABLE 16384 /* BT, BSM: a distance-bias table and its suffix maxima (below) */

/* A ragged launch's work-group table (ocl_attention.c builds it): SEGT_W longs per work-group,
 * its segment's first query row, rows, first key row, keys, rel (q_start - k_start), the
 * tile's first row within the segment, and the segment's offset in the key-norm scans (with
 * F_POS: its first key tile among the launch's, in the per-tile norms and positions). */
#define SEGT_W 8

/* storage types: ape_dtype values */
#define DT_F16 1
#define DT_BF16 2

KFN float ld(__global const void *p, long i, int dt)
{
	if (dt == DT_F16)
		return vload_half((size_t)i, (__global const half *)p);
	if (dt == DT_BF16)
		return as_float((uint)((__global const ushort *)p)[i] << 16);
	return ((__global const float *)p)[i];
}

KFN ushort to_bf16(float f)
{
	uint u = as_uint(f);

	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (ushort)((u >> 16) | 0x40u); /* a NaN stays a NaN */
	u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
	return (ushort)(u >> 16);
}

KFN void st(__global void *p, long i, float x, int dt)
{
	if (dt == DT_F16)
		vstore_half_rte(x, (size_t)i, (__global half *)p);
	else if (dt == DT_BF16)
		((__global ushort *)p)[i] = to_bf16(x);
	else
		((__global float *)p)[i] = x;
}

/* One K row (at element kb of K) into the pair-ordered halves (u = first, w = second component
 * of each pair) and one V row (at element vb of V), converted to float; the layout and type
 * branches sit outside the loops. */
KFN void load_kv_row(__global const void *K, __global const void *V, long kb, long vb, int P,
		     int dt, int inter, __local float *ku, __local float *kw,
		     __local float *vrow)
{
	if (dt == 0) {
		__global const float *k = (__global const float *)K + kb;
		__global const float *v = (__global const float *)V + vb;

		if (inter) {
			for (int p = 0; p < P; p++) {
				ku[p] = k[2 * p];
				kw[p] = k[2 * p + 1];
			}
		} else {
			for (int p = 0; p < P; p++) {
				ku[p] = k[p];
				kw[p] = k[p + P];
			}
		}
		for (int d = 0; d < 2 * P; d++)
			vrow[d] = v[d];
		return;
	}
	for (int p = 0; p < P; p++) {
		ku[p] = ld(K, kb + (inter ? 2 * p : p), dt);
		kw[p] = ld(K, kb + (inter ? 2 * p + 1 : p + P), dt);
	}
	for (int d = 0; d < 2 * P; d++)
		vrow[d] = ld(V, vb + d, dt);
}

/*
 * Where the tensors lie (core/backend.h, struct ape_be_view): a view is (offset, B stride, H
 * stride, L stride) in elements of the tensor's type, D contiguous. The host passes one per
 * tensor as a long4 (x = offset, y, z, w = the strides of B, H, L): the caller's layout for the
 * tensors of a strided launch, the contiguous one otherwise and for K and V made by ape_kv_prep.
 * VIEW_ROW: element [b, h, 0, 0].
 */
#define VIEW_ROW(v, b, h) ((v).x + (long)(b) * (v).y + (long)(h) * (v).z)

/* The launch's constants, gathered once and read by every helper. */
struct run {
	__global const void *Q, *K, *V;
	__global const float *prior; /* F_PRIOR: [B*H, Lq] LSE of earlier launches */
	__global const APE_REAL *omega; /* omega_p, P values */
	long Lq, Lk, rel, ntk, bh, bkv, i0;
	long pbase; /* PAIRS and PRIOR: element of this (batch, head)'s row 0 */
	long kp; /* kpre and ksuf: element of this kv head's (and segment's) tile 0 */
	/* element [b, h, 0, 0] of each tensor of this (batch, head) and its L stride */
	long qbase, qsl, kbase, ksl, vbase, vsl, obase, osl, lbase, lsl;
	long ebase, esl, mbase, msl; /* F_DIAG: ENT and MDIST, as LSE (core/backend.h, ABI 8) */
	/* F_TABLE: this head's row of the distance-bias table (blen entries) and its suffix
	 * maxima (core/backend.h, struct ape_be_launch.bias_table, bias_smax) */
	__global const float *bt, *bsm;
	long blen;
	int D, wi, dtin, kvdt, inter, kvinter, causal, skip, flags;
	APE_REAL delta, beta, gamma, lambda;
	float scale, tol, prior_tol;
};

/* The head's table entry at distance an (F_TABLE; 0 without a table): every score adds it
 * beside the decay bias, in the per-distance tables or per pair. */
KFN APE_REAL tab_at(const struct run *R, long an)
{
	return (R->flags & F_TABLE) ? (APE_REAL)R->bt[ape_bias_index(an, R->blen)] : (APE_REAL)0;
}

/* The frame a far-key bound takes for a row (ape_may_skip*()'s crow argument): c_row lowered by
 * the table's largest entry at the keys' nearest distance an or beyond (its suffix maximum),
 * so that the bound covers every score whatever the table's shape; c_row without a table. */
KFN APE_REAL bound_frame(const struct run *R, APE_REAL crow, long an)
{
	return (R->flags & F_TABLE) ? crow - (APE_REAL)R->bsm[ape_bias_index(an, R->blen)] : crow;
}

/* One row vector: APE_RW query rows of a work-item, from first query load to output. */
struct rows {
	long i; /* first row */
	int rb; /* first row within the work-group's query tile */
	vf xq[APE_PMAX], yq[APE_PMAX]; /* the query's pairs */
	vf cw[APE_PMAX], sw[APE_PMAX]; /* cos, sin of the per-key step w_p = omega_p / alpha */
	vf acc[APE_DMAX], m, l; /* online softmax: sum of weights * V, running maximum, sum */
	vf s1, s2; /* F_DIAG: sum of weights * (score - m), sum of weights * |n| (ape_diag_*()) */
	vr ia, crow; /* 1 / alpha; the score shift c_row */
	APE_REAL qn[APE_RW], crow_s[APE_RW]; /* |q| (rounded up), c_row: per lane */
	APE_REAL prior[APE_RW]; /* earlier launches' LSE - c_row per lane, or -inf */
	long tlo, thi; /* key tiles scored: tlo .. thi */
	int done_b, done_f; /* proved the rest negligible backward, forward */
};

/* Loads the rows, then what stays fixed per row: alpha, the steps, |q|, c_row. */
KFN void rows_init(const struct run *R, struct rows *r, long i, int rb)
{
	const int P = DIM / 2;
	float tx[APE_RW], ty[APE_RW];
	APE_REAL tr[APE_RW], tc[APE_RW];
	vr sum = (vr)0, ss = (vr)0, qq = (vr)0, mean;

	r->i = i;
	r->rb = rb;
	r->m = (vf)(-INFINITY);
	r->l = (vf)0.0f;
	r->s1 = r->s2 = (vf)0.0f;
	NOUNROLL
	for (int d = 0; d < DIM; d++)
		r->acc[d] = (vf)0.0f;
	if (i >= R->Lq) {
		/* padding rows alone (a short segment's tile): never scored, their seeds (P
		 * sincos per lane) not needed */
		r->ia = r->crow = (vr)0;
		for (int k = 0; k < APE_RW; k++) {
			r->qn[k] = r->crow_s[k] = 0;
			r->prior[k] = -INFINITY;
		}
		return;
	}
	NOUNROLL
	for (int p = 0; p < P; p++) {
		const int a = R->inter ? 2 * p : p, c = R->inter ? 2 * p + 1 : p + P;

		NOUNROLL
		for (int k = 0; k < APE_RW; k++) {
			const long row = R->qbase + (i + k) * R->qsl;

			tx[k] = i + k < R->Lq ? ld(R->Q, row + a, R->dtin) : 0.0f;
			ty[k] = i + k < R->Lq ? ld(R->Q, row + c, R->dtin) : 0.0f;
		}
		r->xq[p] = VL(tx);
		r->yq[p] = VL(ty);
		sum += TO_VR(r->xq[p]) + TO_VR(r->yq[p]);
	}
	/* sigma: two passes (mean, then squares; see ape_sigma()) */
	mean = sum / (APE_REAL)DIM;
	NOUNROLL
	for (int p = 0; p < P; p++) {
		const vr x = TO_VR(r->xq[p]), y = TO_VR(r->yq[p]);

		ss += (x - mean) * (x - mean) + (y - mean) * (y - mean);
		qq += x * x + y * y;
	}
	VS(ss, tr);
	VS(qq, tc);
	NOUNROLL
	for (int k = 0; k < APE_RW; k++) {
		const long diag = ape_sat_add(R->rel, i + k); /* the key at n = 0 (padding: any) */
		const long an = ape_anchor_distance(diag, R->Lk, R->causal);

		tr[k] = ape_inv_alpha(R->lambda, tr[k], DIM);
		r->qn[k] = ape_norm_bound(tc[k]);
		/* c_row: the bias at the row's nearest visible distance */
		r->crow_s[k] = ape_bias(R->delta, R->beta, R->gamma, (APE_REAL)an);
		r->prior[k] = (R->flags & F_PRIOR) && i + k < R->Lq
				      ? (APE_REAL)R->prior[R->pbase + i + k] - r->crow_s[k]
				      : -INFINITY;
	}
	r->ia = VL(tr);
	r->crow = VL(r->crow_s);
	NOUNROLL
	for (int p = 0; p < P; p++)
		r->sw[p] = ape_seed_sincos(R->omega[p] * r->ia, &r->cw[p]);
}

/*
 * A key tile into local memory (this work-item's share): K as pair-ordered halves, V, and the
 * block's Bq + Bk - 1 distances' temperature and bias, the bias relative to the block's own
 * reference bref so that float32 keeps its fine differences. The float64 values per distance
 * are kept (raw, pairs of scale * temp and bias) so that the next tile takes the distances it
 * shares with this one (half of them when the walk steps to a neighbour) instead of another
 * log1p, sqrt and division each: the tables had cost a seventh of the dense kernel's time.
 */
KFN void tile_kv(const struct run *R, long j0, int len, __local float *ku, __local float *kw,
		 __local float *vt)
{
	const int P = DIM / 2;

	NOUNROLL
	for (int j = R->wi; j < APE_BK; j += APE_NWI) {
		if (j < len) {
			load_kv_row(R->K, R->V, R->kbase + (j0 + j) * R->ksl,
				    R->vbase + (j0 + j) * R->vsl, P, R->kvdt, R->kvinter,
				    ku + j * P, kw + j * P, vt + j * DIM);
		} else { /* past the end: zeros, so that 0 * V stays 0 */
			for (int p = 0; p < P; p++)
				ku[j * P + p] = kw[j * P + p] = 0.0f;
			for (int d = 0; d < DIM; d++)
				vt[j * DIM + d] = 0.0f;
		}
	}
}

KFN void tile_load(const struct run *R, long j0, int len, long nbase, APE_REAL bref,
		   __local float *ku, __local float *kw, __local float *vt, __local float *ttab,
		   __local float *btab, __local const APE_REAL *rold, __local APE_REAL *rnew,
		   long shift, int reuse)
{
	tile_kv(R, j0, len, ku, kw, vt);
	NOUNROLL
	for (int e = R->wi; e < BQ + APE_BK - 1; e += APE_NWI) {
		const long eo = e + shift; /* the same distance in the previous tile's table */
		APE_REAL t, b;

		if (reuse && eo >= 0 && eo < BQ + APE_BK - 1) {
			t = rold[2 * eo];
			b = rold[2 * eo + 1];
		} else {
			/* past the problem's rows or keys: saturated, never used */
			const long n = ape_sat_add(nbase, e - (APE_BK - 1)), al = ape_abs_dist(n);
			const APE_REAL an = (APE_REAL)al;

			t = ape_temp(R->lambda, an) * (APE_REAL)R->scale;
			b = ape_bias(R->delta, R->beta, R->gamma, an) + tab_at(R, al);
		}
		rnew[2 * e] = t;
		rnew[2 * e + 1] = b;
		ttab[e] = (float)t;
		btab[e] = (float)(b - bref);
	}
}

/*
 * The scores of the rows against the tile into sc[]: seeds (the angle n * omega_p / alpha at the
 * tile's first key, exactly reduced) rotate the query, which then walks the keys (n falls by one
 * per key, so it turns by -w_p each step) while APE_SB score vectors stay in registers.
 * Masked keys (past the tile's end, after the row's diagonal) get -inf.
 */
KFN void tile_scores(const struct run *R, const struct rows *r, long nbase, int len, int lim,
		     int mask, APE_REAL bref, __local const float *ku, __local const float *kw,
		     __local const float *ttab, __local const float *btab, vf *sc)
{
	const int P = DIM / 2;
	const vi ii = r->rb + IOTA;
	const vf cr = TO_VF((vr)bref - r->crow);
	const vr n0 = (APE_REAL)ape_sat_add(nbase, r->rb) + TO_VR(IOTA);
	vf xr[APE_PMAX], yr[APE_PMAX];

	NOUNROLL
	for (int p = 0; p < P; p++) {
		vf c, s = ape_seed_sincos(n0 * (R->omega[p] * r->ia), &c);

		xr[p] = r->xq[p] * c - r->yq[p] * s;
		yr[p] = r->xq[p] * s + r->yq[p] * c;
	}
	/* the tile's keys only (a short segment's or the last tile's): sc[] past len is unread */
	NOUNROLL
	for (int sb = 0; sb < len; sb += APE_SB) {
		vf S[APE_SB];

#pragma unroll
		for (int jj = 0; jj < APE_SB; jj++)
			S[jj] = (vf)0.0f;
		NOUNROLL
		for (int p = 0; p < P; p++) {
			vf x = xr[p], y = yr[p];
			const vf c = r->cw[p], s = r->sw[p];
			__local const float *pu = ku + sb * P + p, *pw = kw + sb * P + p;

#pragma unroll
			for (int jj = 0; jj < APE_SB; jj++) {
				const vf xn = fma(x, c, y * s);

				S[jj] = fma(x, (vf)pu[jj * P], fma(y, (vf)pw[jj * P], S[jj]));
				y = fma(y, c, -(x * s));
				x = xn;
			}
			xr[p] = x;
			yr[p] = y;
		}
#pragma unroll
		for (int jj = 0; jj < APE_SB; jj++) {
			const int j = sb + jj, e = r->rb - j + APE_BK - 1;
			const vf s = fma(S[jj], VL(ttab + e), VL(btab + e) + cr);
			const vi hide = (vi)(-(j >= len)) | (mask ? ii - j < lim : (vi)0);

			/* a NaN or Inf input must not vanish into a zero weight: its non-finite
			 * dot product makes the score NaN (a bias so large that it rounds to -inf
			 * is only a zero weight) */
			sc[j] = select(select((vf)NAN, s, isfinite(S[jj])), (vf)(-INFINITY), hide);
		}
	}
}

/*
 * acc[d0 .. d0+W) += P V over the tile, after scaling by corr. In a block cut by the causal
 * diagonal a masked key must add nothing at all, not 0 * V: V may hold a NaN that only the rows
 * which see the key may receive.
 */
#define ACC_CHUNK(W)                                                                               \
	do {                                                                                       \
		vf a[W];                                                                           \
		_Pragma("unroll") for (int dd = 0; dd < (W); dd++) a[dd] = r->acc[d0 + dd] * corr; \
		if (!mask) {                                                                       \
			NOUNROLL for (int j = 0; j < len; j++) {                                   \
				const vf pj = sc[j];                                               \
				__local const float *vv = vt + j * DIM + d0;                       \
				_Pragma("unroll") for (int dd = 0; dd < (W); dd++) a[dd] =         \
					fma(pj, (vf)vv[dd], a[dd]);                                \
			}                                                                          \
		} else {                                                                           \
			NOUNROLL for (int j = 0; j < len; j++) {                                   \
				const vf pj = sc[j];                                               \
				const vi vis = pos ? VIS_OF(pq >= (vlg)pk[j]) : ii - j >= lim;     \
				__local const float *vv = vt + j * DIM + d0;                       \
				_Pragma("unroll") for (int dd = 0; dd < (W); dd++) a[dd] =         \
					fma(pj, select((vf)0.0f, (vf)vv[dd], vis), a[dd]);         \
			}                                                                          \
		}                                                                                  \
		_Pragma("unroll") for (int dd = 0; dd < (W); dd++) r->acc[d0 + dd] = a[dd];        \
	} while (0)

/*
 * One online-softmax update for the whole tile; '>' ignores NaN, exp() keeps it.
 * Weights below e^-87 (APE_EXP_CUTOFF: float turns subnormal) are exact zeros: they are 1e-38 of the
 * row's largest and change nothing, but an x86 FMA with a subnormal operand takes a microcode
 * assist, and a decaying bias makes every row meet a band of them: the dense kernel with the
 * seed's parameters ran at less than half speed. A NaN score keeps its NaN (a comparison
 * with NaN is false). pos (ape_attention_pos): the rows' positions pq and the tile's keys' pk
 * decide visibility (mask: causal) and the distances, instead of the diagonal (lim, nbase).
 */
KFN void tile_softmax(const struct run *R, struct rows *r, int len, int lim, int mask, long nbase,
		      __local const float *vt, vf *sc, int pos, vlg pq, __local const long *pk)
{
	const vi ii = r->rb + IOTA;
	vf mt = r->m, corr, lsum = (vf)0.0f;
	int d0 = 0;

	NOUNROLL
	for (int j = 0; j < len; j++)
		mt = select(mt, sc[j], sc[j] > mt);
	corr = select(select(exp(r->m - mt), (vf)0.0f, r->m - mt < APE_EXP_CUTOFF), (vf)1.0f,
		      r->m == mt);
	if (R->flags & F_DIAG) {
		/* the two running sums of the diagnostics (ape/ape_math.h), rescaled with the
		 * softmax: nothing yet (corr 0) stays 0; an unchanged maximum moves nothing */
		const vf dm = select(r->m - mt, (vf)0.0f, r->m == mt);
		/* n of key 0 */
		const vf nf = TO_VF((APE_REAL)ape_sat_add(nbase, r->rb) + TO_VR(IOTA));
		vf s1 = select(APE_DIAG_RESCALE_S1(r->s1, r->l, corr, dm), (vf)0.0f,
			       corr == (vf)0.0f);
		vf s2 = r->s2 * corr;

		NOUNROLL
		for (int j = 0; j < len; j++) {
			const vf dj = sc[j] - mt;
			const vf pj = select(exp(dj), (vf)0.0f,
					     dj < APE_EXP_CUTOFF || sc[j] == (vf)(-INFINITY));

			sc[j] = pj;
			lsum += pj;
			s1 += select(pj * dj, (vf)0.0f, pj == (vf)0.0f); /* ape_diag_s1_term() */
			s2 = fma(pj, pos ? fabs(TO_VF(AS_VLG(AS_VULG(pq) - (ulong)pk[j])))
					 : fabs(nf - (float)j),
				 s2);
		}
		r->s1 = s1;
		r->s2 = s2;
	} else {
		NOUNROLL
		for (int j = 0; j < len; j++) {
			const vf dj = sc[j] - mt; /* NaN for a masked key in a row with no key yet */
			const vf pj = select(exp(dj), (vf)0.0f,
					     dj < APE_EXP_CUTOFF || sc[j] == (vf)(-INFINITY));

			sc[j] = pj;
			lsum += pj;
		}
	}
	r->l = r->l * corr + lsum;
	r->m = mt;
	NOUNROLL
	for (; d0 + 16 <= DIM; d0 += 16)
		ACC_CHUNK(16);
	NOUNROLL
	for (; d0 < DIM; d0 += 2)
		ACC_CHUNK(2);
}

/*
 * May every row of r stop walking backward (tiles 0..lo remain) / forward (tiles hi.. remain)?
 * *cb and *cf come in as "still asked" and leave as the answers. The bound of docs/kernels.md:
 * kb and kf are the largest key norms left on each side.
 */
KFN void rows_may_stop(const struct run *R, const struct rows *r, long lo, long hi,
		       APE_REAL kb, APE_REAL kf, int *cb, int *cf)
{
	const APE_REAL as = fabs((APE_REAL)R->scale);
	float ms[APE_RW], ls[APE_RW];

	VS(r->m, ms);
	VS(r->l, ls);
	NOUNROLL
	for (int k = 0; k < APE_RW && (*cb || *cf); k++) {
		const long i = r->i + k, diag = ape_sat_add(R->rel, i);

		if (i >= R->Lq)
			continue; /* padding rows never hold the work-group back */
		if (*cb) {
			const long cnt = ape_visible_keys(diag, (lo + 1) * APE_BK, R->causal);
			const long an = ape_keys_min_abs(diag, 0, cnt);

			*cb = ape_may_skip(R->lambda, R->delta, R->beta, R->gamma, as, r->qn[k],
					   kb, an, cnt, bound_frame(R, r->crow_s[k], an), ms[k],
					   ls[k], -INFINITY, R->tol);
		}
		if (*cf) {
			const long cnt = R->Lk - hi * APE_BK;
			const long an = ape_keys_min_abs(diag, hi * APE_BK, R->Lk);

			*cf = ape_may_skip(R->lambda, R->delta, R->beta, R->gamma, as, r->qn[k],
					   kf, an, cnt, bound_frame(R, r->crow_s[k], an), ms[k],
					   ls[k], -INFINITY, R->tol);
		}
	}
}

/*
 * Before the walk, with the earlier launches' LSE: may the row vector leave out every key of
 * this launch? (For the streaming executor's key chunks off the diagonal, most rows can: without
 * this, each would score at least the tile nearest to it.) kall: the largest key norm of all.
 * The test has its own tolerance, prior_tol: the executor shares its budget among the launches
 * of a direction (the walk's own tests above stay relative to this launch's weight alone).
 */
KFN int rows_skip_all(const struct run *R, const struct rows *r, APE_REAL kall)
{
	const APE_REAL as = fabs((APE_REAL)R->scale);

	NOUNROLL
	for (int k = 0; k < APE_RW; k++) {
		const long i = r->i + k, diag = ape_sat_add(R->rel, i);
		const long cnt = ape_visible_keys(diag, R->Lk, R->causal);
		const long an = ape_anchor_distance(diag, R->Lk, R->causal);

		if (i < R->Lq &&
		    !ape_may_skip(R->lambda, R->delta, R->beta, R->gamma, as, r->qn[k], kall, an,
				  cnt, bound_frame(R, r->crow_s[k], an), -INFINITY, 0.0f,
				  r->prior[k], R->prior_tol))
			return 0;
	}
	return 1;
}

/* LSE (c_row + m + ln l, -inf with no key) and the pairs computed, row by row; O = acc / l (0
 * with no key, NaN stays NaN) straight out (one row per work-item) or into the transposing
 * stage (rows in vector lanes), which stage_store() writes out. The visited keys are
 * [jbeg, jend), or the pairs seen[] per lane when not NULL. */
KFN void rows_finish(const struct run *R, const struct rows *r, long jbeg, long jend,
		     __global void *O, __global float *LSE, __global ulong *PAIRS,
		     __global float *ENT, __global float *MDIST, __local float *stage,
		     const ulong *seen)
{
	const vf inv = select((vf)1.0f / r->l, (vf)0.0f, r->l == (vf)0.0f);
	float ms[APE_RW], ls[APE_RW], s1s[APE_RW], s2s[APE_RW];

	VS(r->m, ms);
	VS(r->l, ls);
	VS(r->s1, s1s);
	VS(r->s2, s2s);
	NOUNROLL
	for (int k = 0; k < APE_RW; k++) {
		const long i = r->i + k, diag = ape_sat_add(R->rel, i);

		if (i >= R->Lq)
			break;
		if (R->flags & F_LSE)
			LSE[R->lbase + i * R->lsl] =
				ls[k] > 0.0f ? (float)(r->crow_s[k] + (APE_REAL)ms[k] +
						       log((APE_REAL)ls[k]))
				: ls[k] == 0.0f ? -INFINITY
						: NAN;
		if (R->flags & F_DIAG) {
			/* ls NaN (a NaN row) gives NaN in both; either may be absent (NULL) */
			if (ENT)
				ENT[R->ebase + i * R->esl] = (float)ape_diag_entropy(
					(APE_REAL)ls[k], (APE_REAL)s1s[k]);
			if (MDIST)
				MDIST[R->mbase + i * R->msl] = (float)ape_diag_distance(
					(APE_REAL)ls[k], (APE_REAL)s2s[k]);
		}
		if (R->flags & F_PAIRS) { /* seen: each lane's count (explicit positions) */
			PAIRS[R->pbase + i] =
				seen ? seen[k]
				     : (ulong)ape_row_visible_pairs(diag, jbeg, jend, R->causal);
		}
	}
#if APE_RW == 1
	if (r->i < R->Lq) {
		NOUNROLL
		for (int d = 0; d < DIM; d++)
			st(O, R->obase + r->i * R->osl + d, r->acc[d] * inv, F_DT_OUT(R->flags));
	}
#else
	NOUNROLL
	for (int d = 0; d < DIM; d++)
		VS(r->acc[d] * inv, stage + d * BQ + r->rb);
#endif
}

/* The rows of a launch in vector lanes, written out of the transposing stage as whole rows
 * (after rows_finish()); nothing to do with one row per work-item. */
KFN void stage_store(const struct run *R, __global void *O, __local const float *stage)
{
#if APE_RW > 1
	WG_BARRIER();
	NOUNROLL
	for (int rr = R->wi; rr < BQ; rr += APE_NWI) {
		const long i = R->i0 + rr;

		if (i >= R->Lq)
			break;
		NOUNROLL
		for (int d = 0; d < DIM; d++)
			st(O, R->obase + i * R->osl + d, stage[d * BQ + rr], F_DT_OUT(R->flags));
	}
#else
	(void)R;
	(void)O;
	(void)stage;
#endif
}

/* The launch's constants into *R, for this work-group and (batch, head): a ragged launch's
 * (F_SEGS) from its entry of SEGT, the segment as a problem of its own; *q0 and *k0 its first
 * query and key rows in the launch (0 without segments). */
KFN void run_setup(struct run *R, __global const void *Q, __global const void *K,
		   __global const void *V, __global const float *PRIOR,
		   __global const APE_REAL *prm, int D, long Lq, long Lk, int H, int group,
		   long rel, float scale, float skip_tol, float prior_tol, int flags, long4 vq,
		   long4 vk, long4 vv, long4 vo, long4 vl, long4 ve, long4 vm,
		   __global const long *SEGT, long kpt, __global const float *BT,
		   __global const float *BSM, long blen, long bhs, long *q0p, long *k0p)
{
	const int h = (int)(get_global_id(1) % H);
	long q0 = 0, k0 = 0;

	R->D = D;
	const int P = DIM / 2; /* a constant in the specialised programs */

	R->i0 = ((long)get_num_groups(0) - 1 - (long)get_group_id(0)) * BQ;
	R->pbase = get_global_id(1) * Lq;
	if (flags & F_SEGS) {
		__global const long *e = SEGT + SEGT_W * get_group_id(0);

		q0 = e[0];
		Lq = e[1];
		k0 = e[2];
		Lk = e[3];
		rel = e[4];
		R->i0 = e[5];
		R->pbase += q0;
	}
	R->Q = Q;
	R->prior = PRIOR;
	R->K = K;
	R->V = V;
	R->omega = prm;
	R->Lq = Lq;
	R->Lk = Lk;
	R->rel = rel;
	R->ntk = (Lk + APE_BK - 1) / APE_BK;
	R->bh = get_global_id(1);
	R->bkv = R->bh / H * (H / group) + h / group;
	R->kp = flags & F_SEGS ? R->bkv * kpt + SEGT[SEGT_W * get_group_id(0) + 6]
			       : R->bkv * (R->ntk + 1);
	{
		const long b = R->bh / H, hk = h / group;

		R->qbase = VIEW_ROW(vq, b, h) + q0 * vq.w;
		R->qsl = vq.w;
		R->kbase = VIEW_ROW(vk, b, hk) + k0 * vk.w;
		R->ksl = vk.w;
		R->vbase = VIEW_ROW(vv, b, hk) + k0 * vv.w;
		R->vsl = vv.w;
		R->obase = VIEW_ROW(vo, b, h) + q0 * vo.w;
		R->osl = vo.w;
		R->lbase = VIEW_ROW(vl, b, h) + q0 * vl.w;
		R->lsl = vl.w;
		R->ebase = VIEW_ROW(ve, b, h) + q0 * ve.w;
		R->esl = ve.w;
		R->mbase = VIEW_ROW(vm, b, h) + q0 * vm.w;
		R->msl = vm.w;
	}
	/* the heaviest causal query tiles (the last ones) are handed out first (a ragged
	 * launch's table is so ordered) */
	R->wi = get_local_id(0);
	R->flags = flags;
	R->dtin = F_DT_IN(flags);
	R->inter = (flags & F_INTERLEAVED) != 0;
	R->kvdt = flags & F_KV_F32 ? 0 : R->dtin;
	R->kvinter = flags & F_KV_F32 ? 0 : R->inter;
	R->causal = (flags & F_CAUSAL) != 0;
	R->skip = (flags & F_SKIP) != 0;
	R->delta = prm[P + 4 * h];
	R->beta = prm[P + 4 * h + 1];
	R->gamma = prm[P + 4 * h + 2];
	R->lambda = prm[P + 4 * h + 3];
	R->scale = scale;
	R->tol = skip_tol;
	R->prior_tol = prior_tol;
	/* the head's row (bhs 0: one row for every head) */
	R->bt = flags & F_TABLE ? BT + h * bhs : BT;
	R->bsm = flags & F_TABLE ? BSM + h * bhs : BSM;
	R->blen = blen;
	*q0p = q0;
	*k0p = k0;
}

/* The arguments both attention kernels take, in this order (ocl_attention.c sets them). */
#define ATTN_ARGS                                                                                  \
	__global const void *Q, __global const void *K, __global const void *V, __global void *O, \
		__global float *LSE, __global ulong *PAIRS, __global const float *PRIOR,           \
		__global const APE_REAL *prm, __global const float *kpre,                          \
		__global const float *ksuf, int D, long Lq, long Lk, int H, int group, long rel,   \
		float scale, float skip_tol, float prior_tol, int flags, long4 vq, long4 vk,       \
		long4 vv, long4 vo, long4 vl, __global float *ENT, __global float *MDIST,          \
		long4 ve, long4 vm, __global const long *SEGT, long kpt, __global const float *BT, \
		__global const float *BSM, long blen, long bhs
#define RUN_SETUP(R, q0, k0)                                                                       \
	run_setup((R), Q, K, V, PRIOR, prm, D, Lq, Lk, H, group, rel, scale, skip_tol, prior_tol,  \
		  flags, vq, vk, vv, vo, vl, ve, vm, SEGT, kpt, BT, BSM, blen, bhs, (q0), (k0))

__kernel __attribute__((reqd_work_group_size(APE_NWI, 1, 1))) void ape_attention(ATTN_ARGS)
{
	__local float kv[KV_FLOATS];
	__local float ttab[BQ + APE_BK], btab[BQ + APE_BK];
	__local APE_REAL rawtab[2][2 * (BQ + APE_BK)]; /* this tile's and the previous tile's */
#if APE_NWI > 1
	__local int slots[2 * APE_NWI];
#endif
	struct run run, *R = &run;
	struct rows rg[APE_RG];
	vf sc[APE_BK]; /* one tile's scores, then weights */
	long q0, k0;

	RUN_SETUP(R, &q0, &k0);
	const int P = DIM / 2; /* a constant in the specialised programs */
	__local float *ku = kv, *kw = kv + APE_BK * P, *vt = kv + 2 * APE_BK * P;

	/* a ragged launch (B = 1): this work-group's segment as a problem of its own */
	Lq = R->Lq;
	Lk = R->Lk;
	rel = R->rel;

	NOUNROLL
	for (int g = 0; g < APE_RG; g++) {
		const int rb = (R->wi * APE_RG + g) * APE_RW;

		rows_init(R, &rg[g], R->i0 + rb, rb);
	}

	/* ---- the walk over key tiles, from the diagonal outward */
	const long ilast = min(R->i0 + BQ, Lq) - 1;
	/* causal and no row of the tile sees any key: one pass over an empty tile, so that the
	 * loop has a single shape */
	const int none = Lk == 0 || (R->causal && rel + ilast < 0);
	const long start = none ? 0
			   : R->causal ? min(rel + ilast, Lk - 1) / APE_BK
				       : clamp(rel + (R->i0 + ilast) / 2, 0L, Lk - 1) / APE_BK;
	long lo = start - 1, hi = start + 1, t = start, nprev = 0;
	int back_done = 0, fwd_done = R->causal, next_back = 1, cur = 0;

	NOUNROLL
	for (int g = 0; g < APE_RG; g++) {
		rg[g].tlo = rg[g].thi = start;
		rg[g].done_b = 0;
		rg[g].done_f = R->causal;
		/* proved negligible in full by the earlier launches' weight: an empty range of
		 * visited tiles (tlo > thi), both sides done, so the walk never scores it */
		if (R->skip && (flags & F_PRIOR) &&
		    rows_skip_all(R, &rg[g], kpre[R->kp + R->ntk])) {
			rg[g].tlo = start + 1;
			rg[g].thi = start - 1;
			rg[g].done_b = rg[g].done_f = 1;
		}
	}
	do {
		const long j0 = t * APE_BK;
		const int len = none ? 0 : (int)min((long)APE_BK, Lk - j0);
		const long nbase = rel + R->i0 - j0; /* n of (row i0, key j0) */
		/* causal: visible iff (row in tile) - (key in tile) >= lim */
		const int lim = (int)clamp(ape_sat_sub(0, nbase), -2L * APE_BK, 2L * BQ);
		const APE_REAL bref = ape_bias(R->delta, R->beta, R->gamma,
					       (APE_REAL)ape_abs_dist(nbase));

		WG_BARRIER(); /* the previous tile is no longer read */
		tile_load(R, j0, len, nbase, bref, ku, kw, vt, ttab, btab, rawtab[cur ^ 1],
			  rawtab[cur], nbase - nprev, t != start);
		cur ^= 1;
		nprev = nbase;
		WG_BARRIER();
		/* a row vector that has proved the rest of this side negligible sits it out */
		NOUNROLL
		for (int g = 0; g < APE_RG; g++) {
			struct rows *r = &rg[g];
			const int mask = R->causal && ape_sat_add(nbase, r->rb - (APE_BK - 1)) < 0;

			/* nor does a row vector of padding rows alone (a short segment's tile) */
			if ((t < r->tlo && r->done_b) || (t > r->thi && r->done_f) || r->i >= Lq)
				continue;
			tile_scores(R, r, nbase, len, lim, mask, bref, ku, kw, ttab, btab, sc);
			tile_softmax(R, r, len, lim, mask, nbase, vt, sc, 0, (vlg)0,
				     (__local const long *)0);
			r->tlo = min(r->tlo, t);
			r->thi = max(r->thi, t);
		}

		/* far keys: each row vector stops a side once it has proved the rest of it
		 * negligible (the doc's per-row rule, 16 rows at a time); the work-group stops
		 * loading that side once all of its rows have */
		{
			const int can_back = R->skip && lo >= 0 && !back_done;
			const int can_fwd = R->skip && hi < R->ntk && !fwd_done;
			const APE_REAL kb = can_back ? kpre[R->kp + lo + 1] : 0;
			const APE_REAL kf = can_fwd ? ksuf[R->kp + hi] : 0;
			int cb = can_back, cf = can_fwd;

			NOUNROLL
			for (int g = 0; g < APE_RG; g++) {
				struct rows *r = &rg[g];
				int b = can_back && !r->done_b, f = can_fwd && !r->done_f;

				if (b || f)
					rows_may_stop(R, r, lo, hi, kb, kf, &b, &f);
				r->done_b |= b;
				r->done_f |= f;
				cb &= r->done_b;
				cf &= r->done_f;
			}
#if APE_NWI > 1
			slots[2 * R->wi] = cb;
			slots[2 * R->wi + 1] = cf;
			/* unconditional even without skipping: under a branch, PoCL would copy
			 * all the code after it */
			barrier(CLK_LOCAL_MEM_FENCE);
			cb = can_back;
			cf = can_fwd;
			for (int w = 0; w < APE_NWI; w++) {
				cb &= slots[2 * w];
				cf &= slots[2 * w + 1];
			}
#endif
			back_done |= cb;
			fwd_done |= cf;
		}

		/* next tile: alternate between the two sides while both are open */
		{
			const int ob = lo >= 0 && !back_done, of = hi < R->ntk && !fwd_done;

			if (ob && (next_back || !of)) {
				t = lo--;
				next_back = 0;
			} else if (of) {
				t = hi++;
				next_back = 1;
			} else {
				t = -1;
			}
		}
	} while (t >= 0);

	/* ---- outputs */
	WG_BARRIER(); /* every work-item is done with the K/V tile: kv becomes the stage */
	NOUNROLL
	for (int g = 0; g < APE_RG; g++)
		rows_finish(R, &rg[g], none ? 0 : rg[g].tlo * APE_BK,
			    none ? 0 : min((rg[g].thi + 1) * APE_BK, Lk), O, LSE, PAIRS, ENT, MDIST,
			    kv, (const ulong *)0);
	stage_store(R, O, kv);
}

/*
 * ---- Explicit positions (F_POS, core/backend.h ABI 13: struct ape_be_launch.pos_q, .pos_k),
 * always through the segment table (one segment of every row and key without segments).
 * Every pair has its own n = pos_q - pos_k, so nothing rests on consecutive positions: no
 * rotation recurrence (each pair's angle is seeded, P ape_seed_sincos() per pair instead of
 * per tile), no per-distance tables (temperature and bias per pair), visibility and distances
 * from the positions. The key tiles are those of the contiguous walk (APE_BK keys of the
 * segment each), but visited nearest first (the tile whose position range is nearest to the
 * work-group's rows), then in order; a tile no row of the work-group sees (causal: every key
 * after every row) is not loaded. The far-key bound is taken per key tile and per row from
 * the tile's position range (TPOS: smallest and largest key position) and its largest key
 * norm: the tile's smallest |n| for the row, every key of the tile counted (keys may share a
 * distance), each tile against tol / ntk, so that the tiles a row leaves out weigh at most tol
 * of what it computes, with gaps, repeats and any order alike.
 */

/* Per row vector: the lanes' positions and the pairs each lane computed. */
struct prow {
	vlg pos;
	ulong seen[APE_RW];
};

/* The smallest |n| a row at position x has to the keys of a tile with positions tmin..tmax,
 * or -1 when causal and it sees none of them. */
KFN long pos_tile_min_abs(const struct run *R, long x, long tmin, long tmax)
{
	long lo = ape_sat_sub(x, tmax), hi = ape_sat_sub(x, tmin);

	if (R->causal) {
		if (hi < 0)
			return -1;
		lo = max(lo, 0L);
	}
	return ape_min_abs(lo, hi);
}

/* The lanes' positions (a padding lane takes the segment's last row's) and their score frame
 * c_row: the bias at the nearest visible distance over the tiles' position ranges (a lower
 * bound of the row's nearest |n|, so with decays >= 0 at least its largest bias). */
KFN void pos_rows_init(const struct run *R, struct rows *r, struct prow *pw,
		       __global const long *pq, __global const long *tp)
{
	long ps[APE_RW];

	NOUNROLL
	for (int k = 0; k < APE_RW; k++) {
		long best = -1;

		ps[k] = pq[min(r->i + k, R->Lq - 1)];
		pw->seen[k] = 0;
		NOUNROLL
		for (long t = 0; t < R->ntk; t++) {
			const long d = pos_tile_min_abs(R, ps[k], tp[2 * t], tp[2 * t + 1]);

			best = d >= 0 && (best < 0 || d < best) ? d : best;
		}
		r->crow_s[k] = ape_bias(R->delta, R->beta, R->gamma, (APE_REAL)max(best, 0L));
	}
	pw->pos = VL(ps);
	r->crow = VL(r->crow_s);
}

/* May every row of r leave out the tile (len keys at positions tmin..tmax, norms at most kn),
 * each against tol, its share of skip_tol? */
KFN int pos_may_skip(const struct run *R, const struct rows *r, const struct prow *pw,
		     long tmin, long tmax, int len, APE_REAL kn, APE_REAL tol)
{
	const APE_REAL as = fabs((APE_REAL)R->scale);
	float ms[APE_RW], ls[APE_RW];
	long ps[APE_RW];

	VS(r->m, ms);
	VS(r->l, ls);
	VS(pw->pos, ps);
	NOUNROLL
	for (int k = 0; k < APE_RW; k++) {
		const long an = pos_tile_min_abs(R, ps[k], tmin, tmax);

		if (r->i + k >= R->Lq || an < 0)
			continue; /* padding, or a row that sees none of the tile */
		if (!ape_may_skip_weighed(R->lambda, R->delta, R->beta, R->gamma, as, r->qn[k], kn,
					  (APE_REAL)an, (APE_REAL)len,
					  bound_frame(R, r->crow_s[k], an), ms[k], ls[k], -INFINITY,
					  tol))
			return 0;
	}
	return 1;
}

/* The scores of the rows against the tile into sc[], each pair at its own distance (masked:
 * -inf; a non-finite dot product: NaN, as in tile_scores()); counts the visible pairs. */
KFN void pos_scores(const struct run *R, const struct rows *r, struct prow *pw, int len,
		    __local const float *ku, __local const float *kw, __local const long *pk,
		    vf *sc)
{
	const int P = DIM / 2;

	NOUNROLL
	for (int j = 0; j < len; j++) {
		/* exact: every real pair's distance fits (padding lanes' wrap, unread) */
		const vlg n = AS_VLG(AS_VULG(pw->pos) - (ulong)pk[j]);
		const vr nr = TO_VR(n);
		long ns[APE_RW];
		float ts[APE_RW], bs[APE_RW];
		vf S = (vf)0.0f;

		NOUNROLL
		for (int p = 0; p < P; p++) {
			vf c, s = ape_seed_sincos(nr * (R->omega[p] * r->ia), &c);
			const vf u = (vf)ku[j * P + p], w = (vf)kw[j * P + p];

			S = fma(fma(r->xq[p], u, r->yq[p] * w), c, S);
			S = fma(fma(r->xq[p], w, -(r->yq[p] * u)), s, S);
		}
		VS(n, ns);
		NOUNROLL
		for (int k = 0; k < APE_RW; k++) {
			const long al = ape_abs_dist(ns[k]);
			const APE_REAL an = (APE_REAL)al;

			ts[k] = (float)(ape_temp(R->lambda, an) * (APE_REAL)R->scale);
			bs[k] = (float)(ape_bias(R->delta, R->beta, R->gamma, an) - r->crow_s[k] +
					tab_at(R, al));
			pw->seen[k] += !R->causal || ns[k] >= 0;
		}
		{
			const vf s = fma(S, VL(ts), VL(bs));
			const vi hide = R->causal ? VIS_OF(n < (vlg)0) : (vi)0;

			sc[j] = select(select((vf)NAN, s, isfinite(S)), (vf)(-INFINITY), hide);
		}
	}
}

__kernel __attribute__((reqd_work_group_size(APE_NWI, 1, 1))) void
ape_attention_pos(ATTN_ARGS, __global const long *POSQ, __global const long *POSK,
		  __global const long *TPOS)
{
	__local float kv[KV_FLOATS];
	__local long pk[APE_BK];
	struct run run, *R = &run;
	struct rows rg[APE_RG];
	struct prow pw[APE_RG];
	vf sc[APE_BK]; /* one tile's scores, then weights */
	long q0, k0, qlo = LONG_MAX, qhi = LONG_MIN, start = -1, best = -1;

	RUN_SETUP(R, &q0, &k0);
	const int P = DIM / 2; /* a constant in the specialised programs */
	__local float *ku = kv, *kw = kv + APE_BK * P, *vt = kv + 2 * APE_BK * P;
	/* the segment's rows' and keys' positions, its tiles' position ranges */
	__global const long *pq = POSQ + q0, *pkg = POSK + k0;
	__global const long *tp = TPOS + 2 * SEGT[SEGT_W * get_group_id(0) + 6];
	const APE_REAL tol = (APE_REAL)R->tol / (APE_REAL)max(R->ntk, 1L);

	NOUNROLL
	for (int g = 0; g < APE_RG; g++) {
		const int rb = (R->wi * APE_RG + g) * APE_RW;

		rows_init(R, &rg[g], R->i0 + rb, rb);
		pos_rows_init(R, &rg[g], &pw[g], pq, tp);
	}
	/* the work-group's rows' positions; the tile nearest to them goes first */
	for (long i = R->i0; i < min(R->i0 + BQ, R->Lq); i++) {
		qlo = min(qlo, pq[i]);
		qhi = max(qhi, pq[i]);
	}
	for (long t = 0; t < R->ntk; t++) {
		/* the gap between the rows' and the tile's position ranges (causal: -1 when
		 * every key of the tile is after every row) */
		const long tmin = tp[2 * t], tmax = tp[2 * t + 1];
		const long d = R->causal && tmin > qhi ? -1
			       : tmin > qhi	       ? ape_sat_sub(tmin, qhi)
			       : tmax < qlo	       ? ape_sat_sub(qlo, tmax)
						       : 0;

		if (d >= 0 && (best < 0 || d < best)) {
			best = d;
			start = t;
		}
	}

	/* ---- the walk: the nearest tile, then every other in order (none: no row sees any) */
	NOUNROLL
	for (long c = 0; start >= 0 && c < R->ntk; c++) {
		const long t = c == 0 ? start : c - 1 + (c - 1 >= start);
		const long tmin = tp[2 * t], tmax = tp[2 * t + 1], j0 = t * APE_BK;
		const int len = (int)min((long)APE_BK, R->Lk - j0);

		if (R->causal && tmin > qhi)
			continue; /* every key after every row: the same answer for the work-group */
		WG_BARRIER(); /* the previous tile is no longer read */
		tile_kv(R, j0, len, ku, kw, vt);
		for (int j = R->wi; j < APE_BK; j += APE_NWI)
			pk[j] = j < len ? pkg[j0 + j] : 0;
		WG_BARRIER();
		NOUNROLL
		for (int g = 0; g < APE_RG; g++) {
			struct rows *r = &rg[g];

			/* padding rows alone, or every row's share of the tile provably negligible */
			if (r->i >= R->Lq ||
			    (R->skip &&
			     pos_may_skip(R, r, &pw[g], tmin, tmax, len, kpre[R->kp + t], tol)))
				continue;
			pos_scores(R, r, &pw[g], len, ku, kw, pk, sc);
			tile_softmax(R, r, len, 0, R->causal, 0, vt, sc, 1, pw[g].pos, pk);
		}
	}

	/* ---- outputs */
	WG_BARRIER(); /* every work-item is done with the K/V tile: kv becomes the stage */
	NOUNROLL
	for (int g = 0; g < APE_RG; g++)
		rows_finish(R, &rg[g], 0, 0, O, LSE, PAIRS, ENT, MDIST, kv, pw[g].seen);
	stage_store(R, O, kv);
}

/*
 * K and V as float32, K's pairs in the half layout, once per call: every query tile reads each
 * key tile again, and converting f16/bf16 (or de-interleaving) there cost more than the
 * attention arithmetic on PoCL. One work-item per key row, read where the views vk, vv say
 * (Hkv heads of Lk rows per batch), written contiguous.
 */
__kernel void ape_kv_prep(__global const void *K, __global const void *V, int D, long rows, int dt,
			  int inter, int do_v, __global float *Kp, __global float *Vf, int Hkv,
			  long Lk, long4 vk, long4 vv)
{
	const long row = get_global_id(0), base = row * D;
	const int P = D / 2;

	if (row >= rows)
		return;
	const long j = row % Lk, bh = row / Lk, b = bh / Hkv, h = bh % Hkv;
	const long kb = VIEW_ROW(vk, b, h) + j * vk.w, vb = VIEW_ROW(vv, b, h) + j * vv.w;

	for (int p = 0; p < P; p++) {
		Kp[base + p] = ld(K, kb + (inter ? 2 * p : p), dt);
		Kp[base + P + p] = ld(K, kb + (inter ? 2 * p + 1 : p + P), dt);
	}
	if (do_v)
		for (int d = 0; d < D; d++)
			Vf[base + d] = ld(V, vb + d, dt);
}

/*
 * Skip pre-pass, part 1: the largest key norm of each key tile of each kv head, rounded up so
 * that it stays a bound. A NaN or Inf anywhere in the tile's K or V gives +inf, so that such a
 * tile is never skipped and its NaN reaches every row that sees it. Tile t holds keys
 * t * APE_BK .. of the launch, or in a ragged launch (segs) keys KT[2t] .. KT[2t+1]-1 (each
 * segment's keys cut into tiles from its own first key).
 */
__kernel void ape_kmax(__global const void *K, __global const void *V, int D, long Lk, int dt,
		       long ntk, __global float *ktile, int Hkv, long4 vk, long4 vv,
		       __global const long *KT, int segs)
{
	const long t = get_global_id(0), bkv = get_global_id(1);
	const long kb = VIEW_ROW(vk, bkv / Hkv, bkv % Hkv), vb = VIEW_ROW(vv, bkv / Hkv, bkv % Hkv);
	float mx = 0.0f;

	if (t >= ntk)
		return;
	const long j0 = segs ? KT[2 * t] : t * APE_BK;
	const long j1 = segs ? KT[2 * t + 1] : min((t + 1) * APE_BK, Lk);

	for (long j = j0; j < j1; j++) {
		const long kj = kb + j * vk.w, vj = vb + j * vv.w;
		float s = 0.0f, vs = 0.0f;

		for (int d = 0; d < D; d++) {
			const float k = ld(K, kj + d, dt);

			s += k * k;
			vs += 0.0f * ld(V, vj + d, dt); /* NaN for any NaN or Inf */
		}
		s = sqrt(s) + vs;
		if (!(s <= mx))
			mx = isnan(s) ? INFINITY : s;
	}
	ktile[bkv * ntk + t] = ape_norm_bound_f(mx);
}

/* Skip pre-pass, part 2: prefix and suffix maxima, so that "the largest key norm among the
 * tiles not visited yet in this direction" is one load: pre[t] over tiles < t, suf[t] over
 * tiles >= t. Per kv head ntk + 1 values; in a ragged launch (nst segments, ST[2s] the first
 * tile of segment s and ST[2s+1] its tile count) the scans of each segment's own tiles, segment
 * s's ST[2s+1] + 1 values from element ST[2s] + s of its kv head's ntk + nst. */
__kernel void ape_kscan(__global const float *ktile, long ntk, __global float *pre,
			__global float *suf, __global const long *ST, long nst)
{
	const long bkv = get_global_id(0), s = get_global_id(1);
	const long t0 = nst ? ST[2 * s] : 0, n = nst ? ST[2 * s + 1] : ntk;
	const long off = bkv * (nst ? ntk + nst : ntk + 1) + (nst ? t0 + s : 0);
	__global const float *kt = ktile + bkv * ntk + t0;
	__global float *pr = pre + off, *su = suf + off;
	float run = 0.0f;

	pr[0] = 0.0f;
	for (long t = 0; t < n; t++) {
		run = fmax(run, kt[t]);
		pr[t + 1] = run;
	}
	run = 0.0f;
	su[n] = 0.0f;
	for (long t = n - 1; t >= 0; t--) {
		run = fmax(run, kt[t]);
		su[t] = run;
	}
}

/*
 * attention_merge (core/backend.h, struct ape_be_merge): row r's partial result (PO, PLSE, ...)
 * folded into its running one (O, LSE, ...) by their LSE, one work-item per row (the row's LSE
 * is read before and written after its O, by the same work-item). flags: 1 pair counts,
 * 2 diagnostics, 4 the pair counts' sums in 32 bits; buffers they leave out are NULL.
 */
__kernel void ape_merge(__global float *O, __global float *LSE, __global void *PAIRS,
			__global float *ENT, __global float *MD, __global const float *PO,
			__global const float *PLSE, __global const ulong *PPAIRS,
			__global const float *PENT, __global const float *PMD, long rows, long D,
			int flags)
{
	const long r = get_global_id(0);
	__global float *o = O + r * D;
	__global const float *po = PO + r * D;
	ape_real l = 0, w1 = 0, w2 = 0, lw1 = 0, lw2 = 0;
	int how;

	if (r >= rows)
		return;
	if (flags & 4)
		((__global uint *)PAIRS)[r] += (uint)PPAIRS[r];
	else if (flags & 1)
		((__global ulong *)PAIRS)[r] += PPAIRS[r];
	how = ape_merge_lse((ape_real)LSE[r], (ape_real)PLSE[r], &l, &w1, &w2, &lw1, &lw2);
	if (how == APE_MERGE_KEEP)
		return;
	if (how == APE_MERGE_NAN) {
		for (long d = 0; d < D; d++)
			o[d] = NAN;
		LSE[r] = NAN;
		if (flags & 2)
			ENT[r] = MD[r] = NAN;
		return;
	}
	if (how == APE_MERGE_TAKE) {
		for (long d = 0; d < D; d++)
			o[d] = po[d];
		LSE[r] = PLSE[r];
		if (flags & 2) {
			ENT[r] = PENT[r];
			MD[r] = PMD[r];
		}
		return;
	}
	for (long d = 0; d < D; d++)
		o[d] = (float)(w1 * (ape_real)o[d] + w2 * (ape_real)po[d]);
	if (flags & 2) {
		ENT[r] = (float)ape_merge_entropy(w1, (ape_real)ENT[r], lw1, w2, (ape_real)PENT[r],
						  lw2);
		MD[r] = (float)(w1 * (ape_real)MD[r] + w2 * (ape_real)PMD[r]);
	}
	LSE[r] = (float)l;
}
