/* SPDX-License-Identifier: MIT */
/*
 * Every libape test includes this instead of kselftest_harness.h directly: the Linux kernel's
 * harness (fetched by `make deps`, never committed) plus libape's test helpers.
 */
#ifndef APE_TEST_H
#define APE_TEST_H

#include <kselftest_harness.h>

/* The harness kills a test after TEST_TIMEOUT_DEFAULT seconds (30 upstream). Our tests scale
 * their sizes down under valgrind (see ape_test_slow()), but the reference backend is float64 and
 * unhurried, and a cold program cache has PoCL compile every kernel variant a test forces (the
 * barrier shapes of test_opencl took over 600 s on a loaded 2-core machine): give every test a
 * generous budget rather than flaky kills on a loaded machine. */
#undef TEST_TIMEOUT_DEFAULT
#define TEST_TIMEOUT_DEFAULT 1200

#include "common/testutil.h"

/*
 * TEST_HARNESS_MAIN for a program whose every test needs something this build may lack: the
 * program exits 4 (KSFT_SKIP) with the reason before running anything, so `make check` counts
 * it as skipped, not passed.
 */
#define APE_TEST_MAIN_SKIP_UNLESS(cond, reason)                                                    \
	static void __attribute__((constructor)) __constructor_order_last(void)                   \
	{                                                                                          \
		if (!__constructor_order)                                                          \
			__constructor_order = _CONSTRUCTOR_ORDER_BACKWARD;                         \
	}                                                                                          \
	int main(int argc, char **argv)                                                            \
	{                                                                                          \
		if (!(cond))                                                                       \
			ksft_exit_skip("%s\n", reason);                                            \
		return test_harness_run(argc, argv);                                               \
	}

/*
 * SKIP from a FIXTURE_SETUP: this harness (Linux 6.1) runs the test body after a setup that
 * called SKIP(), so the test child ends here instead, with the status the harness reads as
 * "skipped" (255) and the reason recorded. `cleanup` runs first (LeakSanitizer checks at _exit).
 */
#define APE_SETUP_SKIP(cleanup, fmt, ...)                                                          \
	do {                                                                                       \
		cleanup;                                                                           \
		SKIP(_exit(255), fmt, ##__VA_ARGS__);                                              \
	} while (0)

/* What optional dependencies this build has (the Makefile defines APE_HAVE_*). */
#ifdef APE_HAVE_HWLOC
#define APE_TEST_HAVE_HWLOC 1
#else
#define APE_TEST_HAVE_HWLOC 0
#endif
#ifdef APE_HAVE_DRM
#define APE_TEST_HAVE_DRM 1
#else
#define APE_TEST_HAVE_DRM 0
#endif
#define APE_TEST_NO_HWLOC "hwloc is not built into this libape (WITH_HWLOC=no, or not found)"
#define APE_TEST_NO_DRM "libdrm is not built into this libape (WITH_DRM=no, or not found)"

#endif
