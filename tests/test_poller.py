"""Poller: per-GPU threads, stall detection, loss, throttle accounting, slow fields."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import pytest
from builders import wait_until
from fakes_backend import FakeBackend

from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.replay import ReplayBackend
from gpuwatchd.telemetry.types import DeviceInfo, ThrottleReason

TRACE = Path(__file__).parent / "data" / "h200-matmul-burn.jsonl"
#: What a loaded 2-core machine may add to a thread's wake-up: a stall is noticed two
#: periods after its read began, plus at most this (generous: a bound, not a benchmark).
SCHEDULING_S = 2.0
#: How long a test looks for a stall that must come.
STALL_SEARCH_S = 15.0


def test_hanging_read_is_noticed_within_two_periods_and_others_keep_polling(caplog):
    backend = FakeBackend(gpus=2)
    board = StateBoard()
    period = 0.05
    poller = Poller(backend, board, GateConfig(), period_s=period, stall_periods=2)
    caplog.set_level(logging.ERROR, logger="gpuwatchd.monitor.poller")
    poller.start()
    try:
        assert wait_until(lambda: board.get(1) is not None and board.get(1).health.success)
        backend.hang(1)
        hung_at = time.monotonic()
        noticed_at = None
        while time.monotonic() - hung_at < STALL_SEARCH_S:
            if poller.check_stalls() == [1]:
                noticed_at = time.monotonic()
                break
            time.sleep(period / 5)
        assert noticed_at is not None, "stall never noticed"
        # It can only be noticed once the read has run 2 periods (one more for the hang to
        # start at the next poll); beyond that only the machine's load delays it.
        assert noticed_at - hung_at <= 3 * period + SCHEDULING_S
        snap = board.get(1)
        assert snap.health.stalled and not snap.health.success
        assert snap.sample is None
        assert snap.gate.state is GateState.UNAVAILABLE
        assert "stalled" in snap.gate.reasons[0]
        assert any("GPU 1" in r.message and "stuck" in r.message for r in caplog.records)
        # GPU 0 keeps polling while GPU 1 is stuck.
        before = backend.reads[0]
        assert wait_until(lambda: backend.reads[0] >= before + 3, what="GPU 0 to keep polling")
        assert board.get(0).health.success
        assert poller.longest_stall_s() >= 2 * period
    finally:
        backend.unhang(1)
        poller.stop()
    assert wait_until(lambda: backend.reads[1] > 0)


def test_the_next_stall_check_waits_for_the_next_sweep_unless_a_gpu_is_stalled():
    backend = FakeBackend(gpus=1)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=1.0, stall_periods=2)
    limit = 2.0
    poller.start()
    try:
        # Between sweeps no read is in flight and none begins before the next sweep.
        assert wait_until(lambda: poller.stall_check_due_in() > limit, 5, "sweep-aware check")
        assert poller.stall_check_due_in() <= 1.0 + limit
    finally:
        poller.stop()

    backend = FakeBackend(gpus=1)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.05, stall_periods=2)
    poller.start()
    try:
        backend.hang(0)
        assert wait_until(lambda: poller.check_stalls() == [0])
        assert poller.stall_check_due_in() <= 0.1  # re-published once per limit meanwhile
    finally:
        backend.unhang(0)
        poller.stop()


def test_a_quarantined_gpu_keeps_the_stall_check_within_one_limit():
    """A replaced sweeper may start its next read on a quarantined GPU at any moment."""
    backend = FakeBackend(gpus=1)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=1.0, stall_periods=2)
    limit = 2.0
    poller.start()
    try:
        assert wait_until(lambda: poller.stall_check_due_in() > limit, 5, "sweep-aware check")
        next(iter(poller._tracks.values())).quarantined = True
        assert poller.stall_check_due_in() <= limit
    finally:
        poller.stop()


def test_recovers_after_a_stall():
    backend = FakeBackend(gpus=1)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=0.02)
    poller.start()
    try:
        backend.hang(0)
        assert wait_until(lambda: poller.check_stalls() == [0])
        backend.unhang(0)
        assert wait_until(lambda: board.get(0).health.success and not board.get(0).health.stalled)
        assert poller.longest_stall_s() == 0.0
    finally:
        poller.stop()


def test_lost_gpu_is_unavailable_and_comes_back():
    backend = FakeBackend(gpus=2)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=0.02)
    backend.lost.add(1)
    snap1 = poller.poll(1)
    snap0 = poller.poll(0)
    assert snap1.health.lost and not snap1.health.success and snap1.sample is None
    assert snap1.gate.state is GateState.UNAVAILABLE
    assert snap0.health.success and snap0.sample is not None
    backend.lost.clear()
    snap1 = poller.poll(1)
    assert snap1.health.success and not snap1.health.lost
    assert snap1.info is not None and snap1.info.uuid == "GPU-fake-1"


def test_throttle_seconds_follow_the_replayed_h200_trace():
    clock = ManualClock()
    backend = ReplayBackend(TRACE, loop=False, clock=clock)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=0.05)
    states = []
    while clock.now() < 109.0:
        snap = poller.poll(0)
        states.append((snap.sample.t, snap.gate.state))
        clock.advance(0.05)
    capped = snap.throttle_seconds.get(ThrottleReason.SW_POWER_CAP, 0.0)
    # The matmul loop ran from 4.8 s to 64.8 s with the SW power cap set nearly throughout.
    assert 55.0 <= capped <= 60.5
    assert snap.throttle_seconds.get(ThrottleReason.HW_THERMAL_SLOWDOWN, 0.0) == 0.0
    during = [s for t, s in states if 5.2 <= t <= 64.5]
    assert GateState.COOL_STABLE not in during
    assert during.count(GateState.THROTTLED) > 0.9 * len(during)


def test_slow_reads_are_skipped_while_one_is_running():
    backend = FakeBackend(gpus=2)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=0.05)
    poller.start()
    try:
        assert wait_until(lambda: all(board.get(g) is not None for g in (0, 1)))
        poller._tracks[1].slow_busy = True  # a slow read of GPU 1 still in flight
        poller.dispatch_slow_reads()
        assert wait_until(lambda: backend.energy_calls[0] == 1)
        time.sleep(0.05)
        assert backend.energy_calls[1] == 0
        assert wait_until(lambda: board.get(0).energy_j == 1000.0)
    finally:
        poller.stop()


def test_fast_poll_never_reads_the_energy_counter():
    backend = FakeBackend(gpus=1)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.01)
    for _ in range(20):
        poller.poll(0)
    assert backend.energy_calls[0] == 0


def test_own_pids_reach_the_gate():
    """Our process on the GPU is no foreign job, another is; an idle reading never asks."""
    backend = FakeBackend(gpus=1)
    procs = [(123,)]
    read = backend.read
    backend.read = lambda gpu: dataclasses.replace(read(gpu), procs=procs[0])  # type: ignore[method-assign]
    asked = []

    def own() -> frozenset[int]:
        asked.append(True)
        return frozenset({123})

    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.01, own_pids=own)
    assert poller.poll(0).gate.state is not GateState.BUSY
    assert asked
    procs[0] = (123, 456)
    decision = poller.poll(0).gate
    assert decision.state is GateState.BUSY
    assert "(pid 456)" in decision.reasons[0]
    procs[0] = ()
    asked.clear()
    poller.poll(0)
    assert not asked


@pytest.mark.parametrize("listener_fails", [False, True])
def test_listeners_get_every_snapshot_and_a_failing_one_is_contained(listener_fails):
    backend = FakeBackend(gpus=1)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.01)
    got = []

    def listener(snap):
        got.append(snap.index)
        if listener_fails:
            raise RuntimeError("boom")

    poller.add_listener(listener)
    poller.poll(0)
    poller.poll(0)
    assert got == [0, 0]


def test_every_backend_gives_the_poller_its_static_facts(tmp_path):
    """The poller asks device_info(gpu, refresh=True); a backend that cannot take it
    would leave every GPU without limits and thresholds (and the gate on fallbacks)."""
    from gpuwatchd.telemetry.sim import SimBackend

    for backend in (
        ReplayBackend(TRACE, loop=False, clock=ManualClock()),
        SimBackend(gpus=1, clock=ManualClock()),
        FakeBackend(gpus=1),
    ):
        snap = Poller(backend, StateBoard(), GateConfig(), period_s=0.05).poll(0)
        assert snap.info is not None, backend.name
        assert snap.info.power_limit_w == 700.0 and snap.info.slowdown_temp_c == 89.0


class _InfoHangs(FakeBackend):
    """A backend whose static-facts read blocks while ``info_release`` is clear."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus)
        self.info_release = threading.Event()
        self.info_release.set()

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        self.info_release.wait(30.0)
        return super().device_info(gpu, refresh)


def _stall_noticed(poller: Poller, gpu: int, within_s: float) -> float | None:
    """Seconds until check_stalls() reports ``gpu`` (called as the daemon's loop does)."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if gpu in poller.check_stalls():
            return time.monotonic() - started
        time.sleep(0.005)
    return None


def test_a_hung_first_static_facts_read_is_a_stall():
    backend = _InfoHangs(gpus=2)
    backend.info_release.clear()  # the first poll's device_info never returns
    board = StateBoard()
    period = 0.05
    poller = Poller(backend, board, GateConfig(), period_s=period, stall_periods=2)
    poller.start()
    try:
        noticed = _stall_noticed(poller, 0, within_s=STALL_SEARCH_S)
        assert noticed is not None, "a hung device_info was never reported stalled"
        assert noticed <= 2 * period + SCHEDULING_S
        assert poller.longest_stall_s() >= 2 * period  # what stops the watchdog pings
        snap = board.get(0)
        assert snap is not None and snap.health.stalled and not snap.health.success
    finally:
        backend.info_release.set()
        poller.stop()


def test_a_hung_static_facts_read_after_a_gpu_returns_is_a_stall(caplog):
    backend = _InfoHangs(gpus=1)
    board = StateBoard()
    period = 0.05
    poller = Poller(backend, board, GateConfig(), period_s=period, stall_periods=2)
    backend.lost.add(0)
    poller.start()
    try:
        assert wait_until(lambda: board.get(0) is not None and board.get(0).health.lost)
        backend.info_release.clear()
        backend.lost.clear()  # it answers again: the poll re-reads its facts, which hang
        noticed = _stall_noticed(poller, 0, within_s=STALL_SEARCH_S)
        assert noticed is not None, "a hung device_info was never reported stalled"
        caplog.set_level(logging.WARNING, logger="gpuwatchd.monitor.poller")
        backend.info_release.set()
        assert wait_until(lambda: poller.longest_stall_s() == 0.0 and board.get(0).health.success)
        assert any("returned after" in r.message for r in caplog.records)
    finally:
        backend.info_release.set()
        poller.stop()
