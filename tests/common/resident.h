/* SPDX-License-Identifier: MIT */
/*
 * The device-resident tests' runs (tests/test_resident.c, tests/test_resident_diag.c): a test
 * problem on device buffers laid out like its host tensors, through ape_attention_enqueue() or
 * ape_attention_enqueue_diag(), and bit-for-bit comparisons of the results.
 */
#ifndef APE_TEST_RESIDENT_H
#define APE_TEST_RESIDENT_H

#include "problem.h"

/* The diagnostics' outputs of a resident run (run_resident_diag()): each wanted one is a device
 * tensor of one float per row in a buffer of its own, `pad` bytes in, laid out [B, Lq, H] with
 * a gap after each (b, l) when `gappy`, else contiguous; the buffer is NaN-poisoned first, read
 * back whole after the run into ent / md ([B, H, Lq] order), and `dirty` counts the floats
 * outside the tensor (padding, gaps) that are no longer NaN. */
struct rdiag {
	bool want_ent, want_md, gappy;
	float *ent, *md; /* tp->rows floats each, written when wanted */
	int64_t dirty;
};

/* Runs tp on dev on the device: inputs and outputs in device buffers laid out like tp's host
 * tensors, `pad` bytes in (a multiple of 4); results read back into tp. With d (not NULL) the
 * call is ape_attention_enqueue_diag() with the outputs d wants, else ape_attention_enqueue(). */
int run_resident_diag(test_problem *tp, ape_device *dev, size_t pad, struct rdiag *d);
/* Runs tp on dev with ape_attention_enqueue() (run_resident_diag() without diagnostics). */
int run_resident(test_problem *tp, ape_device *dev, size_t pad);
/* Elements of O that differ in bits (NaN equal to NaN), and LSE rows likewise. */
int64_t bits_differing(const test_problem *a, const test_problem *b);

#endif
