/* SPDX-License-Identifier: MIT */
/*
 * The fake CUDA driver's streams, events, modules and launches (fake_libcuda.c says what the
 * fake is): every launch is checked against the hardware's limits, logged for the tests
 * (fake_cuda.h) and, with FAKE_CUDA_EMU, run on the CPU by the emulator.
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

/* ------------------------------------------------------------------ streams and events */

CUresult fk_cuStreamCreate(CUstream *s, unsigned flags)
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

CUresult fk_cuStreamDestroy(CUstream s)
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

CUresult fk_cuStreamSynchronize(CUstream s)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	pthread_mutex_lock(&lock);
	count_stream_call(s, 0, 1);
	pthread_mutex_unlock(&lock);
	return r;
}

CUresult fk_cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
	CUresult r = need_ctx();

	(void)flags;
	if (!e)
		return CUDA_ERROR_INVALID_HANDLE;
	return r ? r : check_stream(s);
}

CUresult fk_cuEventCreate(CUevent *e, unsigned flags)
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

CUresult fk_cuEventRecord(CUevent e, CUstream s)
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

CUresult fk_cuEventSynchronize(CUevent e)
{
	if (sticky_error())
		return sticky_error();
	return ((struct fake_event *)e)->recorded ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fk_cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
	const struct fake_event *ea = (const struct fake_event *)a, *eb = (const struct fake_event *)b;

	if (!ea->recorded || !eb->recorded)
		return CUDA_ERROR_INVALID_HANDLE;
	*ms = (float)(eb->ms - ea->ms);
	return CUDA_SUCCESS;
}

CUresult fk_cuEventDestroy(CUevent e)
{
	free(e);
	return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ modules and launches */

CUresult fk_cuModuleLoadData(CUmodule *m, const void *image)
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

CUresult fk_cuModuleUnload(CUmodule m)
{
	free(m);
	return CUDA_SUCCESS;
}

CUresult fk_cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
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

CUresult fk_cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v)
{
	struct fake_func *ff = (struct fake_func *)f;

	if (a != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (v < 0 || v > 227 * 1024)
		return CUDA_ERROR_INVALID_VALUE;
	ff->max_dyn_smem = v;
	return CUDA_SUCCESS;
}

CUresult fk_cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f)
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

CUresult fk_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
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

CUresult fk_cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data)
{
	CUresult r = need_ctx();

	if (!r)
		r = check_stream(s);
	if (r)
		return r;
	fn(data);
	return CUDA_SUCCESS;
}
