"""What a Pipeline computes for one batch, in whichever process runs it: the
stages applied to each sample, with its random number generators seeded
from (seed, epoch, sample index), then the collate function.

A Stages object is all a worker process needs (with the spawn start method
it is pickled to the worker: its functions and source must then be
importable).
"""

from __future__ import annotations

import hashlib
import random
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter_ns

import numpy as np

from ._collate import default_collate

_SEED_KEY = struct.Struct("<QQQB")
_WORDS = struct.Struct("<7Q")
_PCG_STATE = {"bit_generator": "PCG64", "state": {"state": 0, "inc": 1}, "has_uint32": 0, "uinteger": 0}
MASK128 = (1 << 128) - 1

# Seeding points: each sample's generators are seeded from (seed, epoch,
# index) before it is loaded and again before augment, from different keys,
# so augment sees the same state whether or not the loading stages ran (the
# decoded-sample cache, _cache.py, skips them).
LOAD, AUGMENT = 0, 1

#: The stages, in order; Stages.ns times each (tsock.metrics' stage seconds).
STAGE_NAMES = ("source", "read", "decode", "augment", "collate")
_MISS = object()  # Stages._lookup: the sample is not in the cache (or there is none)

#: Modules whose global generator is seeded per sample when they are imported
#: (random and numpy always are).
SEEDED_MODULES = ("torch",)


class StageError(Exception):
    """A stage raised: which stage, for which sample (the original exception
    is the __cause__)."""

    def __init__(self, stage: str, index, epoch: int):
        super().__init__(stage, index, epoch)
        self.stage, self.index, self.epoch = stage, index, epoch

    @staticmethod
    def what(stage: str, index, epoch: int) -> str:
        """'augment failed on sample 13 of epoch 0' (collate: on a batch)."""
        if stage == "collate":
            return f"collate failed on epoch {epoch}"
        return f"{stage} failed on sample {index} of epoch {epoch}"


def _seed_words(seed: int, epoch: int, index: int, point: int) -> tuple:
    digest = hashlib.blake2b(_SEED_KEY.pack(seed, epoch, index, point), digest_size=56, person=b"tsock-rng").digest()
    return _WORDS.unpack(digest)


def seed_globals(words: tuple) -> None:
    """Seeds Python's random, numpy's global RandomState and, if torch is
    imported, torch's default CPU generator."""
    random.seed(words[0])
    np.random.seed(words[1] & 0xFFFFFFFF)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.manual_seed(words[2])


class GlobalRNGState:
    """The caller's global generator states, saved before stages run in its
    own process (workers=0) and put back after, so that seeding them per
    sample leaves its training loop's random streams (dropout, its own
    shuffling) as they were."""

    def __init__(self):
        self.py = random.getstate()
        self.np = np.random.get_state()
        torch = sys.modules.get("torch")
        self.torch = None if torch is None else torch.get_rng_state()

    def restore(self) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None:
            torch.set_rng_state(self.torch)


class Stages:
    """source[i] -> read -> decode -> augment(sample, rng) for each index of a
    batch, then collate."""

    def __init__(self, source, read, decode, augment, collate, seed: int, cache=None):
        self.source = source
        self.cache = cache  # a _cache.SampleCache of the decoded samples, or None
        self.read = read
        self.decode = decode
        self.augment = augment
        self.collate = collate or default_collate
        self.seed = seed
        self._bits = None  # one PCG64 per process, its state set per sample
        self._io = None  # (threads, ThreadPoolExecutor) of batch(threads=k)
        #: nanoseconds spent in each stage in this process, since take_ns()
        self.ns = dict.fromkeys(STAGE_NAMES, 0)

    def take_ns(self) -> tuple:
        """The stage times (ns, in STAGE_NAMES' order) since the last call."""
        ns, self.ns = self.ns, dict.fromkeys(STAGE_NAMES, 0)
        return tuple(ns[n] for n in STAGE_NAMES)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_bits"] = None
        state["_io"] = None
        return state

    def rng(self, words: tuple) -> np.random.Generator:
        """augment's generator: PCG64 whose 128-bit state and increment come
        from the sample's seed words. Valid during the augment call."""
        if self._bits is None:
            self._bits = np.random.PCG64(0)
        state = dict(_PCG_STATE)
        state["state"] = {
            "state": (words[3] << 64 | words[4]) & MASK128,
            "inc": (words[5] << 65 | words[6] << 1 | 1) & MASK128,
        }
        self._bits.state = state
        return np.random.Generator(self._bits)

    def sample(self, epoch: int, index: int, cached=_MISS):
        """One sample of epoch `epoch`: the stages on source[index] (from
        read on, `cached`: the cache's decoded sample, if the caller looked
        it up)."""
        index = int(index)
        seed_globals(_seed_words(self.seed, epoch, index, LOAD))
        x = self.decoded(epoch, index) if cached is _MISS else cached
        if self.augment is not None:
            words = _seed_words(self.seed, epoch, index, AUGMENT)
            seed_globals(words)
            x = self._stage("augment", index, epoch, self.augment, x, self.rng(words))
        return x

    def decoded(self, epoch: int, index: int):
        """source[index], read, decode, computed (and offered to the
        cache: the caller looked it up)."""
        start = perf_counter_ns()
        x = self._stage("source", index, epoch, self.source.__getitem__, index)
        if self.read is not None:
            x = self._stage("read", index, epoch, self.read, x)
        if self.decode is not None:
            x = self._stage("decode", index, epoch, self.decode, x)
        if self.cache is not None:
            self.cache.insert(index, x, perf_counter_ns() - start)
        return x

    def _lookup_many(self, epoch: int, indices: list) -> list:
        """The cache's decoded sample or _MISS for each of `indices` (epoch:
        the epoch of the known order they are asked in); all _MISS without
        a cache."""
        if self.cache is None:
            return [_MISS] * len(indices)
        from ._cache import MISS

        return [_MISS if x is MISS else x for x in self.cache.lookup_many(epoch, indices)]

    def batch(self, epoch: int, indices, threads: int | None = None):
        """The batch of these indices of epoch `epoch`: the cache looked up
        for all of them at once, then each sample's stages. threads: run
        `read` on that many I/O threads (see threaded())."""
        indices = [int(i) for i in indices]
        try:
            if threads is None or self.read is None:
                cached = self._lookup_many(epoch, indices)
                samples = [self.sample(epoch, i, x) for i, x in zip(indices, cached)]
            else:
                samples = self.threaded(epoch, indices, threads)
        finally:
            if self.cache is not None:
                self.cache.batch_done()
        return self._stage("collate", indices, epoch, self.collate, samples)

    def threaded(self, epoch: int, indices, threads: int) -> list:
        """The samples of a batch with their `read` stage on `threads` I/O
        threads (reads that wait for a file system release the GIL): the
        cache's samples first, source[i] for each other sample in turn, the
        reads all at once, then decode and augment of each sample in turn
        as its read is done. The global generators are seeded before
        source[i] and again before decode (the reads ran meanwhile), so the
        samples are the same whatever `threads`, and the same as sample()'s
        when source[i] and read draw nothing from the global generators
        (read is I/O: it must not)."""
        cached = self._lookup_many(epoch, indices)
        items = {}
        cost = {}  # ns each computed sample took (source, its read, decode): what a hit on it saves
        for k, i in enumerate(indices):
            if cached[k] is _MISS:
                seed_globals(_seed_words(self.seed, epoch, i, LOAD))
                start = perf_counter_ns()
                items[k] = self._stage("source", i, epoch, self.source.__getitem__, i)
                cost[k] = perf_counter_ns() - start
        io = self._io
        if io is None or io[0] != threads:
            if io is not None:
                io[1].shutdown(wait=False)
            io = self._io = (threads, ThreadPoolExecutor(threads, thread_name_prefix="tsock-read"))
        futures = {k: io[1].submit(_timed, self.read, x) for k, x in items.items()}
        try:
            samples = []
            for k, i in enumerate(indices):
                x = cached[k]
                if k in futures:
                    ok, x, ns = futures[k].result()
                    self.ns["read"] += ns
                    if not ok:
                        raise StageError("read", i, epoch) from x
                    seed_globals(_seed_words(self.seed, epoch, i, LOAD))
                    start = perf_counter_ns()
                    if self.decode is not None:
                        x = self._stage("decode", i, epoch, self.decode, x)
                    if self.cache is not None:
                        self.cache.insert(i, x, cost[k] + ns + perf_counter_ns() - start)
                if self.augment is not None:
                    words = _seed_words(self.seed, epoch, i, AUGMENT)
                    seed_globals(words)
                    x = self._stage("augment", i, epoch, self.augment, x, self.rng(words))
                samples.append(x)
            return samples
        finally:
            for f in futures.values():
                f.cancel()

    def _stage(self, name: str, index, epoch: int, fn, *args):
        start = perf_counter_ns()
        try:
            return fn(*args)
        except Exception as e:
            raise StageError(name, index, epoch) from e
        finally:
            self.ns[name] += perf_counter_ns() - start


def _timed(fn, x) -> tuple:
    """(ok, result or exception, ns) of fn(x), on an I/O thread."""
    start = perf_counter_ns()
    try:
        return True, fn(x), perf_counter_ns() - start
    except Exception as e:  # noqa: BLE001 - raised as a StageError by the batch's thread
        return False, e, perf_counter_ns() - start
