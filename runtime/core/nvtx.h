/* SPDX-License-Identifier: MIT */
/*
 * NVTX v3 ranges (docs/profiling.md): around every public call (core/verbose.c) and every
 * kernel launch (core/ops.c), in the "libape" domain, when the build found the nvtx3 headers
 * (WITH_NVTX=auto, APE_WITH_NVTX defined); empty inline functions otherwise. Header-only and
 * free until a tool (Nsight Systems, or a library named by NVTX_INJECTION64_PATH) attaches.
 */
#ifndef APE_RUNTIME_NVTX_H
#define APE_RUNTIME_NVTX_H

#pragma GCC visibility push(hidden)

#if defined(APE_WITH_NVTX)
/* Opens a range on this thread's stack in the "libape" domain; name: a string that outlives
 * the call (the names are literals). Every push has its pop on the same thread. */
void ape__nvtx_push(const char *name);
/* Closes this thread's innermost libape range. */
void ape__nvtx_pop(void);
#else
static inline void ape__nvtx_push(const char *name)
{
	(void)name;
}

static inline void ape__nvtx_pop(void)
{
}
#endif

#pragma GCC visibility pop
#endif
