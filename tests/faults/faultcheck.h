/* SPDX-License-Identifier: MIT */
/*
 * The calls the fault-injection tests break (tests/faults/): a forward call (one-shot, streamed,
 * over one or two devices) or a KV-cache session (create, two appends, one attend), with its
 * clean result and a copy of its inputs, and the check every broken run must pass: the inputs
 * are byte-identical, and the outputs hold either the clean result or, after a failure, exactly
 * what README's 'Outputs on failure' promises (whole query chunks, as many as the message says,
 * the rest untouched).
 */
#ifndef APE_TEST_FAULTCHECK_H
#define APE_TEST_FAULTCHECK_H

#include "common/problem.h"

typedef struct fx_call {
	test_problem tp; /* what each run reads and writes */
	test_problem want; /* the clean run's outputs */
	test_problem inputs; /* the inputs as they were before any run */
	ape_device *devs[2];
	int ndev;
	bool kv; /* a KV-cache session instead of a forward call */
	bool exact; /* one device: a written row equals the clean one bit for bit */
	ape_exec_options eo;
	int64_t cq; /* query rows per chunk, as the outputs are written */
	char msg[1024]; /* ape_last_error() of the last failed run */
} fx_call;

/* A forward call of Lq = Lk = L rows in chunks of `chunk` (0: one chunk) over ndev devices, or a
 * KV-cache session (kv: L cached tokens); runs it once cleanly. 0, or the clean run's error. */
int fx_call_init(fx_call *c, ape_device *const *devs, int ndev, bool kv, int64_t L, int64_t chunk);
/* A copy of src (same problem, same clean result) that runs on dev. 0 or APE_ENOMEM. */
int fx_call_clone(fx_call *dst, const fx_call *src, ape_device *dev);
/* Poisons the outputs and runs; the error code (message in c->msg). */
int fx_call_run(fx_call *c);
/* NULL when the run that returned ret left inputs and outputs as promised, else what is wrong. */
const char *fx_call_verify(fx_call *c, int ret);
void fx_call_free(fx_call *c);

#endif
