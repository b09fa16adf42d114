/* SPDX-License-Identifier: MIT */
/**
 * \file ape_dlpack.h
 * \brief libape on DLPack tensors: what PyTorch, NumPy, CuPy and JAX hand over with `__dlpack__`.
 *
 * Include `<dlpack/dlpack.h>` (Debian: libdlpack-dev) or let this header include it. Only the
 * unversioned `DLTensor` is used, which every DLPack version since 0.5 has.
 */
#ifndef APE_APE_DLPACK_H
#define APE_APE_DLPACK_H

#include <dlpack/dlpack.h>

#include "ape/ape.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device types an older header may lack (values fixed by the DLPack ABI). */
#ifndef DLPACK_VERSION
#error "dlpack/dlpack.h without DLPACK_VERSION: too old"
#endif

/**
 * \brief The forward pass on DLPack tensors, where they are.
 *
 * q, k, v, o are 4-D `[B, H, L, D]` (k, v `[B, Hkv, Lk, D]`), lse NULL or 3-D `[B, H, Lq]`
 * float32; float32, float16 or bfloat16 (lanes 1); strides in elements (NULL: compact
 * row-major), the last one 1 (D contiguous); `byte_offset` honoured and a multiple of the element
 * size. Every tensor must live where \p dev computes:
 *   - `kDLCPU` on the reference and on OpenCL CPU devices: computed in place, and the call
 *     returns when O is written (\p stream must be NULL);
 *   - `kDLOpenCL` (`data` is a `cl_mem` of the device's context) on OpenCL devices: \p stream is
 *     the caller's `cl_command_queue`, or NULL for libape's own queue, waited for before the call
 *     returns;
 *   - `kDLCUDA` (`data` a device pointer of the device's primary context, `device_id` its
 *     ordinal) on CUDA devices: \p stream is a `CUstream`, NULL meaning the legacy default
 *     stream; the call returns once the work is enqueued.
 * \return 0; APE_EINVAL naming the tensor and what is wrong (its device type or id, dtype,
 *         ndim, shape, a stride, the offset); the errors of ape_attention_enqueue().
 */
APE_API int ape_attention_forward_dlpack(ape_device *dev, const ape_attn_desc *desc,
					 const DLTensor *q, const DLTensor *k, const DLTensor *v,
					 DLTensor *o, DLTensor *lse, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* APE_APE_DLPACK_H */
