# The Python package (python/libape): pure Python over libape.so.0 through ctypes. `make check`
# runs its pytest suite (python/tests) in the virtual environment `make deps` creates, against
# the library of this build, and counts it in the last summary line.
VENV        ?= build/venv
VENV_PY     := $(VENV)/bin/python
PY_PACKAGES := pytest torch

python-deps:
	$(Q)tools/deps-python.sh $(VENV) $(PY_PACKAGES)

python-check: $(LIBSO) $(PLUGIN_FIXTURES)
	@if [ ! -x $(VENV_PY) ]; then \
		echo "python: no virtual environment at $(VENV): run 'make deps'" >&2; exit 1; fi
	$(Q)APE_BUILD_DIR=$(abspath $(BUILD)) LIBAPE_LIBRARY=$(abspath $(LIBSO)) \
		$(VENV_PY) -m pytest -q -p no:cacheprovider python/tests

# Under `make sanitize` the library is built with ASan, which Python cannot load: the Python
# suite runs in the plain `make check` only.
ifeq ($(SANITIZE),)
CHECK_EXTRA += python-check
endif
.PHONY: python-deps python-check
