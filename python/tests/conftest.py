"""Test set-up: the package from this source tree and the library from the build tree (unless
LIBAPE_LIBRARY says otherwise), and the counts `make check` adds up."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.environ.get("APE_BUILD_DIR", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("LIBAPE_LIBRARY", os.path.join(BUILD, "lib", "libape.so.0"))


def has_backend(name):
    """Whether libape has a device of backend `name` here (libape.backends() says why not)."""
    import libape
    return any(b["name"] == name and b["available"] for b in libape.backends())


def pytest_terminal_summary(terminalreporter):
    """Appends "passed failed skipped" to $APE_TEST_SUMMARY, as the C suites do."""
    path = os.environ.get("APE_TEST_SUMMARY")
    if not path:
        return
    st = terminalreporter.stats
    n = lambda k: len([r for r in st.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
    passed, failed = n("passed"), n("failed") + n("error")
    skipped = n("skipped")
    with open(path, "a") as f:
        f.write("%d %d %d\n" % (passed, failed, skipped))
