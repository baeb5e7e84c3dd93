"""The metrics registry: named counters and gauges with bounded labels
(public as tsock.metrics)."""

from __future__ import annotations

import re
import threading
import warnings

#: at most this many label sets per family; more are dropped, with a warning
MAX_SERIES = 64
KINDS = ("counter", "gauge")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


class Family:
    """A named counter or gauge with fixed label names. Values are set
    (gauge) or added to (counter) per label set, or computed when the
    metrics are collected by `source`: a callable that returns
    {label values tuple: value}."""

    def __init__(self, name: str, documentation: str, kind: str, labelnames=(), source=None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        for n in (name, *labelnames):
            if not isinstance(n, str) or not _NAME.match(n):
                raise ValueError(f"{n!r} is not a Prometheus metric or label name")
        self.name, self.documentation, self.kind = name, documentation, kind
        self.labelnames = tuple(labelnames)
        self.source = source
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._warned = False

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name} has labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _room(self, key: tuple) -> bool:
        """Whether key may be stored: known, or under MAX_SERIES."""
        if key in self._values or len(self._values) < MAX_SERIES:
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"tsock metric {self.name}: more than {MAX_SERIES} label sets, the rest dropped", stacklevel=3
            )
        return False

    def inc(self, amount: float = 1, **labels) -> None:
        """Adds amount (>= 0 for a counter) to the series of these labels."""
        if self.kind == "counter" and amount < 0:
            raise ValueError(f"counter {self.name} can only grow, got {amount}")
        key = self._key(labels)
        with self._lock:
            if self._room(key):
                self._values[key] = self._values.get(key, 0) + amount

    def set(self, value: float, **labels) -> None:
        """Sets the gauge series of these labels."""
        if self.kind != "gauge":
            raise TypeError(f"{self.name} is a counter: inc() it")
        key = self._key(labels)
        with self._lock:
            if self._room(key):
                self._values[key] = value

    def samples(self) -> dict[tuple, float]:
        """{label values: value} now: the stored ones and the source's, at
        most MAX_SERIES label sets."""
        with self._lock:
            out = dict(self._values)
        if self.source is not None:
            for key, value in self.source().items():
                if key in out or len(out) < MAX_SERIES:
                    out[key] = out.get(key, 0) + value
        return out


class Registry:
    """Named families; one per process (REGISTRY)."""

    def __init__(self):
        self._families: dict[str, Family] = {}
        self._lock = threading.Lock()

    def family(self, name, documentation, kind, labelnames=(), source=None) -> Family:
        """The family of this name, made on first use; the same kind and
        labels each time (ValueError otherwise)."""
        with self._lock:
            f = self._families.get(name)
            if f is None:
                f = self._families[name] = Family(name, documentation, kind, labelnames, source)
            elif (f.kind, f.labelnames) != (kind, tuple(labelnames)):
                raise ValueError(f"metric {name} is a {f.kind} with labels {f.labelnames} already")
            return f

    def families(self) -> list[Family]:
        """Every family, in registration order."""
        with self._lock:
            return list(self._families.values())


REGISTRY = Registry()


def counter(name: str, documentation: str, labelnames=(), source=None) -> Family:
    """A counter family of REGISTRY (Prometheus appends _total to its name)."""
    return REGISTRY.family(name, documentation, "counter", labelnames, source)


def gauge(name: str, documentation: str, labelnames=(), source=None) -> Family:
    """A gauge family of REGISTRY."""
    return REGISTRY.family(name, documentation, "gauge", labelnames, source)
