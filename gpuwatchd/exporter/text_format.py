"""The Prometheus text format (0.0.4), byte for byte what prometheus_client writes, faster.

``prometheus_client.exposition.generate_latest`` validates and escapes every metric and
label name and formats every label set again for each sample: 4-5 ms of GIL-bound Python
for 8 GPUs, and a scrape that misses the render cache waits for all of it (bench/RESULTS.md,
"The daemon's cost"). Per-GPU label sets and names repeat from scrape to scrape, so this
encoder remembers them. A name outside the legacy character set (none of gpuwatchd's) makes
it hand the whole registry to the library instead, so the output never differs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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
#: Remembered label sets and values are dropped past this many (a changing pid label).
_MEMO_LIMIT = 20_000


class _Unusual(Exception):
    """A name the fast path does not handle: the library renders this registry."""


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class TextEncoder:
    """``encode(registry)`` -> the body ``generate_latest(registry)`` would return.

    One per renderer: its memo of label strings is not locked (a lost race only
    formats a string twice).
    """

    def __init__(self) -> None:
        self._names: dict[str, bool] = {}
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}
        self._values: dict[float, str] = {}

    def encode(self, registry: Collector) -> bytes:
        metrics = list(registry.collect())
        try:
            return "".join(self._lines(metrics)).encode("utf-8")
        except _Unusual:
            return generate_latest(_Collected(metrics))

    def _lines(self, metrics: Iterable[Metric]) -> list[str]:
        out: list[str] = []
        for metric in metrics:
            name = metric.name
            mtype = metric.type
            suffix, shown_type = _TYPE_RENAMES.get(mtype, ("", mtype))
            mname = name + suffix
            self._check_name(mname)
            help_text = _escape_help(metric.documentation)
            out.append(f"# HELP {mname} {help_text}\n# TYPE {mname} {shown_type}\n")
            extra: dict[str, list[str]] = {}
            for sample in metric.samples:
                line = self._sample_line(sample)
                for om in _OM_SUFFIXES:
                    if sample.name == name + om:
                        extra.setdefault(om, []).append(line)
                        break
                else:
                    out.append(line)
            for om, lines in sorted(extra.items()):
                self._check_name(name + om)
                out.append(f"# HELP {name + om} {help_text}\n# TYPE {name + om} gauge\n")
                out.extend(lines)
        return out

    def _check_name(self, name: str) -> None:
        ok = self._names.get(name)
        if ok is None:
            ok = self._names[name] = _METRIC_NAME.match(name) is not None
        if not ok:
            raise _Unusual(name)

    def _sample_line(self, sample: Sample) -> str:
        self._check_name(sample.name)
        labels = sample.labels
        if labels:
            key = tuple(labels.items())
            text = self._labels.get(key)
            if text is None:
                text = self._label_text(key)
        else:
            text = ""
        value = sample.value
        shown = self._values.get(value) if value else None  # 0.0 == -0.0: not memoised
        if shown is None:
            shown = floatToGoString(value)
            if value and value == value:  # NaN is never found again: don't keep it
                if len(self._values) > _MEMO_LIMIT:
                    self._values.clear()
                self._values[value] = shown
        if sample.timestamp is not None:
            return f"{sample.name}{text} {shown} {int(float(sample.timestamp) * 1000):d}\n"
        return f"{sample.name}{text} {shown}\n"

    def _label_text(self, key: tuple[tuple[str, str], ...]) -> str:
        for label, _ in key:
            if _LABEL_NAME.match(label) is None or _RESERVED_LABEL.match(label):
                raise _Unusual(label)
        text = "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(key)) + "}"
        if len(self._labels) > _MEMO_LIMIT:
            self._labels.clear()
        self._labels[key] = text
        return text


class _Collected(Collector):
    """Metrics already collected, replayed as a registry for the library's encoder."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)
