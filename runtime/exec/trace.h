/* SPDX-License-Identifier: MIT */
/*
 * Chrome trace-event JSON (the format Perfetto and chrome://tracing open) of a streamed call:
 * one process per device, one thread per queue, an "X" event per copy and kernel with its
 * device timestamps. Each device's worker records into its own struct ape__trace_dev; the
 * calling thread writes the file once every worker is done.
 */
#ifndef APE_RUNTIME_TRACE_H
#define APE_RUNTIME_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* Queue lanes ("threads" of a device's process). */
enum ape__lane {
	APE__LANE_KERNEL = 1,
	APE__LANE_H2D_Q = 10, /* + slot */
	APE__LANE_H2D_KV = 20, /* + slot */
	APE__LANE_D2H = 30, /* + slot */
};

struct ape__trace_ev {
	const char *what; /* static string: "h2d K/V", "attention", "d2h O/LSE", "h2d Q" */
	int lane;
	double t0, t1; /* milliseconds on the device's clock (or the host's) */
	double enq; /* the host's clock (ape__now_ms()) when its commands were enqueued: before t0 */
	int64_t qc, kc; /* chunk indices; -1 when not applicable */
	uint64_t bytes;
};

struct ape__trace_dev {
	struct ape__trace_ev *ev;
	size_t n, cap;
	bool device_clock; /* t0/t1 from event_timestamp; false: the host's clock */
	double host_start_ms; /* host clock when the device's worker started, relative to the call */
	char label[200]; /* "opencl:0 pthread-... (entry 1)" */
	bool failed; /* out of memory while recording: the file says so */
	char path[64]; /* the kernel paths its launches took ("separable"; "" unknown) */
};

/* Appends one event; on allocation failure marks the recorder failed instead of failing the
 * call (a trace is a diagnostic, not a result). */
void ape__trace_add(struct ape__trace_dev *t, const char *what, int lane, double t0, double t1,
		    double enq, int64_t qc, int64_t kc, uint64_t bytes);
void ape__trace_free(struct ape__trace_dev *t);
/* The process name of entry d of a device list: "opencl:0 NAME", " (again)" when the same
 * device came earlier in the list. */
struct ape_device;
void ape__trace_label(struct ape__trace_dev *t, struct ape_device *const *devs, int d);

/* Adds t's spans to the session trace (core/strace.h) on the host's clock: spans timed on the
 * host as they are; on a device clock, shifted by the smallest offset that puts no span
 * before its commands were enqueued (the device clock's origin is arbitrary). */
void ape__trace_to_session(const struct ape__trace_dev *t);

/* Writes the trace of `n` devices to `path` through a temporary file and a rename. Returns 0
 * or APE_EIO / APE_ENOMEM with a message naming `fn` and the file. */
int ape__trace_write(const char *path, const char *fn, struct ape__trace_dev *devs, int n);

#pragma GCC visibility pop
#endif
