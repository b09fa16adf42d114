/* SPDX-License-Identifier: MIT */
/*
 * Chunk-level skipping. The kernels already skip far key tiles inside a launch; this skips
 * whole key chunks before they are ever copied to the device, which is what turns a long
 * sequence with real decay from O(L^2) copies into O(L).
 */
#include "exec/skip.h"
#include "core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define APE_REAL double
#include "ape/ape_math.h"
#include "core/error.h"
#include "core/limits.h"
#include "exec/pack.h"

int ape__kmax_alloc(struct ape__kmax *km, int64_t nbg, int64_t nk)
{
	size_t n = (size_t)nbg * (size_t)nk;

	km->nbg = nbg;
	km->nk = nk;
	km->pre = ape__malloc(n * sizeof(float) + 1);
	km->suf = ape__malloc(n * sizeof(float) + 1);
	if (!km->pre || !km->suf) {
		ape__kmax_free(km);
		return ape__error(APE_ENOMEM, "out of memory for key norms (%zu chunks)", n);
	}
	return 0;
}

void ape__kmax_free(struct ape__kmax *km)
{
	free(km->pre);
	free(km->suf);
	km->pre = km->suf = NULL;
}

void ape__kmax_scan(struct ape__kmax *km)
{
	for (int64_t g = 0; g < km->nbg; g++) {
		float *pre = km->pre + g * km->nk, *suf = km->suf + g * km->nk;

		memcpy(suf, pre, (size_t)km->nk * sizeof(float));
		for (int64_t c = 1; c < km->nk; c++)
			pre[c] = fmaxf(pre[c], pre[c - 1]);
		for (int64_t c = km->nk - 2; c >= 0; c--)
			suf[c] = fmaxf(suf[c], suf[c + 1]);
	}
}

float ape__norm(const float *x, int64_t D)
{
	double ss = 0;
	float f;

	for (int64_t d = 0; d < D; d++)
		ss += (double)x[d] * x[d];
	if (!(ss < INFINITY)) /* NaN or Inf: can never be proved small */
		return INFINITY;
	/* rounded up, so the float norm still bounds the exact one */
	f = (float)sqrt(ss);
	return nextafterf(f, INFINITY);
}

int ape__kmax_from_tensor(struct ape__kmax *km, const ape_tensor *k, const int64_t ks[4],
			  int64_t ck)
{
	const int64_t B = k->shape[0], Hkv = k->shape[1], Lk = k->shape[2], D = k->shape[3];
	float row[APE_MAX_D];
	int ret;

	ret = ape__kmax_alloc(km, B * Hkv, (Lk + ck - 1) / ck);
	if (ret)
		return ret;
	for (int64_t b = 0; b < B; b++)
		for (int64_t g = 0; g < Hkv; g++) {
			float *pre = km->pre + (b * Hkv + g) * km->nk;

			for (int64_t c = 0; c < km->nk; c++)
				pre[c] = 0;
			for (int64_t j = 0; j < Lk; j++) {
				ape__load_row_f32(k, ks, b, g, j, row);
				pre[j / ck] = fmaxf(pre[j / ck], ape__norm(row, D));
			}
		}
	ape__kmax_scan(km);
	return 0;
}

/* Keys of the remaining chunks a row at position pq can see: how many, and the nearest
 * distance. False when it sees none. */
static bool remaining(const struct ape__skip_ctx *c, int64_t chunk, int dir, int64_t pq,
		      double *count, double *nmin)
{
	const int64_t j0 = dir < 0 ? 0 : chunk * c->ck;
	const int64_t j1 =
		dir < 0 ? ((chunk + 1) * c->ck < c->Lk ? (chunk + 1) * c->ck : c->Lk) : c->Lk;
	const int64_t diag = pq - c->k_start; /* the row's distance to key 0: validated to fit */
	/* the visible ones of keys j0..j1-1 are j0..j0+n-1 (causal: a prefix) */
	const int64_t n = ape_row_visible_pairs(diag, j0, j1, c->causal);

	if (n <= 0)
		return false;
	*count = (double)n;
	*nmin = (double)ape_keys_min_abs(diag, j0, j0 + n);
	return true;
}

/* The largest bias-table entry of head h at distance an or beyond (0 without a table); an is
 * a distance in double (up to 2^63): compared before any conversion. */
static double table_max(const struct ape__skip_ctx *c, int64_t h, double an)
{
	if (!c->bias_smax)
		return 0.0;
	return c->bias_smax[h * c->bias_hstride +
			    (an < (double)(c->bias_len - 1) ? (int64_t)an : c->bias_len - 1)];
}

bool ape__skip_tail(const struct ape__skip_ctx *c, const struct ape__skip_rows *r, int64_t chunk,
		    int dir)
{
	const int64_t group = c->H / c->Hkv;

	for (int64_t b = 0; b < c->B; b++)
		for (int64_t h = 0; h < c->H; h++) {
			const float *prm = c->head_params + 4 * h;
			const int64_t bg = b * c->Hkv + h / group;
			const double kmax = dir < 0 ? c->km->pre[bg * c->km->nk + chunk]
						    : c->km->suf[bg * c->km->nk + chunk];

			for (int64_t i = 0; i < r->n; i++) {
				const int64_t row = (b * c->H + h) * r->n + i;
				double count, nmin, lse;

				if (!remaining(c, chunk, dir, r->pos0 + i, &count, &nmin))
					continue;
				lse = r->m[row] == -INFINITY ? -INFINITY : r->m[row] + log(r->s[row]);
				/* the kernels' test, on the row's LSE so far (frame 0, l = 1; a
				 * bias table's largest entry from nmin on lowers the frame) */
				if (!ape_may_skip(prm[3], prm[0], prm[1], prm[2], c->abs_scale,
						  r->qnorm[row], kmax, nmin, count,
						  -table_max(c, h, nmin), lse, 1.0, -INFINITY,
						  c->tol))
					return false;
			}
		}
	return true;
}

void ape__walk_init(struct ape__walk *w, int64_t pos_first, int64_t pos_last, int64_t Lk,
		    int64_t ck, int64_t k_start, bool causal, bool keep_one)
{
	int64_t j;

	memset(w, 0, sizeof(*w));
	w->nk = (Lk + ck - 1) / ck;
	w->turn = -1;
	if (causal) {
		/* the last row sees up to key pos_last - k_start; later chunks are invisible */
		j = pos_last - k_start;
		if (j < 0 && !keep_one) {
			w->started = true; /* nothing visible at all */
			return;
		}
		j = j < 0 ? 0 : j;
		w->diag = (j < Lk ? j : Lk - 1) / ck;
		w->back = w->diag > 0;
	} else {
		j = pos_first + (pos_last - pos_first) / 2 - k_start;
		j = j < 0 ? 0 : j >= Lk ? Lk - 1 : j;
		w->diag = j / ck;
		w->back = w->diag > 0;
		w->fwd = w->diag < w->nk - 1;
	}
	w->lo = w->diag - 1;
	w->hi = w->diag + 1;
}

bool ape__walk_next(struct ape__walk *w, int64_t *chunk, int *dir)
{
	if (!w->started) {
		w->started = true;
		*chunk = w->diag;
		*dir = 0;
		return true;
	}
	if (!w->back && !w->fwd)
		return false;
	if (!w->fwd || (w->back && w->turn < 0)) {
		*chunk = w->lo--;
		*dir = -1;
		w->back = w->lo >= 0;
	} else {
		*chunk = w->hi++;
		*dir = 1;
		w->fwd = w->hi < w->nk;
	}
	w->turn = -w->turn;
	return true;
}

int64_t ape__walk_close(struct ape__walk *w, int dir, int64_t chunk)
{
	if (dir < 0) {
		w->back = false;
		return chunk + 1;
	}
	w->fwd = false;
	return w->nk - chunk;
}
