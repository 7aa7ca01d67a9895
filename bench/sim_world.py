"""A simulated GPU with known truth, for comparing measurement protocols.

Each candidate set is a handful of kernels whose true times at full clock lie within
0.5-5% of the best, run on gpuwatchd's simulated H200 (``SimSession``: power cap fitted
to the recorded burn, 1980 -> ~1440 MHz within ~0.25 s of a heavy load, 40 -> 61 C,
clocks back at once when the load stops). On top of that physics a :class:`NoisySession`
adds what the physics leaves out: per-call and per-batch timing jitter, the capped
clock hunting around its setpoint, rare outliers, small unflagged clock steps and
flagged throttle episodes.

The truth per regime comes from the same physics without any of the noise: the time
of a call at full clock (unthrottled), and at the clock the kernel settles at when it
runs back-to-back for a minute alone (sustained). Compute-bound kernels slow down with
the clock, memory-bound ones less, and each draws its own power, so a set's winner can
change between regimes.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.sim import H200, SimBackend
from gpuwatchd.telemetry.types import Sample, ThrottleReason
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError
from gpuwatchd.tuning.worker.devices import SimSession

#: Set kinds and their shares: power-capped kernels, kernels near the cap, light ones.
KINDS = (("heavy", 0.6), ("borderline", 0.15), ("light", 0.25))
#: Dynamic power ranges (W above idle at max clock) per kind. The H200 sim caps at
#: ~693 W with ~147 W static when warm: borderline sets cross the cap only once warm.
POWER_W = {"heavy": (900.0, 1400.0), "borderline": (520.0, 600.0), "light": (150.0, 450.0)}
#: Correlation time of the capped clock's hunting: a longer timed region averages it.
DITHER_TAU_S = 0.005
#: Relative spread of the capped clock's hunting (H200 trace: 1410-1515 MHz around 1440).
DITHER_REL = 0.015
#: A heavy GEMM that puts the GPU at its power cap before a "hot" start.
PREHEAT_S = 20.0
PREHEAT_DYNAMIC_W = 1325.0
HORIZON_S = 600.0 + PREHEAT_S  # disturbance schedules cover this much simulated time


@dataclass(frozen=True, slots=True)
class KernelTruth:
    """One candidate: its physics, and its true time per call in each regime."""

    name: str
    compute_s: float  # time that scales with the SM clock, at max clock
    memory_s: float  # time that does not
    dynamic_power_w: float
    unthrottled_s: float
    sustained_s: float
    settled_clock_mhz: float


@dataclass(frozen=True, slots=True)
class Noise:
    """Timing noise of one set; see :meth:`NoisySession.time_batch`."""

    batch_rel: float  # common to a whole timed region
    call_rel: float  # independent per call, so it averages down in a batch
    outlier_p: float  # per call: one call delayed by 10-100%
    minor_rate_hz: float  # unflagged clock steps of 0.5-3%, 0.1-1 s long
    major_rate_hz: float  # flagged throttle episodes to 60-90% of the clock, 0.1-1 s long


@dataclass(frozen=True, slots=True)
class CandidateSet:
    index: int
    seed: int
    kind: str
    start: str  # "cool": idle GPU; "hot": a heavy load ran until the measurement began
    kernels: tuple[KernelTruth, ...]  # in list order: the order anchors time them in
    noise: Noise

    def best(self, regime: str) -> KernelTruth:
        return min(self.kernels, key=lambda k: _truth(k, regime))

    def regret(self, regime: str, pick: str | None) -> float:
        """How much slower the pick truly is than the best, relative (inf: no pick)."""
        if pick is None:
            return math.inf
        by_name = {k.name: k for k in self.kernels}
        best = _truth(self.best(regime), regime)
        return _truth(by_name[pick], regime) / best - 1.0


def _truth(k: KernelTruth, regime: str) -> float:
    if regime == "unthrottled":
        return k.unthrottled_s
    if regime == "sustained":
        return k.sustained_s
    raise ValueError(f"regime: unknown {regime!r}")


def settled_clock_mhz(dynamic_power_w: float, seconds: float = 60.0) -> float:
    """The SM clock a kernel of this power settles at running alone back-to-back."""
    clock = ManualClock()
    backend = SimBackend(clock=clock)
    backend.set_load(0, 1.0, dynamic_power_w)
    clock.advance(seconds)
    return backend.model(0).sm_clock_mhz


def make_set(index: int, seed: int = 0) -> CandidateSet:
    """The ``index``-th random candidate set of a benchmark run with ``seed``."""
    rng = random.Random(f"gpuwatchd-bench-set:{seed}:{index}")
    kind = _pick(rng, KINDS)
    n = rng.randint(3, 10)
    best_s = math.exp(rng.uniform(math.log(0.5e-3), math.log(3e-3)))
    compute_share = rng.uniform(0.6, 0.95)
    power = rng.uniform(*POWER_W[kind])
    fmax = H200.max_sm_clock_mhz
    kernels = []
    for i in range(n):
        t_u = best_s * (1.0 if i == 0 else 1.0 + rng.uniform(0.005, 0.05))
        c = min(0.99, max(0.3, compute_share + rng.uniform(-0.08, 0.08)))
        dyn = power * rng.uniform(0.9, 1.1)
        f = settled_clock_mhz(dyn)
        compute_s, memory_s = c * t_u, (1.0 - c) * t_u
        kernels.append(
            KernelTruth(
                name=f"k{i}",
                compute_s=compute_s,
                memory_s=memory_s,
                dynamic_power_w=dyn,
                unthrottled_s=t_u,
                sustained_s=compute_s * fmax / f + memory_s,
                settled_clock_mhz=f,
            )
        )
    rng.shuffle(kernels)
    noise = Noise(
        batch_rel=rng.uniform(0.001, 0.003),
        call_rel=rng.uniform(0.005, 0.015),
        outlier_p=rng.uniform(0.002, 0.01),
        minor_rate_hz=0.1,
        major_rate_hz=1.0 / 40.0,
    )
    start = "cool" if rng.random() < 0.5 else "hot"
    return CandidateSet(index, seed, kind, start, tuple(kernels), noise)


def _pick(rng: random.Random, shares: tuple[tuple[str, float], ...]) -> str:
    u = rng.random()
    for name, share in shares:
        if u < share:
            return name
        u -= share
    return shares[-1][0]


@dataclass(frozen=True, slots=True)
class Episode:
    """A stretch of simulated time during which the SM clock runs slower."""

    start: float
    end: float
    factor: float  # multiplies the SM clock while it lasts
    reasons: ThrottleReason  # what NVML reports while it lasts (none for a minor step)


class Disturbances:
    """A seeded schedule of clock steps and throttle episodes over simulated time."""

    def __init__(self, noise: Noise, seed: str, horizon_s: float = HORIZON_S) -> None:
        rng = random.Random(f"gpuwatchd-bench-disturbances:{seed}")
        eps: list[Episode] = []
        for rate, lo, hi, reasons in (
            (noise.minor_rate_hz, 0.97, 0.995, ThrottleReason(0)),
            (noise.major_rate_hz, 0.6, 0.9, ThrottleReason.HW_SLOWDOWN),
        ):
            t = rng.expovariate(rate) if rate > 0 else math.inf
            while t < horizon_s:
                eps.append(Episode(t, t + rng.uniform(0.1, 1.0), rng.uniform(lo, hi), reasons))
                t += rng.expovariate(rate)
        eps.sort(key=lambda e: e.start)
        self.episodes = tuple(eps)
        self._starts = [e.start for e in eps]

    def _near(self, t0: float, t1: float) -> list[Episode]:
        """Episodes that overlap [t0, t1] (none lasts over a second)."""
        lo = bisect.bisect_left(self._starts, t0 - 1.0)
        hi = bisect.bisect_right(self._starts, t1)
        return [e for e in self.episodes[lo:hi] if e.end > t0 and e.start <= t1]

    def factor_at(self, t: float) -> float:
        f = 1.0
        for e in self._near(t, t):
            f *= e.factor
        return f

    def reasons_between(self, t0: float, t1: float) -> ThrottleReason:
        out = ThrottleReason(0)
        for e in self._near(t0, t1):
            out |= e.reasons
        return out


class BenchKernel:
    """A candidate that only a :class:`NoisySession` runs; slowed by the session's episodes."""

    family = "bench.sim"

    def __init__(self, truth: KernelTruth, clock_factor: Callable[[], float]) -> None:
        self.name = truth.name
        self.truth = truth
        self.dynamic_power_w = truth.dynamic_power_w
        self._factor = clock_factor

    @property
    def compute_share(self) -> float:
        return self.truth.compute_s / (self.truth.compute_s + self.truth.memory_s)

    def seconds_per_call(self, sm_clock_mhz: float, max_sm_clock_mhz: float) -> float:
        f = sm_clock_mhz * self._factor()
        if f <= 0:
            raise CandidateError(f"{self.name}: SM clock {f} MHz, cannot run")
        return self.truth.compute_s * max_sm_clock_mhz / f + self.truth.memory_s

    def setup(self) -> None:
        return None

    def run(self, calls: int) -> None:
        raise CandidateError(f"{self.name}: runs only on a simulated session")

    def meta(self) -> dict[str, Any]:
        # Far bigger than L2, like the GEMMs and convs it stands for: no flush needed.
        return {"working_set_bytes": 1 << 30}

    def teardown(self) -> None:
        return None


HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e: what an L2 flush's memset runs at


class NoisySession(SimSession):
    """``SimSession`` plus timing noise, clock steps, throttle episodes and meters.

    Meters: ``busy_s`` (seconds the GPU ran kernels, flushes included), ``paused_s``
    (seconds a protocol left it idle on purpose) and :meth:`energy_j` (the model's exact
    energy since the backend started); ``timed_s`` (the timed batches, as measured) and
    ``settle_s`` (the sustained regime's settling) are filled in by the gpuwatchd runner
    of bench/protocol_vs_anchors.py.
    ``flush_bytes`` is how much ``flush_l2`` writes (each anchor flushes its own way).
    """

    def __init__(self, cset: CandidateSet, tag: str) -> None:
        clock = ManualClock()
        backend = SimBackend(clock=clock, seed=cset.seed)
        super().__init__(backend, clock, noise=0.0, seed=cset.index)
        self.cset = cset
        self.disturbances = Disturbances(cset.noise, f"{cset.seed}:{cset.index}")
        self._rng = random.Random(f"gpuwatchd-bench-noise:{cset.seed}:{cset.index}:{tag}")
        self._last_sample_t = 0.0
        self.flush_bytes = 100 * 2**20
        if cset.start == "hot":
            self._preheat()
        self.busy_s = 0.0
        self.paused_s = 0.0
        self.timed_s = 0.0
        self.settle_s = 0.0
        self.t0 = self.now()
        self.e0 = self.energy_j()

    def kernels(self, cset: CandidateSet | None = None) -> list[BenchKernel]:
        """The kernels of ``cset`` (default: the session's own set) on this device."""
        return [BenchKernel(k, self.clock_factor) for k in (cset or self.cset).kernels]

    def clock_factor(self) -> float:
        return self.disturbances.factor_at(self.now())

    def energy_j(self) -> float:
        return self.backend.read_energy(self.gpu)

    def elapsed_s(self) -> float:
        return self.now() - self.t0

    def used_energy_j(self) -> float:
        return self.energy_j() - self.e0

    def _preheat(self) -> None:
        """A heavy GEMM runs back-to-back and is still running when the protocol starts."""
        heavy = KernelTruth("preheat", 0.9e-3, 0.1e-3, PREHEAT_DYNAMIC_W, 1e-3, 1e-3, 0.0)
        kernel = BenchKernel(heavy, lambda: 1.0)
        fine, self._substep = self._substep, 0.25
        try:
            super().time_batch(kernel, round(PREHEAT_S / 1e-3))
        finally:
            self._substep = fine
        self._last_sample_t = self.now()

    def time_batch(self, candidate: Candidate, calls: int) -> float:
        """The batch's exact time plus what CUDA events would also see: jitter common to
        the batch, per-call jitter that averages down over its calls, the capped clock's
        hunting (on the compute share, averaged over the batch) and outlier calls."""
        exact = super().time_batch(candidate, calls)
        self.busy_s += exact
        if not isinstance(candidate, BenchKernel):
            return exact
        n = self.cset.noise
        rng = self._rng
        rel = rng.gauss(0.0, n.batch_rel) + rng.gauss(0.0, n.call_rel / math.sqrt(calls))
        if self._view.reasons & ThrottleReason.SW_POWER_CAP:
            hunt = DITHER_REL * candidate.compute_share
            rel += rng.gauss(0.0, hunt * math.sqrt(DITHER_TAU_S / max(DITHER_TAU_S, exact)))
        per_call = exact / calls
        hits = _outliers(rng, calls, n.outlier_p)
        extra = sum(rng.uniform(0.1, 1.0) * per_call for _ in range(hits))
        return exact * max(0.5, 1.0 + rel) + extra

    def pause(self, seconds: float) -> None:
        super().pause(seconds)
        self.paused_s += max(0.0, seconds)

    def flush_l2(self) -> None:
        """The memset takes its HBM time; the GPU stays loaded as by the last kernel.

        Modelling its own (lower) power would cost a model step per flush for a few
        tens of microseconds of load: the flush counts as time, not as a power change.
        """
        seconds = self.flush_bytes / HBM_BYTES_PER_S
        self.clock.advance(seconds)
        self.busy_s += seconds

    def sample(self) -> Sample:
        s = super().sample()
        reasons = self.disturbances.reasons_between(self._last_sample_t, s.t)
        factor = self.disturbances.factor_at(s.t)
        self._last_sample_t = s.t
        if not reasons and factor == 1.0:
            return s
        clock = s.sm_clock_mhz
        if clock is not None:
            clock = round(clock * factor / 15.0) * 15.0
        return replace(s, sm_clock_mhz=clock, reasons=(s.reasons or ThrottleReason(0)) | reasons)


def _outliers(rng: random.Random, calls: int, prob: float) -> int:
    """How many of ``calls`` calls were hit by an outlier (binomial, normal beyond 50)."""
    if calls <= 50:
        return sum(rng.random() < prob for _ in range(calls))
    mean = calls * prob
    return max(0, round(rng.gauss(mean, math.sqrt(mean * (1.0 - prob)))))
