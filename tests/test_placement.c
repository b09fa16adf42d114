/* SPDX-License-Identifier: MIT */
/*
 * Placement on this machine, checked and not assumed: the pages of a staging buffer are on the
 * node libape reports for the device (asked of the kernel with move_pages and get_mempolicy, not
 * of hwloc), interleaved or plain when the policy says so; a bound thread's affinity is the
 * device's CPU set; real forward calls use placed staging buffers; the visible-devices filter
 * and device selection by spec work on the real device list.
 *
 * Every device of this context is checked: the reference always, the OpenCL CPU device (PoCL)
 * when the OpenCL backend is there.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/pages.h"
#include "core/context.h"
#include "topo/placement.h"
#include "topo/numa.h"
#include "topo/topology.h"

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define BUF_BYTES (4u << 20)

static bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

#define EXPECT_MSG(needle)                                                                         \
	EXPECT_TRUE(has(ape_last_error(), needle))                                                 \
	TH_LOG("last error \"%s\" does not mention \"%s\"", ape_last_error(), needle)

static ape_context *context(ape_numa_policy numa, const char *visible)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ape_context_options_init(&o);
	o.numa = numa;
	o.visible_devices = visible;
	if (ape_context_create(&ctx, &o))
		fprintf(stderr, "# context: %s\n", ape_last_error());
	return ctx;
}

/* This machine's topology must be known for anything here to mean something. */
#define REQUIRE_MACHINE(ctx)                                                                       \
	do {                                                                                       \
		ape_topology_info t_;                                                              \
		ASSERT_EQ(0, ape_topology_get_info(ctx, &t_));                                     \
		if (!t_.this_machine) {                                                            \
			ape_context_destroy(ctx);                                                  \
			SKIP(return, "hwloc does not describe this machine: %s", t_.source);       \
		}                                                                                  \
	} while (0)

static bool backend_available(ape_context *ctx, const char *name)
{
	ape_backend_info b;

	for (int i = 0; i < ape_backend_get_info(ctx, 0, NULL); i++)
		if (!ape_backend_get_info(ctx, i, &b) && !strcmp(b.name, name))
			return b.available;
	return false;
}

static int all_nodes(ape_context *ctx, char *list, size_t cap)
{
	int n = ape_numa_get_info(ctx, 0, NULL);
	uint64_t mask = 0;

	for (int i = 0; i < n; i++) {
		ape_numa_info ni;

		if (!ape_numa_get_info(ctx, i, &ni) && ni.os_index < 64)
			mask |= 1ull << ni.os_index;
	}
	test_mask_list(mask, list, cap);
	return n;
}

/* ---------------------------------------------------------------- the device list here */

TEST(this_machine_lists_its_devices)
{
	ape_context *ctx = context(APE_NUMA_DEFAULT, NULL);
	ape_device *all[16];
	int nd, np;

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	nd = ape_device_list(ctx, all, 16);
	np = ape_physical_get_info(ctx, 0, NULL);
	ASSERT_LE(1, np);
	for (int i = 0; i < nd; i++) {
		ape_device *d = all[i];
		ape_device_info di;
		ape_physical_info p;

		ASSERT_EQ(0, ape_device_get_info(d, &di));
		ASSERT_LE(0, di.physical_index) TH_LOG("%s has no physical device", di.name);
		ASSERT_EQ(0, ape_physical_get_info(ctx, di.physical_index, &p));
		EXPECT_EQ(p.numa_node, di.numa_node);
		EXPECT_STREQ(p.cpuset, di.cpuset);
		EXPECT_TRUE(p.usable);
		if (p.device_index == i) {
			EXPECT_STREQ(di.backend, p.backend);
		}
		if (di.kind == APE_DEVICE_CPU) {
			/* the OpenCL CPU device (PoCL) spans every node and every CPU we may use */
			char nodes[64], cpus[256];

			all_nodes(ctx, nodes, sizeof(nodes));
			test_affinity_list(cpus, sizeof(cpus));
			EXPECT_STREQ(nodes, p.numa_nodes);
			/* every CPU the process may use (taskset may narrow what this thread has) */
			for (int c = 0; c < 4096; c++) {
				if (ape__list_has(cpus, c))
					EXPECT_TRUE(ape__list_has(p.cpuset, c)) TH_LOG("CPU %d", c);
			}
			EXPECT_GE(sysconf(_SC_NPROCESSORS_CONF), ape__list_count(p.cpuset));
			EXPECT_EQ(APE_API_OPENCL, p.apis & APE_API_OPENCL);
			EXPECT_STREQ("opencl", p.backend);
			if (ape__list_count(nodes) == 1) {
				EXPECT_EQ(ape__list_first(nodes), p.numa_node);
			}
		}
	}
	if (backend_available(ctx, "opencl")) {
		ape_physical_info p;
		bool cpu = false;

		for (int i = 0; i < np; i++) {
			ASSERT_EQ(0, ape_physical_get_info(ctx, i, &p));
			cpu |= p.kind == APE_DEVICE_CPU && (p.apis & APE_API_OPENCL);
		}
		EXPECT_TRUE(cpu) TH_LOG("PoCL's CPU device is missing from the physical list");
	}
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- staging buffers */

/* Allocates a staging buffer for every device, touches it, and compares what the kernel says
 * with what libape promised. */
static void check_staging(struct __test_metadata *_metadata, ape_context *ctx,
			  ape_numa_policy pol)
{
	ape_device *devs[16];
	char nodes[64];
	int nd = ape_device_list(ctx, devs, 16);

	all_nodes(ctx, nodes, sizeof(nodes));
	for (int i = 0; i < nd; i++) {
		ape_device_info di;
		ape_physical_info p;
		struct ape__hostmem m;
		char where[64], where_hwloc[64], mask_list[64];
		uint64_t mask;
		int mode;

		ASSERT_EQ(0, ape_device_get_info(devs[i], &di));
		ASSERT_EQ(0, ape_physical_get_info(ctx, di.physical_index, &p));
		ASSERT_EQ(0, ape__host_alloc(devs[i], BUF_BYTES, &m));
		memset(m.ptr, 0xa5, BUF_BYTES); /* pages exist only once touched */
		ASSERT_EQ(0, test_page_policy(m.ptr, &mode, &mask));
		ASSERT_EQ(0, test_area_nodes(m.ptr, BUF_BYTES, where, sizeof(where)));
		ASSERT_EQ(0, ape__numa_area_nodes(ctx->numa, m.ptr, BUF_BYTES, where_hwloc,
						  sizeof(where_hwloc)));
		EXPECT_STREQ(where, where_hwloc) TH_LOG("hwloc and move_pages disagree");
		test_mask_list(mask, mask_list, sizeof(mask_list));
		EXPECT_EQ(p.staging_policy, m.placed) TH_LOG("%s", di.name);
		switch (pol) {
		case APE_NUMA_LOCAL:
			EXPECT_EQ(TEST_MPOL_BIND, mode) TH_LOG("%s", di.name);
			EXPECT_STREQ(p.numa_nodes, mask_list);
			EXPECT_EQ(ape__list_count(p.numa_nodes) == 1 ? APE_NUMA_LOCAL
								     : APE_NUMA_INTERLEAVE,
				  p.staging_policy);
			if (di.numa_node >= 0) {
				char want[16];

				snprintf(want, sizeof(want), "%d", di.numa_node);
				EXPECT_STREQ(want, where)
				TH_LOG("%s: pages on %s, device on node %d", di.name, where,
				       di.numa_node);
			}
			break;
		case APE_NUMA_INTERLEAVE:
			EXPECT_EQ(TEST_MPOL_INTERLEAVE, mode) TH_LOG("%s", di.name);
			EXPECT_STREQ(nodes, mask_list);
			EXPECT_STREQ(nodes, where) TH_LOG("4 MiB spread over every node");
			break;
		default:
			EXPECT_EQ(TEST_MPOL_DEFAULT, mode) TH_LOG("%s: a plain allocation", di.name);
			EXPECT_FALSE(m.hwloc);
		}
		ape__host_free(devs[i], &m);
	}
}

TEST(staging_buffers_land_on_the_device_node)
{
	ape_context *ctx = context(APE_NUMA_LOCAL, NULL);

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	check_staging(_metadata, ctx, APE_NUMA_LOCAL);
	EXPECT_EQ(0u, (unsigned)atomic_load(&ctx->staging_plain));
	ape_context_destroy(ctx);
}

TEST(staging_buffers_interleaved)
{
	ape_context *ctx = context(APE_NUMA_INTERLEAVE, NULL);

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	check_staging(_metadata, ctx, APE_NUMA_INTERLEAVE);
	ape_context_destroy(ctx);
}

TEST(numa_off_gives_plain_memory)
{
	ape_context *ctx;
	ape_topology_info t;

	ASSERT_EQ(0, setenv("APE_NUMA", "off", 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_topology_get_info(ctx, &t));
	EXPECT_EQ(APE_NUMA_OFF, t.numa_policy);
	EXPECT_TRUE(has(t.numa_note, "APE_NUMA")) TH_LOG("%s", t.numa_note);
	REQUIRE_MACHINE(ctx);
	check_staging(_metadata, ctx, APE_NUMA_OFF);
	EXPECT_EQ(0u, (unsigned)atomic_load(&ctx->staging_placed));
	ape_context_destroy(ctx);
}

TEST(bad_numa_policy)
{
	ape_context *ctx = (ape_context *)&ctx;

	ASSERT_EQ(0, setenv("APE_NUMA", "nearest", 1));
	EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, NULL));
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("APE_NUMA = \"nearest\": must be local, interleave or off");
	ASSERT_EQ(0, setenv("APE_NUMA", "", 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	EXPECT_NE(NULL, ctx) TH_LOG("empty means the default");
	ape_context_destroy(ctx);
	ctx = context((ape_numa_policy)7, NULL);
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("opts->numa = 7");
}

/* The staging cache: a buffer given back is handed out again for the same device when it holds
 * the request without wasting much, counted like a fresh one; never to another device; at most
 * APE__STAGING_CACHE_SLOTS kept (the oldest goes), none over APE__STAGING_CACHE_MAX; a failure
 * point per buffer handed out (the fault sweeps); everything freed with the context (ASan's
 * leak check). */
TEST(staging_cache_reuses_within_bounds)
{
	ape_context *ctx = context(APE_NUMA_DEFAULT, NULL);
	ape_device *devs[16];
	struct ape__hostmem m, k[APE__STAGING_CACHE_SLOTS + 1];
	void *first;
	size_t held;
	int nd;
	uint64_t handed;

	ASSERT_NE(NULL, ctx);
	nd = ape_device_list(ctx, devs, 16);
	ASSERT_LE(1, nd);
	EXPECT_EQ(0, ape__staging_cache_held(ctx, NULL));
	ASSERT_EQ(0, ape__host_alloc(devs[0], 8192, &m));
	first = m.ptr;
	memset(m.ptr, 1, 8192);
	ape__host_free(devs[0], &m);
	EXPECT_EQ(NULL, m.ptr) TH_LOG("zeroed when given back");
	EXPECT_EQ(1, ape__staging_cache_held(ctx, &held));
	EXPECT_EQ(8192u, held);
	if (nd > 1) { /* another device's buffer is not this one's */
		ASSERT_EQ(0, ape__host_alloc(devs[1], 4096, &m));
		EXPECT_NE(first, m.ptr);
		EXPECT_EQ(1, ape__staging_cache_held(ctx, NULL));
		ape__host_free(devs[1], &m);
		EXPECT_EQ(2, ape__staging_cache_held(ctx, NULL));
	}
	handed = atomic_load(&ctx->staging_placed) + atomic_load(&ctx->staging_plain);
	ASSERT_EQ(0, ape__host_alloc(devs[0], 5000, &m));
	EXPECT_EQ(first, m.ptr) TH_LOG("the kept 8 KiB buffer holds 5000 bytes");
	EXPECT_EQ(8192u, m.bytes);
	EXPECT_EQ(nd > 1 ? 1 : 0, ape__staging_cache_held(ctx, NULL)) TH_LOG("taken out of it");
	EXPECT_EQ(handed + 1, atomic_load(&ctx->staging_placed) + atomic_load(&ctx->staging_plain))
	TH_LOG("counted as handed out");
	ape__host_free(devs[0], &m);

	/* too small for 100 KiB; a 1 MiB one too wasteful for 4 KiB */
	ASSERT_EQ(0, ape__host_alloc(devs[0], 100 << 10, &m));
	EXPECT_NE(first, m.ptr);
	ape__host_free(devs[0], &m);
	ASSERT_EQ(0, ape__host_alloc(devs[0], 1 << 20, &m));
	first = m.ptr;
	ape__host_free(devs[0], &m);
	ASSERT_EQ(0, ape__host_alloc(devs[0], 4096, &m));
	EXPECT_NE(first, m.ptr);
	EXPECT_GE((size_t)(64 << 10), m.bytes) TH_LOG("a small kept one or a fresh page");
	ape__host_free(devs[0], &m);

	/* over the largest kept size: freed at once */
	nd = ape__staging_cache_held(ctx, &held);
	ASSERT_EQ(0, ape__host_alloc(devs[0], APE__STAGING_CACHE_MAX + 4096, &m));
	ape__host_free(devs[0], &m);
	EXPECT_EQ(nd, ape__staging_cache_held(ctx, NULL));

	/* full: the oldest makes room */
	for (int i = 0; i <= APE__STAGING_CACHE_SLOTS; i++)
		ASSERT_EQ(0, ape__host_alloc(devs[0], APE__STAGING_CACHE_MAX, &k[i]));
	EXPECT_EQ(nd, ape__staging_cache_held(ctx, NULL)) TH_LOG("none of these fit a kept one");
	for (int i = 0; i <= APE__STAGING_CACHE_SLOTS; i++)
		ape__host_free(devs[0], &k[i]);
	EXPECT_EQ(APE__STAGING_CACHE_SLOTS, ape__staging_cache_held(ctx, &held));
	EXPECT_EQ((size_t)APE__STAGING_CACHE_SLOTS * APE__STAGING_CACHE_MAX, held)
	TH_LOG("the last %d given back, the others freed", APE__STAGING_CACHE_SLOTS);
	ape_context_destroy(ctx);
}

struct churn_arg {
	ape_device *dev;
	unsigned seed;
	int bad;
};

static void *churn(void *p)
{
	struct churn_arg *a = p;

	for (int i = 0; i < 2000; i++) {
		struct ape__hostmem m;
		const size_t bytes = 1 + (size_t)(rand_r(&a->seed) % (256 << 10));

		if (ape__host_alloc(a->dev, bytes, &m) || m.bytes < bytes) {
			a->bad++;
			continue;
		}
		memset(m.ptr, (int)(a->seed & 0xff), bytes); /* a buffer handed out twice shows */
		for (size_t j = 0; j < bytes; j += 4096)
			if (((unsigned char *)m.ptr)[j] != (a->seed & 0xff))
				a->bad++;
		ape__host_free(a->dev, &m);
	}
	return NULL;
}

/* Threads taking and giving back buffers of one context at once (TSan's and ASan's case). */
TEST(staging_cache_threads)
{
	ape_context *ctx = context(APE_NUMA_DEFAULT, NULL);
	ape_device *devs[4];
	struct churn_arg a[4];
	pthread_t t[4];
	int nd;

	ASSERT_NE(NULL, ctx);
	nd = ape_device_list(ctx, devs, 4);
	ASSERT_LE(1, nd);
	for (int i = 0; i < 4; i++) {
		a[i] = (struct churn_arg){ devs[i % nd], 1234u + (unsigned)i, 0 };
		ASSERT_EQ(0, pthread_create(&t[i], NULL, churn, &a[i]));
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(t[i], NULL);
		EXPECT_EQ(0, a[i].bad) TH_LOG("thread %d", i);
	}
	EXPECT_GE(APE__STAGING_CACHE_SLOTS, ape__staging_cache_held(ctx, NULL));
	ape_context_destroy(ctx);
}

/* Every chunk goes through staging buffers on the device's node: one for query rows, one for
 * key and value rows, one for what comes back (O, LSE and the pair counts). */
TEST(forward_uses_placed_staging)
{
	ape_context *ctx = context(APE_NUMA_LOCAL, NULL);
	test_tensor q, k, v, o1, o2, kr;
	ape_attn_desc desc;
	ape_stats st;
	ape_device *dev;
	ape_rng rng;
	float lse1[2 * 3 * 16], lse2[2 * 3 * 16];
	ape_exec_options eo;

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	dev = test_device(ctx, "ref");
	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, _metadata->name);
	ASSERT_EQ(0, test_tensor_random(&q, &rng, APE_F32, 2, 3, 16, 8, 1.0));
	ASSERT_EQ(0, test_tensor_random(&k, &rng, APE_F32, 2, 3, 16, 8, 1.0));
	ASSERT_EQ(0, test_tensor_random(&v, &rng, APE_F32, 2, 3, 16, 8, 1.0));
	ASSERT_EQ(0, test_tensor_relayout(&kr, &k, 3));
	ASSERT_EQ(0, test_tensor_empty(&o1, APE_F32, 2, 3, 16, 8));
	ASSERT_EQ(0, test_tensor_empty(&o2, APE_F32, 2, 3, 16, 8));
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.3f;
	desc.lambda.value = 0.1f;

	/* inputs copied: the path of a discrete device, with its staging (on the reference a call
	 * otherwise reads them in place and stages only the outputs) */
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = 4096;
	eo.flags = APE_EXEC_COPY_INPUTS;
	ASSERT_EQ(0, ape_attention_forward_ex(&dev, 1, &eo, &desc, &q.t, &k.t, &v.t, &o1.t, lse1,
					      NULL));
	EXPECT_EQ(4u, (unsigned)atomic_load(&ctx->staging_placed))
	TH_LOG("Q, K/V, outputs, the parameter tables");
	ape_stats_init(&st);
	ASSERT_EQ(0, ape_attention_forward_ex(&dev, 1, &eo, &desc, &q.t, &kr.t, &v.t, &o2.t, lse2,
					      &st));
	EXPECT_EQ(8u, (unsigned)atomic_load(&ctx->staging_placed)) TH_LOG("the same again");
	EXPECT_EQ(0u, (unsigned)atomic_load(&ctx->staging_plain));
	EXPECT_EQ(0.0, test_max_err_o(&o1.t, &o2.t)) TH_LOG("the same problem, the same bits");
	EXPECT_EQ(0.0, test_max_err_lse(lse1, lse2, N_OF(lse1)));
	test_tensor_free(&q);
	test_tensor_free(&k);
	test_tensor_free(&kr);
	test_tensor_free(&v);
	test_tensor_free(&o1);
	test_tensor_free(&o2);
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- threads */

struct bind_try {
	ape_device *dev;
	const char *cpus; /* NULL: ape__bind_thread(dev) */
	struct ape__numa *numa;
	int ret;
	char before[256], after[256];
};

static void *try_bind(void *arg)
{
	struct bind_try *b = arg;

	test_affinity_list(b->before, sizeof(b->before));
	b->ret = b->cpus ? ape__numa_bind_thread(b->numa, b->cpus) : ape__bind_thread(b->dev);
	test_affinity_list(b->after, sizeof(b->after));
	return NULL;
}

static void run_bind(struct __test_metadata *_metadata, struct bind_try *b)
{
	char mine[256], still[256];
	pthread_t t;

	ASSERT_EQ(0, test_affinity_list(mine, sizeof(mine)));
	ASSERT_EQ(0, pthread_create(&t, NULL, try_bind, b));
	ASSERT_EQ(0, pthread_join(t, NULL));
	ASSERT_EQ(0, test_affinity_list(still, sizeof(still)));
	EXPECT_STREQ(mine, still) TH_LOG("binding a worker must not move the caller");
}

TEST(threads_bound_to_the_device_cpus)
{
	ape_context *ctx = context(APE_NUMA_LOCAL, NULL);
	ape_device *devs[16];
	int nd;

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	nd = ape_device_list(ctx, devs, 16);
	for (int i = 0; i < nd; i++) {
		struct bind_try b = { .dev = devs[i] };
		ape_device_info di;

		char want[256] = "";
		uint64_t mask = 0;

		ASSERT_EQ(0, ape_device_get_info(devs[i], &di));
		run_bind(_metadata, &b);
		/* the device's CPUs, within the affinity the thread had */
		for (int c = 0; c < 64; c++)
			if (ape__list_has(di.cpuset, c) && ape__list_has(b.before, c))
				mask |= 1ull << c;
		test_mask_list(mask, want, sizeof(want));
		EXPECT_EQ(1, b.ret) TH_LOG("%s", di.name);
		EXPECT_STREQ(want, b.after) TH_LOG("%s: device CPUs %s", di.name, di.cpuset);
	}
	EXPECT_EQ(APE_EINVAL, ape__bind_thread(NULL));
	ape_context_destroy(ctx);
}

/* Binding to all CPUs proves little on a small machine: bind to one CPU, and check it holds. */
TEST(thread_binding_is_real)
{
	ape_context *ctx = context(APE_NUMA_LOCAL, NULL);
	struct bind_try b = { 0 };
	char cpus[256], one[16];
	int last = -1;

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	ASSERT_EQ(0, test_affinity_list(cpus, sizeof(cpus)));
	if (ape__list_count(cpus) < 2) {
		ape_context_destroy(ctx);
		SKIP(return, "one CPU allowed (%s): nothing to narrow", cpus);
	}
	for (int c = 0; c < 4096; c++)
		if (ape__list_has(cpus, c))
			last = c;
	snprintf(one, sizeof(one), "%d", last);
	b.numa = ctx->numa;
	b.cpus = one;
	run_bind(_metadata, &b);
	EXPECT_EQ(0, b.ret);
	EXPECT_STREQ(cpus, b.before);
	EXPECT_STREQ(one, b.after);
	ape_context_destroy(ctx);
}

TEST(no_binding_unless_local)
{
	static const ape_numa_policy pols[] = { APE_NUMA_OFF, APE_NUMA_INTERLEAVE };

	for (int k = 0; k < N_OF(pols); k++) {
		ape_context *ctx = context(pols[k], NULL);
		struct bind_try b = { 0 };

		ASSERT_NE(NULL, ctx);
		b.dev = test_device(ctx, "ref");
		run_bind(_metadata, &b);
		EXPECT_EQ(0, b.ret);
		EXPECT_STREQ(b.before, b.after);
		ape_context_destroy(ctx);
	}
}

/* ---------------------------------------------------------------- copy bandwidth */

TEST(measure_h2d_from_a_node)
{
	ape_context *ctx = context(APE_NUMA_LOCAL, NULL);
	ape_copy_result res;
	ape_device_info di;
	ape_device *dev;

	ASSERT_NE(NULL, ctx);
	REQUIRE_MACHINE(ctx);
	dev = test_device(ctx, "ref");
	ASSERT_NE(NULL, dev);
	ASSERT_EQ(0, ape_device_get_info(dev, &di));
	ASSERT_EQ(0, ape_device_measure_h2d(dev, -1, 1 << 20, 3, &res)) TH_LOG("%s",
									       ape_last_error());
	EXPECT_LT(0.0, res.gbytes_per_s);
	EXPECT_LT(0.0, res.ms);
	if (di.numa_node >= 0) {
		EXPECT_EQ(di.numa_node, res.numa_node);
		ASSERT_EQ(0, ape_device_measure_h2d(dev, di.numa_node, 1 << 20, 1, &res));
		EXPECT_EQ(di.numa_node, res.numa_node);
	}
	EXPECT_EQ(APE_EINVAL, ape_device_measure_h2d(dev, 4095, 4096, 1, &res));
	EXPECT_MSG("numa_node = 4095: no such NUMA node");
	EXPECT_EQ(APE_EINVAL, ape_device_measure_h2d(dev, 0, 0, 1, &res));
	EXPECT_MSG("bytes = 0");
	EXPECT_EQ(APE_EINVAL, ape_device_measure_h2d(dev, 0, 4096, 0, &res));
	EXPECT_EQ(APE_EINVAL, ape_device_measure_h2d(NULL, 0, 4096, 1, &res));
	EXPECT_EQ(APE_EINVAL, ape_device_measure_h2d(dev, 0, 4096, 1, NULL));
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- filter and selection here */

TEST(visible_devices_hide_the_rest)
{
	ape_context *ctx = context(APE_NUMA_DEFAULT, NULL);
	ape_physical_info p;
	ape_backend_info b;
	ape_selection sel;
	int cpu = -1, ref = -1, np;
	char list[16];

	ASSERT_NE(NULL, ctx);
	np = ape_physical_get_info(ctx, 0, NULL);
	for (int i = 0; i < np; i++) {
		ASSERT_EQ(0, ape_physical_get_info(ctx, i, &p));
		if (p.kind == APE_DEVICE_CPU)
			cpu = i;
		if (p.kind == APE_DEVICE_HOST_REFERENCE)
			ref = i;
	}
	ape_context_destroy(ctx);
	ASSERT_LE(0, ref);
	if (cpu < 0)
		SKIP(return, "no CPU device (OpenCL) to hide");

	/* naming only the reference hides the CPU device and its OpenCL logical device */
	snprintf(list, sizeof(list), "%d", ref);
	ASSERT_EQ(0, setenv("APE_VISIBLE_DEVICES", list, 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_physical_get_info(ctx, 0, NULL));
	ASSERT_EQ(1, ape_device_list(ctx, NULL, 0));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel));
	EXPECT_TRUE(has(sel.note, "ref:0")) TH_LOG("%s", sel.note);
	for (int i = 0; i < ape_backend_get_info(ctx, 0, NULL); i++) {
		ASSERT_EQ(0, ape_backend_get_info(ctx, i, &b));
		if (!strcmp(b.name, "opencl")) {
			EXPECT_FALSE(b.available);
			EXPECT_EQ(0, b.device_count);
			EXPECT_TRUE(has(b.reason, "hidden by APE_VISIBLE_DEVICES")) TH_LOG("%s",
											 b.reason);
		}
	}
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select(ctx, "opencl", 0, &sel));
	EXPECT_MSG("APE_VISIBLE_DEVICES");
	ape_context_destroy(ctx);

	/* the option overrides the variable */
	snprintf(list, sizeof(list), "%d", cpu);
	ctx = context(APE_NUMA_DEFAULT, list);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(2, ape_physical_get_info(ctx, 0, NULL)) TH_LOG("the CPU and the reference");
	ape_context_destroy(ctx);

	ASSERT_EQ(0, setenv("APE_VISIBLE_DEVICES", "0000:fe:1f.7", 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("APE_VISIBLE_DEVICES = \"0000:fe:1f.7\"");
	EXPECT_MSG("no device at PCI address 0000:fe:1f.7");
	ASSERT_EQ(0, setenv("APE_VISIBLE_DEVICES", "first", 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("\"first\" is neither a device index nor a PCI address");
	ASSERT_EQ(0, setenv("APE_VISIBLE_DEVICES", "", 1));
	ctx = context(APE_NUMA_DEFAULT, NULL);
	EXPECT_NE(NULL, ctx) TH_LOG("empty means every device");
	ape_context_destroy(ctx);
}

TEST(select_by_spec)
{
	ape_context *ctx = context(APE_NUMA_DEFAULT, NULL);
	ape_selection sel, auto_sel;
	ape_device_info di;
	ape_physical_info p;
	char spec[32];
	int np;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, unsetenv("APE_BACKEND"));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &auto_sel));
	ASSERT_EQ(0, ape_device_select_spec(ctx, NULL, &sel));
	EXPECT_EQ(auto_sel.device, sel.device);
	ASSERT_EQ(0, ape_device_select_spec(ctx, "auto", &sel));
	EXPECT_EQ(auto_sel.device, sel.device);
	ASSERT_EQ(0, ape_device_select_spec(ctx, "ref", &sel));
	ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
	EXPECT_STREQ("ref", di.backend);
	ASSERT_EQ(0, ape_device_select_spec(ctx, "ref:0", &sel));
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "ref:1", &sel));
	/* every physical device by its index, through its default backend */
	np = ape_physical_get_info(ctx, 0, NULL);
	for (int i = 0; i < np; i++) {
		ASSERT_EQ(0, ape_physical_get_info(ctx, i, &p));
		snprintf(spec, sizeof(spec), "%d", i);
		if (!p.usable) {
			EXPECT_EQ(APE_ENOBACKEND, ape_device_select_spec(ctx, spec, &sel));
			EXPECT_MSG(p.reason);
			continue;
		}
		ASSERT_EQ(0, ape_device_select_spec(ctx, spec, &sel)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
		EXPECT_EQ(p.device_index, di.index);
		EXPECT_EQ(i, di.physical_index);
		EXPECT_STREQ(p.backend, di.backend);
		if (p.pci_address[0]) {
			ASSERT_EQ(0, ape_device_select_spec(ctx, p.pci_address, &sel));
			ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
			EXPECT_EQ(p.device_index, di.index);
		}
	}
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "999", &sel));
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "0000:fe:1f.7", &sel));
	EXPECT_EQ(APE_ENODEV, ape_device_select_spec(ctx, "ref:0000:fe:1f.7", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(ctx, "ref:zz", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(ctx, "nosuch", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(ctx, "0000:zz:00.0", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(ctx, "-1", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(NULL, "ref", &sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select_spec(ctx, "ref", NULL));
	ape_context_destroy(ctx);
}

/* A caller built against the first ape_context_options (no topology fields) still works. */
TEST(options_of_the_first_version)
{
	struct {
		size_t struct_size;
		const char *backends;
		unsigned flags;
	} v1 = { sizeof(v1), "ref", 0 };
	ape_context *ctx = NULL;

	ASSERT_EQ(0, ape_context_create(&ctx, (const ape_context_options *)&v1))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, ape_device_list(ctx, NULL, 0));
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
