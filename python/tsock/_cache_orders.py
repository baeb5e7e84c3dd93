"""The inverse sample orders Belady eviction ranks by (docs/CACHE.md,
"Costs"), one memo per process.

An inverse order maps a dataset index to its first position in a
consumer's sample sequence of one epoch (-1: not in it). Computing one is
O(n log n) (the Pipeline's order is a sort by hashed keys, and partition
mode a torch.randperm: neither has a cheap inverse), so it is done once per
(order parameters, epoch) in a process, shared by every store and consumer
of that process, and always outside the store lock: the store asks for the
orders it needs before it takes the lock (`CacheStore._plan`). When a
consumer nears the end of an epoch the store asks for the epoch after the
next in a background thread (`prefetch`), so that the first eviction of
the next epoch finds it computed.

Memory: at most KEPT epochs per order, and only for the orders some open
store of this process saw in its consumer table at its last look
(`set_live`; a store's close() or collection drops its own): 4 bytes a
sample each (int32 below 2^31 samples).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

import numpy as np

KEPT = 4  # epochs kept per order: the consumers' epoch, the next, one prefetched, one for a consumer ahead


class Orders:
    """(order blob, epoch) -> (inverse, sequence length), computed once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._memo: OrderedDict = OrderedDict()  # (blob, epoch) -> (inverse, length)
        self._busy: dict = {}  # (blob, epoch) -> Event set when its computation ends
        self._live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> its orders (blobs)
        self._closed: list = []  # weak references to stores closed since the last trim
        self._trimmed_at = -1  # how many stores _live held after the last trim (fewer: one was collected since)
        self.computed = 0  # inverse orders computed in this process (tests, costs)

    def _after_fork(self) -> None:
        # A computation in flight belongs to a thread the child does not
        # have; the lock may have been held by one. What is computed stays.
        self._lock = threading.Lock()
        self._busy = {}

    def get(self, blob: bytes, epoch: int, sequence_fn, n: int, wait: bool = True):
        """(inverse, length) of order `blob`'s epoch `epoch`; computed here
        (sequence_fn(epoch): the sample sequence) unless cached, or being
        computed by another thread (waited for; with wait=False, None)."""
        key = (blob, epoch)
        while True:
            with self._lock:
                got = self._memo.get(key)
                if got is not None:
                    self._memo.move_to_end(key)
                    return got
                event = self._busy.get(key)
                if event is None:
                    event = self._busy[key] = threading.Event()
                    break
            if not wait:
                return None
            event.wait()
        try:
            got = inverse_of(sequence_fn(epoch), n)
            with self._lock:
                self._memo[key] = got
                self.computed += 1
                self._trim()
            return got
        finally:
            with self._lock:
                if self._busy.get(key) is event:
                    del self._busy[key]
            event.set()

    def prefetch(self, blob: bytes, epoch: int, sequence_fn, n: int) -> None:
        """Computes (blob, epoch) in a background thread unless it is cached
        or being computed."""
        with self._lock:
            if (blob, epoch) in self._memo or (blob, epoch) in self._busy:
                return
        threading.Thread(
            target=self.get, args=(blob, epoch, sequence_fn, n), name="tsock-cache-order", daemon=True
        ).start()

    def set_live(self, store, blobs) -> None:
        """The orders `store` saw in its consumer table: the others are
        dropped unless another store of this process sees them."""
        blobs = frozenset(blobs)
        with self._lock:
            if not self._closed and len(self._live) == self._trimmed_at and self._live.get(store) == blobs:
                return  # as at the last trim, which left nothing to drop (misses repeat this call)
            self._drain()
            if store not in self._live:
                # A store collected without close(): its orders go then
                # (review 33, L1), or at the next call if the lock is held.
                weakref.finalize(store, self._try_trim)
            self._live[store] = blobs
            self._trim()

    def forget(self, store) -> None:
        """`store` is closed: the orders only it used are dropped (now, or
        at the next call if another thread holds the lock)."""
        self._closed.append(weakref.ref(store))  # atomic: no lock needed
        self._try_trim()

    def _try_trim(self) -> None:
        # Also run by the garbage collector (a store's finalizer, a
        # pipeline's), maybe in a thread that holds the lock already: never
        # wait for it.
        if self._lock.acquire(blocking=False):
            try:
                self._trim()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._closed:
            store = self._closed.pop()()
            if store is not None:
                self._live.pop(store, None)

    def _trim(self) -> None:
        self._drain()
        live = set().union(*self._live.values()) if len(self._live) else set()
        drop, seen = [], {}
        for key in reversed(self._memo):  # the most recently used first
            blob = key[0]
            seen[blob] = seen.get(blob, 0) + 1
            if blob not in live or seen[blob] > KEPT:
                drop.append(key)
        for key in drop:
            del self._memo[key]
        self._trimmed_at = len(self._live)

    def cached(self) -> list:
        """The (blob, epoch) keys held, least recently used first."""
        with self._lock:
            return list(self._memo)


def inverse_of(sequence, n: int):
    """(inverse, length): inverse[j] is the first position of index j in
    `sequence` (-1 if absent); int32 where it fits."""
    seq = np.asarray(sequence, dtype=np.int64)
    inv = np.full(n, -1, dtype=np.int32 if n < 1 << 31 else np.int64)
    positions = np.arange(len(seq), dtype=inv.dtype)
    inv[seq] = positions
    if not np.array_equal(inv[seq], positions):  # repeats (partition mode pads): the first occurrence
        inv[:] = -1
        uniq, first = np.unique(seq, return_index=True)
        inv[uniq] = first
    return inv, len(seq)


ORDERS = Orders()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=ORDERS._after_fork)
