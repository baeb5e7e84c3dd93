# tsock: `make sweep` runs the main job, `make test` runs every test.
BUILD ?= build
VENV ?= .venv
PY = $(VENV)/bin/python
# Keys Go's build cache on the C sources cgo #includes (see scripts/cgo.sh).
export CGO_CFLAGS := $(shell sh scripts/cgo.sh)
GO_FILES = $(shell git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './build/*')

.PHONY: all build lint go-test c-test py-env py-test test sweep demo bench bench-quick bench-latency bench-gpu soak fuzz clean

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

# Python: Debian's CPU PyTorch and NumPy plus JAX from PyPI, in $(VENV).
py-env: $(VENV)/.ready
$(VENV)/.ready: scripts/py-env.sh
	bash scripts/py-env.sh $(VENV)

# Python tests (real numpy, torch and JAX on the CPU) against the built libraries.
py-test: build py-env
	$(PY) -m ruff check python tests/python examples bench
	$(PY) -m ruff format --check python tests/python examples bench
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) -m pytest -q tests/python

test: lint py-env go-test c-test py-test

# The main job: a hyper-parameter sweep, one producer (a PyTorch DataLoader
# decoding and augmenting JPEGs) feeding 4 PyTorch trainers through tsock.
# SWEEP_ARGS=--quick for a 20-second run; --help for the options.
SWEEP_ARGS ?=
sweep: build py-env
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) examples/python/sweep.py $(SWEEP_ARGS)

demo:
	go run ./cmd/tsock demo

# Every benchmark against its baselines, in one run (under 10 minutes on 2
# CPUs): writes docs/BENCHMARKS.md and docs/bench/*.png. BENCH_ARGS=--quick
# for the smoke run (about a minute; into build/bench-quick).
BENCH_ARGS ?=
bench: build py-env
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) bench/run.py $(BENCH_ARGS)

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

bench-latency:
	go run ./bench/latency

# The GPU path against a copy per trainer and TensorSocket's CUDA mode
# (needs a GPU and a CUDA PyTorch; says so and stops otherwise).
bench-gpu: build py-env
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) PYTHONPATH=$(abspath python) $(PY) bench/gpu.py $(GPU_ARGS)

# Chaos soak (docs/OPERATIONS.md): SOAK_DURATION=10m by default.
SOAK_DURATION ?= 10m
soak:
	go run ./bench/soak --duration $(SOAK_DURATION)

# Every fuzz target for FUZZTIME each (the seed corpora run in go-test).
FUZZTIME ?= 60s
fuzz:
	for t in ring:FuzzCheckHeader ring:FuzzCheckTensor ring:FuzzNameOK reader:FuzzAttachAcquire producer:FuzzBuggyReaderRecord; do \
		go test -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME) ./$${t%%:*} || exit 1; \
	done

clean:
	rm -rf $(BUILD) $(VENV)
