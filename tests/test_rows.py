"""Rows families: the library's families, byte for byte, written without samples by our encoder."""

from __future__ import annotations

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from gpuwatchd.exporter.collectors.gpu import has_series
from gpuwatchd.exporter.rows import CounterRows, GaugeRows
from gpuwatchd.exporter.text_format import Collected, TextEncoder

ROWS = [
    (("0", "GPU-a"), 61.0),
    (("1", 'GPU-"quoted"\\'), 0.0),
    (("2", "GPU-c\nnewline"), -0.0),
    (("3", "GPU-d"), float("nan")),
    (("4", "GPU-e"), 1e-9),
    (("5",), 7.0),  # fewer values than label names: the library keeps what zip keeps
]


def _pair(counter: bool) -> tuple[Metric, Metric]:
    args = ("gpuwatchd_test_thing_seconds", 'A "test" family\nover two lines.', ("gpu", "uuid"))
    if counter:
        ours: Metric = CounterRows(*args, unit="seconds")
        theirs: Metric = CounterMetricFamily(args[0], args[1], labels=args[2], unit="seconds")
    else:
        ours = GaugeRows(*args, unit="seconds")
        theirs = GaugeMetricFamily(args[0], args[1], labels=args[2], unit="seconds")
    for labels, value in ROWS:
        ours.add_metric(list(labels), value)  # type: ignore[call-arg]
        theirs.add_metric(list(labels), value)  # type: ignore[call-arg]
    return ours, theirs


@pytest.mark.parametrize("counter", [False, True])
def test_rows_encode_as_the_library_writes_its_families(counter: bool) -> None:
    ours, theirs = _pair(counter)
    encoder = TextEncoder()
    for _ in range(2):  # then from the remembered label text
        assert encoder.encode_families([ours]) == generate_latest(Collected([theirs]))
    assert openmetrics_latest(Collected([ours])) == openmetrics_latest(Collected([theirs]))
    assert [s.name for s in ours.samples][:1] == [theirs.samples[0].name]
    assert str(ours.samples) == str(theirs.samples)  # NaN != NaN: compare the spelling


def test_a_rows_family_takes_series_through_add_metric_only() -> None:
    family = GaugeRows("gpuwatchd_test_value", "A value.", ("gpu",))
    assert not has_series(family)
    family.add_metric(["0"], 1.0)
    assert has_series(family) and family.rows == [(("0",), 1.0)]
    with pytest.raises(TypeError, match="add_metric"):
        family.samples = list(family.samples)
    assert has_series(GaugeMetricFamily("gpuwatchd_test_plain", "x", value=1.0))
    assert not has_series(GaugeMetricFamily("gpuwatchd_test_plain", "x", labels=()))
