/* SPDX-License-Identifier: MIT */
/*
 * ape-bench's pieces: tools/ape-bench.c (main, and the host call's mode with its table),
 * tools/bench/args.c (the options), tools/bench/inputs.c (random inputs, the timed host calls,
 * the rows of a mode, what every mode's report shares), tools/bench/resident.c (--resident),
 * tools/bench/stream.c (--stream), tools/bench/varlen.c (--varlen) and tools/bench/pool.c
 * (--pool). Linked into ape-bench alone.
 */
#ifndef APE_TOOLS_BENCH_H
#define APE_TOOLS_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"
#include "common/refcheck.h"
#include "common/rng.h"

#define MAX_LIST 16

struct bench_opts {
	const char *backend;
	int device;
	int64_t B, H, Hkv, D, Lq; /* Lq 0: Lq = L */
	int64_t L[MAX_LIST];
	int nL;
	double skip[MAX_LIST];
	int nskip;
	ape_dtype dtype;
	bool causal;
	float delta, beta, gamma, lambda;
	int warmup, repeats, check_rows;
	bool json;
	uint64_t seed;
	bool seeded;
	bool numa; /* --numa: copy bandwidth per NUMA node instead of attention */
	int64_t copy_mib;
	bool backward; /* --backward: time ape_attention_backward() after each forward */
	bool stream; /* --stream: chunked execution under a budget, overlap and peak memory */
	bool resident; /* --resident: ape_attention_enqueue on device buffers beside the host call */
	bool serial; /* --stream: also time copies and kernels back to back (--no-serial: not) */
	int64_t varlen; /* --varlen S: ragged batches of S sequences of L tokens; 0: not */
	int64_t pool; /* --pool S: a decode step of S sequences of a KV pool; 0: not */
	int64_t page_tokens; /* --pool: tokens per page; 0: the pool's default */
	bool spread_even, spread_set; /* --pool: lengths in even steps (else geometric) */
	double membw; /* --pool: GB/s to compare the read bandwidth with; 0: none */
	int64_t chunk;
	uint64_t max_mem;
	bool warmup_set, repeats_set, check_set, L_set, skip_set;
};

struct inputs {
	void *q, *k, *v, *o;
	float *lse;
	ape_tensor tq, tk, tv, to;
	/* --backward: dO and the gradients, in the storage type; NULL otherwise */
	void *dout, *dq, *dk, *dv;
	float *dparams;
	ape_tensor tdout, tdq, tdk, tdv;
};

/* Host calls of one configuration: o->warmup untimed, then o->repeats (at most 1024) timed. */
struct host_times {
	double median_ms, min_ms, max_ms, kernel_ms; /* wall time, and the kernels' (medians) */
	ape_stats last; /* the last call's statistics */
	/* --backward: the same of the backward call run after each forward, and the median of
	 * each round's backward / forward wall time */
	double bwd_median_ms, bwd_min_ms, bwd_max_ms, bwd_kernel_ms, ratio;
	ape_stats bwd_last;
};

/* Which configuration a row of the host call or of --resident times: Lq query rows (o->Lq, or
 * L when that is larger or unset) against L keys, at skip_tol. */
struct row_key {
	int64_t L, Lq;
	double skip_tol;
};

/* One (L, skip_tol) row of a mode, into *out (the mode's own row struct). */
typedef int (*row_fn)(ape_device *dev, ape_device *ref, const struct bench_opts *o, int64_t L,
		      double skip_tol, ape_rng *rng, void *out);

/* ---- args.c */

/* The command line into o (defaults already in it); 0, or a libape code with the message in
 * err. --help prints the usage and exits. */
int bench_parse_args(int argc, char **argv, struct bench_opts *o, char *err, size_t errlen);

/* ---- inputs.c */

/* The median of x[0..n), sorting x. */
double bench_median(double *x, int n);
/* Wall-time figures of n timed calls: median, fastest, slowest (t is sorted). */
void bench_summarize(double *t, int n, double *med, double *min, double *max);
/* Random Q, K, V (and with --backward dO) of the row's shape, room for O, LSE (and the
 * gradients); APE_ENOMEM with nothing left allocated. */
int bench_make_inputs(const struct bench_opts *o, int64_t L, int64_t Lq, ape_rng *rng,
		      struct inputs *in);
void bench_free_inputs(struct inputs *in);
/* The call every row times: the options' parameters and causality, this row's skip_tol. */
void bench_desc(const struct bench_opts *o, double skip_tol, ape_attn_desc *desc);
/*
 * What a mode times and prints: `one` fills a row of `row_size` bytes, whose refcheck_result
 * lies at byte `check_at`, per (L, skip_tol) of o; `done` (or NULL) sees each row as it comes
 * (not with --json); `table` or, with --json, `json` prints the rows.
 */
struct bench_mode {
	row_fn one;
	size_t row_size, check_at;
	void (*done)(const struct bench_opts *o, const void *row);
	void (*table)(const ape_device_info *info, const struct bench_opts *o, const void *rows,
		      int n);
	void (*json)(const ape_device_info *info, const struct bench_opts *o, const void *rows,
		     int n);
};
/* Runs every row of m into rows (room for MAX_LIST * MAX_LIST) and prints them; the exit
 * status: 0, 1 when a row was out of tolerance, or bench_failed()'s. */
int bench_mode_run(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng,
		   const struct bench_mode *m, void *rows);
/* What a row of the host call and of --resident start from: its configuration in *key (Lq
 * from o and L), fresh inputs of that shape, its desc, and the host calls timed on them
 * (inputs freed on failure). */
int bench_host_row(ape_device *dev, const struct bench_opts *o, int64_t L, double skip_tol,
		   ape_rng *rng, struct row_key *key, struct inputs *in, ape_attn_desc *desc,
		   struct host_times *ht);
/* What every mode's table starts with: "ape-bench MODE: DEVICE", then the shape, the line left
 * open for the mode's own figures. */
void bench_table_head(const char *mode, const ape_device_info *info, const struct bench_opts *o);
/* What every mode's JSON starts with: the device and the shape. */
void bench_json_head(const ape_device_info *info, const struct bench_opts *o);
/* The table's columns err_O and err_LSE, each `width` wide. */
void bench_print_check(const struct refcheck_result *c, int width);
/* What ends a table's line: a warning when the sampled rows were out of tolerance. */
const char *bench_tol_note(const struct refcheck_result *c);
/* "true" when the sampled rows were within tolerance, or none was checked. */
const char *bench_json_within_tol(const struct refcheck_result *c);
/* A mode that failed: the message, and the exit status (2: bad arguments; 3: the device cannot,
 * e.g. --backward on a backend without a backward pass; 1: the rest). */
int bench_failed(int ret);

/* ---- resident.c: --resident, the device-resident call beside the host call; the exit
 * status */
int bench_resident(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng);

/* ---- varlen.c: --varlen, ragged batches against a dense call per sequence; the exit
 * status */
int bench_varlen(ape_device *dev, const struct bench_opts *o, ape_rng *rng);

/* ---- pool.c: --pool, a decode step of many sequences in one KV pool against one KV cache per
 * sequence; the exit status */
int bench_pool(ape_device *dev, const struct bench_opts *o, ape_rng *rng);

/* ---- stream.c: --stream, long sequences streamed under a budget */

/* What --stream measures unless told otherwise: long sequences, skipping on, one repeat. */
void bench_stream_defaults(struct bench_opts *o);
/* The exit status. */
int bench_stream(ape_device *dev, ape_device *ref, const struct bench_opts *o, ape_rng *rng);

#endif
