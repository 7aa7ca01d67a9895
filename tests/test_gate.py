"""The stability gate: unit cases per state and reason, hysteresis, config validation,
and the real H200 matmul trace replayed sample by sample."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest
from builders import h200, idle

from gpuwatchd.gate import GateConfig, GateDecision, GateState, evaluate
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.replay import ReplayBackend
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

H200_TRACE = Path(__file__).parent / "data" / "h200-matmul-burn.jsonl"
H200 = h200(uuid="GPU-test", slowdown_temp_c=89.0)  # default margin 15 C: limit 74 C, reopen 71
CFG = GateConfig()
S = GateState
R = ThrottleReason


def run(
    samples: Iterable[Sample],
    cfg: GateConfig = CFG,
    info: DeviceInfo | None = H200,
    own_pids: frozenset[int] = frozenset(),
    prev: GateDecision | None = None,
) -> list[GateDecision]:
    """Feed samples one by one as the poller does (a deque per GPU), return every decision."""
    window: deque[Sample] = deque(maxlen=200)
    out = []
    for s in samples:
        window.append(s)
        prev = evaluate(window, info, cfg, prev, own_pids)
        out.append(prev)
    return out


def steady(t0: float, t1: float, step: float = 0.1, **kw: object) -> list[Sample]:
    n = round((t1 - t0) / step)
    return [idle(t0 + i * step, **kw) for i in range(n)]


def opened(decisions: list[GateDecision]) -> GateDecision:
    return next(d for d in decisions if d.open)


# --------------------------------------------------------------------------- states


def test_quiet_gpu_opens_after_settle_time_from_the_first_sample() -> None:
    ds = run(steady(0.0, 15.0))
    first = opened(ds)
    assert first.t == pytest.approx(CFG.settle_s)
    assert all(not d.open for d in ds if d.t < CFG.settle_s)
    assert all(d.open for d in ds if d.t >= first.t)
    assert first.state is S.COOL_STABLE and "temp 40 C" in first.reasons[0]
    assert first.since == first.t and ds[-1].since == first.t
    assert ds[2].state is S.WARMING and "need 5" in ds[2].reasons[0]  # too few samples
    assert "settling" in ds[20].reasons[0]


def _open_then(last: Sample, **cfg_kw: object) -> GateDecision:
    """Decision for ``last`` after 15 s of quiet, so only ``last`` can shut the gate."""
    cfg = dataclasses.replace(CFG, **cfg_kw)  # type: ignore[arg-type]
    ds = run([*steady(0.0, 15.0), last], cfg)
    assert ds[-2].open
    return ds[-1]


@pytest.mark.parametrize(
    ("last", "state", "needle"),
    [
        (idle(15.0, procs=(4242,)), S.BUSY, "1 foreign compute process(es) (pid 4242)"),
        (idle(15.0, util_gpu=0.37), S.BUSY, "util 37.0%; needs ≤"),
        (idle(15.0, reasons=R.SW_POWER_CAP, sm_clock_mhz=1500.0), S.THROTTLED, "sw_power_cap"),
        (idle(15.0, reasons=R.HW_SLOWDOWN | R.SW_THERMAL_SLOWDOWN), S.THROTTLED,
         "hw_slowdown+sw_thermal_slowdown"),
        (idle(15.0, sm_clock_mhz=1200.0, power_w=600.0, reasons=None), S.THROTTLED,
         "< 75% of max 1980 MHz under load"),
        (idle(15.0, temp_c=76.0), S.WARMING,
         "temp 76 C; needs ≤ 74 C (temp_margin_c 15 C below slowdown 89 C)"),
        (idle(15.0, sm_clock_mhz=885.0), S.WARMING,
         "SM clock 885 MHz = 45% of max 1980 MHz; needs ≥ 95%"),
        (idle(15.0, power_w=350.0), S.WARMING, "power 350 W = 50% of limit 700 W; needs ≤ 40%"),
        (idle(15.0, power_w=170.0), S.WARMING, "power spread 125-170 W; needs ≤ 35 W"),
        (idle(15.0, temp_c=44.0), S.WARMING, "temp spread 40-44 C; needs ≤ 3 C"),
    ],
)  # fmt: skip
def test_each_state_and_reason(last: Sample, state: GateState, needle: str) -> None:
    d = _open_then(last)
    assert d.state is state
    assert any(needle in r for r in d.reasons), d.reasons
    assert d.disturbed_at == last.t and d.since == last.t


def test_unavailable_beats_everything() -> None:
    window = steady(0.0, 15.0, reasons=R.SW_POWER_CAP, procs=(1,))
    d = evaluate(window, H200, CFG, None, lost=True)
    assert d.state is S.UNAVAILABLE and d.reasons == ("GPU lost",)
    prev = run(steady(0.0, 15.0))[-1]
    d = evaluate([], H200, CFG, prev)
    assert (d.state, d.reasons, d.t) == (S.UNAVAILABLE, ("no samples",), prev.t)
    d = evaluate(steady(0.0, 15.0), H200, CFG, prev, now=20.0)
    assert d.state is S.UNAVAILABLE and d.reasons[0].startswith("last sample 5.1s old")
    assert evaluate(steady(0.0, 15.0), H200, CFG, prev, now=15.5).open  # fresh enough
    d = evaluate([*steady(0.0, 15.0), idle(15.0, temp_c=None)], H200, CFG, prev)
    assert (d.state, d.reasons) == (S.UNAVAILABLE, ("no temperature reading",))
    # Coming back needs the full settle time again, from the first reading after the spell.
    back = run(steady(15.2, 30.0), prev=d)
    assert opened(back).t == pytest.approx(15.2 + CFG.settle_s)


def test_busy_outranks_throttled() -> None:
    d = _open_then(idle(15.0, procs=(9,), reasons=R.SW_POWER_CAP, power_w=690.0))
    assert d.state is S.BUSY and len(d.reasons) == 1


def test_own_processes_do_not_make_the_gate_busy() -> None:
    own = frozenset({77})
    quiet = steady(0.0, 15.0)
    # Our worker alone, even at full utilization: not busy (power/heat are judged as usual).
    d = run([*quiet, idle(15.0, procs=(77,), util_gpu=1.0)], own_pids=own)[-1]
    assert d.open
    # Utilization without a process list while our worker runs is attributed to it.
    d = run([*quiet, idle(15.0, util_gpu=1.0)], own_pids=own)[-1]
    assert d.open
    # A foreign process next to ours is busy, and so is utilization when ours is absent.
    d = run([*quiet, idle(15.0, procs=(77, 4242), util_gpu=1.0)], own_pids=own)[-1]
    assert d.state is S.BUSY and "pid 4242" in d.reasons[0]
    d = run([*quiet, idle(15.0, procs=(), util_gpu=1.0)], own_pids=own)[-1]
    assert d.state is S.BUSY and "util 100.0%" in d.reasons[0]


def test_idle_parked_clock_is_not_warming() -> None:
    # Many GPUs park their clock when idle and say so with GPU_IDLE.
    ds = run(steady(0.0, 15.0, sm_clock_mhz=345.0, reasons=R.GPU_IDLE))
    assert ds[-1].open
    # A parked clock hopping between idle levels is not jitter either.
    hop = [idle(i * 0.1, sm_clock_mhz=210.0 + 135.0 * (i % 2), reasons=R.GPU_IDLE)
           for i in range(150)]  # fmt: skip
    assert run(hop)[-1].open
    # The same low clock without GPU_IDLE is a clock that has not ramped up yet.
    assert run(steady(0.0, 15.0, sm_clock_mhz=885.0))[-1].state is S.WARMING


def test_clock_jitter_keeps_the_gate_shut() -> None:
    wobbly = [idle(i * 0.1, sm_clock_mhz=1980.0 - 60.0 * (i % 2)) for i in range(150)]
    d = run(wobbly)[-1]
    assert d.state is S.WARMING and any("SM clock spread 1920-1980 MHz" in r for r in d.reasons)


def test_max_temp_fallback_without_slowdown_temperature() -> None:
    no_slowdown = dataclasses.replace(H200, slowdown_temp_c=None)
    for info in (None, no_slowdown):
        d = run([*steady(0.0, 15.0, temp_c=76.0)], info=info)[-1]
        assert d.state is S.WARMING and "max_temp_c 75 C" in d.reasons[0]
        assert run(steady(0.0, 15.0, temp_c=70.0), info=info)[-1].open


def test_samples_older_than_the_window_are_ignored() -> None:
    # A clock dip at t=0 is SM jitter while it is inside the 5 s window, and only then.
    ds = run([idle(0.0, sm_clock_mhz=885.0), *steady(0.1, 20.0)])
    at = {round(d.t, 1): d for d in ds}
    assert any("SM clock spread 885-1980 MHz" in r for r in at[5.0].reasons)
    assert at[5.1].reasons[0].startswith("settling: 0.1s")
    assert opened(ds).t == pytest.approx(5.0 + CFG.settle_s)


# ----------------------------------------------------------------- settle, hysteresis


def test_gate_reopens_only_after_settle_time() -> None:
    samples = [*steady(0.0, 15.0), idle(15.0, reasons=R.SW_POWER_CAP), *steady(15.1, 40.0)]
    ds = run(samples)
    after = [d for d in ds if d.t > 15.0]
    assert all(not d.open for d in after if d.t < 15.0 + CFG.settle_s - 1e-9)
    assert opened(after).t == pytest.approx(25.0)
    assert opened(after).disturbed_at == 15.0


# Level hysteresis in isolation: a wide temperature-spread allowance.
HYST = dataclasses.replace(CFG, temp_jitter_max_c=20.0)


def between(ds: list[GateDecision], t0: float, t1: float) -> list[GateDecision]:
    return [d for d in ds if t0 - 1e-9 <= d.t < t1 - 1e-9]


def test_temperature_hysteresis() -> None:
    # Open at 70 C. At the limit (74 C) it stays open; crossing it shuts the gate; back
    # at 73 C it stays shut (reopening needs 71 C) without restarting the settle timer.
    ds = run(
        [
            *steady(0.0, 15.0, temp_c=70.0),
            *steady(15.0, 20.0, temp_c=74.0),
            idle(20.0, temp_c=75.0),
            *steady(20.1, 45.0, temp_c=73.0),
            idle(45.0, temp_c=71.0),
        ],
        HYST,
    )
    assert between(ds, 10.0, 15.0)[0].open
    assert all(d.open for d in between(ds, 10.0, 20.0))
    shut = between(ds, 20.0, 45.0)
    assert not any(d.open for d in shut)
    assert (
        shut[0]
        .reasons[0]
        .startswith("temp 75 C; needs ≤ 74 C (temp_margin_c 15 C below slowdown 89 C)")
    )
    assert shut[-1].reasons[0] == (
        "temp 73 C; needs ≤ 71 C to reopen (temp_margin_c 15 C below slowdown 89 C)"
    )
    assert shut[-1].disturbed_at == 20.0  # the band delays opening but is no disturbance
    assert ds[-1].open and ds[-1].t == 45.0


def test_noise_at_a_limit_does_not_flap() -> None:
    ds = run(
        [
            *steady(0.0, 15.0, temp_c=70.0),
            *[idle(15.0 + i * 0.1, temp_c=73.0 + (i % 2)) for i in range(100)],
            *[idle(25.0 + i * 0.1, temp_c=74.0 + (i % 2)) for i in range(300)],
        ],
        HYST,
    )
    assert all(d.open for d in between(ds, 10.0, 25.0))  # below or at the limit: open
    states = [d.open for d in between(ds, 25.0, 55.0)]  # straddling it: shuts once, for good
    assert sum(a != b for a, b in itertools.pairwise(states)) == 1 and not states[-1]


def test_utilization_hysteresis_is_busy_without_disturbance() -> None:
    ds = run(
        [
            *steady(0.0, 30.0),
            idle(30.0, util_gpu=0.10),  # a blip over 5%: busy, and a disturbance
            *steady(30.1, 45.0, util_gpu=0.045),  # 4.5%: fine when open, over 4% to reopen
            idle(45.0, util_gpu=0.03),
        ]
    )
    band = between(ds, 30.0, 45.0)
    assert band[0].state is S.BUSY and band[0].disturbed_at == 30.0
    assert all(d.state is S.BUSY for d in band)
    assert band[-1].disturbed_at == 30.0 and band[-1].reasons == (
        "util 4.5%; needs ≤ 4.0% to reopen (util_max 5.0%)",
    )
    assert ds[-1].open
    # The same 4.5% never shuts a gate that is already open.
    assert run([*steady(0.0, 15.0), *steady(15.0, 20.0, util_gpu=0.045)])[-1].open


# -------------------------------------------------------------------------- config


def test_default_config_is_valid_and_from_mapping_converts_numbers() -> None:
    cfg = GateConfig.from_mapping({"settle_s": 20, "util_max": 0.1, "min_samples": 3})
    assert cfg.settle_s == 20.0 and isinstance(cfg.settle_s, float)
    assert (cfg.util_max, cfg.min_samples) == (0.1, 3)
    assert GateConfig.from_mapping({}) == GateConfig()


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"settle": 10}, "gate.settle: unknown key"),
        ({"window_s": "5s"}, "gate.window_s: expected a number, got '5s'"),
        ({"window_s": True}, "gate.window_s: expected a number"),
        ({"window_s": 0}, "gate.window_s: must be > 0"),
        ({"min_samples": 2.5}, "gate.min_samples: expected a whole number"),
        ({"min_samples": 0}, "gate.min_samples: must be >= 1"),
        ({"clock_ratio_min": 1.5}, "gate.clock_ratio_min: must be > 0 and <= 1"),
        ({"hyst_ratio": 1}, "gate.hyst_ratio: must be >= 0 and < 1"),
        ({"settle_s": -1}, "gate.settle_s: must be >= 0"),
        ({"temp_margin_c": float("nan")}, "gate.temp_margin_c: expected a finite number"),
        ({"clock_ratio_throttled": 0.97}, "gate.clock_ratio_throttled: must be <= clock_ratio"),
    ],
)
def test_config_errors_name_the_key(table: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        GateConfig.from_mapping(table)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"gate\.util_max: must be >= 0 and <= 1"):
        GateConfig(util_max=5.0)


# ------------------------------------------------------------- the real H200 trace

FAST = GateConfig(window_s=1.0, settle_s=2.0)


def replay_gate(cfg: GateConfig) -> tuple[list[Sample], list[GateDecision], ReplayBackend]:
    """Poll the replayed trace at 40 Hz (faster than its 20 Hz) and gate every new sample."""
    clock = ManualClock()
    backend = ReplayBackend(H200_TRACE, loop=False, clock=clock)
    info = backend.device_info(0)
    window: deque[Sample] = deque(maxlen=round(cfg.window_s / 0.05) + 20)
    samples: list[Sample] = []
    decisions: list[GateDecision] = []
    prev: GateDecision | None = None
    while not backend.finished:
        s = backend.read(0)
        if not samples or s.t != samples[-1].t:
            window.append(s)
            prev = evaluate(window, info, cfg, prev)
            samples.append(s)
            decisions.append(prev)
        clock.advance(0.025)
    return samples, decisions, backend


@pytest.mark.parametrize("cfg", [CFG, FAST], ids=["default", "fast"])
def test_h200_trace_replayed_through_the_gate(cfg: GateConfig) -> None:
    samples, decisions, backend = replay_gate(cfg)
    assert len(samples) == 2176  # every recorded sample was seen once
    start, end = (e.t for e in backend.trace.events[:2])

    # Throttled within two samples of the SW power cap first appearing (t ~ 5.05 s).
    first_cap = next(i for i, s in enumerate(samples) if R.SW_POWER_CAP in (s.reasons or R(0)))
    assert 4.8 < samples[first_cap].t < 5.1
    assert S.THROTTLED in {d.state for d in decisions[first_cap : first_cap + 2]}
    assert "sw_power_cap" in decisions[first_cap].reasons[0]

    # Never open while the matmul loop runs.
    during = [d for s, d in zip(samples, decisions, strict=True) if start <= s.t <= end]
    assert len(during) > 1000 and not any(d.open for d in during)

    # Open again after the loop ends, but only once settle_s has passed.
    after = [d for s, d in zip(samples, decisions, strict=True) if s.t > end]
    reopen = opened(after)
    assert reopen.t >= end + cfg.settle_s
    assert reopen.t - reopen.disturbed_at >= cfg.settle_s  # type: ignore[operator]
    assert reopen.t < end + cfg.settle_s + 10.0  # and not absurdly late
    assert all(d.open for d in after if d.t >= reopen.t)  # no flapping while it cools


def test_fast_gate_was_open_before_the_load_and_shut_at_its_first_sample() -> None:
    # With a short window the gate opens in the 5 s idle prelude, so the test above
    # checks a real transition: the first sample after the load starts shuts it.
    samples, decisions, backend = replay_gate(FAST)
    start = backend.trace.events[0].t
    before = [d for s, d in zip(samples, decisions, strict=True) if s.t < start]
    assert before[-1].open
    i = next(i for i, s in enumerate(samples) if s.t >= start)
    assert not decisions[i].open and decisions[i].state is S.WARMING
