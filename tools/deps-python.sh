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
# PyTorch from PyPI brings its CUDA libraries: about 5.3 GB installed, plus its wheels while they
# install. No pip cache (it would keep a second copy of the wheels), and a clear word first when
# the disk is short (pip's own "No space left on device" names no size).
dir=$(dirname "$venv")
need_kb=$((8 * 1024 * 1024))
free_kb=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
tmp_kb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt "$need_kb" ] || [ "${tmp_kb:-0}" -lt "$need_kb" ]; then
	echo "deps: warning: $((free_kb / 1024)) MiB free under $dir and $((tmp_kb / 1024)) MiB under ${TMPDIR:-/tmp};" \
		"PyTorch from PyPI needs about 8 GiB (5.3 GB installed plus its wheels while installing)" >&2
fi
echo "deps: installing from PyPI into $venv:$missing"
"$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check $missing
