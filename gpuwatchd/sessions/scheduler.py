"""The daemon's tuning scheduler: pending work per GPU, started only behind an open gate.

``tick`` runs as a periodic task (:class:`~gpuwatchd.daemon.periodic.Periodic`) and never
blocks: it only decides, and a session that may take minutes runs on its own thread. A
hung or slow session can therefore never hold up later ticks (a task runs one run at a
time, so a hung tick would silence tuning for good). Every decision not to start is
counted by reason (``gpuwatchd_tune_deferred_total``).

Every session its runners end is announced on :attr:`TuneScheduler.events`
(:class:`~gpuwatchd.sessions.events.SessionFinished`): the scheduler's own tuning
snapshot listens there to refresh what the store says (totals, winners, last tune), and
so can anything else that depends on finished sessions (drift references).

On a store shared by a fleet (:mod:`gpuwatchd.sessions.fleet`) a session's thread first
drops the work other hosts have answered and claims the rest
(:class:`~gpuwatchd.sessions.fleet_choice.FleetChoice`); it runs only what it claimed,
renews the claims while it runs and gives them back when it ends. Those store calls
happen on the session's thread or its claim renewer's
(:mod:`gpuwatchd.sessions.claim_renewal`: :meth:`TuneScheduler.tick` only says when a
renewal is due), never on the tick's: a stalled shared store cannot stall the
scheduler. What the exporter shows is :class:`~gpuwatchd.sessions.tuning_view.
TuningView`'s.

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
from typing import TYPE_CHECKING, Any, Protocol

from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.sessions.claim_renewal import ClaimRenewer
from gpuwatchd.sessions.events import (
    SessionEvents,
    SessionFinished,
    SessionListener,
)
from gpuwatchd.sessions.fleet import FleetPolicy
from gpuwatchd.sessions.fleet_choice import Chosen, FleetChoice
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.sessions.pending import Pending
from gpuwatchd.sessions.plan import build_specs, preempt_reason
from gpuwatchd.sessions.readiness import (
    WorkerProbe,
    allows,
    needed_modules,
)
from gpuwatchd.sessions.tuning_view import TuningView
from gpuwatchd.store import FINAL_STATUSES, SqlStore
from gpuwatchd.store.errors import StoreBusy, StoreError, StoreUnavailable
from gpuwatchd.telemetry.backend import FeelsSessionLoad
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload
from gpuwatchd.tuning.windows import in_windows, parse_windows
from gpuwatchd.validate import describe

if TYPE_CHECKING:  # a session's modules load with the first session
    from gpuwatchd.sessions.runner import TuneRunner
    from gpuwatchd.tuning.session_spec import SessionSpec

log = logging.getLogger(__name__)

#: The deferral reason of a GPU whose pending work all needs a module the worker lacks.
WORKER_NOT_READY = "worker_not_ready"


class RunnerFactory(Protocol):
    """Makes the runner of one GPU; ``on_finished`` must hear of every session it ends."""

    def __call__(self, store: SqlStore, *, on_finished: SessionListener) -> TuneRunner: ...


def default_runner(store: SqlStore, *, on_finished: SessionListener) -> TuneRunner:
    """A runner with the defaults; its module (the worker's wire, resume) loads with the
    first session, so a daemon that never tunes never loads it."""
    from gpuwatchd.sessions.runner import TuneRunner

    return TuneRunner(store, on_finished=on_finished)


class TuneScheduler(FleetChoice, TuningView):
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
        if not self._abandoned or not self.store.writable:  # not answered since start, or
            return "store_unavailable"  # writes refused (a schema too new, a clone)
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
            chosen = Chosen(self._spec(snap.info, work, sim_t))
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
        chosen: Chosen | None,
        sim_t: float,
        fresh: Mapping[str, float],
    ) -> None:
        assert snap.info is not None
        try:
            if chosen is None:
                try:
                    chosen = self._choose(gpu, snap.info, work, why, sim_t)
                except Exception as exc:
                    self._back_off(gpu, exc)
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
        except Exception as exc:  # the store (a full disk) or the runner broke: back off, go on
            if not isinstance(exc, StoreError | OSError):  # a bug: the one with a traceback
                log.exception("GPU %d: tuning session could not run", gpu)
            status, why = SessionStatus.FAILED, describe(exc, with_type=type(exc) is not StoreError)
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
