/* SPDX-License-Identifier: MIT */
/* `--mpi`: the tools hand over to ape-mpi-run (mpi_exec.h). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mpi_exec.h"

int tools_mpi_exec(const char *tool, int argc, char **argv, const char *mode)
{
	char self[PATH_MAX], drv[PATH_MAX + 16], **nargv;
	ssize_t n;
	int at = -1, k = 0;
	char *slash;

	for (int i = 1; i < argc && at < 0; i++)
		if (!strcmp(argv[i], "--mpi"))
			at = i;
	if (at < 0)
		return -1;
	n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0) {
		fprintf(stderr, "%s: --mpi: cannot find this program's directory: %s\n", tool,
			strerror(errno));
		return 1;
	}
	self[n] = 0;
	slash = strrchr(self, '/');
	*(slash ? slash : self) = 0;
	snprintf(drv, sizeof(drv), "%s/ape-mpi-run", slash ? self : ".");
	if (access(drv, X_OK)) {
		fprintf(stderr,
			"%s: --mpi: %s not found: this build has no MPI (libape_mpi and its driver "
			"are built when MPI is found, WITH_MPI=auto|yes; see docs/distributed.md)\n",
			tool, drv);
		return 3;
	}
	nargv = calloc((size_t)argc + 2, sizeof(*nargv));
	if (!nargv) {
		fprintf(stderr, "%s: --mpi: out of memory\n", tool);
		return 1;
	}
	nargv[k++] = drv;
	if (mode)
		nargv[k++] = (char *)mode;
	for (int i = 1; i < argc; i++)
		if (i != at)
			nargv[k++] = argv[i];
	execv(drv, nargv);
	fprintf(stderr, "%s: --mpi: cannot run %s: %s\n", tool, drv, strerror(errno));
	free(nargv);
	return 1;
}
