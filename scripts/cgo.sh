#!/bin/sh
# cgo.sh [COMMAND...] - runs a go command with CGO_CFLAGS that name a hash
# of the C headers cgo includes from outside a package's own folder; with
# no command, prints them.
#
# Why: Go's build cache keys a cgo package on the files of its own folder
# (its .go, .c and .h files) and on CGO_CFLAGS, but not on headers included
# from elsewhere (golang/go#24355). Ours are include/tsock.h (ring, reader,
# producer, cabi), ring/layout.h (reader, cabi), cuda/api.h and
# cuda/load.h (reader, producer), reader/internal.h and producer/defaults.h
# (cabi): edit one and
# go build would reuse objects compiled from the old text. The hash in
# CGO_CFLAGS changes the cache key exactly when one of them changes.
root=$(cd "$(dirname "$0")/.." && pwd)
hash=$(cd "$root" && cat include/*.h ring/*.h cuda/*.h reader/*.h producer/*.h | sha256sum | cut -c1-16)
CGO_CFLAGS="-O2 -g -DTSOCK_CGO_HEADERS=0x$hash"
export CGO_CFLAGS
[ $# -eq 0 ] && { echo "$CGO_CFLAGS"; exit 0; }
exec "$@"
