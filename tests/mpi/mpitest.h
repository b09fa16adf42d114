// SPDX-License-Identifier: MIT
/*
 * The MPI tests' driver runs (tests/mpi/test_mpi*.c): mpirun and the driver under it
 * (build/bin/ape-mpi-run), and the fields of the one line per rank it prints.
 */
#ifndef APE_TEST_MPITEST_H
#define APE_TEST_MPITEST_H

#include <stdbool.h>
#include <stddef.h>

#define OUT_CAP (1 << 20)
/* APE_MPIRUN, or "mpirun" */
const char *mpirun(void);
bool have_mpirun(void);

/* SKIP the test (a Kselftest one) without mpirun. */
#define NEED_MPIRUN()                                                                              \
	do {                                                                                       \
		if (!have_mpirun())                                                                \
			SKIP(return, "mpirun not found (Debian: openmpi-bin; or set APE_MPIRUN)"); \
	} while (0)

/* Runs the shell command cmd; returns its exit status and its output in out (OUT_CAP bytes). */
int capture(const char *cmd, char *out);
/* Runs the driver on np ranks with args; returns its exit status (124: timed out) and its
 * output in out (OUT_CAP bytes). */
int drive(int np, const char *args, char *out);
/* The line of rank r ("  rank=R ..."), copied into line; false when absent. */
bool rank_line(const char *out, int r, char *line, size_t cap);
/* The value of key=NUMBER in a line; -1 when absent. */
double field(const char *line, const char *key);
/* The quoted value of key="..." in a line, copied into buf. */
void quoted(const char *line, const char *key, char *buf, size_t cap);

#endif
