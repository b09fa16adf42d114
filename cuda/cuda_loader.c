/* SPDX-License-Identifier: MIT */
/*
 * Loading the CUDA driver at run time.
 *
 * dlopen("libcuda.so.1") (or the file APE_CUDA_LIBRARY names: unusual installs, and the tests'
 * fake drivers), then cuGetProcAddress_v2 (CUDA 12.0; cuGetProcAddress, CUDA 11.3, on older
 * drivers) resolves every entry point of cuda_syms.h at the version its signature was written
 * for. A machine without the driver, a driver too old for the embedded kernels, or the toolkit's
 * link stub (whose every function answers CUDA_ERROR_STUB_LIBRARY) each give a reason the
 * context reports; nothing here aborts.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cu.h"

#define DEFAULT_LIBRARY "libcuda.so.1"

typedef CUresult (*gpa2_fn)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
			    CUdriverProcAddressQueryResult *status);
typedef CUresult (*gpa1_fn)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
typedef CUresult (*version_fn)(int *v);

void ape__cu_version_string(int version, char *buf, size_t cap)
{
	if (version % 10)
		snprintf(buf, cap, "%d.%d.%d", version / 1000, version % 1000 / 10, version % 10);
	else
		snprintf(buf, cap, "%d.%d", version / 1000, version % 1000 / 10);
}

struct resolver {
	gpa2_fn gpa2;
	gpa1_fn gpa1;
};

static CUresult resolve(const struct resolver *r, const char *name, int version, void **pfn)
{
	CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SUCCESS;
	CUresult res;

	*pfn = NULL;
	if (r->gpa2)
		res = r->gpa2(name, pfn, version, CU_GET_PROC_ADDRESS_DEFAULT, &st);
	else
		res = r->gpa1(name, pfn, version, CU_GET_PROC_ADDRESS_DEFAULT);
	if (res == CUDA_SUCCESS && (st != CU_GET_PROC_ADDRESS_SUCCESS || !*pfn))
		res = CUDA_ERROR_NOT_FOUND;
	return res;
}

/* The toolkit's stub answers every call with CUDA_ERROR_STUB_LIBRARY: say what it is. */
static void stub_reason(const char *path, char *why, size_t cap)
{
	snprintf(why, cap,
		 "%s is the CUDA toolkit's link stub (CUDA_ERROR_STUB_LIBRARY), not a driver: "
		 "install the NVIDIA driver, or point APE_CUDA_LIBRARY at its libcuda.so.1",
		 path);
}

int ape__cu_driver_load(struct ape__cu_driver *drv, char *why, size_t cap)
{
	const char *env = getenv("APE_CUDA_LIBRARY");
	const char *path = env && *env ? env : DEFAULT_LIBRARY;
	struct resolver r = { NULL, NULL };
	char vbuf[16], need[16];
	version_fn getver;
	CUresult res;
	void *p;

	memset(drv, 0, sizeof(*drv));
	snprintf(drv->path, sizeof(drv->path), "%s", path);
	drv->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!drv->lib) {
		const char *e = dlerror();

		if (env && *env)
			snprintf(why, cap, "APE_CUDA_LIBRARY=%s: cannot load it: %s", path,
				 e ? e : "unknown error");
		else if (!e || strstr(e, "No such file or directory"))
			snprintf(why, cap,
				 DEFAULT_LIBRARY " not found (no NVIDIA driver installed here)");
		else /* there, but broken: a wrong architecture, a missing dependency */
			snprintf(why, cap, DEFAULT_LIBRARY " cannot be loaded: %s", e);
		return -1;
	}

	r.gpa2 = (gpa2_fn)dlsym(drv->lib, "cuGetProcAddress_v2");
	if (!r.gpa2)
		r.gpa1 = (gpa1_fn)dlsym(drv->lib, "cuGetProcAddress");
	getver = (version_fn)dlsym(drv->lib, "cuDriverGetVersion");
	if (getver) {
		res = getver(&drv->version);
		if (res == CUDA_ERROR_STUB_LIBRARY) {
			stub_reason(path, why, cap);
			goto out_close;
		}
		if (res != CUDA_SUCCESS)
			drv->version = 0;
	}
	ape__cu_version_string(drv->version, vbuf, sizeof(vbuf));
	ape__cu_version_string(APE_CU_DRIVER_MIN, need, sizeof(need));
	if (!r.gpa2 && !r.gpa1) {
		snprintf(why, cap,
			 "driver too old: %s has no cuGetProcAddress (CUDA %s; libape needs %s)",
			 path, drv->version ? vbuf : "older than 11.3", need);
		goto out_close;
	}
	if (drv->version && drv->version < APE_CU_DRIVER_MIN) {
		snprintf(why, cap, "driver too old: CUDA %s (%s), libape needs %s or newer", vbuf,
			 path, need);
		goto out_close;
	}

#define APE_CU_RESOLVE(name, ver, req, params)                                                     \
	res = resolve(&r, #name, ver, &p);                                                         \
	if (res == CUDA_ERROR_STUB_LIBRARY) {                                                      \
		stub_reason(path, why, cap);                                                       \
		goto out_close;                                                                    \
	}                                                                                          \
	if (res != CUDA_SUCCESS && req) {                                                          \
		snprintf(why, cap, "%s (driver %s) lacks %s (CUDA %d.%d ABI)", path, vbuf, #name,  \
			 ver / 1000, ver % 1000 / 10);                                             \
		goto out_close;                                                                    \
	}                                                                                          \
	if (res != CUDA_SUCCESS) {                                                                 \
		size_t used = strlen(drv->missing_optional);                                       \
		snprintf(drv->missing_optional + used, sizeof(drv->missing_optional) - used,       \
			 "%s%s", used ? ", " : "", #name);                                         \
	}                                                                                          \
	memcpy(&drv->p_##name, &p, sizeof(p));
	APE_CUDA_SYMBOLS(APE_CU_RESOLVE)
#undef APE_CU_RESOLVE

	drv->pinning = drv->p_cuMemHostRegister && drv->p_cuMemHostUnregister;
	if (!drv->version) {
		res = drv->p_cuDriverGetVersion(&drv->version);
		if (res != CUDA_SUCCESS || drv->version < APE_CU_DRIVER_MIN) {
			ape__cu_version_string(drv->version, vbuf, sizeof(vbuf));
			snprintf(why, cap, "driver too old: CUDA %s (%s), libape needs %s or newer",
				 res == CUDA_SUCCESS ? vbuf : "unknown", path, need);
			goto out_close;
		}
	}
	return 0;

out_close:
	dlclose(drv->lib);
	memset(drv, 0, sizeof(*drv));
	return -1;
}

void ape__cu_driver_unload(struct ape__cu_driver *drv)
{
	if (drv->lib)
		dlclose(drv->lib);
	memset(drv, 0, sizeof(*drv));
}
