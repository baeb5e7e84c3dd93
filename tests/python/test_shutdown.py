"""A process exits while a daemon thread of it is blocked reading a consumer:
the exit finalizers detach the reader under that thread's acquire
(tsock_reader_detach from another thread). It must exit cleanly, never
crash (it segfaulted in the acquire: review 30)."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import time

import pytest
from tsock import _shared

# A producer that publishes one batch, then nothing (its data blocks).
PRODUCER = """
import sys, threading
import numpy as np
import tsock

def data():
    yield (np.arange(16, dtype=np.float32),)
    threading.Event().wait()  # never set: nothing more
    yield (np.arange(16, dtype=np.float32),)

producer = tsock.Producer(data(), sys.argv[1], slots=4, wait_readers=1)
if __name__ == "__main__":
    producer.run(epochs=1)
"""

# The child: a daemon thread reads the producer's batch, then waits in
# next(); the main thread exits while it waits. The producer runs in a
# thread of the child or in a process of its own (the channel then stays
# open while the reader's process exits).
PLAIN = """
import atexit, sys, subprocess, threading, time

# Registered first, so it runs last, after the finalizers that detach: it
# waits for the reading thread, woken by the detach, to end (it crashed
# here, not always before the process was gone). It joins the thread
# rather than sleep a while: a thread not scheduled within the sleep on a
# loaded machine was cut off at exit, before it printed "reader ended".
readers = []
atexit.register(lambda: [t.join(30) for t in readers])
import tsock

name, lifetime, output, where, producer_code = sys.argv[1:6]
if where == "thread":
    scope = {"__name__": "producer"}
    exec(producer_code, scope)
    threading.Thread(target=scope["producer"].run, daemon=True).start()
else:
    child = subprocess.Popen([sys.executable, "-c", producer_code, name], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    print("producer", child.pid, flush=True)  # alive after we exit: the test ends it
consumer = tsock.Consumer(name, output=output, timeout=30, lifetime=lifetime)
got = threading.Event()

def read():
    try:
        for batch in consumer:
            got.set()
    finally:  # woken by the exit's detach: ends quietly (no traceback)
        print("reader ended", flush=True)

readers.append(threading.Thread(target=read, daemon=True))
readers[0].start()
assert got.wait(30), "no batch"
time.sleep(0.5)  # the reader is back in acquire, waiting for the next batch
print("exiting", flush=True)
"""


def _assert_clean_exit(p, timeout=60) -> str:
    out, err = p.communicate(timeout=timeout)
    for line in out.splitlines():  # a producer process it left running
        if line.startswith("producer "):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[1]), signal.SIGKILL)
    assert "exiting" in out, err
    assert "Segmentation fault" not in err and "Fatal Python error" not in err, err
    assert p.returncode == 0, (p.returncode, err)
    # The reading thread was woken by the exit's detach and ended with no
    # traceback (review 32, F4 and F6).
    assert "reader ended" in out, (out, err)
    assert "Traceback" not in err, err
    return out


@pytest.mark.parametrize("lifetime", ["referenced", "step"])
@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_exit_with_a_daemon_thread_blocked_in_next(spawn, channel, lifetime, output):
    if output == "torch":
        pytest.importorskip("torch")
    _assert_clean_exit(spawn(PLAIN, channel, lifetime, output, "thread", PRODUCER))


def test_exit_with_a_daemon_thread_blocked_on_a_producer_process(spawn, channel):
    # The channel stays open while the reader's process exits.
    _assert_clean_exit(spawn(PLAIN, channel, "referenced", "numpy", "process", PRODUCER))


SHARED = """
import atexit, sys, threading, time

readers = []
atexit.register(lambda: [t.join(30) for t in readers])  # runs after the finalizers (see PLAIN)
import shared_helpers as h
import tsock

token, gate = sys.argv[1:3]
loader = tsock.shared(h.stalling_pipeline, 64, 4, token, gate, linger=0.5)
got = threading.Event()

def read():
    try:
        while True:
            for batch in loader:
                got.set()
    finally:
        print("reader ended", flush=True)

readers.append(threading.Thread(target=read, daemon=True))
readers[0].start()
assert got.wait(60), "no batch"


def in_acquire(thread):
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code.co_name != "acquire":
        frame = frame.f_back
    return frame is not None


# The reader is back in acquire, waiting for the next batch (a sleep was
# not enough on a loaded machine: a thread not yet there when the exit
# closed the consumer met "consumer is closed" and printed a traceback).
deadline = time.monotonic() + 30
while not in_acquire(readers[0]):
    assert time.monotonic() < deadline, "the reader never went back to acquire"
    time.sleep(0.01)
print("exiting", flush=True)
"""


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A runtime directory of this test's; afterwards its producers are
    killed and their channels removed."""
    path = tmp_path / "rt"
    monkeypatch.setenv("TSOCK_RUNTIME_DIR", str(path))
    yield path
    for alive_file in glob.glob(str(path / "*.alive")):
        key = os.path.basename(alive_file)[: -len(".alive")]
        note = _shared.Paths(str(path), key).read_alive()
        if _shared.lock_is_held(alive_file) and note.get("pid"):
            os.kill(note["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _shared.lock_is_held(alive_file) and time.monotonic() < deadline:
                time.sleep(0.01)
        if note.get("channel") and os.path.exists(f"/dev/shm/tsock.{note['channel']}"):
            os.unlink(f"/dev/shm/tsock.{note['channel']}")


def test_exit_with_a_daemon_thread_blocked_in_a_shared_loader(spawn, runtime, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    p = spawn(SHARED, f"{os.getpid()}-{time.monotonic_ns()}", gate)
    _assert_clean_exit(p, timeout=120)


def test_a_consumer_closed_by_another_thread_says_so_in_the_reading_thread(channel, run_producer):
    # Not at exit: the reading thread gets one clear error, whichever call
    # of it noticed the close (before: "reader handle 0x10001 is not open",
    # "release: ...", "pin a slot: ..." by turns).
    import threading

    import numpy as np
    import tsock

    stop = threading.Event()

    def data():
        yield (np.arange(16, dtype=np.float32),)
        stop.wait(60)  # nothing more until the test ends

    producer = tsock.Producer(data(), channel, slots=4, wait_readers=1)
    run_producer(producer)
    consumer = tsock.Consumer(channel, timeout=30)
    got, ended = threading.Event(), []

    def read():
        try:
            for _ in consumer:
                got.set()
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            ended.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert got.wait(30), "no batch"
    time.sleep(0.3)  # back in acquire (or about to be: either way the same error)
    consumer.close()
    t.join(30)
    stop.set()
    assert not t.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], tsock.TsockError), ended
    assert "closed by another thread" in str(ended[0]) or "consumer is closed" in str(ended[0]), ended


# The script's main thread returns while two non-daemon threads run on: a
# trainer and a watchdog that closes the consumer. The process is not
# exiting, so the trainer gets the error (its except runs), not the quiet
# SystemExit of an exit (review 34, B3: it did, as the main thread had
# stopped).
MAIN_RETURNS = """
import sys, threading, time
import numpy as np
import tsock

name = sys.argv[1]
stop = threading.Event()

def data():
    yield (np.zeros(8, np.float32),)
    stop.wait(60)

prod = tsock.Producer(data(), name, slots=4, wait_readers=1)
threading.Thread(target=prod.run, daemon=True).start()
consumer = tsock.Consumer(name, timeout=30)
got = threading.Event()

def trainer():
    try:
        for _ in consumer:
            got.set()
        print("trainer: epoch ended", flush=True)
    except Exception as e:
        print(f"trainer: caught {type(e).__name__}: {e}", flush=True)
    except BaseException as e:
        print(f"trainer: ended by {type(e).__name__}", flush=True)
        raise
    finally:
        stop.set()

def watchdog():
    assert got.wait(30), "no batch"
    while threading.main_thread().is_alive():
        time.sleep(0.05)
    time.sleep(0.3)  # the trainer is back in next()
    consumer.close()

threading.Thread(target=trainer).start()
threading.Thread(target=watchdog).start()
"""


def test_a_consumer_closed_after_the_main_thread_returned_is_not_an_exit(spawn, channel):
    p = spawn(MAIN_RETURNS, channel)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "trainer: caught TsockError" in out, (out, err)
    assert "closed by another thread" in out or "consumer is closed" in out, out
