#!/bin/sh
# Installs what libape needs on Debian, idempotently: the packages (after apt-get update, as root)
# and the Linux kernel's Kselftest headers, taken from Debian's linux-source package.
# usage: tools/deps.sh KSFT_DIR PACKAGE...
set -eu
ksft_dir=$1
shift

missing=""
for p in "$@"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "deps: missing Debian packages:$missing" >&2
		echo "deps: run as root:  apt-get update && apt-get install -y --no-install-recommends$missing" >&2
		exit 1
	fi
	echo "deps: installing$missing"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
else
	echo "deps: Debian packages already installed"
fi

if [ -f "$ksft_dir/kselftest_harness.h" ] && [ -f "$ksft_dir/kselftest.h" ]; then
	echo "deps: Kselftest headers already in $ksft_dir"
	exit 0
fi
# Debian 12's own kernel source (the harness the tests were written against); failing that, the
# newest linux-source-X.Y the archive offers.
pkg=linux-source-6.1
if ! apt-cache show "$pkg" >/dev/null 2>&1; then
	pkg=$(apt-cache search --names-only '^linux-source-[0-9]+\.[0-9]+$' | awk '{print $1}' | sort -V | tail -n 1)
fi
if [ -z "$pkg" ]; then
	echo "deps: no linux-source package in the apt lists; run apt-get update first" >&2
	exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "deps: taking kselftest_harness.h and kselftest.h from $pkg"
(cd "$tmp" && apt-get download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
deb=$(ls "$tmp"/"$pkg"_*.deb 2>/dev/null | head -n 1)
if [ -z "$deb" ]; then
	echo "deps: apt-get download $pkg failed" >&2
	exit 1
fi
ver=${pkg#linux-source-}
sel=tools/testing/selftests
dpkg-deb --fsys-tarfile "$deb" | tar -xO "./usr/src/linux-source-$ver.tar.xz" |
	tar -xJ -C "$tmp" "linux-source-$ver/$sel/kselftest_harness.h" "linux-source-$ver/$sel/kselftest.h"
mkdir -p "$ksft_dir"
cp "$tmp/linux-source-$ver/$sel/kselftest_harness.h" "$tmp/linux-source-$ver/$sel/kselftest.h" "$ksft_dir/"
echo "deps: Kselftest headers installed in $ksft_dir"
