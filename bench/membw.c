/* SPDX-License-Identifier: MIT */
/*
 * membw: how fast this machine's cores read memory, the ceiling of a decode step (which streams
 * K and V once). Reads a buffer of MB MiB (2 MiB-aligned, advised huge pages, as libape's large
 * OpenCL CPU buffers are) with T threads, each a contiguous share, ROUNDS times; prints the
 * fastest and the median round in ms and GB/s (10^9 bytes/s).
 *
 * usage: build/bench/membw [MB = 96] [T = number of online CPUs] [ROUNDS = 15]
 * (make bench-membw; built for this machine's instruction set, -march=native). 96 MiB =
 * 100.7 MB: K and V of H = 6, D = 64, Lk = 32768, float32. A round is timed from the first
 * thread's start to the last thread's end. A buffer under 4x the last-level cache is said to
 * count cache hits (the Xeon VMs here have 260 MiB of L3: 96 MiB read there at 50 GB/s, 1 GiB
 * at 27 GB/s); bench/pool_decode.py --membw auto reads as many bytes as its step.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

typedef uint64_t v8u __attribute__((vector_size(64))); /* GCC/clang vector: 64 bytes */

struct share {
	const v8u *p;
	size_t n; /* vectors */
	int rounds;
	pthread_barrier_t *bar; /* every thread and main meet before and after each round */
	double *t0, *t1; /* [rounds]: when this thread started and ended each round */
	uint64_t sum;
};

static double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Sums the share, round after round between two barriers, with four independent chains of
 * 64-byte vectors (so that loads, not adds, bound the loop). */
static void *reader(void *arg)
{
	struct share *s = arg;

	for (int r = 0; r < s->rounds; r++) {
		v8u a[4] = { { 0 } };

		pthread_barrier_wait(s->bar);
		s->t0[r] = now_s();
		for (size_t i = 0; i + 4 <= s->n; i += 4)
			for (int k = 0; k < 4; k++)
				a[k] += s->p[i + k];
		a[0] += a[1] + a[2] + a[3];
		for (int k = 0; k < 8; k++)
			s->sum += a[0][k];
		s->t1[r] = now_s();
		pthread_barrier_wait(s->bar);
	}
	return NULL;
}

static int arg_int(int argc, char **argv, int i, int def, int lo, int hi)
{
	char *end;
	long v;

	if (argc <= i)
		return def;
	v = strtol(argv[i], &end, 10);
	if (*end || end == argv[i] || v < lo || v > hi) {
		fprintf(stderr, "membw: argument %d = '%s': must be an integer in [%d, %d]\n", i,
			argv[i], lo, hi);
		exit(2);
	}
	return (int)v;
}

int main(int argc, char **argv)
{
	const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	const int mb = arg_int(argc, argv, 1, 96, 1, 1 << 16);
	const int nt = arg_int(argc, argv, 2, ncpu > 0 ? (int)ncpu : 1, 1, 1024);
	const int rounds = arg_int(argc, argv, 3, 15, 1, 100000);
	const size_t bytes = (size_t)mb << 20, nv = bytes / sizeof(v8u);
	struct share *sh = calloc((size_t)nt, sizeof(*sh));
	pthread_t *th = calloc((size_t)nt, sizeof(*th));
	double *t = calloc((size_t)rounds, sizeof(*t));
	pthread_barrier_t bar;
	v8u *buf = NULL;
	uint64_t check = 0;

	if (!sh || !th || !t || posix_memalign((void **)&buf, 2u << 20, bytes)) {
		fprintf(stderr, "membw: out of memory (%d MiB)\n", mb);
		return 1;
	}
	madvise(buf, bytes, MADV_HUGEPAGE); /* advice only: 4 KiB pages if refused */
	for (size_t i = 0; i < bytes / 8; i++)
		((uint64_t *)buf)[i] = i;
	pthread_barrier_init(&bar, NULL, (unsigned)nt + 1);
	for (int k = 0; k < nt; k++) {
		const size_t lo = nv * (size_t)k / (size_t)nt, hi = nv * (size_t)(k + 1) / (size_t)nt;

		sh[k] = (struct share){ buf + lo, hi - lo, rounds, &bar,
					calloc((size_t)rounds, sizeof(double)),
					calloc((size_t)rounds, sizeof(double)), 0 };
		if (!sh[k].t0 || !sh[k].t1 || pthread_create(&th[k], NULL, reader, &sh[k])) {
			fprintf(stderr, "membw: cannot start thread %d\n", k);
			return 1;
		}
	}
	for (int r = 0; r < 2 * rounds; r++)
		pthread_barrier_wait(&bar);
	for (int k = 0; k < nt; k++) {
		pthread_join(th[k], NULL);
		check += sh[k].sum;
	}
	/* a round: from the first thread's start to the last one's end */
	for (int r = 0; r < rounds; r++) {
		double lo = sh[0].t0[r], hi = sh[0].t1[r];

		for (int k = 1; k < nt; k++) {
			lo = sh[k].t0[r] < lo ? sh[k].t0[r] : lo;
			hi = sh[k].t1[r] > hi ? sh[k].t1[r] : hi;
		}
		t[r] = hi - lo;
	}
	{
		double best = t[0], med;

		for (int r = 1; r < rounds; r++)
			best = t[r] < best ? t[r] : best;
		med = bench_median(t, rounds);
		printf("membw: %d MiB (%.1f MB), %d threads, %d rounds: fastest %.2f ms (%.1f GB/s), "
		       "median %.2f ms (%.1f GB/s) [check %llx]\n",
		       mb, (double)bytes / 1e6, nt, rounds, best * 1e3, (double)bytes / best / 1e9,
		       med * 1e3, (double)bytes / med / 1e9, (unsigned long long)check);
	}
	{
		/* what a read of memory means here: past the last-level cache (a 96 MiB buffer fits
		 * in some VMs' 260 MiB L3, and reads twice as fast as memory there) */
		long llc = sysconf(_SC_LEVEL4_CACHE_SIZE);

		if (llc <= 0)
			llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
		if (llc > 0 && bytes < 4 * (size_t)llc)
			printf("membw: note: %d MiB is less than 4x this machine's last-level cache "
			       "(%ld MiB): the figure counts cache hits; a read of memory needs %ld "
			       "MiB or more\n",
			       mb, llc >> 20, (4 * llc) >> 20);
	}
	pthread_barrier_destroy(&bar);
	for (int k = 0; k < nt; k++) {
		free(sh[k].t0);
		free(sh[k].t1);
	}
	free(buf);
	free(sh);
	free(th);
	free(t);
	return 0;
}
