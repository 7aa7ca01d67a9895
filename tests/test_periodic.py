"""Periodic work runs on the monotonic clock: a wall-clock step either way stalls none of
it, an overdue task is logged once and counted, and a stuck one withholds the watchdog."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from builders import wait_until
from test_daemon_fleet import _sim_config

from gpuwatchd.daemon.periodic import GRACE_S, Periodic
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.exporter.collectors.periodic import PeriodicCollector
from gpuwatchd.sessions.fleet_settings import FleetConfig


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Held:
    """A ``submit`` that holds each run until the test lets it go (or never: a hung run)."""

    def __init__(self) -> None:
        self.runs: list[Callable[[], None]] = []

    def __call__(self, run: Callable[[], None]) -> None:
        self.runs.append(run)

    def finish_all(self) -> None:
        runs, self.runs = self.runs, []
        for run in runs:
            run()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def held() -> Held:
    return Held()


def periodic(clock: Clock, held: Held) -> Periodic:
    return Periodic(clock=clock, submit=held)


def test_tasks_run_every_interval_of_the_monotonic_clock(clock: Clock, held: Held) -> None:
    p = periodic(clock, held)
    calls: list[str] = []
    p.add("tune", lambda: calls.append("tune"), 5.0)
    p.add("drift", lambda: calls.append("drift"), 10.0, first_in_s=2.0)
    assert p.run_due() == 2.0 and held.runs == []
    clock.t += 2.0
    assert p.run_due() == 3.0
    held.finish_all()
    clock.t += 3.0
    p.run_due()
    held.finish_all()
    assert calls == ["drift", "tune"]
    assert p.interval_s("tune") == 5.0 and p.interval_s("nothing") is None


def test_a_wall_clock_step_either_way_changes_nothing(
    clock: Clock, held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = periodic(clock, held)
    calls: list[float] = []
    p.add("spool", lambda: calls.append(clock.t), 1.0)
    real = time.time
    for step in (-3600.0, +3600.0, -86400.0):
        monkeypatch.setattr(time, "time", lambda step=step: real() + step)
        clock.t += 1.0
        p.run_due()
        held.finish_all()
    assert len(calls) == 3


def test_missed_runs_collapse_into_one(clock: Clock, held: Held) -> None:
    p = periodic(clock, held)
    calls: list[int] = []
    p.add("prune", lambda: calls.append(1), 1.0)
    clock.t += 10.0
    p.run_due()
    p.run_due()
    held.finish_all()
    assert calls == [1]
    assert p.run_due() == 1.0  # next due one interval after the run started


def test_a_failing_run_is_logged_and_the_task_runs_again(
    clock: Clock, held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    p = periodic(clock, held)
    calls: list[int] = []

    def boom() -> None:
        calls.append(1)
        raise RuntimeError("store said no")

    p.add("fleet-sync", boom, 1.0)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            clock.t += 1.0
            p.run_due()
            held.finish_all()
    assert calls == [1, 1, 1]
    failed = [r for r in caplog.records if "periodic task fleet-sync failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None  # once while it repeats


def test_an_overdue_task_is_logged_once_counted_and_stalls_the_watchdog(
    clock: Clock, held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    p = periodic(clock, held)
    p.add("drift", lambda: None, 10.0)
    p.add("tune", lambda: None, 1.0)
    clock.t += 10.0
    p.run_due()  # both start; the drift run hangs, the tune run finishes
    hung = held.runs.pop(0)
    held.finish_all()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            clock.t += 10.0
            p.run_due()
            held.finish_all()
            p.check()
    assert p.overdue_counts() == {"drift": 1, "tune": 0}
    warned = [r.getMessage() for r in caplog.records if "overdue" in r.getMessage()]
    assert warned == ["periodic task drift is 40 s overdue: its last run has not finished"]
    assert p.stalled(39.0) == ["drift"] and p.stalled(41.0) == []
    hung()  # it returns at last: it starts again, on time
    p.run_due()
    held.finish_all()
    assert p.check() == [] and p.stalled(60.0) == []
    clock.t += 10.0 + GRACE_S + 1  # the whole loop stalls: a new episode, counted again
    assert p.check() == ["drift", "tune"]
    assert p.overdue_counts() == {"drift": 2, "tune": 1}


def test_rescheduling_counts_the_new_interval_from_now(clock: Clock, held: Held) -> None:
    p = periodic(clock, held)
    p.add("fleet-sync", lambda: None, 60.0)
    clock.t += 30.0
    p.reschedule("fleet-sync", 5.0)
    p.reschedule("nothing", 5.0)
    assert p.interval_s("fleet-sync") == 5.0 and p.run_due() == 5.0


def test_the_counter_is_exported_per_task(clock: Clock, held: Held) -> None:
    p = periodic(clock, held)
    p.add("tune", lambda: None, 1.0)
    p.add("spool", lambda: None, 1.0)
    clock.t += 1.0 + GRACE_S + 1
    p.check()
    collector = PeriodicCollector(p.overdue_counts)
    (family,) = collector.collect()
    assert family.name == "gpuwatchd_periodic_overdue"
    samples = {s.labels["task"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert samples == {"spool": 1.0, "tune": 1.0}
    assert collector.version() == (("spool", 1), ("tune", 1))


def test_the_real_loop_runs_tasks_on_threads_and_stops() -> None:
    p = Periodic()
    ran = threading.Event()
    p.add("tune", ran.set, 0.05, first_in_s=0.0)
    p.start()
    try:
        assert wait_until(ran.is_set, 15, "a run on the loop's thread")
        assert p.running
    finally:
        p.shutdown()
    assert not p.running


# -- the daemon ----------------------------------------------------------------------------


class SteppedWallClock:
    """``time.time`` and APScheduler's ``datetime.now`` an hour behind once ``step()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = 0.0
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.offset)
        try:  # the library the daemon used before, if installed: it reads datetime.now
            import datetime

            import apscheduler.schedulers.base as base
        except ImportError:
            return
        outer = self

        class Stepped(datetime.datetime):
            @classmethod
            def now(cls, tz: datetime.tzinfo | None = None) -> Stepped:  # type: ignore[override]
                return super().now(tz) + datetime.timedelta(seconds=outer.offset)

        monkeypatch.setattr(base, "datetime", Stepped)

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    monkeypatch.setenv("GPUWATCHD_HOST", "host-under-test")
    d = Daemon(_sim_config(tmp_path, FleetConfig(sync_interval_s=1.0)))
    yield d
    d.store.close()  # run() closes it too; closing twice is harmless


def test_the_daemons_periodic_work_survives_a_backward_wall_clock_step(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    wall = SteppedWallClock(monkeypatch)
    ticks: list[str] = []
    drift, fleet = daemon.drift_tick, daemon.fleet_tick
    monkeypatch.setattr(daemon, "drift_tick", lambda: (ticks.append("drift"), drift()))
    monkeypatch.setattr(daemon, "fleet_tick", lambda: (ticks.append("fleet"), fleet()))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: "fleet" in ticks, 30, "the first fleet sync")
        wall.step(-3600.0)  # an NTP step back by an hour
        seen = len(ticks)
        wait_until(
            lambda: ticks[seen:].count("drift") >= 2 and "fleet" in ticks[seen:],
            30,
            "drift and fleet ticks after the step",
        )
        wall.step(+7200.0)  # and forward past where it was
        seen = len(ticks)
        wait_until(lambda: ticks[seen:].count("drift") >= 2, 30, "drift ticks after the step")
    finally:
        daemon.request_stop()
        thread.join(15)
    assert not thread.is_alive()


def test_a_stuck_periodic_task_withholds_the_watchdog_pings(
    daemon: Daemon, clock: Clock, held: Held, caplog: pytest.LogCaptureFixture
) -> None:
    daemon.scheduler = Periodic(clock=clock, submit=held)
    daemon.scheduler.add("drift", lambda: None, 1.0)
    clock.t += 1.0
    daemon.scheduler.run_due()  # the run hangs
    assert daemon.healthy()
    clock.t += daemon.cfg.daemon.watchdog_stall_s + 2.0
    with caplog.at_level(logging.WARNING):
        assert not daemon.healthy()
        assert not daemon.healthy()
        held.finish_all()
        daemon.scheduler.run_due()
        assert daemon.healthy()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("periodic task(s) drift stuck over 60 s") and len(lines) == 2
