#!/bin/sh
# Checks that no file of the library includes a header of a layer above its own:
#   runtime/api -> exec, topo, core;  runtime/exec -> topo, core;  runtime/topo -> core;
#   runtime/core -> core;  backends (runtime/ref, opencl, cuda) -> core and their own files.
# Prints each offending include and exits 1; prints one summary line otherwise.
# usage: tools/check-layers.sh [SOURCE_DIR]
set -eu
cd "${1:-.}"
allowed() {
	case $1 in
	runtime/api/*) echo "api exec topo core" ;;
	runtime/exec/*) echo "exec topo core" ;;
	runtime/topo/*) echo "topo core" ;;
	runtime/core/*) echo "core" ;;
	runtime/ref/* | opencl/* | cuda/*) echo "core" ;;
	esac
}
bad=0
files=0
for f in $(find runtime opencl cuda -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cl' -o -name '*.cc' \) | sort); do
	ok=$(allowed "$f")
	files=$((files + 1))
	for layer in $(sed -n 's|^[[:space:]]*#[[:space:]]*include[[:space:]]*"\(api\|exec\|topo\|core\)/.*|\1|p' "$f"); do
		case " $ok " in
		*" $layer "*) ;;
		*)
			echo "check-layers: $f includes a header of runtime/$layer/, a layer above its own" >&2
			bad=1
			;;
		esac
	done
done
[ "$bad" -eq 0 ] || exit 1
echo "check-layers: $files files, every include points down (api > exec > topo > core; backends > core)"
