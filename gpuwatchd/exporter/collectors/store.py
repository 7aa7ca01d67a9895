"""The ``store`` sub-collector: ``gpuwatchd_store_up``, whether the tuning store answers.

The daemon runs on without its store (telemetry and the gate need none of it), so an
outage would otherwise show only as tuning that stops; this gauge (and the
GpuwatchdStoreDown alert on it) names the cause. Reads one flag the store keeps: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric


class StoreCollector:
    """``gpuwatchd_store_up`` from ``up()``: the store's last call reached it."""

    name = "store"
    runs_inline = True
    timeless = True  # made from up() alone

    def __init__(self, up: Callable[[], bool]) -> None:
        self._up = up

    def version(self) -> object:
        return self._up()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpuwatchd_store_up",
            "1 if the tuning store answered the daemon's last call, else 0 (tuning waits;"
            " /api/v1/winners serves its last known winners, marked stale).",
            value=1.0 if self._up() else 0.0,
        )
