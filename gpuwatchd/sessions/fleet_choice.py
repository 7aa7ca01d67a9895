"""How the tuning scheduler shares work with a fleet: skip what it answered, claim the rest.

On a store shared by hosts a session's thread first drops the work other hosts have
answered and claims the rest; it runs only what it claimed. The fleet is asked again
once the claims are held: a host that finished the same work and gave its claims back
between the first question and the claim has answered it, and that work is given back
and skipped too. A completed session on one GPU also answers its work for this host's
other GPUs of the model. A part of :class:`~gpuwatchd.sessions.scheduler.TuneScheduler`,
kept apart because it changes with the fleet's protocol, not with scheduling.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.claim_renewal import ClaimRenewer
from gpuwatchd.sessions.events import SessionEvents, SessionFinished, WorkSkipped
from gpuwatchd.sessions.fleet import SKIP_REASON, FleetAnswer, FleetPolicy
from gpuwatchd.sessions.pending import Pending
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, Versions, Workload

if TYPE_CHECKING:  # a session's modules load with the first session
    from gpuwatchd.tuning.session_spec import SessionSpec

log = logging.getLogger("gpuwatchd.sessions.scheduler")

#: How soon a GPU tries again after the store was unreachable when its work should have
#: started or was cut off: an outage is nobody's failed tuning, so it waits seconds, not
#: ``retry_failed_after_s`` (the store lets one call through per few seconds meanwhile).
STORE_RETRY_S = 5.0


@dataclass(frozen=True, slots=True)
class Chosen:
    """What a session runs: the spec, the claims it holds, the workloads it verifies."""

    spec: SessionSpec
    keys: dict[str, str] = field(default_factory=dict)
    verify: frozenset[str] = frozenset()


class FleetChoice:
    """The scheduler's part in the fleet (a mixin of TuneScheduler: its state)."""

    cfg: TuningSetup
    board: StateBoard
    events: SessionEvents
    _fleet: FleetPolicy | None
    _now: Callable[[], float]
    _lock: threading.Lock
    _pending: dict[int, Pending]
    _held: dict[int, ClaimRenewer]
    _tuning: dict[int, frozenset[str]]
    _deferred: Counter[str]
    _skipped: Counter[str]
    _claimed_elsewhere: int

    if TYPE_CHECKING:  # the scheduler's own

        def _spec(
            self, info: DeviceInfo, workloads: Sequence[Workload], sim_t: float
        ) -> SessionSpec: ...

        def _publish(self) -> None: ...

    def _fleet_on(self) -> FleetPolicy | None:
        fleet = self._fleet
        return fleet if fleet is not None and fleet.active else None

    def _back_off(self, gpu: int, exc: Exception) -> None:
        """Asking the fleet's store what ``gpu`` should tune failed with ``exc``: nothing
        runs; the GPU tries again soon after an outage or a held lock, else backs off as
        after a failed session."""
        if isinstance(exc, StoreUnavailable | StoreBusy):  # an outage (logged once), a held lock
            log.debug("GPU %d: the fleet's store is unreachable or busy: %s", gpu, exc)
            self._wait_for_store(gpu)
            return
        log.warning("GPU %d: asking the fleet's store what to tune failed: %s", gpu, exc)
        with self._lock:
            p = self._pending.get(gpu)
            if p is not None:
                p.not_before = self._now() + self.cfg.tuning.retry_failed_after_s

    def _wait_for_store(self, gpu: int) -> None:
        """The store was unreachable when ``gpu``'s work needed it: try again soon."""
        with self._lock:
            p = self._pending.get(gpu)
            if p is not None:
                p.not_before, p.store_wait = self._now() + STORE_RETRY_S, True

    def _choose(
        self,
        gpu: int,
        info: DeviceInfo,
        work: Sequence[Workload],
        why: Mapping[str, frozenset[str]],
        sim_t: float,
    ) -> Chosen | None:
        """Drop the work the fleet answered, claim the rest; None when nothing is left."""
        fleet = self._fleet_on()
        if fleet is None:
            return Chosen(self._spec(info, work, sim_t))
        regimes = tuple(Regime(r) for r in self.cfg.tuning.regimes)
        versions = fleet.versions(info)
        plan = fleet.plan(info, versions, work, regimes, why)
        if plan.skipped:
            self._skip(gpu, info, plan.skipped)
        if not plan.run:
            return None
        first = self._spec(info, plan.run, sim_t).workloads
        claimed = fleet.claim(info, versions, first, plan.verify)
        if claimed.elsewhere:
            self._claimed_by_others(gpu, claimed.elsewhere, all_of_them=not claimed.keys)
        if not claimed.keys:
            return None
        keys, verify = self._answered_meanwhile(
            gpu, info, versions, [w for w in first if w.name in claimed.keys], why, claimed.keys
        )
        if not keys:
            return None
        renewer = ClaimRenewer(gpu, info.uuid, keys, fleet.renew, self._now())
        with self._lock:
            self._held[gpu] = renewer
            self._tuning[gpu] = frozenset(keys)
        spec = self._spec(info, [w for w in first if w.name in keys], sim_t)
        for name in sorted(verify):
            log.info("GPU %d: %s has fresh fleet winners; measuring it again to verify them"
                     " (verify_fraction %g)", gpu, name, fleet.cfg.verify_fraction)  # fmt: skip
        return Chosen(spec, keys, verify)

    def _answered_meanwhile(
        self,
        gpu: int,
        info: DeviceInfo,
        versions: Versions,
        held: Sequence[Workload],
        why: Mapping[str, frozenset[str]],
        keys: Mapping[str, str],
    ) -> tuple[dict[str, str], frozenset[str]]:
        """Ask the fleet again about the claimed work ``held`` (claim ``keys``): what
        another host answered between the first question and the claim is given back and
        skipped. Returns the claims kept and the workloads measured to verify the fleet.

        A store error gives every claim back and is raised.
        """
        fleet = self._fleet
        assert fleet is not None
        regimes = tuple(Regime(r) for r in self.cfg.tuning.regimes)
        try:
            again = fleet.plan(info, versions, held, regimes, why)
        except Exception:
            fleet.release(info.uuid, keys.values())
            raise
        late = {w.name for w, _ in again.skipped}
        if late:
            fleet.release(info.uuid, [keys[n] for n in sorted(late)])
            self._skip(gpu, info, again.skipped)
        kept = {name: key for name, key in keys.items() if name not in late}
        return kept, again.verify & frozenset(kept)

    def _skip(
        self, gpu: int, info: DeviceInfo, skipped: Sequence[tuple[Workload, FleetAnswer]]
    ) -> None:
        """Take work the fleet answered off the GPU's pending list, count it, and tell
        the skip listeners."""
        names = {w.name for w, _ in skipped}
        with self._lock:
            p = self._pending.get(gpu)
            if p is not None:
                p.drop(names)
                if not p.workloads:
                    del self._pending[gpu]
            self._skipped[SKIP_REASON] += len(names)
        self._publish()
        now = self._now()
        for w, answer in skipped:
            log.info(
                "GPU %d: %s skipped (%s): every regime has a winner measured by %s %.1f h ago"
                " on the same GPU model and stack",
                gpu, w.name, SKIP_REASON, ", ".join(answer.hosts),
                max(0.0, now - answer.measured_at) / 3600.0,
            )  # fmt: skip
        ordered = tuple(dict.fromkeys(w.name for w, _ in skipped))
        self.events.notify_skipped(WorkSkipped(gpu, info.uuid, info.name, ordered, SKIP_REASON))

    def _claimed_by_others(self, gpu: int, names: Sequence[str], *, all_of_them: bool) -> None:
        """Work another holder has claimed stays pending; with nothing left to run, the
        GPU waits a little before looking again."""
        fleet = self._fleet
        assert fleet is not None
        with self._lock:
            self._claimed_elsewhere += len(names)
            p = self._pending.get(gpu)
            if all_of_them:
                self._deferred["claimed_elsewhere"] += 1
                if p is not None:
                    p.recheck_at = self._now() + fleet.recheck_s
        self._publish()
        log.info("GPU %d: %s claimed by another host (or GPU); left pending, retried later",
                 gpu, ", ".join(names))  # fmt: skip

    def _renewals_due(self) -> list[ClaimRenewer]:
        """Running sessions whose claims are due for renewal (called with the lock held)."""
        fleet = self._fleet
        if fleet is None or not self._held:
            return []
        now, every_s = self._now(), fleet.cfg.renew_every_s
        return [r for r in self._held.values() if r.due(now, every_s)]

    def _drop_answered_here(self, event: SessionFinished) -> None:
        """A completed session on one GPU answers its workloads for every GPU of this
        host with the same model: the others skip what they had pending of it (save what
        a reason such as an operator's re-tune measures anyway)."""
        fleet = self._fleet_on()
        if fleet is None:
            return
        answer_at = self._now()
        with self._lock:
            gpus = sorted(self._pending)
        for gpu in gpus:
            snap = self.board.get(gpu)
            if gpu == event.gpu_index or snap is None or snap.info is None:
                continue
            if snap.info.name != event.gpu_model:
                continue
            with self._lock:
                p = self._pending.get(gpu)
                if p is None:
                    continue
                busy = self._tuning.get(gpu, frozenset())
                answered = [
                    w for w in p.workloads
                    if w.name in event.workloads and w.name not in busy
                    and not fleet.measure_anyway.intersection(p.why.get(w.name, ()))
                ]  # fmt: skip
            if answered:
                here = FleetAnswer("", answer_at, (fleet.host,))
                self._skip(gpu, snap.info, [(w, replace(here, workload=w.name)) for w in answered])
