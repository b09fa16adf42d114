/* SPDX-License-Identifier: MIT */
/*
 * The public API's contract, ape.h's sections "Version" and "Errors": the version numbers, the
 * error table (names, texts, -errno values, libape's own range, unknown codes) and the
 * per-thread message of ape_last_error(). Holds on any machine: contexts load only "ref".
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ape_test.h"
#include "ape/ape_backend.h"
#include "common/apitest.h"

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

/* Context around what failed below: the current message may be an argument of the new one (as a
 * ragged call wraps what its sequence's call said), and comes out whole. */
TEST(message_wraps_itself)
{
	ape_be_error(APE_EDEVLOST, "plug_a:0 fixture: attention: kernel %d faulted", 7);
	EXPECT_EQ(APE_EDEVLOST, ape_be_error(APE_EDEVLOST, "call: sequence %d (rows 0..3): %s", 2,
					     ape_last_error()));
	EXPECT_STREQ("call: sequence 2 (rows 0..3): plug_a:0 fixture: attention: kernel 7 faulted",
		     ape_last_error());
}

TEST_HARNESS_MAIN
