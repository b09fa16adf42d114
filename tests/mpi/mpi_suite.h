// SPDX-License-Identifier: MIT
/*
 * The MPI tests' shared checks (tests/mpi/test_mpi.c, test_mpi_backward.c): the driver's suite
 * on np ranks, and one rank passing something different or invalid. Include after the Kselftest
 * harness.
 */
#ifndef APE_TEST_MPI_SUITE_H
#define APE_TEST_MPI_SUITE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpitest.h"

/* The driver's suite on np ranks (extra: more driver options, e.g. --backward): every case
 * passes, the named ones included. */
static void suite(struct __test_metadata *_metadata, int np, const char *extra)
{
	static const char *const names[] = { "contiguous-causal", "zigzag-causal-gqa",
					     "contiguous-noncausal-f16", "zigzag-noncausal-bf16",
					     "ranks-without-rows", "offsets", "zero-decay",
					     "strong-decay-noncausal" };
	char *out = malloc(OUT_CAP), tail[64], args[128];
	int rc, passed = -1, total = -2;
	const char *p;

	ASSERT_NE(NULL, out);
	snprintf(args, sizeof(args), "--suite 12 %s", extra);
	rc = drive(np, args, out);
	if (rc)
		TH_LOG("%s", out);
	ASSERT_EQ(0, rc);
	ASSERT_EQ(NULL, strstr(out, "FAIL "));
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(tail, sizeof(tail), "pass %s ", names[i]);
		ASSERT_NE(NULL, strstr(out, tail));
	}
	p = strstr(out, "# ");
	p = p ? strstr(p + 1, "\n# ") : NULL;
	ASSERT_NE(NULL, p);
	ASSERT_EQ(2, sscanf(p, "\n# %d of %d cases passed", &passed, &total));
	ASSERT_EQ(total, passed);
	ASSERT_GE(total, 12 + (int)(sizeof(names) / sizeof(names[0])));
	if (strstr(extra, "--backward")) /* the driver ran the backward in every case */
		ASSERT_NE(NULL, strstr(out, " backward ndev="));
	free(out);
}

/* One rank passes something different or invalid (the driver's --corrupt) on np ranks. */
struct mismatch {
	const char *corrupt, *names; /* what is corrupted; what the message must name */
	int np, rank;
};

/* Each case fails cleanly: every rank returns the same APE_EINVAL with the same message, from
 * fn, naming that rank and the field, and nothing hangs. extra: more driver options. */
static void mismatches(struct __test_metadata *_metadata, const struct mismatch *cases, size_t n,
		       const char *extra, const char *fn)
{
	char *out = malloc(OUT_CAP), args[256], line[2048], msg[1024], first[1024], want[32];

	ASSERT_NE(NULL, out);
	for (size_t i = 0; i < n; i++) {
		snprintf(args, sizeof(args), "-L 40 --check %s --corrupt %s --corrupt-rank %d",
			 extra, cases[i].corrupt, cases[i].rank);
		ASSERT_EQ(1, drive(cases[i].np, args, out)); /* 1: the case failed, cleanly */
		snprintf(want, sizeof(want), "rank %d: ", cases[i].rank);
		for (int r = 0; r < cases[i].np; r++) {
			ASSERT_TRUE(rank_line(out, r, line, sizeof(line)));
			ASSERT_NE(NULL, strstr(line, " ret=APE_EINVAL "));
			quoted(line, "msg", msg, sizeof(msg));
			if (!strstr(msg, want) || !strstr(msg, cases[i].names))
				TH_LOG("%s on rank %d: %s", cases[i].corrupt, cases[i].rank, msg);
			ASSERT_NE(NULL, strstr(msg, fn));
			ASSERT_NE(NULL, strstr(msg, want));
			ASSERT_NE(NULL, strstr(msg, cases[i].names));
			if (r == 0)
				snprintf(first, sizeof(first), "%s", msg);
			ASSERT_STREQ(first, msg);
		}
	}
	free(out);
}

#endif
