#!/bin/sh
# no_cuda_link_test.sh LIBRARY... - each library must load without CUDA: no
# CUDA library among its dependencies (ldd, readelf) and no undefined cu*
# symbol (nm -D --undefined-only); the driver is dlopen'ed at run time.
set -u
status=0
for lib in "$@"; do
  [ -n "$lib" ] || continue
  needed=$(readelf -d "$lib" | grep NEEDED)
  if echo "$needed" | grep -qi 'cuda\|nvidia'; then
    echo "FAIL: $lib needs a CUDA library:"; echo "$needed"; status=1
  fi
  if ldd "$lib" | grep -qi 'cuda\|nvidia'; then
    echo "FAIL: $lib resolves a CUDA library:"; ldd "$lib"; status=1
  fi
  undef=$(nm -D --undefined-only "$lib" | awk '{print $NF}' | grep -E '^cu[A-Z]|^cuda' || true)
  if [ -n "$undef" ]; then
    echo "FAIL: $lib has undefined CUDA symbols:"; echo "$undef"; status=1
  fi
  if ! nm -D --defined-only "$lib" | grep -q ' T tsock_reader_register_host$'; then
    echo "FAIL: $lib does not export tsock_reader_register_host"; status=1
  fi
  [ $status -eq 0 ] && echo "ok: $lib links no CUDA"
done
exit $status
