"""Gate vocabulary shared by the gate logic, the exporter, the scheduler and the CLI."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GateState(enum.StrEnum):
    """Per-GPU gate state. Only ``COOL_STABLE`` means the gate is open."""

    COOL_STABLE = "cool_stable"
    WARMING = "warming"
    THROTTLED = "throttled"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The gate's verdict for one GPU at time ``t`` (backend clock).

    ``since`` is when the current state began; ``disturbed_at`` the last time anything
    kept the gate shut (used for the settle time); ``reasons`` are short human-readable
    strings, e.g. ``"temp 71.0C within 15C of slowdown 87C"``.
    """

    state: GateState
    reasons: tuple[str, ...]
    t: float
    since: float
    disturbed_at: float | None = None

    @property
    def open(self) -> bool:
        return self.state is GateState.COOL_STABLE
