"""An outage is a disturbance, never quiet time.

A GPU that falls off the bus (or whose reads stall or fail) for 30 s and comes back
must wait the whole ``settle_s`` from its return before the gate opens; before the fix
it opened ~1.5 s after the return, reporting "quiet 32.5s".
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import h200, idle

from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.monitor.watch import GpuWatch
from gpuwatchd.telemetry.backend import GpuLost
from gpuwatchd.telemetry.types import DeviceInfo, Sample

CFG = GateConfig()  # settle_s 10, window_s 5
PERIOD = 0.5


def _feed(watch: GpuWatch, start: float, end: float) -> list[tuple[float, GateState, str]]:
    """Idle readings every PERIOD from ``start`` to ``end``; each judgement's t, state, why."""
    out = []
    n = round((end - start) / PERIOD)
    for i in range(n + 1):
        t = start + i * PERIOD
        watch.add(idle(t))
        d = watch.judge(h200())
        out.append((t, d.state, "; ".join(d.reasons)))
    return out


def _first_open(judgements: list[tuple[float, GateState, str]]) -> tuple[float, str]:
    return next((t, why) for t, state, why in judgements if state is GateState.COOL_STABLE)


@pytest.mark.parametrize(
    ("lost", "why"),
    [(True, None), (True, "telemetry read stalled"), (True, "read failed: NVMLError_Unknown")],
    ids=["gpu-lost", "read-stalled", "read-failed"],
)
def test_gate_waits_settle_s_after_an_outage(lost: bool, why: str | None) -> None:
    watch = GpuWatch(CFG)
    before = _feed(watch, 0.0, 20.0)
    assert _first_open(before)[0] == pytest.approx(CFG.settle_s)  # opens on a quiet GPU
    for _ in range(60):  # 30 s of polls that bring no reading
        d = watch.judge(h200(), lost=lost, why=why)
        assert d.state is GateState.UNAVAILABLE
    back = 50.5
    after = _feed(watch, back, back + 15.0)
    opened_at, reason = _first_open(after)
    assert opened_at == pytest.approx(back + CFG.settle_s)
    assert "quiet 10.0 s" in reason
    still_shut = [why for t, state, why in after if t < back + CFG.settle_s]
    assert still_shut and all(("settling:" in w or "sample(s) in" in w) for w in still_shut)


def test_a_stale_reading_restarts_the_settle_time_too() -> None:
    watch = GpuWatch(CFG)
    _feed(watch, 0.0, 20.0)
    d = watch.judge(h200(), age_s=CFG.stale_after_s + 1.0)  # a client reading a stuck daemon
    assert d.state is GateState.UNAVAILABLE
    after = _feed(watch, 40.0, 55.0)
    assert _first_open(after)[0] == pytest.approx(40.0 + CFG.settle_s)


class _ScriptedBackend:
    """One GPU on a scripted clock: idle readings, a spell of GpuLost or errors, readings."""

    name = "scripted"

    def __init__(self, fault: BaseException, down: tuple[float, float]) -> None:
        self.t = 0.0
        self.fault = fault
        self.down = down

    def devices(self) -> list[int]:
        return [0]

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        return h200()

    def read(self, gpu: int) -> Sample:
        if self.down[0] <= self.t < self.down[1]:
            raise self.fault
        return replace(idle(self.t), gpu=gpu)

    def read_energy(self, gpu: int) -> float | None:
        return None

    def close(self) -> None:
        return None


@pytest.mark.parametrize(
    "fault", [GpuLost(0), RuntimeError("NVML: Unknown Error")], ids=["lost", "error"]
)
def test_poller_gate_after_a_gpu_comes_back(fault: BaseException) -> None:
    backend = _ScriptedBackend(fault, down=(20.0, 50.0))
    poller = Poller(backend, StateBoard(), CFG, period_s=PERIOD)  # type: ignore[arg-type]
    opened: list[float] = []
    while backend.t <= 70.0:
        snap = poller.poll(0)
        if snap.gate is not None and snap.gate.open:
            opened.append(backend.t)
        backend.t += PERIOD
    assert opened[0] == pytest.approx(CFG.settle_s)
    reopened = [t for t in opened if t >= 20.0]
    assert reopened[0] == pytest.approx(50.0 + CFG.settle_s)
