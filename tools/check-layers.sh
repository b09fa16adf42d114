#!/bin/sh
# Checks that no file includes a header of a layer it must not depend on:
#   runtime/api -> exec, topo, core;  runtime/exec -> topo, core;  runtime/topo -> core;
#   runtime/core -> core;  backends (runtime/ref, opencl, cuda) -> the public headers (the backend
#   ABI ape/ape_backend.h, ape/ape_math.h) and their own files only, as a plugin sees libape
#   (cuda/emu/, the CPU emulator of the tests, may also use core/);
#   mpi/ (libape_mpi, on libape's public API) -> its own files and the formulas of
#   ape/ape_math.h; its driver (ape-mpi-run.c, mpi-files.c, mpi_files.h, mpi/driver/) also
#   tools/;
#   tools/ -> tools/;  everyone -> the public headers (include/).
# Every include is resolved as the compiler would find it, whatever its spelling ("exec/plan.h",
# <exec/plan.h>, "../exec/plan.h", "#  include", a path through other folders): from the
# including file's folder for quotes, then the build's include paths (include, runtime, tools,
# cuda/kernels); what resolves to no file of the tree (the C library, a driver's headers) is not
# ours. Prints each offending include and exits 1; prints one summary line otherwise.
# usage: tools/check-layers.sh [SOURCE_DIR]
#        tools/check-layers.sh --self-test   (deliberate upward includes must be caught)
set -eu

# The layer of a path of the tree (a file, or a header an include resolved to).
layer_of() {
	case $1 in
	include/*) echo public ;;
	runtime/api/*) echo api ;;
	runtime/exec/*) echo exec ;;
	runtime/topo/*) echo topo ;;
	include/ape/ape_math.h) echo math ;; # core's, and the formulas others may share
	runtime/core/*) echo core ;;
	runtime/ref/*) echo ref ;;
	opencl/*) echo opencl ;;
	cuda/emu/*) echo cuda-emu ;;
	cuda/*) echo cuda ;;
	mpi/ape-mpi-run.c | mpi/mpi-files.c | mpi/mpi_files.h | mpi/driver/*) echo mpi-driver ;;
	mpi/*) echo mpi ;;
	tools/*) echo tools ;;
	*) echo "${1%%/*}" ;; # tests/, bench/, python/, ...: nothing of the checked tree's
	esac
}

# What a file of each layer may include (math: ape/ape_math.h, which core itself may too).
allowed() {
	case $1 in
	api) echo "public api exec topo core math" ;;
	exec) echo "public exec topo core math" ;;
	topo) echo "public topo core math" ;;
	core | math) echo "public core math" ;;
	ref | opencl) echo "public $1" ;;
	cuda) echo "public cuda cuda-emu" ;; # the kernels compile against the emulator in tests
	cuda-emu) echo "public core cuda cuda-emu" ;;
	mpi) echo "public mpi math" ;;
	mpi-driver) echo "public mpi mpi-driver math tools" ;;
	tools) echo "public tools" ;;
	esac
}

# The tree path a spelling of an include resolves to, or nothing: $1 the including file, $2 the
# quote ('"' or '<'), $3 the name.
resolve() {
	if [ "$2" = '"' ]; then
		set -- "$1" "${1%/*} include runtime tools cuda/kernels" "$3"
	else
		set -- "$1" "include runtime tools cuda/kernels" "$3"
	fi
	for dir in $2; do
		[ -f "$dir/$3" ] || continue
		case "$dir/$3" in
		*./*) realpath -m --relative-to=. "$dir/$3" ;; # "../x.h", "./x.h": normalised
		*) echo "$dir/$3" ;;
		esac
		return
	done
}

check_tree() {
	cd "$1"
	bad=0
	files=0
	for f in $(find runtime opencl cuda mpi tools -type f \( -name '*.c' -o -name '*.h' -o \
		   -name '*.cu' -o -name '*.cuh' -o -name '*.cl' -o -name '*.cc' \) 2>/dev/null | sort); do
		from=$(layer_of "$f")
		ok=" $(allowed "$from") "
		files=$((files + 1))
		# "QUOTE NAME" for each include, however spaced
		incs=$(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*\([<"]\)\([^>"]*\)[>"].*/\1 \2/p' "$f")
		[ -n "$incs" ] || continue
		while read -r quote name; do
			to=$(resolve "$f" "$quote" "$name")
			[ -n "$to" ] || continue
			layer=$(layer_of "$to")
			[ "$layer" = "$from" ] && continue
			case $ok in
			*" $layer "*) ;;
			*)
				[ "$quote" = '"' ] && close='"' || close='>'
				echo "check-layers: $f includes $quote$name$close ($to, of $layer):" \
				     "$from includes only${ok% }" >&2
				bad=1
				;;
			esac
		done <<EOF
$incs
EOF
	done
	[ "$bad" -eq 0 ] || return 1
	echo "check-layers: $files files, every include points down (api > exec > topo > core;" \
	     "backends > public headers; mpi > public API and ape/ape_math.h; tools > public API)"
}

# A tree of every layer with one file per spelling of a wrong include, and files that are
# right; the check must name each wrong one, no right one, and fail; without the wrong files
# it must pass.
self_test() {
	t=$(mktemp -d)
	trap 'rm -rf "$t"' EXIT
	for h in include/ape/ape.h runtime/api/registry.h runtime/exec/plan.h runtime/topo/numa.h \
		 runtime/core/backend.h include/ape/ape_math.h runtime/core/context.h \
		 runtime/ref/ref.h opencl/ocl.h cuda/cu.h cuda/emu/emu.h cuda/kernels/args.h \
		 mpi/mpi_internal.h mpi/driver/driver.h tools/common/cli.h tests/common/wrapops.h; do
		mkdir -p "$t/${h%/*}"
		: >"$t/$h"
	done
	# right: own layer, lower layers, own folder, public headers, system headers
	printf '#include "exec/plan.h"\n#include "registry.h"\n#include <stdio.h>\n#include "ape/ape.h"\n' \
		>"$t/runtime/api/good.c"
	printf '#include "../emu/emu.h"\n#include "args.h"\n#include "ape/ape_math.h"\n' \
		>"$t/cuda/kernels/good.cuh"
	printf '#include "ape/ape_math.h"\n#include "mpi_internal.h"\n' >"$t/mpi/good.c"
	printf '#include "common/cli.h"\n#include "ape/ape.h"\n' >"$t/mpi/ape-mpi-run.c"
	printf '#include "common/cli.h"\n#include "driver.h"\n#include "../mpi_internal.h"\n' \
		>"$t/mpi/driver/good.c"
	printf '/* #include "api/registry.h" */\n * #include "api/registry.h"\n' >"$t/runtime/core/prose.c"
	(check_tree "$t") >/dev/null || {
		echo "check-layers --self-test: a tree of right includes fails" >&2
		exit 1
	}
	# wrong: one per spelling
	printf '#include "api/registry.h"\n' >"$t/runtime/core/quoted.c"
	printf '#include <exec/plan.h>\n' >"$t/runtime/topo/angle.c"
	printf '#include "../api/registry.h"\n' >"$t/runtime/exec/relative.c"
	printf '#include"exec/plan.h"\n' >"$t/runtime/topo/no_space.c"
	printf '  #  include   "ref/ref.h"  /* a backend */\n' >"$t/runtime/api/spaced.c"
	printf '#include "../../opencl/ocl.h"\n' >"$t/runtime/core/through_root.c"
	printf '#include "../cuda/cu.h"\n' >"$t/opencl/other_backend.c"
	printf '#include <core/../api/registry.h>\n' >"$t/runtime/exec/dotted.c"
	printf '#include "core/context.h"\n' >"$t/mpi/internal.c"
	printf '#include "common/cli.h"\n' >"$t/mpi/library_tool.c"
	printf '#include "core/context.h"\n' >"$t/mpi/driver/internal.c"
	printf '#include "exec/plan.h"\n' >"$t/tools/internal.c"
	printf '#include "core/context.h"\n' >"$t/opencl/core_private.c"
	printf '#include "../tests/common/wrapops.h"\n' >"$t/runtime/exec/tests.c"
	if out=$(check_tree "$t" 2>&1); then
		echo "check-layers --self-test: a tree of wrong includes passes" >&2
		exit 1
	fi
	for f in runtime/core/quoted.c runtime/topo/angle.c runtime/exec/relative.c \
		 runtime/topo/no_space.c runtime/api/spaced.c runtime/core/through_root.c \
		 opencl/other_backend.c runtime/exec/dotted.c mpi/internal.c mpi/library_tool.c \
		 mpi/driver/internal.c tools/internal.c runtime/exec/tests.c opencl/core_private.c; do
		case $out in
		*"check-layers: $f includes"*) ;;
		*)
			echo "check-layers --self-test: $f's wrong include is not caught:" >&2
			echo "$out" >&2
			exit 1
			;;
		esac
	done
	case $out in
	*good.c* | *good.cuh* | *ape-mpi-run.c* | *prose.c*)
		echo "check-layers --self-test: a right include is reported:" >&2
		echo "$out" >&2
		exit 1
		;;
	esac
	echo "check-layers --self-test: 14 wrong spellings caught, the right ones pass"
}

if [ "${1:-}" = --self-test ]; then
	self_test
else
	check_tree "${1:-.}"
fi
