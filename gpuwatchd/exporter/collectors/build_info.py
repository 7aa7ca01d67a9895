"""``gpuwatchd_build_info``: which gpuwatchd, on which telemetry backend and Python.

Registered beside the aggregator rather than under it: a constant cannot fail, so it
gets no success/duration self-metrics, and it comes first in every scrape.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import InfoMetricFamily, Metric

import gpuwatchd


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """Build facts exported as ``gpuwatchd_build_info``."""

    version: str
    backend: str
    python_version: str

    @classmethod
    def current(cls, backend: str) -> DaemonInfo:
        """Facts for this process, given the telemetry backend's name."""
        return cls(gpuwatchd.__version__, backend, platform.python_version())


class BuildInfoCollector:
    """One always-1 info series labelled with the :class:`DaemonInfo`."""

    runs_inline = True  # an immutable value

    def __init__(self, info: DaemonInfo) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "gpuwatchd_build",
            "gpuwatchd build and runtime facts; always 1.",
            value={
                "version": self._info.version,
                "backend": self._info.backend,
                "python_version": self._info.python_version,
            },
        )
