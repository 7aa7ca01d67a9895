"""The ``store`` sub-collector: whether the tuning store answers, and what waits for it.

The daemon runs on without its store (telemetry and the gate need none of it), so an
outage would otherwise show only as tuning that stops; ``gpuwatchd_store_up`` (and the
GpuwatchdStoreDown alert on it) names the cause. Session ends the store could not take
(an outage, a lock held past every retry) wait on disk and are counted here. Reads
what the store and the daemon keep in memory: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class PendingCounts(NamedTuple):
    """Session ends waiting for the store, and those recorded late or dropped so far."""

    waiting: int = 0
    recorded_late: int = 0
    dropped: int = 0


class StoreCollector:
    """``gpuwatchd_store_up`` from ``up()``: the store's last call reached it; the
    pending session ends from ``pending()``."""

    name = "store"
    runs_inline = True
    timeless = True  # made from up() and pending() alone

    def __init__(
        self, up: Callable[[], bool], pending: Callable[[], PendingCounts] = PendingCounts
    ) -> None:
        self._up = up
        self._pending = pending

    def version(self) -> object:
        return (self._up(), self._pending())

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpuwatchd_store_up",
            "1 if the tuning store answered the daemon's last call, else 0 (tuning waits;"
            " /api/v1/winners serves its last known winners, marked stale).",
            value=1.0 if self._up() else 0.0,
        )
        counts = self._pending()
        yield GaugeMetricFamily(
            "gpuwatchd_store_pending_results",
            "Tuning sessions whose end (and results) the store could not take yet, kept in"
            " the state directory and recorded when it can.",
            value=float(counts.waiting),
        )
        late = CounterMetricFamily(
            "gpuwatchd_store_late_results",
            "Tuning sessions' ends that waited for the store: recorded late, or dropped"
            " (over the pending limit, or the store refused them).",
            labels=["outcome"],
        )
        late.add_metric(["recorded"], float(counts.recorded_late))
        late.add_metric(["dropped"], float(counts.dropped))
        yield late
