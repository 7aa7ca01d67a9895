"""Drift references from the tuning store: at daemon start and after every completed session.

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
from collections.abc import Iterable, Sequence

from gpuwatchd.drift.detector import DriftDetector, Reference
from gpuwatchd.store import SessionRow, Store, StoredResult, StoreError
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


def reference_from_store(store: Store, info: DeviceInfo) -> Reference | None:
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


def seed_reference(detector: DriftDetector, store: Store, info: DeviceInfo) -> Reference | None:
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
    """Keeps every GPU's reference in step with the store, cheaply enough to run each check.

    A GPU is looked up when first seen (or when another GPU takes its slot) and again
    for all GPUs whenever the newest completed session changes: one indexed query
    per call otherwise. A store error is logged and the lookup retried next call.
    """

    def __init__(self, detector: DriftDetector, store: Store) -> None:
        self._detector = detector
        self._store = store
        self._last_completed: float | None = None
        self._seeded: dict[int, str] = {}  # GPU index -> uuid looked up

    def sync(self, infos: Iterable[DeviceInfo]) -> None:
        try:
            last = self._store.last_completed_at()
        except StoreError as exc:
            log.warning("drift: cannot read the store: %s", exc)
            return
        changed = last != self._last_completed
        self._last_completed = last
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
