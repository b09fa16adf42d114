/* SPDX-License-Identifier: MIT */
/*
 * Loading backend plugins (include/ape/ape_backend.h; runtime/api/plugins.c), with the fixture
 * plugins of tests/plugins/fixture.c (tests/module.mk builds one per variant into
 * APE_BUILD_DIR/tests/plugins): a plugin that loads is a backend like the built-in ones (listed,
 * selected by its name, in opts->backends, APE_BACKEND, device specs; its extras found by
 * ape_backend_get_proc()); each broken one (wrong major, a required op missing, a short
 * struct_size, no entry point, a NULL table, a file dlopen refuses, a missing file, a name
 * taken, no device, a failing probe, a device claiming what its ops cannot do) is listed by
 * ape_plugin_get_info() with the reason, and the context still computes on the reference and
 * OpenCL; where plugins come from (backend_path over APE_BACKEND_PATH, folders in name order,
 * the plugin folder and APE_CONTEXT_NO_PLUGIN_DIR); contexts created and destroyed again and
 * again, and two at once, close the shared object when the last one goes; ape-info lists
 * every plugin found. The example plugin (examples/backend-plugin/, `make plugin-example`)
 * found through its folder computes what the reference computes, selected by its name in the
 * API, by `ape-run --backend` and by APE_BACKEND.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/apitest.h"
#include "common/npy.h"
#include "ape/ape_backend.h"

/* The fixtures' ABI minor, as ape-info and the refusals print it */
#define MINOR_(x) #x
#define MINOR_S(x) MINOR_(x)
#define MINOR MINOR_S(APE_BACKEND_ABI_MINOR)

/* The plugin folder the library searches (runtime/api/plugins.h): pointed elsewhere here. */
extern const char *ape__plugin_folder;

#define PLUGINS APE_BUILD_DIR "/tests/plugins"
#define PLUGIN(v) PLUGINS "/libape-backend-" v ".so"

/* A context over `path` (backend_path; NULL: APE_BACKEND_PATH) and the backends `only` (NULL:
 * all), without the plugin folder; NULL on failure (message logged). */
static ape_context *plugin_context(const char *path, const char *only)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ape_context_options_init(&o);
	o.backend_path = path;
	o.backends = only;
	o.flags = APE_CONTEXT_NO_PLUGIN_DIR;
	if (ape_context_create(&ctx, &o))
		fprintf(stderr, "# plugin_context(%s): %s\n", path, ape_last_error());
	return ctx;
}

enum { SMALL_L = 16, SMALL_D = 8 };

/* A small forward call on dev (its output in o, SMALL_L * SMALL_D floats, when not NULL). */
static int small_forward_into(ape_device *dev, float *out)
{
	enum { L = SMALL_L, D = SMALL_D };
	static float q[L * D], k[L * D], v[L * D], o[L * D], lse[L];
	ape_attn_desc desc;
	int ret;
	ape_tensor tq, tk, tv, to;

	for (int i = 0; i < L * D; i++)
		q[i] = k[i] = v[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
	ape_attn_desc_init(&desc);
	ape_tensor_init(&tq, q, APE_F32, 1, 1, L, D);
	ape_tensor_init(&tk, k, APE_F32, 1, 1, L, D);
	ape_tensor_init(&tv, v, APE_F32, 1, 1, L, D);
	ape_tensor_init(&to, o, APE_F32, 1, 1, L, D);
	desc.delta.value = 0.25f;
	desc.lambda.value = 0.1f;
	ret = ape_attention_forward(dev, &desc, &tq, &tk, &tv, &to, lse, NULL);
	if (!ret && out)
		memcpy(out, o, sizeof(o));
	return ret;
}

/* A small forward call on dev that must succeed: the context still computes. */
static int small_forward(ape_device *dev)
{
	return small_forward_into(dev, NULL);
}

/* A fresh folder under /tmp, its path in dir (cap bytes). */
static bool temp_folder(char *dir, size_t cap)
{
	snprintf(dir, cap, "/tmp/ape-plugins-XXXXXX");
	return mkdtemp(dir) != NULL;
}

/* dir/name: a symbolic link to `target`, or a file holding `text` when target is NULL. */
static bool put(const char *dir, const char *name, const char *target, const char *text)
{
	char path[4200];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if (target)
		return symlink(target, path) == 0;
	f = fopen(path, "w");
	if (!f)
		return false;
	fputs(text, f);
	return fclose(f) == 0;
}

FIXTURE(pl)
{
	int unused;
};

FIXTURE_SETUP(pl)
{
	/* a machine with plugins installed does not change what these tests see */
	ape__plugin_folder = NULL;
	unsetenv("APE_BACKEND_PATH");
	unsetenv("APE_BACKEND");
}

FIXTURE_TEARDOWN(pl)
{
}

/* A plugin that loads is a backend of the context like the built-in ones. */
TEST_F(pl, loads_as_a_backend)
{
	ape_context *ctx = plugin_context(PLUGIN("a"), NULL);
	ape_plugin_info pi;
	ape_backend_info bi;
	ape_device_info di;
	ape_selection sel;
	int (*answer)(void);
	void *fn;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_STREQ(PLUGIN("a"), pi.path);
	EXPECT_STREQ("plug_a", pi.name);
	EXPECT_TRUE(pi.loaded);
	EXPECT_EQ(1, pi.device_count);
	EXPECT_EQ((unsigned)APE_BACKEND_ABI_MAJOR, pi.abi_major);
	EXPECT_EQ((uint32_t)APE_BACKEND_ABI_MINOR, pi.abi_minor);
	EXPECT_STREQ("", pi.reason);
	EXPECT_EQ(APE_EINVAL, ape_plugin_get_info(ctx, 1, &pi));
	EXPECT_MSG("ape_plugin_get_info: index = 1");
	EXPECT_EQ(APE_EINVAL, ape_plugin_get_info(ctx, -1, &pi));
	EXPECT_EQ(APE_EINVAL, ape_plugin_get_info(NULL, 0, &pi));

	/* listed among the backends, after the built-in ones */
	ASSERT_TRUE(backend_info(ctx, "plug_a", &bi));
	EXPECT_TRUE(bi.built);
	EXPECT_TRUE(bi.available);
	EXPECT_EQ(1, bi.device_count);
	EXPECT_STREQ("", bi.reason);
	ASSERT_EQ(0, ape_backend_get_info(ctx, ape_backend_get_info(ctx, 0, NULL) - 1, &bi));
	EXPECT_STREQ("plug_a", bi.name);

	/* selected by its name, by a spec, by APE_BACKEND; never by "auto" (its rank is below
	 * the reference's) */
	ASSERT_EQ(0, ape_device_select(ctx, "plug_a", 0, &sel)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
	EXPECT_STREQ("plug_a", di.backend);
	EXPECT_STREQ("fixture device of plug_a", di.name);
	EXPECT_EQ(0, di.backend_index);
	EXPECT_LE(0, di.physical_index) TH_LOG("the plugin's device has a physical entry");
	EXPECT_EQ(0, ape_device_select_spec(ctx, "plug_a:0", &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_ENODEV, ape_device_select(ctx, "plug_a", 1, &sel));
	EXPECT_EQ(0, ape_device_select(ctx, "auto", -1, &sel));
	ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
	EXPECT_STRNE("plug_a", di.backend);
	setenv("APE_BACKEND", "plug_a", 1);
	ASSERT_EQ(0, ape_device_select(ctx, "auto", -1, &sel)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_device_get_info(sel.device, &di));
	EXPECT_STREQ("plug_a", di.backend);
	unsetenv("APE_BACKEND");
	if (di.physical_index >= 0) {
		ape_physical_info ph;

		ASSERT_EQ(0, ape_physical_get_info(ctx, di.physical_index, &ph));
		EXPECT_TRUE(ph.usable) TH_LOG("%s", ph.reason);
		EXPECT_STREQ("plug_a", ph.backend);
	}

	/* its extras by name; NULL for what it has not, and for the built-in ones' */
	fn = ape_backend_get_proc(ctx, "plug_a", "fixture_answer");
	ASSERT_NE(NULL, fn);
	memcpy(&answer, &fn, sizeof(answer));
	EXPECT_EQ(42, answer());
	EXPECT_EQ(NULL, ape_backend_get_proc(ctx, "plug_a", "no_such_extra"));
	EXPECT_EQ(NULL, ape_backend_get_proc(ctx, "ref", "fixture_answer"));
	EXPECT_EQ(NULL, ape_backend_get_proc(ctx, "nosuch", "fixture_answer"));
	EXPECT_EQ(NULL, ape_backend_get_proc(ctx, NULL, "fixture_answer"));
	EXPECT_EQ(NULL, ape_backend_get_proc(ctx, "plug_a", NULL));
	EXPECT_EQ(NULL, ape_backend_get_proc(NULL, "plug_a", "fixture_answer"));

	/* its attention op computes nothing: the failure names the plugin's device and the op */
	EXPECT_EQ(APE_ENOTSUP, small_forward(sel.device));
	EXPECT_MSG("plug_a:0");
	EXPECT_MSG("plugin fixture: computes nothing");
	/* and the reference still computes */
	ASSERT_EQ(0, ape_device_select(ctx, "ref", 0, &sel));
	EXPECT_EQ(0, small_forward(sel.device)) TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);
}

/* Every broken plugin is listed with its reason and never breaks the context, whose built-in
 * backends still compute. */
TEST_F(pl, each_refused_with_its_reason)
{
	static const struct {
		const char *path, *name, *reason;
		unsigned major;
	} cases[] = {
		{ PLUGIN("major"), "", "refused: backend ABI 2." MINOR ": this libape takes major 1 only",
		  2 },
		{ PLUGIN("noattn"), "noattn", "refused: required op attention is missing", 1 },
		{ PLUGIN("short"), "",
		  "refused: struct_size 20 is shorter than the 24 bytes every table begins with", 1 },
		{ PLUGIN("nodev"), "nodev", "no device found: plugin fixture: no device on purpose",
		  1 },
		{ PLUGIN("probefail"), "probefail",
		  "refused: probe failed (APE_EBACKEND): plugin fixture: probe fails on purpose", 1 },
		{ PLUGIN("badcaps"), "badcaps",
		  "refused: device fixture device of badcaps: capability backward without "
		  "attention_backward",
		  1 },
		{ PLUGIN("clash"), "ref",
		  "refused: the backend name \"ref\" is taken by the built-in backend ref", 1 },
		{ PLUGIN("null"), "", "refused: ape_backend_plugin() returned NULL", 0 },
		{ PLUGIN("nosym"), "", "not a libape backend: no symbol ape_backend_plugin (", 0 },
		{ "/tmp/ape-no-such-folder/libape-backend-x.so", "",
		  "not found: No such file or directory", 0 },
		{ NULL /* the file that is no shared object */, "", "dlopen: ", 0 },
	};
	const size_t n = sizeof(cases) / sizeof(cases[0]);
	char dir[64], junk[128], path[4096] = "";
	ape_context *ctx;
	ape_selection sel;
	size_t len = 0;

	ASSERT_TRUE(temp_folder(dir, sizeof(dir)));
	ASSERT_TRUE(put(dir, "not-elf.so", NULL, "this is not a shared object\n"));
	snprintf(junk, sizeof(junk), "%s/not-elf.so", dir);
	for (size_t i = 0; i < n; i++)
		len += (size_t)snprintf(path + len, sizeof(path) - len, "%s%s", i ? ":" : "",
					cases[i].path ? cases[i].path : junk);
	ctx = plugin_context(path, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ((int)n, ape_plugin_get_info(ctx, 0, NULL));
	for (size_t i = 0; i < n; i++) {
		ape_plugin_info pi;
		ape_backend_info bi;

		ASSERT_EQ(0, ape_plugin_get_info(ctx, (int)i, &pi));
		EXPECT_STREQ(cases[i].path ? cases[i].path : junk, pi.path);
		EXPECT_FALSE(pi.loaded) TH_LOG("%s", pi.path);
		EXPECT_EQ(0, pi.device_count);
		EXPECT_STREQ(cases[i].name, pi.name);
		EXPECT_EQ(cases[i].major, pi.abi_major) TH_LOG("%s", pi.path);
		EXPECT_EQ(0, strncmp(pi.reason, cases[i].reason, strlen(cases[i].reason)))
		TH_LOG("%s: \"%s\"", pi.path, pi.reason);
		/* not a backend of the context, whatever its name */
		if (pi.name[0] && strcmp(pi.name, "ref")) {
			EXPECT_FALSE(backend_info(ctx, pi.name, &bi)) TH_LOG("%s", pi.name);
		}
	}
	EXPECT_EQ(3, ape_backend_get_info(ctx, 0, NULL)) TH_LOG("the built-in backends only");
	/* a name found but not loaded: ape_device_select says why, naming the plugin */
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select(ctx, "nodev", 0, &sel));
	EXPECT_MSG(PLUGIN("nodev"));
	EXPECT_MSG("no device on purpose");
	EXPECT_EQ(APE_EINVAL, ape_device_select(ctx, "nosuch", 0, &sel));
	EXPECT_MSG("known: auto, cuda, opencl, ref");
	/* the built-in backends compute as ever */
	ASSERT_EQ(0, ape_device_select(ctx, "ref", 0, &sel));
	EXPECT_EQ(0, small_forward(sel.device)) TH_LOG("%s", ape_last_error());
	if (ape_test_slow()) { /* valgrind: PoCL's kernel build alone outlasts the test */
		ksft_print_msg("under valgrind: the reference only\n");
	} else if (!ape_device_select(ctx, "opencl", 0, &sel)) {
		EXPECT_EQ(0, small_forward(sel.device)) TH_LOG("%s", ape_last_error());
	} else {
		ksft_print_msg("no OpenCL device: the reference only\n");
	}
	ape_context_destroy(ctx);
	/* none of them stays loaded */
	EXPECT_FALSE(test_mapped("libape-backend-noattn.so"));
	EXPECT_FALSE(test_mapped("libape-backend-nodev.so"));
	test_rmtree(dir);
}

/* opts->backends takes a plugin's name; one it leaves out is listed as such. */
TEST_F(pl, backends_list_takes_plugin_names)
{
	ape_context *ctx = plugin_context(PLUGIN("a") ":" PLUGIN("b"), "ref,plug_a");
	ape_plugin_info pi;
	ape_backend_info bi;
	ape_selection sel;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_TRUE(pi.loaded);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 1, &pi));
	EXPECT_FALSE(pi.loaded);
	EXPECT_STREQ("plug_b", pi.name);
	EXPECT_STREQ("not loaded: left out by ape_context_options.backends", pi.reason);
	ASSERT_TRUE(backend_info(ctx, "opencl", &bi));
	EXPECT_FALSE(bi.available);
	EXPECT_EQ(0, ape_device_select(ctx, "plug_a", 0, &sel)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, ape_device_select(ctx, "ref", 0, &sel));
	EXPECT_EQ(APE_ENOBACKEND, ape_device_select(ctx, "plug_b", 0, &sel));
	EXPECT_MSG("left out");
	ape_context_destroy(ctx);

	/* the plugin alone */
	ctx = plugin_context(PLUGIN("a"), "plug_a");
	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(1, ape_device_list(ctx, NULL, 0));
	ape_context_destroy(ctx);

	/* a name no plugin found states is unknown; the message lists the plugins' */
	ctx = (ape_context *)&pi;
	{
		ape_context_options o;

		ape_context_options_init(&o);
		o.backend_path = PLUGIN("a");
		o.backends = "ref,plug_c";
		o.flags = APE_CONTEXT_NO_PLUGIN_DIR;
		EXPECT_EQ(APE_EINVAL, ape_context_create(&ctx, &o));
	}
	EXPECT_EQ(NULL, ctx);
	EXPECT_MSG("unknown backend \"plug_c\"");
	EXPECT_MSG("plug_a");
	EXPECT_FALSE(test_mapped("libape-backend-a.so"));
}

/* ape_context_options.backend_path wins over APE_BACKEND_PATH; NULL reads it; "" loads none;
 * a layout without the field reads it too. */
TEST_F(pl, backend_path_over_the_environment)
{
	ape_context_options o;
	ape_context *ctx;
	ape_plugin_info pi;

	setenv("APE_BACKEND_PATH", PLUGIN("b"), 1);
	ctx = plugin_context(PLUGIN("a"), NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_STREQ("plug_a", pi.name);
	ape_context_destroy(ctx);

	ctx = plugin_context(NULL, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_STREQ("plug_b", pi.name);
	ape_context_destroy(ctx);

	ctx = plugin_context("", NULL);
	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(0, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);

	/* NULL options read it */
	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);

	/* the layout before backend_path (up to verbose): the field is not read */
	ape_context_options_init(&o);
	o.struct_size = offsetof(ape_context_options, backend_path);
	o.backend_path = PLUGIN("a");
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_STREQ("plug_b", pi.name);
	ape_context_destroy(ctx);

	/* empty entries are nothing; a folder that is not there is nothing */
	ctx = plugin_context("::/tmp/ape-no-such-folder:" PLUGIN("a") ":", NULL);
	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);
}

/* A folder gives its libape-backend-*.so files, in name order, nothing else; the same plugin
 * found twice loads once. */
TEST_F(pl, folders_in_name_order)
{
	static const char *const want[] = { "libape-backend-1b.so", "libape-backend-2a.so",
					    "libape-backend-3junk.so", "libape-backend-4a.so" };
	char dir[64], path[4200], sub[128];
	ape_context *ctx;
	ape_plugin_info pi;

	ASSERT_TRUE(temp_folder(dir, sizeof(dir)));
	ASSERT_TRUE(put(dir, "libape-backend-2a.so", PLUGIN("a"), NULL));
	ASSERT_TRUE(put(dir, "libape-backend-1b.so", PLUGIN("b"), NULL));
	ASSERT_TRUE(put(dir, "libape-backend-3junk.so", NULL, "not a shared object\n"));
	ASSERT_TRUE(put(dir, "libape-backend-4a.so", PLUGIN("a"), NULL)); /* plug_a again */
	ASSERT_TRUE(put(dir, "libape-backend-5.so.1", PLUGIN("nodev"), NULL));
	ASSERT_TRUE(put(dir, "other.so", PLUGIN("nodev"), NULL));
	ASSERT_TRUE(put(dir, "libape-backend-.so", PLUGIN("nodev"), NULL));
	ASSERT_TRUE(put(dir, "libape-backend-6.so.txt", NULL, "no\n"));
	snprintf(sub, sizeof(sub), "%s/libape-backend-7dir.so", dir);
	ASSERT_EQ(0, mkdir(sub, 0700));

	ctx = plugin_context(dir, NULL);
	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(4, ape_plugin_get_info(ctx, 0, NULL));
	for (int i = 0; i < 4; i++) {
		ASSERT_EQ(0, ape_plugin_get_info(ctx, i, &pi));
		snprintf(path, sizeof(path), "%s/%s", dir, want[i]);
		EXPECT_STREQ(path, pi.path);
	}
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_TRUE(pi.loaded);
	EXPECT_STREQ("plug_b", pi.name);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 1, &pi));
	EXPECT_TRUE(pi.loaded);
	EXPECT_STREQ("plug_a", pi.name);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 2, &pi));
	EXPECT_FALSE(pi.loaded);
	EXPECT_EQ(0, strncmp(pi.reason, "dlopen: ", 8)) TH_LOG("%s", pi.reason);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 3, &pi));
	EXPECT_FALSE(pi.loaded);
	snprintf(path, sizeof(path),
		 "refused: the backend name \"plug_a\" is taken by the plugin %s/%s", dir,
		 want[1]);
	EXPECT_STREQ(path, pi.reason);
	ape_context_destroy(ctx);

	/* a trailing '/' and a folder named twice */
	snprintf(path, sizeof(path), "%s/:%s", dir, dir);
	ctx = plugin_context(path, NULL);
	ASSERT_NE(NULL, ctx);
	EXPECT_EQ(8, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	snprintf(path, sizeof(path), "%s/%s", dir, want[0]);
	EXPECT_STREQ(path, pi.path);
	ape_context_destroy(ctx);
	test_rmtree(dir);
}

/* The plugin folder comes after the path, unless APE_CONTEXT_NO_PLUGIN_DIR; a missing one is
 * nothing. */
TEST_F(pl, plugin_folder)
{
	ape_context_options o;
	ape_context *ctx;
	ape_plugin_info pi;
	char dir[64], path[4200];

	ASSERT_TRUE(temp_folder(dir, sizeof(dir)));
	ASSERT_TRUE(put(dir, "libape-backend-a.so", PLUGIN("a"), NULL));
	ape__plugin_folder = dir;
	ape_context_options_init(&o);
	o.backend_path = PLUGIN("b");
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(2, ape_plugin_get_info(ctx, 0, NULL));
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	EXPECT_STREQ("plug_b", pi.name);
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 1, &pi));
	EXPECT_STREQ("plug_a", pi.name);
	snprintf(path, sizeof(path), "%s/libape-backend-a.so", dir);
	EXPECT_STREQ(path, pi.path);
	EXPECT_TRUE(pi.loaded);
	ape_context_destroy(ctx);

	/* NULL options search it too */
	ASSERT_EQ(0, ape_context_create(&ctx, NULL)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);

	o.flags = APE_CONTEXT_NO_PLUGIN_DIR;
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);

	ape__plugin_folder = "/tmp/ape-no-such-folder";
	o.flags = 0;
	ASSERT_EQ(0, ape_context_create(&ctx, &o)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(1, ape_plugin_get_info(ctx, 0, NULL));
	ape_context_destroy(ctx);
	test_rmtree(dir);
}

/* Each context opens the plugin itself: created and destroyed again and again, and two at
 * once, the shared object stays while a context holds it and goes with the last one. */
TEST_F(pl, contexts_open_and_close_it)
{
	ape_context *c1, *c2;
	ape_selection s1, s2;

	EXPECT_FALSE(test_mapped("libape-backend-a.so"));
	for (int i = 0; i < 50; i++) {
		ape_selection sel;

		c1 = plugin_context(PLUGIN("a"), NULL);
		ASSERT_NE(NULL, c1);
		ASSERT_EQ(0, ape_device_select(c1, "plug_a", 0, &sel)) TH_LOG("%s", ape_last_error());
		ape_context_destroy(c1);
		ASSERT_FALSE(test_mapped("libape-backend-a.so")) TH_LOG("round %d", i);
	}
	c1 = plugin_context(PLUGIN("a"), NULL);
	c2 = plugin_context(PLUGIN("a"), NULL);
	ASSERT_NE(NULL, c1);
	ASSERT_NE(NULL, c2);
	ASSERT_EQ(0, ape_device_select(c1, "plug_a", 0, &s1));
	ASSERT_EQ(0, ape_device_select(c2, "plug_a", 0, &s2));
	EXPECT_NE(s1.device, s2.device);
	ape_context_destroy(c1);
	EXPECT_TRUE(test_mapped("libape-backend-a.so"));
	EXPECT_EQ(0, ape_device_select(c2, "plug_a", 0, &s2)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_ENOTSUP, small_forward(s2.device)); /* its code is still there */
	ape_context_destroy(c2);
	EXPECT_FALSE(test_mapped("libape-backend-a.so"));
}

/* ape-info lists every plugin found: its file, its name, loaded or why not; the same in JSON. */
TEST_F(pl, ape_info_lists_them)
{
	char out[65536], err[4096];
	int st;

	st = test_run_tool("ape-info",
			   (const char *const[]){ "--backend-path",
						  PLUGIN("a") ":" PLUGIN("major") ":" PLUGIN("nodev"),
						  NULL },
			   NULL, out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	EXPECT_TRUE(has(out, "\nplugins:\n")) TH_LOG("%s", out);
	EXPECT_TRUE(has(out, "  " PLUGIN("a") "\n    plug_a   loaded (ABI 1." MINOR "): 1 device\n"))
	TH_LOG("%s", out);
	EXPECT_TRUE(has(out, "  " PLUGIN("major") "\n    -        not loaded (ABI 2." MINOR "): refused: "
			     "backend ABI 2." MINOR))
	TH_LOG("%s", out);
	EXPECT_TRUE(has(out, "    nodev    not loaded (ABI 1." MINOR "): no device found: plugin fixture"))
	TH_LOG("%s", out);
	EXPECT_TRUE(has(out, "\n  plug_a   available: 1 device, driver fixture 1\n"))
	TH_LOG("%s", out);

	st = test_run_tool("ape-info",
			   (const char *const[]){ "--json", "--backend-path", PLUGIN("major"), NULL },
			   NULL, out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	EXPECT_TRUE(has(out, "\"plugins\": [\n  {\"path\": \"" PLUGIN("major") "\", \"name\": \"\", "
			     "\"loaded\": false, \"device_count\": 0, \"abi_major\": 2, "
			     "\"abi_minor\": " MINOR ", \"reason\": \"refused: backend ABI 2." MINOR))
	TH_LOG("%s", out);

	/* none found */
	st = test_run_tool("ape-info", (const char *const[]){ "--backend-path", "", NULL }, NULL,
			   out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	EXPECT_TRUE(has(out, "\nplugins: none found\n") || has(out, "\nplugins:\n"))
	TH_LOG("%s", out);
}

/* A program linked with libape.a that does not export libape's symbols: a plugin would bind to
 * a second copy (the libape.so its run path finds), so it is refused, and the reason says how
 * to link instead. */
TEST_F(pl, a_static_program_is_told)
{
	char cmd[4096], out[4096] = "";
	FILE *f;

	snprintf(cmd, sizeof(cmd), "%s %s 2>&1", PLUGINS "/static_host", PLUGIN("a"));
	f = popen(cmd, "r");
	ASSERT_NE(NULL, f);
	fread(out, 1, sizeof(out) - 1, f);
	EXPECT_EQ(0, pclose(f)) TH_LOG("%s", out);
	EXPECT_TRUE(has(out, "loaded 0: refused: its calls to libape (ape_be_device_add, ...) would "
			     "reach another copy of libape than this program's"))
	TH_LOG("%s", out);
}

/* The example plugin, found in its folder: a backend that computes what the reference does,
 * through the API, `ape-run --backend example` and APE_BACKEND. */
TEST_F(pl, the_example_plugin_computes)
{
	static const int64_t shape[4] = { 1, 2, 48, 16 };
	char dir[64], path[4200], out[8192], err[8192], msg[256];
	float o_ex[SMALL_L * SMALL_D], o_ref[SMALL_L * SMALL_D], *x;
	struct npy_array a, b;
	ape_context *ctx = plugin_context(APE_BUILD_DIR "/plugins", NULL);
	ape_selection sel;
	ape_plugin_info pi;
	size_t n = 1;
	int st;

	ASSERT_NE(NULL, ctx);
	ASSERT_EQ(1, ape_plugin_get_info(ctx, 0, NULL)) TH_LOG("make plugin-example");
	ASSERT_EQ(0, ape_plugin_get_info(ctx, 0, &pi));
	ASSERT_TRUE(pi.loaded) TH_LOG("%s: %s", pi.path, pi.reason);
	EXPECT_STREQ("example", pi.name);
	ASSERT_EQ(0, ape_device_select(ctx, "example", 0, &sel)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, small_forward_into(sel.device, o_ex)) TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_device_select(ctx, "ref", 0, &sel));
	ASSERT_EQ(0, small_forward_into(sel.device, o_ref)) TH_LOG("%s", ape_last_error());
	for (int i = 0; i < SMALL_L * SMALL_D; i++) {
		ASSERT_TRUE(fabsf(o_ref[i] - o_ex[i]) <= 1e-5f)
		TH_LOG("element %d: %g, the reference %g", i, o_ex[i], o_ref[i]);
	}
	ape_context_destroy(ctx);

	/* the tools take its name: --backend, and APE_BACKEND with auto */
	for (int i = 0; i < 4; i++)
		n *= (size_t)shape[i];
	x = malloc(n * sizeof(*x));
	ASSERT_NE(NULL, x);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)((i * 29) % 17) / 17.0f - 0.5f;
	ASSERT_TRUE(temp_folder(dir, sizeof(dir)));
	snprintf(path, sizeof(path), "%s/x.npy", dir);
	ASSERT_EQ(0, npy_save(path, APE_F32, 4, shape, x, msg, sizeof(msg))) TH_LOG("%s", msg);
	free(x);
	setenv("APE_BACKEND_PATH", APE_BUILD_DIR "/plugins", 1);
	st = test_run_tool("ape-run",
			   (const char *const[]){ "-q", "x.npy", "-k", "x.npy", "-v", "x.npy", "-o",
						  "o_example.npy", "--backend", "example", NULL },
			   dir, out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	setenv("APE_BACKEND", "example", 1);
	st = test_run_tool("ape-run",
			   (const char *const[]){ "-q", "x.npy", "-k", "x.npy", "-v", "x.npy", "-o",
						  "o_env.npy", "--stats", NULL },
			   dir, out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	EXPECT_TRUE(has(err, "backend example")) TH_LOG("%s", err);
	unsetenv("APE_BACKEND");
	unsetenv("APE_BACKEND_PATH");
	st = test_run_tool("ape-run",
			   (const char *const[]){ "-q", "x.npy", "-k", "x.npy", "-v", "x.npy", "-o",
						  "o_ref.npy", "--backend", "ref", NULL },
			   dir, out, sizeof(out), err, sizeof(err));
	ASSERT_EQ(0, st) TH_LOG("%s", err);
	snprintf(path, sizeof(path), "%s/o_example.npy", dir);
	ASSERT_EQ(0, npy_load(path, &a, msg, sizeof(msg))) TH_LOG("%s", msg);
	snprintf(path, sizeof(path), "%s/o_ref.npy", dir);
	ASSERT_EQ(0, npy_load(path, &b, msg, sizeof(msg))) TH_LOG("%s", msg);
	for (size_t i = 0; i < n; i++) {
		const float e = ((float *)a.data)[i], r = ((float *)b.data)[i];

		ASSERT_TRUE(fabsf(e - r) <= 1e-5f)
		TH_LOG("element %zu: %g, the reference %g", i, e, r);
	}
	npy_free(&a);
	npy_free(&b);
	test_rmtree(dir);
}

TEST_HARNESS_MAIN
