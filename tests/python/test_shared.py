"""tsock.shared: independently started trainers elect one producer process,
which lingers after the last and is replaced, exactly, when it dies
(docs/SHARED.md)."""

from __future__ import annotations

import fractions
import gc
import glob
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import shared_helpers as h
import tsock
from tsock import _shared, _state
from tsock.producer import resume_note_path

BOUND_S = 60.0  # only a failure waits this long
RECLAIM_GRACE_S = 30.0  # producer/reclaim.go reclaimGrace


def wait_for(condition, what: str, timeout: float = BOUND_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A runtime directory of this test's (children inherit it); afterwards
    every producer still running is killed and its channel removed."""
    path = tmp_path / "rt"
    monkeypatch.setenv("TSOCK_RUNTIME_DIR", str(path))
    yield path
    for alive_file in glob.glob(str(path / "*.alive")):
        key = os.path.basename(alive_file)[: -len(".alive")]
        if _shared.lock_is_held(alive_file):
            pid = _shared.Paths(str(path), key).read_alive().get("pid")
            if pid:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda f=alive_file: not _shared.lock_is_held(f), "the producer to die")
        channel = _shared.Paths(str(path), key).read_alive().get("channel")
        if not channel:
            continue
        for leftover in (f"/dev/shm/tsock.{channel}", note_path(path, channel)):
            if os.path.exists(leftover):
                os.unlink(leftover)


def note_path(runtime, channel: str) -> str:
    """Where a shared producer keeps its resume note: the runtime directory."""
    return os.path.join(runtime, os.path.basename(resume_note_path(channel)))


def token() -> str:
    return f"{os.getpid()}-{time.monotonic_ns()}"


def start_trainer(spawn, factory: str, n: int, batch_size: int, tok: str, epochs: int, stop_file: str = "", **kw):
    code = """
        import sys, shared_helpers as h
        h.train(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
    """
    return spawn(code, factory, n, batch_size, tok, epochs, stop_file, **kw)


def finish(proc, timeout: float = BOUND_S) -> list:
    """The JSON lines a trainer printed; fails with its stderr unless it exited 0."""
    # Waited for, then read: the output is small (pipes hold 64 KiB), and
    # read through the text wrappers that a readline() may have filled.
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # its stacks (PYTHONFAULTHANDLER, conftest.child_env)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        stacks = proc.stderr.read()[-6000:]
        raise AssertionError(f"trainer still running after {timeout} s; its stacks:\n{stacks}") from None
    except BaseException:
        proc.kill()
        raise
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def epochs_of(lines: list) -> list:
    return [line for line in lines if "epoch" in line]


def starts(runtime, key_suffix: str = "") -> list:
    """The 'started' lines of every producer log in the runtime directory."""
    out = []
    for log in glob.glob(str(runtime / f"*{key_suffix}.log")):
        with open(log) as f:
            out += [line for line in f if "started" in line]
    return out


def producer_pid(runtime) -> int:
    files = glob.glob(str(runtime / "*.alive"))
    if not files:
        return 0
    (alive_file,) = files
    key = os.path.basename(alive_file)[: -len(".alive")]
    if not _shared.lock_is_held(alive_file):
        return 0
    return _shared.Paths(str(runtime), key).read_alive().get("pid", 0)


def producer_processes(runtime) -> list:
    """Pids of the shared producers of this test and of their pipeline
    workers (forked from them: the same command line and environment)."""
    mine = f"TSOCK_RUNTIME_DIR={runtime}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"tsock._shared_run" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mine not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie: exited, waiting for its parent
        except OSError:
            continue
        pids.append(int(entry))
    return pids


def shared_told_of_a_slow_start(tok: str, gate):
    """tsock.shared() of h.gated_pipeline, whose gate opens once the trainer
    was told (a RuntimeWarning) that its producer has not published yet:
    the loader and the warnings seen."""
    import warnings

    def open_the_gate_once_told(seen):
        try:
            wait_for(lambda: any("has not published its first batch" in str(w.message) for w in seen), "a warning")
        finally:
            (gate / "go").touch()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        helper = threading.Thread(target=open_the_gate_once_told, args=(seen,))
        helper.start()
        try:
            loader = tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate), linger=0.3)
        finally:
            helper.join(BOUND_S)
    return loader, seen


def run_script(spawn, script) -> tuple[str, str]:
    """Runs a training script as `python script` does; its stdout and stderr."""
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = spawn(code, script)
    try:
        proc.wait(BOUND_S)
    finally:
        proc.kill()
    return proc.stdout.read(), proc.stderr.read()


# ---- one producer per pipeline ----


def test_eight_simultaneous_trainers_start_one_producer(runtime, spawn, tmp_path):
    go = tmp_path / "go"
    tok = token()
    code = """
        import os, sys, time, shared_helpers as h
        open(sys.argv[3], "w").close()
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.001)
        h.train("pipeline", 64, 8, sys.argv[2], 2)
    """
    ready = [tmp_path / f"ready{i}" for i in range(8)]
    trainers = [spawn(code, go, tok, r) for r in ready]
    # All at the same instant: each has imported tsock and spins on `go`.
    wait_for(lambda: all(r.exists() for r in ready), "the trainers to start")
    go.touch()
    results = [finish(p) for p in trainers]
    pids = {line["pid"] for r in results for line in epochs_of(r)}
    assert len(pids) == 1, pids
    assert len(starts(runtime)) == 1
    for r in results:
        for line in epochs_of(r):
            assert sorted(line["ids"]) == list(range(64))


def test_different_arguments_get_different_producers(runtime, spawn):
    tok = token()
    a = start_trainer(spawn, "pipeline", 40, 4, tok, 1)
    b = start_trainer(spawn, "pipeline", 48, 4, tok, 1)
    ra, rb = finish(a), finish(b)
    assert sorted(epochs_of(ra)[0]["ids"]) == list(range(40))
    assert sorted(epochs_of(rb)[0]["ids"]) == list(range(48))
    assert epochs_of(ra)[0]["pid"] != epochs_of(rb)[0]["pid"]
    assert len(glob.glob(str(runtime / "*.alive"))) == 2


def test_the_key_is_the_name_or_the_arguments(runtime):
    ref = _shared.factory_ref(h.pipeline)
    same = _shared.fingerprint(ref, (40, 4), {})
    assert same == _shared.fingerprint(ref, (40, 4), {})
    assert same != _shared.fingerprint(ref, (40, 5), {})
    assert same != _shared.fingerprint(_shared.factory_ref(h.plain), (40, 4), {})
    with pytest.raises(TypeError, match="pass name="):
        tsock.shared(h.pipeline, object(), 4)
    # A method bound to an object is named by its class: two objects of one
    # class in different states would share a producer (review 24). A
    # function of a module, a class, or a method bound to a class are named
    # by what they are.
    with pytest.raises(TypeError, match="bound to an object"):
        _shared.fingerprint(ref, (json.JSONEncoder(indent=2).encode,), {})
    with pytest.raises(TypeError, match="bound to an object"):
        _shared.factory_ref(json.JSONDecoder().decode)
    assert _shared.fingerprint(ref, (os.path.join, dict, fractions.Fraction.from_float), {})


def test_same_name_other_arguments_is_refused(runtime):
    name = f"n{os.getpid()}"
    with tsock.shared(h.pipeline, 40, 4, name=name, linger=0.5) as first:
        assert name in first.channel
        with pytest.raises(ValueError, match="runs another pipeline"):
            tsock.shared(h.pipeline, 44, 4, name=name)


# ---- what cannot be shared ----


def nested_factory():
    def make(n):
        return h.pipeline(n, 4)

    return make


def test_a_factory_the_producer_cannot_import_is_refused_naming_the_fix(runtime, monkeypatch):
    with pytest.raises(TypeError, match="lambda or a nested function.*top level of a .py module"):
        tsock.shared(lambda: h.pipeline(40, 4))
    with pytest.raises(TypeError, match="lambda or a nested function"):
        tsock.shared(nested_factory(), 40)

    def notebook_factory(n):
        return h.pipeline(n, 4)

    notebook_factory.__module__ = "__main__"
    notebook_factory.__qualname__ = "notebook_factory"
    kernel_main = types.ModuleType("__main__")  # an ipykernel's __main__ has no __file__
    kernel_main.notebook_factory = notebook_factory
    monkeypatch.setitem(sys.modules, "__main__", kernel_main)
    with pytest.raises(TypeError, match="notebook.*top level of a .py module"):
        tsock.shared(notebook_factory, 40)
    assert not glob.glob(str(runtime / "*.alive"))  # refused before anything started


def test_from_a_real_jupyter_kernel(runtime):
    """A notebook shares a module's factory (two epochs, the producer
    started from the kernel process) and is told how to fix a factory
    defined in a cell."""
    manager = pytest.importorskip("jupyter_client.manager", reason="needs jupyter_client (requirements/test.in)")
    pytest.importorskip("ipykernel", reason="needs ipykernel (requirements/test.in)")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    km = manager.KernelManager(kernel_name="python3")
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    km.start_kernel(env=env)
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=BOUND_S)

        def run(code: str) -> str:
            out = []

            def hook(msg):
                content = msg["content"]
                if msg["msg_type"] == "stream":
                    out.append(content["text"])
                elif msg["msg_type"] == "error":
                    out.append("\n".join(content["traceback"]))

            reply = kc.execute_interactive(code, output_hook=hook, timeout=BOUND_S)
            text = "".join(out)
            assert reply["content"]["status"] == "ok", text
            return text

        tok = token()
        run(f"import tsock, shared_helpers as h\nloader = tsock.shared(h.pipeline, 40, 4, {tok!r})")
        for _ in range(2):
            assert run("print(sorted(int(y) for _, ys in loader for y in ys.tolist()))") == f"{list(range(40))}\n"
        refused = run(
            "def mine(n):\n    return h.pipeline(n, 4)\n"
            "try:\n    tsock.shared(mine, 40)\nexcept TypeError as e:\n    print('refused:', e)"
        )
        assert refused.startswith("refused:") and "notebook" in refused and ".py module" in refused, refused
        pid = int(run("print(loader.producer_pid); loader.close()"))
    finally:
        km.shutdown_kernel(now=True)
    wait_for(lambda: not alive(pid), "the producer to linger out after the kernel's loader closed")


def test_a_runtime_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    monkeypatch.setenv("TSOCK_RUNTIME_DIR", str(loose))
    with pytest.raises(tsock.TsockError, match="mode 0700"):
        tsock.shared(h.pipeline, 40, 4)


# ---- failures of the factory ----


def test_a_factory_that_raises_reaches_the_trainers(runtime):
    tok = token()
    for _ in range(2):  # each call tries again: the cause may have been fixed in between
        # A first start: "could not be started", not "no successor" (review 24, F9).
        with pytest.raises(
            tsock.ProducerGone, match=f"could not be started: ValueError: dataset 40 is not there \\(token {tok}\\)"
        ):
            tsock.shared(h.failing, 40, 4, tok)
    assert len(starts(runtime)) == 2


def test_a_loader_that_fails_later_ends_every_trainer_with_its_message_and_no_successor(runtime):
    with tsock.shared(h.failing_later, 40, 4, token(), linger=0.5) as loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
        with pytest.raises(tsock.ProducerGone, match="no successor.*bad sample in the second epoch"):
            list(loader)
    assert len(starts(runtime)) == 1


# ---- lifetime ----


def test_the_producer_lingers_then_exits_leaving_nothing_in_dev_shm(runtime):
    loader = tsock.shared(h.pipeline, 40, 4, token(), linger=5)  # long enough to see it linger, under load
    channel = loader.channel
    assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
    pid = loader.producer_pid
    loader.close()
    assert os.path.exists(f"/dev/shm/tsock.{channel}")  # lingering
    wait_for(lambda: not alive(pid), "the producer to exit after its linger time")
    assert not os.path.exists(f"/dev/shm/tsock.{channel}")
    assert not os.path.exists(note_path(runtime, channel))
    assert not glob.glob(str(runtime / "*.trainer.*"))


def test_shared_producers_finds_the_running_producer_by_its_factory_and_arguments(runtime):
    tok = token()
    assert tsock.shared_producers() == []
    loader = tsock.shared(h.pipeline, 40, 4, tok, linger=0.5)
    other = tsock.shared(h.pipeline, 40, 4, tok, linger=0.5)  # the same key: two loaders of one producer
    try:
        (found,) = tsock.shared_producers(h.pipeline, 40, 4, tok)
        assert (found.key, found.pid, found.channel) == (loader.key, loader.producer_pid, loader.channel)
        assert found.trainers == 2 and found.description == loader.description
        assert tsock.shared_producers(h.pipeline, 40, 4, "another token") == []
        assert tsock.shared_producers(name=loader.key) == [found]
        assert tsock.shared_producers() == [found]
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
    finally:
        other.close()
        loader.close()
    wait_for(lambda: not alive(found.pid), "the producer to exit after its linger time")
    assert tsock.shared_producers() == []
    assert not glob.glob(str(runtime / "*.alive.*"))  # the query made no file


def test_the_trainer_that_started_the_producer_can_be_killed(runtime, spawn, tmp_path):
    tok = token()
    stop = tmp_path / "stop"
    first = start_trainer(spawn, "slow_pipeline", 64, 4, tok, 1, stop, start_new_session=True)
    pid = json.loads(first.stdout.readline())["attached"]
    others = [start_trainer(spawn, "slow_pipeline", 64, 4, tok, 2) for _ in range(2)]
    assert [json.loads(p.stdout.readline())["attached"] for p in others] == [pid, pid]
    os.killpg(first.pid, signal.SIGKILL)  # the trainer and its process group
    first.wait()
    for r in (finish(p) for p in others):
        lines = epochs_of(r)
        assert len(lines) == 2
        for line in lines:
            assert sorted(line["ids"]) == list(range(64))
            assert line["pid"] == pid
    assert len(starts(runtime)) == 1


# ---- a producer crash is survived ----


def test_producer_killed_at_random_points_every_trainer_gets_each_sample_once_per_epoch(runtime, spawn, tmp_path):
    tok = token()
    stop = tmp_path / "stop"
    trainers = [start_trainer(spawn, "slow_pipeline", 96, 4, tok, 1, stop) for _ in range(3)]
    rng = random.Random(13)
    killed = []
    for _ in range(10):
        pid = wait_for(lambda: (p := producer_pid(runtime)) not in killed and p, "a producer")
        time.sleep(rng.uniform(0, 0.3))  # while it starts, waits for trainers or publishes
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    stop.touch()
    results = [finish(p) for p in trainers]
    for r in results:
        lines = epochs_of(r)
        assert lines, r
        for line in lines:
            assert sorted(line["ids"]) == list(range(96)), (line["epoch"], len(line["ids"]))
        # The successors started where the dead producer stopped: nothing
        # was published again for a trainer to drop.
        assert (r[-1]["lost"], r[-1]["repeated"], r[-1]["restarts"]) == (0, 0, 0)
    assert sum(r[-1]["recoveries"] for r in results) >= 1
    # The last producer lingers, then exits; the killed ones' workers died with them.
    wait_for(lambda: not producer_processes(runtime), "every producer and pipeline worker to exit")


def test_a_plain_loader_restarts_the_epoch_and_tells_the_trainer(runtime):
    loader = tsock.shared(h.plain, 400, 4, token(), linger=0.3)
    it = iter(loader)
    first = next(it)[1].tolist()
    assert first == [0, 1, 2, 3]
    os.kill(loader.producer_pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match="epoch 0 restarted"):
        rest = [y for _, ys in it for y in ys.tolist()]
    assert loader.restarts == 1 and loader.recoveries == 1
    # The successor's first epoch came whole, after what was read before.
    assert rest[-400:] == list(range(400))
    loader.close()


class FakeProducer:
    """The Gate's view of a producer: the pids of its attached readers."""

    name = "shared.fake"

    def __init__(self):
        self.readers = []

    def stats(self):
        return {"readers": len(self.readers)}

    def reader_pids(self):
        return list(self.readers)


def test_a_producer_waits_for_every_live_trainer_before_its_first_batch(runtime):
    """The successor publishes nothing until every trainer of the roster is
    attached again: one attaching later would miss batches (start="now")."""
    from tsock import _shared_run

    runtime.mkdir(mode=0o700)
    paths = _shared.Paths(str(runtime), "k")
    rosters = [_shared.open_lock(paths.trainer(1, serial)) for serial in (0, 1)]
    for fd in rosters:
        assert _shared.try_lock(fd)
    producer = FakeProducer()
    gate = _shared_run.Gate(paths, linger=60.0, alive=-1, announce=lambda paths, channel: None)
    passed = []
    import threading

    t = threading.Thread(target=lambda: passed.append(gate(producer)), daemon=True)
    t.start()
    producer.readers = [1]
    time.sleep(0.2)  # long enough for the gate's 10 ms polls to let it through, were it to
    assert not passed
    producer.readers = [1, 1]
    t.join(BOUND_S)
    assert passed == [None]
    # A trainer that dies is counted out: one live trainer, one reader.
    gate.first = True
    _shared.close_lock(rosters[0])
    producer.readers = [1]
    gate(producer)
    _shared.close_lock(rosters[1])


def test_a_killed_trainers_reader_does_not_stand_in_for_a_live_trainer_not_attached_yet(runtime):
    """A trainer killed just after it attached leaves the roster at once (its
    flock), but stays a reader until the producer has seen its connection
    end. The successor counted readers against trainers: the dead one's
    reader stood in for a live trainer busy elsewhere, the successor
    published, and that trainer, attaching later with start="now", lost
    those batches (review 27, N1). Here trainer 11 is attached, 12 is not
    yet, and 13 (killed) is still a reader: the gate must wait for 12."""
    import threading

    from tsock import _shared_run

    runtime.mkdir(mode=0o700)
    paths = _shared.Paths(str(runtime), "k")
    rosters = [_shared.open_lock(paths.trainer(pid)) for pid in (11, 12)]
    for fd in rosters:
        assert _shared.try_lock(fd)
    producer = FakeProducer()
    producer.readers = [11, 13]
    gate = _shared_run.Gate(paths, linger=60.0, alive=-1, announce=lambda paths, channel: None)
    passed = []
    t = threading.Thread(target=lambda: passed.append(gate(producer)), daemon=True)
    t.start()
    time.sleep(0.2)  # long enough for the gate's 10 ms polls to let it through, were it to
    assert not passed, "published before trainer 12 attached"
    producer.readers = [11, 12]  # 13's entry freed, 12 attached
    t.join(BOUND_S)
    assert passed == [None]
    for fd in rosters:
        _shared.close_lock(fd)


def test_a_stream_past_the_position_is_caught_up_from_it_whatever_the_jump():
    """A jump from (1, 27) to (3, 388) in epochs of 400 batches: before the
    catch-up, only the first epoch boundary was counted as lost (review 27,
    N1); now the trainer's batches from (1, 27) come from a producer of its
    own, and nothing is lost."""
    loader = object.__new__(_shared.SharedLoader)
    loader.key, loader.epoch, loader.restarts, loader.lost_batches, loader.evictions = "k", 0, 0, 0, 0
    loader._position, loader._epoch_done, loader._resumed = ("f", 1, 27), False, False
    started = []
    loader._start_catchup = lambda: started.append(loader._position)
    assert not loader._take(types.SimpleNamespace(fingerprint="f", epoch=3, index=388), 400)
    assert started == [("f", 1, 27)] and loader.lost_batches == 0
    assert loader.position == (1, 27)


def test_the_producer_names_its_readers_by_pid(runtime):
    """What the gate matches the roster against: the kernel's pid of each
    attached reader, once per reader."""
    channel = f"rp{os.getpid()}x{time.monotonic_ns() % 10**9}"
    import numpy as np

    with tsock.Producer(name=channel) as producer:
        producer.publish((np.zeros(4, np.float32),))  # the channel exists from the first batch
        assert producer.reader_pids() == []
        with tsock.Consumer(channel, timeout=BOUND_S), tsock.Consumer(channel, timeout=BOUND_S):
            wait_for(lambda: len(producer.reader_pids()) == 2, "two readers")
            assert producer.reader_pids() == [os.getpid(), os.getpid()]
        wait_for(lambda: producer.reader_pids() == [], "the readers to leave")
    assert producer.reader_pids() == []


def read_into_epoch_3(loader):
    """35 batches of a 40-sample pipeline of batch 4 (10 a epoch): epoch 3,
    batch 5. Returns the epoch's iterator."""
    for _ in range(3):
        assert sum(1 for _ in loader) == 10
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert loader.position == (3, 5)
    return it


def read_on_past_the_dead_ring(loader, epoch_3) -> None:
    """The rest of epoch 3 and epochs 4 and 5: 25 batches, more than the
    dead producer's ring held (16 slots), so the trainer recovers on the way."""
    rest = [y for _, ys in epoch_3 for y in ys.tolist()]
    assert len(rest) == 20
    for _ in range(2):
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
    assert loader.position == (6, 0)


def test_a_trainer_arriving_while_the_only_trainer_is_busy_after_a_crash_starts_a_successor(runtime, spawn, tmp_path):
    """The run's only trainer is busy (an evaluation) when its producer dies,
    and a new trainer arrives. It started a new run (a new channel, epoch 0)
    and removed the dead run's segment: the busy trainer came back, attached
    and dropped the 35 batches up to its position (review 27, N4)."""
    tok, stop = token(), tmp_path / "stop"
    busy = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    channel = busy.channel
    epoch_3 = read_into_epoch_3(busy)
    dead = busy.producer_pid
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: not _shared.lock_is_held(busy._paths.alive), "the producer to die")
    newcomer = start_trainer(spawn, "pipeline", 40, 4, tok, 1, stop)
    assert json.loads(newcomer.stdout.readline())["attached"] not in (0, dead)
    read_on_past_the_dead_ring(busy, epoch_3)  # the busy trainer comes back
    assert busy.channel == channel  # the run's successor, not a new run
    assert (busy.recoveries, busy.repeated_batches, busy.lost_batches) == (1, 0, 0)
    busy.close()
    stop.touch()
    result = finish(newcomer)
    assert result[-1] == {"recoveries": 0, "restarts": 0, "lost": 0, "repeated": 0}
    for line in epochs_of(result):  # from the next epoch start, whole
        assert sorted(line["ids"]) == list(range(40))


def test_a_trainer_attaching_when_the_producer_dies_starts_a_successor_on_its_channel(runtime, spawn, tmp_path):
    """A trainer attaching to a live producer that dies before it is attached
    started a producer on a new channel: the run restarted at epoch 0 and
    the trainer already in it dropped the batches up to its position
    (review 27, N3). The producer is stopped while the second trainer
    joins, then killed."""
    tok, stop = token(), tmp_path / "stop"
    first = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    channel = first.channel
    epoch_3 = read_into_epoch_3(first)
    pid = first.producer_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        second = start_trainer(spawn, "pipeline", 40, 4, tok, 1, stop)
        wait_for(lambda: first._paths.live_trainers() == 2, "the second trainer to register")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    assert json.loads(second.stdout.readline())["attached"] not in (0, pid)
    read_on_past_the_dead_ring(first, epoch_3)
    assert first.channel == channel  # the successor took the run's channel, and resumed it
    assert (first.recoveries, first.repeated_batches, first.lost_batches) == (1, 0, 0)
    first.close()
    stop.touch()
    result = finish(second)
    assert result[-1] == {"recoveries": 0, "restarts": 0, "lost": 0, "repeated": 0}
    for line in epochs_of(result):
        assert sorted(line["ids"]) == list(range(40))


def test_two_loaders_of_one_key_in_one_process_survive_a_crash(runtime):
    """Two models trained in lockstep, zip(a, b): after a crash the first
    loader to notice attached to the successor and waited for its first
    batch, which waited for the second loader, which could attach only
    when the first returned: they waited for each other for ever (review
    27, N6)."""
    import threading

    tok = token()
    a = tsock.shared(h.pipeline, 40, 4, tok, linger=0.5)
    b = tsock.shared(h.pipeline, 40, 4, tok, linger=0.5)
    epochs, failed = [], []

    def lockstep():
        try:
            for epoch in range(4):
                got = ([], [])
                for (_xa, ya), (_xb, yb) in zip(a, b):
                    got[0].extend(ya.tolist())
                    got[1].extend(yb.tolist())
                    if epoch == 1 and len(got[0]) == 8:
                        os.kill(a.producer_pid, signal.SIGKILL)  # mid-epoch
                epochs.append(got)
        except Exception as e:
            failed.append(e)

    t = threading.Thread(target=lockstep, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "the two loaders still wait for each other"
    assert not failed, failed
    for got in epochs:
        assert sorted(got[0]) == sorted(got[1]) == list(range(40))
    assert a.recoveries == b.recoveries == 1
    assert (a.repeated_batches, a.lost_batches, b.repeated_batches, b.lost_batches) == (0, 0, 0, 0)
    a.close()
    b.close()
    assert a._paths.live_trainers() == 0


def evict(busy, steady):
    """`busy` reads a batch and stops; `steady` reads on, more than the ring
    holds past busy's batch: the producer cannot have published that much
    without evicting busy (evict_after)."""
    it = iter(busy)
    held = next(it)
    steady_it = iter(steady)
    for _ in range(3 * 4):  # slots=4
        next(steady_it)
    return it, held


EVICTING = {"evict_after": 0.3, "slots": 4}


def test_an_evicted_trainer_attaches_again_and_is_told(runtime):
    """Evicted escaped the loop, and every later next() raised it again:
    the loader was dead for good (review 27, N8)."""
    tok = token()
    steady = tsock.shared(h.pipeline, 400, 4, tok, linger=0.3, producer=EVICTING)
    busy = tsock.shared(h.pipeline, 400, 4, tok, linger=0.3, producer=EVICTING)
    it, _held = evict(busy, steady)
    epoch = busy.position.epoch  # of busy's first batch: the next one if it attached after the join window
    steady.close()  # not to hold the producer back in turn
    with pytest.warns(RuntimeWarning) as told:
        more = [y for _, ys in it for y in ys.tolist()]
    told = [str(w.message) for w in told]
    assert any("evicted; it attaches again" in m for m in told), told
    assert more and busy.evictions == 1
    # The stream went on meanwhile: caught up on a producer of its own, nothing lost.
    assert busy.catchups == 1 and busy.lost_batches == 0
    assert busy.position == (epoch + 1, 0)
    # The next epoch comes whole.
    assert sorted(y for _, ys in busy for y in ys.tolist()) == list(range(400))
    busy.close()
    assert busy._paths.live_trainers() == 0


def test_closing_an_evicted_trainer_leaves_the_roster(runtime):
    """close() raised Evicted (the Consumer's keep) before the roster file
    was released: it stayed locked for the process's life, and every later
    producer of the key waited for it (review 27, N8)."""
    tok = token()
    steady = tsock.shared(h.pipeline, 400, 4, tok, linger=0.3, producer=EVICTING)
    busy = tsock.shared(h.pipeline, 400, 4, tok, linger=0.3, producer=EVICTING)
    _it, held = evict(busy, steady)  # a batch still referenced: close() keeps it, which an eviction refuses
    busy.close()
    assert busy._paths.live_trainers() == 1  # steady only
    steady.close()
    assert busy._paths.live_trainers() == 0


SCRIPT = """
import multiprocessing as mp
import sys

import numpy as np
import shared_helpers as h
import tsock


def make(n, batch_size, tok):  # in the script itself: the producer loads it as a module
    return tsock.Pipeline(h.Ids(n), batch_size=batch_size, seed=3)


def child(tok, out, inherited):
    if inherited is not None:
        try:
            iter(inherited)
            out.put("the inherited loader was usable")
            return
        except tsock.TsockError:
            pass
    loader = tsock.shared(make, 40, 4, tok, linger=0.5)
    ids = sorted(int(y) for _, ys in loader for y in np.asarray(ys).tolist())
    out.put((ids == list(range(40)), loader.producer_pid))
    loader.close()


if __name__ == "__main__":
    tok = sys.argv[1]
    loader = tsock.shared(make, 40, 4, tok, linger=0.5)
    children = []
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(tok, q, loader if method == "fork" else None))
        p.start()
        children.append((method, p, q))
    results = {}
    while len(results) < len(children):  # read epochs until each child has had one
        assert sum(1 for _ in loader) == 10
        for method, p, q in children:
            if method not in results and not q.empty():
                results[method] = q.get()
    for _, p, _ in children:
        p.join()
    for method, (ok, pid) in results.items():
        assert ok and pid == loader.producer_pid, (method, ok, pid, loader.producer_pid)
    print("ok", loader.producer_pid)
    loader.close()
"""


def test_a_script_factory_shared_by_fork_and_spawn_children(runtime, spawn, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = spawn(code, script, token())
    try:
        proc.wait(BOUND_S)
    finally:
        proc.kill()
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 0 and out.startswith("ok "), err[-3000:]
    assert len(starts(runtime)) == 1


def test_a_killed_trainers_forked_children_do_not_keep_it_in_the_roster(runtime, spawn):
    """A DataLoader worker (say) forked by a trainer that is then killed must
    not hold the trainer's roster lock: the producer would wait for it."""
    code = """
        import os, sys, time, shared_helpers as h, tsock
        loader = tsock.shared(h.pipeline, 40, 4, sys.argv[1], linger=0.3)
        if os.fork() == 0:
            time.sleep(600)  # the worker, alive after its parent (killed at the end)
            os._exit(0)
        print(loader.key, flush=True)
        time.sleep(60)
    """
    trainer = spawn(code, token(), start_new_session=True)
    key = trainer.stdout.readline().strip()
    paths = _shared.Paths(str(runtime), key)
    assert paths.live_trainers() == 1
    os.kill(trainer.pid, signal.SIGKILL)  # the trainer only: its child lives on
    trainer.wait()
    try:
        wait_for(lambda: paths.live_trainers() == 0, "the killed trainer to leave the roster")
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)


def test_a_key_that_extends_another_with_trainer_is_not_in_its_roster(runtime):
    """name='exp' and name='exp.trainer.x': every file of the second matched
    the first's roster prefix 'exp.trainer.': its producer counted the
    other key's trainers (and producer lock) as its own, waited for them,
    and removed the other key's unlocked files (.ready, .start, .log)
    (review 27, N7). The roster is now the names KEY.trainer.PID.SERIAL
    exactly."""
    runtime.mkdir(mode=0o700)
    exp = _shared.Paths(str(runtime), "exp")
    others = [_shared.Paths(str(runtime), key) for key in ("exp.trainer.x", "exp.trainer.7", "exp.trainer.7.0")]
    held, files = [], []
    for other in others:
        held.append(other.join_roster(other.trainer(os.getpid())))
        held.append(_shared.open_lock(other.alive))
        assert _shared.try_lock(held[-1])
        for path in (other.start, other.ready, other.log, other.error):
            open(path, "w").close()
            files.append(path)
    try:
        assert exp.live_trainers() == 0
        assert all(os.path.exists(path) for path in files)
        assert [other.live_trainers() for other in others] == [1, 1, 1]
    finally:
        for fd in held:
            _shared.close_lock(fd)


def test_a_lock_file_of_another_user_is_refused(runtime):
    runtime.mkdir(mode=0o700)
    key = _shared.fingerprint(_shared.factory_ref(h.pipeline), (40, 4, "x"), {})
    planted = runtime / f"{key}.start"
    planted.touch()
    os.chown(planted, 65534, 65534)
    with pytest.raises(tsock.TsockError, match="not a regular file of uid"):
        tsock.shared(h.pipeline, 40, 4, "x")


def test_a_stale_channel_of_a_dead_producer_is_replaced_and_a_new_run_starts_at_the_beginning(runtime):
    tok = token()
    loader = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    it = iter(loader)
    next(it)
    os.kill(loader.producer_pid, signal.SIGKILL)  # mid-epoch, then its only trainer goes
    dead = loader.producer_pid
    wait_for(lambda: not _shared.lock_is_held(str(runtime / f"{loader.key}.alive")), "the producer to die")
    loader._consumer.close()  # what a killed trainer leaves: no detach by this loader
    loader._consumer = None
    loader.close()
    assert os.path.exists(f"/dev/shm/tsock.{loader.channel}")  # the dead producer's segment
    with tsock.shared(h.pipeline, 40, 4, tok, linger=0.3) as fresh:
        assert fresh.producer_pid != dead
        assert fresh.channel != loader.channel  # a new run, a new name; the dead run's segment removed
        assert not os.path.exists(f"/dev/shm/tsock.{loader.channel}")
        ids = [y for _, ys in fresh for y in ys.tolist()]
        assert sorted(ids) == list(range(40))
        assert fresh.position == (1, 0)  # it read epoch 0, not the rest of the dead run's epoch
        assert fresh.repeated_batches == 0


def test_a_trainer_killed_holding_the_start_lock_blocks_nobody(runtime, spawn):
    tok = token()
    key = _shared.fingerprint(_shared.factory_ref(h.pipeline), (40, 4, tok), {})
    runtime.mkdir(mode=0o700)
    holder = spawn(
        """
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
        """,
        runtime / f"{key}.start",
    )
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with tsock.shared(h.pipeline, 40, 4, tok, linger=0.3) as loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))


def test_arguments_pickle_refuses_are_named(runtime):
    import threading

    with pytest.raises(TypeError, match="pickle refused"):
        tsock.shared(h.pipeline, 40, 4, threading.Lock(), name=f"p{os.getpid()}")


def test_a_pipeline_built_differently_by_the_successor_restarts_the_epoch_and_tells_the_trainer(runtime):
    loader = tsock.shared(h.unseeded, 400, 4, token(), linger=0.3)
    it = iter(loader)
    next(it)
    os.kill(loader.producer_pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match="another fingerprint"):
        rest = [y for _, ys in it for y in ys.tolist()]
    assert loader.restarts == 1 and loader.recoveries == 1 and loader.repeated_batches == 0
    # The successor's pipeline from its first batch: its whole epoch, in this loop.
    assert sorted(rest[-400:]) == list(range(400))
    loader.close()


def test_a_producer_that_answers_a_join_late_does_not_end_the_trainer(runtime, spawn):
    # The producer stopped (SIGSTOP) while a second trainer joins: its join
    # slices time out, and it waits on while the producer lives. Before,
    # the first timed-out slice (TsockError ETIMEDOUT) ended the trainer;
    # the 10-kill test hit it beside four CPU hogs (review 24).
    tok = token()
    first = tsock.shared(h.pipeline, 40, 4, tok, linger=1.5)
    pid = first.producer_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        second = start_trainer(spawn, "pipeline", 40, 4, tok, 1)
        # Once it is in the roster (its interpreter may take seconds to
        # start on a loaded machine), it attaches, and its slices of 0.25 s
        # time out meanwhile.
        wait_for(lambda: first._paths.live_trainers() >= 2, "the second trainer to enter the roster")
        time.sleep(1)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert sorted(y for _, ys in first for y in ys.tolist()) == list(range(40))
    # Closed before the second is waited for: attached and not reading, it
    # held the producer a ring ahead of it, and a second trainer that
    # joined after that (start at the next epoch) waited for ever (issue
    # 16: a loaded series failed so).
    first.close()
    assert sorted(epochs_of(finish(second))[0]["ids"]) == list(range(40))


def test_a_trainer_registering_while_a_producer_counts_the_roster_stays_counted(runtime, monkeypatch):
    """A roster file seen by a producer's count before its trainer locked it
    was removed as a dead trainer's: that trainer was then left out of every
    later producer's wait, and lost batches after a crash (review 24, F1).
    The window between making the file and locking it is widened here until
    the count has run twice through the directory."""
    import threading

    tok = token()
    first = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    paths = first._paths
    polls = [0]
    stop = threading.Event()

    def count_like_the_gate():
        while not stop.is_set():
            paths.live_trainers()
            polls[0] += 1

    real_try_lock = _shared.try_lock

    registering = threading.get_ident()

    def slow_try_lock(fd):
        # The trainer's thread, about to lock its roster file (the count's
        # own thread takes the real one).
        if threading.get_ident() == registering and ".trainer." in os.readlink(f"/proc/self/fd/{fd}"):
            seen = polls[0]
            wait_for(lambda: polls[0] >= seen + 2, "the count to run through the roster twice")
        return real_try_lock(fd)

    counter = threading.Thread(target=count_like_the_gate, daemon=True)
    counter.start()
    monkeypatch.setattr(_shared, "try_lock", slow_try_lock)
    try:
        second = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    finally:
        stop.set()
        counter.join(BOUND_S)
    monkeypatch.setattr(_shared, "try_lock", real_try_lock)
    assert paths.live_trainers() == 2
    second.close()
    first.close()


def test_a_new_run_whose_first_producer_dies_does_not_resume_a_dead_earlier_run(runtime, tmp_path):
    """An earlier run's producer killed mid-epoch with no trainer left leaves
    its segment. A new run's first producer killed before its first batch
    made the next one a successor, which resumed the earlier run's position
    (review 24, F4): the new run began in the middle of another epoch."""
    import threading

    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    (gate / "go").touch()
    earlier = tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate), linger=30.0)
    batches = (batch for _epoch in range(3) for batch in earlier)
    for _ in range(13):  # into its second epoch: (1, 3) at least is recorded
        next(batches)
    os.kill(earlier.producer_pid, signal.SIGKILL)
    wait_for(lambda: not _shared.lock_is_held(earlier._paths.alive), "the earlier producer to die")
    earlier._consumer.close()  # what a killed trainer leaves: no detach by this loader
    earlier._consumer = None
    earlier.close()
    assert tsock.Producer.recorded_position(earlier.channel) >= (1, 3)
    (gate / "go").unlink()
    for f in gate.glob("factory.*"):
        f.unlink()
    made = []
    thread = threading.Thread(target=lambda: made.append(tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate))))
    thread.start()
    try:
        first = wait_for(lambda: list(gate.glob("factory.*")), "the new run's first producer to run its factory")
        os.kill(int(first[0].name.split(".")[1]), signal.SIGKILL)
    finally:
        (gate / "go").touch()
        thread.join(BOUND_S)
    (fresh,) = made
    with fresh:
        assert sorted(y for _, ys in fresh for y in ys.tolist()) == list(range(40))
        assert fresh.position == (1, 0)  # its epoch 0, not the rest of the earlier run's
        assert fresh.recoveries == 0 and fresh.repeated_batches == 0


def read_past_the_dead_ring(loader, it, into: list) -> None:
    """The rest of the epoch and one more (17 batches from (1, 3) in epochs
    of 10: more than a dead ring of 16 slots held), into `into`: the
    trainer recovers on the way."""
    into.extend(y for _, ys in it for y in ys.tolist())
    into.extend(y for _, ys in loader for y in ys.tolist())


def test_a_successor_keeps_its_resume_note_in_the_runtime_directory(runtime):
    """It was /dev/shm/.tsock-resume.CHANNEL, where another uid, who reads
    the channel from `ls /dev/shm`, could plant a file the successor can
    neither replace nor remove: its TsockError ended every trainer at the
    next crash (review 27, N2). The note lives while the successor waits
    for a trainer (here a roster entry that never attaches)."""
    import threading

    tok = token()
    loader = tsock.shared(h.pipeline, 40, 4, tok, linger=30.0)
    it = iter(loader)
    for _ in range(13):  # epoch 1, batch 3: a position to resume at
        if next(it, None) is None:
            it = iter(loader)
            next(it)
    stalling = loader._paths.join_roster(loader._paths.trainer(os.getpid(), 10**6))
    os.kill(loader.producer_pid, signal.SIGKILL)
    rest = []
    reader = threading.Thread(target=read_past_the_dead_ring, args=(loader, it, rest), daemon=True)
    reader.start()
    try:
        wait_for(lambda: os.path.exists(note_path(runtime, loader.channel)), "the successor's resume note")
        assert not os.path.exists(resume_note_path(loader.channel))  # not in /dev/shm
    finally:
        _shared.close_lock(stalling)  # the successor publishes now, and removes its note
    reader.join(BOUND_S)
    assert len(rest) == 28 + 40 and loader.position == (3, 0) and loader.recoveries == 1
    assert (loader.repeated_batches, loader.lost_batches) == (0, 0)
    wait_for(lambda: not os.path.exists(note_path(runtime, loader.channel)), "the note to go")
    loader.close()


def test_a_file_of_another_user_at_a_dead_runs_names_does_not_stop_a_new_run(monkeypatch):
    """A new run's first producer removes the dead run's segment and note;
    a file another uid planted there (the name is listed in /dev/shm) is one
    a non-root user can neither remove nor replace, and the PermissionError
    ended every later producer of the key at its start (review 27, N2). A
    non-root victim's unlink is simulated here: it raises EPERM."""
    import errno

    from tsock import _shared_run

    channel = _shared.new_channel(f"plant{os.getpid()}")
    planted = _shared.segment_path(channel)
    with open(planted, "w") as f:
        f.write("planted")
    real_unlink = os.unlink
    try:
        if os.geteuid() == 0:
            os.chown(planted, 65534, 65534)

        def unlink_as_a_user(path, *args, **kwargs):
            if path == planted:
                raise PermissionError(errno.EPERM, "Operation not permitted", path)
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", unlink_as_a_user)
        _shared_run._forget_earlier_run(channel)  # raised PermissionError
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert os.path.exists(planted)  # not ours: left
    finally:
        real_unlink(planted)


@pytest.mark.filterwarnings("ignore:.*has not published its first batch:RuntimeWarning")
def test_a_slow_successor_resumes_though_another_producer_is_created_meanwhile(runtime, tmp_path):
    """The successor reads where the dead producer stopped after its factory
    ran. Every trainer had closed its consumer of the dead ring by then, so
    any Create of this user 30 s after the dead producer's last publish
    (another key's producer, any tsock.Producer) reclaimed the dead segment
    and the successor restarted the run at epoch 0, silently (review 27,
    N5). This test waits those 30 s."""
    import threading

    import numpy as np

    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    (gate / "go").touch()
    loader = tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate), linger=30.0)
    it = iter(loader)
    for _ in range(13):  # epoch 1, batch 3
        if next(it, None) is None:
            it = iter(loader)
            next(it)
    (gate / "go").unlink()
    first = loader.producer_pid
    os.kill(first, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = []
    reader = threading.Thread(target=read_past_the_dead_ring, args=(loader, it, rest), daemon=True)
    reader.start()
    try:
        wait_for(lambda: [f for f in gate.glob("factory.*") if f.name != f"factory.{first}"], "the successor")
        dead = _shared.segment_path(loader.channel)
        # Past the library's grace for a dead channel (30 s after its last
        # publish, producer/reclaim.go): a lower bound, whatever the load.
        time.sleep(max(0.0, killed_at + RECLAIM_GRACE_S + 2 - time.monotonic()))
        other = f"other{os.getpid()}x{time.monotonic_ns() % 10**9}"
        with tsock.Producer(name=other) as producer:
            producer.publish((np.zeros(4, np.float32),))  # its Create reclaims the dead channels nobody holds
        assert os.path.exists(dead)  # held by the trainer's consumer of it
    finally:
        (gate / "go").touch()
    reader.join(BOUND_S)
    assert len(rest) == 28 + 40 and loader.position == (3, 0)
    assert (loader.recoveries, loader.repeated_batches, loader.lost_batches) == (1, 0, 0)
    loader.close()


def plant(path: str, user: str = "") -> None:
    """A truncated file at `path` (5 bytes), made by `user` if given."""
    if user:
        import subprocess

        subprocess.run(["runuser", "-u", user, "--", "sh", "-c", f"printf trunc > {path}"], check=True)
    else:
        with open(path, "w") as f:
            f.write("trunc")


@pytest.mark.parametrize("user", ["", "nobody"])
def test_a_file_at_the_channels_old_predictable_name_is_never_opened(runtime, tmp_path, user):
    """The channel was shared.UID.KEY, and a trainer opened whatever sat
    there while its producer ran the factory: a leftover or a file another
    user planted (/dev/shm is world-writable) ended it with CorruptSegment
    (review 24, F8). Now it opens only the segment its producer announced.
    The file is planted while the factory runs (held by the gate)."""
    import threading

    if user and (os.geteuid() != 0 or not shutil.which("runuser")):
        pytest.skip("planting as another uid needs root and runuser")
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    key = _shared.fingerprint(_shared.factory_ref(h.gated_pipeline), (40, 4, tok, str(gate)), {})
    predictable = f"/dev/shm/tsock.shared.{os.geteuid()}.{key}"
    made, failed = [], []

    def trainer():
        try:
            made.append(tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate), linger=0.3))
        except Exception as e:
            failed.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        wait_for(lambda: list(gate.glob("factory.*")), "the producer to run its factory")
        plant(predictable, user)
        time.sleep(0.3)  # not needed for the test to pass: gives an attach to the planted file its chance
    finally:
        (gate / "go").touch()
        thread.join(BOUND_S)
        if os.path.exists(predictable):
            os.unlink(predictable)
    assert not failed, failed
    with made[0] as loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
        assert os.stat(_shared.segment_path(loader.channel)).st_uid == os.geteuid()


@pytest.mark.parametrize(
    ("factory", "n", "message"),
    [("generator", 40, "TypeError: the factory returned an iterator.*re-iterable"), ("plain", 0, "gave no batch")],
)
def test_a_loader_of_one_epoch_or_of_empty_epochs_is_refused(runtime, spawn, factory, n, message):
    """A generator gave epoch 0, then the producer spun on end markers and
    the trainer waited forever; an empty loader never made its channel, so
    every trainer waited forever (review 24, F7). Both reach the trainers
    as the factory's error."""
    code = """
        import sys, shared_helpers as h, tsock
        try:
            loader = tsock.shared(getattr(h, sys.argv[1]), int(sys.argv[2]), 4, sys.argv[3], linger=0.3)
            for epoch in range(3):
                print(epoch, sum(1 for _ in loader), flush=True)
        except tsock.ProducerGone as e:
            print("ProducerGone:", e, flush=True)
    """
    proc = spawn(code, factory, n, token())
    try:
        proc.wait(BOUND_S)
    finally:
        proc.kill()
    out = proc.stdout.read()
    assert re.search(f"ProducerGone:.*{message}", out), (out, proc.stderr.read()[-2000:])


def test_a_trainer_waiting_for_a_slow_factory_is_told_naming_the_log(runtime, tmp_path, monkeypatch):

    monkeypatch.setattr(_shared, "SLOW_START_WARN_S", 0.5, raising=False)  # raising: to see it fail before
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()

    loader, seen = shared_told_of_a_slow_start(tok, gate)
    (told,) = [str(w.message) for w in seen if "first batch" in str(w.message)]
    assert told.endswith(f"see {loader._paths.log}"), told
    with loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))


def test_a_producer_whose_factory_hangs_exits_once_no_trainer_is_left(runtime, spawn, tmp_path):
    """Its main thread never reaches the Gate's linger check: a watchdog
    thread exits it (review 24, F7: it stayed forever)."""
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    code = """
        import sys, shared_helpers as h, tsock
        tsock.shared(h.gated_pipeline, 40, 4, sys.argv[1], sys.argv[2], linger=0.3)
    """
    trainer = spawn(code, tok, gate)
    factory = wait_for(lambda: list(gate.glob("factory.*")), "the producer to run its factory")
    pid = int(factory[0].name.split(".")[1])
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    wait_for(lambda: not alive(pid), "the hung producer to exit with no trainer left")
    (alive_file,) = glob.glob(str(runtime / "*.alive"))
    assert not _shared.lock_is_held(alive_file)
    channel = _shared.Paths(str(runtime), os.path.basename(alive_file)[: -len(".alive")]).read_alive()["channel"]
    assert not os.path.exists(_shared.segment_path(channel))


def test_the_watchdog_exit_takes_the_pipelines_workers_along(runtime, spawn, tmp_path):
    """The watchdog's os._exit left the pipeline's worker processes running:
    a worker stuck in the I/O the watchdog exists for stayed for ever
    (review 27, N12)."""
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    code = """
        import sys, shared_helpers as h, tsock
        tsock.shared(h.stuck_pipeline, 40, 4, sys.argv[1], sys.argv[2], linger=0.3)
    """
    trainer = spawn(code, tok, gate)
    try:
        wait_for(lambda: len(list(gate.glob("worker.*"))) == 2, "both workers to be stuck")
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        wait_for(lambda: not producer_processes(runtime), "the producer and its workers to exit")
    finally:
        (gate / "go").touch()  # releases workers left behind (before the fix)


def test_producers_killed_at_start_up_do_not_end_the_trainer(runtime, tmp_path, monkeypatch):
    """Six producers in a row killed before their first batch (an OOM killer
    at start-up), the factory itself fine: the trainer goes on. Before, the
    fifth such death ended it with ProducerGone (review 24, F5)."""
    import threading

    monkeypatch.setattr(_shared, "START_BUDGET_S", 4 * BOUND_S, raising=False)  # only the count matters here
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()

    def kill_six_at_start_up():
        try:
            seen = set()
            for _ in range(6):
                new = wait_for(lambda: {f.name for f in gate.glob("factory.*")} - seen, "a new producer")
                (name,) = new
                seen.add(name)
                os.kill(int(name.split(".")[1]), signal.SIGKILL)
        finally:
            (gate / "go").touch()

    killer = threading.Thread(target=kill_six_at_start_up)
    killer.start()
    try:
        loader = tsock.shared(h.gated_pipeline, 40, 4, tok, str(gate), linger=0.3)
    finally:
        killer.join(BOUND_S)
    with loader:
        assert len(list(gate.glob("factory.*"))) == 7
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
        assert loader.position == (1, 0)


def test_a_factory_that_ends_its_process_ends_the_trainers_after_some_attempts(runtime, monkeypatch):
    monkeypatch.setattr(_shared, "START_BUDGET_S", 0.0)
    with pytest.raises(tsock.ProducerGone, match="5 producers .* in a row died before making their channel"):
        tsock.shared(h.dying, 40, 4, token())


def test_producers_dying_on_a_full_file_system_say_so(runtime, monkeypatch):
    """Review 27, N9: producers that died because the runtime directory's
    file system was full were reported as "killed? crashed?"."""
    real = os.statvfs

    def full(path):
        st = real(path)
        if os.path.realpath(path) != os.path.realpath(str(runtime)):
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, 0, 0, 0, st.f_namemax))

    monkeypatch.setattr(_shared.os, "statvfs", full)
    monkeypatch.setattr(_shared, "START_BUDGET_S", 0.0)
    with pytest.raises(tsock.ProducerGone, match=f"died before making their channel.*{runtime} is full: 0 bytes"):
        tsock.shared(h.dying, 40, 4, token())


MAIN_ARGUMENT_SCRIPT = """
import sys

import shared_helpers as h
import tsock


def scale(x):  # of the script, passed to a factory of a module
    return x


if __name__ == "__main__":
    try:
        tsock.shared(h.pipeline, 40, 4, scale, linger=0.3)
    except TypeError as e:
        print("TypeError:", e)
"""


def test_a_function_of_the_script_passed_to_a_module_factory_is_refused_naming_the_fix(runtime, spawn, tmp_path):
    """The producer loads the script only when the factory is in it: it
    could not unpickle the argument, and the trainer got a confusing
    ProducerGone (review 24, F3)."""
    script = tmp_path / "train.py"
    script.write_text(MAIN_ARGUMENT_SCRIPT)
    out, err = run_script(spawn, script)
    assert "TypeError: tsock.shared: an argument refers to scale" in out and "top level of a .py module" in out, (
        out,
        err[-3000:],
    )
    assert not glob.glob(str(runtime / "*.alive"))  # refused in the trainer, before anything started


NO_GUARD_SCRIPT = """
import shared_helpers as h
import tsock


def make(n, batch_size, tok):
    return tsock.Pipeline(h.Ids(n), batch_size=batch_size, seed=3)


try:  # no `if __name__ == "__main__":` guard: the producer runs this too
    tsock.shared(make, 40, 4, "{tok}", linger=0.3)
except tsock.ProducerGone as e:
    print("ProducerGone:", e)
"""


def test_a_script_without_the_main_guard_is_told_so(runtime, spawn, tmp_path):
    """Its top-level shared() call ran in the producer while it loaded the
    script: it started a producer of another key, which could not import
    the script (a nested ProducerGone ... ModuleNotFoundError naming no fix),
    and left that key's files (review 27, N11)."""
    script = tmp_path / "train.py"
    script.write_text(NO_GUARD_SCRIPT.replace("{tok}", token()))
    out, err = run_script(spawn, script)
    assert "RuntimeError: tsock.shared was called while the producer process loaded the training script" in out, (
        out,
        err[-3000:],
    )
    assert 'if __name__ == "__main__":' in out
    assert len(glob.glob(str(runtime / "*.alive"))) == 1  # no producer of a second key


PACKAGE_SCRIPT = """
import sys

import numpy as np
import tsock

from .data import Ids  # a relative import: the script is run as `python -m package.train`


def make(n, batch_size, tok):
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=3)


if __name__ == "__main__":
    with tsock.shared(make, 40, 4, sys.argv[1], linger=0.3) as loader:
        ids = sorted(int(y) for _, ys in loader for y in np.asarray(ys).tolist())
        print("ok" if ids == list(range(40)) else ids, loader.key)
"""


def test_a_factory_of_a_script_run_as_a_module_with_relative_imports(runtime, spawn, tmp_path):
    """`python -m package.train`: the producer loaded the script from its
    file with no package, and its relative import failed ("attempted
    relative import with no known parent package", review 27, N10)."""
    package = tmp_path / "r27pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text("from shared_helpers import Ids  # noqa: F401\n")
    (package / "train.py").write_text(PACKAGE_SCRIPT)
    code = """
        import runpy, sys
        sys.path.insert(0, sys.argv[1])
        sys.argv = ["train", sys.argv[2]]
        runpy.run_module("r27pkg.train", run_name="__main__", alter_sys=True)
    """
    proc = spawn(code, tmp_path, token())
    try:
        proc.wait(BOUND_S)
    finally:
        proc.kill()
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.returncode == 0 and out.startswith("ok "), (out, err[-3000:])


def test_functions_of_two_scripts_have_two_keys(runtime, monkeypatch, tmp_path):
    """Both were '__main__.scale': two scripts would share one producer."""
    ref = _shared.factory_ref(h.pipeline)
    keys = []
    for script in ("a.py", "b.py"):

        def scale(x):
            return x

        scale.__module__, scale.__qualname__ = "__main__", "scale"
        main = types.ModuleType("__main__")
        main.__file__ = str(tmp_path / script)
        main.scale = scale
        monkeypatch.setitem(sys.modules, "__main__", main)
        keys.append(_shared.fingerprint(ref, (40, 4, scale), {}))
    assert keys[0] != keys[1]


def test_a_trainer_queued_behind_one_waiting_for_a_slow_factory_is_told_too(runtime, spawn, tmp_path, monkeypatch):
    """The first trainer holds KEY.start while the factory runs; the others
    waited for it without a word (review 24, F7)."""

    monkeypatch.setattr(_shared, "SLOW_START_WARN_S", 0.5)
    tok, gate = token(), tmp_path / "gate"
    gate.mkdir()
    code = """
        import sys, shared_helpers as h, tsock
        with tsock.shared(h.gated_pipeline, 40, 4, sys.argv[1], sys.argv[2], linger=0.3) as loader:
            print(sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40)), flush=True)
    """
    first = spawn(code, tok, gate)
    wait_for(lambda: list(gate.glob("factory.*")), "the first trainer's producer to run its factory")

    loader, seen = shared_told_of_a_slow_start(tok, gate)
    assert [w for w in seen if str(w.message).endswith(f"see {loader._paths.log}")]
    with loader:
        assert sorted(y for _, ys in loader for y in ys.tolist()) == list(range(40))
    first.wait(BOUND_S)
    assert first.stdout.read().strip() == "True"


# ---- resume from a trainer's state (issue 14) ----


PACED = """
    import json, os, sys, time
    import numpy as np, tsock, shared_helpers as h
    n, bs, tok, pause, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
    slots = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    loader = tsock.shared(h.pipeline, n, bs, tok, linger=0.5, producer={"slots": slots})

    def done(e):  # the stop file holds the number of epochs to read
        try:
            with open(stop) as f:
                return e >= int(f.read())
        except (OSError, ValueError):
            return False

    e = 0
    while not done(e):
        ids, longest, t, line = [], 0.0, time.monotonic(), {}
        for _x, y in loader:
            if ids:
                longest = max(longest, time.monotonic() - t)  # waiting for this batch
            ids.append(np.asarray(y).tolist())
            if len(ids) == 3 and e < 2:
                # Its checkpoint after 3 batches, in its first two epochs
                # only: nothing reads a paced child's stdout until it ends,
                # and the pipe holds 64 KiB.
                line["state3"] = loader.state_dict()["tsock"].hex()
            time.sleep(pause)
            t = time.monotonic()
        epoch = loader.position.epoch - 1  # the pipeline's
        print(json.dumps({"epoch": epoch, "batches": ids, "longest_wait": longest, **line}), flush=True)
        e += 1
    loader.close()
"""


PACED_OF = """
    import json, os, sys, time
    import numpy as np, tsock, shared_helpers as h
    factory, n, bs, tok, extra = getattr(h, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    pause, stop = float(sys.argv[6]), sys.argv[7]
    loader = tsock.shared(factory, n, bs, tok, extra, linger=0.5)
    while not os.path.exists(stop):
        for _x, y in loader:
            time.sleep(pause)
        print(json.dumps({"epoch": loader.position.epoch - 1}), flush=True)
    loader.close()
"""


def test_state_dict_is_48_bytes_and_refuses_what_is_not_one(runtime):
    loader = tsock.shared(h.pipeline, 40, 4, token(), linger=0.5)
    try:
        assert loader.state_dict() == {"tsock": _state.encode(_state.BEGINNING)["tsock"]}
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        assert len(state["tsock"]) == 48
        decoded = _state.decode(state)
        assert (decoded.epoch, decoded.batch, decoded.samples) == (0, 2, 8)
        for bad in ({}, {"tsock": b"x" * 47}, {"tsock": b"TSS2" + bytes(44)}, "state", None):
            with pytest.raises(ValueError, match="tsock loader state"):
                _state.decode(bad)
        with pytest.raises(ValueError, match="before the loader's first batch"):
            loader.load_state_dict(state)
    finally:
        loader.close()


def test_a_state_of_another_pipeline_is_refused(runtime):
    tok = token()
    first = tsock.shared(h.pipeline, 40, 4, tok, linger=0.5)
    next(iter(first))
    state = first.state_dict()
    first.close()
    other = tsock.shared(h.unseeded, 40, 4, tok, linger=0.5)  # another seed: another fingerprint
    try:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match="saved from another pipeline"):
            next(iter(other))
    finally:
        other.close()


def test_a_trainer_resumed_behind_the_stream_catches_up_exactly_then_rejoins(runtime, spawn, tmp_path):
    n, bs, tok = 40, 4, token()
    stop = tmp_path / "stop"
    paced = spawn(PACED, n, bs, tok, 0.05, stop)  # about 20 batches a second: the stream's pace
    # The checkpoint: the paced trainer's own after 3 batches of its second
    # epoch (a full one), as if it crashed there; the stream is past it now
    # (see test_a_trainer_at_the_others_pace_rejoins_without_stalling_them).
    for _ in range(2):
        line = paced.stdout.readline()
        assert line, paced.stderr.read()
    line = json.loads(line)
    assert len(line["batches"]) == n // bs and isinstance(line.get("state3"), str), line
    state = {"tsock": bytes.fromhex(line["state3"])}
    start, got, at = line["epoch"], line["batches"][:3], _state.decode(state)  # the pipeline's epoch of those batches
    assert (at.epoch, at.batch) == (start, 3), (at, line)
    resumed = tsock.shared(h.pipeline, n, bs, tok, linger=0.5)
    resumed.load_state_dict(state)
    epochs, rejoined_at = [], None
    try:
        # Faster than the paced trainer, it overtakes the stream's position
        # and goes back to it at an epoch start; then two epochs more.
        while len(epochs) < 200 and (rejoined_at is None or len(epochs) < rejoined_at + 2):
            epochs.append([np.asarray(y).tolist() for _, y in resumed])
            if len(epochs) == 1:
                assert resumed.catchups == 1 and resumed._catchup is not None
            if resumed.rejoins and rejoined_at is None:
                rejoined_at = len(epochs)
        assert (resumed.catchups, resumed.rejoins) == (1, 1)
        assert resumed._catchup is None
        # Back in the roster, naming the channel (review 29: a successor
        # decided on a new run without it).
        assert resumed.channel in resumed._paths.live_trainer_channels()
        catchup_pids = [p for p in producer_processes(runtime) if p != resumed.producer_pid]
    finally:
        resumed.close()
        stop.write_text("0")
    paced.wait(BOUND_S)
    assert paced.returncode == 0, paced.stderr.read()[-3000:]
    # The rest of the epoch of the state, in the same batches as a run never
    # interrupted; every later epoch whole, from its own producer or from
    # the stream. (The pipeline's batches are a function of the epoch.)
    with h.pipeline(n, bs) as reference:
        assert got + epochs[0] == [y.tolist() for _, y in reference.batches(start)]
        for e in range(1, len(epochs)):
            assert epochs[e] == [y.tolist() for _, y in reference.batches(start + e)], e
    assert (resumed.repeated_batches, resumed.lost_batches, resumed.restarts) == (0, 0, 0)
    wait_for(lambda: not any(alive(p) for p in catchup_pids), "the catch-up producer to linger out")
    wait_for(lambda: not glob.glob(str(runtime / f"*.c{os.getpid()}.*")), "the catch-up key's files to go with it")


def test_a_trainer_at_the_others_pace_rejoins_without_stalling_them(runtime, spawn, tmp_path):
    """Review 28, F7: a resumed trainer that reads no faster than the others
    never rejoined (it waited for the stream's next batch not to be past
    it, which the producer keeps up to a ring ahead of its trainers). Now
    it holds the stream's oldest batch while its own producer serves those
    before it: same pace, it rejoins at the first epoch start that finds
    it within half the ring, and the others' waits for a batch stay short.
    Same pace, the distance it has to make up is how long its catch-up
    producer took to start (0.5-1 s, 5 and more on a loaded machine): 512
    slots (half: 25 s at this pace) and up to 30 epochs (30 s) leave room
    for that; it rejoins in 2-3 epochs otherwise.

    The checkpoint is the paced trainer's own, after 3 batches of its
    second epoch (a full one, as every epoch it prints): the resumed trainer
    is that trainer crashed there and resumed while the stream went on. A
    checkpoint of another loader put it wherever that loader had joined:
    one that was attached, or whose producer still lingered, while the
    paced trainer joined (the producer a ring ahead of its one reader) had
    joined about 50 epochs before the paced trainer: the resumed trainer
    was 470 batches behind it, too far to hold (a loaded machine;
    reproduced by delaying the other loader's close by 5 s)."""
    n, bs, tok, pause, slots = 40, 4, token(), 0.1, 512
    stop = tmp_path / "stop"
    paced = spawn(PACED, n, bs, tok, pause, stop, slots)
    for _ in range(2):
        line = paced.stdout.readline()
        assert line, paced.stderr.read()
    line = json.loads(line)
    assert len(line["batches"]) == n // bs and isinstance(line.get("state3"), str), line
    state = {"tsock": bytes.fromhex(line["state3"])}
    start, got, at = line["epoch"], line["batches"][:3], _state.decode(state)
    assert (at.epoch, at.batch) == (start, 3), (at, line)
    resumed = tsock.shared(h.pipeline, n, bs, tok, linger=0.5, producer={"slots": slots}, state=state)
    epochs, rejoined_at = [], None
    try:
        while len(epochs) < 30 and (rejoined_at is None or len(epochs) < rejoined_at + 2):
            batches = []
            for _x, y in resumed:
                batches.append(np.asarray(y).tolist())
                time.sleep(pause)  # the others' pace
            epochs.append(batches)
            if resumed.rejoins and rejoined_at is None:
                rejoined_at = len(epochs)
        assert (resumed.catchups, resumed.rejoins) == (1, 1), "a trainer at the others' pace never rejoined"
        assert resumed._catchup is None and resumed.channel in resumed._paths.live_trainer_channels()
    finally:
        resumed.close()
        stop.write_text("0")
    paced.wait(BOUND_S)
    out, err = paced.communicate()
    assert paced.returncode == 0, err[-3000:]
    waits = [json.loads(line)["longest_wait"] for line in out.splitlines()]
    assert max(waits) < 2.0, waits  # a stall would be the rejoining trainer's steps: 0.1 s each
    with h.pipeline(n, bs) as reference:
        assert got + epochs[0] == [y.tolist() for _, y in reference.batches(start)]
        for e in range(1, len(epochs)):
            assert epochs[e] == [y.tolist() for _, y in reference.batches(start + e)], e
    assert (resumed.repeated_batches, resumed.lost_batches, resumed.restarts) == (0, 0, 0)


def _pipeline_epochs(factory, n: int, bs: int, epochs: int) -> list:
    with factory(n, bs) as reference:
        return [[y.tolist() for _, y in reference.batches(e)] for e in range(epochs)]


def test_a_rejoin_at_an_epoch_start_keeps_the_epochs_apart(runtime):
    """Review 30, F4: the stream's oldest batch, held to rejoin, was the
    first of an epoch: the rejoin came before the catch-up's epoch end, and
    the loop ran through two epochs (8 batches instead of 4), every later
    epoch shifted."""
    n, bs, tok = 16, 4, token()
    a = tsock.shared(h.pipeline, n, bs, tok, linger=0.5)
    it = iter(a)
    next(it)
    state = a.state_dict()  # (0, 1)
    for _ in it:
        pass
    for _ in a:  # a's next batch is (2, 0)
        pass
    b = tsock.shared(h.pipeline, n, bs, tok, linger=0.5, state=state)
    try:
        held = next(iter(a))  # a holds (2, 0): the stream's oldest
        loops = [[np.asarray(y).tolist() for _, y in b] for _ in range(3)]
        assert b.rejoins == 1
    finally:
        del held
        b.close()
        a.close()
    want = _pipeline_epochs(h.pipeline, n, bs, 3)
    assert loops == [want[0][1:], want[1], want[2]]


def test_a_trainer_rejoins_a_stream_its_producer_paces(runtime):
    """Review 30, F3: with the trainers waiting at the head of the ring,
    start="oldest" finds no batch; the probe then waited in len() for the
    next one and took it for another loader's: it left the stream at every
    epoch start and never rejoined."""
    n, bs, tok = 16, 4, token()
    # The stream is paced by its producer and so is the catch-up: the
    # distance to make up is the catch-up producer's start-up (0.5-1 s, 5
    # and more on a loaded machine). 512 slots (half: 30 s at 0.12 s a
    # batch) and up to 60 epochs (29 s) leave room for that.
    kw = {"linger": 0.5, "lifetime": "step", "producer": {"slots": 512}}
    a = tsock.shared(h.producer_bound, n, bs, tok, **kw)
    it = iter(a)
    next(it)
    state = a.state_dict()
    stop = threading.Event()

    def read_on():
        for _ in it:
            pass
        while not stop.is_set():
            for _ in a:
                pass

    reader = threading.Thread(target=read_on)
    reader.start()
    b = None
    try:
        wait_for(lambda: a.position.epoch >= 1, "the stream to go past the state")
        b = tsock.shared(h.producer_bound, n, bs, tok, state=state, **kw)
        loops = []
        # It holds the stream's batch from its first epoch start on, and
        # rejoins when its own producer reaches it.
        while len(loops) < 60 and not (b.rejoins and len(loops) > 2):
            loops.append([np.asarray(y).tolist() for _, y in b])
        assert (b.catchups, b.rejoins) == (1, 1), "never rejoined a producer-paced stream"
        loops.append([np.asarray(y).tolist() for _, y in b])  # an epoch on the stream
    finally:
        stop.set()
        if b is not None:
            b.close()
        reader.join(BOUND_S)
        a.close()
    want = _pipeline_epochs(h.producer_bound, n, bs, len(loops))
    assert loops == [want[0][1:], *want[1:]]


def test_a_probe_of_an_empty_ring_waits_for_nothing():
    """Review 30, F3: with no batch in the ring yet (the trainers wait at
    its head), the probe asked the stream's len(), which waits for a batch
    and keeps it: the trainer then took it for another loader's and left
    the stream, at every epoch start. It now looks again at its next batch."""

    class EmptyRing:
        _pending: list = []

        def _peek_tag(self, timeout):
            assert timeout == 0, "the probe waits"
            return None

        def __len__(self):
            raise AssertionError("len() of the stream waits for a batch")

    loader = object.__new__(_shared.SharedLoader)
    ring = EmptyRing()
    loader._probe, loader._position, loader._consumer = ("ch", 1, None), (b"f" * 16, 1, 0), ring
    assert loader._rejoined() is False
    assert (loader._probe, loader._consumer) == (("ch", 1, None), ring)  # still attached, probing


def test_a_trainer_evicted_while_it_holds_the_streams_batch_is_not_handed_it(runtime):
    """Review 30, F2: the hold makes the rejoining trainer the slowest
    reader; evicted (producer={"evict_after": s}), it was later handed the
    held batches out of its consumer's queue, rewritten since: another
    epoch's batches under this one's position, nothing said."""
    n, bs, tok = 40, 4, token()
    kw = {"linger": 0.5, "producer": {"evict_after": 4.0}}
    a = tsock.shared(h.pipeline, n, bs, tok, **kw)
    it = iter(a)
    next(it)
    state = a.state_dict()  # (0, 1)
    for _ in it:
        pass
    del _
    it = iter(a)
    held = [next(it) for _ in range(3)]  # (1, 0..2)
    del held
    gc.collect()

    def read_on():
        yield from it
        while True:
            yield from a

    b = tsock.shared(h.pipeline, n, bs, tok, state=state, **kw)
    try:
        got = [[np.asarray(y).tolist() for _, y in b]]  # epoch 0's rest, on its own producer
        itb = iter(b)
        got.append([np.asarray(next(itb)[1]).tolist()])  # the probe holds the stream's oldest now
        for _ in itertools.islice(read_on(), 25):
            pass  # a reads on: the ring fills behind the hold, and b is evicted
        got[1] += [np.asarray(y).tolist() for _, y in itb]
    finally:
        b.close()
        a.close()
    want = _pipeline_epochs(h.pipeline, n, bs, 2)
    assert got == [want[0][1:], want[1]]


VICTIM = """
    import json, os, sys, time
    import numpy as np, tsock, shared_helpers as h
    n, bs, tok, epochs, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    path = os.path.join(where, "checkpoint.json")
    try:
        with open(path) as f:
            checkpoint = json.load(f)
    except FileNotFoundError:
        checkpoint = {"state": None, "batches": [], "catchups": []}
    checkpoint["catchups"].append(0)
    loader = tsock.shared(h.pipeline, n, bs, tok, linger=0.5)
    if checkpoint["state"]:
        loader.load_state_dict({"tsock": bytes.fromhex(checkpoint["state"])})
    print("resumed", flush=True)
    while True:
        for _x, y in loader:
            # The step's result and the loader's state, saved together (a
            # checkpoint written whole, then renamed).
            checkpoint["batches"].append(np.asarray(y).tolist())
            checkpoint["state"] = loader.state_dict()["tsock"].hex()
            checkpoint["catchups"][-1] = loader.catchups
            with open(path + ".tmp", "w") as f:
                json.dump(checkpoint, f)
            os.replace(path + ".tmp", path)
            print("saved", flush=True)
            time.sleep(0.01)  # a step: faster than the others' (it can catch up with them)
        if loader.position.epoch >= epochs:
            break
    print(json.dumps({"catchups": loader.catchups, "rejoins": loader.rejoins}), flush=True)
    loader.close()
"""


def test_a_trainer_killed_at_random_points_resumes_from_its_checkpoint_exactly(runtime, spawn, tmp_path):
    """The issue's test: 3 trainers, one killed with SIGKILL 10 times at
    random points and restarted from its last checkpoint: its batches,
    epoch by epoch, are those of a run never interrupted."""
    n, bs, tok, epochs = 40, 4, token(), 30
    stop = tmp_path / "stop"
    others = [spawn(PACED, n, bs, tok, 0.02, stop) for _ in range(2)]
    rng = random.Random(14)
    for kill in range(10):
        victim = spawn(VICTIM, n, bs, tok, epochs, tmp_path)
        assert victim.stdout.readline() == "resumed\n", victim.stderr.read()
        # Killed after a random number of steps of this run (0: while it
        # starts, during its catch-up's start), then as soon as it can be.
        for _ in range(0 if kill % 5 == 0 else rng.randrange(1, 25)):
            assert victim.stdout.readline() == "saved\n", victim.stderr.read()
        victim.kill()
        victim.wait()
    victim = spawn(VICTIM, n, bs, tok, epochs, tmp_path)
    out, err = victim.communicate(timeout=300)
    assert victim.returncode == 0, err[-3000:]
    stop.write_text("0")
    waits = []
    for other in others:
        assert other.wait(BOUND_S) == 0, other.stderr.read()[-3000:]
        waits += [json.loads(line)["longest_wait"] for line in other.stdout]
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    got = checkpoint["batches"]
    # The restarted trainer was behind the stream (the others went on) and
    # caught up on a producer of its own; the others never waited for it
    # (5 s: far more than a batch takes even under load, far less than a
    # stall on the victim would be: its restart plus its catch-up).
    assert len(checkpoint["catchups"]) >= 9 and sum(checkpoint["catchups"]) >= 1, checkpoint["catchups"]
    assert max(waits) < 5.0, waits
    sys.stderr.write(f"\ncatch-ups per run {checkpoint['catchups']}; the others' longest wait {max(waits):.3f} s\n")
    with h.pipeline(n, bs) as reference:
        want = [y.tolist() for e in range(epochs) for _, y in reference.batches(e)]
    # From wherever its first run joined: an epoch start, then exactly the
    # pipeline's batches in order, through the last epoch.
    first = want.index(got[0])
    assert first % (n // bs) == 0 and got == want[first:], (first, len(got), len(want))


def test_a_state_ahead_of_a_new_run_catches_up_from_its_position(runtime):
    n, bs, tok = 40, 4, token()
    first = tsock.shared(h.pipeline, n, bs, tok, linger=0.2)
    for _ in range(2):
        for _ in first:  # epochs 0 and 1
            pass
    it = iter(first)
    got = [np.asarray(next(it)[1]).tolist() for _ in range(3)]
    state, pid = first.state_dict(), first.producer_pid
    first.close()
    wait_for(lambda: not alive(pid), "the run's producer to linger out")
    resumed = tsock.shared(h.pipeline, n, bs, tok, linger=0.2)  # a new run: its producer starts at epoch 0
    resumed.load_state_dict(state)
    try:
        rest = [np.asarray(y).tolist() for _, y in resumed]
        following = [np.asarray(y).tolist() for _, y in resumed]
        # 23 batches behind: more than SKIP_MAX to read at the stream's pace,
        # so a producer of its own from the position (review 29).
        assert resumed.catchups == 1 and resumed.skipped_batches == 0
    finally:
        resumed.close()
    with h.pipeline(n, bs) as reference:
        assert got + rest == [y.tolist() for _, y in reference.batches(2)]
        assert following == [y.tolist() for _, y in reference.batches(3)]


def test_a_state_given_to_shared_starts_a_new_run_at_it(runtime):
    """state= (not load_state_dict afterwards): the new run's producer starts
    at the position, so nothing before it is computed or read (review 28:
    the first batch came after reading every batch before the position)."""
    n, bs, tok = 40, 4, token()
    first = tsock.shared(h.pipeline, n, bs, tok, linger=0.2)
    for _ in range(3):
        for _ in first:
            pass
    it = iter(first)
    got = [np.asarray(next(it)[1]).tolist() for _ in range(2)]
    state, pid = first.state_dict(), first.producer_pid
    first.close()
    wait_for(lambda: not alive(pid), "the run's producer to linger out")
    resumed = tsock.shared(h.pipeline, n, bs, tok, linger=0.2, state=state)
    try:
        rest = [np.asarray(y).tolist() for _, y in resumed]
        assert (resumed.skipped_batches, resumed.catchups, resumed.repeated_batches) == (0, 0, 0)
    finally:
        resumed.close()
    with h.pipeline(n, bs) as reference:
        assert got + rest == [y.tolist() for _, y in reference.batches(3)]


def test_a_state_part_of_the_way_into_a_batch_is_refused(runtime, channel):
    """A re-batching Consumer's state of the same pipeline: tsock.shared hands
    out whole batches, so it refuses it rather than repeat rows (review 28)."""
    n, bs, tok = 40, 4, token()
    with h.pipeline(n, bs) as pipe:
        producer = tsock.Producer(pipe, channel, wait_readers=1)
        t = threading.Thread(target=lambda: _quietly(producer.run), daemon=True)
        t.start()
        with tsock.Consumer(channel, batch_size=3, timeout=30) as c:
            next(iter(c))
            state = c.state_dict()
        producer.close()
        t.join(60)
    assert _state.decode(state).samples == 3
    loader = tsock.shared(h.pipeline, n, bs, tok, linger=0.2, state=state)
    try:
        with pytest.raises(ValueError, match="3 samples into batch 0"):
            next(iter(loader))
    finally:
        loader.close()


def _quietly(run):
    try:
        run()
    except tsock.TsockError:
        pass  # closed under it: how the test stops it


def test_a_catch_up_whose_producer_fails_raises_its_error_and_leaves_nothing(runtime, spawn, tmp_path):
    n, bs, tok = 40, 4, token()
    marker = tmp_path / "fail"
    stop = tmp_path / "stop"
    loader = tsock.shared(h.failing_once_marked, n, bs, tok, str(marker), linger=0.5)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    paced = spawn(PACED_OF, "failing_once_marked", n, bs, tok, str(marker), 0.02, stop)
    while json.loads(paced.stdout.readline())["epoch"] < 1:  # the stream is past the state
        pass
    marker.touch()  # from now on the factory fails: the catch-up producer's does
    resumed = tsock.shared(h.failing_once_marked, n, bs, tok, str(marker), linger=0.5)
    resumed.load_state_dict(state)
    try:
        for _ in range(2):  # and again: the loader is not left broken
            with pytest.raises(tsock.ProducerGone, match="the catch-up factory fails"):
                next(iter(resumed))
    finally:
        resumed.close()
        stop.write_text("0")
    assert paced.wait(BOUND_S) == 0, paced.stderr.read()[-3000:]
    assert not glob.glob(str(runtime / f"*.c{os.getpid()}.*"))


def test_a_catch_up_producer_never_evicts_its_trainer(runtime, spawn, tmp_path):
    """Review 29, item 4: the catch-up producer is the trainer's alone, so
    it does not take the stream's evict_after: a step longer than that on
    it evicted the trainer, which then nested a catch-up in its catch-up."""
    n, bs, tok = 40, 4, token()
    stop = tmp_path / "stop"
    loader = tsock.shared(h.pipeline, n, bs, tok, linger=0.5)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    paced = spawn(PACED, n, bs, tok, 0.02, stop)
    while json.loads(paced.stdout.readline())["epoch"] < 1:  # the stream is past the state
        pass
    resumed = tsock.shared(h.pipeline, n, bs, tok, linger=0.5, producer={"evict_after": 0.2}, state=state)
    try:
        ids = []
        for _x, y in resumed:  # the rest of the state's epoch, on its own producer
            ids.append(np.asarray(y).tolist())
            if len(ids) == 2:
                time.sleep(1.0)  # five times evict_after, its ring full meanwhile
        assert resumed.catchups == 1 and resumed._catchup is not None
        own = resumed._catchup  # evicted, it would have caught up on a producer of its own in turn
        assert (own.evictions, own.catchups, resumed.evictions) == (0, 0, 0)
    finally:
        resumed.close()
        stop.write_text("0")
    assert paced.wait(BOUND_S) == 0, paced.stderr.read()[-3000:]
    with h.pipeline(n, bs) as reference:
        assert ids == [y.tolist() for _, y in reference.batches(0)][1:]


def test_a_dead_catch_up_s_leftovers_are_removed(runtime):
    """A trainer and its catch-up producer killed together leave a key and a
    segment nobody else uses: the next loader of the key removes them."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no more
    key = f"{token()[:8]}"
    private = _shared.Paths(str(runtime), f"{key}.c{gone.pid}.0")
    channel = _shared.new_channel(private.key)
    runtime.mkdir(mode=0o700, exist_ok=True)
    with open(private.alive, "w") as f:
        json.dump({"pid": gone.pid, "channel": channel}, f)
    # Its trainer's roster file and one of an attach it was in (review 29,
    # item 5: the roster files stayed).
    roster, joining = private.trainer(gone.pid), f"{private.dir}/{private.key}.joining.{gone.pid}"
    for path in (private.start, private.log, _shared.segment_path(channel), roster, joining):
        open(path, "w").close()
    loader = tsock.shared(h.pipeline, 40, 4, "x", name=key, linger=0.2)
    loader.close()
    assert not glob.glob(str(runtime / f"{key}.c*"))
    assert not os.path.exists(_shared.segment_path(channel))


def test_readers_of_another_pid_namespace_are_counted():
    """The producer sees pid 0 for a reader in another pid namespace, whose
    trainer's roster pid is its own namespace's: the gate then counts, as
    before review 27's N1 (review 29: it never opened)."""
    from tsock._shared_run import _every_trainer_attached

    assert _every_trainer_attached([11, 12], [12, 11])
    assert not _every_trainer_attached([11, 11], [11, 12])
    assert _every_trainer_attached([0, 0], [1, 1])  # two containers, both pid 1
    assert not _every_trainer_attached([0], [1, 1])
