/* SPDX-License-Identifier: MIT */
/*
 * The core's table of one backend's ops (core/backend.h, "Registration"), in the manner of
 * libuv's uv-common.c and PoCL's devices/common.c: what every backend would otherwise write
 * around each op, written once. A trampoline per fallible op finds the device (the op's own
 * argument, or the first member of its queue or event), calls the backend's op and, when it
 * fails, puts the device and the op in front of the message the backend set
 * ("opencl:0 NAME (pci): copy_h2d: clEnqueueWriteBuffer (64 bytes): CL_OUT_OF_RESOURCES (-5)").
 * Ops that cannot fail are called as they are. Before any of it, the table is checked.
 * The kernel launches and the copies each run inside an NVTX range named after the op
 * ("attention", "copy_h2d", ...; core/nvtx.h), opened and closed on the calling thread around
 * the backend's op alone: free unless a tool is attached, compiled out without WITH_NVTX.
 */
#include "core/ops.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "core/nvtx.h"

/* The backend's own table behind a device, a queue or an event. */
static const struct ape_backend_plugin *raw_of(const struct ape_device *dev)
{
	return dev->be->raw;
}

static const struct ape_backend_plugin *queue_raw(const struct ape_be_queue *q)
{
	return raw_of(ape_be_queue_dev(q));
}

static const struct ape_backend_plugin *event_raw(const struct ape_be_event *e)
{
	return raw_of(ape_be_event_dev(e));
}

/* err of op, on the device of queue q or of event e: named (ape__op_error()) unless 0. */
static int named_q(int err, const struct ape_be_queue *q, const char *op)
{
	return err ? ape__op_error(err, ape_be_queue_dev(q), op) : 0;
}

static int named_e(int err, const struct ape_be_event *e, const char *op)
{
	return err ? ape__op_error(err, ape_be_event_dev(e), op) : 0;
}

/* The op's code, once the NVTX range opened before it is closed (the op is called first: an
 * argument is evaluated before the call). */
static int ranged(int err)
{
	ape__nvtx_pop();
	return err;
}

/* ------------------------------------------------------------------ ops on a device */

static int core_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	return ape__op_error(raw_of(dev)->buf_alloc(dev, bytes, out), dev, "buf_alloc");
}

static int core_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	return ape__op_error(raw_of(dev)->queue_create(dev, out), dev, "queue_create");
}

static int core_host_register(struct ape_device *dev, void *ptr, size_t bytes, void **handle)
{
	return ape__op_error(raw_of(dev)->host_register(dev, ptr, bytes, handle), dev,
			     "host_register");
}

static int core_buf_wrap(struct ape_device *dev, int kind, void *handle, size_t bytes,
			 struct ape_be_buf **out, size_t *bytes_out)
{
	return ape__op_error(raw_of(dev)->buf_wrap(dev, kind, handle, bytes, out, bytes_out), dev,
			     "buf_wrap");
}

static int core_queue_wrap(struct ape_device *dev, void *handle, struct ape_be_queue **out)
{
	return ape__op_error(raw_of(dev)->queue_wrap(dev, handle, out), dev, "queue_wrap");
}

/* ------------------------------------------------------------------ ops on a queue */

static int core_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, const void *src,
			 size_t n)
{
	ape__nvtx_push("copy_h2d");
	return named_q(ranged(queue_raw(q)->copy_h2d(q, dst, off, src, n)), q, "copy_h2d");
}

static int core_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off,
			 size_t n)
{
	ape__nvtx_push("copy_d2h");
	return named_q(ranged(queue_raw(q)->copy_d2h(q, dst, src, off, n)), q, "copy_d2h");
}

static int core_copy_d2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t dst_off,
			 struct ape_be_buf *src, size_t src_off, size_t n)
{
	ape__nvtx_push("copy_d2d");
	return named_q(ranged(queue_raw(q)->copy_d2d(q, dst, dst_off, src, src_off, n)), q,
		       "copy_d2d");
}

static int core_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off, uint32_t pattern,
		     size_t n)
{
	return named_q(queue_raw(q)->fill(q, dst, off, pattern, n), q, "fill");
}

static int core_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	return named_q(queue_raw(q)->event_record(q, out), q, "event_record");
}

static int core_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	return named_q(queue_raw(q)->event_wait(q, e), q, "event_wait");
}

static int core_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	ape__nvtx_push("attention");
	return named_q(ranged(queue_raw(q)->attention(q, l)), q, "attention");
}

static int core_synchronize(struct ape_be_queue *q)
{
	return named_q(queue_raw(q)->synchronize(q), q, "synchronize");
}

/*
 * ABI 1.0's backward launch, for a plugin built against it: the forward launch as 1.0 had it
 * (every member before bias_table: 1.1 appended to struct ape_be_launch, which the backward
 * launch embeds first), then 1.0's backward members (no dbias). The core never gives such a
 * plugin a table (it cannot say APE_BE_CAP_BIAS_TABLE), so nothing is lost in the copy.
 */
struct bwd_launch_1_0 {
	_Alignas(struct ape_be_launch) unsigned char f[offsetof(struct ape_be_launch, bias_table)];
	ape_dtype dout_dtype;
	struct ape_be_buf *dout, *dlse, *dq, *dk, *dv, *dparams;
};
_Static_assert(offsetof(struct ape_be_launch, bias_table) % _Alignof(struct ape_be_launch) == 0,
	       "ABI 1.0's struct ape_be_launch ended where bias_table begins");

static const struct ape_be_bwd_launch *bwd_launch_for(const struct ape_backend_plugin *t,
						      const struct ape_be_bwd_launch *l,
						      struct bwd_launch_1_0 *old)
{
	if (t->abi_minor >= 1)
		return l;
	memcpy(old->f, &l->f, sizeof(old->f));
	old->dout_dtype = l->dout_dtype;
	old->dout = l->dout;
	old->dlse = l->dlse;
	old->dq = l->dq;
	old->dk = l->dk;
	old->dv = l->dv;
	old->dparams = l->dparams;
	return (const struct ape_be_bwd_launch *)(const void *)old;
}

static int core_attention_backward(struct ape_be_queue *q, const struct ape_be_bwd_launch *l)
{
	struct bwd_launch_1_0 old;

	ape__nvtx_push("attention_backward");
	return named_q(ranged(queue_raw(q)->attention_backward(
			       q, bwd_launch_for(queue_raw(q), l, &old))),
		       q, "attention_backward");
}

static uint64_t core_attention_backward_scratch(struct ape_device *dev,
						const struct ape_be_bwd_launch *l, unsigned parts)
{
	struct bwd_launch_1_0 old;

	return raw_of(dev)->attention_backward_scratch(dev, bwd_launch_for(raw_of(dev), l, &old),
						       parts);
}

static int core_scratch_alloc(struct ape_be_queue *q, size_t bytes, struct ape_be_buf **out)
{
	return named_q(queue_raw(q)->scratch_alloc(q, bytes, out), q, "scratch_alloc");
}

static int core_scratch_free(struct ape_be_queue *q, struct ape_be_buf *buf)
{
	return named_q(queue_raw(q)->scratch_free(q, buf), q, "scratch_free");
}

static int core_copy_view(struct ape_be_queue *q, const struct ape_be_copy *c)
{
	return named_q(queue_raw(q)->copy_view(q, c), q, "copy_view");
}

static int core_attention_merge(struct ape_be_queue *q, const struct ape_be_merge *m)
{
	ape__nvtx_push("attention_merge");
	return named_q(ranged(queue_raw(q)->attention_merge(q, m)), q, "attention_merge");
}

/* ------------------------------------------------------------------ ops on an event */

static int core_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	return named_e(event_raw(start)->event_elapsed(start, end, ms), start, "event_elapsed");
}

static int core_event_timestamp(struct ape_be_event *e, double *ms)
{
	return named_e(event_raw(e)->event_timestamp(e, ms), e, "event_timestamp");
}

/* ------------------------------------------------------------------ checks */

/* An op of a table, by name, and whether the table sets it. */
struct op_set {
	const char *name;
	bool set;
};

#define OP(t, op) { #op, (t)->op != NULL }

/* "refused: " and the reason, in why; returns APE_EBACKEND. */
static int refuse(char *why, size_t cap, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int refuse(char *why, size_t cap, const char *fmt, ...)
{
	const int n = snprintf(why, cap, "refused: ");
	va_list ap;

	if (n >= 0 && (size_t)n < cap) {
		va_start(ap, fmt);
		vsnprintf(why + n, cap - (size_t)n, fmt, ap);
		va_end(ap);
	}
	return APE_EBACKEND;
}

/* The first op of ops[0..n) not set, or NULL. */
static const char *first_missing(const struct op_set *ops, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!ops[i].set)
			return ops[i].name;
	return NULL;
}

/* A group of n ops that comes all or none: NULL, or the first one missing beside another set. */
static const char *group_gap(const struct op_set *ops, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (ops[i].set)
			return first_missing(ops, n);
	return NULL;
}

/* Every op of this header's table by name, where it lies: what a table shorter than this one
 * (an older minor) is completed from, through its proc_address. */
#define OP_AT(op) { #op, offsetof(struct ape_backend_plugin, op) }
static const struct {
	const char *name;
	size_t off;
} op_at[] = {
	OP_AT(probe),	     OP_AT(teardown),	       OP_AT(device_release),
	OP_AT(native),	     OP_AT(buf_alloc),	       OP_AT(buf_free),
	OP_AT(buf_wrap),     OP_AT(host_register),     OP_AT(host_unregister),
	OP_AT(queue_create), OP_AT(queue_destroy),     OP_AT(queue_wrap),
	OP_AT(synchronize),  OP_AT(copy_h2d),	       OP_AT(copy_d2h),
	OP_AT(copy_d2d),     OP_AT(fill),	       OP_AT(event_record),
	OP_AT(event_wait),   OP_AT(event_elapsed),     OP_AT(event_timestamp),
	OP_AT(event_destroy), OP_AT(attention),	       OP_AT(attention_scratch),
	OP_AT(attention_merge), OP_AT(attention_backward), OP_AT(attention_backward_scratch),
	OP_AT(scratch_alloc), OP_AT(scratch_free),     OP_AT(copy_view),
	OP_AT(attention_pages), OP_AT(proc_address),
};

/* A table's name: [a-z0-9_], 1 to 15 characters. */
static bool good_name(const char *name)
{
	size_t n = 0;

	if (!name)
		return false;
	for (; name[n]; n++)
		if (n >= 15 || !((name[n] >= 'a' && name[n] <= 'z') ||
				 (name[n] >= '0' && name[n] <= '9') || name[n] == '_'))
			return false;
	return n > 0;
}

/*
 * The table as this library reads it, into *own: the ABI checked (the major equal, the minor
 * not newer, struct_size covering the four members every ABI begins with), the members
 * struct_size covers copied, the ops beyond it asked of the table's proc_address by name (when
 * the table has one within its size) and NULL otherwise.
 */
static int complete_table(const struct ape_backend_plugin *t, struct ape_backend_plugin *own,
			  char *why, size_t cap)
{
	const size_t head = offsetof(struct ape_backend_plugin, name) + sizeof(t->name);
	const size_t pa_end = offsetof(struct ape_backend_plugin, proc_address) +
			      sizeof(t->proc_address);

	if (t->abi_major != APE_BACKEND_ABI_MAJOR)
		return refuse(why, cap,
			      "backend ABI %u.%u: this libape takes major %d only (backend ABI %d.%d)",
			      t->abi_major, t->abi_minor, APE_BACKEND_ABI_MAJOR,
			      APE_BACKEND_ABI_MAJOR, APE_BACKEND_ABI_MINOR);
	if (t->abi_minor > APE_BACKEND_ABI_MINOR)
		return refuse(why, cap,
			      "backend ABI %u.%u is newer than this libape's %d.%d: it may rely on "
			      "what this library does not do",
			      t->abi_major, t->abi_minor, APE_BACKEND_ABI_MAJOR,
			      APE_BACKEND_ABI_MINOR);
	if (t->struct_size < head)
		return refuse(why, cap,
			      "struct_size %zu is shorter than the %zu bytes every table begins "
			      "with (abi_major, abi_minor, struct_size, name)",
			      t->struct_size, head);
	memset(own, 0, sizeof(*own));
	memcpy(own, t, t->struct_size < sizeof(*own) ? t->struct_size : sizeof(*own));
	own->struct_size = sizeof(*own);
	if (t->struct_size >= sizeof(*own))
		return 0;
	/* an older minor's table: the later ops by name, if it can say */
	if (t->struct_size < pa_end)
		own->proc_address = NULL;
	for (size_t i = 0; i < sizeof(op_at) / sizeof(op_at[0]); i++) {
		void *fn;

		if (op_at[i].off < t->struct_size || !own->proc_address)
			continue;
		fn = own->proc_address(op_at[i].name);
		memcpy((char *)own + op_at[i].off, &fn, sizeof(fn));
	}
	return 0;
}

static int check_table(const struct ape_backend_plugin *t, char *why, size_t cap)
{
	const struct op_set required[] = {
		OP(t, probe),	     OP(t, buf_alloc),	  OP(t, buf_free),    OP(t, queue_create),
		OP(t, queue_destroy), OP(t, copy_h2d),	  OP(t, copy_d2h),    OP(t, fill),
		OP(t, event_record), OP(t, event_wait),	  OP(t, event_elapsed),
		OP(t, event_destroy), OP(t, attention),	  OP(t, synchronize),
	};
	const struct op_set scratch[] = { OP(t, scratch_alloc), OP(t, scratch_free),
					  OP(t, copy_view) };
	const struct op_set pinning[] = { OP(t, host_register), OP(t, host_unregister) };
	const char *op;

	if (!good_name(t->name))
		return refuse(why, cap,
			      "backend name \"%.32s\": must be 1 to 15 characters of [a-z0-9_]",
			      t->name ? t->name : "(null)");
	if ((op = first_missing(required, sizeof(required) / sizeof(required[0]))))
		return refuse(why, cap, "required op %s is missing", op);
	if ((op = group_gap(scratch, sizeof(scratch) / sizeof(scratch[0]))))
		return refuse(why, cap,
			      "scratch_alloc, scratch_free and copy_view come all or none: %s is "
			      "missing",
			      op);
	if ((op = group_gap(pinning, sizeof(pinning) / sizeof(pinning[0]))))
		return refuse(why, cap,
			      "host_register and host_unregister come both or neither: %s is "
			      "missing",
			      op);
	return 0;
}

int ape__backend_bind(struct ape_backend *be, const struct ape_backend_plugin *table, char *why,
		      size_t cap)
{
	struct ape_backend_plugin *t = &be->table, *raw = &be->own;
	int ret = complete_table(table, raw, why, cap);

	if (!ret)
		ret = check_table(raw, why, cap);
	if (ret)
		return ret;
	*t = *raw; /* the ops that cannot fail as they are, and NULL where raw has no op */
	t->buf_alloc = raw->buf_alloc ? core_buf_alloc : NULL;
	t->queue_create = raw->queue_create ? core_queue_create : NULL;
	t->copy_h2d = raw->copy_h2d ? core_copy_h2d : NULL;
	t->copy_d2h = raw->copy_d2h ? core_copy_d2h : NULL;
	t->fill = raw->fill ? core_fill : NULL;
	t->event_record = raw->event_record ? core_event_record : NULL;
	t->event_wait = raw->event_wait ? core_event_wait : NULL;
	t->event_elapsed = raw->event_elapsed ? core_event_elapsed : NULL;
	t->attention = raw->attention ? core_attention : NULL;
	t->synchronize = raw->synchronize ? core_synchronize : NULL;
	t->host_register = raw->host_register ? core_host_register : NULL;
	t->copy_d2d = raw->copy_d2d ? core_copy_d2d : NULL;
	t->event_timestamp = raw->event_timestamp ? core_event_timestamp : NULL;
	t->attention_backward = raw->attention_backward ? core_attention_backward : NULL;
	t->attention_backward_scratch =
		raw->attention_backward_scratch ? core_attention_backward_scratch : NULL;
	t->buf_wrap = raw->buf_wrap ? core_buf_wrap : NULL;
	t->queue_wrap = raw->queue_wrap ? core_queue_wrap : NULL;
	t->scratch_alloc = raw->scratch_alloc ? core_scratch_alloc : NULL;
	t->scratch_free = raw->scratch_free ? core_scratch_free : NULL;
	t->copy_view = raw->copy_view ? core_copy_view : NULL;
	t->attention_merge = raw->attention_merge ? core_attention_merge : NULL;
	be->raw = raw;
	be->ops = t;
	return 0;
}

int ape__device_check(const struct ape_device *dev, char *why, size_t cap)
{
	const struct ape_be_caps *c = &dev->caps;
	const struct ape_backend_plugin *t = dev->be->raw;
#define HAS(bit) ape_be_caps_have(c, APE_BE_CAP_##bit)
	/* each capability claimed, and what it needs */
	const struct {
		uint64_t cap;
		struct op_set needs;
	} rules[] = {
		{ APE_BE_CAP_HOST_MEMORY, OP(t, buf_wrap) },
		{ APE_BE_CAP_DIAG_VIEWS, { "diag", HAS(DIAG) } },
		{ APE_BE_CAP_POSITIONS, { "segments", HAS(SEGMENTS) } },
		{ APE_BE_CAP_BACKWARD, OP(t, attention_backward) },
		{ APE_BE_CAP_RESIDENT_BACKWARD, { "backward", HAS(BACKWARD) } },
		{ APE_BE_CAP_RESIDENT_BACKWARD,
		  { "scratch_alloc, scratch_free and copy_view", t->scratch_alloc != NULL } },
		{ APE_BE_CAP_TIMESTAMPS, OP(t, event_timestamp) },
		{ APE_BE_CAP_BWD_SEGMENTS, { "backward", HAS(BACKWARD) } },
		{ APE_BE_CAP_BWD_SEGMENTS, { "segments", HAS(SEGMENTS) } },
		{ APE_BE_CAP_BWD_VIEWS, { "backward", HAS(BACKWARD) } },
	};

#undef HAS
	if (c->features & ~APE_BE_CAP_ALL)
		return refuse(why, cap,
			      "device %.100s: capability bits 0x%llx unknown to this libape (backend "
			      "ABI %d.%d)",
			      dev->info.name, (unsigned long long)(c->features & ~APE_BE_CAP_ALL),
			      APE_BACKEND_ABI_MAJOR, APE_BACKEND_ABI_MINOR);
	for (size_t i = 0; i < sizeof(rules) / sizeof(rules[0]); i++)
		if (ape_be_caps_have(c, rules[i].cap) && !rules[i].needs.set)
			return refuse(why, cap, "device %.100s: capability %s without %s",
				      dev->info.name, ape_be_cap_name(rules[i].cap),
				      rules[i].needs.name);
	return 0;
}
