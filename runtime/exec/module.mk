# exec/: the executor. Takes a validated problem (exec/problem.h) and runs it: plans chunks under
# the device budget, streams them through backends' queues, merges partial results by LSE.
LIB_SRCS += $(wildcard runtime/exec/*.c)
