"""Physics of one simulated GPU: heat, power, and the clock controllers that react.

Time is integrated lazily: nothing happens until someone asks for the state at a later
time, then the model steps forward in sub-steps. Each sub-step holds power constant
and applies the exact exponential solution of every thermal stage, so it is stable at
any step size: fine steps (50 ms) right after a load changes, coarse ones (1 s) once
the die has settled, which lets tests run a simulated day in about a second.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gpuwatchd.telemetry.sim.profiles import GpuPreset
from gpuwatchd.telemetry.types import ThrottleReason

FINE_STEP_S = 0.05
COARSE_STEP_S = 1.0

# The controllers' reasons as int bits (a Flag's ``|`` builds a new member per call, and
# a model step wants only the power): a ThrottleReason once, for the state read.
_IDLE = ThrottleReason.GPU_IDLE.value
_NONE = 0
_POWER = ThrottleReason.SW_POWER_CAP.value
_SW_THERMAL = ThrottleReason.SW_THERMAL_SLOWDOWN.value
_HW_THERMAL = ThrottleReason.HW_THERMAL_SLOWDOWN.value
#: Hardware thermal slowdown halves the clock, as the real clamp does.
_HW_SLOWDOWN_CLOCK_RATIO = 0.5
#: The power controller regulates slightly under the limit: the H200 trace sits at
#: 692.5 W (median) under its 700 W cap.
POWER_CAP_SETPOINT = 0.99


@dataclass(frozen=True, slots=True)
class Load:
    """Work running on the GPU: share of time busy and dynamic power at max clock.

    ``dynamic_power_w`` is what the kernels would draw on top of idle power if they
    ran 100 % of the time at the maximum SM clock; the power cap usually forbids it.
    ``memory_bytes`` is the device memory its process holds.
    """

    util: float
    dynamic_power_w: float
    pid: int | None = None
    mem_util: float = 0.0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.util <= 1.0:
            raise ValueError(f"util must be within 0-1, got {self.util}")
        if not 0.0 <= self.mem_util <= 1.0:
            raise ValueError(f"mem_util must be within 0-1, got {self.mem_util}")
        if not self.dynamic_power_w >= 0.0 or math.isinf(self.dynamic_power_w):
            raise ValueError(f"dynamic_power_w must be finite and >= 0, got {self.dynamic_power_w}")
        if self.pid is not None and self.pid <= 0:
            raise ValueError(f"pid must be > 0, got {self.pid}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {self.memory_bytes}")


class LoadSource(Protocol):
    """What the environment does to one GPU over time (a scenario, bound to a GPU).

    Times are seconds since the simulation started.
    """

    @property
    def cooling_varies(self) -> bool:
        """Whether ``sink_factor`` changes over time (else it is always 1)."""
        ...

    def loads_at(self, t: float) -> tuple[Load, ...]: ...

    def next_change(self, t: float) -> float:
        """The first time strictly after ``t`` at which ``loads_at`` changes, or inf."""
        ...

    def sink_factor(self, t: float) -> float:
        """Multiplier on the heatsink-to-air resistance (1 = healthy cooling)."""
        ...


class ModelState(NamedTuple):
    """Exact (noise-free) state of one GPU at time ``t`` (seconds since start).

    ``sm_clock_mhz`` is the effective clock: the firmware dithers between 15 MHz bins
    around it, so it is not quantised here; the sensor quantises what it reports.
    """

    t: float
    temp_c: float
    power_w: float  # instantaneous
    avg_power_w: float  # over the preset's power window, as NVML reports it
    energy_j: float
    sm_clock_mhz: float
    reasons: ThrottleReason
    util: float
    mem_util: float
    procs: tuple[int, ...]
    busy_s: float = 0.0  # integral of util over time: what the load has moved so far
    proc_memory: tuple[tuple[int, int], ...] = ()  # (pid, bytes) of each process


class _Control(NamedTuple):
    clock: float
    power: float
    reasons: int  # ThrottleReason bits


class GpuModel:
    """Thermal RC network + power-cap and thermal clock controllers for one GPU.

    Not thread-safe: the owner serialises calls.
    """

    def __init__(self, preset: GpuPreset, source: LoadSource) -> None:
        self.preset = preset
        self._source = source
        p = preset
        self._fmax = p.max_sm_clock_mhz
        self._fmin = p.min_sm_clock_mhz
        self._bin = p.clock_bin_mhz
        self._k = p.power_exponent
        self._inv_k = 1.0 / p.power_exponent
        self._hw_clock = math.floor(self._fmax * _HW_SLOWDOWN_CLOCK_RATIO / self._bin) * self._bin
        self._settle_s = max(5.0 * p.die_tau_s, p.power_window_s)
        self._e_die_h = math.exp(-p.thermal_horizon_s / p.die_tau_s)
        self._t = 0.0
        self._external: Load | None = None
        self._scenario_loads: tuple[Load, ...] = source.loads_at(0.0)
        self._fine_until = 0.0
        self._next_change = 0.0
        self._set_sink_factor(source.sink_factor(0.0))
        self._refresh_loads()
        # Start at the idle equilibrium: T = amb + R*P and P = idle + leak*(T - ref).
        r_tot = p.die_r_c_per_w + self._r_sink
        p_idle = (p.idle_power_w + p.leakage_w_per_c * (p.ambient_c - p.ref_temp_c)) / (
            1.0 - p.leakage_w_per_c * r_tot
        )
        self._d_die = p.die_r_c_per_w * p_idle
        self._d_sink = self._r_sink * p_idle
        self._energy = 0.0
        self._busy_s = 0.0
        start_power = self._control(p.thermal_horizon_s).power
        # Energy checkpoints for the windowed average; the first pretends the GPU ran
        # at its starting power for one window before the simulation began.
        self._history: deque[tuple[float, float]] = deque(
            [(-p.power_window_s, -start_power * p.power_window_s), (0.0, 0.0)]
        )

    # ---------------------------------------------------------------- inputs

    @property
    def t(self) -> float:
        """Model time: seconds since the simulation started."""
        return self._t

    def set_external_load(self, load: Load | None) -> None:
        """Add (or with None remove) a load on top of the scenario's, from now on."""
        self._external = load
        self._refresh_loads()

    # ---------------------------------------------------------------- integration

    def advance(self, t: float) -> None:
        """Integrate up to time ``t``; a time in the past is a no-op."""
        while self._t < t:
            if self._t >= self._next_change:
                self._scenario_loads = self._source.loads_at(self._t)
                self._refresh_loads()
            h = t - self._t
            limit = FINE_STEP_S if self._t < self._fine_until else COARSE_STEP_S
            to_event = self._next_change - self._t
            if to_event <= h and to_event <= limit:
                self._step(to_event)
                self._t = self._next_change  # land exactly on the event
            elif h <= limit:
                self._step(h)
                self._t = t
            else:
                self._step(limit)
                self._t += limit
            self._history.append((self._t, self._energy))
        if self._t >= self._next_change:
            self._scenario_loads = self._source.loads_at(self._t)
            self._refresh_loads()
        self._trim_history()

    def state(self) -> ModelState:
        """The exact state at the current model time."""
        c = self._control(self.preset.thermal_horizon_s)
        return ModelState(
            t=self._t,
            temp_c=self.preset.ambient_c + self._d_die + self._d_sink,
            power_w=c.power,
            avg_power_w=self._average_power(),
            energy_j=self._energy,
            sm_clock_mhz=c.clock,
            reasons=ThrottleReason(c.reasons),
            util=self._util,
            mem_util=self._mem_util,
            procs=self._procs,
            busy_s=self._busy_s,
            proc_memory=self._proc_memory,
        )

    # ---------------------------------------------------------------- internals

    def _refresh_loads(self) -> None:
        """Recompute load aggregates; time-slice when utilisations add past 1."""
        loads = self._scenario_loads
        if self._external is not None:
            loads = (*loads, self._external)
        total = sum((ld.util for ld in loads), 0.0)
        scale = 1.0 / total if total > 1.0 else 1.0
        self._dyn = sum(ld.dynamic_power_w * ld.util for ld in loads) * scale
        self._util = min(1.0, total)
        self._mem_util = min(1.0, sum((ld.mem_util * ld.util for ld in loads), 0.0) * scale)
        self._busy = total > 0.0
        self._procs = tuple(sorted({ld.pid for ld in loads if ld.pid is not None}))
        memory: dict[int, int] = {}
        for ld in loads:
            if ld.pid is not None:
                memory[ld.pid] = memory.get(ld.pid, 0) + ld.memory_bytes
        self._proc_memory = tuple(sorted(memory.items()))
        self._next_change = self._source.next_change(self._t)
        self._fine_until = self._t + self._settle_s

    def _set_sink_factor(self, factor: float) -> None:
        self._r_sink = self.preset.sink_r_c_per_w * factor
        # Heat capacity is fixed, so tau = R*C grows with R.
        self._tau_sink = self.preset.sink_tau_s * factor

    def _control(self, horizon: float) -> _Control:
        """Pick the SM clock the firmware would run now, and the power it draws."""
        p = self.preset
        temp = p.ambient_c + self._d_die + self._d_sink
        static = p.idle_power_w + p.leakage_w_per_c * (temp - p.ref_temp_c)
        dyn = self._dyn
        hot = temp >= p.slowdown_temp_c
        if dyn <= 0.0:
            reasons = _NONE if self._busy else _IDLE
            return _Control(self._fmax, static, (reasons | _HW_THERMAL) if hot else reasons)
        fmax = self._fmax
        inv_k = self._inv_k
        # Power cap: the highest clock whose power fits under the firmware's setpoint.
        budget = p.power_limit_w * POWER_CAP_SETPOINT - static
        f_cap = fmax if budget >= dyn else fmax * (budget / dyn) ** inv_k if budget > 0 else 0.0
        # Software thermal slowdown: the power that brings the die to the target
        # temperature one horizon from now, given both stages' current heat.
        e_die = (
            self._e_die_h if horizon == p.thermal_horizon_s else math.exp(-horizon / p.die_tau_s)
        )
        e_sink = math.exp(-horizon / self._tau_sink)
        gain = p.die_r_c_per_w * (1.0 - e_die) + self._r_sink * (1.0 - e_sink)
        p_thermal = (
            p.thermal_target_c - p.ambient_c - self._d_die * e_die - self._d_sink * e_sink
        ) / gain
        th_budget = p_thermal - static
        f_th = (
            fmax
            if th_budget >= dyn
            else fmax * (th_budget / dyn) ** inv_k
            if th_budget > 0
            else 0.0
        )
        f = min(f_cap, f_th)
        reasons = _NONE
        if f_cap < fmax and f_cap - f < self._bin:
            reasons |= _POWER
        if f_th < fmax and f_th - f < self._bin:
            reasons |= _SW_THERMAL
        if f < self._fmin:
            f = self._fmin
        if hot:  # the hardware clamp overrides everything, the minimum clock included
            reasons |= _HW_THERMAL
            f = min(f, self._hw_clock)
        return _Control(f, static + dyn * (f / fmax) ** self._k, reasons)

    def _step(self, h: float) -> None:
        """Hold this instant's power for ``h`` seconds; exact for each RC stage."""
        if self._source.cooling_varies:
            self._set_sink_factor(self._source.sink_factor(self._t))
        p = self.preset
        power = self._control(max(p.thermal_horizon_s, h)).power
        e_die = math.exp(-h / p.die_tau_s)
        e_sink = math.exp(-h / self._tau_sink)
        ss_die = p.die_r_c_per_w * power
        ss_sink = self._r_sink * power
        self._d_die = ss_die + (self._d_die - ss_die) * e_die
        self._d_sink = ss_sink + (self._d_sink - ss_sink) * e_sink
        self._energy += power * h
        self._busy_s += self._util * h

    def _trim_history(self) -> None:
        start = self._t - self.preset.power_window_s
        hist = self._history
        while len(hist) > 2 and hist[1][0] <= start:
            hist.popleft()

    def _average_power(self) -> float:
        """Mean power over the last window, from energy checkpoints (exact)."""
        window = self.preset.power_window_s
        start = self._t - window
        (t0, e0), (t1, e1) = self._history[0], self._history[1]
        e_start = e0 + (e1 - e0) * (start - t0) / (t1 - t0)
        return (self._energy - e_start) / window
