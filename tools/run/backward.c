/* SPDX-License-Identifier: MIT */
/*
 * ape-run --backward: dL/dLSE from its file, and the backward call after the forward
 * (ape_attention_backward_ex(), or ape_attention_backward_varlen() for a ragged call; the
 * forward's devices, chunk size and device budget).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/npy.h"
#include "run/run.h"

int run_load_dlse(const struct run_args *a, const struct input *q, struct run_grads *g,
		  char *msg, size_t len)
{
	struct npy_array arr;
	char got[256], want[256];
	int ret;
	bool same;

	if (!a->dlse)
		return 0;
	ret = npy_load(a->dlse, &arr, msg, len);
	if (ret)
		return ret == APE_ENOMEM ? RUN_FAIL : RUN_USAGE;
	if (arr.info.dtype != APE_F32) {
		snprintf(msg, len, "--dlse %s: dtype %s: dL/dLSE must be '<f4' (float32), as LSE is",
			 a->dlse, arr.info.dtype == APE_F16 ? "'<f2' (float16)" : "not '<f4'");
		npy_free(&arr);
		return RUN_USAGE;
	}
	/* LSE's shape: Q's without D */
	same = arr.info.ndim == q->ndim - 1;
	for (int i = 0; same && i < q->ndim - 1; i++)
		same = arr.info.shape[i] == q->shape[i];
	if (!same) {
		npy_format_shape(arr.info.shape, arr.info.ndim, got, sizeof(got));
		npy_format_shape(q->shape, q->ndim - 1, want, sizeof(want));
		snprintf(msg, len, "--dlse %s: shape %s differs from LSE's %s for %s", a->dlse, got,
			 want, q->path);
		npy_free(&arr);
		return RUN_USAGE;
	}
	g->dlse = arr.data;
	return 0;
}

static float *grad_buffer(const char *flag, const char *path, uint64_t count, char *msg,
			  size_t len)
{
	float *p = malloc(count ? count * sizeof(float) : 1);

	if (!p)
		snprintf(msg, len, "%s %s: out of memory (%" PRIu64 " floats)", flag, path, count);
	return p;
}

int run_backward(const struct run_args *a, ape_device *const *devs, int ndev,
		 const ape_varlen *vl, const struct input in[4], const ape_tensor *ot,
		 const float *lse, struct run_grads *g, char *msg, size_t len)
{
	const int64_t *qs = in[0].t.shape;
	const uint64_t ntable = (uint64_t)(a->table.rows * a->table.len);
	ape_tensor dq, dk, dv, *pq, *pk, *pv;
	ape_attn_desc desc = a->desc;
	ape_exec_options eo;
	ape_stats st;
	int ret;

	if ((a->dq && !(g->dq = grad_buffer("--dq", a->dq, in[0].count, msg, len))) ||
	    (a->dk && !(g->dk = grad_buffer("--dk", a->dk, in[1].count, msg, len))) ||
	    (a->dv && !(g->dv = grad_buffer("--dv", a->dv, in[2].count, msg, len))) ||
	    (a->dparams &&
	     !(g->dparams = grad_buffer("--dparams", a->dparams, (uint64_t)qs[1] * 4, msg, len))) ||
	    (a->dbias_table &&
	     !(g->dbias = grad_buffer("--dbias-table", a->dbias_table, ntable, msg, len))))
		return RUN_FAIL;
	desc.dbias_table = g->dbias;
	/* float32 gradients whatever the storage, as O: the files get the inputs' types */
	run_tensor_init(&dq, g->dq, APE_F32, &in[0]);
	run_tensor_init(&dk, g->dk, APE_F32, &in[1]);
	run_tensor_init(&dv, g->dv, APE_F32, &in[2]);
	pq = g->dq ? &dq : NULL;
	pk = g->dk ? &dk : NULL;
	pv = g->dv ? &dv : NULL;
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = a->chunk;
	eo.max_device_bytes = a->max_mem;
	ape_stats_init(&st);
	if (vl)
		ret = ape_attention_backward_varlen(devs, ndev, &eo, &desc, vl, &in[0].t, &in[1].t,
						    &in[2].t, ot, lse, &in[3].t, g->dlse, pq, pk,
						    pv, g->dparams, &st);
	else
		ret = ape_attention_backward_ex(devs, ndev, &eo, &desc, &in[0].t, &in[1].t,
						&in[2].t, ot, lse, &in[3].t, g->dlse, pq, pk, pv,
						g->dparams, &st);
	if (ret) {
		snprintf(msg, len, "--backward: %s", ape_last_error());
		/* a device whose backend has no backward pass is a device not available for it */
		return ret == APE_ENOTSUP ? RUN_NODEV : run_exit_code(ret);
	}
	if (a->stats)
		run_stats_print(&st, "backward: ");
	return 0;
}

void run_grads_free(struct run_grads *g)
{
	free(g->dq);
	free(g->dk);
	free(g->dv);
	free(g->dparams);
	free(g->dbias);
	free(g->dlse);
	memset(g, 0, sizeof(*g));
}
