/* SPDX-License-Identifier: MIT */
/*
 * Opens the OpenCL ICD loader (libOpenCL.so.1) at run time; see ocl_api.h. Loaded once per
 * process and never closed: drivers the ICD loader opened may have threads running.
 */
#define APE__OCL_LOADER
#include "ocl_api.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#define OCL_LIBRARY "libOpenCL.so.1"

struct ape__ocl_api ape__ocl;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static char load_failure[256]; /* "" once loaded */

static void ocl_load_once(void)
{
	void *lib = dlopen(OCL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
	const char *e, *missing = NULL;

	if (!lib) {
		e = dlerror();
		snprintf(load_failure, sizeof(load_failure),
			 "cannot load " OCL_LIBRARY ", the ICD loader (%.100s): install "
			 "ocl-icd-libopencl1", e ? e : "unknown error");
		return;
	}
	/* an ICD loader older than OpenCL 1.2 lacks some: then it is as good as absent */
#define APE__OCL_RESOLVE(f)                                                                        \
	if (!missing && !(ape__ocl.f = (__typeof__(ape__ocl.f))dlsym(lib, #f)))                    \
		missing = #f;
	APE__OCL_ENTRY_POINTS(APE__OCL_RESOLVE)
#undef APE__OCL_RESOLVE
	if (missing)
		snprintf(load_failure, sizeof(load_failure),
			 OCL_LIBRARY " lacks %s: an ICD loader for OpenCL 1.2 or later is needed",
			 missing);
}

int ape__ocl_load(char *why, size_t cap)
{
	pthread_once(&load_once, ocl_load_once);
	if (!load_failure[0])
		return 0;
	snprintf(why, cap, "%s", load_failure);
	return -1;
}
