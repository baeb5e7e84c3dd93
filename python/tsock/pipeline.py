"""Pipeline: a map-style source, a seeded sampler and stages as plain
functions, run by worker processes, whose batches are a pure function of
(seed, epoch, batch index).

    pipe = tsock.Pipeline(dataset, batch_size=64, seed=0, workers=4)
    for x, y in pipe.batches(epoch=3, start=10):   # batches 10.. of epoch 3, nothing before computed
        ...
    with tsock.Producer(pipe, "sweep") as p:       # or publish it to every trainer on the node
        p.run(epochs=10)

See docs/PIPELINE.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import os
import weakref
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from . import _sampler
from ._stages import STAGE_NAMES, GlobalRNGState, StageError, Stages
from .errors import PipelineError

FINGERPRINT_BYTES = 16
_ORDERS_KEPT = 4  # epochs whose order is kept (a stream prefetches across an epoch boundary)


class Position(NamedTuple):
    """Where a stream of a pipeline's batches is: epoch, and the index of
    the next batch in it (len(pipeline): only its epoch-end marker is left)."""

    epoch: int
    batch: int


_ORIGIN = Position(0, 0)


class BatchInfo:
    """What a batch is: its epoch, its index in the epoch's batches, and its
    samples. In partition mode also the rank it belongs to, and its index
    among that rank's batches (`step`).

    `indices` are the dataset indices of its samples, in order; they are
    positions start..stop-1 of the epoch's order (in partition mode: of the
    rank's order, Pipeline.indices(epoch, rank)).
    """

    __slots__ = ("epoch", "index", "rank", "world_size", "step", "start", "indices")

    def __init__(self, epoch: int, index: int, rank: int, world_size: int, step: int, start: int, indices):
        self.epoch = epoch
        self.index = index
        self.rank = rank
        self.world_size = world_size  # 0 when not partitioned
        self.step = step
        self.start = start
        self.indices = indices

    @property
    def stop(self) -> int:
        return self.start + len(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __eq__(self, other):
        if not isinstance(other, BatchInfo):
            return NotImplemented
        return self._key() == other._key() and np.array_equal(self.indices, other.indices)

    def _key(self):
        return (self.epoch, self.index, self.rank, self.world_size, self.step, self.start)

    def __repr__(self):
        part = f", rank={self.rank}/{self.world_size}, step={self.step}" if self.world_size else ""
        return f"BatchInfo(epoch={self.epoch}, index={self.index}{part}, samples {self.start}..{self.stop - 1})"

    def describe(self) -> str:
        rank = f" (rank {self.rank})" if self.world_size else ""
        return f"batch {self.index}{rank} of epoch {self.epoch}"


def _int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in {lo}..{'' if hi is None else hi}, got {v}")
    return v


def _stage_name(fn):
    """A stable description of a stage: its importable name, never an id()."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return {
            "partial": _stage_name(fn.func),
            "args": [_value(a) for a in fn.args],
            "kwargs": {k: _value(v) for k, v in sorted(fn.keywords.items())},
        }
    if hasattr(fn, "__qualname__") and hasattr(fn, "__module__"):  # functions, builtins, classes
        return f"{fn.__module__}.{fn.__qualname__}"
    t = type(fn)  # a callable object (a torchvision Compose, say): its class
    return f"{t.__module__}.{t.__qualname__}"


def _value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_value(x) for x in v]
    return _stage_name(v) if callable(v) else f"{type(v).__module__}.{type(v).__qualname__}"


def _source_digest(source) -> str | None:
    """For a list of file names, a digest of the names: they are the data."""
    if isinstance(source, (list, tuple)) and source and all(isinstance(x, (str, bytes, os.PathLike)) for x in source):
        h = hashlib.blake2b(digest_size=16)
        for x in source:
            h.update(os.fsencode(x) + b"\0")
        return h.hexdigest()
    return None


class Pipeline:
    """A deterministic, seekable input pipeline over a map-style source.

    Each sample goes through source[i] -> read -> decode -> augment(sample,
    rng); a batch is collate([samples]). The order of epoch e is a pure
    function of (seed, e, len(source), shuffle), batches are consecutive
    chunks of batch_size of it, and each sample's random numbers come from
    (seed, epoch, sample index): the batches of an epoch are the same bytes
    whatever the number of workers, their timing, or where a run restarted.

    Args:
      source: a map-style dataset (len() and [i]: a torch Dataset, a list,
        an array), or a list of file names with `read`.
      batch_size: samples per batch.
      read: I/O, item -> bytes (for a list of file names: open and read).
      decode: deterministic, bytes -> sample.
      augment: random, (sample, rng) -> sample; rng is a numpy Generator
        seeded from (seed, epoch, sample index), valid during the call.
        Python's `random`, numpy's global RNG and torch's default CPU
        generator (when torch is imported) are seeded the same way before
        each sample is loaded and again before augment, so transforms that
        use them (torchvision's) are deterministic too.
      collate: list of samples -> batch; default tsock.default_collate.
      shuffle: shuffle the order each epoch (else the source's order).
      seed: 0 .. 2^63-1.
      drop_last: drop an epoch's last, incomplete batch (DataLoader's).
      workers: worker processes (0: every stage runs in the calling process,
        for debugging). They start at the first batch and live until close().
        "auto": as many as a controller finds best at run time, from 1 up to
        cpu_budget, judged on the batches/s handed out and the time the
        consumer waits for them (see docs/PIPELINE.md, "workers='auto'").
      cpu_budget: with workers="auto", the most worker processes (default:
        the CPUs this process may run on, os.sched_getaffinity).
      io_threads: run `read` on this many threads in each worker (reads that
        wait on a file system release the GIL: an I/O-bound source gains
        without using more cores); "auto" (with workers="auto") sizes them
        from the stage times. Default: none, the stages of each sample run
        in turn. Opt-in because `read` must then be thread-safe (several
        calls at once in one process: no shared file object with seek and
        read, for one) and must not draw from the global generators; the
        batches are then the same whatever the thread count, and the same
        as without threads when source[i] draws nothing from them either.
      start_method: "fork", "spawn" or "forkserver" (default: fork where the
        platform has it). With spawn and forkserver the source and the
        stages are pickled: they must be importable (module level).
      prefetch: batches each worker may compute ahead of the one being used
        (DataLoader's prefetch_factor).
      timeout: seconds to wait for a batch from the workers (None: no limit;
        a worker that dies is reported at once either way).
      world_size: partition mode: the samples of each epoch are split among
        this many ranks exactly as torch's DistributedSampler(num_replicas=
        world_size, rank=r, shuffle, seed, drop_last=sampler_drop_last)
        splits them, and each rank's share is cut into batches.
      ranks: in partition mode, the ranks whose batches this pipeline makes
        (default: all; a node of a multi-node job gives its local ranks).
        Each epoch's batches are then, step by step, the step's batch of
        each of these ranks in turn.
      sampler_drop_last: DistributedSampler's drop_last: drop the tail of
        the order that does not fill a round of world_size (default: pad by
        repeating the order from its start).
      version: a string of yours that goes into the fingerprint (say, the
        dataset's version): pipelines that differ only in what the
        fingerprint cannot see should differ in it.
      cache_bytes: keep decoded samples (the output of source[i], read and
        decode) in a shared-memory cache of this many bytes on the node,
        shared by every process and pipeline that decodes the same data
        (docs/CACHE.md); "auto": a quarter of the available memory, at most
        half of /dev/shm's free space and a quarter of its total size less
        this uid's caches there; None (default): no cache. Only for
        pipelines whose loading stages are deterministic and draw no random
        numbers: a cached sample is the same in every epoch.
      cache_policy: "belady" (default: evict the sample whose next use, in
        the known orders of every pipeline using the cache, is farthest),
        "lru" or "fill-once".
        The cache's key follows the state and code of the source, read and
        decode (cache_key()); a source or stage that pickle cannot handle
        needs version= (ValueError otherwise).
      cache_auto_off: turn the cache off in a process where it costs more
        time than its hits save (measured per epoch once the cache is
        filled: lookups and inserts against hits times the time a sample
        takes to compute), with a CacheWarning (default True); False keeps
        it on. A bool (TypeError otherwise).
      cache_dir: where the cache's segment lives (a tmpfs; default /dev/shm).
      cache_keep: keep the segment after this pipeline's close when no
        other process uses it (for the next run, which finds it warm);
        default False: the last user's close (or exit) removes it.
        tsock.caches() lists the segments left, tsock.remove_caches()
        removes those unused (every unused one of this uid unless limited
        with keys= or older_than=).
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        read=None,
        decode=None,
        augment=None,
        collate=None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        workers: int | str = 0,
        cpu_budget: int | None = None,
        io_threads: int | str | None = None,
        start_method: str | None = None,
        prefetch: int = 2,
        timeout: float | None = None,
        world_size: int | None = None,
        ranks=None,
        sampler_drop_last: bool = False,
        version: str = "",
        cache_bytes=None,
        cache_policy: str = "belady",
        cache_auto_off: bool = True,
        cache_dir: str = "/dev/shm",
        cache_keep: bool = False,
    ):
        try:
            n = len(source)
        except TypeError:
            raise TypeError(
                f"Pipeline needs a map-style source with len() and [i], got a {type(source).__name__}; "
                "an iterable without them can be published with tsock.Producer(loader) as it is"
            ) from None
        if not hasattr(source, "__getitem__"):
            raise TypeError(f"Pipeline needs a source with [i], {type(source).__name__} has none")
        for name, fn in (("read", read), ("decode", decode), ("augment", augment), ("collate", collate)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {fn!r}")
        self.batch_size = _int("batch_size", batch_size, 1)
        self.seed = _int("seed", seed, 0, (1 << 63) - 1)
        self.autosize = workers == "auto"
        self.workers = "auto" if self.autosize else _int("workers", workers, 0, 1024)
        if cpu_budget is not None and not self.autosize:
            raise ValueError('cpu_budget= is for workers="auto"')
        self.cpu_budget = _int("cpu_budget", cpu_budget, 1, 1024) if cpu_budget is not None else _cpus()
        if io_threads is None:
            pass  # off unless asked: `read` on threads must be thread-safe (review 34, A2)
        elif read is None:
            raise ValueError("io_threads= runs the read stage on threads: this pipeline has none")
        elif io_threads == "auto":
            if not self.autosize:
                raise ValueError('io_threads="auto" needs workers="auto"')
        else:
            io_threads = _int("io_threads", io_threads, 1, 1024)
        self.io_threads = io_threads
        self._feedback = None
        self.prefetch = _int("prefetch", prefetch, 1, 64)
        if start_method is not None:
            import multiprocessing

            if start_method not in multiprocessing.get_all_start_methods():
                raise ValueError(
                    f"start_method must be one of {multiprocessing.get_all_start_methods()}, got {start_method!r}"
                )
        elif self.workers:
            import multiprocessing

            start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be None or seconds > 0, got {timeout!r}")
        if not isinstance(version, str):
            raise TypeError(f"version must be a str, got {version!r}")
        self.source = source
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.start_method = start_method
        self.timeout = timeout
        self.version = version
        self.sampler_drop_last = bool(sampler_drop_last)
        self._n = n
        if world_size is None:
            if ranks is not None:
                raise ValueError("ranks= needs world_size=")
            self.world_size = 0
            self.ranks: tuple = (0,)
            per_stream = n
        else:
            self.world_size = _int("world_size", world_size, 1, 65535)
            all_ranks = tuple(range(self.world_size))
            self.ranks = all_ranks if ranks is None else tuple(_int("rank", r, 0, self.world_size - 1) for r in ranks)
            if not self.ranks or len(set(self.ranks)) != len(self.ranks):
                raise ValueError(f"ranks must be distinct ranks of 0..{self.world_size - 1}, got {ranks!r}")
            per_stream = _sampler.rank_samples(n, self.world_size, self.sampler_drop_last)
        #: batches per epoch of each rank (of the epoch, when not partitioned)
        self.steps = per_stream // self.batch_size if self.drop_last else math.ceil(per_stream / self.batch_size)
        kept = self.steps * self.batch_size if self.drop_last else per_stream
        #: samples per epoch, over every rank this pipeline makes
        self.samples_per_epoch = kept * len(self.ranks)
        self._stream_len = per_stream
        self._stages = Stages(source, read, decode, augment, collate, self.seed)
        self.fingerprint = self._fingerprint()
        self._cache_key = None
        if not isinstance(cache_auto_off, bool):
            raise TypeError(f"cache_auto_off must be True or False, got {cache_auto_off!r}")
        self._stages.cache = self._make_cache(cache_bytes, cache_policy, cache_dir, cache_auto_off)
        self._orders: OrderedDict = OrderedDict()
        #: the epoch the next `for batch in pipeline` iterates
        self.epoch = 0
        self._pool_box: list = []  # the WorkerPool once started (a list, for the finalizer)
        self._cache_keep = bool(cache_keep)
        self._finalizer = weakref.finalize(self, _close_all, self._pool_box, self._stages.cache, self._cache_keep)

    # ---- what it is ----

    def __len__(self) -> int:
        """Batches per epoch (in partition mode: of every rank made here)."""
        return self.steps * len(self.ranks)

    def description(self) -> dict:
        """What the fingerprint is computed from."""
        return {
            "tsock_pipeline": 1,
            "order": _sampler.ORDER_VERSION,
            "source": {
                "type": f"{type(self.source).__module__}.{type(self.source).__qualname__}",
                "len": self._n,
                "names": _source_digest(self.source),
            },
            "stages": {
                "read": _stage_name(self._stages.read),
                "decode": _stage_name(self._stages.decode),
                "augment": _stage_name(self._stages.augment),
                "collate": _stage_name(self._stages.collate),
            },
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "sampler_drop_last": self.sampler_drop_last if self.world_size else None,
            "version": self.version,
        }

    def order_params(self) -> dict:
        """What the order of every epoch is computed from (the sample
        sequence of _sampler.sample_sequence): the cache's consumer table
        holds it so that other processes know this pipeline's future."""
        return {
            "n": self._n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "ranks": list(self.ranks),
            "sampler_drop_last": self.sampler_drop_last,
        }

    def cache_key(self) -> bytes:
        """16 bytes naming the decoded samples: blake2b of what decides
        them, not of the seed, augment or batching (pipelines that differ
        only there share the cache): the state of the source, read and
        decode (a digest of their pickle, with every Python function's
        code, defaults, closure cells and, two calls deep, the globals and
        user modules' attributes it uses, and every user class's MRO with
        its methods and attributes: _cache_key.state_digest; docs/CACHE.md
        says what it cannot see), the dataset's length, `version`
        and the cache's sample encoding. Where no digest can be made (the
        source or a stage holds something pickle cannot handle, or its
        pickle is over 256 MiB) the key is the names of the source's type
        and the stages plus `version`, which must then be given (a string
        you change whenever their data or code changes): ValueError
        otherwise."""
        if self._cache_key is None:
            self._cache_key = self._make_cache_key()
        return self._cache_key

    def _make_cache_key(self) -> bytes:
        from ._cache_codec import VERSION
        from ._cache_key import Unkeyable, state_digest

        s = self._stages
        try:
            state = state_digest((s.source, s.read, s.decode)).hex()
        except Unkeyable as e:
            if not self.version:
                raise ValueError(
                    f"cache_bytes: the cache key cannot be made from the state of the source, read and decode ({e}): "
                    "pass version=, a string you change whenever their data or code changes, to name the "
                    "decoded samples instead"
                ) from None
            state = None
        d = self.description()
        text = json.dumps(
            {
                "tsock_cache": VERSION,
                "source": d["source"],
                "read": d["stages"]["read"],
                "decode": d["stages"]["decode"],
                "state": state,
                "version": self.version,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES, person=b"tsock-cache").digest()

    def _make_cache(self, cache_bytes, policy: str, directory: str, auto_off: bool):
        if cache_bytes is None:
            return None
        from ._cache import SampleCache
        from ._cache_store import POLICIES

        if cache_bytes != "auto":
            cache_bytes = _int("cache_bytes", cache_bytes, 1)
        if policy not in POLICIES:
            raise ValueError(f"cache_policy must be one of {POLICIES}, got {policy!r}")
        budget = None if cache_bytes == "auto" else cache_bytes
        return SampleCache(self.cache_key(), self.order_params(), budget, policy, directory, auto_off)

    def cache_stats(self) -> dict | None:
        """The cache's counts in this process (with workers=0: every
        sample's; with workers, the segment's totals are what tells) and
        its segment's advisory totals over every process; None without a
        cache."""
        cache = self._stages.cache
        return None if cache is None else cache.stats()

    def remove_cache(self) -> bool:
        """Removes this pipeline's cache segment from /dev/shm if no process
        uses it (this one lets go of it first); True if it did. close()
        does the same unless cache_keep."""
        cache = self._stages.cache
        if cache is None:
            return False
        from ._cache_segment import remove

        cache.close()
        return remove(self.cache_key(), cache.directory)

    def _fingerprint(self) -> bytes:
        text = json.dumps(self.description(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()

    def __repr__(self):
        part = f" world_size={self.world_size} ranks={list(self.ranks)}" if self.world_size else ""
        return (
            f"<tsock.Pipeline {len(self)} batches of {self.batch_size} per epoch, seed={self.seed}{part} "
            f"workers={self.workers!r} fingerprint={self.fingerprint.hex()}>"
        )

    # ---- the order ----

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's order (1-d), or every rank's (2-d, one row per rank)."""
        order = self._orders.get(epoch)
        if order is None:
            if self.world_size:
                order = _sampler.partition(
                    self._n, self.world_size, self.seed, epoch, self.shuffle, self.sampler_drop_last
                )
            else:
                order = _sampler.epoch_order(self._n, self.seed, epoch, self.shuffle)
            order.setflags(write=False)
            self._orders[epoch] = order
            while len(self._orders) > _ORDERS_KEPT:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order

    def indices(self, epoch: int, rank: int | None = None) -> np.ndarray:
        """The dataset indices of epoch `epoch` in order (read-only); in
        partition mode those of `rank`, which are what DistributedSampler
        gives that rank (its padding included)."""
        epoch = _int("epoch", epoch, 0)
        order = self._order(epoch)
        if not self.world_size:
            if rank is not None:
                raise ValueError("rank= is for partition mode (world_size=...)")
            return order
        if rank is None:
            raise ValueError("partition mode: pass rank=")
        return order[_int("rank", rank, 0, self.world_size - 1)]

    def info(self, epoch: int, index: int) -> BatchInfo:
        """What batch `index` of epoch `epoch` is, without computing it."""
        epoch = _int("epoch", epoch, 0)
        index = _int("index", index, 0)
        if index >= len(self):
            raise IndexError(f"batch {index} of a pipeline of {len(self)} batches per epoch")
        step, which = divmod(index, len(self.ranks))
        rank = self.ranks[which]
        order = self._order(epoch)
        seq = order[rank] if self.world_size else order
        start = step * self.batch_size
        return BatchInfo(epoch, index, rank, self.world_size, step, start, seq[start : start + self.batch_size])

    # ---- batches ----

    def batches(self, epoch: int, start: int = 0, *, with_info: bool = False):
        """The batches start.. of epoch `epoch`, in order, as private arrays
        (or tensors, as collate made them); with_info: (BatchInfo, batch)
        pairs. Batches before `start` are not computed. One iteration at a
        time per pipeline."""
        self._check_position(epoch, start)

        def gen():
            for info, batch in self.stream(Position(epoch, start), epoch + 1):
                batch = _owned(batch) if self.workers else batch
                yield (info, batch) if with_info else batch

        return gen()

    def __iter__(self):
        """The batches of epoch `self.epoch`, which then moves on: like a
        DataLoader, each for-loop is the next epoch (set_epoch() to choose)."""
        epoch = self.epoch
        self.epoch += 1
        return self.batches(epoch)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next for-loop over the pipeline iterates."""
        self.epoch = _int("epoch", epoch, 0)

    def _check_position(self, epoch, start) -> None:
        _int("epoch", epoch, 0)
        _int("start", start, 0, len(self))

    def stream(self, start: Position = _ORIGIN, stop_epoch: int | None = None):
        """(BatchInfo, batch) from `start` up to the end of epoch stop_epoch - 1
        (None: for ever), prefetched across epoch boundaries. With workers,
        a batch's arrays are views of a worker's staging memory, valid until
        the next item is asked for (the Producer copies them into its
        channel); batches() gives private copies."""
        epoch, first = start
        self._check_position(epoch, first)
        if stop_epoch is not None:
            _int("stop_epoch", stop_epoch, 0)

        def positions():
            e, k = epoch, first
            while (stop_epoch is None or e < stop_epoch) and len(self):
                for j in range(k, len(self)):
                    yield self.info(e, j)
                e, k = e + 1, 0

        if self.workers == 0:
            return ((info, self._local_batch(info)) for info in positions())
        pool = self._pool()
        return pool.run((info, info.epoch, info.indices) for info in positions())

    def _local_batch(self, info: BatchInfo):
        saved = GlobalRNGState()
        try:
            return self._stages.batch(info.epoch, info.indices)
        except StageError as e:
            what = StageError.what(e.stage, e.index, e.epoch)
            raise PipelineError(f"{what} ({info.describe()}): {_summary(e.__cause__)}") from e.__cause__
        finally:
            saved.restore()

    def _pool(self):
        from ._workers import WorkerPool

        if not self._pool_box:
            self._pool_box.append(
                # A staging buffer per batch each worker may compute ahead,
                # and one for the batch being handed out.
                WorkerPool(
                    self._stages,
                    1 if self.autosize else self.workers,
                    self.start_method,
                    self.prefetch + 1,
                    self.timeout,
                    BatchInfo.describe,
                    threads=1 if self.io_threads == "auto" else self.io_threads,
                    auto=self._controller() if self.autosize else None,
                )
            )
            self._pool_box[0].feedback = self._feedback
        return self._pool_box[0]

    def _controller(self):
        from ._autosize import MAX_THREADS, Controller

        return Controller(
            budget=self.cpu_budget,
            threads_wanted=self.io_threads == "auto",
            max_threads=min(MAX_THREADS, self.batch_size),
            threads=1,
        )

    def autosize_feedback(self, seconds) -> None:
        """With workers="auto": `seconds()` is the time what this pipeline
        feeds has waited for its own consumers so far (a Producer's ring
        full: tsock.Producer passes its stats' backpressure_s). While it
        grows, the pool is not the bottleneck: no worker is added."""
        self._feedback = seconds
        if self._pool_box:
            self._pool_box[0].feedback = seconds

    def pool_size(self) -> dict:
        """The worker pool now: processes computing, I/O threads per worker
        (None: none), and with workers="auto" the controller's changes as
        (seconds since the pool started, workers, threads, why)."""
        if not self._pool_box:
            return {"workers": 0, "threads": None, "changes": []}
        pool = self._pool_box[0]
        return {"workers": len(pool.procs), "threads": pool.threads, "changes": list(pool.changes)}

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent in each stage (source, read, decode, augment,
        collate) so far, summed over this process and its workers (a
        worker's time counts once its batch arrives): where the pipeline's
        time goes. Costs two clock reads per stage call."""
        ns = self._stages.ns
        pooled = self._pool_box[0].stage_ns if self._pool_box else (0,) * len(STAGE_NAMES)
        return {name: (ns[name] + p) / 1e9 for name, p in zip(STAGE_NAMES, pooled)}

    def start(self) -> None:
        """Starts the worker processes now rather than at the first batch
        (tsock.Producer does, before it loads its library, so that they
        are forked from a process without the library's threads)."""
        if self.workers:
            self._pool().start()

    def close(self) -> None:
        """Stops the worker processes (a later iteration starts new ones)
        and lets go of the cache's segment, which is removed if no other
        process uses it, unless cache_keep (a later iteration makes a new
        one)."""
        _close_all(self._pool_box, self._stages.cache, self._cache_keep)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        raise TypeError("a Pipeline is not picklable (its workers are processes); pickle its source and stages")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _close_pool(box: list) -> None:
    if box:
        box[0].close()


def _close_all(box: list, cache, keep: bool) -> None:
    """The workers stopped, then the cache let go of (and removed when no
    other process uses it, unless keep)."""
    _close_pool(box)
    if cache is not None:
        cache.close()
        if not keep:
            from ._cache_segment import remove

            try:
                remove(cache.key, cache.directory)
            except OSError:
                pass  # the directory went: nothing to remove


def _summary(e) -> str:
    return f"{type(e).__name__}: {e}"


def _owned(batch):
    """A private copy of a batch whose arrays are views of staging memory."""
    from ._workers import join, split

    skeleton, arrays = split(batch)
    copies = [np.array(a, copy=True) for a in arrays]
    return join(skeleton, copies)
