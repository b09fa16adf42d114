/* SPDX-License-Identifier: MIT */
/*
 * CUDA errors at the backend boundary: every CUresult becomes a libape code and a message naming
 * the driver call and the error (cuGetErrorName and cuGetErrorString); the core's table adds
 * the device and the backend op around it (core/backend.h, "Failure"). Nothing aborts.
 */
#include <stdarg.h>
#include <stdio.h>

#include "cu.h"

/* Names of the results libape maps specially or is likely to meet, for when the driver cannot
 * name a code itself (not loaded, or an older driver meeting a newer code). */
static const struct {
	int code;
	const char *name;
} cu_names[] = {
	{ 0, "CUDA_SUCCESS" },
	{ 1, "CUDA_ERROR_INVALID_VALUE" },
	{ 2, "CUDA_ERROR_OUT_OF_MEMORY" },
	{ 3, "CUDA_ERROR_NOT_INITIALIZED" },
	{ 4, "CUDA_ERROR_DEINITIALIZED" },
	{ 34, "CUDA_ERROR_STUB_LIBRARY" },
	{ 35, "CUDA_ERROR_INSUFFICIENT_DRIVER" },
	{ 46, "CUDA_ERROR_DEVICE_UNAVAILABLE" },
	{ 100, "CUDA_ERROR_NO_DEVICE" },
	{ 101, "CUDA_ERROR_INVALID_DEVICE" },
	{ 102, "CUDA_ERROR_DEVICE_NOT_LICENSED" },
	{ 200, "CUDA_ERROR_INVALID_IMAGE" },
	{ 201, "CUDA_ERROR_INVALID_CONTEXT" },
	{ 209, "CUDA_ERROR_NO_BINARY_FOR_GPU" },
	{ 214, "CUDA_ERROR_ECC_UNCORRECTABLE" },
	{ 218, "CUDA_ERROR_INVALID_PTX" },
	{ 220, "CUDA_ERROR_NVLINK_UNCORRECTABLE" },
	{ 221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND" },
	{ 222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" },
	{ 500, "CUDA_ERROR_NOT_FOUND" },
	{ 600, "CUDA_ERROR_NOT_READY" },
	{ 700, "CUDA_ERROR_ILLEGAL_ADDRESS" },
	{ 701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" },
	{ 702, "CUDA_ERROR_LAUNCH_TIMEOUT" },
	{ 710, "CUDA_ERROR_ASSERT" },
	{ 714, "CUDA_ERROR_HARDWARE_STACK_ERROR" },
	{ 715, "CUDA_ERROR_ILLEGAL_INSTRUCTION" },
	{ 716, "CUDA_ERROR_MISALIGNED_ADDRESS" },
	{ 717, "CUDA_ERROR_INVALID_ADDRESS_SPACE" },
	{ 718, "CUDA_ERROR_INVALID_PC" },
	{ 719, "CUDA_ERROR_LAUNCH_FAILED" },
	{ 801, "CUDA_ERROR_NOT_SUPPORTED" },
	{ 999, "CUDA_ERROR_UNKNOWN" },
};

int ape__cu_err_code(CUresult r)
{
	switch ((int)r) {
	case CUDA_SUCCESS:
		return 0;
	case CUDA_ERROR_OUT_OF_MEMORY:
		return APE_ENOMEM;
	case CUDA_ERROR_NO_DEVICE:
	case CUDA_ERROR_INVALID_DEVICE:
	case CUDA_ERROR_DEVICE_UNAVAILABLE:
	case CUDA_ERROR_DEVICE_NOT_LICENSED:
		return APE_ENODEV;
	/* the context is gone or the hardware failed: nothing on this device works any more */
	case CUDA_ERROR_ECC_UNCORRECTABLE:
	case CUDA_ERROR_NVLINK_UNCORRECTABLE:
	case CUDA_ERROR_ILLEGAL_ADDRESS:
	case CUDA_ERROR_LAUNCH_TIMEOUT:
	case CUDA_ERROR_ASSERT:
	case CUDA_ERROR_HARDWARE_STACK_ERROR:
	case CUDA_ERROR_ILLEGAL_INSTRUCTION:
	case CUDA_ERROR_MISALIGNED_ADDRESS:
	case CUDA_ERROR_INVALID_ADDRESS_SPACE:
	case CUDA_ERROR_INVALID_PC:
	case CUDA_ERROR_LAUNCH_FAILED:
		return APE_EDEVLOST;
	/* the kernels cannot be loaded on this GPU with this driver */
	case CUDA_ERROR_INVALID_IMAGE:
	case CUDA_ERROR_NO_BINARY_FOR_GPU:
	case CUDA_ERROR_INVALID_PTX:
	case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
	case CUDA_ERROR_JIT_COMPILER_NOT_FOUND:
		return APE_EBUILD;
	default:
		return APE_EBACKEND;
	}
}

const char *ape__cu_err_name(const struct ape__cu_driver *drv, CUresult r, char *buf, size_t cap)
{
	const char *s = NULL;

	if (drv && drv->p_cuGetErrorName && drv->p_cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
		return s;
	for (size_t i = 0; i < sizeof(cu_names) / sizeof(cu_names[0]); i++)
		if (cu_names[i].code == (int)r)
			return cu_names[i].name;
	snprintf(buf, cap, "CUresult %d", (int)r);
	return buf;
}

int ape__cu_error(CUresult r, const struct ape_device *dev, const char *fmt, ...)
{
	const struct ape__cu_device *cd = dev ? ape__cu_dev(dev) : NULL;
	const struct ape__cu_driver *drv = cd ? cd->drv : NULL;
	const char *text = NULL;
	char what[384], nbuf[32];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	if (!drv || !drv->p_cuGetErrorString || drv->p_cuGetErrorString(r, &text) != CUDA_SUCCESS)
		text = NULL;
	return ape_be_error(ape__cu_err_code(r), "%s: %s (%d)%s%s", what,
			  ape__cu_err_name(drv, r, nbuf, sizeof(nbuf)), (int)r, text ? ": " : "",
			  text ? text : "");
}
