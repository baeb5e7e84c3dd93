"""The producer's pipeline figures for `tsock stat`.

They live in the producer's Python process (stage times, worker pool,
decoded-sample cache), not in the channel's segment, so a Producer fed by a
tsock.Pipeline writes them at most once a second, while it publishes, to a
hidden file beside the segment: /dev/shm/.tsock-stats.NAME, JSON, replaced
whole (written to NAME+PID, then renamed) and removed at close.
cmd/tsock/stat_pipeline.go reads it as untrusted input: only a regular file
of the segment's owner, at most 64 KiB, written by the channel's producer
pid, with sane values. Writing it never fails the producer."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import struct
import threading
import time
import weakref

from . import _runtime

DIRECTORY = "/dev/shm"
INTERVAL_S = 1.0


def path(name: str) -> str:
    """Where the figures of channel `name` go (a name no channel can have)."""
    return os.path.join(DIRECTORY, f".tsock-stats.{name}")


def figures(pipe) -> dict:
    """What `tsock stat` shows of a Pipeline: workers now, read threads per
    worker, seconds per stage (workers summed), and its cache's counts."""
    size = pipe.pool_size()
    out = {
        "workers": size["workers"],
        "io_threads": size["threads"] or 0,
        "stage_s": pipe.stage_seconds(),
    }
    cache = cache_figures(pipe)
    if cache:
        out["cache"] = cache
    return out


def cache_figures(pipe) -> dict:
    """Hits, misses and bytes held of the Pipeline's cache segment (its
    advisory totals: every process using it counts); {} without a cache,
    or while its segment cannot be read."""
    stats = getattr(pipe, "cache_stats", None)
    try:
        seg = (stats() or {}).get("segment") if stats is not None else None
    except Exception:  # noqa: BLE001 - figures for a tool must not fail the producer
        return {}
    if not seg:
        return {}
    used = max(0, seg["blocks"] - seg["free_blocks"]) * seg["block_bytes"]
    return {"hits": seg["hits"], "misses": seg["misses"], "bytes": used}


def sweep() -> None:
    """Removes this user's figures and half-written temporaries left by
    producers that were killed (their pid is gone): a new producer does it
    once, so they do not pile up in /dev/shm."""
    try:
        names = [n for n in os.listdir(DIRECTORY) if n.startswith(".tsock-stats.")]
    except OSError:
        return
    for n in names:
        full = os.path.join(DIRECTORY, n)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if os.lstat(full).st_uid != os.geteuid():
                continue
            data = _read(full)
            try:
                pid = json.loads(data).get("pid")
            except ValueError:  # half-written: a temporary NAME+PID whose writer was killed
                tail = n.rpartition(_runtime.TMP_SEP)[2] if _runtime.TMP_SEP in n else ""
                pid = int(tail) if tail.isdigit() else None
            # Not a pid of this namespace, and no producer holds the
            # channel (containers sharing /dev/shm see each other's pids
            # as dead, not their locks: review 35 A5).
            if isinstance(pid, int) and pid > 0 and not _runtime.pid_alive(pid) and not _producer_holds(n):
                os.unlink(full)


def _read(path: str) -> bytes:
    """The first 64 KiB of a regular file, never through a link or a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86-64 and aarch64
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)


def _producer_holds(note_name: str) -> bool:
    """Whether a live producer holds the channel a note is named after (its
    write lock on byte 0 of /dev/shm/tsock.NAME: ring/layout.h)."""
    channel = note_name[len(".tsock-stats.") :]
    try:
        fd = os.open(
            os.path.join(DIRECTORY, f"tsock.{channel}"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return False
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        return _FLOCK.unpack(got)[0] == fcntl.F_WRLCK
    except OSError:
        return False
    finally:
        os.close(fd)


class StatsNote:
    """Writes a Pipeline's figures for channel `name` now and then."""

    def __init__(self, name: str, pipe):
        self.name, self.pipe = name, pipe
        self._next = 0.0
        self._closed = False
        # tick (the publishing thread) against remove (close, from any
        # thread): a note written after its removal would be left behind.
        # Re-entrant: close() from a signal handler that interrupted a write
        # on this thread must not wait for it (review 36, M1).
        self._lock = threading.RLock()
        # What the finalizer needs (not self): the inode of the note this
        # object wrote last, None once removed; a finalizer run late must
        # not remove a newer producer's note of the channel (review 36, L2).
        self._mine = {"ino": None}
        sweep()
        # A producer never closed (the process ends) removes it too.
        weakref.finalize(self, _remove_ours, path(name), self._mine)

    def tick(self) -> None:
        """Writes the figures if INTERVAL_S has passed since the last time."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + INTERVAL_S
        try:
            fig = figures(self.pipe)
            with self._lock:
                if not self._closed:
                    self._write(fig)
                    if self._closed:  # by a signal handler during the write
                        _remove_ours(path(self.name), self._mine)
        except Exception:  # noqa: BLE001 - a full /dev/shm, another uid's file: no figures, same batches
            self._next = now + 60 * INTERVAL_S

    def _write(self, fig: dict) -> None:
        data = json.dumps({"pid": os.getpid(), **fig}, separators=(",", ":")).encode()
        final = path(self.name)
        _runtime.write_whole(final, data, 0o644)
        self._mine["ino"] = os.lstat(final).st_ino

    def remove(self) -> None:
        """Removes the figures this process wrote, and writes no more (a
        killed producer's stay: stat ignores them, their pid is not the
        channel's producer's, and the next producer sweeps them)."""
        with self._lock:
            self._closed = True
            _remove_ours(path(self.name), self._mine)


def _remove_ours(final: str, mine: dict) -> None:
    """Removes the note at `final` if it is the one `mine` records writing
    (same inode, this pid), and forgets it."""
    ino, mine["ino"] = mine["ino"], None
    if ino is None:
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if os.lstat(final).st_ino == ino and json.loads(_read(final)).get("pid") == os.getpid():
            os.unlink(final)
