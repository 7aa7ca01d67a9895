"""Gauge and counter families kept as rows of (label values, value), for the per-GPU families.

prometheus_client's families store every series as a ``Sample`` with a labels dict, and
an encoder turns the dict back into label text: for the ~370 per-GPU series a scrape
re-renders after every poll, that round trip was half the render. These families keep
``(label values, value)`` rows instead: :class:`~gpuwatchd.exporter.text_format.TextEncoder`
writes them straight out (the label text of a row's values is remembered), and
``samples`` builds the library's samples only when something else asks (OpenMetrics, a
test), so every encoder sees the same family.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.samples import Sample

Row = tuple[tuple[str, ...], float]


class GaugeRows(GaugeMetricFamily):
    """A labelled gauge family; ``add_metric(labels, value)`` as for the library's."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], unit: str = ""
    ) -> None:
        self.rows: list[Row] = []
        super().__init__(name, documentation, labels=labels, unit=unit)

    @property
    def sample_name(self) -> str:
        """The name each series is written under."""
        return self.name

    @property
    def label_names(self) -> tuple[str, ...]:
        return self._labelnames

    def add_metric(  # type: ignore[override]  # no timestamps: none of ours has one
        self, labels: Sequence[str], value: float
    ) -> None:
        self.rows.append((tuple(labels), value))

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        """The rows as the library's samples (made anew at each access)."""
        return _samples(self.sample_name, self._labelnames, self.rows)

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        _refuse_samples(value)


class CounterRows(CounterMetricFamily):
    """A labelled counter family (series named ``<name>_total``, no created time)."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], unit: str = ""
    ) -> None:
        self.rows: list[Row] = []
        super().__init__(name, documentation, labels=labels, unit=unit)

    @property
    def sample_name(self) -> str:
        return self.name + "_total"

    @property
    def label_names(self) -> tuple[str, ...]:
        return self._labelnames

    def add_metric(  # type: ignore[override]  # no created time, timestamp or exemplar
        self, labels: Sequence[str], value: float
    ) -> None:
        self.rows.append((tuple(labels), value))

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        return _samples(self.sample_name, self._labelnames, self.rows)

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        _refuse_samples(value)


def _samples(name: str, label_names: tuple[str, ...], rows: list[Row]) -> list[Sample]:
    return [
        Sample(name, dict(zip(label_names, values, strict=False)), value, None)
        for values, value in rows
    ]


def _refuse_samples(value: list[Sample]) -> None:
    # The library's Metric.__init__ starts every family with an empty list.
    if value:
        raise TypeError("a rows family takes series through add_metric(), not samples")
