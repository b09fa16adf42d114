/* SPDX-License-Identifier: MIT */
/*
 * Every CUDA driver entry point libape uses, with the CUDA version whose ABI it wants and whether
 * the backend can live without it. cuda_loader.c resolves each through cuGetProcAddress with that
 * version, so the driver hands out the variant this code was written for (cuMemAlloc at 3020 is
 * cuMemAlloc_v2, with a 64-bit CUdeviceptr and size_t), never a newer one whose signature differs.
 *
 * X(name, version, requirement, return type, parameters)
 *   REQ: missing means the backend is unavailable, naming the symbol;
 *   OPT: missing only turns off its feature (host memory pinning; wrapping the caller's memory
 *        without cuMemGetAddressRange; the checks that a wrapped pointer or stream is the
 *        device's without cuPointerGetAttribute and cuStreamGetCtx).
 * Signatures are written out here, not taken from cuda.h: cuda.h renames most functions to their
 * newest variant (cuMemAlloc -> cuMemAlloc_v2, cuGetProcAddress -> cuGetProcAddress_v2), which is
 * the wrong type for an older version number.
 */
#ifndef APE_CUDA_SYMS_H
#define APE_CUDA_SYMS_H

#define APE_CU_REQ 1
#define APE_CU_OPT 0

#define APE_CUDA_SYMBOLS(X)                                                                        \
	X(cuGetErrorName, 6000, APE_CU_REQ, (CUresult error, const char **pStr))                   \
	X(cuGetErrorString, 6000, APE_CU_REQ, (CUresult error, const char **pStr))                 \
	X(cuInit, 2000, APE_CU_REQ, (unsigned int Flags))                                          \
	X(cuDriverGetVersion, 2020, APE_CU_REQ, (int *driverVersion))                              \
	X(cuDeviceGetCount, 2000, APE_CU_REQ, (int *count))                                        \
	X(cuDeviceGet, 2000, APE_CU_REQ, (CUdevice * device, int ordinal))                         \
	X(cuDeviceGetName, 2000, APE_CU_REQ, (char *name, int len, CUdevice dev))                  \
	X(cuDeviceGetAttribute, 2000, APE_CU_REQ, (int *pi, CUdevice_attribute attrib, CUdevice dev)) \
	X(cuDeviceTotalMem, 3020, APE_CU_REQ, (size_t * bytes, CUdevice dev))                      \
	X(cuDevicePrimaryCtxRetain, 7000, APE_CU_REQ, (CUcontext * pctx, CUdevice dev))           \
	X(cuDevicePrimaryCtxRelease, 11000, APE_CU_REQ, (CUdevice dev))                            \
	X(cuCtxPushCurrent, 4000, APE_CU_REQ, (CUcontext ctx))                                     \
	X(cuCtxPopCurrent, 4000, APE_CU_REQ, (CUcontext * pctx))                                   \
	X(cuMemGetInfo, 3020, APE_CU_REQ, (size_t * free, size_t *total))                          \
	X(cuMemAlloc, 3020, APE_CU_REQ, (CUdeviceptr * dptr, size_t bytesize))                     \
	X(cuMemFree, 3020, APE_CU_REQ, (CUdeviceptr dptr))                                         \
	X(cuMemAllocAsync, 11020, APE_CU_REQ, (CUdeviceptr * dptr, size_t bytesize, CUstream h))   \
	X(cuMemFreeAsync, 11020, APE_CU_REQ, (CUdeviceptr dptr, CUstream h))                       \
	X(cuMemcpyHtoDAsync, 3020, APE_CU_REQ,                                                     \
	  (CUdeviceptr dst, const void *src, size_t n, CUstream h))                                \
	X(cuMemcpyDtoHAsync, 3020, APE_CU_REQ, (void *dst, CUdeviceptr src, size_t n, CUstream h)) \
	X(cuMemcpyDtoDAsync, 3020, APE_CU_REQ,                                                     \
	  (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h))                                \
	X(cuMemsetD32Async, 3020, APE_CU_REQ,                                                      \
	  (CUdeviceptr dst, unsigned int ui, size_t n, CUstream h))                                \
	X(cuStreamCreate, 2000, APE_CU_REQ, (CUstream * ph, unsigned int flags))                   \
	X(cuStreamDestroy, 4000, APE_CU_REQ, (CUstream h))                                         \
	X(cuStreamSynchronize, 2000, APE_CU_REQ, (CUstream h))                                     \
	X(cuStreamWaitEvent, 3020, APE_CU_REQ, (CUstream h, CUevent e, unsigned int flags))        \
	X(cuEventCreate, 2000, APE_CU_REQ, (CUevent * ph, unsigned int flags))                     \
	X(cuEventRecord, 2000, APE_CU_REQ, (CUevent e, CUstream h))                                \
	X(cuEventSynchronize, 2000, APE_CU_REQ, (CUevent e))                                       \
	X(cuEventElapsedTime, 2000, APE_CU_REQ, (float *ms, CUevent start, CUevent end))           \
	X(cuEventDestroy, 4000, APE_CU_REQ, (CUevent e))                                           \
	X(cuModuleLoadData, 2000, APE_CU_REQ, (CUmodule * module, const void *image))              \
	X(cuModuleUnload, 2000, APE_CU_REQ, (CUmodule module))                                     \
	X(cuModuleGetFunction, 2000, APE_CU_REQ, (CUfunction * f, CUmodule module, const char *name)) \
	X(cuFuncSetAttribute, 9000, APE_CU_REQ, (CUfunction f, CUfunction_attribute a, int v))     \
	X(cuFuncGetAttribute, 2020, APE_CU_REQ, (int *pi, CUfunction_attribute a, CUfunction f))   \
	X(cuLaunchKernel, 4000, APE_CU_REQ,                                                        \
	  (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,       \
	   unsigned int by, unsigned int bz, unsigned int smem, CUstream h, void **params,         \
	   void **extra))                                                                          \
	X(cuLaunchHostFunc, 10000, APE_CU_REQ, (CUstream h, CUhostFn fn, void *data))              \
	X(cuMemHostRegister, 6050, APE_CU_OPT, (void *p, size_t bytes, unsigned int flags))        \
	X(cuMemHostUnregister, 4000, APE_CU_OPT, (void *p))                                        \
	X(cuMemGetAddressRange, 3020, APE_CU_OPT,                                                  \
	  (CUdeviceptr * pbase, size_t *psize, CUdeviceptr dptr))                                  \
	X(cuPointerGetAttribute, 4000, APE_CU_OPT,                                                 \
	  (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))                            \
	X(cuStreamGetCtx, 9020, APE_CU_OPT, (CUstream h, CUcontext * pctx))

#endif /* APE_CUDA_SYMS_H */
