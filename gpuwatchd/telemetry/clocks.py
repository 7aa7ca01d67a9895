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
