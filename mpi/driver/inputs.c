/* SPDX-License-Identifier: MIT */
/*
 * ape-mpi-run's inputs (mpi/driver/driver.h): generated from a counter-based hash of (seed,
 * tensor, b, h, global row, d), so every rank makes its own rows and the same sequence whatever
 * the rank count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

uint64_t driver_mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* N(0, 1) for element (b, h, l, d) of tensor t: the same on every rank for a global row l. */
float driver_gen(uint64_t seed, int t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	uint64_t x = driver_mix(seed ^ driver_mix((uint64_t)t << 56 ^ (uint64_t)b << 48 ^
						  (uint64_t)h << 36 ^ (uint64_t)d << 26 ^
						  driver_mix((uint64_t)l)));
	double u1 = ((x >> 11) + 0.5) / 9007199254740992.0;
	double u2 = (driver_mix(x) >> 11) / 9007199254740992.0;

	return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

int64_t driver_global_row(const ape_mpi_shard_info *sh, int64_t i)
{
	return i < sh->count[0] ? sh->start[0] + i : sh->start[1] + (i - sh->count[0]);
}

/* Element (b, h, l, d) of t as a double, through its strides and type. */
double driver_get(const ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d)
{
	int64_t s[4];
	size_t es = ape_dtype_size(t->dtype);
	const char *p;
	float f;

	ape_tensor_strides(t, s);
	p = (const char *)t->data + (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]) * es;
	ape_convert(&f, APE_F32, p, t->dtype, 1);
	return f;
}

void driver_set(ape_tensor *t, int64_t b, int64_t h, int64_t l, int64_t d, float x)
{
	int64_t s[4];
	size_t es = ape_dtype_size(t->dtype);

	ape_tensor_strides(t, s);
	ape_convert((char *)t->data + (size_t)(b * s[0] + h * s[1] + l * s[2] + d * s[3]) * es,
		    t->dtype, &x, APE_F32, 1);
}

/* [B, H, L, D], or stored as [B, L, H, D] when strided; NULL data for no memory. */
void *driver_alloc_tensor(ape_tensor *t, ape_dtype dt, int64_t B, int64_t H, int64_t L, int64_t D,
			  bool strided)
{
	void *p = calloc((size_t)(B * H * L * D) + 1, ape_dtype_size(dt));

	ape_tensor_init(t, p, dt, B, H, L, D);
	if (strided) {
		t->strides[0] = L * H * D;
		t->strides[1] = D;
		t->strides[2] = H * D;
		t->strides[3] = 1;
	}
	return p;
}

void driver_fill(const struct cfg *c, ape_tensor *t, int id, const ape_mpi_shard_info *sh)
{
	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t i = 0; i < t->shape[2]; i++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					driver_set(t, b, h, i, d,
						   driver_gen(c->seed, id, b, h,
							      sh ? driver_global_row(sh, i) : i,
							      d));
}

static void set_param(ape_param *p, float *store, double x, int64_t H, bool per_head)
{
	p->value = (float)x;
	p->per_head = NULL;
	if (!per_head)
		return;
	for (int64_t h = 0; h < H; h++)
		store[h] = (float)(x * (1 + 0.25 * h)); /* a different value per head */
	p->per_head = store;
}

int driver_setup(const struct cfg *c, struct run *r)
{
	ape_attn_desc *d = &r->desc;
	int ret;

	memset(r, 0, sizeof(*r));
	if ((ret = ape_mpi_shard(c->L, driver_nranks, driver_rank, c->kind, &r->sh)))
		return ret;
	r->q = driver_alloc_tensor(&r->tq, c->dt, c->B, c->H, r->sh.rows, c->D, c->strided);
	r->k = driver_alloc_tensor(&r->tk, c->dt, c->B, c->Hkv, r->sh.rows, c->D, c->strided);
	r->v = driver_alloc_tensor(&r->tv, c->dt, c->B, c->Hkv, r->sh.rows, c->D, c->strided);
	r->o = driver_alloc_tensor(&r->to, c->odt, c->B, c->H, r->sh.rows, c->D, c->strided);
	r->lse = calloc((size_t)(c->B * c->H * r->sh.rows) + 1, sizeof(float));
	r->params = calloc((size_t)(4 * c->H), sizeof(float));
	if (!r->q || !r->k || !r->v || !r->o || !r->lse || !r->params)
		return APE_ENOMEM;
	driver_fill(c, &r->tq, 0, &r->sh);
	driver_fill(c, &r->tk, 1, &r->sh);
	driver_fill(c, &r->tv, 2, &r->sh);
	ape_attn_desc_init(d);
	set_param(&d->delta, r->params, c->delta, c->H, c->per_head);
	set_param(&d->beta, r->params + c->H, c->beta, c->H, c->per_head);
	set_param(&d->gamma, r->params + 2 * c->H, c->gamma, c->H, c->per_head);
	set_param(&d->lambda, r->params + 3 * c->H, c->lambda, c->H, c->per_head);
	d->causal = c->causal;
	d->skip_tol = c->skip_tol;
	d->k_start = c->k_start;
	d->q_start_set = c->q_start_set;
	d->q_start = c->q_start;
	return 0;
}

void driver_teardown(struct run *r)
{
	free(r->q);
	free(r->k);
	free(r->v);
	free(r->o);
	free(r->lse);
	free(r->params);
}
