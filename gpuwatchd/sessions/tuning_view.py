"""What the tuning scheduler shows: its snapshot for the exporter, and the store's view.

:class:`TuningSnapshot` is replaced whole and read without locks. What the store says
about tuning (winners, each GPU's last tune) changes only when a session ends or the
fleet answers work here, so :class:`TuningView` reads it then (and when this host's GPUs
change), not at every scrape. A part of :class:`~gpuwatchd.sessions.scheduler.
TuneScheduler`, kept apart because it changes with what is shown, not with scheduling.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.events import WorkSkipped
from gpuwatchd.sessions.pending import Pending
from gpuwatchd.sessions.plan import runnable_workloads
from gpuwatchd.sessions.readiness import (
    REASON_DISABLED,
    REASON_OK,
    ProbeResult,
    WorkerProbe,
    readiness,
)
from gpuwatchd.store import SqlStore
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import SessionStatus

log = logging.getLogger("gpuwatchd.sessions.scheduler")


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


class TuningView:
    """The scheduler's snapshot and store view (a mixin of TuneScheduler: its state)."""

    cfg: TuningSetup
    board: StateBoard
    store: SqlStore
    backend_name: str
    snapshot: TuningSnapshot
    _host: str | None
    _read_uuids: frozenset[str]
    _stored: _Stored
    _probe: WorkerProbe | None
    _lock: threading.Lock
    _pending: dict[int, Pending]
    _threads: dict[int, threading.Thread]
    _deferred: Counter[str]
    _ended: Counter[str]
    _skipped: Counter[str]
    _verified: int
    _claimed_elsewhere: int

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
