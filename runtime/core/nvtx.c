/* SPDX-License-Identifier: MIT */
/*
 * NVTX v3 ranges (core/nvtx.h; docs/profiling.md, "NVTX ranges"), built when the nvtx3 headers
 * were found (WITH_NVTX=auto|yes defines APE_WITH_NVTX). The headers are the implementation:
 * each call is an inline check of a function pointer that stays NULL until a tool attaches
 * (the first NVTX call looks for NVTX_INJECTION64_PATH once, in a thread-safe init of its own),
 * so without a tool a range costs a load and a branch and nothing here adds to it. Every range
 * is pushed in the "libape" domain with an ASCII message, the name as given (a string literal:
 * NVTX copies nothing, the tool reads it during the push).
 */
#include "core/nvtx.h"

#if defined(APE_WITH_NVTX)

#include <pthread.h>

#include <nvtx3/nvToolsExt.h>

static pthread_once_t domain_once = PTHREAD_ONCE_INIT;
/* NULL without a tool (nvtxDomainCreateA then returns NULL), which NVTX reads as its default
 * domain: no push reaches a tool then anyway. */
static nvtxDomainHandle_t domain;

/* Once for the process: NVTX does not promise one handle per name over several calls.
 * (pthread_once, not C11 call_once: ThreadSanitizer sees the order pthread_once makes, which
 * glibc's call_once gives through an inner function it does not intercept.) */
static void create_domain(void)
{
	domain = nvtxDomainCreateA("libape");
}

void ape__nvtx_push(const char *name)
{
	nvtxEventAttributes_t a = { 0 };

	pthread_once(&domain_once, create_domain);
	a.version = NVTX_VERSION;
	a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
	a.messageType = NVTX_MESSAGE_TYPE_ASCII;
	a.message.ascii = name;
	nvtxDomainRangePushEx(domain, &a);
}

/* The thread's own push came first: its pthread_once has run, and domain is set for it. */
void ape__nvtx_pop(void)
{
	nvtxDomainRangePop(domain);
}

#else

/* ISO C wants something in a translation unit. */
typedef int ape__nvtx_unused;

#endif
