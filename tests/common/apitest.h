/* SPDX-License-Identifier: MIT */
/*
 * Helpers of the public API's contract tests (tests/test_api_*.c, one program per section of
 * include/ape/ape.h); include after ape_test.h. Inline: each program uses some of them.
 */
#ifndef APE_TEST_APITEST_H
#define APE_TEST_APITEST_H

#include <stdbool.h>
#include <string.h>

#include "ape/ape.h"

static inline bool has(const char *s, const char *needle)
{
	return s && needle && strstr(s, needle);
}

/* The thread's last message must contain `needle`; failures show the whole message. */
#define EXPECT_MSG(needle)                                                                         \
	EXPECT_TRUE(has(ape_last_error(), needle))                                                 \
	TH_LOG("last error \"%s\" does not mention \"%s\"", ape_last_error(), needle)

/* A context with the reference backend only (no flags), or NULL. */
static inline ape_context *ref_context(void)
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
static inline bool backend_info(ape_context *ctx, const char *name, ape_backend_info *out)
{
	int n = ape_backend_get_info(ctx, 0, NULL);

	for (int i = 0; i < n; i++)
		if (!ape_backend_get_info(ctx, i, out) && !strcmp(out->name, name))
			return true;
	return false;
}

#endif
