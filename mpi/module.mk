# libape_mpi (issue 17): context-parallel APE over MPI, a library of its own on top of libape's
# public API; libape itself never depends on MPI. WITH_MPI = auto (default), yes or no, announced
# like the other options. Built with the C compiler and MPI's flags from pkg-config (Open MPI's
# "mpi-c", MPICH's "mpich"); the tests need `mpirun` too.
MPI_PKG    := $(firstword $(foreach p,mpi-c mpich,\
                $(shell $(PKG_CONFIG) --exists $(p) 2>/dev/null && echo $(p))))
MPIRUN     ?= $(shell command -v mpirun 2>/dev/null)
ifeq ($(WITH_MPI),no)
MPI_WHY := disabled at build time (WITH_MPI=no)
else ifneq ($(MPI_PKG),)
HAVE_MPI := yes
# -isystem: MPI's headers are not ours to hold to -Wextra -Werror
MPI_CFLAGS := $(patsubst -I%,-isystem %,$(shell $(PKG_CONFIG) --cflags $(MPI_PKG)))
MPI_LIBS   := $(shell $(PKG_CONFIG) --libs $(MPI_PKG))
else ifeq ($(WITH_MPI),yes)
$(error WITH_MPI=yes but pkg-config finds no MPI (Debian: libopenmpi-dev): run `make deps`)
else
MPI_WHY := no MPI found by pkg-config at build time (Debian: libopenmpi-dev)
endif

ifneq ($(if $(MAKECMDGOALS),$(filter-out deps help clean distclean,$(MAKECMDGOALS)),all),)
ifeq ($(MAKELEVEL),0)
$(info libape: MPI:            $(if $(HAVE_MPI),yes (libape_mpi, $(MPI_PKG)),no ($(MPI_WHY))))
endif
endif

# the calls (mpi/mpi_call.h): forward.c the call itself, check.c each rank's arguments,
# exchange.c the transfers between ranks, compute.c the local pieces and their merge
MPI_LIB_SRCS := mpi/shard.c mpi/agree.c mpi/plan.c mpi/forward.c mpi/check.c mpi/exchange.c \
                mpi/compute.c
MPI_LIBA     := $(BUILD)/lib/libape_mpi.a
MPI_LIBSO    := $(BUILD)/lib/libape_mpi.so.$(APE_SOVERSION)
MPI_RUN      := $(BUILD)/bin/ape-mpi-run
MPI_TESTS    := $(BUILD)/tests/mpi/test_mpi $(BUILD)/tests/mpi/test_mpi_backward \
		$(BUILD)/tests/mpi/test_mpi_tools
MPI_STAMP    := $(BUILD)/mpi.stamp
MPI_CONFIG   := $(MPI_PKG) $(MPI_CFLAGS)
$(shell mkdir -p $(BUILD) && { test -f $(MPI_STAMP) && test "$$(cat $(MPI_STAMP))" = '$(MPI_CONFIG)' \
	|| echo '$(MPI_CONFIG)' > $(MPI_STAMP); })

ifneq ($(HAVE_MPI),)
$(BUILD)/mpi-obj/%.o: %.c $(CONFIG_STAMP) $(MPI_STAMP)
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) $(MPI_CFLAGS) $(LIB_CFLAGS) -c $< -o $@

$(MPI_LIBA): $(MPI_LIB_SRCS:%.c=$(BUILD)/mpi-obj/%.o)
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	$(Q)rm -f $@ && $(AR) rcs $@ $^

$(MPI_LIBSO): $(MPI_LIB_SRCS:%.c=$(BUILD)/mpi-obj/%.o) $(LIBSO)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) -shared -Wl,-soname,libape_mpi.so.$(APE_SOVERSION) -Wl,--no-undefined $(LDFLAGS) \
		-o $@ $(filter %.o,$^) -L$(BUILD)/lib -lape $(MPI_LIBS) $(LDLIBS)
	$(Q)ln -sf libape_mpi.so.$(APE_SOVERSION) $(BUILD)/lib/libape_mpi.so

# the driver: a random problem (or a generated long one) over the ranks, checked against the
# single-process call; the tests and the measurements in bench/RESULTS.md run it
# (a tool like the others: its options go through tools/common/cli.c, --help and --version too)
# (ape-run --mpi execs `ape-mpi-run --files ARGS`: mpi/mpi-files.c, ape-run's options on .npy
# files; ape-bench --mpi execs it with ape-bench's arguments)
# (mpi/driver/: its options, inputs, cases, backward and suite; mpi/driver/driver.h)
MPI_RUN_OBJS := $(BUILD)/mpi-obj/mpi/ape-mpi-run.o $(BUILD)/mpi-obj/mpi/mpi-files.o \
                $(patsubst %.c,$(BUILD)/mpi-obj/%.o,$(wildcard mpi/driver/*.c))
$(MPI_RUN_OBJS): CPPFLAGS += -Itools
$(MPI_RUN): $(MPI_RUN_OBJS) $(MPI_LIBA) $(TOOLS_LIB) $(LIBA)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $(MPI_RUN_OBJS) $(MPI_LIBA) $(TOOLS_LIB) $(LIBA) $(LIB_LIBS) $(MPI_LIBS) \
		$(LDLIBS)

all: $(MPI_LIBA) $(MPI_LIBSO) $(MPI_RUN)

# The test programs call the pure parts directly (the plan's internals too: it links libape_mpi,
# MPI and tests/common/) and runs everything distributed through mpirun and the driver.
$(BUILD)/tests-obj/tests/mpi/%.o: tests/mpi/%.c $(CONFIG_STAMP) $(MPI_STAMP) \
		| $(KSFT_DIR)/kselftest_harness.h
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CPPFLAGS) -Impi $(MPI_CFLAGS) $(TEST_CFLAGS) -c $< -o $@

# (each links the driver runs of tests/mpi/mpitest.c too)
$(MPI_TESTS): $(BUILD)/tests/mpi/%: $(BUILD)/tests-obj/tests/mpi/%.o \
		$(BUILD)/tests-obj/tests/mpi/mpitest.o \
		$(TEST_COMMON_SRCS:%.c=$(BUILD)/tests-obj/%.o) $(MPI_LIBA) $(TOOLS_LIB) $(LIBA) \
		$(MPI_RUN)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(MPI_LIBA) $(TOOLS_LIB) $(LIBA) $(LIB_LIBS) \
		$(MPI_LIBS) $(LDLIBS)

install: install-mpi
install-mpi: $(MPI_LIBA) $(MPI_LIBSO)
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include/ape
	install -m 644 include/ape/ape_mpi.h $(DESTDIR)$(PREFIX)/include/ape/
	install -m 644 $(MPI_LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(MPI_LIBSO) $(DESTDIR)$(PREFIX)/lib/
	ln -sf libape_mpi.so.$(APE_SOVERSION) $(DESTDIR)$(PREFIX)/lib/libape_mpi.so

# the tests: a Kselftest program that starts the driver under mpirun (APE_MPIRUN)
mpi-ci: $(MPI_TESTS) $(MPI_RUN)
	$(Q)APE_MPIRUN="$(MPIRUN)" tests/run-tests.sh $(BUILD) $(MPI_TESTS)
else
mpi-ci:
	@echo "mpi: SKIP: $(MPI_WHY)"
	$(Q)[ -z "$$APE_TEST_SUMMARY" ] || echo "0 0 1" >>"$$APE_TEST_SUMMARY"
endif

ifeq ($(SANITIZE),)
CHECK_EXTRA += mpi-ci
endif
mpi-clean:
	rm -rf $(BUILD)/mpi-obj $(MPI_STAMP)
clean: mpi-clean
.PHONY: mpi-ci mpi-clean install-mpi
