/* SPDX-License-Identifier: MIT */
/*
 * ape-run's pieces: tools/ape-run.c (main, the one-call mode), tools/run/args.c (the options,
 * --help), tools/run/devices.c (--backend, --device, --devices; exit statuses),
 * tools/run/inputs.c (Q, K, V, dO: read, checked, converted), tools/run/outputs.c (the output
 * files: checked first, written together), tools/run/kv.c (the --kv-cache mode),
 * tools/run/backward.c (the --backward mode: dLSE, the gradients), tools/run/varlen.c (the
 * ragged call's offsets and positions: --cu-seqlens-q/-k, --positions-q/-k) and tools/run/stats.c
 * (the --stats report and the sum of a KV-cache run's per-step statistics). Linked into ape-run
 * alone.
 */
#ifndef APE_TOOLS_RUN_H
#define APE_TOOLS_RUN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ape/ape.h"
#include "common/bias_table.h"

/* Exit statuses; RUN_HELP is --help, never an exit status. */
enum { RUN_OK = 0, RUN_FAIL = 1, RUN_USAGE = 2, RUN_NODEV = 3, RUN_HELP = -1 };

/* A per-head parameter as given on the command line; checked against H once Q is read. */
struct head_param {
	const char *flag;
	float def;
	float *vals; /* NULL: not given */
	size_t n;
};

struct run_args {
	const char *q, *k, *v, *o, *lse;
	const char *ent, *md; /* --entropy, --mean-distance; NULL: not wanted */
	const char *backend;
	int device; /* -1: the first */
	const char *device_spec; /* --device as a PCI address or "backend:N"; NULL for an index */
	struct head_param param[4]; /* delta, beta, gamma, lambda */
	ape_attn_desc desc; /* everything but the per-head parameters */
	int dtype; /* an ape_dtype, or -1 for the input's */
	bool stats;
	int64_t chunk; /* 0: the library's default */
	uint64_t max_mem; /* 0: the library's default */
	const char *trace;
	const char *devices; /* --devices: comma-separated specs */
	int64_t kv_step; /* 0: no KV cache */
	int64_t kv_block, kv_capacity;
	bool kv_release;
	/* --backward DO.npy and its outputs; NULL: not given */
	const char *dout, *dlse, *dq, *dk, *dv, *dparams;
	/* the ragged call (ape_attention_forward_varlen_ex()) on packed files: cu_q and cu_k both
	 * set (one given stands for both) or both NULL; pos_q, pos_k NULL: the library's default */
	const char *cu_q, *cu_k, *pos_q, *pos_k;
	bool k_start_set; /* --k-start given */
	/* --bias-table FILE (read into table, desc pointing at it, once Q gives H) and, with
	 * --backward, --dbias-table FILE, its gradient; NULL: not given */
	const char *bias_table, *dbias_table;
	struct bias_table_file table;
};

/* One input file, its shape seen as [B, H, L, D], and its data in the computation's type. */
struct input {
	const char *path;
	ape_dtype file_dtype;
	bool packed; /* a ragged call's [total, H, D] file: t is [1, H, total, D], token-major */
	int ndim; /* 3 or 4, as in the file */
	int64_t shape[4]; /* as in the file */
	uint64_t count;
	void *data;
	ape_tensor t;
};

/* The ragged call's batch, from --cu-seqlens-q/-k and --positions-q/-k (run_load_ragged()). */
struct run_ragged {
	ape_varlen vl; /* pointing at the arrays below */
	int64_t *cu_q, *cu_k, *pos_q, *pos_k;
};

/* The gradients of a --backward run: float32, NULL where no file asked for them. */
struct run_grads {
	float *dq, *dk, *dv; /* Q's and K's shapes */
	float *dparams; /* [H, 4] */
	float *dbias; /* the distance-bias table's, its shape */
	float *dlse; /* the input dL/dLSE, [B, H, Lq]; NULL: zero */
};

/* ---- args.c */

/* --help's text on stdout. */
void run_usage(void);
/* The defaults (the seed's parameters: common/seed.h) into a. */
void run_args_init(struct run_args *a);
/* Frees what parsing and run_load_bias_table() allocated. */
void run_args_free(struct run_args *a);
/* The command line into a (run_args_init() first), the options checked against each other.
 * Returns 0, RUN_HELP for --help, or an exit status with msg filled. */
int run_parse_args(int argc, char **argv, struct run_args *a, char *msg, size_t len);

/* ---- devices.c */

/* The exit status for a libape error code. */
int run_exit_code(int err);
/* The exit status for a computing call's error: run_exit_code()'s, but 3 (not available) for
 * APE_ENOTSUP with --bias-table (a device that does not compute distance-bias tables). */
int run_call_exit_code(const struct run_args *a, int err);
/*
 * A context of the backend asked for and its device(s): --devices' list, --device's spec or
 * index, or the first (auto says on stderr when it passes over a preferred backend). Returns
 * an exit status, msg filled and *ctx NULL on failure.
 */
int run_open_devices(const struct run_args *a, ape_context **ctx, ape_device **devs, int *ndev,
		     char *msg, size_t len);

/* ---- inputs.c (each returns an exit status, msg filled on failure) */

/* Reads Q, K, V into in[0..2] and, with --backward, dO into in[3] (as in the files). */
int run_load_inputs(const struct run_args *a, struct input in[4], char *msg, size_t len);
/* The checks best explained in terms of the files (dtypes, B, D, Hkv, dO's shape); the library
 * checks the rest. */
int run_check_inputs(const struct input in[4], char *msg, size_t len);
/* Converts every input to the storage type and sets its tensor. */
int run_stage_inputs(struct input in[4], ape_dtype storage, char *msg, size_t len);
/* The per-head parameters into a->desc: one value, or H of them for Q's H heads. */
int run_set_head_params(struct run_args *a, const struct input *q, char *msg, size_t len);
/* --bias-table: the table for Q's H heads (q) into a->table, a->desc pointing at it. Nothing
 * to do without it. */
int run_load_bias_table(struct run_args *a, const struct input *q, char *msg, size_t len);
/* t as a tensor of `like`'s shape and layout (packed or not) over data of type dt. */
void run_tensor_init(ape_tensor *t, void *data, ape_dtype dt, const struct input *like);

/* ---- varlen.c */

/* Reads the ragged call's offsets and positions into r and checks them against the packed
 * inputs (in[0] Q, in[1] K): returns an exit status, msg filled on failure (naming the option,
 * the file and the entry). Nothing to do (r empty) without --cu-seqlens-*. */
int run_load_ragged(const struct run_args *a, const struct input in[4], struct run_ragged *r,
		    char *msg, size_t len);
/* Frees what run_load_ragged() allocated. */
void run_ragged_free(struct run_ragged *r);

/* ---- outputs.c (each returns an exit status, msg filled on failure) */

/* Refuses output paths that cannot work (two options naming one file, a directory, a missing
 * directory) before any time is spent computing. */
int run_check_outputs(const struct run_args *a, char *msg, size_t len);
/* Writes O, LSE, the diagnostics and the gradients asked for (each NULL where not), all or
 * none: in[] gives their shapes and dtypes. */
int run_write_outputs(const struct run_args *a, const struct input in[4], const float *o,
		      const float *lse, const float *ent, const float *md, const struct run_grads *g,
		      char *msg, size_t len);

/* ---- kv.c, backward.c, stats.c */

/*
 * --kv-cache: Q, K, V (in[0..2]) through an ape_kv_cache on dev, a->kv_step queries per attend;
 * O into ot (float32, Q's shape), LSE into lse, the diagnostics into ent and md when not NULL
 * (ape_kv_cache_attend_diag()). *tot gets the statistics of every step added up and the wall
 * time of the whole. Returns an exit status, msg filled on failure.
 */
int run_kv(const struct run_args *a, ape_device *dev, const struct input in[3], ape_tensor *ot,
	   float *lse, float *ent, float *md, ape_stats *tot, char *msg, size_t len);

/*
 * --dlse: reads the file into g->dlse, checking that it is '<f4' of LSE's shape for Q (q).
 * Returns an exit status, msg filled on failure. Nothing to do without --dlse.
 */
int run_load_dlse(const struct run_args *a, const struct input *q, struct run_grads *g,
		  char *msg, size_t len);

/*
 * The backward call after the forward, on the forward's devices: in[0..2] Q, K, V and in[3] dO
 * in the computation's type, ot and lse the forward's O (float32) and LSE; vl the ragged
 * call's batch (NULL: the dense call). Allocates the gradients the arguments ask for into g and
 * fills them; prints the call's statistics with --stats. Returns an exit status (3 for a
 * backend without a backward pass), msg filled on failure.
 */
int run_backward(const struct run_args *a, ape_device *const *devs, int ndev,
		 const ape_varlen *vl, const struct input in[4], const ape_tensor *ot,
		 const float *lse, struct run_grads *g, char *msg, size_t len);

/* Frees what run_load_dlse() and run_backward() allocated. */
void run_grads_free(struct run_grads *g);

/* Adds one call's statistics to the running totals (a KV-cache run is many calls). */
void run_stats_add(ape_stats *tot, const ape_stats *st);

/* --stats: the report on stderr, one "ape-run: " line per subject, each after `label` (""
 * for the forward, "backward: " for the backward call). */
void run_stats_print(const ape_stats *st, const char *label);

#endif
