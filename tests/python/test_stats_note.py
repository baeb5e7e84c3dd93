"""A Producer fed by a tsock.Pipeline writes the pipeline's figures for
`tsock stat` (python/tsock/_stats_note.py, read by
cmd/tsock/stat_pipeline.go) while it publishes, and removes them at close."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from pathlib import Path

import numpy as np
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
    (tmp_path / f".tsock-stats.gone+{dead}").write_text("{")  # a temporary, its writer killed
    (tmp_path / f".tsock-stats.run.{dead}").write_text("{")  # channel run.PID's, half-written by no one we know
    (tmp_path / ".tsock-stats.live").write_text(json.dumps({"pid": os.getpid()}))
    (tmp_path / ".tsock-stats.broken").write_text("not json")
    _stats_note.sweep()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".tsock-stats.broken", ".tsock-stats.live", f".tsock-stats.run.{dead}"]


def test_a_fifo_planted_at_the_temporary_name_does_not_block_the_producer(tmp_path, monkeypatch):
    # /dev/shm is world-writable and pids are public: anyone can put a FIFO
    # at NAME.PID (review 35, A1: the open blocked the publishing thread).
    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path))
    final = _stats_note.path("fifo")
    planted = f"{final}+{os.getpid()}"
    os.mkfifo(planted)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # another user's: not ours to remove
    note = _stats_note.StatsNote("fifo", h.make_pipeline(0, n=8))
    t = threading.Thread(target=note.tick, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "tick blocked on the FIFO"
    if os.geteuid() == 0:  # another user's FIFO is left, and no note written through it
        assert not os.path.exists(final) and stat.S_ISFIFO(os.lstat(planted).st_mode)


def test_a_live_producers_note_is_not_swept_though_its_pid_is_not_ours(channel, tmp_path, monkeypatch):
    # Another PID namespace sharing /dev/shm: its producer's pid means
    # nothing here, but its lock on the channel does (review 35, A5).
    pipe = h.make_pipeline(0, n=16)
    with tsock.Producer(pipe, channel, slots=4) as p:
        p.publish((np.zeros(4, np.float32),))  # the channel exists, its lock held
        note = Path(_stats_note.path(channel))
        note.write_text(json.dumps({"pid": 2**22 + 12345}))  # no such pid here
        try:
            _stats_note.sweep()
            assert note.exists(), "a live producer's note was swept"
        finally:
            note.unlink(missing_ok=True)
    pipe.close()


def test_a_note_written_after_close_is_not_left(tmp_path, monkeypatch):
    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path))
    monkeypatch.setattr(_stats_note, "INTERVAL_S", 0.0)
    note = _stats_note.StatsNote("late", h.make_pipeline(0, n=8))
    note.tick()
    assert os.path.exists(_stats_note.path("late"))
    note.remove()
    note.tick()  # the publishing thread, after a close from another thread
    assert not os.path.exists(_stats_note.path("late"))


def test_a_close_from_a_signal_handler_during_a_write_neither_hangs_nor_leaves_the_note(tmp_path, monkeypatch):
    # close() in a handler that interrupted tick's write on the same thread
    # (review 36, M1: a plain lock waited for itself for ever).
    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path))
    monkeypatch.setattr(_stats_note, "INTERVAL_S", 0.0)
    note = _stats_note.StatsNote("sig", h.make_pipeline(0, n=8))
    real = _stats_note._runtime.write_whole

    def write_then_handler(*args):
        real(*args)
        note.remove()  # what a SIGTERM handler calling producer.close() does here

    monkeypatch.setattr(_stats_note._runtime, "write_whole", write_then_handler)
    t = threading.Thread(target=note.tick, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "tick waited for itself"
    assert not os.path.exists(_stats_note.path("sig"))


def test_a_late_finalizer_leaves_a_newer_producers_note(tmp_path, monkeypatch):
    # A closed producer's note object collected late must not remove the
    # note a newer producer of the channel wrote since (review 36, L2).
    import gc

    monkeypatch.setattr(_stats_note, "DIRECTORY", str(tmp_path))
    monkeypatch.setattr(_stats_note, "INTERVAL_S", 0.0)
    old = _stats_note.StatsNote("same", h.make_pipeline(0, n=8))
    old.tick()
    new = _stats_note.StatsNote("same", h.make_pipeline(0, n=8))
    new.tick()  # replaces the file: another inode
    del old
    gc.collect()
    assert os.path.exists(_stats_note.path("same")), "the old one's finalizer removed the new note"
    new.remove()
    assert not os.path.exists(_stats_note.path("same"))
