"""Drift references from the tuning store: at daemon start and after every completed session.

The daemon hears of completed sessions through the scheduler's session events
(:class:`~gpuwatchd.sessions.events.SessionEvents`), so the store is read only then.

A GPU's reference comes from its latest completed tuning session: the power limit,
max clock and software stack recorded when it started, when it ended, and the SM
clock its sustained-regime winners ran at (the median over workloads). A GPU never
tuned itself borrows the latest session of a GPU of the same model, whose winners it
uses. The sustained clock may come from an earlier session of the same GPU when the
latest measured no sustained regime, provided the power limit and max clock match.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Iterable, Sequence

from gpuwatchd.drift.detector import DriftDetector, Reference
from gpuwatchd.sessions.events import SessionFinished
from gpuwatchd.store import SessionRow, StoredResult, StoreError, TuningStore
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, SessionStatus
from gpuwatchd.tuning.winners import pick_winner

log = logging.getLogger(__name__)

#: Completed sessions examined per lookup, newest first.
SCAN_SESSIONS = 50


def sustained_clock_hz(results: Iterable[StoredResult]) -> float | None:
    """Median SM clock of the sustained-regime winners (the nominal pick on a tie)."""
    clocks = []
    for stored in results:
        if stored.result.regime is not Regime.SUSTAINED:
            continue
        pick = pick_winner(stored.result)
        if pick is not None and pick.sm_clock_hz is not None and pick.sm_clock_hz > 0:
            clocks.append(pick.sm_clock_hz)
    return statistics.median(clocks) if clocks else None


def _same_limits(a: SessionRow, b: SessionRow) -> bool:
    return (
        a.meta.power_limit_w == b.meta.power_limit_w
        and a.meta.max_sm_clock_hz == b.meta.max_sm_clock_hz
    )


def reference_from_store(store: TuningStore, info: DeviceInfo) -> Reference | None:
    """The reference for GPU ``info``, or None when no GPU of its model was ever tuned.

    Raises :class:`StoreError` when the store cannot be read.
    """
    sessions: Sequence[SessionRow] = store.sessions(
        limit=SCAN_SESSIONS, status=SessionStatus.COMPLETED, gpu_uuid=info.uuid
    )
    if not sessions:
        sessions = [
            s
            for s in store.sessions(limit=SCAN_SESSIONS, status=SessionStatus.COMPLETED)
            if s.meta.gpu_model == info.name
        ]
    if not sessions:
        return None
    latest = sessions[0]
    clock = None
    for session in sessions:
        if not _same_limits(session, latest):
            continue
        clock = sustained_clock_hz(store.results(session.id))
        if clock is not None:
            break
    return Reference(
        uuid=info.uuid,
        sustained_clock_hz=clock,
        power_limit_w=latest.meta.power_limit_w,
        max_clock_hz=latest.meta.max_sm_clock_hz,
        versions=latest.meta.versions,
        measured_at=latest.ended_at if latest.ended_at is not None else latest.started_at,
    )


def seed_reference(
    detector: DriftDetector, store: TuningStore, info: DeviceInfo
) -> Reference | None:
    """Look up ``info``'s reference and give it to ``detector``; returns it (None: none yet)."""
    ref = reference_from_store(store, info)
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
    """Keeps every GPU's reference in step with the store, reading it only when it changed.

    A GPU is looked up when first seen (or when another GPU takes its slot), and every
    GPU again at the first :meth:`sync` after a session completed: a completed session
    can change its own GPU's reference and those of same-model GPUs that borrow it.
    :meth:`session_finished` is the listener that hears of one (register it on the
    scheduler's ``events``); nothing polls the store. A store error is logged and the
    lookup retried next call.
    """

    def __init__(self, detector: DriftDetector, store: TuningStore) -> None:
        self._detector = detector
        self._store = store
        self._completed = threading.Event()  # set by the session thread, cleared by sync
        self._seeded: dict[int, str] = {}  # GPU index -> uuid looked up

    def session_finished(self, event: SessionFinished) -> None:
        """Session listener: after a completed session, look every GPU up again. O(1)."""
        if event.completed:
            self._completed.set()

    def sync(self, infos: Iterable[DeviceInfo]) -> None:
        """Give the detector the reference of each GPU in ``infos`` that may have a new one."""
        changed = self._completed.is_set()
        if changed:  # cleared before the reads, so a session ending meanwhile is not missed
            self._completed.clear()
        for info in infos:
            if not changed and self._seeded.get(info.index) == info.uuid:
                continue
            try:
                seed_reference(self._detector, self._store, info)
            except (StoreError, ValueError) as exc:
                log.warning("drift: cannot read GPU %d's reference: %s", info.index, exc)
                self._seeded.pop(info.index, None)
                continue
            self._seeded[info.index] = info.uuid
