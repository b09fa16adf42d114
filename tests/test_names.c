/* SPDX-License-Identifier: MIT */
/*
 * The enum name helpers of ape.h (ape_dtype_name() and ape_dtype_from_name() and the like): every
 * value round-trips through its name, unknown values get the static "?", unknown or NULL names
 * APE_EINVAL with a message that names the function, quotes the name and lists every word.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"

/* Adapters: the name functions take their own enum types. */
static const char *dtype_name(int v)
{
	return ape_dtype_name((ape_dtype)v);
}

static const char *layout_name(int v)
{
	return ape_rope_layout_name((ape_rope_layout)v);
}

static const char *kind_name(int v)
{
	return ape_device_kind_name((ape_device_kind)v);
}

static const char *numa_name(int v)
{
	return ape_numa_policy_name((ape_numa_policy)v);
}

static const char *api_name(int v)
{
	return ape_api_name((unsigned)v);
}

struct table {
	const char *fn; /* the from_name function, as its messages name it */
	const char *(*name)(int);
	int (*from_name)(const char *);
	int n;
	int values[8];
	const char *names[8];
	const char *list; /* what the message says the names are */
	int unknown[4]; /* values that are none of the enum's */
};

static const struct table tables[] = {
	{ "ape_dtype_from_name", dtype_name, ape_dtype_from_name, 3,
	  { APE_F32, APE_F16, APE_BF16 }, { "f32", "f16", "bf16" }, "f32, f16 or bf16",
	  { -1, 3, 100, INT_MAX } },
	{ "ape_rope_layout_from_name", layout_name, ape_rope_layout_from_name, 2,
	  { APE_ROPE_HALF, APE_ROPE_INTERLEAVED }, { "half", "interleaved" }, "half or interleaved",
	  { -1, 2, 7, INT_MIN } },
	{ "ape_device_kind_from_name", kind_name, ape_device_kind_from_name, 4,
	  { APE_DEVICE_CPU, APE_DEVICE_GPU, APE_DEVICE_ACCELERATOR, APE_DEVICE_HOST_REFERENCE },
	  { "cpu", "gpu", "accelerator", "reference" }, "cpu, gpu, accelerator or reference",
	  { -1, 4, 5, INT_MAX } },
	{ "ape_numa_policy_from_name", numa_name, ape_numa_policy_from_name, 4,
	  { APE_NUMA_DEFAULT, APE_NUMA_LOCAL, APE_NUMA_INTERLEAVE, APE_NUMA_OFF },
	  { "default", "local", "interleave", "off" }, "default, local, interleave or off",
	  { -1, 4, 99, INT_MAX } },
	{ "ape_link_from_name", ape_link_name, ape_link_from_name, 7,
	  { APE_LINK_SELF, APE_LINK_PIX, APE_LINK_PXB, APE_LINK_PHB, APE_LINK_NODE, APE_LINK_SYS,
	    APE_LINK_UNKNOWN },
	  { "X", "PIX", "PXB", "PHB", "NODE", "SYS", "-" }, "X, PIX, PXB, PHB, NODE, SYS or -",
	  { -1, 7, APE_EINVAL, INT_MAX } },
	{ "ape_api_from_name", api_name, ape_api_from_name, 4,
	  { APE_API_CUDA, APE_API_OPENCL, APE_API_DRM, APE_API_HOST },
	  { "cuda", "opencl", "drm", "host" }, "cuda, opencl, drm or host",
	  { 0, APE_API_CUDA | APE_API_DRM, 1 << 4, -1 } },
};

#define NTABLES (int)(sizeof(tables) / sizeof(tables[0]))

TEST(every_value_round_trips)
{
	for (int t = 0; t < NTABLES; t++) {
		const struct table *tb = &tables[t];

		for (int i = 0; i < tb->n; i++) {
			EXPECT_STREQ(tb->names[i], tb->name(tb->values[i])) TH_LOG("%s", tb->fn);
			EXPECT_EQ(tb->values[i], tb->from_name(tb->name(tb->values[i])))
				TH_LOG("%s(\"%s\")", tb->fn, tb->names[i]);
			/* static: the same string every time, nothing to free */
			EXPECT_EQ(tb->name(tb->values[i]), tb->name(tb->values[i]));
		}
	}
}

TEST(unknown_values_are_a_static_question_mark)
{
	for (int t = 0; t < NTABLES; t++)
		for (int i = 0; i < 4; i++) {
			const char *s = tables[t].name(tables[t].unknown[i]);

			EXPECT_STREQ("?", s)
				TH_LOG("%s: value %d", tables[t].fn, tables[t].unknown[i]);
			EXPECT_EQ(s, tables[t].name(tables[t].unknown[i]));
		}
}

TEST(unknown_names_are_refused_with_the_list)
{
	static const char *const bad[] = { "", "F32", "f32 ", " half", "gpu0", "Local", "pix",
					   "CUDA", "?" };
	char want[256];

	for (int t = 0; t < NTABLES; t++) {
		const struct table *tb = &tables[t];

		for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
			EXPECT_EQ(APE_EINVAL, tb->from_name(bad[i]))
				TH_LOG("%s(\"%s\")", tb->fn, bad[i]);
			snprintf(want, sizeof(want), "%s: name = \"%s\": must be %s", tb->fn, bad[i],
				 tb->list);
			EXPECT_STREQ(want, ape_last_error());
		}
		EXPECT_EQ(APE_EINVAL, tb->from_name(NULL));
		snprintf(want, sizeof(want), "%s: name = NULL: must be %s", tb->fn, tb->list);
		EXPECT_STREQ(want, ape_last_error());
	}
}

/* A name of any length is quoted cut short, never overflowing the message. */
TEST(long_names_are_cut_short)
{
	char *name = malloc(100000);

	ASSERT_NE(NULL, name);
	memset(name, 'x', 99999);
	name[99999] = '\0';
	EXPECT_EQ(APE_EINVAL, ape_dtype_from_name(name));
	EXPECT_NE(NULL, strstr(ape_last_error(), "must be f32, f16 or bf16"));
	EXPECT_GT(200u, strlen(ape_last_error()));
	free(name);
}

/* APE_NUMA takes a policy, not "default" (which would mean APE_NUMA again), as before. */
TEST(ape_numa_refuses_default)
{
	ape_context *ctx = NULL;

	ASSERT_EQ(0, setenv("APE_NUMA", "default", 1));
	EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, NULL));
	EXPECT_EQ(NULL, ctx);
	EXPECT_NE(NULL, strstr(ape_last_error(), "APE_NUMA = \"default\": must be local, "
						 "interleave or off"))
		TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, setenv("APE_NUMA", "interleave", 1));
	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);
	unsetenv("APE_NUMA");
}

TEST_HARNESS_MAIN
