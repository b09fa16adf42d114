/* SPDX-License-Identifier: MIT */
/*
 * The public API contract around the attention kernel: version, the error table, per-thread
 * messages, contexts, backends, devices, device selection, descriptor defaults, storage conversion
 * and pair counting. Everything here must hold on any machine, so the contexts load only "ref"
 * unless a test says otherwise, and nothing assumes which optional backends were built.
 */
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ape_test.h"
#include "common/naive.h"

/* ---------------------------------------------------------------- helpers */

static bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

/* The thread's last message must contain `needle`; failures show the whole message. */
#define EXPECT_MSG(needle)                                                                         \
	EXPECT_TRUE(has(ape_last_error(), needle))                                                 \
	TH_LOG("last error \"%s\" does not mention \"%s\"", ape_last_error(), needle)

static ape_context *ref_context(void)
{
	ape_context_options o;
	ape_context *ctx = NULL;

	ape_context_options_init(&o);
	o.backends = "ref";
	if (ape_context_create(&ctx, &o))
		return NULL;
	return ctx;
}

/* Backend info by name, or false when the context does not list it. */
static bool backend_info(ape_context *ctx, const char *name, ape_backend_info *out)
{
	int n = ape_backend_get_info(ctx, 0, NULL);

	for (int i = 0; i < n; i++)
		if (!ape_backend_get_info(ctx, i, out) && !strcmp(out->name, name))
			return true;
	return false;
}

/* ---------------------------------------------------------------- version and errors */

TEST(version_matches_header)
{
	char want[32];

	snprintf(want, sizeof(want), "%d.%d.%d", APE_VERSION_MAJOR, APE_VERSION_MINOR,
		 APE_VERSION_PATCH);
	ASSERT_EQ((unsigned)APE_VERSION, ape_version());
	EXPECT_EQ((unsigned)APE_VERSION_MAJOR, ape_version() >> 16);
	EXPECT_EQ((unsigned)APE_VERSION_MINOR, (ape_version() >> 8) & 0xffu);
	EXPECT_EQ((unsigned)APE_VERSION_PATCH, ape_version() & 0xffu);
	ASSERT_NE(NULL, ape_version_string());
	EXPECT_STREQ(want, ape_version_string());
}

static const struct err_entry {
	const char *name;
	int enum_value; /* APE_<NAME> as the enum has it */
	int value; /* as the table has it */
	const char *text;
} err_table[] = {
#define ERR_ENTRY(name, value, text) { "APE_" #name, APE_##name, value, text },
	APE_ERRNO_MAP(ERR_ENTRY)
#undef ERR_ENTRY
};

#define N_ERRS ((int)(sizeof(err_table) / sizeof(err_table[0])))

TEST(error_table_names_and_texts)
{
	for (int i = 0; i < N_ERRS; i++) {
		const struct err_entry *e = &err_table[i];
		const char *name = ape_err_name(e->value), *text = ape_strerror(e->value);

		EXPECT_EQ(e->value, e->enum_value);
		EXPECT_GT(0, e->value) TH_LOG("%s = %d is not negative", e->name, e->value);
		ASSERT_NE(NULL, name);
		ASSERT_NE(NULL, text);
		EXPECT_STREQ(e->name, name);
		EXPECT_STREQ(e->text, text);
		EXPECT_NE('\0', text[0]) TH_LOG("%s has an empty description", e->name);
		/* libape's own codes live in -4000..-4099; the others claim to be -errno */
		if (e->value <= -4000) {
			EXPECT_LE(-4099, e->value) TH_LOG("%s = %d", e->name, e->value);
		}
		for (int j = 0; j < i; j++) {
			EXPECT_NE(err_table[j].value, e->value)
			TH_LOG("%s and %s share a code", err_table[j].name, e->name);
			EXPECT_STRNE(err_table[j].name, e->name);
		}
	}
	EXPECT_STREQ("APE_OK", ape_err_name(APE_OK));
	ASSERT_NE(NULL, ape_strerror(APE_OK));
	EXPECT_NE('\0', ape_strerror(APE_OK)[0]);
}

TEST(error_codes_are_negated_errno)
{
	EXPECT_EQ(-EIO, APE_EIO);
	EXPECT_EQ(-ENOMEM, APE_ENOMEM);
	EXPECT_EQ(-EBUSY, APE_EBUSY);
	EXPECT_EQ(-ENODEV, APE_ENODEV);
	EXPECT_EQ(-EINVAL, APE_EINVAL);
	EXPECT_EQ(-ERANGE, APE_ERANGE);
	EXPECT_EQ(-EOVERFLOW, APE_EOVERFLOW);
	EXPECT_EQ(-ENOTSUP, APE_ENOTSUP);
	EXPECT_EQ(-4000, APE_EBACKEND);
	EXPECT_EQ(-4001, APE_EDEVLOST);
	EXPECT_EQ(-4002, APE_EBUILD);
	EXPECT_EQ(-4003, APE_ENOBACKEND);
	EXPECT_EQ(-4004, APE_EFORMAT);
}

TEST(unknown_error_codes)
{
	static const int unknown[] = { -9999, 1, 4, -1, -2, -4005, -4099, -4100, INT_MIN, INT_MAX };

	for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
		const char *text = ape_strerror(unknown[i]), *name = ape_err_name(unknown[i]);

		ASSERT_NE(NULL, text);
		ASSERT_NE(NULL, name);
		EXPECT_STREQ("unknown error", text) TH_LOG("code %d", unknown[i]);
		EXPECT_STREQ("APE_EUNKNOWN", name) TH_LOG("code %d", unknown[i]);
	}
}

/* ---------------------------------------------------------------- per-thread messages */

struct thread_msg {
	int ret;
	char msg[1024];
};

static void *fail_in_thread(void *arg)
{
	struct thread_msg *m = arg;

	m->ret = ape_context_create(NULL, NULL);
	snprintf(m->msg, sizeof(m->msg), "%s", ape_last_error());
	return NULL;
}

static void *read_fresh_thread(void *arg)
{
	struct thread_msg *m = arg;
	const char *s = ape_last_error();

	m->ret = s != NULL;
	snprintf(m->msg, sizeof(m->msg), "%s", s ? s : "(null)");
	return NULL;
}

TEST(last_error_is_per_thread)
{
	struct thread_msg tm = { 0 }, fresh = { 0 };
	char mine[1024];
	pthread_t t;

	ASSERT_EQ(APE_EINVAL, ape_device_list(NULL, NULL, 0));
	snprintf(mine, sizeof(mine), "%s", ape_last_error());
	ASSERT_TRUE(has(mine, "ape_device_list")) TH_LOG("%s", mine);

	ASSERT_EQ(0, pthread_create(&t, NULL, fail_in_thread, &tm));
	ASSERT_EQ(0, pthread_join(t, NULL));
	EXPECT_EQ(APE_EINVAL, tm.ret);
	EXPECT_TRUE(has(tm.msg, "ape_context_create")) TH_LOG("thread saw \"%s\"", tm.msg);
	EXPECT_STREQ(mine, ape_last_error());

	/* a thread that never failed has an empty message, not ours and not NULL */
	ASSERT_EQ(0, pthread_create(&t, NULL, read_fresh_thread, &fresh));
	ASSERT_EQ(0, pthread_join(t, NULL));
	EXPECT_EQ(1, fresh.ret);
	EXPECT_STREQ("", fresh.msg);
}

#define N_ERR_THREADS 8

struct err_worker {
	ape_context *ctx;
	int id;
	int bad; /* iterations where the thread saw a message that was not its own */
};

static void *err_worker(void *arg)
{
	struct err_worker *w = arg;
	char want[64];

	snprintf(want, sizeof(want), "index = %d:", 1000 + w->id);
	for (int i = 0; i < 2000; i++) {
		ape_backend_info info;

		if (ape_backend_get_info(w->ctx, 1000 + w->id, &info) != APE_EINVAL ||
		    !has(ape_last_error(), want))
			w->bad++;
		/* success does not clear the message */
		if (ape_device_list(w->ctx, NULL, 0) < 0 || !has(ape_last_error(), want))
			w->bad++;
	}
	return NULL;
}

TEST(last_error_concurrent_threads)
{
	struct err_worker w[N_ERR_THREADS];
	pthread_t t[N_ERR_THREADS];
	ape_context *ctx = ref_context();

	ASSERT_NE(NULL, ctx);
	for (int i = 0; i < N_ERR_THREADS; i++) {
		w[i] = (struct err_worker){ .ctx = ctx, .id = i };
		ASSERT_EQ(0, pthread_create(&t[i], NULL, err_worker, &w[i]));
	}
	for (int i = 0; i < N_ERR_THREADS; i++) {
		ASSERT_EQ(0, pthread_join(t[i], NULL));
		EXPECT_EQ(0, w[i].bad) TH_LOG("thread %d saw foreign messages", i);
	}
	ape_context_destroy(ctx);
}

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

/* ---------------------------------------------------------------- initialisers */

TEST(attn_desc_defaults)
{
	ape_attn_desc d;

	memset(&d, 0x5a, sizeof(d));
	ape_attn_desc_init(&d);
	EXPECT_EQ(sizeof(d), d.struct_size);
	EXPECT_TRUE(d.delta.value == 0.0f && d.beta.value == 0.0f && d.gamma.value == 0.0f &&
		    d.lambda.value == 0.0f);
	EXPECT_EQ(NULL, d.delta.per_head);
	EXPECT_EQ(NULL, d.beta.per_head);
	EXPECT_EQ(NULL, d.gamma.per_head);
	EXPECT_EQ(NULL, d.lambda.per_head);
	EXPECT_TRUE(d.rope_base == 10000.0) TH_LOG("rope_base %g", d.rope_base);
	EXPECT_FALSE(d.scale_set);
	EXPECT_TRUE(d.causal);
	EXPECT_EQ(APE_ROPE_HALF, d.layout);
	EXPECT_EQ(0, d.k_start);
	EXPECT_FALSE(d.q_start_set);
	EXPECT_TRUE(d.skip_tol == 0x1p-24) TH_LOG("skip_tol %g", d.skip_tol);
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

TEST(stats_init_zeroes)
{
	ape_stats st, zero;

	memset(&st, 0x5a, sizeof(st));
	ape_stats_init(&st);
	memset(&zero, 0, sizeof(zero));
	zero.struct_size = sizeof(zero);
	EXPECT_EQ(sizeof(st), st.struct_size);
	EXPECT_EQ(0u, st.pairs_visible);
	EXPECT_EQ(0u, st.pairs_computed);
	EXPECT_TRUE(st.kernel_ms == 0 && st.total_ms == 0);
	EXPECT_EQ(0, memcmp(&zero, &st, sizeof(st)));
}

TEST(tensor_init_and_dtypes)
{
	ape_tensor t;
	float buf[4];

	memset(&t, 0x5a, sizeof(t));
	ape_tensor_init(&t, buf, APE_BF16, 2, 3, 5, 7);
	EXPECT_EQ((void *)buf, t.data);
	EXPECT_EQ(APE_BF16, t.dtype);
	EXPECT_EQ(2, t.shape[0]);
	EXPECT_EQ(3, t.shape[1]);
	EXPECT_EQ(5, t.shape[2]);
	EXPECT_EQ(7, t.shape[3]);
	for (int d = 0; d < 4; d++) {
		EXPECT_EQ(0, t.strides[d]);
	}

	EXPECT_EQ(4u, ape_dtype_size(APE_F32));
	EXPECT_EQ(2u, ape_dtype_size(APE_F16));
	EXPECT_EQ(2u, ape_dtype_size(APE_BF16));
	EXPECT_EQ(0u, ape_dtype_size((ape_dtype)7));
	EXPECT_STREQ("f32", ape_dtype_name(APE_F32));
	EXPECT_STREQ("f16", ape_dtype_name(APE_F16));
	EXPECT_STREQ("bf16", ape_dtype_name(APE_BF16));
	EXPECT_STREQ("?", ape_dtype_name((ape_dtype)7));
}

TEST(tensor_rows_view)
{
	uint16_t buf[2 * 3 * 5 * 4];
	ape_tensor t, v;

	ape_tensor_init(&t, buf, APE_F16, 2, 3, 5, 4);
	ASSERT_EQ(0, ape_tensor_rows(&t, 1, 3, &v));
	EXPECT_EQ((void *)(buf + 4), v.data);
	EXPECT_EQ(3, v.shape[2]);
	EXPECT_EQ(60, v.strides[0]);
	EXPECT_EQ(20, v.strides[1]);
	EXPECT_EQ(4, v.strides[2]);
	EXPECT_EQ(1, v.strides[3]);
	/* a view of a view keeps the parent's strides */
	ASSERT_EQ(0, ape_tensor_rows(&v, 2, 1, &v));
	EXPECT_EQ((void *)(buf + 12), v.data);
	EXPECT_EQ(20, v.strides[1]);
	/* the empty ranges at either end are views too */
	EXPECT_EQ(0, ape_tensor_rows(&t, 0, 0, &v));
	EXPECT_EQ(0, ape_tensor_rows(&t, 5, 0, &v));

	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 4, 2, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "rows [4, 4 + 2) are not inside [0, 5)"));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, -1, 1, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 6, 0, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 1, INT64_MAX, &v));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(NULL, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t is NULL"));
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, NULL));
	EXPECT_NE(NULL, strstr(ape_last_error(), "out is NULL"));
	t.strides[1] = -3;
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t->strides[1] = -3"));
	t.strides[1] = 0;
	t.dtype = (ape_dtype)9;
	EXPECT_EQ(APE_EINVAL, ape_tensor_rows(&t, 0, 1, &v));
	EXPECT_NE(NULL, strstr(ape_last_error(), "t->dtype = 9"));
}

/* ---------------------------------------------------------------- storage conversion */


static bool is_nan16(uint16_t bits, bool bf16)
{
	uint16_t exp = bf16 ? 0x7f80 : 0x7c00;

	return (bits & exp) == exp && (bits & (uint16_t)~(exp | 0x8000));
}

static uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static float bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static uint16_t to16(float f, ape_dtype dt)
{
	uint16_t h = 0x1234;

	ape_convert(&h, dt, &f, APE_F32, 1);
	return h;
}

/* Every 16-bit pattern widens exactly and narrows back to itself; NaN stays NaN. */
static void check_roundtrip(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	uint16_t *h = malloc(65536 * sizeof(*h)), *back = malloc(65536 * sizeof(*back));
	float *f = malloc(65536 * sizeof(*f));
	int bad_value = 0, bad_back = 0;

	ASSERT_TRUE(h && back && f);
	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	ASSERT_EQ(0, ape_convert(f, APE_F32, h, dt, 65536));
	ASSERT_EQ(0, ape_convert(back, dt, f, APE_F32, 65536));
	for (uint32_t i = 0; i < 65536; i++) {
		long double want = naive_decode16(h[i], bf16);

		if (is_nan16(h[i], bf16)) {
			bad_value += !isnan(f[i]);
			bad_back += !is_nan16(back[i], bf16);
			continue;
		}
		if ((long double)f[i] != want || !signbit(f[i]) != !signbit(want)) {
			if (bad_value++ < 5)
				TH_LOG("%s 0x%04x widened to %a, want %La", ape_dtype_name(dt), i,
				       (double)f[i], want);
		}
		if (back[i] != h[i] && bad_back++ < 5)
			TH_LOG("%s 0x%04x came back as 0x%04x", ape_dtype_name(dt), i, back[i]);
	}
	EXPECT_EQ(0, bad_value);
	EXPECT_EQ(0, bad_back);
	free(h);
	free(back);
	free(f);
}

TEST(convert_f16_roundtrip_exhaustive)
{
	check_roundtrip(_metadata, APE_F16);
}

TEST(convert_bf16_roundtrip_exhaustive)
{
	check_roundtrip(_metadata, APE_BF16);
}

/*
 * The exact midpoint between every two adjacent finite values (subnormals included) must round to
 * the one with the even pattern, and the floats just beside it to the nearer one. The last pair
 * is the largest finite value and the first power of two past it: its midpoint overflows.
 */
static void check_ties(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	const uint16_t max_finite = bf16 ? 0x7f7f : 0x7bff, inf = bf16 ? 0x7f80 : 0x7c00;
	int bad = 0;

	for (uint32_t lo = 0; lo <= max_finite; lo++) {
		const uint16_t hi = (uint16_t)(lo + 1);
		long double a = naive_decode16((uint16_t)lo, bf16);
		long double b = hi == inf ? ldexpl(1, bf16 ? 128 : 16) : naive_decode16(hi, bf16);
		long double mid = (a + b) / 2;
		float m = (float)mid, below = nextafterf(m, 0), above = nextafterf(m, INFINITY);
		uint16_t even = (lo & 1) ? hi : (uint16_t)lo;
		uint16_t got_m = to16(m, dt), got_below = to16(below, dt);
		uint16_t got_above = to16(above, dt), got_neg = to16(-m, dt);

		ASSERT_TRUE((long double)m == mid) TH_LOG("midpoint %La is not a float", mid);
		if (got_m != even || got_below != lo || got_above != hi ||
		    got_neg != (even | 0x8000)) {
			if (bad++ < 5)
				TH_LOG("%s: between 0x%04x and 0x%04x: %a -> 0x%04x (want 0x%04x), "
				       "below -> 0x%04x, above -> 0x%04x, negated -> 0x%04x",
				       ape_dtype_name(dt), lo, hi, (double)m, got_m, even,
				       got_below, got_above, got_neg);
		}
	}
	EXPECT_EQ(0, bad);
}

TEST(convert_f16_ties_to_even)
{
	check_ties(_metadata, APE_F16);
	/* the overflow threshold, spelled out */
	EXPECT_EQ(0x7c00, to16(65520.0f, APE_F16));
	EXPECT_EQ(0x7bff, to16(65519.99f, APE_F16));
	EXPECT_EQ(0x7bff, to16(65504.0f, APE_F16));
	EXPECT_EQ(0xfc00, to16(-65520.0f, APE_F16));
	EXPECT_EQ(0x7c00, to16(1e6f, APE_F16));
	EXPECT_EQ(0x7c00, to16(FLT_MAX, APE_F16));
	EXPECT_EQ(0x7c00, to16(INFINITY, APE_F16));
	EXPECT_EQ(0xfc00, to16(-INFINITY, APE_F16));
	/* below half the smallest subnormal (2^-25): zero, sign kept; 2^-25 itself ties to 0 */
	EXPECT_EQ(0x0000, to16(0x1p-25f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0x1p-25f, APE_F16));
	EXPECT_EQ(0x0001, to16(nextafterf(0x1p-25f, 1), APE_F16));
	EXPECT_EQ(0x0000, to16(nextafterf(0x1p-25f, 0), APE_F16));
	EXPECT_EQ(0x0000, to16(0x1p-26f, APE_F16));
	EXPECT_EQ(0x0000, to16(FLT_MIN, APE_F16));
	EXPECT_EQ(0x0000, to16(0x1p-149f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0x1p-149f, APE_F16));
	EXPECT_EQ(0x0000, to16(0.0f, APE_F16));
	EXPECT_EQ(0x8000, to16(-0.0f, APE_F16));
	/* 1.5 * 2^-24 ties between subnormals 1 and 2: even is 2 */
	EXPECT_EQ(0x0002, to16(0x1.8p-24f, APE_F16));
	/* the smallest normal half, reached from below by rounding */
	EXPECT_EQ(0x0400, to16(nextafterf(0x1p-14f, 0), APE_F16));
}

TEST(convert_bf16_ties_to_even)
{
	check_ties(_metadata, APE_BF16);
	EXPECT_EQ(0x7f80, to16(FLT_MAX, APE_BF16));
	EXPECT_EQ(0x7f80, to16(INFINITY, APE_BF16));
	EXPECT_EQ(0xff80, to16(-INFINITY, APE_BF16));
	EXPECT_EQ(0x0000, to16(0x1p-134f, APE_BF16));
	EXPECT_EQ(0x0000, to16(0x1p-149f, APE_BF16));
	EXPECT_EQ(0x8000, to16(-0x1p-149f, APE_BF16));
	EXPECT_EQ(0x0000, to16(0.0f, APE_BF16));
	EXPECT_EQ(0x8000, to16(-0.0f, APE_BF16));
	EXPECT_EQ(0x3f80, to16(1.0f, APE_BF16));
}

TEST(convert_nan_stays_nan)
{
	static const uint32_t nans[] = { 0x7f800001u, 0x7fc00000u, 0xffc00000u, 0x7f802000u,
					 0x7f801fffu, 0xffffffffu, 0x7fbfffffu, 0xff800001u };

	for (size_t i = 0; i < sizeof(nans) / sizeof(nans[0]); i++) {
		float f = bits_f32(nans[i]);

		EXPECT_TRUE(is_nan16(to16(f, APE_F16), false))
		TH_LOG("0x%08x -> f16 0x%04x", nans[i], to16(f, APE_F16));
		EXPECT_TRUE(is_nan16(to16(f, APE_BF16), true))
		TH_LOG("0x%08x -> bf16 0x%04x", nans[i], to16(f, APE_BF16));
	}
}

/* Sorted positive finite values of a 16-bit type; pattern i is value i. */
static long double *value_table(bool bf16, uint32_t *count)
{
	uint32_t n = (bf16 ? 0x7f7fu : 0x7bffu) + 1;
	long double *v = malloc(n * sizeof(*v));

	for (uint32_t i = 0; v && i < n; i++)
		v[i] = naive_decode16((uint16_t)i, bf16);
	*count = n;
	return v;
}

/* The nearest value by search, ties to the even pattern, overflow past the last midpoint. */
static uint16_t nearest16(const long double *v, uint32_t n, bool bf16, float x)
{
	long double ax = fabsl((long double)x), next = ldexpl(1, bf16 ? 128 : 16);
	uint16_t sign = signbit(x) ? 0x8000 : 0, pick;
	uint32_t lo = 0, hi = n - 1;

	while (lo < hi) { /* largest i with v[i] <= ax */
		uint32_t mid = lo + (hi - lo + 1) / 2;

		if (v[mid] <= ax)
			lo = mid;
		else
			hi = mid - 1;
	}
	{
		long double a = v[lo], b = lo + 1 < n ? v[lo + 1] : next;
		long double da = ax - a, db = b - ax;

		if (da < db)
			pick = (uint16_t)lo;
		else if (db < da)
			pick = (uint16_t)(lo + 1);
		else
			pick = (uint16_t)((lo & 1) ? lo + 1 : lo);
	}
	return sign | pick; /* lo + 1 == n is the infinity pattern */
}

static float random_float(ape_rng *r, bool bf16)
{
	uint64_t x = ape_rng_next(r);
	uint32_t u = (uint32_t)x, sign = u & 0x80000000u;

	switch ((x >> 32) % 3) {
	case 0: /* any pattern: every exponent equally likely */
		break;
	case 1: { /* exponents around the type's range, where the rounding happens */
		int lo = bf16 ? 127 - 135 : 127 - 27, hi = bf16 ? 127 + 128 : 127 + 17;
		int e = (int)ape_rng_range(r, lo < 0 ? 0 : lo, hi > 254 ? 254 : hi);

		u = sign | ((uint32_t)e << 23) | (u & 0x7fffffu);
		break;
	}
	default: { /* a few ulps around a midpoint of two adjacent 16-bit values */
		uint32_t m = (uint32_t)ape_rng_range(r, 0, bf16 ? 0x7f7e : 0x7bfe);
		long double a = naive_decode16((uint16_t)m, bf16), b = naive_decode16((uint16_t)(m + 1), bf16);
		float f = (float)((a + b) / 2);

		u = f32_bits(f) + (uint32_t)ape_rng_range(r, -3, 3);
		u = sign | (u & 0x7fffffffu);
		break;
	}
	}
	if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu))
		u &= ~0x7fffffu; /* NaN: tested elsewhere; use the infinity */
	return bits_f32(u);
}

static void check_random_vs_reference(struct __test_metadata *_metadata, ape_dtype dt)
{
	const bool bf16 = dt == APE_BF16;
	const size_t n = ape_test_slow() ? 20000 : 300000;
	float *x = malloc(n * sizeof(*x));
	uint16_t *got = malloc(n * sizeof(*got));
	uint32_t nv;
	long double *v = value_table(bf16, &nv);
	ape_rng rng;
	int bad = 0;

	ASSERT_TRUE(x && got && v);
	ape_rng_init(&rng, bf16 ? "convert_bf16_random" : "convert_f16_random");
	for (size_t i = 0; i < n; i++)
		x[i] = random_float(&rng, bf16);
	ASSERT_EQ(0, ape_convert(got, dt, x, APE_F32, n));
	for (size_t i = 0; i < n; i++) {
		uint16_t want = nearest16(v, nv, bf16, x[i]);

		if (got[i] != want && bad++ < 5)
			TH_LOG("%s: %a (0x%08x) -> 0x%04x, nearest is 0x%04x", ape_dtype_name(dt),
			       (double)x[i], f32_bits(x[i]), got[i], want);
	}
	EXPECT_EQ(0, bad);
	free(x);
	free(got);
	free(v);
}

TEST(convert_f16_random_vs_long_double)
{
	check_random_vs_reference(_metadata, APE_F16);
}

TEST(convert_bf16_random_vs_long_double)
{
	check_random_vs_reference(_metadata, APE_BF16);
}

/* f16 <-> bf16 directly rounds once, like going through f32; in place works for equal sizes. */
TEST(convert_between_16bit_types)
{
	uint16_t *h = malloc(65536 * 2), *direct = malloc(65536 * 2), *two = malloc(65536 * 2);
	float *f = malloc(65536 * sizeof(float));
	int bad = 0;

	ASSERT_TRUE(h && direct && two && f);
	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	for (int pass = 0; pass < 2; pass++) {
		ape_dtype from = pass ? APE_BF16 : APE_F16, to = pass ? APE_F16 : APE_BF16;

		ASSERT_EQ(0, ape_convert(direct, to, h, from, 65536));
		ASSERT_EQ(0, ape_convert(f, APE_F32, h, from, 65536));
		ASSERT_EQ(0, ape_convert(two, to, f, APE_F32, 65536));
		for (uint32_t i = 0; i < 65536; i++) {
			bool nan = is_nan16(h[i], from == APE_BF16);

			if (nan ? !is_nan16(direct[i], to == APE_BF16) : direct[i] != two[i])
				if (bad++ < 5)
					TH_LOG("%s 0x%04x -> %s 0x%04x, via f32 0x%04x",
					       ape_dtype_name(from), i, ape_dtype_name(to),
					       direct[i], two[i]);
		}
		memcpy(two, h, 65536 * 2);
		ASSERT_EQ(0, ape_convert(two, to, two, from, 65536));
		EXPECT_EQ(0, memcmp(direct, two, 65536 * 2)) TH_LOG("in place differs");
	}
	EXPECT_EQ(0, bad);

	/* same type: a copy, and a no-op in place */
	for (uint32_t i = 0; i < 1024; i++)
		f[i] = (float)i * 0.37f - 100;
	memcpy(two, f, 1024 * sizeof(float));
	ASSERT_EQ(0, ape_convert(f + 2048, APE_F32, f, APE_F32, 1024));
	EXPECT_EQ(0, memcmp(f, f + 2048, 1024 * sizeof(float)));
	ASSERT_EQ(0, ape_convert(f, APE_F32, f, APE_F32, 1024));
	EXPECT_EQ(0, memcmp(f, two, 1024 * sizeof(float)));
	free(h);
	free(direct);
	free(two);
	free(f);
}

TEST(convert_errors)
{
	float src[4] = { 1, 2, 3, 4 };
	uint16_t dst[4] = { 0xaaaa, 0xaaaa, 0xaaaa, 0xaaaa };

	EXPECT_EQ(APE_EINVAL, ape_convert(dst, (ape_dtype)7, src, APE_F32, 4));
	EXPECT_MSG("ape_convert");
	EXPECT_MSG("dst_type");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, src, (ape_dtype)7, 4));
	EXPECT_MSG("src_type");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, src, (ape_dtype)-1, 4));
	EXPECT_EQ(APE_EINVAL, ape_convert(NULL, APE_F16, src, APE_F32, 4));
	EXPECT_MSG("dst");
	EXPECT_EQ(APE_EINVAL, ape_convert(dst, APE_F16, NULL, APE_F32, 4));
	EXPECT_MSG("src");
	EXPECT_EQ(APE_EINVAL, ape_convert(NULL, APE_F32, NULL, APE_F32, 1));
	for (int i = 0; i < 4; i++) {
		EXPECT_EQ(0xaaaa, dst[i]) TH_LOG("a failed conversion wrote element %d", i);
	}
	/* nothing to convert: NULL is fine */
	EXPECT_EQ(0, ape_convert(NULL, APE_F16, NULL, APE_F32, 0));
	EXPECT_EQ(0, ape_convert(NULL, APE_BF16, NULL, APE_F16, 0));
}

/* ---------------------------------------------------------------- visible pairs */

static uint64_t brute_pairs(bool causal, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t qs,
			    int64_t ks)
{
	uint64_t n = 0;

	for (int64_t i = 0; i < Lq; i++)
		for (int64_t j = 0; j < Lk; j++)
			n += !causal || ks + j <= qs + i;
	return n * (uint64_t)B * (uint64_t)H;
}

TEST(visible_pairs_brute_force)
{
	const int iters = ape_test_slow() ? 2000 : 20000;
	ape_rng rng;
	int bad = 0;

	ape_rng_init(&rng, "visible_pairs_brute_force");
	for (int it = 0; it < iters; it++) {
		ape_attn_desc d;
		int64_t B = ape_rng_range(&rng, 0, 3), H = ape_rng_range(&rng, 0, 3);
		int64_t Lq = ape_rng_range(&rng, 0, 40), Lk = ape_rng_range(&rng, 0, 40), qs;
		uint64_t got = 0xdeadbeef, want;
		int ret;

		ape_attn_desc_init(&d);
		d.causal = ape_rng_next(&rng) & 1;
		/* small positions mostly, sometimes far from 0 (only differences matter) */
		d.k_start = ape_rng_range(&rng, -50, 50);
		if (ape_rng_next(&rng) % 4 == 0)
			d.k_start += (int64_t)(ape_rng_next(&rng) % (1ull << 60)) - (1ll << 59);
		d.q_start_set = ape_rng_next(&rng) & 1;
		/* offsets reach far before (no key visible) and far after (every key visible) */
		d.q_start = d.k_start + ape_rng_range(&rng, -100, 100);
		qs = d.q_start_set ? d.q_start : d.k_start + Lk - Lq;
		want = brute_pairs(d.causal, B, H, Lq, Lk, qs, d.k_start);
		ret = ape_visible_pairs(&d, B, H, Lq, Lk, &got);
		if ((ret || got != want) && bad++ < 5)
			TH_LOG("causal %d B %lld H %lld Lq %lld Lk %lld q_start %lld k_start %lld: "
			       "ret %d, %llu pairs, want %llu (%s)",
			       d.causal, (long long)B, (long long)H, (long long)Lq, (long long)Lk,
			       (long long)qs, (long long)d.k_start, ret, (unsigned long long)got,
			       (unsigned long long)want, ape_last_error());
	}
	EXPECT_EQ(0, bad);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct huge_case {
	bool causal, q_set;
	int64_t B, H, Lq, Lk, q_start, k_start;
	int ret;
	uint64_t pairs;
};

TEST(visible_pairs_huge)
{
	const int64_t T40 = 1ll << 40, T32 = 1ll << 32, T31 = 1ll << 31;
	const struct huge_case cases[] = {
		/* full causal square of 2^40: about 2^79 pairs */
		{ true, false, 1, 1, T40, T40, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 1, 1, T40, T40, 0, 0, APE_EOVERFLOW, 0 },
		{ true, false, 1, 1, T32 - 1, T32 - 1, 0, 0, 0,
		  (uint64_t)(T32 - 1) * (uint64_t)T31 },
		{ true, false, 1, 1, 2 * T32, 2 * T32, 0, 0, APE_EOVERFLOW, 0 },
		/* exactly 2^64 - 1, then exactly 2^64 */
		{ false, false, 1, 1, T32 - 1, T32 + 1, 0, 0, 0, UINT64_MAX },
		{ false, false, 1, 1, T32, T32, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 3, 1, T31, T31, 0, 0, 0, 3ull << 62 },
		{ false, false, 4, 1, T31, T31, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 2, 2, T31, T31, 0, 0, APE_EOVERFLOW, 0 },
		{ false, false, 1, 3, T31, T31, 0, 0, 0, 3ull << 62 },
		/* queries entirely before the keys, entirely after, and touching at one pair */
		{ true, true, 1, 1, T40, T40, -2 * T40, 0, 0, 0 },
		{ true, true, 1, 1, T40, 4, 10, 0, 0, 4 * (uint64_t)T40 },
		{ true, true, 1, 1, T40, T40, -T40 + 1, 0, 0, 1 },
		{ true, false, 1, 1, 1, T40, 0, 0, 0, (uint64_t)T40 },
		/* end-aligned: only the last Lk rows see keys, a triangle */
		{ true, false, 7, 5, T40, 1 << 20, 0, 0, 0, 35 * ((1ull << 39) + (1ull << 19)) },
		/* far positions: fine while the ends fit, EOVERFLOW when they do not */
		{ true, false, 1, 1, T40, T40, 0, INT64_MAX - T40, APE_EOVERFLOW, 0 },
		{ true, false, 1, 1, T31, T31, 0, INT64_MAX - T31 + 1, 0,
		  (uint64_t)T31 * (uint64_t)(T31 + 1) / 2 },
		{ true, false, 1, 1, 5, 6, 0, INT64_MAX - 2, APE_EOVERFLOW, 0 },
		{ true, true, 1, 1, 5, 6, INT64_MIN, 10, APE_EOVERFLOW, 0 },
		{ false, true, 1, 1, 1, 1, INT64_MAX, INT64_MIN, APE_EOVERFLOW, 0 },
	};
	double t0 = now_s();

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct huge_case *c = &cases[i];
		ape_attn_desc d;
		uint64_t got = 0xdeadbeef;
		int ret;

		ape_attn_desc_init(&d);
		d.causal = c->causal;
		d.q_start_set = c->q_set;
		d.q_start = c->q_start;
		d.k_start = c->k_start;
		ret = ape_visible_pairs(&d, c->B, c->H, c->Lq, c->Lk, &got);
		EXPECT_EQ(c->ret, ret) TH_LOG("case %zu: %s", i, ape_last_error());
		if (c->ret == 0 && ret == 0) {
			EXPECT_EQ(c->pairs, got) TH_LOG("case %zu", i);
		}
		if (c->ret) {
			EXPECT_EQ(0xdeadbeefu, got) TH_LOG("case %zu: *out written on failure", i);
			EXPECT_MSG("ape_visible_pairs");
		}
	}
	/* a closed form: absurd lengths must cost nothing */
	EXPECT_GT(2.0, now_s() - t0);
}

/* With no batch or no head there is no pair at all, however long the sequences. */
TEST(visible_pairs_zero_heads_do_not_overflow)
{
	const int64_t T40 = 1ll << 40;
	ape_attn_desc d;
	uint64_t got = 0xdeadbeef;

	ape_attn_desc_init(&d);
	d.causal = false;
	EXPECT_EQ(0, ape_visible_pairs(&d, 0, 1, T40, T40, &got)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0u, got);
	got = 0xdeadbeef;
	EXPECT_EQ(0, ape_visible_pairs(&d, 1 << 20, 0, 1ll << 31, 1ll << 31, &got))
	TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0u, got);
}

TEST(visible_pairs_errors)
{
	static const int64_t sizes[][4] = {
		{ -1, 1, 1, 1 }, { 1, -1, 1, 1 }, { 1, 1, -1, 1 },
		{ 1, 1, 1, -1 }, { INT64_MIN, 1, 1, 1 },
	};
	ape_attn_desc d;
	uint64_t got = 0xdeadbeef;

	ape_attn_desc_init(&d);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, sizes[i][0], sizes[i][1], sizes[i][2],
							sizes[i][3], &got))
		TH_LOG("sizes %zu", i);
		EXPECT_MSG("ape_visible_pairs");
	}
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(NULL, 1, 1, 1, 1, &got));
	EXPECT_MSG("desc");
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, 1, 1, 1, 1, NULL));
	EXPECT_MSG("out");
	d.struct_size = 0;
	EXPECT_EQ(APE_EINVAL, ape_visible_pairs(&d, 1, 1, 1, 1, &got));
	EXPECT_MSG("struct_size");
	EXPECT_EQ(0xdeadbeefu, got);

	ape_attn_desc_init(&d);
	EXPECT_EQ(0, ape_visible_pairs(&d, 0, 0, 0, 0, &got));
	EXPECT_EQ(0u, got);
}

TEST_HARNESS_MAIN
