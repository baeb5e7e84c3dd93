"""A Pipeline's use of the decoded-sample cache (docs/CACHE.md): what
Stages.sample calls between decode and augment, in whichever process
computes the sample.

A SampleCache is part of the Stages object, so it travels to the worker
processes (pickled with spawn, copied with fork); each process opens the
segment itself on first use, registers its own order in the segment's
consumer table (its pid makes the entry its own, and frees it when the
process ends) and keeps its position there up to date. Any CacheError
(a foreign or truncated segment, a budget /dev/shm cannot hold) is
reported once as a warning in the process that met it, which then computes
every sample itself: the cache can make a pipeline faster, never fail it.
Any other exception inside the cache is a bug of tsock's, reported the same
way (CacheWarning, naming it) rather than ending the pipeline.
"""

from __future__ import annotations

import os
import warnings

from ._cache_codec import CorruptSample, Uncacheable, decode, prepare
from ._cache_store import CacheStore
from .errors import CacheError

MISS = object()
LAZY_PIECES = 8  # a sample of more arrays is encoded before the store's lock is taken


class CacheWarning(UserWarning):
    """The sample cache was turned off in this process (why is in the message)."""


class SampleCache:
    """The cache of one pipeline's decoded samples, as seen by one process."""

    def __init__(self, key: bytes, params: dict, budget: int | None, policy: str, directory: str):
        self.key, self.params, self.budget, self.policy, self.directory = key, params, budget, policy, directory
        self.store = CacheStore(key, params["n"], budget=budget, policy=policy, directory=directory)
        self.counts = {"uncacheable": 0}
        self._epoch = 0  # the epoch of the last lookup
        self._slot = None  # this process's consumer entry (-1: the table was full)
        self._slot_pid = None  # the process it belongs to: a forked worker registers its own
        self._off = False

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("key", "params", "budget", "policy", "directory")}

    def __setstate__(self, state):
        self.__init__(**state)

    def lookup(self, epoch: int, index: int):
        """The decoded sample `index` (a private copy), or MISS."""
        if self._off:
            return MISS
        try:
            raw = self.store.get(index)
            self._at(epoch, index)
        except Exception as e:  # noqa: BLE001 - the cache must never fail the pipeline
            return self._disable(e)
        if raw is None:
            return MISS
        try:
            return decode(raw)
        except CorruptSample:
            self.store.forget(index)
            return MISS

    def insert(self, index: int, sample) -> None:
        """Offers a computed sample to the cache (the policy may decline)."""
        if self._off:
            return
        try:
            data = prepare(sample)  # copied by put() only if the policy keeps it
        except Uncacheable:
            self.counts["uncacheable"] += 1
            return
        if data.pieces > LAZY_PIECES:
            data = data.tobytes()  # many small copies: made now, not under the store lock
        try:
            self.store.put(index, data)
            self._at(None, index)
        except Exception as e:  # noqa: BLE001 - the cache must never fail the pipeline
            self._disable(e)

    def _at(self, epoch: int | None, index: int) -> None:
        """Records where this process is in its order (advisory), once the
        segment exists; epoch None: where the last lookup was."""
        if self._slot_pid != os.getpid():
            self._slot, self._slot_pid = None, os.getpid()
        if self._slot is None:
            if not self.store.opened:
                return
            slot = self.store.register(self.params)
            self._slot = -1 if slot is None else slot  # -1: the table is full, not asked again
        if self._slot < 0:
            return
        if epoch is not None:
            self._epoch = epoch
        self.store.at(self._slot, self._epoch, index)  # O(1): no order is computed here

    def _disable(self, e: Exception):
        self._off = True
        what = str(e) if isinstance(e, CacheError) else f"internal error, please report: {type(e).__name__}: {e}"
        warnings.warn(
            f"tsock: the sample cache is off in this process, every sample is computed: {what}",
            CacheWarning,
            stacklevel=3,
        )
        return MISS

    def stats(self) -> dict:
        """This process's counts (hits, misses, inserts, ...) and, under
        "segment", the segment's advisory totals over every process (the
        segment is opened here for them if it exists)."""
        out = self.store.stats(open_segment=True)
        out.update(self.counts)
        return out

    def close(self) -> None:
        """Lets go of the segment in this process (it stays for others)."""
        self.store.close()
        self._slot = None
