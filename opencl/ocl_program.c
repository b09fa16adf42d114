/* SPDX-License-Identifier: MIT */
/*
 * Programs: chosen per device (tile shapes from its limits), built lazily per D specialisation,
 * cached on disk as binaries (runtime/core/progcache.c) and kept for the context's life. The
 * cached variant used last (or those APE_OCL_PRELOAD names) is loaded when the device is opened
 * (ape__ocl_program_preload(), ape_context_create()), not in the first call: loading a binary
 * is PoCL parsing the program's LLVM bitcode, about 45 ms on a 2-core Xeon for every variant,
 * which made a fresh process's first call 2-5x its kernels' time (bench/RESULTS.md, 2026-12-06).
 *
 * Build options: none beyond the shape. Measured on PoCL 3.1 (150 random f32 cases against the
 * reference, NaN/Inf cases, dense L = 4096): -cl-mad-enable, -cl-fast-relaxed-math,
 * -cl-finite-math-only, -cl-unsafe-math-optimizations and -cl-denorms-are-zero all left the
 * results bit for bit the same (worst O error 2.3e-5 x max|V|, LSE 4.1e-5, NaN rows intact)
 * and the speed within noise: the kernel already writes fma() and vector code where it
 * matters. They stay out because they buy nothing here and license other compilers to break
 * the spec: -cl-finite-math-only (implied by -cl-fast-relaxed-math) lets isfinite() fold to
 * true, and then an Inf score would vanish instead of turning its row into NaN.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ocl.h"
#include "ocl_fast.h"

/* Ahead of ape_math.h: the arithmetic of the per-row and per-seed code (float64 when present). */
/* The prelude of every program. Clang (PoCL's compiler) reports each '#pragma unroll' it could
 * not honour (a row loop with an early exit, in some of the decode's row counts) as a warning,
 * and PoCL prints the count on the application's stderr at every build: the kernels ask for
 * unrolling as a hint, so that report is silenced. */
static const char ocl_prelude[] = "#ifdef __clang__\n"
				  "#pragma clang diagnostic ignored \"-Wpass-failed\"\n"
				  "#endif\n"
				  "#if APE_FP64\n"
				  "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
				  "#define APE_REAL double\n"
				  "#else\n"
				  "#define APE_REAL float\n"
				  "#endif\n";

static int ocl_variant(int64_t D)
{
	return D == 64 ? APE__OCL_D64 : D == 128 ? APE__OCL_D128 : APE__OCL_DGEN;
}

static int ocl_variant_dmax(int v)
{
	return v == APE__OCL_D64 ? 64 : v == APE__OCL_D128 ? 128 : APE_MAX_D;
}

/* Local memory the kernel declares for a shape (kernels/attention.cl: kv, ttab, btab, rawtab,
 * slots), with float64 tables. */
static size_t ocl_local_bytes(const struct ape__ocl_tuning *t, int dmax)
{
	size_t bq = (size_t)(t->rw * t->rg * t->nwi), kv = 2 * (size_t)t->bk * (size_t)dmax;
	size_t stage = t->rw > 1 ? bq * (size_t)dmax : 0;

	return 4 * ((kv > stage ? kv : stage) + 2 * (bq + (size_t)t->bk) + 2 * (size_t)t->nwi) +
	       8 * 4 * (bq + (size_t)t->bk);
}

/*
 * APE_OCL_TUNE="rw,rg,nwi,bk,sb" replaces the shape chosen below: for tuning experiments, and so
 * that the tests run the GPU-shaped kernel (one row per work-item, barriers) on a CPU device.
 * A value the kernel cannot take is refused with a warning; local memory still bounds it.
 * Its twin for the separable path: APE_OCL_SEP_SHAPE=gpu gives a CPU device the separable
 * path's work-group kernel (ocl_separable.c, sep_wg_shape(); read at each launch, no rebuild).
 */
static void ocl_tune_override(const struct ape__ocl_device *od, struct ape__ocl_tuning *t)
{
	const char *e = getenv("APE_OCL_TUNE");
	struct ape__ocl_tuning o;

	if (!e || !*e)
		return;
	if (sscanf(e, "%d,%d,%d,%d,%d", &o.rw, &o.rg, &o.nwi, &o.bk, &o.sb) != 5 ||
	    !(o.rw == 1 || o.rw == 2 || o.rw == 4 || o.rw == 8 || o.rw == 16) || o.rg < 1 ||
	    o.rg > 16 || o.nwi < 1 || (size_t)o.nwi > od->max_wg || o.sb < 1 || o.sb > 16 ||
	    o.bk > 64 || o.bk < o.sb || o.bk % o.sb) {
		/* sb = 32 crashes LLVM 15's inliner inside PoCL 3.1: not offered */
		ape_be_warn("APE_OCL_TUNE=\"%s\" ignored: expected rw,rg,nwi,bk,sb with rw one of "
			  "1, 2, 4, 8, 16, rg <= 16, nwi <= %zu, sb <= 16 dividing bk, bk <= 64",
			  e, od->max_wg);
		return;
	}
	*t = o;
}

/*
 * Tile shapes from the device's properties (measured on PoCL 3.1, 2-core Zen 4, D = 64):
 * CPU: the rows are the lanes of a float vector as wide as the device prefers (16 with AVX-512):
 * PoCL turns each float16 operation into one zmm instruction, where its own vectorisation across
 * work-items of scalar code gave a third of the speed (NOTES.md). One work-item owns 4 such row
 * vectors (64 rows) and shares its K/V tile with no one, so the kernel has no barrier: 4
 * work-items of 16 rows sharing a tile ran at the same speed but took 4 to 30 times longer to
 * compile (PoCL replicates the code around barriers in loops); 2 row vectors per work-item were
 * 7% slower (each tile load serves fewer rows), 8 were 3% faster dense but skipped less finely.
 * Keys per tile: 64, the longest recurrence the accuracy budget allows (32 was 30% slower: the
 * seeds and distance tables serve half as many keys), halved until the tile fits in local
 * memory. GPU and others: one row per work-item, 64 work-items (or the device maximum).
 */
static void ocl_tune(const struct ape__ocl_device *od, int dmax, struct ape__ocl_tuning *t)
{
	if (od->type & CL_DEVICE_TYPE_CPU) {
		t->rw = od->vec_float >= 16 ? 16 : od->vec_float >= 8 ? 8 : 4;
		t->rg = 64 / t->rw;
		t->sb = 4; /* measured: 8 score vectors were 4% slower, 16 (they spill) 8% */
		t->nwi = 1;
	} else {
		t->rw = 1;
		t->rg = 1;
		t->sb = 16;
		t->nwi = 64;
	}
	t->bk = 64;
	ocl_tune_override(od, t);
	while ((size_t)t->nwi > od->max_wg && t->nwi > 1)
		t->nwi /= 2;
	while (t->bk / 2 >= t->sb && t->bk / 2 % t->sb == 0 &&
	       ocl_local_bytes(t, dmax) > od->local_mem)
		t->bk /= 2;
	while (t->nwi > 1 && ocl_local_bytes(t, dmax) > od->local_mem)
		t->nwi /= 2;
}

static void ocl_options(const struct ape__ocl_device *od, int v, const struct ape__ocl_tuning *t,
			char *buf, size_t cap)
{
	snprintf(buf, cap,
		 "-cl-std=CL1.2 -DAPE_D=%d -DAPE_RW=%d -DAPE_RG=%d -DAPE_NWI=%d -DAPE_BK=%d "
		 "-DAPE_SB=%d -DAPE_FP64=%d -DAPE_MAX_D=%d",
		 v == APE__OCL_DGEN ? 0 : ocl_variant_dmax(v), t->rw, t->rg, t->nwi, t->bk, t->sb,
		 od->fp64, APE_MAX_D);
}

/* The hash of the programs' whole source (160 KB, about a millisecond byte by byte): once. */
static uint64_t ocl_src_hash;
static pthread_once_t ocl_src_once = PTHREAD_ONCE_INIT;

static void ocl_src_hash_init(void)
{
	uint64_t h = APE_BE_HASH64_INIT;

	h = ape_be_hash64(ocl_prelude, strlen(ocl_prelude), h);
	h = ape_be_hash64(ape__ocl_src_math, strlen(ape__ocl_src_math), h);
	h = ape_be_hash64(ape__ocl_src_attention, strlen(ape__ocl_src_attention), h);
	h = ape_be_hash64(ape__ocl_src_bwd_layout, strlen(ape__ocl_src_bwd_layout), h);
	h = ape_be_hash64(ape__ocl_src_backward, strlen(ape__ocl_src_backward), h);
	h = ape_be_hash64(ape__ocl_src_decode, strlen(ape__ocl_src_decode), h);
	h = ape_be_hash64(ape__ocl_src_separable, strlen(ape__ocl_src_separable), h);
	ocl_src_hash = h;
}

/* Everything a binary depends on: platform, device, driver, the exact source, the options. */
static void ocl_cache_key(const struct ape__ocl_device *od, const char *opts, char *buf,
			  size_t cap)
{
	uint64_t h;

	pthread_once(&ocl_src_once, ocl_src_hash_init);
	h = ocl_src_hash;
	snprintf(buf, cap,
		 "libape opencl program 1\nplatform: %s\nplatform version: %s\ndevice: %s\n"
		 "driver: %s\nsource fnv1a64: %016llx\noptions: %s\n",
		 od->platform_name, od->platform_version, od->name, od->driver,
		 (unsigned long long)h, opts);
}

/* The first part of the build log, for the error message. */
static void ocl_build_log(const struct ape__ocl_device *od, cl_program prog, char *buf, size_t cap)
{
	size_t n = 0;

	buf[0] = '\0';
	if (clGetProgramBuildInfo(prog, od->id, CL_PROGRAM_BUILD_LOG, 0, NULL, &n) != CL_SUCCESS)
		return;
	if (n <= cap) {
		if (clGetProgramBuildInfo(prog, od->id, CL_PROGRAM_BUILD_LOG, cap, buf, NULL) !=
		    CL_SUCCESS)
			buf[0] = '\0';
	} else {
		char *all = ape_be_malloc(n);

		if (all && clGetProgramBuildInfo(prog, od->id, CL_PROGRAM_BUILD_LOG, n, all,
						 NULL) == CL_SUCCESS)
			snprintf(buf, cap, "%s", all);
		free(all);
	}
	buf[cap - 1] = '\0';
}

/*
 * The kernels exist and the attention kernel fits the device as built (a GPU may allow fewer
 * work-items per group than tuned once registers are counted); a cached binary that fails this
 * is rebuilt. The work-group size is asked only when it can matter: PoCL compiles a work-group
 * function to answer it, seconds of work that the first launch repeats for its own sizes.
 */
static int ocl_check_kernels(const struct ape__ocl_device *od, cl_program prog,
			     const struct ape__ocl_tuning *t)
{
	static const char *const names[] = { "ape_attention", "ape_kmax", "ape_kscan",
					       "ape_kv_prep", "ape_merge", "ape_bwd_prep", "ape_bwd_dist",
					       "ape_bwd_rows", "ape_bwd_fused", "ape_bwd_sep",
					       "ape_bwd_reduce", "ape_bwd_params", "ape_copy_view" };

	const size_t nk = sizeof(names) / sizeof(names[0]);

	for (size_t i = 0; i < nk; i++) {
		cl_int err;
		cl_kernel k = clCreateKernel(prog, names[i], &err);
		size_t wg = 0;

		if (!k)
			return -1;
		if (i == 0 && t->nwi > 1) {
			err = clGetKernelWorkGroupInfo(k, od->id, CL_KERNEL_WORK_GROUP_SIZE,
						       sizeof(wg), &wg, NULL);
			if (err != CL_SUCCESS || wg < (size_t)t->nwi) {
				clReleaseKernel(k);
				return -1;
			}
		}
		clReleaseKernel(k);
	}
	return 0;
}

static void ocl_count(struct ape__ocl_device *od, unsigned *counter)
{
	pthread_mutex_lock(&od->lock);
	(*counter)++;
	pthread_mutex_unlock(&od->lock);
}

/* The program of `key` from the cache, or NULL; *refused (when not NULL) is set when an entry
 * was there but could not be used (counted in cache_rejects). */
static cl_program ocl_from_cache(struct ape__ocl_device *od, const char *key, const char *opts,
				 const struct ape__ocl_tuning *t, bool *refused)
{
	void *blob;
	size_t len;
	cl_int err, status;
	cl_program prog;
	int ret = ape_be_cache_load(key, &blob, &len);

	if (ret != APE_BE_CACHE_HIT) {
		if (ret == APE_BE_CACHE_REJECTED) {
			ocl_count(od, &od->counters.cache_rejects);
			if (refused)
				*refused = true;
		}
		return NULL;
	}
	prog = clCreateProgramWithBinary(od->ctx, 1, &od->id, &len,
					 (const unsigned char **)&blob, &status, &err);
	free(blob);
	if (prog && (clBuildProgram(prog, 1, &od->id, opts, NULL, NULL) != CL_SUCCESS ||
		     ocl_check_kernels(od, prog, t))) {
		clReleaseProgram(prog);
		prog = NULL;
	}
	if (!prog) {
		/* the driver refused it: rebuild and overwrite */
		ocl_count(od, &od->counters.cache_rejects);
		if (refused)
			*refused = true;
		return NULL;
	}
	ocl_count(od, &od->counters.cache_hits);
	return prog;
}

/* PoCL compiles a generic work-group function of every kernel to hand out a binary (2.5 s for
 * the attention kernel): worth it only when the binary will really be stored. */
static void ocl_to_cache(struct ape__ocl_device *od, cl_program prog, const char *key)
{
	size_t len = 0;
	unsigned char *bin;

	if (!ape_be_cache_usable())
		return;
	if (clGetProgramInfo(prog, CL_PROGRAM_BINARY_SIZES, sizeof(len), &len, NULL) !=
		    CL_SUCCESS ||
	    len == 0)
		return;
	bin = ape_be_malloc(len);
	if (!bin)
		return;
	if (clGetProgramInfo(prog, CL_PROGRAM_BINARIES, sizeof(bin), &bin, NULL) == CL_SUCCESS &&
	    ape_be_cache_store(key, bin, len) == 0)
		ocl_count(od, &od->counters.cache_writes);
	free(bin);
}

static int ocl_from_source(struct ape_device *dev, int v, const char *opts,
			   const struct ape__ocl_tuning *t, cl_program *out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	const char *srcs[] = { ocl_prelude, ape__ocl_src_math, ape__ocl_src_attention,
			       ape__ocl_src_bwd_layout, ape__ocl_src_backward,
			       ape__ocl_src_decode, ape__ocl_src_separable };
	cl_program prog;
	cl_int err;

	prog = clCreateProgramWithSource(od->ctx, sizeof(srcs) / sizeof(srcs[0]), srcs, NULL, &err);
	if (!prog)
		return ape__ocl_error(err, "clCreateProgramWithSource");
	err = clBuildProgram(prog, 1, &od->id, opts, NULL, NULL);
	if (err != CL_SUCCESS) {
		char log[1536];
		int ret;

		ocl_build_log(od, prog, log, sizeof(log));
		ret = ape_be_error(ape__ocl_err_code(err),
				 "building the attention kernel (D %s, options \"%s\"): "
				 "%s (%d): %s",
				 v == APE__OCL_DGEN ? "generic" : "specialised",
				 opts, ape__ocl_err_name(err), (int)err, log);
		clReleaseProgram(prog);
		return ret;
	}
	ocl_count(od, &od->counters.builds);
	if (ocl_check_kernels(od, prog, t)) {
		clReleaseProgram(prog);
		return 1; /* built, but does not fit as tuned: caller retries smaller */
	}
	*out = prog;
	return 0;
}

/* Called with the variant's lock held. */
static int ocl_build(struct ape_device *dev, int v)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	struct ape__ocl_tuning t;
	char opts[256], key[1024];
	cl_program prog = NULL;
	int ret;

	ocl_tune(od, ocl_variant_dmax(v), &t);
	for (;;) {
		ocl_options(od, v, &t, opts, sizeof(opts));
		ocl_cache_key(od, opts, key, sizeof(key));
		/* an entry the preload refused is not read again: it is rebuilt and replaced */
		prog = od->progs[v].cache_refused ? NULL : ocl_from_cache(od, key, opts, &t, NULL);
		od->progs[v].cache_refused = false;
		if (prog) {
			ape_be_cache_touch(key); /* used: the next process preloads it */
			break;
		}
		ret = ocl_from_source(dev, v, opts, &t, &prog);
		if (ret < 0)
			return ret;
		if (ret == 0) {
			ocl_to_cache(od, prog, key);
			break;
		}
		/* the compiled kernel needs more per-work-item resources than the device has
		 * for this work-group size (GPU registers): fewer work-items per group */
		if (t.nwi == 1)
			return ape_be_error(APE_EBUILD,
					  "the attention kernel cannot run even with one work-item "
					  "per work-group");
		t.nwi /= 2;
	}
	od->progs[v].prog = prog;
	od->progs[v].t = t;
	return 0;
}

/*
 * Which variants APE_OCL_PRELOAD (see ocl.h) asks for: a bit per variant in *want; returns true
 * when only the most recently used of them should be loaded (the default).
 */
static bool ocl_preload_wanted(unsigned *want)
{
	const char *e = getenv("APE_OCL_PRELOAD");
	const char *p;

	*want = 0;
	if (!e || !*e || !strcmp(e, "1")) {
		*want = (1u << APE__OCL_NVARIANTS) - 1;
		return true;
	}
	if (!strcmp(e, "all")) {
		*want = (1u << APE__OCL_NVARIANTS) - 1;
		return false;
	}
	for (p = e; *p;) { /* "0" loads nothing; anything malformed neither, said once */
		char *end;
		long d = strtol(p, &end, 10);

		if (end == p || (*end && *end != ',') || (d != 0 && (d < 2 || d > APE_MAX_D || d % 2))) {
			ape_be_warn("APE_OCL_PRELOAD=\"%s\" ignored: expected 1, all, 0 or even head "
				  "dimensions up to %d (\"64,128\")",
				  e, APE_MAX_D);
			*want = 0;
			break;
		}
		if (d > 0 && d <= APE_MAX_D && d % 2 == 0)
			*want |= 1u << ocl_variant(d);
		p = *end ? end + 1 : end;
	}
	return false;
}

/* The tuning, options and cache key variant v is first built with (ocl_build's first try). */
static void ocl_first_key(const struct ape__ocl_device *od, int v, struct ape__ocl_tuning *t,
			  char *opts, size_t opts_cap, char *key, size_t key_cap)
{
	ocl_tune(od, ocl_variant_dmax(v), t);
	ocl_options(od, v, t, opts, opts_cap);
	ocl_cache_key(od, opts, key, key_cap);
}

void ape__ocl_program_preload(struct ape__ocl_device *od)
{
	struct ape__ocl_tuning t;
	char opts[256], key[1024];
	unsigned want;
	const bool latest = ocl_preload_wanted(&want);

	if (latest) {
		/* the variant whose entry was used last (a load renews its time, ocl_build): the
		 * head dimension this machine's last process computed with, which a process that
		 * never touches the others does not pay to load */
		struct timespec best = { 0, 0 }, when;
		int pick = -1;

		for (int v = 0; v < APE__OCL_NVARIANTS; v++) {
			ocl_first_key(od, v, &t, opts, sizeof(opts), key, sizeof(key));
			if (!ape_be_cache_used(key, &when))
				continue;
			if (pick < 0 || when.tv_sec > best.tv_sec ||
			    (when.tv_sec == best.tv_sec && when.tv_nsec > best.tv_nsec)) {
				best = when;
				pick = v;
			}
		}
		want = pick < 0 ? 0 : 1u << pick;
	}
	for (int v = 0; v < APE__OCL_NVARIANTS; v++) {
		cl_program prog;
		bool refused = false;

		if (!(want & (1u << v)))
			continue;
		ocl_first_key(od, v, &t, opts, sizeof(opts), key, sizeof(key));
		pthread_mutex_lock(&od->progs[v].lock);
		if (!od->progs[v].prog) {
			prog = ocl_from_cache(od, key, opts, &t, &refused);
			if (prog) {
				od->progs[v].prog = prog;
				od->progs[v].t = t;
				ocl_count(od, &od->counters.preloads);
			}
			od->progs[v].cache_refused = refused;
		}
		pthread_mutex_unlock(&od->progs[v].lock);
	}
}

int ape__ocl_program_get(struct ape_device *dev, int64_t D, const struct ape__ocl_program **out)
{
	struct ape__ocl_device *od = ape__ocl_dev(dev);
	const int v = ocl_variant(D);
	int ret = 0;

	/* one lock per variant: a thread building D = 128 does not hold up one running D = 64 */
	pthread_mutex_lock(&od->progs[v].lock);
	if (!od->progs[v].prog)
		ret = ocl_build(dev, v);
	pthread_mutex_unlock(&od->progs[v].lock);
	if (!ret)
		*out = &od->progs[v];
	return ret;
}

void ape__ocl_debug_cache_key(const struct ape_device *dev, int64_t D, char *buf, unsigned cap)
{
	struct ape__ocl_device *od;
	struct ape__ocl_tuning t;
	char opts[256];
	int v = ocl_variant(D);

	buf[0] = '\0';
	if (!dev || strcmp(dev->info.backend, "opencl"))
		return;
	od = ape__ocl_dev(dev);
	pthread_mutex_lock(&od->progs[v].lock);
	if (od->progs[v].prog)
		t = od->progs[v].t;
	else
		ocl_tune(od, ocl_variant_dmax(v), &t);
	pthread_mutex_unlock(&od->progs[v].lock);
	ocl_options(od, v, &t, opts, sizeof(opts));
	ocl_cache_key(od, opts, buf, cap);
}
