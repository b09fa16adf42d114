/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape.h's ape_device_select(): by name and index, "auto" and what it
 * passes over (and says so in its note), backends that are not available, outputs untouched on
 * failure, and APE_BACKEND. Holds on any machine: the contexts load only "ref".
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/apitest.h"

/* ---------------------------------------------------------------- device selection */

TEST(select_by_name)
{
	ape_context *ctx = ref_context();
	ape_device *ref;
	ape_selection sel;
	ape_device_info info;

	ASSERT_NE(NULL, ctx);
	unsetenv("APE_BACKEND");
	ASSERT_EQ(1, ape_device_list(ctx, &ref, 1));

	ASSERT_EQ(0, ape_device_select(ctx, "ref", 0, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);
	EXPECT_FALSE(sel.passed_over);
	EXPECT_TRUE(has(sel.note, "ref")) TH_LOG("note \"%s\"", sel.note);
	ASSERT_EQ(0, ape_device_get_info(sel.device, &info));
	EXPECT_STREQ("ref", info.backend);

	ASSERT_EQ(0, ape_device_select(ctx, "ref", -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);

	EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, "ref", 1, &sel));
	EXPECT_MSG("ape_device_select");
	EXPECT_MSG("index");
	EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, "ref", INT_MAX, &sel));

	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, "nosuch", 0, &sel));
	EXPECT_MSG("ape_device_select");
	EXPECT_MSG("nosuch");
	EXPECT_EQ(APE_EINVAL, ape_device_select(NULL, "ref", 0, &sel));
	EXPECT_MSG("ctx");
	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, "ref", 0, NULL));
	EXPECT_MSG("sel");
	ape_context_destroy(ctx);
}

TEST(select_auto_passes_over_unloaded)
{
	static const char *const names[] = { "auto", NULL };
	ape_context *ctx = ref_context();
	ape_backend_info cuda, opencl;
	ape_device *ref;
	ape_selection sel;

	ASSERT_NE(NULL, ctx);
	unsetenv("APE_BACKEND");
	ASSERT_EQ(1, ape_device_list(ctx, &ref, 1));
	ASSERT_TRUE(backend_info(ctx, "cuda", &cuda));
	ASSERT_TRUE(backend_info(ctx, "opencl", &opencl));
	for (int i = 0; i < 2; i++) {
		const char *name = names[i] ? names[i] : "(NULL)";

		memset(&sel, 0x5a, sizeof(sel));
		ASSERT_EQ(0, ape_device_select(ctx, names[i], -1, &sel))
		TH_LOG("%s: %s", name, ape_last_error());
		EXPECT_EQ(ref, sel.device);
		ASSERT_NE(NULL, memchr(sel.note, '\0', sizeof(sel.note)));
		EXPECT_NE('\0', sel.note[0]);
		/* cuda and opencl are preferred over ref and were not loaded: the note says so */
		EXPECT_TRUE(sel.passed_over) TH_LOG("%s", name);
		EXPECT_TRUE(has(sel.note, "cuda")) TH_LOG("%s: note \"%s\"", name, sel.note);
		EXPECT_TRUE(has(sel.note, "opencl")) TH_LOG("%s: note \"%s\"", name, sel.note);
		EXPECT_TRUE(has(sel.note, cuda.reason)) TH_LOG("%s: note \"%s\"", name, sel.note);
		EXPECT_TRUE(has(sel.note, opencl.reason)) TH_LOG("%s: note \"%s\"", name, sel.note);

		ASSERT_EQ(0, ape_device_select(ctx, names[i], 0, &sel));
		EXPECT_EQ(ref, sel.device);
		EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, names[i], 1, &sel)) TH_LOG("%s", name);
		EXPECT_MSG("ape_device_select");
		EXPECT_MSG("index");
	}
	ape_context_destroy(ctx);
}

TEST(select_unavailable_backend)
{
	static const char *const names[] = { "cuda", "opencl" };
	ape_context *ctx = ref_context();

	ASSERT_NE(NULL, ctx);
	unsetenv("APE_BACKEND");
	for (int i = 0; i < 2; i++) {
		ape_backend_info info;
		ape_selection sel;

		ASSERT_TRUE(backend_info(ctx, names[i], &info));
		ASSERT_FALSE(info.available);
		EXPECT_EQ(APE_ENOBACKEND, ape_device_select(ctx, names[i], 0, &sel))
		TH_LOG("%s", names[i]);
		EXPECT_MSG(names[i]);
		EXPECT_MSG(info.reason);
		/* ape.h: the message names the function, like every other one */
		EXPECT_MSG("ape_device_select");
	}
	ape_context_destroy(ctx);
}

/* ape.h, error model: "On failure, outputs are left untouched unless the function's
 * documentation says otherwise"; ape_device_select's does not. */
TEST(select_failure_leaves_selection_untouched)
{
	ape_context *ctx = ref_context();
	ape_selection sel, before;

	ASSERT_NE(NULL, ctx);
	unsetenv("APE_BACKEND");
	memset(&sel, 0x5a, sizeof(sel));
	memcpy(&before, &sel, sizeof(sel));
	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, "nosuch", 0, &sel));
	EXPECT_EQ(0, memcmp(&before, &sel, sizeof(sel)));
	EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, "ref", 7, &sel));
	EXPECT_EQ(0, memcmp(&before, &sel, sizeof(sel)));
	ape_context_destroy(ctx);
}

TEST(select_ape_backend_environment)
{
	ape_context *ctx = ref_context();
	ape_device *ref;
	ape_selection sel;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_device_list(ctx, &ref, 1));

	ASSERT_EQ(0, setenv("APE_BACKEND", "ref", 1));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);
	EXPECT_TRUE(has(sel.note, "APE_BACKEND")) TH_LOG("note \"%s\"", sel.note);
	ASSERT_EQ(0, ape_device_select(ctx, NULL, -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);
	EXPECT_TRUE(has(sel.note, "APE_BACKEND")) TH_LOG("note \"%s\"", sel.note);
	EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, "auto", 1, &sel));

	ASSERT_EQ(0, setenv("APE_BACKEND", "nosuch", 1));
	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, "auto", -1, &sel));
	EXPECT_MSG("nosuch");
	EXPECT_MSG("APE_BACKEND");
	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, NULL, -1, &sel));
	/* an explicit request wins over the environment */
	ASSERT_EQ(0, ape_device_select(ctx, "ref", -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);
	EXPECT_FALSE(has(sel.note, "APE_BACKEND")) TH_LOG("note \"%s\"", sel.note);

	ASSERT_EQ(0, setenv("APE_BACKEND", "cuda", 1));
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select(ctx, "auto", -1, &sel));
	EXPECT_MSG("cuda");
	EXPECT_MSG("APE_BACKEND");

	/* "auto" and "" in the environment mean no preference */
	ASSERT_EQ(0, setenv("APE_BACKEND", "auto", 1));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);
	EXPECT_TRUE(sel.passed_over);
	ASSERT_EQ(0, setenv("APE_BACKEND", "", 1));
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(ref, sel.device);

	unsetenv("APE_BACKEND");
	ape_context_destroy(ctx);
}

TEST_HARNESS_MAIN
