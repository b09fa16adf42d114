/* SPDX-License-Identifier: MIT */
/*
 * The fake CUDA driver's memory (fake_libcuda.c says what the fake is): allocations, the checks
 * of device pointers against them, pinned host memory, copies and fills on streams (which run
 * when they are enqueued), and the streams' own checks.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_state.h"
#include "kernels/args.h"

#ifdef FAKE_CUDA_EMU
#include "emu_api.h"
#endif

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

CUresult fk_cuMemAlloc(CUdeviceptr *p, size_t n)
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
CUresult fk_cuMemFree(CUdeviceptr p)
{
	CUresult r = have_ctx();

	if (r)
		return r;
	r = del_alloc((uintptr_t)p, 0);
	if (!r)
		free((void *)(uintptr_t)p);
	return r ? r : sticky_error();
}

CUresult fk_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s)
{
	if (mode("no-mempool"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (check_stream(s))
		return CUDA_ERROR_INVALID_HANDLE;
	return fk_cuMemAlloc(p, n);
}

CUresult fk_cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
	if (mode("no-mempool"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (check_stream(s))
		return CUDA_ERROR_INVALID_HANDLE;
	return fk_cuMemFree(p);
}

CUresult fk_cuMemGetInfo(size_t *freeb, size_t *total)
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

CUresult fk_cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p)
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

CUresult fk_cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr p)
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
CUresult stream_ok(CUstream s)
{
	if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
		return CUDA_SUCCESS;
	for (size_t i = 0; i < FAKE_MAX_STREAMS; i++)
		if (streams[i] == (struct fake_stream *)s)
			return CUDA_SUCCESS;
	return CUDA_ERROR_INVALID_HANDLE;
}

CUresult check_stream(CUstream s)
{
	CUresult r;

	pthread_mutex_lock(&lock);
	r = stream_ok(s);
	pthread_mutex_unlock(&lock);
	return r;
}

/* Counts a call on stream s for fake_cuda_stream_calls(); under lock. */
void count_stream_call(CUstream s, int destroyed, int synchronised)
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

CUresult fk_cuStreamGetCtx(CUstream s, CUcontext *pctx)
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

CUresult fk_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s)
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

CUresult fk_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s)
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

CUresult fk_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
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

CUresult fk_cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s)
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

CUresult fk_cuMemHostRegister(void *p, size_t n, unsigned flags)
{
	CUresult r = need_ctx();

	(void)flags;
	if (r)
		return r;
	if (find((uintptr_t)p, 1, 1))
		return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	return add_alloc((uintptr_t)p, n, 1);
}

CUresult fk_cuMemHostUnregister(void *p)
{
	CUresult r = have_ctx();

	if (r)
		return r;
	return del_alloc((uintptr_t)p, 1) ? CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED : sticky_error();
}
