"""The daemon's tuning scheduler: gated starts, deferral reasons, outcomes, metrics."""

from __future__ import annotations

import datetime as dt
import errno
import logging
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from builders import judged, wait_until
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatchd.config import Config
from gpuwatchd.config.loader import TuningConfig
from gpuwatchd.exporter.collectors.tuning import TuningCollector
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.sessions.events import SessionEvents, SessionFinished, SessionListener
from gpuwatchd.sessions.runner import SessionOutcome
from gpuwatchd.sessions.scheduler import TuneScheduler
from gpuwatchd.store import SessionMeta, SqlStore, sqlite_store
from gpuwatchd.store.errors import StoreError
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, SessionStatus
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS

SIM_GEMM = next(w for w in DEFAULT_WORKLOADS if w.name == "sim-gemm")


def put(board: StateBoard, gpu: int, state: GateState, reasons: tuple[str, ...] = ()) -> None:
    info = DeviceInfo(index=gpu, uuid=f"GPU-{gpu}", name="Test GPU")
    health = PollHealth(True, 0.001)
    board.put(judged(gpu, info, None, state, reasons, t=0.0, since=0.0, health=health))


def request_on_open_gate(board: StateBoard, sched: TuneScheduler) -> None:
    """Open GPU 0's gate, ask for ``sim-gemm`` there and let the scheduler decide once."""
    put(board, 0, GateState.COOL_STABLE)
    sched.request(0, [SIM_GEMM], "manual")
    sched.tick()


class FakeRunner:
    """Blocks each session until released, then ends it with ``status`` and says so."""

    instances: ClassVar[list[FakeRunner]] = []

    def __init__(self, store: SqlStore, *, on_finished: SessionListener) -> None:
        self.on_finished = on_finished
        self.session_id = 1
        self.status = SessionStatus.COMPLETED
        self.release = threading.Event()
        self.started = threading.Event()
        self.preempt_seen: list[str | None] = []
        self.cancelled: str | None = None
        FakeRunner.instances.append(self)

    def pids(self) -> frozenset[int]:
        return (
            frozenset({4321})
            if self.started.is_set() and not self.release.is_set()
            else frozenset()
        )

    def cancel(self, reason: str) -> bool:
        self.cancelled = reason
        self.release.set()
        return True

    def run_session(self, spec, info, backend_name, should_preempt, **kw) -> SessionOutcome:
        self.spec = spec
        self.started.set()
        why = None
        while not self.release.wait(0.01):
            why = should_preempt()
            if why:
                self.preempt_seen.append(why)
                break
        status = SessionStatus.PREEMPTED if why else self.status
        event = SessionFinished(self.session_id, info.index, info.uuid, info.name, status, why)
        self.on_finished(event)
        return SessionOutcome(status, why, self.session_id, ())


@pytest.fixture
def setup(tmp_path: Path):
    FakeRunner.instances = []
    board = StateBoard()
    store = sqlite_store(tmp_path / "g.db")
    clock = [1000.0]
    local = [dt.datetime(2026, 11, 21, 23, 0)]
    cfg = Config(tuning=TuningConfig(check_interval_s=1.0))

    def make(cfg: Config = cfg) -> TuneScheduler:
        return TuneScheduler(
            cfg.tuning_setup(), board, store, "sim", runner_factory=FakeRunner,
            now=lambda: clock[0], local_now=lambda: local[0],
        )  # fmt: skip

    yield board, make, clock, local
    store.close()


def test_shut_gate_defers_with_the_state_as_reason_then_open_gate_starts(setup):
    board, make, _, _ = setup
    sched = make()
    put(board, 0, GateState.WARMING, ("temp 71C",))
    sched.request(0, [SIM_GEMM], "manual")
    sched.tick()
    sched.tick()
    assert sched.snapshot.deferred_total == {"warming": 2}
    assert not FakeRunner.instances
    put(board, 0, GateState.COOL_STABLE)
    sched.tick()
    runner = FakeRunner.instances[0]
    assert runner.started.wait(2)
    assert runner.spec.workloads == (SIM_GEMM,)
    assert sched.own_pids() == frozenset({4321})
    runner.release.set()
    assert wait_until(lambda: not sched.pending())
    assert wait_until(lambda: 0 not in sched.snapshot.running)


def test_one_gpu_at_a_time(setup):
    board, make, _, _ = setup
    sched = make()
    for gpu in (0, 1):
        put(board, gpu, GateState.COOL_STABLE)
        sched.request(gpu, [SIM_GEMM], "manual")
    sched.tick()
    assert len(FakeRunner.instances) == 1
    assert sched.snapshot.deferred_total == {"another_session": 1}
    FakeRunner.instances[0].release.set()
    assert wait_until(lambda: sched.pending() == {1: ("sim-gemm",)})
    sched.tick()
    assert len(FakeRunner.instances) == 2


def test_a_foreign_process_preempts_and_the_work_stays_pending(setup):
    board, make, _, _ = setup
    sched = make()
    request_on_open_gate(board, sched)
    runner = FakeRunner.instances[0]
    assert runner.started.wait(2)
    # Our own sustained load throttles the GPU: that must not stop the session.
    put(board, 0, GateState.THROTTLED, ("throttle sw_power_cap",))
    time.sleep(0.1)
    assert runner.preempt_seen == []
    put(board, 0, GateState.BUSY, ("1 foreign compute process(es) (pid 77)",))
    assert wait_until(lambda: runner.preempt_seen)
    assert "pid 77" in runner.preempt_seen[0]
    assert wait_until(lambda: 0 not in sched.snapshot.running)
    assert sched.pending() == {0: ("sim-gemm",)}


def test_failure_backs_off_before_retrying(setup):
    board, make, clock, _ = setup
    sched = make()
    request_on_open_gate(board, sched)
    runner = FakeRunner.instances[0]
    runner.status = SessionStatus.FAILED
    runner.release.set()
    assert wait_until(lambda: 0 not in sched.snapshot.running)
    sched.tick()
    assert sched.snapshot.deferred_total.get("retry_backoff") == 1
    clock[0] += 3601
    sched.tick()
    assert len(FakeRunner.instances) == 1  # one runner per GPU, reused
    assert wait_until(lambda: runner.started.is_set())


def test_quiet_hours_window(setup):
    board, make, _, local = setup
    cfg = Config(tuning=TuningConfig(windows=("01:00-05:00",)))
    sched = make(cfg)
    request_on_open_gate(board, sched)
    assert sched.snapshot.deferred_total == {"outside_window": 1}
    local[0] = dt.datetime(2026, 11, 22, 2, 30)
    sched.tick()
    assert FakeRunner.instances and FakeRunner.instances[0].started.wait(2)


def test_disabled_tuning_never_starts(setup):
    board, make, _, _ = setup
    sched = make(Config(tuning=TuningConfig(enabled=False)))
    request_on_open_gate(board, sched)
    assert not FakeRunner.instances


def test_shutdown_cancels_a_running_session(setup):
    board, make, _, _ = setup
    sched = make()
    request_on_open_gate(board, sched)
    runner = FakeRunner.instances[0]
    assert runner.started.wait(2)
    sched.shutdown(timeout=2)
    assert runner.cancelled == "daemon stopping"
    sched.tick()
    assert len(FakeRunner.instances) == 1


def test_tuning_metrics_pass_promtool(setup, tmp_path: Path):
    board, make, _, _ = setup
    sched = make()
    put(board, 0, GateState.WARMING)
    sched.request(0, [SIM_GEMM], "manual")
    sched.tick()
    reg = CollectorRegistry()
    reg.register(TuningCollector(board, lambda: sched.snapshot))
    text = generate_latest(reg).decode()
    assert 'gpuwatchd_tune_deferred_total{reason="warming"} 1.0' in text
    assert 'gpuwatchd_tune_pending_workloads{gpu="0",uuid="GPU-0"} 1.0' in text
    assert 'gpuwatchd_tune_sessions_total{status="completed"} 0.0' in text
    promtool = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


def test_finished_sessions_are_announced_and_refresh_the_tuning_snapshot(setup, tmp_path: Path):
    board, _, clock, local = setup
    store = sqlite_store(tmp_path / "events.db")
    events = SessionEvents()
    heard: list[SessionFinished] = []
    events.add_listener(heard.append)
    sched = TuneScheduler(
        Config(tuning=TuningConfig(check_interval_s=1.0)).tuning_setup(), board, store, "sim",
        runner_factory=FakeRunner, now=lambda: clock[0], local_now=lambda: local[0],
        events=events,
    )  # fmt: skip
    assert sched.events is events
    assert sched.snapshot.sessions_total.get("completed") == 0
    request_on_open_gate(board, sched)
    runner = FakeRunner.instances[0]
    assert runner.started.wait(2)
    # What a real runner does before it announces the end: the store holds the final row.
    info = board.get(0).info
    meta = SessionMeta.for_device(info, backend="sim", workloads=(SIM_GEMM,), regimes=(
        Regime.UNTHROTTLED,))  # fmt: skip
    runner.session_id = store.start_session(meta)
    store.finish_session(runner.session_id, SessionStatus.COMPLETED)
    runner.release.set()
    assert wait_until(lambda: heard)
    assert heard == [
        SessionFinished(runner.session_id, 0, "GPU-0", "Test GPU", SessionStatus.COMPLETED)
    ]
    assert heard[0].completed
    assert wait_until(lambda: sched.snapshot.sessions_total.get("completed") == 1)
    assert sched.snapshot.last_tune_unix is not None
    store.close()


def test_a_failing_listener_does_not_stop_the_others(caplog):
    events = SessionEvents()
    heard: list[int] = []

    def broken(event: SessionFinished) -> None:
        raise RuntimeError("boom")

    events.add_listener(broken)
    events.add_listener(lambda e: heard.append(e.session_id))
    events.notify(SessionFinished(7, 0, "GPU-0", "Test GPU", SessionStatus.FAILED, "crash"))
    assert heard == [7]
    assert any("session 7" in r.message for r in caplog.records)
    events.remove_listener(broken)
    events.notify(SessionFinished(8, 0, "GPU-0", "Test GPU", SessionStatus.PREEMPTED))
    assert heard == [7, 8]


class _DiskFullRunner(FakeRunner):
    """Every session fails as a full disk does: in the store, or writing a file."""

    error: ClassVar[Exception] = OSError(errno.ENOSPC, "No space left on device")

    def run_session(self, spec, info, backend_name, should_preempt, **kw) -> SessionOutcome:
        self.started.set()
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as cause:
            raise type(self).error from cause


@pytest.mark.parametrize(
    "error",
    [
        StoreError("store /var/lib/g.db: cannot start a session: database or disk is full"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_full_disk_at_runtime_is_one_line_per_session_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """Issue 26, finding 10: ~25 lines of chained traceback per tuning session."""
    FakeRunner.instances = []
    _DiskFullRunner.error = error
    board = StateBoard()
    store = sqlite_store(tmp_path / "g.db")
    clock = [1000.0]
    sched = TuneScheduler(
        Config().tuning_setup(), board, store, "sim", runner_factory=_DiskFullRunner,
        now=lambda: clock[0], local_now=lambda: dt.datetime(2026, 11, 21, 23, 0),
    )  # fmt: skip

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "tuning session" in r.getMessage()]

    try:
        with caplog.at_level(logging.INFO, logger="gpuwatchd.sessions.scheduler"):
            for k in range(2):  # two sessions, the second after the failure back-off
                request_on_open_gate(board, sched)
                assert wait_until(lambda k=k: len(failed()) == k + 1)
                assert wait_until(lambda: not sched.snapshot.running)
                clock[0] += 3601
    finally:
        store.close()
    assert len(FakeRunner.instances) == 1 and FakeRunner.instances[0].started.is_set()
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert len(failed()) == 2, [r.getMessage() for r in failed()]
    for record in failed():
        assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
        assert ("disk is full" in record.getMessage()) or ("No space left" in record.getMessage())
