"""Bundles the libape.so.0 of the build tree next to it (../build/lib, or $LIBAPE_BUILD/lib),
so that `pip install ./python` after `make` gives a package that runs without installing the C
library. Without a built library the package installs without it and finds the installed one
(or LIBAPE_LIBRARY) at import time."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithLibrary(build_py):
    def run(self):
        build = os.environ.get("LIBAPE_BUILD", os.path.join(HERE, "..", "build"))
        lib = os.path.join(build, "lib", "libape.so.0")
        dst = os.path.join(HERE, "libape", "_lib")
        if os.path.exists(lib):
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), os.path.join(dst, "libape.so.0"))
            print("libape: bundling %s" % os.path.realpath(lib))
        else:
            print("libape: no %s (run `make` first to bundle it); the package will look for "
                  "LIBAPE_LIBRARY or an installed libape" % lib)
        super().run()


setup(cmdclass={"build_py": BuildWithLibrary})
