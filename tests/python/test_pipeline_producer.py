"""tsock.Producer(pipeline): every batch tagged with its place in the
pipeline, partitioned channels a rank can filter, and a producer killed at
random points and restarted from its recorded position publishing exactly
the remaining batches, byte for byte."""

from __future__ import annotations

import glob
import os
import random
import threading
import time

import pipeline_helpers as h
import pytest
import tsock
from tsock import _capi
from tsock.producer import resume_note_path


def _read_all(reader, until_end_of: int) -> list:
    """Events from a RawReader up to the end of `until_end_of` epochs."""
    out, ends = [], 0
    while ends < until_end_of:
        ev = reader.next()
        if ev[0] == "end":
            ends += 1
            out.append(("end",))
        elif ev[0] == "batch":
            out.append(ev)
        else:
            raise AssertionError(f"reader stopped: status {ev[1]}")
    return out


def test_batches_carry_their_tag_and_consumers_read_them(channel, run_producer):
    ref_pipe = h.make_pipeline()
    pipe = h.make_pipeline(workers=2)
    # 64 slots: the whole run fits, so the two readers need not take turns.
    t = run_producer(tsock.Producer(pipe, channel, wait_readers=2, slots=64), epochs=2)
    reader = h.RawReader(channel, timeout=30)
    try:
        with tsock.Consumer(channel, output="numpy", timeout=30) as c:
            got = []
            for _ in range(2):
                assert len(c) == len(pipe)
                got.append([h.batch_hash(b) for b in c])
            events = _read_all(reader, 2)
        t.join()
    finally:
        reader.close()
        pipe.close()
    assert got == [[h.batch_hash(b) for b in ref_pipe.batches(e)] for e in range(2)]
    batches = [ev for ev in events if ev[0] == "batch"]
    assert len(batches) == 2 * len(pipe)
    for _, tag, _digest, labels in batches:
        info = ref_pipe.info(tag.epoch, tag.index)
        assert tag.fingerprint == pipe.fingerprint
        assert (tag.start, tag.samples, tag.rank, tag.world_size, tag.ranks) == (info.start, len(info), 0, 0, 1)
        assert labels == info.indices.tolist()
    assert [ev[0] for ev in events].count("end") == 2


def test_a_rank_takes_only_its_batches(channel, run_producer):
    # Two ranks in one channel: a reader of rank 1 keeps the batches tagged
    # rank 1, read in place, and gets exactly DistributedSampler's share.
    pipe = h.make_pipeline(n=23, batch_size=3, world_size=2, workers=2)
    t = run_producer(tsock.Producer(pipe, channel, wait_readers=1), epochs=2)
    reader = h.RawReader(channel, timeout=30)
    try:
        events = _read_all(reader, 2)
        t.join()
    finally:
        reader.close()
        pipe.close()
    for epoch in range(2):
        mine = [ev for ev in events if ev[0] == "batch" and ev[1].epoch == epoch and ev[1].rank == 1]
        assert [ev[1].index % 2 for ev in mine] == [1] * pipe.steps
        assert sum((ev[3] for ev in mine), []) == pipe.indices(epoch, rank=1).tolist()
        assert all(ev[1].world_size == 2 and ev[1].ranks == 2 for ev in mine)


def test_run_from_a_position(channel):
    pipe = h.make_pipeline()
    n = len(pipe)
    ref = h.reference(pipe, range(4))  # epoch e's batch i is ref[e * (n + 1) + i], its end marker ref[e * (n + 1) + n]
    errors = []

    def produce():
        try:
            with tsock.Producer(pipe, channel, wait_readers=1) as p:
                p.run(epochs=3, start=(1, 5))
                assert p.recorded_position(channel, pipe) == (3, 0)
                p.run(epochs=4, start=(3, n))  # every batch of epoch 3 was published, its marker not
                assert p.recorded_position(channel, pipe) == (4, 0)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    reader = h.RawReader(channel, timeout=30)
    try:
        events = _read_all(reader, 3)
    finally:
        t.join(60)
        reader.close()
    assert not errors, errors
    assert [ev if ev[0] == "end" else ("batch", ev[1].epoch, ev[1].index, ev[2]) for ev in events] == ref[
        (n + 1) + 5 : 3 * (n + 1)
    ] + [("end",)]


def test_recorded_position_follows_the_stream(channel):
    # The pipeline fails at batch 3 of epoch 0 (sample 13): batches 0-2 were
    # published, so the channel's position is (0, 3), whoever reads it.
    pipe = h.make_pipeline(augment=h.fail_on_13, shuffle=False)
    assert tsock.Producer.recorded_position(channel, pipe) is None  # no channel yet
    with tsock.Producer(pipe, channel, slots=64) as p:
        with pytest.raises(tsock.PipelineError, match="sample 13"):
            p.run(epochs=1)
        assert p.recorded_position(channel, pipe) == (0, 3)
        p.run(epochs=1, start=(0, 4))  # past the bad batch, to the end of the epoch
        assert p.recorded_position(channel, pipe) == (1, 0)


def test_recorded_position_refuses_another_pipeline(channel):
    pipe = h.make_pipeline(world_size=2)
    with tsock.Producer(pipe, channel) as p:
        p.run(epochs=1)
        assert p.recorded_position(channel, pipe) == (1, 0)
        with pytest.raises(ValueError, match="another pipeline"):
            p.recorded_position(channel, h.make_pipeline(world_size=2, seed=99))
        # The same pipeline, but this node makes one rank of the two: batch numbers differ.
        with pytest.raises(ValueError, match="2 rank.* of world size 2, this pipeline makes 1"):
            p.recorded_position(channel, h.make_pipeline(world_size=2, ranks=(1,)))
    plain = tsock.Producer([(h.Numbers(4)[0][0],)], channel)
    plain.run(epochs=1)
    try:
        with pytest.raises(tsock.TsockError, match="not published from a tsock Pipeline"):
            tsock.Producer.recorded_position(channel)
        with pytest.raises(ValueError, match="start= needs a tsock.Pipeline"):
            plain.run(epochs=1, start=(0, 0))
    finally:
        plain.close()


PRODUCER = """
import sys
import pipeline_helpers as h
import tsock
name, epochs = sys.argv[1], int(sys.argv[2])
pipe = h.make_pipeline(workers=2)
with tsock.Producer(pipe, name, slots=4, wait_readers=int(sys.argv[3]), timeout=120) as p:
    print("workers", *[w.pid for w in pipe._pool_box[0].procs], flush=True)
    p.run(epochs=epochs, start="recorded")
print("done", flush=True)
"""


def _workers_of(proc) -> list[int]:
    line = proc.stdout.readline().split()
    assert line and line[0] == "workers", (line, proc.stderr.read() if proc.poll() is not None else "")
    return [int(x) for x in line[1:]]


def test_producer_killed_and_restarted_publishes_exactly_the_rest(channel, spawn):
    """Kill the producer 5 times at random points (while it publishes, while
    it waits for the reader; half the time its successor too, while that
    one starts), restart it each time from its recorded position: the reader gets every batch exactly
    once, in order, the same bytes as an uninterrupted run, then every
    epoch's end marker, and no worker process is left behind."""
    epochs = 3
    pipe = h.make_pipeline()
    ref = h.reference(pipe, range(epochs))
    rng = random.Random(int(os.environ.get("TSOCK_TEST_SEED", time.time_ns())))
    # The producer is at most 4 slots ahead of the reader: killed before the
    # reader's last 6 events, it has not finished (a finished producer has
    # closed its channel: a successor would then start a new run).
    kill_at = sorted(rng.sample(range(1, len(ref) - 6), 5))
    procs, workers = [], []

    def start_producer():
        p = spawn(PRODUCER, channel, epochs, 1)
        procs.append(p)
        workers.extend(_workers_of(p))
        return p

    def restart(prod):
        prod.kill()
        prod.wait()
        if rng.random() < 0.5:
            # A successor killed too, while it starts, waits for the reader
            # or publishes its first batches.
            prod = start_producer()
            time.sleep(rng.uniform(0, 0.5))
            prod.kill()
            prod.wait()
        return start_producer()

    prod = start_producer()
    events, reader = [], None
    try:
        while True:
            if reader is None:
                try:
                    reader = h.RawReader(channel, timeout=30)
                except OSError:
                    time.sleep(0.02)
                    continue
            ev = reader.next(timeout=60)
            if ev[0] == "status":
                # The producer died: everything it published was read. Attach
                # again (the dead channel may still be there until the
                # successor replaces it).
                assert ev[1] in (_capi.EPRODUCER_GONE, _capi.ECLOSED), ev
                reader.close()
                reader = None
                if ev[1] == _capi.ECLOSED:
                    break
                time.sleep(0.02)
                continue
            events.append(ev if ev[0] == "end" else ("batch", ev[1].epoch, ev[1].index, ev[2]))
            time.sleep(rng.uniform(0, 0.01))
            if kill_at and len(events) >= kill_at[0]:
                kill_at.pop(0)
                time.sleep(rng.uniform(0, 0.03))  # anywhere: publishing, waiting for us, starting
                prod = restart(prod)
    finally:
        if reader is not None:
            reader.close()
    last = prod.stdout.readline().strip()
    assert last == "done", f"{last!r} {prod.wait()} {prod.stderr.read()}"
    assert len(procs) >= 6
    assert events == ref
    assert h.wait_gone(workers) == [], "pipeline workers outlived their producer"
    assert glob.glob(resume_note_path(channel) + "*") == [], "a note or a temporary one was left in /dev/shm"


def test_successor_killed_before_its_first_batch_resumes_from_its_note(channel, spawn):
    """A successor replaces the dead channel when it creates its own, and
    waits for readers before its first batch: killed then, its ring holds
    nothing, and the next successor must still start where the first
    producer stopped (from the note), not from the beginning."""
    pipe = h.make_pipeline()
    first = spawn(PRODUCER, channel, 3, 1)
    workers = _workers_of(first)
    reader = h.RawReader(channel, timeout=30)
    try:
        seen = [reader.next() for _ in range(7)]
    finally:
        reader.close()
    first.kill()
    first.wait()
    stopped = tsock.Producer.recorded_position(channel, pipe)
    assert stopped is not None and stopped >= (0, seen[-1][1].index + 1)
    second = spawn(PRODUCER, channel, 3, 5)  # waits for 5 readers: none come
    workers += _workers_of(second)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/tsock.{channel}") and not _replaced(channel, pipe, deadline):
        time.sleep(0.02)
    assert os.path.exists(resume_note_path(channel))
    second.kill()
    second.wait()
    assert tsock.Producer.recorded_position(channel, pipe) == stopped
    assert h.wait_gone(workers) == []
    os.unlink(resume_note_path(channel))
    assert tsock.Producer.recorded_position(channel, pipe) is None  # without the note: from the start


def _replaced(channel, pipe, deadline) -> bool:
    """The successor's channel (nothing published yet) has replaced the dead one."""
    assert time.monotonic() < deadline, "the successor did not create its channel"
    out = _capi.Peek()
    out.size = _capi.ctypes.sizeof(out)
    lib = tsock.producer.library()
    return lib.tsock_producer_peek(channel.encode(), 0, _capi.ctypes.byref(out)) == _capi.EAGAIN


def test_temporary_notes_of_dead_writers_are_removed(channel, spawn):
    # A producer killed between writing its temporary note and renaming it
    # leaves NOTE+PID; the next note written for the channel removes it (not
    # the temporary note of a live process, nor the note of a channel whose
    # name ends in .PID: review 36, L3).
    dead = spawn("pass")
    dead.wait()
    note = resume_note_path(channel)
    stale, live, other = f"{note}+{dead.pid}", f"{note}+{os.getppid()}", f"{note}.{dead.pid}"
    for path in (stale, live, other):
        with open(path, "w"):
            pass
    try:
        pipe = h.make_pipeline()
        with tsock.Producer(pipe, channel) as p:
            p.run(epochs=1, start=(0, 3))
        assert not os.path.exists(stale) and os.path.exists(live)
        assert os.path.exists(other), "channel NAME.PID's note is not a temporary of NAME's"
        assert not os.path.exists(resume_note_path(channel))
    finally:
        os.unlink(live)
        os.unlink(other)


@pytest.fixture(autouse=True)
def _no_note_left(channel):
    yield
    for path in glob.glob(resume_note_path(channel) + "*"):
        os.unlink(path)
