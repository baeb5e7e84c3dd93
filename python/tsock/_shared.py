"""tsock.shared: trainers launched independently share one producer process,
started by whichever comes first, lingering after the last, and replaced by
one of them if it dies (docs/SHARED.md: the protocol and its failure cases)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import inspect
import io
import itertools
import json
import os
import pickle
import re
import secrets
import stat
import subprocess
import sys
import threading
import time
import types
import warnings
import weakref
from typing import NamedTuple

from . import _capi, _state
from .consumer import Consumer
from .errors import ChannelClosed, ChannelNotFound, Evicted, ProducerGone, TsockError
from .pipeline import Position

KEY_MAX = 40  # shared.UID.KEY stays within a channel name's 64 characters
ATTACH_SLICE_S = 0.25
SKIP_MAX = 16  # batches of a stream behind its position a trainer reads and lets go, rather than catch up
CATCHUP_LINGER_S = 0.5  # a catch-up producer's linger after its trainer rejoined or left
READY_POLL_S = 0.01  # a trainer waiting for the producer's first batch
START_LOCK_POLL_S = 0.02  # a trainer waiting for another to attach
SLOW_START_WARN_S = 30.0  # then a trainer still waiting says so, naming the producer's log
# A trainer gives up (ProducerGone) once this many producers in a row died
# without a word and without making their channel, over at least this
# long: kills at start-up (an OOM killer, a sweep tool's) are survived, a
# factory that kills its process is not retried forever (review 24, F5).
START_ATTEMPTS = 5
START_BUDGET_S = 30.0
HANDSHAKE_TIMEOUT_S = 120.0  # the producer process's interpreter start, under load
CONSUMER_OPTIONS = ("output", "copy", "lifetime")
# The running script: __main__, or __mp_main__ in a child multiprocessing
# started with spawn or forkserver (the same file, another module name).
MAIN_MODULES = ("__main__", "__mp_main__")
MOVE_IT = "define it at the top level of a .py module (say data.py beside the script) and import it from there"
PRODUCER_OPTIONS = ("slots", "slot_bytes", "headroom", "join_window", "max_readers", "evict_after")


# ---- the runtime directory and its lock files ----


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


# ---- the key ----


def factory_ref(factory) -> dict:
    """How the producer process finds `factory`: its module and qualified
    name, and for the running script its file. TypeError naming the fix for
    what it cannot import."""
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not callable(factory) or module is None or qualname is None:
        raise TypeError(f"tsock.shared needs a function or class as the factory, got {factory!r}")
    fix = (
        "the producer runs in its own process and imports the factory by name: define it at the top level "
        "of a .py module (say data.py beside the script) and import it from there"
    )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(f"tsock.shared: factory {qualname} is a lambda or a nested function; {fix}")
    if _bound_to_an_object(factory):
        raise TypeError(f"tsock.shared: factory {qualname} is a method bound to an object; {fix}")
    ref = {"module": module, "qualname": qualname, "file": None}
    if module in MAIN_MODULES:
        main = sys.modules.get(module)
        name = getattr(getattr(main, "__spec__", None), "name", None)
        if name and name not in MAIN_MODULES:
            # Run as `python -m package.train`: imported by that name, as
            # multiprocessing's spawn does, so that its relative imports
            # work; loaded from its file, it had no package (review 27, N10).
            if _lookup(main, qualname) is not factory:
                raise TypeError(f"tsock.shared: {module}.{qualname} does not name the factory given; {fix}")
            return {"module": name, "qualname": qualname, "file": None, "main": True}
        path = getattr(main, "__file__", None)
        if not path or not path.endswith(".py"):
            raise TypeError(
                f"tsock.shared: factory {qualname} is defined in __main__ of an interactive session or notebook; {fix}"
            )
        ref["file"] = os.path.abspath(path)
    obj = _resolve(ref) if ref["file"] is None else _lookup(sys.modules[module], qualname)
    if obj is not factory:
        raise TypeError(f"tsock.shared: {module}.{qualname} does not name the factory given; {fix}")
    return ref


def _lookup(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _resolve(ref: dict):
    import importlib

    try:
        return _lookup(importlib.import_module(ref["module"]), ref["qualname"])
    except ImportError:
        return None


def _bound_to_an_object(value) -> bool:
    """Whether value is a method bound to an instance (not to a class or a
    module, which its qualified name does say)."""
    owner = getattr(value, "__self__", None)
    return owner is not None and not isinstance(owner, (type, types.ModuleType))


def _canonical(value, where: str):
    """A JSON form of an argument that is the same in every process, or
    TypeError naming name= as the fix."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"tsock.shared: {where} is a dict with non-str keys: cannot fingerprint it; pass name=")
        return {"dict": {k: _canonical(v, f"{where}[{k!r}]") for k, v in sorted(value.items())}}
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    named = (callable(value) or isinstance(value, type)) and module and qualname and "<" not in qualname
    if named and _bound_to_an_object(value):
        # A bound method's name is its class's: Scale(1).apply and
        # Scale(1000).apply would share one producer (review 24).
        raise TypeError(
            f"tsock.shared: argument {where} is a method bound to an object ({qualname}), whose state its name "
            "does not say; pass name='...' to name the pipeline yourself, or pass a module-level function"
        )
    if named and module in MAIN_MODULES:
        # The running script's: its module name is the same in every script
        # (review 24, F3), its file is not.
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path:
            raise TypeError(f"tsock.shared: argument {where} ({qualname}) is defined in a notebook; {MOVE_IT}")
        return {"ref": f"{os.path.abspath(path)}:{qualname}"}
    if named:
        return {"ref": f"{module}.{qualname}"}
    raise TypeError(
        f"tsock.shared: argument {where} is a {type(value).__name__}, which has no form that is the same in every "
        "process; pass name='...' to name the pipeline yourself (trainers with the same name share it)"
    )


def fingerprint(ref: dict, args: tuple, kwargs: dict) -> str:
    """The key of a factory call: 20 hex digits of blake2b of its canonical form."""
    where = ref["file"] or ref["module"]
    form = {
        "factory": f"{where}:{ref['qualname']}",
        "args": [_canonical(a, f"args[{i}]") for i, a in enumerate(args)],
        "kwargs": {k: _canonical(v, k) for k, v in sorted(kwargs.items())},
    }
    text = json.dumps(form, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


class _NothingOfTheScript(pickle.Pickler):
    """Refuses a function or class of the running script: the producer
    loads the script only when the factory is in it, so it could not
    unpickle them (review 24, F3)."""

    def reducer_override(self, obj):
        module = getattr(obj, "__module__", None)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and module in MAIN_MODULES:
            raise _ScriptReference(f"{obj.__qualname__} is defined in the running script ({module})")
        return NotImplemented


class _ScriptReference(Exception):
    pass


def _pickled(args: tuple, kwargs: dict, script_loaded: bool) -> bytes:
    """The arguments as the producer gets them; with script_loaded False (the
    factory is not in the running script), nothing of the script."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer) if script_loaded else _NothingOfTheScript(buffer)
    try:
        pickler.dump((tuple(args), dict(kwargs)))
        return buffer.getvalue()
    except _ScriptReference as e:
        raise TypeError(
            f"tsock.shared: an argument refers to {e}, which the producer process does not load (the factory is "
            f"not in the script); {MOVE_IT}"
        ) from None
    except Exception as e:
        raise TypeError(
            f"tsock.shared: the factory's arguments are sent to the producer process pickled, and pickle refused "
            f"them: {type(e).__name__}: {e}"
        ) from None


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


# ---- starting the producer ----


def start_producer(paths: Paths, spec: dict) -> int:
    """Starts the producer process (its own session, re-parented to init) and
    returns its pid once it holds KEY.alive; TsockError with its stderr if
    it could not start."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsock._shared_run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        env=env,
        cwd=spec["cwd"],
    )
    try:
        out, err = proc.communicate(pickle.dumps(spec), timeout=HANDSHAKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    answer = out.decode(errors="replace").split()
    if len(answer) == 2 and answer[0] == "ok" and answer[1].isdigit():
        return int(answer[1])
    if answer[:1] == ["busy"]:
        return 0  # another producer holds KEY.alive: attach to it
    detail = err.decode(errors="replace").strip()[-2000:] or f"exit status {proc.returncode}, no output"
    full = _full_file_systems(paths.dir)
    raise TsockError(
        f"tsock.shared: the producer process for '{paths.key}' did not start{f' ({full})' if full else ''}: {detail}",
        _capi.ESYS,
    )


# Below this, a file system counts as full: a producer writes its log, its
# notes and its segment's first slots there before it can say it started.
FULL_BELOW_BYTES = 1 << 20


def _full_file_systems(runtime: str) -> str:
    """Which of the runtime directory's and /dev/shm's file systems is full
    (bytes or inodes), said as the cause of a producer that died before its
    channel; "" when neither is (review 27, N9: the trainer said "killed?")."""
    said = []
    for path in (runtime, "/dev/shm"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < FULL_BELOW_BYTES or (st.f_files and st.f_favail == 0):
            said.append(f"{path} is full: {free} bytes and {st.f_favail} inodes free")
    return "; ".join(said)


# ---- the trainer's loader ----

_serials = itertools.count()
# True in a producer process while it loads the training script (the
# factory is defined there): a shared() call at the script's top level runs
# then, and would start a producer of another key that cannot import it.
_loading_script = False
# This process's open loaders: a recovery attaches its siblings of the same key ahead.
_open_loaders: weakref.WeakSet = weakref.WeakSet()


class SharedLoader:
    """What tsock.shared returns: a loader over the shared producer's batches
    (see tsock.shared)."""

    def __init__(self, factory, args, kwargs, *, name, linger, producer, consumer, start_at=None, state=None):
        ref = factory_ref(factory)
        private = start_at is not None  # a catch-up loader: its key is this trainer's alone
        if state is not None:
            loaded = _state.decode(state)  # before anything starts
            if loaded.world_size:
                raise ValueError("this state is a partitioned consumer's (rank and world size): tsock.shared is not")
            if loaded.started:
                start_at = (loaded.fingerprint, loaded.epoch, loaded.batch)
        self._call = (factory, args, kwargs, producer, consumer)  # for a catch-up producer
        if name is None:
            self.description = fingerprint(ref, args, kwargs)
            key = self.description
        else:
            if not isinstance(name, str) or not name or len(name) > KEY_MAX:
                raise ValueError(f"name must be a str of 1..{KEY_MAX} characters, got {name!r}")
            try:
                self.description = fingerprint(ref, args, kwargs)
            except TypeError:
                self.description = None  # name= is how such arguments are shared
            key = name
        if not isinstance(linger, (int, float)) or linger < 0:
            raise ValueError(f"linger must be seconds >= 0, got {linger!r}")
        from .producer import check_name

        check_name(new_channel(key))
        #: the channel the producer publishes on (a run's own random name)
        self.channel = None
        #: the key trainers share a producer by (name, or the fingerprint)
        self.key = key
        self._spec = {
            "factory": ref,
            "args": _pickled(args, kwargs, script_loaded=ref["file"] is not None or ref.get("main", False)),
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            "channel": None,
            "key": key,
            "description": self.description,
            "linger": float(linger),
            "producer": dict(producer),
            "start": start_at and list(start_at[1:]),  # (epoch, batch) where a first producer's run starts
            "private": private,
        }
        self._options = consumer
        self._paths = Paths(runtime_dir(), key)
        self._pid = os.getpid()
        #: producer crashes this trainer went through (each time a successor took over)
        self.recoveries = 0
        #: epochs that started over after a crash (the loader's order is not reproducible)
        self.restarts = 0
        #: batches this trainer did not get (always 0: a Pipeline's are caught up, see catchups)
        self.lost_batches = 0
        #: batches a successor published again that this trainer had (dropped; 0 when it resumed exactly)
        self.repeated_batches = 0
        #: times the producer evicted this trainer (producer={"evict_after": s}); it attached again each time
        self.evictions = 0
        #: epochs completed (each for-loop that ran to its end)
        self.epoch = 0
        #: pid of the producer this trainer reads from
        self.producer_pid = 0
        self._position = start_at  # (fingerprint, epoch, next index) in a pipeline's order
        self._behind_ok = start_at is not None  # batches before the position are expected (skipped, not repeated)
        self._resumed = state is not None and start_at is not None  # a loaded state set the position
        self._resumed_samples = loaded.samples if self._resumed else 0  # samples before it: a whole batch's?
        self._samples = self._resumed_samples  # samples of the position's epoch handed out (state_dict)
        self._catchup = None  # the private loader this trainer reads while behind the shared stream
        self._catchup_epoch_start = False  # it just ended an epoch: try to rejoin first
        # (channel, producer pid, hold_max, (tag, batches) held or None)
        # while it probes the stream
        self._probe = None
        if not private:
            _sweep_dead_catchups(self._paths)
        #: times this trainer was behind the shared stream and caught up on a producer of its own
        self.catchups = 0
        #: times it then went back to the shared stream
        self.rejoins = 0
        #: batches of a stream behind this trainer's resumed position it read and let go
        self.skipped_batches = 0
        self._tagged = None  # the stream carries pipeline tags (None: no batch seen yet)
        self._open = False  # the trainer's epoch in progress has handed out a batch
        self._epoch_done = False  # ended by a tag; the ring's marker may still come
        self._consumer = None
        self._closed = False
        self._announced = False  # the producer being attached to made its channel
        self._ahead_pid = 0  # the producer of the consumer attached ahead (_attach_siblings)
        roster = self._paths.trainer(self._pid, next(_serials))
        self._roster = self._paths.join_roster(roster)
        # What the finalizer undoes: the consumer (replaced at each
        # recovery), the roster lock and its file.
        # What the finalizer undoes also holds the consumer attached ahead
        # to a successor for a sibling (_attach_siblings), until it is used.
        self._state = [None, self._roster, roster, self._pid, None]
        self._finalizer = weakref.finalize(self, _detach, self._state)
        # Held while this loader changes consumers: a sibling's recovery
        # attaches it ahead from another thread, perhaps.
        self._switching = threading.RLock()
        try:
            self._use(self._connect(recovering=False))
        except BaseException:
            self.close()
            raise
        _open_loaders.add(self)

    # ---- attaching ----

    def _connect(self, recovering: bool) -> Consumer:
        paths = self._paths
        successor = recovering  # a producer of this trainer's died (not a first start)
        start = open_lock(paths.start)
        try:
            self._take_start_lock(start)
            deaths, since = 0, time.monotonic()
            while True:
                if not lock_is_held(paths.alive):
                    error = paths.read_error() if recovering else None
                    if error is not None:
                        raise self._failed(error, successor)
                    channel, resume = self._run_to_start()
                    start_producer(paths, {**self._spec, "channel": channel, "resume": resume})
                alive = paths.read_alive()
                self._check_description(alive)
                self._announced = False
                consumer = self._attach("now" if recovering else "epoch")
                if consumer is not None:
                    self.producer_pid = int(alive.get("pid", 0))
                    return consumer
                # The producer died before its channel took this trainer.
                error = paths.read_error()
                if error is not None:
                    raise self._failed(error, successor)
                recovering = True  # from here on a KEY.error is this run's, and attaching is start="now"
                if self._announced:  # it got as far as its channel: the factory works
                    deaths, since = 0, time.monotonic()
                deaths += 1
                if deaths >= START_ATTEMPTS and time.monotonic() - since >= START_BUDGET_S:
                    raise ProducerGone(
                        f"tsock.shared: {deaths} producers of '{self.key}' in a row died before making their "
                        f"channel, over {time.monotonic() - since:.0f} s "
                        f"({_full_file_systems(paths.dir) or 'killed? crashed?'}); see {paths.log}",
                        _capi.EPRODUCER_GONE,
                    )
        finally:
            close_lock(start)  # releases KEY.start

    def _run_to_start(self) -> tuple[str, bool]:
        """(channel, resume) of the producer to start, decided under KEY.start.
        A successor on the last producer's channel (it reads where that one
        stopped from its ring, or its resume note) while a live trainer of
        the roster holds a position in that run: this one recovering, one
        busy elsewhere when the producer died while this one arrives (review
        27, N4), or one attached while this one was attaching (N3). A new
        run on a new channel otherwise: nobody holds a position in the last
        one, which its first producer forgets."""
        last = self._paths.read_alive().get("channel")
        if isinstance(last, str) and last in self._paths.live_trainer_channels():
            return check_name_of_run(last), True
        return new_channel(self.key), False

    def _record_channel(self, channel: str) -> None:
        """Writes in this loader's roster file the channel it is attached to
        (under KEY.start, where every producer start is decided): it holds a
        position in that run."""
        if self._roster is None:
            return  # out of the roster: catching up on a producer of its own
        os.ftruncate(self._roster, 0)
        os.pwrite(self._roster, channel.encode(), 0)

    def _enter_roster(self) -> None:
        """Back in the roster (after a catch-up): a new roster file, locked."""
        roster = self._paths.trainer(self._pid, next(_serials))
        self._roster = self._paths.join_roster(roster)
        self._state[1], self._state[2] = self._roster, roster

    def _take_start_lock(self, start: int) -> None:
        """KEY.start, waited for in short tries: another trainer holds it
        while its producer runs the factory, and a factory that hangs must
        not leave this one waiting without a word either (review 24, F7)."""
        since, warned = time.monotonic(), False
        while not try_lock(start):
            if not warned and time.monotonic() - since >= SLOW_START_WARN_S:
                warned = True
                self._warn_slow_start(time.monotonic() - since)
            time.sleep(START_LOCK_POLL_S)

    def _failed(self, error: str, successor: bool) -> ProducerGone:
        what = "failed, so no successor was started" if successor else "could not be started"
        return ProducerGone(f"tsock.shared: the producer of '{self.key}' {what}: {error}", _capi.EPRODUCER_GONE)

    def _check_description(self, alive: dict) -> None:
        theirs = alive.get("description")
        if self.description is not None and theirs is not None and theirs != self.description:
            raise ValueError(
                f"tsock.shared: the producer named '{self.key}' runs another pipeline (arguments' fingerprint "
                f"{theirs}, this trainer's {self.description}); use another name= or the same arguments"
            )

    def _ready_channel(self) -> str | None:
        """The channel of the live producer once it said it exists (KEY.ready,
        of its pid), checked to be the segment it made; None before."""
        ready, alive = self._paths.read_ready(), self._paths.read_alive()
        channel = ready.get("channel")
        if not ready.get("pid") or ready.get("pid") != alive.get("pid") or not isinstance(channel, str):
            return None
        check_name_of_run(channel)
        try:
            st = os.stat(segment_path(channel), follow_symlinks=False)
        except FileNotFoundError:
            return None  # the producer is closing it: it lingered out
        if st.st_uid != os.geteuid() or [st.st_dev, st.st_ino] != ready.get("segment"):
            raise TsockError(
                f"tsock.shared: {segment_path(channel)} is not the segment the producer of '{self.key}' made "
                f"(replaced by uid {st.st_uid}?); not attaching",
                _capi.ECORRUPT,
            )
        return channel

    def _attach(self, start: str) -> Consumer | None:
        """A Consumer of the channel, once the producer says it made it (at
        its first batch, after the factory ran), tried in slices while the
        producer lives; None if it died. Never opens what sits at a channel
        name before that: a leftover or a planted file (review 24, F8)."""
        since, warned = time.monotonic(), False
        while lock_is_held(self._paths.alive):
            channel = self._ready_channel()
            self._announced = self._announced or channel is not None
            if channel is None:
                if not warned and time.monotonic() - since >= SLOW_START_WARN_S:
                    warned = True
                    self._warn_slow_start(time.monotonic() - since)
                time.sleep(READY_POLL_S)
                continue
            try:
                consumer = Consumer(channel, start=start, timeout=ATTACH_SLICE_S, **self._options)
            except (ChannelNotFound, ProducerGone):
                continue  # closed meanwhile (the producer lingered out, or died)
            except TsockError as e:
                if e.status != _capi.ETIMEDOUT:
                    raise
                continue  # the producer answered no join in the slice (stopped, starved of CPU): it still lives
            consumer.track_tags = True
            self._record_channel(channel)
            self.channel = channel
            return consumer
        return None

    def _warn_slow_start(self, waited: float) -> None:
        """A factory that hangs (a dead mount) must not leave the trainers
        waiting without a word (review 24, F7)."""
        pid = self._paths.read_alive().get("pid", "?")
        warnings.warn(
            f"tsock.shared: the producer {pid} of '{self.key}' has not published its first batch to this trainer after "
            f"{waited:.0f} s (its factory or loader still running, or stuck?); this trainer waits on while it "
            f"lives; see {self._paths.log}",
            RuntimeWarning,
            stacklevel=5,
        )

    def _use(self, consumer, pending=None) -> None:
        """Makes `consumer` this loader's (and `pending` the one attached ahead)."""
        self._consumer = self._state[0] = consumer
        self._state[4] = pending

    def _recover(self) -> None:
        """The producer died: attach to its successor (starting it if this
        trainer is the first to notice), or take the consumer a sibling's
        recovery attached ahead; then attach ahead this process's other
        loaders of the key still reading the dead producer's ring."""
        with self._switching:
            dead, old, ahead = self.producer_pid, self._consumer, self._state[4]
            self.recoveries += 1
            if ahead is not None:
                self._use(ahead)
                self.producer_pid = self._ahead_pid
            else:
                # The old consumer stays open until this one is attached:
                # its reader lock keeps the dead segment, which holds the
                # position the successor resumes from (read after its
                # factory ran), from being reclaimed by any Create of this
                # user meanwhile (30 s after the dead producer's last
                # publish): the run restarted at epoch 0 (review 27, N5).
                self._use(self._connect(recovering=True), None)
            if old is not None:
                old.close()
        self._attach_siblings(dead)
        if self._tagged is False and self._open:
            self.restarts += 1
            warnings.warn(
                f"tsock.shared: the producer of '{self.key}' died and its successor started the loader over: "
                f"epoch {self.epoch} restarted in this loop (its order is not known to be reproducible: return a "
                "tsock.Pipeline or a seeded map-style DataLoader from the factory for exact resume; its log says why "
                f"this one is not: {self._paths.log})",
                RuntimeWarning,
                stacklevel=4,
            )

    def _attach_siblings(self, dead: int) -> None:
        """This process's other open loaders of the key, still on the dead
        producer's ring: each gets a consumer of the successor now, kept
        until it has read the dead ring out (its ProducerGone), so that it
        loses nothing. The successor waits for every loader of the roster
        before its first batch, and a sibling reads only when this one
        returns (zip(loader_a, loader_b)): without this, the two waited for
        each other for ever (review 27, N6)."""
        for sibling in list(_open_loaders):
            if sibling is self or sibling.key != self.key or sibling._pid != os.getpid():
                continue
            if not sibling._switching.acquire(blocking=False):
                continue  # recovering in another thread by itself
            try:
                if sibling._consumer is None or sibling._state[4] is not None or sibling.producer_pid != dead:
                    continue
                current = sibling.producer_pid
                ahead = sibling._connect(recovering=True)
                sibling._ahead_pid, sibling.producer_pid = sibling.producer_pid, current
                sibling._use(sibling._consumer, ahead)
            finally:
                sibling._switching.release()

    def _reattach_evicted(self) -> None:
        """producer={"evict_after": s}: this trainer held the producer back
        that long and was evicted. It attaches again (start="now"), told;
        a Pipeline's batches published meanwhile come from a catch-up
        producer of its own (its tags show the stream went on), another
        loader's are lost to it. Before, Evicted ended the loader for good,
        and its close() raised too, leaving it in the roster (review 27,
        N8)."""
        old = self._consumer
        self._use(None, self._state[4])
        with contextlib.suppress(TsockError):
            old.close()  # evicted: its batches still referenced cannot be kept
        self.evictions += 1
        warnings.warn(
            f"tsock.shared: this trainer held the producer of '{self.key}' back longer than its evict_after and was "
            "evicted; it attaches again, and the batches published meanwhile come from a producer of its own "
            "(a Pipeline's; another loader's are lost to it)",
            RuntimeWarning,
            stacklevel=4,
        )
        self._use(self._connect(recovering=True), self._state[4])

    # ---- iterating ----

    def _usable(self) -> Consumer:
        self._check_process()
        return self._consumer

    def _check_process(self) -> None:
        if self._closed:
            raise TsockError("tsock.shared loader is closed", _capi.EHANDLE)
        if os.getpid() != self._pid:
            raise TsockError(
                "a tsock.shared loader cannot be used in a forked child; call tsock.shared there", _capi.EFORKED
            )

    def _next_batch(self):
        """The next batch of the trainer's epoch, or None at its end."""
        if self._epoch_done:
            self._epoch_done = False
            return None
        while True:
            if self._catchup is not None:
                self._check_process()
                return self._next_caught_up()
            consumer = self._usable()
            try:
                batch = next(consumer)
            except StopIteration:
                if self._tagged:
                    continue  # pipeline epochs end by their tags
                if not self._open:
                    continue  # an end marker before anything: not an epoch
                return None
            except (ProducerGone, ChannelClosed):
                # Closed: a producer closes only with no reader attached, or
                # when its loader failed (its KEY.error says so).
                self._recover()
                continue
            except Evicted:
                self._reattach_evicted()
                continue
            tag = consumer.last_tag
            self._tagged = tag is not None
            if tag is None or self._take(tag, len(consumer)):
                self._open = True
                return batch

    def _take(self, tag, batches: int) -> bool:
        """Whether a pipeline batch is this trainer's next one; moves the position."""
        pos = self._position
        if pos is not None and tag.fingerprint != pos[0] and self._resumed:
            raise ValueError(
                f"tsock.shared: the state loaded into this loader was saved from another pipeline (fingerprint "
                f"{pos[0].hex()}) than the one '{self.key}' runs ({tag.fingerprint.hex()}): load it into a loader of "
                "the same factory and arguments"
            )
        if pos is not None and tag.fingerprint != pos[0]:
            self.restarts += 1
            warnings.warn(
                f"tsock.shared: the producer of '{self.key}' was replaced by one whose pipeline has another "
                f"fingerprint (not reproducible): epoch {self.epoch} restarts at the next epoch start",
                RuntimeWarning,
                stacklevel=4,
            )
            pos = self._position = None
        if pos is None:
            if tag.index != 0:
                return False  # attached mid-epoch: start with the next one
        else:
            here, want = (tag.epoch, tag.index), (pos[1], pos[2])
            if here < want:
                if not self._behind_ok:
                    self.repeated_batches += 1  # handed out before the crash
                elif _behind(tag, pos, batches) > SKIP_MAX and self._catchup is None:
                    # Reading it up to the position would take the others'
                    # time for each batch (review 29): a producer of its own.
                    self._start_catchup()
                else:
                    self.skipped_batches += 1
                return False
            if here > want:
                # The stream is past this trainer's next batch (it resumed
                # from an older state, was evicted, or a successor did not
                # publish it again): its batches come from a producer of its
                # own from its position, nothing is lost.
                self._start_catchup()
                return False
        if self._resumed and tag.start != self._resumed_samples:
            raise ValueError(
                f"tsock.shared: the loaded state is {self._resumed_samples - tag.start} samples into batch "
                f"{tag.index} (a re-batching Consumer's?): a shared loader hands out whole batches; use a state it "
                "saved, or tsock.Consumer(..., batch_size=) to resume it"
            )
        self._behind_ok = self._resumed = False
        if tag.index + 1 >= batches:
            self._position = (tag.fingerprint, tag.epoch + 1, 0)
            self._samples = 0
            self._epoch_done = True
        else:
            self._position = (tag.fingerprint, tag.epoch, tag.index + 1)
            self._samples = tag.start + tag.samples
        return True

    # ---- resume ----

    def state_dict(self) -> dict:
        """Where this trainer is in the pipeline's order: {"tsock": 48 bytes}
        (the pipeline's fingerprint, the epoch, the samples and batches of it
        handed out). Save it with the model's checkpoint; load_state_dict()
        in a new loader resumes at the next batch. Nothing is snapshotted:
        taking it costs nothing, and so does keeping it up to date."""
        pos = self._catchup._position if self._catchup is not None else self._position
        samples = self._catchup._samples if self._catchup is not None else self._samples
        if pos is None:
            return _state.encode(_state.BEGINNING)
        return _state.encode(_state.State(pos[0], pos[1], samples, pos[2]))

    def load_state_dict(self, state_dict: dict) -> None:
        """Resumes at the position state_dict() gave, before the first batch:
        the next batch is the one after the last the saving loader handed
        out, in the same batches as a run never interrupted. When the shared
        stream is past it, this trainer's batches come from a producer of
        its own until it can rejoin the stream at an epoch start
        (docs/SHARED.md, "Resume"). ValueError for a state of another
        pipeline (at the first batch) or one that is not a tsock state."""
        state = _state.decode(state_dict)
        if self._open or self._position is not None or self.epoch:
            raise ValueError("load_state_dict() must come before the loader's first batch")
        if state.world_size:
            raise ValueError("this state is a partitioned consumer's (rank and world size): tsock.shared is not")
        if not state.started:
            return  # saved before any batch: the beginning, as without a state
        self._position = (state.fingerprint, state.epoch, state.batch)
        self._samples = self._resumed_samples = state.samples
        self._behind_ok = self._resumed = True

    def _start_catchup(self) -> None:
        """This trainer is behind the shared stream (resumed from an older
        state, or a successor did not publish its next batch): it leaves the
        stream and the roster (the shared producer must not wait for it) and
        reads its own producer, the same pipeline from its position."""
        factory, args, kwargs, producer, consumer = self._call
        # Its one reader is this trainer, whom nobody else waits for: an
        # eviction would only nest another catch-up in it (review 29).
        producer = {k: v for k, v in producer.items() if k != "evict_after"}
        key = f"{self.key[:20]}.c{self._pid}.{next(_serials)}"
        self._leave_shared()
        _sweep_dead_catchups(self._paths)
        try:
            catchup = SharedLoader(
                factory,
                args,
                kwargs,
                name=key,
                linger=CATCHUP_LINGER_S,
                producer=producer,
                consumer=consumer,
                start_at=self._position,
            )
        except BaseException:
            # Its producer failed (the factory's error is raised): nothing of
            # the key is left, and the trainer is back on the stream, where
            # its next batch tries again.
            _forget_private_key(Paths(self._paths.dir, key))
            self._join_shared()
            raise
        catchup._samples = self._samples
        # The loaded state's checks go with the position, to the catch-up's first batch.
        catchup._resumed, catchup._resumed_samples = self._resumed, self._resumed_samples
        self._resumed = False
        self._catchup = catchup
        self.catchups += 1

    def _join_shared(self) -> None:
        """Back in the roster and attached to the shared stream (its producer
        started again if it is gone)."""
        self._enter_roster()
        self._consumer = self._connect(recovering=False)

    def _leave_shared(self) -> None:
        """Detaches from the shared stream and leaves its roster."""
        consumer, self._consumer = self._consumer, None
        self._probe = None
        self._state[0] = None
        if consumer is not None:
            consumer.close()
        roster_fd, roster = self._state[1], self._state[2]
        self._state[1] = self._roster = None
        if roster_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(roster)
            close_lock(roster_fd)

    def _next_caught_up(self):
        """The next batch from the catch-up producer (None at an epoch's
        end). At an epoch start the trainer attaches to the shared stream
        again; once the stream's oldest batch is its next one, it goes back
        to the stream (_rejoined)."""
        if self._catchup_epoch_start:
            self._catchup_epoch_start = False
            if self._consumer is None:
                self._probe_shared()
        if self._consumer is not None and self._rejoined():
            return self._next_batch()
        catchup = self._catchup
        batch = catchup._next_batch()
        self._position, self._samples = catchup._position, catchup._samples
        if batch is None:
            self._catchup_epoch_start = True
        else:
            self._open = True
        return batch

    def _probe_shared(self) -> None:
        """Attaches to the shared stream with start="oldest": its first batch
        is the oldest one a trainer of the stream has not let go (the
        slowest one's next), which the ring keeps for this trainer from the
        attach on. Nothing happens if the stream is gone or not ready."""
        start = open_lock(self._paths.start)
        try:
            # Under KEY.start, as any attach: the roster file names the
            # channel, which decides whether a successor resumes this run
            # (review 29: a trainer that rejoined was invisible to it).
            self._take_start_lock(start)
            if not lock_is_held(self._paths.alive):
                return
            channel = self._ready_channel()
            if channel is None:
                return
            pid = int(self._paths.read_alive().get("pid", 0))
            hold_max = _hold_max(self._paths.read_ready())
            self._enter_roster()
            try:
                consumer = Consumer(channel, start="oldest", timeout=ATTACH_SLICE_S, **self._options)
            except TsockError:
                self._leave_shared()
                return
            self._record_channel(channel)
        finally:
            close_lock(start)
        self._state[0] = self._consumer = consumer
        consumer.track_tags = True
        self._probe = (channel, pid, hold_max, None)

    def _rejoined(self) -> bool:
        """Whether the trainer is back on the shared stream, which it probed
        at an epoch start. The stream's oldest batch, once there is one, is
        held (the producer cannot overwrite it) while the catch-up producer
        serves the batches before it, up to half the ring: the others
        read on meanwhile, through the ring's other slots, and never wait
        for this trainer unless it reads slower than they do (review 28,
        F7: before, a trainer at the others' pace never rejoined, and one
        whose stream took more than 1 s per batch was never seen to). A
        stream further ahead, or gone, leaves the trainer on its own
        producer until the next epoch start."""
        channel, pid, hold_max, held = self._probe
        want = self._position
        if held is None:
            consumer = self._consumer
            try:
                tag = consumer._peek_tag(0)
                batches = len(consumer)
            except TsockError:
                self._leave_shared()  # the shared producer died or closed meanwhile
                return False
            if tag is None:
                if consumer._pending:  # a batch, but not a pipeline's
                    self._leave_shared()
                return False  # nothing in its ring yet: look again at the next batch
            held = tag, batches
            self._probe = (channel, pid, hold_max, held)
        tag, batches = held
        behind = _behind(tag, want, batches)
        if tag.fingerprint != want[0] or behind > SKIP_MAX or -behind > hold_max:
            self._leave_shared()  # past this trainer by more than it may hold, or too far behind
            return False
        if behind < 0:
            return False  # its own producer serves the batches before the held one
        self.channel, self.producer_pid = channel, pid
        catchup, self._catchup = self._catchup, None
        catchup.close()
        self._behind_ok = True
        self._probe = None
        self.rejoins += 1
        return True

    @property
    def position(self):
        """(epoch, batch): the pipeline position of the next batch this
        trainer takes; None before its first pipeline batch."""
        return None if self._position is None else Position(self._position[1], self._position[2])

    def _end_epoch(self) -> None:
        self.epoch += 1
        self._open = False

    def __iter__(self):
        """One epoch, as a DataLoader's iterator; a loop that broke off
        before drops the rest of its epoch first (the producer is shared)."""
        self._check_process()  # now, not at the first next()
        if self._open:
            while self._next_batch() is not None:
                pass
            self._end_epoch()
        return self._epoch()

    def _epoch(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                self._end_epoch()
                return
            yield batch

    def __len__(self) -> int:
        if self._catchup is not None:
            return len(self._catchup)
        while True:
            try:
                return len(self._usable())
            except ProducerGone:
                self._recover()

    # ---- lifecycle ----

    def close(self) -> None:
        """Detaches (the producer lingers, then exits, once no trainer is
        attached). Idempotent."""
        self._closed = True
        self._consumer = None
        if self._catchup is not None:
            self._catchup.close()
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<tsock.SharedLoader key={self.key!r} channel={self.channel!r} producer_pid={self.producer_pid}>"


_PRIVATE_KEY = re.compile(r".*\.c(\d+)\.\d+")


def remove_if_ours(path: str) -> None:
    """Unlinks `path` if it is a file of this uid. /dev/shm is world-writable
    and sticky: a file another uid put at a name this run used (its channel
    is listed there) can be neither removed nor replaced by us, and the
    PermissionError ended every later producer of the key before it said
    ok (review 27, N2). Such a file is left: no later run uses that name."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_uid == os.geteuid():
            os.unlink(path)


def _forget_private_key(paths: Paths) -> None:
    """Removes a catch-up key's files, its channel's segment and its resume
    note (kept in the runtime directory: review 27, N2); its producer and
    its trainer are gone."""
    from .producer import resume_note_path

    channel = paths.read_alive().get("channel")
    if isinstance(channel, str):
        with contextlib.suppress(TsockError):
            check_name_of_run(channel)
            for path in (segment_path(channel), resume_note_path(channel, paths.dir)):
                remove_if_ours(path)
    for path in (paths.ready, paths.error, paths.log, paths.alive, paths.start):
        remove_if_ours(path)
    with contextlib.suppress(OSError):
        for entry in os.listdir(paths.dir):
            if entry.startswith((paths.trainer_prefix, f"{paths.key}.joining.")):
                remove_if_ours(os.path.join(paths.dir, entry))  # its trainer's roster file: dead too


def _sweep_dead_catchups(paths: Paths) -> None:
    """Catch-up keys whose trainer and producer were killed together (an
    OOM kill, a job killed whole) left a segment and files that nobody
    would remove: a trainer of the same key removes them (review 28)."""
    try:
        entries = os.listdir(paths.dir)
    except OSError:
        return
    prefix = paths.key[:20] + ".c"
    for entry in entries:
        key, _, suffix = entry.rpartition(".")
        if suffix != "alive" or not key.startswith(prefix):
            continue
        found = _PRIVATE_KEY.fullmatch(key)
        if found is None or _pid_alive(int(found.group(1))):
            continue
        private = Paths(paths.dir, key)
        if lock_is_held(private.alive):
            continue  # its producer lingers still
        _forget_private_key(private)


def _hold_max(ready: dict) -> int:
    """The most batches a trainer rejoining the stream of the KEY.ready
    note `ready` serves from its own producer while it holds the stream's
    oldest batch: half the ring's slots, the other half left for what the
    other trainers hold. An older producer's note without them: the
    default ring's."""
    slots = ready.get("slots")
    if not isinstance(slots, int) or not 2 <= slots <= 65536:
        slots = _capi.PRODUCER_DEFAULTS["SLOT_COUNT"]
    return slots // 2


def _behind(tag, position: tuple, batches: int) -> int:
    """Batches from the stream's batch `tag` to `position` (fingerprint,
    epoch, index): > 0 when the stream is behind it, < 0 when past it."""
    return (position[1] - tag.epoch) * batches + position[2] - tag.index


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _detach(state: list) -> None:
    consumer, roster, path, pid, ahead = state
    if os.getpid() != pid:
        return
    try:
        if ahead is not None:
            ahead.close()
        if consumer is not None:
            with contextlib.suppress(Evicted):  # evicted: nothing left to detach
                consumer.close()
    finally:
        # Whatever close() raised: a loader left in the roster would hold
        # every later producer of the key back for the process's life
        # (review 27, N8). None: out of the roster (catching up on a
        # producer of its own).
        if roster is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            close_lock(roster)


class SharedProducer(NamedTuple):
    """A running shared producer (tsock.shared_producers)."""

    key: str  #: what its trainers share it by: the name= given, or the arguments' fingerprint
    pid: int  #: its process
    channel: str | None  #: the channel it publishes on (None before its first batch)
    trainers: int  #: loaders attached to it or waiting for it now
    description: str | None  #: the fingerprint of its factory and arguments (None for unnamed objects)


def _held_by_a_producer(path: str) -> bool:
    """Whether `path` (a KEY.alive) is ours and locked: opened without
    creating it, so a query leaves nothing behind."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        if try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def shared_producers(factory=None, *args, name: str | None = None, **kwargs) -> list[SharedProducer]:
    """The shared producers of this user running on the node, or only the
    one `tsock.shared(factory, *args, name=name, **kwargs)` would attach
    to (give the factory's own arguments, not shared()'s keywords).
    Nothing is started or attached; a tool can watch or stop a producer by
    its pid (SIGTERM lets it finish cleanly: docs/OPERATIONS.md)."""
    if name is not None:
        wanted = name
    elif factory is not None:
        wanted = fingerprint(factory_ref(factory), args, kwargs)
    else:
        wanted = None
    directory = runtime_dir()
    found = []
    for entry in sorted(os.listdir(directory)):
        key, dot, suffix = entry.rpartition(".")
        if suffix != "alive" or not dot or (wanted is not None and key != wanted):
            continue
        paths = Paths(directory, key)
        if not _held_by_a_producer(paths.alive):
            continue
        note = paths.read_alive()
        pid = note.get("pid")
        if not isinstance(pid, int):
            continue  # its producer is writing the note this instant
        ready = paths.read_ready()
        channel = ready.get("channel") if ready.get("pid") == pid else None
        description = note.get("description") if isinstance(note.get("description"), str) else None
        found.append(SharedProducer(key, pid, channel, paths.live_trainers(), description))
    return found


def shared(
    factory,
    *args,
    name: str | None = None,
    linger: float = 5.0,
    producer: dict | None = None,
    output: str = "numpy",
    copy: bool = False,
    lifetime: str = "referenced",
    state: dict | None = None,
    **kwargs,
) -> SharedLoader:
    """A loader over `factory(*args, **kwargs)`'s batches, made once by one
    producer process that every trainer calling shared() with the same
    factory and arguments (or the same `name`) shares: the first caller
    starts it (in its own session: it outlives the trainer that started
    it), later ones attach, it exits `linger` seconds after the last one
    detaches, and if it dies a trainer starts a successor that resumes
    where it stopped. docs/SHARED.md has the details.

    Args:
      factory: an importable function (module level, not a lambda, not
        defined in a notebook) returning a tsock.Pipeline (exact resume after
        a crash) or any re-iterable loader of batches (a DataLoader, a list:
        after a crash the epoch restarts, with a RuntimeWarning; an iterator
        is refused). It runs in the producer.
      args, kwargs: its arguments, pickled to the producer; part of the key.
      name: the key instead of the arguments' fingerprint (needed when an
        argument has no canonical form, such as an object); at most 40 of
        [A-Za-z0-9._-].
      linger: seconds the producer stays once no trainer is attached.
      producer: Producer options (slots, slot_bytes, headroom, join_window,
        max_readers, evict_after), used if this call starts the producer.
      output, copy, lifetime: the Consumer's options.
      state: a loader's state_dict() to resume after: a new run's first
        producer starts there (load_state_dict() after the call would read
        a new run from its beginning up to it).
    """
    if _loading_script:
        raise RuntimeError(
            "tsock.shared was called while the producer process loaded the training script to import the factory "
            'from it: put the script\'s work under `if __name__ == "__main__":` (the producer loads the script '
            "as a module, as multiprocessing's spawn does)"
        )
    producer = dict(producer or {})
    unknown = set(producer) - set(PRODUCER_OPTIONS)
    if unknown:
        raise TypeError(f"producer= takes {PRODUCER_OPTIONS}, not {sorted(unknown)}")
    consumer = {"output": output, "copy": copy, "lifetime": lifetime}
    return SharedLoader(
        factory, args, kwargs, name=name, linger=linger, producer=producer, consumer=consumer, state=state
    )
