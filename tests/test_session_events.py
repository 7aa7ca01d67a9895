"""The runner announces every session it ends, once the store holds the final row."""

from __future__ import annotations

import sys

import pytest

from gpuwatchd.sessions.events import SessionEvents, SessionFinished
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.session_spec import SessionSpec
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload

INFO = DeviceInfo(index=0, uuid="cpu-0", name="test cpu")
WL = Workload("mm", "matmul", {"m": 64, "n": 64, "k": 64}, "fp32", ("cpu.matmul",))
SPEC = SessionSpec(0, "cpu-0", "cpu", (WL,), (Regime.UNTHROTTLED,))
CRASH = [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"]


def test_a_finished_session_is_announced_after_its_row_is_final(store: SqlStore) -> None:
    seen: list[tuple[SessionFinished, SessionStatus | None]] = []

    def listener(event: SessionFinished) -> None:
        row = store.session(event.session_id)
        seen.append((event, row.status if row is not None else None))

    events = SessionEvents()
    events.add_listener(listener)
    runner = TuneRunner(store, worker_cmd=CRASH, on_finished=events.notify)
    out = runner.run_session(SPEC, INFO, "sim", lambda: None, None, 20)
    assert out.status is SessionStatus.FAILED
    [(event, stored)] = seen
    names = tuple(w.name for w in SPEC.workloads)
    assert event == SessionFinished(
        out.session_id, 0, "cpu-0", "test cpu", SessionStatus.FAILED, out.why, names
    )
    assert stored is SessionStatus.FAILED and not event.completed


def test_a_failing_listener_does_not_fail_the_session(store: SqlStore) -> None:
    def broken(event: SessionFinished) -> None:
        raise RuntimeError("listener bug")

    runner = TuneRunner(store, worker_cmd=CRASH, on_finished=broken)
    out = runner.run_session(SPEC, INFO, "sim", lambda: None, None, 20)
    assert out.status is SessionStatus.FAILED
    assert store.session(out.session_id).status is SessionStatus.FAILED  # type: ignore[union-attr]


def test_no_announcement_when_the_store_cannot_end_the_session(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    heard: list[SessionFinished] = []

    def refuse(*args: object, **kw: object) -> None:
        raise StoreError("disk full")

    monkeypatch.setattr(store, "finish_session", refuse)
    runner = TuneRunner(store, worker_cmd=CRASH, on_finished=heard.append)
    runner.run_session(SPEC, INFO, "sim", lambda: None, None, 20)
    assert heard == []
