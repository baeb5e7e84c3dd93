"""The Prometheus exporter of tsock.metrics: an HTTP endpoint or a textfile
(node_exporter's textfile collector), through prometheus_client, which is
imported only here and only when asked for."""

from __future__ import annotations

import atexit
import os
import threading
import warnings

from ._metrics_registry import REGISTRY, Registry

INSTALL = "pip install prometheus_client"
DEFAULT_INTERVAL = 10.0  # seconds between textfile writes (TSOCK_METRICS_INTERVAL)

_prom = None  # prometheus_client's CollectorRegistry holding tsock's collector
_prom_lock = threading.Lock()
_env_pid = None  # the process that read the environment (a forked child reads it again)


def _prometheus_client():
    """The prometheus_client module, or ImportError saying how to get it."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(f"tsock's Prometheus metrics need the prometheus_client package: {INSTALL}") from e
    return prometheus_client


class _Collector:
    """A prometheus_client collector over a tsock Registry."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self):
        """The families, with their samples now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for f in self.registry.families():
            cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            m = cls(f.name, f.documentation, labels=f.labelnames)
            for key, value in f.samples().items():
                m.add_metric(list(key), value)
            yield m


def collector(registry: Registry = REGISTRY):
    """A prometheus_client collector of tsock's metrics, for a program that
    serves its own: prometheus_client.REGISTRY.register(tsock.metrics.collector())."""
    _prometheus_client()
    return _Collector(registry)


def _registry():
    global _prom
    prometheus_client = _prometheus_client()
    with _prom_lock:
        if _prom is None:
            _prom = prometheus_client.CollectorRegistry(auto_describe=False)
            _prom.register(_Collector(REGISTRY))
        return _prom


def text() -> str:
    """tsock's metrics now, in Prometheus' text format."""
    return _prometheus_client().generate_latest(_registry()).decode()


def write_textfile(path: str) -> None:
    """Writes tsock's metrics now to path (atomically: a temporary file
    renamed), for node_exporter's textfile collector."""
    _prometheus_client().write_to_textfile(path, _registry())


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serves tsock's metrics over HTTP on addr:port (/metrics) from a daemon
    thread; port 0 picks a free one. Returns the port."""
    server, _ = _prometheus_client().start_http_server(port, addr, registry=_registry())
    return server.server_port


def _write_every(path: str, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        _write_quietly(path)


def _write_quietly(path: str) -> None:
    try:
        write_textfile(path)
    except OSError as e:
        warnings.warn(f"tsock metrics: cannot write {path}: {e}", RuntimeWarning, stacklevel=1)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        value = default if raw in (None, "") else float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return value


def _env_port() -> int | None:
    raw = os.environ.get("TSOCK_METRICS_PORT")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"TSOCK_METRICS_PORT must be a port number (0..65535), got {raw!r}")
    return int(raw)


def from_env() -> None:
    """Starts what TSOCK_METRICS_PORT (an HTTP endpoint on
    TSOCK_METRICS_ADDR, default 127.0.0.1) and TSOCK_METRICS_TEXTFILE (a
    file rewritten every TSOCK_METRICS_INTERVAL seconds and at exit; {pid}
    in it is replaced by the pid) ask for, once per process."""
    global _env_pid
    if _env_pid == os.getpid():
        return
    port, path = _env_port(), os.environ.get("TSOCK_METRICS_TEXTFILE")
    if port is None and not path:
        _env_pid = os.getpid()
        return
    _registry()  # ImportError naming the package before anything starts
    interval = _env_float("TSOCK_METRICS_INTERVAL", DEFAULT_INTERVAL)
    _env_pid = os.getpid()
    if port is not None:
        addr = os.environ.get("TSOCK_METRICS_ADDR") or "127.0.0.1"
        try:
            serve(port, addr)
        except OSError as e:
            warnings.warn(f"tsock metrics: cannot serve on {addr}:{port}: {e}", RuntimeWarning, stacklevel=3)
    if path:
        path = path.replace("{pid}", str(os.getpid()))
        stop = threading.Event()
        threading.Thread(target=_write_every, args=(path, interval, stop), daemon=True, name="tsock-metrics").start()
        atexit.register(_write_quietly, path)
        atexit.register(stop.set)
