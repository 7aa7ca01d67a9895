"""The Prometheus text format (0.0.4), byte for byte what prometheus_client writes, faster.

``prometheus_client.exposition.generate_latest`` validates and escapes every metric and
label name and formats every label set again for each sample: milliseconds of GIL-bound Python
for 8 GPUs, and a scrape that misses the render cache waits for all of it (bench/RESULTS.md,
"/metrics in OpenMetrics and text: render and scrape cost"). Per-GPU label sets and
names repeat from scrape to scrape, so this encoder remembers them. A name outside the
legacy character set (none of gpuwatchd's) makes it hand the whole registry to the
library instead, so the output never differs.
:class:`SeriesMemo` (what is remembered) also serves the OpenMetrics writer
(:mod:`gpuwatchd.exporter.openmetrics_format`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gpuwatchd.exporter.rows import CounterRows, GaugeRows

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABEL = re.compile(r"^__.*$")
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_TYPE_RENAMES = {
    "counter": ("_total", "counter"),
    "info": ("_info", "gauge"),
    "stateset": ("", "gauge"),
    "gaugehistogram": ("", "histogram"),
    "unknown": ("", "untyped"),
}
#: Remembered label sets are dropped past this many (a changing pid label).
_MEMO_LIMIT = 20_000
#: Remembered value spellings are dropped past this many. The values that repeat
#: (limits, states, whole degrees) are few; a reading that changes every poll would
#: otherwise fill the memo to _MEMO_LIMIT, megabytes the process keeps for good.
_VALUE_MEMO_LIMIT = 2_048
_ZERO = floatToGoString(0.0)
_NEGATIVE_ZERO = floatToGoString(-0.0)


class Unusual(Exception):
    """A name the fast path does not handle: the library renders this registry."""


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class SeriesMemo:
    """The label text and value spellings both of our encoders remember between scrapes.

    Not locked (a lost race only formats a string twice). ``_sample_name_ok`` and
    ``_label_name_ok`` are what a sample's name and a label's name must match to be
    written as they are; anything else is :class:`Unusual` and goes to the library.
    """

    _sample_name_ok = _METRIC_NAME
    _label_name_ok = _LABEL_NAME

    def __init__(self) -> None:
        self._names: dict[str, bool] = {}
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}
        self._values: dict[float, str] = {}
        #: (series name, label names) -> label values -> "name{labels}" of a rows family
        self._prefixes: dict[tuple[str, tuple[str, ...]], dict[tuple[str, ...], str]] = {}

    def _row_lines(self, metric: GaugeRows | CounterRows, out: list[str]) -> None:
        """A rows family's series: the remembered label text of each row's values."""
        sname = metric.sample_name
        self._check_name(sname)
        names = metric.label_names
        prefixes = self._prefixes.get((sname, names))
        if prefixes is None or len(prefixes) > _MEMO_LIMIT:
            prefixes = self._prefixes[(sname, names)] = {}
        value_text = self._value_text
        for values, value in metric.rows:
            prefix = prefixes.get(values)
            if prefix is None:
                labels = tuple(dict(zip(names, values, strict=False)).items())
                prefix = sname + (self._label_text(labels) if labels else "")
                prefixes[values] = prefix
            out.append(f"{prefix} {value_text(value)}\n")

    def _series_and_value(self, sample: Sample) -> tuple[str, str]:
        """``name{labels}`` and the value's spelling of one sample, from the memos.

        Called once per sample of a plain family (a rows family's go through _row_lines).
        """
        sname = sample.name
        if not self._names.get(sname):
            self._check_name(sname)
        labels = sample.labels
        if labels:
            key = tuple(labels.items())
            text = self._labels.get(key)
            if text is None:
                text = self._label_text(key)
        else:
            text = ""
        return sname + text, self._value_text(sample.value)

    def _check_name(self, name: str) -> None:
        """A sample's name (or, in the text format, a family's) written as it is."""
        ok = self._names.get(name)
        if ok is None:
            ok = self._names[name] = self._sample_name_ok.fullmatch(name) is not None
        if not ok:
            raise Unusual(name)

    def _value_text(self, value: float) -> str:
        """The library's spelling of ``value``; what it cannot convert (None, "") raises
        as it does, so the aggregator reports that collector failed instead of a 0."""
        if value == 0:  # 0.0 == -0.0 as a key: both are spelled out here
            return _NEGATIVE_ZERO if math.copysign(1.0, value) < 0 else _ZERO
        shown = self._values.get(value)
        if shown is None:
            shown = floatToGoString(value)
            if value == value:  # NaN is never found again: don't keep it
                if len(self._values) >= _VALUE_MEMO_LIMIT:
                    self._values.clear()
                self._values[value] = shown
        return shown

    def _label_text(self, key: tuple[tuple[str, str], ...]) -> str:
        for label, _ in key:
            if self._label_name_ok.fullmatch(label) is None or _RESERVED_LABEL.match(label):
                raise Unusual(label)
        text = "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(key)) + "}"
        if len(self._labels) > _MEMO_LIMIT:
            self._labels.clear()
        self._labels[key] = text
        return text


class TextEncoder(SeriesMemo):
    """``encode(registry)`` -> the body ``generate_latest(registry)`` would return.

    One per renderer: its memos are not locked.
    """

    def encode(self, registry: Collector) -> bytes:
        return self.encode_families(list(registry.collect()))

    def encode_families(self, metrics: list[Metric]) -> bytes:
        """The families' part of a body: bodies of consecutive lists join into one."""
        try:
            return "".join(self._lines(metrics)).encode("utf-8")
        except Unusual:
            return generate_latest(Collected(metrics))

    def _lines(self, metrics: Iterable[Metric]) -> list[str]:
        out: list[str] = []
        series_and_value = self._series_and_value
        for metric in metrics:
            name = metric.name
            mtype = metric.type
            suffix, shown_type = _TYPE_RENAMES.get(mtype, ("", mtype))
            mname = name + suffix
            self._check_name(mname)
            help_text = _escape_help(metric.documentation)
            out.append(f"# HELP {mname} {help_text}\n# TYPE {mname} {shown_type}\n")
            if isinstance(metric, GaugeRows | CounterRows):
                self._row_lines(metric, out)
                continue
            extra: dict[str, list[str]] = {}
            om_names = {name + om: om for om in _OM_SUFFIXES}
            for sample in metric.samples:
                series, shown = series_and_value(sample)
                if sample.timestamp is not None:
                    ms = int(float(sample.timestamp) * 1000)
                    line = f"{series} {shown} {ms:d}\n"
                else:
                    line = f"{series} {shown}\n"
                om = om_names.get(sample.name)
                if om is None:
                    out.append(line)
                else:
                    extra.setdefault(om, []).append(line)
            for om, lines in sorted(extra.items()):
                self._check_name(name + om)
                out.append(f"# HELP {name + om} {help_text}\n# TYPE {name + om} gauge\n")
                out.extend(lines)
        return out


class Collected(Collector):
    """Metrics already collected, replayed as a registry for the library's encoder."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)
