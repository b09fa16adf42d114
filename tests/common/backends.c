/* SPDX-License-Identifier: MIT */
#include "backends.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/testutil.h"

bool test_cuda_emulated(void)
{
#ifdef APE_HAVE_CUDA
	/* APE_TEST_CUDA_DEVICE=1: the machine's own driver and GPU (tools/gpu-check.sh) */
	const char *e = getenv("APE_TEST_CUDA_DEVICE");

	return !(e && *e && strcmp(e, "0"));
#else
	return false;
#endif
}

int test_backend_prepare(const char *backend, const char *fake_mode, char *why, size_t cap)
{
	if (strcmp(backend, "cuda") || !test_cuda_emulated())
		return 0; /* nothing to choose: the context says what is missing */
	if (ape_test_slow()) {
		snprintf(why, cap, "the CUDA emulator under valgrind would take tens of minutes; "
				   "make sanitize runs these cases under ASan and UBSan");
		return -1;
	}
	if (access(TEST_CUDA_EMU_LIB, R_OK)) {
		snprintf(why, cap, "the emulated CUDA driver %s is missing: make builds it",
			 TEST_CUDA_EMU_LIB);
		return -1;
	}
	setenv("APE_CUDA_LIBRARY", TEST_CUDA_EMU_LIB, 1);
	unsetenv("FAKE_CUDA_MEM");
	if (fake_mode)
		setenv("FAKE_CUDA_MODE", fake_mode, 1);
	else
		unsetenv("FAKE_CUDA_MODE");
	return 0;
}

const char *test_backend_absent(ape_context *ctx, const char *backend, char *why, size_t cap)
{
	int n = ctx ? ape_backend_get_info(ctx, 0, NULL) : 0;
	ape_backend_info bi;

	snprintf(why, cap, "no %s device", backend);
	for (int i = 0; i < n; i++)
		if (!ape_backend_get_info(ctx, i, &bi) && !strcmp(bi.name, backend)) {
			snprintf(why, cap, "no %s device: %s", backend,
				 bi.reason[0] ? bi.reason : "the backend lists none");
			break;
		}
	return why;
}
