"""Scripted scenarios: which foreign work runs when, how cooling ages, when a GPU drops.

Times are simulated seconds since the backend started. Every GPU of a backend plays
the same script (one rank of a multi-GPU job per GPU, pid ``pid_base + gpu``), except
that only GPU 0 is ever lost and each XID names its GPU. Each scenario's docstring says
what a run of it shows.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from gpuwatchd.telemetry.sim.health import XID_DBE_ECC, XID_ROW_REMAP_PENDING, XidEvent
from gpuwatchd.telemetry.sim.model import Load
from gpuwatchd.telemetry.sim.profiles import H200, L4, GpuPreset

#: PID of the foreign process on GPU 0; GPU n sees ``FOREIGN_PID + n``.
FOREIGN_PID = 4242


@dataclass(frozen=True, slots=True)
class LoadPattern:
    """A foreign process: on for ``duration_s`` every ``period_s``, from ``start_s``."""

    start_s: float
    util: float
    dynamic_power_w: float
    mem_util: float
    duration_s: float = math.inf
    period_s: float = math.inf
    pid_base: int = FOREIGN_PID
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        if self.start_s < 0:
            raise ValueError(f"start_s must be >= 0, got {self.start_s}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.period_s > self.duration_s and not math.isinf(self.duration_s):
            raise ValueError(f"period_s must exceed duration_s, got {self.period_s}")
        Load(  # validates
            self.util, self.dynamic_power_w, self.pid_base, self.mem_util, self.memory_bytes
        )

    def _cycle_start(self, t: float) -> tuple[int, float]:
        """The current cycle's index and start time (``t >= start_s``)."""
        if math.isinf(self.period_s):
            return 0, self.start_s
        k = math.floor((t - self.start_s) / self.period_s)
        # Guard against rounding putting t just outside cycle k.
        if self.start_s + (k + 1) * self.period_s <= t:
            k += 1
        elif self.start_s + k * self.period_s > t:
            k -= 1
        return k, self.start_s + k * self.period_s

    def is_on(self, t: float) -> bool:
        if t < self.start_s:
            return False
        _, begin = self._cycle_start(t)
        return t < begin + self.duration_s

    def next_change(self, t: float) -> float:
        """First time strictly after ``t`` at which ``is_on`` flips (inf if never)."""
        if t < self.start_s:
            return self.start_s
        k, begin = self._cycle_start(t)
        end = begin + self.duration_s
        if t < end:
            return end
        return self.start_s + (k + 1) * self.period_s

    def load_for(self, gpu: int) -> Load:
        return Load(
            self.util, self.dynamic_power_w, self.pid_base + gpu, self.mem_util, self.memory_bytes
        )


@dataclass(frozen=True, slots=True)
class CoolingDecline:
    """Heatsink-to-air resistance grows linearly to ``final_factor`` over ``ramp_s``."""

    start_s: float
    ramp_s: float
    final_factor: float

    def __post_init__(self) -> None:
        if self.ramp_s <= 0:
            raise ValueError(f"ramp_s must be > 0, got {self.ramp_s}")
        if self.final_factor < 1:
            raise ValueError(f"final_factor must be >= 1, got {self.final_factor}")

    def factor(self, t: float) -> float:
        if t <= self.start_s:
            return 1.0
        progress = min(1.0, (t - self.start_s) / self.ramp_s)
        return 1.0 + (self.final_factor - 1.0) * progress


@dataclass(frozen=True, slots=True)
class LostWindow:
    """GPU 0 stops answering at ``start_s`` and answers again ``duration_s`` later."""

    start_s: float
    duration_s: float

    def covers(self, t: float) -> bool:
        return self.start_s <= t < self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Scenario:
    """A script for the simulated GPUs; registration fills in name and description."""

    preset: GpuPreset
    loads: tuple[LoadPattern, ...] = ()
    cooling: CoolingDecline | None = None
    lost: LostWindow | None = None
    xids: tuple[XidEvent, ...] = ()
    name: str = ""
    description: str = ""

    def source(self, gpu: int) -> ScenarioSource:
        """This script as seen by one GPU (the model's ``LoadSource``)."""
        return ScenarioSource(self, gpu)


class ScenarioSource:
    """A scenario bound to one GPU index."""

    def __init__(self, scenario: Scenario, gpu: int) -> None:
        self._patterns = scenario.loads
        self._loads = tuple(p.load_for(gpu) for p in scenario.loads)
        self._cooling = scenario.cooling

    @property
    def cooling_varies(self) -> bool:
        return self._cooling is not None

    def loads_at(self, t: float) -> tuple[Load, ...]:
        return tuple(ld for p, ld in zip(self._patterns, self._loads, strict=True) if p.is_on(t))

    def next_change(self, t: float) -> float:
        return min((p.next_change(t) for p in self._patterns), default=math.inf)

    def sink_factor(self, t: float) -> float:
        return 1.0 if self._cooling is None else self._cooling.factor(t)


SCENARIOS: dict[str, Scenario] = {}


def _scenario(name: str) -> Callable[[Callable[[], Scenario]], Callable[[], Scenario]]:
    """Register a scenario built by the decorated function; its docstring describes it."""

    def register(build: Callable[[], Scenario]) -> Callable[[], Scenario]:
        doc = inspect.cleandoc(build.__doc__ or "")
        SCENARIOS[name] = replace(build(), name=name, description=doc)
        return build

    return register


@_scenario("idle")
def _idle() -> Scenario:
    """H200, nothing running, forever: 40 °C, ~125 W, 1980 MHz, reason GPU_IDLE."""
    return Scenario(H200)


@_scenario("power-cap")
def _power_cap() -> Scenario:
    """H200 replaying the recorded matmul burn, every 10 minutes.

    Idle for 5 s, then a foreign process (pid 4242) runs a bf16 matmul loop for 60 s
    (util 1.0): power pins at ~692 W under the 700 W cap, the SM clock drops to
    ~1440 MHz with SW_POWER_CAP, the die goes 40 -> ~60 °C in ~2 s; then idle again,
    back to ~41 °C within ~3 s. The burst repeats at t = 605 s, 1205 s, ...
    """
    burst = LoadPattern(  # a bf16 8192³ matmul loop: all SMs busy, far over the cap
        start_s=5.0,
        duration_s=60.0,
        period_s=600.0,
        util=1.0,
        dynamic_power_w=H200.heavy_load_dynamic_w,
        mem_util=0.35,
        memory_bytes=2 * 2**30,
    )
    return Scenario(H200, loads=(burst,))


@_scenario("heat-soak")
def _heat_soak() -> Scenario:
    """L4 (passively cooled, 72 W) under a foreign sustained load from t = 10 s on.

    At first the load is power-capped (~1780 MHz, SW_POWER_CAP) and the clock sags a
    little as leakage grows with temperature. The heatsink (tau 4 min) soaks: at
    ~4 min the die reaches the 87 °C thermal target and the software thermal
    controller holds it there (SW_THERMAL_SLOWDOWN), lowering the clock as the
    heatsink keeps warming, to ~1500 MHz (-17 %) by ~8 min, where it stays.
    """
    load = LoadPattern(
        start_s=10.0,
        util=1.0,
        dynamic_power_w=L4.heavy_load_dynamic_w,
        mem_util=0.5,
        memory_bytes=18 * 2**30,
    )
    return Scenario(L4, loads=(load,))


def _production_job() -> LoadPattern:
    """The training job of ``fan-failure`` and ``periodic-job``: 5-minute bursts every 15."""
    return LoadPattern(
        start_s=60.0,
        duration_s=300.0,
        period_s=900.0,
        util=0.98,
        dynamic_power_w=H200.heavy_load_dynamic_w,
        mem_util=0.45,
        memory_bytes=110 * 2**30,
    )


@_scenario("fan-failure")
def _fan_failure() -> Scenario:
    """H200 whose chassis fans degrade over hours under a periodic production job.

    A foreign training job (pid 4242, util 0.98) runs 5-minute bursts every 15 minutes
    from t = 60 s (bursts start at 60 + 900*k s). The heatsink-to-air resistance grows
    linearly to 9.25x over 4 hours, then stays. Each burst is power-capped at first
    (~1450 MHz, SW_POWER_CAP) and its sustained clock creeps down as leakage grows with
    temperature (~2 % after 2.5 h); from ~2.7 h the die reaches 87 °C during bursts
    and the thermal controller takes over (SW_THERMAL_SLOWDOWN), so the drift speeds
    up to ~2 % per burst. The sustained clock (mean of a burst's samples after its
    first minute) is first more than 3 % below the first burst's in the burst that
    starts at t = 9960 s (2.77 h; ~4 % there), and settles ~12.5 % below it after 4 h.
    """
    decline = CoolingDecline(start_s=0.0, ramp_s=4 * 3600.0, final_factor=9.25)
    return Scenario(H200, loads=(_production_job(),), cooling=decline)


@_scenario("periodic-job")
def _periodic_job() -> Scenario:
    """H200 running ``fan-failure``'s production job with healthy cooling: its fleet twin.

    The same foreign training job (pid 4242, util 0.98, 5-minute bursts every 15 minutes
    from t = 60 s), power-capped at ~1450 MHz (SW_POWER_CAP) in every burst, for ever:
    the sustained clock a host with working fans learns, which a ``fan-failure`` host
    falls more than 5 % below after ~3 simulated hours.
    """
    return Scenario(H200, loads=(_production_job(),))


@_scenario("busy")
def _busy() -> Scenario:
    """H200; another process (pid 4242) starts using the GPU at t = 30 s and keeps it.

    A production job at util 0.95 whose kernels would draw more than the power cap:
    from t = 30 s on, procs = (4242,), util ~0.95, SW_POWER_CAP, ~60 °C.
    """
    job = LoadPattern(
        start_s=30.0, util=0.95, dynamic_power_w=1200.0, mem_util=0.6, memory_bytes=80 * 2**30
    )
    return Scenario(H200, loads=(job,))


@_scenario("gpu-lost")
def _gpu_lost() -> Scenario:
    """H200, idle; GPU 0 falls off the bus at t = 20 s and answers again at t = 50 s.

    Between those times read(), read_energy() and device_info() of GPU 0 raise GpuLost;
    other GPUs are unaffected. The GPU keeps its physical state across the outage.
    """
    return Scenario(H200, lost=LostWindow(20.0, 30.0))


@_scenario("ecc-error")
def _ecc_error() -> Scenario:
    """H200, idle; at t = 20 s GPU 0's HBM takes an uncorrectable ECC error.

    The driver reports XID 48 (double-bit ECC error) and XID 63 (the row is marked for
    remapping): gpuwatchd_gpu_xid_errors_total{xid="48"} and {xid="63"} count 1, the
    uncorrected ECC totals go to 1 and gpuwatchd_gpu_row_remap_pending to 1 (until a GPU
    reset, which the simulation never does). Other GPUs stay clean.
    """
    return Scenario(H200, xids=(XidEvent(20.0, XID_DBE_ECC), XidEvent(20.0, XID_ROW_REMAP_PENDING)))
