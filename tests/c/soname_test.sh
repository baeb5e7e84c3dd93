#!/bin/sh
# soname_test.sh BUILD_DIR VERSION LINKED_TSOCK LINKED_READER - both libraries
# carry a soname versioned by the major version (libX.so.MAJOR), sit in the
# build folder as libX.so.VERSION with the links libX.so.MAJOR and libX.so,
# and a program linked against each records the versioned name.
set -u
dir=$1 version=$2 major=${2%%.*}
status=0
fail() { echo "FAIL: $*"; status=1; }
soname() { readelf -d "$1" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
for lib in libtsock libtsock_reader; do
  file="$dir/$lib.so.$version"
  [ -f "$file" ] && [ ! -L "$file" ] || { fail "$file is missing (or a link)"; continue; }
  [ "$(soname "$file")" = "$lib.so.$major" ] || fail "$file has soname '$(soname "$file")', want $lib.so.$major"
  [ "$(readlink "$dir/$lib.so.$major")" = "$lib.so.$version" ] || fail "$dir/$lib.so.$major does not link to $lib.so.$version"
  [ "$(readlink "$dir/$lib.so")" = "$lib.so.$major" ] || fail "$dir/$lib.so does not link to $lib.so.$major"
done
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(libtsock.*\)\]/\1/p'; }
[ "$(needed "$3")" = "libtsock.so.$major" ] || fail "$3 needs '$(needed "$3")', want libtsock.so.$major"
[ "$(needed "$4")" = "libtsock_reader.so.$major" ] || fail "$4 needs '$(needed "$4")', want libtsock_reader.so.$major"
[ $status -eq 0 ] && echo "ok: libtsock.so.$major and libtsock_reader.so.$major"
exit $status
