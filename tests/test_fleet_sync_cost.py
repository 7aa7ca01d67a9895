"""A fleet sync's reads do not grow with the fleet: the clock medians are kept in the
store and recomputed by one host per interval, and only this host's GPU models are read
(real PostgreSQL: SQLite stores hold one host's clocks and compute them in Python)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pg_server import PostgresServer

from gpuwatchd.store import HostClock, SqlStore
from gpuwatchd.store.postgres import postgres_store

H200, L4 = "NVIDIA H200", "NVIDIA L4"
MHZ = 1e6
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def store(postgres_server: PostgresServer, clock: Clock) -> Iterator[SqlStore]:
    s = postgres_store(postgres_server.url(postgres_server.new_database()), now=clock)
    yield s
    s.close()


def _report(store: SqlStore, clock: Clock, host: str, mhz: float, model: str = H200) -> None:
    store.report_host_clock(HostClock(host, f"GPU-{host}", model, 700.0, mhz * MHZ, clock.t))


def test_the_medians_are_kept_and_recomputed_once_they_are_an_interval_old(
    store: SqlStore, clock: Clock
) -> None:
    for host, mhz in (("a", 1400), ("b", 1440), ("c", 1450)):
        _report(store, clock, host, mhz)
    _report(store, clock, "l4", 1200, model=L4)
    (first,) = store.clock_medians(1800, gpu_models=[H200], kept_for_s=60)
    assert (first.gpu_model, first.median_hz, first.peers) == (H200, 1440 * MHZ, 3)
    clock.t += 30
    _report(store, clock, "d", 1000)  # a slow newcomer: counted at the next recompute
    assert store.clock_medians(1800, gpu_models=[H200], kept_for_s=60) == [first]
    clock.t += 31  # the kept medians are over an interval old: this sync recomputes them
    (now,) = store.clock_medians(1800, gpu_models=[H200], kept_for_s=60)
    assert (now.median_hz, now.peers) == (1420 * MHZ, 4)
    assert [m.gpu_model for m in store.clock_medians(1800, gpu_models=[L4], kept_for_s=60)] == [L4]
    assert store.clock_medians(1800, gpu_models=[], kept_for_s=60) == []
    # Read-only readers (the report) compute them, all models at once.
    assert {m.gpu_model for m in store.clock_medians(1800)} == {H200, L4}
