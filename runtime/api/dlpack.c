/* SPDX-License-Identifier: MIT */
/*
 * The forward pass (with or without the diagnostics: ape_attention_forward_dlpack_diag()) and the
 * backward pass on DLPack tensors (include/ape/ape_dlpack.h): each DLTensor becomes an
 * ape_dtensor over a wrapper of the caller's memory (ape__buffer_wrap()), and the call is checked
 * and enqueued by ape__attention_enqueue_diag() or ape__attention_backward_enqueue() (the
 * resident calls' paths, their messages naming this function and the tensor) on a queue: libape's own, synchronised before returning (kDLCPU, and
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
 *
 * Ragged batches (ape_attention_forward_varlen_dlpack(), _backward_): the packed [total, H, D]
 * tensors and [total_q, H] LSE are read by the same reader through their form (struct dl_form:
 * which ape_dtensor axis each DLPack axis is), their shapes checked against each other in the
 * caller's axes; kDLCPU tensors then go to the host ragged calls as ape_tensor views (an LSE or
 * dparams not laid out row-major through a stage, checked for overlaps here since the host call
 * sees the stage), device tensors to ape__attention_enqueue_varlen() and
 * ape__attention_backward_enqueue_varlen() as above.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape/ape_dlpack.h"

#include "core/backend.h"
#include "core/error.h"
#include "core/verbose.h"
#include "api/kvpool.h"
#include "api/resident.h"
#include "api/validate.h"
#include "api/varlen.h"

#define NT APE__RB_COUNT /* the most tensors of a call: the backward's */

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

/* The memory kind (enum ape_be_mem_kind) of a device type, 0 for one libape takes nowhere. */
static int kind_of(int device_type)
{
	switch (device_type) {
	case kDLCPU:
		return APE_BE_MEM_HOST;
	case kDLOpenCL:
		return APE_BE_MEM_OPENCL;
	case kDLCUDA:
		return APE_BE_MEM_CUDA;
	default:
		return 0;
	}
}

/* One tensor as read from its DLTensor, before any wrapper exists. */
struct dl_in {
	const DLTensor *t; /* NULL: absent (an optional tensor of the call) */
	const char *name;
	ape_dtype dtype;
	size_t esz;
	bool empty; /* no element: addresses nothing, its data is never used */
	int64_t s[4]; /* its strides in elements, axis by axis of the DLTensor */
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
			const char *qname, const ape_device *dev)
{
	const char *be = dev->info.backend;
	const int type = (int)t->device.device_type, id = t->device.device_id;
	int want_id = 0;

	if (t != q && (type != (int)q->device.device_type || id != q->device.device_id))
		return ape__error(APE_EINVAL, "%s: %s->device = (%s, %d), %s->device = (%s, %d): "
				  "every tensor must be on one device",
				  fn, name, devtype_name(type), id, qname,
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

/*
 * The form a call takes a tensor in: its ndim axes, each an axis of the 4-D ape_dtensor it
 * becomes (the axes it lacks of one element), and its shape for messages. An axis map that is
 * not increasing (the packed forms) makes compact DLPack strides explicit ones.
 */
struct dl_form {
	int ndim;
	int axis[4]; /* ape_dtensor axis of each DLTensor axis */
	const char *dims;
};

static const struct dl_form F_BHLD = { 4, { 0, 1, 2, 3 }, "[B, H, L, D]" };
static const struct dl_form F_BHL = { 3, { 0, 1, 2 }, "[B, H, Lq]" }; /* [B, H, Lq, 1] */
static const struct dl_form F_H4 = { 2, { 2, 3 }, "[H, 4]" }; /* [1, 1, H, 4] */
/* the ragged calls' packed tensors [total, H, D] as [1, H, total, D], LSE [total_q, H] as
 * [1, H, total_q, 1] */
static const struct dl_form F_THD = { 3, { 2, 1, 3 }, "[total, H, D]" };
static const struct dl_form F_TH = { 2, { 2, 1 }, "[total_q, H]" };
/* the caller's KV pages [num_pages, page_tokens, Hkv, D] (vLLM's order; any strides) as the
 * [num_pages, Hkv, page_tokens, D] tensors ape_paged_kv_run() takes */
static const struct dl_form F_PAGES = { 4, { 0, 2, 1, 3 }, "[num_pages, page_tokens, Hkv, D]" };

/* Reads one DLTensor of form f into in->dt (without a buffer), its strides and byte span. */
static int read_tensor(const char *fn, const char *name, const DLTensor *t,
		       const struct dl_form *f, struct dl_in *in)
{
	const int ndim = f->ndim;
	uint64_t last = 0; /* elements from the first addressed to the last */
	int64_t *s = in->s;
	bool permuted = false;

	memset(in, 0, sizeof(*in));
	in->t = t;
	in->name = name;
	if (t->ndim != ndim)
		return ape__error(APE_EINVAL, "%s: %s->ndim = %d: must be %d (%s)", fn, name, t->ndim,
				  ndim, f->dims);
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
	for (int d = 0; d < 4; d++)
		in->dt.shape[d] = 1;
	for (int d = 0; d < ndim; d++) {
		if (t->shape[d] < 0)
			return ape__error(APE_EINVAL, "%s: %s->shape[%d] = %" PRId64 ": negative", fn,
					  name, d, t->shape[d]);
		in->empty |= t->shape[d] == 0;
		in->dt.shape[f->axis[d]] = t->shape[d];
		permuted |= d > 0 && f->axis[d] < f->axis[d - 1];
	}
	/* the strides given, or compact row-major ones; the stride of an axis of one element
	 * addresses nothing (frameworks leave any value there): 0 (1 for D) */
	for (int d = ndim - 1; d >= 0; d--) {
		if (t->strides)
			s[d] = t->shape[d] > 1 ? t->strides[d] : f->axis[d] == 3 ? 1 : 0;
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
	if (t->strides || permuted) {
		for (int d = 0; d < ndim; d++)
			in->dt.strides[f->axis[d]] = s[d];
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
	if (kind_of((int)t->device.device_type) == APE_BE_MEM_OPENCL)
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

				if (a->group == b->group || !a->t || !b->t || a->empty || b->empty)
					continue;
				same = kind == APE_BE_MEM_OPENCL ? a->t->data == b->t->data
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

/* Wraps the memory of group g (the tensors whose group is g) for every tensor in it. */
static int wrap_group(const char *fn, ape_device *dev, struct dl_in *in, int n, int g, int kind,
		      ape_buffer **out)
{
	/* an empty tensor's data is never read (it may be NULL): a few bytes stand for it */
	static unsigned char dummy[16] __attribute__((aligned(16)));
	uintptr_t lo = UINTPTR_MAX, hi = 0;
	char what[64];
	int ret;

	*out = NULL;
	snprintf(what, sizeof(what), "%s: %s", fn, in[g].name);
	if (in[g].empty) {
		in[g].dt.byte_offset = 0;
		if (kind == APE_BE_MEM_HOST)
			return ape__buffer_wrap(what, dev, APE_BE_MEM_HOST, dummy, sizeof(dummy), out);
		ret = ape_buffer_alloc(dev, sizeof(dummy), out);
		return ret ? ape__error_prefix(ret, what) : 0;
	}
	if (kind == APE_BE_MEM_OPENCL) {
		for (int i = 0; i < n; i++)
			if (in[i].group == g)
				in[i].dt.byte_offset = in[i].t->byte_offset;
		return ape__buffer_wrap(what, dev, APE_BE_MEM_OPENCL, in[g].t->data, 0, out);
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

/* A call's DLTensors as wrapped device tensors, and the queue to enqueue on. */
struct dl_call {
	const char *fn;
	struct dl_in in[NT];
	ape_buffer *wrap[NT];
	ape_queue *queue;
	const ape_dtensor *dt[NT]; /* NULL where absent */
};

/*
 * Reads the n tensors t (NULL: absent) of forms f for dev (their devices, see the header) and
 * checks stream against their memory, whose kind (enum ape_be_mem_kind) goes to *kind.
 */
static int dl_read(struct dl_call *c, ape_device *dev, const DLTensor *const *t,
		   const char *const *names, const struct dl_form *const *f, int n, void *stream,
		   int *kind)
{
	const char *fn = c->fn;
	const DLTensor *q = t[0];
	int ret;

	for (int i = 0; i < n; i++) {
		c->in[i].t = NULL;
		c->in[i].name = names[i];
		if (t[i] && ((ret = check_device(fn, names[i], t[i], q, names[0], dev)) ||
			     (ret = read_tensor(fn, names[i], t[i], f[i], &c->in[i]))))
			return ret;
	}
	*kind = kind_of((int)q->device.device_type);
	if (*kind == APE_BE_MEM_HOST && stream)
		return ape__error(APE_EINVAL, "%s: stream = %p: must be NULL for kDLCPU tensors", fn,
				  stream);
	return 0;
}

/* The n tensors' memory wrapped, tensors sharing memory one wrapper (c->dt: the device
 * tensors); no queue. On failure the caller still calls dl_release(). */
static int dl_wrap_mem(struct dl_call *c, ape_device *dev, int n, int kind)
{
	int ret = 0;

	group_tensors(c->in, n, kind);
	for (int i = 0; i < n && !ret; i++)
		if (c->in[i].t && c->in[i].group == i)
			ret = wrap_group(c->fn, dev, c->in, n, i, kind, &c->wrap[i]);
	if (ret)
		return ret;
	for (int i = 0; i < n; i++) {
		c->in[i].dt.buf = c->wrap[c->in[i].group];
		c->dt[i] = c->in[i].t ? &c->in[i].dt : NULL;
	}
	return 0;
}

/* Wraps the n tensors dl_read() read (memory of that kind) for dev (dl_wrap_mem()), and makes
 * the queue stream names (see the header). On failure the caller still calls dl_release(). */
static int dl_wrap(struct dl_call *c, ape_device *dev, int n, int kind, void *stream)
{
	const char *fn = c->fn;
	int ret = dl_wrap_mem(c, dev, n, kind);

	if (ret)
		return ret;
	if (kind == APE_BE_MEM_CUDA)
		ret = ape__queue_wrap(fn, dev, "cuda", stream, &c->queue);
	else if (kind == APE_BE_MEM_OPENCL && stream)
		ret = ape__queue_wrap(fn, dev, "opencl", stream, &c->queue);
	else if ((ret = ape_queue_create(dev, &c->queue)))
		ret = ape__error_prefix(ret, fn);
	return ret;
}

/* dl_read() and dl_wrap(): the dense calls' tensors, wherever they are. */
static int dl_prepare(struct dl_call *c, ape_device *dev, const DLTensor *const *t,
		      const char *const *names, const struct dl_form *const *f, int n,
		      void *stream)
{
	int kind, ret = dl_read(c, dev, t, names, f, n, stream, &kind);

	return ret ? ret : dl_wrap(c, dev, n, kind, stream);
}

/* After the enqueue (ret its code): libape's own queue waited for, everything released (on
 * failure ape_queue_destroy() waits for what was enqueued before it). */
static int dl_release(struct dl_call *c, int ret)
{
	if (!ret && c->queue && !c->queue->wrapped && (ret = ape_queue_synchronize(c->queue)))
		ape__error_prefix(ret, c->fn);
	ape_queue_destroy(c->queue);
	for (int i = 0; i < NT; i++)
		ape_buffer_free(c->wrap[i]);
	return ret;
}

/* Both forward calls: t[7] (q .. o required; lse, entropy, mean_distance NULL when not
 * wanted). */
static int forward_dlpack(const char *fn, ape_device *dev, const ape_attn_desc *desc,
			  const DLTensor *const t[7], void *stream)
{
	static const char *const names[7] = { "q", "k", "v", "o", "lse", "entropy",
					      "mean_distance" };
	static const struct dl_form *const forms[7] = { &F_BHLD, &F_BHLD, &F_BHLD, &F_BHLD,
							&F_BHL,	 &F_BHL,  &F_BHL };
	struct dl_call c = { .fn = fn };
	int ret;

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", c.fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", c.fn);
	for (int i = 0; i < APE_BE_T_LSE; i++)
		if (!t[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL", c.fn, names[i]);
	ret = dl_prepare(&c, dev, t, names, forms, 7, stream);
	if (!ret)
		ret = ape__attention_enqueue_diag(c.fn, c.queue, desc, c.dt[0], c.dt[1], c.dt[2],
						  c.dt[3], c.dt[4], c.dt[5], c.dt[6]);
	return dl_release(&c, ret);
}

int ape_attention_forward_dlpack(ape_device *dev, const ape_attn_desc *desc, const DLTensor *q,
				 const DLTensor *k, const DLTensor *v, DLTensor *o, DLTensor *lse,
				 void *stream)
{
	APE__API_CALL("ape_attention_forward_dlpack");
	const DLTensor *const t[7] = { q, k, v, o, lse, NULL, NULL };

	return forward_dlpack("ape_attention_forward_dlpack", dev, desc, t, stream);
}

int ape_attention_forward_dlpack_diag(ape_device *dev, const ape_attn_desc *desc,
				      const DLTensor *q, const DLTensor *k, const DLTensor *v,
				      DLTensor *o, DLTensor *lse, DLTensor *entropy,
				      DLTensor *mean_distance, void *stream)
{
	APE__API_CALL("ape_attention_forward_dlpack_diag");
	const DLTensor *const t[7] = { q, k, v, o, lse, entropy, mean_distance };

	return forward_dlpack("ape_attention_forward_dlpack_diag", dev, desc, t, stream);
}

/* Both backward calls' arguments present: dev, desc, the inputs (lse and dlse in their
 * enum ape__rb_tensor places), a gradient wanted. */
static int check_bwd_args(const char *fn, const ape_device *dev, const ape_attn_desc *desc,
			  const DLTensor *const *t)
{
	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", fn);
	return ape__check_bwd_present(fn, (const void *const *)t);
}

int ape_attention_backward_dlpack(ape_device *dev, const ape_attn_desc *desc, const DLTensor *q,
				  const DLTensor *k, const DLTensor *v, const DLTensor *o,
				  const DLTensor *lse, const DLTensor *dout, const DLTensor *dlse,
				  DLTensor *dq, DLTensor *dk, DLTensor *dv, DLTensor *dparams,
				  void *stream)
{
	APE__API_CALL("ape_attention_backward_dlpack");
	static const char *const names[APE__RB_COUNT] = { "q",	  "k",	"v",  "o",  "lse", "dout",
							  "dlse", "dq", "dk", "dv", "dparams" };
	static const struct dl_form *const forms[APE__RB_COUNT] = {
		&F_BHLD, &F_BHLD, &F_BHLD, &F_BHLD, &F_BHL, &F_BHLD,
		&F_BHL,	 &F_BHLD, &F_BHLD, &F_BHLD, &F_H4
	};
	const DLTensor *t[APE__RB_COUNT] = { q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams };
	struct dl_call c = { .fn = "ape_attention_backward_dlpack" };
	int ret;

	if ((ret = check_bwd_args(c.fn, dev, desc, t)))
		return ret;
	ret = dl_prepare(&c, dev, t, names, forms, APE__RB_COUNT, stream);
	if (!ret)
		ret = ape__attention_backward_enqueue(c.fn, c.queue, desc, c.dt);
	return dl_release(&c, ret);
}

/* ------------------------------------------------------------------ ragged batches */

/* What an axis of a ragged call's tensor must be: axis `axis` of tensor `of` (of >= 0), the
 * value `axis` (of == DIM_IS), anything (of == DIM_ANY). */
struct dl_dim {
	int of, axis;
};

enum { DIM_ANY = -2, DIM_IS = -1 };

#define ANY { DIM_ANY, 0 }
#define LIKE(t, a) { t, a }
#define LIKE_Q { LIKE(0, 0), LIKE(0, 1), LIKE(0, 2) }
#define LIKE_K { LIKE(1, 0), LIKE(1, 1), LIKE(1, 2) }
/* q, k, v, o, lse: the forward's, and the backward's first five */
#define RAGGED_FWD_DIMS                                                                           \
	{ ANY, ANY, ANY }, { ANY, ANY, LIKE(0, 2) }, LIKE_K, LIKE_Q, { LIKE(0, 0), LIKE(0, 1) }

/*
 * The shapes of a ragged call's n tensors (dl_read() done) against each other, in the DLPack
 * axes the caller sees ("o->shape[0] = 5: must be q->shape[0] = 6"), before the packed problem
 * is checked as a whole (its messages name the [1, H, total, D] axes); and the LSE-like forms
 * ([total_q, H], [H, 4]: floats the host calls take) float32.
 */
static int check_ragged(const struct dl_call *c, const struct dl_form *const *f,
			const struct dl_dim (*want)[3], int n)
{
	for (int i = 0; i < n; i++) {
		const struct dl_in *in = &c->in[i];

		if (!in->t)
			continue;
		if (f[i] != &F_THD && in->dtype != APE_F32)
			return ape__error(APE_EINVAL, "%s: %s->dtype = %s: must be float32", c->fn,
					  in->name, ape_dtype_name(in->dtype));
		for (int d = 0; d < f[i]->ndim; d++) {
			const struct dl_dim w = want[i][d];
			const int64_t got = in->t->shape[d];

			if (w.of == DIM_IS && got != w.axis)
				return ape__error(APE_EINVAL,
						  "%s: %s->shape[%d] = %" PRId64 ": must be %d (%s)",
						  c->fn, in->name, d, got, w.axis, f[i]->dims);
			if (w.of >= 0 && c->in[w.of].t && got != c->in[w.of].t->shape[w.axis])
				return ape__error(APE_EINVAL,
						  "%s: %s->shape[%d] = %" PRId64
						  ": must equal %s->shape[%d] = %" PRId64,
						  c->fn, in->name, d, got, c->in[w.of].name, w.axis,
						  c->in[w.of].t->shape[w.axis]);
		}
	}
	return 0;
}

/* A kDLCPU tensor as the host calls take it. */
static void host_tensor(const struct dl_in *in, ape_tensor *h)
{
	memset(h, 0, sizeof(*h));
	if (!in->t)
		return;
	h->data = in->t->data ? (unsigned char *)in->t->data + in->t->byte_offset : NULL;
	h->dtype = in->dtype;
	memcpy(h->shape, in->dt.shape, sizeof(h->shape));
	memcpy(h->strides, in->dt.strides, sizeof(h->strides));
}

/* Element (i, j) of a 2-D float32 kDLCPU tensor. */
static float *elem2(const struct dl_in *in, int64_t i, int64_t j)
{
	return (float *)((unsigned char *)in->t->data + in->t->byte_offset) + i * in->s[0] +
	       j * in->s[1];
}

/*
 * Tensor i of the call, 2-D float32 on kDLCPU (LSE [total_q, H], dparams [H, 4]), as the
 * row-major floats the host calls take: its own memory when laid out so, else *stage
 * (malloc'd, the caller frees it), filled from it for an input; an output (bit i of outs; the
 * others' bits say which they are) then has no two elements at one address and shares no byte
 * with another tensor of the call (the host call sees the stage, not it).
 */
static int host_floats(const struct dl_call *c, int n, int i, unsigned outs, float **out,
		       float **stage)
{
	static float none[1]; /* an empty tensor: nothing is read or written */
	const struct dl_in *in = &c->in[i];
	const int64_t *sh = in->t->shape, *s = in->s;
	const bool is_out = outs >> i & 1;

	*stage = NULL;
	if (in->empty) {
		*out = none;
		return 0;
	}
	if ((sh[1] <= 1 || s[1] == 1) && (sh[0] <= 1 || s[0] == sh[1])) {
		*out = elem2(in, 0, 0);
		return 0;
	}
	if (is_out) {
		const int a = s[0] <= s[1] ? 0 : 1, b = 1 - a; /* a: the smaller stride */
		const int64_t reach = sh[a] > 1 ? s[a] * sh[a] : 1;

		if ((sh[a] > 1 && s[a] < 1) || (sh[b] > 1 && s[b] < reach))
			return ape__error(APE_EINVAL,
					  "%s: %s->strides[%d] = %" PRId64
					  ": output elements would overlap (need >= %" PRId64 ")",
					  c->fn, in->name, sh[a] > 1 && s[a] < 1 ? a : b,
					  sh[a] > 1 && s[a] < 1 ? s[a] : s[b],
					  sh[a] > 1 && s[a] < 1 ? 1 : reach);
	}
	for (int j = 0; j < n; j++) {
		const struct dl_in *x = &c->in[j];
		const uintptr_t ri[2] = { in->lo, in->hi }, rx[2] = { x->lo, x->hi };
		int ret = 0;

		if (j == i || !x->t || x->empty)
			continue;
		if (is_out)
			ret = ape__check_disjoint(c->fn, in->name, ri, x->name, rx);
		else if (outs >> j & 1)
			ret = ape__check_disjoint(c->fn, x->name, rx, in->name, ri);
		if (ret)
			return ret;
	}
	if (!(*stage = malloc((size_t)(sh[0] * sh[1]) * sizeof(float))))
		return ape__error(APE_ENOMEM, "%s: %s: out of memory for %" PRId64 " floats", c->fn,
				  in->name, sh[0] * sh[1]);
	for (int64_t r = 0; !is_out && r < sh[0]; r++)
		for (int64_t e = 0; e < sh[1]; e++)
			(*stage)[r * sh[1] + e] = *elem2(in, r, e);
	*out = *stage;
	return 0;
}

/* A staged output (host_floats()) written back to its tensor; none: nothing to do. */
static void host_floats_publish(const struct dl_in *in, const float *stage)
{
	for (int64_t r = 0; stage && r < in->t->shape[0]; r++)
		for (int64_t e = 0; e < in->t->shape[1]; e++)
			*elem2(in, r, e) = stage[r * in->t->shape[1] + e];
}

/* A message of the packed problem's own checks (the host calls', the resident call's) that names
 * an axis names one of the [1, H, total, D] views the tensors are described as: says so. */
static int view_axes_note(int ret)
{
	const char *m = ape_last_error();

	if (ret == APE_EINVAL && (strstr(m, "->shape[") || strstr(m, "->strides[")))
		return ape__error_suffix(ret, " (axes of the [1, H, total, D] view of a packed "
					      "[total, H, D] tensor: 2 is total, 3 is D)");
	return ret;
}

int ape_attention_forward_varlen_dlpack(ape_device *dev, const ape_attn_desc *desc,
					const ape_varlen *vl, const DLTensor *q, const DLTensor *k,
					const DLTensor *v, DLTensor *o, DLTensor *lse, void *stream)
{
	APE__API_CALL("ape_attention_forward_varlen_dlpack");
	static const char *const names[5] = { "q", "k", "v", "o", "lse" };
	static const struct dl_form *const forms[5] = { &F_THD, &F_THD, &F_THD, &F_THD, &F_TH };
	static const struct dl_dim want[5][3] = { RAGGED_FWD_DIMS };
	const DLTensor *const t[5] = { q, k, v, o, lse };
	struct dl_call c = { .fn = "ape_attention_forward_varlen_dlpack" };
	int kind, ret;

	if (!dev)
		return ape__error(APE_EINVAL, "%s: dev = NULL", c.fn);
	if (!desc)
		return ape__error(APE_EINVAL, "%s: desc = NULL", c.fn);
	for (int i = 0; i < 4; i++)
		if (!t[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL", c.fn, names[i]);
	if ((ret = dl_read(&c, dev, t, names, forms, 5, stream, &kind)) ||
	    (ret = check_ragged(&c, forms, want, 5)))
		return ret;
	if (kind == APE_BE_MEM_HOST) {
		ape_tensor h[4];
		float *l = NULL, *stage = NULL;

		for (int i = 0; i < 4; i++)
			host_tensor(&c.in[i], &h[i]);
		if (lse && (ret = host_floats(&c, 5, 4, 1u << 3 | 1u << 4, &l, &stage)))
			return ret;
		ret = ape__attention_forward_varlen(c.fn, &dev, 1, NULL, desc, vl, &h[0], &h[1],
						    &h[2], &h[3], l, NULL);
		if ((ret = view_axes_note(ret)) == 0)
			host_floats_publish(&c.in[4], stage);
		free(stage);
		return ret;
	}
	ret = dl_wrap(&c, dev, 5, kind, stream);
	if (!ret)
		ret = view_axes_note(ape__attention_enqueue_varlen(c.fn, c.queue, desc, vl, c.dt[0],
								   c.dt[1], c.dt[2], c.dt[3],
								   c.dt[4]));
	return dl_release(&c, ret);
}

int ape_attention_backward_varlen_dlpack(ape_device *dev, const ape_attn_desc *desc,
					 const ape_varlen *vl, const DLTensor *q,
					 const DLTensor *k, const DLTensor *v, const DLTensor *o,
					 const DLTensor *lse, const DLTensor *dout,
					 const DLTensor *dlse, DLTensor *dq, DLTensor *dk,
					 DLTensor *dv, DLTensor *dparams, void *stream)
{
	APE__API_CALL("ape_attention_backward_varlen_dlpack");
	static const char *const names[APE__RB_COUNT] = { "q",	  "k",	"v",  "o",  "lse", "dout",
							  "dlse", "dq", "dk", "dv", "dparams" };
	static const struct dl_form *const forms[APE__RB_COUNT] = {
		&F_THD, &F_THD, &F_THD, &F_THD, &F_TH, &F_THD, &F_TH, &F_THD, &F_THD, &F_THD, &F_H4
	};
	static const struct dl_dim want[APE__RB_COUNT][3] = {
		RAGGED_FWD_DIMS,	       LIKE_Q, { LIKE(0, 0), LIKE(0, 1) }, LIKE_Q, LIKE_K,
		LIKE_K,			       { LIKE(0, 1), { DIM_IS, 4 } }
	};
	static const unsigned outs = 1u << APE__RB_DQ | 1u << APE__RB_DK | 1u << APE__RB_DV |
				     1u << APE__RB_DPARAMS;
	const DLTensor *t[APE__RB_COUNT] = { q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams };
	struct dl_call c = { .fn = "ape_attention_backward_varlen_dlpack" };
	ape_tensor h[APE__RB_COUNT];
	float *f[APE__RB_COUNT] = { NULL }, *stage[APE__RB_COUNT] = { NULL };
	int kind, ret;

	if ((ret = check_bwd_args(c.fn, dev, desc, t)))
		return ret;
	if ((ret = dl_read(&c, dev, t, names, forms, APE__RB_COUNT, stream, &kind)) ||
	    (ret = check_ragged(&c, forms, want, APE__RB_COUNT)))
		return ret;
	if (kind != APE_BE_MEM_HOST) {
		ret = dl_wrap(&c, dev, APE__RB_COUNT, kind, stream);
		if (!ret)
			ret = view_axes_note(
				ape__attention_backward_enqueue_varlen(c.fn, c.queue, desc, vl, c.dt));
		return dl_release(&c, ret);
	}
	for (int i = 0; i < APE__RB_COUNT; i++) {
		if (forms[i] == &F_THD)
			host_tensor(&c.in[i], &h[i]);
		else if (t[i] && (ret = host_floats(&c, APE__RB_COUNT, i, outs, &f[i], &stage[i])))
			goto out;
	}
	ret = ape__attention_backward_varlen(c.fn, &dev, 1, NULL, desc, vl, &h[0], &h[1], &h[2],
					     &h[3], f[APE__RB_LSE], &h[APE__RB_DOUT],
					     f[APE__RB_DLSE], dq ? &h[APE__RB_DQ] : NULL,
					     dk ? &h[APE__RB_DK] : NULL, dv ? &h[APE__RB_DV] : NULL,
					     f[APE__RB_DPARAMS], NULL);
	if ((ret = view_axes_note(ret)) == 0 && dparams)
		host_floats_publish(&c.in[APE__RB_DPARAMS], stage[APE__RB_DPARAMS]);
out:
	for (int i = 0; i < APE__RB_COUNT; i++)
		free(stage[i]);
	return ret;
}

/* ------------------------------------------------------------------ the caller's KV pages */

/* view_axes_note(), and for a message about the pages the axes of their view. */
static int pages_axes_note(int ret)
{
	const char *m = ape_last_error();

	if (ret == APE_EINVAL && (strstr(m, "k_pages->s") || strstr(m, "v_pages->s")))
		return ape__error_suffix(ret, " (axes of the [num_pages, Hkv, page_tokens, D] view "
					      "of the [num_pages, page_tokens, Hkv, D] tensor: 1 is "
					      "Hkv, 2 is page_tokens)");
	return view_axes_note(ret);
}

int ape_paged_kv_run_dlpack(ape_paged_kv *pk, const ape_attn_desc *desc,
			    const DLTensor *k_pages, const DLTensor *v_pages, const DLTensor *q,
			    DLTensor *o, DLTensor *lse)
{
	APE__API_CALL("ape_paged_kv_run_dlpack");
	static const char *const pnames[2] = { "k_pages", "v_pages" };
	static const char *const hnames[3] = { "q", "o", "lse" };
	static const struct dl_form *const pforms[2] = { &F_PAGES, &F_PAGES };
	static const struct dl_form *const hforms[3] = { &F_THD, &F_THD, &F_TH };
	static const struct dl_dim want[3][3] = { { ANY, ANY, ANY }, LIKE_Q,
						  { LIKE(0, 0), LIKE(0, 1) } };
	const DLTensor *const pt[2] = { k_pages, v_pages }, *const ht[3] = { q, o, lse };
	struct dl_call pc = { .fn = "ape_paged_kv_run_dlpack" };
	struct dl_call hc = { .fn = "ape_paged_kv_run_dlpack" };
	ape_device *dev;
	ape_tensor hq, ho;
	float *l = NULL, *stage = NULL;
	int kind, ret;

	if (!pk)
		return ape__error(APE_EINVAL, "%s: pk = NULL", pc.fn);
	for (int i = 0; i < 2; i++)
		if (!pt[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL", pc.fn, pnames[i]);
	for (int i = 0; i < 2; i++)
		if (!ht[i])
			return ape__error(APE_EINVAL, "%s: %s = NULL", pc.fn, hnames[i]);
	dev = ape__paged_kv_device(pk);
	/* the queries and outputs: host memory, as ape_paged_kv_run() takes them */
	if ((ret = dl_read(&hc, dev, ht, hnames, hforms, 3, NULL, &kind)) ||
	    (ret = check_ragged(&hc, hforms, want, 3)))
		return ret;
	if (kind != APE_BE_MEM_HOST)
		return ape__error(APE_ENOTSUP,
				  "%s: q->device = (%s, %d): the queries and outputs are host memory "
				  "(kDLCPU); the pages may be device memory",
				  hc.fn, devtype_name((int)q->device.device_type),
				  q->device.device_id);
	host_tensor(&hc.in[0], &hq);
	host_tensor(&hc.in[1], &ho);
	if (lse && (ret = host_floats(&hc, 3, 2, 1u << 1 | 1u << 2, &l, &stage)))
		return ret;
	/* the pages: wherever the object's device reads them (one wrapper where they share
	 * memory: FlashInfer's K and V halves of one buffer) */
	ret = dl_read(&pc, dev, pt, pnames, pforms, 2, NULL, &kind);
	if (!ret) /* no queue: the run makes its own (the object's session) */
		ret = dl_wrap_mem(&pc, dev, 2, kind);
	if (!ret)
		ret = pages_axes_note(ape__paged_kv_run(pk, pc.fn, desc, pc.dt[0], pc.dt[1], &hq,
							 &ho, l));
	ret = dl_release(&pc, ret);
	if (!ret && lse)
		host_floats_publish(&hc.in[2], stage);
	free(stage);
	return ret;
}
