"""The manylinux wheel (scripts/build-wheel.sh, `make wheel`) as a user gets
it from PyPI: installed with pip into a fresh venv, then used on a PATH with
no `go` and no C compiler: a producer process and two consumer processes
exchange batches, and the `tsock` console script (ls, stat, version, gpus)
sees the channel. Run by `make wheel-test` (part of `make test`), which
builds the wheel into dist/ first: TSOCK_WHEEL_DIR names that folder, and
TSOCK_WHEEL_PYTHONS the interpreters to install it for (the Pythons of both
legs; default: this one).

pip fetches NumPy, the package's one dependency, from PyPI (cached after
the first run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = Path(os.environ.get("TSOCK_WHEEL_DIR", ROOT / "dist"))
PYTHONS = os.environ.get("TSOCK_WHEEL_PYTHONS", sys.executable).split()


def the_wheel() -> Path:
    wheels = sorted(WHEEL_DIR.glob("tsock-*.whl"))
    assert len(wheels) == 1, f"want one wheel in {WHEEL_DIR} (make wheel): {wheels}"
    return wheels[0]


def base_python(python: str) -> str:
    """The interpreter a venv was made from (a fresh venv must not inherit
    the test environment's packages)."""
    out = subprocess.run(
        [python, "-c", "import sys; print(getattr(sys, '_base_executable', sys.executable))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def bare_env(venv: Path, empty: Path) -> dict:
    """A user's shell in the venv: its bin folder and nothing else on PATH,
    so no go, cc, gcc or clang; nothing that points at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSOCK_", "PYTHON", "VIRTUAL_ENV", "GO", "CGO"))}
    env.pop("CC", None)
    env.pop("LD_LIBRARY_PATH", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{empty}"
    env["VIRTUAL_ENV"] = str(venv)
    for tool in ("go", "cc", "gcc", "clang", "c++"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    return env


def run(cmd, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def test_wheel_is_manylinux_with_both_libraries_and_the_command():
    wheel = the_wheel()
    assert "-py3-none-manylinux_" in wheel.name and wheel.name.endswith("_x86_64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        mode = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        entry_points = z.read("tsock-0.1.0.dist-info/entry_points.txt").decode()
    for binary in ("tsock/_lib/libtsock.so", "tsock/_lib/libtsock_reader.so", "tsock/_bin/tsock"):
        assert binary in names, sorted(names)
    assert "tsock/py.typed" in names, "PEP 561 marker missing: " + str(sorted(names))
    assert mode["tsock/_bin/tsock"] & 0o111, oct(mode["tsock/_bin/tsock"])
    assert "tsock = tsock._cli:main" in entry_points, entry_points
    # No library was grafted in: the binaries need only the system's libc.
    assert not [n for n in names if n.startswith("tsock.libs/")], sorted(names)


PRODUCER = """
import sys, numpy as np, tsock
name, n = sys.argv[1], int(sys.argv[2])
batches = [(np.full((8, 4), i, np.float32), np.arange(8, dtype=np.int64) + i) for i in range(n)]
with tsock.Producer(batches, name, slots=4, wait_readers=2, timeout=60) as p:
    p.run(epochs=1)
    print("published", flush=True)
    sys.stdin.readline()  # the channel stays open until the test has looked at it
"""

CONSUMER = """
import json, sys, tsock
with tsock.Consumer(sys.argv[1], output="numpy", timeout=60) as c:
    seen = [(float(x[0, 0]), int(y.sum())) for x, y in c]
print(json.dumps(seen))
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_wheel_runs_producer_consumers_and_tsock_without_go_or_cc(python, tmp_path):
    wheel = the_wheel()
    base = base_python(python)
    venv, empty, work = tmp_path / "venv", tmp_path / "empty-bin", tmp_path / "work"
    empty.mkdir()
    work.mkdir()
    t0 = time.monotonic()
    run([base, "-m", "venv", str(venv)], os.environ, tmp_path)
    env = bare_env(venv, empty)
    t_venv = time.monotonic() - t0
    t0 = time.monotonic()
    pip = run(["python", "-m", "pip", "install", "--disable-pip-version-check", str(wheel)], env, work)
    t_install = time.monotonic() - t0
    assert "Building wheel" not in pip.stdout, pip.stdout  # installed as it is, nothing compiled
    version = run(["python", "-c", "import sys; print(sys.version.split()[0])"], env, work).stdout.strip()

    # The package and the command come from the venv, not from the checkout.
    where = run(["python", "-c", "import tsock, pathlib; print(pathlib.Path(tsock.__file__).parent)"], env, work)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    assert Path(shutil.which("tsock", path=env["PATH"])).parent == venv / "bin"
    assert "C ABI" in run(["tsock", "version"], env, work).stdout
    assert "NVIDIA" in run(["tsock", "gpus"], env, work).stdout  # no driver here: says so, exit 0

    name = f"wheel-{os.getpid()}-{venv.stat().st_ino}"
    producer = subprocess.Popen(
        ["python", "-c", textwrap.dedent(PRODUCER), name, "12"],
        env=env,
        cwd=work,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    consumers = [
        subprocess.Popen(
            ["python", "-c", textwrap.dedent(CONSUMER), name],
            env=env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        # Both consumers attached: the producer waited for them, then published.
        assert producer.stdout.readline().strip() == "published", producer.stderr.read()
        listing = json.loads(run(["tsock", "ls", "--json", name], env, work).stdout)
        (channel,) = listing["channels"]
        assert channel["name"] == name and channel["state"] == "open", channel
        stat = run(["tsock", "stat", "--count", "1", "--interval", "100ms", "--json", name], env, work)
        assert json.loads(stat.stdout.splitlines()[0]), stat.stdout
        want = [(float(i), 8 * i + 28) for i in range(12)]
        for c in consumers:
            out, err = c.communicate(timeout=120)
            assert c.returncode == 0, err
            assert [tuple(s) for s in json.loads(out)] == want
        producer.stdin.close()
        assert producer.wait(timeout=60) == 0, producer.stderr.read()
        gone = subprocess.run(["tsock", "ls", name], env=env, cwd=work, capture_output=True, text=True)
        assert gone.returncode == 1, gone.stdout  # the closed producer removed its channel
    finally:
        for p in (producer, *consumers):
            if p.poll() is None:
                p.kill()
            p.wait()
        Path(f"/dev/shm/tsock.{name}").unlink(missing_ok=True)
    sys.stderr.write(f"\nwheel on Python {version}: venv {t_venv:.1f} s, pip install {t_install:.1f} s\n")
