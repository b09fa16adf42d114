/* SPDX-License-Identifier: MIT */
/*
 * ape-check's pieces: tools/ape-check.c (main, the dense cases and their matrix) and
 * tools/check/varlen.c (the ragged cells). Linked into ape-check alone.
 */
#ifndef APE_TOOLS_CHECK_H
#define APE_TOOLS_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "ape/ape.h"
#include "common/rng.h"

#define CHECK_MAX_DEVICES 32
#define CHECK_MAX_VCASES 8

/* One ragged cell: a case's batch on one device against the reference's. */
struct vcell {
	const char *name;
	ape_dtype dtype;
	int err; /* the device's call failed: its code */
	int64_t rows; /* rows compared (every row of every sequence, all heads) */
	uint64_t launches; /* the call's ape_stats.chunks */
	double max_err_o, max_err_lse, tol_o, tol_lse;
	bool ok;
};

/*
 * Runs every ragged case (quick: the small ones) on the reference, then on each of devs,
 * into cells[case][device], and their count into *ncases. Returns 0, or a negative code when
 * the reference itself failed (message printed). A device's failure is its cell's err.
 */
int check_varlen(ape_device **devs, int ndev, ape_device *ref, ape_rng *rng, bool quick,
		 struct vcell (*cells)[CHECK_MAX_DEVICES], int *ncases);

#endif
