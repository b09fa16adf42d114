# api/: the public entry points (include/ape/ape.h): contexts, device selection, forward calls,
# the KV cache; they validate every argument, then hand the problem to the executor. The registry
# of backends lives here because only context creation reads it.
LIB_SRCS += $(wildcard runtime/api/*.c)

CPPFLAGS += $(if $(HAVE_OPENCL),-DAPE_HAVE_OPENCL,-DAPE_OPENCL_NOT_BUILT='"not built into this libape ($(OPENCL_WHY))"')
CPPFLAGS += $(if $(HAVE_CUDA),-DAPE_HAVE_CUDA,-DAPE_CUDA_NOT_BUILT='"not built into this libape ($(CUDA_WHY))"')
