"""What the tuning metrics count: this daemon's sessions only, and the last tune per GPU."""

from __future__ import annotations

from pathlib import Path

from builders import judged
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatchd.config import Config
from gpuwatchd.exporter.collectors.tuning import TuningCollector
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.sessions.events import SessionFinished
from gpuwatchd.sessions.scheduler import TuneScheduler
from gpuwatchd.store import SessionMeta, SqlStore, sqlite_store
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, SessionStatus

T0 = 1_750_000_000.0


def _board() -> StateBoard:
    board = StateBoard()
    for gpu in (0, 1):
        info = DeviceInfo(index=gpu, uuid=f"GPU-{gpu}", name="Test GPU")
        health = PollHealth(True, 0.001)
        board.put(judged(gpu, info, None, GateState.WARMING, (), t=0.0, since=0.0, health=health))
    return board


def _finish(store: SqlStore, uuid: str, status: SessionStatus, ended_at: float) -> int:
    meta = SessionMeta(gpu_uuid=uuid, gpu_index=0, gpu_model="Test GPU", backend="sim",
                       workloads=(), regimes=(Regime.UNTHROTTLED,))  # fmt: skip
    sid = store.start_session(meta)
    store.finish_session(sid, status, ended_at=ended_at)
    return sid


def _exposition(board: StateBoard, sched: TuneScheduler) -> str:
    registry = CollectorRegistry()
    registry.register(TuningCollector(board, lambda: sched.snapshot))
    return generate_latest(registry).decode()


def test_sessions_counted_are_the_daemons_and_last_tune_is_per_gpu(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "g.db", now=lambda: T0)
    try:
        # A standalone `gpuwatchd tune` on the shared store, before the daemon started.
        _finish(store, "GPU-1", SessionStatus.COMPLETED, T0 + 10.0)
        _finish(store, "GPU-1", SessionStatus.PREEMPTED, T0 + 20.0)
        board = _board()
        sched = TuneScheduler(Config().tuning_setup(), board, store, "sim")
        text = _exposition(board, sched)
        assert 'gpuwatchd_tune_sessions_total{status="completed"} 0.0' in text
        assert 'gpuwatchd_tune_sessions_total{status="preempted"} 0.0' in text
        # GPU 1 was tuned (by whoever); GPU 0 never was: no series, not a zero.
        assert 'gpuwatchd_last_tune_timestamp_seconds{gpu="1",uuid="GPU-1"} 1.75000001e+09' in (
            text
        )
        assert 'last_tune_timestamp_seconds{gpu="0"' not in text

        # The daemon's own runner ends a session on GPU 0.
        sid = _finish(store, "GPU-0", SessionStatus.COMPLETED, T0 + 30.0)
        sched.events.notify(SessionFinished(sid, 0, "GPU-0", "Test GPU", SessionStatus.COMPLETED))
        text = _exposition(board, sched)
        assert 'gpuwatchd_tune_sessions_total{status="completed"} 1.0' in text
        assert 'gpuwatchd_last_tune_timestamp_seconds{gpu="0",uuid="GPU-0"} 1.75000003e+09' in (
            text
        )
    finally:
        store.close()
