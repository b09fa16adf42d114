/* SPDX-License-Identifier: MIT */
/*
 * The backends a test can run on, and the CUDA one without a GPU: where the build has the CUDA
 * backend, a test child selects the fake driver that runs the real kernels on the CPU
 * (tests/fake_cuda with cuda/emu, built by `make`), unless APE_TEST_CUDA_DEVICE=1 asks for this
 * machine's own driver and GPU. The driver is chosen when a context loads the backend, so the
 * selection comes before ape_context_create().
 */
#ifndef APE_TEST_BACKENDS_H
#define APE_TEST_BACKENDS_H

#include <stdbool.h>
#include <stddef.h>

#include "ape/ape.h"

/* The emulated driver (cuda/module.mk builds it where the CUDA backend is built). */
#define TEST_CUDA_EMU_LIB APE_BUILD_DIR "/tests/cuda_emu/libcuda.so.1"

/* Room for a reason a backend cannot run. */
#define TEST_WHY_LEN 512

/*
 * Makes this process ready to create a context that loads `backend` ("ref", "opencl", "cuda"):
 * for "cuda", points APE_CUDA_LIBRARY at the emulated driver, whose behaviour is then the
 * default one (FAKE_CUDA_MODE as `fake_mode`, NULL for none; FAKE_CUDA_MEM unset). Returns 0,
 * or -1 with the reason the backend cannot run in this test in `why` (the emulator under
 * valgrind, or missing).
 */
int test_backend_prepare(const char *backend, const char *fake_mode, char *why, size_t cap);

/* True when "cuda" runs on the emulator here: slow, one fiber per GPU thread, so tests give it
 * smaller shapes. */
bool test_cuda_emulated(void);

/* The note a test prints for `backend` when it has no device in ctx: "no opencl device: <the
 * reason ape_backend_get_info() gives>". Returns why. */
const char *test_backend_absent(ape_context *ctx, const char *backend, char *why, size_t cap);

#endif
