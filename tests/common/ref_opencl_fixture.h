/* SPDX-License-Identifier: MIT */
/*
 * The fixture most executor tests run under (include after kselftest_harness.h): variants `ref`
 * and `opencl`, self->dev the variant's device, self->ref the reference for the expected
 * results; SKIP, with the reason, where the variant's backend has no device. Teardown removes a
 * wrapper a test may have installed (common/wrapops.h). A macro, because the harness needs the
 * fixture defined in the test's own file.
 */
#ifndef APE_TEST_REF_OPENCL_FIXTURE_H
#define APE_TEST_REF_OPENCL_FIXTURE_H

#include "common/testutil.h"
#include "common/wrapops.h"

#define REF_OPENCL_FIXTURE(fx)                                                                     \
	FIXTURE(fx)                                                                                \
	{                                                                                          \
		ape_context *ctx;                                                                  \
		ape_device *dev, *ref;                                                             \
	};                                                                                         \
	FIXTURE_VARIANT(fx)                                                                        \
	{                                                                                          \
		const char *backend;                                                               \
	};                                                                                         \
	FIXTURE_VARIANT_ADD(fx, ref){ .backend = "ref" };                                          \
	FIXTURE_VARIANT_ADD(fx, opencl){ .backend = "opencl" };                                    \
	FIXTURE_SETUP(fx)                                                                          \
	{                                                                                          \
		self->ctx = test_context("ref,opencl");                                            \
		ASSERT_NE(NULL, self->ctx);                                                        \
		self->ref = test_device(self->ctx, "ref");                                         \
		ASSERT_NE(NULL, self->ref);                                                        \
		self->dev = test_device(self->ctx, variant->backend);                              \
		if (!self->dev)                                                                    \
			APE_SETUP_SKIP(ape_context_destroy(self->ctx), "no %s device",             \
				       variant->backend);                                          \
	}                                                                                          \
	FIXTURE_TEARDOWN(fx)                                                                       \
	{                                                                                          \
		wrap_remove();                                                                     \
		ape_context_destroy(self->ctx);                                                    \
	}

#endif
