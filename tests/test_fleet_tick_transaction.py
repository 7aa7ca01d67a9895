"""The fleet tick as one transaction on a real PostgreSQL: what a rollback undoes, what a
lost connection marks, how long a batch may run, and which clock rows readers still see."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from builders import SettableClock
from store_backends import Backend, make_backend
from test_fleet_views import this_host

from gpuwatchd.daemon.fleet_sync import DEFAULT_CLOCK_MAX_AGE_S, FleetSync, in_one_transaction
from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.errors import StoreUnavailable
from gpuwatchd.store.rows import HostClock

H200 = "NVIDIA H200"


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock(1_700_000_000.0)


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request, tmp_path / "tune.db")


@pytest.fixture
def store(backend: Backend, clock: SettableClock) -> Iterator[SqlStore]:
    s = backend.open(now=clock)
    yield s
    s.close()


def stored_clocks(backend: Backend) -> list[object]:
    return [r[0] for r in backend.execute("SELECT gpu_uuid FROM host_clocks ORDER BY gpu_uuid")]


def sync_of(store: SqlStore, clock: SettableClock, max_age_s: float = 1800.0) -> FleetSync:
    board, views = this_host()
    return FleetSync(
        store, board, lambda: views, max_age_s=max_age_s, winner_max_age_s=86400.0,
        host="me", now=clock,
    )  # fmt: skip


def failing_read(store: SqlStore) -> Callable[[], None]:
    """A later step whose read the server refuses (as a statement timeout would)."""

    def step() -> None:
        try:
            with store._tx.read("read winners") as conn:
                conn.execute("SELECT 1/0")
        except StoreError:
            pass  # each step handles its own store errors, as the daemon's do

    return step


def kill_own_backend(store: SqlStore, backend: Backend) -> Callable[[], None]:
    """The server drops the batch's connection (a restart) after the steps' calls."""

    def step() -> None:
        pid = store._tx._batch.conn.raw.info.backend_pid
        backend.server.sql(backend.db, f"SELECT pg_terminate_backend({pid})")

    return step


def test_clock_writes_rolled_back_by_a_later_step_are_written_at_the_next_tick(
    store: SqlStore, backend: Backend, clock: SettableClock, caplog: pytest.LogCaptureFixture
) -> None:
    sync = sync_of(store, clock)
    with caplog.at_level(logging.WARNING, "gpuwatchd.daemon.fleet_sync"):
        in_one_transaction(store, [sync, failing_read(store)], on_rollback=[sync.rolled_back])
    assert stored_clocks(backend) == []
    assert sync.snapshot.stale  # its writes were not kept
    assert any("division by zero" in r.getMessage() for r in caplog.records)  # the cause
    clock.t += 60
    in_one_transaction(store, [sync], on_rollback=[sync.rolled_back])
    assert stored_clocks(backend) == ["GPU-me-0", "GPU-me-1"]
    assert not sync.snapshot.stale


def test_a_commit_that_fails_after_every_step_leaves_the_views_stale(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    sync = sync_of(store, clock)
    steps = [sync, kill_own_backend(store, backend)]
    in_one_transaction(store, steps, on_rollback=[sync.rolled_back])
    assert stored_clocks(backend) == [] and sync.snapshot.stale
    store.probe()  # the store is back (the daemon's store link does this)
    clock.t += 60
    in_one_transaction(store, [sync], on_rollback=[sync.rolled_back])
    assert stored_clocks(backend) == ["GPU-me-0", "GPU-me-1"]


def test_a_connection_lost_inside_a_batch_is_an_outage_and_is_not_pooled_again(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    store.probe()
    row = HostClock("h", "GPU-x", H200, 700.0, 1.4e9, clock.t)
    with pytest.raises(StoreUnavailable), store.batch(write=True):
        store.report_host_clock(row)
        kill_own_backend(store, backend)()
        with pytest.raises(StoreError):
            store.report_host_clock(row)
    assert not store.up
    assert not any(c.raw.closed for c in store._tx._idle)


def test_each_call_of_a_batch_has_its_own_bound_not_the_whole_batch(
    backend: Backend, clock: SettableClock
) -> None:
    store = backend.open(now=clock, call_timeout_s=1.0)
    errors: list[str] = []

    def step(i: int) -> Callable[[], None]:
        def run() -> None:
            try:
                store.report_host_clock(HostClock("h", f"GPU-{i}", H200, 700.0, 1.4e9, clock.t))
            except StoreError as e:
                errors.append(str(e))
            time.sleep(0.4)  # the step's own work between its calls

        return run

    try:
        in_one_transaction(store, [step(i) for i in range(4)])  # 1.6 s in all
    finally:
        store.close()
    assert errors == []
    assert stored_clocks(backend) == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]


def test_unchanged_clocks_stay_counted_by_a_reader_with_default_settings(
    store: SqlStore, clock: SettableClock
) -> None:
    """A host with long drift windows still rewrites its rows within the default age."""
    writer = sync_of(store, clock, max_age_s=10 * DEFAULT_CLOCK_MAX_AGE_S)
    for _ in range(int(DEFAULT_CLOCK_MAX_AGE_S // 60) * 2):  # an hour of syncs, unchanged
        writer()
        clock.t += 60
    medians = store.clock_medians(DEFAULT_CLOCK_MAX_AGE_S)
    assert medians and medians[0].peers == 2
