/* SPDX-License-Identifier: MIT */
/* ape-mpi-run --suite (mpi/driver/driver.h): a case's defaults, the built-in cases and the
 * random ones. */
#include "common/seed.h"
#include "driver.h"

struct cfg driver_base(uint64_t seed)
{
	return (struct cfg){ .L = 50, .B = 1, .H = 2, .Hkv = 2, .D = 16, .dt = APE_F32,
			     .odt = APE_F32, .causal = true, .delta = SEED_DELTA, .beta = SEED_BETA,
			     .gamma = SEED_GAMMA, .lambda = SEED_LAMBDA, .skip_tol = 0x1p-24,
			     .check = true, .seed = seed, .ndev = 1 };
}

/* The cases every rank count runs: each feature of the issue at least once. */
int driver_builtin(uint64_t seed, struct cfg *out)
{
	struct cfg c;
	int n = 0;

#define ADD(...)                                                                                   \
	do {                                                                                       \
		c = driver_base(seed + n);                                                         \
		__VA_ARGS__;                                                                       \
		out[n++] = c;                                                                      \
	} while (0)
	ADD(c.what = "contiguous-causal", c.L = 53);
	ADD(c.what = "zigzag-causal-gqa", c.kind = APE_MPI_SHARD_ZIGZAG, c.H = 4, c.Hkv = 2, c.L = 61);
	ADD(c.what = "contiguous-noncausal-f16", c.causal = false, c.dt = c.odt = APE_F16, c.L = 45,
	    c.Hkv = 1);
	ADD(c.what = "zigzag-noncausal-bf16", c.kind = APE_MPI_SHARD_ZIGZAG, c.causal = false,
	    c.dt = c.odt = APE_BF16, c.L = 47, c.D = 8);
	ADD(c.what = "f16-out-f32-strided", c.kind = APE_MPI_SHARD_ZIGZAG, c.dt = APE_F16,
	    c.strided = true, c.B = 2, c.L = 38);
	ADD(c.what = "ranks-without-rows", c.L = 2);
	ADD(c.what = "zigzag-blocks-without-rows", c.kind = APE_MPI_SHARD_ZIGZAG, c.L = 5);
	ADD(c.what = "empty", c.L = 0);
	ADD(c.what = "offsets", c.kind = APE_MPI_SHARD_ZIGZAG, c.q_start_set = true,
	    c.q_start = 1000, c.k_start = 990, c.L = 43);
	ADD(c.what = "queries-before-keys", c.q_start_set = true, c.q_start = -5, c.L = 40);
	ADD(c.what = "shift-2^40", c.kind = APE_MPI_SHARD_ZIGZAG, c.q_start_set = true,
	    c.q_start = (int64_t)1 << 40, c.k_start = (int64_t)1 << 40, c.L = 37);
	ADD(c.what = "noncausal-offsets", c.causal = false, c.q_start_set = true, c.q_start = 7,
	    c.k_start = -3, c.L = 41, c.dt = c.odt = APE_F16);
	ADD(c.what = "zero-decay", c.delta = c.beta = c.gamma = c.lambda = 0, c.L = 44);
	ADD(c.what = "negative-decay", c.delta = -0.05, c.kind = APE_MPI_SHARD_ZIGZAG, c.L = 44);
	ADD(c.what = "strong-decay-per-head", c.delta = 2, c.beta = 0.2, c.gamma = 0.2,
	    c.per_head = true, c.H = 3, c.Hkv = 1, c.L = 257, c.kind = APE_MPI_SHARD_ZIGZAG);
	ADD(c.what = "strong-decay-noncausal", c.delta = 1.5, c.causal = false, c.L = 203);
	ADD(c.what = "skip_tol-0", c.skip_tol = 0, c.delta = 2, c.L = 60);
#undef ADD
	return n;
}

struct cfg driver_random_case(uint64_t seed, int i)
{
	uint64_t x = driver_mix(seed * 7919 + (uint64_t)i);
	struct cfg c = driver_base(seed + 1000 + (uint64_t)i);
	static const int64_t hs[][2] = { { 1, 1 }, { 2, 1 }, { 4, 2 }, { 3, 3 } };
	int hi = (int)(x % 4);

	x = driver_mix(x);
	c.what = "random";
	c.L = (int64_t)(x % 90);
	c.H = hs[hi][0];
	c.Hkv = hs[hi][1];
	c.D = 2 * (int64_t)(1 + (x >> 8) % 12);
	c.dt = (ape_dtype)((x >> 16) % 3);
	c.odt = (x >> 20) % 4 == 0 ? APE_F32 : c.dt;
	c.kind = (ape_mpi_shard_kind)((x >> 24) % 2);
	c.causal = (x >> 25) % 3 != 0;
	c.strided = (x >> 27) % 4 == 0;
	c.per_head = (x >> 29) % 3 == 0;
	c.delta = ((x >> 32) % 5) * 0.4;
	c.beta = c.gamma = c.delta / 10;
	c.lambda = ((x >> 36) % 3) * 0.1;
	if ((x >> 40) % 3 == 0) {
		c.q_start_set = true;
		c.q_start = (int64_t)((x >> 44) % 21) - 10;
	}
	c.k_start = (int64_t)((x >> 50) % 11) - 5;
	return c;
}
