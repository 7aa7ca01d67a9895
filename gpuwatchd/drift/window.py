"""The learned sustained-load SM clock of one GPU: a trailing window with an O(1) update.

A sample is *sustained load* when the GPU is busy (``util >= util_min``) with a power
or thermal throttle reason holding its clock down, and has been so without a break
for ``settle_s``: a short burst, or a burst on top of an unthrottled job, never counts.
The learned clock is the interquartile mean of those samples' clocks in the last
``window_s``: robust to the power controller's hunting and to stray samples, yet not
quantised to 15 MHz clock bins the way a median is. Clocks take few distinct values,
so a histogram keeps the estimate cheap however fast the GPU is polled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from gpuwatchd.telemetry.types import POWER_REASONS, THERMAL_REASONS, ThrottleReason

#: A gap between samples longer than this is a lost or stalled GPU, not load: it
#: breaks the load streak and credits no load time.
MAX_GAP_S = 10.0

_LIMITING = int(POWER_REASONS | THERMAL_REASONS)
#: Raw reason mask -> whether it holds the clock down by power or heat (no enum maths
#: on the hot path).
_LIMITED: tuple[bool, ...] = tuple(bool(m & _LIMITING) for m in range(1 << len(ThrottleReason)))


def interquartile_mean(hist: Mapping[float, int]) -> float | None:
    """Mean of the middle half of the values counted in ``hist`` (value -> count)."""
    n = sum(hist.values())
    if n <= 0:
        return None
    lo, hi = n / 4.0, 3.0 * n / 4.0
    below = 0
    total = weight = 0.0
    for value in sorted(hist):
        count = hist[value]
        w = min(below + count, hi) - max(below, lo)
        if w > 0.0:
            total += w * value
            weight += w
        below += count
        if below >= hi:
            break
    return total / weight


class LoadWindow:
    """Sustained-load clock readings of one GPU over a trailing window. Not thread-safe."""

    __slots__ = (
        "_hist",
        "_load_s",
        "_loaded_since",
        "_prev_t",
        "_queue",
        "_stale",
        "settle_s",
        "util_min",
        "window_s",
    )

    def __init__(self, window_s: float, settle_s: float, util_min: float) -> None:
        self.window_s = window_s
        self.settle_s = settle_s
        self.util_min = util_min
        self._queue: deque[tuple[float, float, float]] = deque()  # (t, clock MHz, load credit s)
        self._hist: dict[float, int] = {}
        self._load_s = 0.0
        self._prev_t: float | None = None
        self._loaded_since: float | None = None
        self._stale = False

    def reset(self) -> None:
        """Forget everything (another GPU in this slot, or the backend's clock restarted)."""
        self._queue.clear()
        self._hist.clear()
        self._load_s = 0.0
        self._prev_t = None
        self._loaded_since = None
        self._stale = False

    def gap(self) -> None:
        """A poll without a sample: the load streak breaks and the estimate is withheld."""
        self._prev_t = None
        self._loaded_since = None
        self._stale = True

    def add(
        self,
        t: float,
        util: float | None,
        reasons: ThrottleReason | None,
        clock_mhz: float | None,
    ) -> None:
        """Take one sample; O(1) amortised (each reading is appended and expired once)."""
        prev = self._prev_t
        if prev is not None and t < prev:
            self.reset()
            prev = None
        self._prev_t = t
        self._stale = False
        queue = self._queue
        horizon = t - self.window_s
        while queue and queue[0][0] < horizon:
            _, old_clock, old_credit = queue.popleft()
            left = self._hist[old_clock] - 1
            if left:
                self._hist[old_clock] = left
            else:
                del self._hist[old_clock]
            self._load_s -= old_credit
        if not queue:
            self._load_s = 0.0  # no rounding residue survives an empty window
        dt = MAX_GAP_S + 1.0 if prev is None else t - prev
        limited = reasons is not None and _LIMITED[int(reasons)]
        if util is None or util < self.util_min or not limited:
            self._loaded_since = None
            return
        if self._loaded_since is None or dt > MAX_GAP_S:
            self._loaded_since = t
        if clock_mhz is None or t - self._loaded_since < self.settle_s:
            return
        credit = dt if dt <= MAX_GAP_S else 0.0
        queue.append((t, clock_mhz, credit))
        self._hist[clock_mhz] = self._hist.get(clock_mhz, 0) + 1
        self._load_s += credit

    @property
    def load_s(self) -> float:
        """Seconds of sustained load inside the window."""
        return self._load_s

    @property
    def samples(self) -> int:
        return len(self._queue)

    def estimate_mhz(self, min_samples: int, min_load_s: float) -> float | None:
        """The learned sustained clock, or None without enough fresh evidence."""
        if self._stale or len(self._queue) < min_samples or self._load_s < min_load_s:
            return None
        return interquartile_mean(self._hist)
