/* SPDX-License-Identifier: MIT */
#ifndef APE_RUNTIME_CONTEXT_H
#define APE_RUNTIME_CONTEXT_H

#include "backend.h"

#pragma GCC visibility push(hidden)

#define APE__MAX_BACKENDS 8

struct ape__ctx_backend {
	struct ape__backend be;
	bool probed; /* probe ran: teardown is owed */
	struct ape_backend_info info;
};

struct ape_context {
	unsigned flags; /* APE_CONTEXT_* */
	int nbackends;
	struct ape__ctx_backend backends[APE__MAX_BACKENDS];
	int ndevices, cap;
	struct ape_device **devices; /* sorted by rank, then probe order */
};

#pragma GCC visibility pop
#endif
