# tsock: `make demo` runs the main job, `make test` runs every test.
BUILD ?= build
GO_FILES = $(shell git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './build/*')

.PHONY: all build lint go-test c-test py-test test demo bench-latency clean

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

# Python tests through ctypes against the built libraries.
py-test: build
	python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore ruff pytest
	python3 -m ruff check python tests/python
	TSOCK_LIBRARY_DIR=$(abspath $(BUILD)) python3 -m pytest -q tests/python

test: lint go-test c-test py-test

demo:
	go run ./cmd/tsock demo

bench-latency:
	go run ./bench/latency

clean:
	rm -rf $(BUILD)
