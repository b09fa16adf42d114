/* SPDX-License-Identifier: MIT */
/*
 * Whether this machine has an OpenCL platform at all, asked in a child process: PoCL starts
 * threads when a context loads it, and the test harness forks every test from the process that
 * asks, where those threads would not exist.
 */
#ifndef APE_TEST_OPENCL_PRESENT_H
#define APE_TEST_OPENCL_PRESENT_H

/* 0: an OpenCL platform answers; 4: none at all (the test program then skips, exit code 4);
 * 1: something else is wrong (the tests then run and fail). Only with APE_HAVE_OPENCL. */
int test_opencl_platform_present(void);

#endif
