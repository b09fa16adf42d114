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
 */
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_cuda.h"
#include "kernels/args.h"

#ifdef FAKE_CUDA_EMU
#include "emu_api.h"
#endif

/* cuda.h renames these to their newest variants; this file defines the exact symbols. */
#undef cuGetProcAddress
#undef cuDriverGetVersion

#define FAKE_API __attribute__((visibility("default")))

/* the exported symbols cuda.h does not declare under these names */
FAKE_API const void *fake_cuda_table(void);
FAKE_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);

/* ------------------------------------------------------------------ state */

struct fake_ctx {
	int ordinal;
	int refs;
};

struct fake_alloc {
	uintptr_t p;
	size_t n;
	int pinned_host;
	int ordinal; /* the device of the context it was allocated in */
};

struct fake_func {
	char name[64];
	void *emu; /* the emulated kernel */
	int max_dyn_smem;
};

#define FAKE_MAX_FUNCS 64

struct fake_module {
	struct fake_func funcs[FAKE_MAX_FUNCS]; /* handles point in here: never moved */
	int nfuncs;
};

struct fake_stream {
	int launches; /* a handle of its own; counted for no one but a debugger */
	struct fake_ctx *ctx; /* the context current at its creation */
};

/* every stream created and not destroyed, and the calls on streams tests ask about */
#define FAKE_MAX_STREAMS 256
static struct fake_stream *streams[FAKE_MAX_STREAMS];
static struct {
	CUstream s;
	int destroyed, synchronised;
} stream_calls[FAKE_MAX_STREAMS];
static size_t nstream_calls;
static struct fake_launch_rec launch_log[FAKE_LOG_MAX];
static size_t nlaunches; /* since the last clear; launch_log holds the latest FAKE_LOG_MAX */

static CUresult check_stream(CUstream s);

struct fake_event {
	double ms;
	int recorded;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_alloc *allocs;
static size_t nallocs, capallocs, used_bytes;
static struct fake_ctx ctxs[2] = { { 0, 0 }, { 1, 0 } };
static int initialised;
/* A fault corrupts the context: the error sticks to every later call, on every stream (the
 * CUDA driver's "sticky" errors), so a caller that waits on another stream still sees it. */
static CUresult sticky;
static __thread struct fake_ctx *ctx_stack[16];
static __thread int ctx_depth;

static int mode(const char *m)
{
	const char *e = getenv("FAKE_CUDA_MODE");
	size_t n = strlen(m);

	for (const char *p = e ? strstr(e, m) : NULL; p; p = strstr(p + 1, m))
		if ((p == e || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
			return 1;
	return 0;
}

static size_t device_memory(void)
{
	const char *e = getenv("FAKE_CUDA_MEM");

	return e && *e ? (size_t)strtoull(e, NULL, 0) : (size_t)1 << 30;
}

static int ndevices(void)
{
	return mode("zero-devices") ? 0 : mode("two-devices") ? 2 : 1;
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static CUresult sticky_error(void)
{
	CUresult r;

	pthread_mutex_lock(&lock);
	r = sticky;
	pthread_mutex_unlock(&lock);
	return r;
}

static void set_sticky(CUresult r)
{
	pthread_mutex_lock(&lock);
	if (sticky == CUDA_SUCCESS)
		sticky = r;
	pthread_mutex_unlock(&lock);
}

static CUresult have_ctx(void)
{
	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	return ctx_depth > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult need_ctx(void)
{
	CUresult r = have_ctx();

	return r ? r : sticky_error();
}

/* The allocation holding [p, p + n), or NULL. */
static struct fake_alloc *find(uintptr_t p, size_t n, int host)
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

static CUresult dev_range(CUdeviceptr p, size_t n)
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

/* ------------------------------------------------------------------ memory */

static CUresult add_alloc(uintptr_t p, size_t n, int host)
{
	pthread_mutex_lock(&lock);
	if (nallocs == capallocs) {
		size_t cap = capallocs ? 2 * capallocs : 64;
		struct fake_alloc *a = realloc(allocs, cap * sizeof(*a));

		if (!a) {
			pthread_mutex_unlock(&lock);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
		allocs = a;
		capallocs = cap;
	}
	allocs[nallocs++] = (struct fake_alloc){ p, n, host,
						 ctx_depth ? ctx_stack[ctx_depth - 1]->ordinal : -1 };
	if (!host)
		used_bytes += n;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

static CUresult del_alloc(uintptr_t p, int host)
{
	CUresult r = CUDA_ERROR_INVALID_VALUE;

	pthread_mutex_lock(&lock);
	for (size_t i = 0; i < nallocs; i++)
		if (allocs[i].p == p && allocs[i].pinned_host == host) {
			if (!host)
				used_bytes -= allocs[i].n;
			allocs[i] = allocs[--nallocs];
			r = CUDA_SUCCESS;
			break;
		}
	pthread_mutex_unlock(&lock);
	return r;
}

static CUresult fk_cuMemAlloc(CUdeviceptr *p, size_t n)
{
	void *m = NULL;
	CUresult r = need_ctx();

	if (r)
		return r;
	if (n == 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	r = used_bytes + n > device_memory() ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
	pthread_mutex_unlock(&lock);
	if (r)
		return r;
	/* exactly n bytes: a sanitizer sees a kernel reading past a buffer */
	if (posix_memalign(&m, 256, n))
		return CUDA_ERROR_OUT_OF_MEMORY;
#ifdef FAKE_CUDA_EMU
	/* NaN bytes, as a GPU's memory may hold anything: a kernel that reads what nothing wrote
	 * gets NaN rather than a lucky zero */
	memset(m, 0xff, n);
#endif
	r = add_alloc((uintptr_t)m, n, 0);
	if (r) {
		free(m);
		return r;
	}
	*p = (CUdeviceptr)(uintptr_t)m;
	return CUDA_SUCCESS;
}

/* Releases still release after a fault (and report it): the fake's own memory must not leak
 * because the "device" is lost. */
static CUresult fk_cuMemFree(CUdeviceptr p)
{
	CUresult r = have_ctx();

	if (r)
		return r;
	r = del_alloc((uintptr_t)p, 0);
	if (!r)
		free((void *)(uintptr_t)p);
	return r ? r : sticky_error();
}

static CUresult fk_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s)
{
	if (mode("no-mempool"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (check_stream(s))
		return CUDA_ERROR_INVALID_HANDLE;
	return fk_cuMemAlloc(p, n);
}

static CUresult fk_cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
	if (mode("no-mempool"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (check_stream(s))
		return CUDA_ERROR_INVALID_HANDLE;
	return fk_cuMemFree(p);
}

static CUresult fk_cuMemGetInfo(size_t *freeb, size_t *total)
{
	CUresult r = need_ctx();

	if (r)
		return r;
	pthread_mutex_lock(&lock);
	*total = device_memory();
	*freeb = *total - used_bytes;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

static CUresult fk_cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	const struct fake_alloc *a;
	CUresult r = need_ctx();

	if (r)
		return r;
	a = find((uintptr_t)p, 1, 0);
	if (!a)
		return CUDA_ERROR_NOT_FOUND;
	if (base)
		*base = (CUdeviceptr)a->p;
	if (size)
		*size = a->n;
	return CUDA_SUCCESS;
}

static CUresult fk_cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr p)
{
	const struct fake_alloc *a;

	if (!initialised)
		return CUDA_ERROR_NOT_INITIALIZED;
	a = find((uintptr_t)p, 1, 0);
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	if (attr != CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
		return CUDA_ERROR_NOT_SUPPORTED;
	*(int *)data = a->ordinal;
	return CUDA_SUCCESS;
}

/* A stream handle the fake gave (or a default stream), under lock. */
static CUresult stream_ok(CUstream s)
{
	if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
		return CUDA_SUCCESS;
	for (size_t i = 0; i < FAKE_MAX_STREAMS; i++)
		if (streams[i] == (struct fake_stream *)s)
			return CUDA_SUCCESS;
	return CUDA_ERROR_INVALID_HANDLE;
}

static CUresult check_stream(CUstream s)
{
	CUresult r;

	pthread_mutex_lock(&lock);
	r = stream_ok(s);
	pthread_mutex_unlock(&lock);
	return r;
}

/* Counts a call on stream s for fake_cuda_stream_calls(); under lock. */
static void count_stream_call(CUstream s, int destroyed, int synchronised)
{
	size_t i;

	for (i = 0; i < nstream_calls && stream_calls[i].s != s; i++)
		;
	if (i == FAKE_MAX_STREAMS)
		return;
	if (i == nstream_calls) {
		stream_calls[i].s = s;
		stream_calls[i].destroyed = stream_calls[i].synchronised = 0;
		nstream_calls++;
	}
	stream_calls[i].destroyed += destroyed;
	stream_calls[i].synchronised += synchronised;
}

static CUresult fk_cuStreamGetCtx(CUstream s, CUcontext *pctx)
{
	CUresult r = need_ctx();

	if (r)
		return r;
	pthread_mutex_lock(&lock);
	r = stream_ok(s);
	if (!r)
		*pctx = (CUcontext)(s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD
					    ? ((struct fake_stream *)s)->ctx
					    : ctx_stack[ctx_depth - 1]);
	pthread_mutex_unlock(&lock);
	return r;
}

static CUresult fk_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (!r)
		r = dev_range(dst, n);
	if (!r)
		memcpy((void *)(uintptr_t)dst, src, n);
	return r;
}

static CUresult fk_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (!r)
		r = dev_range(src, n);
	if (!r)
		memcpy(dst, (const void *)(uintptr_t)src, n);
	return r;
}

static CUresult fk_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (!r)
		r = dev_range(dst, n);
	if (!r)
		r = dev_range(src, n);
	if (!r)
		memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
	return r;
}

static CUresult fk_cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (!r)
		r = dev_range(dst, n * 4);
	if (!r && (dst & 3))
		r = CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; !r && i < n; i++)
		memcpy((char *)(uintptr_t)dst + 4 * i, &v, 4);
	return r;
}

static CUresult fk_cuMemHostRegister(void *p, size_t n, unsigned flags)
{
	CUresult r = need_ctx();

	(void)flags;
	if (r)
		return r;
	if (find((uintptr_t)p, 1, 1))
		return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	return add_alloc((uintptr_t)p, n, 1);
}

static CUresult fk_cuMemHostUnregister(void *p)
{
	CUresult r = have_ctx();

	if (r)
		return r;
	return del_alloc((uintptr_t)p, 1) ? CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED : sticky_error();
}

/* ------------------------------------------------------------------ streams and events */

static CUresult fk_cuStreamCreate(CUstream *s, unsigned flags)
{
	struct fake_stream *fs;
	CUresult r = need_ctx();

	(void)flags;
	if (r)
		return r;
	fs = calloc(1, sizeof(*fs));
	if (!fs)
		return CUDA_ERROR_OUT_OF_MEMORY;
	fs->ctx = ctx_stack[ctx_depth - 1];
	pthread_mutex_lock(&lock);
	for (size_t i = 0; i < FAKE_MAX_STREAMS; i++)
		if (!streams[i]) {
			streams[i] = fs;
			*s = (CUstream)fs;
			pthread_mutex_unlock(&lock);
			return CUDA_SUCCESS;
		}
	pthread_mutex_unlock(&lock);
	free(fs);
	return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult fk_cuStreamDestroy(CUstream s)
{
	CUresult r = have_ctx();

	if (r)
		return r;
	pthread_mutex_lock(&lock);
	r = s && stream_ok(s) == CUDA_SUCCESS && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD
		    ? CUDA_SUCCESS
		    : CUDA_ERROR_INVALID_HANDLE;
	for (size_t i = 0; !r && i < FAKE_MAX_STREAMS; i++)
		if (streams[i] == (struct fake_stream *)s)
			streams[i] = NULL;
	count_stream_call(s, 1, 0);
	pthread_mutex_unlock(&lock);
	if (r)
		return r;
	free(s);
	return sticky_error();
}

static CUresult fk_cuStreamSynchronize(CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	pthread_mutex_lock(&lock);
	count_stream_call(s, 0, 1);
	pthread_mutex_unlock(&lock);
	return r;
}

static CUresult fk_cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
	CUresult r = need_ctx();

	(void)flags;
	if (!e)
		return CUDA_ERROR_INVALID_HANDLE;
	return r ? r : check_stream(s);
}

static CUresult fk_cuEventCreate(CUevent *e, unsigned flags)
{
	struct fake_event *fe;
	CUresult r = need_ctx();

	(void)flags;
	if (r)
		return r;
	fe = calloc(1, sizeof(*fe));
	if (!fe)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*e = (CUevent)fe;
	return CUDA_SUCCESS;
}

static CUresult fk_cuEventRecord(CUevent e, CUstream s)
{
	struct fake_event *fe = (struct fake_event *)e;
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (r)
		return r;
	fe->ms = now_ms();
	fe->recorded = 1;
	return CUDA_SUCCESS;
}

static CUresult fk_cuEventSynchronize(CUevent e)
{
	if (sticky_error())
		return sticky_error();
	return ((struct fake_event *)e)->recorded ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult fk_cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
	const struct fake_event *ea = (const struct fake_event *)a, *eb = (const struct fake_event *)b;

	if (!ea->recorded || !eb->recorded)
		return CUDA_ERROR_INVALID_HANDLE;
	*ms = (float)(eb->ms - ea->ms);
	return CUDA_SUCCESS;
}

static CUresult fk_cuEventDestroy(CUevent e)
{
	free(e);
	return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ modules and launches */

static CUresult fk_cuModuleLoadData(CUmodule *m, const void *image)
{
	struct fake_module *fm;
	uint32_t magic;
	CUresult r = need_ctx();

	if (r)
		return r;
	memcpy(&magic, image, 4);
	if (magic != 0xBA55ED50u) /* what nvcc -fatbin writes */
		return CUDA_ERROR_INVALID_IMAGE;
	fm = calloc(1, sizeof(*fm));
	if (!fm)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*m = (CUmodule)fm;
	return CUDA_SUCCESS;
}

static CUresult fk_cuModuleUnload(CUmodule m)
{
	free(m);
	return CUDA_SUCCESS;
}

static CUresult fk_cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
	struct fake_module *fm = (struct fake_module *)m;
	struct fake_func *ff;
	void *emu = NULL;

#ifdef FAKE_CUDA_EMU
	emu = ape_emu_find(name);
#endif
	if (!emu)
		return CUDA_ERROR_NOT_FOUND; /* without the emulator no kernel exists */
	pthread_mutex_lock(&lock);
	ff = fm->nfuncs < FAKE_MAX_FUNCS ? &fm->funcs[fm->nfuncs++] : NULL;
	pthread_mutex_unlock(&lock);
	if (!ff)
		return CUDA_ERROR_OUT_OF_MEMORY;
	snprintf(ff->name, sizeof(ff->name), "%s", name);
	ff->emu = emu;
	ff->max_dyn_smem = 48 * 1024;
	*f = (CUfunction)ff;
	return CUDA_SUCCESS;
}

static CUresult fk_cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v)
{
	struct fake_func *ff = (struct fake_func *)f;

	if (a != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (v < 0 || v > 227 * 1024)
		return CUDA_ERROR_INVALID_VALUE;
	ff->max_dyn_smem = v;
	return CUDA_SUCCESS;
}

static CUresult fk_cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f)
{
	const struct fake_func *ff = (const struct fake_func *)f;

	switch (a) {
	case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
		*v = ff->max_dyn_smem;
		return CUDA_SUCCESS;
	case CU_FUNC_ATTRIBUTE_NUM_REGS:
		*v = 128;
		return CUDA_SUCCESS;
	default:
		return CUDA_ERROR_NOT_SUPPORTED;
	}
}

/* The size of kernel `name`'s argument struct (args.h), or 0. */
static size_t args_size(const char *name)
{
	if (!strcmp(name, "ape_prep"))
		return sizeof(struct ape_cu_prep_args);
	if (!strcmp(name, "ape_kscan"))
		return sizeof(struct ape_cu_scan_args);
	if (!strcmp(name, "ape_dwindow"))
		return sizeof(struct ape_cu_window_args);
	if (!strcmp(name, "ape_dmerge"))
		return sizeof(struct ape_cu_merge_args);
	if (!strncmp(name, "ape_prefill_", 12))
		return sizeof(struct ape_cu_prefill_args);
	if (!strncmp(name, "ape_decode_", 11))
		return sizeof(struct ape_cu_decode_args);
	return 0;
}

static void log_launch(const char *name, CUstream s, void **params)
{
	struct fake_launch_rec *rec;
	size_t n = args_size(name);

	pthread_mutex_lock(&lock);
	rec = &launch_log[nlaunches++ % FAKE_LOG_MAX];
	memset(rec, 0, sizeof(*rec));
	snprintf(rec->name, sizeof(rec->name), "%s", name);
	rec->stream = s;
	rec->ctx_ordinal = ctx_stack[ctx_depth - 1]->ordinal;
	rec->args_size = n <= FAKE_ARGS_MAX ? n : 0;
	if (params && params[0] && rec->args_size)
		memcpy(rec->args, params[0], rec->args_size);
	pthread_mutex_unlock(&lock);
}

static CUresult fk_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
				  unsigned bx, unsigned by, unsigned bz, unsigned smem, CUstream s,
				  void **params, void **extra)
{
	struct fake_func *ff = (struct fake_func *)f;
	struct fake_stream *fs = (struct fake_stream *)s;
	CUresult r = need_ctx();

	(void)extra;
	if (r)
		return r;
	if (!gx || !gy || !gz || gx > 0x7fffffffu || gy > 65535 || gz > 65535)
		return CUDA_ERROR_INVALID_VALUE;
	if (!bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
		return CUDA_ERROR_INVALID_VALUE;
	if ((int)smem > ff->max_dyn_smem)
		return CUDA_ERROR_INVALID_VALUE; /* above 48 KB only after cuFuncSetAttribute */
	r = check_stream(s);
	if (r)
		return r;
	if (fs && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD)
		fs->launches++;
	log_launch(ff->name, s, params);
	if (mode("fault")) {
		set_sticky(CUDA_ERROR_ILLEGAL_ADDRESS);
		return CUDA_SUCCESS; /* launches are asynchronous: the fault shows later */
	}
#ifdef FAKE_CUDA_EMU
	{
		const unsigned grid[3] = { gx, gy, gz }, block[3] = { bx, by, bz };
		char err[512];

		if (ape_emu_launch(ff->emu, grid, block, smem, params, err, sizeof(err))) {
			fprintf(stderr, "fake libcuda: %s: %s\n", ff->name, err);
			set_sticky(CUDA_ERROR_LAUNCH_FAILED);
		}
	}
#else
	(void)params;
#endif
	return CUDA_SUCCESS;
}

static CUresult fk_cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (r)
		return r;
	fn(data);
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
