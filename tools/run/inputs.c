/* SPDX-License-Identifier: MIT */
/* ape-run's input files: Q, K, V and dO read, checked against each other, converted to the
 * computation's type; the per-head parameters checked against Q's heads (tools/run/run.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/npy.h"
#include "run/run.h"

/* Reads one file; `dims` names its last three dimensions for messages ("H, Lq, D"). A packed
 * file (in->packed, the ragged call's) is 3-D, `dims` naming all three ("total_q, H, D"). */
static int load_input(struct input *in, const char *what, const char *dims, char *msg,
		      size_t len)
{
	struct npy_array arr;
	char shp[256];
	int ret;

	ret = npy_load(in->path, &arr, msg, len);
	if (ret)
		return ret == APE_ENOMEM ? RUN_FAIL : RUN_USAGE;
	in->file_dtype = arr.info.dtype;
	in->ndim = arr.info.ndim;
	in->count = arr.info.count;
	in->data = arr.data;
	if (in->packed && in->ndim != 3) {
		npy_format_shape(arr.info.shape, arr.info.ndim, shp, sizeof(shp));
		snprintf(msg, len, "%s: shape %s: with --cu-seqlens-q/-k %s must be 3-D, packed "
			 "[%s]", in->path, shp, what, dims);
		return RUN_USAGE;
	}
	if (in->ndim != 3 && in->ndim != 4) {
		npy_format_shape(arr.info.shape, arr.info.ndim, shp, sizeof(shp));
		snprintf(msg, len, "%s: shape %s: %s must be 4-D [B, %s] or 3-D [%s]", in->path,
			 shp, what, dims, dims);
		return RUN_USAGE;
	}
	memcpy(in->shape, arr.info.shape, sizeof(in->shape));
	run_tensor_init(&in->t, NULL, arr.info.dtype, in);
	return 0;
}

void run_tensor_init(ape_tensor *t, void *data, ape_dtype dt, const struct input *like)
{
	const int64_t *s = like->shape;

	if (like->packed)
		ape_tensor_init_packed(t, data, dt, s[0], s[1], s[2]);
	else if (like->ndim == 3) /* a 3-D file is one batch */
		ape_tensor_init(t, data, dt, 1, s[0], s[1], s[2]);
	else
		ape_tensor_init(t, data, dt, s[0], s[1], s[2], s[3]);
}

/* Q, K, V and, with --backward, dO as in[3]. */
int run_load_inputs(const struct run_args *a, struct input in[4], char *msg, size_t len)
{
	static const char *const what[4] = { "Q", "K", "V", "dO" };
	static const char *const dims[4] = { "H, Lq, D", "Hkv, Lk, D", "Hkv, Lk, D", "H, Lq, D" };
	static const char *const packed[4] = { "total_q, H, D", "total_k, Hkv, D",
					       "total_k, Hkv, D", "total_q, H, D" };
	int ret;

	in[0].path = a->q;
	in[1].path = a->k;
	in[2].path = a->v;
	in[3].path = a->dout;
	for (int i = 0; i < (a->dout ? 4 : 3); i++) {
		in[i].packed = a->cu_q != NULL;
		ret = load_input(&in[i], what[i], in[i].packed ? packed[i] : dims[i], msg, len);
		if (ret)
			return ret;
	}
	return 0;
}

static const char *npy_descr(ape_dtype dt)
{
	return dt == APE_F16 ? "'<f2' (float16)" : "'<f4' (float32)";
}

static int mismatch(char *msg, size_t len, const struct input *x, const struct input *y,
		    const char *what, int dim)
{
	snprintf(msg, len, "%s: %s = %" PRId64 " differs from %s's %s = %" PRId64, x->path, what,
		 x->t.shape[dim], y->path, what, y->t.shape[dim]);
	return RUN_USAGE;
}

/* The checks whose failure is best explained in terms of the files; the library checks the rest
 * (sizes, D in 2..256, every parameter) and says so in its own words. */
int run_check_inputs(const struct input in[4], char *msg, size_t len)
{
	const struct input *q = &in[0], *k = &in[1], *v = &in[2], *dout = &in[3];
	const int64_t H = q->t.shape[1], Hkv = k->t.shape[1];
	char got[256], want[256];

	for (int i = 1; i < 3; i++)
		if (in[i].file_dtype != q->file_dtype) {
			snprintf(msg, len,
				 "%s: dtype %s differs from %s's %s: Q, K and V must have the same "
				 "dtype", in[i].path, npy_descr(in[i].file_dtype), q->path,
				 npy_descr(q->file_dtype));
			return RUN_USAGE;
		}
	if (k->t.shape[0] != q->t.shape[0])
		return mismatch(msg, len, k, q, "batch size B", 0);
	if (k->t.shape[3] != q->t.shape[3])
		return mismatch(msg, len, k, q, "head dimension D", 3);
	for (int i = 0; i < 4; i++)
		if (v->t.shape[i] != k->t.shape[i])
			return mismatch(msg, len, v, k, i == 0 ? "B" : i == 1 ? "Hkv" :
					i == 2 ? (v->packed ? "total_k" : "Lk") : "D", i);
	if (q->t.shape[3] % 2) {
		snprintf(msg, len, "%s: head dimension D = %" PRId64 " is odd: rotary pairs need "
			 "an even D", q->path, q->t.shape[3]);
		return RUN_USAGE;
	}
	if (Hkv > 0 && H % Hkv) {
		snprintf(msg, len,
			 "%s has H = %" PRId64 " heads and %s has Hkv = %" PRId64 ": H must be a "
			 "multiple of Hkv", q->path, H, k->path, Hkv);
		return RUN_USAGE;
	}
	if (dout->path && (dout->ndim != q->ndim ||
			   memcmp(dout->shape, q->shape, sizeof(int64_t) * (size_t)q->ndim))) {
		npy_format_shape(dout->shape, dout->ndim, got, sizeof(got));
		npy_format_shape(q->shape, q->ndim, want, sizeof(want));
		snprintf(msg, len, "--backward %s: shape %s differs from %s's %s: dL/dO has Q's "
			 "shape", dout->path, got, q->path, want);
		return RUN_USAGE;
	}
	return 0;
}

/* Converts every input (dO too, when given) to the computation's storage type. */
int run_stage_inputs(struct input in[4], ape_dtype storage, char *msg, size_t len)
{
	for (int i = 0; i < (in[3].path ? 4 : 3); i++) {
		void *conv;

		if (in[i].file_dtype != storage) {
			conv = malloc(in[i].count ? in[i].count * ape_dtype_size(storage) : 1);
			if (!conv) {
				snprintf(msg, len, "%s: out of memory converting to %s", in[i].path,
					 ape_dtype_name(storage));
				return RUN_FAIL;
			}
			ape_convert(conv, storage, in[i].data, in[i].file_dtype, in[i].count);
			free(in[i].data);
			in[i].data = conv;
		}
		run_tensor_init(&in[i].t, in[i].data, storage, &in[i]);
	}
	return 0;
}

int run_load_bias_table(struct run_args *a, const struct input *q, char *msg, size_t len)
{
	int ret;

	if (!a->bias_table)
		return 0;
	ret = bias_table_load("--bias-table", a->bias_table, q->t.shape[1], &a->table, msg, len);
	if (ret)
		return ret == APE_ENOMEM ? RUN_FAIL : RUN_USAGE;
	bias_table_set(&a->table, &a->desc);
	return 0;
}

int run_set_head_params(struct run_args *a, const struct input *q, char *msg, size_t len)
{
	ape_param *dst[4] = { &a->desc.delta, &a->desc.beta, &a->desc.gamma, &a->desc.lambda };
	const int64_t H = q->t.shape[1];

	for (int i = 0; i < 4; i++) {
		const struct head_param *p = &a->param[i];

		dst[i]->per_head = NULL;
		dst[i]->value = p->vals ? p->vals[0] : p->def;
		if (!p->vals || p->n == 1)
			continue;
		if ((int64_t)p->n != H) {
			snprintf(msg, len,
				 "%s: %zu values given, but %s has H = %" PRId64 " heads: give "
				 "one value or exactly %" PRId64, p->flag, p->n, q->path, H, H);
			return RUN_USAGE;
		}
		dst[i]->per_head = p->vals;
	}
	return 0;
}
