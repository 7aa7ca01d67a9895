"""``sim.start_s``: simulated GPUs that start part-way into their scenario.

A fleet test starts a ``fan-failure`` host already hours into its cooling decline; the
daemon's GPU and the sim tuning worker's copy of it must then agree on the scenario time.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from gpuwatchd.config import ConfigError, load_config
from gpuwatchd.sessions.plan import build_specs, runnable_workloads
from gpuwatchd.telemetry.clocks import ManualClock, OffsetClock, ScaledClock
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.telemetry.settings import BackendSpec
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.telemetry.types import Sample
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime
from gpuwatchd.tuning.worker.main import open_device
from gpuwatchd.validate import from_table

#: 3.5 h into fan-failure: the next production burst starts 60 s later (t = 12660 s).
START = 3.5 * 3600
FIRST_BURST = 60.0 + 900.0 * 14


def _burst_clock(backend: SimBackend, clock: ManualClock, burst_start: float) -> float:
    """Mean SM clock over a production burst after its first minute, read every second."""
    clock.advance(burst_start + 60 - backend.clock.now())
    samples: list[Sample] = []
    for _ in range(240):
        samples.append(backend.read(0))
        clock.advance(1.0)
    return statistics.fmean(_num(s.sm_clock_mhz) for s in samples)


def _num(value: float | None) -> float:
    assert value is not None
    return value


def test_sim_start_s_config_default_and_one_line_errors(tmp_path: Path) -> None:
    assert SimConfig().start_s == 0.0
    assert from_table(SimConfig, {"start_s": 12600}, "sim").start_s == 12600.0
    for bad, needle in (
        (-1, "sim.start_s: must be >= 0"),
        ("later", "sim.start_s: expected a number"),
        (1e12, "sim.start_s: expected seconds from 0 to 366 days"),
    ):
        with pytest.raises(ValueError) as err:
            from_table(SimConfig, {"start_s": bad}, "sim")
        assert needle in str(err.value) and "\n" not in str(err.value)
    path = tmp_path / "c.toml"
    path.write_text("[sim]\nstart_s = -5\n")
    with pytest.raises(ConfigError, match=r"sim\.start_s: must be >= 0"):
        load_config(str(path))
    path.write_text('[sim]\nscenario = "fan-failure"\nstart_s = 12600.0\n')
    assert load_config(str(path)).sim.start_s == 12600.0


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "1"])
def test_backend_rejects_a_bad_start_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="start_s"):
        SimBackend(clock=ManualClock(), start_s=bad)  # type: ignore[arg-type]


def test_the_clock_reads_scenario_time_from_the_start() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="fan-failure", clock=clock, start_s=START)
    assert isinstance(backend.clock, OffsetClock) and backend.clock.inner is clock
    assert backend.clock.now() == START
    assert backend.read(0).t == START
    clock.advance(30.0)
    assert backend.clock.now() == START + 30.0
    assert backend.read(0).t == START + 30.0
    assert SimBackend(clock=clock).clock is clock  # no offset: the given clock itself


def test_a_started_backend_is_the_same_gpu_as_one_that_ran_up_to_that_time() -> None:
    late_clock, early_clock = ManualClock(), ManualClock()
    late = SimBackend(scenario="fan-failure", seed=3, clock=late_clock, start_s=START)
    early = SimBackend(scenario="fan-failure", seed=3, clock=early_clock)
    early_clock.advance(START)
    assert late.device_info(0) == early.device_info(0)
    for _ in range(3):
        assert late.read(0) == early.read(0)
        late_clock.advance(45.0)
        early_clock.advance(45.0)
    # The heatsink soaked through the earlier bursts: warmer than a fresh GPU at rest.
    fresh = SimBackend(scenario="fan-failure", seed=3, clock=ManualClock())
    assert _num(late.read(0).temp_c) > _num(fresh.read(0).temp_c) + 3


def test_fan_failure_started_late_is_degraded_from_its_first_burst() -> None:
    """What the fleet test relies on: the late host's first burst is >5% under a healthy
    twin's (``periodic-job``, the same production job with working fans)."""
    clock = ManualClock()
    failing = SimBackend(scenario="fan-failure", clock=clock, start_s=START)
    degraded = _burst_clock(failing, clock, FIRST_BURST)
    healthy_clock = ManualClock()
    healthy = SimBackend(scenario="periodic-job", clock=healthy_clock)
    normal = _burst_clock(healthy, healthy_clock, 60.0)
    assert degraded < 0.95 * normal, (degraded, normal)
    assert normal > 1400  # the power-capped twin holds ~1450 MHz


def test_open_backend_starts_the_configured_sim_at_start_s() -> None:
    spec = BackendSpec(kind="sim", sim=SimConfig(scenario="fan-failure", speed=60.0, start_s=START))
    backend = open_backend(spec)
    assert isinstance(backend, SimBackend) and backend.start_s == START
    assert isinstance(backend.clock, OffsetClock)
    assert isinstance(backend.clock.inner, ScaledClock) and backend.clock.inner.speed == 60.0
    assert START <= backend.clock.now() < START + 60.0  # less than a real second has passed
    backend.close()
    # ``tune`` hands its fast-forward clock in: the offset applies on top of it.
    manual = ManualClock()
    fast = open_backend(spec, sim_clock=manual)
    assert fast.clock.now() == START
    manual.advance(5.0)
    assert fast.clock.now() == START + 5.0


def test_the_sim_worker_simulates_the_daemons_gpu_at_the_same_scenario_time() -> None:
    """The scheduler passes ``backend.clock.now()`` to ``build_specs`` as the worker's start:
    with an offset that is scenario time, so the worker's GPU is the daemon's GPU."""
    clock = ManualClock()
    sim = SimConfig(scenario="fan-failure", seed=5, start_s=START)
    daemon_gpu = SimBackend(scenario=sim.scenario, seed=sim.seed, clock=clock, start_s=START)
    clock.advance(FIRST_BURST + 90 - START)  # a minute and a half into the first burst
    setup = TuningSetup(sim=sim)
    (spec,) = build_specs(
        setup,
        daemon_gpu.device_info(0),
        runnable_workloads(setup, "sim"),
        (Regime.SUSTAINED,),
        sim_start_t=daemon_gpu.clock.now(),
    )
    assert spec.sim is not None and spec.sim.start_t == FIRST_BURST + 90
    opened = open_device(spec)  # the worker's own simulated GPU (no torch needed)
    try:
        worker_gpu = opened.session.backend  # type: ignore[attr-defined]
        mine, theirs = daemon_gpu.read(0), worker_gpu.read(0)
        assert theirs.t == mine.t == FIRST_BURST + 90
        assert theirs.temp_c == pytest.approx(mine.temp_c, abs=0.5)
        assert theirs.sm_clock_mhz == pytest.approx(mine.sm_clock_mhz, rel=0.01)
        assert theirs.procs == mine.procs and mine.procs  # the production burst, on both
    finally:
        opened.close()
