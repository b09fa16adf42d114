/* SPDX-License-Identifier: MIT */
/* Helpers shared by the tests: seeded randomness, tensors, comparisons with the spec's tolerances. */
#ifndef APE_TESTUTIL_H
#define APE_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"
#include "common/rng.h"

/* Randomness comes from tools/common/rng.h: fresh each run, replayed with APE_TEST_SEED. */

/* True when running under valgrind (APE_TEST_VALGRIND set): tests shrink their sizes. */
bool ape_test_slow(void);

/* ---- tensors owned by the tests */
typedef struct test_tensor {
	ape_tensor t;
	void *alloc; /* the allocation (data may point inside it for strided layouts) */
	size_t alloc_bytes;
} test_tensor;

/* Contiguous [d0,d1,d2,d3], elements drawn N(0, sd) and rounded to dtype. */
int test_tensor_random(test_tensor *tt, ape_rng *r, ape_dtype dt, int64_t d0, int64_t d1,
		       int64_t d2, int64_t d3, double sd);
/* The same logical tensor stored as [d0, d2, d1, d3] (the "BLHD" layout most models use), with
 * `pad` unused elements after each row; returns the tensor with strides describing it. */
int test_tensor_relayout(test_tensor *dst, const test_tensor *src, int64_t pad);
/* Uninitialised (poisoned with NaN) tensor of the given shape. */
int test_tensor_empty(test_tensor *tt, ape_dtype dt, int64_t d0, int64_t d1, int64_t d2,
		      int64_t d3);
void test_tensor_free(test_tensor *tt);
/* Element (b,h,l,d) as double, honouring strides. */
double test_tensor_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d);
void test_tensor_set(ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d, double x);
/* Fills every element (strides honoured) with NaN. */
/* Rows [l0, l0 + n) of t along L (ape_tensor_rows); aborts on a bad range, a bug in the test. */
ape_tensor test_rows(const ape_tensor *t, int64_t l0, int64_t n);
void test_tensor_poison(ape_tensor *t);
double test_tensor_maxabs(const ape_tensor *t);

/* Random per-head parameters for H <= 8 heads in prm (delta in [0, 0.4), beta and gamma in
 * [0, 0.04), lambda in [0, 0.3), drawn head by head), made d's per-head values. */
void test_random_head_params(ape_attn_desc *d, float prm[4][8], int64_t H, ape_rng *r);

/* ---- the spec's accuracy table */
double test_tol_o(ape_dtype storage); /* times max|V| */
double test_tol_lse(ape_dtype storage); /* times max(1, |LSE|) */
/* What skipping may add on top of those (APE-SPEC.md, "Skipping far keys"): the keys a row
 * leaves out weigh at most skip_tol of those it computes, so O moves by at most
 * 2 skip_tol / (1 + skip_tol) times max|V| and LSE by at most log(1 + skip_tol). */
double test_skip_tol_o(double skip_tol);
double test_skip_tol_lse(double skip_tol);
/* What merging key chunks may add to O's error (docs/ape.md, "Storage and accuracy"): each
 * chunk's LSE is float32, off by up to 2^-24 |LSE|, which moves the chunks' weights against
 * each other; 2^-22 (|LSE| + 1) times max|V| bounds it with a factor of two to spare (|LSE|:
 * the row's, from the reference). Negligible but where a row's nearest key lies far away
 * under a strong decay. Static inline: the fuzzers use it without the tests' library. */
static inline double test_merge_tol_o(double lse)
{
	return 0x1p-22 * ((lse < 0 ? -lse : lse) + 1);
}
/* Execution options with the given most rows per query and key chunk, the rest default. */
ape_exec_options test_chunks(int64_t cq, int64_t ck);

/* Largest |a - b| over O, and over LSE (two -inf count as equal; NaN on either side is +inf). */
double test_max_err_o(const ape_tensor *a, const ape_tensor *b);
double test_max_err_lse(const float *a, const float *b, size_t n);
/* Largest |a - b| / max(1, |b|) over LSE. */
double test_max_rel_err_lse(const float *a, const float *b, size_t n);

/* ---- files */
/* Removes a directory tree (ignores errors). */
void test_rmtree(const char *dir);
/* Entries of dir other than . and ..; the first name found goes to `first` when not NULL.
 * -1 if dir cannot be opened. */
int test_count_entries(const char *dir, char *first, size_t firstlen);
/* The whole file, NUL-terminated (free() it), its length in *len when len is not NULL; NULL on
 * any error. */
unsigned char *test_read_file(const char *path, size_t *len);

/* Whether a file whose path holds `name` is mapped into this process (/proc/self/maps): a
 * shared object still loaded. */
bool test_mapped(const char *name);

/* ---- documentation run as it stands */
/* Writes text to path (created or truncated): 0, or -1. */
int test_write_text(const char *path, const char *text);
/* The ```sh block of doc (a Markdown text) holding `needle`, without its fences (free() it);
 * NULL if none. */
char *test_doc_block(const char *doc, const char *needle);
/*
 * Runs script with sh in a bare environment: PATH, HOME = dir and the NULL-terminated extra
 * "NAME=value" entries (NULL: none); script written to dir/NAME.sh, output to dir/log. Returns
 * the exit status, or -1.
 */
int test_run_script(const char *dir, const char *name, const char *script,
		    const char *const *extra_env);

/* ---- tools */
/*
 * Runs APE_BUILD_DIR/bin/<tool> with args (NULL-terminated) in directory cwd (NULL: this one),
 * capturing stdout and stderr (each cut to cap - 1 bytes and NUL-terminated). Returns the exit
 * status, 128 + the signal if it was killed, or -1 if it could not be started.
 */
int test_run_tool(const char *tool, const char *const *args, const char *cwd, char *out,
		  size_t outcap, char *err, size_t errcap);

/* ---- contexts */
/* A context with only the named backends and output poisoning on; aborts the test on failure. */
ape_context *test_context(const char *backends);
ape_device *test_device(ape_context *ctx, const char *backend);

#endif
