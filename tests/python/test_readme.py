"""The README's C and C++ reader snippets, compiled and linked with the
README's own commands (pkg-config with tsock.pc / tsock_reader.pc and the
hand-written -I/-L/rpath line) against a tsock installed by CMake into a
scratch prefix, then run against the C example producer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TSOCK_LIBRARY_DIR", ROOT / "build"))


def section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(text: str) -> list[str]:
    """The shell lines of a section's sh blocks that build something."""
    lines = [line for b in blocks(text, "sh") for line in b.splitlines()]
    return [line for line in lines if line.split(" ")[0] in ("export", "cc", "c++")]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    for tool in ("cmake", "cc", "c++"):
        assert shutil.which(tool), f"{tool} is not on PATH"
    assert (BUILD / "example_producer").is_file(), f"{BUILD} has no example_producer: make build first"
    where = tmp_path_factory.mktemp("prefix")
    subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(where)], check=True, capture_output=True)
    return where


def test_snippets_build_with_the_readme_commands_and_run(prefix, tmp_path):
    name = f"readme-{os.getpid()}"
    c_section, cpp_section = section("A reader in C"), section("A reader in C++")
    (c_src,) = blocks(c_section, "c")
    (cpp_src,) = blocks(cpp_section, "cpp")
    (tmp_path / "reader.c").write_text(c_src.replace('"demo"', f'"{name}"'))
    (tmp_path / "reader.cpp").write_text(cpp_src.replace('"demo"', f'"{name}"'))
    script = commands(c_section) + commands(cpp_section)
    # pkg-config and the flags spelled out: both ways, each must build reader.
    assert sum("pkg-config" in c for c in script) == 2 and any("-L$PREFIX/lib" in c for c in script), script

    # pkg-config itself comes from PyPI (the pkgconf package) beside this Python.
    env = dict(os.environ, PREFIX=str(prefix))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env.pop("LD_LIBRARY_PATH", None)
    built = subprocess.run(["bash", "-euc", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert built.returncode == 0, f"{script}\n{built.stdout}\n{built.stderr}"
    for exe in ("reader", "reader_cpp"):
        # found through the rpath, with no LD_LIBRARY_PATH
        libs = subprocess.run(["ldd", str(tmp_path / exe)], capture_output=True, text=True, env=env).stdout
        found = re.search(r"libtsock_reader\.so\.0 => (\S+)", libs)
        assert found and Path(found[1]).resolve() == (prefix / "lib" / "libtsock_reader.so.0").resolve(), libs

    readers = [
        subprocess.Popen([str(tmp_path / exe)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for exe in ("reader", "reader_cpp")
    ]
    try:
        producer = subprocess.run(
            [str(BUILD / "example_producer"), name, "2", "2", "5"], capture_output=True, text=True, timeout=60
        )
        assert producer.returncode == 0, producer.stderr
        (c_out, c_err), (cpp_out, cpp_err) = (r.communicate(timeout=60) for r in readers)
    finally:
        for r in readers:
            if r.poll() is None:
                r.kill()
        Path(f"/dev/shm/tsock.{name}").unlink(missing_ok=True)
    assert [r.returncode for r in readers] == [0, 0], (c_err, cpp_err)
    want = ["epoch 0: 5 batches", "epoch 1: 5 batches", "stopped: channel closed by the producer"]
    assert c_out.splitlines() == want, c_out
    cpp_lines = cpp_out.splitlines()
    assert cpp_lines.count("epoch 0 done") == 1 and cpp_lines.count("epoch 1 done") == 1, cpp_out
    assert sum(line.startswith("batch of 32 rows, x[0] = ") for line in cpp_lines) == 10, cpp_out
