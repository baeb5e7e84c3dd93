"""The producer process of tsock.shared: `python -m tsock._shared_run`, the
pickled spec on stdin (docs/SHARED.md, "Starting the producer")."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback

from . import _capi
from . import _factory as factory
from . import _runtime as runtime
from . import _shared as shared
from .errors import TsockError
from .pipeline import Pipeline

POLL_S = 0.01
WATCHDOG_POLL_S = 0.1


class Stop(Exception):
    """No trainer for `linger` seconds: run() ends here."""


def _detach() -> None:
    """Forks; the parent exits at once (the trainer reaps it), the child is
    re-parented to init, in the session start_new_session made."""
    if os.fork() > 0:
        os._exit(0)


def _keep_resume_notes_in(directory: str) -> None:
    """This process's producer writes its resume note in the user's 0700
    runtime directory, not in /dev/shm: there another uid, reading the
    run's channel from `ls /dev/shm`, could plant a file at the note's name
    that a successor can neither replace nor remove, and its "cannot record
    the resume position" ended every trainer at the next crash (review 27,
    N2). The process runs one producer only: the module's setting is its."""
    from . import producer

    producer.RESUME_DIR = directory


def _load_factory(ref: dict):
    if ref["file"] is None and ref.get("main"):
        # The trainer's script, run as `python -m package.train`: imported
        # by its module name (its `if __name__ == "__main__":` part does not
        # run), and where pickled arguments look for its classes.
        import importlib

        shared._loading_script = True
        try:
            module = importlib.import_module(ref["module"])
        finally:
            shared._loading_script = False
        for name in factory.MAIN_MODULES:
            sys.modules[name] = module
    elif ref["file"] is None:
        import importlib

        module = importlib.import_module(ref["module"])
    else:
        # The running script of the trainer, loaded as a module (not as
        # __main__: its `if __name__ == "__main__":` part does not run), as
        # multiprocessing's spawn does.
        import importlib.util

        spec = importlib.util.spec_from_file_location("__tsock_main__", ref["file"])
        module = importlib.util.module_from_spec(spec)
        for name in (*factory.MAIN_MODULES, "__tsock_main__"):  # where pickled arguments look for its classes
            sys.modules[name] = module
        shared._loading_script = True  # a tsock.shared() call at its top level is refused (review 27, N11)
        try:
            spec.loader.exec_module(module)
        finally:
            shared._loading_script = False
    return factory._lookup(module, ref["qualname"])


class Gate:
    """Producer.before_publish: before the first batch, waits for every live
    trainer of the roster; later, lingers while no trainer is attached."""

    def __init__(self, paths: runtime.Paths, linger: float, alive: int, announce=None, private: bool = False):
        self.paths = paths
        self.private = private  # a catch-up producer's key: its files go with it
        self.announce = announce or _announce_ready  # a test's fake producer has no segment
        self.alive = alive
        self.linger = linger
        self.first = True

    def __call__(self, producer) -> None:
        if self.first:
            self.first = False
            self.announce(self.paths, producer.name)
            self._wait(producer, _every_trainer_attached)
        elif producer.stats()["readers"] == 0:
            self._wait(producer, lambda readers, trainers: len(readers) >= 1)

    def _wait(self, producer, enough) -> None:
        idle_since = None
        while True:
            readers = producer.reader_pids()
            trainers = self.paths.live_trainer_pids()
            if enough(readers, trainers):
                return
            if not readers and not trainers:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= self.linger and self._may_stop(producer):
                    raise Stop
            else:
                idle_since = None
            time.sleep(POLL_S)

    def _may_stop(self, producer) -> bool:
        """Decided under KEY.start: a trainer attaching holds it until it is
        attached, so none can come between this check and the exit."""
        start = runtime.open_lock(self.paths.start)
        if not runtime.try_lock(start):
            runtime.close_lock(start)
            return False
        if producer.stats()["readers"] or self.paths.live_trainers():
            runtime.close_lock(start)
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.paths.ready)
        if self.private:
            _forget_key(self.paths)
        producer.close()  # the segment is unlinked now
        runtime.close_lock(self.alive)  # then KEY.start, at the exit: a trainer taking it finds no producer
        self.start_lock = start
        return True


def _every_trainer_attached(readers: list, trainers: list) -> bool:
    """Whether each live trainer of the roster has a reader of its own pid
    attached (one per loader), and there is one reader at least. Identities,
    not counts: a trainer killed just after it attached leaves the roster at
    once (its flock) but stays a reader until the producer has seen its
    connection end; counted, it stood in for a live trainer not attached
    yet, which then missed the first batches (review 27, N1). A reader of
    another pid namespace shows as pid 0 here, and its trainer's roster pid
    is its own namespace's: then they are counted, as before N1 (review 29:
    the gate never opened for trainers in containers)."""
    if 0 in readers:
        return len(readers) >= max(1, len(trainers))
    return bool(readers) and not collections.Counter(trainers) - collections.Counter(readers)


def _announce_ready(paths: runtime.Paths, channel: str) -> None:
    """Tells the trainers the channel exists, and which segment it is:
    until then they open nothing (review 24, F8). Written whole, then
    renamed: a trainer reads all of it or nothing."""
    st = os.stat(runtime.segment_path(channel), follow_symlinks=False)
    note = {"pid": os.getpid(), "channel": channel, "segment": [st.st_dev, st.st_ino]}
    tmp = f"{paths.ready}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(note).encode())
    finally:
        os.close(fd)
    os.replace(tmp, paths.ready)


def _start_position(producer, pipe: Pipeline):
    """Where the dead predecessor stopped; the beginning when there is none or
    it published another pipeline (then trainers see the new fingerprint)."""
    try:
        position = producer.recorded_position(producer.name, pipe)
    except (ValueError, TsockError) as e:
        print(f"tsock.shared: not resuming ({e}); starting at epoch 0", flush=True)
        return (0, 0)
    if position is None:
        # Its trainers hold a position in this run (they will drop batches
        # up to it): say so (review 27, N5).
        print(
            f"tsock.shared: not resuming (no position of channel '{producer.name}': neither its ring nor a resume "
            "note is left); starting at epoch 0",
            flush=True,
        )
        return (0, 0)
    return position


def _run(spec: dict, paths: runtime.Paths, alive: int) -> None:
    from .producer import Producer

    sys.path[:] = spec["sys_path"]
    factory = _load_factory(spec["factory"])
    args, kwargs = pickle.loads(spec["args"])
    loader = factory(*args, **kwargs)
    if isinstance(loader, collections.abc.Iterator):
        # iter(loader) is loader: a generator gives its batches once, then
        # every later epoch is empty (review 24, F7).
        raise TypeError(
            f"the factory returned an iterator ({type(loader).__name__}), which gives one epoch only; return a "
            "re-iterable loader (a DataLoader, a list) or a tsock.Pipeline"
        )
    options = dict(spec["producer"])
    slots = options.get("slots") or _capi.PRODUCER_DEFAULTS["SLOT_COUNT"]
    options.setdefault("join_window", slots // 2)
    producer = Producer(loader, spec["channel"], **options)
    loader = producer.loader  # a seeded map-style DataLoader is a Pipeline now
    if producer.not_resumable:
        note = producer.not_resumable
        print(f"tsock.shared: a crash restarts the epoch, since the factory's DataLoader: {note}", flush=True)
    producer.before_publish = Gate(paths, spec["linger"], alive, private=bool(spec.get("private")))
    try:
        if isinstance(loader, Pipeline):
            if spec["resume"]:
                start = _start_position(producer, loader)
            else:
                start = tuple(spec.get("start") or (0, 0))  # a catch-up's, or a resumed trainer's new run
            producer.run(epochs=None, start=start)
        else:
            _publish_epochs(producer, loader)
    except Stop:
        pass
    except BaseException as e:
        _record_error(paths, f"{type(e).__name__}: {e}")  # before the channel closes: trainers then look
        raise
    finally:
        producer.close()
        if isinstance(loader, Pipeline):
            loader.close()


def _forget_key(paths: runtime.Paths) -> None:
    """A catch-up producer's key is its trainer's alone, used once: its
    files are removed at its exit (under KEY.start and KEY.alive, so no
    trainer is between them), not left to pile up in the runtime directory."""
    for path in (paths.alive, paths.start, paths.log, paths.error):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _forget_earlier_run(channel: str) -> None:
    """A first producer of a run removes what a dead producer of an earlier
    run left (its segment, its resume note) before anything can kill it: a
    successor of this one then resumes this run, never the earlier one
    (review 24, F4). No producer of the key lives: this one holds KEY.alive,
    and a lingering one unlinks its channel before releasing it."""
    from .producer import resume_note_path

    try:
        runtime.check_name_of_run(channel)
    except TsockError:
        return  # not a name this user's producers use: not ours to remove
    for path in (runtime.segment_path(channel), resume_note_path(channel)):
        runtime.remove_if_ours(path)


def _publish_epochs(producer, loader) -> None:
    """Producer.run(epochs=None) for a loader that is not a Pipeline, which
    refuses an epoch with no batch: it would spin forever publishing end
    markers, and the trainers would wait forever (review 24, F7)."""
    while True:
        published = 0
        for batch in loader:
            producer.publish(batch)
            published += 1
        if not published:
            raise ValueError("an epoch of the factory's loader gave no batch (an empty dataset?)")
        producer.end_epoch()


class Watchdog(threading.Thread):
    """The linger exit, decided whatever the main thread does (a factory that
    hangs on a dead mount, a loader that never returns): once no trainer
    is in the roster for `linger` seconds, it takes KEY.start, checks
    again, removes the channel and exits the process (review 24, F7).
    A producer whose main thread runs lingers out by the Gate first, which
    closes the channel properly; this one waits a little longer."""

    GRACE_S = 2.0

    def __init__(self, paths: runtime.Paths, linger: float, alive: int, channel: str, private: bool = False):
        super().__init__(name="tsock-shared-watchdog", daemon=True)
        self.paths, self.linger, self.alive, self.channel = paths, linger, alive, channel
        self.private = private

    def run(self) -> None:
        idle_since = None
        while True:
            time.sleep(WATCHDOG_POLL_S)
            if self.paths.live_trainers():
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= self.linger + self.GRACE_S:
                self._exit_if_still_alone()

    def _exit_if_still_alone(self) -> None:
        start = runtime.open_lock(self.paths.start)
        if not runtime.try_lock(start):  # a trainer is attaching, or the Gate is exiting
            runtime.close_lock(start)
            return
        if self.paths.live_trainers():
            runtime.close_lock(start)
            return
        print(f"tsock.shared: producer {os.getpid()} had no trainer for {self.linger:g} s (watchdog)", flush=True)
        from .producer import resume_note_path

        for path in (self.paths.ready, runtime.segment_path(self.channel), resume_note_path(self.channel)):
            runtime.remove_if_ours(path)  # never raise here: this thread holds KEY.start and KEY.alive
        if self.private:
            _forget_key(self.paths)
        runtime.close_lock(self.alive)  # then KEY.start, at the exit, as the Gate's exit does
        _exit_with_workers()


def _exit_with_workers() -> None:
    """Ends this process and the pipeline's worker processes it forked: they
    share its process group, the one start_new_session made for the
    producer alone. os._exit left them running, and a worker stuck in the
    I/O the watchdog exists for (a dead mount) stayed for ever (review 27,
    N12)."""
    group = os.getpgid(0)
    if group == os.getsid(0):  # the producer's own session and group, as started
        os.killpg(group, signal.SIGKILL)  # this process too: its work is done
    os._exit(0)


def _record_error(paths: runtime.Paths, text: str) -> None:
    tmp = f"{paths.error}.{os.getpid()}"
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode(errors="replace")[: 1 << 16])
        finally:
            os.close(fd)
        os.replace(tmp, paths.error)


def main() -> int:
    spec = pickle.loads(sys.stdin.buffer.read())
    _detach()
    paths = runtime.Paths(runtime.runtime_dir(), spec["key"])
    _keep_resume_notes_in(paths.dir)
    alive = runtime.open_lock(paths.alive)
    if not runtime.try_lock(alive):
        print("busy", flush=True)
        return 0
    earlier = paths.read_alive().get("channel")  # the last producer's, dead or gone
    for stale in (paths.error, paths.ready):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    if not spec["resume"] and isinstance(earlier, str):
        _forget_earlier_run(earlier)
    os.ftruncate(alive, 0)
    note = {"pid": os.getpid(), "description": spec["description"], "channel": spec["channel"]}
    os.pwrite(alive, json.dumps(note).encode(), 0)
    # The answer, then stdout and stderr go to the log: the trainer reads
    # until both pipes close.
    print(f"ok {os.getpid()}", flush=True)
    log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    print(f"tsock.shared: producer {os.getpid()} of '{spec['key']}' started", flush=True)
    Watchdog(paths, spec["linger"], alive, spec["channel"], private=bool(spec.get("private"))).start()
    try:
        _run(spec, paths, alive)
    except BaseException as e:  # noqa: BLE001 - reported to the trainers, then the process ends
        traceback.print_exc()
        _record_error(paths, f"{type(e).__name__}: {e}")
        return 1
    finally:
        print(f"tsock.shared: producer {os.getpid()} of '{spec['key']}' exits", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the pipeline's workers and the library's threads are gone or going
