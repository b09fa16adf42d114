# The OpenCL backend: contributes only when the Makefile found the headers and the ICD loader
# (HAVE_OPENCL=yes; it then defines APE_HAVE_OPENCL everywhere, so the registry lists it).
ifeq ($(HAVE_OPENCL),yes)
OPENCL_SRCS := $(wildcard opencl/ocl_*.c)
LIB_SRCS    += $(OPENCL_SRCS)
LIB_ASM     += opencl/kernels_embed.S
# libOpenCL.so.1 is opened at run time (ocl_loader.c), never linked: programs start without it.

# OpenCL 1.2 API (no deprecation warnings for clCreateCommandQueue; runs on every ICD).
$(OPENCL_SRCS:%.c=$(BUILD)/obj/%.o): CPPFLAGS += -DCL_TARGET_OPENCL_VERSION=120

# .incbin is invisible to -MMD: the embedded sources are explicit prerequisites.
$(BUILD)/obj/opencl/kernels_embed.o: opencl/kernels/attention.cl opencl/kernels/backward.cl \
				   opencl/kernels/decode.cl opencl/kernels/separable.cl \
				   opencl/kernels/bwd_layout.h \
				   include/ape/ape_math.h
endif
