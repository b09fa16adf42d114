/* SPDX-License-Identifier: MIT */
/*
 * A pass: one operation (the forward, the backward) as the executor runs it. The executor
 * (exec/stream.h, one pipelined session per device; exec/multidev.h, the call over devices)
 * knows nothing of attention: it moves the pass's tensors between host and device in chunks of
 * rows, keeps launches in flight, times and traces them, and unwinds after a failure. The pass
 * says which tensors there are and what each is for, walks the inner chunks of an outer chunk,
 * enqueues the kernels of one job, and takes in what comes back.
 *
 * Two row axes: Q (query rows, Lq) and K (key rows, Lk). The outer axis is the one whose chunks
 * a device takes one at a time from the work queue (the forward: Q; the backward: K); the inner
 * axis is the one each outer chunk walks (the forward: K; the backward: Q). A job is one
 * (outer chunk, inner chunk) launch.
 *
 * Tensor roles:
 *   OUTER_IN   inputs along the outer axis, copied once per outer chunk (the forward's Q; the
 *              backward's K, V)
 *   INNER_IN   inputs along the inner axis, copied per job unless still resident from an
 *              earlier outer chunk (the forward's K, V, or the pass's loader fills them; the
 *              backward's Q, O, dO, LSE, dLSE)
 *   OUTER_ACC  device accumulators of one outer chunk: filled with `init` when it starts, read
 *              back (`back`) when its last job is done (the forward's merged O, LSE, ...; the
 *              backward's dK, dV)
 *   JOB_OUT    one job's outputs, filled with `init` before its launch when `init_each`, read
 *              back after it when `back` (the forward's partial O, LSE; the backward's dQ)
 *   JOB_IN     one job's inputs made on the host by the pass (job_input), copied before it,
 *              and read back after it when `back` (the backward's per-row pair counts: the
 *              visible ones in, the computed ones out)
 *   CALL_ACC   device accumulators of a session's whole run: filled with `init` at its start,
 *              read back at its end (the backward's parameter sums)
 *   CALL_IN    inputs of a session's whole run made by the pass (call_input), copied once at
 *              its start (the per-head parameter tables every launch reads)
 * Row bytes count all (batch, head) pairs of a row: a chunk of n rows is [B, heads, n, D]
 * packed, `n * row_bytes` bytes; CALL_ACC tensors have `bytes` instead.
 *
 * In place: on a device whose kernels read host memory (the reference, OpenCL CPU devices), an
 * input is not copied at all but wrapped where it lies, when the launches take it as a strided
 * view (`views`), or when one chunk covers all its rows in the layout the launch wants. An
 * accumulator with a `dest` (a packed host array of all its rows) accumulates there in place
 * when one chunk covers all of it. A job's output with a `host` tensor (the call's own host
 * staging of all its rows, at element strides s, never the caller's memory) is written there in
 * place by each job, at its rows, and nothing comes back (consume() sees it wrapped, host NULL).
 * Outputs the caller sees are never written in place: a call writes them only once the work
 * they hold has succeeded.
 */
#ifndef APE_RUNTIME_PASS_H
#define APE_RUNTIME_PASS_H

#include <stdbool.h>
#include <stdint.h>

#include "core/backend.h"

#pragma GCC visibility push(hidden)

#define APE__PASS_MAX_T 16 /* tensors of one pass */

enum ape__axis { APE__AXIS_Q, APE__AXIS_K, APE__AXIS_NONE };

enum ape__role {
	APE__ROLE_OUTER_IN,
	APE__ROLE_INNER_IN,
	APE__ROLE_OUTER_ACC,
	APE__ROLE_JOB_OUT,
	APE__ROLE_JOB_IN,
	APE__ROLE_CALL_ACC,
	APE__ROLE_CALL_IN,
};

struct ape__pass_tensor {
	const char *name; /* "q", "dk", ...: for messages */
	enum ape__role role;
	enum ape__axis axis; /* APE__AXIS_NONE for CALL_ACC */
	uint64_t row_bytes; /* bytes per row of a chunk (all batches and heads); 0: unused */
	uint64_t bytes; /* CALL_ACC, CALL_IN: its size */
	uint32_t init; /* accumulators, init_each outputs: the 4-byte pattern they start as */
	bool init_each; /* JOB_OUT: filled with init before each launch (an accumulating launch) */
	bool back; /* OUTER_ACC, JOB_OUT, CALL_ACC: read back into host staging */
	/* inputs from the caller's host tensor (NULL: INNER_IN filled by the loader, JOB_IN by the
	 * pass): its rows, with element strides s; JOB_OUT: the call's own staging of all its rows
	 * (NULL: none), which a device reading host memory writes in place */
	const ape_tensor *host;
	const int64_t *s;
	bool views; /* inputs: every launch takes it as a strided view (struct ape_be_view) */
	bool packed; /* inputs: the host tensor is laid out as its chunk buffer would be */
	void *dest; /* OUTER_ACC: a packed host array of all rows it may accumulate into in place */
};

/* One job, as the pass sees it at launch and when its outputs come back. */
struct ape__pass_job {
	int64_t oc, ic; /* outer chunk and inner chunk */
	int64_t o0, on; /* its outer rows [o0, o0 + on) */
	int64_t i0, in; /* its inner rows [i0, i0 + in) */
	int slot; /* the outer slot (0 .. o_slots - 1) */
	int nth; /* jobs of its outer chunk issued before it */
	/* each tensor's buffer (NULL: unused), and whether it is the caller's host tensor wrapped
	 * where it lies (rows at their host strides from its element 0) or a chunk buffer (rows
	 * packed [B, heads, rows, D] at offset 0) */
	struct ape_be_buf *buf[APE__PASS_MAX_T];
	bool wrapped[APE__PASS_MAX_T];
	/* the inner inputs read in place where the loader keeps them (NULL: in buf[]) */
	const struct ape_be_kv_pages *pages;
	/* at consume(): JOB_OUT (and JOB_IN) tensors read back, [B, heads, rows, D] packed
	 * (NULL: not back) */
	const void *host[APE__PASS_MAX_T];
};

/* What next() says. */
enum { APE__WALK_NEXT, APE__WALK_WAIT, APE__WALK_DONE };

struct ape__pass_ops {
	/*
	 * Sets the pass's tensors (struct ape__pass.t, .nt) for a chunking of no outer and ni
	 * inner chunks on device dev (what a pass holds may depend on both: the forward merges
	 * partial results only with several inner chunks, on the device where its backend can).
	 * Called by the planner for every candidate, and once more for the plan chosen.
	 */
	void (*shape)(void *pass, struct ape_device *dev, int64_t no, int64_t ni);
	/* Device scratch the backend allocates for a launch of `on` outer and `in` inner rows
	 * (its attention_scratch or attention_backward_scratch; 0 without). */
	uint64_t (*scratch)(void *pass, struct ape_device *dev, int64_t on, int64_t in);
	/*
	 * Outer chunk oc (rows [o0, o0 + n)) starts in outer slot `slot`: the pass sets up its
	 * walk. 0 or a negative code (message set).
	 */
	int (*outer_begin)(void *pass, int slot, int64_t oc, int64_t o0, int64_t n);
	/*
	 * The next inner chunk of slot's walk: APE__WALK_NEXT with *ic (and *dir: 0 for the
	 * first, -1 or +1 for its direction from it), APE__WALK_WAIT to have the oldest job in
	 * flight retired first (only while `pending` jobs of this outer chunk are in flight), or
	 * APE__WALK_DONE. `issued` is how many jobs of the chunk were issued so far.
	 */
	int (*next)(void *pass, int slot, int pending, int issued, int64_t *ic, int *dir);
	/*
	 * Optional (NULL: never). Job j's inner inputs could be read in place (j->pages, and the
	 * loader's buffers in j->buf of the two INNER_IN tensors): whether the launch takes them
	 * so (the forward asks the backend's attention_pages). Cannot fail.
	 */
	bool (*in_pages)(void *pass, const struct ape__pass_job *j);
	/* Fills CALL_IN tensor t (`bytes` bytes) into `host`, once per run. Optional without one. */
	void (*call_input)(void *pass, int t, void *host, size_t bytes);
	/* Fills JOB_IN tensor t's rows of job j into `host` (packed, `bytes` bytes). */
	void (*job_input)(void *pass, const struct ape__pass_job *j, int t, void *host, size_t bytes);
	/* Enqueues job j's kernels on q (between the events the executor times). */
	int (*launch)(void *pass, struct ape_be_queue *q, const struct ape__pass_job *j);
	/* Job j's outputs came back (j->host); called in issue order. */
	void (*consume)(void *pass, const struct ape__pass_job *j);
	/*
	 * Every job of outer chunk oc is done and its OUTER_ACC tensors came back (`host`, each
	 * packed [B, heads, n, D], NULL where not back or accumulated in place at dest).
	 */
	void (*outer_done)(void *pass, int slot, int64_t oc, int64_t o0, int64_t n,
			   const void *const *host);
	/* The run's CALL_ACC tensors came back (NULL: none was back). Optional. */
	void (*call_done)(void *pass, const void *const *host);
	/* Span names of the trace, by what they move: outer inputs, inner inputs, the kernel,
	 * job outputs, outer accumulators. */
	const char *span[5];
};

/* A pass: its tensors, its ops and its state (per device: one object per session run). */
struct ape__pass {
	const struct ape__pass_ops *ops;
	void *self; /* the first argument of every op */
	enum ape__axis outer; /* APE__AXIS_Q or APE__AXIS_K */
	int nt;
	struct ape__pass_tensor t[APE__PASS_MAX_T];
	/* inner chunks the last closed walk proved negligible (<= dead_lo, >= dead_hi; the pass
	 * sets them, -1 and INT64_MAX when none): the first resident ones to be overwritten */
	int64_t dead_lo, dead_hi;
	/* NULL, or the kernel paths the pass's launches noted (its traces name them) */
	const struct ape_be_path_log *paths;
	/* An outer chunk's OUTER_ACC read-back is enqueued as soon as its walk is done, after its
	 * last kernel, rather than once the host has seen its jobs retire: one host round trip
	 * less on a call of one chunk (the forward's KV attends). The forward sets it; the
	 * backward does not (with it, two-device backward calls took more device memory than
	 * their plan in tests/test_multidev.c, for a reason not yet found). */
	bool early_back;
};

#pragma GCC visibility pop
#endif
