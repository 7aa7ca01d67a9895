"""Instantaneous power in the tuning worker's samples, and the protocol's use of it.

NVML's ``POWER_INSTANT`` field is read once per worker sample where the GPU has it (None,
and never asked again, where it does not); the simulated GPU offers it too. The protocol
then probes for ``power_probe_instant_s`` instead of ``power_probe_s``, settles without
waiting for NVML's 1 s average, holds settling while the board draws over its limit
with no power reason, and tags sustained batches with the instantaneous power.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pynvml  # type: ignore[import-untyped]
from fakes_nvml import FakeGpu, FakeNvml
from test_anchor_protocols import WL, kernels
from test_deciding_faster import Timed, _samples, cfg

from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.types import (
    POWER_INSTANT_KEY,
    Sample,
    ThrottleReason,
    instant_power,
    with_instant_power,
)
from gpuwatchd.tuning.types import Regime
from gpuwatchd.tuning.worker.devices import SimSession
from gpuwatchd.tuning.worker.protocol import tune
from gpuwatchd.tuning.worker.settle import settled

POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT

# -- reading it ------------------------------------------------------------------------------


def test_nvml_reads_instantaneous_power_in_watts_with_one_field_values_call() -> None:
    fields = {**(FakeGpu().fields or {}), POWER_INSTANT: 612_345}  # mW
    fake = FakeNvml([FakeGpu(fields=fields)])
    backend = NvmlBackend(nvml=fake)
    try:
        before = fake.count("nvmlDeviceGetFieldValues")
        assert backend.read_instant_power(0) == 612.345
        assert fake.count("nvmlDeviceGetFieldValues") == before + 1
        s = with_instant_power(backend.read(0), backend.read_instant_power(0))
        assert instant_power(s) == 612.345 and s.power_w == 125.0  # the average stays
    finally:
        backend.close()


def test_a_gpu_without_the_field_gives_none_and_is_not_asked_again() -> None:
    fake = FakeNvml([FakeGpu()])  # no POWER_INSTANT among its fields
    backend = NvmlBackend(nvml=fake)
    try:
        assert backend.read_instant_power(0) is None
        asked = fake.count("nvmlDeviceGetFieldValues")
        assert backend.read_instant_power(0) is None
        assert fake.count("nvmlDeviceGetFieldValues") == asked
        s = backend.read(0)
        assert with_instant_power(s, None) is s and instant_power(s) is None
    finally:
        backend.close()


def test_a_failed_read_is_none_this_time_only() -> None:
    fields = {**(FakeGpu().fields or {}), POWER_INSTANT: 500_000}
    fake = FakeNvml([FakeGpu(fields=fields)])
    backend = NvmlBackend(nvml=fake)
    try:
        fake.fail_field(POWER_INSTANT, pynvml.NVML_ERROR_UNKNOWN)
        assert backend.read_instant_power(0) is None
        fake.fail_field(POWER_INSTANT, None)
        assert backend.read_instant_power(0) == 500.0
    finally:
        backend.close()


class _Heavy:
    name = "heavy"
    family = "sim"
    dynamic_power_w = 1150.0

    def seconds_per_call(self, sm_clock_mhz: float, max_sm_clock_mhz: float) -> float:
        return 1e-3 * max_sm_clock_mhz / sm_clock_mhz


def test_the_simulated_gpu_reads_over_the_limit_before_its_limiter_engages() -> None:
    s = SimSession.create(noise=0.0)
    s.pause(2.0)
    s.time_batch(_Heavy(), 100)  # 0.1 s: the limiter (filtered power) has not engaged
    early = s.sample()
    limit = s.info.power_limit_w
    assert limit is not None
    assert not (early.reasons or 0) & ThrottleReason.SW_POWER_CAP
    watts = instant_power(early)
    assert watts is not None and watts > limit  # the board really draws this
    assert early.power_w is not None and early.power_w < 0.5 * limit  # the 1 s average lags
    s.time_batch(_Heavy(), 2000)
    late = s.sample()
    assert (late.reasons or 0) & ThrottleReason.SW_POWER_CAP
    capped = instant_power(late)
    assert capped is not None and capped < 1.3 * limit
    without = SimSession.create(noise=0.0, instant_power=False)
    without.time_batch(_Heavy(), 100)
    assert POWER_INSTANT_KEY not in without.sample().extra


# -- the protocol ----------------------------------------------------------------------------


class Instant(Timed):
    """A scripted GPU that also reads instantaneous power (``instant_w``; None: lacks it)."""

    def __init__(self, instant_w: float | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.instant_w = instant_w

    def sample(self) -> Sample:
        return with_instant_power(super().sample(), self.instant_w)


def _probed_s(reason: str) -> float:
    m = re.search(r"after (\d+\.\d) s back-to-back", reason)
    assert m, reason
    return float(m[1])


def test_the_power_probe_is_short_where_instantaneous_power_is_read() -> None:
    c = cfg(power_probe_s=1.0, power_probe_instant_s=0.25, warmup_s=0.05, warmup_min_s=0.05)
    two = kernels(1e-3, 1.05e-3)
    quick = Instant(300.0, power_w=300.0)
    res = tune(WL, two, quick, ["unthrottled", "sustained"], c)
    assert 0.25 <= _probed_s(res[1].candidates[0].meta["sustained_skipped"]) < 0.5
    assert quick.t >= 0.25 and quick.paused_at == []
    plain = Instant(None, power_w=300.0)  # the field is not supported: 1 s, as without it
    res = tune(WL, two, plain, ["unthrottled", "sustained"], c)
    assert _probed_s(res[1].candidates[0].meta["sustained_skipped"]) >= 1.0
    # Limited: the probe ends at half of its own length.
    capped = Instant(760.0, power_w=690.0, reasons=ThrottleReason.SW_POWER_CAP)
    tune(WL, two, capped, ["unthrottled", "sustained"], c)
    assert 0.125 <= capped.paused_at[0] < 0.2
    slow = Instant(None, power_w=690.0, reasons=ThrottleReason.SW_POWER_CAP)
    tune(WL, two, slow, ["unthrottled", "sustained"], c)
    assert 0.5 <= slow.paused_at[0] < 0.55


def test_the_probe_judges_instantaneous_power_not_the_lagging_average() -> None:
    """The average still shows the idle time before the load; the instantaneous reading
    shows a draw near the limit, so the sustained regime is not skipped."""
    c = cfg(power_probe_instant_s=0.25, warmup_s=0.05, warmup_min_s=0.05)
    near = Instant(680.0, power_w=300.0)
    res = tune(WL, kernels(1e-3, 1.05e-3), near, ["unthrottled", "sustained"], c)
    assert "sustained_skipped" not in res[1].candidates[0].meta
    assert res[1].candidates[0].meta["settled"] is True


def test_settling_judges_instantaneous_power_and_needs_no_second_of_load() -> None:
    c = cfg(settle_window_s=0.5, settle_horizon_s=1.0, power_probe_instant_s=0.25)

    def instant(samples: list[Sample], watts: Any) -> list[Sample]:
        return [with_instant_power(s, watts(s.t)) for s in samples]

    # Capped, the 1 s average still climbing: without the instantaneous reading this
    # waits for power_probe_s of load; with it, a quarter second does.
    climbing = _samples(lambda t: 1500.0, lambda t: 500.0 + 200.0 * t, capped=True)
    assert not settled(climbing, c, 0.5, loaded_s=0.3, power_limit_w=700.0)
    read = instant(climbing, lambda t: 690.0)
    assert settled(read, c, 0.5, loaded_s=0.3, power_limit_w=700.0)
    hunting = instant(climbing, lambda t: 690.0 + 40.0 * t)  # the capped reading swings
    assert settled(hunting, c, 0.5, loaded_s=0.3, power_limit_w=700.0)
    assert not settled(hunting, c, 0.5, loaded_s=0.2, power_limit_w=700.0)
    # Uncapped: the instantaneous power's trend is judged, not the average's.
    lagging = _samples(lambda t: 1980.0, lambda t: 300.0 + 200.0 * t, capped=False)
    assert not settled(lagging, c, 0.5, loaded_s=0.3)
    assert settled(instant(lagging, lambda t: 560.0), c, 0.5, loaded_s=0.3)
    assert not settled(instant(lagging, lambda t: 400.0 + 200.0 * t), c, 0.5, loaded_s=0.3)


def test_a_board_near_or_over_its_limit_with_no_power_reason_has_not_settled() -> None:
    """The limiter may yet engage: flat readings at full clock are not the steady state.
    Near the limit that wait lasts the averaged reading's own (power_probe_s), over it
    until transient_max_s, when a state that lasts counts as the steady one."""
    c = cfg(settle_window_s=0.5, settle_horizon_s=1.0, power_probe_s=1.0, transient_max_s=2.0)
    flat = _samples(lambda t: 1980.0, lambda t: 600.0, capped=False)

    def reading(watts: float) -> list[Sample]:
        return [with_instant_power(s, watts) for s in flat]

    def ok(window: list[Sample], loaded_s: float) -> bool:
        return settled(window, c, 0.5, loaded_s=loaded_s, power_limit_w=700.0)

    over, near, under = reading(745.0), reading(650.0), reading(500.0)
    assert not ok(over, 0.6) and not ok(over, 1.0) and ok(over, 2.0)
    assert not ok(near, 0.6) and ok(near, 1.0)
    assert ok(under, 0.6)
    one = [*under[:-1], over[-1]]  # one hungry candidate in the window is enough
    assert not ok(one, 1.0)
    capped = [replace(s, reasons=ThrottleReason.SW_POWER_CAP) for s in over]
    assert ok(capped, 0.6)  # the limiter holds it: the trend alone decides
    assert ok(flat, 0.6)  # no instantaneous reading: as before
    assert settled(over, c, 0.5, loaded_s=0.6)  # the limit unknown: nothing to wait for


def test_sustained_batches_carry_instantaneous_power_and_energy_from_it() -> None:
    c = cfg(skip_sustained=False, max_rounds=6)
    two = kernels(1e-3, 1.2e-3)
    res = tune(WL, two, Instant(650.0, power_w=420.0), ["unthrottled", "sustained"], c)
    unthrottled, sustained = res
    assert unthrottled.regime is Regime.UNTHROTTLED and sustained.regime is Regime.SUSTAINED
    best = sustained.candidates[0]
    assert best.power_w == 650.0
    assert best.energy_j_per_call == 650.0 * (best.median_s or 0.0)
    assert best.meta["power_note"] == "instantaneous power after each batch"
    assert unthrottled.candidates[0].power_w == 420.0  # the average, as before
    plain = tune(WL, two, Instant(None, power_w=420.0), ["unthrottled", "sustained"], c)
    assert plain[1].candidates[0].power_w == 420.0
    assert "power_note" not in plain[1].candidates[0].meta
