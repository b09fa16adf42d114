/* SPDX-License-Identifier: MIT */
/*
 * What every CUDA kernel file shares: the shared math of include/ape/ape_math.h (in float64), the
 * device primitives (barriers, shuffles, asynchronous copies, ldmatrix, mma, ex2), storage-type
 * conversions and the small helpers of the walk over key tiles.
 *
 * The primitives are the only place with inline PTX. Built with APE_CUDA_EMU defined (by
 * tests/fake_cuda, with the host C++ compiler), the same kernels run on the CPU: cuda/emu/emu.h
 * then provides each primitive with the semantics the PTX ISA documents (fragment layouts
 * included), so that the tests exercise the kernels' indexing, masking and walk logic without
 * a GPU.
 */
#ifndef APE_CUDA_KERNELS_COMMON_CUH
#define APE_CUDA_KERNELS_COMMON_CUH

#include <stdint.h>

#include "args.h"

#ifdef APE_CUDA_EMU
#include "../emu/emu.h"
#define APE_EMU_REGISTER(name, args_t) APE_EMU_KERNEL(name, args_t)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define APE_EMU_REGISTER(name, args_t)
#endif

/* The shared formulas (sigma, alpha, |q|, the anchor, the seed sincos, the distance tables, the
 * skip test) in float64 where they take APE_REAL: seeds, alpha, |q|, the skip bound and LSE are
 * per row or per tile, never per pair, so float64 costs nothing measurable on the GPUs this
 * targets (A100, H100/H200: half the float32 rate). */
#define APE_REAL double
#include "ape/ape_math.h"

#define APE_INF __int_as_float(0x7f800000)
#define APE_NAN __int_as_float(0x7fffffff)
#define APE_LOG2E 1.4426950408889634
#define APE_LN2 0.6931471805599453

namespace ape {

/* ------------------------------------------------------------------ device primitives */
#ifndef APE_CUDA_EMU

#define APE_DEV __device__ __forceinline__

APE_DEV unsigned char *smem_base()
{
	extern __shared__ __align__(16) unsigned char ape_dyn_smem[];
	return ape_dyn_smem;
}

APE_DEV void bar()
{
	__syncthreads();
}

APE_DEV int bar_or(int pred)
{
	return __syncthreads_or(pred);
}

APE_DEV float shfl_xor(float v, int m)
{
	return __shfl_xor_sync(0xffffffffu, v, m);
}

APE_DEV double shfl_xor(double v, int m)
{
	return __shfl_xor_sync(0xffffffffu, v, m);
}

APE_DEV int shfl_xor(int v, int m)
{
	return __shfl_xor_sync(0xffffffffu, v, m);
}

APE_DEV float shfl_idx(float v, int src)
{
	return __shfl_sync(0xffffffffu, v, src);
}

APE_DEV void warp_sync()
{
	__syncwarp();
}

APE_DEV unsigned smem_addr(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

/* 16 bytes from global to shared memory, asynchronously; the bytes past src_bytes (0 or 16)
 * are zeros. Both addresses 16-byte aligned. */
APE_DEV void cp_async16(void *sdst, const void *gsrc, unsigned src_bytes)
{
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(sdst)),
		     "l"(gsrc), "r"(src_bytes)
		     : "memory");
}

APE_DEV void cp_commit()
{
	asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are still in flight. */
template <int N> APE_DEV void cp_wait()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Four 8x8 matrices of 16-bit elements; lanes 8m..8m+7 give the row addresses of matrix m. */
APE_DEV void ldsm_x4(uint32_t (&r)[4], const void *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(smem_addr(p)));
}

APE_DEV void ldsm_x4_trans(uint32_t (&r)[4], const void *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(smem_addr(p)));
}

/* D = A B + C on one 16x8x16 tile, float32 accumulators; VT picks f16 or bf16 operands. */
template <int VT>
APE_DEV void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
	if (VT == APE_CU_F16)
		asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
			     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
			     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
			     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
	else
		asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
			     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
			     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
			     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x, one MUFU instruction (relative error about 2^-22); subnormal results are 0. */
APE_DEV float ex2_approx(float x)
{
	float y;

	asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
	return y;
}
#endif

/* A weight or merge factor 2^x (scores in log2 units): 0 below the underflow cutoff that every
 * backend shares (ape/ape_math.h), NaN stays NaN. */
APE_DEV float ex2(float x)
{
	return x < APE_EXP2_CUTOFF ? 0.0f : ex2_approx(x);
}
#ifndef APE_CUDA_EMU

APE_DEV float h2f(uint16_t h)
{
	return __half2float(__ushort_as_half(h));
}

APE_DEV float b2f(uint16_t h)
{
	return __uint_as_float((uint32_t)h << 16);
}

/* Two floats as one packed pair of VT (low half = lo), rounded to nearest even. */
template <int VT> APE_DEV uint32_t pack2(float lo, float hi)
{
	if (VT == APE_CU_F16) {
		__half2 v = __floats2half2_rn(lo, hi);

		return *reinterpret_cast<uint32_t *>(&v);
	} else {
		__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);

		return *reinterpret_cast<uint32_t *>(&v);
	}
}

APE_DEV uint16_t f2h(float x)
{
	return __half_as_ushort(__float2half_rn(x));
}

APE_DEV uint16_t f2b(float x)
{
	return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/* A 16-byte read-only global load. */
APE_DEV uint4 ldg16(const void *p)
{
	return __ldg(reinterpret_cast<const uint4 *>(p));
}

APE_DEV void atomic_or_shared(int *p, int v)
{
	atomicOr(p, v);
}

#endif /* !APE_CUDA_EMU */

/* ------------------------------------------------------------------ helpers on top */

APE_DEV int64_t block_linear()
{
	return (int64_t)blockIdx.y * (int64_t)gridDim.x + (int64_t)blockIdx.x;
}

APE_DEV int64_t imin(int64_t a, int64_t b)
{
	return a < b ? a : b;
}

APE_DEV int64_t imax(int64_t a, int64_t b)
{
	return a > b ? a : b;
}

/* Exchanges a and b when c holds; written on values (not as a choice between two array
 * elements, which the compiler may turn into a computed address and put the array in local
 * memory). */
APE_DEV void swap_if(bool c, float &a, float &b)
{
	const float x = c ? b : a, y = c ? a : b;

	a = x;
	b = y;
}

/* Sum and maximum over the W consecutive lanes that share a query row (W a power of two). */
template <int W, class T> APE_DEV T group_sum(T v)
{
#pragma unroll
	for (int m = W / 2; m > 0; m >>= 1)
		v += shfl_xor(v, m);
	return v;
}

template <int W> APE_DEV float group_max(float v)
{
#pragma unroll
	for (int m = W / 2; m > 0; m >>= 1)
		v = fmaxf(v, shfl_xor(v, m));
	return v;
}

/* The element offset of row i of head h of batch b (core/backend.h, struct ape_be_view). */
APE_DEV int64_t vrow(const ape_cu_view &v, int64_t b, int64_t h, int64_t i)
{
	return v.off + b * v.sb + h * v.sh + i * v.sl;
}

/* Physical block of logical block lb of keys read in place (struct ape_cu_pages, args.h): from
 * the page table, or the ring's. */
APE_DEV int64_t page_block(const ape_cu_pages &pg, int64_t lb)
{
	return pg.table ? reinterpret_cast<const int64_t *>(pg.table)[pg.first + lb]
			: (pg.first + lb) % pg.nblocks;
}

/* The element offset of key j of a (batch, kv head) from that head's base (vrow(view, b, h, 0)),
 * for a view whose row stride is sl: j * sl, or where the pages put it (pg.bt > 0, args.h). */
APE_DEV int64_t key_at(const ape_cu_pages &pg, int64_t sl, int64_t j)
{
	if (!pg.bt)
		return j * sl;
	const int64_t t = pg.row + j, lb = t / pg.bt;

	return page_block(pg, lb) * pg.sblock + (t - lb * pg.bt) * sl;
}

/* key_at() for keys met in order (start(j), then next() for j + 1, ...): one division at the
 * start, one table read per block; at() reads the table only when asked (a key past the last
 * may have no block). */
struct KeyWalk {
	int64_t key, lb, r, clb, cbase;

	APE_DEV void start(const ape_cu_pages &pg, int64_t j)
	{
		key = j;
		lb = r = cbase = 0;
		clb = -1;
		if (pg.bt) {
			const int64_t t = pg.row + j;

			lb = t / pg.bt;
			r = t - lb * pg.bt;
		}
	}

	APE_DEV void next(const ape_cu_pages &pg)
	{
		key++;
		if (pg.bt && ++r == pg.bt) {
			r = 0;
			lb++;
		}
	}

	APE_DEV int64_t at(const ape_cu_pages &pg, int64_t sl)
	{
		if (!pg.bt)
			return key * sl;
		if (lb != clb) {
			clb = lb;
			cbase = page_block(pg, lb) * pg.sblock;
		}
		return cbase + r * sl;
	}
};

/* 16 bytes of a K or V row at src into shared memory at dst (16-byte aligned) with cp.async, or
 * zeros where !ok (cp.async of 0 bytes from base: 16-byte aligned, the buffer's start). check
 * (keys read in place whose rows the host could not prove 16-byte aligned, APE_CU_F_KV_CHECK):
 * a src that is not 16-byte aligned is copied with plain 2-byte loads instead (every element is
 * at least 2-byte aligned): the same bytes. */
APE_DEV void copy_row16(void *dst, const void *src, const void *base, bool ok, bool check)
{
	if (check && ok && (reinterpret_cast<uintptr_t>(src) & 15)) {
		uint16_t *d = reinterpret_cast<uint16_t *>(dst);

#pragma unroll
		for (int e = 0; e < 8; e++)
			d[e] = reinterpret_cast<const uint16_t *>(src)[e];
		return;
	}
	cp_async16(dst, ok ? src : base, ok ? 16u : 0u);
}

/* One element of a global tensor of storage type dt, as float. */
APE_DEV float load_el(const void *base, int64_t i, int dt)
{
	if (dt == APE_CU_F16)
		return h2f(reinterpret_cast<const uint16_t *>(base)[i]);
	if (dt == APE_CU_BF16)
		return b2f(reinterpret_cast<const uint16_t *>(base)[i]);
	return reinterpret_cast<const float *>(base)[i];
}

APE_DEV void store_el(void *base, int64_t i, float x, int dt)
{
	if (dt == APE_CU_F16)
		reinterpret_cast<uint16_t *>(base)[i] = f2h(x);
	else if (dt == APE_CU_BF16)
		reinterpret_cast<uint16_t *>(base)[i] = f2b(x);
	else
		reinterpret_cast<float *>(base)[i] = x;
}

/* Two adjacent elements (index i even, so 4- or 8-byte aligned). */
APE_DEV void store_el2(void *base, int64_t i, float x0, float x1, int dt)
{
	if (dt == APE_CU_F16)
		reinterpret_cast<uint32_t *>(base)[i / 2] = pack2<APE_CU_F16>(x0, x1);
	else if (dt == APE_CU_BF16)
		reinterpret_cast<uint32_t *>(base)[i / 2] = pack2<APE_CU_BF16>(x0, x1);
	else
		reinterpret_cast<float2 *>(base)[i / 2] = make_float2(x0, x1);
}

/* Two adjacent elements of O (i even), one store unless APE_CU_F_O_SCALAR says the pair is not
 * aligned for it. */
APE_DEV void store_o2(const ape_cu_common &c, int64_t i, float x0, float x1)
{
	void *o = reinterpret_cast<void *>(c.o);

	if (c.flags & APE_CU_F_O_SCALAR) {
		store_el(o, i, x0, c.dt_out);
		store_el(o, i + 1, x1, c.dt_out);
	} else {
		store_el2(o, i, x0, x1, c.dt_out);
	}
}

/* A 16-bit element of a packed pair (k = 0: low half). */
APE_DEV uint16_t half_of(uint32_t w, int k)
{
	return (uint16_t)(k ? w >> 16 : w & 0xffffu);
}

/* The four parameters of head h. */
APE_DEV void head_params(const struct ape_cu_common &c, int h, float hp[4])
{
	const float *src = c.hparams ? reinterpret_cast<const float *>(c.hparams) + 4 * h
				     : c.hp + 4 * h;
#pragma unroll
	for (int k = 0; k < 4; k++)
		hp[k] = src[k];
}

/* Head h's row of the distance-bias table t (args.h, struct ape_cu_bias), or nullptr without
 * one: what a loop over keys reads, having tested the table's presence once. */
APE_DEV const float *bias_row(const ape_cu_bias &t, int64_t h)
{
	return t.tab ? reinterpret_cast<const float *>(t.tab) + h * t.hstride : nullptr;
}

/* Head h's table entry at distance an; 0 without a table. */
APE_DEV float bias_at(const ape_cu_bias &t, int64_t h, int64_t an)
{
	return t.tab ? reinterpret_cast<const float *>(t.tab)[h * t.hstride +
							       ape_bias_index(an, t.len)]
		     : 0.0f;
}

/*
 * May a query row of head h leave out `count` keys, none nearer than distance an, whose norms
 * are at most kmax? Its computed keys have maximum m2 (log2 units, relative to crow) and
 * denominator l; prior: earlier launches' LSE relative to crow (natural log), or -inf.
 * ape_may_skip() in this kernels' units; a distance-bias table's largest entry from an on (its
 * suffix maximum) raises the score bound, passed as crow lowered by it.
 */
APE_DEV bool may_stop(const float hp[4], const ape_cu_bias &bias, int64_t h, double abs_scale,
		      double qnorm, double kmax, int64_t an, int64_t count, double crow, float m2,
		      float l, double prior, double tol)
{
	const double tmax = bias.tab ? (double)reinterpret_cast<const float *>(
					       bias.smax)[h * bias.hstride + ape_bias_index(an, bias.len)]
				     : 0.0;

	return ape_may_skip(hp[3], hp[0], hp[1], hp[2], abs_scale, qnorm, kmax, (double)an,
			    (double)count, crow - tmax, (double)m2 * APE_LN2, (double)l, prior, tol);
}

} /* namespace ape */

#endif /* APE_CUDA_KERNELS_COMMON_CUH */
