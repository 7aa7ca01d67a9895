"""OpenMetrics 1.0.0, byte for byte what prometheus_client writes, faster.

A Prometheus server asks for OpenMetrics first (``Accept: application/openmetrics-text;
version=1.0.0;...``), and ``prometheus_client.openmetrics.exposition.generate_latest``
escapes every sample's name one character at a time through a ``StringIO`` and formats
every label set again for each sample: about three times the text format's render
(bench/RESULTS.md, "/metrics in OpenMetrics and text: render and scrape cost"). This encoder
remembers label text and value spellings as :class:`~gpuwatchd.exporter.text_format.TextEncoder`
does. It writes names only where both the ``underscores`` and the ``allow-utf-8``
escaping leave them unchanged (all of gpuwatchd's); a family list with any other name, an
exemplar or a native histogram goes to the library whole, so the output never differs.

One deliberate difference: a sample whose value is None raises ``TypeError`` (the
library writes an empty value, which Prometheus rejects along with the whole scrape); the
aggregator then reports that collector failed, as the text format does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from gpuwatchd.exporter.rows import CounterRows, GaugeRows
from gpuwatchd.exporter.text_format import Collected, SeriesMemo, Unusual

#: The escapings under which a strictly legacy name is written unchanged.
FAST_ESCAPINGS = frozenset({openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8})
#: The version written (what Prometheus asks for); the library writes any other.
OPENMETRICS_VERSION = "1.0.0"
EOF = b"# EOF\n"
#: Names the library writes unchanged in both escapings: every character a legacy one
#: (a sample's name is escaped per character, so no colon), no trailing newline.
_FAMILY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SAMPLE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _escape_text(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class OpenMetricsEncoder(SeriesMemo):
    """``encode(registry)`` -> what ``openmetrics.generate_latest(registry, escaping)``
    returns (version 1.0.0). One per renderer and escaping: its memos are not locked."""

    _sample_name_ok = _SAMPLE_NAME
    _label_name_ok = _SAMPLE_NAME

    def __init__(self, escaping: str = openmetrics.UNDERSCORES) -> None:
        if escaping not in FAST_ESCAPINGS:
            raise ValueError(
                f"escaping must be one of {sorted(FAST_ESCAPINGS)} (others: the library), "
                f"got {escaping!r}"
            )
        super().__init__()
        self._library = partial(
            openmetrics.generate_latest, escaping=escaping, version=OPENMETRICS_VERSION
        )
        self._families: dict[str, bool] = {}

    def encode(self, registry: Collector) -> bytes:
        return self.encode_families(list(registry.collect())) + EOF

    def encode_families(self, metrics: list[Metric]) -> bytes:
        """The families' part of a body, without ``# EOF``: parts join into one body."""
        try:
            return "".join(self._lines(metrics)).encode("utf-8")
        except Unusual:
            return self._library(Collected(metrics))[: -len(EOF)]

    def _lines(self, metrics: Iterable[Metric]) -> list[str]:
        out: list[str] = []
        series_and_value = self._series_and_value
        for metric in metrics:
            name = metric.name
            self._check_family(name)
            out.append(
                f"# HELP {name} {_escape_text(metric.documentation)}\n# TYPE {name} {metric.type}\n"
            )
            if metric.unit:
                out.append(f"# UNIT {name} {metric.unit}\n")
            if isinstance(metric, GaugeRows | CounterRows):
                self._row_lines(metric, out)
                continue
            for sample in metric.samples:
                if sample.exemplar or sample.native_histogram:
                    raise Unusual(sample.name)
                series, shown = series_and_value(sample)
                if sample.timestamp is not None:
                    out.append(f"{series} {shown} {sample.timestamp}\n")
                else:
                    out.append(f"{series} {shown}\n")
        return out

    def _check_family(self, name: str) -> None:
        ok = self._families.get(name)
        if ok is None:
            ok = self._families[name] = _FAMILY_NAME.match(name) is not None
        if not ok:
            raise Unusual(name)
