"""The web config's ``rate_limit``: one token bucket over all requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RateLimiter:
    """Token bucket like Go's ``rate.NewLimiter(rate.Every(interval), burst)``; starts full."""

    def __init__(
        self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            elapsed = max(0.0, now - self._last)
            self._tokens = min(self._burst, self._tokens + elapsed / self._interval_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False
