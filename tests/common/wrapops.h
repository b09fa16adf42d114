/* SPDX-License-Identifier: MIT */
/*
 * A backend seen through a wrapper, for tests of the streaming executor and of device failures
 * (tests/faults/): counts every device allocation (and the bytes held, with the scratch the
 * backend declares for each backward launch in flight, and their peak) and every
 * call of each fallible op, can make the N-th call of any op fail or every op fail from the k-th
 * call on (a device lost mid-run), and can hide optional ops so that the core's fallbacks run.
 * One wrapper per process at a time (the harness forks each test); it wraps every device of one
 * backend, so a multi-device test fails one device by pairing two backends.
 */
#ifndef APE_TEST_WRAPOPS_H
#define APE_TEST_WRAPOPS_H

#include <stdint.h>

#include "ape/ape.h"
#include "core/backend.h"

#define WRAP_NO_COPY_D2D (1u << 0) /* hide copy_d2d */
#define WRAP_NO_TIMESTAMP (1u << 1) /* hide event_timestamp (and the capability timestamps) */
#define WRAP_NO_SCRATCH (1u << 2) /* hide attention_scratch */
/* hide attention_backward_scratch from the core (the wrapper still counts what the backend
 * declares: a plan that ignores it shows) */
#define WRAP_NO_BWD_SCRATCH (1u << 3)
/* take diag_views from the devices' capabilities: no diagnostics on device tensors */
#define WRAP_NO_DIAG_VIEWS (1u << 4)
#define WRAP_NO_PAGES (1u << 5) /* hide attention_pages: KV caches gather */
/* no diagnostics at all (capabilities diag and diag_views false): the core's refusal runs on
 * any backend */
#define WRAP_NO_DIAG (1u << 6)
/* hide buf_wrap (and with it the capability host_memory): a device that cannot read host memory
 * in place (the backward's host call then stages and copies its inputs) */
#define WRAP_NO_BUF_WRAP (1u << 7)
/* take the capability host_memory, buf_wrap kept: the core must not compute on host memory in
 * place all the same (it decides from the capability, never by trying buf_wrap) */
#define WRAP_NO_HOST_MEMORY (1u << 8)
/* take the capability resident_backward, the ops kept: the core's paths for a device without
 * working queue-ordered scratch and copy_view */
#define WRAP_NO_RESIDENT_BWD (1u << 9)
/* hide attention_merge: partial results go back per launch and merge on the host */
#define WRAP_NO_MERGE (1u << 10)
/* take the capability positions: the core's paths for a device that reads no explicit
 * positions (ragged batches with gaps or repeats decomposed, or refused on device tensors) */
#define WRAP_NO_POSITIONS (1u << 11)
/* take the capability bwd_segments: a device without ragged backward launches (the host call
 * runs pieces; device tensors are refused) */
#define WRAP_NO_BWD_SEGMENTS (1u << 12)
/* hide the capability bwd_views: the backward's inputs copied into packed buffers, as on a
 * device that cannot read them strided */
#define WRAP_NO_BWD_VIEWS (1u << 13)

/* The ops that can fail, as the wrapper counts and fails them. */
enum wrap_op {
	WRAP_BUF_ALLOC,
	WRAP_QUEUE_CREATE,
	WRAP_COPY_H2D,
	WRAP_COPY_D2H,
	WRAP_COPY_D2D,
	WRAP_FILL,
	WRAP_EVENT_RECORD,
	WRAP_EVENT_WAIT,
	WRAP_EVENT_ELAPSED,
	WRAP_EVENT_TIMESTAMP,
	WRAP_ATTENTION,
	WRAP_SYNCHRONIZE,
	WRAP_HOST_REGISTER,
	WRAP_BUF_WRAP, /* fails with APE_ENOMEM, as buf_alloc */
	WRAP_QUEUE_WRAP,
	WRAP_ATTENTION_BACKWARD,
	WRAP_SCRATCH_ALLOC, /* fails with APE_ENOMEM, as buf_alloc */
	WRAP_COPY_VIEW,
	WRAP_ATTENTION_MERGE,
	WRAP_NOPS
};

struct wrap_counts {
	/* buf_alloc / buf_free calls (scratch_alloc / scratch_free too); buffers buf_wrap made are
	 * not counted when freed */
	uint64_t allocs, frees;
	/* device bytes held, and their peak since reset: buffers, and the scratch the backend
	 * declares (attention_backward_scratch) for each backward launch, from the call until its
	 * queue's next synchronize or queue_destroy */
	uint64_t live_bytes, peak_bytes;
	uint64_t bwd_scratch_max; /* the largest scratch declared for one backward launch */
	uint64_t attention_calls;
	/* launches given an lse_prior, and the pairs they computed (read back after each such
	 * launch that reports pairs: the wrapper waits for it) */
	uint64_t prior_launches, prior_pairs;
	uint64_t h2d_calls, d2h_calls, d2d_calls;
	uint64_t calls[WRAP_NOPS]; /* every call of each op, failed ones included */
	uint64_t failed; /* calls the wrapper failed */
};

/* Puts the wrapper between the core's table and dev's backend (every device of that backend in
 * its context), as the table the core calls (ape__backend_bind()); a failure it injects gets
 * the device and the op from the core, as a backend's own does. */
void wrap_install(ape_device *dev, unsigned flags);
/* Restores the backend's own ops and its devices' capabilities. */
void wrap_remove(void);
/* After wrap_install(): each device's capability max_alloc says at most `bytes` (0: the
 * backend's own figure again). */
void wrap_max_alloc(uint64_t bytes);
/* After wrap_install(): the resident executor's default budget (exec/resident.c) holds the
 * scratch of at most `rows` (1 to 700) query rows, so that a call of more rows is split into
 * launches: each device says 2^40 bytes of memory, and attention_scratch declares a share of
 * its default budget per query row on top of the backend's own (0: the backend's own scratch
 * and memory again). For the resident path only: a host call planned under it would chunk as
 * finely. */
void wrap_rows_per_launch(uint64_t rows);
/* The counts so far; wrap_reset() zeroes them (peak_bytes restarts from live_bytes). */
struct wrap_counts wrap_get(void);
void wrap_reset(void);
/* Launch number n (1-based, counted from now) fails with APE_EDEVLOST; 0: none fails. */
void wrap_fail_attention(uint64_t n);
/* Call number n (1-based, counted from now) of op fails, with APE_ENOMEM for buf_alloc and
 * APE_EDEVLOST for the rest (buf_wrap: APE_ENOMEM too), as the backend contract says a failure must (a message naming the
 * device and the op, out-parameters cleared); 0: none fails. Replaces any earlier
 * wrap_fail_op() or wrap_fail_attention(). */
void wrap_fail_op(enum wrap_op op, uint64_t n);
/* The device is lost: from call number k (1-based, counted from now, over all fallible ops) on,
 * every fallible op fails with APE_EDEVLOST; 0: the device works again. */
void wrap_lose_device(uint64_t k);
/* "buf_alloc", "copy_h2d", ...: the op's name in the backend interface and in the messages. */
const char *wrap_op_name(enum wrap_op op);

#endif
