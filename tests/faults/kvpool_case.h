/* SPDX-License-Identifier: MIT */
/*
 * A KV-pool session the fault and thread tests share (test_kvpoolfail.c, test_threads.c;
 * include after the Kselftest harness), made through tests/kvpool_model.h: create a pool
 * (pages of 4 tokens, max_batch_tokens 8: appends of more than 4 tokens take several staging
 * rounds), add two sequences, append 10 tokens to the first, fork it, append a batch to all
 * three (the first's shared last page copied on write), attend a ragged batch of the three
 * (2, 1 and 3 rows), append one token to the third and attend it alone (a one-sequence decode:
 * the dense path, its pages read in place where they follow each other and the device can;
 * with its diagnostics), append 6 tokens to the first and release its two oldest pages (a steep
 * decay), remove the fork, destroy.
 *
 * Each call of the pool is judged as it returns: a failed create must leave *out NULL; in a
 * run under host-allocation failures (pcase.host_faults) a failed call must return APE_ENOMEM
 * and leave ape_kv_pool_get_info() and every sequence's ape_kv_pool_sequence_info() as they
 * were, and is made again (the one armed allocation has failed): it must then succeed, and the
 * session go on to the clean result. Elsewhere (device failures) the first failure ends the
 * session: the broken pool still answers ape_kv_pool_get_info() and removes a sequence, and is
 * destroyed (LeakSanitizer sees what it leaves). Attend outputs are kept only from calls that
 * succeeded, so a failed run leaves the rest poisoned.
 */
#ifndef APE_TEST_FAULTS_KVPOOL_CASE_H
#define APE_TEST_FAULTS_KVPOOL_CASE_H

#include <stdio.h>
#include <string.h>

#include "kvpool_model.h"

enum { PC_H = 2, PC_HKV = 1, PC_D = 32, PC_Q1 = 6, PC_Q2 = 1 };

struct pcase {
	ape_device *dev;
	ape_rng rng; /* the session's random data: every run starts from this state */
	ape_dtype dt;
	bool host_faults; /* a run of the allocation sweep: see the file's comment */
	/* the two attends' outputs ([rows, H, D] float32, LSE [rows, H]) and the clean run's */
	float o1[PC_Q1 * PC_H * PC_D], lse1[PC_Q1 * PC_H], o2[PC_Q2 * PC_H * PC_D], lse2[PC_Q2 * PC_H];
	float clean[PC_Q1 * PC_H * (PC_D + 1) + PC_Q2 * PC_H * (PC_D + 1)];
	/* the last run: its first failure (code, call, message), and what it broke */
	int ret;
	const char *failed;
	char msg[1024], bad[256];
	double err_o, err_lse; /* the clean run against the oracle (pcase_prepare()) */
};

/* What a sequence holds and what the pool says of it. */
struct pstate {
	ape_kv_pool_info info;
	int64_t n[8], k_start[8];
	int rc[8];
};

static void pstate_take(const struct model *m, struct pstate *s)
{
	memset(s, 0, sizeof(*s));
	if (!m->pool)
		return;
	ape_kv_pool_get_info(m->pool, &s->info);
	for (int64_t i = 0; i < m->ns && i < 8; i++)
		s->rc[i] = ape_kv_pool_sequence_info(m->pool, m->s[i].id, &s->n[i], &s->k_start[i]);
}

static bool pstate_same(const struct pstate *a, const struct pstate *b)
{
	return !memcmp(a, b, sizeof(*a));
}

static void pcase_bad(struct pcase *c, const char *fn, const char *what)
{
	if (!c->bad[0])
		snprintf(c->bad, sizeof(c->bad), "%s: %s", fn, what);
}

/* A call of the pool returned ret: 0 go on, 1 make it again, -1 end the session. */
static int pcase_judge(struct pcase *c, const struct model *m, const char *fn, int ret,
		       const struct pstate *before)
{
	struct pstate after;

	if (!ret)
		return 0;
	if (c->ret) { /* one allocation fails per run: the call made again must not */
		pcase_bad(c, fn, "failed again when made again");
		return -1;
	}
	c->ret = ret;
	c->failed = fn;
	snprintf(c->msg, sizeof(c->msg), "%s", ape_last_error());
	if (!c->host_faults)
		return -1;
	if (ret != APE_ENOMEM)
		pcase_bad(c, fn, "a failed host allocation did not return APE_ENOMEM");
	pstate_take(m, &after);
	if (!pstate_same(before, &after))
		pcase_bad(c, fn, "a failed host allocation changed the pool (get_info, sequence_info)");
	return 1;
}

/* Makes `call` (an int expression) until pcase_judge() says go on; ends the session at `out`
 * when it says so. The random data of a call made again are the first try's. */
#define PCASE_CALL(c, m, rng, fn, call)                                                            \
	do {                                                                                       \
		const ape_rng keep_ = *(rng);                                                      \
		struct pstate before_;                                                             \
		int r_;                                                                            \
                                                                                                   \
		do {                                                                               \
			*(rng) = keep_;                                                            \
			pstate_take((m), &before_);                                                \
			r_ = pcase_judge((c), (m), (fn), (call), &before_);                        \
		} while (r_ > 0);                                                                  \
		if (r_ < 0)                                                                        \
			goto out;                                                                  \
	} while (0)

static int pcase_create(struct pcase *c, struct model *m)
{
	ape_kv_pool_options o;
	int ret;

	ape_kv_pool_options_init(&o);
	o.Hkv = PC_HKV;
	o.H = PC_H;
	o.D = PC_D;
	o.dtype = c->dt;
	o.page_tokens = 4;
	o.capacity_tokens = 48;
	o.max_batch_tokens = 8;
	o.max_query_norm = 20; /* the release below: rows of 32 N(0,1) values have norm ~6 */
	(void)model_init; /* its create starts from NULL: here *out starts set, to see it cleared */
	m->pool = (ape_kv_pool *)(uintptr_t)1;
	ret = ape_kv_pool_create(c->dev, &o, &m->pool);
	if (ret && m->pool)
		pcase_bad(c, "ape_kv_pool_create", "a failed create left *out set");
	if (ret)
		m->pool = NULL;
	return ret;
}

/* Attends the batch (idx, lq), its outputs kept in o and lse when it succeeds. */
static int pcase_attend(const struct model *m, struct mbatch *b, float *o, float *lse)
{
	int ret = mbatch_attend(m, b, NULL);

	if (!ret) {
		memcpy(o, b->o.t.data, sizeof(float) * (size_t)(b->tq * PC_H * PC_D));
		memcpy(lse, b->lse, sizeof(float) * (size_t)(b->tq * PC_H));
	}
	return ret;
}

/* Releases what sequence i's decay proves out of reach: the call's code; a clean call must
 * release two pages (8 tokens). */
static int pcase_release(struct pcase *c, const struct model *m, int64_t i,
			 const ape_attn_desc *desc)
{
	int64_t n = -1;
	int ret = ape_kv_pool_release_unreachable(m->pool, m->s[i].id, desc, &n);

	if (!ret && n != 8)
		pcase_bad(c, "ape_kv_pool_release_unreachable", "did not release the two pages");
	return ret;
}

/* One session (see the file's comment); c->ret: its first failure's code (0: none). With
 * `oracle`, both attends are checked against tests/common/naive.c into c->err_o, c->err_lse
 * (-1 when the oracle ran out of memory). */
static int pcase_run_checked(struct pcase *c, bool oracle)
{
	static const int64_t q1[3] = { 2, 1, 3 }, q2 = PC_Q2;
	struct model m;
	struct mbatch b1, b2;
	ape_rng rng;
	int64_t a = -1, f = -1, s = -1, idx[3], cnt[3] = { 1, 2, 5 };
	int ret = 0;

	c->ret = 0;
	c->failed = NULL;
	c->msg[0] = c->bad[0] = 0;
	memset(c->o1, 0xff, sizeof(c->o1)); /* NaN: kept only from an attend that succeeded */
	memset(c->lse1, 0xff, sizeof(c->lse1));
	memset(c->o2, 0xff, sizeof(c->o2));
	memset(c->lse2, 0xff, sizeof(c->lse2));
	memset(&b1, 0, sizeof(b1));
	memset(&b2, 0, sizeof(b2));
	memset(&m, 0, sizeof(m));
	m.Hkv = PC_HKV;
	m.H = PC_H;
	m.D = PC_D;
	m.dt = c->dt;
	m.esz = ape_dtype_size(c->dt);
	if (!(m.s = calloc(16, sizeof(*m.s))))
		return c->ret = APE_ENOMEM;
	rng = c->rng;
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_create", pcase_create(c, &m));
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_add_sequence", (a = model_add(&m, 3, &ret)) < 0 ? ret : 0);
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_add_sequence", (s = model_add(&m, -5, &ret)) < 0 ? ret : 0);
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_append", model_append(&m, &rng, a, 10));
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_fork", (f = model_fork(&m, a, &ret)) < 0 ? ret : 0);
	idx[0] = a;
	idx[1] = f;
	idx[2] = s;
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_append_batch", model_append_batch(&m, &rng, 3, idx, cnt));
	if (mbatch_make(&b1, &m, &rng, 3, idx, q1, POS_DEFAULT)) {
		pcase_bad(c, "mbatch_make", "out of memory");
		goto out;
	}
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_attend", pcase_attend(&m, &b1, c->o1, c->lse1));
	c->err_o = c->err_lse = -1;
	if (oracle && mbatch_check(&m, &b1, &c->err_o, &c->err_lse)) /* before the keys change */
		c->err_o = -1;
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_append", model_append(&m, &rng, s, 1));
	if (mbatch_make(&b2, &m, &rng, 1, &s, &q2, POS_DEFAULT)) {
		pcase_bad(c, "mbatch_make", "out of memory");
		goto out;
	}
	if (mbatch_want_diag(&m, &b2)) { /* the decode with its diagnostics */
		pcase_bad(c, "mbatch_want_diag", "out of memory");
		goto out;
	}
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_attend_diag", pcase_attend(&m, &b2, c->o2, c->lse2));
	if (oracle && c->err_o >= 0) {
		double eo, el;

		if (mbatch_check(&m, &b2, &eo, &el))
			eo = -1;
		c->err_o = eo < 0 ? -1 : fmax(c->err_o, eo);
		c->err_lse = fmax(c->err_lse, el);
	}
	/* the first sequence's two oldest pages released under a steep decay (b2's desc, its
	 * outputs kept already) */
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_append", model_append(&m, &rng, a, 6));
	for (int h = 0; h < PC_H; h++) {
		b2.prm[0][h] = 60;
		b2.prm[1][h] = b2.prm[2][h] = b2.prm[3][h] = 0;
	}
	b2.desc.skip_tol = 1e-3;
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_release_unreachable",
		   pcase_release(c, &m, a, &b2.desc));
	PCASE_CALL(c, &m, &rng, "ape_kv_pool_remove_sequence", model_remove(&m, f));
out:
	if (c->ret && !c->host_faults && m.pool) {
		/* a broken pool still describes itself, removes a sequence, and is destroyed */
		ape_kv_pool_info in;

		if (ape_kv_pool_get_info(m.pool, &in))
			pcase_bad(c, "ape_kv_pool_get_info", "refused on a broken pool");
		if (a >= 0 && m.s[a].live && model_remove(&m, a))
			pcase_bad(c, "ape_kv_pool_remove_sequence", "refused on a broken pool");
	}
	mbatch_free(&b1);
	mbatch_free(&b2);
	model_free(&m);
	return c->ret;
}

static int pcase_run(struct pcase *c)
{
	return pcase_run_checked(c, false);
}

/* A clean run, its outputs kept as the clean result. 0, or its error. */
static int pcase_prepare(struct pcase *c, bool oracle)
{
	int ret = pcase_run_checked(c, oracle);

	if (ret || c->bad[0])
		return ret ? ret : APE_EINVAL;
	memcpy(c->clean, c->o1, sizeof(c->o1));
	memcpy(c->clean + PC_Q1 * PC_H * PC_D, c->lse1, sizeof(c->lse1));
	memcpy(c->clean + PC_Q1 * PC_H * (PC_D + 1), c->o2, sizeof(c->o2));
	memcpy(c->clean + PC_Q1 * PC_H * (PC_D + 1) + PC_Q2 * PC_H * PC_D, c->lse2,
	       sizeof(c->lse2));
	return 0;
}

/* NULL when the last run kept every promise: the clean outputs after a run that succeeded
 * (or, under host faults, made its failed call again), else outputs from attends that
 * succeeded only (the clean ones) and the rest poisoned. */
static const char *pcase_verify(const struct pcase *c, int ret)
{
	const float *w = c->clean;
	const size_t n1 = sizeof(c->o1), l1 = sizeof(c->lse1), n2 = sizeof(c->o2),
		     l2 = sizeof(c->lse2);
	const unsigned char *p[4] = { (const void *)c->o1, (const void *)c->lse1,
				      (const void *)c->o2, (const void *)c->lse2 };
	const size_t len[4] = { n1, l1, n2, l2 };
	const float *want[4] = { w, w + PC_Q1 * PC_H * PC_D, w + PC_Q1 * PC_H * (PC_D + 1),
				 w + PC_Q1 * PC_H * (PC_D + 1) + PC_Q2 * PC_H * PC_D };

	if (c->bad[0])
		return c->bad;
	if (ret != c->ret)
		return "the run's code is not its first failure's";
	for (int i = 0; i < 4; i++) {
		bool poisoned = true;

		for (size_t j = 0; j < len[i]; j++)
			poisoned &= p[i][j] == 0xff;
		if (memcmp(p[i], want[i], len[i]) && (!ret || c->host_faults || !poisoned))
			return i < 2 ? "the ragged attend's O or LSE is not the clean result"
				     : "the decode's O or LSE is not the clean result";
	}
	return NULL;
}

#endif
