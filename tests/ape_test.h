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
 * unhurried: give every test a generous budget rather than flaky kills on a loaded machine. */
#undef TEST_TIMEOUT_DEFAULT
#define TEST_TIMEOUT_DEFAULT 600

#include "common/testutil.h"

#endif
