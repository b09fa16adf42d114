/* SPDX-License-Identifier: MIT */
/*
 * The calls the fault-injection tests break (tests/faults/): a forward call (one-shot, streamed,
 * over one or two devices), a KV-cache session (create, two appends, one attend; the second
 * append perhaps from device buffers, then a release), a
 * device-resident call (queue, buffers, writes, ape_attention_enqueue, reads, synchronize) or
 * the DLPack call on kDLCPU tensors (with or without the diagnostics), with its
 * clean result and a copy of its inputs, and the check every broken run must pass: the inputs
 * are byte-identical, and the outputs hold either the clean result or, after a failure, exactly
 * what README's 'Outputs on failure' promises (whole query chunks, as many as the message says,
 * the rest untouched; where the message says the outputs were computed in place, at least the
 * chunks it says are held; for the resident and DLPack calls, whose outputs are unspecified
 * after a failure, only the inputs and the message are checked then).
 */
#ifndef APE_TEST_FAULTCHECK_H
#define APE_TEST_FAULTCHECK_H

#include "common/problem.h"

/* What an fx_call runs. FX_FORWARD and FX_KV are false and true: fx_call_init() took a bool. */
enum fx_mode {
	FX_FORWARD = 0, /* ape_attention_forward_ex() */
	FX_KV = 1, /* a KV-cache session */
	FX_ENQUEUE = 2, /* ape_queue_create, ape_buffer_alloc x5, writes, ape_attention_enqueue,
			 * reads, ape_queue_synchronize, frees (one device) */
	FX_DLPACK = 3, /* ape_attention_forward_dlpack() on kDLCPU tensors (one device) */
	/* the same calls with both diagnostics (docs/diagnostics.md), whose rows must follow O's:
	 * written and clean, or untouched */
	FX_DIAG = 4, /* ape_attention_forward_diag() */
	FX_KV_DIAG = 5, /* a KV-cache session attending with ape_kv_cache_attend_diag() */
	FX_ENQUEUE_DIAG = 6, /* FX_ENQUEUE with ape_attention_enqueue_diag(), 7 buffers */
	FX_DLPACK_DIAG = 7, /* ape_attention_forward_dlpack_diag() on kDLCPU tensors */
	/* FX_KV with the second append from device buffers (ape_queue_create, ape_buffer_alloc x2,
	 * writes, ape_kv_cache_append_device) and ape_kv_cache_release_unreachable() before the
	 * attend (allow_release; nothing is released with skip_tol 0) */
	FX_KV_DEVICE = 8,
};

typedef struct fx_call {
	test_problem tp; /* what each run reads and writes */
	test_problem want; /* the clean run's outputs */
	test_problem inputs; /* the inputs as they were before any run */
	ape_device *devs[2];
	int ndev;
	bool kv; /* a KV-cache session instead of a forward call */
	enum fx_mode mode;
	bool exact; /* one device: a written row equals the clean one bit for bit */
	ape_exec_options eo;
	int64_t cq; /* query rows per chunk, as the outputs are written */
	char msg[1024]; /* ape_last_error() of the last failed run */
	/* the diagnostics modes: entropy and mean distance of each run and of the clean one
	 * (rows floats each; NULL in the other modes) */
	float *ent, *md, *want_ent, *want_md;
} fx_call;

/* A forward call of Lq = Lk = L rows in chunks of `chunk` (0: one chunk) over ndev devices, a
 * KV-cache session (FX_KV, FX_KV_DIAG, FX_KV_DEVICE: L cached tokens), or a resident or DLPack
 * call of L rows (ndev 1, chunk 0); runs it once cleanly. 0, or the clean run's error. */
int fx_call_init(fx_call *c, ape_device *const *devs, int ndev, enum fx_mode mode, int64_t L,
		 int64_t chunk);
/* A copy of src (same problem, same clean result) that runs on dev. 0 or APE_ENOMEM. */
int fx_call_clone(fx_call *dst, const fx_call *src, ape_device *dev);
/* Poisons the outputs and runs; the error code (message in c->msg). */
int fx_call_run(fx_call *c);
/* NULL when the run that returned ret left inputs and outputs as promised, else what is wrong. */
const char *fx_call_verify(fx_call *c, int ret);
void fx_call_free(fx_call *c);
/* NULL when dev computes on host memory in place (FX_DLPACK runs on it), else why not. */
const char *fx_no_host_memory(ape_device *dev);

#endif
