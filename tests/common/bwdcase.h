/* SPDX-License-Identifier: MIT */
/*
 * A backward-pass case for the tests: a random forward problem (common/problem.h) with its saved
 * O and LSE, upstream gradients dO and dLSE, and gradient outputs poisoned with NaN. Shared by
 * tests/test_backward*.c and the fault tests (tests/faults/test_bwdfail.c).
 */
#ifndef APE_TEST_BWDCASE_H
#define APE_TEST_BWDCASE_H

#include "ape/ape_dlpack.h"
#include "problem.h"

/* Bits of the `wanted` masks: which outputs a call asks for. */
#define W_DQ 1u
#define W_DK 2u
#define W_DV 4u
#define W_DP 8u
#define W_ALL 15u

/* A forward problem with its saved O and LSE, and the upstream gradients. */
typedef struct bcase {
	test_problem tp;
	test_tensor dout;
	float *dlse; /* NULL: not given */
} bcase;

/* Gradients of one call. */
typedef struct grads {
	test_tensor dq, dk, dv;
	float *dparams; /* 4 * H */
	int64_t H;
} grads;

/* Inputs and upstream gradients (dO N(0,1) in dt, dLSE N(0,1) when with_dlse); the caller sets
 * the parameters, then bcase_forward(). -1 if out of memory. */
int bcase_make(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt, bool strided,
	       bool with_dlse);
void bcase_free(bcase *c);
/*
 * max |a - b| over the gradient of c's distance-bias table (bias_table_heads x bias_table_len
 * floats), relative to its scale (a NaN in a counts as infinite). The scale is max |b|, except
 * for a table of one entry per head row: over every key of a row dS sums to dLSE_i, so such an
 * entry is the sum of its rows' dLSE, which random signs cancel down to any size while each
 * term keeps its float32 rounding; there the scale is at least the sum of those |dLSE_i|
 * (c->dlse given; 2026-12-08: an entry of 0.076 from terms summing to 96 in absolute value).
 */
double bcase_dbias_rel_err(const bcase *c, const float *a, const float *b);
/* The saved O and LSE, from the forward on dev; returns its code. */
int bcase_forward(bcase *c, ape_device *dev);
/* bcase_make(), random parameters (test_problem_random_params()), bcase_forward(). */
int bcase_ready(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt, bool strided,
		bool with_dlse, ape_device *dev);
/* bcase_ready() with the queries end-aligned (q_start_set false), so that every query row sees
 * keys and every device launches: for the tests that count on a launch happening (a fault, a
 * failing launch), which random positions alone may hide entirely from the causal mask. */
int bcase_ready_visible(bcase *c, ape_rng *r, const test_problem_shape *sh, ape_dtype dt,
			bool strided, bool with_dlse, ape_device *dev);

/* Per-head parameters (the drawn ones, in tp.params) with head 0's decays negative and its
 * lambda large (1.75), head 1's lambda 0 (when there is a head 1). */
void bcase_edge_heads(bcase *c);

/* dq, dk, dv of type dt and dparams, every element NaN. -1 if out of memory. */
int grads_alloc(grads *g, const bcase *c, ape_dtype dt);
void grads_free(grads *g);

/* ape_attention_backward() of case c into the outputs of g that `wanted` (W_*) names. */
int run_backward(bcase *c, ape_device *dev, grads *g, unsigned wanted, ape_stats *st);
/* ape_attention_backward_ex() on dev alone with options eo, every output. */
int run_backward_ex(bcase *c, ape_device *dev, grads *g, const ape_exec_options *eo,
		    ape_stats *st);
/* run_backward_ex() with chunk_q = cq and chunk_k = ck. */
int run_chunked(bcase *c, ape_device *dev, grads *g, int64_t cq, int64_t ck, ape_stats *st);

/* The spec's accuracy of gradients for a storage type, times max |G_64| (APE-SPEC.md,
 * "Gradients"). */
double grads_tol(ape_dtype storage);
/* max |a - b| over a gradient tensor, relative to max |b|. */
double grads_rel_err(const ape_tensor *a, const ape_tensor *b);
/* The same over the 4 * H parameter gradients (a NaN in a counts as infinite). */
double grads_rel_err_params(const float *a, const float *b, int64_t H);

/* The same bytes; the outputs `wanted` names. */
bool same_bits(const test_tensor *a, const test_tensor *b);
bool same_grads(const grads *a, const grads *b, unsigned wanted);

/* Chunked against one launch: the same float64 terms, summed over chunks in float32 (dK, dV
 * on the device) or in float64 from float32 partials (dQ). */
#define CHUNK_TOL 1e-5

/* The same values as a contiguous tensor's, stored as float32 (widening is exact). */
int grads_widen(test_tensor *dst, const test_tensor *src);

/* Byte copies of the four outputs, to prove nothing was written. */
typedef struct grads_snapshot {
	void *b[4];
	size_t n[4];
} grads_snapshot;

void grads_snap(grads_snapshot *s, const grads *g);
/* Whether g's outputs hold the snapshot's bytes; frees the copies. */
bool grads_unchanged(const grads_snapshot *s, const grads *g);

/* ---- the same case on device tensors (ape_attention_backward_enqueue()) */

/* The device side of one case: every tensor in its own buffer. */
enum dcase_tensor { T_Q, T_K, T_V, T_O, T_LSE, T_DOUT, T_DLSE, T_DQ, T_DK, T_DV, T_DP, T_COUNT };

typedef struct dcase {
	ape_buffer *b[T_COUNT];
	ape_dtensor d[T_COUNT];
	size_t pad;
} dcase;

/* n floats to a new buffer of qu's device, `pad` bytes in, viewed as [d0, d1, d2, d3]. */
int dcase_up_floats(ape_queue *qu, const float *x, size_t n, size_t pad, ape_buffer **b,
		    ape_dtensor *d, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
/* Case c and the outputs of g (each tensor's whole allocation) to buffers of their own, `pad`
 * bytes in (x->d views them as c's and g's tensors); returns the first failure's code. */
int dcase_up(dcase *x, ape_queue *qu, const bcase *c, const grads *g, size_t pad);
/* ape_attention_backward_enqueue() of the outputs `wanted` names (W_*). */
int dcase_enqueue(dcase *x, ape_queue *qu, const bcase *c, unsigned wanted);
/* Every output buffer back into g's allocations (padding included), then synchronises. */
int dcase_down(dcase *x, ape_queue *qu, grads *g);
void dcase_free(dcase *x);
/* All of it on a queue of its own: up, enqueue, down. */
int run_enqueue_backward(const bcase *c, ape_device *dev, grads *g, unsigned wanted, size_t pad);

/* ---- the same case on DLPack tensors (ape_attention_backward_dlpack(), kDLCPU) */

/* The DLPack type of an ape_dtype (kDLFloat 32 or 16, kDLBfloat 16; lanes 1). */
DLDataType test_dl_dtype(ape_dtype dt);

/* A backward call's DLTensors over a bcase and its gradients (host memory, kDLCPU). */
typedef struct dlbwd {
	int64_t shp[11][4], str[11][4];
	DLTensor t[11]; /* q, k, v, o, lse, dout, dlse, dq, dk, dv, dparams */
} dlbwd;

/* b's DLTensors over c's tensors and g's outputs, each with its own data and strides. */
void dlbwd_make(dlbwd *b, bcase *c, grads *g);
/* ape_attention_backward_dlpack() of the outputs `wanted` names (W_*), dlse where c has one. */
int dlbwd_run(ape_device *dev, const bcase *c, dlbwd *b, unsigned wanted, void *stream);

#endif
