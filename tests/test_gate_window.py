"""SampleWindow: the gate's spans kept in order give exactly the decisions of a sorted window.

The pinned and behavioural gate tests run again here with every window handed to the
gate as a :class:`~gpuwatchd.gate.SampleWindow`, so the fast path is pinned as tightly as
the sorting one; randomized windows (missing readings, idle samples, NaN, equal values of
both types) then compare the two paths decision by decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import test_gate
import test_gate_pinned
from builders import h200, idle

from gpuwatchd.gate import GateConfig, GateDecision, SampleWindow, evaluate
from gpuwatchd.telemetry.types import Sample, ThrottleReason

# The same tests, collected again in this module, with the windows converted below.
PINNED = {k: v for k, v in vars(test_gate_pinned).items() if k.startswith("test_")}
BEHAVIOUR = {k: v for k, v in vars(test_gate).items() if k.startswith("test_")}
assert not PINNED.keys() & BEHAVIOUR.keys()
globals().update({f"{k}__as_window": v for k, v in (PINNED | BEHAVIOUR).items()})

H200 = h200()
CFG = GateConfig()


def _as_window(window: Sequence[Sample], *args: Any, **kw: Any) -> GateDecision:
    converted = SampleWindow(window)
    assert list(converted) == list(window)
    return evaluate(converted, *args, **kw)


@pytest.fixture(autouse=True)
def _windows_are_sample_windows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(test_gate_pinned, "evaluate", _as_window)
    monkeypatch.setattr(test_gate, "evaluate", _as_window)
    yield


def _random_sample(rng: random.Random, t: float) -> Sample:
    def value(base: float, spread: float) -> float | int | None:
        roll = rng.random()
        if roll < 0.05:
            return None
        if roll < 0.07:
            return math.nan
        if roll < 0.3:
            return int(base)  # an int equal to a float of the window
        return float(round(base + rng.uniform(-spread, spread)))

    reasons = rng.choice([None, ThrottleReason(0), ThrottleReason.GPU_IDLE])
    return Sample(
        0,
        t=t,
        temp_c=value(40.0, 3.0),
        power_w=value(125.0, 40.0),
        sm_clock_mhz=value(1980.0, 60.0) if reasons is None or not reasons else value(900.0, 400.0),
        reasons=reasons,
    )


@pytest.mark.parametrize("seed", range(12))
def test_a_kept_window_decides_as_a_sorted_one(seed: int) -> None:
    """Poll by poll (one in, one out), across gaps (several out) and by hand."""
    rng = random.Random(seed)
    cfg = GateConfig(window_s=2.0, min_samples=3, settle_s=1.0)
    stepped, by_hand = SampleWindow(), SampleWindow()
    plain: list[Sample] = []
    prev_kept: GateDecision | None = None
    prev_plain: GateDecision | None = None
    t = 0.0
    for i in range(400):
        t += 0.1 if rng.random() < 0.95 else rng.uniform(0.3, 3.0)  # a stalled read now and then
        sample = _random_sample(rng, round(t, 6))
        horizon = sample.t - cfg.window_s
        stepped.advance(sample, horizon)
        by_hand.append(sample)
        plain.append(sample)
        while plain[0].t < horizon:
            assert by_hand.popleft() is plain.pop(0)
        assert list(stepped) == list(by_hand) == plain
        assert stepped.ordered == by_hand.ordered
        if stepped.ordered:
            for span in ("temp_span", "power_span", "clock_span"):
                assert getattr(stepped, span)() == getattr(by_hand, span)()
            assert stepped.clock_span(working_only=True) == by_hand.clock_span(working_only=True)
        prev_kept = evaluate(stepped, H200, cfg, prev_kept)
        prev_plain = evaluate(plain, H200, cfg, prev_plain)
        assert prev_kept == prev_plain, i


def test_spans_follow_samples_in_and_out_and_a_nan_turns_them_off() -> None:
    w = SampleWindow([idle(0.0, temp_c=41.0), idle(0.1, temp_c=39.0, power_w=None)])
    assert (w.temp_span(), w.power_span(), w.clock_span()) == ((39.0, 41.0), (125.0, 125.0),
                                                               (1980.0, 1980.0))  # fmt: skip
    w.append(idle(0.2, sm_clock_mhz=900.0, reasons=ThrottleReason.GPU_IDLE))
    assert w.clock_span() == (900.0, 1980.0)
    assert w.clock_span(working_only=True) == (1980.0, 1980.0)
    w.append(idle(0.3, temp_c=math.nan))
    assert not w.ordered
    assert w.popleft().t == 0.0
    assert w.temp_span() == (39.0, 40.0)
    w.popleft(), w.popleft()
    assert w.clock_span() is None and w.power_span() is None and w.temp_span() is None
    assert not w.ordered  # the NaN sample is still in
    w.popleft()
    assert w.ordered and len(w) == 0
    with pytest.raises(IndexError):
        w.popleft()


def test_a_gap_keeps_the_sample_exactly_at_the_horizon() -> None:
    """Several samples leave at once; one exactly ``window_s`` old stays, as in evaluate."""
    w = SampleWindow([idle(0.0), idle(0.5), idle(1.0, temp_c=45.0), idle(1.5)])
    w.advance(idle(3.0), horizon=1.0)
    assert [s.t for s in w] == [1.0, 1.5, 3.0]
    assert w.temp_span() == (40.0, 45.0)


def test_a_window_not_trimmed_to_window_s_is_judged_on_its_recent_part() -> None:
    """A reload that shrinks window_s leaves older samples in: the gate must ignore them."""
    old = [idle(t / 10, temp_c=60.0) for t in range(0, 20)]
    recent = [idle(t / 10) for t in range(100, 160)]
    cfg = GateConfig()
    prev = GateDecision(test_gate_pinned.S.COOL_STABLE, (), 15.8, 0.0, 0.0)
    assert evaluate(SampleWindow(old + recent), H200, cfg, prev) == evaluate(
        old + recent, H200, cfg, prev
    )
    assert evaluate(SampleWindow(old + recent), H200, cfg, prev).open


def test_only_append_and_popleft_change_it() -> None:
    w = SampleWindow([idle(0.0), idle(0.1)])
    for change in (
        lambda: w.appendleft(idle(-1.0)),
        lambda: w.extend([idle(0.2)]),
        lambda: w.pop(),
        lambda: w.clear(),
        lambda: w.rotate(1),
        lambda: w.__setitem__(0, idle(0.5)),
        lambda: w.__delitem__(0),
        lambda: w + w,
    ):
        with pytest.raises(TypeError, match="only append"):
            change()
    copied = w.copy()
    copied.append(idle(0.2, temp_c=50.0))
    assert isinstance(copied, SampleWindow) and copied.temp_span() == (40.0, 50.0)
    assert len(w) == 2 and w.temp_span() == (40.0, 40.0)
