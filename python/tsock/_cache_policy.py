"""Eviction policies of the decoded-sample cache, and a trace simulator.

Pure code: no shared memory, no processes. The store (`_cache_store.py`)
ranks its cached samples with `next_use` and `_farthest`, as `KnownFuture`
and `choose_victims` do for the simulator (which keep their own orders; the
store's come from `_cache_orders`); the simulator replays an
access trace through a policy so that policies can be compared on the same
trace (docs/CACHE.md, "Eviction"), and tests check them against an
exhaustive search.

A policy sees the simulator's calls in trace order:

- `start(trace, sizes, capacity, who)` once;
- `hit(t, key)` when access t finds its key cached;
- `miss(t, key, size, free, cached)` when it does not: returns
  (insert, victims), the keys to evict first; the simulator checks that
  the victims are cached and that the key then fits.

Optimality. With equal sizes, Belady's MIN with bypass (evict the key
whose next use is farthest; do not insert a key used later than every
victim) minimises misses (Belady 1966, Mattson et al. 1970). With sizes
that differ the problem is NP-hard (Chrobak et al. 2012, "Caching is hard -
even in the fault model") and farthest-next-use is a heuristic; the tests
measure its gap against `optimal_hits` (exhaustive) on small traces.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

INF = math.inf
SORT_WHOLE = 128  # _farthest sorts this many entries whole: fewer array calls than selecting the farthest first


@dataclass
class Result:
    """What a replay of a trace gave."""

    policy: str
    hits: int
    misses: int
    inserts: int
    evictions: int
    peak_bytes: int

    @property
    def hit_rate(self) -> float:
        """Hits over accesses (0 for an empty trace)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class BudgetExceeded(AssertionError):
    """A policy's decision would put more bytes in the cache than its capacity."""


def simulate(trace, sizes, capacity: int, policy, who=None) -> Result:
    """Replays `trace` (a sequence of keys) through `policy` with a cache of
    `capacity` bytes; `sizes[key]` is a key's size. `who`, if given, is a
    parallel sequence of (consumer, epoch) for online policies. Raises
    BudgetExceeded if the policy evicts something not cached or inserts
    past the capacity."""
    trace = list(trace)
    policy.start(trace, sizes, capacity, who)
    cached: set = set()
    used = peak = hits = inserts = evictions = 0
    for t, key in enumerate(trace):
        if key in cached:
            hits += 1
            policy.hit(t, key)
            continue
        size = sizes[key]
        insert, victims = policy.miss(t, key, size, capacity - used, cached)
        for v in victims:
            if v not in cached:
                raise BudgetExceeded(f"{policy.name} evicted {v!r} at access {t}, which is not cached")
            cached.remove(v)
            used -= sizes[v]
            evictions += 1
        if insert:
            if used + size > capacity:
                raise BudgetExceeded(
                    f"{policy.name} inserted {key!r} ({size} B) at access {t} with {used} B of {capacity} used"
                )
            cached.add(key)
            used += size
            inserts += 1
            peak = max(peak, used)
    return Result(policy.name, hits, len(trace) - hits, inserts, evictions, peak)


def next_uses(trace) -> list:
    """next_uses(trace)[t]: the next access of trace[t]'s key after t (INF: none)."""
    out = [INF] * len(trace)
    last: dict = {}
    for t in range(len(trace) - 1, -1, -1):
        out[t] = last.get(trace[t], INF)
        last[trace[t]] = t
    return out


class _Ranked:
    """Keys ranked by a priority, the largest first (a heap with lazy
    deletion: an entry is current while the key's priority is unchanged)."""

    def __init__(self):
        self.prio: dict = {}
        self.heap: list = []
        self.tie = itertools.count()

    def set(self, key, prio) -> None:
        self.prio[key] = prio
        heapq.heappush(self.heap, (-prio, next(self.tie), key))

    def drop(self, key) -> None:
        self.prio.pop(key, None)

    def pop_largest(self):
        """(key, priority) of the largest, None when none is left; the key
        stays ranked until dropped."""
        while self.heap:
            neg, _, key = heapq.heappop(self.heap)
            if self.prio.get(key) == -neg:
                return key, -neg
        return None

    def push_back(self, items) -> None:
        for key, prio in items:
            heapq.heappush(self.heap, (-prio, next(self.tie), key))


def _farthest_first(ranked: _Ranked, sizes, size: int, free: int, nearest_allowed):
    """Victims by largest priority until `size` fits in `free` plus what
    they free; None (bypass) as soon as a victim's priority is not above
    `nearest_allowed` (the new key's own next use). Popped keys are pushed
    back either way: the caller drops the victims it evicts."""
    victims, popped = [], []
    try:
        while free < size:
            top = ranked.pop_largest()
            if top is None:
                return None
            key, prio = top
            popped.append((key, prio))
            if prio <= nearest_allowed:
                return None
            victims.append(key)
            free += sizes[key]
        return victims
    finally:
        ranked.push_back(popped)


class Belady:
    """Offline MIN with bypass: knows the whole trace (next_uses)."""

    name = "belady"

    def start(self, trace, sizes, capacity, who=None) -> None:
        self.next = next_uses(trace)
        self.capacity = capacity
        self.sizes = sizes
        self.ranked = _Ranked()

    def hit(self, t, key) -> None:
        self.ranked.set(key, self.next[t])

    def miss(self, t, key, size, free, cached):
        if size > self.capacity:
            return False, []
        victims = _farthest_first(self.ranked, self.sizes, size, free, self.next[t])
        if victims is None:
            return False, []
        for v in victims:
            self.ranked.drop(v)
        self.ranked.set(key, self.next[t])
        return True, victims


class LRU:
    """Always insert (if the key fits at all); evict the least recently used."""

    name = "lru"

    def start(self, trace, sizes, capacity, who=None) -> None:
        self.sizes = sizes
        self.capacity = capacity
        self.order: OrderedDict = OrderedDict()

    def hit(self, t, key) -> None:
        self.order.move_to_end(key)

    def miss(self, t, key, size, free, cached):
        if size > self.capacity:
            return False, []
        victims = []
        for v in self.order:
            if free >= size:
                break
            victims.append(v)
            free += self.sizes[v]
        for v in victims:
            del self.order[v]
        self.order[key] = True
        return True, victims


class FillOnce:
    """CoorDL's policy: insert while there is room, never evict."""

    name = "fill-once"

    def start(self, trace, sizes, capacity, who=None) -> None:
        pass

    def hit(self, t, key) -> None:
        pass

    def miss(self, t, key, size, free, cached):
        return size <= free, []


def optimal_hits(trace, sizes, capacity: int) -> int:
    """The most hits any policy can get on `trace` (exhaustive search over
    every bypass and every set of victims at every miss; small traces only)."""
    trace = tuple(trace)

    @functools.cache
    def best(t: int, cache: frozenset) -> int:
        if t == len(trace):
            return 0
        key = trace[t]
        if key in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]
        if sizes[key] <= capacity:
            members = sorted(cache)
            for r in range(len(members) + 1):
                for gone in itertools.combinations(members, r):
                    kept = cache.difference(gone)
                    if sum(sizes[k] for k in kept) + sizes[key] <= capacity:
                        options.append(best(t + 1, kept | {key}))
        return max(options)

    return best(0, frozenset())


# ---- the known future of pipelines --------------------------------------------------------------------


class KnownFuture:
    """Next-use distances from the exact sample sequences of consumers.

    A consumer is a function epoch -> its sample sequence (the indices in
    the order it computes them) and a position (epoch, p). The distance of
    index j for one consumer is how many samples of its sequence come
    before its next use of j, within the rest of this epoch and the next
    (INF if neither has j); over several consumers, the smallest.
    Consumers given the same `order` key (the workers of one pipeline, say)
    share their inverse orders.
    """

    KEPT = 3  # inverse orders kept per order key

    def __init__(self, n: int):
        self.n = n
        self.consumers: dict = {}  # cid -> [sequence_fn, epoch, position, order key]
        self._memo: OrderedDict = OrderedDict()  # (order key, epoch) -> (inverse, length)
        # int32 where it fits: 4 bytes a sample and epoch instead of 8
        self._dtype = np.int32 if n < 1 << 31 else np.int64

    def set_consumer(self, cid, sequence_fn, order=None) -> None:
        """Adds (or replaces) a consumer, at epoch 0 position 0; `order`
        names its sequence (None: its own)."""
        self.consumers[cid] = [sequence_fn, 0, 0, ("cid", cid) if order is None else ("order", order)]

    def remove_consumer(self, cid) -> None:
        """Forgets a consumer."""
        self.consumers.pop(cid, None)

    def _inverse(self, cid, epoch: int):
        fn, _, _, order = self.consumers[cid]
        key = (order, epoch)
        got = self._memo.get(key)
        if got is None:
            seq = np.asarray(fn(epoch), dtype=np.int64)
            inv = np.full(self.n, -1, dtype=self._dtype)
            uniq, first = np.unique(seq, return_index=True)
            inv[uniq] = first  # the first occurrence (partition mode pads with repeats)
            got = self._memo[key] = (inv, len(seq))
            orders = {c[3] for c in self.consumers.values()}
            while len(self._memo) > self.KEPT * len(orders):
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return got

    def set_position(self, cid, epoch: int, position: int) -> None:
        """Consumer `cid` is at sample `position` of epoch `epoch`."""
        c = self.consumers[cid]
        c[1], c[2] = epoch, position

    def at_index(self, cid, epoch: int, index: int) -> None:
        """Consumer `cid` is computing sample `index` of epoch `epoch`."""
        inv, _ = self._inverse(cid, epoch)
        self.set_position(cid, epoch, max(int(inv[index]), 0))

    def distance(self, indices) -> np.ndarray:
        """Next-use distance (float, INF for none) of each of `indices`."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.full(len(indices), INF)
        for cid, (_, epoch, pos, _) in self.consumers.items():
            np.minimum(out, self._one(cid, epoch, pos, indices), out=out)
        return out

    def _one(self, cid, epoch: int, pos: int, indices: np.ndarray) -> np.ndarray:
        inv, length = self._inverse(cid, epoch)
        nxt, _ = self._inverse(cid, epoch + 1)
        return next_use(indices, pos, inv, length, nxt)


def next_use(indices: np.ndarray, pos: int, inv, length: int, nxt) -> np.ndarray:
    """Next-use distance (float, INF for none) of `indices` for one
    consumer at position `pos` of an epoch whose inverse order is `inv`
    (`length` samples long), `nxt` the next epoch's inverse order."""
    here, there = inv[indices].astype(np.int64), nxt[indices].astype(np.int64)
    d = np.full(len(indices), INF)
    later = here > pos
    d[later] = here[later] - pos
    wrap = ~later & (there >= 0)
    d[wrap] = length - pos + there[wrap]
    return d


def distances(indices: np.ndarray, futures) -> np.ndarray:
    """The nearest next use over `futures` (position, inverse order, its
    length, next epoch's inverse: one per consumer) of each of `indices`
    (float, INF for none): the minimum of `next_use` over them, in fewer
    array operations (each costs microseconds whatever its length, and
    `next_use` takes 15): one gather of each inverse per consumer into a
    (consumers x indices) table, then 7 operations on the table, in
    float64 (exact: every distance is below 2^53)."""
    indices = np.asarray(indices, dtype=np.int64)
    k, m = len(futures), len(indices)
    if not k:
        return np.full(m, INF)
    dtype = futures[0][1].dtype  # every inverse order of a store has its n's dtype
    here, there = np.empty((k, m), dtype), np.empty((k, m), dtype)
    for c, (_, inv, _, nxt) in enumerate(futures):
        np.take(inv, indices, out=here[c])
        np.take(nxt, indices, out=there[c])
    if k == 1:  # rest a float: the sum is float64 (an int32 one could overflow)
        pos, rest = futures[0][0], float(futures[0][2] - futures[0][0])
    else:
        pos = np.array([[f[0]] for f in futures], dtype=np.int64)
        rest = np.array([[f[2] - f[0]] for f in futures], dtype=np.float64)
    # Within this epoch: here - pos; past it (here <= pos): the next
    # epoch's position plus what is left of this one; INF if neither.
    d = np.where(there >= 0, there + rest, INF)
    np.copyto(d, here - pos, where=here > pos)
    return d[0] if k == 1 else d.min(axis=0)


def distance(index: int, futures) -> float:
    """`distances` of one index, in Python scalars (no array calls)."""
    best = INF
    for pos, inv, length, nxt in futures:
        here = int(inv[index])
        if here > pos:
            best = min(best, here - pos)
        else:
            there = int(nxt[index])
            if there >= 0:
                best = min(best, length - pos + there)
    return float(best)


class OnlineBelady:
    """Belady driven by a KnownFuture, as the store runs it: at each access
    the consumer who[t] = (consumer, epoch) is moved to the accessed index,
    and distances come from the consumers' sequences, not from the trace."""

    name = "belady-online"

    def __init__(self, future: KnownFuture):
        self.future = future

    def start(self, trace, sizes, capacity, who=None) -> None:
        if who is None:
            raise ValueError("OnlineBelady needs who= (consumer, epoch) for each access")
        self.who = list(who)
        self.sizes = sizes
        self.capacity = capacity
        self.recent: dict = {}  # key -> last access time

    def _advance(self, t, key) -> None:
        cid, epoch = self.who[t]
        self.future.at_index(cid, epoch, key)
        self.recent[key] = t

    def hit(self, t, key) -> None:
        self._advance(t, key)

    def miss(self, t, key, size, free, cached):
        self._advance(t, key)
        if size > self.capacity:
            return False, []
        keys = sorted(cached)
        sizes = [self.sizes[k] for k in keys]
        last = [self.recent.get(k, -1) for k in keys]
        victims = choose_victims(self.future, keys, sizes, last, key, size, free)
        if victims is None:
            return False, []
        return True, [int(v) for v in victims]


def choose_victims(future: KnownFuture, cached, cached_sizes, last_use, key: int, size: int, free: int):
    """Belady's victims for inserting `key` (`size` bytes, `free` free):
    the fewest of `cached` (with their sizes and last-use clocks, aligned
    arrays), farthest next use first and least recent among equals, that
    make room; None to bypass, when the key's own next use is not before
    the nearest of them (INF for both: never used again, no gain)."""
    if free >= size:
        return np.zeros(0, dtype=np.int64)
    cached = np.asarray(cached, dtype=np.int64)
    sizes, last = np.asarray(cached_sizes, dtype=np.int64), np.asarray(last_use)
    dist = future.distance(cached)
    order = _farthest(dist, last, sizes, size - free)
    if order is None:
        return None
    d_new = float(future.distance([key])[0])
    if dist[order[-1]] <= d_new:
        return None
    return cached[order]


def _farthest(dist, last, sizes, room: int, extra: int = 0, order=None):
    """Positions of the fewest entries, farthest first (then least recent,
    then by position), whose sizes add up to `room`, followed by up to
    `extra` more in the same order; None if all of them do not make room.
    `order`, if given, is that order of all of them (np.lexsort((last,
    -dist))). Otherwise only the entries at or beyond the k-th farthest
    distance are sorted, k from room + extra (an entry is at least a block,
    so that many usually make room) and growing until they do: they are
    the first entries of the full order, which a large cache does not need
    (up to SORT_WHOLE entries, one sort of all of them costs less)."""
    n = len(dist)
    k = n if order is not None or n <= SORT_WHOLE else min(max(room + extra, 1), n)
    while True:
        if order is not None:
            cand = order
        elif k >= n:
            cand = np.lexsort((last, -dist))
        else:
            neg = -dist
            threshold = np.partition(neg, k - 1)[k - 1]  # minus the k-th farthest
            cand = np.flatnonzero(neg <= threshold)  # every tie of the k-th too
            cand = cand[np.lexsort((last[cand], neg[cand]))]  # the last key is the primary one
        m = int(np.searchsorted(np.cumsum(sizes[cand]), room)) + 1  # the first prefix with room
        if m + extra <= len(cand) or (k >= n and m <= len(cand)):
            return cand[: m + extra]
        if k >= n:
            return None
        k *= 4
