# Fault injection and concurrency (issue 7), each in a build of its own so that the normal build
# stays untouched: `make faults-ci` builds libape with ASan and -DAPE_FAULT_INJECT (the counting
# allocators of runtime/core/alloc.h) in $(BUILD)/faults and runs the allocation- and device-failure
# tests; `make tsan-ci` builds it with ThreadSanitizer in $(BUILD)/tsan and runs the concurrency
# tests. Both leave CUDA out: no GPU reaches these tests here, and nvcc would double the build.
# test_contract too: in that build, host allocations inside each backend op fail in turn
FAULT_TESTS  := $(BUILD)/tests/faults/test_allocfail $(BUILD)/tests/faults/test_devfail \
		$(BUILD)/tests/test_contract $(BUILD)/tests/faults/test_bwdfail \
		$(BUILD)/tests/faults/test_varlenfail $(BUILD)/tests/faults/test_posfail \
		$(BUILD)/tests/faults/test_kvpoolfail $(BUILD)/tests/faults/test_kvpagedfail \
		$(BUILD)/tests/faults/test_pluginfail $(BUILD)/tests/faults/test_tablefail
THREAD_TESTS := $(BUILD)/tests/faults/test_threads $(BUILD)/tests/faults/test_pluginthreads
FAULT_SUBMAKE = $(MAKE) --no-print-directory OPT=-O1 WITH_CUDA=no

# the generic test rule links tests/common/; these also need the shared fault checks
$(FAULT_TESTS) $(THREAD_TESTS): $(BUILD)/tests-obj/tests/faults/faultcheck.o
# the backend plugins they load (tests/module.mk)
$(BUILD)/tests/faults/test_pluginfail $(BUILD)/tests/faults/test_pluginthreads: $(PLUGIN_FIXTURES)

faults-ci:
	$(Q)$(FAULT_SUBMAKE) BUILD=$(BUILD)/faults SANITIZE=1 CFLAGS=-DAPE_FAULT_INJECT faults-run

faults-run: $(FAULT_TESTS)
	$(Q)APE_TEST_JOBS=$(TEST_JOBS) tests/run-tests.sh $(BUILD) $(FAULT_TESTS)

# halt_on_error: a race is a failure, not a warning; the suppressions cover PoCL only (see there)
tsan-ci:
	$(Q)$(FAULT_SUBMAKE) BUILD=$(BUILD)/tsan CFLAGS=-fsanitize=thread LDFLAGS=-fsanitize=thread \
		tsan-run

tsan-run: $(THREAD_TESTS)
	$(Q)TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/tests/faults/tsan.supp" \
		tests/run-tests.sh $(BUILD) $(THREAD_TESTS)

# `make sanitize` reruns `check` under ASan: these goals already run sanitized, once is enough.
ifeq ($(SANITIZE),)
CHECK_EXTRA += faults-ci tsan-ci
endif

.PHONY: faults-ci faults-run tsan-ci tsan-run
