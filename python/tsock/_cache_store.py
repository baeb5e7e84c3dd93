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
import sys
import threading
import time
import weakref

import numpy as np

from ._cache_codec import Encoded
from ._cache_orders import ORDERS
from ._cache_policy import _farthest, distance, distances
from ._cache_segment import (
    _CORRUPT,
    BYPASSES,
    CONSUMER_SLOTS,
    FREE_COUNT,
    FULL,
    MEMBERS,
    PARAMS_MAX,
    TABLE_CHANGES,
    _alive,
    _Segment,
    auto_budget,
    block_size_for,
    segment_path,
)
from .errors import CacheError

POLICIES = ("belady", "lru", "fill-once")
RANKED = 4096  # cached samples ranked per eviction, at most
# Belady ranks RANKED samples of the cache once per REFRESH misses and keeps
# its POOL farthest; the misses between rank those again with FRESH newly
# drawn ones (a cache of at most POOL_ALL samples is ranked whole each time).
POOL, FRESH, REFRESH, POOL_ALL = 64, 64, 32, 256
SPARE = 16  # candidates ranked beyond those that make room: others may evict some before the lock is taken
PREFETCH_AT = 0.9  # a consumer this far into its epoch: the epoch after the next is computed in the background
# After a miss bypassed because the full cache keeps what it holds (Belady's
# _KEEP_ALL), the next KEEP_ALL_RUN misses of samples of the same size bypass
# without looking at the segment (no ranking, no lock): see put().
KEEP_ALL_RUN = 64
ALIVE_FOR = 1.0  # seconds a consumer process seen alive is taken to be (no /proc read per consumer per miss)
_REPLAN = object()
# Belady's plan when no eviction can gain a hit (_nothing_to_gain): no
# candidates, so the insert bypasses unless room was made meanwhile.
_KEEP_ALL = (np.empty(0, np.int64), np.empty(0), 0.0, False)
for _array in _KEEP_ALL[:2]:
    _array.flags.writeable = False


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
        # fills: inserts into free space (none evicted), a cache still filling
        self.counts = dict.fromkeys(
            ("hits", "misses", "inserts", "fills", "evictions", "bypasses", "corrupt", "refused"), 0
        )
        self._thread_lock = threading.RLock()
        self._params_of: dict = {}  # consumer params blob -> checked params (None: refused)
        self._seen_alive: dict = {}  # (pid, start time) -> when /proc last said it lives
        self._bad: set = set()  # indices whose entry failed a check: dropped at the next change
        self._unseen_misses = 0  # misses before this process had the segment: counted in it at the next put
        self._rng = np.random.default_rng()  # which cached samples are ranked, beyond RANKED: no effect on batches
        self._pool = None  # Belady's kept candidates (indices, blocks, last uses), and misses since they were ranked
        self._pool_age = 0
        self._seg = None
        self._pid = None
        self._slots: list = []  # consumer entries this process registered
        self._keeping = (0, 0, 0)  # (misses left, blocks a sample, table seen) the last keep-all bypass covers
        self._table_seen = 0  # the consumer table's change count when _plan last read it
        self._bypassed = 0  # bypasses counted here, not yet in the segment (flush)
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
            # entries, verdicts and unflushed counts are the parent's.
            self._seg, self._pid, self._slots = None, os.getpid(), []
            self._keeping, self._bypassed = (0, 0, 0), 0
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
        return self.get_many((index,))[0]

    def get_many(self, indices) -> list:
        """The bytes cached for each of `indices` (private), or None: one
        look under one shared lock, the hits' last uses and the counts
        written once (what a batch's samples cost one at a time was most
        of a hit's time: docs/CACHE.md, "Costs")."""
        n = len(indices)
        with self._thread_lock:
            seg = self._segment()
            if seg is None:
                # Counted in the segment once this process's insert made
                # or opened it (put).
                self._unseen_misses += n
                self.counts["misses"] += n
                return [None] * n
            out, hits = [], []
            with seg.locked(exclusive=False):
                for index in indices:
                    got = seg.read(index)
                    if got is _CORRUPT:
                        self._bad.add(index)
                        self.counts["corrupt"] += 1
                        got = None
                    elif got is not None:
                        hits.append(index)
                    out.append(got)
                if hits:
                    seg.touch(hits)
                if len(hits) < n:
                    seg.count_miss(n - len(hits))
            self.counts["hits"] += len(hits)
            self.counts["misses"] += n - len(hits)
            return out

    def forget(self, index: int) -> None:
        """The bytes get() returned for `index` were bad: counted as a miss,
        and the entry is dropped at the next change."""
        with self._thread_lock:  # _settle may be iterating _bad in another thread
            self._bad.add(index)
            self.counts["hits"] -= 1
            self.counts["misses"] += 1
            self.counts["corrupt"] += 1

    def put(self, index: int, data) -> bool:
        """Caches `data` (bytes-like, or an Encoded: then copied only if
        kept, straight into its blocks) for `index`; False if the policy
        declined it, it does not fit, or it was cached already.

        Belady ranks the cached samples before it takes the exclusive lock
        (`_plan`, under the shared lock and none): under it, it only checks
        that its candidates are still cached and evicts them."""
        if not isinstance(data, Encoded):
            data = np.frombuffer(data, dtype=np.uint8)
        with self._thread_lock:
            seg = self._segment(create_for=len(data))
            need = -(-len(data) // seg.h.block_bytes)
            left, size, table = self._keeping
            if left and need == size and self._still_keeping(seg, need, table):
                # The last miss found the cache full and keeping what it
                # holds; the segment's words say it still is, and the
                # consumer table is the one it judged: so this miss
                # bypasses too. Counted in the segment at the next flush.
                self._keeping = (left - 1, size, table)
                self._bypassed += 1
                self.counts["bypasses"] += 1
                return False
            plan = None
            for attempt in (0, 1):
                if self.policy == "belady" and 0 < need <= seg.h.n_blocks:
                    plan = self._plan(seg, index, need, again=bool(attempt))
                bypasses = self.counts["bypasses"]
                with seg.locked(exclusive=True):
                    self._settle(seg)
                    got = self._insert(seg, index, data, plan, last_try=bool(attempt))
                if got is not _REPLAN:
                    if plan is _KEEP_ALL and self.counts["bypasses"] > bypasses:
                        self._keeping = (KEEP_ALL_RUN, need, self._table_seen)
                    return got
            raise AssertionError("the second try has a plan")  # pragma: no cover

    @staticmethod
    def _still_keeping(seg, need: int, table: int) -> bool:
        """Whether the keep-all verdict's conditions on the segment hold
        still: the consumer table unchanged, no room for the sample (room
        freed by a rebuild, a dropped bad entry or another policy's
        eviction is filled as before), every cached sample `need` blocks
        (a sample of another size cached by a peer ends it). One pread of
        the mutable words, no lock: a stale read costs a bypass, or a look
        under the lock, never a wrong sample."""
        words = seg.mutable_words()
        free, members = words[FREE_COUNT], words[MEMBERS]
        return words[TABLE_CHANGES] == table and free < need and seg.h.n_blocks - free == members * need

    def _settle(self, seg) -> None:
        """Under the exclusive lock: a change cut short repaired, the
        entries found bad dropped, and the misses and bypasses counted here
        written into the segment."""
        seg.repair(self._bad)
        self._bad.clear()
        if self._unseen_misses:
            seg.count_miss(self._unseen_misses)
            self._unseen_misses = 0
        if self._bypassed:
            seg.bump(BYPASSES, self._bypassed)
            self._bypassed = 0

    def flush(self) -> None:
        """Writes what this process counted but has not written yet (the
        bypasses of put()'s keep-all run, misses before it had the
        segment) and drops the entries it found bad: one exclusive lock,
        and only when there is something to write (a Pipeline calls it
        after each batch, close() does too). A process killed between two
        flushes loses what it counted since the last (advisory counts)."""
        with self._thread_lock:
            if not self.opened or not (self._bypassed or self._bad or self._unseen_misses):
                return
            with self._seg.locked(exclusive=True):
                self._settle(self._seg)

    def _insert(self, seg, index: int, data, plan=None, last_try: bool = True):
        if seg.entry(index)[0] == FULL:
            return False
        need = -(-len(data) // seg.h.block_bytes)
        if need > seg.h.n_blocks or not len(data):
            self.counts["refused"] += 1
            return False
        free = seg.free_count()
        if free >= need:
            self.counts["fills"] += 1
        else:
            if self.policy == "belady" and plan is None and not last_try:
                return _REPLAN  # room was taken since the look before the lock: rank, then come back
            victims = self._victims(seg, index, need, free, plan)
            if victims is _REPLAN:
                if not last_try:
                    return _REPLAN
                victims = None
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

    def _victims(self, seg, index: int, need: int, free: int, plan=None):
        if self.policy == "fill-once":
            return None
        if self.policy == "lru":
            # Ranking every cached sample costs O(cached) per eviction: beyond
            # RANKED, a random sample of them (the victim is then among the
            # least recent 1/RANKED of the cache, on average).
            cached, blocks, last = seg.cached(RANKED, self._rng)
            order = np.argsort(last, kind="stable")
            room = free + np.cumsum(blocks[order])
            m = int(np.searchsorted(room, need)) + 1
            return cached[order[:m]] if m <= len(order) else None
        # Belady: the plan's candidates, farthest first, that are still
        # cached (O(candidates) under the lock); bypass at the first one
        # whose next use is not after the new sample's.
        candidates, dist, d_new, pooled = plan
        victims, taken = [], set()
        for v, d in zip(candidates.tolist(), dist.tolist()):
            if free >= need:
                break
            if d <= d_new:
                return None
            state, length, _, _ = seg.entry(v)
            if state != FULL or v in taken or v == index:
                continue  # evicted (or taken) since the ranking
            victims.append(v)
            taken.add(v)
            free += min(-(-length // seg.h.block_bytes), seg.h.n_blocks)
        if free < need:
            # Too few left: others evicted the kept candidates (rank afresh)
            # or the sample does not make room (bypass).
            return _REPLAN if pooled else None
        if self._pool is not None and victims:
            keep = ~np.isin(self._pool[0], victims)
            self._pool = tuple(a[keep] for a in self._pool)
        return victims

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

    def at(self, slot: int, epoch: int, index: int) -> None:
        """Advisory: consumer `slot` is at sample `index` of epoch `epoch`
        (O(1): the Belady evictors map it to a position in the order)."""
        seg = self._seg
        if seg is not None and self._pid == os.getpid() and 0 <= index < self.n_samples:
            seg.set_position(slot, epoch, index)

    def _alive(self, pid: int, started: int) -> bool:
        """Whether consumer process `pid` lives: /proc read at most once per
        ALIVE_FOR seconds per process."""
        now = time.monotonic()
        seen = self._seen_alive.get((pid, started))
        if seen is not None and now - seen < ALIVE_FOR:
            return True
        if not _alive(pid, started):
            self._seen_alive.pop((pid, started), None)
            return False
        if len(self._seen_alive) > 1024:
            self._seen_alive.clear()
        self._seen_alive[(pid, started)] = now
        return True

    def _plan(self, seg, index: int, need: int, again: bool):
        """Belady's ranking for inserting `index` (`need` blocks), made
        without the exclusive lock: (candidates farthest first, their
        distances, the new sample's distance, whether kept candidates were
        used), or None when there was room at the look (and not `again`).

        The consumer table and a sample of the cached entries are copied
        under the shared lock; the orders are computed (once per order and
        epoch in this process, `_cache_orders`) and the entries ranked
        under none. A large cache is ranked RANKED samples at a time once
        per REFRESH misses; the misses between rank the POOL farthest of
        the last ranking with FRESH newly drawn samples (O(POOL + FRESH)
        per consumer, not O(RANKED)). `again`: the kept ones were stale."""
        with seg.locked(exclusive=False):
            free = int(seg.mut[FREE_COUNT])
            if not again and free >= need:
                return None
            self._table_seen = seg.table_changes()  # under the lock: the table read next is this one
            table = seg.consumers(alive=self._alive)
            members = int(seg.mut[MEMBERS])
            keep_all = self._nothing_to_gain(table, need, seg.h.n_blocks - free, members)
            if not keep_all:
                large = members > POOL_ALL and RANKED > POOL_ALL
                pooled = large and not again and self._pool is not None and self._pool_age < REFRESH
                cached, blocks, last = seg.cached(FRESH if pooled else RANKED, self._rng, repair=False)
        if keep_all:
            self._pool = None
            ORDERS.set_live(self, ())  # the orders of consumers gone meanwhile are not kept
            return _KEEP_ALL
        if pooled:
            cached, blocks, last = _merge(self._pool, (cached, blocks, last))
        return self._rank(self._futures(table), cached, blocks, last, index, max(need - free, 1), large, pooled)

    def _rank(self, futures, cached, blocks, last, index: int, room: int, large: bool, pooled: bool):
        """_plan's ranking of `cached` (with their blocks and last uses) for
        inserting `index`, `room` blocks short, under no lock: the plan, and
        the kept candidates (`large`) updated.

        Per miss: one gather of each consumer's two inverse orders and a few
        array operations for all of them (`distances`), the new sample's
        distance in Python scalars; if no cached sample's next use is after
        the new one's, the plan bypasses at its first candidate without
        sorting any (`_victims` bypasses at the first candidate whose
        distance is not above the new sample's, and the farthest is first:
        the same decision); otherwise only the candidates at or beyond the
        room + SPARE farthest are sorted (`_farthest`), or the large
        cache's ranking, sorted whole for its kept ones, is used as it is."""
        dist = distances(cached, futures)
        d_new = distance(index, futures)
        order = None
        if large:
            order = np.lexsort((last, -dist))
            top = order[:POOL]
            self._pool = (cached[top], blocks[top], last[top])
            self._pool_age = self._pool_age + 1 if pooled else 0
        else:
            self._pool = None
        if len(dist) and dist.max() <= d_new:  # bypass (or no eviction needed, if room was made meanwhile)
            first = [int(order[0]) if order is not None else int(np.argmax(dist))]
            return cached[first], dist[first], d_new, pooled
        order = _farthest(dist, last, blocks, room, SPARE, order=order)
        if order is None:
            order = np.argsort(-dist, kind="stable")  # not enough room among them: every one, farthest first
        return cached[order], dist[order], d_new, pooled

    def _checked(self, blob: bytes):
        """A consumer entry's (order parameters, pipeline, order key), checked
        once per process; None: refused. The order key is the parameters'
        JSON without the pipeline: the orders memo computes an order once
        for every pipeline that follows it."""
        if blob not in self._params_of:
            if len(self._params_of) > 256:
                self._params_of.clear()
            p = _params(blob, self.n_samples)
            if p is not None:
                pipeline = p.pop("pipeline", None)
                p = (p, pipeline, json.dumps(p, sort_keys=True, separators=(",", ":")).encode())
            self._params_of[blob] = p
        return self._params_of[blob]

    def _nothing_to_gain(self, table, need: int, used_blocks: int, members: int) -> bool:
        """Whether no eviction can add a hit, so a full cache keeps what it
        holds (fill-once) without ranking anything: samples of one size
        (the blocks in use are `need` for each cached sample), and every
        consumer the table shows belongs to one pipeline (one pipeline
        token, SampleCache's; however many workers) whose order visits
        every sample once an epoch; or no order is known at all.

        Why: in such an order a sample missed in epoch e is next used in
        epoch e + 1, as is every cached sample already used in e, and the
        hits of epoch e + 1 can only be samples cached when it starts (an
        insert during e + 1 is of a sample e + 1 has used: its one visit).
        So an epoch hits at most as many samples as the cache holds, and a
        cache that keeps what it holds hits exactly that many: swapping one
        for another costs an insert and a ranking and gains nothing. Not
        so, and ranked: two pipelines of the same order (one behind the
        other hits what the first inserted), samples of different sizes
        (what filled the cache first is not the best use of its blocks), an
        order that leaves samples out (drop_last with a short last batch, a
        partition), a consumer entry this process cannot read, or a full
        table (a process that could not register is not seen)."""
        if not table:
            return True  # every next use unknown (inf): Belady bypasses whenever full, which is this
        if len(table) >= CONSUMER_SLOTS or used_blocks != members * need:
            return False
        seen = [self._checked(blob) for _, blob, _, _ in table]
        if any(c is None for c in seen):
            return False
        pipelines = {(pipeline, order) for _, pipeline, order in seen}
        if len(pipelines) > 1 or (seen[0][1] is None and len(seen) > 1):
            return False  # several pipelines, or entries that do not say whether they are one
        p = seen[0][0]
        return p["world_size"] == 0 and (not p["drop_last"] or p["n"] % p["batch_size"] == 0)

    def _futures(self, table) -> list:
        """(position, inverse order, its length, next epoch's inverse) of
        each consumer in `table`, the orders computed outside any lock."""
        from ._sampler import sample_sequence

        checked = [(self._checked(blob), epoch, index) for _, blob, epoch, index in table]
        table = [(c[0], c[2], epoch, index) for c, epoch, index in checked if c is not None]
        ORDERS.set_live(self, {c[1] for c in table})  # before computing: what is not live is not kept
        out, seen = [], set()
        for params, order, epoch, index in table:
            if (order, epoch, index) in seen:
                continue
            seen.add((order, epoch, index))
            fn = _sequence_fn(sample_sequence, params)
            inv, length = ORDERS.get(order, epoch, fn, self.n_samples)
            nxt, _ = ORDERS.get(order, epoch + 1, fn, self.n_samples)
            pos = max(int(inv[index]), 0)
            if pos >= PREFETCH_AT * length:
                ORDERS.prefetch(order, epoch + 2, fn, self.n_samples)
            out.append((pos, inv, length, nxt))
        return out

    # ---- housekeeping ----

    def stats(self, open_segment: bool = False) -> dict:
        """This process's counts, and under "segment" the segment's advisory
        totals when it is open (or opened here, with open_segment)."""
        out = dict(self.counts)
        with self._thread_lock:
            seg = self._segment() if open_segment else (self._seg if self.opened else None)
            if seg is not None:
                # pread only, no flush: stats may come from another thread
                # (metrics), and must not write through the mapping (see
                # docs/CACHE.md, "Truncation while in use"); a Pipeline's
                # batches flush as they end.
                out["segment"] = seg.totals()
        return out

    def close(self) -> None:
        """Lets go of the segment (it stays for the next user), and of this
        process's consumer entries."""
        with self._thread_lock:
            if self.opened:
                try:
                    with self._seg.locked(exclusive=True):
                        self._settle(self._seg)
                        for slot in self._slots:
                            self._seg.unregister(slot)
                except CacheError:
                    pass  # a truncated segment: nothing to give back in it
                self._seg.close()
            self._seg, self._slots = None, []
            self._keeping, self._bypassed = (0, 0, 0), 0
        ORDERS.forget(self)


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
        store._unseen_misses = store._bypassed = 0  # the parent counts its own
        store._keeping = (0, 0, 0)
        if seg is not None:
            seg.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _merge(a, b):
    """The union of two (indices, blocks, last uses), b's rows where both have an index."""
    idx, blocks, last = (np.concatenate((x, y)) for x, y in zip(b, a))
    idx, first = np.unique(idx, return_index=True)
    return idx, blocks[first], last[first]


def _sequence_fn(sample_sequence, params: dict):
    if params["world_size"] and params["shuffle"] and "torch" not in sys.modules:
        # Partition mode orders with torch.randperm: imported here, in the
        # caller, not first in a prefetch thread (a fork while that thread
        # holds torch's import lock leaves a child that hangs on its own
        # import of torch: review 33, P1).
        try:
            import torch  # noqa: F401
        except ImportError:
            pass  # sample_sequence says what is missing
    return lambda epoch: sample_sequence(params, epoch)


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
    pipeline = p.get("pipeline")  # which pipeline the entry is of (SampleCache's token), if it says
    if pipeline is not None and (type(pipeline) is not str or not 0 < len(pipeline) <= 32):
        return None
    return p
