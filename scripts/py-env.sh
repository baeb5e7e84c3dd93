#!/usr/bin/env bash
# py-env.sh LEG VENV GROUP... - makes (or completes) the Python environment
# VENV for one leg of the supported range, with only PyPI packages and no
# root:
#
#   LEG    current: the newest releases, pinned in requirements/current.txt,
#                   on Python 3.12-3.14 (current JAX needs 3.12)
#          oldest:  the oldest releases tsock supports, pinned in
#                   requirements/oldest.txt, on Python 3.11
#   GROUP  sweep (the main job), test (the suite), bench (the benchmarks):
#          requirements/GROUP.in, installed within the leg's pins
#
# The interpreter is PYTHON (current leg) or PYTHON_OLDEST (oldest leg) when
# set; otherwise the newest fitting one among python3.X on PATH, pyenv's
# versions and uv's managed Pythons; when there is none, `uv python install`
# fetches one (a standalone CPython in ~/.local/share/uv). VENV may also be
# an existing environment of the user's (a venv, a conda env): it is used as
# it is, if its Python fits the leg.
#
# Packages are installed with uv (pinned in requirements/uv-version, fetched
# once from PyPI with pip into $TSOCK_PY_TOOLS, default build/py-tools):
# parallel downloads, and a shared cache (~/.cache/uv) that hard-links
# files into every environment instead of unpacking PyTorch's 3 GB again.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
leg=${1:?usage: py-env.sh current|oldest VENV GROUP...}
venv=${2:?usage: py-env.sh current|oldest VENV GROUP...}
shift 2
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(sweep)

# uv trusts the system's certificate store (as pip does), not only its own
# bundle: a site's TLS-inspecting proxy has its CA there.
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}

say() { echo "py-env: $*"; }
die() { echo "py-env: $*" >&2; exit 1; }

case "$leg" in
  current) min=3.12 max=3.14 want=${PYTHON:-} var=PYTHON ;;
  oldest) min=3.11 max=3.11 want=${PYTHON_OLDEST:-} var=PYTHON_OLDEST ;;
  *) die "unknown leg '$leg' (current or oldest)" ;;
esac
pins="$here/requirements/$leg.txt"
for g in "${groups[@]}"; do
  [ -f "$here/requirements/$g.in" ] || die "unknown group '$g' (requirements/$g.in)"
done

# X.Y of an interpreter, or nothing when it does not run (a pyenv shim of a
# version that is not selected, a broken link).
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true; }
# 0 when X.Y is within [min, max].
fits() {
  [ -n "$1" ] || return 1
  [ "$(printf '%s\n%s\n' "$min" "$1" | sort -V | head -1)" = "$min" ] &&
    [ "$(printf '%s\n%s\n' "$1" "$max" | sort -V | tail -1)" = "$max" ]
}

candidates() {
  local v root
  for v in 3.14 3.13 3.12 3.11; do command -v "python$v" || true; done
  for root in "${PYENV_ROOT:-}" "$HOME/.pyenv"; do
    [ -n "$root" ] && ls -d "$root"/versions/3.*/bin/python3 2>/dev/null | sort -rV || true
  done
  ls -d "${UV_PYTHON_INSTALL_DIR:-$HOME/.local/share/uv/python}"/cpython-3.*/bin/python3 2>/dev/null | sort -rV || true
  command -v python3 || true
}

# The newest interpreter that fits the leg, or nothing.
find_python() {
  local best="" best_v="" c v
  while read -r c; do
    [ -n "$c" ] || continue
    v=$(version_of "$c")
    fits "$v" || continue
    if [ -z "$best" ] || [ "$(printf '%s\n%s\n' "$best_v" "$v" | sort -V | tail -1)" != "$best_v" ]; then
      best=$c best_v=$v
    fi
  done < <(candidates)
  [ -n "$best" ] && echo "$best"
  return 0
}

# uv, pinned, installed with pip into a private folder from any Python 3.
tools=${TSOCK_PY_TOOLS:-$here/build/py-tools}
uv_version=$(tr -d ' \n' <"$here/requirements/uv-version")
uv="$tools/bin/uv"
ensure_uv() {
  if [ -x "$uv" ] && [ "$("$uv" --version 2>/dev/null | awk '{print $2}')" = "$uv_version" ]; then
    return
  fi
  local boot=${1:-}
  [ -n "$boot" ] || boot=$(command -v python3 || true)
  [ -n "$boot" ] || die "no python3 on PATH to fetch uv with"
  say "installing uv $uv_version from PyPI into $tools (with $boot)"
  rm -rf "$tools"
  if ! "$boot" -m venv "$tools" >/dev/null 2>&1; then
    rm -rf "$tools"
    "$boot" -m pip --version >/dev/null 2>&1 ||
      die "$boot can neither make a venv (python3-venv) nor run pip: install uv (pip install --user uv) and retry"
    "$boot" -m pip install --disable-pip-version-check -q --target "$tools/lib" "uv==$uv_version"
    mkdir -p "$tools/bin"
    ln -sf ../lib/bin/uv "$tools/bin/uv"
    return
  fi
  "$tools/bin/python" -m pip install --disable-pip-version-check -q "uv==$uv_version"
}

if [ -x "$venv/bin/python" ]; then
  py="$venv/bin/python"
  v=$(version_of "$py")
  fits "$v" || die "$venv has Python ${v:-?} ($py), the $leg leg needs $min-$max: remove it (rm -rf $venv) or name another environment"
  ensure_uv
  say "$leg leg: using $venv (Python $v)"
else
  if [ -n "$want" ]; then
    py=$want
    v=$(version_of "$py")
    fits "$v" || die "$var=$py is Python ${v:-(not runnable)}, the $leg leg needs $min-$max"
  else
    py=$(find_python)
  fi
  if [ -z "$py" ]; then
    ensure_uv
    say "no Python $min-$max found (PATH, pyenv, uv's): fetching CPython $max with uv python install"
    "$uv" python install "$max" ||
      die "no Python $min-$max here and none could be fetched: install one (uv python install $max, pyenv install $max, conda create -p ~/py python=$max) and name it: make ... $var=/path/to/python$max"
    py=$("$uv" python find "$max")
  fi
  v=$(version_of "$py")
  ensure_uv "$py"
  say "$leg leg: creating $venv with Python $v ($py)"
  "$uv" venv -q --python "$py" "$venv"
fi

# Only the groups asked for; every package at the leg's pinned version.
for g in "${groups[@]}"; do
  what=$(grep -v '^\s*#' "$here/requirements/$g.in" | grep -v '^-r' | awk 'NF' | tr '\n' ' ')
  say "$leg leg, $g: $what(pinned in requirements/$leg.txt; the first install downloads PyTorch's CUDA build from PyPI, about 3 GB, then the cache in ${UV_CACHE_DIR:-~/.cache/uv} is reused)"
done
args=()
for g in "${groups[@]}"; do args+=(-r "$here/requirements/$g.in"); done
t0=$(date +%s)
"$uv" pip install --python "$venv/bin/python" -c "$pins" "${args[@]}"
say "$leg leg ready in $venv ($(($(date +%s) - t0)) s)"
