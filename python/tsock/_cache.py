"""A Pipeline's use of the decoded-sample cache (docs/CACHE.md): what
Stages.sample calls between decode and augment, in whichever process
computes the sample.

A SampleCache is part of the Stages object, so it travels to the worker
processes (pickled with spawn, copied with fork); each process opens the
segment itself on first use, registers its own order in the segment's
consumer table (its pid makes the entry its own, and frees it when the
process ends) and keeps its position there up to date (the first sample of
each batch it looks up, then each sample it computes). Any CacheError
(a foreign or truncated segment, a budget /dev/shm cannot hold) is
reported once as a warning in the process that met it, which then computes
every sample itself: the cache can make a pipeline faster, never fail it.
Any other exception inside the cache is a bug of tsock's, reported the same
way (CacheWarning, naming it) rather than ending the pipeline.

A cache can also cost a process more than it saves it: when computing a
sample is cheap (a small JPEG), a hit's copy and a miss's lookup and
insert can take longer than the decode they spare. Each process keeps a
Ledger per epoch of its order (the CPU time its lookups and inserts took,
and its hits) and, over its whole life, the time each sample it computed
took. As each epoch ends, it weighs the cache's time in that epoch
against what the hits saved (hits times the mean time of a computed
sample), and turns the cache off in that process when it costs more than
MARGIN times that, with a CacheWarning saying by how much (auto_off=False
keeps it on whatever it costs). Not judged: the process's first epoch (it
fills a cold cache, or pays for opening a warm one), and any epoch that was
still filling the cache (a first epoch cut short by `break` or a resume
leaves the filling to the next); both would price a steady state by a
start-up. The two sides use different clocks on purpose: the cache's is
its thread's CPU time (a wait for the GIL or the segment's lock is not its
doing), a computed sample's is wall time (what a hit spares the consumer).
"""

from __future__ import annotations

import os
import sys
import warnings
from time import thread_time_ns

from ._cache_codec import CorruptSample, Uncacheable, decode, prepare
from ._cache_store import CacheStore
from .errors import CacheError

MISS = object()
LAZY_PIECES = 8  # a sample of more arrays is encoded before the store's lock is taken
MIN_LOOKUPS = 64  # an epoch with fewer lookups in this process decides nothing (too noisy)
MARGIN = 1.25  # off only when the cache's time exceeds what its hits saved by this factor (one epoch is noisy)
FILLING = 8  # an epoch with more than 1/FILLING of its lookups ending in an insert into free space was filling
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class CacheWarning(UserWarning):
    """The sample cache was turned off in this process (why is in the message)."""


class Ledger:
    """One epoch of one process's cache accounts: what its lookups and
    inserts cost (CPU time of the calling thread), how many of the
    lookups hit, and how many inserts went into free space (fills: set as
    the epoch ends). first: the first epoch this process used the cache
    in."""

    __slots__ = ("epoch", "first", "lookups", "hits", "cache_ns", "fills")

    def __init__(self, epoch: int, first: bool = False):
        self.epoch, self.first = epoch, first
        self.lookups = self.hits = self.cache_ns = self.fills = 0

    def verdict(self, per_compute_ns: float | None) -> str | None:
        """Why the cache does not pay for itself in this epoch, given what
        computing a sample costs (per_compute_ns, None: not known yet), or
        None: it pays (or costs less than MARGIN times what it saves), or
        the epoch tells too little: the process's first (it fills a cold
        cache, a resumed run's included, or pays the opening of a warm
        one), one still filling the cache (more than 1/FILLING of its
        lookups ended in an insert into free space: its hits are those of
        a cache half built), under MIN_LOOKUPS lookups, no computed sample
        to price a hit."""
        if self.first or self.lookups < MIN_LOOKUPS or per_compute_ns is None:
            return None
        if self.fills * FILLING > self.lookups:
            return None
        saved = self.hits * per_compute_ns
        if self.cache_ns <= MARGIN * saved:
            return None
        return (
            f"in epoch {self.epoch} its lookups and inserts took {self.cache_ns / self.lookups / 1e3:.1f} us per "
            f"sample, and its hits ({self.hits} of {self.lookups}) saved {saved / self.lookups / 1e3:.1f} us per "
            f"sample (a sample is computed in {per_compute_ns / 1e3:.1f} us)"
        )


class SampleCache:
    """The cache of one pipeline's decoded samples, as seen by one process.
    auto_off: turn it off in a process where it costs more time than its
    hits save (see the module's doc)."""

    def __init__(self, key: bytes, params: dict, budget: int | None, policy: str, directory: str,
                 auto_off: bool = True, pipeline: str | None = None):  # fmt: skip
        self.key, self.params, self.budget, self.policy, self.directory = key, params, budget, policy, directory
        self.auto_off = auto_off
        # Which pipeline this is, in every process of it: Belady tells one
        # pipeline's workers, which share one pass over the order, from two
        # pipelines of the same order (CacheStore._nothing_to_gain). Only
        # where that matters (the whole dataset, not a partition, whose list
        # of ranks needs the room in the entry). The token is this process's
        # and its workers' (adopt_pipeline): a copy in any other process (a
        # trainer forked from the one that made the Pipeline, a Pipeline
        # unpickled elsewhere) iterates on its own and draws its own.
        self.pipeline = pipeline or os.urandom(6).hex()
        self._token_pid = None if pipeline else os.getpid()
        self._refused_epoch = None  # the epoch in which a full consumer table refused this process
        self.store = CacheStore(key, params["n"], budget=budget, policy=policy, directory=directory)
        self.counts = {"uncacheable": 0}
        self._epoch = 0  # the epoch of the last lookup
        self._slot = None  # this process's consumer entry (-1: the table was full)
        self._slot_pid = None  # the process it belongs to: a forked worker registers its own
        self._ledger = Ledger(0)
        self._fills_before = 0  # the store's fills when the ledger's epoch began
        self._unjudged = Ledger(0)  # what lookups count in with auto_off=False: nothing reads it
        self._ledger_pid = None  # the process the ledger's figures are of: a forked worker starts its own
        self._computed = self._compute_ns = 0  # samples this process computed, and their time: a hit's worth
        self._off = False
        self._off_for_cost = False  # off because it did not pay: on again after close()
        self.off = None  # why the cache is off in this process (None: it is on)

    def adopt_pipeline(self) -> None:
        """Called in a worker of the pipeline: this process is part of the
        pipeline whose token it was given (not a copy that iterates alone)."""
        self._token_pid = os.getpid()

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("key", "params", "budget", "policy", "directory", "auto_off", "pipeline")}

    def __setstate__(self, state):
        self.__init__(**state)

    def lookup(self, epoch: int, index: int):
        """The decoded sample `index` (a private copy), or MISS."""
        return self.lookup_many(epoch, (index,))[0]

    def lookup_many(self, epoch: int, indices) -> list:
        """The decoded sample (a private copy) or MISS for each of
        `indices` (a batch's, in its order): one look at the segment, and
        this process's position in its order set once, at the first."""
        indices = [int(i) for i in indices]
        if self._is_off():
            return [MISS] * len(indices)
        if not self.auto_off:
            return self._lookup_many(epoch, indices, self._unjudged)  # no accounts: the clock calls cost too
        ledger = self._ledger_for(epoch)
        if ledger is None:
            return [MISS] * len(indices)
        start = thread_time_ns()
        try:
            return self._lookup_many(epoch, indices, ledger)
        finally:
            ledger.lookups += len(indices)
            ledger.cache_ns += thread_time_ns() - start

    def _lookup_many(self, epoch: int, indices: list, ledger: Ledger) -> list:
        try:
            raws = self.store.get_many(indices)
            if self._off:  # turned off by another thread meanwhile: its entry stays given back
                return [MISS] * len(indices)
            if indices:
                self._at(epoch, indices[0])
        except Exception as e:  # noqa: BLE001 - the cache must never fail the pipeline
            return [self._disable(e)] * len(indices)
        out = []
        for index, raw in zip(indices, raws):
            sample = MISS
            if raw is not None:
                try:
                    sample = decode(raw)
                    ledger.hits += 1
                except CorruptSample:
                    self.store.forget(index)
            out.append(sample)
        return out

    def insert(self, index: int, sample, cost_ns: int | None = None) -> None:
        """Offers a computed sample to the cache (the policy may decline);
        cost_ns: the time computing it took (source, read, decode), what a
        later hit on it would save."""
        if self._is_off():
            return
        if not self.auto_off:
            return self._insert(index, sample)
        ledger = self._ledger_for(None)
        if ledger is None:
            return
        if cost_ns is not None:
            self._computed += 1
            self._compute_ns += cost_ns
        start = thread_time_ns()
        try:
            self._insert(index, sample)
        finally:
            ledger.cache_ns += thread_time_ns() - start

    def _insert(self, index: int, sample) -> None:
        try:
            data = prepare(sample)  # copied by put() only if the policy keeps it
        except Uncacheable:
            self.counts["uncacheable"] += 1
            return
        if data.pieces > LAZY_PIECES:
            data = data.tobytes()  # many small copies: made now, not under the store lock
        try:
            registered = self._slot is not None and self._slot_pid == os.getpid()
            if registered:
                # Where this process is, before the plan: Belady scores the
                # batch's samples computed so far as used (review 44, 1).
                self._at(None, index)
            self.store.put(index, data)
            if not registered:
                self._at(None, index)  # registers this process once its put made or opened the segment
        except Exception as e:  # noqa: BLE001 - the cache must never fail the pipeline
            self._disable(e)

    def batch_done(self) -> None:
        """A batch's samples are in: what this process counted is written
        into the segment (CacheStore.flush), at most one lock a batch."""
        if self._is_off():
            return
        ledger = self._ledger if self.auto_off and self._ledger_pid == os.getpid() else None
        start = thread_time_ns() if ledger is not None else 0
        try:
            self.store.flush()
        except Exception as e:  # noqa: BLE001 - the cache must never fail the pipeline
            self._disable(e)
        if ledger is not None:
            ledger.cache_ns += thread_time_ns() - start

    def _is_off(self) -> bool:
        """Whether the cache is off in this process. A forked child starts
        on, where its parent turned it off for its cost: that verdict was
        on the parent's share of the work, not the child's."""
        if self._off and self._off_for_cost and self._ledger_pid != os.getpid():
            self._off = self._off_for_cost = False
            self.off = None
        return self._off

    def _ledger_for(self, epoch: int | None) -> Ledger | None:
        """This process's ledger for `epoch` (None: the current one); a
        later epoch than the ledger's first settles the one that ended,
        which can turn the cache off (then None)."""
        if self._ledger_pid != os.getpid():
            self._ledger = Ledger(0 if epoch is None else epoch, first=True)
            self._ledger_pid = os.getpid()
            self._computed = self._compute_ns = 0
            self._fills_before = self.store.counts["fills"]
        ledger = self._ledger
        if epoch is None or epoch <= ledger.epoch:
            return ledger  # a straggler of an earlier epoch counts in this one
        if ledger.first and ledger.lookups == 0:
            ledger.epoch = epoch  # opened by an insert: the first epoch is the first lookup's
            return ledger
        per_compute = self._compute_ns / self._computed if self._computed else None
        fills = self.store.counts["fills"]
        ledger.fills, self._fills_before = fills - self._fills_before, fills
        why = ledger.verdict(per_compute)
        if why is not None:
            self._turn_off(why)
            return None
        self._ledger = Ledger(epoch)
        return self._ledger

    def _turn_off(self, why: str) -> None:
        """Off in this process because it does not pay: its consumer entry
        is given back, so that evictions stop planning for its order."""
        self._off = self._off_for_cost = True
        self.off = f"costs more than it saves: {why}"
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - the cache must never fail the pipeline
            pass
        self._slot = None
        _warn_off(f"it {self.off}; Pipeline(cache_auto_off=False) keeps it on")

    def _at(self, epoch: int | None, index: int) -> None:
        """Records where this process is in its order (advisory), once the
        segment exists; epoch None: where the last lookup was."""
        if self._off:
            return  # off (another thread, meanwhile): no entry is registered again
        if self._slot_pid != os.getpid():
            self._slot, self._slot_pid = None, os.getpid()
        if self._slot == -1 and epoch is not None and epoch != self._refused_epoch:
            self._slot = None  # refused by a full table: asked again once an epoch, others may have left
        if self._slot is None:
            if not self.store.opened:
                return
            if self._token_pid != os.getpid():
                self.pipeline, self._token_pid = os.urandom(6).hex(), os.getpid()
            params = self.params if self.params["world_size"] else dict(self.params, pipeline=self.pipeline)
            slot = self.store.register(params)
            self._slot = -1 if slot is None else slot  # -1: the table is full, asked again next epoch
            if slot is None:
                self._refused_epoch = self._epoch if epoch is None else epoch
        if self._slot < 0:
            return
        if epoch is not None:
            self._epoch = epoch
        self.store.at(self._slot, self._epoch, index)  # O(1): no order is computed here

    def _disable(self, e: Exception):
        self._off, self._off_for_cost = True, False
        what = str(e) if isinstance(e, CacheError) else f"internal error, please report: {type(e).__name__}: {e}"
        self.off = what
        _warn_off(what)
        return MISS

    def stats(self) -> dict:
        """This process's counts (hits, misses, inserts, ...), "off" (why
        the cache is off in this process, or None), and under "segment" the
        segment's advisory totals over every process (the segment is opened
        here for them if it exists; where the cache is off, only while they
        are read: an off process holds no mapping that keeps a remove()
        from freeing it)."""
        was_open = self.store.opened
        out = self.store.stats(open_segment=True)
        if self._off and not was_open:
            self.store.close()
        out.update(self.counts)
        out["off"] = self.off
        return out

    def close(self) -> None:
        """Lets go of the segment in this process (it stays for others). A
        later use starts new accounts, with a first epoch that is not
        judged, and a cache that was off for its cost is on again."""
        self.store.close()
        self._slot = None
        self._ledger_pid = None
        if self._off_for_cost:
            self._off = self._off_for_cost = False
            self.off = None


def _warn_off(why: str) -> None:
    """The one CacheWarning of a cache turned off in this process; never
    raised, even where -W error makes warnings errors: the cache can make
    a pipeline slower or faster, never fail it."""
    try:
        warnings.warn(
            f"tsock: the sample cache is off in this process, every sample is computed: {why}",
            CacheWarning,
            stacklevel=_outside_tsock(),
        )
    except Warning:
        pass


def _outside_tsock() -> int:
    """The stacklevel of a warning raised here that names the first caller
    outside tsock's package (the user's loop), whatever the depth of the
    path that got here; in a worker, where every frame is tsock's, the
    outermost frame."""
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warn()
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
