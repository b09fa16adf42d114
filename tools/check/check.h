/* SPDX-License-Identifier: MIT */
/*
 * ape-check's pieces: tools/ape-check.c (main, the dense cases and their matrix),
 * tools/check/varlen.c (the ragged cells: the forward and the backward of each batch),
 * tools/check/diag.c (the diagnostics), tools/check/kv.c (the KV cache, the KV pool, the
 * caller's pages), tools/check/resident.c (device-resident calls), tools/check/tables.c
 * (distance-bias tables), tools/check/conduct.c (determinism and failure behaviour),
 * tools/check/compare.c (comparisons against the reference) and tools/check/report.c (every
 * cell's record, the summary, the JSON). Linked into ape-check alone.
 */
#ifndef APE_TOOLS_CHECK_H
#define APE_TOOLS_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ape/ape.h"
#include "common/refcheck.h"
#include "common/rng.h"

#define CHECK_MAX_DEVICES 32
#define CHECK_MAX_VCASES 8

/* ---- The record of every cell (tools/check/report.c) */

/* The operation groups of the summary, in its order. */
enum check_group {
	CHECK_LOAD, /* --plugin: the plugin loads */
	CHECK_FORWARD, /* ape_attention_forward() */
	CHECK_BACKWARD, /* ape_attention_backward() */
	CHECK_RAGGED, /* ape_attention_forward_varlen(), ape_attention_backward_varlen() */
	CHECK_DIAG, /* ape_attention_forward_diag(), ape_kv_cache_attend_diag() */
	CHECK_KV, /* ape_kv_cache_*, ape_kv_pool_*, ape_paged_kv_* */
	CHECK_RESIDENT, /* ape_attention_enqueue*(), ape_attention_backward_enqueue() */
	CHECK_TABLES, /* desc->bias_table: forward, KV cache, ragged, backward with dbias_table */
	CHECK_DETERMINISM, /* the same call twice: the same bits */
	CHECK_FAILURES, /* bad arguments and failing device ops: named, nothing written */
	CHECK_NGROUPS
};

enum check_status {
	CHECK_PASS,
	CHECK_FAIL,
	/* the device's backend does not do it: APE_ENOTSUP naming the device, no failure */
	CHECK_NOT_CLAIMED,
};

struct check_cell {
	const char *name; /* a string literal */
	enum check_group group;
	int dev; /* index in the devices checked; -1: none (the plugin's loading) */
	enum check_status status;
	double err, tol; /* the largest error, of the quantity nearest its tolerance; NaN: none */
	char msg[480]; /* what was checked, or what went wrong */
};

/* Records a cell; `fmt` (printf) its message. */
void check_add(enum check_group group, const char *name, int dev, enum check_status status,
	       double err, double tol, const char *fmt, ...) __attribute__((format(printf, 7, 8)));

/* Whether a call's failure `ret` with message `msg` says that dev does not do it: APE_ENOTSUP
 * naming the device (how the core answers a call a device's capabilities leave out), but from
 * no op every backend must have (APE_ENOTSUP from its attention op is a broken contract), and
 * not for a call whose capability bits `needs` (APE_BE_CAP_*, ape_device_capabilities(); 0:
 * none gates it alone) the device states: what a device states, it must do. */
bool check_not_claimed(const ape_device *dev, int ret, const char *msg, uint64_t needs);

/* The capability bits a cell of `group` called `name` needs (0: none gates it alone). */
uint64_t check_cell_needs(enum check_group group, const char *name);

/* Records the cell of a call that returned `ret` (< 0) on devs[d]: not claimed when `optional`
 * and check_not_claimed(), else failed with ape_last_error(); either is said on stderr. */
void check_add_error(enum check_group group, const char *name, int d, ape_device *dev, int ret,
		     bool optional);

/* Records a cell of errors err[i] against tolerances tol[i] (i < n, labels[i] naming each):
 * passed when every one is within, with the errors over their tolerances as the message. */
void check_add_errors(enum check_group group, const char *name, int d, int n,
		      const char *const *labels, const double *err, const double *tol);
/* As check_add_errors(), the message followed by "; " and `note` (NULL: none): what else the
 * cell found that is no error, such as a part of it the device does not claim. */
void check_add_errors_note(enum check_group group, const char *name, int d, int n,
			   const char *const *labels, const double *err, const double *tol,
			   const char *note);

/* Whether `msg` names `dev`: its "backend:index" or its name, as the core's messages do. */
bool check_names_device(const ape_device *dev, const char *msg);

int check_count(void);
const struct check_cell *check_get(int i);
/* Whether every cell recorded passed or is not claimed. */
bool check_all_passed(void);
/* "forward", ...; "pass", "fail", "not_claimed" (the JSON's words) */
const char *check_group_name(enum check_group group);
const char *check_status_name(enum check_status status);

/* One line per cell of the groups first..last, a column per device. */
void check_print_cells(ape_device **devs, int ndev, enum check_group first,
		       enum check_group last);
/* The table of passed, failed and not claimed cells per group, and the verdict. */
void check_print_summary(int ndev);
/* The "cells" and "summary" members of the JSON object (each preceded by ",\n "). */
void check_json_cells(FILE *f, ape_device **devs);

/* ---- Comparisons against the reference (tools/check/compare.c) */

/* n values of type dtype as float32, in a new allocation (free()); NULL when out of memory. */
float *check_to_f32(const void *p, ape_dtype dtype, size_t n);
/* max |got - want| / scale; NaN or Inf on one side only: infinite. */
double check_err_abs(const float *got, const float *want, size_t n, double scale);
/* max |got - want| / max(1, |want|) (the spec's LSE measure); equal infinities: 0. */
double check_err_rel(const float *got, const float *want, size_t n);
/* |got - want| / max(1, |scale|) (scale not finite: 1), as check_err_rel() measures each value:
 * the diagnostics' measure, entropy against its row's LSE, mean distance against its row's
 * largest distance. */
double check_err_one(double got, double want, double scale);
/* max |got - want| / max |want| over n values (the spec's "Gradients" measure, whose bound is
 * refcheck_tol_grad()); max |want| at least 1e-30. */
double check_err_grad(const float *got, const float *want, size_t n);
/* max |x| over n values, at least 1e-30. */
double check_max_abs(const float *x, size_t n);

/* What every group's cells get: the devices checked, the reference, the random source. */
struct check_env {
	ape_device **devs;
	int ndev;
	ape_device *ref;
	ape_rng *rng;
	bool quick; /* --quick: the small cases only */
	bool long_cases; /* neither --quick nor --plugin: the long cases too */
};

/* The seed's parameters, one value for every head. */
void check_seed_desc(ape_attn_desc *desc);

/* Contiguous random Q, K, V of one dense problem, host memory, and V as float32. */
struct check_qkv {
	int64_t B, H, Hkv, Lq, Lk, D;
	ape_dtype dtype;
	void *q, *k, *v;
	float *vf;
	ape_tensor tq, tk, tv;
};

/* Returns 0 or APE_ENOMEM (what was made freed). */
int check_qkv_make(struct check_qkv *x, ape_rng *rng, ape_dtype dtype, int64_t B, int64_t H,
		   int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D);
void check_qkv_free(struct check_qkv *x);
/* n floats, every one NaN (an output a call leaves unwritten stays NaN); NULL: no memory. */
float *check_nan_floats(size_t n);

/* ---- The groups */

/* One ragged cell: a case's batch on one device against the reference's, the forward, then
 * the backward of the same batch. */
struct vcell {
	const char *name;
	ape_dtype dtype;
	int err; /* the device's forward failed: its code (and no backward run) */
	int64_t rows; /* rows compared (every row of every sequence, all heads) */
	uint64_t launches; /* the forward's ape_stats.chunks */
	double max_err_o, max_err_lse, tol_o, tol_lse;
	/* the backward (ape_attention_backward_varlen()) from the reference's O and LSE with a
	 * random dO (of the storage type) and dLSE, the gradients of the storage type: bwd_ran
	 * when the forward passed on to it */
	bool bwd_ran;
	int bwd_err; /* its code when it failed */
	/* APE_ENOTSUP naming the device, which does not state APE_BE_CAP_BACKWARD: skipped, no
	 * failure (bwd_msg says why) */
	bool bwd_not_claimed;
	uint64_t bwd_launches; /* the backward's ape_stats.chunks */
	/* max |G - G_ref| / max |G_ref| per gradient (REFCHECK_DQ ... REFCHECK_DPARAMS, the
	 * parameters' as one [H, 4] tensor), and refcheck_tol_grad() of the storage type */
	double max_err_grad[REFCHECK_NGRADS], tol_grad;
	bool ok; /* the forward within its tolerances, the backward within its or not claimed */
	char msg[256]; /* the device's forward failure */
	char bwd_msg[256]; /* the backward's failure, or why it is not claimed */
};

/*
 * Runs every ragged case (quick: the small ones) on the reference, the forward and the
 * backward, then on each of devs, into cells[case][device], and their count into *ncases, each
 * also recorded (check_add(), CHECK_RAGGED: one cell of O, LSE, dQ, dK, dV, dP per case and
 * device). Returns 0, or a negative code when the reference itself failed (message printed). A
 * device's failure is its cell's err or bwd_err.
 */
int check_varlen(ape_device **devs, int ndev, ape_device *ref, ape_rng *rng, bool quick,
		 struct vcell (*cells)[CHECK_MAX_DEVICES], int *ncases);

/*
 * Each group runs its cases on every device of env and records a cell per case and device
 * (check_add()). They return 0, or a negative code when the reference or the host failed (the
 * message printed): the check cannot go on.
 */
int check_diag(const struct check_env *env);
int check_kv(const struct check_env *env);
int check_resident(const struct check_env *env);
int check_tables(const struct check_env *env);
int check_determinism(const struct check_env *env);
int check_failures(const struct check_env *env);

#endif
