# tsock: `make sweep` runs the main job, `make test` runs every test.
BUILD ?= build
# The Python environments (scripts/py-env.sh): VENV, the current leg (the
# newest PyTorch, NumPy, JAX on Python 3.12+: the main job, the tests, the
# benchmarks), and VENV_OLDEST, the oldest leg (the oldest supported
# releases on Python 3.11: the tests). PYTHON / PYTHON_OLDEST name their
# interpreters; by default the newest fitting one is found.
VENV ?= .venv
VENV_OLDEST ?= .venv-oldest
PY = $(VENV)/bin/python
PY_OLDEST = $(VENV_OLDEST)/bin/python
export PYTHON PYTHON_OLDEST
# Keys Go's build cache on the headers cgo #includes from outside a
# package's folder, which Go does not track (see scripts/cgo.sh).
export CGO_CFLAGS := $(shell sh scripts/cgo.sh)
GO_FILES = $(shell git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './build/*')

.PHONY: all build lint go-test c-test py-env py-env-test py-env-bench py-test bench-test wheel wheel-test constraints test sweep sweep-producer demo bench bench-quick bench-latency bench-gpu gpu-bundle soak fuzz clean

all: build

# Both libraries, the examples and the C/C++ tests (CMake drives go build).
build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD) -j2

# Formatters and linters are part of the tests.
lint:
	@bad="$$(gofmt -l $(GO_FILES))"; if [ -n "$$bad" ]; then echo "gofmt would change:"; echo "$$bad"; exit 1; fi
	go vet ./...

go-test:
	go test -race -count=1 -timeout 10m ./...

c-test: build
	ctest --test-dir $(BUILD) --output-on-failure --timeout 300

# Python environments, PyPI only, no root (scripts/py-env.sh; pins in
# requirements/current.txt and oldest.txt). Each target installs only its
# group: py-env the main job's (PyTorch, Pillow, tqdm), py-env-test the
# suite's on both legs, py-env-bench the benchmarks' extras.
PY_ENV_DEPS = scripts/py-env.sh requirements/uv-version requirements/sweep.in
py-env: $(VENV)/.tsock-sweep
py-env-test: $(VENV)/.tsock-test $(VENV_OLDEST)/.tsock-test
py-env-bench: $(VENV)/.tsock-bench
$(VENV)/.tsock-%: requirements/%.in requirements/current.txt $(PY_ENV_DEPS)
	bash scripts/py-env.sh current $(VENV) $*
	touch $@
$(VENV_OLDEST)/.tsock-%: requirements/%.in requirements/oldest.txt $(PY_ENV_DEPS)
	bash scripts/py-env.sh oldest $(VENV_OLDEST) $*
	touch $@

# Moves the pins of both legs to what PyPI serves now (the oldest leg's
# direct pins stay: they are the supported minimum).
constraints:
	bash scripts/py-env.sh current $(VENV) sweep
	$(BUILD)/py-tools/bin/uv pip compile -q --universal --python-version 3.12 requirements/current.in -o requirements/current.txt
	$(BUILD)/py-tools/bin/uv pip compile -q --python-version 3.11 --python-platform x86_64-manylinux_2_28 requirements/oldest.in -o requirements/oldest.txt

# Python tests against the built libraries, on both legs: ruff once, then
# pytest with the current leg's Python and with the oldest leg's.
PY_TEST_ENV = TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python)
py-test: build py-env-test
	$(PY) -m ruff check python tests/python tests/wheel tests/soak examples bench
	$(PY) -m ruff format --check python tests/python tests/wheel tests/soak examples bench
	$(PY_TEST_ENV) TSOCK_LEG=current $(PY) -m pytest -q --durations=15 tests/python
	$(PY_TEST_ENV) TSOCK_LEG=oldest $(PY_OLDEST) -m pytest -q --durations=15 tests/python

# The manylinux wheel (scripts/build-wheel.sh): both libraries and the tsock
# command, for `pip install` with no Go and no C compiler; into dist/.
wheel: py-env
	bash scripts/build-wheel.sh dist

# The wheel in a fresh venv on a PATH with no go and no cc.
wheel-test: wheel py-env-test
	TSOCK_WHEEL_DIR=$(abspath dist) TSOCK_WHEEL_PYTHONS="$(abspath $(PY)) $(abspath $(PY_OLDEST))" \
		$(PY) -m pytest -q tests/wheel

# The benchmarks' smoke run (bench/run.py --quick, in bench/test_bench.py)
# with the benchmarks' extras.
bench-test: build py-env-test py-env-bench
	$(PY_TEST_ENV) $(PY) -m pytest -q bench/test_bench.py

test: lint go-test c-test py-test bench-test wheel-test

# The main job: an Optuna study (4 workers, RDB storage on SQLite) whose
# trials share one input pipeline through tsock.shared, then the same trials
# with a DataLoader each; per trial and per loader the accuracy, the
# throughput and the CPU of every process. SWEEP_ARGS=--quick for a smaller
# grid, --kill-producer S to kill the shared producer once, --help.
SWEEP_ARGS ?=
sweep: build py-env
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) examples/optuna/study.py $(SWEEP_ARGS)

# The same kind of sweep written against tsock.Producer and tsock.Consumer:
# one producer process feeding 4 trainers (SWEEP_ARGS="--device cuda:0" for
# the GPU path; --quick; --help).
sweep-producer: build py-env
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) examples/python/sweep.py $(SWEEP_ARGS)

demo:
	go run ./cmd/tsock demo

# Every benchmark against its baselines, in one run (under 10 minutes on 2
# CPUs): writes docs/BENCHMARKS.md and docs/bench/*.png. BENCH_ARGS=--quick
# for the smoke run (about a minute; into build/bench-quick).
BENCH_ARGS ?=
bench: build py-env py-env-bench
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) bench/run.py $(BENCH_ARGS)

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

bench-latency:
	go run ./bench/latency

# The GPU path against a copy per trainer and TensorSocket's CUDA mode
# (needs a GPU and a CUDA PyTorch; says so and stops otherwise).
bench-gpu: build py-env py-env-bench
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) bench/gpu.py $(GPU_ARGS)

# The libraries scripts/gpu-check.sh needs, as plain files in build-gpu/
# (git-ignored): what to send to a GPU machine without Go, where all of
# build/ would be too much to carry.
gpu-bundle: build
	rm -rf build-gpu && mkdir build-gpu
	cp -L $(BUILD)/libtsock.so $(BUILD)/libtsock_reader.so $(BUILD)/libtsock_fake_cuda.so build-gpu/
	git describe --always --dirty > build-gpu/COMMIT

# Chaos soak (docs/OPERATIONS.md): SOAK_DURATION=10m by default.
SOAK_DURATION ?= 10m
soak:
	go run ./tests/soak --duration $(SOAK_DURATION)

# Every fuzz target for FUZZTIME each (the seed corpora run in go-test).
FUZZTIME ?= 60s
fuzz:
	for t in ring:FuzzCheckHeader ring:FuzzCheckTensor ring:FuzzNameOK reader:FuzzAttachAcquire producer:FuzzBuggyReaderRecord; do \
		go test -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME) ./$${t%%:*} || exit 1; \
	done

clean:
	rm -rf $(BUILD) build-gpu $(VENV) $(VENV_OLDEST) dist
