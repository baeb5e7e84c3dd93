"""Build step of `pip install .`: compiles the two libraries into tsock/_lib
and the operators' command into tsock/_bin.

    libtsock.so         go build -buildmode=c-shared ./cabi   (producer + reader)
    libtsock_reader.so  cc reader/*.c                       (reader only, no Go runtime)
    tsock               go build ./cmd/tsock (ls, stat, rm, gpus; run by the
                        `tsock` console script, python/tsock/_cli.py)

The metadata is in pyproject.toml. The wheel holds native code but no Python
extension module, so it is tagged py3-none-<platform>; scripts/build-wheel.sh
turns it into a manylinux wheel with auditwheel. Tools are found on PATH or
named by GO and CC. The Go build cache (go env GOCACHE) is shared with
`make build`, so a rebuild after `make build` mostly hits the cache.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools with the wheel package
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
# The reader's sources are the C files of reader/: the rule cgo applies to
# package reader (in libtsock.so) and CMakeLists.txt follows too.
READER_SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "reader").glob("*.c"))
LIBS = ["libtsock.so", "libtsock_reader.so"]
COMMAND = "tsock"  # in tsock/_bin
# The soname of libtsock.so: versioned by the major version, as CMake names
# libtsock_reader.so's (CMakeLists.txt, SOVERSION); the wheel's file keeps
# the plain name, which is what the package loads.
SONAME = "libtsock.so.0"


class BuildError(Exception):
    """A missing tool or a failed compiler run, with a message for humans."""


def _tools() -> tuple[str, list[str]]:
    """The go executable and the C compiler command; BuildError names what is missing."""
    go = shutil.which(os.environ.get("GO", "go"))
    cc_cmd = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    cc = shutil.which(cc_cmd[0])
    missing = []
    if go is None:
        missing.append(
            "Go (the `go` command, version in go.mod or newer; https://go.dev/dl/, "
            "or set GO=/path/to/go) builds libtsock.so"
        )
    if cc is None:
        missing.append(
            f"a C compiler (`{cc_cmd[0]}`; e.g. apt-get install gcc, or set CC=...) "
            "builds libtsock_reader.so and the cgo parts of libtsock.so"
        )
    if missing:
        raise BuildError("tsock needs tools that are not on PATH:\n  - " + "\n  - ".join(missing))
    return go, [cc, *cc_cmd[1:]]


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("tsock build:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    except subprocess.CalledProcessError as e:
        raise BuildError(f"tsock build step failed with exit status {e.returncode}: {' '.join(cmd)}") from None


def build_libraries(out_dir: Path) -> list[Path]:
    """Compiles libtsock.so and libtsock_reader.so into out_dir."""
    go, cc = _tools()
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in ["go.mod", "cabi", "cmd/tsock", "cuda", "reader", *READER_SOURCES]:
        if not (ROOT / src).exists():
            raise BuildError(f"tsock source {src} is missing from {ROOT} (build from a full checkout or sdist)")

    # Same flags as CMakeLists.txt, so both builds share Go's build cache;
    # scripts/cgo.sh keys that cache on the headers cgo cannot track (see there).
    cflags = subprocess.run(["sh", str(ROOT / "scripts" / "cgo.sh")], capture_output=True, text=True, check=True)
    env = dict(os.environ, CGO_ENABLED="1", CC=" ".join(cc), CGO_CFLAGS=cflags.stdout.strip())
    lib = out_dir / "libtsock.so"
    _run(
        [
            go,
            "build",
            "-buildmode=c-shared",
            "-buildvcs=false",
            f"-ldflags=-extldflags=-Wl,-soname,{SONAME}",
            "-o",
            str(lib),
            "./cabi",
        ],
        env=env,
    )
    (out_dir / "libtsock.h").unlink(missing_ok=True)  # cgo's header; include/tsock.h is the real one

    reader = out_dir / "libtsock_reader.so"
    _run(
        [
            *cc,
            "-std=c11",
            "-O2",
            "-fPIC",
            "-shared",
            "-Iinclude",
            "-Iring",
            "-Wl,-soname,libtsock_reader.so.0",
            "-o",
            str(reader),
            *READER_SOURCES,
            "-lpthread",
            "-ldl",
        ]
    )
    return [lib, reader]


def build_command(out_dir: Path) -> Path:
    """Compiles the tsock command (cmd/tsock) into out_dir."""
    go, cc = _tools()
    out_dir.mkdir(parents=True, exist_ok=True)
    cflags = subprocess.run(["sh", str(ROOT / "scripts" / "cgo.sh")], capture_output=True, text=True, check=True)
    env = dict(os.environ, CGO_ENABLED="1", CC=" ".join(cc), CGO_CFLAGS=cflags.stdout.strip())
    exe = out_dir / COMMAND
    _run([go, "build", "-buildvcs=false", "-trimpath", "-ldflags=-s -w", "-o", str(exe), "./cmd/tsock"], env=env)
    return exe


class BuildPyWithLibs(build_py):
    """build_py that also compiles the native libraries into tsock/_lib."""

    def run(self):
        super().run()
        # An editable install (pip install -e .) imports from python/tsock.
        base = ROOT / "python" if getattr(self, "editable_mode", False) else Path(self.build_lib)
        try:
            self._libs = build_libraries(base / "tsock" / "_lib")
            self._libs.append(build_command(base / "tsock" / "_bin"))
        except BuildError as e:
            raise SystemExit(f"\nerror: {e}\n") from None

    def get_outputs(self, include_bytecode=True):
        outs = super().get_outputs(include_bytecode)
        pkg = Path(self.build_lib) / "tsock"
        return outs + [str(pkg / "_lib" / n) for n in LIBS] + [str(pkg / "_bin" / COMMAND)]


class NativeDistribution(Distribution):
    """Holds native code: installed into platlib (the wheel's root, where
    auditwheel looks for binaries), never purelib."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Native libraries, no CPython extension: any Python 3, this platform only."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


# setuptools' scratch folder: private to this run, so concurrent builds from
# one checkout cannot mix files, and kept out of CMake's build/ folder.
_scratch = tempfile.mkdtemp(prefix="tsock-setup-")
atexit.register(shutil.rmtree, _scratch, ignore_errors=True)

setup(
    distclass=NativeDistribution,
    cmdclass={"build_py": BuildPyWithLibs, "bdist_wheel": PlatformWheel},
    options={"build": {"build_base": _scratch}},
)
