"""The runtime directory of tsock.shared, its lock files, and the files and
channel names of one key (docs/SHARED.md, "Files")."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import secrets
import stat

from . import _capi
from .errors import TsockError

# Serial numbers of this process's roster files and catch-up keys.
serials = itertools.count()
ATTACH_SLICE_S = 0.25  # a trainer's attach is tried in slices this long while its producer lives


def runtime_dir() -> str:
    """The user's directory for the lock files: $TSOCK_RUNTIME_DIR, else
    $XDG_RUNTIME_DIR/tsock, else /tmp/tsock-UID; created 0700, refused unless
    it is a real directory of ours that nobody else can write."""
    path = os.environ.get("TSOCK_RUNTIME_DIR")
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = os.path.join(xdg, "tsock") if xdg and os.path.isdir(xdg) else f"/tmp/tsock-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise TsockError(
            f"tsock.shared: {path} must be a directory owned by uid {os.geteuid()} with mode 0700 (it holds the "
            "lock files that elect the producer); remove it or set TSOCK_RUNTIME_DIR to another one",
            _capi.EPERM,
        )
    return path


# Lock descriptors a forked child must not inherit: a child of a dead
# trainer (a DataLoader worker) would keep its locks, so the trainer "alive".
_held_fds: set[int] = set()


def _close_held_in_child() -> None:
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def open_lock(path: str) -> int:
    """A descriptor of lock file `path` (created 0600), refused unless it is
    a regular file of ours."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise TsockError(f"tsock.shared: {path} is not a regular file of uid {os.geteuid()}", _capi.ESYS)
    _held_fds.add(fd)
    return fd


def close_lock(fd: int) -> None:
    _held_fds.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def try_lock(fd: int) -> bool:
    """flock(LOCK_EX | LOCK_NB): False when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def lock_is_held(path: str) -> bool:
    """Whether a process holds the lock of `path` (a missing file: no)."""
    try:
        fd = open_lock(path)
    except FileNotFoundError:
        return False
    try:
        if try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        close_lock(fd)


class Paths:
    """The files of one key (docs/SHARED.md, "Files")."""

    def __init__(self, directory: str, key: str):
        self.dir = directory
        self.key = key
        base = os.path.join(directory, key)
        self.start = base + ".start"
        self.alive = base + ".alive"
        self.error = base + ".error"
        self.ready = base + ".ready"
        self.log = base + ".log"
        self.trainer_prefix = key + ".trainer."

    def trainer(self, pid: int, serial: int = 0) -> str:
        """A loader's roster file: one per loader, so that a process with two
        loaders of the same key (a notebook cell run twice) counts twice.
        Random digits follow the serial: trainers in two pid namespaces may
        have the same pid (review 29)."""
        return os.path.join(self.dir, f"{self.trainer_prefix}{pid}.{serial}{secrets.randbelow(10**9):09d}")

    def join_roster(self, roster: str) -> int:
        """Enters a loader in the roster: its file is made and locked under a
        name the roster does not list, then renamed into it, so a roster
        file is locked from the moment it appears (a producer counting
        trainers removed one made but not yet locked: review 24). Returns
        the locked descriptor, held for the loader's life."""
        joining = os.path.join(self.dir, f"{self.key}.joining.{os.path.basename(roster)}")
        fd = open_lock(joining)
        try:
            if not try_lock(fd):
                raise TsockError(f"tsock.shared: {joining} is locked by another process", _capi.ESYS)
            os.rename(joining, roster)
        except BaseException:
            close_lock(fd)
            with contextlib.suppress(OSError):
                os.unlink(joining)
            raise
        return fd

    def live_trainers(self) -> int:
        """How many trainers are in the roster (see live_trainer_pids)."""
        return len(self.live_trainer_pids())

    def live_trainer_pids(self) -> list[int]:
        """The pid of each trainer whose roster file is locked (a process with
        two loaders twice)."""
        return [pid for pid, _channel in self.live_roster()]

    def live_trainer_channels(self) -> set[str]:
        """The channels live trainers are (or were last) attached to: each
        holds a position in that channel's run."""
        return {channel for _pid, channel in self.live_roster() if channel}

    def live_roster(self) -> list[tuple[int, str]]:
        """(pid, channel it last attached to, "" before) of each trainer whose
        roster file is locked; removes dead ones' files, each while holding
        its lock (so never a live one's)."""
        live = []
        try:
            entries = os.listdir(self.dir)
        except OSError:
            return []
        for entry in entries:
            pid = self._roster_pid(entry)
            if pid is None:
                continue
            path = os.path.join(self.dir, entry)
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # gone meanwhile
            # Closed in a child forked meanwhile (the producer's watchdog
            # counts while its main thread forks pipeline workers): a
            # worker holding a dead trainer's lock would keep it counted.
            _held_fds.add(fd)
            try:
                if not try_lock(fd):
                    live.append((pid, os.pread(fd, 256, 0).decode(errors="replace")))
                elif os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path)):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            finally:
                close_lock(fd)
        return live

    def _roster_pid(self, entry: str) -> int | None:
        """The pid of roster file name `entry` (KEY.trainer.PID.SERIAL), or None."""
        if not entry.startswith(self.trainer_prefix):
            return None
        pid, _, serial = entry[len(self.trainer_prefix) :].partition(".")
        return int(pid) if pid.isdigit() and serial.isdigit() else None

    def read_error(self) -> str | None:
        try:
            fd = os.open(self.error, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                return None
            return os.read(fd, 1 << 16).decode(errors="replace")
        finally:
            os.close(fd)

    def read_alive(self) -> dict:
        """The running (or last) producer's pid, channel and arguments'
        fingerprint ({} when unreadable)."""
        return _read_json(self.alive)

    def read_ready(self) -> dict:
        """What the producer wrote once its channel existed: its pid, the
        channel and the segment's identity ({} before that)."""
        return _read_json(self.ready)


def _read_json(path: str) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return {}
        value = json.loads(os.read(fd, 4096) or b"{}")
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


def remove_if_ours(path: str) -> None:
    """Unlinks `path` if it is a file of this uid. /dev/shm is world-writable
    and sticky: a file another uid put at a name this run used (its channel
    is listed there) can be neither removed nor replaced by us, and the
    PermissionError ended every later producer of the key before it said
    ok (review 27, N2). Such a file is left: no later run uses that name."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_uid == os.geteuid():
            os.unlink(path)


TMP_SEP = "+"  # no channel name has it: PATH+PID is never another channel's file (review 36, L3)


def write_whole(path: str, data: bytes, mode: int) -> None:
    """Writes `path` whole: to PATH+PID, created afresh, then renamed over
    it (a reader sees the old file or the new one). O_EXCL|O_NONBLOCK: never
    into a file, FIFO or link someone put at the temporary's name (/dev/shm
    is world-writable and pids are public: opening a planted FIFO blocked
    the producer, review 35 A1); one of ours left by an earlier process of
    this pid is replaced. OSError if it cannot."""
    tmp = f"{path}{TMP_SEP}{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        remove_if_ours(tmp)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- channel names ----


def channel_prefix() -> str:
    return f"shared.{os.geteuid()}."


def new_channel(key: str) -> str:
    """A run's channel: the uid and the key's beginning (for whoever lists
    /dev/shm) and 64 random bits, so that nobody can plant a file where a
    trainer will look (/dev/shm is world-writable; review 24, F8). The
    trainers learn it from KEY.ready, in the user's 0700 directory."""
    return f"{channel_prefix()}{key[:20]}.{secrets.token_hex(8)}"


def segment_path(channel: str) -> str:
    """Where the library keeps a channel's segment (docs/ARCHITECTURE.md)."""
    return f"/dev/shm/tsock.{channel}"


def check_name_of_run(channel: str) -> str:
    """A channel read from the runtime directory: one new_channel could make."""
    from .producer import check_name

    if not channel.startswith(channel_prefix()):
        raise TsockError(f"tsock.shared: channel {channel!r} is not one of uid {os.geteuid()}'s", _capi.ECORRUPT)
    return check_name(channel)
