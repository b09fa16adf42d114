# ref/: the reference backend, plain C in float64: the oracle every other backend is tested
# against. A backend like opencl/ and cuda/: it includes the public backend ABI
# (ape/ape_backend.h) and core/ helpers only.
LIB_SRCS += $(wildcard runtime/ref/*.c)

# The registry's entry (runtime/api/backends.mk): probed last, always built.
APE_BACKENDS += 90:ref
APE_BACKEND_ref_OPS := ape__ref_ops
