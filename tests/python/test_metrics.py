"""Consumer.stats() and tsock.metrics: the accounting adds up, the
Prometheus textfile and HTTP endpoint carry the right values, labels stay
bounded, and asking for metrics without prometheus_client says how to get
it. Timing checks are lower bounds or sums, never speeds: they hold on a
loaded machine."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pipeline_helpers as h
import pytest
import tsock
import tsock.metrics as metrics
from tsock import _metrics_export

N = 12


def publish(p, n, start=0):
    for i in range(start, start + n):
        p.publish((np.full(4, i, np.int64),))


def read(c, n):
    return [int(next(c)[0][0]) for _ in range(n)]


def series(text: str, name: str, **labels) -> list[float]:
    """The values of metric `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
                out.append(s.value)
    return out


def test_blocked_and_user_seconds_add_up_to_the_wall_time(channel):
    with tsock.Producer(None, channel, slots=32) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            before = c.stats()
            assert before["batches"] == 0 and before["time_to_first_batch_s"] is None
            publish(p, N)
            # Bounds from clock reads around the calls, none on how long a
            # pause or a call took: a loaded machine stretches both (a
            # bound of 10 ms on the last pause's overshoot failed 1 run in
            # 10 under load).
            got, before_calls, after_calls = [], [], []
            for i in range(N):
                if i:
                    time.sleep(0.01)
                before_calls.append(time.perf_counter())
                got.append(int(next(c)[0][0]))
                after_calls.append(time.perf_counter())
            assert got == list(range(N))
            s = c.stats()
    assert s["batches"] == N
    assert s["user_s"] >= (N - 1) * 0.01, "every pause between batches is user time"
    busy = s["blocked_s"] + s["user_s"]
    assert busy <= after_calls[-1] - before_calls[0], "the calls and the gaps between them lie within the loop"
    # blocked + user runs from the first call's start to the last call's
    # end: it covers at least the time from the first call's return to the
    # last call's start, with no gap left out.
    assert busy >= before_calls[-1] - after_calls[0], "a gap between calls was not accounted"
    assert 0 <= s["stall"] <= 1 and s["stall"] == pytest.approx(s["blocked_s"] / busy)
    assert 0 < s["time_to_first_batch_s"]
    assert (s["name"], s["rank"]) == (channel, None)


def test_waiting_for_the_producer_is_blocked_time(channel):
    with tsock.Producer(None, channel, slots=8) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            # Published 0.3 s after next() is entered (not 0.3 s after the
            # timer starts: a main thread descheduled before its call would
            # then wait less, and the bound failed under load).
            entered = threading.Event()
            real = c._next_profiled

            def entering():
                entered.set()
                return real()

            c._next_profiled = entering

            def later():
                assert entered.wait(30)
                time.sleep(0.3)
                publish(p, 1)

            t = threading.Thread(target=later)
            t.start()
            read(c, 1)
            t.join()
            s = c.stats()
    assert s["blocked_s"] >= 0.3 and s["batches"] == 1
    assert s["time_to_first_batch_s"] >= 0.3


def test_the_end_of_an_epoch_is_not_a_batch(channel):
    with tsock.Producer(None, channel, slots=8) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, 3)
            p.end_epoch()
            assert len(list(c)) == 3
            assert c.stats()["batches"] == 3


def test_textfile_has_the_values_after_n_batches(channel, tmp_path):
    pytest.importorskip("prometheus_client")
    path = tmp_path / "tsock.prom"
    pid = os.getpid()
    with tsock.Producer(None, channel, slots=32) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, N)
            read(c, N)
            s = c.stats()
            metrics.write_textfile(str(path))
    text = path.read_text()
    mine = {"channel": channel, "rank": "", "process": pid}
    assert series(text, "tsock_iter_batches_total", **mine) == [N]
    assert series(text, "tsock_iter_total_blocked_seconds", **mine) == [pytest.approx(s["blocked_s"])]
    assert series(text, "tsock_iter_user_seconds", **mine) == [pytest.approx(s["user_s"])]
    assert series(text, "tsock_iter_time_to_first_batch_seconds", **mine) == [pytest.approx(s["time_to_first_batch_s"])]
    assert series(text, "tsock_producer_batches_published_total", channel=channel, process=pid) == [N + 1]
    assert series(text, "tsock_producer_readers", channel=channel, process=pid) == [1]
    assert len(series(text, "tsock_producer_backpressure_seconds_total", channel=channel)) == 1


def test_counts_stay_when_a_consumer_goes(channel):
    pytest.importorskip("prometheus_client")
    with tsock.Producer(None, channel, slots=32) as p:
        publish(p, 1)
        for _ in range(2):
            c = tsock.Consumer(channel, start="now", timeout=30)
            publish(p, 3)
            read(c, 3)
            c.close()
            del c
        text = metrics.text()
    assert series(text, "tsock_iter_batches_total", channel=channel) == [6], "one series, never going back"
    assert series(text, "tsock_producer_batches_published_total", channel=channel) == [7]


def test_the_http_endpoint_serves_them(channel):
    pytest.importorskip("prometheus_client")
    port = metrics.serve(0)
    with tsock.Producer(None, channel, slots=32) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, N)
            read(c, N)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                text = r.read().decode()
    assert series(text, "tsock_iter_batches_total", channel=channel) == [N]
    assert series(text, "tsock_producer_batches_published_total", channel=channel) == [N + 1]


def test_labels_are_bounded(channel):
    pytest.importorskip("prometheus_client")
    with tsock.Producer(None, channel, slots=64) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, 40)
            read(c, 1)
            first = metrics.text()
            read(c, 39)
            after = metrics.text()
    for name in ("tsock_iter_batches_total", "tsock_iter_total_blocked_seconds", "tsock_iter_user_seconds"):
        assert len(series(after, name, channel=channel)) == len(series(first, name, channel=channel)) == 1
    families = {f.name: f for f in metrics.REGISTRY.families()}
    assert families["tsock_iter_batches"].labelnames == ("channel", "rank", "process")
    assert families["tsock_producer_batches_published"].labelnames == ("channel", "process")

    many = metrics.counter("tsock_test_many_series", "a family given too many label sets", ("key",))
    with pytest.warns(UserWarning, match="label sets"):
        for i in range(metrics.MAX_SERIES + 10):
            many.inc(1, key=i)
    assert len(many.samples()) == metrics.MAX_SERIES
    with pytest.raises(ValueError, match="labels"):
        many.inc(1, key=1, batch=2)


def test_a_live_consumer_is_exported_after_many_gone(channel):
    """The fresh-clone run found the exporter's series full of consumers
    gone (each earlier test's own channel): a live consumer's series were
    dropped. Live ones come first now."""
    pytest.importorskip("prometheus_client")
    for i in range(metrics.MAX_SERIES + 6):
        other = f"{channel}-{i}"
        with tsock.Producer(None, other, slots=8) as p:
            publish(p, 1)
            with tsock.Consumer(other, start="now", timeout=30) as c:
                publish(p, 1)
                read(c, 1)
        del c
    gc.collect()
    with tsock.Producer(None, channel, slots=8) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, 2)
            read(c, 2)
            text = metrics.text()
    assert series(text, "tsock_iter_batches_total", channel=channel) == [2]


def test_a_registered_family_is_exported():
    # How the decoded-sample cache registers its counters.
    pytest.importorskip("prometheus_client")
    hits = metrics.counter("tsock_test_cache_hits", "Samples served from the cache.", ("channel",))
    assert metrics.counter("tsock_test_cache_hits", "again", ("channel",)) is hits
    hits.inc(3, channel="c1")
    hits.inc(2, channel="c1")
    size = metrics.gauge("tsock_test_cache_bytes", "Bytes the cache holds.", ("channel",))
    size.set(4096, channel="c1")
    text = metrics.text()
    assert series(text, "tsock_test_cache_hits_total", channel="c1") == [5]
    assert series(text, "tsock_test_cache_bytes", channel="c1") == [4096]
    with pytest.raises(ValueError, match="can only grow"):
        hits.inc(-1, channel="c1")
    with pytest.raises(ValueError, match="already"):
        metrics.gauge("tsock_test_cache_hits", "another kind", ("channel",))
    with pytest.raises(ValueError, match="not a Prometheus"):
        metrics.counter("tsock test", "a bad name")


def test_without_prometheus_client_the_error_says_how_to_get_it(channel, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    monkeypatch.setattr(_metrics_export, "_prom", None)
    for call in (metrics.text, lambda: metrics.serve(0), lambda: metrics.write_textfile("/nonexistent")):
        with pytest.raises(ImportError, match="pip install prometheus_client"):
            call()
    # Asked for through the environment: the consumer says so before it attaches.
    monkeypatch.setattr(_metrics_export, "_env_pid", None)
    monkeypatch.setenv("TSOCK_METRICS_PORT", "0")
    with pytest.raises(ImportError, match="pip install prometheus_client"):
        tsock.Consumer(channel, timeout=0)
    # Not asked for: tsock works without it.
    monkeypatch.delenv("TSOCK_METRICS_PORT")
    monkeypatch.setattr(_metrics_export, "_env_pid", None)
    with tsock.Producer(None, channel, slots=8) as p:
        publish(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish(p, 2)
            assert read(c, 2) == [0, 1] and c.stats()["batches"] == 2


def test_bad_environment_values_are_refused(channel, monkeypatch):
    monkeypatch.setattr(_metrics_export, "_env_pid", None)
    monkeypatch.setenv("TSOCK_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="TSOCK_METRICS_PORT"):
        tsock.Consumer(channel, timeout=0)


TEXTFILE_SCRIPT = """
import numpy as np, tsock
name = {name!r}
with tsock.Producer(None, name, slots=16) as p:
    p.publish((np.zeros(4),))
    with tsock.Consumer(name, start="now", timeout=30) as c:
        for i in range({n}):
            p.publish((np.full(4, i),))
        for i in range({n}):
            next(c)
        print("pid", __import__("os").getpid())
"""


def test_the_environment_turns_the_textfile_on(channel, tmp_path):
    pytest.importorskip("prometheus_client")
    env = dict(os.environ, TSOCK_METRICS_TEXTFILE=str(tmp_path / "tsock-{pid}.prom"), TSOCK_METRICS_INTERVAL="60")
    script = textwrap.dedent(TEXTFILE_SCRIPT.format(name=channel, n=N))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = out.stdout.split()[-1]
    text = (tmp_path / f"tsock-{pid}.prom").read_text()  # written at exit
    assert series(text, "tsock_iter_batches_total", channel=channel, process=pid) == [N]
    assert series(text, "tsock_producer_batches_published_total", channel=channel, process=pid) == [N + 1]


@pytest.mark.parametrize("workers", [0, 2])
def test_pipeline_stage_seconds(workers):
    with h.make_pipeline(workers, n=16, decode=h.sleepy) as pipe:
        assert len(list(pipe.batches(0))) == 4
        took = pipe.stage_seconds()
    assert set(took) == {"source", "read", "decode", "augment", "collate"}
    assert took["decode"] >= 16 * 0.002, "every sample's decode slept 2 ms"
    assert took["read"] == 0, "no read stage"
    assert took["source"] > 0 and took["augment"] > 0 and took["collate"] > 0


def _published(pipe, channel: str, epochs: int = 1) -> str:
    """metrics.text() once a Producer of `pipe` published `epochs` of it
    and a Consumer read them all (before either closed); closes `pipe`."""
    try:
        with tsock.Producer(pipe, channel, slots=8, wait_readers=1) as p:
            runner = threading.Thread(target=p.run, kwargs={"epochs": epochs})
            runner.start()
            with tsock.Consumer(channel, timeout=60) as c:
                for _ in range(epochs):
                    assert len(list(c)) == len(pipe)
                runner.join(60)
                return metrics.text()
    finally:
        pipe.close()


def test_the_producer_exports_its_pipeline(channel, tmp_path):
    pytest.importorskip("prometheus_client")
    text = _published(h.make_pipeline(2, n=16, decode=h.sleepy), channel)
    pid = os.getpid()
    assert series(text, "tsock_pipeline_workers", channel=channel, process=pid) == [2]
    (decode,) = series(text, "tsock_pipeline_stage_seconds_total", channel=channel, stage="decode", process=pid)
    assert decode >= 16 * 0.002
    assert len(series(text, "tsock_pipeline_stage_seconds_total", channel=channel)) == 5, "one series per stage"
    # Closed, the producer's counters stay.
    assert series(metrics.text(), "tsock_pipeline_stage_seconds_total", channel=channel, stage="decode") == [decode]


def test_an_auto_pipeline_exports_its_pool_size(channel):
    # workers="auto": the gauge is the number of worker processes now (it
    # was the string "auto", which no exporter can write).
    pytest.importorskip("prometheus_client")
    pipe = h.make_pipeline("auto", n=16, decode=h.sleepy)
    sizes = []
    real = pipe.pool_size
    pipe.pool_size = lambda: sizes.append(real()) or sizes[-1]  # what the export saw
    text = _published(pipe, channel)
    (exported,) = series(text, "tsock_pipeline_workers", channel=channel)
    assert sizes and exported == sizes[-1]["workers"] >= 1


def test_the_producer_exports_its_pipelines_cache(channel):
    # Two epochs over 16 samples with room for all: the first computes
    # every sample, the second is served from the cache.
    pytest.importorskip("prometheus_client")
    pipe = h.make_pipeline(0, n=16, decode=h.sleepy, cache_bytes=1 << 20, version=f"metrics-{channel}")
    text = _published(pipe, channel, epochs=2)
    assert series(text, "tsock_pipeline_cache_misses", channel=channel) == [16]
    assert series(text, "tsock_pipeline_cache_hits", channel=channel) == [16]
    (held,) = series(text, "tsock_pipeline_cache_bytes", channel=channel)
    assert held >= 16 * 8, "16 samples of at least 8 bytes each are held"
