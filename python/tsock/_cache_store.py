"""The decoded-sample cache as one process uses it (docs/CACHE.md):
CacheStore opens (or creates) the segment of a cache key, looks samples up
and inserts them, choosing victims by its policy; the segment itself is
`_cache_segment.py`.

Every process opens the file itself: a forked child opens it again (the
locks are open-file-description locks, which a descriptor inherited across
fork would share with its parent), and registers its own consumer entry.
"""

from __future__ import annotations

import json
import os
import threading
import weakref

import numpy as np

from ._cache_policy import KnownFuture, choose_victims
from ._cache_segment import (
    _CORRUPT,
    BYPASSES,
    FULL,
    PARAMS_MAX,
    _Segment,
    auto_budget,
    block_size_for,
    segment_path,
)
from .errors import CacheError

POLICIES = ("belady", "lru", "fill-once")
RANKED = 4096  # cached samples ranked per eviction, at most


class CacheStore:
    """One process's handle on the segment of a cache key.

    get(index) -> the sample's bytes (a private numpy uint8 array) or None;
    put(index, data) inserts, evicting by the policy. The segment is
    created at the first put that finds none (its block size from that
    sample), within `budget` bytes (default: default_budget()).
    """

    def __init__(self, key: bytes, n_samples: int, *, budget: int | None = None, policy: str = "belady",
                 directory: str = "/dev/shm"):  # fmt: skip
        if len(key) != 16:
            raise ValueError("a cache key is 16 bytes")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.key, self.n_samples, self.budget, self.policy = key, n_samples, budget, policy
        self.directory = directory
        self.path = segment_path(key, directory)
        self.counts = dict.fromkeys(("hits", "misses", "inserts", "evictions", "bypasses", "corrupt", "refused"), 0)
        self._thread_lock = threading.RLock()
        self._future = KnownFuture(n_samples)
        self._future_ids: dict = {}
        self._bad: set = set()  # indices whose entry failed a check: dropped at the next change
        self._rng = np.random.default_rng()  # which cached samples are ranked, beyond RANKED: no effect on batches
        self._seg = None
        self._pid = None
        self._slots: list = []  # consumer entries this process registered
        _STORES.add(self)

    # ---- pickling (spawned workers), fork ----

    def __getstate__(self):
        state = {k: self.__dict__[k] for k in ("key", "n_samples", "budget", "policy", "directory", "path")}
        return state

    def __setstate__(self, state):
        self.__init__(state["key"], state["n_samples"], budget=state["budget"], policy=state["policy"],
                      directory=state["directory"])  # fmt: skip

    def _segment(self, create_for: int | None = None):
        """The open segment (opened again in a forked child), None if there
        is none yet and create_for (a sample's size) is None."""
        if self._pid != os.getpid():
            # The parent's descriptor shares the parent's locks; its consumer
            # entries are the parent's.
            self._seg, self._pid, self._slots = None, os.getpid(), []
        if self._seg is None:
            self._seg, self.path = _Segment.locate(self.key, self.directory, self.n_samples)
            if self._seg is None and create_for is not None:
                block = block_size_for(create_for)
                budget = self.budget
                if budget is None:
                    budget = auto_budget(self.n_samples, create_for, block, self.directory)
                self._seg = _Segment.create(self.path, self.key, self.n_samples, block, budget)
        return self._seg

    @property
    def opened(self) -> bool:
        """Whether this process has the segment open."""
        return self._seg is not None and self._pid == os.getpid()

    # ---- lookups and inserts ----

    def get(self, index: int):
        """The bytes cached for `index` (private), or None."""
        with self._thread_lock:
            seg = self._segment()
            if seg is None:
                self.counts["misses"] += 1
                return None
            with seg.locked(exclusive=False):
                got = seg.read(index)
            if got is _CORRUPT:
                self._bad.add(index)
                self.counts["corrupt"] += 1
                got = None
            self.counts["hits" if got is not None else "misses"] += 1
            return got

    def forget(self, index: int) -> None:
        """The bytes get() returned for `index` were bad: counted as a miss,
        and the entry is dropped at the next change."""
        self._bad.add(index)
        self.counts["hits"] -= 1
        self.counts["misses"] += 1
        self.counts["corrupt"] += 1

    def put(self, index: int, data) -> bool:
        """Caches `data` (bytes-like) for `index`; False if the policy
        declined it, it does not fit, or it was cached already."""
        data = np.frombuffer(data, dtype=np.uint8)
        with self._thread_lock:
            seg = self._segment(create_for=len(data))
            with seg.locked(exclusive=True):
                seg.repair(self._bad)
                self._bad.clear()
                return self._insert(seg, index, data)

    def _insert(self, seg, index: int, data) -> bool:
        if seg.entry(index)[0] == FULL:
            return False
        need = -(-len(data) // seg.h.block_bytes)
        if need > seg.h.n_blocks or not len(data):
            self.counts["refused"] += 1
            return False
        free = seg.free_count()
        if free < need:
            victims = self._victims(seg, index, need, free)
            if victims is None:
                self.counts["bypasses"] += 1
                seg.bump(BYPASSES)
                return False
            seg.evict(victims)
            self.counts["evictions"] += len(victims)
            if seg.free_count() < need:  # a victim's chain was damaged: its blocks come back at the rebuild
                self.counts["refused"] += 1
                return False
        seg.insert(index, data, need)
        self.counts["inserts"] += 1
        return True

    def _victims(self, seg, index: int, need: int, free: int):
        if self.policy == "fill-once":
            return None
        # Ranking every cached sample costs O(cached) per eviction: beyond
        # RANKED, a random sample of them (the victim is then among the
        # farthest 1/RANKED of the cache, on average).
        cached, blocks, last = seg.cached(RANKED, self._rng)
        if self.policy == "lru":
            order = np.argsort(last, kind="stable")
            room = free + np.cumsum(blocks[order])
            m = int(np.searchsorted(room, need)) + 1
            return cached[order[:m]] if m <= len(order) else None
        self._refresh_future(seg)
        return choose_victims(self._future, cached, blocks, last, index, need, free)

    # ---- consumers: the known future ----

    def register(self, params: dict) -> int | None:
        """Adds this process's order to the consumer table (params: the
        Pipeline's order parameters, see _sampler.sample_sequence); the
        slot, or None if the table is full, the JSON too long, or there is
        no segment yet (the first insert makes it: its block size comes
        from that sample)."""
        blob = json.dumps(params, sort_keys=True, separators=(",", ":")).encode()
        if len(blob) > PARAMS_MAX:
            return None
        with self._thread_lock:
            seg = self._segment()
            if seg is None:
                return None
            with seg.locked(exclusive=True):
                slot = seg.register(blob)
            if slot is not None:
                self._slots.append(slot)
            return slot

    def set_position(self, slot: int, epoch: int, position: int) -> None:
        """Advisory: consumer `slot` is at `position` of epoch `epoch`."""
        seg = self._seg
        if seg is not None and self._pid == os.getpid():
            seg.set_position(slot, epoch, position)

    def _refresh_future(self, seg) -> None:
        from ._sampler import sample_sequence

        live = {}
        for slot, blob, epoch, position in seg.consumers():
            ident = (slot, blob)
            live[ident] = (epoch, position)
            if ident not in self._future_ids:
                params = _params(blob, self.n_samples)
                if params is None:
                    continue
                self._future.set_consumer(ident, lambda e, p=params: sample_sequence(p, e), order=blob)
                self._future_ids[ident] = True
        for ident in list(self._future_ids):
            if ident not in live:
                self._future.remove_consumer(ident)
                del self._future_ids[ident]
        for ident, (epoch, position) in live.items():
            if ident in self._future_ids:
                self._future.set_position(ident, epoch, position)

    # ---- housekeeping ----

    def stats(self, open_segment: bool = False) -> dict:
        """This process's counts, and under "segment" the segment's advisory
        totals when it is open (or opened here, with open_segment)."""
        out = dict(self.counts)
        with self._thread_lock:
            seg = self._segment() if open_segment else (self._seg if self.opened else None)
            if seg is not None:
                out["segment"] = seg.totals()
        return out

    def close(self) -> None:
        """Lets go of the segment (it stays for the next user), and of this
        process's consumer entries."""
        with self._thread_lock:
            if self.opened:
                try:
                    with self._seg.locked(exclusive=True):
                        for slot in self._slots:
                            self._seg.unregister(slot)
                except CacheError:
                    pass  # a truncated segment: nothing to give back in it
                self._seg.close()
            self._seg, self._slots = None, []


_STORES: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child, every store gets a fresh thread lock (another
    thread of the parent may have held the old one at the fork: the child
    would wait on it forever) and lets go of the parent's segment: its
    descriptor and mapping are closed (the parent's locks stay, held by
    the parent's descriptor of the same open file description), and the
    child opens the file again on first use."""
    for store in list(_STORES):
        store._thread_lock = threading.RLock()
        seg = store._seg
        store._seg, store._pid, store._slots = None, os.getpid(), []
        if seg is not None:
            seg.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _params(blob: bytes, n: int):
    """A consumer's order parameters, checked, or None."""
    try:
        p = json.loads(blob)
    except ValueError:
        return None
    ints = ("n", "seed", "batch_size", "world_size")
    if not isinstance(p, dict) or any(type(p.get(k)) is not int or p[k] < 0 for k in ints):
        return None
    if p["n"] != n or p["batch_size"] < 1 or p["world_size"] > 65535 or p["seed"] >= 1 << 63:
        return None
    if any(type(p.get(k)) is not bool for k in ("shuffle", "drop_last", "sampler_drop_last")):
        return None
    ranks = p.get("ranks")
    if not isinstance(ranks, list) or not ranks or any(type(r) is not int for r in ranks):
        return None
    if any(not 0 <= r < max(p["world_size"], 1) for r in ranks):
        return None
    return p
