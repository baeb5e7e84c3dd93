#!/usr/bin/env bash
# Makes the Python environment the tests and the sweep use, in $1 (.venv):
# Debian's CPU-only PyTorch (small; PyPI's torch is the multi-GB CUDA build)
# and NumPy, seen from a venv of the system Python that adds JAX for the CPU.
# For the benchmarks (bench/run.py): libzmq's headers (the C ZMQ baseline),
# matplotlib (plots), pyzmq and tornado, and TensorSocket itself, installed
# without its dependencies: it asks for torch>=2 but runs on Debian's 1.13
# (bench/e2e.py supplies the one missing method).
set -euo pipefail
venv=${1:-.venv}
debs="python3-torch python3-numpy python3-pil python3-venv libzmq3-dev pkgconf"
missing=""
for d in $debs; do
  dpkg-query -W -f='${Status}' "$d" 2>/dev/null | grep -q "install ok installed" || missing="$missing $d"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "py-env: needs Debian packages:$missing (run as root or apt-get install them)" >&2
    exit 1
  fi
  echo "py-env: installing$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  "jax[cpu]==0.4.30" "numpy<2" "pytest>=7" "pytest-timeout==2.3.1" "ruff==0.17.6" \
  "matplotlib>=3.7,<3.10" "pyzmq>=25,<28" "tornado>=6"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "tensorsocket==0.0.5"
touch "$venv/.ready"
