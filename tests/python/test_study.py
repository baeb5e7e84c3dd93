"""The main job (`make sweep`: examples/optuna/study.py) end to end, small:
an Optuna study whose trials share one pipeline through tsock.shared, then
the same trials with a DataLoader each; the shared producer is killed once
and no trial loses or repeats a sample."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna", reason="the main job's Optuna study needs optuna (requirements/sweep.in)")

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "examples" / "optuna" / "study.py"
pytestmark = pytest.mark.timeout(900)


def test_the_study_survives_a_killed_producer_and_compares_the_loaders(tmp_path):
    env = dict(os.environ, TSOCK_RUNTIME_DIR=str(tmp_path / "rt"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    out = tmp_path / "study.json"
    cmd = [sys.executable, str(STUDY), "--quick", "--train", "640", "--val", "64", "--workers", "2"]
    cmd += ["--kill-producer", "2", "--json", str(out), "--data-dir", str(tmp_path / "data")]
    cmd += ["--out-dir", str(tmp_path / "optuna")]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=800)
    finally:  # the study's workers too, should it hang (the shared producer lingers out by itself)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    runs = {run["loader"]: run for run in json.loads(out.read_text())}
    assert set(runs) == {"tsock", "plain"}
    for run in runs.values():
        assert run["worker_status"] == [0, 0], run
        assert len(run["trials"]) == 4
        for trial in run["trials"]:
            assert trial["state"] == "COMPLETE", trial
            # every sample of every epoch, once: nothing lost or repeated across the kill
            assert trial["samples"] == run["samples_per_trial"], (run["loader"], trial)
            assert 0.0 <= trial["acc"] <= 1.0
    (kill,) = runs["tsock"]["killed_producer"]
    assert 0 < kill["at_s"] < runs["tsock"]["wall_s"], kill
    assert "Input pipeline CPU saved by sharing it" in stdout, stdout
    assert "was killed" in stdout, stdout
    # The producer that replaced the killed one lingered out: nothing of
    # the study is left running (the study reaps every process below it).
    assert not list((tmp_path / "rt").glob("*.trainer.*"))
    for alive_file in (tmp_path / "rt").glob("*.alive"):
        note = json.loads(alive_file.read_text() or "{}")
        pid = note.get("pid")
        if pid:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    assert not any(
        name.startswith(f"tsock.shared.{os.geteuid()}.") and _ours(name, tmp_path) for name in os.listdir("/dev/shm")
    )


def _ours(segment: str, tmp_path: Path) -> bool:
    """Whether a /dev/shm segment is this test's: its channel is named in one
    of this test's KEY.alive notes."""
    for alive_file in (tmp_path / "rt").glob("*.alive"):
        note = json.loads(alive_file.read_text() or "{}")
        if note.get("channel") and segment == f"tsock.{note['channel']}":
            return True
    return False
