/* SPDX-License-Identifier: MIT */
/*
 * Host allocations of the library. Every malloc/calloc/realloc/posix_memalign in runtime/,
 * opencl/ and cuda/ goes through these, so that a test build can make any one of them fail and
 * prove that each failure path returns APE_ENOMEM, leaks nothing and leaves the caller's buffers
 * alone (tests/faults/). In normal builds they are the libc calls themselves, inlined: no counter,
 * no branch, nothing to pay.
 *
 * With -DAPE_FAULT_INJECT (only `make faults-ci` builds that way) they count every call,
 * process-wide and thread-safe, and the N-th one after ape__fault_alloc_arm(N) fails as libc
 * would (NULL, or ENOMEM from posix_memalign). Allocations made by drivers (PoCL, libcuda, hwloc
 * internals) are not ours and are not counted.
 */
#ifndef APE_RUNTIME_ALLOC_H
#define APE_RUNTIME_ALLOC_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC visibility push(hidden)

#ifdef APE_FAULT_INJECT
void *ape__malloc(size_t n);
void *ape__calloc(size_t n, size_t size);
void *ape__realloc(void *p, size_t n);
int ape__posix_memalign(void **p, size_t align, size_t n);
/* For allocators the library calls through another API (hwloc_alloc_membind): true when this
 * allocation is the one that must fail; it counts as one allocation. */
bool ape__fault_alloc_hit(void);

/* Test hooks. Allocations counted since the last arm (or since start). */
uint64_t ape__fault_alloc_count(void);
/* Restarts the count; the n-th allocation from now (1-based) fails, 0: none does. */
void ape__fault_alloc_arm(uint64_t n);
/* True once the armed allocation has been failed (a run may end before reaching it). */
bool ape__fault_alloc_fired(void);
#else
static inline void *ape__malloc(size_t n)
{
	return malloc(n);
}
static inline void *ape__calloc(size_t n, size_t size)
{
	return calloc(n, size);
}
static inline void *ape__realloc(void *p, size_t n)
{
	return realloc(p, n);
}
static inline int ape__posix_memalign(void **p, size_t align, size_t n)
{
	return posix_memalign(p, align, n);
}
static inline bool ape__fault_alloc_hit(void)
{
	return false;
}
#endif

/* A copy of the string s through ape__malloc() (counted like any allocation), or NULL. */
static inline char *ape__strdup(const char *s)
{
	const size_t n = strlen(s) + 1;
	char *d = ape__malloc(n);

	return d ? memcpy(d, s, n) : NULL;
}

#pragma GCC visibility pop
#endif /* APE_RUNTIME_ALLOC_H */
