/* SPDX-License-Identifier: MIT */
/*
 * Paged attention over the caller's pages under failure (ape_paged_kv_*, include/ape/ape.h
 * "Paged attention over the caller's pages"), on the reference and on an OpenCL CPU device:
 * the session of tests/faults/kvpaged_case.h (create; a CSR plan of four sequences sharing a
 * page, one of no page; its runs over two layers, vLLM's layout and FlashInfer's halves of one
 * buffer; a block-table plan of decode rows at explicit positions; its run; destroy), in
 * float32 and float16. Each host allocation of a clean session fails in turn (a fault build:
 * the counting allocators of runtime/core/alloc.h), then each call of every device op, then
 * the device is lost from each point on (sweep.h). Every broken session returns the injected
 * code with a message naming the call that failed (and, for a device op, "fails on purpose");
 * a failed create leaves *out NULL; after a failed plan a run is refused ("no plan") and the
 * plan made again succeeds; after a failed run the plan stays and the run made again gives the
 * clean result, bit for bit; where the device is lost for good the session ends, the object
 * still plans (host memory only) and is destroyed; the runs' outputs are the clean ones
 * wherever a run succeeded; the next session is clean; ASan/LSan (make faults-ci) see no error
 * and no leak. The clean session is checked against tests/common/naive.c first.
 */
#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "faults/kvpaged_case.h"
#include "faults/sweep.h"

static int prepare_hook(void *p)
{
	struct kcase *c = p;
	bool host = c->host_faults;
	int ret;

	c->host_faults = false;
	ret = kcase_prepare(c, true);
	c->host_faults = host;
	if (!ret && (c->err_o < 0 || c->err_o > test_tol_o(c->dt) + test_skip_tol_o(2e-3) ||
		     c->err_lse > test_tol_lse(c->dt) + test_skip_tol_lse(2e-3))) {
		snprintf(c->msg, sizeof(c->msg), "the clean session is not the oracle's: O %g, LSE %g",
			 c->err_o, c->err_lse);
		return APE_EINVAL;
	}
	if (ret && !c->msg[0])
		snprintf(c->msg, sizeof(c->msg), "%s %s", c->bad, ape_last_error());
	return ret;
}

static int run_hook(void *p)
{
	return kcase_run(p);
}

static const char *verify_hook(const void *p, int ret)
{
	const struct kcase *c = p;
	const char *bad = kcase_verify(c, ret);

	if (bad)
		ksft_print_msg("%s (the session's first failure: %s)\n", bad,
			       c->ret ? c->msg : "none");
	return bad;
}

/* The failed session's message names the call that failed. */
static bool names_the_call_hook(const void *p, const char *word)
{
	const struct kcase *c = p;

	(void)word;
	return c->failed && strstr(c->msg, c->failed) != NULL;
}

static void paged_sweep(struct __test_metadata *_metadata, ape_device *dev, ape_dtype dt,
			bool host, void (*sweep)(struct __test_metadata *, const struct sweep *))
{
	struct kcase *c = calloc(1, sizeof(*c));
	char what[64];
	struct sweep s = {
		.dev = dev, .what = what, .c = c, .prepare = prepare_hook, .run = run_hook,
		.verify = verify_hook, .names_the_call = names_the_call_hook,
	};

	ASSERT_NE(NULL, c);
	snprintf(what, sizeof(what), "paged session, %s", ape_dtype_name(dt));
	c->dev = dev;
	c->dt = dt;
	ape_rng_init(&c->rng, what);
	c->host_faults = host;
	s.msg = c->msg;
	sweep(_metadata, &s);
	kcase_free(c);
	free(c);
}

struct sweep_arg {
	bool host;
	void (*sweep)(struct __test_metadata *, const struct sweep *);
};

static void both_types(struct __test_metadata *_metadata, ape_device *dev, void *arg)
{
	const struct sweep_arg *a = arg;

	paged_sweep(_metadata, dev, APE_F32, a->host, a->sweep);
	paged_sweep(_metadata, dev, APE_F16, a->host, a->sweep);
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
