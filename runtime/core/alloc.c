/* SPDX-License-Identifier: MIT */
/* The counting allocators of fault-injection builds (see alloc.h); empty otherwise. */
#include "core/alloc.h"

#ifdef APE_FAULT_INJECT
#include <errno.h>
#include <execinfo.h>
#include <stdatomic.h>
#include <unistd.h>

/* Process-wide on purpose: the worker threads of a multi-device call allocate too, and "the
 * N-th allocation of the call" must count theirs. */
static atomic_uint_fast64_t count, fail_at;
static atomic_bool fired;

bool ape__fault_alloc_hit(void)
{
	uint64_t n = atomic_fetch_add(&count, 1) + 1;

	if (n != atomic_load(&fail_at))
		return false;
	atomic_store(&fired, true);
	if (getenv("APE_FAULT_BACKTRACE")) { /* which allocation a failing test broke */
		void *pc[32];

		backtrace_symbols_fd(pc, backtrace(pc, 32), STDERR_FILENO);
	}
	return true;
}

uint64_t ape__fault_alloc_count(void)
{
	return atomic_load(&count);
}

void ape__fault_alloc_arm(uint64_t n)
{
	atomic_store(&fail_at, 0);
	atomic_store(&count, 0);
	atomic_store(&fired, false);
	atomic_store(&fail_at, n);
}

bool ape__fault_alloc_fired(void)
{
	return atomic_load(&fired);
}

void *ape__malloc(size_t n)
{
	return ape__fault_alloc_hit() ? NULL : malloc(n);
}

void *ape__calloc(size_t n, size_t size)
{
	return ape__fault_alloc_hit() ? NULL : calloc(n, size);
}

void *ape__realloc(void *p, size_t n)
{
	return ape__fault_alloc_hit() ? NULL : realloc(p, n); /* p stays valid, as with libc */
}

int ape__posix_memalign(void **p, size_t align, size_t n)
{
	return ape__fault_alloc_hit() ? ENOMEM : posix_memalign(p, align, n);
}
#else
typedef int ape__alloc_unused; /* ISO C forbids an empty translation unit */
#endif
