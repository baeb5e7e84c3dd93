"""The decoded-sample cache's shared-memory segment (docs/CACHE.md): its
one layout (`geometry()`), the header's checks, the locks, and the
operations on the index (lookups, inserts, evictions, the rebuild after a
change cut short), which the caller runs under the store lock.

One file per cache key, /dev/shm/tsock-cache.<uid>.<key hex>: a header,
an entry per sample index, a block chain per cached sample in an arena of
fixed-size blocks, a free-block stack, the members list (the cached
samples) and a table of consumers (whose known orders drive Belady
eviction). Byte 0 of the file is the store lock (exclusive for changes,
shared for lookups), byte 1 the users lock (shared while open; exclusive
without waiting means nobody uses the file); both are open-file-description
locks. Every value read from the segment is copied into a local and
checked before use.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time

import numpy as np

from .errors import CacheError

MAGIC = b"TSKCACHE"
VERSION = 3  # 2: a consumer entry holds the sample index it is at, not its position; 3: TABLE_CHANGES
PAGE = 4096
HEADER_BYTES = PAGE
END = 0xFFFFFFFF  # the last block of a chain
EMPTY, FULL = 0, 1
CONSUMER_SLOTS = 64
CONSUMER_BYTES = 256
PARAMS_MAX = 216
MIN_BLOCK, MAX_BLOCK = 4096, 1 << 20
COPY_MAX = 1 << 30  # the most bytes a lookup copies with one call

# Header: fixed at creation (offset 0) ...
_FIXED = struct.Struct("<8sII16sQQQIIQQQQQQQQQII")
# ... and the mutable words (u64 each) from offset 192.
MUTABLE_OFFSET = 192
# TABLE_CHANGES: bumped at every change of the consumer table (register,
# unregister), so a process can tell the table it judged is still the one
# there with one read (CacheStore.put's keep-all run).
(DIRTY, FREE_COUNT, CLOCK, HITS, MISSES, INSERTS, EVICTIONS, BYPASSES, CORRUPT, REBUILDS, MEMBERS, TABLE_CHANGES) = (
    range(12)
)
N_MUTABLE = 12
_MUTABLE = struct.Struct(f"<{N_MUTABLE}Q")
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_ENTRY = struct.Struct("<IIQQQ")  # state, member (place in the members list), length, first block, last use
_CONSUMER = struct.Struct("<IIQQQQ")  # pid, params length, start time, epoch, index (the sample it is at), updated_ns

_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86-64 and aarch64
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
STORE_BYTE, USERS_BYTE = 0, 1


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def geometry(n_samples: int, block_bytes: int, n_blocks: int) -> dict:
    """Every offset of a segment, and its size, from its three parameters."""
    g = {"entries_offset": HEADER_BYTES}
    off = _page_up(HEADER_BYTES + _ENTRY.size * n_samples)
    for name in ("next_offset", "owner_offset", "free_offset", "members_offset"):
        g[name] = off
        off = _page_up(off + 4 * n_blocks)
    g["consumers_offset"] = off
    g["arena_offset"] = off = _page_up(off + CONSUMER_SLOTS * CONSUMER_BYTES)
    g["file_bytes"] = off + n_blocks * block_bytes
    return g


def blocks_for_budget(n_samples: int, block_bytes: int, budget: int) -> int:
    """The most blocks a segment of at most `budget` bytes holds."""
    fixed = geometry(n_samples, block_bytes, 0)["file_bytes"]
    # 16 bytes a block in the four u32 arrays, each rounded up to a page.
    n = max(0, (budget - fixed - 4 * PAGE) // (block_bytes + 16))
    while n > 0 and geometry(n_samples, block_bytes, n)["file_bytes"] > budget:
        n -= 1
    while geometry(n_samples, block_bytes, n + 1)["file_bytes"] <= budget:
        n += 1
    return n


def budget_for(n_samples: int, sample_bytes: int, cached: int) -> int:
    """The cache_bytes whose segment holds exactly `cached` samples of
    `sample_bytes` encoded bytes each (len(_cache_codec.encode(sample))),
    for a dataset of `n_samples`: what a benchmark sets to cache a given
    fraction of the decoded dataset."""
    block = block_size_for(sample_bytes)
    return geometry(n_samples, block, cached * -(-sample_bytes // block))["file_bytes"]


def block_size_for(sample_bytes: int) -> int:
    """The power of two near sample_bytes / 16, within 4 KiB .. 1 MiB."""
    b = MIN_BLOCK
    while b < MAX_BLOCK and b * 16 < sample_bytes:
        b *= 2
    return b


def segment_path(key: bytes, directory: str = "/dev/shm") -> str:
    """Where the segment of a cache key lives (the uid keeps users apart)."""
    return os.path.join(directory, f"tsock-cache.{os.geteuid()}.{key.hex()}")


FALLBACK_NAMES = 7


def candidate_paths(key: bytes, directory: str = "/dev/shm") -> list:
    """segment_path(), then the names tried when a file of another uid
    sits at it (/dev/shm is writable by all: review 31, F7)."""
    base = segment_path(key, directory)
    return [base] + [f"{base}.{i}" for i in range(1, FALLBACK_NAMES + 1)]


class NotOurs(CacheError):
    """A file at a cache's name that this uid may not use or remove."""


def default_budget(directory: str = "/dev/shm") -> int:
    """What cache_bytes="auto" may take in `directory`: a quarter of
    MemAvailable, at most half of the free space, and at most a quarter of
    the file system's total size less what this uid's caches there take
    already (the rest is for rings and other users: review 31, F5)."""
    avail = _mem_available()
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    ours = sum(c["bytes"] for c in list_caches(directory))
    return int(max(0, min(avail // 4 if avail else free // 2, free // 2, total // 4 - ours)))


def auto_budget(n_samples: int, sample_bytes: int, block_bytes: int, directory: str = "/dev/shm") -> int:
    """default_budget(), but no more than the whole dataset needs if its
    samples are about the size of the first one (with a quarter more room):
    the file is allocated in full when created, so a small dataset must
    not take a quarter of the memory. CacheError if that leaves no room."""
    blocks = -(-sample_bytes // block_bytes)
    need = geometry(n_samples, block_bytes, -(-5 * n_samples * blocks // 4))["file_bytes"]
    budget = min(default_budget(directory), need)
    if blocks_for_budget(n_samples, block_bytes, budget) < 1:
        caches = list_caches(directory)
        raise CacheError(
            f'cache_bytes="auto" leaves no room in {directory}: this uid\'s {len(caches)} caches there take '
            f"{sum(c['bytes'] for c in caches)} bytes of the quarter of the file system auto may use "
            f"(tsock.caches() lists them, tsock.remove_caches() removes those unused)"
        )
    return budget


def list_caches(directory: str = "/dev/shm") -> list:
    """This uid's cache segments in `directory`: dicts of path, key (hex),
    bytes (allocated), in_use (a process has it open), n_samples (None if
    the header is not a cache's). Nothing is locked or changed."""
    prefix = f"tsock-cache.{os.geteuid()}."
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except OSError:
        return out
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                n_samples = Header(os.pread(fd, HEADER_BYTES, 0)).n_samples
            except CacheError:
                n_samples = None
            out.append(
                {
                    "path": path,
                    "key": name[len(prefix) :],
                    "bytes": st.st_blocks * 512,
                    "in_use": _locked_by_others(fd, USERS_BYTE),
                    "n_samples": n_samples,
                }
            )
        finally:
            os.close(fd)
    return out


def remove_caches(directory: str = "/dev/shm", keys=None, older_than: float | None = None) -> list:
    """Removes this uid's cache segments in `directory` that no process
    uses; the paths removed. Without keys or older_than that is every
    unused cache of the uid on the node, other jobs' kept ones included
    (on an account several jobs share, limit it): keys, cache keys (bytes,
    as Pipeline.cache_key(), or their hex) to remove only those;
    older_than, seconds: only those not modified for that long."""
    wanted = None
    if keys is not None:
        wanted = {k.hex() if isinstance(k, (bytes, bytearray)) else str(k) for k in keys}
    if older_than is not None and older_than < 0:
        raise ValueError(f"older_than must be >= 0 seconds, got {older_than}")
    removed = []
    now = time.time()
    for c in list_caches(directory):
        if wanted is not None and c["key"].partition(".")[0] not in wanted:
            continue
        if older_than is not None:
            try:
                if now - os.stat(c["path"], follow_symlinks=False).st_mtime < older_than:
                    continue
            except OSError:
                continue
        try:
            fd = os.open(c["path"], os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if _remove_if_unused(fd, c["path"]):
                removed.append(c["path"])
        finally:
            os.close(fd)
    return removed


def _locked_by_others(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on `byte`."""
    got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _lock(fd: int, kind: int, byte: int, wait: bool) -> bool:
    """An OFD lock on one byte (F_RDLCK, F_WRLCK or F_UNLCK); False when
    not waiting and someone else holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
        return True
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _alive(pid: int, started: int) -> bool:
    return _start_time(pid) == started


class Header:
    """The header's fixed fields, from a private copy, checked."""

    def __init__(self, raw: bytes):
        if len(raw) < _FIXED.size:
            raise CacheError(f"a header of {len(raw)} bytes (truncated)")
        (magic, version, header_bytes, key, n_samples, block_bytes, n_blocks, slots, cbytes, *rest) = (
            _FIXED.unpack_from(raw, 0)
        )
        offsets, (self.file_bytes, self.created_ns, self.creator_pid, _) = rest[:7], rest[7:]
        if magic != MAGIC:
            raise CacheError(f"magic {magic!r}, not {MAGIC!r}: not a tsock cache")
        if version != VERSION:
            raise CacheError(f"layout version {version}, this tsock reads {VERSION}")
        if (header_bytes, slots, cbytes) != (HEADER_BYTES, CONSUMER_SLOTS, CONSUMER_BYTES):
            raise CacheError(f"header/consumer sizes {(header_bytes, slots, cbytes)}")
        if not (MIN_BLOCK <= block_bytes <= MAX_BLOCK and block_bytes & (block_bytes - 1) == 0):
            raise CacheError(f"block size {block_bytes}")
        if not (1 <= n_blocks < END and 1 <= n_samples < END):
            raise CacheError(f"{n_blocks} blocks, {n_samples} samples")
        self.key, self.n_samples, self.block_bytes, self.n_blocks = key, n_samples, block_bytes, n_blocks
        want = geometry(n_samples, block_bytes, n_blocks)
        names = (
            "entries_offset",
            "next_offset",
            "owner_offset",
            "free_offset",
            "members_offset",
            "consumers_offset",
            "arena_offset",
        )
        got = dict(zip(names, offsets), file_bytes=self.file_bytes)
        for name, value in want.items():
            if got[name] != value:
                raise CacheError(f"{name} is {got[name]}, the geometry gives {value}")
        self.geometry = want

    @staticmethod
    def pack(key: bytes, n_samples: int, block_bytes: int, n_blocks: int) -> bytes:
        g = geometry(n_samples, block_bytes, n_blocks)
        return _FIXED.pack(
            MAGIC,
            VERSION,
            HEADER_BYTES,
            key,
            n_samples,
            block_bytes,
            n_blocks,
            CONSUMER_SLOTS,
            CONSUMER_BYTES,
            g["entries_offset"],
            g["next_offset"],
            g["owner_offset"],
            g["free_offset"],
            g["members_offset"],
            g["consumers_offset"],
            g["arena_offset"],
            g["file_bytes"],
            time.time_ns(),
            os.getpid(),
            0,
        )


_CORRUPT = object()  # read(): the entry failed a check


def _run_nexts(first: int, k: int) -> bytes:
    """The next words of a chain laid out as blocks first .. first + k - 1
    (a struct for the usual few blocks, numpy for a long run: review 44, 7)."""
    if k <= 64:
        return struct.pack(f"<{k}I", *range(first + 1, first + k), END)
    nexts = np.arange(first + 1, first + k + 1, dtype="<u4")
    nexts[-1] = END
    return nexts.tobytes()


class _Segment:
    """The mapped file, its checked header, and the operations on it. The
    caller holds the store lock (locked()) around every operation."""

    def __init__(self, fd: int, header: Header, path: str):
        import mmap

        self.fd, self.h, self.path = fd, header, path
        self.suspect = False  # a change met damage: rebuild at its end
        g = header.geometry
        try:
            self.mm = mmap.mmap(fd, g["file_bytes"])
        except (ValueError, OSError) as e:  # ValueError: the file shrank below its size since the check
            raise CacheError(f"cannot map {path}: {e}") from None
        nb = header.n_blocks
        self.mut = np.ndarray(N_MUTABLE, np.uint64, self.mm, MUTABLE_OFFSET)
        words = np.ndarray(header.n_samples, np.dtype((np.uint32, (8,))), self.mm, g["entries_offset"])
        self.state, self.member = words[:, 0], words[:, 1]
        self.next = np.ndarray(nb, np.uint32, self.mm, g["next_offset"])
        self.owner = np.ndarray(nb, np.uint32, self.mm, g["owner_offset"])
        self.free = np.ndarray(nb, np.uint32, self.mm, g["free_offset"])
        self.members = np.ndarray(nb, np.uint32, self.mm, g["members_offset"])  # the FULL entries, unordered
        self.arena = np.ndarray((nb, header.block_bytes), np.uint8, self.mm, g["arena_offset"])
        self._rows = np.ndarray((header.n_samples, 4), np.uint64, self.mm, g["entries_offset"])  # entries, as words
        self._pids = np.ndarray(CONSUMER_SLOTS, np.uint32, self.mm, g["consumers_offset"], (CONSUMER_BYTES,))
        _lock(fd, fcntl.F_RDLCK, USERS_BYTE, wait=True)
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)

    # ---- open, create ----

    @classmethod
    def open(cls, path: str, key: bytes, n_samples: int):
        """The segment at `path` checked against (key, n_samples); None if
        there is none. A bad one that nobody uses is removed (None); one in
        use raises CacheError."""
        for _ in range(3):
            seg = cls._open_once(path, key, n_samples)
            if seg is None or _same_file(seg.fd, path):
                return seg
            seg.close()  # removed as unused between the check and our users lock: open the new one
        raise CacheError(f"{path} keeps being replaced while this process opens it")

    @classmethod
    def _open_once(cls, path: str, key: bytes, n_samples: int):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):
                raise NotOurs(f"{path}: {e.strerror}: a file of another uid (or a link) at the cache's name") from None
            raise CacheError(f"cannot open the cache segment {path}: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise NotOurs(f"{path}: owned by uid {st.st_uid}, not a regular file of ours: left alone")
            return cls(fd, _check(fd, path, key, n_samples), path)
        except NotOurs:
            os.close(fd)
            raise
        except CacheError as e:
            if _remove_if_unused(fd, path):
                os.close(fd)
                return None
            os.close(fd)
            raise CacheError(f"{path}: {e}; it is in use, so it was left alone") from None
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def locate(cls, key: bytes, directory: str, n_samples: int):
        """(segment, path): the segment of `key` open, or None and the path
        at which to create it: the first of candidate_paths() that is free
        or ours; CacheError if files of other uids take all of them."""
        for path in candidate_paths(key, directory):
            try:
                return cls.open(path, key, n_samples), path
            except NotOurs:
                continue
        raise CacheError(f"files of other uids take every name of this cache ({path} and before): it is off")

    @classmethod
    def create(cls, path: str, key: bytes, n_samples: int, block_bytes: int, budget: int):
        """A new segment at `path` (or the one another process made first)."""
        n_blocks = blocks_for_budget(n_samples, block_bytes, budget)
        if n_blocks < 1:
            need = geometry(n_samples, block_bytes, 1)["file_bytes"]
            raise CacheError(f"cache_bytes={budget} is less than the {need} bytes {n_samples} samples need at least")
        size = geometry(n_samples, block_bytes, n_blocks)["file_bytes"]
        directory = os.path.dirname(path)
        free = _free_bytes(directory)
        if size > free:
            raise CacheError(f"the cache needs {size} bytes and {directory} has {free} free: lower cache_bytes")
        fd = _unnamed(directory)
        try:
            _allocate(fd, size, directory)
            _initialise(fd, Header.pack(key, n_samples, block_bytes, n_blocks), n_blocks, size)
            try:
                _link(fd, path)
            except FileExistsError:
                os.close(fd)
                fd = -1  # closed: its number may be reused by the open below
                got = cls.open(path, key, n_samples)
                if got is None:
                    raise CacheError(f"{path} appeared and went while this process created it") from None
                return got
            return cls(fd, Header(os.pread(fd, HEADER_BYTES, 0)), path)
        except BaseException:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise

    def close(self) -> None:
        """Unmaps the file and closes it (which releases this descriptor's locks)."""
        for view in ("mut", "state", "member", "next", "owner", "free", "members", "arena", "_rows", "_pids"):
            setattr(self, view, None)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with it
        os.close(self.fd)

    def forget_in_child(self) -> None:
        """In a child forked while this segment was open: closes the
        inherited descriptor (if it is still this file: a thread of the
        parent may have been closing it at the fork) and mapping."""
        try:
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) == self.ident:
                self.close()
        except (OSError, AttributeError):
            pass

    # ---- locking ----

    def locked(self, exclusive: bool):
        return _Locked(self, exclusive)

    def _whole(self) -> bool:
        """check_size's test, as a bool."""
        st, want = os.fstat(self.fd), self.h.geometry["file_bytes"]
        return st.st_size == want and st.st_blocks * 512 >= want

    def check_size(self) -> None:
        st = os.fstat(self.fd)
        want = self.h.geometry["file_bytes"]
        if st.st_size != want:
            raise CacheError(f"{self.path} is {st.st_size} bytes now, not {want} (truncated?)")
        if st.st_blocks * 512 < want:
            raise CacheError(f"{self.path} has {st.st_blocks * 512} of its {want} bytes allocated (holes: truncated?)")

    def _pread(self, n: int, offset: int) -> bytes:
        """n bytes of the file at offset, read, not mapped: a file that a
        peer truncates under us gives a short read (CacheError), where a
        read of the mapping would be a SIGBUS (review 31, F4)."""
        got = os.pread(self.fd, n, offset)
        if len(got) != n:
            raise CacheError(f"{self.path}: {len(got)} of {n} bytes at {offset} (truncated while in use?)")
        return got

    def _pwrite(self, data: bytes, offset: int) -> None:
        os.pwrite(self.fd, data, offset)

    # ---- entries ----

    def entry(self, index: int) -> tuple:
        """(state, length, first block, last use), a private copy."""
        if not 0 <= index < self.h.n_samples:
            raise IndexError(f"sample {index} of a cache of {self.h.n_samples}")
        state, _, length, first, last = _ENTRY.unpack_from(self.mm, self.h.geometry["entries_offset"] + 32 * index)
        return state, length, first, last

    def read(self, index: int):
        """The entry's bytes (private), None, or _CORRUPT; the caller counts
        the hits and sets their last uses (touch(), once a batch). Everything is
        read with pread, not from the mapping (see _pread). After the
        blocks are copied the file is checked for holes (a peer that
        truncates and re-extends it leaves them; check_size found none
        when the lock was taken) and the entry and its chain's owner and
        next words are read again: a change is _CORRUPT (a miss), not a
        sample with zeroed blocks (review 33, W1). A run of consecutive
        blocks is copied with one call (inserts lay chains out so)."""
        if not 0 <= index < self.h.n_samples:
            raise IndexError(f"sample {index} of a cache of {self.h.n_samples}")
        chain = self._checked_chain(index)
        if chain is None or chain is _CORRUPT:
            return chain
        length, runs = chain
        arena, b_bytes = self.h.geometry["arena_offset"], self.h.block_bytes
        data = np.empty(length, dtype=np.uint8)
        view, at = memoryview(data), 0
        step = max(1, COPY_MAX // b_bytes)  # blocks a call: one read(2) returns at most 2 GiB - 4 KiB
        for run_first, count in runs:
            for first in range(run_first, run_first + count, step):
                part = view[at : min(at + min(step, run_first + count - first) * b_bytes, length)]
                got = os.preadv(self.fd, [part], arena + first * b_bytes)
                if got != len(part):
                    raise CacheError(
                        f"{self.path}: {got} of {len(part)} bytes of block {first} (truncated while in use?)"
                    )
                at += len(part)
        if not self._whole() or self._checked_chain(index) != chain:
            return _CORRUPT
        return data

    def _checked_chain(self, index: int):
        """(length, runs) of a full entry whose chain checks (each block
        owned by it, the last one's next END), None, or _CORRUPT; runs are
        (first block, count) of consecutive blocks, in the chain's order."""
        g = self.h.geometry
        state, _, length, first, _ = _ENTRY.unpack(self._pread(_ENTRY.size, g["entries_offset"] + 32 * index))
        if state != FULL:
            return None
        b_bytes, nb = self.h.block_bytes, self.h.n_blocks
        k = -(-length // b_bytes)
        if not 0 < k <= nb:
            return _CORRUPT
        if first + k <= nb and self._is_run(index, first, k):
            return length, ((first, k),)
        runs = []
        b = first
        for _ in range(k):
            if b >= nb or _U32.unpack(self._pread(4, g["owner_offset"] + 4 * b))[0] != index + 1:
                return _CORRUPT
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
            b = _U32.unpack(self._pread(4, g["next_offset"] + 4 * b))[0]
        if b != END:
            return _CORRUPT
        return length, tuple(map(tuple, runs))

    def _is_run(self, index: int, first: int, k: int) -> bool:
        """Whether blocks first .. first + k - 1 are the chain of `index`
        in that order: two reads, for the common layout (see insert)."""
        g = self.h.geometry
        # Compared as bytes: O(k) in C whatever a peer wrote (k is at most
        # the arena's blocks), and cheaper than arrays for the usual few.
        if self._pread(4 * k, g["owner_offset"] + 4 * first) != _U32.pack(index + 1) * k:
            return False
        return self._pread(4 * k, g["next_offset"] + 4 * first) == _run_nexts(first, k)

    def touch(self, indices) -> None:
        """Counts hits on `indices` and sets their last uses, in that order.
        Advisory under the shared lock: a lost update costs LRU order only.
        Read and written with pread/pwrite, as read() (no SIGBUS)."""
        clock_at, hits_at = MUTABLE_OFFSET + 8 * CLOCK, MUTABLE_OFFSET + 8 * HITS
        clock = _U64.unpack(self._pread(8, clock_at))[0]
        entries = self.h.geometry["entries_offset"]
        for index in indices:
            clock += 1
            self._pwrite(_U64.pack(clock), entries + 32 * index + 24)
        self._pwrite(_U64.pack(clock), clock_at)
        self._pwrite(_U64.pack(_U64.unpack(self._pread(8, hits_at))[0] + len(indices)), hits_at)

    def count_miss(self, more: int = 1) -> None:
        """Adds to the segment's misses (advisory, any lock: pread/pwrite,
        as touch() counts hits)."""
        at = MUTABLE_OFFSET + 8 * MISSES
        self._pwrite(_U64.pack(_U64.unpack(self._pread(8, at))[0] + more), at)

    def free_count(self) -> int:
        n = int(self.mut[FREE_COUNT])
        if n > self.h.n_blocks:
            self.rebuild()
            n = int(self.mut[FREE_COUNT])
        return n

    def cached(self, sample: int | None = None, rng=None, repair: bool = True):
        """(indices, blocks each, last use each) of the FULL entries, from
        the members list (no scan of the entry table); at most `sample` of
        them, drawn at random, when there are more. A members list that is
        wrong is rebuilt (the exclusive lock held); with repair=False
        (the shared lock held) the entries that are not FULL are left out
        instead."""
        raw = self._rows
        if not repair:
            count = min(int(self.mut[MEMBERS]), self.h.n_blocks)
            if sample is not None and count > sample:
                idx = np.sort(self.members[rng.integers(0, count, sample)].astype(np.int64))  # a private copy
                idx = idx[np.concatenate(([True], idx[1:] != idx[:-1]))]  # drawn twice: once
            else:
                idx = self.members[:count].astype(np.int64)  # a private copy
            if idx.max(initial=0) >= self.h.n_samples:
                idx = idx[idx < self.h.n_samples]
            rows = raw[idx]  # a private copy
            full = rows[:, 0] & np.uint64(0xFFFFFFFF) == FULL
            if not full.all():
                idx, rows = idx[full], rows[full]
        for attempt in (0, 1) if repair else ():
            count = int(self.mut[MEMBERS])
            live = min(count, self.h.n_blocks)
            if sample is not None and live > sample:
                idx = np.sort(self.members[rng.integers(0, live, sample)].astype(np.int64))  # a private copy
                idx = idx[np.concatenate(([True], idx[1:] != idx[:-1]))]  # drawn twice: once
            else:
                idx = self.members[:live].astype(np.int64)  # a private copy
            ok = count <= self.h.n_blocks and bool(np.all(idx < self.h.n_samples))
            if ok:
                rows = raw[idx]  # a private copy
                ok = bool(np.all(rows[:, 0] & np.uint64(0xFFFFFFFF) == FULL))
            if ok or attempt:
                break
            self.rebuild()
        if repair and not ok:
            raise CacheError(f"{self.path}: the members list is still wrong after a rebuild")
        blocks = (rows[:, 1] + (self.h.block_bytes - 1)) // self.h.block_bytes
        blocks = np.minimum(blocks, self.h.n_blocks).astype(np.int64)  # a bad length counts as the arena
        return idx, blocks, rows[:, 3].astype(np.float64)

    def evict(self, victims) -> None:
        self.mut[DIRTY] = 1
        for v in victims:
            v = int(v)
            self.state[v] = EMPTY
            self._leave(v)
            mine = self._chain(v)
            self.owner[mine] = 0
            n = int(self.mut[FREE_COUNT])
            self.free[n : n + len(mine)] = np.sort(mine)[::-1]  # pops lowest first: a run again
            self.mut[FREE_COUNT] = n + len(mine)
            self.mut[EVICTIONS] += 1
        self._done()

    def _leave(self, index: int) -> None:
        """Takes `index` out of the members list: the last member moves into
        its place (a wrong place marks the segment for a rebuild)."""
        k, count = int(self.member[index]), int(self.mut[MEMBERS])
        if not (k < count <= self.h.n_blocks and int(self.members[k]) == index):
            self.suspect = True
            return
        last = int(self.members[count - 1])
        self.members[k] = last
        if last < self.h.n_samples:
            self.member[last] = k
        self.mut[MEMBERS] = count - 1

    def _chain(self, index: int) -> np.ndarray:
        """The blocks of an entry, walked and checked (a bad chain: rebuild)."""
        _, length, first, _ = self.entry(index)
        k = -(-length // self.h.block_bytes)
        out, b = [], first
        for _ in range(min(k, self.h.n_blocks)):
            if b >= self.h.n_blocks or int(self.owner[b]) != index + 1:
                break
            out.append(b)
            b = int(self.next[b])
        if len(out) != k or b != END:
            self.suspect = True  # the rebuild at the end of this change frees whatever it owned
        return np.asarray(out, dtype=np.int64)

    def insert(self, index: int, data, need: int) -> None:
        """Stores `data` (a uint8 array, or an Encoded written out here)."""
        if int(self.mut[MEMBERS]) >= self.h.n_blocks:  # every member holds a block: a count this high is wrong
            self.rebuild()
        self.mut[DIRTY] = 1
        n = int(self.mut[FREE_COUNT])
        # Popped, the top of the stack first: with the stack's order (block 0
        # on top at creation and after a rebuild, a freed chain pushed to pop
        # lowest block first) samples of one size get runs of consecutive
        # blocks, which read() copies with one call each.
        blocks = self.free[n - need : n][::-1].astype(np.int64)
        if blocks.max() >= self.h.n_blocks or np.any(self.owner[blocks] != 0) or len(set(blocks.tolist())) != need:
            self.rebuild()  # the free stack was wrong: rebuilt, then taken again
            self.mut[DIRTY] = 1
            n = int(self.mut[FREE_COUNT])
            blocks = self.free[n - need : n][::-1].astype(np.int64)
        self.mut[FREE_COUNT] = n - need
        self._write(blocks, data)
        self.next[blocks[:-1]] = blocks[1:]
        self.next[blocks[-1]] = END
        self.owner[blocks] = index + 1
        off = self.h.geometry["entries_offset"] + 32 * index
        clock = int(self.mut[CLOCK]) + 1
        self.mut[CLOCK] = clock
        struct.pack_into("<QQQ", self.mm, off + 8, len(data), int(blocks[0]), clock)
        count = int(self.mut[MEMBERS])  # checked below n_blocks before the blocks were taken
        self.members[count] = index
        self.member[index] = count
        self.mut[MEMBERS] = count + 1
        self.state[index] = FULL  # last: the entry is whole
        self.mut[INSERTS] += 1
        self.mut[DIRTY] = 0

    def _write(self, blocks: np.ndarray, data) -> None:
        """data into the arena's `blocks`: straight into a run of
        consecutive blocks (the usual layout), through a copy otherwise."""
        length, bb, need = len(data), self.h.block_bytes, len(blocks)
        first = int(blocks[0])
        if need == 1 or bool(np.all(np.diff(blocks) == 1)):
            dest = self.arena[first : first + need].reshape(-1)[:length]
            if isinstance(data, np.ndarray):
                dest[:] = data
            else:
                data.into(dest)
            return
        if not isinstance(data, np.ndarray):
            data = np.frombuffer(data.tobytes(), dtype=np.uint8)
        full = (need - 1) * bb
        self.arena[blocks[:-1]] = data[:full].reshape(need - 1, bb)
        self.arena[blocks[-1], : length - full] = data[full:]

    def _done(self) -> None:
        """The end of a change: rebuilt if it met a damaged chain or list."""
        if self.suspect:
            self.suspect = False
            self.rebuild()
        self.mut[DIRTY] = 0

    def bump(self, which: int, more: int = 1) -> None:
        self.mut[which] += more

    # ---- repair ----

    def repair(self, bad) -> None:
        """Under the exclusive lock: rebuild if a change was cut short
        (dirty) and drop the entries this process found corrupt."""
        self.check_size()
        if bad:
            for i in bad:
                self.state[i] = EMPTY
            self.mut[CORRUPT] += len(bad)
            self.mut[DIRTY] = 1
        if int(self.mut[DIRTY]):
            self.rebuild()

    def rebuild(self) -> None:
        """The index made consistent again from the entries and owners:
        blocks of entries not FULL are freed, entries whose blocks do not
        number ceil(length / block size) dropped, the free stack remade."""
        n, nb, bb = self.h.n_samples, self.h.n_blocks, self.h.block_bytes
        raw = np.ndarray((n, 4), np.uint64, self.mm, self.h.geometry["entries_offset"])
        state = self.state.copy()
        owner = self.owner.astype(np.int64)
        lengths = raw[:, 1].copy()
        owner[(owner < 1) | (owner > n)] = 0
        owner[(owner > 0) & (state[np.maximum(owner - 1, 0)] != FULL)] = 0
        counts = np.bincount(owner[owner > 0] - 1, minlength=n)
        need = (np.minimum(lengths, np.uint64(nb * bb)).astype(np.int64) + bb - 1) // bb
        full = state == FULL
        bad = full & ((lengths == 0) | (lengths > nb * bb) | (counts != need))
        state[bad] = EMPTY
        owner[(owner > 0) & bad[np.maximum(owner - 1, 0)]] = 0
        self.state[:] = state
        self.owner[:] = owner.astype(np.uint32)
        free = np.flatnonzero(owner == 0)[::-1].astype(np.uint32)  # the lowest block on top
        self.free[: len(free)] = free
        self.mut[FREE_COUNT] = len(free)
        members = np.flatnonzero(state == FULL)
        self.members[: len(members)] = members.astype(np.uint32)
        self.member[members] = np.arange(len(members), dtype=np.uint32)
        self.mut[MEMBERS] = len(members)
        self.mut[REBUILDS] += 1
        self.mut[DIRTY] = 0

    # ---- consumers ----

    def _consumer_offset(self, slot: int) -> int:
        return self.h.geometry["consumers_offset"] + CONSUMER_BYTES * slot

    def register(self, blob: bytes) -> int | None:
        me, start = os.getpid(), _start_time(os.getpid())
        for slot in range(CONSUMER_SLOTS):
            pid, _, started, *_ = _CONSUMER.unpack_from(self.mm, self._consumer_offset(slot))
            if pid == 0 or _start_time(pid) != started:
                off = self._consumer_offset(slot)
                struct.pack_into("<I", self.mm, off, 0)
                self.mm[off + _CONSUMER.size : off + _CONSUMER.size + PARAMS_MAX] = blob.ljust(PARAMS_MAX, b"\0")
                _CONSUMER.pack_into(self.mm, off, me, len(blob), start or 0, 0, 0, time.time_ns())
                self.mut[TABLE_CHANGES] += 1
                return slot
        return None

    def unregister(self, slot: int) -> None:
        """Frees consumer entry `slot` if this process holds it."""
        off = self._consumer_offset(slot)
        if _CONSUMER.unpack_from(self.mm, off)[0] == os.getpid():
            struct.pack_into("<I", self.mm, off, 0)
            self.mut[TABLE_CHANGES] += 1

    def table_changes(self) -> int:
        """The consumer table's change count (any lock or none: pread)."""
        return self.mutable_words()[TABLE_CHANGES]

    def mutable_words(self) -> tuple:
        """The header's mutable words (DIRTY .. TABLE_CHANGES), read with
        one pread (any lock or none: advisory without the lock)."""
        return _MUTABLE.unpack(self._pread(_MUTABLE.size, MUTABLE_OFFSET))

    def set_position(self, slot: int, epoch: int, index: int) -> None:
        """Consumer `slot` is at sample `index` of epoch `epoch` (unlocked,
        advisory: a batch's first lookup and each insert): pwrite, not the
        mapping (see _pread)."""
        self._pwrite(struct.pack("<QQQ", epoch, index, time.time_ns()), self._consumer_offset(slot) + 16)

    def consumers(self, alive=None) -> list:
        """(slot, params blob, epoch, index) of the live consumers, checked;
        alive(pid, start time) says whether a process lives (default: a
        read of /proc/<pid>/stat)."""
        if alive is None:
            alive = _alive
        out = []
        for slot in np.flatnonzero(self._pids).tolist():  # one look at every slot's pid: the used slots
            off = self._consumer_offset(slot)
            pid, length, started, epoch, position, _ = _CONSUMER.unpack_from(self.mm, off)
            if pid == 0 or length > PARAMS_MAX or epoch >= 1 << 32 or position >= self.h.n_samples:
                continue
            if not alive(pid, started):
                continue
            blob = bytes(self.mm[off + _CONSUMER.size : off + _CONSUMER.size + length])
            out.append((slot, blob, epoch, position))
        return out

    def totals(self) -> dict:
        names = ("dirty", "free_blocks", "clock", "hits", "misses", "inserts", "evictions", "bypasses", "corrupt",
                 "rebuilds", "cached", "table_changes")  # fmt: skip
        words = self.mutable_words()  # unlocked: no mapping
        return dict(zip(names, words), blocks=self.h.n_blocks, block_bytes=self.h.block_bytes)


class _Locked:
    """The store lock held, shared or exclusive, with the file's size checked."""

    def __init__(self, seg: _Segment, exclusive: bool):
        self.seg, self.kind = seg, fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK

    def __enter__(self):
        _lock(self.seg.fd, self.kind, STORE_BYTE, wait=True)
        try:
            self.seg.check_size()
        except BaseException:
            _lock(self.seg.fd, fcntl.F_UNLCK, STORE_BYTE, wait=True)
            raise
        return self.seg

    def __exit__(self, *exc):
        _lock(self.seg.fd, fcntl.F_UNLCK, STORE_BYTE, wait=True)


def _check(fd: int, path: str, key: bytes, n_samples: int) -> Header:
    """The header of an opened segment, checked against the file and the key."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CacheError("not a regular file")
    if st.st_uid != os.geteuid():
        raise CacheError(f"owned by uid {st.st_uid}, not this process's {os.geteuid()}")
    if st.st_mode & 0o022:
        raise CacheError(f"mode {stat.S_IMODE(st.st_mode):o} lets others write it")
    h = Header(os.pread(fd, HEADER_BYTES, 0))
    if h.key != key:
        raise CacheError(f"key {h.key.hex()}, not {key.hex()}")
    if h.n_samples != n_samples:
        raise CacheError(f"{h.n_samples} samples, the pipeline has {n_samples}")
    if st.st_size != h.file_bytes:
        raise CacheError(f"{st.st_size} bytes, its header says {h.file_bytes} (truncated?)")
    # The creator allocates every byte (posix_fallocate): a sparse file, or
    # one larger than its file system, would SIGBUS at the first write to
    # a hole the file system cannot fill (review 31, F4).
    if st.st_blocks * 512 < h.file_bytes:
        raise CacheError(f"{st.st_blocks * 512} of its {h.file_bytes} bytes allocated (a sparse file)")
    fs = os.fstatvfs(fd)
    if h.file_bytes > fs.f_blocks * fs.f_frsize:
        raise CacheError(f"{h.file_bytes} bytes, larger than its file system ({fs.f_blocks * fs.f_frsize})")
    return h


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _remove_if_unused(fd: int, path: str) -> bool:
    """Unlinks `path` if it is still this file and nobody holds its users
    lock; True if it did."""
    if not _lock(fd, fcntl.F_WRLCK, USERS_BYTE, wait=False):
        return False
    try:
        if _same_file(fd, path):
            os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except PermissionError as e:
        raise NotOurs(f"{path}: {e.strerror}: not ours to remove, left alone") from None
    finally:
        _lock(fd, fcntl.F_UNLCK, USERS_BYTE, wait=True)


def _unnamed(directory: str) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise CacheError(f"cannot create an unnamed file in {directory}: {e}") from None


def _link(fd: int, path: str) -> None:
    """Gives the unnamed file `fd` its name (FileExistsError if taken):
    linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N. os.link with default
    arguments calls link(), which would link the /proc symlink itself."""
    procfd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=procfd, follow_symlinks=True)
    finally:
        os.close(procfd)


def _allocate(fd: int, size: int, directory: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise CacheError(f"cannot allocate {size} bytes in {directory}: {e.strerror}: lower cache_bytes") from None
        raise


def _initialise(fd: int, header: bytes, n_blocks: int, size: int) -> None:
    import mmap

    mm = mmap.mmap(fd, size)
    try:
        mm[: len(header)] = header
        h = Header(header)
        free = np.ndarray(n_blocks, np.uint32, mm, h.geometry["free_offset"])
        free[:] = np.arange(n_blocks - 1, -1, -1, dtype=np.uint32)  # block 0 on top
        del free
        mut = np.ndarray(N_MUTABLE, np.uint64, mm, MUTABLE_OFFSET)
        mut[FREE_COUNT] = n_blocks
        del mut
    finally:
        mm.close()


def remove(key: bytes, directory: str = "/dev/shm") -> bool:
    """Removes the segment of `key` if nobody uses it; True if it did."""
    for path in candidate_paths(key, directory):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # none, or not ours: the next name
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                return _remove_if_unused(fd, path)
        finally:
            os.close(fd)
    return False
