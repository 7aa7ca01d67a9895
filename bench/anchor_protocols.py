"""The measurement protocols gpuwatchd is compared with, on any ``DeviceSession``.

Each is a faithful re-implementation of what the anchor does when it picks a kernel,
so it can run in simulated time against a known truth:

- cuDNN's find (cudnn-frontend ``time_sorted_plan``): candidates in list order, one
  untimed warm-up run each, then ``SAMPLE_ONCE`` (one timed run, what
  ``cudnn.benchmark`` does), ``MEDIAN_OF_THREE`` (median of three runs) or
  ``TILL_STABLE`` (repeat while a run is over 5% faster than the best so far, up to
  100; keep the best). No cache flush, no pauses.
- Triton's ``do_bench`` as ``triton.autotune`` calls it: candidates in list order; per
  candidate one call, five flushed calls to estimate its time, ``25 ms`` of warm-up
  calls, then ``100 ms`` of calls each after a 256 MB cache clear, timed one by one;
  the pick has the lowest (median, 20th, 80th percentile).
- nvbench's cold measurement (``measure_cold`` + the ``stdrel`` criterion): candidates
  in list order; one warm-up; samples of one call after an L2 flush; a sample taken
  while the SM clock is under 75% of the rated clock is discarded and followed by a
  recovery sleep (50 ms, growing after three discards in a row); stop once at least
  10 samples and 0.5 s of GPU time are in and the relative standard deviation is under
  0.5% (or has itself stopped moving), or after 15 s; the pick has the lowest mean.

Every anchor returns the candidate it would use and its own statistic per candidate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatchd.tuning.worker import stats
from gpuwatchd.tuning.worker.candidate import Candidate, DeviceSession

CUDNN_TECHNIQUES = ("sample_once", "median_of_three", "till_stable")
#: cudnn-frontend: TILL_STABLE goes on while a run beats the best so far by 5%.
CUDNN_STABLE_RATIO = 0.95
CUDNN_MAX_ITERS = 100


@dataclass(frozen=True, slots=True)
class AnchorResult:
    """The anchor's pick and the statistic it ranked by (seconds per call)."""

    pick: str
    times_s: dict[str, float]
    samples: dict[str, int]


def _first_min(times: dict[str, float], key: dict[str, tuple[float, ...]] | None = None) -> str:
    """The lowest, first in list order on a tie (a C++ std::set / Python min do the same)."""
    keys = key or {name: (t,) for name, t in times.items()}
    return min(times, key=lambda name: keys[name])


def cudnn_find(
    session: DeviceSession, candidates: Sequence[Candidate], technique: str
) -> AnchorResult:
    """cudnn-frontend's ``time_sorted_plan`` with one of its sampling techniques."""
    if technique not in CUDNN_TECHNIQUES:
        raise ValueError(f"technique: expected one of {CUDNN_TECHNIQUES}, got {technique!r}")
    times: dict[str, float] = {}
    samples: dict[str, int] = {}
    for cand in candidates:
        session.time_batch(cand, 1)  # the warm-up run; its time is not used
        if technique == "sample_once":
            runs = [session.time_batch(cand, 1)]
            final = runs[0]
        elif technique == "median_of_three":
            runs = [session.time_batch(cand, 1) for _ in range(3)]
            a, b, c = runs
            final = max(min(a, b), min(max(a, b), c))
        else:
            runs, best, final = [], math.inf, math.inf
            for _ in range(CUDNN_MAX_ITERS):
                t = session.time_batch(cand, 1)
                runs.append(t)
                final = min(best, t)
                if t / best < CUDNN_STABLE_RATIO:
                    best = final
                else:
                    break
        times[cand.name] = final
        samples[cand.name] = len(runs)
    return AnchorResult(_first_min(times), times, samples)


def triton_autotune(
    session: DeviceSession,
    candidates: Sequence[Candidate],
    warmup_s: float = 0.025,
    rep_s: float = 0.100,
) -> AnchorResult:
    """``triton.autotune`` over the candidates, each timed by ``do_bench``.

    The session's ``flush_l2`` stands for do_bench's 256 MB cache clear; the estimate
    covers five (clear, call) pairs end to end, as do_bench's two events do.
    """
    times: dict[str, float] = {}
    keys: dict[str, tuple[float, ...]] = {}
    samples: dict[str, int] = {}
    for cand in candidates:
        session.time_batch(cand, 1)  # fn() then synchronize
        begin = session.now()
        for _ in range(5):
            session.flush_l2()
            session.time_batch(cand, 1)
        estimate = max((session.now() - begin) / 5, 1e-9)
        n_warmup = max(1, int(warmup_s / estimate))
        n_repeat = max(1, int(rep_s / estimate))
        session.time_batch(cand, n_warmup)  # warm-up calls, back-to-back, untimed
        runs = []
        for _ in range(n_repeat):
            session.flush_l2()
            runs.append(session.time_batch(cand, 1))
        keys[cand.name] = tuple(stats.quantile(runs, q) for q in (0.5, 0.2, 0.8))
        times[cand.name] = keys[cand.name][0]
        samples[cand.name] = n_repeat
    return AnchorResult(_first_min(times, keys), times, samples)


@dataclass(frozen=True, slots=True)
class NvbenchRule:
    """nvbench's defaults for a cold measurement with the stdrel criterion."""

    throttle_threshold: float = 0.75
    recovery_delay_s: float = 0.05
    min_samples: int = 10
    min_time_s: float = 0.5
    max_noise: float = 0.005
    timeout_s: float = 15.0
    noise_window: int = 512  # the criterion's ring buffer of noise values
    converged_rel: float = 0.05  # noise counted as converged when its own rel stdev is under


def nvbench_cold(
    session: DeviceSession, candidates: Sequence[Candidate], rule: NvbenchRule | None = None
) -> AnchorResult:
    """nvbench's cold measurement of each candidate in list order; lowest mean wins."""
    r = rule or NvbenchRule()
    rated = session.info.max_sm_clock_mhz
    times: dict[str, float] = {}
    samples: dict[str, int] = {}
    for cand in candidates:
        session.flush_l2()
        session.time_batch(cand, 1)  # warm-up
        kept = _Moments()
        noise: deque[float] = deque(maxlen=r.noise_window)
        delay, discards = r.recovery_delay_s, 0
        begin = session.now()
        while True:
            session.flush_l2()
            t = session.time_batch(cand, 1)
            clock = session.sample().sm_clock_mhz
            if rated and clock is not None and clock < r.throttle_threshold * rated:
                if discards > 2:
                    delay += min(delay * 1.5, 0.5)
                session.pause(delay)
                discards += 1
            else:
                discards = 0
                kept.add(t)
                rel = kept.rel_stdev()
                if math.isfinite(rel):
                    noise.append(rel)
            if kept.n >= r.min_samples and _stdrel_finished(kept, noise, r):
                break
            if session.now() - begin > r.timeout_s:
                break
        if kept.n:
            times[cand.name] = kept.mean
            samples[cand.name] = kept.n
    if not times:
        raise RuntimeError("nvbench: every sample of every candidate was discarded")
    return AnchorResult(_first_min(times), times, samples)


def _stdrel_finished(kept: _Moments, noise: deque[float], r: NvbenchRule) -> bool:
    if kept.total <= r.min_time_s or not noise:
        return False
    if noise[-1] < r.max_noise:
        return True
    if len(noise) > 64 and kept.n % 16 == 0:
        current = noise[-1]
        sd = math.sqrt(sum((x - current) ** 2 for x in noise) / (len(noise) - 1))
        return sd / current < r.converged_rel
    return False


class _Moments:
    """Running count, sum and sum of squares: a sample's mean and standard deviation."""

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self._sq = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self._sq += x * x

    @property
    def mean(self) -> float:
        return self.total / self.n

    def rel_stdev(self) -> float:
        if self.n < 2:
            return math.inf
        mean = self.mean
        var = max(0.0, (self._sq - self.n * mean * mean) / (self.n - 1))
        return math.sqrt(var) / mean if mean > 0 else math.inf
