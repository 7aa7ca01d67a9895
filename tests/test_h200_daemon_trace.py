"""The gate against a trace recorded by gpuwatchd's own nvml backend on a lent H200.

tests/data/h200-daemon-burn.jsonl (bench/gpu_daemon_check.py, 2026-11-22): idle, a child
process runs bf16 8192^3 matmuls from t=20.6 s to 51.3 s (power-capped, 0x4), exits,
idle again. Unlike the shared trace, this one carries utilization and the number of
compute processes, so a real job shows up as a foreign process: ``busy`` outranks
``throttled``. (At t=73.6 s some other process on the host opened the GPU.)
"""

from __future__ import annotations

from pathlib import Path

from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.replay import ReplayBackend
from gpuwatchd.telemetry.trace import load_trace
from gpuwatchd.telemetry.types import ThrottleReason

TRACE = Path(__file__).parent / "data" / "h200-daemon-burn.jsonl"


def replay(cfg: GateConfig) -> list[tuple[float, GateState, bool]]:
    clock = ManualClock()
    backend = ReplayBackend(TRACE, loop=False, clock=clock)
    poller = Poller(backend, StateBoard(), cfg, period_s=0.05)
    out = []
    while not backend.finished:
        snap = poller.poll(0)
        out.append((snap.sample.t, snap.gate.state, bool(snap.sample.procs)))
        clock.advance(0.05)
    return out


def test_a_real_job_keeps_the_gate_busy_and_it_reopens_only_after_settling():
    trace = load_trace(TRACE)
    samples = trace.samples[0]
    first_proc = next(s.t for s in samples if s.procs)
    exit_t = next(s.t for s in samples if s.t > first_proc and not s.procs)
    cfg = GateConfig()
    states = replay(cfg)
    with_job = [st for t, st, procs in states if procs]
    assert with_job and all(st is GateState.BUSY for st in with_job)
    opened = [t for t, st, _ in states if st is GateState.COOL_STABLE]
    assert not [t for t in opened if first_proc <= t < exit_t]
    reopened = next(t for t, st, _ in states if t > exit_t and st is GateState.COOL_STABLE)
    assert reopened - exit_t >= cfg.settle_s
    # The die needs ~3 s to cool back (docs/design.md), then the window must forget the spread.
    assert reopened - exit_t <= cfg.settle_s + cfg.window_s + 4.0
    # Open before the job: idle at 345 MHz with GPU_IDLE is not a throttle.
    assert any(st is GateState.COOL_STABLE for t, st, _ in states if t < first_proc)


def test_power_cap_seconds_match_the_recorded_load():
    clock = ManualClock()
    backend = ReplayBackend(TRACE, loop=False, clock=clock)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.05)
    while not backend.finished:
        snap = poller.poll(0)
        clock.advance(0.05)
    capped = snap.throttle_seconds[ThrottleReason.SW_POWER_CAP]
    assert 28.0 <= capped <= 31.0  # the loop ran 30.7 s, capped from its first 0.4 s on
