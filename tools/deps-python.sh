#!/bin/sh
# The Python side of `make deps`: a virtual environment VENV (with Debian's NumPy from the system
# site-packages) holding what the Python package's tests need from PyPI: pytest, and PyTorch for
# the torch paths (about a minute and a few GB on a fresh machine). Idempotent.
# usage: tools/deps-python.sh VENV PACKAGE...
set -eu
venv=$1
shift
if [ ! -x "$venv/bin/python" ]; then
	echo "deps: creating the Python virtual environment $venv"
	/usr/bin/python3 -m venv --system-site-packages "$venv"
fi
missing=""
for p in "$@"; do
	"$venv/bin/python" -c "import $p" 2>/dev/null || missing="$missing $p"
done
if [ -z "$missing" ]; then
	echo "deps: Python packages already in $venv"
	exit 0
fi
echo "deps: installing from PyPI into $venv:$missing"
"$venv/bin/pip" install -q --disable-pip-version-check $missing
