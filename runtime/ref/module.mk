# ref/: the reference backend, plain C in float64: the oracle every other backend is tested
# against. A backend like opencl/ and cuda/: it includes core/ only.
LIB_SRCS += $(wildcard runtime/ref/*.c)
