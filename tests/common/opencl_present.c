/* SPDX-License-Identifier: MIT */
/* Whether there is an OpenCL platform (opencl_present.h). */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape/ape.h"
#include "opencl_present.h"

#ifdef APE_HAVE_OPENCL
#include "../../opencl/ocl_debug.h"

int test_opencl_platform_present(void)
{
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		ape_context_options o;
		ape_backend_info bi;
		ape_context *ctx;
		int n;

		ape_context_options_init(&o);
		o.backends = "opencl";
		if (ape_context_create(&ctx, &o))
			_exit(1);
		n = ape_backend_get_info(ctx, -1, NULL);
		for (int i = 0; i < n; i++)
			if (!ape_backend_get_info(ctx, i, &bi) && !strcmp(bi.name, "opencl"))
				_exit(bi.available ? 0
				      : !strncmp(bi.reason, APE__OCL_NO_PLATFORM,
						 strlen(APE__OCL_NO_PLATFORM))
					      ? 4
					      : 1);
		_exit(1);
	}
	if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return 1;
	return WEXITSTATUS(status);
}
#endif
