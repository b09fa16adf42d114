/* SPDX-License-Identifier: MIT */
/*
 * The backend plugins tests/test_plugins.c and the fault and thread tests load
 * (tests/module.mk builds one shared object per variant, FIXTURE_* chosen by -D): a minimal
 * backend of one device on host memory, with a synchronous queue, that registers and probes
 * like any backend but computes nothing (its attention fails with APE_ENOTSUP: no test
 * computes on it; examples/backend-plugin/ is the plugin that computes), and variants that
 * libape must refuse or limit, each for its own reason:
 *
 *   FIXTURE_NAME="x"       the backend name (default "plug_a")
 *   FIXTURE_MAJOR          states backend ABI 2.0
 *   FIXTURE_NO_ATTENTION   leaves the required op attention out
 *   FIXTURE_SHORT          states struct_size 20 (shorter than the four members of every ABI)
 *   FIXTURE_NO_DEVICE      its probe adds no device, and says why
 *   FIXTURE_PROBE_FAILS    its probe fails with APE_EBACKEND and a message (ape_be_error())
 *   FIXTURE_BAD_CAPS       its device claims the backward pass without attention_backward
 *   FIXTURE_NULL_TABLE     its entry point returns NULL
 *   FIXTURE_NO_SYMBOL      exports no entry point
 *
 * It links libape (-lape) like a vendor's plugin; in a program that carries libape itself (the
 * tests link the static library and export its API), the loader binds these calls to the
 * program's copy. Its host memory comes from ape_be_calloc() and friends, so that fault
 * injection reaches it. Its extra "fixture_answer" (ape_backend_get_proc()) returns 42.
 */
#include <stdio.h>
#include <string.h>

#include "ape/ape_backend.h"

#ifndef FIXTURE_NAME
#define FIXTURE_NAME "plug_a"
#endif
#ifdef FIXTURE_MAJOR
#define FIXTURE_ABI_MAJOR 2
#else
#define FIXTURE_ABI_MAJOR APE_BACKEND_ABI_MAJOR
#endif
#ifdef FIXTURE_SHORT
#define FIXTURE_STRUCT_SIZE 20
#else
#define FIXTURE_STRUCT_SIZE sizeof(struct ape_backend_plugin)
#endif

struct ape_be_buf {
	size_t bytes;
	unsigned char *p;
};

struct ape_be_queue {
	struct ape_device *dev; /* first: the contract's */
};

struct ape_be_event {
	struct ape_device *dev; /* first: the contract's */
	double ms; /* when it was recorded: the queue is synchronous */
};

/* The backend's own state: proof that teardown runs once per probe. */
struct fixture_state {
	int devices_live;
};

static int fixture_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
#if defined(FIXTURE_NO_DEVICE)
	(void)be;
	snprintf(res->reason, sizeof(res->reason), "plugin fixture: no device on purpose");
	return 0;
#elif defined(FIXTURE_PROBE_FAILS)
	(void)be;
	(void)res;
	return ape_be_error(APE_EBACKEND, "plugin fixture: probe fails on purpose");
#else
	struct fixture_state *st = ape_be_calloc(1, sizeof(*st));
	struct ape_device_info info;
	struct ape_be_caps caps = { 0, 0 };
	int ret;

	(void)res;
	if (!st)
		return ape_be_error(APE_ENOMEM, "plugin fixture: out of memory");
	ape_be_set_priv(be, st);
	memset(&info, 0, sizeof(info));
	snprintf(info.name, sizeof(info.name), "fixture device of %s", FIXTURE_NAME);
	snprintf(info.vendor, sizeof(info.vendor), "libape tests");
	snprintf(info.driver_version, sizeof(info.driver_version), "fixture 1");
	info.kind = APE_DEVICE_ACCELERATOR;
	info.compute_units = 1;
	info.global_mem_bytes = 1u << 30;
#ifdef FIXTURE_BAD_CAPS
	caps.features = APE_BE_CAP_BACKWARD;
#endif
	/* below the reference's 0: "auto" never picks it over the devices of the built-ins */
	ret = ape_be_device_add(be, &info, &caps, -10, NULL);
	if (!ret)
		st->devices_live++;
	return ret;
#endif
}

static void fixture_teardown(struct ape_backend *be)
{
	ape_be_free(ape_be_priv(be));
	ape_be_set_priv(be, NULL);
}

static void fixture_device_release(struct ape_device *dev)
{
	struct fixture_state *st = ape_be_priv(dev->be);

	if (st)
		st->devices_live--;
}

static int fixture_buf_alloc(struct ape_device *dev, size_t bytes, struct ape_be_buf **out)
{
	struct ape_be_buf *b = ape_be_calloc(1, sizeof(*b));

	(void)dev;
	*out = NULL;
	if (!b || ape_be_posix_memalign((void **)&b->p, 64, bytes)) {
		ape_be_free(b);
		return ape_be_error(APE_ENOMEM, "plugin fixture: %zu bytes", bytes);
	}
	b->bytes = bytes;
	*out = b;
	return 0;
}

static void fixture_buf_free(struct ape_device *dev, struct ape_be_buf *buf)
{
	(void)dev;
	if (buf)
		ape_be_free(buf->p);
	ape_be_free(buf);
}

static int fixture_queue_create(struct ape_device *dev, struct ape_be_queue **out)
{
	*out = ape_be_calloc(1, sizeof(**out));
	if (!*out)
		return ape_be_error(APE_ENOMEM, "plugin fixture: a queue");
	(*out)->dev = dev;
	return 0;
}

static void fixture_queue_destroy(struct ape_be_queue *q)
{
	ape_be_free(q);
}

static int fixture_synchronize(struct ape_be_queue *q)
{
	(void)q;
	return 0;
}

static int fixture_copy_h2d(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off,
			    const void *src, size_t n)
{
	(void)q;
	memcpy(dst->p + off, src, n);
	return 0;
}

static int fixture_copy_d2h(struct ape_be_queue *q, void *dst, struct ape_be_buf *src, size_t off,
			    size_t n)
{
	(void)q;
	memcpy(dst, src->p + off, n);
	return 0;
}

static int fixture_fill(struct ape_be_queue *q, struct ape_be_buf *dst, size_t off,
			uint32_t pattern, size_t n)
{
	(void)q;
	for (size_t i = 0; i < n; i += 4)
		memcpy(dst->p + off + i, &pattern, 4);
	return 0;
}

static int fixture_event_record(struct ape_be_queue *q, struct ape_be_event **out)
{
	*out = ape_be_calloc(1, sizeof(**out));
	if (!*out)
		return ape_be_error(APE_ENOMEM, "plugin fixture: an event");
	(*out)->dev = q->dev;
	(*out)->ms = ape_be_now_ms();
	return 0;
}

static int fixture_event_wait(struct ape_be_queue *q, struct ape_be_event *e)
{
	(void)q;
	(void)e;
	return 0;
}

static int fixture_event_elapsed(struct ape_be_event *start, struct ape_be_event *end, double *ms)
{
	*ms = end->ms > start->ms ? end->ms - start->ms : 0;
	return 0;
}

static void fixture_event_destroy(struct ape_be_event *e)
{
	ape_be_free(e);
}

#ifndef FIXTURE_NO_ATTENTION
static int fixture_attention(struct ape_be_queue *q, const struct ape_be_launch *l)
{
	(void)q;
	(void)l;
	return ape_be_error(APE_ENOTSUP, "plugin fixture: computes nothing");
}
#endif

/* The extra ape_backend_get_proc() finds. */
static int fixture_answer(void)
{
	return 42;
}

static void *fixture_proc_address(const char *name)
{
	return !strcmp(name, "fixture_answer") ? (void *)fixture_answer : NULL;
}

static const struct ape_backend_plugin fixture_table = {
	/* APE_BACKEND_PLUGIN_HEAD(FIXTURE_NAME), but for the variants that state another */
	.abi_major = FIXTURE_ABI_MAJOR,
	.abi_minor = APE_BACKEND_ABI_MINOR,
	.struct_size = FIXTURE_STRUCT_SIZE,
	.name = FIXTURE_NAME,
	.probe = fixture_probe,
	.teardown = fixture_teardown,
	.device_release = fixture_device_release,
	.buf_alloc = fixture_buf_alloc,
	.buf_free = fixture_buf_free,
	.queue_create = fixture_queue_create,
	.queue_destroy = fixture_queue_destroy,
	.synchronize = fixture_synchronize,
	.copy_h2d = fixture_copy_h2d,
	.copy_d2h = fixture_copy_d2h,
	.fill = fixture_fill,
	.event_record = fixture_event_record,
	.event_wait = fixture_event_wait,
	.event_elapsed = fixture_event_elapsed,
	.event_destroy = fixture_event_destroy,
#ifndef FIXTURE_NO_ATTENTION
	.attention = fixture_attention,
#endif
	.proc_address = fixture_proc_address,
};

#ifdef FIXTURE_NO_SYMBOL
/* Exported, but under another name than the one libape looks up. */
APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin_v0(void);
APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin_v0(void)
#else
APE_PLUGIN_EXPORT const struct ape_backend_plugin *ape_backend_plugin(void) /* ape_backend.h */
#endif
{
#ifdef FIXTURE_NULL_TABLE
	(void)fixture_table;
	return NULL;
#else
	return &fixture_table;
#endif
}
