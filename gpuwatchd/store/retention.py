"""Retention: old sessions and departed hosts' clocks leave the store.

:func:`prune` is what both the daemon's schedule and ``gpuwatchd store prune`` run.
:class:`Pruner` is the schedule: every host runs it, and a lease in the store (a claims
row, :data:`PRUNE_CLAIM`) that lasts the whole interval lets one host of the fleet
prune per interval; the others find it held and skip.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpuwatchd.store.errors import StoreError, StoreUnavailable
from gpuwatchd.store.store import SqlStore

log = logging.getLogger(__name__)

#: The claim key of the fleet's pruning lease (work claims never look like it).
PRUNE_CLAIM = "retention:prune"


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one pruning deleted."""

    sessions: int
    clocks: int


def prune(store: SqlStore, *, keep_sessions_s: float, keep_clocks_s: float) -> Pruned:
    """Delete sessions finished over ``keep_sessions_s`` ago (winners' sessions and each
    GPU's latest completed one stay) and clocks not reported for ``keep_clocks_s``."""
    return Pruned(store.prune(keep_sessions_s), store.prune_clocks(keep_clocks_s))


class Pruner:
    """One call = prune, if this host gets the fleet's lease for ``interval_s``."""

    def __init__(
        self,
        store: SqlStore,
        *,
        host: str,
        machine: str,
        keep_sessions_s: float,
        keep_clocks_s: float,
        interval_s: float,
    ) -> None:
        self._store = store
        self._host = host
        self._machine = machine
        self.keep_sessions_s = keep_sessions_s
        self.keep_clocks_s = keep_clocks_s
        self.interval_s = interval_s

    def __call__(self) -> Pruned | None:
        """Prune now, unless another host holds the lease; never raises (a store error
        is logged, the next interval tries again)."""
        try:
            if not self._store.claim(PRUNE_CLAIM, self._host, self._machine, self.interval_s):
                return None  # another host pruned within the interval, or prunes now
            done = prune(
                self._store,
                keep_sessions_s=self.keep_sessions_s,
                keep_clocks_s=self.keep_clocks_s,
            )
        except StoreUnavailable:
            return None  # logged once per outage by the store
        except StoreError as exc:
            log.warning("pruning the store failed (tried again next interval): %s", exc)
            return None
        log.info(
            "pruned the store: %d session(s) finished over %g days ago, %d clock(s) of"
            " hosts gone over %g days",
            done.sessions,
            self.keep_sessions_s / 86400,
            done.clocks,
            self.keep_clocks_s / 86400,
        )
        return done
