"""A running session's fleet claims, renewed on a thread of their own.

Renewing a claim is a write to the shared store, and a write can wait on the database
(another host's stalled transaction holds the write lock, the network is gone). The
scheduler's tick must never wait on it: that would stall every GPU's decisions, and an
periodic task that overruns skips its next runs. So the tick only decides that a
renewal is due (:meth:`ClaimRenewer.due`, on the clock the scheduler is given) and
wakes the session's renewer (:meth:`ClaimRenewer.poke`, which never blocks); the
renewer's thread talks to the store. :meth:`ClaimRenewer.stop` joins that thread, so
the claims are given back only after the last renewal has finished: a renewal never
takes back the claims of a session that has ended.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from gpuwatchd.store.errors import StoreUnavailable

log = logging.getLogger("gpuwatchd.sessions.scheduler")

#: Extends the claims ``(gpu_uuid, workload -> key)``; returns the workloads whose claim
#: another holder took (:meth:`FleetPolicy.renew`).
Renew = Callable[[str, Mapping[str, str]], "tuple[str, ...]"]


class ClaimRenewer:
    """The claims ``keys`` (workload -> key) of the session running on one GPU."""

    def __init__(
        self, gpu: int, gpu_uuid: str, keys: Mapping[str, str], renew: Renew, now: float
    ) -> None:
        self.gpu = gpu
        self.gpu_uuid = gpu_uuid
        self.keys = dict(keys)
        self._renew = renew
        self._lock = threading.Lock()
        self._renewed_at = now  # when the last renewal was asked for (0: retry at once)
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._loop, name=f"gpuwatchd-claims-{gpu}", daemon=True
        )
        self._thread.start()

    def due(self, now: float, every_s: float) -> bool:
        """True (once) when the claims are due for renewal at ``now``; never blocks long."""
        with self._lock:
            if self._stopped or now - self._renewed_at < every_s:
                return False
            self._renewed_at = now
            return True

    def poke(self) -> None:
        """Wake the renewer's thread to renew now; returns at once."""
        self._wake.set()

    def stop(self) -> None:
        """No more renewals; returns once one in progress has ended (the store bounds
        how long a call may wait)."""
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                if self._stopped:
                    return
            self._renew_once()

    def _renew_once(self) -> None:
        try:
            lost = self._renew(self.gpu_uuid, self.keys)
        except Exception as exc:  # the next tick tries again, before the lease lapses
            with self._lock:
                self._renewed_at = 0.0
            # an unreachable store is logged once per outage, by the store
            level = logging.DEBUG if isinstance(exc, StoreUnavailable) else logging.WARNING
            log.log(level, "GPU %d: renewing the fleet claims failed: %s", self.gpu, exc)
            return
        if lost:
            names = ", ".join(lost)
            log.warning(
                "GPU %d: the claim on %s lapsed and another host holds it now; session goes on",
                self.gpu,
                names,
            )
