#!/bin/sh
# gpu-check.sh [OUT] - the on-GPU checks, for a machine with an NVIDIA GPU,
# PyTorch with CUDA and pytest, where the libraries were built elsewhere
# (Go is not needed here: bring build/ with libtsock.so, libtsock_reader.so
# and libtsock_fake_cuda.so from `make build`).
#
#   1. tests/python/test_gpu.py: the device path, fences against a long
#      kernel, pinned registration, a killed producer, JAX (skipped in CI);
#   2. the fake-driver tests again, as a check that nothing there depends
#      on the machine;
#   3. bench/gpu.py: latency and host-to-device bytes for K = 1, 2, 4
#      against a copy per trainer and TensorSocket's CUDA mode (where the
#      tensorsocket package is installed), JSON into OUT (default build/).
set -eu
cd "$(dirname "$0")/.."
out=${1:-build}
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/python" TSOCK_LIBRARY_DIR="${TSOCK_LIBRARY_DIR:-$PWD/build}" PYTHONUNBUFFERED=1
nvidia-smi -L || true
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
"$py" -m pytest -q -rs -p no:cacheprovider tests/python/test_gpu.py tests/python/test_device.py tests/python/test_cuda.py
"$py" bench/gpu.py --json "$out/gpu.json"
