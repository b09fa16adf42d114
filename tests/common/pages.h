/* SPDX-License-Identifier: MIT */
/*
 * What the kernel says about memory and threads, asked directly (get_mempolicy, move_pages,
 * sched_getaffinity) and not through hwloc, so that tests check libape's placement against an
 * independent witness.
 */
#ifndef APE_TEST_PAGES_H
#define APE_TEST_PAGES_H

#include <stddef.h>
#include <stdint.h>

/* Kernel memory policies (linux/mempolicy.h). */
enum { TEST_MPOL_DEFAULT = 0, TEST_MPOL_PREFERRED = 1, TEST_MPOL_BIND = 2,
       TEST_MPOL_INTERLEAVE = 3 };

/* The policy of the page holding `addr` and its node mask (nodes 0-63). 0 or -errno. */
int test_page_policy(const void *addr, int *mode, uint64_t *nodemask);

/* The node the (touched) page holding `addr` lives on, or -errno. */
int test_page_node(const void *addr);

/* The nodes of every page of [p, p + len), in list format ("0", "0-1"). 0 or -errno. */
int test_area_nodes(const void *p, size_t len, char *list, size_t cap);

/* A node mask in list format. */
void test_mask_list(uint64_t mask, char *list, size_t cap);

/* The calling thread's CPU affinity in list format ("0-7,16-23"). 0 or -errno. */
int test_affinity_list(char *list, size_t cap);

#endif
