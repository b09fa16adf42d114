/* SPDX-License-Identifier: MIT */
/*
 * The limits every layer must agree on, in one place: the head dimension, how many devices one
 * call may use, and how many chunks may be in flight on one device. The first two are public
 * (APE_MAX_D and APE_MAX_DEVICES in ape/ape.h, included here), since callers size their rows
 * and device arrays by them; kernels get APE_MAX_D as a build option (opencl/ocl_program.c) or
 * from ape/ape.h (the CUDA kernels' args.h).
 */
#ifndef APE_RUNTIME_LIMITS_H
#define APE_RUNTIME_LIMITS_H

#include "ape/ape.h"

/*
 * Most (query chunk, key chunk) launches in flight per device: ape_exec_options.pipeline_depth
 * is 1..APE__MAX_DEPTH. Three slots are what overlap needs (the copy of chunk i + 1, the kernel
 * of chunk i, the read-back of chunk i - 1); the executor sizes its queue and buffer arrays by
 * it.
 */
#define APE__MAX_DEPTH 3
/* The depth a call gets when it does not ask for one (pipeline_depth = 0). */
#define APE__DEFAULT_DEPTH APE__MAX_DEPTH

#endif
