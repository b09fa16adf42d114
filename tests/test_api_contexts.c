/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape.h's section "Contexts, backends and devices" up to device
 * selection: creating and destroying contexts, their options, the backends a context lists
 * (built or not, loaded or not, and why) and the devices it enumerates (count-then-fill). Holds
 * on any machine: nothing assumes which optional backends were built.
 */
#include <limits.h>
#include <string.h>

#include "ape_test.h"
#include "common/apitest.h"

/* ---------------------------------------------------------------- contexts */

TEST(context_create_destroy)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	ASSERT_NE(NULL, ctx);
	EXPECT_LE(1, ape_device_list(ctx, NULL, 0)) TH_LOG("the reference device is always there");
	ape_context_destroy(ctx);
	ape_context_destroy(NULL);

	EXPECT_EQ(APE_EINVAL, ape_context_create(NULL, NULL));
	EXPECT_MSG("ape_context_create");
	EXPECT_MSG("out");

	ape_context_options_init(&o);
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);
}

TEST(context_options_struct_size)
{
	static const size_t sizes[] = { 0, 1, sizeof(ape_context_options) - 1,
					 sizeof(ape_context_options) + 8, (size_t)-1 };
	ape_context_options o;

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		ape_context *ctx = (ape_context *)&o; /* must come back NULL */

		ape_context_options_init(&o);
		o.struct_size = sizes[i];
		EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o))
		TH_LOG("struct_size %zu", sizes[i]);
		EXPECT_EQ(NULL, ctx);
		EXPECT_MSG("ape_context_create");
		EXPECT_MSG("struct_size");
		if (ctx != (ape_context *)&o)
			ape_context_destroy(ctx);
	}
}

TEST(context_backend_names)
{
	static const char *const bad[] = { "nosuch", "ref,nosuch", "nosuch,ref",
					   "ref,nosuch,cuda" };
	static const char *const good[] = { "ref", "cuda,opencl,ref", "ref,cuda" };
	ape_context_options o;
	ape_context *ctx;

	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		ape_context_options_init(&o);
		o.backends = good[i];
		ctx = NULL;
		EXPECT_EQ(0, ape_context_create(&ctx, &o))
		TH_LOG("%s: %s", good[i], ape_last_error());
		EXPECT_LE(1, ape_device_list(ctx, NULL, 0));
		ape_context_destroy(ctx);
	}
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ape_context_options_init(&o);
		o.backends = bad[i];
		ctx = (ape_context *)&o;
		EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o))
		TH_LOG("backends \"%s\"", bad[i]);
		EXPECT_EQ(NULL, ctx);
		EXPECT_MSG("ape_context_create");
		EXPECT_MSG("\"nosuch\"");
		if (ctx != (ape_context *)&o)
			ape_context_destroy(ctx);
	}
}

TEST(backend_info_ref_only)
{
	ape_context *ctx = ref_context();
	ape_backend_info info;
	bool seen_ref = false, seen_cuda = false, seen_opencl = false;
	int n;

	ASSERT_NE(NULL, ctx);
	n = ape_backend_get_info(ctx, 0, NULL);
	ASSERT_LE(3, n) TH_LOG("every known backend is listed, built or not");
	for (int i = 0; i < n; i++) {
		memset(&info, 0x5a, sizeof(info));
		ASSERT_EQ(0, ape_backend_get_info(ctx, i, &info)) TH_LOG("%s", ape_last_error());
		ASSERT_NE(NULL, memchr(info.name, '\0', sizeof(info.name)));
		ASSERT_NE(NULL, memchr(info.reason, '\0', sizeof(info.reason)));
		ASSERT_NE('\0', info.name[0]);
		for (int j = 0; j < i; j++) {
			ape_backend_info other;

			ASSERT_EQ(0, ape_backend_get_info(ctx, j, &other));
			EXPECT_STRNE(other.name, info.name);
		}
		if (!strcmp(info.name, "ref")) {
			seen_ref = true;
			EXPECT_TRUE(info.built);
			EXPECT_TRUE(info.available);
			EXPECT_EQ(1, info.device_count);
			EXPECT_STREQ("", info.reason);
			continue;
		}
		seen_cuda |= !strcmp(info.name, "cuda");
		seen_opencl |= !strcmp(info.name, "opencl");
		EXPECT_FALSE(info.available) TH_LOG("%s was not asked for", info.name);
		EXPECT_EQ(0, info.device_count) TH_LOG("%s", info.name);
		EXPECT_NE('\0', info.reason[0]) TH_LOG("%s: no reason given", info.name);
		/* built: left out by the options; not built: says so (ape.h: "not built into this
		 * libape (nvcc not found at build time)") */
		if (info.built) {
			EXPECT_EQ(0, strncmp(info.reason, "not loaded", 10))
			TH_LOG("%s: reason \"%s\"", info.name, info.reason);
		} else {
			EXPECT_EQ(0, strncmp(info.reason, "not built", 9))
			TH_LOG("%s: reason \"%s\"", info.name, info.reason);
		}
	}
	EXPECT_TRUE(seen_ref);
	EXPECT_TRUE(seen_cuda);
	EXPECT_TRUE(seen_opencl);

	memset(&info, 0x5a, sizeof(info));
	EXPECT_EQ(APE_EINVAL, ape_backend_get_info(ctx, n, &info));
	EXPECT_MSG("ape_backend_get_info");
	EXPECT_MSG("index");
	EXPECT_EQ(APE_EINVAL, ape_backend_get_info(ctx, -1, &info));
	EXPECT_MSG("index");
	EXPECT_EQ(APE_EINVAL, ape_backend_get_info(ctx, INT_MAX, &info));
	EXPECT_EQ(APE_EINVAL, ape_backend_get_info(NULL, 0, &info));
	EXPECT_MSG("ctx");
	EXPECT_EQ(APE_EINVAL, ape_backend_get_info(NULL, 0, NULL));
	ape_context_destroy(ctx);
}

/* ---------------------------------------------------------------- devices */

/* Count-then-fill and the info of every device, on one context. */
static void check_device_list(struct __test_metadata *_metadata, ape_context *ctx)
{
	ape_device *all[64], *part[66];
	ape_device *const poison = (ape_device *)&part; /* never a device */
	int n = ape_device_list(ctx, NULL, 0), nref = 0;

	ASSERT_LE(1, n);
	ASSERT_GE(64, n);
	ASSERT_EQ(n, ape_device_list(ctx, all, 64));
	for (int cap = 0; cap <= n + 1; cap++) {
		int want = cap < n ? cap : n;

		for (int i = 0; i < 66; i++)
			part[i] = poison;
		EXPECT_EQ(want, ape_device_list(ctx, part, cap)) TH_LOG("cap %d", cap);
		for (int i = 0; i < want; i++) {
			EXPECT_EQ(all[i], part[i]);
		}
		for (int i = want; i < 66; i++) {
			EXPECT_EQ(poison, part[i]) TH_LOG("cap %d wrote entry %d", cap, i);
		}
	}
	part[0] = poison;
	EXPECT_EQ(APE_EINVAL, ape_device_list(ctx, part, -1));
	EXPECT_MSG("ape_device_list");
	EXPECT_MSG("cap");
	EXPECT_EQ(poison, part[0]);

	for (int i = 0; i < n; i++) {
		ape_device_info info;
		int nth = 0;

		memset(&info, 0x5a, sizeof(info));
		ASSERT_EQ(0, ape_device_get_info(all[i], &info)) TH_LOG("%s", ape_last_error());
		ASSERT_NE(NULL, memchr(info.name, '\0', sizeof(info.name)));
		ASSERT_NE(NULL, memchr(info.backend, '\0', sizeof(info.backend)));
		ASSERT_NE(NULL, memchr(info.pci_address, '\0', sizeof(info.pci_address)));
		EXPECT_NE('\0', info.name[0]);
		EXPECT_EQ(i, info.index);
		for (int j = 0; j < i; j++) {
			ape_device_info other;

			ASSERT_EQ(0, ape_device_get_info(all[j], &other));
			nth += !strcmp(other.backend, info.backend);
		}
		EXPECT_EQ(nth, info.backend_index) TH_LOG("device %d (%s)", i, info.backend);
		if (!strcmp(info.backend, "ref")) {
			nref++;
			EXPECT_EQ(APE_DEVICE_HOST_REFERENCE, info.kind);
		} else {
			/* preference order: the reference device comes last */
			EXPECT_EQ(0, nref)
			TH_LOG("%s device %d after the reference", info.backend, i);
			EXPECT_NE(APE_DEVICE_HOST_REFERENCE, info.kind);
		}
	}
	EXPECT_EQ(1, nref);
}

TEST(devices_ref_context)
{
	ape_context *ctx = ref_context();
	ape_device *dev;
	ape_device_info info;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_device_list(ctx, NULL, 0));
	check_device_list(_metadata, ctx);
	ASSERT_EQ(1, ape_device_list(ctx, &dev, 1));
	ASSERT_EQ(0, ape_device_get_info(dev, &info));
	EXPECT_STREQ("ref", info.backend);
	EXPECT_EQ(APE_DEVICE_HOST_REFERENCE, info.kind);
	EXPECT_EQ(0, info.index);
	EXPECT_EQ(0, info.backend_index);

	EXPECT_EQ(APE_EINVAL, ape_device_get_info(NULL, &info));
	EXPECT_MSG("ape_device_get_info");
	EXPECT_MSG("dev");
	EXPECT_EQ(APE_EINVAL, ape_device_get_info(dev, NULL));
	EXPECT_MSG("info");
	EXPECT_EQ(APE_EINVAL, ape_device_list(NULL, NULL, 0));
	EXPECT_MSG("ctx");
	EXPECT_EQ(APE_EINVAL, ape_device_list(NULL, &dev, 1));
	ape_context_destroy(ctx);
}

TEST(devices_default_context)
{
	ape_context *ctx = NULL;

	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	check_device_list(_metadata, ctx);
	ape_context_destroy(ctx);
}

TEST(context_options_defaults)
{
	ape_context_options o;

	memset(&o, 0x5a, sizeof(o));
	ape_context_options_init(&o);
	EXPECT_EQ(sizeof(o), o.struct_size);
	EXPECT_EQ(NULL, o.backends);
	EXPECT_EQ(0u, o.flags);
}

TEST_HARNESS_MAIN
