"""Device sessions the protocol can measure on without a GPU: the CPU and the simulated GPU.

``CpuSession`` times with ``perf_counter`` and reports samples whose GPU fields are
absent (None), so nothing is rejected and settling falls back to elapsed time.
``SimSession`` runs simulated kernels on a :class:`~gpuwatchd.telemetry.sim.SimBackend`
in simulated time on a :class:`~gpuwatchd.telemetry.clocks.ManualClock`: a batch loads
the simulated GPU with the candidate's power draw and advances the clock in sub-steps
so the thermal and power-cap model integrate while the kernel runs.
"""

from __future__ import annotations

import math
import os
import platform
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError

if TYPE_CHECKING:
    from gpuwatchd.telemetry.clocks import ManualClock
    from gpuwatchd.telemetry.sim import SimBackend


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class CpuSession:
    """Measures on the host CPU: wall-clock batches, no telemetry.

    ``flush_l2`` rewrites a buffer larger than a typical L2 plus a slice of L3
    (``flush_bytes``) so a small operand set starts cold, as on a GPU.
    """

    def __init__(self, flush_bytes: int = 8 * 2**20) -> None:
        if flush_bytes < 0:
            raise ValueError(f"flush_bytes must be >= 0, got {flush_bytes}")
        self.info = DeviceInfo(index=0, uuid="cpu-0", name=_cpu_name())
        self._buf = bytearray(flush_bytes)
        self._fill = 0

    def sample(self) -> Sample:
        return Sample(gpu=self.info.index, t=self.now())

    def time_batch(self, candidate: Candidate, calls: int) -> float:
        t0 = time.perf_counter()
        candidate.run(calls)
        return time.perf_counter() - t0

    def flush_l2(self) -> None:
        self._fill = (self._fill + 1) & 0xFF
        self._buf[:] = bytes([self._fill]) * len(self._buf)

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def now(self) -> float:
        return time.perf_counter()


#: Share of the power limit kept free while the limiter has not engaged (see SimSession).
_HEADROOM_MARGIN = 0.03


@runtime_checkable
class SimulatedKernel(Protocol):
    """What a :class:`SimSession` needs from a candidate (see ``families.sim``)."""

    name: str
    dynamic_power_w: float

    def seconds_per_call(self, sm_clock_mhz: float, max_sm_clock_mhz: float) -> float: ...


class SimSession:
    """Runs simulated kernels on one GPU of a :class:`SimBackend`, in simulated time.

    ``time_batch`` loads the GPU with the kernel's dynamic power and advances the
    manual clock in sub-steps of at most ``substep_s``; in each, the kernel progresses
    at the rate the model's current SM clock allows, so a batch slows down as soon as
    the power cap or the thermal controller lowers the clock. The load stays on after
    a batch (back-to-back batches keep the GPU busy) until ``pause`` clears it.

    Power-limit latency: the sim model caps the clock the instant a load exceeds the
    limit, but the H200 firmware does not: in the recorded burn the matmul started at
    t=4.796 s and the clock held 1980 MHz with no reason until ~5.0 s, then fell to
    ~1500 MHz with SW_POWER_CAP. That window is what lets short, paused batches run
    at full clock (the unthrottled regime). The session reproduces it with a limiter
    that acts on power filtered with time constant ``limiter_tau_s`` (0.4 s puts the
    cap 0.23 s after an idle start, as in the trace): while the filtered power is under
    the limit, the kernel's power handed to the model is trimmed to fit under it, so
    the model keeps the full clock and reports no reason; once it is over, the
    kernel's full power goes to the model, which caps the clock. ``limiter_tau_s=0``
    turns this off (a model with its own limiter latency needs no help).

    ``sample`` reads the backend and adds every throttle reason the model showed
    since the previous sample: NVML's reasons are only a snapshot, and a throttle
    that came and went inside a batch must still reach the protocol. The batch time
    carries ``noise`` relative Gaussian jitter (seeded), like CUDA-event timings do.
    """

    def __init__(
        self,
        backend: SimBackend,
        clock: ManualClock,
        gpu: int = 0,
        *,
        substep_s: float = 0.01,
        noise: float = 0.002,
        seed: int = 0,
        pid: int | None = None,
        limiter_tau_s: float = 0.4,
    ) -> None:
        if substep_s <= 0:
            raise ValueError(f"substep_s must be > 0, got {substep_s}")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        if limiter_tau_s < 0:
            raise ValueError(f"limiter_tau_s must be >= 0, got {limiter_tau_s}")
        self.backend = backend
        self.clock = clock
        self.gpu = gpu
        self.info = backend.device_info(gpu)
        self._view = backend.model(gpu)
        self._substep = substep_s
        self._noise = noise
        self._rng = random.Random(f"gpuwatchd-sim-session:{seed}:{gpu}")
        self._pid = pid if pid is not None else os.getpid()  # the load shows as ours
        self._seen = ThrottleReason(0)
        self._tau = limiter_tau_s
        self._limit = self.info.power_limit_w
        self._filtered_w = self._view.power_w  # the limiter's view of power
        self._applied_w: float | None = None  # dynamic power handed to the model now
        self._engaged = False  # the limiter caps until the load stops
        self._static_w = self._filtered_w  # board power without the kernel's dynamic power

    @classmethod
    def create(
        cls,
        scenario: str = "idle",
        seed: int = 0,
        gpu: int = 0,
        *,
        substep_s: float = 0.01,
        noise: float = 0.002,
        limiter_tau_s: float = 0.4,
    ) -> SimSession:
        """A session on a fresh simulated GPU with its own manual clock."""
        from gpuwatchd.telemetry.clocks import ManualClock
        from gpuwatchd.telemetry.sim import SimBackend

        clock = ManualClock()
        backend = SimBackend(gpus=gpu + 1, scenario=scenario, seed=seed, clock=clock)
        return cls(
            backend,
            clock,
            gpu,
            substep_s=substep_s,
            noise=noise,
            seed=seed,
            limiter_tau_s=limiter_tau_s,
        )

    def sample(self) -> Sample:
        s = self.backend.read(self.gpu)
        seen, self._seen = self._seen, ThrottleReason(0)
        if not seen:
            return s
        return replace(s, reasons=(s.reasons or ThrottleReason(0)) | seen)

    def time_batch(self, candidate: Candidate, calls: int) -> float:
        if not isinstance(candidate, SimulatedKernel):
            raise CandidateError(f"{candidate.name}: not a simulated kernel, cannot run on sim")
        view = self._view
        fmax = view.max_sm_clock_mhz
        remaining = float(calls)  # in calls
        elapsed = 0.0
        while remaining > 1e-9:
            true_w = self._load(candidate.dynamic_power_w)
            per_call = candidate.seconds_per_call(view.sm_clock_mhz, fmax)
            step = min(self._substep, remaining * per_call)
            self.clock.advance(step)
            remaining -= step / per_call
            elapsed += step
            self._seen |= view.reasons
            self._filter(true_w if true_w is not None else view.power_w, step)
        return elapsed * max(0.5, 1.0 + self._rng.gauss(0.0, self._noise))

    def flush_l2(self) -> None:
        """Simulated kernels keep no cache state: nothing to flush."""

    def pause(self, seconds: float) -> None:
        if self._applied_w is not None:
            self.backend.clear_load(self.gpu)
            self._applied_w = None
        self._engaged = False
        if seconds > 0:
            self.clock.advance(seconds)
            self._filter(self._view.power_w, seconds)

    def now(self) -> float:
        return self.clock.now()

    def _load(self, dynamic_w: float) -> float | None:
        """Hand the model this step's load.

        Returns the power the GPU really draws while the limiter has not engaged yet
        (the model is handed less), else None. Once engaged, the limiter holds until
        the load stops: a capped kernel's demand stays over the limit.
        """
        applied, true_w = dynamic_w, None
        if not self._engaged and self._tau > 0 and self._limit is not None:
            if self._filtered_w >= self._limit:
                self._engaged = True
            else:
                view = self._view
                if self._applied_w is None or view.sm_clock_mhz >= view.max_sm_clock_mhz:
                    # Exact at full clock: power = static + dynamic * (f/fmax)^k, f = fmax.
                    self._static_w = view.power_w - (self._applied_w or 0.0)
                # The margin covers the firmware's setpoint under the limit and the
                # leakage growth within one sub-step.
                headroom = max(0.0, self._limit * (1.0 - _HEADROOM_MARGIN) - self._static_w)
                if dynamic_w > headroom:
                    applied, true_w = headroom, self._static_w + dynamic_w
        if applied != self._applied_w:
            self.backend.set_load(self.gpu, 1.0, applied, self._pid)
            self._applied_w = applied
        return true_w

    def _filter(self, power_w: float, dt: float) -> None:
        if self._tau > 0:
            self._filtered_w = power_w + (self._filtered_w - power_w) * math.exp(-dt / self._tau)
