/* SPDX-License-Identifier: MIT */
/*
 * The kernel sources, embedded at build time so that the library has no file-path dependency;
 * the .cl files stay the one source of truth (opencl/module.mk rebuilds this when they change).
 * Each string is NUL-terminated for clCreateProgramWithSource.
 */
	.section .rodata
	.global ape__ocl_src_attention
	.hidden ape__ocl_src_attention
	.type ape__ocl_src_attention, @object
ape__ocl_src_attention:
	.incbin "opencl/kernels/attention.cl"
	.byte 0
	.size ape__ocl_src_attention, . - ape__ocl_src_attention

	.global ape__ocl_src_math
	.hidden ape__ocl_src_math
	.type ape__ocl_src_math, @object
ape__ocl_src_math:
	.incbin "include/ape/ape_math.h"
	.byte 0
	.size ape__ocl_src_math, . - ape__ocl_src_math

	.global ape__ocl_src_bwd_layout
	.hidden ape__ocl_src_bwd_layout
	.type ape__ocl_src_bwd_layout, @object
ape__ocl_src_bwd_layout:
	.incbin "opencl/kernels/bwd_layout.h"
	.byte 0
	.size ape__ocl_src_bwd_layout, . - ape__ocl_src_bwd_layout

	.global ape__ocl_src_backward
	.hidden ape__ocl_src_backward
	.type ape__ocl_src_backward, @object
ape__ocl_src_backward:
	.incbin "opencl/kernels/backward.cl"
	.byte 0
	.size ape__ocl_src_backward, . - ape__ocl_src_backward

	.global ape__ocl_src_decode
	.hidden ape__ocl_src_decode
	.type ape__ocl_src_decode, @object
ape__ocl_src_decode:
	.incbin "opencl/kernels/decode.cl"
	.byte 0
	.size ape__ocl_src_decode, . - ape__ocl_src_decode

	.global ape__ocl_src_separable
	.hidden ape__ocl_src_separable
	.type ape__ocl_src_separable, @object
ape__ocl_src_separable:
	.incbin "opencl/kernels/separable.cl"
	.byte 0
	.size ape__ocl_src_separable, . - ape__ocl_src_separable

	/* no executable stack */
	.section .note.GNU-stack,"",@progbits
