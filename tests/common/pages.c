/* SPDX-License-Identifier: MIT */
#include "pages.h"

#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MPOL_F_ADDR_ (1 << 1)

int test_page_policy(const void *addr, int *mode, uint64_t *nodemask)
{
	unsigned long mask[16] = { 0 }; /* the kernel may have up to 1024 possible nodes */

	if (syscall(SYS_get_mempolicy, mode, mask, 1024UL, addr, MPOL_F_ADDR_))
		return -errno;
	*nodemask = mask[0];
	return 0;
}

int test_page_node(const void *addr)
{
	void *page = (void *)((uintptr_t)addr & ~(uintptr_t)(sysconf(_SC_PAGESIZE) - 1));
	int status = -1;

	/* nodes = NULL: move nothing, report where the page is */
	if (syscall(SYS_move_pages, 0, 1UL, &page, NULL, &status, 0))
		return -errno;
	return status;
}

/* "0-1,5" from a membership test over 0..n-1. */
static void to_list(bool (*in)(int, const void *), const void *arg, int n, char *list, size_t cap)
{
	size_t len = 0;

	list[0] = '\0';
	for (int i = 0; i < n; i++) {
		int j = i;

		if (!in(i, arg))
			continue;
		while (j + 1 < n && in(j + 1, arg))
			j++;
		if (len < cap)
			len += (size_t)(j > i ? snprintf(list + len, cap - len, "%s%d-%d",
							 len ? "," : "", i, j)
					      : snprintf(list + len, cap - len, "%s%d",
							 len ? "," : "", i));
		i = j;
	}
}

static bool in_mask(int i, const void *arg)
{
	return (*(const uint64_t *)arg >> i) & 1;
}

void test_mask_list(uint64_t mask, char *list, size_t cap)
{
	to_list(in_mask, &mask, 64, list, cap);
}

int test_area_nodes(const void *p, size_t len, char *list, size_t cap)
{
	const size_t page = (size_t)sysconf(_SC_PAGESIZE);
	uint64_t mask = 0;

	for (size_t off = 0; off < len; off += page) {
		int node = test_page_node((const char *)p + off);

		if (node < 0)
			return node;
		if (node < 64)
			mask |= 1ull << node;
	}
	test_mask_list(mask, list, cap);
	return 0;
}

static bool in_cpuset(int i, const void *arg)
{
	return CPU_ISSET(i, (const cpu_set_t *)arg);
}

int test_affinity_list(char *list, size_t cap)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	if (sched_getaffinity(0, sizeof(set), &set))
		return -errno;
	to_list(in_cpuset, &set, CPU_SETSIZE, list, cap);
	return 0;
}
