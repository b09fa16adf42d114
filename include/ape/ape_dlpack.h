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
 * float32; float32, float16 or bfloat16 (`kDLFloat` 32 or 16, `kDLBfloat` 16; lanes 1);
 * strides in elements (NULL: compact row-major), non-negative, the last one 1 (D contiguous;
 * the stride of an axis of one element is ignored, whatever its value);
 * `byte_offset` honoured and a multiple of the element size. Every tensor on one device, where
 * \p dev computes:
 *   - `kDLCPU`, `device_id` 0, on the reference and on OpenCL CPU devices: computed in place,
 *     and the call returns when O is written (\p stream must be NULL); `data + byte_offset`
 *     aligned to the element size;
 *   - `kDLOpenCL` (`data` a `cl_mem` of the device's context) on OpenCL devices, `device_id`
 *     the device's ape_device_info.backend_index (the N of "opencl:N"): \p stream is the
 *     caller's in-order `cl_command_queue`, libape's work ordered on it and the call returning
 *     once it is enqueued; or NULL for libape's own queue, waited for before the call returns;
 *   - `kDLCUDA` (`data` a device pointer of the device's primary context) on CUDA devices,
 *     `device_id` the `CUdevice` ordinal (ape_device_native()): \p stream is a `CUstream`,
 *     NULL meaning the legacy default stream; the call returns once the work is enqueued.
 * Tensors whose bytes overlap (slices of one packed QKV tensor) are one memory to libape, so the
 * host call's overlap rules apply exactly: inputs may share memory, an output shares none with
 * an input or another output. libape keeps no reference to a tensor after the call returns
 * (the caller keeps the memory alive until the work on \p stream has completed).
 * \return 0; APE_EINVAL naming the tensor and what is wrong (its device type or id, dtype,
 *         lanes, ndim, shape, a stride, the offset, its alignment, an overlap), or a
 *         non-NULL \p stream for kDLCPU tensors; APE_EOVERFLOW (sizes past 64 bits); APE_ENOTSUP
 *         naming the tensor where the device cannot take that memory (kDLCPU on a GPU); the
 *         errors of ape_attention_enqueue(), prefixed with this function's name.
 * \note Thread-safe: each call wraps the memory and the stream for itself.
 */
APE_API int ape_attention_forward_dlpack(ape_device *dev, const ape_attn_desc *desc,
					 const DLTensor *q, const DLTensor *k, const DLTensor *v,
					 DLTensor *o, DLTensor *lse, void *stream);

/**
 * \brief ape_attention_forward_dlpack() that also writes each row's attention entropy and mean
 * attention distance (docs/diagnostics.md): the DLPack twin of ape_attention_enqueue_diag().
 *
 * \p entropy and \p mean_distance are each NULL (not wanted) or 3-D `[B, H, Lq]` float32 like
 * lse, on the same device as the other tensors, by the same rules (strides, offsets,
 * alignment; an output shares no byte with another tensor of the call). As
 * ape_attention_enqueue_diag(), the call runs under `min(desc->skip_tol, 2^-24)`, and on a
 * device whose backend does not compute the diagnostics on device tensors (every backend of
 * libape does) it returns APE_ENOTSUP naming the device, before anything is enqueued.
 * \return as ape_attention_forward_dlpack(), messages naming this function and "entropy" or
 *         "mean_distance"; APE_ENOTSUP as above.
 */
APE_API int ape_attention_forward_dlpack_diag(ape_device *dev, const ape_attn_desc *desc,
					      const DLTensor *q, const DLTensor *k,
					      const DLTensor *v, DLTensor *o, DLTensor *lse,
					      DLTensor *entropy, DLTensor *mean_distance,
					      void *stream);

/**
 * \brief The backward pass on DLPack tensors, where they are: ape_attention_backward_enqueue()
 * (include/ape/ape.h) on the memory and stream the tensors come with.
 *
 * q, k, v, o, dout, dq, dk, dv are 4-D `[B, H, L, D]` (k, v, dk, dv `[B, Hkv, Lk, D]`); lse
 * (required) and dlse (NULL: dL/dLSE = 0) 3-D `[B, H, Lq]` float32; dparams 2-D `[H, 4]`
 * float32 (per head the gradients of delta, beta, gamma, lambda). dq, dk, dv and dparams are
 * each optional (NULL: not computed; all four NULL: APE_EINVAL). Types, strides, devices,
 * streams, memory sharing and what the call returns are as for ape_attention_forward_dlpack():
 * on kDLCPU tensors it returns once the gradients are written, on kDLOpenCL with a stream and
 * on kDLCUDA once the work is enqueued on \p stream. The rules of ape_attention_backward()
 * apply (an output shares no byte with an input or another output).
 * \return as ape_attention_forward_dlpack(), with the errors of
 *         ape_attention_backward_enqueue() prefixed with this function's name.
 */
APE_API int ape_attention_backward_dlpack(ape_device *dev, const ape_attn_desc *desc,
					  const DLTensor *q, const DLTensor *k, const DLTensor *v,
					  const DLTensor *o, const DLTensor *lse,
					  const DLTensor *dout, const DLTensor *dlse, DLTensor *dq,
					  DLTensor *dk, DLTensor *dv, DLTensor *dparams,
					  void *stream);

/**
 * \brief A ragged batch (ape_attention_forward_varlen(), include/ape/ape.h, "Ragged batches")
 * on DLPack tensors, where they are.
 *
 * q and o are 3-D packed `[total_q, H, D]` (token, head, component), k and v `[total_k, Hkv,
 * D]`, lse NULL or 2-D `[total_q, H]` float32; any strides (a PyTorch slice of a packed
 * `[total, 3, H, D]` QKV tensor is passed as it is), D contiguous. \p desc and \p vl (host
 * memory, read before the call returns) as for ape_attention_forward_varlen(). Types, strides,
 * offsets, devices, streams and memory sharing are as for ape_attention_forward_dlpack(), and
 * the shapes are checked against each other in these axes ("o->shape[0] = 5: must equal
 * q->shape[0] = 6"). Where the tensors are decides the route:
 *   - `kDLCPU` (\p stream NULL): the host call ape_attention_forward_varlen() on \p dev, any
 *     positions, the call returning when O is written; every device takes host tensors here
 *     (the host call stages them), the result the host call's bit for bit; an lse not laid
 *     out as `[total_q, H]` row-major is staged and written back on success;
 *   - `kDLOpenCL`, `kDLCUDA`: ape_attention_enqueue_varlen() on the memory and \p stream by
 *     the dense rules (the call returning once the work is enqueued, or after libape's own
 *     queue finished), any positions on a device that reads explicit positions (OpenCL);
 *     elsewhere (CUDA) positions that give a query run several runs of consecutive key
 *     positions are refused with APE_ENOTSUP naming vl->pos_k.
 * On any error o and lse are untouched (nothing is enqueued). libape keeps no reference to a
 * tensor or to \p vl after the call returns.
 * \return 0; APE_EINVAL naming the tensor or the batch and what is wrong (as
 *         ape_attention_forward_dlpack(), and shapes that disagree: "o->shape[0]"); the errors
 *         of ape_attention_forward_varlen() (kDLCPU) or ape_attention_enqueue_varlen()
 *         (device memory), their messages starting with this function's name (those that
 *         name an axis of the `[1, H, total, D]` view the packed tensors are described as end
 *         by saying so).
 * \note Thread-safe as ape_attention_forward_dlpack().
 */
APE_API int ape_attention_forward_varlen_dlpack(ape_device *dev, const ape_attn_desc *desc,
						const ape_varlen *vl, const DLTensor *q,
						const DLTensor *k, const DLTensor *v, DLTensor *o,
						DLTensor *lse, void *stream);

/**
 * \brief The gradients of a ragged batch (ape_attention_backward_varlen()) on DLPack tensors.
 *
 * q, o, dout, dq are 3-D packed `[total_q, H, D]`, k, v, dk, dv `[total_k, Hkv, D]`; lse
 * (required) and dlse (NULL: dL/dLSE = 0) 2-D `[total_q, H]` float32; dparams 2-D `[H, 4]`
 * float32. dq, dk, dv and dparams are each optional (NULL: not computed; all four NULL:
 * APE_EINVAL). Types, strides, shapes and memory sharing as for
 * ape_attention_forward_varlen_dlpack() and ape_attention_backward_dlpack(). kDLCPU tensors
 * (\p stream NULL): the call is ape_attention_backward_varlen() on \p dev, any positions,
 * returning when the gradients are written (bit for bit the host call's); lse, dlse and
 * dparams not laid out row-major are staged. Device tensors (kDLOpenCL, kDLCUDA): the call is
 * ape_attention_backward_enqueue_varlen() on a queue of \p stream as
 * ape_attention_backward_dlpack() takes it (the positions it takes, its refusals). On any
 * error found by the checks nothing is written.
 * \return as ape_attention_forward_varlen_dlpack(), with the errors of
 *         ape_attention_backward_varlen() (kDLCPU) or ape_attention_backward_enqueue_varlen()
 *         (device memory) prefixed with this function's name.
 */
APE_API int ape_attention_backward_varlen_dlpack(ape_device *dev, const ape_attn_desc *desc,
						 const ape_varlen *vl, const DLTensor *q,
						 const DLTensor *k, const DLTensor *v,
						 const DLTensor *o, const DLTensor *lse,
						 const DLTensor *dout, const DLTensor *dlse,
						 DLTensor *dq, DLTensor *dk, DLTensor *dv,
						 DLTensor *dparams, void *stream);

/**
 * \brief ape_paged_kv_run() on DLPack tensors: one layer's attention over the caller's KV
 *        pages (docs/serving.md, "The caller's pages").
 *
 * k_pages and v_pages are 4-D `[num_pages, page_tokens, Hkv, D]` (vLLM's order, as a
 * framework's tensor of it holds them), strides free with D contiguous, both with the same
 * strides: an HND buffer `[num_pages, Hkv, page_tokens, D]` is passed as its permuted view;
 * FlashInfer's K and V halves of one `[num_pages, 2, page_tokens, Hkv, D]` buffer as two
 * slices of it (one memory to libape). They are where the object's device reads them, by the
 * rules of ape_attention_forward_dlpack() (kDLOpenCL, kDLCUDA, or kDLCPU on the reference and
 * OpenCL CPU devices), of the object's dtype, and hold their keys when the call is made (the
 * caller's writes to them completed: on a GPU, synchronise the stream that wrote them first);
 * they are only read. q and o are 3-D `[total_q, H, D]` kDLCPU tensors (the plan's total_q;
 * q of the object's dtype, o of it or float32), lse NULL or 2-D `[total_q, H]` float32 kDLCPU
 * (staged when not row-major), as ape_paged_kv_run() takes its host q, o and lse. Returns when
 * o and lse are written.
 * \return 0; APE_EINVAL naming the tensor and what is wrong (as
 *         ape_attention_forward_dlpack(); a message about an axis of the pages names it in the
 *         `[num_pages, Hkv, page_tokens, D]` view and says so); APE_ENOTSUP naming q->device
 *         for queries or outputs not in host memory; the errors of ape_paged_kv_run(),
 *         prefixed with this function's name. On an error found by the checks nothing is
 *         written.
 * \note Used by one thread at a time, as the object is.
 */
APE_API int ape_paged_kv_run_dlpack(ape_paged_kv *pk, const ape_attn_desc *desc,
				    const DLTensor *k_pages, const DLTensor *v_pages,
				    const DLTensor *q, DLTensor *o, DLTensor *lse);

#ifdef __cplusplus
}
#endif
#endif /* APE_APE_DLPACK_H */
