"""The consumers' and producers' metric families, read from the live objects
when the metrics are collected; what a consumer or producer counted before
it went away is kept, so the counters of a process never go back.

Labels, all bounded: channel (a name the program chose), rank (the
consumer's rank, "" when not partitioned), process (TSOCK_METRICS_PROCESS,
else the pid: it tells apart the trainers of one channel on a node, whose
textfiles one node_exporter reads together).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

from . import _metrics_export
from ._metrics_registry import MAX_SERIES, counter, gauge
from ._stats_note import cache_figures
from .errors import TsockError
from .pipeline import Pipeline

_lock = threading.Lock()
_serials = itertools.count()
_consumers: dict[int, tuple[tuple, object]] = {}  # serial -> (labels, _accounting.Account)
_producers: dict[int, list] = {}  # serial -> [labels, weakref to the Producer, last stats() seen]
_retired: dict[tuple, dict[str, float]] = {}  # (kind, labels) -> counters of objects gone
_gone: list[int] = []  # serials of consumers collected, not retired yet

# Consumer counter -> (name, documentation, kind); Ray Data's names, tsock_ for ray_data_.
CONSUMER = {
    "blocked_s": ("tsock_iter_total_blocked_seconds", "Seconds the consumer's caller was blocked in next().", "gauge"),
    "user_s": ("tsock_iter_user_seconds", "Seconds the caller spent between batches (its steps).", "gauge"),
    "batches": ("tsock_iter_batches", "Batches the consumer handed out.", "counter"),
    "time_to_first_batch_s": (
        "tsock_iter_time_to_first_batch_seconds",
        "Seconds from the consumer's creation to its first batch.",
        "gauge",
    ),
}
PRODUCER = {
    "published": ("tsock_producer_batches_published", "Batches published (epoch markers included).", "counter"),
    "backpressure_s": (
        "tsock_producer_backpressure_seconds",
        "Seconds the producer waited for its slowest consumer.",
        "counter",
    ),
    "readers": ("tsock_producer_readers", "Consumers attached now.", "gauge"),
    "workers": ("tsock_pipeline_workers", "Worker processes of the producer's tsock.Pipeline.", "gauge"),
    "cache_hits": (
        "tsock_pipeline_cache_hits",
        "Samples the decoded-sample cache of the producer's Pipeline served (its segment's count, every process).",
        "gauge",
    ),
    "cache_misses": (
        "tsock_pipeline_cache_misses",
        "Samples looked up in that cache and computed (its segment's count, every process).",
        "gauge",
    ),
    "cache_bytes": ("tsock_pipeline_cache_bytes", "Bytes of decoded samples that cache holds now.", "gauge"),
}
STAGE = "stage_s:"  # a producer's stats key STAGE + stage name: Pipeline.stage_seconds()
SUMMED = {"blocked_s", "user_s", "batches", "published", "backpressure_s"}  # kept when the object goes


def process_label() -> str:
    """The process label: TSOCK_METRICS_PROCESS, else the pid."""
    return os.environ.get("TSOCK_METRICS_PROCESS") or str(os.getpid())


def _retire(kind: str, labels: tuple, stats: dict) -> None:
    if (kind, labels) not in _retired and len(_retired) >= 2 * MAX_SERIES:
        # The oldest series of objects gone make room: bounded memory, and
        # a process that opens channel after channel keeps exporting.
        del _retired[next(iter(_retired))]
    kept = _retired.setdefault((kind, labels), {})
    for k in stats:
        if k in SUMMED or k.startswith(STAGE):
            kept[k] = kept.get(k, 0) + stats[k]
    if stats.get("time_to_first_batch_s") is not None:
        kept["time_to_first_batch_s"] = stats["time_to_first_batch_s"]  # the last one's


def _consumer_gone(serial: int) -> None:
    # A finalizer: it may run in any thread, at any allocation, even one
    # holding _lock, so it only queues (list.append is atomic).
    _gone.append(serial)


def _reap() -> None:
    """Retires the consumers gone (with _lock held)."""
    while _gone:
        labels, acct = _consumers.pop(_gone.pop())
        _retire("consumer", labels, acct.stats())


def track_consumer(consumer) -> None:
    """Puts a new Consumer in the metrics (its stats() are read at each
    collection), and starts the exporter the environment asks for."""
    _metrics_export.from_env()
    rank = "" if consumer.rank is None else str(consumer.rank)
    serial = next(_serials)
    with _lock:
        _reap()
        _consumers[serial] = ((consumer.name, rank, process_label()), consumer._acct)
    weakref.finalize(consumer, _consumer_gone, serial)


def track_producer(producer) -> None:
    """Puts a new Producer in the metrics, and starts the exporter the
    environment asks for."""
    _metrics_export.from_env()
    serial = next(_serials)
    with _lock:
        _producers[serial] = [(producer.name, process_label()), weakref.ref(producer), {}]


def _producer_stats(producer) -> dict:
    """Producer.stats() (thread-safe against close: tsock_producer_stats),
    and its Pipeline's workers and stage seconds."""
    stats = producer.stats()
    pipe = producer.loader
    if isinstance(pipe, Pipeline):
        # The processes computing now: with workers="auto" the pool's size
        # (pipe.workers is the string "auto" there).
        stats["workers"] = pipe.pool_size()["workers"] if pipe.autosize else pipe.workers
        stats.update((STAGE + name, v) for name, v in pipe.stage_seconds().items())
        stats.update(_cache_figures(pipe))
    return stats


def _cache_figures(pipe: Pipeline) -> dict:
    """The Pipeline cache's hits, misses and bytes held (_stats_note's
    figures, which tsock stat shows too), under the metrics' names."""
    return {f"cache_{k}": v for k, v in cache_figures(pipe).items()}


def retire_producer(producer) -> None:
    """Keeps what a Producer being closed counted (its counters, read now)."""
    with _lock:
        serials = [k for k, (_, ref, _) in _producers.items() if ref() is producer]
    if not serials:
        return
    try:
        stats = _producer_stats(producer)
    except Exception:  # noqa: BLE001 - closing must not fail over metrics; the last collection's values stay
        stats = {}
    with _lock:
        entry = _producers.pop(serials[0], None)
        if entry is not None:
            entry[2].update(stats)
            _retire("producer", entry[0], entry[2])


def _live_consumers() -> list[tuple[tuple, dict]]:
    with _lock:
        _reap()
        live = [(labels, acct.stats()) for labels, acct in _consumers.values()]
        gone = [(labels, dict(v)) for (kind, labels), v in _retired.items() if kind == "consumer"]
    # Live consumers first: a family keeps MAX_SERIES label sets, and the
    # series of consumers gone (a test suite's, a process that opened many
    # channels) must not push the live ones out.
    return live + gone


def _live_producers() -> list[tuple[tuple, dict]]:
    with _lock:
        entries = list(_producers.items())
    out = []
    for serial, (labels, ref, last) in entries:
        p = ref()
        if p is not None and not p._closed:
            try:
                last.update(_producer_stats(p))
            except TsockError:
                pass  # a forked child's copy of its parent's producer (EFORKED): the last values stay
        if p is None or p._closed:
            with _lock:
                if _producers.pop(serial, None) is not None:
                    _retire("producer", labels, last)
            continue
        out.append((labels, last))
    with _lock:
        out += [(labels, dict(v)) for (kind, labels), v in _retired.items() if kind == "producer"]
    return out


def _source(rows, key: str):
    """A family's source: the sum per label set of `key` in rows()."""

    def collect() -> dict:
        out: dict[tuple, float] = {}
        for labels, stats in rows():
            v = stats.get(key)
            if v is None:
                continue
            out[labels] = out.get(labels, 0) + v if key in SUMMED else v
        return out

    return collect


def _stage_source() -> dict:
    out: dict[tuple, float] = {}
    for (channel, process), stats in _live_producers():
        for k, v in stats.items():
            if k.startswith(STAGE):
                key = (channel, k[len(STAGE) :], process)
                out[key] = out.get(key, 0) + v
    return out


def _register() -> None:
    make = {"counter": counter, "gauge": gauge}
    for key, (name, doc, kind) in CONSUMER.items():
        make[kind](name, doc, ("channel", "rank", "process"), _source(_live_consumers, key))
    for key, (name, doc, kind) in PRODUCER.items():
        make[kind](name, doc, ("channel", "process"), _source(_live_producers, key))
    counter(
        "tsock_pipeline_stage_seconds",
        "Seconds the producer's tsock.Pipeline spent in each stage, its workers' summed.",
        ("channel", "stage", "process"),
        _stage_source,
    )


_register()
