"""The simulated GPU backend: physics, scenarios, determinism, calibration to the H200 trace."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, GpuLost
from gpuwatchd.telemetry.clocks import ManualClock, ScaledClock
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.telemetry.settings import BackendSpec, ReplayConfig
from gpuwatchd.telemetry.sim import H200, SCENARIOS, GpuModel, Load, SimBackend
from gpuwatchd.telemetry.sim.scenarios import LoadPattern
from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.telemetry.types import Sample, ThrottleReason

R = ThrottleReason


def run(
    backend: SimBackend, clock: ManualClock, seconds: float, period: float, gpu: int = 0
) -> list[Sample]:
    """Read ``gpu`` every ``period`` simulated seconds for ``seconds``; return the samples."""
    samples: list[Sample] = []
    for _ in range(round(seconds / period)):
        samples.append(backend.read(gpu))
        clock.advance(period)
    return samples


def between(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.t < end]


# --------------------------------------------------------------------- construction


def test_unknown_scenario_names_every_valid_one() -> None:
    with pytest.raises(ValueError, match="scenario") as err:
        SimBackend(scenario="meltdown")
    names = (
        "idle",
        "power-cap",
        "heat-soak",
        "fan-failure",
        "periodic-job",
        "busy",
        "gpu-lost",
        "ecc-error",
    )
    for name in names:
        assert name in str(err.value)
    assert set(SCENARIOS) == set(names)


@pytest.mark.parametrize(("kwargs", "field"), [({"gpus": 0}, "gpus"), ({"seed": "x"}, "seed")])
def test_bad_constructor_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SimBackend(clock=ManualClock(), **kwargs)


def test_every_scenario_is_documented() -> None:
    for name, scenario in SCENARIOS.items():
        assert scenario.name == name
        assert len(scenario.description) > 40, name


def test_backend_protocol_and_device_info() -> None:
    backend = SimBackend(gpus=2, seed=7, clock=ManualClock())
    assert isinstance(backend, Backend)
    assert backend.name == "sim"
    assert isinstance(SimBackend().clock, ScaledClock)
    assert backend.devices() == [0, 1]
    info0, info1 = backend.device_info(0), backend.device_info(1)
    assert info0.name == "NVIDIA H200 (simulated)"
    assert info0.driver_version == "sim"
    assert info0.uuid.startswith("GPU-sim-") and info0.uuid != info1.uuid
    assert info0.pci_bus_id != info1.pci_bus_id
    assert (info0.max_sm_clock_mhz, info0.max_mem_clock_mhz) == (1980, 3201)
    assert (info0.power_limit_w, info0.slowdown_temp_c, info0.shutdown_temp_c) == (700, 89, 95)
    assert info0.memory_total_bytes and info0.memory_total_bytes > 140e9
    assert backend.device_info(0, refresh=True) == info0
    again = SimBackend(gpus=2, seed=7, clock=ManualClock())
    assert again.device_info(1).uuid == info1.uuid
    assert SimBackend(gpus=2, seed=8, clock=ManualClock()).device_info(1).uuid != info1.uuid


def test_bad_gpu_index_and_closed_backend() -> None:
    backend = SimBackend(gpus=2, clock=ManualClock())
    for bad in (2, -1):
        with pytest.raises(ValueError, match="gpu"):
            backend.read(bad)
    backend.close()
    with pytest.raises(BackendUnavailable):
        backend.read(0)


def test_open_backend_takes_only_the_backend_spec() -> None:
    clock = ManualClock(5.0)
    spec = BackendSpec(kind="sim", sim=SimConfig(gpus=3, scenario="busy", seed=4))
    backend = open_backend(spec, sim_clock=clock)
    assert isinstance(backend, SimBackend) and backend.devices() == [0, 1, 2]
    assert backend.clock is clock
    same = SimBackend(gpus=3, scenario="busy", seed=4, clock=ManualClock())
    assert backend.device_info(2).uuid == same.device_info(2).uuid
    assert isinstance(open_backend(BackendSpec(kind="sim")).clock, ScaledClock)
    with pytest.raises(BackendUnavailable, match=r"^replay: no trace file given"):
        open_backend(BackendSpec(kind="replay", replay=ReplayConfig(trace="")))
    with pytest.raises(BackendUnavailable, match=r"unknown backend 'tpu' \(known: nvml, sim"):
        open_backend(BackendSpec(kind="tpu"))


# --------------------------------------------------------------------- determinism


def _script(seed: int) -> list[Sample]:
    clock = ManualClock(100.0)
    backend = SimBackend(gpus=2, scenario="power-cap", seed=seed, clock=clock)
    samples = []
    for i in range(400):
        if i == 50:
            backend.set_load(1, util=0.8, dynamic_power_w=900.0, pid=99)
        if i == 300:
            backend.clear_load(1)
        samples += [backend.read(0), backend.read(1)]
        clock.advance(0.1 + 0.37 * (i % 3))
    return samples


def test_same_seed_and_read_times_give_identical_samples() -> None:
    first, second = _script(3), _script(3)
    assert first == second
    assert _script(4) != first  # the noise depends on the seed


def test_physics_barely_depends_on_read_pattern() -> None:
    fine_clock, coarse_clock = ManualClock(), ManualClock()
    fine = SimBackend(scenario="power-cap", clock=fine_clock)
    coarse = SimBackend(scenario="power-cap", clock=coarse_clock)
    run(fine, fine_clock, 100.0, 0.05)
    coarse_clock.advance(100.0)
    assert fine.model(0).temp_c == pytest.approx(coarse.model(0).temp_c, abs=0.05)
    assert fine.read_energy(0) == pytest.approx(coarse.read_energy(0), rel=0.002)


# --------------------------------------------------------------------- scenarios


def test_idle_gpu_reads_idle() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="idle", clock=clock)
    samples = run(backend, clock, 60.0, 0.1)
    assert {s.reasons for s in samples} == {R.GPU_IDLE, R(0)}
    assert sum(s.reasons == R.GPU_IDLE for s in samples) > 0.8 * len(samples)
    assert {s.sm_clock_mhz for s in samples} == {1980.0}
    assert {s.temp_c for s in samples} <= {39.0, 40.0, 41.0}
    assert all(115 < s.power_w < 135 for s in samples)
    assert all(s.util_gpu == 0.0 and s.procs == () for s in samples)
    assert all(s.temp_c == int(s.temp_c) for s in samples)


def test_power_cap_pins_power_and_lowers_clock_every_burst() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="power-cap", clock=clock)
    samples = run(backend, clock, 1300.0, 0.5)
    for start in (5.0, 605.0, 1205.0):  # the burst repeats every 10 minutes
        loaded = between(samples, start + 5, start + 60)
        assert all(s.reasons == R.SW_POWER_CAP for s in loaded)
        assert all(s.procs == (4242,) and s.util_gpu == 1.0 for s in loaded)
        assert all(680 <= s.power_w <= 707 for s in loaded)
        assert all(1380 <= s.sm_clock_mhz <= 1530 for s in loaded)
        assert all(s.sm_clock_mhz % 15 == 0 for s in loaded)
        after = between(samples, start + 62, start + 300)
        assert all(s.sm_clock_mhz == 1980 and s.procs == () for s in after)


def test_busy_shows_the_foreign_process_from_30s_on_every_gpu() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=2, scenario="busy", clock=clock)
    before, after = [], []
    for _ in range(600):
        target = before if clock.now() < 30.0 else after
        target.append((backend.read(0), backend.read(1)))
        clock.advance(0.1)
    assert all(a.procs == () and b.procs == () for a, b in before)
    assert all(a.procs == (4242,) and b.procs == (4243,) for a, b in after)
    assert all(a.util_gpu == pytest.approx(0.95) for a, _ in after)
    assert all(a.reasons & R.SW_POWER_CAP for a, _ in after[50:])


def test_gpu_lost_only_in_its_window_and_only_gpu0() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=2, scenario="gpu-lost", clock=clock)
    lost_at = []
    for _ in range(700):
        t = clock.now()
        backend.read(1)
        try:
            backend.read(0)
        except GpuLost as exc:
            assert exc.gpu == 0
            lost_at.append(t)
            with pytest.raises(GpuLost):
                backend.read_energy(0)
            with pytest.raises(GpuLost):
                backend.device_info(0)
        clock.advance(0.1)
    assert lost_at and min(lost_at) == pytest.approx(20.0) and max(lost_at) == pytest.approx(49.9)
    assert len(lost_at) == 300
    assert backend.read(0).temp_c == pytest.approx(40, abs=1)  # answers again


def test_heat_soak_throttles_thermally_and_the_clock_falls() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="heat-soak", clock=clock)
    info = backend.device_info(0)
    assert info.name == "NVIDIA L4 (simulated)" and info.power_limit_w == 72
    samples = run(backend, clock, 1200.0, 1.0)
    early = between(samples, 20, 80)
    late = between(samples, 900, 1200)
    assert all(s.reasons & R.SW_POWER_CAP for s in early)
    assert not any(s.reasons & R.SW_THERMAL_SLOWDOWN for s in early)
    assert all(s.reasons & R.SW_THERMAL_SLOWDOWN for s in late)
    assert all(85 <= s.temp_c <= 88 for s in late)
    assert max(s.temp_c for s in samples) < info.slowdown_temp_c
    early_clock = statistics.fmean(s.sm_clock_mhz for s in early)
    late_clock = statistics.fmean(s.sm_clock_mhz for s in late)
    assert late_clock < 0.88 * early_clock
    assert statistics.fmean(s.power_w for s in late) < 0.85 * info.power_limit_w


def test_fan_failure_sustained_clock_crosses_3pct_at_the_documented_burst() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="fan-failure", clock=clock)
    samples = run(backend, clock, 4.5 * 3600, 1.0)
    # Sustained clock per burst: the mean after the burst's first minute.
    starts = [60.0 + 900.0 * k for k in range(18)]
    sustained = [
        statistics.fmean(s.sm_clock_mhz for s in between(samples, b + 60, b + 300)) for b in starts
    ]
    drop = [1 - c / sustained[0] for c in sustained]
    first_over = next(k for k, d in enumerate(drop) if d > 0.03)
    assert starts[first_over] == 9960.0
    assert "9960" in SCENARIOS["fan-failure"].description
    assert all(d < 0.025 for d in drop[:first_over])  # clear of noise on both sides
    assert drop[first_over] > 0.035
    assert drop[-1] > 0.10
    last = between(samples, starts[-1] + 60, starts[-1] + 300)
    assert all(s.reasons & R.SW_THERMAL_SLOWDOWN for s in last)


# --------------------------------------------------------------------- external loads


def test_external_load_heats_and_power_caps_then_clears() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="idle", clock=clock)
    view = backend.model(0)
    assert view.max_sm_clock_mhz == 1980 and view.sm_clock_mhz == 1980
    backend.set_load(0, util=1.0, dynamic_power_w=H200.heavy_load_dynamic_w, pid=777)
    assert view.sm_clock_mhz < 1500  # the power controller reacts at once
    clock.advance(10.0)
    sample = backend.read(0)
    assert sample.procs == (777,) and sample.reasons == R.SW_POWER_CAP
    assert view.temp_c > 58
    backend.clear_load(0)
    assert view.sm_clock_mhz == 1980
    clock.advance(10.0)
    assert backend.read(0).procs == () and view.temp_c < 41.5


def test_external_load_adds_to_the_scenario_load() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="busy", clock=clock)
    clock.advance(60.0)
    backend.set_load(0, util=0.05, dynamic_power_w=50.0, pid=9)
    sample = backend.read(0)
    assert sample.procs == (9, 4242)
    assert sample.util_gpu == 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"util": 1.5, "dynamic_power_w": 10.0}, "util"),
        ({"util": 0.5, "dynamic_power_w": -1.0}, "dynamic_power_w"),
        ({"util": 0.5, "dynamic_power_w": math.nan}, "dynamic_power_w"),
        ({"util": 0.5, "dynamic_power_w": 10.0, "pid": 0}, "pid"),
    ],
)
def test_set_load_rejects_bad_values(kwargs: dict, field: str) -> None:
    backend = SimBackend(clock=ManualClock())
    with pytest.raises(ValueError, match=field):
        backend.set_load(0, **kwargs)


def test_energy_is_exact_and_monotonic() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="power-cap", clock=clock)
    view = backend.model(0)
    energy = [backend.read_energy(0)]
    for _ in range(200):
        clock.advance(0.5)
        energy.append(backend.read_energy(0))
    assert all(b > a for a, b in itertools.pairwise(energy))
    # Idle (5 s at ~125 W) + 60 s capped at 693 W + idle until 100 s.
    assert energy[-1] == pytest.approx(5 * 125 + 60 * 693 + 35 * 126, rel=0.01)
    before = backend.read_energy(0)
    power = view.power_w
    clock.advance(3.0)
    assert backend.read_energy(0) - before == pytest.approx(3.0 * power, rel=0.001)


def test_hw_thermal_slowdown_when_software_control_cannot_hold() -> None:
    class Forever:
        cooling_varies = False

        def loads_at(self, t: float) -> tuple[Load, ...]:
            return (Load(1.0, 1325.0, 1),)

        def next_change(self, t: float) -> float:
            return math.inf

        def sink_factor(self, t: float) -> float:
            return 1.0

    # Poor cooling and a minimum clock the software controller may not go under.
    preset = dataclasses.replace(H200, sink_r_c_per_w=0.1, min_sm_clock_mhz=1500.0)
    model = GpuModel(preset, Forever())
    hot = []
    for step in range(1, 600):
        model.advance(step * 0.1)
        state = model.state()
        assert state.temp_c < preset.shutdown_temp_c
        if state.reasons & R.HW_THERMAL_SLOWDOWN:
            hot.append(state)
    assert hot
    assert all(s.sm_clock_mhz <= 990 and s.temp_c >= preset.slowdown_temp_c for s in hot)


def test_periodic_pattern_always_moves_forward() -> None:
    pattern = LoadPattern(
        start_s=5.0, duration_s=60.0, period_s=600.0, util=1.0, dynamic_power_w=1.0, mem_util=0.0
    )
    t = 0.0
    flips = 0
    while t < 600.0 * 2000:
        nxt = pattern.next_change(t)
        assert nxt > t
        assert pattern.is_on(nxt) != pattern.is_on(t) or t == 0.0
        t = nxt
        flips += 1
    assert flips == 2 * 2000 + 1


def test_preset_rejects_inconsistent_values() -> None:
    with pytest.raises(ValueError, match="die_tau_s"):
        dataclasses.replace(H200, die_tau_s=0.0)
    with pytest.raises(ValueError, match="thermal_target_c"):
        dataclasses.replace(H200, thermal_target_c=95.0)


# --------------------------------------------------------------------- calibration

#: Measured from tests/data/h200-matmul-burn.jsonl (see test_reference_matches_the_trace):
#: medians over the loaded window (load start + 5 s to load end) and the idle lead-in,
#: rise = load start -> temp >= loaded median - 1, fall = load end -> temp <= idle + 1.
TRACE_REF = {
    "clock": 1440.0,
    "temp": 60.0,
    "power": 692.5,
    "idle_power": 125.2,
    "idle_temp": 40.0,
    "rise_s": 1.56,
    "fall_s": 2.56,
}


def _burn_stats(samples: list[dict], start: float, end: float) -> dict[str, float]:
    loaded = [s for s in samples if start + 5 <= s["t"] < end]
    idle = [s for s in samples if 1 <= s["t"] < start]
    temp = statistics.median(s["temp_c"] for s in loaded)
    idle_temp = statistics.median(s["temp_c"] for s in idle)
    rise = next(s["t"] for s in samples if s["t"] >= start and s["temp_c"] >= temp - 1)
    fall = next(s["t"] for s in samples if s["t"] >= end and s["temp_c"] <= idle_temp + 1)
    return {
        "clock": statistics.median(s["sm_clock_mhz"] for s in loaded),
        "temp": temp,
        "power": statistics.median(s["power_w"] for s in loaded),
        "idle_power": statistics.median(s["power_w"] for s in idle),
        "idle_temp": idle_temp,
        "rise_s": rise - start,
        "fall_s": fall - end,
    }


def test_power_cap_scenario_matches_the_h200_trace() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="power-cap", clock=clock)
    samples = [
        {"t": s.t, "temp_c": s.temp_c, "power_w": s.power_w, "sm_clock_mhz": s.sm_clock_mhz}
        for s in run(backend, clock, 110.0, 0.05)
    ]
    sim = _burn_stats(samples, 5.0, 65.0)
    assert sim["clock"] == pytest.approx(TRACE_REF["clock"], abs=15)  # one clock bin
    assert sim["temp"] == pytest.approx(TRACE_REF["temp"], abs=1)
    assert sim["power"] == pytest.approx(TRACE_REF["power"], rel=0.01)
    assert sim["idle_power"] == pytest.approx(TRACE_REF["idle_power"], rel=0.03)
    assert sim["idle_temp"] == pytest.approx(TRACE_REF["idle_temp"], abs=1)
    assert sim["rise_s"] == pytest.approx(TRACE_REF["rise_s"], abs=0.75)
    assert sim["fall_s"] == pytest.approx(TRACE_REF["fall_s"], abs=0.75)


#: The recorded H200 burn that ships with the tests (the README's tour replays it too).
TRACE = Path(__file__).resolve().parent / "data" / "h200-matmul-burn.jsonl"


def test_reference_matches_the_trace() -> None:
    lines = TRACE.read_text().splitlines()
    header = json.loads(lines[0])
    start, end = header["events"][0]["t"], header["events"][1]["t"]
    stats = _burn_stats([json.loads(line) for line in lines[1:]], start, end)
    for key, value in TRACE_REF.items():
        assert stats[key] == pytest.approx(value, abs=0.01, rel=0.001), key


# --------------------------------------------------------------------- slow health fields


def test_health_fields_arrive_with_the_slow_path() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=1, scenario="busy", clock=clock)
    assert backend.read(0).slow is None  # nothing until the first slow read, as with NVML
    clock.advance(10.0)
    backend.read_energy(0)
    idle = backend.read(0).slow
    assert idle is not None and idle.processes == ()
    assert idle.memory_used_bytes == H200.reserved_memory_bytes
    assert idle.memory_total_bytes == H200.memory_total_bytes
    assert idle.memory_used_bytes + (idle.memory_free_bytes or 0) == idle.memory_total_bytes
    assert idle.fan_speed_ratio is None  # passively cooled: absent, not 0
    assert idle.xid_errors == {} and idle.remapped_rows is not None
    clock.advance(60.0)  # the foreign job (pid 4242, 80 GiB) has run for 40 s
    backend.read_energy(0)
    busy = backend.read(0).slow
    assert busy is not None and busy.processes is not None
    assert [(p.pid, p.used_bytes) for p in busy.processes] == [(4242, 80 * 2**30)]
    assert busy.memory_used_bytes == H200.reserved_memory_bytes + 80 * 2**30
    for counter in ("pcie_tx_bytes", "pcie_rx_bytes", "nvlink_tx_bytes"):
        before, after = getattr(idle, counter), getattr(busy, counter)
        assert after > before * 10, counter  # traffic follows the load


def test_a_gpu_without_nvlink_has_no_nvlink_bytes() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="heat-soak", clock=clock)  # an L4
    backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None and slow.nvlink_tx_bytes is None and slow.pcie_tx_bytes is not None


def test_ecc_error_scenario_reports_xids_ecc_and_a_pending_remap() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=2, scenario="ecc-error", clock=clock)
    clock.advance(19.0)
    backend.read_energy(0)
    before = backend.read(0).slow
    assert before is not None and before.xid_errors == {}
    clock.advance(2.0)
    backend.read_energy(0)
    backend.read_energy(1)
    after, other = backend.read(0).slow, backend.read(1).slow
    assert after is not None and other is not None
    assert after.xid_errors == {48: 1, 63: 1}
    assert after.ecc_errors is not None
    assert after.ecc_errors[("volatile", "uncorrected")] == 1
    assert after.ecc_errors[("aggregate", "uncorrected")] == 1
    assert after.ecc_errors[("volatile", "corrected")] == 0
    assert after.remapped_rows is not None
    assert after.remapped_rows.pending and after.remapped_rows.uncorrectable == 1
    assert not after.remapped_rows.failed
    assert other.xid_errors == {}  # only GPU 0 was hit


def test_an_injected_xid_is_counted_from_now_on() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=2, clock=clock)
    clock.advance(5.0)
    backend.inject_xid(1, 79)
    backend.inject_xid(1, 79)
    backend.read_energy(1)
    slow = backend.read(1).slow
    assert slow is not None and slow.xid_errors == {79: 2}
    with pytest.raises(ValueError, match="code"):
        backend.inject_xid(0, 0)
    with pytest.raises(ValueError, match="gpu"):
        backend.inject_xid(2, 48)


def test_a_lost_gpu_forgets_its_slow_fields() -> None:
    clock = ManualClock()
    backend = SimBackend(scenario="gpu-lost", clock=clock)
    backend.read_energy(0)
    clock.advance(25.0)
    with pytest.raises(GpuLost):
        backend.read(0)
    clock.advance(30.0)
    assert backend.read(0).slow is None  # back, but nothing stale


# --------------------------------------------------------------------- a tuning worker's load


def test_mirrored_load_reproduces_the_reported_power_and_clock() -> None:
    """The daemon's GPU, told what the worker's copy draws, heats and caps like it."""
    worker_clock, daemon_clock = ManualClock(), ManualClock()
    worker = SimBackend(clock=worker_clock)
    daemon = SimBackend(clock=daemon_clock)
    worker.set_load(0, 1.0, H200.heavy_load_dynamic_w, pid=77)
    for _ in range(40):  # 4 s of a power-capped matmul, reported every 0.1 s
        worker_clock.advance(0.1)
        daemon_clock.advance(0.1)
        view = worker.model(0)
        daemon.session_progress(0, view.power_w, view.sm_clock_mhz, frozenset({77, 78}))
    mine, theirs = daemon.model(0), worker.model(0)
    assert mine.power_w == pytest.approx(theirs.power_w, rel=0.02)
    assert mine.sm_clock_mhz == pytest.approx(theirs.sm_clock_mhz, rel=0.02)
    assert mine.temp_c == pytest.approx(theirs.temp_c, abs=1.0) and mine.temp_c > 55.0
    assert R.SW_POWER_CAP in mine.reasons
    assert daemon.read(0).procs == (77,)  # the worker's pid: the gate counts it as ours
    daemon.session_ended(0)
    daemon_clock.advance(5.0)
    cool = daemon.read(0)
    assert cool.procs == () and cool.power_w is not None and cool.power_w < 150.0


def test_session_progress_without_power_or_worker_changes_nothing() -> None:
    clock = ManualClock()
    backend = SimBackend(clock=clock)
    backend.session_progress(0, None, 1980.0, frozenset({5}))
    backend.session_progress(0, 600.0, 1980.0, frozenset())
    clock.advance(2.0)
    assert backend.read(0).procs == ()
    with pytest.raises(ValueError, match="power_w"):
        backend.mirror_load(0, math.nan)
    with pytest.raises(ValueError, match="sm_clock_mhz"):
        backend.mirror_load(0, 500.0, math.inf)


def test_sim_backend_feels_session_load_and_nvml_does_not() -> None:
    from gpuwatchd.telemetry.backend import FeelsSessionLoad
    from gpuwatchd.telemetry.replay import ReplayBackend

    assert isinstance(SimBackend(), FeelsSessionLoad)
    assert not issubclass(ReplayBackend, FeelsSessionLoad)


def test_paced_clock_never_runs_ahead_of_real_time() -> None:
    from gpuwatchd.telemetry.clocks import PacedClock

    real = [100.0]
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        real[0] += seconds

    clock = PacedClock(10.0, paced_from=50.0, monotonic=lambda: real[0], wait=wait)
    clock.advance(50.0)  # catching up to the daemon's time is free
    assert waits == [] and clock.now() == 50.0
    clock.advance(5.0)  # 5 simulated seconds at speed 10: half a real second
    assert waits == [pytest.approx(0.5)]
    real[0] += 2.0  # real time ran ahead (a slow step): no wait until sim catches up
    clock.sleep(10.0)
    assert len(waits) == 1
    clock.advance(10.0)
    assert waits[-1] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="speed"):
        PacedClock(0.0)
    with pytest.raises(ValueError, match="speed"):
        PacedClock(math.inf)
