"""Retention: old sessions and departed hosts' clocks leave the store, in bounded batches.

:func:`prune` is what both the daemon's schedule and ``gpuwatchd store prune`` run: it
deletes sessions :data:`~gpuwatchd.store.store.PRUNE_BATCH` at a time, one transaction
each, renewing the fleet's pruning lease (a claims row, :data:`PRUNE_CLAIM`) before
each batch. The lease lasts :data:`LEASE_S`, so a pruner that dies or fails leaves it
to another within minutes, never an interval. One that finishes marks the store pruned
(:data:`PRUNED_CLAIM`, for ``interval_s``): the other hosts' :class:`Pruner` skip until
it lapses. ``store prune`` takes the same lease, so it never races a daemon's pruner:
it waits for the holder, or says who holds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.store.errors import StoreError, StoreUnavailable
from gpuwatchd.store.rows import Claim
from gpuwatchd.store.store import PRUNE_BATCH, SqlStore

log = logging.getLogger(__name__)

#: The claim key of the fleet's pruning lease, held while one pruner works.
PRUNE_CLAIM = "retention:prune"
#: The claim key held for ``interval_s`` by the host that finished pruning last.
PRUNED_CLAIM = "retention:pruned"
#: How long the pruning lease lasts unless renewed: a few batches' worth.
LEASE_S = 120.0
#: How often a daemon checks whether the fleet is due a pruning (at most).
CHECK_EVERY_S = 600.0
#: Sessions still running after this long on a host that is gone are ended failed.
STALE_RUNNING_S = 86400.0
#: The longest one daemon's pruning runs before it leaves the rest to its next check.
BUDGET_S = 300.0


class LeaseLost(StoreError):
    """Another pruner holds the lease (this one stalled past :data:`LEASE_S`)."""


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one pruning deleted; ``complete`` is False when it stopped at its budget."""

    sessions: int
    clocks: int
    stale: int = 0
    batches: int = 0
    complete: bool = True


def prune(
    store: SqlStore,
    *,
    keep_sessions_s: float,
    keep_clocks_s: float,
    renew: Callable[[], bool] = lambda: True,
    batch: int = PRUNE_BATCH,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Pruned:
    """Delete sessions finished over ``keep_sessions_s`` ago (winners' sessions and each
    GPU's latest completed one stay) ``batch`` at a time, calling ``renew`` (the lease)
    before each; end stale running sessions; delete clocks not reported for
    ``keep_clocks_s``. Stops, incomplete, once ``budget_s`` is spent; raises
    :class:`LeaseLost` when ``renew`` says another pruner took over."""
    started = clock()
    sessions = batches = 0
    while True:
        if not renew():
            raise LeaseLost(f"store {store.where}: another host took over the pruning lease")
        n = store.prune_batch(keep_sessions_s, batch)
        sessions, batches = sessions + n, batches + 1
        if n < batch:
            break
        if budget_s is not None and clock() - started >= budget_s:
            return Pruned(sessions, 0, batches=batches, complete=False)
    stale = store.sweep_stale_running(STALE_RUNNING_S)
    store.prune_rest(keep_sessions_s)
    return Pruned(sessions, store.prune_clocks(keep_clocks_s), stale, batches)


def holder_text(claim: Claim | None) -> str:
    """``host node-a (since 12:00:01 UTC)``: who holds a lease, for messages."""
    if claim is None:
        return "nobody"
    since = time.strftime("%H:%M:%S UTC", time.gmtime(claim.claimed_at))
    return f"host {claim.host} ({claim.gpu_uuid}, since {since})"


class Pruner:
    """One call = prune, when the fleet is due a pruning and this host gets the lease.

    Scheduled every :attr:`check_every_s`; a host that finishes marks the store pruned
    for ``interval_s``, so the fleet prunes once per interval, and a failed or cut-short
    pruning is taken up again at the next check (by any host), not an interval later.
    """

    def __init__(
        self,
        store: SqlStore,
        *,
        host: str,
        machine: str,
        keep_sessions_s: float,
        keep_clocks_s: float,
        interval_s: float,
        batch: int = PRUNE_BATCH,
        budget_s: float = BUDGET_S,
    ) -> None:
        self._store = store
        self._host = host
        self._machine = machine
        self.keep_sessions_s = keep_sessions_s
        self.keep_clocks_s = keep_clocks_s
        self.interval_s = interval_s
        self.batch = batch
        self.budget_s = budget_s

    @property
    def check_every_s(self) -> float:
        """How often the daemon calls this: the interval, at most :data:`CHECK_EVERY_S`."""
        return min(self.interval_s, CHECK_EVERY_S)

    def __call__(self) -> Pruned | None:
        """Prune now, unless the fleet pruned within the interval or another host is
        pruning; never raises (a store error is logged, the next check tries again)."""
        store, host, machine = self._store, self._host, self._machine
        try:
            if store.claim_holder(PRUNED_CLAIM) is not None:
                return None  # a host finished pruning within the interval
            if not store.claim(PRUNE_CLAIM, host, machine, LEASE_S):
                return None  # another host prunes now
            try:
                done = prune(
                    store,
                    keep_sessions_s=self.keep_sessions_s,
                    keep_clocks_s=self.keep_clocks_s,
                    renew=lambda: store.claim(PRUNE_CLAIM, host, machine, LEASE_S),
                    batch=self.batch,
                    budget_s=self.budget_s,
                )
                if done.complete:
                    store.claim(PRUNED_CLAIM, host, machine, self.interval_s)
            finally:
                store.release(PRUNE_CLAIM, host, machine)
        except StoreUnavailable:
            return None  # logged once per outage by the store
        except StoreError as exc:
            log.warning("pruning the store failed (tried again at the next check): %s", exc)
            return None
        log.info(
            "pruned the store%s: %d session(s) finished over %g days ago in %d batch(es),"
            " %d stale running session(s), %d clock(s) of hosts gone over %g days",
            "" if done.complete else " in part (the rest at the next check)",
            done.sessions,
            self.keep_sessions_s / 86400,
            done.batches,
            done.stale,
            done.clocks,
            self.keep_clocks_s / 86400,
        )
        return done
