/* SPDX-License-Identifier: MIT */
/*
 * Allocation-failure injection through the loading of backend plugins (runtime/api/plugins.c,
 * with the fixture plugins of tests/plugins/fixture.c): creating a context over a path of
 * plugins that load, one refused for its ABI, one without a device, one whose device claims
 * what its ops cannot do and one whose probe fails, each host allocation of a clean run fails
 * in turn, those the plugins make through libape's services (ape_be_device_add()) included.
 * Every broken run returns APE_ENOMEM with a message and no context, or a context with the
 * clean run's devices and the same plugins, each loaded or refused for the same reason; no
 * plugin stays mapped once its contexts are gone; LeakSanitizer (make faults-ci builds with
 * ASan) finds no leak. Needs a build with -DAPE_FAULT_INJECT; other builds skip.
 */
#include <stdio.h>
#include <string.h>

#include "ape_test.h"

#include "core/alloc.h"

#ifndef APE_FAULT_INJECT
int main(void)
{
	ksft_print_header();
	ksft_exit_skip("libape built without -DAPE_FAULT_INJECT: run `make faults-ci`\n");
}
#else

#define PLUGIN(v) APE_BUILD_DIR "/tests/plugins/libape-backend-" v ".so"

enum { MAX_PLUGINS = 8 };

/* What a context says of its plugins and devices. */
struct seen {
	int ndevices, nplugins;
	ape_plugin_info p[MAX_PLUGINS];
};

static int create(ape_context **ctx)
{
	ape_context_options o;

	ape_context_options_init(&o);
	o.backends = "ref,plug_a,plug_b,nodev,badcaps,probefail";
	o.backend_path = PLUGIN("a") ":" PLUGIN("major") ":" PLUGIN("nodev") ":" PLUGIN(
		"badcaps") ":" PLUGIN("probefail") ":" PLUGIN("b");
	o.flags = APE_CONTEXT_NO_PLUGIN_DIR;
	return ape_context_create(ctx, &o);
}

static void look(ape_context *ctx, struct seen *s)
{
	memset(s, 0, sizeof(*s));
	s->ndevices = ape_device_list(ctx, NULL, 0);
	s->nplugins = ape_plugin_get_info(ctx, 0, NULL);
	for (int i = 0; i < s->nplugins && i < MAX_PLUGINS; i++)
		ape_plugin_get_info(ctx, i, &s->p[i]);
}


TEST(context_create_with_plugins)
{
	uint64_t total, errors = 0;
	struct seen clean, now;
	ape_context *ctx;
	int ret;

	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, create(&ctx)) TH_LOG("%s", ape_last_error());
	look(ctx, &clean);
	ape_context_destroy(ctx);
	total = ape__fault_alloc_count();
	ASSERT_EQ(6, clean.nplugins);
	EXPECT_TRUE(clean.p[0].loaded && clean.p[5].loaded);
	for (int i = 1; i < 5; i++) {
		EXPECT_FALSE(clean.p[i].loaded) TH_LOG("%s", clean.p[i].path);
	}
	for (uint64_t n = 1; n <= total; n++) {
		ape__fault_alloc_arm(n);
		ret = create(&ctx);
		ape__fault_alloc_arm(0);
		if (ret) {
			errors++;
			EXPECT_EQ(APE_ENOMEM, ret)
			TH_LOG("allocation %llu: %s", (unsigned long long)n, ape_last_error());
			EXPECT_NE(0, ape_last_error()[0]);
			EXPECT_EQ(NULL, ctx);
		} else {
			look(ctx, &now);
			ape_context_destroy(ctx);
			EXPECT_EQ(clean.ndevices, now.ndevices)
			TH_LOG("allocation %llu failed silently: a device went missing",
			       (unsigned long long)n);
			ASSERT_EQ(clean.nplugins, now.nplugins);
			for (int i = 0; i < clean.nplugins; i++) {
				EXPECT_EQ(clean.p[i].loaded, now.p[i].loaded)
				TH_LOG("allocation %llu: %s", (unsigned long long)n, now.p[i].path);
				EXPECT_STREQ(clean.p[i].reason, now.p[i].reason);
			}
		}
		EXPECT_FALSE(test_mapped("libape-backend-")) TH_LOG("allocation %llu: a plugin stayed",
							       (unsigned long long)n);
	}
	EXPECT_GT(errors, 0u);
	ksft_print_msg("context create with plugins: %llu allocations failed in turn: %llu errors\n",
		       (unsigned long long)total, (unsigned long long)errors);
	fflush(stdout);
}

TEST_HARNESS_MAIN
#endif
