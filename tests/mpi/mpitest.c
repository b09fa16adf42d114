// SPDX-License-Identifier: MIT
#include "mpitest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *mpirun(void)
{
	const char *m = getenv("APE_MPIRUN");

	return m && *m ? m : "mpirun";
}

bool have_mpirun(void)
{
	char cmd[512];

	snprintf(cmd, sizeof(cmd), "command -v '%s' >/dev/null 2>&1", mpirun());
	return system(cmd) == 0;
}

/* Runs the shell command cmd; returns its exit status and its output in out (OUT_CAP bytes). */
int capture(const char *cmd, char *out)
{
	size_t n = 0;
	FILE *f;
	int st;

	out[0] = 0;
	f = popen(cmd, "r");
	if (!f)
		return -1;
	while (n < OUT_CAP - 1) {
		size_t got = fread(out + n, 1, OUT_CAP - 1 - n, f);

		if (!got)
			break;
		n += got;
	}
	out[n] = 0;
	st = pclose(f);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Runs the driver on np ranks with args; returns its exit status (124: timed out) and its
 * output in out (OUT_CAP bytes). */
int drive(int np, const char *args, char *out)
{
	char cmd[2048];

	snprintf(cmd, sizeof(cmd),
		 "timeout 300 '%s' %s--oversubscribe -np %d '%s/bin/ape-mpi-run' %s 2>&1",
		 mpirun(), geteuid() == 0 ? "--allow-run-as-root " : "", np, APE_BUILD_DIR, args);
	return capture(cmd, out);
}

/* The line of rank r ("  rank=R ..."), copied into line; false when absent. */
bool rank_line(const char *out, int r, char *line, size_t cap)
{
	char key[32];
	const char *p, *e;

	snprintf(key, sizeof(key), "  rank=%d ", r);
	p = strstr(out, key);
	if (!p)
		return false;
	e = strchr(p, '\n');
	snprintf(line, cap, "%.*s", (int)(e ? e - p : (ptrdiff_t)strlen(p)), p);
	return true;
}

/* The value of key=NUMBER in a line; -1 when absent. */
double field(const char *line, const char *key)
{
	char k[64];
	const char *p;

	snprintf(k, sizeof(k), " %s=", key);
	p = strstr(line, k);
	return p ? strtod(p + strlen(k), NULL) : -1;
}

/* The quoted value of key="..." in a line, copied into buf. */
void quoted(const char *line, const char *key, char *buf, size_t cap)
{
	char k[64];
	const char *p, *e;

	snprintf(k, sizeof(k), " %s=\"", key);
	p = strstr(line, k);
	buf[0] = 0;
	if (!p)
		return;
	p += strlen(k);
	e = strchr(p, '"');
	snprintf(buf, cap, "%.*s", (int)(e ? e - p : 0), p);
}
