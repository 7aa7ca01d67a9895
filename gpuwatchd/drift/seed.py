"""Drift references from the tuning store: at daemon start, after sessions, after fleet skips.

The daemon hears of completed sessions and of work the fleet answered through the
scheduler's events (:class:`~gpuwatchd.sessions.events.SessionEvents`), so the store is
read mostly then; a GPU with re-tune reasons pending is also looked up again now and then,
since a busy host's re-tune may never start while identical hosts answer it.

A GPU's reference comes from its latest completed tuning session: the power limit,
max clock and software stack recorded when it started, when it ended, and the SM
clock its sustained-regime winners ran at (the median over workloads). The sustained
clock may come from an earlier session of the same GPU when the latest measured no
sustained regime, provided the power limit and max clock match.

A GPU whose winners are not its own (never tuned here, or tuned on a stack it no longer
runs) takes them as jobs on its host get them (``winners(prefer_host=this host)``: the
host's own, else the fleet's), preferring those measured on the stack installed now, and
its reference from the sessions that measured them. Only sessions run at this GPU's power
limit and max clock lend their sustained clock; when none did, the reference keeps the
limits the winners were measured at and no clock, so the detector says the power limit
(or max clock) differs and the GPU is tuned here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from gpuwatchd.drift.detector import (
    MAX_CLOCK_TOLERANCE_HZ,
    POWER_LIMIT_TOLERANCE_W,
    DriftDetector,
    Reference,
)
from gpuwatchd.drift.versions import changed_versions
from gpuwatchd.sessions.events import SessionFinished, WorkSkipped
from gpuwatchd.store import SessionRow, SqlStore, StoredResult, StoreError
from gpuwatchd.store.errors import StoreUnavailable
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, SessionStatus, Versions
from gpuwatchd.tuning.winners import pick_winner

log = logging.getLogger(__name__)

#: Completed sessions examined per lookup, newest first.
SCAN_SESSIONS = 50
#: A GPU with re-tune reasons pending is looked up again at most this often (seconds):
#: identical hosts may answer its re-tune without any event reaching this host.
PENDING_RECHECK_S = 300.0
_MHZ = 1e6

#: The library versions installed now (the driver comes from each GPU's DeviceInfo).
LibrariesNow = Callable[[], Versions]


def sustained_clock_hz(results: Iterable[StoredResult]) -> float | None:
    """Median SM clock of the sustained-regime winners (the nominal pick on a tie)."""
    clocks = []
    for stored in results:
        if stored.result.regime is not Regime.SUSTAINED:
            continue
        pick = pick_winner(stored.result)
        if pick is not None and pick.sm_clock_hz is not None and pick.sm_clock_hz > 0:
            clocks.append(pick.sm_clock_hz)
    return median_or_none(clocks)


def median_or_none(values: Sequence[float]) -> float | None:
    """The median, or None for no values; ``statistics`` is loaded only once there is a
    reference to read (a monitoring-only daemon never pays its memory)."""
    if not values:
        return None
    import statistics

    return statistics.median(values)


def _same_limits(a: SessionRow, b: SessionRow) -> bool:
    return (
        a.meta.power_limit_w == b.meta.power_limit_w
        and a.meta.max_sm_clock_hz == b.meta.max_sm_clock_hz
    )


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    """Equal within ``tolerance``, or unknown on either side (nothing to compare)."""
    return a is None or b is None or abs(a - b) <= tolerance


def fits_gpu(session: SessionRow, info: DeviceInfo) -> bool:
    """Whether ``session`` ran at the power limit and max clock GPU ``info`` has now."""
    max_hz = None if info.max_sm_clock_mhz is None else info.max_sm_clock_mhz * _MHZ
    return _close(
        session.meta.power_limit_w, info.power_limit_w, POWER_LIMIT_TOLERANCE_W
    ) and _close(session.meta.max_sm_clock_hz, max_hz, MAX_CLOCK_TOLERANCE_HZ)


def _ended(session: SessionRow) -> float:
    return session.ended_at if session.ended_at is not None else session.started_at


def _reference(info: DeviceInfo, session: SessionRow, clock: float | None) -> Reference:
    """GPU ``info``'s reference: ``session``'s limits, stack and end, and ``clock``."""
    return Reference(
        uuid=info.uuid,
        sustained_clock_hz=clock,
        power_limit_w=session.meta.power_limit_w,
        max_clock_hz=session.meta.max_sm_clock_hz,
        versions=session.meta.versions,
        measured_at=_ended(session),
    )


def _own_reference(store: SqlStore, info: DeviceInfo, sessions: Sequence[SessionRow]) -> Reference:
    """The reference of a GPU from its own completed sessions (newest first)."""
    latest = sessions[0]
    clock = None
    for session in sessions:
        if not _same_limits(session, latest):
            continue
        clock = sustained_clock_hz(store.results(session.id))
        if clock is not None:
            break
    return _reference(info, latest, clock)


def _served_rows(rows: Sequence[WinnerRow], current: Versions | None) -> list[WinnerRow]:
    """The winners a GPU is served: per (workload, regime) the newest, from those measured
    on the stack installed now when there are any (else from every stack)."""
    if current is not None:
        rows = [r for r in rows if not changed_versions(r.versions, current)] or rows
    newest: dict[tuple[str, Regime], WinnerRow] = {}
    for row in rows:
        key = (row.workload, row.regime)
        best = newest.get(key)
        if best is None or (row.measured_at, row.session_id) > (best.measured_at, best.session_id):
            newest[key] = row
    return list(newest.values())


def served_reference(
    store: SqlStore,
    info: DeviceInfo,
    *,
    host: str | None = None,
    current: Versions | None = None,
) -> Reference | None:
    """The reference of GPU ``info`` from the winners its host serves for its model, or
    None when there are none. ``host`` is this host's name in a shared store (its own
    winners first); ``current`` the stack installed now (its winners first).

    Raises :class:`StoreError` when the store cannot be read.
    """
    rows = _served_rows(store.winners(gpu_model=info.name, prefer_host=host), current)
    sessions = []
    for session_id in sorted({r.session_id for r in rows}):
        session = store.session(session_id)
        if session is not None:
            sessions.append(session)
    if not sessions:
        return None
    fitting = [s for s in sessions if fits_gpu(s, info)]
    newest = max(fitting or sessions, key=lambda s: (_ended(s), s.id))
    clock = None
    if fitting:
        ids = {s.id for s in fitting}
        clocks = [
            r.sm_clock_hz
            for r in rows
            if r.regime is Regime.SUSTAINED
            and r.session_id in ids
            and r.sm_clock_hz is not None
            and r.sm_clock_hz > 0
        ]
        clock = median_or_none(clocks)
    return _reference(info, newest, clock)


def reference_from_store(
    store: SqlStore,
    info: DeviceInfo,
    *,
    host: str | None = None,
    libraries: Versions | None = None,
) -> Reference | None:
    """The reference for GPU ``info``, or None when no GPU of its model was ever tuned.

    Its own sessions give it, unless they ran on another stack than ``libraries`` (the
    versions installed now; None: not compared) and the winners served to ``host`` (see
    :func:`served_reference`) answer for it instead.

    Raises :class:`StoreError` when the store cannot be read.
    """
    own: Sequence[SessionRow] = store.sessions(
        limit=SCAN_SESSIONS, status=SessionStatus.COMPLETED, gpu_uuid=info.uuid
    )
    current = None
    if libraries is not None:
        current = Versions(driver=info.driver_version).merge(libraries)
    if own and (current is None or not changed_versions(own[0].meta.versions, current)):
        return _own_reference(store, info, own)
    served = served_reference(store, info, host=host, current=current)
    if not own:
        return served
    assert current is not None  # own sessions on another stack than the current one
    if served is not None and not changed_versions(served.versions, current):
        return served
    return _own_reference(store, info, own)  # no winners for this stack anywhere


def seed_reference(
    detector: DriftDetector,
    store: SqlStore,
    info: DeviceInfo,
    *,
    host: str | None = None,
    libraries: Versions | None = None,
) -> Reference | None:
    """Look up ``info``'s reference and give it to ``detector``; returns it (None: none yet)."""
    ref = reference_from_store(store, info, host=host, libraries=libraries)
    if ref is not None:
        detector.set_reference(
            info.index,
            ref.uuid,
            ref.sustained_clock_hz,
            ref.power_limit_w,
            ref.max_clock_hz,
            ref.versions,
            ref.measured_at,
        )
    return ref


class ReferenceSync:
    """Keeps every GPU's reference in step with the store, reading it only when it may
    have changed.

    A GPU is looked up when first seen (or when another GPU takes its slot), and every
    GPU again at the first :meth:`sync` after a session completed (it can change its own
    GPU's reference and those of same-model GPUs that borrow it) or after the scheduler
    skipped work the fleet answered (its winners are this host's now). Register
    :meth:`session_finished` and :meth:`work_skipped` on the scheduler's ``events``.
    A GPU with re-tune reasons pending is also looked up again every
    ``pending_recheck_s``: a host too busy to open its gate never gets to skip work, yet
    identical hosts may tune it meanwhile. A store error is logged and the lookup retried
    next call.

    ``host`` is this host's name in a shared store, ``versions_now`` returns the library
    versions installed now (the detector's); both choose which winners serve a GPU.
    """

    def __init__(
        self,
        detector: DriftDetector,
        store: SqlStore,
        *,
        host: str | None = None,
        versions_now: LibrariesNow | None = None,
        pending_recheck_s: float = PENDING_RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._detector = detector
        self._store = store
        self._host = host
        self._versions_now = versions_now
        self._recheck_s = pending_recheck_s
        self._clock = clock
        self._changed = threading.Event()  # set by session threads, cleared by sync
        self._seeded: dict[int, str] = {}  # GPU index -> uuid looked up
        self._read_at: dict[int, float] = {}  # GPU index -> clock() of its last lookup

    def session_finished(self, event: SessionFinished) -> None:
        """Session listener: after a completed session, look every GPU up again. O(1)."""
        if event.completed:
            self._changed.set()

    def work_skipped(self, event: WorkSkipped) -> None:
        """Skip listener: the fleet answered work here, look every GPU up again. O(1)."""
        self._changed.set()

    def sync(self, infos: Iterable[DeviceInfo]) -> None:
        """Give the detector the reference of each GPU in ``infos`` that may have a new one."""
        changed = self._changed.is_set()
        if changed:  # cleared before the reads, so an event arriving meanwhile is not missed
            self._changed.clear()
        now = self._clock()
        libraries: Versions | None = None
        read_libraries = False
        for info in infos:
            if not changed and not self._due(info, now):
                continue
            if not read_libraries:  # once per sync, and only when a GPU is looked up
                libraries, read_libraries = self._libraries(), True
            try:
                seed_reference(
                    self._detector, self._store, info, host=self._host, libraries=libraries
                )
            except (StoreError, ValueError) as exc:
                # an unreachable store is logged once per outage, by the store
                level = logging.DEBUG if isinstance(exc, StoreUnavailable) else logging.WARNING
                log.log(level, "drift: cannot read GPU %d's reference: %s", info.index, exc)
                self._seeded.pop(info.index, None)
                continue
            self._seeded[info.index] = info.uuid
            self._read_at[info.index] = now

    def _due(self, info: DeviceInfo, now: float) -> bool:
        """New in its slot, or waiting on a re-tune and not looked up for a while."""
        if self._seeded.get(info.index) != info.uuid:
            return True
        waited = now - self._read_at.get(info.index, -math.inf)
        return waited >= self._recheck_s and bool(self._detector.pending(info.index))

    def _libraries(self) -> Versions | None:
        if self._versions_now is None:
            return None
        try:
            return self._versions_now()
        except Exception as exc:  # a broken metadata entry must not stop the lookups
            log.warning("drift: cannot read installed library versions: %s", exc)
            return None
