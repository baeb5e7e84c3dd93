"""The suite runs on the stack it claims. `make py-test` runs it twice,
with TSOCK_LEG=current (the newest releases: requirements/current.txt) and
TSOCK_LEG=oldest (the oldest supported: requirements/oldest.txt); here the
running environment is checked against its leg's pins, and the supported
range stated in pyproject.toml and the README against the oldest leg, so
that neither can drift from what was tested."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
LEG = os.environ.get("TSOCK_LEG")
FRAMEWORKS = ["numpy", "torch", "torchvision", "jax", "jaxlib", "pillow", "tqdm"]


def pins(leg: str) -> dict[str, str]:
    """name -> version of requirements/LEG.txt (uv pip compile output)."""
    out = {}
    for line in (ROOT / "requirements" / f"{leg}.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==([^ ;]+)", line)
        if m:
            out.setdefault(m[1].lower(), m[2])
    return out


def lower_bounds() -> dict[str, str]:
    """The minimum versions pyproject.toml states: Python and each dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    bounds = {"python": project["requires-python"].removeprefix(">=")}
    for r in reqs:
        name, low = re.fullmatch(r"([a-z0-9_-]+)>=([0-9.]+)", r).groups()
        bounds[name] = low
    return bounds


def test_stated_range_is_what_the_oldest_leg_runs():
    bounds, oldest = lower_bounds(), pins("oldest")
    assert set(bounds) == {"python", "numpy", "torch", "jax"}, bounds
    for name in ("numpy", "torch", "jax"):
        # The oldest leg runs the newest patch release of each stated minimum.
        assert (oldest[name] + ".").startswith(bounds[name] + "."), (name, bounds[name], oldest[name])
    assert oldest["jaxlib"] == oldest["jax"]
    script = (ROOT / "scripts" / "py-env.sh").read_text()
    assert f"oldest) min={bounds['python']} max={bounds['python']}" in script
    readme = (ROOT / "README.md").read_text()
    for name, label in [("python", "Python"), ("torch", "PyTorch"), ("numpy", "NumPy"), ("jax", "JAX")]:
        assert f"{label} {bounds[name]}" in readme, f"README does not state {label} {bounds[name]}"


def test_current_leg_is_newer_than_the_oldest():
    current, oldest = pins("current"), pins("oldest")
    for name in ("numpy", "torch", "torchvision", "jax", "jaxlib"):
        newer = tuple(map(int, re.findall(r"\d+", current[name])[:3]))
        older = tuple(map(int, re.findall(r"\d+", oldest[name])[:3]))
        assert newer > older, (name, current[name], oldest[name])
    assert int(current["numpy"].split(".")[0]) >= 2  # users run NumPy 2


def test_running_environment_is_its_leg():
    if LEG is None:
        if os.environ.get("CI"):
            pytest.fail("TSOCK_LEG is not set under CI: run the suite through make py-test")
        pytest.skip("TSOCK_LEG is not set (pytest run by hand, outside make py-test)")
    want = pins(LEG)
    got = {name: importlib.metadata.version(name) for name in FRAMEWORKS}
    assert got == {name: want[name] for name in FRAMEWORKS}, (LEG, got)
    if LEG == "current":
        assert sys.version_info >= (3, 12), sys.version  # current JAX needs 3.12
    else:
        assert sys.version_info[:2] == tuple(map(int, lower_bounds()["python"].split("."))), sys.version
    import torch

    # PyPI's torch, as users get it: the CUDA build (the machine may have no GPU).
    assert torch.version.cuda is not None, torch.__version__
