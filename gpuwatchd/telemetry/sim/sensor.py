"""What NVML would report for a model state: rounding, noise and clock jitter.

Kept apart from the physics so the model stays exact (energy, tests of the
controllers) while samples look like a real GPU's: integer °C, power with ~±1 %
noise, a power-capped clock that hunts around its setpoint by a few 15 MHz bins.
"""

from __future__ import annotations

import bisect
import itertools
import random

from gpuwatchd.telemetry.sim.model import ModelState
from gpuwatchd.telemetry.sim.profiles import GpuPreset
from gpuwatchd.telemetry.types import Sample, SlowReading, ThrottleReason

TEMP_NOISE_C = 0.25
POWER_NOISE_RATIO = 0.004  # sigma; 2.5 sigma = 1 %
#: Under the power cap the firmware hunts around its setpoint: offsets in clock bins
#: and how often each was seen in the H200 trace (around its 1440 MHz median).
_CAP_JITTER_BINS = (-3, -2, -1, 0, 1, 2, 3, 4, 5)
_CAP_JITTER_COUNTS = (4, 117, 302, 273, 238, 64, 40, 32, 6)
_CAP_CUMULATIVE = tuple(itertools.accumulate(_CAP_JITTER_COUNTS))
THERMAL_JITTER_P = 0.1  # each of one bin up / one bin down
UNTHROTTLED_JITTER_P = 0.05  # one bin down while busy at full clock
IDLE_REASON_P = 0.9  # idle GPUs report GPU_IDLE, else 0, like the H200 does

_IDLE = ThrottleReason.GPU_IDLE
_NONE = ThrottleReason(0)
# Bits, tested on a reason's int value: a Flag's ``&`` builds a new member per call.
_POWER = ThrottleReason.SW_POWER_CAP.value
_SW_THERMAL = ThrottleReason.SW_THERMAL_SLOWDOWN.value
_HW_THERMAL = ThrottleReason.HW_THERMAL_SLOWDOWN.value


class Sensor:
    """Turns exact model states of one GPU into noisy samples, from its own RNG."""

    def __init__(self, gpu: int, preset: GpuPreset, rng: random.Random) -> None:
        self._gpu = gpu
        self._rng = rng
        self._bin = preset.clock_bin_mhz
        self._fmin = preset.min_sm_clock_mhz
        self._fmax = preset.max_sm_clock_mhz
        self._mem_clock = preset.mem_clock_mhz

    def sample(self, t: float, s: ModelState, slow: SlowReading | None = None) -> Sample:
        """A noisy reading of state ``s`` at backend time ``t``, carrying ``slow``."""
        rng = self._rng
        reasons = s.reasons
        # Stochastic rounding to a bin: the firmware dithers between the two bins
        # around the effective clock, so reports average to it.
        bins, frac = divmod(s.sm_clock_mhz, self._bin)
        clock = (bins + (rng.random() < frac / self._bin)) * self._bin
        bits = reasons.value
        if bits & _HW_THERMAL:
            pass  # a hard clamp to a fixed clock: no hunting
        elif bits & _POWER:
            pick = bisect.bisect_right(_CAP_CUMULATIVE, rng.random() * _CAP_CUMULATIVE[-1])
            clock += _CAP_JITTER_BINS[pick] * self._bin
        elif bits & _SW_THERMAL:
            u = rng.random()
            if u < THERMAL_JITTER_P:
                clock -= self._bin
            elif u < 2 * THERMAL_JITTER_P:
                clock += self._bin
        elif s.util > 0.0 and rng.random() < UNTHROTTLED_JITTER_P:
            clock -= self._bin
        clock = min(self._fmax, max(self._fmin, clock))
        if reasons == _IDLE and rng.random() >= IDLE_REASON_P:
            reasons = _NONE
        return Sample(
            gpu=self._gpu,
            t=t,
            temp_c=float(round(s.temp_c + rng.gauss(0.0, TEMP_NOISE_C))),
            power_w=round(s.avg_power_w * (1.0 + rng.gauss(0.0, POWER_NOISE_RATIO)), 3),
            sm_clock_mhz=clock,
            mem_clock_mhz=self._mem_clock,
            reasons=reasons,
            util_gpu=round(s.util, 2),
            util_mem=round(s.mem_util, 2),
            procs=s.procs,
            pstate=0,
            slow=slow,
        )
