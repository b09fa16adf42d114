#!/bin/sh
# Runs CMD and, when APE_TEST_TIMES names a file, appends "NAME SECONDS" (its wall time) to it:
# `make check` prints each suite's time before its last line (tests/check-total.sh). Exits with
# CMD's status. Under a dry run (make -n: MAKEFLAGS' first word, its single-letter flags, holds
# n) it records nothing: make runs this line even then, since it holds $(MAKE).
# usage: tests/timed.sh NAME CMD [ARG...]
set -u
name=$1
shift
t0=$(date +%s)
"$@"
rc=$?
dry=""
case "${MAKEFLAGS:-}" in
-* | " "* | "") ;;
*) case "${MAKEFLAGS%% *}" in *n*) dry=1 ;; esac ;;
esac
[ -z "$dry" ] && [ -n "${APE_TEST_TIMES:-}" ] && echo "$name $(($(date +%s) - t0))" >>"$APE_TEST_TIMES"
exit $rc
