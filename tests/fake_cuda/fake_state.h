/* SPDX-License-Identifier: MIT */
/*
 * The fake CUDA driver's own state and helpers, shared by its parts, one shared object
 * (libcuda.so.1): fake_libcuda.c (the state, errors, init, devices, cuGetProcAddress and the
 * tests' calls), fake_memory.c (memory and copies), fake_launch.c (streams, events, modules and
 * launches). Nothing here is exported (FAKE_SHARED); what tests see is fake_cuda.h.
 */
#ifndef APE_FAKE_STATE_H
#define APE_FAKE_STATE_H

#include <cuda.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fake_cuda.h"

#define FAKE_API __attribute__((visibility("default")))
#define FAKE_SHARED __attribute__((visibility("hidden")))

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
struct fake_event {
	double ms;
	int recorded;
};

/* every stream created and not destroyed, and the calls on streams tests ask about */
#define FAKE_MAX_STREAMS 256
FAKE_SHARED extern struct fake_stream *streams[FAKE_MAX_STREAMS];
struct fake_stream_calls {
	CUstream s;
	int destroyed, synchronised;
};
FAKE_SHARED extern struct fake_stream_calls stream_calls[FAKE_MAX_STREAMS];
FAKE_SHARED extern size_t nstream_calls;
FAKE_SHARED extern struct fake_launch_rec launch_log[FAKE_LOG_MAX];
/* launches since the last clear; launch_log holds the latest FAKE_LOG_MAX */
FAKE_SHARED extern size_t nlaunches;

FAKE_SHARED extern pthread_mutex_t lock;
FAKE_SHARED extern struct fake_alloc *allocs;
FAKE_SHARED extern size_t nallocs, capallocs, used_bytes;
FAKE_SHARED extern int initialised;
FAKE_SHARED extern __thread struct fake_ctx *ctx_stack[16];
FAKE_SHARED extern __thread int ctx_depth;

/* ---- helpers (fake_libcuda.c, fake_memory.c) */

FAKE_SHARED int mode(const char *m);
FAKE_SHARED size_t device_memory(void);
FAKE_SHARED int ndevices(void);
FAKE_SHARED double now_ms(void);
FAKE_SHARED CUresult sticky_error(void);
FAKE_SHARED void set_sticky(CUresult r);
FAKE_SHARED CUresult have_ctx(void);
FAKE_SHARED CUresult need_ctx(void);
FAKE_SHARED struct fake_alloc *find(uintptr_t p, size_t n, int host);
FAKE_SHARED CUresult dev_range(CUdeviceptr p, size_t n);
FAKE_SHARED CUresult stream_ok(CUstream s);
FAKE_SHARED CUresult check_stream(CUstream s);
FAKE_SHARED void count_stream_call(CUstream s, int destroyed, int synchronised);

/* ---- the driver's calls, for cuGetProcAddress (fake_libcuda.c) */

FAKE_SHARED CUresult fk_cuMemAlloc(CUdeviceptr *p, size_t n);
FAKE_SHARED CUresult fk_cuMemFree(CUdeviceptr p);
FAKE_SHARED CUresult fk_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s);
FAKE_SHARED CUresult fk_cuMemFreeAsync(CUdeviceptr p, CUstream s);
FAKE_SHARED CUresult fk_cuMemGetInfo(size_t *freeb, size_t *total);
FAKE_SHARED CUresult fk_cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p);
FAKE_SHARED CUresult fk_cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr p);
FAKE_SHARED CUresult fk_cuStreamGetCtx(CUstream s, CUcontext *pctx);
FAKE_SHARED CUresult fk_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s);
FAKE_SHARED CUresult fk_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s);
FAKE_SHARED CUresult fk_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
FAKE_SHARED CUresult fk_cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s);
FAKE_SHARED CUresult fk_cuMemHostRegister(void *p, size_t n, unsigned flags);
FAKE_SHARED CUresult fk_cuMemHostUnregister(void *p);
FAKE_SHARED CUresult fk_cuStreamCreate(CUstream *s, unsigned flags);
FAKE_SHARED CUresult fk_cuStreamDestroy(CUstream s);
FAKE_SHARED CUresult fk_cuStreamSynchronize(CUstream s);
FAKE_SHARED CUresult fk_cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags);
FAKE_SHARED CUresult fk_cuEventCreate(CUevent *e, unsigned flags);
FAKE_SHARED CUresult fk_cuEventRecord(CUevent e, CUstream s);
FAKE_SHARED CUresult fk_cuEventSynchronize(CUevent e);
FAKE_SHARED CUresult fk_cuEventElapsedTime(float *ms, CUevent a, CUevent b);
FAKE_SHARED CUresult fk_cuEventDestroy(CUevent e);
FAKE_SHARED CUresult fk_cuModuleLoadData(CUmodule *m, const void *image);
FAKE_SHARED CUresult fk_cuModuleUnload(CUmodule m);
FAKE_SHARED CUresult fk_cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
FAKE_SHARED CUresult fk_cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v);
FAKE_SHARED CUresult fk_cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f);
FAKE_SHARED CUresult fk_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
				  unsigned bx, unsigned by, unsigned bz, unsigned smem, CUstream s,
				  void **params, void **extra);
FAKE_SHARED CUresult fk_cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data);

#endif
