"""tsock's metrics: a small registry of named counters and gauges with
bounded labels, and an opt-in Prometheus exporter over it.

Every Consumer and Producer of the process is in it, read when the metrics
are collected (a scrape, a textfile write), never per batch. Other parts of
tsock (the decoded-sample cache) register their own families::

    hits = tsock.metrics.counter("tsock_cache_hits", "Samples served from the cache.", ("channel",))
    hits.inc(1, channel="sweep")

Exporting needs the prometheus_client package and is off unless asked for:
serve(port) or write_textfile(path), or the environment variables
TSOCK_METRICS_PORT / TSOCK_METRICS_TEXTFILE, read when the process's first
Consumer or Producer is made. Names and labels: docs/METRICS.md.
"""

from __future__ import annotations

from ._metrics_builtin import retire_producer, track_consumer, track_producer
from ._metrics_export import INSTALL, collector, serve, text, write_textfile
from ._metrics_registry import MAX_SERIES, REGISTRY, Family, Registry, counter, gauge

__all__ = [
    "Family",
    "Registry",
    "REGISTRY",
    "MAX_SERIES",
    "INSTALL",
    "counter",
    "gauge",
    "collector",
    "serve",
    "text",
    "write_textfile",
    "track_consumer",
    "track_producer",
    "retire_producer",
]
