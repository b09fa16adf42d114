/* SPDX-License-Identifier: MIT */
/*
 * The kernels as nvcc built them (cuda/module.mk), embedded so that the library has no file-path
 * dependency; cuda/kernels/*.cu stay the one source of truth. The assembler finds the fatbins
 * through -Wa,-I (the build directory). cuModuleLoadData wants each image 8-byte aligned.
 */
#define EMBED(sym, file)                                                                           \
	.global sym;                                                                               \
	.hidden sym;                                                                               \
	.type sym, @object;                                                                        \
	.balign 64;                                                                                \
sym:                                                                                               \
	.incbin file;                                                                              \
	.size sym, .- sym

	.section .rodata
EMBED(ape__cu_fatbin_prep, "prep.fatbin")
EMBED(ape__cu_fatbin_window, "window.fatbin")
EMBED(ape__cu_fatbin_decode, "decode.fatbin")
EMBED(ape__cu_fatbin_prefill, "prefill.fatbin")
EMBED(ape__cu_fatbin_backward, "backward.fatbin")
EMBED(ape__cu_fatbin_separable, "separable.fatbin")

	/* no executable stack */
	.section .note.GNU-stack,"",@progbits
