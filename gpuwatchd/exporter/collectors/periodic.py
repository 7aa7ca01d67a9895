"""The ``periodic`` sub-collector: ``gpuwatchd_periodic_overdue_total{task}``.

A periodic task (tuning, spool rescans, drift, fleet sync, pruning) that starts late
stops the work it does without a sound; this counts each time one was overdue
(:class:`~gpuwatchd.daemon.periodic.Periodic`). Reads a copy of the counts: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric


class PeriodicCollector:
    """``gpuwatchd_periodic_overdue_total`` from ``counts()``: overdue episodes per task."""

    name = "periodic"
    runs_inline = True
    timeless = True  # made from counts() alone

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def version(self) -> object:
        return tuple(sorted(self._counts().items()))

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpuwatchd_periodic_overdue",
            "Times a periodic task (tune, spool, prune, drift, fleet-sync) started over 30 s"
            " after it was due: its last run hung, or the daemon did.",
            labels=["task"],
        )
        for task, n in sorted(self._counts().items()):
            family.add_metric([task], float(n))
        yield family
