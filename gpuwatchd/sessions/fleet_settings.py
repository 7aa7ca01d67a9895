"""The ``[fleet]`` table: how a host on a shared store uses the winners other hosts measured.

It matters only when the store is shared (PostgreSQL): on an embedded SQLite store every
winner is this host's own, so nothing here changes what the scheduler does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.validate import check, from_table

SECTION = "fleet"

#: The shortest claim lease: a session renews its claims every third of it, from the
#: scheduler's tick, and a lease shorter than a few ticks would lapse while it runs.
MIN_CLAIM_TTL_S = 10.0
#: The shortest fleet sync interval: each sync is a few queries on the shared store, and
#: a fleet of hosts syncing faster than once a second only loads it.
MIN_SYNC_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Fleet settings; every field is a key of the ``[fleet]`` TOML table."""

    #: Use other hosts' winners and claims at all (on a shared store only).
    enabled: bool = True
    #: A winner measured by another host at most this long ago (seconds) makes this host
    #: skip the work instead of measuring it again.
    max_winner_age_s: float = field(
        default=7 * 86400.0, metadata=check(lambda v: v > 0, "must be > 0")
    )
    #: Share (0-1) of the work the fleet has answered that is measured again anyway, to
    #: check the fleet's winners; chosen by a stable hash, so each host verifies its own
    #: share and the same work is not re-verified every time it is requested.
    verify_fraction: float = field(
        default=0.05, metadata=check(lambda v: 0.0 <= v <= 1.0, "must be within [0, 1]")
    )
    #: Seconds a claim on a workload lasts without renewal: a host that dies mid-session
    #: holds its work this long at most. Running sessions renew every third of it.
    claim_ttl_s: float = field(
        default=600.0,
        metadata=check(lambda v: v >= MIN_CLAIM_TTL_S, f"must be >= {MIN_CLAIM_TTL_S:g}"),
    )
    #: How often (seconds) the daemon writes its GPUs' learned sustained clocks to the
    #: shared store and reads the fleet's back (the fleet metrics are that fresh).
    sync_interval_s: float = field(
        default=60.0,
        metadata=check(lambda v: v >= MIN_SYNC_INTERVAL_S, f"must be >= {MIN_SYNC_INTERVAL_S:g}"),
    )

    @property
    def renew_every_s(self) -> float:
        """How often a running session renews its claims: well before they lapse."""
        return self.claim_ttl_s / 3.0

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> FleetConfig:
        """Build from the parsed ``[fleet]`` table; errors read ``fleet.<key>: ...``."""
        return from_table(cls, table, SECTION)
