"""Shared fixtures: unique channel names, /dev/shm clean-up, producers run in
a thread, helper processes started with sys.executable."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

_counter = itertools.count()


@pytest.fixture
def channel():
    """A channel name unique to this process and test; its segment is
    removed afterwards whatever happened."""
    name = f"pt-{os.getpid()}-{next(_counter)}"
    yield name
    path = Path("/dev/shm") / f"tsock.{name}"
    if path.exists():
        path.unlink()


class ProducerThread:
    """Runs producer.run(epochs) in a thread; join() re-raises its error."""

    def __init__(self, producer, epochs=1, close=True):
        self.producer = producer
        self.error = None
        self._close = close
        self._thread = threading.Thread(target=self._run, args=(epochs,), daemon=True)
        self._thread.start()

    def _run(self, epochs):
        try:
            self.producer.run(epochs=epochs)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e
        finally:
            if self._close:
                self.producer.close()

    def join(self, timeout=30):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "producer thread did not finish"
        if self.error is not None:
            raise self.error


@pytest.fixture
def run_producer():
    """run_producer(producer, epochs=1) starts producer.run in a thread and
    closes the producer when it is done (or at the end of the test)."""
    started = []

    def start(producer, epochs=1, close=True):
        t = ProducerThread(producer, epochs, close)
        started.append(t)
        return t

    yield start
    for t in started:
        t.producer.close()
        t._thread.join(10)


def child_env() -> dict:
    env = dict(os.environ)
    # The package, and this folder (helpers such as fakecuda).
    paths = [str(ROOT / "python"), str(Path(__file__).parent), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("TSOCK_LIBRARY_DIR", str(ROOT / "build"))
    # A child that hangs is ended with SIGABRT by the tests that wait for
    # it (test_shared's finish): it then prints every thread's stack.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def _default_sigint():
    """Children get Ctrl-C back: a test run from a background job inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def spawn():
    """spawn(code, *args) starts `python -c code args...` (code dedented) with
    the package on its path; every process still running at the end of the
    test is killed."""
    procs = []

    def start(code, *args, **kw):
        kw.setdefault("preexec_fn", _default_sigint)
        p = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def cache_stays_on():
    """Fails the test if the sample cache turned itself off in this process
    and the test did not expect it: a CacheWarning that no pytest.warns or
    catch_warnings of the test took. (The cache never raises its warning,
    even as an error, so a filter cannot tell.) Other warnings go on."""
    from tsock._cache import CacheWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        yield
    off = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    for w in caught:
        if not issubclass(w.category, CacheWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    assert not off, f"the cache turned itself off: {off}"


@pytest.fixture
def shm():
    """A directory of /dev/shm for a test's cache segments, removed after it."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="tsock-cache-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)
