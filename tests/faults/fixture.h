/* SPDX-License-Identifier: MIT */
/*
 * The fixture the fault and thread tests share (include after kselftest_harness.h): a context
 * with the reference and OpenCL, dev[0] the variant's backend (the one under test), dev[1] the
 * other one; SKIP without an OpenCL device. A macro, because the harness needs the fixture
 * defined in the test's own file.
 */
#ifndef APE_TEST_FAULTS_FIXTURE_H
#define APE_TEST_FAULTS_FIXTURE_H

#include "ape_test.h"
#include "common/wrapops.h"

#define FX_FIXTURE(fx)                                                                             \
	FIXTURE(fx)                                                                                \
	{                                                                                          \
		ape_context *ctx;                                                                  \
		ape_device *dev[2];                                                                \
	};                                                                                         \
	FIXTURE_VARIANT(fx)                                                                        \
	{                                                                                          \
		const char *backend, *other;                                                       \
	};                                                                                         \
	FIXTURE_VARIANT_ADD(fx, ref){ .backend = "ref", .other = "opencl" };                       \
	FIXTURE_VARIANT_ADD(fx, opencl){ .backend = "opencl", .other = "ref" };                    \
	FIXTURE_SETUP(fx)                                                                          \
	{                                                                                          \
		self->ctx = test_context("ref,opencl");                                            \
		ASSERT_NE(NULL, self->ctx);                                                        \
		self->dev[0] = test_device(self->ctx, variant->backend);                           \
		self->dev[1] = test_device(self->ctx, variant->other);                             \
		if (!self->dev[0] || !self->dev[1])                                                \
			APE_SETUP_SKIP(ape_context_destroy(self->ctx), "no OpenCL device");        \
	}                                                                                          \
	FIXTURE_TEARDOWN(fx)                                                                       \
	{                                                                                          \
		wrap_remove(); /* a no-op unless a test wrapped a backend */                       \
		ape_context_destroy(self->ctx);                                                    \
	}

#endif
