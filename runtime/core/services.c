/* SPDX-License-Identifier: MIT */
/*
 * The services libape exports to its backends (include/ape/ape_backend.h, "Services"): what the
 * built-in backends used to reach in core/ privately (counted host allocation, 16-bit
 * conversions, the clock, the compiled-program cache), now the same calls for them and for a
 * plugin. Each is a thin door onto the core's own implementation.
 */
#include "ape/ape_backend.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/half.h"
#include "core/progcache.h"

void *ape_be_malloc(size_t n)
{
	return ape__malloc(n);
}

void *ape_be_calloc(size_t n, size_t size)
{
	return ape__calloc(n, size);
}

void *ape_be_realloc(void *p, size_t n)
{
	return ape__realloc(p, n);
}

int ape_be_posix_memalign(void **p, size_t align, size_t n)
{
	return ape__posix_memalign(p, align, n);
}

void ape_be_free(void *p)
{
	free(p);
}

float ape_be_f16_to_f32(uint16_t h)
{
	return ape__f16_to_f32(h);
}

uint16_t ape_be_f32_to_f16(float f)
{
	return ape__f32_to_f16(f);
}

float ape_be_bf16_to_f32(uint16_t b)
{
	return ape__bf16_to_f32(b);
}

uint16_t ape_be_f32_to_bf16(float f)
{
	return ape__f32_to_bf16(f);
}

double ape_be_now_ms(void)
{
	return ape__now_ms();
}

uint64_t ape_be_hash64(const void *p, size_t n, uint64_t h)
{
	return ape__fnv1a64(p, n, h);
}

int ape_be_cache_load(const char *key, void **blob, size_t *len)
{
	switch (ape__progcache_load(key, blob, len)) {
	case APE__CACHE_HIT:
		return APE_BE_CACHE_HIT;
	case APE__CACHE_CORRUPT:
	case APE__CACHE_UNTRUSTED:
		return APE_BE_CACHE_REJECTED;
	default:
		return APE_BE_CACHE_MISS;
	}
}

int ape_be_cache_store(const char *key, const void *blob, size_t len)
{
	return ape__progcache_store(key, blob, len);
}

bool ape_be_cache_usable(void)
{
	return ape__progcache_usable() == 0;
}

void ape_be_cache_touch(const char *key)
{
	ape__progcache_touch(key);
}

bool ape_be_cache_used(const char *key, struct timespec *when)
{
	return ape__progcache_used(key, when) == 0;
}
