/* SPDX-License-Identifier: MIT */
/*
 * The forward pass on DLPack tensors (include/ape/ape_dlpack.h), with or without the diagnostics
 * (ape_attention_forward_dlpack_diag()): each DLTensor becomes an
 * ape_dtensor over a wrapper of the caller's memory (ape__buffer_wrap()), and the call is checked
 * and enqueued by ape__attention_enqueue() (ape_attention_enqueue()'s path, its messages naming
 * this function and the tensor) on a queue: libape's own, synchronised before returning (kDLCPU, and
 * kDLOpenCL without a stream), or a wrapper of the caller's stream. Every wrapper is released
 * before returning, which the backend contract allows while the work is in flight (buf_wrap,
 * queue_wrap in runtime/core/backend.h).
 *
 * Memory: tensors addressed by pointer (kDLCPU, kDLCUDA) whose byte spans overlap share one
 * wrapper covering their union, so that the overlap rules of the host call (an output shares no
 * byte with an input or with another output; inputs may share) apply to them exactly, as they
 * would to ape_tensor: a packed QKV tensor's slices are one wrapper, separate allocations
 * separate wrappers. Tensors of one cl_mem (kDLOpenCL) share its wrapper, with their byte
 * offsets; distinct cl_mem objects are taken to be distinct memory (sub-buffers that alias are
 * the caller's to avoid for outputs).
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ape/ape_dlpack.h"

#include "core/backend.h"
#include "core/error.h"
#include "api/resident.h"
#include "api/validate.h"

#define NT (APE__T_COUNT + 2) /* q, k, v, o, lse, entropy, mean_distance */

static const char *const names[NT] = { "q", "k", "v", "o", "lse", "entropy", "mean_distance" };

static const char *devtype_name(int t)
{
	switch (t) {
	case kDLCPU:
		return "kDLCPU";
	case kDLCUDA:
		return "kDLCUDA";
	case kDLCUDAHost:
		return "kDLCUDAHost";
	case kDLOpenCL:
		return "kDLOpenCL";
	case kDLCUDAManaged:
		return "kDLCUDAManaged";
	case kDLROCM:
		return "kDLROCM";
	case kDLVulkan:
		return "kDLVulkan";
	case kDLMetal:
		return "kDLMetal";
	default:
		return "an unknown device type";
	}
}

/* The memory kind (enum ape__mem_kind) of a device type, 0 for one libape takes nowhere. */
static int kind_of(int device_type)
{
	switch (device_type) {
	case kDLCPU:
		return APE__MEM_HOST;
	case kDLOpenCL:
		return APE__MEM_OPENCL;
	case kDLCUDA:
		return APE__MEM_CUDA;
	default:
		return 0;
	}
}

/* One tensor as read from its DLTensor, before any wrapper exists. */
struct dl_in {
	const DLTensor *t;
	ape_dtype dtype;
	size_t esz;
	bool empty; /* no element: addresses nothing, its data is never used */
	uintptr_t lo, hi; /* kDLCPU, kDLCUDA: the bytes [lo, hi) it addresses */
	int group; /* index of the tensor whose wrapper it uses */
	ape_dtensor dt;
};

static int check_dtype(const char *fn, const char *name, const DLTensor *t, ape_dtype *out)
{
	const DLDataType d = t->dtype;

	if (d.lanes != 1)
		return ape__error(APE_EINVAL, "%s: %s->dtype.lanes = %u: must be 1 (no vector types)",
				  fn, name, (unsigned)d.lanes);
	if (d.code == kDLFloat && d.bits == 32)
		*out = APE_F32;
	else if (d.code == kDLFloat && d.bits == 16)
		*out = APE_F16;
	else if (d.code == kDLBfloat && d.bits == 16)
		*out = APE_BF16;
	else
		return ape__error(APE_EINVAL,
				  "%s: %s->dtype = {code %u, bits %u}: not float32, float16 or "
				  "bfloat16",
				  fn, name, (unsigned)d.code, (unsigned)d.bits);
	return 0;
}

/* The device type and id every tensor must have to be computed on by dev (see the header). */
static int check_device(const char *fn, const char *name, const DLTensor *t, const DLTensor *q,
			const ape_device *dev)
{
	const char *be = dev->info.backend;
	const int type = (int)t->device.device_type, id = t->device.device_id;
	int want_id = 0;

	if (t != q && (type != (int)q->device.device_type || id != q->device.device_id))
		return ape__error(APE_EINVAL, "%s: %s->device = (%s, %d), q->device = (%s, %d): "
				  "every tensor must be on one device",
				  fn, name, devtype_name(type), id,
				  devtype_name((int)q->device.device_type), q->device.device_id);
	if (!kind_of(type))
		return ape__error(APE_EINVAL,
				  "%s: %s->device.device_type = %d (%s): libape takes kDLCPU, kDLOpenCL "
				  "and kDLCUDA tensors",
				  fn, name, type, devtype_name(type));
	if ((type == kDLOpenCL && strcmp(be, "opencl")) || (type == kDLCUDA && strcmp(be, "cuda")))
		return ape__error(APE_EINVAL,
				  "%s: %s->device.device_type = %s: dev is %s:%d, a device of the %s "
				  "backend",
				  fn, name, devtype_name(type), be, dev->info.backend_index, be);
	if (type == kDLOpenCL) {
		want_id = dev->info.backend_index;
	} else if (type == kDLCUDA) {
		void *cuctx = NULL, *cudev = NULL;

		/* the CUdevice ordinal; a backend without native objects: its own numbering */
		ape_device_native(dev, &cuctx, &cudev);
		want_id = cuctx ? (int)(intptr_t)cudev : dev->info.backend_index;
	}
	if (id != want_id)
		return ape__error(APE_EINVAL, "%s: %s->device.device_id = %d: dev (%s:%d) is %s %d",
				  fn, name, id, be, dev->info.backend_index, devtype_name(type),
				  want_id);
	return 0;
}

/* Reads one DLTensor of ndim dimensions into in->dt (without a buffer) and its byte span. */
static int read_tensor(const char *fn, const char *name, const DLTensor *t, int ndim,
		       struct dl_in *in)
{
	uint64_t last = 0; /* elements from the first addressed to the last */
	int64_t s[4];

	memset(in, 0, sizeof(*in));
	in->t = t;
	if (t->ndim != ndim)
		return ape__error(APE_EINVAL, "%s: %s->ndim = %d: must be %d (%s)", fn, name, t->ndim,
				  ndim, ndim == 4 ? "[B, H, L, D]" : "[B, H, Lq]");
	if (!t->shape)
		return ape__error(APE_EINVAL, "%s: %s->shape = NULL", fn, name);
	int ret = check_dtype(fn, name, t, &in->dtype);

	if (ret)
		return ret;
	in->esz = ape_dtype_size(in->dtype);
	if (t->byte_offset % in->esz)
		return ape__error(APE_EINVAL,
				  "%s: %s->byte_offset = %" PRIu64
				  ": not a multiple of the %zu-byte %s element",
				  fn, name, t->byte_offset, in->esz, ape_dtype_name(in->dtype));
	for (int d = 0; d < ndim; d++) {
		if (t->shape[d] < 0)
			return ape__error(APE_EINVAL, "%s: %s->shape[%d] = %" PRId64 ": negative", fn,
					  name, d, t->shape[d]);
		in->empty |= t->shape[d] == 0;
		in->dt.shape[d] = t->shape[d];
	}
	if (ndim == 3)
		in->dt.shape[3] = 1;
	/* the strides given, or compact row-major ones; the stride of an axis of one element
	 * addresses nothing (frameworks leave any value there): 0 */
	s[3] = 1;
	for (int d = ndim - 1; d >= 0; d--) {
		if (t->strides)
			s[d] = t->shape[d] > 1 ? t->strides[d] : d == 3 ? 1 : 0;
		else if (d == ndim - 1)
			s[d] = 1;
		else if (__builtin_mul_overflow(s[d + 1], t->shape[d + 1] ? t->shape[d + 1] : 1,
						&s[d]))
			return ape__error(APE_EOVERFLOW, "%s: %s: more elements than 64 bits count", fn,
					  name);
		if (s[d] < 0)
			return ape__error(APE_EINVAL,
					  "%s: %s->strides[%d] = %" PRId64
					  ": negative strides are not supported",
					  fn, name, d, s[d]);
	}
	if (t->strides) {
		memcpy(in->dt.strides, s, sizeof(in->dt.strides));
		/* D of one element: 1 keeps it "contiguous" and the strides from reading as
		 * ape_dtensor's "all 0: compact" */
		if (in->dt.shape[3] <= 1)
			in->dt.strides[3] = 1;
	}
	in->dt.dtype = in->dtype;
	if (in->empty)
		return 0;
	for (int d = 0; d < ndim; d++) {
		uint64_t step;

		if (__builtin_mul_overflow((uint64_t)(t->shape[d] - 1), (uint64_t)s[d], &step) ||
		    __builtin_add_overflow(last, step, &last) || last >= (UINT64_MAX >> 1) / in->esz)
			return ape__error(APE_EINVAL,
					  "%s: %s->strides[%d] = %" PRId64
					  ": addresses beyond the address space with shape[%d] = %" PRId64,
					  fn, name, d, s[d], d, t->shape[d]);
	}
	uint64_t bytes = (last + 1) * in->esz, lo;

	if (!t->data)
		return ape__error(APE_EINVAL, "%s: %s->data = NULL", fn, name);
	if (kind_of((int)t->device.device_type) == APE__MEM_OPENCL)
		return 0; /* addressed inside its cl_mem: checked against the object's size */
	if (__builtin_add_overflow((uint64_t)(uintptr_t)t->data, t->byte_offset, &lo) ||
	    __builtin_add_overflow(lo, bytes, &bytes) || bytes > UINTPTR_MAX)
		return ape__error(APE_EINVAL,
				  "%s: %s: data %p + byte_offset %" PRIu64
				  " and its extent: beyond the address space",
				  fn, name, t->data, t->byte_offset);
	if (lo % in->esz)
		return ape__error(APE_EINVAL,
				  "%s: %s: data + byte_offset = 0x%" PRIx64
				  ": not aligned to its %zu-byte %s elements",
				  fn, name, lo, in->esz, ape_dtype_name(in->dtype));
	in->lo = (uintptr_t)lo;
	in->hi = (uintptr_t)bytes;
	return 0;
}

/* Groups the tensors that share memory (see the top of this file): in[i].group is the lowest
 * index of the tensors i's memory overlaps, directly or through others. */
static void group_tensors(struct dl_in *in, int n, int kind)
{
	bool changed = true;

	for (int i = 0; i < n; i++)
		in[i].group = i;
	while (changed) {
		changed = false;
		for (int i = 0; i < n; i++)
			for (int j = 0; j < n; j++) {
				const struct dl_in *a = &in[i], *b = &in[j];
				bool same;

				if (a->group == b->group || a->empty || b->empty)
					continue;
				same = kind == APE__MEM_OPENCL ? a->t->data == b->t->data
							       : a->lo < b->hi && b->lo < a->hi;
				if (same) {
					int g = a->group < b->group ? a->group : b->group;

					for (int m = 0; m < n; m++)
						if (in[m].group == a->group || in[m].group == b->group)
							in[m].group = g;
					changed = true;
				}
			}
	}
}

/* Wraps the memory of group g (the tensors whose group is g; `name` the name of tensor g) for
 * every tensor in it. */
static int wrap_group(const char *fn, const char *name, ape_device *dev, struct dl_in *in, int n,
		      int g, int kind, ape_buffer **out)
{
	/* an empty tensor's data is never read (it may be NULL): a few bytes stand for it */
	static unsigned char dummy[16] __attribute__((aligned(16)));
	uintptr_t lo = UINTPTR_MAX, hi = 0;
	char what[64];
	int ret;

	*out = NULL;
	snprintf(what, sizeof(what), "%s: %s", fn, name);
	if (in[g].empty) {
		in[g].dt.byte_offset = 0;
		if (kind == APE__MEM_HOST)
			return ape__buffer_wrap(what, dev, APE__MEM_HOST, dummy, sizeof(dummy), out);
		ret = ape_buffer_alloc(dev, sizeof(dummy), out);
		return ret ? ape__error_prefix(ret, what) : 0;
	}
	if (kind == APE__MEM_OPENCL) {
		for (int i = 0; i < n; i++)
			if (in[i].group == g)
				in[i].dt.byte_offset = in[i].t->byte_offset;
		return ape__buffer_wrap(what, dev, APE__MEM_OPENCL, in[g].t->data, 0, out);
	}
	for (int i = 0; i < n; i++)
		if (in[i].group == g) {
			lo = in[i].lo < lo ? in[i].lo : lo;
			hi = in[i].hi > hi ? in[i].hi : hi;
		}
	/* the wrapper starts 4-byte aligned, so that every member's offset from it is a multiple of
	 * its element size; the bytes before the first element are wrapped, never accessed */
	lo &= ~(uintptr_t)3;
	for (int i = 0; i < n; i++)
		if (in[i].group == g)
			in[i].dt.byte_offset = in[i].lo - lo;
	return ape__buffer_wrap(what, dev, kind, (void *)lo, hi - lo, out);
}

/* Both public calls: t[NT] (q .. o required, lse and the diagnostics NULL when not wanted). */
static int forward_dlpack(const char *fn, ape_device *dev, const ape_attn_desc *desc,
			  const DLTensor *const t[NT], void *stream)
{
	struct dl_in in[NT];
	const ape_dtensor *dt[NT] = { NULL };
	ape_buffer *wrap[NT] = { NULL };
	ape_queue *queue = NULL;
	int idx[NT], n = 0, kind, ret = 0;

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	for (int i = 0; i < APE__T_LSE; i++)
		if (!t[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL", fn, names[i]);
	/* the tensors given, in order: in[m] is t[idx[m]] */
	for (int i = 0; i < NT; i++) {
		if (!t[i])
			continue;
		if ((ret = check_device(fn, names[i], t[i], t[0], dev)) ||
		    (ret = read_tensor(fn, names[i], t[i], i >= APE__T_LSE ? 3 : 4, &in[n])))
			return ret;
		idx[n++] = i;
	}
	kind = kind_of((int)t[0]->device.device_type);
	if (kind == APE__MEM_HOST && stream)
		return ape__error(APE_EINVAL, "%s: stream = %p: must be NULL for kDLCPU tensors", fn,
				  stream);
	group_tensors(in, n, kind);
	for (int m = 0; m < n && !ret; m++)
		if (in[m].group == m)
			ret = wrap_group(fn, names[idx[m]], dev, in, n, m, kind, &wrap[m]);
	if (ret)
		goto out;
	for (int m = 0; m < n; m++) {
		in[m].dt.buf = wrap[in[m].group];
		dt[idx[m]] = &in[m].dt;
	}
	if (kind == APE__MEM_CUDA)
		ret = ape__queue_wrap(fn, dev, "cuda", stream, &queue);
	else if (kind == APE__MEM_OPENCL && stream)
		ret = ape__queue_wrap(fn, dev, "opencl", stream, &queue);
	else if ((ret = ape_queue_create(dev, &queue)))
		ret = ape__error_prefix(ret, fn);
	if (ret)
		goto out;
	/* validated, then enqueued; on failure, ape_queue_destroy() waits for what was enqueued
	 * before it */
	ret = ape__attention_enqueue_diag(fn, queue, desc, dt[0], dt[1], dt[2], dt[3], dt[4], dt[5],
					  dt[6]);
	if (!ret && !queue->wrapped && (ret = ape_queue_synchronize(queue)))
		ape__error_prefix(ret, fn);
out:
	ape_queue_destroy(queue);
	for (int i = 0; i < NT; i++)
		ape_buffer_free(wrap[i]);
	return ret;
}

int ape_attention_forward_dlpack(ape_device *dev, const ape_attn_desc *desc, const DLTensor *q,
				 const DLTensor *k, const DLTensor *v, DLTensor *o, DLTensor *lse,
				 void *stream)
{
	const DLTensor *const t[NT] = { q, k, v, o, lse, NULL, NULL };

	return forward_dlpack("ape_attention_forward_dlpack", dev, desc, t, stream);
}

int ape_attention_forward_dlpack_diag(ape_device *dev, const ape_attn_desc *desc,
				      const DLTensor *q, const DLTensor *k, const DLTensor *v,
				      DLTensor *o, DLTensor *lse, DLTensor *entropy,
				      DLTensor *mean_distance, void *stream)
{
	const DLTensor *const t[NT] = { q, k, v, o, lse, entropy, mean_distance };

	return forward_dlpack("ape_attention_forward_dlpack_diag", dev, desc, t, stream);
}
