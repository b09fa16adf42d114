/* SPDX-License-Identifier: MIT */
/*
 * The host-side limits every layer must agree on, in one place: how many devices one call may
 * use, and how many chunks may be in flight on one device. The device limit is public
 * (APE_MAX_DEVICES in ape/ape.h), since callers size their device arrays by it.
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
