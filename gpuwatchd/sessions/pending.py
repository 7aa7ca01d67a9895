"""The work waiting for one GPU's gate, as the tuning scheduler keeps it."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from gpuwatchd.tuning.types import Workload


@dataclass(slots=True)
class Pending:
    """Work waiting for one GPU's gate."""

    workloads: list[Workload]
    not_before: float = 0.0  # unix time; set after a failure
    #: Why each workload was requested (manual, drift, ...): logged when its session
    #: starts, and the fleet measures some reasons' work whatever other hosts measured.
    why: dict[str, set[str]] = field(default_factory=dict)
    recheck_at: float = 0.0  # unix time; set when every workload was claimed elsewhere
    store_wait: bool = False  # ``not_before`` waits for the store, not after a failure
    #: Workloads requested for a fresh measurement, and when (the latest such request).
    fresh_since: dict[str, float] = field(default_factory=dict)

    def drop(self, names: Collection[str]) -> None:
        """Take the named workloads off this list."""
        self.workloads = [w for w in self.workloads if w.name not in names]
        for name in names:
            self.why.pop(name, None)
            self.fresh_since.pop(name, None)
