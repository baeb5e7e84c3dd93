"""`pip install .` on a fresh virtual environment builds both libraries and
the tsock command and installs a platform wheel that finds them with no
environment variables. The venv is made from the interpreter of the
running leg, with no system packages: pip fetches NumPy from PyPI.

The install takes a few seconds when Go's build cache is warm (`make build`
warms it) and about a minute cold. TSOCK_SKIP_PACKAGING=1 skips it for local
speed only: with CI set it is an error, never a silent skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The interpreter this test environment was made from (a venv's base).
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)

if os.environ.get("TSOCK_SKIP_PACKAGING"):
    if os.environ.get("CI"):
        raise RuntimeError("TSOCK_SKIP_PACKAGING is set under CI: the packaging test must run in CI")
    pytest.skip("TSOCK_SKIP_PACKAGING is set (local speed only)", allow_module_level=True)


def clean_env(**extra: str) -> dict:
    """The caller's environment without anything that would point Python at
    the checkout or at a library folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSOCK_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


# Runs inside the fresh venv, from a folder outside the checkout, after
# the source of c_roundtrip.py (the tests' folder is not on its path).
CHECK = (Path(__file__).with_name("c_roundtrip.py").read_text() + "\n") + textwrap.dedent(
    """
    import ctypes, json, os, sys, sysconfig, threading
    from pathlib import Path
    import tsock
    from tsock import _capi

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    pkg = Path(tsock.__file__).resolve().parent
    assert pkg == site / "tsock", (pkg, site)
    assert not any(k.startswith("TSOCK_") for k in os.environ)
    found = {n: str(_capi._find(n).resolve()) for n in ("libtsock.so", "libtsock_reader.so")}
    for path in found.values():
        assert Path(path).parent == pkg / "_lib", found
    reader_lib = _capi.load(reader_only=True)
    assert reader_lib.tsock_status_str(-5) == b"no such channel"
    lib = _capi.load()

    # Round trip through the C ABI: producer and reader from site-packages.
    roundtrip(_capi, lib, reader_lib, f"pkgtest-{os.getpid()}".encode(), 5_000_000_000)

    # The high-level API, once the package has it.
    high_level = hasattr(tsock, "Producer") and hasattr(tsock, "Consumer")
    if high_level:
        import numpy as np
        batches = [(np.full((4, 3), i, np.float32), np.arange(4, dtype=np.int64) + i) for i in range(5)]
        hname = f"pkgtest-hl-{os.getpid()}"
        errors = []
        with tsock.Producer(batches, name=hname, slots=4, wait_readers=1, timeout=30) as p:
            def produce():
                try:
                    p.run(epochs=1)
                except Exception as e:  # reported below
                    errors.append(e)
            th = threading.Thread(target=produce)
            th.start()
            with tsock.Consumer(hname, output="numpy", timeout=30) as c:
                seen = [(float(x[0, 0]), int(y[0])) for x, y in c]
            th.join(60)
        assert not errors, errors
        assert seen == [(float(i), i) for i in range(5)], seen
    import subprocess
    tsock_cmd = Path(sys.executable).parent / "tsock"
    assert tsock_cmd.is_file(), tsock_cmd
    version = subprocess.run([str(tsock_cmd), "version"], capture_output=True, text=True, check=True).stdout
    assert "C ABI" in version, version
    print(json.dumps({"libs": found, "high_level": high_level, "command": version.strip()}))
    """
)


# A venv, an isolated build (setuptools fetched, go build, cc) and NumPy from
# PyPI: minutes on a loaded 2-CPU machine.
@pytest.mark.timeout(900)
def test_pip_install_into_fresh_venv(tmp_path):
    env = clean_env()
    venv = tmp_path / "venv"
    t0 = time.monotonic()
    run([BASE_PYTHON, "-m", "venv", str(venv)], tmp_path, env)
    py = str(venv / "bin" / "python")
    t_venv = time.monotonic() - t0

    # Build in the venv itself when it already has setuptools and wheel (fast,
    # offline); otherwise let pip fetch them into an isolated build env.
    has_backend = subprocess.run(
        [py, "-c", "import setuptools, wheel; assert int(setuptools.__version__.split('.')[0]) >= 61"],
        env=env,
        capture_output=True,
    )
    isolation = [] if has_backend.returncode else ["--no-build-isolation"]
    t0 = time.monotonic()
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *isolation, str(ROOT)], tmp_path, env)
    t_install = time.monotonic() - t0

    work = tmp_path / "elsewhere"
    work.mkdir()
    t0 = time.monotonic()
    out = run([py, "-c", CHECK], work, env, timeout=180)
    t_check = time.monotonic() - t0
    sys.stderr.write(
        f"\npackaging: venv {t_venv:.1f} s, pip install . {t_install:.1f} s "
        f"({'no build isolation' if isolation else 'isolated build'}), import+round trip {t_check:.1f} s; "
        f"{out.stdout.strip()}\n"
    )

    wheels = list(venv.glob("lib/python3*/site-packages/tsock-*.dist-info/WHEEL"))
    assert len(wheels) == 1, wheels
    tag = [line for line in wheels[0].read_text().splitlines() if line.startswith("Tag:")]
    assert tag and tag[0].startswith("Tag: py3-none-linux_"), tag  # a platform wheel
    assert "Root-Is-Purelib: false" in wheels[0].read_text()


def test_missing_tools_give_a_clear_error(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = clean_env(PATH=str(empty))
    env.pop("GO", None)
    env.pop("CC", None)
    p = subprocess.run(
        [sys.executable, str(ROOT / "setup.py"), "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "tsock needs tools that are not on PATH" in p.stderr, p.stderr
    assert "Go (the `go` command" in p.stderr and "a C compiler" in p.stderr, p.stderr


def test_sdist_grafts_every_go_package_the_builds_import():
    # setup.py builds ./cabi and ./cmd/tsock from the sdist, which holds only
    # what MANIFEST.in grafts: a package of this module they import and the
    # manifest misses fails `pip install` from the sdist (and the wheel).
    import shutil

    go = shutil.which(os.environ.get("GO", "go"))
    if go is None:
        pytest.skip("no Go toolchain to list the packages the builds import")
    listed = subprocess.run(
        [go, "list", "-deps", "-f", "{{.ImportPath}}", "./cabi", "./cmd/tsock"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, CGO_ENABLED="1"),
    ).stdout.split()
    prefix = "github.com/tsock/tsock/"
    folders = [p[len(prefix) :] for p in listed if p.startswith(prefix)]
    assert "ring" in folders and "cmd/tsock" in folders, folders
    grafts = [line.split()[1] for line in (ROOT / "MANIFEST.in").read_text().splitlines() if line.startswith("graft ")]
    missing = [f for f in folders if not any(f == g or f.startswith(g + "/") for g in grafts)]
    assert not missing, f"MANIFEST.in grafts none of {missing}, which ./cabi or ./cmd/tsock import"
