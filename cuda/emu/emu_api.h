/* SPDX-License-Identifier: MIT */
/* The kernel emulator as the test driver (tests/fake_cuda) calls it, from C. */
#ifndef APE_CUDA_EMU_EMU_API_H
#define APE_CUDA_EMU_EMU_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The emulated kernel of that name, or NULL. */
void *ape_emu_find(const char *name);

/* Runs a whole grid on the calling thread, block after block; params[0] points at the kernel's
 * argument struct. 0, or -1 with a message (deadlock, divergent warp, misaligned copy...). */
int ape_emu_launch(void *kernel, const unsigned grid[3], const unsigned block[3],
		   size_t smem_bytes, void **params, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* APE_CUDA_EMU_EMU_API_H */
