#!/bin/sh
# gpu-check.sh [OUT] - the on-GPU checks, for a machine with an NVIDIA GPU,
# PyTorch with CUDA and pytest, where the libraries were built elsewhere
# (Go is not needed there). Here: `make gpu-bundle` puts libtsock.so,
# libtsock_reader.so and libtsock_fake_cuda.so in build-gpu/ (about 4 MiB;
# all of build/ is over 80); send the tree with build-gpu/ and run this
# there (it uses build-gpu/ when it exists, else build/).
#
#   1. tests/python/test_gpu.py: the device path, zero-copy and kept copies,
#      fences against a long kernel, pinned registration, a killed
#      producer, JAX (skipped in CI);
#   2. the fake-driver tests again, as a check that nothing there depends
#      on the machine;
#   3. bench/gpu.py: latency, per-trainer rate and host-to-device bytes for
#      K = 1, 2, 4 against a copy per trainer and TensorSocket's CUDA mode
#      (where the tensorsocket package is installed, or on PYTHONPATH), JSON
#      into OUT (default build/); here, `python3 bench/run.py --import-gpu
#      OUT/gpu.json` puts it into docs/BENCHMARKS.md.
set -eu
cd "$(dirname "$0")/.."
out=${1:-build}
py=${PYTHON:-python3}
libs=$PWD/build
[ -d build-gpu ] && libs=$PWD/build-gpu
[ -f build-gpu/COMMIT ] && TSOCK_COMMIT=$(cat build-gpu/COMMIT) && export TSOCK_COMMIT
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" TSOCK_LIBRARY_DIR="${TSOCK_LIBRARY_DIR:-$libs}" PYTHONUNBUFFERED=1
mkdir -p "$out"
echo "libraries: $TSOCK_LIBRARY_DIR (tsock ${TSOCK_COMMIT:-of this tree})"
nvidia-smi -L || true
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
"$py" -m pytest -q -rs -p no:cacheprovider tests/python/test_gpu.py tests/python/test_device.py tests/python/test_cuda.py
"$py" bench/gpu.py --json "$out/gpu.json"
