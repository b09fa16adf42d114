/* SPDX-License-Identifier: MIT */
/*
 * Backend plugins and threads (runtime/api/plugins.c, the fixture plugins of
 * tests/plugins/fixture.c): two threads at once, each creating contexts that load the same
 * plugins (and refuse some: their shared objects opened and closed as well), driving the
 * plugin's device through libape (a queue, a buffer written and read back: the plugin's ops
 * behind the core's table, as a built-in backend's), computing on the reference, and
 * destroying them, round after round; dlopen and dlclose of one shared object race between
 * the threads. `make tsan-ci` runs this under ThreadSanitizer, where any data race fails it.
 *
 * The main thread holds each plugin open meanwhile, so that the threads' dlclose() never
 * unmaps it: ld.so maps shared objects with system calls ThreadSanitizer does not see, and a
 * plugin mapped again where freed memory lay would inherit that memory's history (a report of
 * a race between a string of the plugin and an old write, now and then).
 * test_plugins.c checks that the last context's dlclose() does unmap it.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ape_test.h"

#define PLUGIN(v) APE_BUILD_DIR "/tests/plugins/libape-backend-" v ".so"

enum { NT = 2, ROUNDS = 50 };

static const char *const plugins[] = { PLUGIN("a"), PLUGIN("major"), PLUGIN("nodev") };
enum { NPLUGINS = sizeof(plugins) / sizeof(plugins[0]) };

struct job {
	char err[512]; /* empty when every round went as it should */
};

/* The plugin's device: a queue, a buffer written and read back. */
static int plugin_round_trip(ape_device *dev)
{
	unsigned char in[256], out[256];
	ape_buffer *b = NULL;
	ape_queue *q = NULL;
	int ret;

	for (size_t i = 0; i < sizeof(in); i++)
		in[i] = (unsigned char)(i * 7);
	memset(out, 0, sizeof(out));
	ret = ape_queue_create(dev, &q);
	if (!ret)
		ret = ape_buffer_alloc(dev, sizeof(in), &b);
	if (!ret)
		ret = ape_buffer_write(q, b, 0, in, sizeof(in));
	if (!ret)
		ret = ape_buffer_read(q, out, b, 0, sizeof(out));
	if (!ret)
		ret = ape_queue_synchronize(q);
	ape_queue_destroy(q);
	ape_buffer_free(b);
	if (!ret && memcmp(in, out, sizeof(in)))
		ret = APE_EBACKEND; /* the bytes did not come back */
	return ret;
}

/* A small forward call on the reference. */
static int small_forward(ape_device *dev)
{
	enum { L = 16, D = 8 };
	float q[L * D], o[L * D], lse[L];
	ape_attn_desc desc;
	ape_tensor tq, to;

	for (int i = 0; i < L * D; i++)
		q[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
	ape_attn_desc_init(&desc);
	ape_tensor_init(&tq, q, APE_F32, 1, 1, L, D);
	ape_tensor_init(&to, o, APE_F32, 1, 1, L, D);
	return ape_attention_forward(dev, &desc, &tq, &tq, &tq, &to, lse, NULL);
}

static void *contexts(void *arg)
{
	struct job *j = arg;

	for (int r = 0; r < ROUNDS && !j->err[0]; r++) {
		ape_context_options o;
		ape_context *ctx = NULL;
		ape_selection sel;
		int ret;

		ape_context_options_init(&o);
		o.backends = "ref,plug_a,nodev";
		o.backend_path = PLUGIN("a") ":" PLUGIN("major") ":" PLUGIN("nodev"); /* plugins[] */
		o.flags = APE_CONTEXT_NO_PLUGIN_DIR;
		ret = ape_context_create(&ctx, &o);
		if (!ret)
			ret = ape_device_select(ctx, "plug_a", 0, &sel);
		if (!ret)
			ret = plugin_round_trip(sel.device);
		if (!ret)
			ret = ape_device_select(ctx, "ref", 0, &sel);
		if (!ret)
			ret = small_forward(sel.device);
		if (!ret && ape_plugin_get_info(ctx, 0, NULL) != NPLUGINS)
			ret = APE_EINVAL;
		if (ret)
			snprintf(j->err, sizeof(j->err), "round %d: %s: %.400s", r, ape_err_name(ret),
				 ape_last_error());
		ape_context_destroy(ctx);
	}
	return NULL;
}

TEST(contexts_with_plugins_at_once)
{
	pthread_t t[NT];
	struct job jobs[NT];
	void *held[NPLUGINS];

	for (int i = 0; i < NPLUGINS; i++) {
		held[i] = dlopen(plugins[i], RTLD_NOW | RTLD_LOCAL);
		ASSERT_NE(NULL, held[i]) TH_LOG("%s", dlerror());
	}
	memset(jobs, 0, sizeof(jobs));
	for (int i = 0; i < NT; i++)
		ASSERT_EQ(0, pthread_create(&t[i], NULL, contexts, &jobs[i]));
	for (int i = 0; i < NT; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < NT; i++) {
		EXPECT_EQ(0, jobs[i].err[0]) TH_LOG("thread %d: %s", i, jobs[i].err);
	}
	for (int i = 0; i < NPLUGINS; i++)
		dlclose(held[i]);
}

TEST_HARNESS_MAIN
