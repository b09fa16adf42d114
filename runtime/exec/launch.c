/* SPDX-License-Identifier: MIT */
/* Attention launches: the builder and the scratch each one needs (exec/launch.h). */
#include "exec/launch.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/context.h"
#include "core/error.h"

void ape__launch_init(struct ape_be_launch *l, const struct ape__problem *p, ape_dtype out_dtype,
		      double skip_tol)
{
	memset(l, 0, sizeof(*l));
	l->B = p->B;
	l->H = p->H;
	l->Hkv = p->Hkv;
	l->D = p->D;
	l->in_dtype = p->in_dtype;
	l->out_dtype = out_dtype;
	l->head_params = p->head_params;
	l->decay_nonneg = p->decay_nonneg;
	l->scale = p->scale;
	l->rope_base = p->rope_base;
	/* position interpolation: theta_p = (n / rope_scale) omega_p / alpha, here once for every
	 * backend and path (a shell problem has rope_base 0 and no omega) */
	for (int64_t i = 0; p->rope_base > 0 && i < p->D / 2; i++)
		l->omega[i] = pow(p->rope_base, -2.0 * (double)i / (double)p->D) / p->rope_scale;
	l->causal = p->causal;
	l->layout = p->layout;
	l->skip_tol = p->decay_nonneg ? skip_tol : 0.0;
	l->bias_table = p->bias_table;
	l->bias_smax = p->bias_smax;
	l->bias_len = p->bias_len;
	l->bias_hstride = p->bias_hstride;
}

int ape__launch_supported(const char *fn, const struct ape_device *dev,
			  const struct ape__problem *p)
{
	if (!p->bias_table || ape_be_dev_has(dev, APE_BE_CAP_BIAS_TABLE))
		return 0;
	return ape__error(APE_ENOTSUP,
			  "%s: %s:%d %s: desc->bias_table: this backend does not compute "
			  "distance-bias tables",
			  fn, dev->info.backend, dev->info.backend_index, dev->info.name);
}

uint64_t ape__scratch_of(struct ape_device *dev, const struct ape_be_launch *l)
{
	const uint64_t kv = (uint64_t)(l->B * l->Hkv);

	if (dev->be->ops->attention_scratch)
		return dev->be->ops->attention_scratch(dev, l);
	/* what a backend may need without saying: float32 copies of K and V, per-tile key
	 * norms with prefix and suffix maxima, per-head parameters in float64 */
	return 2 * kv * (uint64_t)(l->Lk * l->D) * 4 + 12 * kv * (uint64_t)(l->Lk + 2) +
	       8 * (uint64_t)(l->D / 2 + 4 * l->H) + 4096;
}

uint64_t ape__params_bytes(const struct ape__problem *p, int which)
{
	return (uint64_t)(p->D / 2 + 4 * p->H) * (which ? sizeof(float) : sizeof(double));
}

void ape__params_fill(const struct ape_be_launch *l, int which, void *host)
{
	const int64_t P = l->D / 2;

	for (int64_t i = 0; i < P + 4 * l->H; i++) {
		const double x = i < P ? l->omega[i] : (double)l->head_params[i - P];

		if (which)
			((float *)host)[i] = (float)x;
		else
			((double *)host)[i] = x;
	}
}

/* The first segment that holds row o0 (the segments partition the rows in order). */
static int64_t seg_first(const struct ape_be_seg *segs, int64_t nseg, int64_t o0)
{
	int64_t lo = 0, hi = nseg - 1;

	while (lo < hi) {
		const int64_t mid = lo + (hi - lo + 1) / 2;

		if (segs[mid].q0 <= o0)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

int64_t ape__segs_clip(const struct ape_be_seg *segs, int64_t nseg, int64_t o0, int64_t on,
		       int64_t i0, int64_t in, struct ape_be_seg *out)
{
	int64_t n = 0;

	for (int64_t s = seg_first(segs, nseg, o0); s < nseg && segs[s].q0 < o0 + on; s++) {
		const struct ape_be_seg *g = &segs[s];
		const int64_t a = g->q0 > o0 ? g->q0 : o0;
		const int64_t b = g->q0 + g->lq < o0 + on ? g->q0 + g->lq : o0 + on;
		const int64_t c = g->k0 > i0 ? g->k0 : i0;
		const int64_t d = g->k0 + g->lk < i0 + in ? g->k0 + g->lk : i0 + in;
		struct ape_be_seg *x = &out[n++];

		/* positions move with the rows: q_start + (a - q0) is row a's (validated) */
		x->q0 = a - o0;
		x->lq = b - a;
		x->q_start = g->q_start + (a - g->q0);
		if (c < d) {
			x->k0 = c - i0;
			x->lk = d - c;
			x->k_start = g->k_start + (c - g->k0);
		} else {
			x->k0 = x->lk = 0;
			x->k_start = g->k_start;
		}
	}
	return n;
}

void ape__segs_keys(const struct ape_be_seg *segs, int64_t nseg, int64_t o0, int64_t on,
		    int64_t *klo, int64_t *khi)
{
	*klo = INT64_MAX;
	*khi = INT64_MIN;
	for (int64_t s = seg_first(segs, nseg, o0); s < nseg && segs[s].q0 < o0 + on; s++) {
		if (!segs[s].lk)
			continue;
		*klo = segs[s].k0 < *klo ? segs[s].k0 : *klo;
		*khi = segs[s].k0 + segs[s].lk > *khi ? segs[s].k0 + segs[s].lk : *khi;
	}
}

int ape__segs_visible(const struct ape__problem *p, const struct ape_be_seg *sg,
			    int64_t n, uint64_t *out)
{
	uint64_t sum = 0;

	for (int64_t s = 0; s < n; s++) {
		struct ape__problem one = *p;
		uint64_t x;

		if (!sg[s].lk)
			continue;
		one.segs = NULL;
		one.Lq = sg[s].lq;
		one.Lk = sg[s].lk;
		one.q_start = sg[s].q_start;
		one.k_start = sg[s].k_start;
		if (ape__head_visible_pairs(&one, &x) || x > (UINT64_MAX - sum) / (uint64_t)p->H)
			return -1;
		sum += x * (uint64_t)p->H;
	}
	*out = sum;
	return 0;
}
