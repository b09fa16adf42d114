/* SPDX-License-Identifier: MIT */
/*
 * The CUDA kernels on the CPU, for tests (never part of libape): included by
 * cuda/kernels/common.cuh when APE_CUDA_EMU is defined, it maps the CUDA built-ins to a CPU
 * runtime (emu.cc) that runs every thread of a block as a fiber and completes barriers, warp
 * shuffles, ldmatrix and mma when all participants have arrived, with the semantics of the PTX
 * ISA (fragment layouts included). cp.async copies are deferred until the issuing thread waits
 * for them, so a kernel that reads a tile before waiting sees stale data, as it could on a GPU.
 * A warp whose lanes reach different collectives, or a block whose threads cannot all reach a
 * barrier, stops the launch with an error instead of hanging.
 */
#ifndef APE_CUDA_EMU_EMU_H
#define APE_CUDA_EMU_EMU_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <vector_functions.h>
/* the storage conversions with the rounding the hardware's cvt.rn instructions have: libape's own
 * (runtime/core/half.c, linked into the emulated driver) */
extern "C" {
#include "core/half.h"
}
#include <vector_types.h>

/* vector_functions.h brought CUDA's own definitions of these (attributes g++ ignores) */
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

namespace ape_emu {

struct idx3 {
	unsigned x, y, z;
};

/* What a kernel thread sees of itself. */
struct thread_info {
	idx3 tid, bid, bdim, gdim;
};

const thread_info *cur();
unsigned char *smem();

/* Collectives: every lane of the warp (or thread of the block) must call the same one. */
enum wop { W_SHFL_XOR, W_SHFL_IDX, W_SYNC, W_LDSM, W_LDSM_T, W_MMA_F16, W_MMA_BF16 };
void warp_op(wop op, const void *in, size_t n, void *out, size_t outn);
int block_bar(int pred, int mode); /* mode 0: plain, 1: or, 2: and */

void cp_async(void *dst, const void *src, unsigned src_bytes);
void cp_commit();
void cp_wait(int n);

/* Kernels register themselves by name (APE_EMU_KERNEL below); the fake driver finds them. */
typedef void (*kernel_fn)(const void *params);
struct reg {
	reg(const char *name, kernel_fn fn, size_t param_bytes);
};

} /* namespace ape_emu */

#define threadIdx (ape_emu::cur()->tid)
#define blockIdx (ape_emu::cur()->bid)
#define blockDim (ape_emu::cur()->bdim)
#define gridDim (ape_emu::cur()->gdim)

#define APE_EMU_KERNEL(name, args_t)                                                               \
	static void name##_emu_entry(const void *p)                                                \
	{                                                                                          \
		name(*static_cast<const args_t *>(p));                                             \
	}                                                                                          \
	static ape_emu::reg name##_emu_reg(#name, name##_emu_entry, sizeof(args_t));

static inline float __int_as_float(int i)
{
	float f;

	memcpy(&f, &i, 4);
	return f;
}

static inline float __uint_as_float(unsigned u)
{
	float f;

	memcpy(&f, &u, 4);
	return f;
}

static inline unsigned __float_as_uint(float f)
{
	unsigned u;

	memcpy(&u, &f, 4);
	return u;
}

namespace ape {

using std::isfinite;
using std::isnan;

#define APE_DEV inline

APE_DEV unsigned char *smem_base()
{
	return ape_emu::smem();
}

APE_DEV void bar()
{
	ape_emu::block_bar(0, 0);
}

APE_DEV int bar_or(int pred)
{
	return ape_emu::block_bar(pred, 1);
}

APE_DEV float shfl_xor(float v, int m)
{
	float r;
	const int in[2] = { (int)__float_as_uint(v), m };

	ape_emu::warp_op(ape_emu::W_SHFL_XOR, in, sizeof(in), &r, sizeof(r));
	return r;
}

APE_DEV int shfl_xor(int v, int m)
{
	int r;
	const int in[2] = { v, m };

	ape_emu::warp_op(ape_emu::W_SHFL_XOR, in, sizeof(in), &r, sizeof(r));
	return r;
}

APE_DEV double shfl_xor(double v, int m)
{
	uint64_t u;
	uint32_t lo, hi;
	double r;

	memcpy(&u, &v, 8);
	lo = (uint32_t)(uint32_t)shfl_xor((int)(uint32_t)u, m);
	hi = (uint32_t)shfl_xor((int)(uint32_t)(u >> 32), m);
	u = (uint64_t)hi << 32 | lo;
	memcpy(&r, &u, 8);
	return r;
}

APE_DEV float shfl_idx(float v, int src)
{
	float r;
	const int in[2] = { (int)__float_as_uint(v), src };

	ape_emu::warp_op(ape_emu::W_SHFL_IDX, in, sizeof(in), &r, sizeof(r));
	return r;
}

APE_DEV void warp_sync()
{
	ape_emu::warp_op(ape_emu::W_SYNC, nullptr, 0, nullptr, 0);
}

APE_DEV void cp_async16(void *sdst, const void *gsrc, unsigned src_bytes)
{
	ape_emu::cp_async(sdst, gsrc, src_bytes);
}

APE_DEV void cp_commit()
{
	ape_emu::cp_commit();
}

template <int N> APE_DEV void cp_wait()
{
	ape_emu::cp_wait(N);
}

APE_DEV void ldsm_x4(uint32_t (&r)[4], const void *p)
{
	ape_emu::warp_op(ape_emu::W_LDSM, &p, sizeof(p), r, sizeof(r));
}

APE_DEV void ldsm_x4_trans(uint32_t (&r)[4], const void *p)
{
	ape_emu::warp_op(ape_emu::W_LDSM_T, &p, sizeof(p), r, sizeof(r));
}

template <int VT>
APE_DEV void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
	uint32_t in[10];

	memcpy(in, a, 16);
	in[4] = b0;
	in[5] = b1;
	memcpy(in + 6, c, 16);
	ape_emu::warp_op(VT == 1 ? ape_emu::W_MMA_F16 : ape_emu::W_MMA_BF16, in, sizeof(in), c,
			 sizeof(c));
}

/* ex2.approx.ftz: 2^x with subnormal results flushed to zero. */
APE_DEV float ex2_approx(float x)
{
	const float y = exp2f(x);

	return fabsf(y) < FLT_MIN ? 0.0f * y : y;
}

APE_DEV float h2f(uint16_t h)
{
	return ape__f16_to_f32(h);
}

APE_DEV float b2f(uint16_t h)
{
	return ape__bf16_to_f32(h);
}

APE_DEV uint16_t f2h(float x)
{
	return ape__f32_to_f16(x);
}

APE_DEV uint16_t f2b(float x)
{
	return ape__f32_to_bf16(x);
}

template <int VT> APE_DEV uint32_t pack2(float lo, float hi)
{
	if (VT == 1)
		return (uint32_t)f2h(lo) | (uint32_t)f2h(hi) << 16;
	return (uint32_t)f2b(lo) | (uint32_t)f2b(hi) << 16;
}

APE_DEV uint4 ldg16(const void *p)
{
	uint4 v;

	memcpy(&v, p, 16);
	return v;
}

APE_DEV void atomic_or_shared(int *p, int v)
{
	*p |= v; /* fibers of one block run one at a time */
}

} /* namespace ape */

#endif /* APE_CUDA_EMU_EMU_H */
