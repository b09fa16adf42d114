/* SPDX-License-Identifier: MIT */
/*
 * The KV pool under failure (ape_kv_pool_*, include/ape/ape.h "KV pool"), on the reference and
 * on an OpenCL CPU device: the session of tests/faults/kvpool_case.h (create; sequences added;
 * an append in several staging rounds; a fork; a batch append to three sequences with a copy
 * on write; a ragged attend of the three; a one-sequence decode; a removal; destroy), in
 * float32 and float16. Each host allocation of a clean run fails in turn (a fault build: the
 * counting allocators of runtime/core/alloc.h), then each call of every device op, then the
 * device is lost from each point on (sweep.h). Every broken run returns the injected code with
 * a message naming the call that failed (and, for a device op, "fails on purpose"); a failed
 * create leaves *out NULL; a call whose host allocation failed changes nothing in the pool
 * (ape_kv_pool_get_info(), ape_kv_pool_sequence_info()) and succeeds when made again, the
 * session then ending with the clean result; after a device failure the pool still answers
 * ape_kv_pool_get_info(), removes a sequence and is destroyed; the attends' outputs are the
 * clean ones wherever an attend succeeded; the next run is clean; ASan/LSan (make faults-ci)
 * see no error and no leak.
 */
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "faults/kvpool_case.h"
#include "faults/sweep.h"

static int prepare_hook(void *p)
{
	struct pcase *c = p;
	bool host = c->host_faults;
	int ret;

	c->host_faults = false;
	ret = pcase_prepare(c, true);
	c->host_faults = host;
	if (!ret && (c->err_o < 0 || c->err_o > test_tol_o(c->dt) + test_skip_tol_o(2e-3) ||
		     c->err_lse > test_tol_lse(c->dt) + test_skip_tol_lse(2e-3))) {
		snprintf(c->msg, sizeof(c->msg), "the clean run is not the oracle's: O %g, LSE %g",
			 c->err_o, c->err_lse);
		return APE_EINVAL;
	}
	return ret;
}

static int run_hook(void *p)
{
	return pcase_run(p);
}

static const char *verify_hook(const void *p, int ret)
{
	const struct pcase *c = p;
	const char *bad = pcase_verify(c, ret);

	if (bad)
		ksft_print_msg("%s (the run's first failure: %s)\n", bad, c->ret ? c->msg : "none");
	return bad;
}

/* The failed run's message names the call that failed. */
static bool names_the_call_hook(const void *p, const char *word)
{
	const struct pcase *c = p;

	(void)word;
	return c->failed && strstr(c->msg, c->failed) != NULL;
}

static void pool_sweep(struct __test_metadata *_metadata, ape_device *dev, ape_dtype dt,
		       bool host, void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	struct pcase *c = calloc(1, sizeof(*c));
	char what[64];
	struct sweep s = {
		.dev = dev, .what = what, .c = c, .prepare = prepare_hook, .run = run_hook,
		.verify = verify_hook, .names_the_call = names_the_call_hook,
	};

	ASSERT_NE(NULL, c);
	snprintf(what, sizeof(what), "KV pool session, %s", ape_dtype_name(dt));
	c->dev = dev;
	c->dt = dt;
	ape_rng_init(&c->rng, what);
	c->host_faults = host;
	s.msg = c->msg;
	sweep(_metadata, &s);
	free(c);
}

struct sweep_arg {
	bool host;
	void (*sweep)(struct __test_metadata *, const struct sweep *);
};

static void both_types(struct __test_metadata *_metadata, ape_device *dev, void *arg)
{
	const struct sweep_arg *a = arg;

	pool_sweep(_metadata, dev, APE_F32, a->host, a->sweep);
	pool_sweep(_metadata, dev, APE_F16, a->host, a->sweep);
}

static void on_backends(struct __test_metadata *_metadata, bool host,
			void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	struct sweep_arg a = { host, sweep };

	sweep_backends(_metadata, both_types, &a);
}

TEST(allocation_failures)
{
#ifndef APE_FAULT_INJECT
	SKIP(return, "libape built without -DAPE_FAULT_INJECT: run `make faults-ci`");
#endif
	on_backends(_metadata, true, alloc_sweep);
}

TEST(device_failures)
{
	on_backends(_metadata, false, device_sweep);
}

TEST_HARNESS_MAIN
