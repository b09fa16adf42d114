# api/: the public entry points (include/ape/ape.h): contexts, device selection, forward calls,
# the KV cache; they validate every argument, then hand the problem to the executor. The registry
# of backends lives here because only context creation reads it.
LIB_SRCS += $(wildcard runtime/api/*.c)
