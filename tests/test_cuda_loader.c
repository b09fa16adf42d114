/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's loader and error mapping, on any machine: a fake libcuda.so.1
 * (tests/fake_cuda, built by cuda/module.mk) stands in for the driver through APE_CUDA_LIBRARY,
 * its behaviour chosen with FAKE_CUDA_MODE. Every way the driver can be missing or unfit must
 * leave the backend absent with a reason the context and ape-info report (never an abort), a
 * missing optional entry point must not, and a failing driver call must come back as a libape
 * code whose message names the CUresult (cuGetErrorName).
 *
 * Each test runs in its own process (the harness forks), so the environment it sets is its own.
 * The fake cannot run kernels; tests/test_cuda_emu.c runs them.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/problem.h"

#ifdef APE_HAVE_CUDA
#include "../cuda/cu.h"
#include "core/backend.h"
#include "core/error.h"

#define FAKE_DIR APE_BUILD_DIR "/tests/fake_cuda"
#define FAKE_LIB FAKE_DIR "/libcuda.so.1"
#define FAKE_LIB_NOPA FAKE_DIR "/noproc/libcuda.so.1"

/* Points the loader at `lib` (NULL: the default search for libcuda.so.1) in `mode`. */
static void use_driver(const char *lib, const char *mode)
{
	if (lib)
		setenv("APE_CUDA_LIBRARY", lib, 1);
	else
		unsetenv("APE_CUDA_LIBRARY");
	if (mode)
		setenv("FAKE_CUDA_MODE", mode, 1);
	else
		unsetenv("FAKE_CUDA_MODE");
}

/* The cuda entry of a fresh context's backend list (the context stays open in *ctx). */
static int cuda_backend(ape_context **ctx, ape_backend_info *out)
{
	int n;

	*ctx = test_context("cuda,ref");
	if (!*ctx)
		return -1;
	n = ape_backend_get_info(*ctx, 0, NULL);
	for (int i = 0; i < n; i++)
		if (!ape_backend_get_info(*ctx, i, out) && !strcmp(out->name, "cuda"))
			return 0;
	return -1;
}

/* The backend must be absent, with a reason holding every needle (NULL-terminated). */
static void expect_absent(struct __test_metadata *_metadata, const char *lib, const char *mode,
			  const char *const *needles)
{
	ape_backend_info bi;
	ape_context *ctx;

	use_driver(lib, mode);
	ASSERT_EQ(0, cuda_backend(&ctx, &bi));
	TH_LOG("cuda: %s", bi.reason);
	EXPECT_TRUE(bi.built);
	EXPECT_FALSE(bi.available);
	EXPECT_EQ(0, bi.device_count);
	for (int n = 0; needles[n]; n++) {
		if (!strstr(bi.reason, needles[n]))
			TH_LOG("the reason lacks \"%s\"", needles[n]);
		EXPECT_NE(NULL, strstr(bi.reason, needles[n]));
	}
	/* the context still computes, on the reference */
	EXPECT_NE(NULL, test_device(ctx, "ref"));
	ape_context_destroy(ctx);
}

#define EXPECT_ABSENT(lib, mode, ...)                                                              \
	expect_absent(_metadata, lib, mode, (const char *const[]){ __VA_ARGS__, NULL })

/* ---- the driver absent or unfit: the backend is absent, with the reason */

TEST(default_library_absent)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (h) {
		dlclose(h);
		SKIP(return, "this machine has a libcuda.so.1: its absence cannot be tested here");
	}
	EXPECT_ABSENT(NULL, NULL, "libcuda.so.1 not found");
}

TEST(ape_info_says_why)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	char out[32768], err[4096];
	const char *line;

	if (h) {
		dlclose(h);
		SKIP(return, "this machine has a libcuda.so.1");
	}
	use_driver(NULL, NULL);
	ASSERT_EQ(0, test_run_tool("ape-info", (const char *const[]){ NULL }, NULL, out,
				   sizeof(out), err, sizeof(err)))
	TH_LOG("%s", err);
	line = strstr(out, "cuda     not available: ");
	ASSERT_NE(NULL, line) TH_LOG("%s", out);
	EXPECT_EQ(line, strstr(out, "cuda     not available: libcuda.so.1 not found"))
	TH_LOG("%.120s", line);
}

TEST(named_library_unloadable)
{
	EXPECT_ABSENT("/nonexistent/libcuda.so.1", NULL,
		      "APE_CUDA_LIBRARY=/nonexistent/libcuda.so.1: cannot load it");
}

TEST(no_device)
{
	EXPECT_ABSENT(FAKE_LIB, "no-device", "no CUDA device", "driver CUDA 13.0", FAKE_LIB);
}

TEST(zero_devices)
{
	EXPECT_ABSENT(FAKE_LIB, "zero-devices", "no CUDA device", "driver CUDA 13.0");
}

TEST(driver_too_old)
{
	EXPECT_ABSENT(FAKE_LIB, "old-driver", "driver too old: CUDA 11.4", "libape needs ");
}

TEST(no_cuGetProcAddress)
{
	EXPECT_ABSENT(FAKE_LIB_NOPA, NULL, "driver too old", "has no cuGetProcAddress");
}

TEST(missing_required_symbol)
{
	EXPECT_ABSENT(FAKE_LIB, "missing-required", "lacks cuLaunchKernel", "driver 13.0");
}

TEST(init_fails_with_the_error_name)
{
	EXPECT_ABSENT(FAKE_LIB, "init-fails", "cuInit: CUDA_ERROR_OPERATING_SYSTEM",
		      "OS call failed");
}

TEST(compute_capability_too_low)
{
	EXPECT_ABSENT(FAKE_LIB, "cc75", "compute capability 7.5", "8.0 or newer");
}

/* ---- the driver fit */

TEST(missing_optional_symbol_keeps_the_backend)
{
	struct ape__cu_driver drv;
	ape_backend_info bi;
	ape_context *ctx;
	char why[256] = "";

	use_driver(FAKE_LIB, "missing-optional");
	ASSERT_EQ(0, cuda_backend(&ctx, &bi));
	EXPECT_TRUE(bi.available) TH_LOG("%s", bi.reason);
	EXPECT_EQ(1, bi.device_count);
	EXPECT_NE(NULL, test_device(ctx, "cuda"));
	ape_context_destroy(ctx);

	/* what the loader recorded: the feature off, the symbols named */
	ASSERT_EQ(0, ape__cu_driver_load(&drv, why, sizeof(why))) TH_LOG("%s", why);
	EXPECT_FALSE(drv.pinning);
	EXPECT_NE(NULL, strstr(drv.missing_optional, "cuMemHostRegister"));
	EXPECT_NE(NULL, strstr(drv.missing_optional, "cuMemHostUnregister"));
	EXPECT_NE(NULL, drv.p_cuLaunchKernel);
	ape__cu_driver_unload(&drv);

	use_driver(FAKE_LIB, NULL);
	ASSERT_EQ(0, ape__cu_driver_load(&drv, why, sizeof(why))) TH_LOG("%s", why);
	EXPECT_TRUE(drv.pinning);
	EXPECT_STREQ("", drv.missing_optional);
	ape__cu_driver_unload(&drv);
}

TEST(devices_and_driver_version_reported)
{
	ape_device_info info;
	ape_backend_info bi;
	ape_context *ctx;
	ape_device *devs[4];
	int n, ncuda = 0;

	use_driver(FAKE_LIB, "two-devices");
	ASSERT_EQ(0, cuda_backend(&ctx, &bi));
	EXPECT_TRUE(bi.available) TH_LOG("%s", bi.reason);
	EXPECT_EQ(2, bi.device_count);
	EXPECT_STREQ("", bi.reason);
	n = ape_device_list(ctx, devs, 4);
	for (int i = 0; i < n; i++) {
		ASSERT_EQ(0, ape_device_get_info(devs[i], &info));
		if (strcmp(info.backend, "cuda"))
			continue;
		EXPECT_STREQ("CUDA 13.0, sm_90", info.driver_version);
		EXPECT_STREQ("NVIDIA Corporation", info.vendor);
		EXPECT_EQ(APE_DEVICE_GPU, info.kind);
		EXPECT_EQ(4, info.compute_units);
		EXPECT_EQ((uint64_t)1 << 30, info.global_mem_bytes);
		EXPECT_STREQ(ncuda ? "0000:43:00.0" : "0000:42:00.0", info.pci_address);
		EXPECT_NE(NULL, strstr(info.name, "libape fake GPU"));
		ncuda++;
	}
	EXPECT_EQ(2, ncuda);
	ape_context_destroy(ctx);
}

TEST(ape_info_lists_the_fake_device)
{
	char out[32768], err[4096];

	use_driver(FAKE_LIB, NULL);
	ASSERT_EQ(0, test_run_tool("ape-info", (const char *const[]){ NULL }, NULL, out,
				   sizeof(out), err, sizeof(err)))
	TH_LOG("%s", err);
	/* with the driver's version, as the fake reports it (13.0) */
	EXPECT_NE(NULL, strstr(out, "cuda     available: 1 device, driver CUDA 13.0"))
	TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "libape fake GPU 0")) TH_LOG("%s", out);
	EXPECT_NE(NULL, strstr(out, "0000:42:00.0")) TH_LOG("%s", out);
}

/* ---- CUresult at the boundary */

TEST(cuda_results_map_to_libape_codes)
{
	static const struct {
		CUresult r;
		int code;
		const char *name;
	} cases[] = {
		{ CUDA_SUCCESS, 0, "CUDA_SUCCESS" },
		{ CUDA_ERROR_OUT_OF_MEMORY, APE_ENOMEM, "CUDA_ERROR_OUT_OF_MEMORY" },
		{ CUDA_ERROR_NO_DEVICE, APE_ENODEV, "CUDA_ERROR_NO_DEVICE" },
		{ CUDA_ERROR_INVALID_DEVICE, APE_ENODEV, "CUDA_ERROR_INVALID_DEVICE" },
		{ CUDA_ERROR_ILLEGAL_ADDRESS, APE_EDEVLOST, "CUDA_ERROR_ILLEGAL_ADDRESS" },
		{ CUDA_ERROR_LAUNCH_FAILED, APE_EDEVLOST, "CUDA_ERROR_LAUNCH_FAILED" },
		{ CUDA_ERROR_ECC_UNCORRECTABLE, APE_EDEVLOST, "CUDA_ERROR_ECC_UNCORRECTABLE" },
		{ CUDA_ERROR_NO_BINARY_FOR_GPU, APE_EBUILD, "CUDA_ERROR_NO_BINARY_FOR_GPU" },
		{ CUDA_ERROR_UNSUPPORTED_PTX_VERSION, APE_EBUILD,
		  "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" },
		{ CUDA_ERROR_INVALID_VALUE, APE_EBACKEND, "CUDA_ERROR_INVALID_VALUE" },
		{ CUDA_ERROR_NOT_FOUND, APE_EBACKEND, "CUDA_ERROR_NOT_FOUND" },
	};
	char buf[32];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		EXPECT_EQ(cases[i].code, ape__cu_err_code(cases[i].r)) TH_LOG("%s", cases[i].name);
		/* without a driver, libape's own table names the code */
		EXPECT_STREQ(cases[i].name, ape__cu_err_name(NULL, cases[i].r, buf, sizeof(buf)));
	}
	EXPECT_EQ(APE_EBACKEND, ape__cu_err_code((CUresult)12345));
	EXPECT_STREQ("CUresult 12345", ape__cu_err_name(NULL, (CUresult)12345, buf, sizeof(buf)));
}

TEST(driver_names_the_error)
{
	struct ape__cu_driver drv;
	char why[256] = "", buf[32];

	use_driver(FAKE_LIB, NULL);
	ASSERT_EQ(0, ape__cu_driver_load(&drv, why, sizeof(why))) TH_LOG("%s", why);
	EXPECT_EQ(13000, drv.version);
	/* the fake knows CUDA_ERROR_OPERATING_SYSTEM, libape's fallback table does not */
	EXPECT_STREQ("CUDA_ERROR_OPERATING_SYSTEM",
		     ape__cu_err_name(&drv, CUDA_ERROR_OPERATING_SYSTEM, buf, sizeof(buf)));
	ape__cu_driver_unload(&drv);
	EXPECT_NE(NULL, strstr(ape__cu_err_name(NULL, CUDA_ERROR_OPERATING_SYSTEM, buf,
						sizeof(buf)),
			       "CUresult 304"));
}

/* A forward on the fake device fails (it has no kernels, or no memory): with a libape code and
 * the driver's error name in the message, never an abort; the outputs are left alone. */
static void forward_fails(struct __test_metadata *_metadata, int want, const char *const *needles)
{
	const test_problem_shape sh = { 1, 2, 1, 40, 40, 64 };
	ape_context *ctx = test_context("cuda");
	ape_device *dev = test_device(ctx, "cuda");
	ape_rng rng;
	test_problem tp;
	int ret;

	ASSERT_NE(NULL, dev);
	ape_rng_seed(&rng, 6);
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F16, false));
	ret = test_problem_run(&tp, dev);
	TH_LOG("%s: %s", ape_err_name(ret), ape_last_error());
	EXPECT_EQ(want, ret);
	for (int i = 0; needles[i]; i++) {
		if (!strstr(ape_last_error(), needles[i]))
			TH_LOG("the message lacks \"%s\"", needles[i]);
		EXPECT_NE(NULL, strstr(ape_last_error(), needles[i]));
	}
	test_problem_free(&tp);
	ape_context_destroy(ctx);
}

TEST(failing_call_reports_the_cuda_error)
{
	use_driver(FAKE_LIB, NULL);
	forward_fails(_metadata, APE_EBACKEND,
		      (const char *const[]){ ": attention: cuModuleGetFunction",
					     "CUDA_ERROR_NOT_FOUND", "named symbol not found",
					     "0000:42:00.0", NULL });
}

TEST(device_out_of_memory_is_enomem)
{
	ape_context *ctx;
	ape_device *dev;
	struct ape_be_buf *buf = (struct ape_be_buf *)&ctx; /* stale: the op must clear it */
	char label[320];

	/* through the backend op: a forward's planner would refuse the size before any call */
	use_driver(FAKE_LIB, NULL);
	ctx = test_context("cuda");
	dev = test_device(ctx, "cuda");
	ASSERT_NE(NULL, dev);
	EXPECT_EQ(APE_ENOMEM, dev->be->ops->buf_alloc(dev, (size_t)2 << 30, &buf));
	EXPECT_EQ(NULL, buf);
	/* the contract's message: the device, the op, then what failed below */
	snprintf(label, sizeof(label), "cuda:%d %s (%s): buf_alloc: cuMemAlloc (2147483648 bytes)",
		 dev->info.backend_index, dev->info.name, dev->info.pci_address);
	EXPECT_NE(NULL, strstr(ape_last_error(), label)) TH_LOG("want \"%s\"", label);
	EXPECT_NE(NULL, strstr(ape_last_error(), "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape__cu_buf_alloc(dev, 4096, &buf)) TH_LOG("%s", ape_last_error());
	ape__cu_buf_free(dev, buf);
	ape_context_destroy(ctx);
}

#endif /* APE_HAVE_CUDA */

int main(int argc, char **argv)
{
#ifndef APE_HAVE_CUDA
	ksft_exit_skip("the CUDA backend is not built into this libape\n");
#endif
	return test_harness_run(argc, argv);
}
