"""The scheduler and users' work: a user kernel is planned as CUDA work behind the gate,
asked for again while it is being tuned it stays queued, and it can be withdrawn.

On the simulated GPU no user kernel can run, so the runner here records the job it is
handed and ends it as told.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from builders import judged
from user_kernels_fakes import sample_request

from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.sessions.events import SessionFinished, SessionListener
from gpuwatchd.sessions.runner import SessionOutcome
from gpuwatchd.sessions.scheduler import TuneScheduler
from gpuwatchd.store import SqlStore, sqlite_store
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.settings import TuningConfig, TuningSetup
from gpuwatchd.tuning.types import SessionStatus

SIM = DeviceInfo(0, "GPU-sim-0", "NVIDIA H200 (simulated)", max_sm_clock_mhz=1980.0)
USER = sample_request(gpu_model=SIM.name).to_workload()


class RecordingRunner:
    """Holds each session until ``release`` is set; ends it COMPLETED and says so."""

    made: list[RecordingRunner] = []  # noqa: RUF012

    def __init__(self, store: SqlStore, *, on_finished: SessionListener) -> None:
        self.on_finished = on_finished
        self.specs: list[Any] = []
        self.started = threading.Event()
        self.release = threading.Event()
        RecordingRunner.made.append(self)

    def pids(self) -> frozenset[int]:
        return frozenset()

    def cancel(self, reason: str) -> bool:
        self.release.set()
        return True

    def run_session(self, spec: Any, info: DeviceInfo, *_a: Any, **_kw: Any) -> SessionOutcome:
        self.specs.append(spec)
        self.started.set()
        self.release.wait(5)
        names = tuple(w.name for w in spec.workloads)
        status = SessionStatus.COMPLETED
        self.on_finished(SessionFinished(1, info.index, info.uuid, info.name, status, None, names))
        return SessionOutcome(status, None, 1, ())


@pytest.fixture
def sched(tmp_path: Path) -> TuneScheduler:
    RecordingRunner.made = []
    board = StateBoard()
    board.put(judged(0, SIM, None, GateState.COOL_STABLE, health=PollHealth(True, 0.001)))
    setup = TuningSetup(tuning=TuningConfig(allowed_modules=("user_kernels",)))
    return TuneScheduler(
        setup, board, sqlite_store(tmp_path / "s.db"), "sim", runner_factory=RecordingRunner
    )


def wait_idle(sched: TuneScheduler) -> None:
    for _ in range(500):
        if not sched.snapshot.running:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the session did not end")


def test_a_user_kernel_is_planned_as_cuda_work_at_the_open_gate(sched: TuneScheduler) -> None:
    sched.request(0, [USER], "user kernel request")
    sched.tick()
    runner = RecordingRunner.made[0]
    assert runner.started.wait(2)
    spec = runner.specs[0]
    assert spec.device == "cuda" and spec.gpu_uuid == SIM.uuid
    assert [w.name for w in spec.workloads] == [USER.name]
    assert {r.value for r in spec.regimes} == {"unthrottled", "sustained"}
    assert spec.allowed_modules == ("user_kernels",)  # the config's list, not the workload's
    assert "allowed_modules" not in spec.workloads[0].params
    runner.release.set()
    wait_idle(sched)
    assert sched.pending() == {}


def test_asked_for_again_while_being_tuned_it_stays_queued(sched: TuneScheduler) -> None:
    sched.request(0, [USER], "user kernel request")
    sched.tick()
    runner = RecordingRunner.made[0]
    assert runner.started.wait(2)
    sched.request(0, [USER], "no winner yet")
    runner.release.set()
    wait_idle(sched)
    assert sched.pending() == {0: (USER.name,)}


def test_withdraw_takes_waiting_work_off_the_named_gpus(sched: TuneScheduler) -> None:
    sched.request(0, [USER], "a")
    sched.request(1, [USER], "a")
    sched.withdraw([USER.name], gpus=[1])
    assert sched.pending() == {0: (USER.name,)}
    sched.withdraw([USER.name])
    assert sched.pending() == {}
