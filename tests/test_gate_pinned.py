"""The gate's limits pinned one by one: hysteresis direction for every limit, settle-time
restarts, boundaries, windows with missing fields, unknown throttle bits, config ranges.

Written against the mutation test (``bench/mutation_test.py``). Most cases judge one
window against a previous decision built by hand: ``OPEN`` (the gate open, nominal
limits) or ``SHUT`` (shut, limits tightened), both disturbed long ago at -30 s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from builders import h200, idle

from gpuwatchd.gate import GateConfig, GateDecision, GateState, evaluate
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

H200 = h200()  # 1980 MHz, 700 W, slowdown 87 C: temperature limit 72 C, 69 C to reopen
CFG = GateConfig()
S = GateState
R = ThrottleReason
OPEN = GateDecision(S.COOL_STABLE, ("quiet",), t=-0.1, since=-20.0, disturbed_at=-30.0)
SHUT = GateDecision(S.WARMING, ("settling",), t=-0.1, since=-20.0, disturbed_at=-30.0)
UNKNOWN_BIT = R(0x1000)  # a reason bit newer than this code


def window(
    n: int = 50, step: float = 0.1, alt: dict[str, Any] | None = None, **kw: Any
) -> list[Sample]:
    """``n`` idle samples ending at t = (n-1)*step; ``alt`` overrides every other one."""
    out = []
    for i in range(n):
        changes = {**kw, **(alt if alt and (n - 1 - i) % 2 else {})}
        out.append(idle(round(i * step, 6), **changes))
    return out


def judge(
    samples: Sequence[Sample],
    prev: GateDecision | None,
    cfg: GateConfig = CFG,
    info: DeviceInfo | None = H200,
    own_pids: frozenset[int] = frozenset(),
    now: float | None = None,
) -> GateDecision:
    return evaluate(samples, info, cfg, prev, own_pids, now=now)


def feed(samples: Sequence[Sample], cfg: GateConfig = CFG) -> list[GateDecision]:
    """Sample by sample from a cold start, as the poller does."""
    out: list[GateDecision] = []
    prev = None
    for i in range(len(samples)):
        prev = evaluate(samples[: i + 1], H200, cfg, prev)
        out.append(prev)
    return out


# -- hysteresis: inside the band shuts without disturbing, beyond the limit disturbs -------

BANDS = [
    # (name, inside the band, beyond the nominal limit, the reason's basis when shut)
    ("temp", {"temp_c": 70.0}, {"temp_c": 73.0},
     "to reopen (temp_margin_c 15 C below slowdown 87 C)"),
    ("clock", {"sm_clock_mhz": 1891.0}, {"sm_clock_mhz": 1861.0},
     "to reopen (clock_ratio_min 95%)"),
    ("power", {"power_w": 250.0}, {"power_w": 300.0}, "to reopen (power_ratio_max 40%)"),
    ("temp spread", {"alt": {"temp_c": 42.5}}, {"alt": {"temp_c": 43.5}},
     "to reopen (temp_jitter_max_c 3 C)"),
    ("clock spread", {"alt": {"sm_clock_mhz": 1945.0}}, {"alt": {"sm_clock_mhz": 1930.0}},
     "to reopen (clock_jitter_max 2.0%)"),
    ("power spread", {"alt": {"power_w": 155.0}}, {"alt": {"power_w": 165.0}},
     "to reopen (power_jitter_max 5%)"),
]  # fmt: skip
IDS = [b[0] for b in BANDS]


@pytest.mark.parametrize(("name", "band", "beyond", "basis"), BANDS, ids=IDS)
def test_inside_the_band_an_open_gate_stays_open(
    name: str, band: dict[str, Any], beyond: dict[str, Any], basis: str
) -> None:
    d = judge(window(**band), OPEN)
    assert d.state is S.COOL_STABLE, d.reasons
    assert d.disturbed_at == -30.0 and d.since == -20.0


@pytest.mark.parametrize(("name", "band", "beyond", "basis"), BANDS, ids=IDS)
def test_inside_the_band_a_shut_gate_stays_shut_without_a_disturbance(
    name: str, band: dict[str, Any], beyond: dict[str, Any], basis: str
) -> None:
    d = judge(window(**band), SHUT)
    assert d.state is S.WARMING
    assert len(d.reasons) == 1 and d.reasons[0].endswith(basis), d.reasons
    assert d.disturbed_at == -30.0  # the settle timer is not restarted
    assert d.since == -20.0  # still the same warming spell


@pytest.mark.parametrize(("name", "band", "beyond", "basis"), BANDS, ids=IDS)
def test_beyond_the_nominal_limit_the_gate_shuts_and_the_settle_time_restarts(
    name: str, band: dict[str, Any], beyond: dict[str, Any], basis: str
) -> None:
    for prev in (OPEN, SHUT):
        d = judge(window(**beyond), prev)
        assert d.state is S.WARMING, d.reasons
        assert d.disturbed_at == d.t == 4.9
    opened = judge(window(**beyond), OPEN)
    assert opened.since == 4.9  # a new spell
    assert not any("to reopen" in r for r in opened.reasons)  # nominal limits while open
    assert judge(window(**beyond), SHUT).since == -20.0


def test_without_hysteresis_the_reasons_name_only_the_key() -> None:
    cfg = dataclasses.replace(CFG, hyst_ratio=0.0, hyst_temp_c=0.0)
    d = judge(window(sm_clock_mhz=1861.0, temp_c=73.0), SHUT, cfg)
    assert d.reasons == (
        "temp 73 C; needs ≤ 72 C (temp_margin_c 15 C below slowdown 87 C)",
        "SM clock 1861 MHz = 94% of max 1980 MHz; needs ≥ 95% (clock_ratio_min)",
    )
    assert judge(window(sm_clock_mhz=1891.0, temp_c=71.0), SHUT, cfg).open  # no band


@pytest.mark.parametrize(
    "kw", [{"sm_clock_mhz": 1800.0}, {"power_w": 300.0}], ids=["under-clocked", "over-power"]
)
def test_a_steady_disturbance_restarts_the_settle_time_at_every_sample(kw: dict[str, Any]) -> None:
    cfg = dataclasses.replace(CFG, window_s=0.05, min_samples=1)  # judge the latest alone
    samples = window(100, **kw) + [idle(10.0 + i * 0.1) for i in range(150)]
    ds = feed(samples, cfg)
    assert all(d.disturbed_at == d.t for d in ds[:100])
    first = next(d for d in ds if d.open)
    assert first.t == pytest.approx(9.9 + cfg.settle_s, abs=0.11)  # 0.1 s steps in floats
    assert not any(d.open for d in ds if d.t < 9.85 + cfg.settle_s)


# -- evidence and settling boundaries -------------------------------------------------------


def test_min_samples_exactly_met_opens() -> None:
    cfg = dataclasses.replace(CFG, settle_s=0.0)
    five = [idle(float(t)) for t in range(5)]  # all within the 5 s window
    assert judge(five, None, cfg).open
    d = judge(five[1:], None, cfg)
    assert d.state is S.WARMING and d.reasons == ("4 sample(s) in 5s window (need 5)",)
    assert d.disturbed_at == 1.0  # no disturbance: the first sample seen


def test_quiet_time_exactly_settle_s_opens() -> None:
    cfg = dataclasses.replace(CFG, settle_s=4.0)
    five = [idle(float(t)) for t in range(5)]
    d = judge(five, None, cfg)
    assert d.open and d.reasons == ("temp 40 C, SM clock 1980 MHz, 125 W, quiet 4.0 s",)
    d = judge(five, None, dataclasses.replace(CFG, settle_s=4.5))
    assert d.reasons == ("settling: 4.0s since last disturbance (need 4.5s)",)


def test_a_sample_exactly_window_s_old_is_still_in_the_window() -> None:
    samples = [idle(0.0, temp_c=44.0), *[idle(0.5 * i) for i in range(1, 11)]]  # ends at 5.0
    assert not judge(samples, OPEN).open  # the 44 C sample at exactly 5.0 - 5 s counts
    assert judge(samples[1:], OPEN).open


def test_the_settle_time_counts_from_the_previous_disturbance_or_the_first_sample() -> None:
    assert judge(window(), None).disturbed_at == 0.0  # first sample seen
    assert judge(window(), SHUT).disturbed_at == -30.0
    lost = GateDecision(S.UNAVAILABLE, ("GPU lost",), t=3.0, since=1.0, disturbed_at=3.0)
    d = judge(window(), lost)
    assert d.disturbed_at == 4.9 and d.reasons[0].startswith("settling: 0.0s")
    no_mark = GateDecision(S.WARMING, ("x",), t=4.8, since=2.0, disturbed_at=None)
    assert judge(window(), no_mark).disturbed_at == 0.0


# -- windows with missing fields: the slow path ---------------------------------------------


@pytest.mark.parametrize(
    ("field", "values", "reason"),
    [
        ("temp_c", [40.0, None, 44.0, None, 41.0], "temp spread 40-44 C; needs ≤ 2.4 C"),
        ("power_w", [125.0, None, 170.0, None, 125.0], "power spread 125-170 W; needs ≤ 28 W"),
        ("sm_clock_mhz", [1900.0, None, 1980.0, None, 1980.0], "SM clock spread 1900-1980 MHz"),
    ],
)
def test_a_window_with_missing_readings_is_judged_on_the_rest(
    field: str, values: list[float | None], reason: str
) -> None:
    samples = [idle(float(i), **{field: v}) for i, v in enumerate(values)]
    d = judge(samples, SHUT)
    assert d.state is S.WARMING and len(d.reasons) == 1 and d.reasons[0].startswith(reason)


def test_no_power_readings_at_all_skip_the_power_checks() -> None:
    d = judge(window(power_w=None), OPEN)
    assert d.open and d.reasons[0] == "temp 40 C, SM clock 1980 MHz, quiet 34.9 s"


def test_zero_power_readings_have_no_spread() -> None:
    assert judge(window(power_w=0.0), OPEN).open


def test_power_spread_without_a_power_limit_is_relative_to_the_peak() -> None:
    info = dataclasses.replace(H200, power_limit_w=None)
    assert judge(window(power_w=100.0, alt={"power_w": 104.0}), SHUT, info=info).open
    d = judge(window(power_w=100.0, alt={"power_w": 110.0}), SHUT, info=info)
    assert d.reasons[0].startswith("power spread 100-110 W; needs ≤ 4 W")


# -- throttle reasons -----------------------------------------------------------------------


def test_unknown_reason_bits_neither_throttle_nor_mean_idle() -> None:
    assert judge(window(reasons=UNKNOWN_BIT), OPEN).open
    parked = judge(window(reasons=UNKNOWN_BIT, sm_clock_mhz=885.0), OPEN)
    assert parked.state is S.WARMING and "SM clock 885 MHz = 45% of max" in parked.reasons[0]
    assert judge(window(reasons=R.GPU_IDLE | UNKNOWN_BIT, sm_clock_mhz=885.0), OPEN).open
    d = judge(window(reasons=R.SW_POWER_CAP | UNKNOWN_BIT, power_w=None), OPEN)
    assert d.state is S.THROTTLED and d.reasons == ("throttle sw_power_cap (SM clock 1980 MHz)",)


def test_no_reason_reading_is_not_idle() -> None:
    d = judge(window(reasons=None, sm_clock_mhz=885.0), OPEN)
    assert d.state is S.WARMING
    assert judge(window(reasons=None), OPEN).open


def test_clock_spread_ignores_idle_samples_but_not_unread_reasons() -> None:
    samples = [
        idle(0.0, reasons=None, sm_clock_mhz=1900.0),
        idle(1.0, reasons=R.GPU_IDLE, sm_clock_mhz=885.0),
        idle(2.0, reasons=None, sm_clock_mhz=1980.0),
        idle(3.0, reasons=R.GPU_IDLE, sm_clock_mhz=885.0),
        idle(4.0, reasons=R.GPU_IDLE, sm_clock_mhz=885.0),
    ]
    d = judge(samples, OPEN)
    assert d.state is S.WARMING and d.reasons[0].startswith(
        "SM clock spread 1900-1980 MHz = 4.0%; needs ≤ 2.0%"
    )
    samples[0] = idle(0.0, reasons=None, sm_clock_mhz=1975.0)
    assert judge(samples, OPEN).open  # parked idle clocks are no spread; 0.25% is none either


@pytest.mark.parametrize(
    ("power", "clock", "state"),
    [
        (280.0, 1000.0, S.WARMING),  # exactly 40% of the limit: not loaded
        (281.0, 1484.0, S.THROTTLED),
        (281.0, 1485.0, S.WARMING),  # exactly 75% of max: not throttling
    ],
)
def test_low_clock_under_load_boundaries(power: float, clock: float, state: GateState) -> None:
    d = judge(window(power_w=power, sm_clock_mhz=clock), OPEN)
    assert d.state is state, d.reasons


def test_a_ratio_exactly_at_its_limit_passes() -> None:
    assert judge(window(sm_clock_mhz=1881.0), OPEN).open  # 95% of 1980 MHz
    assert judge(window(sm_clock_mhz=1900.8), SHUT).open  # 96%: the limit to reopen
    assert judge(window(power_w=280.0), OPEN).open  # 40% of 700 W
    for kw in ({"sm_clock_mhz": 1881.0}, {"power_w": 280.0}):
        d = judge(window(**kw), SHUT)  # type: ignore[arg-type]
        assert d.state is S.WARMING and d.disturbed_at == -30.0  # only the band


def test_exactly_at_the_nominal_limit_is_no_disturbance() -> None:
    d = judge(window(temp_c=72.0), SHUT)  # the limit itself; 69 C to reopen
    assert d.state is S.WARMING and d.disturbed_at == -30.0
    parked = {"reasons": R.GPU_IDLE, "sm_clock_mhz": 885.0}
    samples = [idle(0.0, reasons=None, sm_clock_mhz=2000.0),
               idle(1.0, reasons=None, sm_clock_mhz=1960.0),
               *[idle(t, **parked) for t in (2.0, 3.0, 4.0)]]  # fmt: skip
    assert judge(samples, OPEN).open  # 2% among the working samples: at the limit


def test_a_spread_exactly_at_its_limit_passes() -> None:
    assert judge(window(alt={"temp_c": 43.0}), OPEN).open  # 3 C
    assert judge(window(sm_clock_mhz=2000.0, alt={"sm_clock_mhz": 1960.0}), OPEN).open  # 2%
    assert judge(window(alt={"power_w": 160.0}), OPEN).open  # 35 W of 700 W: 5%

    for alt in ({"temp_c": 43.0}, {"power_w": 160.0}):  # shut: inside the band, no disturbance
        d = judge(window(alt=alt), SHUT)
        assert d.state is S.WARMING and d.disturbed_at == -30.0
    d = judge(window(sm_clock_mhz=2000.0, alt={"sm_clock_mhz": 1960.0}), SHUT)
    assert d.state is S.WARMING and d.disturbed_at == -30.0


def test_low_clock_under_load_needs_the_power_limit_and_the_max_clock() -> None:
    for info in (dataclasses.replace(H200, power_limit_w=None),
                 dataclasses.replace(H200, max_sm_clock_mhz=None)):  # fmt: skip
        d = judge(window(power_w=600.0, sm_clock_mhz=1000.0), OPEN, info=info)
        assert d.state is not S.THROTTLED


def test_throttled_inside_the_utilisation_band_is_busy() -> None:
    d = judge(window(util_gpu=0.045, reasons=R.SW_POWER_CAP), SHUT)
    assert d.state is S.BUSY and d.reasons[0].startswith("util 4.5%; needs ≤ 4.0%")
    assert d.disturbed_at == 4.9  # the throttle is a disturbance


# -- busy ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("procs", "shown"),
    [((1, 2, 3), "3 foreign compute process(es) (pid 1, 2, 3)"),
     ((1, 2, 3, 4), "4 foreign compute process(es) (pid 1, 2, 3, ...)"),
     ((7, 1, 9, 2, 3), "4 foreign compute process(es) (pid 1, 9, 2, ...)")],
)  # fmt: skip
def test_foreign_processes_are_named_three_at_most(procs: tuple[int, ...], shown: str) -> None:
    d = judge(window(procs=procs), OPEN, own_pids=frozenset({7}))
    assert d.state is S.BUSY and d.reasons == (shown,) and d.disturbed_at == 4.9


@pytest.mark.parametrize(
    ("procs", "own", "busy"),
    [
        (None, frozenset({7}), False),  # no process list: our worker may be the load
        ((7,), frozenset({7}), False),
        ((), frozenset({7}), True),  # a list without our worker: someone else's load
        (None, frozenset(), True),
    ],
)
def test_utilisation_is_ours_only_when_our_worker_may_be_on_the_gpu(
    procs: tuple[int, ...] | None, own: frozenset[int], busy: bool
) -> None:
    d = judge(window(util_gpu=0.9, procs=procs), OPEN, own_pids=own)
    assert (d.state is S.BUSY) is busy


def test_utilisation_boundaries() -> None:
    assert judge(window(util_gpu=0.05), OPEN).open  # exactly util_max
    d = judge(window(util_gpu=0.05), SHUT)
    assert d.state is S.BUSY and d.disturbed_at == -30.0
    d = judge(window(util_gpu=0.06), OPEN)
    assert d.state is S.BUSY and d.disturbed_at == 4.9


# -- unavailable -----------------------------------------------------------------------------


def test_unavailable_stamps_and_reasons() -> None:
    d = evaluate([], H200, CFG, None)
    assert (d.state, d.reasons, d.t, d.since, d.disturbed_at) == (
        S.UNAVAILABLE,
        ("no samples",),
        0.0,
        0.0,
        0.0,
    )
    d = evaluate(window(), H200, CFG, OPEN, lost=True)
    assert (d.reasons, d.t) == (("GPU lost",), -0.1)
    again = evaluate(window(), H200, CFG, d, lost=True, now=7.0)
    assert (again.t, again.since, again.disturbed_at) == (7.0, -0.1, 7.0)
    assert judge(window(temp_c=None), OPEN).reasons == ("no temperature reading",)
    assert judge(window(sm_clock_mhz=None), OPEN).reasons == ("no SM clock reading",)


def test_staleness_boundary_with_now() -> None:
    d = judge(window(), OPEN, now=6.9)  # exactly stale_after_s old: still fresh
    assert d.open and d.t == 6.9
    d = judge(window(), OPEN, now=7.0)
    assert d.state is S.UNAVAILABLE and d.reasons == ("last sample 2.1s old (> 2s)",)
    assert d.disturbed_at == 7.0


def test_without_device_info_the_fixed_temperature_limit_applies() -> None:
    assert judge(window(temp_c=74.0), OPEN, info=None).open
    d = judge(window(temp_c=76.0, sm_clock_mhz=500.0, power_w=690.0), OPEN, info=None)
    assert d.reasons == ("temp 76 C; needs ≤ 75 C (max_temp_c 75 C)",)


# -- "in this state since": carried across polls while the state holds --------------------

SETTLING = GateDecision(S.WARMING, ("settling",), t=-0.1, since=-20.0, disturbed_at=0.0)
SINCE = [
    # (case, the window's changes, the first poll's previous decision, the state both polls give)
    ("busy: a foreign process", {"procs": (999,)}, OPEN, S.BUSY),
    ("busy: utilisation inside the band", {"util_gpu": 0.045}, SHUT, S.BUSY),
    ("busy: throttled inside the utilisation band",
     {"util_gpu": 0.045, "reasons": R.SW_POWER_CAP}, SHUT, S.BUSY),
    ("throttled", {"reasons": R.SW_POWER_CAP}, OPEN, S.THROTTLED),
    ("warming: too hot", {"temp_c": 80.0}, OPEN, S.WARMING),
    ("warming: too few samples", {"n": 3}, None, S.WARMING),
    ("warming: settling", {}, SETTLING, S.WARMING),
    ("cool_stable", {}, SHUT, S.COOL_STABLE),
    ("unavailable: no temperature", {"temp_c": None}, OPEN, S.UNAVAILABLE),
    ("unavailable: no SM clock", {"sm_clock_mhz": None}, OPEN, S.UNAVAILABLE),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "prev", "state"), [c[1:] for c in SINCE], ids=[c[0] for c in SINCE])
def test_since_is_when_the_state_began_across_polls(
    kw: dict[str, Any], prev: GateDecision | None, state: GateState
) -> None:
    samples = window(**kw)
    first = judge(samples[:-1], prev)
    second = judge(samples, first)
    assert (first.state, second.state) == (state, state), (first.reasons, second.reasons)
    assert first.since == (prev.since if prev is not None and prev.state is state else first.t)
    assert second.t > first.t and second.since == first.since


@pytest.mark.parametrize(
    ("kw", "now"),
    [({"lost": True}, None), ({"lost": True}, 9.0), ({}, 9.0)],  # 9.0: the window is stale
    ids=["lost", "lost, with now", "stale"],
)
def test_an_unavailable_spell_keeps_its_since_across_polls(
    kw: dict[str, Any], now: float | None
) -> None:
    first = evaluate(window(), H200, CFG, OPEN, now=now, **kw)
    later = None if now is None else now + 1.0
    second = evaluate(window(), H200, CFG, first, now=later, **kw)
    assert (first.state, second.state) == (S.UNAVAILABLE, S.UNAVAILABLE)
    assert first.since == first.t and second.since == first.t


def test_a_new_state_starts_its_own_since() -> None:
    samples = window()
    first = judge(samples[:-1], OPEN)
    assert first.open and first.since == OPEN.since
    hot = judge([*samples[:-1], idle(samples[-1].t, temp_c=80.0)], first)
    assert hot.state is S.WARMING and hot.since == hot.t


# -- an unavailable decision is always stamped -------------------------------------------------


@pytest.mark.parametrize("prev", [None, OPEN, SHUT], ids=["cold start", "open", "shut"])
@pytest.mark.parametrize(
    ("samples", "kw", "now"),
    [
        ([], {}, None),
        ([], {}, 9.0),
        (window(), {"lost": True}, None),
        (window(), {"lost": True}, 9.0),
        (window(), {}, 9.0),  # the latest sample is 4.1 s old
        (window(temp_c=None), {}, None),
        (window(sm_clock_mhz=None), {}, 5.0),
    ],
    ids=["no samples", "no samples, now", "lost", "lost, now", "stale", "no temp", "no clock"],
)
def test_an_unavailable_decision_carries_its_time_and_a_disturbance(
    samples: list[Sample], kw: dict[str, Any], now: float | None, prev: GateDecision | None
) -> None:
    d = evaluate(samples, H200, CFG, prev, now=now, **kw)
    if now is not None:
        t = now
    elif samples and not kw:
        t = samples[-1].t
    else:
        t = prev.t if prev is not None else 0.0
    assert d.state is S.UNAVAILABLE
    assert isinstance(d.t, float) and isinstance(d.since, float)
    assert (d.t, d.since, d.disturbed_at) == (t, t, t)  # a new spell: it began, and disturbs, now


# -- a zero reading is a reading: spreads still count it, nothing divides by it --------------


@pytest.mark.parametrize(
    "info",
    [H200, None, dataclasses.replace(H200, power_limit_w=None)],
    ids=["h200", "no device info", "no power limit"],
)
@pytest.mark.parametrize("at", [10, 48], ids=["early", "one before the latest"])
def test_one_zero_mhz_reading_is_a_clock_spread(info: DeviceInfo | None, at: int) -> None:
    samples = window()
    samples[at] = idle(samples[at].t, sm_clock_mhz=0.0)
    d = judge(samples, OPEN, info=info)
    assert d.state is S.WARMING
    assert d.reasons == ("SM clock spread 0-1980 MHz = 100.0%; needs ≤ 2.0% (clock_jitter_max)",)
    assert d.disturbed_at == d.t


@pytest.mark.parametrize(
    ("info", "allowed"),
    [(H200, "35 W"), (None, "6 W"), (dataclasses.replace(H200, power_limit_w=None), "6 W")],
    ids=["h200: 5% of the limit", "no device info: 5% of the peak", "no power limit"],
)
@pytest.mark.parametrize("at", [10, 49], ids=["early", "latest"])
def test_one_zero_watt_reading_is_a_power_spread(
    info: DeviceInfo | None, allowed: str, at: int
) -> None:
    samples = window()
    samples[at] = idle(samples[at].t, power_w=0.0)
    d = judge(samples, OPEN, info=info)
    assert d.state is S.WARMING
    assert d.reasons == (f"power spread 0-125 W; needs ≤ {allowed} (power_jitter_max)",)


@pytest.mark.parametrize("info", [H200, None], ids=["h200", "no device info"])
def test_all_zero_readings_divide_by_nothing(info: DeviceInfo | None) -> None:
    d = judge(window(sm_clock_mhz=0.0, power_w=0.0), OPEN, info=info)
    assert all("spread" not in r for r in d.reasons)
    if info is not None:  # a known max clock: 0 MHz is far under it
        assert d.reasons == ("SM clock 0 MHz = 0% of max 1980 MHz; needs ≥ 95% (clock_ratio_min)",)


# -- config -----------------------------------------------------------------------------------

# name -> (lowest allowed or None, is the lowest itself allowed, highest, is it allowed)
RANGES: dict[str, tuple[float, bool, float | None, bool]] = {
    "window_s": (0, False, None, True),
    "min_samples": (1, True, 10_000, True),
    "stale_after_s": (0, False, None, True),
    "settle_s": (0, True, None, True),
    "temp_margin_c": (0, True, 100, True),
    "max_temp_c": (0, False, 150, True),
    "temp_jitter_max_c": (0, True, 100, True),
    "clock_ratio_min": (0, False, 1, True),
    "clock_ratio_throttled": (0, False, 1, True),
    "clock_jitter_max": (0, True, 1, True),
    "util_max": (0, True, 1, True),
    "power_ratio_max": (0, False, 1, True),
    "power_jitter_max": (0, True, 1, True),
    "hyst_temp_c": (0, True, 50, True),
    "hyst_ratio": (0, True, 1, False),
}


def _cfg(name: str, value: float) -> GateConfig:
    other = {"clock_ratio_min": ("clock_ratio_throttled", 0.001),
             "clock_ratio_throttled": ("clock_ratio_min", 1.0)}.get(name)  # fmt: skip
    kw: dict[str, Any] = {name: value}
    if other:
        kw[other[0]] = other[1]
    return GateConfig(**kw)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_every_key_accepts_exactly_its_range(name: str) -> None:
    lo, lo_ok, hi, hi_ok = RANGES[name]
    step = 1 if name == "min_samples" else 0.5
    span = (hi - lo) if hi is not None else 1000
    inside = lo + min(step, span / 2)
    assert getattr(_cfg(name, inside), name) == inside
    cases = [(lo, lo_ok), (lo - step, False)]
    if hi is not None:
        cases += [(hi, hi_ok), (hi + step, False)]
    for value, ok in cases:
        if ok:
            assert getattr(_cfg(name, value), name) == value
        else:
            with pytest.raises(ValueError, match=rf"gate\.{name}: must be >"):
                _cfg(name, value)


def test_range_errors_say_the_range() -> None:
    for kw, message in [
        ({"min_samples": 0}, "gate.min_samples: must be >= 1 and <= 10000, got 0"),
        ({"window_s": 0.0}, "gate.window_s: must be > 0, got 0.0"),
        ({"hyst_ratio": 1.0}, "gate.hyst_ratio: must be >= 0 and < 1, got 1.0"),
        ({"max_temp_c": 151.0}, "gate.max_temp_c: must be > 0 and <= 150, got 151.0"),
    ]:
        with pytest.raises(ValueError) as exc:
            GateConfig(**kw)  # type: ignore[arg-type]
        assert str(exc.value) == message


def test_types_are_checked() -> None:
    for kw, message in [
        ({"min_samples": 5.0}, "gate.min_samples: expected a whole number, got 5.0"),
        ({"min_samples": True}, "gate.min_samples: expected a whole number, got True"),
        ({"settle_s": False}, "gate.settle_s: expected a number, got False"),
        ({"settle_s": float("inf")}, "gate.settle_s: expected a finite number, got inf"),
        ({"clock_ratio_throttled": 0.96},
         "gate.clock_ratio_throttled: must be <= clock_ratio_min (0.95), got 0.96"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as exc:
            GateConfig(**kw)  # type: ignore[arg-type]
        assert str(exc.value) == message
    with pytest.raises(ValueError, match=r"gate\.settle_s"):
        GateConfig(settle_s=1e12)  # durations are bounded too (at most a year)
    assert GateConfig(settle_s=3).settle_s == 3  # an int is a number
    assert GateConfig(clock_ratio_throttled=0.95).clock_ratio_throttled == 0.95


def test_from_mapping_converts_and_names_the_key() -> None:
    cfg = GateConfig.from_mapping({"settle_s": 3, "min_samples": 7})
    assert cfg.settle_s == 3.0 and type(cfg.settle_s) is float
    assert cfg.min_samples == 7 and type(cfg.min_samples) is int
    assert GateConfig.from_mapping({}) == GateConfig()
    for table, message in [
        ({"settle": 1}, "gate.settle: unknown key (known: clock_jitter_max, "),
        ({"settle_s": True}, "gate.settle_s: expected a number, got True"),
        ({"settle_s": "1"}, "gate.settle_s: expected a number, got '1'"),
        ({"min_samples": 2.5}, "gate.min_samples: expected a whole number, got 2.5"),
    ]:
        with pytest.raises(ValueError) as exc:
            GateConfig.from_mapping(table)  # type: ignore[arg-type]
        assert str(exc.value).startswith(message)
