# The OpenCL backend: contributes only when the Makefile found the headers and the ICD loader
# (HAVE_OPENCL=yes; it then defines APE_HAVE_OPENCL everywhere, for the tests). Its registry
# entry (runtime/api/backends.mk) either way: probed after CUDA, before the reference.
APE_BACKENDS += 20:opencl
APE_BACKEND_opencl_OPS := $(if $(filter yes,$(HAVE_OPENCL)),ape__opencl_ops)
APE_BACKEND_opencl_WHY := $(OPENCL_WHY)
ifeq ($(HAVE_OPENCL),yes)
CPPFLAGS += -DAPE_HAVE_OPENCL
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
