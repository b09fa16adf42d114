# core/: what every layer and every backend shares. Includes nothing but itself and ape/ape.h.
LIB_SRCS += $(wildcard runtime/core/*.c)
