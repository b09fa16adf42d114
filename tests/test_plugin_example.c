/* SPDX-License-Identifier: MIT */
/*
 * The example backend plugin (examples/backend-plugin/, `make plugin-example`) against the
 * reference. The plugin is opened with dlopen() and its table taken from ape_backend_plugin(),
 * as the loader does, and registered with ape__context_create() after the reference (built-in
 * backends first, then plugins). Then: its table and devices; the forward (O, LSE, pair counts)
 * and the backward (dQ, dK, dV, dparams) at the spec's tolerances on cases of awkward sizes,
 * GQA, causal or not, both rope layouts, every storage type, offsets up to 2^40, lambda zero
 * and not; in one launch, in chunks and over two example devices; strided on device buffers;
 * explicit positions (which the core cuts into dense launches for a device without them);
 * its configuration (no device, a small memory) and a failure named with its device and op;
 * and docs/backends.md's lines for building it against an installed libape, run as they stand.
 *
 * Linked with -rdynamic (tests/module.mk), so that the plugin's calls of libape's services
 * (ape_be_*) reach this program's libape, the static library, rather than the libape.so its
 * run path brings along: a process linked with libape.so has one libape only.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "ape_test.h"
#include "api/registry.h"
#include "common/bwdcase.h"
#include "common/positions.h"
#include "common/problem.h"
#include "common/resident.h"
#include "core/backend.h"

#define PLUGIN APE_BUILD_DIR "/plugins/libape-backend-example.so"

static const ape_dtype types[] = { APE_F32, APE_F16, APE_BF16 };

/* The plugin, and a context with the reference and it. */
struct ex {
	void *so;
	const struct ape_backend_plugin *table;
	ape_context *ctx;
	ape_device *dev, *ref;
};

static const struct ape__registry_entry *ref_entry(void)
{
	int n;
	const struct ape__registry_entry *reg = ape__registry(&n);

	for (int i = 0; i < n; i++)
		if (!strcmp(reg[i].name, "ref"))
			return &reg[i];
	return NULL;
}

/* Opens the plugin at `path` and creates the context (the plugin's probe reads the
 * APE_EXAMPLE_* variables now). 0, or -1 with the reason printed. x->dev is NULL when the
 * example has no device. */
static int ex_open_at(struct ex *x, const char *path)
{
	const struct ape_backend_plugin *(*entry)(void);
	struct ape__registry_entry reg[2] = { *ref_entry(), { "example", NULL, NULL } };
	ape_context_options o;
	ape_selection sel;

	memset(x, 0, sizeof(*x));
	x->so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!x->so) {
		fprintf(stderr, "# dlopen: %s (make plugin-example)\n", dlerror());
		return -1;
	}
	*(void **)&entry = dlsym(x->so, APE_BACKEND_PLUGIN_SYMBOL);
	if (!entry || !(x->table = entry())) {
		fprintf(stderr, "# %s: no table from %s()\n", path, APE_BACKEND_PLUGIN_SYMBOL);
		return -1;
	}
	reg[1].ops = x->table;
	ape_context_options_init(&o);
	o.flags = APE_CONTEXT_POISON_OUTPUTS | APE_CONTEXT_NO_PLUGIN_DIR;
	o.backend_path = ""; /* no plugin loaded twice, whatever APE_BACKEND_PATH says */
	if (ape__context_create(&x->ctx, &o, reg, 2)) {
		fprintf(stderr, "# ape__context_create: %s\n", ape_last_error());
		return -1;
	}
	x->ref = test_device(x->ctx, "ref");
	if (!ape_device_select(x->ctx, "example", 0, &sel))
		x->dev = sel.device;
	return x->ref ? 0 : -1;
}

static int ex_open(struct ex *x)
{
	return ex_open_at(x, PLUGIN);
}

static void ex_close(struct ex *x)
{
	ape_context_destroy(x->ctx);
	if (x->so)
		dlclose(x->so);
	memset(x, 0, sizeof(*x));
}

/* The example's entry of ape_backend_get_info() (the second of the registry). */
static void example_info(const struct ex *x, ape_backend_info *info)
{
	memset(info, 0, sizeof(*info));
	ape_backend_get_info(x->ctx, 1, info);
}

FIXTURE(ex)
{
	struct ex x;
};

FIXTURE_SETUP(ex)
{
	unsetenv("APE_EXAMPLE_DEVICES");
	unsetenv("APE_EXAMPLE_MEM");
	ASSERT_EQ(0, ex_open(&self->x));
	ASSERT_NE(NULL, self->x.dev) TH_LOG("%s", ape_last_error());
}

FIXTURE_TEARDOWN(ex)
{
	ex_close(&self->x);
}

/* ---- forward */

/* max|V|, never 0 */
static double v_scale(const test_problem *tp)
{
	return fmax(test_tensor_maxabs(&tp->v.t), 1e-30);
}

static bool o_has_nan(const test_problem *tp)
{
	const ape_tensor *t = &tp->o.t;

	for (int64_t b = 0; b < t->shape[0]; b++)
		for (int64_t h = 0; h < t->shape[1]; h++)
			for (int64_t l = 0; l < t->shape[2]; l++)
				for (int64_t d = 0; d < t->shape[3]; d++)
					if (isnan(test_tensor_get(t, b, h, l, d)))
						return true;
	for (size_t r = 0; tp->lse && r < tp->rows; r++)
		if (isnan(tp->lse[r]))
			return true;
	return false;
}

/*
 * tp's result (run on the example by the caller) against the reference's `want`, in the spec's
 * units: O relative to max|V|, LSE to max(1, |LSE|). 0, or -1 after logging.
 */
static int check_forward(struct __test_metadata *_metadata, const test_problem *tp,
			 const test_problem *want, const char *what)
{
	const ape_dtype dt = tp->q.t.dtype;
	const double eo = test_max_err_o(&tp->o.t, &want->o.t) / v_scale(tp);
	const double el = tp->lse ? test_max_rel_err_lse(tp->lse, want->lse, tp->rows) : 0;
	char desc[512];

	test_problem_describe(tp, desc, sizeof(desc));
	if (!(eo <= test_tol_o(dt)) || !(el <= test_tol_lse(dt))) {
		TH_LOG("%s: %s: O error %.3g (x max|V|, tolerance %g), LSE error %.3g "
		       "(tolerance %g)",
		       what, desc, eo, test_tol_o(dt), el, test_tol_lse(dt));
		return -1;
	}
	if (o_has_nan(tp) && !o_has_nan(want)) {
		TH_LOG("%s: %s: NaN left in the outputs (an element not written)", what, desc);
		return -1;
	}
	return 0;
}

/* Forward case i of a series: shape, type, layout, causality, offsets, lambda, O's type and
 * whether LSE is asked for all vary with i; the rest is drawn. */
static int forward_case(test_problem *tp, ape_rng *rng, int i)
{
	static const test_problem_shape shapes[] = {
		{ 1, 1, 1, 1, 1, 2 }, /* the smallest */
		{ 2, 4, 2, 17, 33, 6 }, /* GQA */
		{ 1, 6, 2, 31, 7, 64 }, /* fewer keys than rows */
		{ 2, 3, 1, 33, 65, 66 }, /* MQA, a D no kernel specialises */
		{ 1, 2, 2, 5, 0, 8 }, /* no key at all */
		{ 1, 4, 4, 64, 100, 16 },
	};
	const test_problem_shape *sh = &shapes[i % 6];
	const ape_dtype dt = types[i / 6 % 3];
	const int64_t H = sh->H;

	if (test_problem_make(tp, rng, sh, dt, i % 4 == 3))
		return -1;
	test_problem_random_params(tp, rng);
	tp->desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
	tp->desc.causal = i % 3 != 2;
	tp->desc.k_start = i % 5 == 1 ? ((int64_t)1 << 40) - i : -7 + i;
	tp->desc.q_start_set = i % 2 == 0; /* else aligned to the end of the keys */
	tp->desc.q_start = tp->desc.k_start + sh->Lk - sh->Lq - 2; /* early rows: no key */
	/* (tp->params holds every head's values, in the scalar form too; test_problem_clone()
	 * gives the clone all four per head or none) */
	if (i % 4 == 2) { /* lambda = 0: the separable case of the fast backends */
		for (int64_t h = 0; h < H; h++)
			tp->params[3 * H + h] = 0.0f;
		tp->desc.lambda.value = 0.0f;
	} else if (i % 4 == 1) { /* per head, lambda large and 0 in turn */
		for (int64_t h = 0; h < H; h++)
			tp->params[3 * H + h] = h % 2 ? 0.0f : 1.75f;
		tp->desc.delta.per_head = tp->params;
		tp->desc.beta.per_head = tp->params + H;
		tp->desc.gamma.per_head = tp->params + 2 * H;
		tp->desc.lambda.per_head = tp->params + 3 * H;
	}
	if (dt != APE_F32 && i % 3 == 1 && test_problem_set_out_dtype(tp, APE_F32))
		return -1;
	if (i % 7 == 3) { /* no LSE asked for */
		free(tp->lse);
		tp->lse = NULL;
	}
	if (i % 3 == 0 && test_problem_random_table(tp, rng)) /* ABI 1.1: a distance-bias table */
		return -1;
	return 0;
}

/* The example against the reference, one launch per call: O, LSE, the pairs counted, the
 * path and backend the statistics name. */
TEST_F(ex, forward_against_the_reference)
{
	const int ncases = ape_test_slow() ? 8 : 36;
	ape_rng rng;

	ape_rng_init(&rng, "forward_against_the_reference");
	for (int i = 0; i < ncases; i++) {
		test_problem tp, want;
		ape_stats st, sr;
		char what[32];

		snprintf(what, sizeof(what), "case %d", i);
		ASSERT_EQ(0, forward_case(&tp, &rng, i));
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ape_stats_init(&st);
		ape_stats_init(&sr);
		ASSERT_EQ(0, test_problem_run_stats(&want, self->x.ref, &sr))
		TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_run_stats(&tp, self->x.dev, &st))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, check_forward(_metadata, &tp, &want, what));
		EXPECT_STREQ("example", st.backend);
		EXPECT_EQ(sr.pairs_visible, st.pairs_visible) TH_LOG("%s", what);
		EXPECT_EQ(st.pairs_visible, st.pairs_computed) TH_LOG("%s: skipped keys", what);
		if (st.pairs_visible)
			EXPECT_STREQ("general", st.path) TH_LOG("%s", what);
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/* Streamed: small chunks (the partial results merged on the host: the example has no
 * attention_merge), and the same call over two example devices. */
TEST(forward_in_chunks_and_on_two_devices)
{
	const test_problem_shape sh = { 2, 4, 2, 45, 70, 32 };
	ape_exec_options eo = test_chunks(7, 16);
	ape_device *devs[2];
	ape_selection sel;
	struct ex x;
	ape_rng rng;

	setenv("APE_EXAMPLE_DEVICES", "2", 1);
	ASSERT_EQ(0, ex_open(&x));
	ASSERT_NE(NULL, x.dev);
	devs[0] = x.dev;
	ASSERT_EQ(0, ape_device_select(x.ctx, "example", 1, &sel)) TH_LOG("%s", ape_last_error());
	devs[1] = sel.device;
	ape_rng_init(&rng, "forward_in_chunks_and_on_two_devices");
	for (int i = 0; i < 6; i++) {
		test_problem tp, want;
		ape_stats st;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[i % 3], false));
		test_problem_random_params(&tp, &rng);
		tp.desc.causal = i < 3;
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, x.ref));
		test_tensor_poison(&tp.o.t);
		ape_stats_init(&st);
		ASSERT_EQ(0, ape_attention_forward_ex(devs, i % 2 ? 2 : 1, &eo, &tp.desc, &tp.q.t,
						      &tp.k.t, &tp.v.t, &tp.o.t, tp.lse, &st))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, check_forward(_metadata, &tp, &want, i % 2 ? "two devices" : "chunks"))
		TH_LOG("case %d", i);
		EXPECT_LT(1u, st.chunks);
		EXPECT_EQ(i % 2 ? 2 : 1, st.devices);
		test_problem_free(&tp);
		test_problem_free(&want);
	}
	ex_close(&x);
}

/* ape_attention_enqueue() on the example's own buffers, laid out like strided host tensors:
 * launches with views (struct ape_be_launch.strided), which the example reads through
 * ape_be_launch_view(). */
TEST_F(ex, strided_on_device_buffers)
{
	static const test_problem_shape shapes[] = { { 2, 4, 2, 19, 23, 10 },
						     { 1, 3, 1, 9, 40, 64 } };
	ape_rng rng;

	ape_rng_init(&rng, "strided_on_device_buffers");
	for (int i = 0; i < 6; i++) {
		test_problem tp, want;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &shapes[i % 2], types[i % 3], i < 4));
		test_problem_random_params(&tp, &rng);
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, self->x.ref));
		ASSERT_EQ(0, run_resident(&tp, self->x.dev, 64 * (size_t)i))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, check_forward(_metadata, &tp, &want, "enqueue"));
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/* Explicit positions (gaps, repeats, any order) on a device without the positions capability:
 * the core cuts them into runs of consecutive positions, each a dense launch, merged by LSE. */
TEST_F(ex, explicit_positions_without_the_capability)
{
	const test_problem_shape sh = { 2, 4, 2, 23, 37, 16 };
	int64_t pos_q[23], pos_k[37];
	ape_rng rng;

	ape_rng_init(&rng, "explicit_positions_without_the_capability");
	for (int m = POS_SHIFTED; m < POS_MODES; m++) {
		test_problem tp, want;

		ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, types[m % 3], false));
		test_problem_random_params(&tp, &rng);
		test_positions(&rng, (enum pos_mode)m, pos_k, sh.Lk, -20);
		test_positions(&rng, (enum pos_mode)m, pos_q, sh.Lq, 0);
		tp.desc.pos_q = pos_q;
		tp.desc.pos_k = pos_k;
		tp.desc.q_start_set = false;
		tp.desc.k_start = 0;
		ASSERT_EQ(0, test_problem_clone(&want, &tp));
		ASSERT_EQ(0, test_problem_run(&want, self->x.ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, test_problem_run(&tp, self->x.dev)) TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, check_forward(_metadata, &tp, &want, pos_mode_names[m]));
		test_problem_free(&tp);
		test_problem_free(&want);
	}
}

/* ---- backward */

/*
 * The gradients against the reference's: GQA and MQA, D = 2 and one no kernel specialises,
 * both layouts, causal or not, offsets of 2^40, rows that see no key, a constant query row
 * (sigma = 0), per-head parameters with negative decays and lambda large or 0, lambda = 0 for
 * every head, with and without dLSE, dO in the storage type or in float32; in one piece and in
 * chunks (the accumulators added to launch after launch); two runs bit for bit the same; the
 * parameter gradients alone, the other outputs untouched.
 */
TEST_F(ex, backward_against_the_reference)
{
	static const test_problem_shape shapes[] = {
		{ 1, 4, 2, 9, 13, 64 }, /* GQA */
		{ 2, 3, 1, 7, 10, 6 }, /* MQA */
		{ 1, 2, 2, 5, 8, 2 }, /* D = 2 */
		{ 1, 2, 1, 21, 40, 66 }, /* a D no kernel specialises */
	};
	const int ncases = ape_test_slow() ? 6 : 24;
	ape_rng rng;

	ape_rng_init(&rng, "backward_against_the_reference");
	for (int i = 0; i < ncases; i++) {
		const test_problem_shape *sh = &shapes[i % 4];
		const ape_dtype dt = types[i / 4 % 3];
		const double tol = grads_tol(dt);
		bcase c;
		grads want, g, again, chunked, only, untouched;
		ape_stats st;
		static float want_db[4096], g_db[4096]; /* the table's gradients: 4 x 1000 at most */

		ASSERT_EQ(0, bcase_make(&c, &rng, sh, dt, i % 5 == 4, i % 3 != 0));
		test_problem_random_params(&c.tp, &rng);
		c.tp.desc.layout = i & 1 ? APE_ROPE_INTERLEAVED : APE_ROPE_HALF;
		c.tp.desc.causal = i % 5 != 3;
		c.tp.desc.k_start = i % 7 == 2 ? ((int64_t)1 << 40) - i : -3 + i;
		c.tp.desc.q_start = c.tp.desc.k_start - 2; /* two rows see no key when causal */
		c.tp.desc.q_start_set = true;
		if (i % 2)
			bcase_edge_heads(&c);
		else if (i % 4 == 2)
			c.tp.desc.lambda = (ape_param){ 0, NULL };
		for (int64_t d = 0; d < sh->D; d++) /* sigma = 0 */
			test_tensor_set(&c.tp.q.t, 0, 0, sh->Lq - 1, d, 0.5);
		if (dt != APE_F32 && i % 3 == 1) { /* dO in float32 */
			test_tensor d32;

			ASSERT_EQ(0, grads_widen(&d32, &c.dout));
			test_tensor_free(&c.dout);
			c.dout = d32;
		}
		if (i % 3 == 2) /* ABI 1.1: a distance-bias table, and its gradient below */
			ASSERT_EQ(0, test_problem_random_table(&c.tp, &rng));
		ASSERT_EQ(0, bcase_forward(&c, self->x.ref)) TH_LOG("%s", ape_last_error());
		ASSERT_EQ(0, grads_alloc(&want, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&g, &c, i % 2 ? dt : APE_F32));
		ASSERT_EQ(0, grads_alloc(&again, &c, i % 2 ? dt : APE_F32));
		ASSERT_EQ(0, grads_alloc(&chunked, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&only, &c, APE_F32));
		ASSERT_EQ(0, grads_alloc(&untouched, &c, APE_F32));
		c.tp.desc.dbias_table = c.tp.bias_table ? want_db : NULL;
		ASSERT_EQ(0, run_backward(&c, self->x.ref, &want, W_ALL, NULL));
		ape_stats_init(&st);
		c.tp.desc.dbias_table = c.tp.bias_table ? g_db : NULL;
		EXPECT_EQ(0, run_backward(&c, self->x.dev, &g, W_ALL, &st))
		TH_LOG("%s", ape_last_error());
		c.tp.desc.dbias_table = NULL;
		if (c.tp.bias_table) {
			const int64_t n = c.tp.desc.bias_table_heads * c.tp.desc.bias_table_len;
			double e = 0, m = 1e-30;

			for (int64_t x = 0; x < n; x++) {
				e = fmax(e, fabs((double)g_db[x] - want_db[x]));
				m = fmax(m, fabs(want_db[x]));
			}
			EXPECT_LE(e / m, tol) TH_LOG("case %d: dbias_table", i);
		}
		EXPECT_EQ(0, run_backward(&c, self->x.dev, &again, W_ALL, NULL));
		EXPECT_EQ(0, run_chunked(&c, self->x.dev, &chunked, 3, 4, NULL))
		TH_LOG("%s", ape_last_error());
		EXPECT_EQ(0, run_backward(&c, self->x.dev, &only, W_DP, NULL));
		EXPECT_STREQ("example", st.backend);
		EXPECT_STREQ("backward", st.path);
		EXPECT_LE(grads_rel_err(&g.dq.t, &want.dq.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dk.t, &want.dk.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&g.dv.t, &want.dv.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(g.dparams, want.dparams, sh->H), tol)
		TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&chunked.dq.t, &want.dq.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&chunked.dk.t, &want.dk.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err(&chunked.dv.t, &want.dv.t), tol) TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(chunked.dparams, want.dparams, sh->H), tol)
		TH_LOG("case %d", i);
		EXPECT_LE(grads_rel_err_params(only.dparams, want.dparams, sh->H), tol)
		TH_LOG("case %d", i);
		EXPECT_TRUE(same_grads(&g, &again, W_ALL)) TH_LOG("case %d: reruns differ", i);
		EXPECT_TRUE(same_grads(&only, &untouched, W_ALL & ~W_DP)) TH_LOG("case %d", i);
		if (c.tp.desc.causal)
			for (int64_t d = 0; d < sh->D; d++) /* rows without a key: dQ exactly 0 */
				EXPECT_EQ(0.0, test_tensor_get(&g.dq.t, 0, 0, 0, d));
		grads_free(&want);
		grads_free(&g);
		grads_free(&again);
		grads_free(&chunked);
		grads_free(&only);
		grads_free(&untouched);
		bcase_free(&c);
	}
}

/* ---- the table, the devices, their configuration and a failure */

/* What the table says of itself, its extra by name, and the device it adds: a CPU device with
 * the backward pass and timestamps, ranked so that "auto" keeps the built-in backends. */
TEST_F(ex, table_and_device)
{
	const struct ape_backend_plugin *t = self->x.table;
	const char *(*version)(void);
	ape_backend_info bi;
	ape_device_info info;
	ape_selection sel;

	EXPECT_EQ(APE_BACKEND_ABI_MAJOR, t->abi_major);
	EXPECT_EQ(APE_BACKEND_ABI_MINOR, t->abi_minor);
	EXPECT_EQ(sizeof(struct ape_backend_plugin), t->struct_size);
	EXPECT_STREQ("example", t->name);
	ASSERT_NE(NULL, t->proc_address);
	*(void **)&version = t->proc_address("example_version");
	ASSERT_NE(NULL, version);
	EXPECT_STREQ("1.0", version());
	EXPECT_EQ(NULL, t->proc_address("attention_merge"));

	example_info(&self->x, &bi);
	EXPECT_STREQ("example", bi.name);
	EXPECT_TRUE(bi.available) TH_LOG("%s", bi.reason);
	EXPECT_EQ(1, bi.device_count);
	ASSERT_EQ(0, ape_device_get_info(self->x.dev, &info));
	EXPECT_STREQ("example", info.backend);
	EXPECT_EQ(APE_DEVICE_CPU, info.kind);
	EXPECT_EQ(0, info.backend_index);
	EXPECT_LT(0u, info.global_mem_bytes);
	EXPECT_EQ(APE_BE_CAP_BACKWARD | APE_BE_CAP_TIMESTAMPS | APE_BE_CAP_BIAS_TABLE,
		  self->x.dev->caps.features);
	ASSERT_EQ(0, ape_device_select(self->x.ctx, "auto", -1, &sel));
	EXPECT_EQ(self->x.ref, sel.device) TH_LOG("%s", sel.note);
}

/* No device (APE_EXAMPLE_DEVICES=0, or a value it does not take): the backend is listed with
 * its reason and the rest of libape works; a device of 64 KiB: the core streams within it, and
 * an allocation beyond it fails with the message the core names with the device and the op. */
TEST(configuration_and_failures)
{
	static const struct {
		const char *value, *reason;
	} none[] = {
		{ "0", "APE_EXAMPLE_DEVICES=0: no device" },
		{ "5", "APE_EXAMPLE_DEVICES: expected 0 to 4" },
	};
	const test_problem_shape sh = { 1, 2, 1, 300, 300, 32 };
	test_problem tp, want;
	ape_backend_info bi;
	ape_buffer *buf = NULL;
	struct ex x;
	ape_stats st;
	ape_rng rng;

	for (size_t i = 0; i < sizeof(none) / sizeof(none[0]); i++) {
		setenv("APE_EXAMPLE_DEVICES", none[i].value, 1);
		ASSERT_EQ(0, ex_open(&x));
		EXPECT_EQ(NULL, x.dev);
		example_info(&x, &bi);
		EXPECT_FALSE(bi.available);
		EXPECT_EQ(0, bi.device_count);
		EXPECT_NE(NULL, strstr(bi.reason, none[i].reason)) TH_LOG("\"%s\"", bi.reason);
		ex_close(&x);
	}
	unsetenv("APE_EXAMPLE_DEVICES");

	setenv("APE_EXAMPLE_MEM", "65536", 1);
	ASSERT_EQ(0, ex_open(&x));
	ASSERT_NE(NULL, x.dev);
	EXPECT_EQ(65536u, x.dev->info.global_mem_bytes);
	EXPECT_EQ(APE_ENOMEM, ape_buffer_alloc(x.dev, 65537, &buf));
	EXPECT_EQ(NULL, buf);
	EXPECT_NE(NULL, strstr(ape_last_error(), "example:0 ")) TH_LOG("%s", ape_last_error());
	EXPECT_NE(NULL, strstr(ape_last_error(), ": buf_alloc: 65537 bytes do not fit: "))
	TH_LOG("%s", ape_last_error());
	ASSERT_EQ(0, ape_buffer_alloc(x.dev, 65536, &buf)) TH_LOG("%s", ape_last_error());
	ape_buffer_free(buf);

	ape_rng_init(&rng, "configuration_and_failures");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_F32, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, x.ref));
	ape_stats_init(&st);
	ASSERT_EQ(0, test_problem_run_stats(&tp, x.dev, &st)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, check_forward(_metadata, &tp, &want, "64 KiB"));
	EXPECT_LT(1u, st.chunks);
	EXPECT_GE(65536u, st.peak_device_bytes);
	test_problem_free(&tp);
	test_problem_free(&want);
	ex_close(&x);
}

/* ---- docs/backends.md's build lines */

/*
 * docs/backends.md, "Building a plugin", as it stands: `make install PREFIX=$HOME/ape` into a
 * temporary HOME (make runs in the source tree with this build's variables, so that it neither
 * reconfigures nor rebuilds it), then the cc line in a copy of the example's folder. The plugin
 * it builds, from the installed headers and libape.so alone, loads and computes what the
 * reference does.
 */
TEST(guide_build_lines_work_against_an_install)
{
	static const char *const files[] = { "example_backend.c", "example_kernels.c",
					     "example.h" };
	const test_problem_shape sh = { 1, 4, 2, 13, 29, 16 };
	char dir[] = "/tmp/ape-plugin-XXXXXX", path[4200], *doc, *block, *script, *log;
	test_problem tp, want;
	void *lib;
	struct ex x;
	ape_rng rng;
	size_t len;

	doc = (char *)test_read_file(APE_SOURCE_DIR "/docs/backends.md", NULL);
	ASSERT_NE(NULL, doc);
	block = test_doc_block(doc, "example_backend.c example_kernels.c");
	ASSERT_NE(NULL, block) TH_LOG("docs/backends.md has no ```sh block building the example");
	EXPECT_NE(NULL, strstr(block, "make install")) TH_LOG("%s", block);
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/examples", dir);
	ASSERT_EQ(0, mkdir(path, 0755));
	snprintf(path, sizeof(path), "%s/examples/backend-plugin", dir);
	ASSERT_EQ(0, mkdir(path, 0755));
	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		char *text;

		snprintf(path, sizeof(path), "%s/examples/backend-plugin/%s", APE_SOURCE_DIR,
			 files[i]);
		text = (char *)test_read_file(path, NULL);
		ASSERT_NE(NULL, text) TH_LOG("%s", path);
		snprintf(path, sizeof(path), "%s/examples/backend-plugin/%s", dir, files[i]);
		ASSERT_EQ(0, test_write_text(path, text));
		free(text);
	}
	len = strlen(block) + 8192;
	script = malloc(len);
	ASSERT_NE(NULL, script);
	snprintf(script, len,
		 "set -ex\ncd '%s'\n"
		 "make() { command make --no-print-directory -C '%s' %s \"$@\"; }\n%s",
		 dir, APE_SOURCE_DIR, APE_MAKE_OVERRIDES, block);
	EXPECT_EQ(0, test_run_script(dir, "build", script, NULL)) TH_LOG("%s", script);
	snprintf(path, sizeof(path), "%s/log", dir);
	log = (char *)test_read_file(path, NULL);

	/* the installed libape.so first: the plugin needs it and has no run path */
	snprintf(path, sizeof(path), "%s/ape/lib/libape.so.%d", dir, APE_VERSION_MAJOR);
	lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	ASSERT_NE(NULL, lib) TH_LOG("%s\n%s", dlerror(), log ? log : "");
	snprintf(path, sizeof(path), "%s/examples/backend-plugin/libape-backend-example.so", dir);
	ASSERT_EQ(0, ex_open_at(&x, path)) TH_LOG("%s", log ? log : "");
	ASSERT_NE(NULL, x.dev);
	ape_rng_init(&rng, "guide_build_lines_work_against_an_install");
	ASSERT_EQ(0, test_problem_make(&tp, &rng, &sh, APE_BF16, false));
	test_problem_random_params(&tp, &rng);
	ASSERT_EQ(0, test_problem_clone(&want, &tp));
	ASSERT_EQ(0, test_problem_run(&want, x.ref));
	ASSERT_EQ(0, test_problem_run(&tp, x.dev)) TH_LOG("%s", ape_last_error());
	EXPECT_EQ(0, check_forward(_metadata, &tp, &want, "installed"));
	test_problem_free(&tp);
	test_problem_free(&want);
	ex_close(&x);
	dlclose(lib);
	test_rmtree(dir);
	free(log);
	free(script);
	free(block);
	free(doc);
}

TEST_HARNESS_MAIN
