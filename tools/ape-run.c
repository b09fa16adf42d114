/* SPDX-License-Identifier: MIT */
/*
 * ape-run: APE attention on NumPy .npy files, the way users run libape on their own data.
 *
 * Exit status: 0 success; 2 bad arguments or input files (and parameters or shapes the library
 * refuses); 3 the backend or device asked for is not available (or, with --backward, has no
 * backward pass); 1 anything else. Outputs (O, LSE, the diagnostics, the gradients, the trace)
 * are written to temporary files and renamed into place only once all of them are complete, so
 * a failing run never leaves a partial or stale-looking output behind.
 *
 * This file holds main() and the one-call mode (dense or ragged); tools/run/ the options, the
 * devices, the input and output files, the ragged call's offsets and positions, the --kv-cache
 * and --backward modes and the statistics (tools/run/run.h).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ape/ape.h"
#include "common/mpi_exec.h"
#include "run/run.h"

/* The forward call: ragged (vl), with the diagnostics, or plain. */
static int forward(const struct run_args *a, ape_device *const *devs, int ndev,
		   const ape_varlen *vl, const struct input in[4], ape_tensor *ot, float *lse,
		   float *ent, float *md, ape_stats *st)
{
	ape_exec_options eo;

	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = a->chunk;
	eo.max_device_bytes = a->max_mem;
	eo.trace_path = a->trace;
	if (vl)
		return ape_attention_forward_varlen_ex(devs, ndev, &eo, &a->desc, vl, &in[0].t,
						       &in[1].t, &in[2].t, ot, lse, st);
	if (ent || md)
		return ape_attention_forward_diag(devs, ndev, &eo, &a->desc, &in[0].t, &in[1].t,
						  &in[2].t, ot, lse, ent, md, st);
	return ape_attention_forward_ex(devs, ndev, &eo, &a->desc, &in[0].t, &in[1].t, &in[2].t,
					ot, lse, st);
}

static int compute(const struct run_args *a, ape_device *const *devs, int ndev,
		   const ape_varlen *vl, const struct input in[4], struct run_grads *g, char *msg,
		   size_t len)
{
	const int64_t *s = in[0].t.shape;
	size_t rows = (size_t)(s[0] * s[1] * s[2]);
	ape_tensor ot;
	ape_stats st;
	float *o, *lse = NULL, *ent = NULL, *md = NULL;
	int ret;

	o = malloc(in[0].count ? in[0].count * sizeof(float) : 1);
	if (!o) {
		snprintf(msg, len, "out of memory for O (%" PRIu64 " floats)", in[0].count);
		return RUN_FAIL;
	}
	if (a->lse || a->dout) { /* the backward needs the forward's LSE */
		lse = malloc(rows ? rows * sizeof(float) : 1);
		if (!lse) {
			snprintf(msg, len, "out of memory for LSE (%zu floats)", rows);
			ret = RUN_FAIL;
			goto out_free;
		}
	}
	if ((a->ent && !(ent = malloc(rows ? rows * sizeof(float) : 1))) ||
	    (a->md && !(md = malloc(rows ? rows * sizeof(float) : 1)))) {
		snprintf(msg, len, "out of memory for the diagnostics (%zu floats)", rows);
		ret = RUN_FAIL;
		goto out_free;
	}
	/* O in float32 whatever the storage, which the library allows for every type, so that one
	 * path serves all: run_write_outputs() rounds it to f16 for an '<f2' file, just as a
	 * backend asked for an f16 O rounds its float32 result */
	run_tensor_init(&ot, o, APE_F32, &in[0]);
	ape_stats_init(&st);
	if (a->kv_step) {
		ret = run_kv(a, devs[0], in, &ot, lse, ent, md, &st, msg, len);
		if (ret)
			goto out_free;
	} else {
		ret = forward(a, devs, ndev, vl, in, &ot, lse, ent, md, &st);
		if (ret) {
			snprintf(msg, len, "%s", ape_last_error());
			ret = run_call_exit_code(a, ret);
			goto out_free;
		}
	}
	if (a->stats)
		run_stats_print(&st, "");
	ret = a->dout ? run_backward(a, devs, ndev, vl, in, &ot, lse, g, msg, len) : 0;
	if (!ret)
		ret = run_write_outputs(a, in, o, lse, ent, md, g, msg, len);
	if (ret && a->trace)
		unlink(a->trace); /* no output without the others */
out_free:
	free(ent);
	free(md);
	free(lse);
	free(o);
	return ret;
}

/* ------------------------------------------------------------------ main */

static int run(struct run_args *a, char *msg, size_t len)
{
	ape_device *devs[APE_MAX_DEVICES];
	struct input in[4]; /* Q, K, V, dO */
	struct run_ragged rg;
	struct run_grads g;
	ape_context *ctx = NULL;
	int ret, ndev = 0;

	memset(in, 0, sizeof(in));
	memset(&g, 0, sizeof(g));
	memset(&rg, 0, sizeof(rg));
	ret = run_check_outputs(a, msg, len);
	if (ret)
		return ret;
	ret = run_open_devices(a, &ctx, devs, &ndev, msg, len);
	if (ret)
		return ret;
	ret = run_load_inputs(a, in, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_check_inputs(in, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_load_ragged(a, in, &rg, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_set_head_params(a, &in[0], msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_load_bias_table(a, &in[0], msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_load_dlse(a, &in[0], &g, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = run_stage_inputs(in, a->dtype < 0 ? in[0].file_dtype : (ape_dtype)a->dtype, msg, len);
	if (ret)
		goto out_free_inputs;
	ret = compute(a, devs, ndev, a->cu_q ? &rg.vl : NULL, in, &g, msg, len);
out_free_inputs:
	for (int i = 0; i < 4; i++)
		free(in[i].data);
	run_grads_free(&g);
	run_ragged_free(&rg);
	ape_context_destroy(ctx);
	return ret;
}

int main(int argc, char **argv)
{
	struct run_args a;
	char msg[2048] = "";
	int ret;

	/* --mpi: the sequence sharded over MPI ranks, by ape-mpi-run (docs/distributed.md) */
	if ((ret = tools_mpi_exec("ape-run", argc, argv, "--files")) >= 0)
		return ret;
	run_args_init(&a);
	ret = run_parse_args(argc, argv, &a, msg, sizeof(msg));
	if (ret == RUN_HELP) {
		run_usage();
		ret = fflush(stdout) ? RUN_FAIL : RUN_OK;
		goto out;
	}
	if (!ret)
		ret = run(&a, msg, sizeof(msg));
	if (ret)
		fprintf(stderr, "ape-run: %s\n", msg);
out:
	run_args_free(&a);
	return ret;
}
