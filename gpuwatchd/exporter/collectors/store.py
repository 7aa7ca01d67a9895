"""The ``store`` sub-collector: whether the tuning store answers, may be written, and
what waits for it.

The daemon runs on without its store (telemetry and the gate need none of it), so an
outage would otherwise show only as tuning that stops; ``gpuwatchd_store_up`` (and the
GpuwatchdStoreDown alert on it) names the cause. During a rolling upgrade or after a
rollback daemons of two schema versions share one database: ``gpuwatchd_store_schema_skew``
says how far this one is from it, and ``gpuwatchd_store_writable`` whether it may
still write (GpuwatchdStoreWritesRefused). Session ends the store could not take (an
outage, a lock held past every retry) wait on disk and are counted here. Reads what the
store and the daemon keep in memory: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatchd.store.schema import SchemaState


class PendingCounts(NamedTuple):
    """Session ends waiting for the store, and those recorded late or dropped so far."""

    waiting: int = 0
    recorded_late: int = 0
    dropped: int = 0


class StoreView(Protocol):
    """What the collector reads of the store (:class:`~gpuwatchd.store.SqlStore`)."""

    @property
    def up(self) -> bool: ...

    @property
    def writable(self) -> bool: ...

    @property
    def schema(self) -> SchemaState | None: ...


class StoreCollector:
    """``gpuwatchd_store_up``, ``_writable`` and ``_schema_skew`` from ``store``; the
    pending session ends from ``pending()``."""

    name = "store"
    runs_inline = True
    timeless = True  # made from the store's flags and pending() alone

    def __init__(
        self, store: StoreView, pending: Callable[[], PendingCounts] = PendingCounts
    ) -> None:
        self._store = store
        self._pending = pending

    def version(self) -> object:
        s = self._store
        return (s.up, s.writable, s.schema, self._pending())

    def collect(self) -> Iterator[Metric]:
        s = self._store
        yield GaugeMetricFamily(
            "gpuwatchd_store_up",
            "1 if the tuning store answered the daemon's last call, else 0 (tuning waits;"
            " /api/v1/winners serves its last known winners, marked stale).",
            value=1.0 if s.up else 0.0,
        )
        yield GaugeMetricFamily(
            "gpuwatchd_store_writable",
            "1 if this daemon may write the store, else 0 (tuning waits, monitoring goes"
            " on): its schema is newer than this gpuwatchd and not compatible, or another"
            " machine holds this host name and machine id; the log says which.",
            value=1.0 if s.writable else 0.0,
        )
        schema = s.schema
        if schema is not None:
            yield GaugeMetricFamily(
                "gpuwatchd_store_schema_skew",
                "The store's schema version minus this gpuwatchd's (> 0: a newer gpuwatchd"
                " migrated it, as in a rolling upgrade or after a rollback).",
                value=float(schema.skew),
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
