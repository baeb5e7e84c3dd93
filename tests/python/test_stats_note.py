"""A Producer fed by a tsock.Pipeline writes the pipeline's figures for
`tsock stat` (python/tsock/_stats_note.py, read by
cmd/tsock/stat_pipeline.go) while it publishes, and removes them at close."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pipeline_helpers as h
import tsock
from tsock import _stats_note

GO = Path(__file__).resolve().parents[2] / "cmd" / "tsock" / "stat_pipeline.go"


def _go_note_fields() -> set:
    """The JSON names of the Go side's pipelineNote fields (nested included)."""
    text = GO.read_text()
    body = text[text.index("type pipelineNote struct") : text.index("// pipelineSample is")]
    return set(re.findall(r'json:"([a-z_]+)"', body))


def test_the_producer_writes_its_pipelines_figures_and_removes_them(channel, monkeypatch):
    monkeypatch.setattr(_stats_note, "INTERVAL_S", 0.0)  # at every batch
    pipe = h.make_pipeline(2, n=32, decode=h.sleepy)
    path = _stats_note.path(channel)
    seen = []
    with tsock.Producer(pipe, channel, slots=4, wait_readers=1) as p:
        p.before_publish = lambda _: seen.append(json.loads(Path(path).read_text())) if os.path.exists(path) else None
        runner = threading.Thread(target=p.run, kwargs={"epochs": 1})
        runner.start()
        with tsock.Consumer(channel, timeout=60) as c:
            assert len(list(c)) == 8
        runner.join(60)
        note = json.loads(Path(path).read_text())
    pipe.close()
    assert not os.path.exists(path), "removed at close"
    assert seen, "written while publishing"
    assert note["pid"] == os.getpid() and note["workers"] == 2 and note["io_threads"] == 0
    assert note["stage_s"]["decode"] >= 32 * 0.002, "every sample's decode slept 2 ms"
    assert set(note["stage_s"]) == {"source", "read", "decode", "augment", "collate"}
    assert "cache" not in note, "no cache"
    assert set(note) <= _go_note_fields(), "every field is one tsock stat reads"


def test_a_note_that_cannot_be_written_costs_nothing(channel, monkeypatch, tmp_path):
    # /dev/shm full or the name taken by another user: no figures, the same batches.
    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path / "missing"))
    pipe = h.make_pipeline(0, n=16)
    with tsock.Producer(pipe, channel, slots=4, wait_readers=1) as p:
        runner = threading.Thread(target=p.run, kwargs={"epochs": 1})
        runner.start()
        with tsock.Consumer(channel, timeout=60) as c:
            assert len(list(c)) == 4
        runner.join(60)
    pipe.close()


def test_figures_of_killed_producers_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / ".tsock-stats.gone").write_text(json.dumps({"pid": dead}))
    (tmp_path / f".tsock-stats.gone.{dead}").write_text("{")  # a temporary, its writer killed
    (tmp_path / ".tsock-stats.live").write_text(json.dumps({"pid": os.getpid()}))
    (tmp_path / ".tsock-stats.broken").write_text("not json")
    _stats_note.sweep()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tsock-stats.broken", ".tsock-stats.live"]
