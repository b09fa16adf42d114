/* SPDX-License-Identifier: MIT */
/*
 * The failure sweeps of the ragged and positions fault tests (test_varlenfail.c,
 * test_posfail.c; include after the Kselftest harness), over a call seen through struct sweep:
 * each host allocation of a clean run fails in turn (a fault build: the counting allocators of
 * runtime/core/alloc.h), then each call of every device op (tests/common/wrapops.h), then the
 * device is lost from each point on. Every broken run returns the injected code (APE_ENOMEM
 * for allocations, APE_EDEVLOST for the rest) or, where the library has a fallback (a device
 * buffer or a host registration refused), succeeds; its message names the call and, for a
 * device op, says "fails on purpose"; the case's verify() passes after it (inputs intact,
 * outputs clean or untouched); and the next run is clean.
 */
#ifndef APE_TEST_FAULTS_SWEEP_H
#define APE_TEST_FAULTS_SWEEP_H

#include <stdlib.h>
#include <string.h>

#include "ape_test.h"
#include "common/wrapops.h"
#include "core/alloc.h"

struct sweep {
	ape_device *dev;
	const char *what; /* the call, in the logs */
	unsigned wrap_flags; /* wrap_install()'s flags (the allocation sweep wraps only if set) */
	void *c; /* the case each hook gets */
	int (*prepare)(void *c); /* sets the case up on dev and runs it cleanly: 0 or its error */
	int (*run)(void *c); /* poisons the outputs and runs the call: its code, message in msg */
	const char *(*verify)(const void *c, int ret); /* NULL when the run left all as promised */
	/* whether the failed run's message names the call (NULL: msg holds word) */
	bool (*names_the_call)(const void *c, const char *word);
	const char *msg; /* the case's copy of ape_last_error() after its last run */
	const bool *in_call; /* NULL, or: the last failed run failed in the resident call itself */
	const char *alloc_word, *device_word; /* what a failed run's message must hold */
};

/* The byte a case's run fills its outputs with first: a failed run must leave them so. */
#define SWEEP_POISON 0x5a

/* NULL when a run that returned ret left n output bytes at got as promised: the clean ones
 * (ret 0) or SWEEP_POISON throughout. */
static __attribute__((unused)) const char *sweep_outputs_verify(const void *got,
								const void *clean, size_t n,
								int ret)
{
	if (!ret)
		return memcmp(got, clean, n) ? "not the clean result" : NULL;
	if (strstr(ape_last_error(), "computed in place and are unspecified"))
		return NULL; /* a forward's launch had them (a device reading host memory): said so */
	for (size_t i = 0; i < n; i++)
		if (((const unsigned char *)got)[i] != SWEEP_POISON)
			return "a failed call wrote an output";
	return NULL;
}

static __attribute__((unused)) const char *backend_of(const ape_device *dev)
{
	static __thread ape_device_info di;

	return ape_device_get_info(dev, &di) ? "?" : di.backend;
}

static bool sweep_names(const struct sweep *s, const char *word)
{
	return s->names_the_call ? s->names_the_call(s->c, word) : strstr(s->msg, word) != NULL;
}

static __attribute__((unused)) void alloc_sweep(struct __test_metadata *_metadata,
						const struct sweep *s)
{
#ifdef APE_FAULT_INJECT
	uint64_t total, errors = 0, in_call = 0;
	const char *bad;

	if (s->wrap_flags)
		wrap_install(s->dev, s->wrap_flags);
	ASSERT_EQ(0, s->prepare(s->c)) TH_LOG("%s: %s", s->what, s->msg);
	ape__fault_alloc_arm(0);
	ASSERT_EQ(0, s->run(s->c)) TH_LOG("%s: %s", s->what, s->msg);
	total = ape__fault_alloc_count();
	ASSERT_GT(total, 0u);
	for (uint64_t n = 1; n <= total; n++) {
		int ret;

		ape__fault_alloc_arm(n);
		ret = s->run(s->c);
		ape__fault_alloc_arm(0);
		EXPECT_EQ(NULL, bad = s->verify(s->c, ret))
		TH_LOG("%s: allocation %llu (returned %d): %s (%s)", s->what, (unsigned long long)n,
		       ret, bad, s->msg);
		if (!ret)
			continue;
		errors++;
		in_call += s->in_call && *s->in_call;
		EXPECT_EQ(APE_ENOMEM, ret) TH_LOG("%s: allocation %llu: %s", s->what,
						  (unsigned long long)n, s->msg);
		EXPECT_TRUE(sweep_names(s, s->alloc_word)) TH_LOG("%s", s->msg);
	}
	EXPECT_GT(errors, 0u);
	if (s->in_call) {
		EXPECT_GT(in_call, 0u) TH_LOG("no allocation of the resident call failed");
	}
	EXPECT_EQ(0, s->run(s->c)) TH_LOG("%s", s->msg);
	EXPECT_EQ(NULL, s->verify(s->c, 0));
	ksft_print_msg("%s on %s: %llu allocations failed in turn, %llu errors (%llu in the "
		       "resident call)\n",
		       s->what, backend_of(s->dev), (unsigned long long)total,
		       (unsigned long long)errors, (unsigned long long)in_call);
	if (s->wrap_flags)
		wrap_remove();
#else
	(void)_metadata;
	(void)s;
#endif
}

static __attribute__((unused)) void device_sweep(struct __test_metadata *_metadata,
						 const struct sweep *s)
{
	struct wrap_counts clean;
	uint64_t total = 0, runs = 0, absorbed = 0, in_call = 0;
	const char *bad;

	wrap_install(s->dev, s->wrap_flags);
	ASSERT_EQ(0, s->prepare(s->c)) TH_LOG("%s: %s", s->what, s->msg);
	wrap_reset();
	ASSERT_EQ(0, s->run(s->c)) TH_LOG("%s: %s", s->what, s->msg);
	clean = wrap_get();
	for (int op = 0; op < WRAP_NOPS; op++) {
		const char *name = wrap_op_name((enum wrap_op)op);

		for (uint64_t n = 1; n <= clean.calls[op]; n++, runs++) {
			int ret;

			wrap_fail_op((enum wrap_op)op, n);
			ret = s->run(s->c);
			wrap_fail_op((enum wrap_op)op, 0);
			EXPECT_EQ(NULL, bad = s->verify(s->c, ret))
			TH_LOG("%s: %s #%llu (returned %d): %s", s->what, name, (unsigned long long)n,
			       ret, bad);
			if (!ret) {
				absorbed++;
				EXPECT_TRUE(op == WRAP_BUF_ALLOC || op == WRAP_HOST_REGISTER)
				TH_LOG("%s: %s #%llu: a failure was swallowed", s->what, name,
				       (unsigned long long)n);
				continue;
			}
			in_call += s->in_call && *s->in_call;
			EXPECT_EQ(op == WRAP_BUF_ALLOC || op == WRAP_BUF_WRAP ||
					  op == WRAP_SCRATCH_ALLOC
				  ? APE_ENOMEM
				  : APE_EDEVLOST,
				  ret)
			TH_LOG("%s: %s #%llu: %s", s->what, name, (unsigned long long)n, s->msg);
			EXPECT_NE(NULL, strstr(s->msg, "fails on purpose")) TH_LOG("%s", s->msg);
			EXPECT_TRUE(sweep_names(s, s->device_word)) TH_LOG("%s", s->msg);
			EXPECT_EQ(0, s->run(s->c)) TH_LOG("after %s: %s", name, s->msg);
		}
		total += clean.calls[op];
	}
	for (uint64_t k = 1; k <= total; k++, runs++) {
		int ret;

		wrap_lose_device(k);
		ret = s->run(s->c);
		wrap_lose_device(0);
		in_call += s->in_call && *s->in_call;
		EXPECT_EQ(APE_EDEVLOST, ret) TH_LOG("%s: lost at call %llu", s->what,
						    (unsigned long long)k);
		EXPECT_NE(NULL, strstr(s->msg, "fails on purpose")) TH_LOG("%s", s->msg);
		EXPECT_EQ(NULL, bad = s->verify(s->c, ret))
		TH_LOG("%s: lost at call %llu: %s", s->what, (unsigned long long)k, bad);
	}
	EXPECT_GT(runs, absorbed);
	if (s->in_call) {
		EXPECT_GT(in_call, 0u) TH_LOG("no device op of the resident call failed");
	}
	EXPECT_EQ(0, s->run(s->c)) TH_LOG("%s", s->msg);
	EXPECT_EQ(NULL, s->verify(s->c, 0));
	ksft_print_msg("%s on %s: %llu broken runs, %llu absorbed (%llu in the resident call)\n",
		       s->what, backend_of(s->dev), (unsigned long long)runs,
		       (unsigned long long)absorbed, (unsigned long long)in_call);
	wrap_remove();
}

/*
 * Calls each(_metadata, dev, arg) on the reference device and on an OpenCL device, each in a
 * context of its own (a backend with no device here is said and not tested), stdout flushed
 * after each: the fault tests' loop over backends.
 */
static __attribute__((unused)) void sweep_backends(struct __test_metadata *_metadata,
						   void (*each)(struct __test_metadata *,
								ape_device *, void *),
						   void *arg)
{
	static const char *const backends[] = { "ref", "opencl" };

	for (size_t i = 0; i < 2; i++) {
		ape_context *ctx = test_context(backends[i]);
		ape_device *dev = ctx ? test_device(ctx, backends[i]) : NULL;

		if (!dev) {
			ksft_print_msg("no %s device, not tested\n", backends[i]);
			ape_context_destroy(ctx);
			continue;
		}
		each(_metadata, dev, arg);
		fflush(stdout);
		ape_context_destroy(ctx);
	}
}

#endif
