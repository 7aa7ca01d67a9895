"""The measurement protocol's settings (``[tuning.protocol]``).

Shared vocabulary: the config loader and the job spec carry them, the worker's
protocol applies them. Kept apart from the protocol so the daemon side never imports
the worker package.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

FLUSH_MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """Knobs of the protocol. Times are seconds on the session's clock.

    Defaults follow nvbench where it has an opinion (recovery pause, clock threshold),
    but the clock threshold is 0.9 rather than 0.75: an H200 at its power cap runs at
    ~0.73 of max, which a 0.75 threshold would wave through as "unthrottled". Short
    batches at a 25% duty cycle keep a heavy kernel inside the ~0.2 s the H200's power
    limiter takes to engage (DESIGN.md trace), so it is timed at full clock.
    """

    #: One timed batch lasts about this long: short, so that a power-hungry kernel finishes
    #: a batch before the power limiter reacts (about 0.2 s on an H200).
    batch_target_s: float = 0.01
    warmup_s: float = 0.2  # back-to-back warm-up per candidate (ramps clocks, calibrates)
    min_calls: int = 1
    max_calls: int = 100_000
    pause_s: float = 0.05  # unthrottled: idle between batches so the clock stays up
    #: Unthrottled: recovery pause after a rejected batch. On an H200 the clock is back
    #: the moment the load stops (DESIGN.md), so a quarter second is plenty.
    cool_pause_s: float = 0.25
    max_retries: int = 5  # unthrottled: retries of one rejected batch before skipping it
    clock_ratio_min: float = 0.9  # unthrottled: reject a batch under this fraction of max
    min_rounds: int = 5
    max_rounds: int = 200
    spread_target: float = 0.02  # stop once every candidate's IQR/median is under this
    time_budget_s: float = 120.0  # per regime, warm-up and settling included
    settle_window_s: float = 3.0  # sustained: rolling window judged for settling
    settle_clock_rel: float = 0.01  # sustained: max relative change of mean SM clock
    settle_power_rel: float = 0.02  # sustained: max relative change of mean power
    settle_timeout_s: float = 30.0  # sustained: time anyway after this long
    flush_l2: str = "auto"  # auto: when the working set fits in l2_bytes; always; never
    l2_bytes: int = 50 * 2**20  # H100/H200 L2 size
    noise_k: float = 1.0  # multiplier on the combined relative CI half-width
    min_margin: float = 0.005  # a margin under this is a tie even when it is real
    confidence: float = 0.95  # of each median's CI
    seed: int = 0  # of the per-round interleaving order

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"protocol.{f.name}: expected an integer, got {value!r}")
            elif f.type == "float":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"protocol.{f.name}: expected a number, got {value!r}")
                if not math.isfinite(value):
                    raise ValueError(f"protocol.{f.name}: must be finite, got {value!r}")
        _check(self.batch_target_s > 0, "batch_target_s", "must be > 0", self.batch_target_s)
        for name in ("warmup_s", "pause_s", "cool_pause_s", "settle_timeout_s"):
            _check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        _check(self.min_calls >= 1, "min_calls", "must be >= 1", self.min_calls)
        _check(
            self.max_calls >= self.min_calls, "max_calls", "must be >= min_calls", self.max_calls
        )
        _check(self.max_retries >= 0, "max_retries", "must be >= 0", self.max_retries)
        _check(0 <= self.clock_ratio_min <= 1, "clock_ratio_min", "must be in [0, 1]",
               self.clock_ratio_min)  # fmt: skip
        _check(self.min_rounds >= 1, "min_rounds", "must be >= 1", self.min_rounds)
        _check(self.max_rounds >= self.min_rounds, "max_rounds", "must be >= min_rounds",
               self.max_rounds)  # fmt: skip
        for name in ("spread_target", "time_budget_s", "settle_window_s"):
            _check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        for name in ("settle_clock_rel", "settle_power_rel", "noise_k", "min_margin"):
            _check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        _check(self.flush_l2 in FLUSH_MODES, "flush_l2", f"must be one of {FLUSH_MODES}",
               self.flush_l2)  # fmt: skip
        _check(self.l2_bytes >= 0, "l2_bytes", "must be >= 0", self.l2_bytes)
        _check(0 < self.confidence < 1, "confidence", "must be in (0, 1)", self.confidence)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> ProtocolConfig:
        """Build from config-file data; unknown keys and bad values name the key."""
        if not isinstance(m, Mapping):
            raise ValueError(f"protocol: expected a mapping, got {type(m).__name__}")
        known = {f.name for f in fields(cls)}
        for key in m:
            if key not in known:
                raise ValueError(
                    f"protocol.{key}: unknown setting (known: {', '.join(sorted(known))})"
                )
        values = dict(m)
        for f in fields(cls):  # integral floats from YAML/TOML ("2") are fine for floats
            v = values.get(f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                values[f.name] = float(v)
        return cls(**values)


def _check(ok: bool, name: str, what: str, value: object) -> None:
    if not ok:
        raise ValueError(f"protocol.{name}: {what}, got {value!r}")
