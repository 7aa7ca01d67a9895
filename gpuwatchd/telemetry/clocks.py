"""Clocks for simulated time: a manual one for tests, a scaled one for demos."""

from __future__ import annotations

import threading
import time


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
