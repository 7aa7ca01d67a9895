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


class _Rows:
    """What both row families share: rows in, the library's samples out on demand.

    Listed before the library's family class, so ``samples`` here wins over the plain
    attribute the library's ``Metric.__init__`` assigns (the setter takes that empty list).
    """

    rows: list[Row]
    _labelnames: tuple[str, ...]

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], unit: str = ""
    ) -> None:
        self.rows = []
        super().__init__(name, documentation, labels=labels, unit=unit)  # type: ignore[call-arg]

    @property
    def sample_name(self) -> str:
        """The name each series is written under."""
        raise NotImplementedError

    @property
    def label_names(self) -> tuple[str, ...]:
        return self._labelnames

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series; no timestamps, created times or exemplars: none of ours has one."""
        self.rows.append((tuple(labels), value))

    @property
    def samples(self) -> list[Sample]:
        """The rows as the library's samples (made anew at each access)."""
        return [
            Sample(self.sample_name, dict(zip(self._labelnames, values, strict=False)), value)
            for values, value in self.rows
        ]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        # The library's Metric.__init__ starts every family with an empty list.
        if value:
            raise TypeError("a rows family takes series through add_metric(), not samples")


class GaugeRows(_Rows, GaugeMetricFamily):  # type: ignore[misc]
    """A labelled gauge family; ``add_metric(labels, value)`` as for the library's."""

    @property
    def sample_name(self) -> str:
        return self.name


class CounterRows(_Rows, CounterMetricFamily):  # type: ignore[misc]
    """A labelled counter family (series named ``<name>_total``, no created time)."""

    @property
    def sample_name(self) -> str:
        return self.name + "_total"
