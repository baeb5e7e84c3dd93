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
VERSION = 2  # 2: a consumer entry holds the sample index it is at, not its position
PAGE = 4096
HEADER_BYTES = PAGE
END = 0xFFFFFFFF  # the last block of a chain
EMPTY, FULL = 0, 1
CONSUMER_SLOTS = 64
CONSUMER_BYTES = 256
PARAMS_MAX = 216
MIN_BLOCK, MAX_BLOCK = 4096, 1 << 20

# Header: fixed at creation (offset 0) ...
_FIXED = struct.Struct("<8sII16sQQQIIQQQQQQQQQII")
# ... and the mutable words (u64 each) from offset 192.
MUTABLE_OFFSET = 192
(DIRTY, FREE_COUNT, CLOCK, HITS, MISSES, INSERTS, EVICTIONS, BYPASSES, CORRUPT, REBUILDS, MEMBERS) = range(11)
N_MUTABLE = 11
_ENTRY = struct.Struct("<IIQQQ")  # state, member (place in the members list), length, first block, last use
_CONSUMER = struct.Struct("<IIQQQQ")  # pid, params length, start time, epoch, index (the sample it is at), updated_ns

_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86-64 and aarch64
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


def default_budget(directory: str = "/dev/shm") -> int:
    """A quarter of MemAvailable, at most half of the directory's free space."""
    avail = _mem_available()
    free = _free_bytes(directory)
    return int(min(avail // 4 if avail else free // 2, free // 2))


def auto_budget(n_samples: int, sample_bytes: int, block_bytes: int, directory: str = "/dev/shm") -> int:
    """default_budget(), but no more than the whole dataset needs if its
    samples are about the size of the first one (with a quarter more room):
    the file is allocated in full when created, so a small dataset must
    not take a quarter of the memory."""
    blocks = -(-sample_bytes // block_bytes)
    need = geometry(n_samples, block_bytes, -(-5 * n_samples * blocks // 4))["file_bytes"]
    return min(default_budget(directory), need)


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


class _Segment:
    """The mapped file, its checked header, and the operations on it. The
    caller holds the store lock (locked()) around every operation."""

    def __init__(self, fd: int, header: Header, path: str):
        import mmap

        self.fd, self.h, self.path = fd, header, path
        self.suspect = False  # a change met damage: rebuild at its end
        g = header.geometry
        self.mm = mmap.mmap(fd, g["file_bytes"])
        nb = header.n_blocks
        self.mut = np.ndarray(N_MUTABLE, np.uint64, self.mm, MUTABLE_OFFSET)
        words = np.ndarray(header.n_samples, np.dtype((np.uint32, (8,))), self.mm, g["entries_offset"])
        self.state, self.member = words[:, 0], words[:, 1]
        self.next = np.ndarray(nb, np.uint32, self.mm, g["next_offset"])
        self.owner = np.ndarray(nb, np.uint32, self.mm, g["owner_offset"])
        self.free = np.ndarray(nb, np.uint32, self.mm, g["free_offset"])
        self.members = np.ndarray(nb, np.uint32, self.mm, g["members_offset"])  # the FULL entries, unordered
        self.arena = np.ndarray((nb, header.block_bytes), np.uint8, self.mm, g["arena_offset"])
        _lock(fd, fcntl.F_RDLCK, USERS_BYTE, wait=True)

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
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CacheError(f"cannot open the cache segment {path}: {e}") from None
        try:
            return cls(fd, _check(fd, path, key, n_samples), path)
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
        for view in ("mut", "state", "member", "next", "owner", "free", "members", "arena"):
            setattr(self, view, None)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with it
        os.close(self.fd)

    # ---- locking ----

    def locked(self, exclusive: bool):
        return _Locked(self, exclusive)

    def check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.h.geometry["file_bytes"]:
            raise CacheError(f"{self.path} is {size} bytes now, not {self.h.geometry['file_bytes']} (truncated?)")

    # ---- entries ----

    def entry(self, index: int) -> tuple:
        """(state, length, first block, last use), a private copy."""
        if not 0 <= index < self.h.n_samples:
            raise IndexError(f"sample {index} of a cache of {self.h.n_samples}")
        state, _, length, first, last = _ENTRY.unpack_from(self.mm, self.h.geometry["entries_offset"] + 32 * index)
        return state, length, first, last

    def read(self, index: int):
        """The entry's bytes (private), None, or _CORRUPT."""
        state, length, first, _ = self.entry(index)
        if state != FULL:
            return None
        b_bytes, nb = self.h.block_bytes, self.h.n_blocks
        k = -(-length // b_bytes)
        if not 0 < k <= nb:
            return _CORRUPT
        blocks = np.empty(k, dtype=np.int64)
        b = first
        for j in range(k):
            if b >= nb or int(self.owner[b]) != index + 1:
                return _CORRUPT
            blocks[j] = b
            b = int(self.next[b])
        if b != END:
            return _CORRUPT
        data = self.arena[blocks].reshape(-1)[:length]  # a copy: fancy indexing
        self._touch(index)
        return data

    def _touch(self, index: int) -> None:
        # Advisory under the shared lock: a lost update costs LRU order only.
        clock = int(self.mut[CLOCK]) + 1
        self.mut[CLOCK] = clock
        struct.pack_into("<Q", self.mm, self.h.geometry["entries_offset"] + 32 * index + 24, clock)
        self.mut[HITS] += 1

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
        raw = np.ndarray((self.h.n_samples, 4), np.uint64, self.mm, self.h.geometry["entries_offset"])
        if not repair:
            count = min(int(self.mut[MEMBERS]), self.h.n_blocks)
            if sample is not None and count > sample:
                idx = np.sort(self.members[rng.integers(0, count, sample)].astype(np.int64))  # a private copy
                idx = idx[np.concatenate(([True], idx[1:] != idx[:-1]))]  # drawn twice: once
            else:
                idx = self.members[:count].astype(np.int64)  # a private copy
            idx = idx[idx < self.h.n_samples]
            rows = raw[idx]  # a private copy
            full = rows[:, 0] & np.uint64(0xFFFFFFFF) == FULL
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
            self.free[n : n + len(mine)] = mine
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

    def insert(self, index: int, data: np.ndarray, need: int) -> None:
        if int(self.mut[MEMBERS]) >= self.h.n_blocks:  # every member holds a block: a count this high is wrong
            self.rebuild()
        self.mut[DIRTY] = 1
        n = int(self.mut[FREE_COUNT])
        blocks = self.free[n - need : n].astype(np.int64)
        if blocks.max() >= self.h.n_blocks or np.any(self.owner[blocks] != 0) or len(set(blocks.tolist())) != need:
            self.rebuild()  # the free stack was wrong: rebuilt, then taken again
            self.mut[DIRTY] = 1
            n = int(self.mut[FREE_COUNT])
            blocks = self.free[n - need : n].astype(np.int64)
        self.mut[FREE_COUNT] = n - need
        bb = self.h.block_bytes
        full = (need - 1) * bb
        if need > 1:
            self.arena[blocks[:-1]] = data[:full].reshape(need - 1, bb)
        self.arena[blocks[-1], : len(data) - full] = data[full:]
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

    def _done(self) -> None:
        """The end of a change: rebuilt if it met a damaged chain or list."""
        if self.suspect:
            self.suspect = False
            self.rebuild()
        self.mut[DIRTY] = 0

    def bump(self, which: int) -> None:
        self.mut[which] += 1

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
        free = np.flatnonzero(owner == 0).astype(np.uint32)
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
                return slot
        return None

    def unregister(self, slot: int) -> None:
        """Frees consumer entry `slot` if this process holds it."""
        off = self._consumer_offset(slot)
        if _CONSUMER.unpack_from(self.mm, off)[0] == os.getpid():
            struct.pack_into("<I", self.mm, off, 0)

    def set_position(self, slot: int, epoch: int, index: int) -> None:
        """Consumer `slot` is at sample `index` of epoch `epoch` (unlocked, advisory)."""
        off = self._consumer_offset(slot)
        struct.pack_into("<QQQ", self.mm, off + 16, epoch, index, time.time_ns())

    def consumers(self, alive=None) -> list:
        """(slot, params blob, epoch, index) of the live consumers, checked;
        alive(pid, start time) says whether a process lives (default: a
        read of /proc/<pid>/stat)."""
        if alive is None:
            alive = _alive
        out = []
        for slot in range(CONSUMER_SLOTS):
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
                 "rebuilds", "cached")  # fmt: skip
        return dict(zip(names, (int(v) for v in self.mut)), blocks=self.h.n_blocks, block_bytes=self.h.block_bytes)


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
    path = segment_path(key, directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return _remove_if_unused(fd, path)
    finally:
        os.close(fd)
