#!/bin/sh
# cgo.sh [COMMAND...] - runs a go command with CGO_CFLAGS that name a hash
# of every C source the Go packages compile; with no command, prints them.
#
# Why: cgo compiles the C files of a package's own folder, and ours
# #include others (ring/layout.h, cuda/*.c through reader/cuda_shim.c and
# producer/cuda_shim.c). The go build cache does not look at included files
# from other folders, so a change there would reuse stale objects; CGO_CFLAGS
# is part of the cache key, so the hash forces a rebuild exactly when a C
# source changed.
root=$(cd "$(dirname "$0")/.." && pwd)
hash=$(cd "$root" && cat include/*.h ring/*.h reader/*.c reader/*.h cuda/*.c cuda/*.h \
  producer/*.c producer/*.h cabi/*.c internal/batchgen/*.h 2>/dev/null | sha256sum | cut -c1-16)
CGO_CFLAGS="-O2 -g -DTSOCK_C_SOURCES=0x$hash"
export CGO_CFLAGS
[ $# -eq 0 ] && { echo "$CGO_CFLAGS"; exit 0; }
exec "$@"
