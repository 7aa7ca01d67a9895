"""GpuWatch: one GPU's sample window and gate state, as the poller and the client use it."""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

import pytest
from builders import h200, idle

from gpuwatchd.gate import GateConfig, GateDecision, GateState, evaluate
from gpuwatchd.monitor.watch import GpuWatch
from gpuwatchd.telemetry.trace import load_trace
from gpuwatchd.telemetry.types import Sample

DATA = Path(__file__).parent / "data"
H200 = h200(uuid="GPU-test", slowdown_temp_c=89.0)
CFG = GateConfig()


def feed(watch: GpuWatch, samples: list[Sample]) -> list[GateDecision]:
    out = []
    for s in samples:
        watch.add(s)
        out.append(watch.judge(H200))
    return out


@pytest.mark.parametrize("trace", ["h200-matmul-burn.jsonl", "h200-daemon-burn.jsonl"])
def test_decisions_match_the_gate_run_by_hand_over_a_recorded_trace(trace: str) -> None:
    """The watch is gate.evaluate over a trimmed window with the previous decision."""
    rec = load_trace(DATA / trace)
    samples = list(rec.samples[0])
    info = rec.devices[0]
    window: deque[Sample] = deque()
    prev = None
    expected = []
    for s in samples:
        window.append(s)
        while window[0].t < s.t - CFG.window_s:
            window.popleft()
        prev = evaluate(list(window), info, CFG, prev)
        expected.append(prev)
    watch = GpuWatch(CFG)
    got = []
    for s in samples:
        watch.add(s)
        got.append(watch.judge(info))
    assert got == expected
    states = {d.state for d in got}
    assert GateState.COOL_STABLE in states and len(states) >= 3  # the trace exercises the gate


def test_window_keeps_only_window_s_and_ignores_a_reading_seen_again() -> None:
    watch = GpuWatch(dataclasses.replace(CFG, window_s=1.0))
    for i in range(30):
        assert watch.add(idle(i * 0.25))
    assert [s.t for s in watch.window] == [6.25, 6.5, 6.75, 7.0, 7.25]
    assert not watch.add(idle(7.25))  # the same reading again
    assert not watch.add(idle(7.0))  # an older one
    assert len(watch.window) == 5
    watch.cfg = dataclasses.replace(CFG, window_s=0.5)  # a reload takes effect at the next add
    watch.add(idle(7.5))
    assert [s.t for s in watch.window] == [7.0, 7.25, 7.5]


def test_repeated_readings_are_not_counted_as_evidence() -> None:
    """A client reading the daemon's latest sample twice must not reach min_samples sooner."""
    watch = GpuWatch(CFG)
    for _ in range(10):
        watch.add(idle(0.0))
        d = watch.judge(H200)
    assert d.state is GateState.WARMING and "1 sample(s)" in d.reasons[0]


def test_hysteresis_and_settle_carry_from_one_judgement_to_the_next() -> None:
    watch = GpuWatch(CFG)
    ds = feed(watch, [idle(i * 0.1) for i in range(150)])
    first = next(d for d in ds if d.open)
    assert first.t == pytest.approx(CFG.settle_s)
    assert ds[-1].since == first.t and watch.decision is ds[-1]
    hot = feed(watch, [idle(15.0 + i * 0.1, temp_c=80.0) for i in range(3)])
    assert hot[-1].state is GateState.WARMING and hot[-1].disturbed_at == pytest.approx(15.2)


def test_own_pids_are_asked_at_every_judgement() -> None:
    own: set[int] = set()
    watch = GpuWatch(CFG, own_pids=lambda: frozenset(own))
    watch.add(idle(0.0, procs=(4321,), util_gpu=0.9))
    assert watch.judge(H200).state is GateState.BUSY
    own.add(4321)
    watch.add(idle(0.1, procs=(4321,), util_gpu=0.9))
    assert watch.judge(H200).state is GateState.WARMING


def test_no_fresh_reading_is_unavailable_with_the_reason_given() -> None:
    watch = GpuWatch(CFG)
    feed(watch, [idle(i * 0.1) for i in range(20)])
    d = watch.judge(H200, lost=True)
    assert d.state is GateState.UNAVAILABLE and d.reasons == ("GPU lost",)
    d = watch.judge(H200, lost=True, why="telemetry read stalled")
    assert d.reasons == ("telemetry read stalled",) and d.since == d.disturbed_at
    assert watch.judge(H200, age_s=CFG.stale_after_s).state is GateState.WARMING
    stale = watch.judge(H200, age_s=CFG.stale_after_s + 0.1)
    assert stale.state is GateState.UNAVAILABLE


def test_max_poll_s_lets_the_window_hold_min_samples() -> None:
    watch = GpuWatch(CFG)
    step = watch.max_poll_s
    feed(watch, [idle(i * step) for i in range(40)])
    assert len(watch.window) >= CFG.min_samples
