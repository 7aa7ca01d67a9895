"""The daemon's tuning scheduler: pending work per GPU, started only behind an open gate.

``tick`` runs as a periodic task (APScheduler, interval trigger) and never blocks: it
only decides, and a session that may take minutes runs on its own thread. A hung or slow session can
therefore never make APScheduler skip later ticks (``max_instances=1`` plus a hung task
would silence the scheduler forever). Every decision not to start is counted by reason
(``gpuwatchd_tune_deferred_total``).

Every session its runners end is announced on :attr:`TuneScheduler.events`
(:class:`~gpuwatchd.sessions.events.SessionFinished`): the scheduler's own tuning
snapshot listens there to refresh what the store says (totals, winners, last tune), and
so can anything else that depends on finished sessions (drift references).

On a store shared by a fleet (:mod:`gpuwatchd.sessions.fleet`) a session's thread first
drops the work other hosts have answered and claims the rest; it runs only what it
claimed, renews the claims while it runs and gives them back when it ends. Those store
calls happen on the session's thread or its claim renewer's
(:mod:`gpuwatchd.sessions.claim_renewal`: :meth:`TuneScheduler.tick` only says when a
renewal is due), never on the tick's: a stalled shared store cannot stall the
scheduler. The fleet is asked again once the claims are held: a host that finished the
same work and gave its claims back between the first question and the claim has
answered it, and that work is given back and skipped too. Skipped work is announced on
``events`` (:class:`~gpuwatchd.sessions.events.WorkSkipped`), since no session here will
end for it.

Work requested for a reason in ``fresh_reasons`` (an operator's re-tune, a change on
this GPU) is measured afresh: its session reuses no result of a preempted session
recorded before the request (the runner's ``fresh_after``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.sessions.claim_renewal import ClaimRenewer
from gpuwatchd.sessions.events import (
    SessionEvents,
    SessionFinished,
    SessionListener,
    WorkSkipped,
)
from gpuwatchd.sessions.fleet import SKIP_REASON, FleetAnswer, FleetPolicy
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.sessions.plan import build_specs, preempt_reason, runnable_workloads
from gpuwatchd.sessions.readiness import (
    REASON_DISABLED,
    REASON_OK,
    ProbeResult,
    WorkerProbe,
    allows,
    needed_modules,
    readiness,
)
from gpuwatchd.store import FINAL_STATUSES, SqlStore
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.telemetry.backend import FeelsSessionLoad
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, SessionStatus, Versions, Workload
from gpuwatchd.tuning.windows import in_windows, parse_windows

if TYPE_CHECKING:  # a session's modules load with the first session
    from gpuwatchd.sessions.runner import TuneRunner
    from gpuwatchd.tuning.session_spec import SessionSpec

log = logging.getLogger(__name__)

#: The deferral reason of a GPU whose pending work all needs a module the worker lacks.
WORKER_NOT_READY = "worker_not_ready"
#: How soon a GPU tries again after the store was unreachable when its work should have
#: started or was cut off: an outage is nobody's failed tuning, so it waits seconds, not
#: ``retry_failed_after_s`` (the store lets one call through per few seconds meanwhile).
STORE_RETRY_S = 5.0


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


@dataclass(frozen=True, slots=True)
class _Chosen:
    """What a session runs: the spec, the claims it holds, the workloads it verifies."""

    spec: SessionSpec
    keys: dict[str, str] = field(default_factory=dict)
    verify: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class _Stored:
    last_tune_unix: float | None
    winners: tuple[WinnerRow, ...]
    last_tune_by_uuid: dict[str, float] = field(default_factory=dict)


#: Completed sessions read to find each GPU's last tune (newest first).
LAST_TUNE_SCAN = 1000


@dataclass(frozen=True, slots=True)
class TuningSnapshot:
    """What the exporter shows about tuning; replaced whole, read without locks."""

    sessions_total: dict[str, int]  # sessions this daemon's runners ended, since it started
    deferred_total: dict[str, int]
    running: frozenset[int]
    pending: dict[int, tuple[str, ...]]
    last_tune_unix: float | None
    winners: tuple[WinnerRow, ...] = ()
    last_tune_by_uuid: dict[str, float] = field(default_factory=dict)  # completed, per GPU
    #: Workloads taken off the pending lists without tuning them, by reason.
    fleet_skipped_total: dict[str, int] = field(default_factory=dict)
    #: Workloads the fleet had answered that a completed session measured again anyway.
    fleet_verified_total: int = 0
    #: Workloads found claimed by another host (or GPU) when this one wanted to tune them.
    claimed_elsewhere_total: int = 0
    #: Whether the worker's Python can run the work the daemon tunes, and why not.
    ready: tuple[bool, str] = (True, REASON_OK)


class RunnerFactory(Protocol):
    """Makes the runner of one GPU; ``on_finished`` must hear of every session it ends."""

    def __call__(self, store: SqlStore, *, on_finished: SessionListener) -> TuneRunner: ...


def default_runner(store: SqlStore, *, on_finished: SessionListener) -> TuneRunner:
    """A runner with the defaults; its module (the worker's wire, resume) loads with the
    first session, so a daemon that never tunes never loads it."""
    from gpuwatchd.sessions.runner import TuneRunner

    return TuneRunner(store, on_finished=on_finished)


class TuneScheduler:
    """Starts tuning sessions on GPUs whose gate is open, one GPU at a time by default.

    ``events`` (a fresh :class:`SessionEvents` when not given) hears of every session
    the scheduler's runners end. ``fleet`` is given only for a store shared by hosts.
    ``worker_probe`` (the daemon's) says which modules the worker's Python imports: work
    needing a missing one is never started (without it, every session may start).
    ``fresh_reasons`` are the request reasons whose work reuses no earlier preempted
    session's results (the daemon's ``MEASURED_ANYWAY``); ``now`` is the store's clock.
    """

    def __init__(
        self,
        cfg: TuningSetup,
        board: StateBoard,
        store: SqlStore,
        backend_name: str,
        sim_time: Callable[[], float] = lambda: 0.0,
        runner_factory: RunnerFactory = default_runner,
        now: Callable[[], float] = time.time,
        local_now: Callable[[], dt.datetime] = dt.datetime.now,
        events: SessionEvents | None = None,
        session_load: FeelsSessionLoad | None = None,
        fleet: FleetPolicy | None = None,
        fresh_reasons: Collection[str] = (),
        worker_probe: WorkerProbe | None = None,
        host: str | None = None,
    ) -> None:
        self.cfg = cfg
        self._probe = worker_probe
        self._host = host  # the daemon's host: its metrics show its own winners and GPUs
        self._read_uuids: frozenset[str] = frozenset()  # the GPUs the last read was for
        self._fleet = fleet
        self._fresh_reasons = frozenset(str(r) for r in fresh_reasons)
        self._session_load = session_load  # the sim backend: its GPU feels our sessions
        self.board = board
        self.store = store
        self.backend_name = backend_name
        self._sim_time = sim_time
        self._runner_factory = runner_factory
        self._now = now
        self._local_now = local_now
        self._windows = parse_windows(cfg.tuning.windows)
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._runners: dict[int, TuneRunner] = {}
        self._threads: dict[int, threading.Thread] = {}
        # per running GPU: its session's workloads, and those requested again meanwhile
        self._tuning: dict[int, frozenset[str]] = {}
        self._again: dict[int, set[str]] = {}
        self._deferred: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()
        self._verified = 0
        self._claimed_elsewhere = 0
        self._held: dict[int, ClaimRenewer] = {}  # per running GPU: its fleet claims
        # Counted from our own runners' events: a standalone `tune` on the same store is
        # not this daemon's session (the store's totals would count it).
        self._ended: Counter[str] = Counter(dict.fromkeys((s.value for s in FINAL_STATUSES), 0))
        self._abandoned = False  # sessions a killed process left running are marked failed
        self._stopping = False
        self._abandon_left_running()
        self._stored = self._read_store()
        self.snapshot = self._make_snapshot()
        self.events = events if events is not None else SessionEvents()
        self.events.add_listener(self._session_finished)
        self.events.add_skip_listener(self._work_skipped)
        if worker_probe is not None:
            worker_probe.add_listener(self._probed)

    def _abandon_left_running(self) -> None:
        """Sessions a killed daemon or `tune` left running end now, failed, and count as
        such; with the store unreachable, once it is back (:meth:`store_back`)."""
        if self._abandoned:
            return
        try:
            n = self.store.abandon_running()
        except (StoreUnavailable, StoreBusy):  # tried again once the store is back
            return
        with self._lock:
            self._abandoned = True
            self._ended[SessionStatus.FAILED.value] += n

    def store_back(self) -> None:
        """The store answers again (after an outage, or for the first time): record what
        was left waiting for it, and let the GPUs it held back try again now."""
        self._abandon_left_running()
        with self._lock:
            runners = list(self._runners.values())
            for p in self._pending.values():
                if p.store_wait:
                    p.store_wait, p.not_before = False, 0.0
        for runner in runners:
            runner.record_endings()
        self._stored = self._read_store()
        self._publish()

    # -- requests --------------------------------------------------------------------

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None:
        """Queue ``workloads`` for ``gpu``; merged with what is already pending."""
        if not workloads:
            return
        with self._lock:
            p = self._pending.setdefault(gpu, Pending(workloads=[]))
            names = {w.name for w in p.workloads}
            p.workloads.extend(w for w in workloads if w.name not in names)
            for w in workloads:
                p.why.setdefault(w.name, set()).add(reason)
                if reason in self._fresh_reasons:
                    p.fresh_since[w.name] = self._now()
            p.not_before = 0.0
            p.recheck_at = 0.0
            running = self._tuning.get(gpu)
            if running:  # asked for again while being tuned: stays pending when it ends
                again = self._again.setdefault(gpu, set())
                again.update(w.name for w in workloads if w.name in running)
        log.info(
            "GPU %d: tuning requested (%s): %s", gpu, reason, ", ".join(w.name for w in workloads)
        )
        self.check_worker(workloads)
        self._publish()

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None:
        """Take the named workloads off the pending lists of ``gpus`` (None: every GPU).

        A session already running keeps its workloads; only waiting work is withdrawn
        (a user's workload tuned on another GPU of the same model, one removed by a user).
        """
        drop = set(names)
        if not drop:
            return
        with self._lock:
            for gpu in list(self._pending):
                if gpus is not None and gpu not in gpus:
                    continue
                p = self._pending[gpu]
                p.drop(drop)
                if not p.workloads:
                    del self._pending[gpu]
        self._publish()

    def pending(self) -> dict[int, tuple[str, ...]]:
        with self._lock:
            return {g: tuple(w.name for w in p.workloads) for g, p in self._pending.items()}

    def in_session(self) -> dict[int, frozenset[str]]:
        """Per GPU with a session running: the workloads it measures (still pending until
        it ends)."""
        with self._lock:
            return dict(self._tuning)

    def own_pids(self) -> frozenset[int]:
        """Every live worker PID: the gate must not call our own worker a foreign job."""
        pids: set[int] = set()
        for runner in list(self._runners.values()):
            pids |= runner.pids()
        return frozenset(pids)

    def reconfigure(self, cfg: TuningSetup, fleet: FleetConfig | None = None) -> None:
        """Apply a reloaded config; ``fleet`` (when given) replaces the fleet settings."""
        with self._lock:
            self.cfg = cfg
            self._windows = parse_windows(cfg.tuning.windows)
            if fleet is not None and self._fleet is not None:
                self._fleet.cfg = fleet

    # -- the periodic decision ---------------------------------------------------------

    def tick(self) -> None:
        """Start what may start now; count the rest as deferred; wake the renewers of
        running sessions' fleet claims that are due. Never blocks on a GPU or the store."""
        with self._lock:
            for renewer in self._renewals_due():
                renewer.poke()
            if not self._stopping and self.cfg.tuning.enabled:
                for gpu in sorted(self._pending):
                    if gpu in self._threads:
                        continue  # its session is running
                    why = self._blocker(gpu)
                    work = () if why is not None else self._startable(self._pending[gpu])
                    if why is None and not work:
                        why = WORKER_NOT_READY
                    if why is not None:
                        self._deferred[why] += 1
                        continue
                    self._start(gpu, work)
        self._publish()

    def _blocker(self, gpu: int) -> str | None:
        p = self._pending[gpu]
        if not self._abandoned:  # the store has not answered since the daemon started
            return "store_unavailable"
        if self._now() < p.not_before:
            return "retry_backoff"
        if self._now() < p.recheck_at:
            return "claimed_elsewhere"
        if not in_windows(self._windows, self._local_now()):
            return "outside_window"
        if len(self._threads) >= self.cfg.tuning.max_concurrent:
            return "another_session"
        snap = self.board.get(gpu)
        if snap is None or snap.gate is None or snap.info is None:
            return "unavailable"
        if not snap.gate.open:
            return snap.gate.state.value
        return None

    def check_worker(self, workloads: Iterable[Workload]) -> None:
        """Start the worker probe (once) if tuning is on and any of ``workloads`` needs a
        module: the daemon's own set at start, pending work at each tick."""
        if self._probe is None or self._probe.started or not self.cfg.tuning.enabled:
            return
        if any(needed_modules(w) for w in workloads):
            self._probe.start()

    def _startable(self, p: Pending) -> tuple[Workload, ...]:
        """The pending workloads the worker's Python can run (all without a probe)."""
        if self._probe is None:
            return tuple(p.workloads)
        self.check_worker(p.workloads)
        result = self._probe.result
        return tuple(w for w in p.workloads if allows(result, w))

    def _fleet_on(self) -> FleetPolicy | None:
        fleet = self._fleet
        return fleet if fleet is not None and fleet.active else None

    def _spec(self, info: DeviceInfo, workloads: Sequence[Workload], sim_t: float) -> SessionSpec:
        """The first device kind's spec for ``workloads`` (the others wait their turn)."""
        regimes = tuple(Regime(r) for r in self.cfg.tuning.regimes)
        speed = self.cfg.sim.speed if self._session_load is not None else None
        return build_specs(self.cfg, info, workloads, regimes, sim_t, speed)[0]

    def _start(self, gpu: int, work: tuple[Workload, ...]) -> None:
        snap = self.board.get(gpu)
        assert snap is not None and snap.info is not None
        p = self._pending[gpu]
        runner = self._runners.get(gpu)
        if runner is None:
            runner = self._runners[gpu] = self._runner_factory(
                self.store, on_finished=self.events.notify
            )
        why = {w.name: frozenset(p.why.get(w.name, ())) for w in work}
        fresh = {w.name: p.fresh_since[w.name] for w in work if w.name in p.fresh_since}
        sim_t = self._sim_time()
        chosen = None
        if self._fleet_on() is None:  # decided here; with a fleet, on the session's thread
            chosen = _Chosen(self._spec(snap.info, work, sim_t))
            work = chosen.spec.workloads
        t = threading.Thread(
            target=self._run, args=(gpu, runner, snap, work, why, chosen, sim_t, fresh),
            name=f"gpuwatchd-tune-{gpu}", daemon=True,
        )  # fmt: skip
        self._threads[gpu] = t
        self._tuning[gpu] = frozenset(w.name for w in work)
        self._again.pop(gpu, None)
        t.start()

    def _run(
        self,
        gpu: int,
        runner: TuneRunner,
        snap: GpuSnapshot,
        work: tuple[Workload, ...],
        why: Mapping[str, frozenset[str]],
        chosen: _Chosen | None,
        sim_t: float,
        fresh: Mapping[str, float],
    ) -> None:
        assert snap.info is not None
        try:
            if chosen is None:
                chosen = self._choose_or_back_off(gpu, snap.info, work, why, sim_t)
            if chosen is not None:
                names = [w.name for w in chosen.spec.workloads]
                reasons = sorted(set().union(*(why.get(n, ()) for n in names)))
                log.info("GPU %d: gate open, tuning %s (%s)", gpu, ", ".join(names),
                         ", ".join(reasons))  # fmt: skip
                fresh_after = {n: fresh[n] for n in names if n in fresh}
                self._run_session(gpu, runner, chosen.spec, snap, chosen.verify, fresh_after)
        finally:  # whatever happened, this GPU is free for the next session
            with self._lock:
                held = self._held.pop(gpu, None)
            if held is not None and self._fleet is not None:
                held.stop()  # the last renewal has ended: none can follow the release
                self._fleet.release(held.gpu_uuid, held.keys.values())
            if self._session_load is not None:
                self._session_load.session_ended(gpu)
            with self._lock:
                self._threads.pop(gpu, None)
                self._tuning.pop(gpu, None)
                self._again.pop(gpu, None)
            self._publish()

    # -- the fleet -----------------------------------------------------------------------

    def _choose_or_back_off(
        self,
        gpu: int,
        info: DeviceInfo,
        work: Sequence[Workload],
        why: Mapping[str, frozenset[str]],
        sim_t: float,
    ) -> _Chosen | None:
        """:meth:`_choose`; when the shared store fails, the GPU backs off as after a
        failed session and nothing runs."""
        try:
            return self._choose(gpu, info, work, why, sim_t)
        except (StoreUnavailable, StoreBusy) as exc:  # an outage (logged once), a held lock
            log.debug("GPU %d: the fleet's store is unreachable or busy: %s", gpu, exc)
            self._wait_for_store(gpu)
            return None
        except Exception as exc:
            log.warning("GPU %d: asking the fleet's store what to tune failed: %s", gpu, exc)
            with self._lock:
                p = self._pending.get(gpu)
                if p is not None:
                    p.not_before = self._now() + self.cfg.tuning.retry_failed_after_s
            return None

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
    ) -> _Chosen | None:
        """Drop the work the fleet answered, claim the rest; None when nothing is left."""
        fleet = self._fleet
        if fleet is None or not fleet.active:
            return _Chosen(self._spec(info, work, sim_t))
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
        return _Chosen(spec, keys, verify)

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

    # -- sessions --------------------------------------------------------------------------

    def _run_session(
        self,
        gpu: int,
        runner: TuneRunner,
        spec: SessionSpec,
        snap: GpuSnapshot,
        verify: frozenset[str] = frozenset(),
        fresh_after: Mapping[str, float] | None = None,
    ) -> None:
        assert snap.info is not None
        outcome_cut = False  # the store cut the session off: retried once it is back
        try:
            outcome = runner.run_session(
                spec,
                snap.info,
                self.backend_name,
                should_preempt=lambda: preempt_reason(self.board.get(gpu)),
                timeout_s=self.cfg.tuning.session_timeout_s,
                sample=snap.sample,
                on_progress=self._feel_load(gpu, runner),
                fresh_after=fresh_after or {},
            )
            status, why, outcome_cut = outcome.status, outcome.why, outcome.store_cut
        except (StoreUnavailable, StoreBusy) as exc:  # no session started: nothing to record
            log.info("GPU %d: tuning waits for the store: %s", gpu, exc)
            self._wait_for_store(gpu)
            return
        except Exception as exc:  # the store or the runner broke: log, back off, go on
            log.exception("GPU %d: tuning session could not run", gpu)
            status, why = SessionStatus.FAILED, f"{type(exc).__name__}: {exc}"
        with self._lock:
            done = {w.name for w in spec.workloads} - self._again.get(gpu, set())
            p = self._pending.get(gpu)
            if status is SessionStatus.COMPLETED:
                self._verified += len(verify)
            if status is SessionStatus.COMPLETED and p is not None:
                p.drop(done)
                if not p.workloads:
                    del self._pending[gpu]
            elif status is SessionStatus.FAILED and p is not None and not outcome_cut:
                p.not_before = self._now() + self.cfg.tuning.retry_failed_after_s
            # PREEMPTED: stays pending, retried at the next open gate.
        if outcome_cut:
            self._wait_for_store(gpu)
        level = logging.INFO if status is SessionStatus.COMPLETED else logging.WARNING
        log.log(level, "GPU %d: tuning session %s%s", gpu, status.value, f": {why}" if why else "")

    def _feel_load(self, gpu: int, runner: TuneRunner) -> Callable[[dict[str, Any]], None] | None:
        """The daemon's simulated GPU heats with the session: fed the worker's reports."""
        load = self._session_load
        if load is None:
            return None
        return lambda p: load.session_progress(
            gpu, p.get("power_w"), p.get("sm_clock_mhz"), runner.pids()
        )

    # -- exporter view -------------------------------------------------------------------

    def _session_finished(self, event: SessionFinished) -> None:
        """A session's row is final: what the store says about tuning has changed, and
        on a fleet the host's other GPUs of the model drop the work it just answered."""
        with self._lock:
            self._ended[event.status.value] += 1
        if event.completed:
            self._drop_answered_here(event)
        self._stored = self._read_store()
        self._publish()

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

    def _work_skipped(self, event: WorkSkipped) -> None:
        """The fleet answered work here: the store holds winners this host had not seen."""
        self._stored = self._read_store()
        self._publish()

    def refresh_stored(self) -> None:
        """Read the store's view again if this host's GPUs changed since the last read
        (the first poll after start found them): called each fleet sync."""
        if self._host is not None and self._board_uuids() != self._read_uuids:
            self._stored = self._read_store()
            self._publish()

    def _board_uuids(self) -> frozenset[str]:
        return frozenset(s.info.uuid for s in self.board.all() if s.info is not None)

    def _read_own(self, host: str) -> _Stored:
        """This host's view: per key the winner it serves (its own, else the fleet's)
        for its GPUs' models, and each of its GPUs' last completed session."""
        infos = [s.info for s in self.board.all() if s.info is not None]
        self._read_uuids = frozenset(i.uuid for i in infos)
        models = {i.name for i in infos}
        winners = [w for w in self.store.winners(latest=True, prefer_host=host)
                   if w.gpu_model in models]  # fmt: skip
        last_by_uuid: dict[str, float] = {}
        for info in infos:
            ended = self.store.last_completed_at(info.uuid)
            if ended is not None:
                last_by_uuid[info.uuid] = ended
        last = max(last_by_uuid.values(), default=None)
        return _Stored(last, tuple(winners), last_by_uuid)

    def _read_store(self) -> _Stored:
        """What the store says about tuning; it changes only when a session ends."""
        try:
            if self._host is not None:
                return self._read_own(self._host)
            last_by_uuid: dict[str, float] = {}
            for row in self.store.sessions(LAST_TUNE_SCAN, status=SessionStatus.COMPLETED):
                ended = row.ended_at
                if ended is not None and ended > last_by_uuid.get(row.meta.gpu_uuid, -1.0):
                    last_by_uuid[row.meta.gpu_uuid] = ended
            return _Stored(
                self.store.last_completed_at(),
                tuple(self.store.winners(latest=True)),
                last_by_uuid,
            )
        except Exception as exc:
            log.warning("reading tuning totals from the store failed: %s", exc)
            return _Stored(None, ())

    def _probed(self, result: ProbeResult) -> None:
        """The worker's Python answered: say what it lacks once, and republish."""
        ready, reason = self._readiness()
        if ready or not self.cfg.tuning.enabled:
            log.info("tuning: %s", result.describe())
        else:
            log.warning("tuning not ready (%s): %s", reason, result.describe())
        self._publish()

    def _readiness(self) -> tuple[bool, str]:
        """Whether the worker can run the default set and the pending work, and why not."""
        enabled = self.cfg.tuning.enabled
        if self._probe is None:
            return enabled, REASON_OK if enabled else REASON_DISABLED
        with self._lock:
            pending = [w for p in self._pending.values() for w in p.workloads]
        work = [*runnable_workloads(self.cfg, self.backend_name), *pending]
        return readiness(self._probe.result, work, enabled)

    def _make_snapshot(self) -> TuningSnapshot:
        stored = self._stored
        ready = self._readiness()
        with self._lock:
            running = frozenset(self._threads)
            pending = {g: tuple(w.name for w in p.workloads) for g, p in self._pending.items()}
            deferred = dict(self._deferred)
            ended = dict(self._ended)
            skipped = dict(self._skipped)
            verified, elsewhere = self._verified, self._claimed_elsewhere
        return TuningSnapshot(
            ended,
            deferred,
            running,
            pending,
            stored.last_tune_unix,
            stored.winners,
            stored.last_tune_by_uuid,
            fleet_skipped_total=skipped,
            fleet_verified_total=verified,
            claimed_elsewhere_total=elsewhere,
            ready=ready,
        )

    def _publish(self) -> None:
        self.snapshot = self._make_snapshot()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop starting sessions and cancel running ones (they end ``preempted``)."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads.values())
        for runner in self._runners.values():
            runner.cancel("daemon stopping")
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
