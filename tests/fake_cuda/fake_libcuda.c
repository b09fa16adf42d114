/* SPDX-License-Identifier: MIT */
/*
 * A fake CUDA driver (libcuda.so.1) for tests on machines without a GPU, loaded by libape through
 * APE_CUDA_LIBRARY. Plain C, host compiler only; cuda.h gives the types.
 *
 * "Device memory" is host memory, every stream runs its commands when they are enqueued, events
 * hold the host clock. The driver checks what a real one would refuse: calls that need a current
 * context, device pointers outside any allocation, launches above the shared memory a function
 * was opened up to, grids beyond the hardware's limits, a module image that is not a fatbin.
 *
 * FAKE_CUDA_MODE (comma-separated) picks the behaviour:
 *   no-device         cuInit answers CUDA_ERROR_NO_DEVICE
 *   zero-devices      cuInit succeeds, cuDeviceGetCount gives 0
 *   old-driver        cuDriverGetVersion says 11.4
 *   init-fails        cuInit answers CUDA_ERROR_OPERATING_SYSTEM
 *   missing-optional  cuGetProcAddress finds none of the optional symbols (cuMemHostRegister,
 *                     cuMemHostUnregister, cuMemGetAddressRange, cuPointerGetAttribute,
 *                     cuStreamGetCtx)
 *   missing-required  cuGetProcAddress finds no cuLaunchKernel
 *   cc75              the device has compute capability 7.5
 *   two-devices       two devices, 0000:42:00.0 and 0000:43:00.0
 *   no-mempool        no memory pools (cuMemAllocAsync is not supported)
 *   fault             every kernel launch "faults": like a real driver after an illegal
 *                     address, every later call that needs the context (synchronisations,
 *                     copies, allocations, launches) answers CUDA_ERROR_ILLEGAL_ADDRESS
 * FAKE_CUDA_MEM: device memory in bytes (default 1 GiB); allocations beyond it fail with
 * CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Built with FAKE_CUDA_NO_PROCADDRESS it exports no cuGetProcAddress at all (a pre-11.3 driver);
 * with FAKE_CUDA_EMU it runs libape's kernels on the CPU through cuda/emu.
 *
 * Streams: the handles cuStreamCreate gave, NULL (the legacy default stream, as are
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD); any other handle is CUDA_ERROR_INVALID_HANDLE.
 * Every launch is logged (fake_cuda.h) with its stream, context and argument struct, and the
 * streams destroyed or synchronised are counted, so tests see what reached the driver.
 *
 * One shared object of three files: this one (the state, errors, init, devices,
 * cuGetProcAddress, the tests' calls), fake_memory.c and fake_launch.c; what they share is in
 * fake_state.h.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_state.h"

/* cuda.h renames these to their newest variants; this file defines the exact symbols. */
#undef cuGetProcAddress
#undef cuDriverGetVersion

/* the exported symbols cuda.h does not declare under these names */
FAKE_API const void *fake_cuda_table(void);
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);

/* ------------------------------------------------------------------ state */

struct fake_stream *streams[FAKE_MAX_STREAMS];
struct fake_stream_calls stream_calls[FAKE_MAX_STREAMS];
size_t nstream_calls;
struct fake_launch_rec launch_log[FAKE_LOG_MAX];
size_t nlaunches;

pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
struct fake_alloc *allocs;
size_t nallocs, capallocs, used_bytes;
static struct fake_ctx ctxs[2] = { { 0, 0 }, { 1, 0 } };
int initialised;
/* A fault corrupts the context: the error sticks to every later call, on every stream (the
 * CUDA driver's "sticky" errors), so a caller that waits on another stream still sees it. */
static CUresult sticky;
__thread struct fake_ctx *ctx_stack[16];
__thread int ctx_depth;

int mode(const char *m)
{
	const char *e = getenv("FAKE_CUDA_MODE");
	size_t n = strlen(m);

	for (const char *p = e ? strstr(e, m) : NULL; p; p = strstr(p + 1, m))
		if ((p == e || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
			return 1;
	return 0;
}

size_t device_memory(void)
{
	const char *e = getenv("FAKE_CUDA_MEM");

	return e && *e ? (size_t)strtoull(e, NULL, 0) : (size_t)1 << 30;
}

int ndevices(void)
{
	return mode("zero-devices") ? 0 : mode("two-devices") ? 2 : 1;
}

double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

CUresult sticky_error(void)
{
	CUresult r;

	pthread_mutex_lock(&lock);
	r = sticky;
	pthread_mutex_unlock(&lock);
	return r;
}

void set_sticky(CUresult r)
{
	pthread_mutex_lock(&lock);
	if (sticky == CUDA_SUCCESS)
		sticky = r;
	pthread_mutex_unlock(&lock);
}

CUresult have_ctx(void)
{
	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	return ctx_depth > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult need_ctx(void)
{
	CUresult r = have_ctx();

	return r ? r : sticky_error();
}

/* The allocation holding [p, p + n), or NULL. */
struct fake_alloc *find(uintptr_t p, size_t n, int host)
{
	struct fake_alloc *a = NULL;

	pthread_mutex_lock(&lock);
	for (size_t i = 0; i < nallocs; i++)
		if (allocs[i].pinned_host == host && p >= allocs[i].p &&
		    p + n <= allocs[i].p + allocs[i].n) {
			a = &allocs[i];
			break;
		}
	pthread_mutex_unlock(&lock);
	return a;
}

/* The allocation table outlives no one: libape closes the driver when its last context goes. */
__attribute__((destructor)) static void fake_unload(void)
{
	free(allocs);
	allocs = NULL;
	nallocs = capallocs = used_bytes = 0;
}

CUresult dev_range(CUdeviceptr p, size_t n)
{
	return find((uintptr_t)p, n, 0) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ errors, init, devices */

static const struct {
	CUresult r;
	const char *name, *text;
} errors[] = {
	{ CUDA_SUCCESS, "CUDA_SUCCESS", "no error" },
	{ CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
	{ CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory" },
	{ CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error" },
	{ CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
	{ CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal" },
	{ CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid" },
	{ CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context" },
	{ CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found" },
	{ CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
	  "an illegal memory access was encountered" },
	{ CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure" },
	{ CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported" },
	{ CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed" },
	{ CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle" },
};

static CUresult fk_cuGetErrorName(CUresult r, const char **s)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].r == r) {
			*s = errors[i].name;
			return CUDA_SUCCESS;
		}
	*s = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult fk_cuGetErrorString(CUresult r, const char **s)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].r == r) {
			*s = errors[i].text;
			return CUDA_SUCCESS;
		}
	*s = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult fk_cuInit(unsigned flags)
{
	(void)flags;
	if (mode("init-fails"))
		return CUDA_ERROR_OPERATING_SYSTEM;
	if (mode("no-device"))
		return CUDA_ERROR_NO_DEVICE;
	initialised = 1;
	return CUDA_SUCCESS;
}

FAKE_API CUresult cuDriverGetVersion(int *v)
{
	*v = mode("old-driver") ? 11040 : 13000;
	return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceGetCount(int *n)
{
	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	*n = ndevices();
	return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceGet(CUdevice *d, int ordinal)
{
	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ordinal < 0 || ordinal >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	*d = ordinal;
	return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceGetName(char *name, int len, CUdevice d)
{
	if (d < 0 || d >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	snprintf(name, (size_t)len, "libape fake GPU %d (tests/fake_cuda)", (int)d);
	return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
	if (d < 0 || d >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	switch (a) {
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
		*v = mode("cc75") ? 7 : 9;
		break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
		*v = mode("cc75") ? 5 : 0;
		break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
		*v = 4;
		break;
	case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
		*v = 227 * 1024;
		break;
	case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
		*v = !mode("no-mempool");
		break;
	case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
		*v = 0;
		break;
	case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
		*v = 0x42 + (int)d;
		break;
	case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
		*v = 0;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

static CUresult fk_cuDeviceTotalMem(size_t *bytes, CUdevice d)
{
	if (d < 0 || d >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	*bytes = device_memory();
	return CUDA_SUCCESS;
}

static CUresult fk_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (d < 0 || d >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&lock);
	ctxs[d].refs++;
	pthread_mutex_unlock(&lock);
	*c = (CUcontext)&ctxs[d];
	return CUDA_SUCCESS;
}

static CUresult fk_cuDevicePrimaryCtxRelease(CUdevice d)
{
	CUresult r = CUDA_SUCCESS;

	if (d < 0 || d >= ndevices())
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&lock);
	if (ctxs[d].refs <= 0)
		r = CUDA_ERROR_INVALID_CONTEXT;
	else
		ctxs[d].refs--;
	pthread_mutex_unlock(&lock);
	return r;
}

static CUresult fk_cuCtxPushCurrent(CUcontext c)
{
	struct fake_ctx *fc = (struct fake_ctx *)c;

	if (fc != &ctxs[0] && fc != &ctxs[1])
		return CUDA_ERROR_INVALID_CONTEXT;
	if (fc->refs <= 0 || ctx_depth == 16)
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_stack[ctx_depth++] = fc;
	return CUDA_SUCCESS;
}

static CUresult fk_cuCtxPopCurrent(CUcontext *c)
{
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_depth--;
	if (c)
		*c = (CUcontext)ctx_stack[ctx_depth];
	return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ cuGetProcAddress */

#define FK(name) { #name, (void *)fk_##name }
static const struct {
	const char *name;
	void *fn;
} table[] = {
	FK(cuGetErrorName),
	FK(cuGetErrorString),
	FK(cuInit),
	{ "cuDriverGetVersion", (void *)cuDriverGetVersion },
	FK(cuDeviceGetCount),
	FK(cuDeviceGet),
	FK(cuDeviceGetName),
	FK(cuDeviceGetAttribute),
	FK(cuDeviceTotalMem),
	FK(cuDevicePrimaryCtxRetain),
	FK(cuDevicePrimaryCtxRelease),
	FK(cuCtxPushCurrent),
	FK(cuCtxPopCurrent),
	FK(cuMemGetInfo),
	FK(cuMemAlloc),
	FK(cuMemFree),
	FK(cuMemAllocAsync),
	FK(cuMemFreeAsync),
	FK(cuMemcpyHtoDAsync),
	FK(cuMemcpyDtoHAsync),
	FK(cuMemcpyDtoDAsync),
	FK(cuMemsetD32Async),
	FK(cuStreamCreate),
	FK(cuStreamDestroy),
	FK(cuStreamSynchronize),
	FK(cuStreamWaitEvent),
	FK(cuEventCreate),
	FK(cuEventRecord),
	FK(cuEventSynchronize),
	FK(cuEventElapsedTime),
	FK(cuEventDestroy),
	FK(cuModuleLoadData),
	FK(cuModuleUnload),
	FK(cuModuleGetFunction),
	FK(cuFuncSetAttribute),
	FK(cuFuncGetAttribute),
	FK(cuLaunchKernel),
	FK(cuLaunchHostFunc),
	FK(cuMemHostRegister),
	FK(cuMemHostUnregister),
	FK(cuMemGetAddressRange),
	FK(cuPointerGetAttribute),
	FK(cuStreamGetCtx),
};

/* ------------------------------------------------------------------ for tests (fake_cuda.h) */

FAKE_API const struct fake_launch_rec *fake_cuda_log(size_t *n);
FAKE_API void fake_cuda_log_clear(void);
FAKE_API int fake_cuda_stream_calls(CUstream s, int *destroyed, int *synchronised);

/* The latest launches, oldest first: the ring is rotated in place so that the array reads in
 * order (the caller reads it before the next launch). */
FAKE_API const struct fake_launch_rec *fake_cuda_log(size_t *n)
{
	static struct fake_launch_rec ordered[FAKE_LOG_MAX];

	pthread_mutex_lock(&lock);
	*n = nlaunches < FAKE_LOG_MAX ? nlaunches : FAKE_LOG_MAX;
	for (size_t i = 0; i < *n; i++)
		ordered[i] = launch_log[(nlaunches - *n + i) % FAKE_LOG_MAX];
	pthread_mutex_unlock(&lock);
	return ordered;
}

FAKE_API void fake_cuda_log_clear(void)
{
	pthread_mutex_lock(&lock);
	nlaunches = 0;
	nstream_calls = 0;
	pthread_mutex_unlock(&lock);
}

FAKE_API int fake_cuda_stream_calls(CUstream s, int *destroyed, int *synchronised)
{
	int found = 0;

	pthread_mutex_lock(&lock);
	*destroyed = *synchronised = 0;
	for (size_t i = 0; i < nstream_calls; i++)
		if (stream_calls[i].s == s) {
			*destroyed = stream_calls[i].destroyed;
			*synchronised = stream_calls[i].synchronised;
			found = 1;
		}
	pthread_mutex_unlock(&lock);
	return found;
}

/* For tests that want to call the fake directly. */
FAKE_API const void *fake_cuda_table(void)
{
	return table;
}

#ifndef FAKE_CUDA_NO_PROCADDRESS
static CUresult lookup(const char *name, void **pfn, int version)
{
	*pfn = NULL;
	if (version < 2000)
		return CUDA_ERROR_INVALID_VALUE;
	if (mode("missing-optional") &&
	    (!strcmp(name, "cuMemHostRegister") || !strcmp(name, "cuMemHostUnregister") ||
	     !strcmp(name, "cuMemGetAddressRange") || !strcmp(name, "cuPointerGetAttribute") ||
	     !strcmp(name, "cuStreamGetCtx")))
		return CUDA_ERROR_NOT_FOUND;
	if (mode("missing-required") && !strcmp(name, "cuLaunchKernel"))
		return CUDA_ERROR_NOT_FOUND;
	for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
		if (!strcmp(table[i].name, name)) {
			*pfn = table[i].fn;
			return CUDA_SUCCESS;
		}
	return CUDA_ERROR_NOT_FOUND;
}

FAKE_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
				      cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	CUresult r;

	(void)flags;
	r = lookup(symbol, pfn, version);
	if (status)
		*status = r == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS
					    : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	/* like the real driver: CUDA_ERROR_NOT_FOUND, and the status saying which kind */
	return r;
}

FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
	(void)flags;
	return lookup(symbol, pfn, version);
}
#endif
