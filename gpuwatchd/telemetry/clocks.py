"""Clocks for simulated time: manual (tests), paced (sim tuning workers), scaled (demos),
offset (a sim backend started part-way into its scenario)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatchd.telemetry.backend import Clock


class ManualClock:
    """Time moves only when told to; ``sleep`` advances it instantly.

    Tests use it to run hours of simulated GPU time in milliseconds.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += max(0.0, seconds)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


class PacedClock(ManualClock):
    """A manual clock that never runs ahead of real time at ``speed``.

    Simulated time up to ``paced_from`` costs nothing (a sim tuning worker catches its
    model up to the daemon's time at start); from there on, ``advance`` sleeps so that
    simulated time runs at most ``speed`` times real time. A daemon's sim tuning session
    then takes as long, in the daemon's simulated time, as the worker simulates, so the
    daemon's own simulated GPU can carry the session's load for the whole of it.
    """

    def __init__(
        self,
        speed: float,
        paced_from: float = 0.0,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wait: Callable[[float], None] = time.sleep,
    ) -> None:
        if not speed > 0 or math.isinf(speed):
            raise ValueError(f"speed must be finite and > 0, got {speed}")
        super().__init__()
        self.speed = speed
        self._paced_from = paced_from
        self._real_origin = monotonic()
        self._monotonic = monotonic
        self._wait = wait

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        ahead = (self.now() - self._paced_from) / self.speed
        delay = self._real_origin + ahead - self._monotonic()
        if delay > 0:
            self._wait(delay)


class ScaledClock:
    """Real time multiplied by ``speed``: at speed 60 a simulated minute takes a second."""

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.speed = speed
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.speed

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.speed)


class FastForwardClock:
    """Real time at ``speed``, plus jumps: ``skip`` moves time ahead without waiting.

    ``gpuwatchd tune --backend sim`` uses it to wait for a simulated gate in no real
    time (nothing happens on a simulated GPU between polls that the model can't
    integrate in one step), while a tuning session still runs against a clock that
    moves on its own.
    """

    def __init__(self, speed: float = 1.0) -> None:
        self._scaled = ScaledClock(speed)
        self._offset = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._scaled.now() + self._offset

    def skip(self, seconds: float) -> None:
        with self._lock:
            self._offset += max(0.0, seconds)

    def sleep(self, seconds: float) -> None:
        self._scaled.sleep(seconds)


class OffsetClock:
    """Another clock's reading plus a fixed ``offset``; ``sleep`` is the other clock's.

    A sim backend started at scenario time ``sim.start_s`` reads its clock through one,
    so every user of ``backend.clock`` (the scheduler handing a sim tuning worker its
    start time, ``tune``'s progress) sees scenario time, as with a backend started at 0.
    """

    def __init__(self, inner: Clock, offset: float) -> None:
        if not math.isfinite(offset):
            raise ValueError(f"offset must be finite, got {offset}")
        self.inner = inner
        self.offset = offset

    def now(self) -> float:
        return self.inner.now() + self.offset

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)
