/* SPDX-License-Identifier: MIT */
/* Exact 16-bit float decoding and round-to-nearest-even encoding, shared by the reference backend,
 * the packing code and the tools. */
#ifndef APE_RUNTIME_HALF_H
#define APE_RUNTIME_HALF_H

#include <stdint.h>
#include <string.h>

#pragma GCC visibility push(hidden)

float ape__f16_to_f32(uint16_t h);
uint16_t ape__f32_to_f16(float f);

static inline float ape__bf16_to_f32(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline uint16_t ape__f32_to_bf16(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u); /* keep NaN a NaN: set a mantissa bit */
	u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
	return (uint16_t)(u >> 16);
}

#pragma GCC visibility pop
#endif
