/* SPDX-License-Identifier: MIT */
#include "core/half.h"

#include "core/error.h"

float ape__f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t man = h & 0x3ffu;
	uint32_t u;
	float f;

	if (exp == 0x1f) {
		u = sign | 0x7f800000u | (man << 13); /* Inf, or NaN with its payload */
	} else if (exp != 0) {
		u = sign | ((exp + 112) << 23) | (man << 13);
	} else if (man == 0) {
		u = sign;
	} else {
		/* subnormal half: every one is a normal float, so normalise exactly */
		int e = -1;

		do {
			man <<= 1;
			e++;
		} while (!(man & 0x400u));
		u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
	}
	memcpy(&f, &u, sizeof(f));
	return f;
}

uint16_t ape__f32_to_f16(float f)
{
	uint32_t u, sign, mag;

	memcpy(&u, &f, sizeof(u));
	sign = (u >> 16) & 0x8000u;
	mag = u & 0x7fffffffu;
	if (mag > 0x7f800000u)
		return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x3ffu)); /* NaN stays NaN */
	if (mag >= 0x477ff000u) /* rounds to >= 65520: overflow to Inf */
		return (uint16_t)(sign | 0x7c00u);
	if (mag >= 0x38800000u) { /* normal half */
		uint32_t r = mag - 0x38000000u; /* rebias exponent 127 -> 15 */

		r += 0xfffu + ((r >> 13) & 1u);
		return (uint16_t)(sign | (r >> 13));
	}
	if (mag < 0x33000000u) /* below half the smallest subnormal: rounds to zero */
		return (uint16_t)sign;
	{
		/* subnormal half: shift the full significand and round to nearest even */
		uint32_t e = mag >> 23;
		uint32_t m = (mag & 0x7fffffu) | 0x800000u;
		uint32_t shift = 126 - e; /* 14..24 */
		uint32_t q = m >> shift;
		uint32_t rem = m & ((1u << shift) - 1);
		uint32_t half = 1u << (shift - 1);

		if (rem > half || (rem == half && (q & 1u)))
			q++;
		return (uint16_t)(sign | q);
	}
}

size_t ape_dtype_size(ape_dtype dt)
{
	switch (dt) {
	case APE_F32:
		return 4;
	case APE_F16:
	case APE_BF16:
		return 2;
	}
	return 0;
}

static float load_f32(const void *src, ape_dtype t, size_t i)
{
	const uint16_t *s16 = src;

	switch (t) {
	case APE_F16:
		return ape__f16_to_f32(s16[i]);
	case APE_BF16:
		return ape__bf16_to_f32(s16[i]);
	case APE_F32:
		break;
	}
	return ((const float *)src)[i];
}

static void store_f32(void *dst, ape_dtype t, size_t i, float x)
{
	uint16_t *d16 = dst;

	switch (t) {
	case APE_F16:
		d16[i] = ape__f32_to_f16(x);
		return;
	case APE_BF16:
		d16[i] = ape__f32_to_bf16(x);
		return;
	case APE_F32:
		break;
	}
	((float *)dst)[i] = x;
}

int ape_convert(void *dst, ape_dtype dst_type, const void *src, ape_dtype src_type, size_t n)
{
	if (!ape_dtype_size(dst_type))
		return ape__error(APE_EINVAL, "ape_convert: dst_type = %d: not a libape type",
				  (int)dst_type);
	if (!ape_dtype_size(src_type))
		return ape__error(APE_EINVAL, "ape_convert: src_type = %d: not a libape type",
				  (int)src_type);
	if (n && !dst)
		return ape__error(APE_EINVAL, "ape_convert: dst = NULL with n = %zu", n);
	if (n && !src)
		return ape__error(APE_EINVAL, "ape_convert: src = NULL with n = %zu", n);
	if (dst_type == src_type) {
		if (dst != src)
			memmove(dst, src, n * ape_dtype_size(dst_type));
		return 0;
	}
	/* Every f16 and bf16 value is exactly a float, so going through float rounds only once. */
	for (size_t i = 0; i < n; i++)
		store_f32(dst, dst_type, i, load_f32(src, src_type, i));
	return 0;
}
