"""The ``[drift]`` table: when a sustained-clock change, or anything else, calls for a re-tune.

Defaults fit a GPU whose production jobs run for minutes: a sample counts as
sustained load once the GPU has been busy and power- or heat-limited for ``settle_s``
without a break (the same "after the first minute" rule a tuning session's sustained
regime uses), the learned clock needs
``min_load_s`` of such load inside the trailing ``window_s``, and a drift must hold
for ``dwell_s`` of evidence-backed time before a re-tune is requested.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.validate import from_table

SECTION = "drift"


def _fail(key: str, message: str, value: object) -> ValueError:
    return ValueError(f"{SECTION}.{key}: {message}, got {value!r}")


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(key, "expected a finite number", value)
    return float(value)


#: The shortest period between two drift checks.
MIN_CHECK_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class DriftConfig:
    """Drift detector settings; every field is a key of the ``[drift]`` TOML table."""

    #: Watch for drift and request re-tunes at all.
    enabled: bool = True
    #: Relative change of the sustained clock (either way) that counts as drift.
    threshold: float = 0.03
    #: Seconds of evidence-backed drift beyond ``threshold`` before a re-tune is requested.
    dwell_s: float = 300.0
    #: Utilisation (0-1) at or above which the GPU counts as busy.
    util_min: float = 0.9
    #: Seconds a GPU must have been busy and throttled before its samples count as sustained.
    settle_s: float = 60.0
    #: Trailing window of sustained-load samples the learned clock is estimated from.
    window_s: float = 600.0
    #: Seconds of sustained load the window must hold before the learned clock is trusted.
    min_load_s: float = 120.0
    #: Sustained-load samples the window must hold before the learned clock is trusted.
    min_samples: int = 20
    #: Winners older than this (seconds) are re-tuned; 0 turns the age check off.
    max_winner_age_s: float = 7 * 86400.0
    #: No clock-drift re-tune within this many seconds of the reference being measured;
    #: bounds re-tunes when production jobs run at another clock than the tuning workloads.
    cooldown_s: float = 3600.0
    #: How often (seconds) the daemon evaluates drift and requests re-tunes.
    check_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise _fail("enabled", "expected true or false", self.enabled)
        if not 0.0 < _number("threshold", self.threshold) < 1.0:
            raise _fail("threshold", "must be between 0 and 1 (exclusive)", self.threshold)
        if not 0.0 < _number("util_min", self.util_min) <= 1.0:
            raise _fail("util_min", "must be within (0, 1]", self.util_min)
        for key in ("dwell_s", "settle_s", "max_winner_age_s", "cooldown_s"):
            if _number(key, getattr(self, key)) < 0.0:
                raise _fail(key, "must be >= 0", getattr(self, key))
        for key in ("window_s", "min_load_s"):
            if _number(key, getattr(self, key)) <= 0.0:
                raise _fail(key, "must be > 0", getattr(self, key))
        # A check reads the store and every GPU's window: more often than 10 Hz only spins.
        if _number("check_interval_s", self.check_interval_s) < MIN_CHECK_INTERVAL_S:
            raise _fail(
                "check_interval_s", f"must be >= {MIN_CHECK_INTERVAL_S:g}", self.check_interval_s
            )
        if self.min_load_s > self.window_s:
            raise _fail(
                "min_load_s", f"must not exceed window_s ({self.window_s:g})", self.min_load_s
            )
        n = self.min_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _fail("min_samples", "must be an integer >= 1", n)

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> DriftConfig:
        """Build from the parsed ``[drift]`` table; errors read ``drift.<key>: ...``."""
        return from_table(cls, table, SECTION)
