/* SPDX-License-Identifier: MIT */
/*
 * The fixture the executor tests run under (include after ape_test.h): one variant per backend,
 * `ref`, `opencl` and `cuda` (on the CPU emulator where there is no GPU: common/backends.h);
 * self->dev is the variant's device, self->ref the reference for the expected results, self->emu
 * true on the emulated CUDA device, where kernels run slowly and tests that say so use smaller
 * shapes. A variant whose backend is absent (not built, no driver, no platform) SKIPs with the
 * reason the context gives. Teardown removes a wrapper a test may have installed
 * (common/wrapops.h). A macro, because the harness needs the fixture defined in the test's own
 * file.
 */
#ifndef APE_TEST_BACKEND_FIXTURE_H
#define APE_TEST_BACKEND_FIXTURE_H

#include <string.h>

/* APE_BACKEND_NAMES only: the X-macros of the registry's entries are left undefined */
#define APE_BACKEND_BUILT(name, ops)
#define APE_BACKEND_NOT_BUILT(name, why)
#include "ape_backends.h"
#undef APE_BACKEND_BUILT
#undef APE_BACKEND_NOT_BUILT
#include "common/backends.h"
#include "common/testutil.h"
#include "common/wrapops.h"

/* One variant per backend the build knows (APE_BACKEND_NAMES: every backend.mk's, built or not,
 * from the generated $(BUILD)/gen/ape_backends.h), so that a backend added to the tree runs these
 * suites without an edit here. */
#define BACKEND_FIXTURE_VARIANT(fx, name) FIXTURE_VARIANT_ADD(fx, name){ .backend = #name };

#define BACKEND_FIXTURE(fx)                                                                        \
	FIXTURE(fx)                                                                                \
	{                                                                                          \
		ape_context *ctx;                                                                  \
		ape_device *dev, *ref;                                                             \
		bool emu;                                                                          \
	};                                                                                         \
	FIXTURE_VARIANT(fx)                                                                        \
	{                                                                                          \
		const char *backend;                                                               \
	};                                                                                         \
	APE_BACKEND_NAMES(BACKEND_FIXTURE_VARIANT, fx)                                             \
	FIXTURE_SETUP(fx)                                                                          \
	{                                                                                          \
		const bool is_ref = !strcmp(variant->backend, "ref");                              \
		char why[TEST_WHY_LEN], names[32];                                                 \
                                                                                                   \
		if (test_backend_prepare(variant->backend, NULL, why, sizeof(why)))                \
			APE_SETUP_SKIP((void)0, "%s", why);                                        \
		snprintf(names, sizeof(names), "ref%s%s", is_ref ? "" : ",",                       \
			 is_ref ? "" : variant->backend);                                          \
		self->ctx = test_context(names);                                                   \
		ASSERT_NE(NULL, self->ctx);                                                        \
		self->ref = test_device(self->ctx, "ref");                                         \
		ASSERT_NE(NULL, self->ref);                                                        \
		self->dev = test_device(self->ctx, variant->backend);                              \
		if (!self->dev) {                                                                  \
			test_backend_absent(self->ctx, variant->backend, why, sizeof(why));        \
			APE_SETUP_SKIP(ape_context_destroy(self->ctx), "%s", why);                 \
		}                                                                                  \
		self->emu = !strcmp(variant->backend, "cuda") && test_cuda_emulated();             \
	}                                                                                          \
	FIXTURE_TEARDOWN(fx)                                                                       \
	{                                                                                          \
		wrap_remove();                                                                     \
		ape_context_destroy(self->ctx);                                                    \
	}


/* The reference device alone (self->dev), for the tests of the reference itself and of the
 * API. */
#define REF_FIXTURE(fx)                                                                            \
	FIXTURE(fx)                                                                                \
	{                                                                                          \
		ape_context *ctx;                                                                  \
		ape_device *dev;                                                                   \
	};                                                                                         \
	FIXTURE_SETUP(fx)                                                                          \
	{                                                                                          \
		self->ctx = test_context("ref");                                                   \
		self->dev = test_device(self->ctx, "ref");                                         \
		ASSERT_NE(NULL, self->dev);                                                        \
	}                                                                                          \
	FIXTURE_TEARDOWN(fx)                                                                       \
	{                                                                                          \
		ape_context_destroy(self->ctx);                                                    \
	}

#endif
