"""The daemon's tuning scheduler: pending work per GPU, started only behind an open gate.

``tick`` runs as an APScheduler interval job and never blocks: it only decides, and a
session that may take minutes runs on its own thread. A hung or slow session can
therefore never make APScheduler skip later ticks (``max_instances=1`` plus a hung job
would silence the scheduler forever). Every decision not to start is counted by reason
(``gpuwatchd_tune_deferred_total``).

Every session its runners end is announced on :attr:`TuneScheduler.events`
(:class:`~gpuwatchd.sessions.events.SessionFinished`): the scheduler's own tuning
snapshot listens there to refresh what the store says (totals, winners, last tune), and
so can anything else that depends on finished sessions (drift references).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.events import SessionEvents, SessionFinished, SessionListener
from gpuwatchd.sessions.plan import build_jobs, preempt_reason
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import FINAL_STATUSES, TuningStore
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.telemetry.backend import FeelsSessionLoad
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload
from gpuwatchd.tuning.windows import in_windows, parse_windows

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """Work waiting for one GPU's gate."""

    workloads: list[Workload]
    reasons: set[str] = field(default_factory=set)  # why it was requested (manual, drift, ...)
    not_before: float = 0.0  # unix time; set after a failure


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


class RunnerFactory(Protocol):
    """Makes the runner of one GPU; ``on_finished`` must hear of every session it ends."""

    def __call__(self, store: TuningStore, *, on_finished: SessionListener) -> TuneRunner: ...


class TuneScheduler:
    """Starts tuning sessions on GPUs whose gate is open, one GPU at a time by default.

    ``events`` (a fresh :class:`SessionEvents` when not given) hears of every session
    the scheduler's runners end.
    """

    def __init__(
        self,
        cfg: TuningSetup,
        board: StateBoard,
        store: TuningStore,
        backend_name: str,
        sim_time: Callable[[], float] = lambda: 0.0,
        runner_factory: RunnerFactory = TuneRunner,
        now: Callable[[], float] = time.time,
        local_now: Callable[[], dt.datetime] = dt.datetime.now,
        events: SessionEvents | None = None,
        session_load: FeelsSessionLoad | None = None,
    ) -> None:
        self.cfg = cfg
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
        # Counted from our own runners' events: a standalone `tune` on the same store is
        # not this daemon's session (the store's totals would count it).
        self._ended: Counter[str] = Counter(dict.fromkeys((s.value for s in FINAL_STATUSES), 0))
        # Sessions a killed daemon or `tune` left running end now, failed, and count as such.
        self._ended[SessionStatus.FAILED.value] += store.abandon_running()
        self._stopping = False
        self._stored = self._read_store()
        self.snapshot = self._make_snapshot()
        self.events = events if events is not None else SessionEvents()
        self.events.add_listener(self._session_finished)

    # -- requests --------------------------------------------------------------------

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None:
        """Queue ``workloads`` for ``gpu``; merged with what is already pending."""
        if not workloads:
            return
        with self._lock:
            p = self._pending.setdefault(gpu, Pending(workloads=[]))
            names = {w.name for w in p.workloads}
            p.workloads.extend(w for w in workloads if w.name not in names)
            p.reasons.add(reason)
            p.not_before = 0.0
            running = self._tuning.get(gpu)
            if running:  # asked for again while being tuned: stays pending when it ends
                again = self._again.setdefault(gpu, set())
                again.update(w.name for w in workloads if w.name in running)
        log.info(
            "GPU %d: tuning requested (%s): %s", gpu, reason, ", ".join(w.name for w in workloads)
        )
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
                p.workloads = [w for w in p.workloads if w.name not in drop]
                if not p.workloads:
                    del self._pending[gpu]
        self._publish()

    def pending(self) -> dict[int, tuple[str, ...]]:
        with self._lock:
            return {g: tuple(w.name for w in p.workloads) for g, p in self._pending.items()}

    def own_pids(self) -> frozenset[int]:
        """Every live worker PID: the gate must not call our own worker a foreign job."""
        pids: set[int] = set()
        for runner in list(self._runners.values()):
            pids |= runner.pids()
        return frozenset(pids)

    def reconfigure(self, cfg: TuningSetup) -> None:
        with self._lock:
            self.cfg = cfg
            self._windows = parse_windows(cfg.tuning.windows)

    # -- the periodic decision ---------------------------------------------------------

    def tick(self) -> None:
        """Start what may start now; count the rest as deferred. Never blocks."""
        with self._lock:
            if self._stopping or not self.cfg.tuning.enabled:
                return
            for gpu in sorted(self._pending):
                if gpu in self._threads:
                    continue  # its session is running
                why = self._blocker(gpu)
                if why is not None:
                    self._deferred[why] += 1
                    continue
                self._start(gpu)
        self._publish()

    def _blocker(self, gpu: int) -> str | None:
        p = self._pending[gpu]
        if self._now() < p.not_before:
            return "retry_backoff"
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

    def _start(self, gpu: int) -> None:
        snap = self.board.get(gpu)
        assert snap is not None and snap.info is not None
        p = self._pending[gpu]
        regimes = tuple(Regime(r) for r in self.cfg.tuning.regimes)
        speed = self.cfg.sim.speed if self._session_load is not None else None
        job = build_jobs(self.cfg, snap.info, p.workloads, regimes, self._sim_time(), speed)[0]
        runner = self._runners.get(gpu)
        if runner is None:
            runner = self._runners[gpu] = self._runner_factory(
                self.store, on_finished=self.events.notify
            )
        t = threading.Thread(
            target=self._run, args=(gpu, runner, job, snap), name=f"gpuwatchd-tune-{gpu}",
            daemon=True,
        )  # fmt: skip
        self._threads[gpu] = t
        self._tuning[gpu] = frozenset(w.name for w in job.workloads)
        self._again.pop(gpu, None)
        log.info(
            "GPU %d: gate open, tuning %s (%s)",
            gpu,
            ", ".join(w.name for w in job.workloads),
            ", ".join(sorted(p.reasons)),
        )
        t.start()

    def _run(self, gpu: int, runner: TuneRunner, job, snap) -> None:  # type: ignore[no-untyped-def]
        try:
            self._run_session(gpu, runner, job, snap)
        finally:  # whatever happened, this GPU is free for the next session
            if self._session_load is not None:
                self._session_load.session_ended(gpu)
            with self._lock:
                self._threads.pop(gpu, None)
                self._tuning.pop(gpu, None)
                self._again.pop(gpu, None)
            self._publish()

    def _run_session(self, gpu: int, runner: TuneRunner, job, snap) -> None:  # type: ignore[no-untyped-def]
        try:
            outcome = runner.run_session(
                job,
                snap.info,
                self.backend_name,
                should_preempt=lambda: preempt_reason(self.board.get(gpu)),
                timeout_s=self.cfg.tuning.session_timeout_s,
                sample=snap.sample,
                on_progress=self._feel_load(gpu, runner),
            )
            status, why = outcome.status, outcome.why
        except Exception as exc:  # the store or the runner broke: log, back off, go on
            log.exception("GPU %d: tuning session could not run", gpu)
            status, why = SessionStatus.FAILED, f"{type(exc).__name__}: {exc}"
        with self._lock:
            done = {w.name for w in job.workloads} - self._again.get(gpu, set())
            p = self._pending.get(gpu)
            if status is SessionStatus.COMPLETED and p is not None:
                p.workloads = [w for w in p.workloads if w.name not in done]
                if not p.workloads:
                    del self._pending[gpu]
            elif status is SessionStatus.FAILED and p is not None:
                p.not_before = self._now() + self.cfg.tuning.retry_failed_after_s
            # PREEMPTED: stays pending, retried at the next open gate.
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
        """A session's row is final: what the store says about tuning has changed."""
        with self._lock:
            self._ended[event.status.value] += 1
        self._stored = self._read_store()
        self._publish()

    def _read_store(self) -> _Stored:
        """What the store says about tuning; it changes only when a session ends."""
        try:
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

    def _make_snapshot(self) -> TuningSnapshot:
        stored = self._stored
        with self._lock:
            running = frozenset(self._threads)
            pending = {g: tuple(w.name for w in p.workloads) for g, p in self._pending.items()}
            deferred = dict(self._deferred)
            ended = dict(self._ended)
        return TuningSnapshot(
            ended,
            deferred,
            running,
            pending,
            stored.last_tune_unix,
            stored.winners,
            stored.last_tune_by_uuid,
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
