/* SPDX-License-Identifier: MIT */
/*
 * NVTX ranges (docs/profiling.md, "NVTX ranges"), without a GPU or Nsight: each test points
 * NVTX_INJECTION64_PATH at a fake tool (tests/nvtx_inject.c, built next to this test) before
 * its first libape call, so that NVTX's own init, at libape's first range, loads it as it
 * would load Nsight Systems' library; the tool writes every domain, push and pop to a log that
 * the test reads back and checks:
 *
 * - every range is in the domain "libape" (created once, also when the first calls race), no
 *   range is pushed outside it, every push has its pop on its own thread, nothing stays open;
 * - a public call is one range named after it, outermost on the calling thread, and its kernel
 *   launches ("attention", "attention_backward", "attention_merge") and copies ("copy_h2d",
 *   "copy_d2h") are ranges inside it, on every backend this build has (the reference, OpenCL,
 *   CUDA through the emulated driver);
 * - a call that fails on a bad argument still closes its range, with no launch inside;
 * - with several devices the launches run on the executor's per-device threads: their ranges
 *   are there, each the outermost of its thread, every one closed;
 * - a library NVTX_INJECTION64_PATH names that does not exist changes nothing.
 *
 * Each test is its own process (the harness forks one per test, before any libape call), so
 * each has a fresh NVTX init. A build without NVTX (WITH_NVTX=no, or no nvtx3 headers) skips
 * the whole program with the reason.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ape_test.h"
#include "common/backends.h"
#include "common/bwdcase.h"
#include "common/problem.h"

#define NVTX_INJECT_LIB APE_BUILD_DIR "/tests/libnvtx_inject.so"

#ifdef APE_WITH_NVTX
#define HAVE_NVTX 1
#else
#define HAVE_NVTX 0
#endif
#define NO_NVTX                                                                                    \
	"libape was built without NVTX ranges (WITH_NVTX=no, or no nvtx3/nvToolsExt.h at build "  \
	"time: see the build's \"libape: NVTX ranges:\" line)"

/* ---------------------------------------------------------------- the fake tool's log */

enum ev_kind { EV_INIT, EV_DOMAIN, EV_PUSH, EV_POP };

struct ev {
	long tid;
	enum ev_kind kind;
	int depth; /* push: after it; pop: before it */
	char domain[64]; /* push, pop: "-" for NVTX's default domain; EV_DOMAIN: its name */
	char name[128]; /* push */
	int pop; /* push: the index of its pop, or -1 */
};

struct nvtx_log {
	struct ev *ev;
	int n;
	long pid; /* the init line's */
};

static long this_tid(void)
{
	return (long)syscall(SYS_gettid);
}

/* Before any libape call of the process: the fake tool and a fresh log for it, at path. */
static int nvtx_attach(char *path, size_t cap)
{
	const char *tmp = getenv("TMPDIR");
	int fd;

	if (access(NVTX_INJECT_LIB, R_OK)) {
		fprintf(stderr, "# %s is missing: make builds it with this test\n",
			NVTX_INJECT_LIB);
		return -1;
	}
	snprintf(path, cap, "%s/ape-nvtx-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	fd = mkstemp(path);
	if (fd < 0)
		return -1;
	close(fd);
	setenv("APE_TEST_NVTX_LOG", path, 1);
	setenv("NVTX_INJECTION64_PATH", NVTX_INJECT_LIB, 1);
	return 0;
}

/* Parses the log at path, pairs every push with its pop (per thread and domain, as NVTX's
 * stacks are) and removes the file. -1 on a line it cannot read. */
static int log_read(const char *path, struct nvtx_log *lg)
{
	FILE *f = fopen(path, "r");
	char line[512];
	int cap = 0;

	memset(lg, 0, sizeof(*lg));
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		struct ev e = { .pop = -1 };
		char kind[16];
		int off = 0;

		line[strcspn(line, "\n")] = '\0';
		if (sscanf(line, "%ld %15s %n", &e.tid, kind, &off) < 2)
			goto bad;
		if (!strcmp(kind, "init")) {
			e.kind = EV_INIT;
			lg->pid = strtol(line + off, NULL, 10);
		} else if (!strcmp(kind, "domain")) {
			e.kind = EV_DOMAIN;
			snprintf(e.domain, sizeof(e.domain), "%s", line + off);
		} else if (!strcmp(kind, "push")) {
			int k = 0;

			e.kind = EV_PUSH;
			if (sscanf(line + off, "%d %63s %n", &e.depth, e.domain, &k) < 2)
				goto bad;
			snprintf(e.name, sizeof(e.name), "%s", line + off + k);
		} else if (!strcmp(kind, "pop")) {
			e.kind = EV_POP;
			if (sscanf(line + off, "%d %63s", &e.depth, e.domain) < 2)
				goto bad;
		} else {
			goto bad;
		}
		if (lg->n == cap) {
			struct ev *p;

			cap = cap ? 2 * cap : 256;
			p = realloc(lg->ev, (size_t)cap * sizeof(*p));

			if (!p)
				goto bad;
			lg->ev = p;
		}
		lg->ev[lg->n++] = e;
	}
	fclose(f);
	remove(path);
	/* each pop closes the latest push of its thread and domain still open */
	for (int i = 0; i < lg->n; i++) {
		if (lg->ev[i].kind != EV_POP)
			continue;
		for (int j = i - 1; j >= 0; j--) {
			struct ev *p = &lg->ev[j];

			if (p->kind == EV_PUSH && p->pop < 0 && p->tid == lg->ev[i].tid &&
			    !strcmp(p->domain, lg->ev[i].domain)) {
				p->pop = i;
				break;
			}
		}
	}
	return 0;
bad:
	fprintf(stderr, "# unreadable line in the NVTX log: \"%s\"\n", line);
	fclose(f);
	remove(path);
	return -1;
}

static void log_free(struct nvtx_log *lg)
{
	free(lg->ev);
	memset(lg, 0, sizeof(*lg));
}

static void log_dump(const struct nvtx_log *lg)
{
	for (int i = 0; i < lg->n; i++) {
		const struct ev *e = &lg->ev[i];

		if (e->kind == EV_PUSH)
			fprintf(stderr, "#   %ld push %d %s %s\n", e->tid, e->depth, e->domain,
				e->name);
		else if (e->kind == EV_POP)
			fprintf(stderr, "#   %ld pop %d %s\n", e->tid, e->depth, e->domain);
		else if (e->kind == EV_DOMAIN)
			fprintf(stderr, "#   %ld domain %s\n", e->tid, e->domain);
	}
}

/*
 * What every log must show: the tool's init in this process, the domain "libape" created once
 * and no other, every range in it, each push at its thread's depth + 1 and each pop at its
 * thread's depth (nothing popped that was not open), nothing left open. NULL, or what is wrong.
 */
static const char *log_sound(const struct nvtx_log *lg, char *why, size_t cap)
{
	int domains = 0, inits = 0;

	for (int i = 0; i < lg->n; i++) {
		const struct ev *e = &lg->ev[i];
		int open = 0;

		switch (e->kind) {
		case EV_INIT:
			inits++;
			break;
		case EV_DOMAIN:
			domains++;
			if (strcmp(e->domain, "libape"))
				return snprintf(why, cap, "a domain \"%s\"", e->domain), why;
			break;
		case EV_PUSH:
		case EV_POP:
			if (strcmp(e->domain, "libape"))
				return snprintf(why, cap, "event %d (%s) in the domain \"%s\"", i,
						e->name, e->domain),
				       why;
			/* the thread's ranges open before this event */
			for (int j = 0; j < i; j++)
				if (lg->ev[j].kind == EV_PUSH && lg->ev[j].tid == e->tid &&
				    (lg->ev[j].pop < 0 || lg->ev[j].pop >= i))
					open++;
			if (e->kind == EV_PUSH && e->depth != open + 1)
				return snprintf(why, cap, "push %d (%s) at depth %d, %d open",
						i, e->name, e->depth, open),
				       why;
			if (e->kind == EV_POP && (e->depth != open || open == 0))
				return snprintf(why, cap, "pop %d at depth %d with %d open", i,
						e->depth, open),
				       why;
			if (e->kind == EV_PUSH && e->pop < 0)
				return snprintf(why, cap, "range %d (%s) never closed", i, e->name),
				       why;
			break;
		}
	}
	if (inits != 1 || lg->pid != (long)getpid())
		return snprintf(why, cap, "%d init lines (pid %ld, this process %ld)", inits,
				lg->pid, (long)getpid()),
		       why;
	if (domains != 1)
		return snprintf(why, cap, "the domain created %d times", domains), why;
	return NULL;
}

/* The index of the next outermost range named `name` on thread tid from index `from`, or -1. */
static int log_find(const struct nvtx_log *lg, long tid, const char *name, int from)
{
	for (int i = from; i < lg->n; i++)
		if (lg->ev[i].kind == EV_PUSH && lg->ev[i].tid == tid && lg->ev[i].depth == 1 &&
		    !strcmp(lg->ev[i].name, name))
			return i;
	return -1;
}

/* Ranges named `name` inside range r (its thread's, between its push and pop, deeper). */
static int log_inside(const struct nvtx_log *lg, int r, const char *name)
{
	const struct ev *outer = &lg->ev[r];
	int n = 0;

	for (int i = r + 1; i < outer->pop; i++)
		if (lg->ev[i].kind == EV_PUSH && lg->ev[i].tid == outer->tid &&
		    lg->ev[i].depth > outer->depth && !strcmp(lg->ev[i].name, name))
			n++;
	return n;
}

/* Ranges of thread tid outside any public call's (an outermost range not named "ape_..."). */
static int log_outside_calls(const struct nvtx_log *lg, long tid)
{
	int n = 0;

	for (int i = 0; i < lg->n; i++)
		n += lg->ev[i].kind == EV_PUSH && lg->ev[i].tid == tid && lg->ev[i].depth == 1 &&
		     strncmp(lg->ev[i].name, "ape_", 4);
	return n;
}

/* Every range named `name` of the log, on any thread. */
static int log_count(const struct nvtx_log *lg, const char *name)
{
	int n = 0;

	for (int i = 0; i < lg->n; i++)
		n += lg->ev[i].kind == EV_PUSH && !strcmp(lg->ev[i].name, name);
	return n;
}

/* ---------------------------------------------------------------- every backend */

FIXTURE(nv)
{
	char log[512];
	ape_context *ctx;
	ape_device *dev;
};

FIXTURE_VARIANT(nv)
{
	const char *backend;
};

FIXTURE_VARIANT_ADD(nv, ref){ .backend = "ref" };
FIXTURE_VARIANT_ADD(nv, opencl){ .backend = "opencl" };
FIXTURE_VARIANT_ADD(nv, cuda){ .backend = "cuda" };

FIXTURE_SETUP(nv)
{
	char why[TEST_WHY_LEN];

	/* the ranges are the core's, the same on every backend: under valgrind the reference's
	 * suffice (PoCL compiling its kernels there would take minutes) */
	if (ape_test_slow() && strcmp(variant->backend, "ref"))
		APE_SETUP_SKIP((void)0, "%s under valgrind: the ref variant checks the same ranges",
			       variant->backend);
	ASSERT_EQ(0, nvtx_attach(self->log, sizeof(self->log)));
	if (test_backend_prepare(variant->backend, NULL, why, sizeof(why))) {
		remove(self->log);
		APE_SETUP_SKIP((void)0, "%s", why);
	}
	self->ctx = test_context(variant->backend);
	ASSERT_NE(NULL, self->ctx);
	self->dev = test_device(self->ctx, variant->backend);
	if (!self->dev) {
		test_backend_absent(self->ctx, variant->backend, why, sizeof(why));
		remove(self->log);
		APE_SETUP_SKIP(ape_context_destroy(self->ctx), "%s", why);
	}
}

FIXTURE_TEARDOWN(nv)
{
	ape_context_destroy(self->ctx);
	remove(self->log);
}

/* The forward: one call, its launch inside its range; a failing call closes its range; a
 * streamed call with its inputs copied: launches, merges and copies inside its range. */
TEST_F(nv, forward)
{
	const long tid = this_tid();
	ape_exec_options opts;
	struct nvtx_log lg;
	test_problem tp;
	char why[256];
	ape_rng rng;
	int r, bad, ex;

	ape_rng_init(&rng, "nvtx_forward");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, 24, 40, 64, APE_F32));
	ASSERT_EQ(0, test_problem_run(&tp, self->dev)) TH_LOG("%s", ape_last_error());
	/* a bad argument: no desc */
	ASSERT_EQ(APE_EINVAL, ape_attention_forward(self->dev, NULL, &tp.q.t, &tp.k.t, &tp.v.t,
						    &tp.o.t, tp.lse, NULL));
	/* three key chunks, merged; the inputs copied to the device and O back */
	ape_exec_options_init(&opts);
	opts.chunk_k = 16;
	opts.flags = APE_EXEC_COPY_INPUTS;
	ASSERT_EQ(0, ape_attention_forward_ex(&self->dev, 1, &opts, &tp.desc, &tp.q.t, &tp.k.t,
					      &tp.v.t, &tp.o.t, tp.lse, NULL))
	TH_LOG("%s", ape_last_error());
	ape_context_destroy(self->ctx);
	self->ctx = NULL;

	ASSERT_EQ(0, log_read(self->log, &lg));
	EXPECT_EQ(NULL, log_sound(&lg, why, sizeof(why))) TH_LOG("%s", why);
	r = log_find(&lg, tid, "ape_attention_forward", 0);
	ASSERT_LE(0, r) log_dump(&lg);
	EXPECT_LE(1, log_inside(&lg, r, "attention")) log_dump(&lg);
	bad = log_find(&lg, tid, "ape_attention_forward", lg.ev[r].pop);
	ASSERT_LE(0, bad)
	{
		TH_LOG("the failing call has no range");
		log_dump(&lg);
	}
	EXPECT_EQ(0, log_inside(&lg, bad, "attention"));
	ex = log_find(&lg, tid, "ape_attention_forward_ex", lg.ev[bad].pop);
	ASSERT_LE(0, ex) log_dump(&lg);
	EXPECT_LE(3, log_inside(&lg, ex, "attention")) log_dump(&lg);
	EXPECT_LE(1, log_inside(&lg, ex, "copy_h2d")) log_dump(&lg);
	EXPECT_LE(1, log_inside(&lg, ex, "copy_d2h")) log_dump(&lg);
	/* every launch and copy within a call; the merges (on the device where the executor
	 * merges there, else on the host) within the streamed one */
	EXPECT_EQ(0, log_outside_calls(&lg, tid)) log_dump(&lg);
	EXPECT_EQ(log_count(&lg, "attention_merge"), log_inside(&lg, ex, "attention_merge"));
	/* the context's own calls are ranges too */
	EXPECT_LE(0, log_find(&lg, tid, "ape_context_create", 0)) log_dump(&lg);
	EXPECT_LE(0, log_find(&lg, tid, "ape_device_select", 0)) log_dump(&lg);
	log_free(&lg);
	test_problem_free(&tp);
}

/* The backward: its launch inside its range. */
TEST_F(nv, backward)
{
	const test_problem_shape sh = { 1, 2, 1, 9, 11, 16 };
	const long tid = this_tid();
	struct nvtx_log lg;
	char why[256];
	ape_rng rng;
	grads g;
	bcase c;
	int r;

	ape_rng_init(&rng, "nvtx_backward");
	ASSERT_EQ(0, bcase_ready_visible(&c, &rng, &sh, APE_F32, false, true, self->dev));
	ASSERT_EQ(0, grads_alloc(&g, &c, APE_F32));
	r = run_backward(&c, self->dev, &g, W_ALL, NULL);
	if (r == APE_ENOTSUP) {
		grads_free(&g);
		bcase_free(&c);
		SKIP(return, "no backward pass on %s: %s", variant->backend, ape_last_error());
	}
	ASSERT_EQ(0, r) TH_LOG("%s", ape_last_error());
	ape_context_destroy(self->ctx);
	self->ctx = NULL;

	ASSERT_EQ(0, log_read(self->log, &lg));
	EXPECT_EQ(NULL, log_sound(&lg, why, sizeof(why))) TH_LOG("%s", why);
	r = log_find(&lg, tid, "ape_attention_backward", 0);
	ASSERT_LE(0, r) log_dump(&lg);
	EXPECT_LE(1, log_inside(&lg, r, "attention_backward")) log_dump(&lg);
	EXPECT_EQ(log_count(&lg, "attention_backward"), log_inside(&lg, r, "attention_backward"));
	EXPECT_EQ(0, log_outside_calls(&lg, tid)) log_dump(&lg);
	log_free(&lg);
	grads_free(&g);
	bcase_free(&c);
}

/* ---------------------------------------------------------------- threads */

/* Two devices (the reference listed twice): the executor runs each on a thread of its own,
 * and the launches' ranges are there, each the outermost of its thread. */
TEST(launches_on_the_executor_threads)
{
	const long tid = this_tid();
	char path[512], why[256];
	ape_device *devs[2];
	ape_exec_options opts;
	struct nvtx_log lg;
	ape_context *ctx;
	test_problem tp;
	ape_rng rng;
	int r, elsewhere = 0;

	ASSERT_EQ(0, nvtx_attach(path, sizeof(path)));
	ctx = test_context("ref");
	ASSERT_NE(NULL, ctx);
	devs[0] = devs[1] = test_device(ctx, "ref");
	ASSERT_NE(NULL, devs[0]);
	ape_rng_init(&rng, "nvtx_threads");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 2, 1, 64, 64, 32, APE_F32));
	ape_exec_options_init(&opts);
	opts.chunk_q = 16; /* four query chunks for the two devices */
	ASSERT_EQ(0, ape_attention_forward_ex(devs, 2, &opts, &tp.desc, &tp.q.t, &tp.k.t, &tp.v.t,
					      &tp.o.t, tp.lse, NULL))
	TH_LOG("%s", ape_last_error());
	ape_context_destroy(ctx);

	ASSERT_EQ(0, log_read(path, &lg));
	EXPECT_EQ(NULL, log_sound(&lg, why, sizeof(why))) TH_LOG("%s", why);
	r = log_find(&lg, tid, "ape_attention_forward_ex", 0);
	ASSERT_LE(0, r) log_dump(&lg);
	for (int i = 0; i < lg.n; i++)
		if (lg.ev[i].kind == EV_PUSH && !strcmp(lg.ev[i].name, "attention")) {
			EXPECT_NE(tid, lg.ev[i].tid);
			EXPECT_EQ(1, lg.ev[i].depth);
			/* within the call */
			EXPECT_LT(r, i);
			EXPECT_GT(lg.ev[r].pop, lg.ev[i].pop);
			elsewhere++;
		}
	EXPECT_EQ(4, elsewhere) log_dump(&lg);
	log_free(&lg);
	test_problem_free(&tp);
}

#define RACERS 4

struct racer {
	pthread_barrier_t *go;
	long tid;
	int ret;
};

/* A thread's first libape call races the others': its own context, one forward. */
static void *race(void *arg)
{
	struct racer *rc = arg;
	ape_context *ctx;
	ape_device *dev;
	test_problem tp;
	ape_rng rng;

	rc->tid = this_tid();
	ape_rng_init(&rng, "nvtx_race");
	rc->ret = -1;
	if (test_problem_make_dims(&tp, &rng, 1, 1, 1, 8, 8, 16, APE_F32))
		return NULL;
	pthread_barrier_wait(rc->go);
	ctx = test_context("ref");
	dev = test_device(ctx, "ref");
	if (dev)
		rc->ret = test_problem_run(&tp, dev);
	ape_context_destroy(ctx);
	test_problem_free(&tp);
	return NULL;
}

/* The first ranges of several threads at once: NVTX's init and the domain happen once, and
 * each thread's ranges nest on its own stack. */
TEST(first_calls_race)
{
	struct racer rc[RACERS];
	pthread_t t[RACERS];
	pthread_barrier_t go;
	char path[512], why[256];
	struct nvtx_log lg;

	ASSERT_EQ(0, nvtx_attach(path, sizeof(path)));
	ASSERT_EQ(0, pthread_barrier_init(&go, NULL, RACERS));
	for (int i = 0; i < RACERS; i++) {
		rc[i] = (struct racer){ &go, 0, -1 };
		ASSERT_EQ(0, pthread_create(&t[i], NULL, race, &rc[i]));
	}
	for (int i = 0; i < RACERS; i++)
		pthread_join(t[i], NULL);
	pthread_barrier_destroy(&go);

	ASSERT_EQ(0, log_read(path, &lg));
	EXPECT_EQ(NULL, log_sound(&lg, why, sizeof(why))) TH_LOG("%s", why);
	for (int i = 0; i < RACERS; i++) {
		int r = log_find(&lg, rc[i].tid, "ape_attention_forward", 0);

		EXPECT_EQ(0, rc[i].ret);
		ASSERT_LE(0, r) log_dump(&lg);
		EXPECT_EQ(1, log_inside(&lg, r, "attention"));
		EXPECT_LE(0, log_find(&lg, rc[i].tid, "ape_context_create", 0));
	}
	log_free(&lg);
}

/* ---------------------------------------------------------------- no tool */

/* A tool library that cannot be loaded: NVTX gives up quietly, the calls work as without. */
TEST(a_missing_tool_changes_nothing)
{
	ape_context *ctx;
	ape_device *dev;
	test_problem tp;
	ape_rng rng;

	setenv("NVTX_INJECTION64_PATH", APE_BUILD_DIR "/tests/no-such-nvtx-tool.so", 1);
	ctx = test_context("ref");
	dev = test_device(ctx, "ref");
	ASSERT_NE(NULL, dev);
	ape_rng_init(&rng, "nvtx_missing");
	ASSERT_EQ(0, test_problem_make_dims(&tp, &rng, 1, 1, 1, 8, 8, 16, APE_F32));
	EXPECT_EQ(0, test_problem_run(&tp, dev)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(APE_EINVAL, ape_attention_forward(dev, NULL, &tp.q.t, &tp.k.t, &tp.v.t, &tp.o.t,
						    tp.lse, NULL));
	ape_context_destroy(ctx);
	test_problem_free(&tp);
}

APE_TEST_MAIN_SKIP_UNLESS(HAVE_NVTX, NO_NVTX)
