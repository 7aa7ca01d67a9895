"""The daemon's tuning scheduler: pending work per GPU, started only behind an open gate.

``tick`` runs as an APScheduler interval job and never blocks: it only decides, and a
session that may take minutes runs on its own thread. A hung or slow session can
therefore never make APScheduler skip later ticks (``max_instances=1`` plus a hung job
would silence the scheduler forever). Every decision not to start is counted by reason
(``gpuwatchd_tune_deferred_total``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuwatchd.config import Config
from gpuwatchd.config.windows import in_windows, parse_windows
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.plan import build_jobs, preempt_reason
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import Store
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """Work waiting for one GPU's gate."""

    workloads: list[Workload]
    reasons: set[str] = field(default_factory=set)  # why it was requested (manual, drift, ...)
    not_before: float = 0.0  # unix time; set after a failure


@dataclass(frozen=True, slots=True)
class _Stored:
    totals: dict[str, int]
    last_tune_unix: float | None
    winners: tuple[WinnerRow, ...]


@dataclass(frozen=True, slots=True)
class TuningSnapshot:
    """What the exporter shows about tuning; replaced whole, read without locks."""

    sessions_total: dict[str, int]
    deferred_total: dict[str, int]
    running: frozenset[int]
    pending: dict[int, tuple[str, ...]]
    last_tune_unix: float | None
    winners: tuple[WinnerRow, ...] = ()


class TuneScheduler:
    """Starts tuning sessions on GPUs whose gate is open, one GPU at a time by default."""

    def __init__(
        self,
        cfg: Config,
        board: StateBoard,
        store: Store,
        backend_name: str,
        sim_time: Callable[[], float] = lambda: 0.0,
        runner_factory: Callable[[Store], TuneRunner] = TuneRunner,
        now: Callable[[], float] = time.time,
        local_now: Callable[[], dt.datetime] = dt.datetime.now,
    ) -> None:
        self.cfg = cfg
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
        self._deferred: Counter[str] = Counter()
        self._stopping = False
        self._stored = self._read_store()
        self.snapshot = self._make_snapshot()

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
        log.info(
            "GPU %d: tuning requested (%s): %s", gpu, reason, ", ".join(w.name for w in workloads)
        )
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

    def reconfigure(self, cfg: Config) -> None:
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
        job = build_jobs(self.cfg, snap.info, p.workloads, regimes, self._sim_time())[0]
        runner = self._runners.get(gpu)
        if runner is None:
            runner = self._runners[gpu] = self._runner_factory(self.store)
        t = threading.Thread(
            target=self._run, args=(gpu, runner, job, snap), name=f"gpuwatchd-tune-{gpu}",
            daemon=True,
        )  # fmt: skip
        self._threads[gpu] = t
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
            with self._lock:
                self._threads.pop(gpu, None)
            self._stored = self._read_store()
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
            )
            status, why = outcome.status, outcome.why
        except Exception as exc:  # the store or the runner broke: log, back off, go on
            log.exception("GPU %d: tuning session could not run", gpu)
            status, why = SessionStatus.FAILED, f"{type(exc).__name__}: {exc}"
        with self._lock:
            done = {w.name for w in job.workloads}
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

    # -- exporter view -------------------------------------------------------------------

    def _read_store(self) -> _Stored:
        """What the store says about tuning; it changes only when a session ends."""
        try:
            return _Stored(
                {s.value: n for s, n in self.store.session_totals().items()},
                self.store.last_completed_at(),
                tuple(self.store.winners(latest=True)),
            )
        except Exception as exc:
            log.warning("reading tuning totals from the store failed: %s", exc)
            return _Stored({}, None, ())

    def _make_snapshot(self) -> TuningSnapshot:
        stored = self._stored
        with self._lock:
            running = frozenset(self._threads)
            pending = {g: tuple(w.name for w in p.workloads) for g, p in self._pending.items()}
            deferred = dict(self._deferred)
        return TuningSnapshot(
            stored.totals, deferred, running, pending, stored.last_tune_unix, stored.winners
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
