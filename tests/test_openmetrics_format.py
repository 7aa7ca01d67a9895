"""gpuwatchd's OpenMetrics encoder writes exactly what prometheus_client writes.

On the daemon's own registry (simulated GPUs, every sub-collector populated), through the
renderer with the Accept headers Prometheus sends, and on edge cases: every metric type,
units, created times, timestamps, escaping, NaN and infinities, names the fast path
leaves to the library.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
from daemon_registry import daemon_registry
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Exemplar, Timestamp

from gpuwatchd.exporter.openmetrics_format import OpenMetricsEncoder
from gpuwatchd.exporter.render import MetricsRenderer
from gpuwatchd.exporter.rows import CounterRows, GaugeRows
from gpuwatchd.exporter.text_format import Collected

ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)
#: What Prometheus 2.42 (the one tests/test_prometheus_e2e.py runs) sends, and what a 3.x
#: server with UTF-8 names sends.
PROMETHEUS_2 = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3 = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)
_DURATION = re.compile(rb"(scrape_+collector_+duration_+seconds\{[^}]*\}) \S+")  # any escaping


def _library(metrics: list[Metric], escaping: str) -> bytes:
    return openmetrics.generate_latest(Collected(metrics), escaping=escaping)


def _assert_same(metrics: list[Metric], escaping: str) -> None:
    encoder = OpenMetricsEncoder(escaping)
    for _ in range(2):  # the second time from the remembered label text and values
        assert encoder.encode(Collected(metrics)) == _library(metrics, escaping)


# -- the daemon's registry ----------------------------------------------------------------


@pytest.mark.parametrize("escaping", ESCAPINGS)
def test_the_daemons_populated_registry_encodes_identically(escaping: str) -> None:
    daemon = daemon_registry(gpus=4)
    encoder = OpenMetricsEncoder(escaping)
    for _ in range(3):  # values move between polls; the memos must not keep old ones
        families = list(daemon.registry.collect())
        ours = encoder.encode(Collected(families))
        assert ours == _library(families, escaping)
        daemon.poll()
    text = ours.decode()
    for kind in ("counter", "gauge", "info"):
        assert f" {kind}\n" in text
    assert "# UNIT gpuwatchd_gpu_temperature_celsius celsius\n" in text
    assert "gpuwatchd_gpu_xid_errors_total{" in text  # counters: family name, sample _total
    assert 'gpuwatchd_scrape_collector_success{collector="fleet"} 1.0' in text
    assert 'gpuwatchd_retune_pending{gpu="1"' in text and "gpuwatchd_winner_info{" in text
    assert any(isinstance(f, GaugeRows | CounterRows) for f in families)  # the rows path ran


@pytest.mark.parametrize("accept", [PROMETHEUS_2, PROMETHEUS_3])
def test_the_renderer_writes_prometheus_openmetrics_with_our_encoder(
    accept: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    encode_families = OpenMetricsEncoder.encode_families

    def counted(self: OpenMetricsEncoder, metrics: list[Metric]) -> bytes:
        calls.append(len(metrics))
        return encode_families(self, metrics)

    monkeypatch.setattr(OpenMetricsEncoder, "encode_families", counted)
    daemon = daemon_registry(gpus=3)
    renderer = MetricsRenderer(daemon.registry, daemon.board.all, max_age_s=0.0)
    library, content_type = choose_encoder(accept)
    for _ in range(2):  # afresh, then with the unchanged parts reused
        rendered = renderer.render(accept, "")
        assert rendered.content_type == content_type
        assert rendered.content_type.startswith("application/openmetrics-text; version=1.0.0")
        body = rendered.body
        assert _DURATION.sub(rb"\1 D", body) == _DURATION.sub(rb"\1 D", library(daemon.registry))
        assert body.count(b"# EOF\n") == 1 and body.endswith(b"# EOF\n")
        daemon.poll()
    assert calls, "the library's encoder wrote the body"


@pytest.mark.parametrize("escaping", [openmetrics.DOTS, openmetrics.VALUES])
def test_other_escapings_and_versions_are_the_librarys(escaping: str) -> None:
    daemon = daemon_registry(gpus=2)
    renderer = MetricsRenderer(daemon.registry, daemon.board.all, max_age_s=0.0)
    for accept in (
        f"application/openmetrics-text;version=1.0.0;escaping={escaping}",
        "application/openmetrics-text;version=2.0.0",
    ):
        library, _ = choose_encoder(accept)
        body = renderer.render(accept, "").body
        assert _DURATION.sub(rb"\1 D", body) == _DURATION.sub(rb"\1 D", library(daemon.registry))
    with pytest.raises(ValueError, match="escaping must be one of"):
        OpenMetricsEncoder(escaping)


# -- edge cases ----------------------------------------------------------------------------


def _client_objects() -> list[Metric]:
    """What prometheus_client's own metric objects yield: _created, buckets, quantiles."""
    registry = CollectorRegistry()
    Histogram("h_seconds", "a histogram", ["l"], registry=registry).labels('q"').observe(0.3)
    Counter("c", "a counter", registry=registry).inc()
    Summary("s", "a summary", registry=registry).observe(1)
    Info("i", "an info", registry=registry).info({"v": 'a"b'})
    Enum("e", "an enum", states=["x", "y"], registry=registry)
    Gauge("g_bytes", "a gauge with a unit", unit="bytes", registry=registry).set(3)
    return list(registry.collect())


def _values_and_labels() -> list[Metric]:
    values = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e22, 1234567.0, 12345678.0, 1e-7, -5, 3]
    family = GaugeMetricFamily("g", 'help \\ back\nnewline "quote"', labels=["b", "a"])
    for i, value in enumerate([*values, True, 2**70, "1.5"]):
        family.add_metric([f'x"{i}\\y\nz', "ünïcode"], value)  # type: ignore[arg-type]
    family.add_metric(["zero", ""], 0.0)  # a zero after -0.0: the memo must keep both
    return [family]


def _families() -> list[Metric]:
    counter = CounterMetricFamily("cnt", "c", labels=["k"], created=1.5, unit="bytes")
    counter.add_metric(["v"], 3.0, created=1600000000.5)
    stamped = GaugeMetricFamily("stamped", "timestamps")
    stamped.add_metric([], 1.5, timestamp=1700000000.123)
    stamped.add_metric([], 2.0, timestamp=Timestamp(1700000000, 5))  # type: ignore[arg-type]
    return [
        counter,
        stamped,
        InfoMetricFamily("build", "info", value={"version": "1.2.3", "x": 'q"'}),
        StateSetMetricFamily("st", "states", {"a": True, "b": False}),
        UnknownMetricFamily("u", "unknown", value=1.0),
        GaugeHistogramMetricFamily("gh", "gh", buckets=[("1", 2.0), ("+Inf", 3.0)], gsum_value=4),
        HistogramMetricFamily("hm", "hm", buckets=[("1", 2.0), ("+Inf", 3.0)], sum_value=4),
        SummaryMetricFamily("sm_seconds", "sm", count_value=2, sum_value=1.5, unit="seconds"),
    ]


def _unusual(name: str, sample: str, labels: dict[str, str]) -> list[Metric]:
    metric = Metric(name, "help", "gauge")
    metric.add_sample(sample, labels, 1.0)
    return [metric]


EDGE_CASES: dict[str, Callable[[], list[Metric]]] = {
    "client objects": _client_objects,
    "values and labels": _values_and_labels,
    "every family type": _families,
    "exemplar": lambda: [
        HistogramMetricFamily(
            "hx", "hx", buckets=[("1", 2.0, Exemplar({"t": "1"}, 0.5)), ("+Inf", 3.0)], sum_value=4
        )
    ],
    "utf-8 family name": lambda: _unusual("a.b", "a.b", {}),
    "colon name": lambda: _unusual("a:b", "a:b", {}),
    "sample name with a newline": lambda: _unusual("nl", "nl\n", {}),
    "digit-first sample name": lambda: _unusual("d", "1d", {}),
    "label name with a newline": lambda: _unusual("lb", "lb", {"a\n": "x"}),
    "reserved label name": lambda: _unusual("lb", "lb", {"__x": "x"}),
    "utf-8 label name": lambda: _unusual("lb", "lb", {"a.b": "x"}),
    "control characters": lambda: _unusual("cr", "cr", {"a": "x\ry\tz"}),
}


@pytest.mark.parametrize("escaping", ESCAPINGS)
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases_encode_identically(case: str, escaping: str) -> None:
    _assert_same(EDGE_CASES[case](), escaping)


def test_an_unusual_family_hands_only_its_own_part_to_the_library() -> None:
    plain = GaugeMetricFamily("plain", "p", value=1.0)
    odd = _unusual("a.b", "a.b", {})
    encoder = OpenMetricsEncoder()
    assert encoder.encode_families([plain]) + encoder.encode_families(odd) + b"# EOF\n" == (
        _library([plain, *odd], openmetrics.UNDERSCORES)
    )


@pytest.mark.parametrize("value", ["", "one"])
def test_a_value_the_library_cannot_convert_raises_as_it_does(value: str) -> None:
    metrics = _unusual("v", "v", {})
    metrics[0].samples[0] = metrics[0].samples[0]._replace(value=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _library(metrics, openmetrics.UNDERSCORES)
    with pytest.raises(ValueError):
        OpenMetricsEncoder().encode(Collected(metrics))


def test_a_none_value_raises_where_the_library_writes_no_value() -> None:
    metrics = _unusual("v", "v", {})
    metrics[0].samples[0] = metrics[0].samples[0]._replace(value=None)  # type: ignore[arg-type]
    assert _library(metrics, openmetrics.UNDERSCORES).endswith(b"v \n# EOF\n")  # invalid
    with pytest.raises(TypeError):
        OpenMetricsEncoder().encode(Collected(metrics))
