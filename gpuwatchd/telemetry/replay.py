"""The ``replay`` backend: plays a recorded ``gpuwatchd-trace/1`` file as if it were a GPU.

Time design (one rule): **the clock ticks in trace seconds.** Replay time is
``clock.now()`` minus the clock's reading at construction, and one clock second
plays one second of the recording. ``speed`` only sets how fast the *default* clock,
``ScaledClock(speed)``, runs against real time; passing both a clock and a speed other
than 1 is refused, so there is never a second scaling factor to reason about. Tests
pass a :class:`ManualClock` and advance it by trace seconds.

``read`` returns the latest sample with ``t <= now`` on the unrolled timeline (the
trace repeated end to end when looping, one sample period between the last sample
and the next loop's first), with ``t`` rebased onto the clock so it keeps increasing
across loops. Without looping, once the whole trace has played :attr:`finished` turns
True and ``read`` keeps returning the last sample with its original (rebased) ``t``,
so consumers see the data go stale rather than a GPU that disappeared.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.telemetry.backend import BackendUnavailable, Clock, GpuLost
from gpuwatchd.telemetry.clocks import ScaledClock
from gpuwatchd.telemetry.trace import Trace, load_trace
from gpuwatchd.telemetry.types import DeviceInfo, Sample


@dataclass(frozen=True, slots=True)
class _Track:
    """One GPU's samples, offsets from the trace start and cumulative energy."""

    samples: tuple[Sample, ...]
    offsets: tuple[float, ...]  # sample.t - trace start, non-decreasing
    energy: tuple[float, ...] | None  # joules from the first sample to each sample
    loop_energy: float | None  # one whole loop, including the wrap segment


def _build_track(samples: tuple[Sample, ...], start: float, loop_s: float) -> _Track:
    offsets = tuple(s.t - start for s in samples)
    powers = [s.power_w for s in samples]
    if any(p is None for p in powers):
        return _Track(samples, offsets, None, None)
    cum = [0.0]
    for i in range(1, len(samples)):
        p0, p1 = powers[i - 1], powers[i]
        assert p0 is not None and p1 is not None
        cum.append(cum[-1] + 0.5 * (p0 + p1) * (offsets[i] - offsets[i - 1]))
    first, last = powers[0], powers[-1]
    assert first is not None and last is not None
    wrap = loop_s - offsets[-1] + offsets[0]
    return _Track(samples, offsets, tuple(cum), cum[-1] + 0.5 * (last + first) * wrap)


class ReplayBackend:
    """A :class:`~gpuwatchd.telemetry.backend.Backend` that plays a recorded trace.

    Raises :class:`~gpuwatchd.telemetry.trace.TraceError` (a ``BackendUnavailable``)
    for a file it cannot read. ``read(gpu)`` before that GPU's first recorded sample
    raises :class:`GpuLost`: the recording has no reading for it yet.
    """

    name = "replay"

    def __init__(
        self,
        path: str | Path,
        speed: float = 1.0,
        loop: bool = True,
        clock: Clock | None = None,
    ) -> None:
        if not (speed > 0 and math.isfinite(speed)):
            raise ValueError(f"speed: must be > 0, got {speed}")
        if clock is not None and speed != 1.0:
            raise ValueError(
                "speed: applies only to the default clock; pass a clock that runs at the "
                "speed you want instead"
            )
        self.trace: Trace = load_trace(path)
        self.clock: Clock = clock if clock is not None else ScaledClock(speed)
        self.loop = loop
        self._origin = self.clock.now()
        self._start = self.trace.start
        #: Length of one loop in trace seconds: the span plus one sample period.
        self.loop_s = self.trace.end - self._start + self.trace.period_s
        self._tracks = {
            gpu: _build_track(samples, self._start, self.loop_s)
            for gpu, samples in self.trace.samples.items()
        }
        self._closed = False

    # -- Backend protocol --------------------------------------------------------

    def devices(self) -> list[int]:
        return sorted(self.trace.devices)

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        """The trace header's facts; a recording never changes, so ``refresh`` reads the same."""
        self._track(gpu)
        return self.trace.devices[gpu]

    def read(self, gpu: int) -> Sample:
        track = self._track(gpu)
        loop_i, idx, _ = self._locate(track, self._elapsed())
        if idx < 0:
            raise GpuLost(gpu, "the trace has no reading for this GPU yet")
        sample = track.samples[idx]
        t = self._origin + loop_i * self.loop_s + track.offsets[idx]
        return dataclasses.replace(sample, t=t)

    def read_energy(self, gpu: int) -> float | None:
        """Joules since replay start: exact trapezoid integral of the recorded power.

        Power is linear between samples (and across the wrap from the last sample to
        the next loop's first). None when any sample of this GPU lacks power.
        """
        track = self._track(gpu)
        if track.energy is None or track.loop_energy is None:
            return None
        loop_i, idx, x = self._locate(track, self._elapsed())
        if idx < 0:
            return 0.0
        base = loop_i * track.loop_energy + track.energy[idx]
        if idx + 1 < len(track.samples):
            seg_len = track.offsets[idx + 1] - track.offsets[idx]
            p1 = track.samples[idx + 1].power_w
        elif self.loop:  # the wrap segment towards the next loop's first sample
            seg_len = self.loop_s - track.offsets[idx] + track.offsets[0]
            p1 = track.samples[0].power_w
        else:
            return base  # the recording is over: no more energy
        p0 = track.samples[idx].power_w
        assert p0 is not None and p1 is not None
        dt = min(x - track.offsets[idx], seg_len)
        if dt <= 0:
            return base
        p_now = p0 + (p1 - p0) * (dt / seg_len)
        return base + 0.5 * (p0 + p_now) * dt

    def close(self) -> None:
        self._closed = True

    # -- replay state ------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once a non-looping replay has played the whole trace."""
        return not self.loop and self._elapsed() >= self.loop_s

    def _elapsed(self) -> float:
        return self.clock.now() - self._origin

    def _track(self, gpu: int) -> _Track:
        if self._closed:
            raise BackendUnavailable("replay backend is closed")
        track = self._tracks.get(gpu)
        if track is None:
            raise GpuLost(gpu, f"not in trace {self.trace.path}")
        return track

    def _locate(self, track: _Track, elapsed: float) -> tuple[int, int, float]:
        """(loop number, sample index or -1, position within that loop) for ``elapsed``.

        Loops are counted from this GPU's first sample, so a position before it in
        loop k belongs to the tail of loop k-1; that keeps "latest sample with t <= now"
        true on the unrolled timeline for GPUs whose recording starts late.
        """
        first = track.offsets[0]
        if elapsed < first:
            return 0, -1, elapsed
        if self.loop:
            loop_i = math.floor((elapsed - first) / self.loop_s)
            x = elapsed - loop_i * self.loop_s
            if x < first:  # float rounding at a loop boundary
                loop_i, x = loop_i - 1, x + self.loop_s
        else:
            loop_i, x = 0, elapsed
        idx = bisect.bisect_right(track.offsets, x) - 1
        return loop_i, idx, x
