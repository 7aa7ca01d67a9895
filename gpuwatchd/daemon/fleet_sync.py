"""The daemon's periodic exchange with the shared store for the fleet views.

Every ``interval_s`` (a periodic task) it writes this host's learned sustained clock
of each GPU (the drift detector's view; the model and power limit from the state board)
and reads back, for this host's GPU models only, the fleet's clock medians, its
disagreement counts and its tuning coverage.
The result is published as one immutable :class:`FleetSnapshot` that the ``fleet``
collector reads without a lock or I/O. A store that fails is logged once per distinct
message and leaves the last good snapshot in place, marked stale; nothing raises into
the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.drift.detector import GpuDriftView
from gpuwatchd.drift.fleet import (
    RECENT_DISAGREEMENTS_S,
    ClockGroup,
    FleetSnapshot,
    OwnClock,
    clock_max_age_s,
    coverage,
    groups_from_medians,
)
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.rows import HostClock, WinnerRow, host_name
from gpuwatchd.validate import describe

log = logging.getLogger(__name__)

#: How often the daemon syncs with the shared store.
DEFAULT_INTERVAL_S = 60.0
#: A GPU's unchanged clock is written again after this share of ``max_age_s``, not at
#: every sync (a fleet's GPUs would rewrite every row each minute: gigabytes of the
#: database's log a day); a third, so one lost write still leaves the row counted.
REWRITE_SHARE = 1 / 3
#: The clock age a reader with default settings counts (``report --fleet``, a daemon
#: whose ``[drift] window_s`` is the default): a longer ``max_age_s`` here does not make
#: this host's unchanged rows vanish from those readers' medians.
DEFAULT_CLOCK_MAX_AGE_S = clock_max_age_s(DriftConfig(), FleetConfig())


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"fleet sync: {name} must be a number > 0, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"fleet sync: {name} must be finite, got {value!r}")
    return float(value)


class FleetSync:
    """One call = one sync with the store; :attr:`snapshot` is the latest result.

    ``max_age_s``: a host's clock row older than this is left out of the medians (a host
    gone, or one that has not seen sustained load for that long); a few drift windows.
    ``winner_max_age_s``: winners older than this do not count towards coverage (the
    fleet's ``max_winner_age_s``, as the scheduler uses it).
    """

    def __init__(
        self,
        store: SqlStore,
        board: StateBoard,
        drift_view: Callable[[], Mapping[int, GpuDriftView]],
        *,
        max_age_s: float,
        winner_max_age_s: float,
        interval_s: float = DEFAULT_INTERVAL_S,
        host: str | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._board = board
        self._drift_view = drift_view
        self.max_age_s = _positive("max_age_s", max_age_s)
        self.winner_max_age_s = _positive("winner_max_age_s", winner_max_age_s)
        self.interval_s = _positive("interval_s", interval_s)
        self.host = host if host is not None else host_name()
        self._now = now
        self._snapshot = FleetSnapshot()
        self._logged: set[str] = set()  # messages logged during the current failure streak
        self._written: dict[str, HostClock] = {}  # per GPU UUID: the row last written
        # this sync's writes, with what _written held before (None: nothing), until they
        # are known to be kept: a transaction rolled back takes them back
        self._this_sync: dict[str, HostClock | None] = {}

    @property
    def snapshot(self) -> FleetSnapshot:
        """The latest published snapshot; never blocks."""
        return self._snapshot

    def __call__(self) -> FleetSnapshot:
        """Write this host's clocks, read the fleet's; never raises."""
        self._this_sync = {}
        try:
            fresh = self._sync()
        except Exception as exc:  # a dead store must not stop the other periodic tasks
            self._failed(describe(exc, with_type=not isinstance(exc, StoreError)))
            return self._snapshot
        if self._logged:
            log.info("fleet sync with the store %s works again", self._store.where)
            self._logged.clear()
        self._snapshot = fresh
        return fresh

    def rolled_back(self, message: str) -> None:
        """The transaction this sync ran in was rolled back (``message`` says why): its
        clock writes were not kept, so they are due again, and the views are stale."""
        for uuid, before in self._this_sync.items():
            if before is None:
                self._written.pop(uuid, None)
            else:
                self._written[uuid] = before
        self._this_sync = {}
        self._failed(message)

    def _failed(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning(
                "fleet sync with the store %s failed (fleet metrics keep their last values): %s",
                self._store.where,
                message,
            )
        self._snapshot = dataclasses.replace(self._snapshot, stale=True)

    def own_clocks(self) -> list[tuple[OwnClock, HostClock]]:
        """This host's GPUs that have a learned sustained clock, as published and as stored."""
        view = self._drift_view()
        out: list[tuple[OwnClock, HostClock]] = []
        for snap in self._board.all():
            info = snap.info
            drift = view.get(snap.index)
            if info is None or drift is None or drift.learned_clock_hz is None:
                continue
            clock_hz = drift.learned_clock_hz
            group = ClockGroup.of(info.name, info.power_limit_w)
            own = OwnClock(snap.index, info.uuid, group, clock_hz)
            row = HostClock(
                host=self.host,
                gpu_uuid=info.uuid,
                gpu_model=info.name,
                power_limit_w=info.power_limit_w,
                sustained_clock_hz=clock_hz,
                updated_at=self._now(),
            )
            out.append((own, row))
        return out

    def _sync(self) -> FleetSnapshot:
        own = self.own_clocks()
        for _, row in own:
            if self._due(row):
                self._store.report_host_clock(row)
                self._this_sync.setdefault(row.gpu_uuid, self._written.get(row.gpu_uuid))
                self._written[row.gpu_uuid] = row
        # Only this host's GPU models, and the medians the fleet keeps (one host
        # recomputes them per interval): a sync costs the same in a fleet of any size.
        models = sorted({s.info.name for s in self._board.all() if s.info is not None})
        medians = self._store.clock_medians(
            self.max_age_s, gpu_models=models, kept_for_s=self.interval_s
        )
        groups = groups_from_medians(medians)
        disagreements = self._store.disagreement_counts(gpu_models=models)
        recent = self._store.disagreement_counts(
            since=self._now() - RECENT_DISAGREEMENTS_S, gpu_models=models
        )
        return FleetSnapshot(
            own=tuple(clock for clock, _ in own),
            groups=groups,
            disagreements=dict(disagreements),
            coverage=coverage(self._fresh_winners(models)),
            synced_at=self._now(),
            recent_disagreements=dict(recent),
        )

    def _due(self, row: HostClock) -> bool:
        """Whether ``row`` is to be written: it changed, or its last write ages."""
        last = self._written.get(row.gpu_uuid)
        if last is None or dataclasses.replace(last, updated_at=row.updated_at) != row:
            return True
        rewrite_s = REWRITE_SHARE * min(self.max_age_s, DEFAULT_CLOCK_MAX_AGE_S)
        return row.updated_at - last.updated_at >= rewrite_s

    def _fresh_winners(self, models: Iterable[str]) -> list[WinnerRow]:
        winners: list[WinnerRow] = []
        for model in models:
            winners += self._store.fleet_winners(model, self.winner_max_age_s)
        return winners


def in_one_transaction(
    store: SqlStore,
    steps: Sequence[Callable[[], object]],
    on_rollback: Sequence[Callable[[str], None]] = (),
) -> None:
    """Run ``steps`` (each handles its own store errors) as one transaction on a shared
    store, so a fleet's load is one transaction per host and sync, not one per query and
    GPU. On an embedded store each step runs on its own (a write transaction there would
    hold the file's lock over every step); when the transaction cannot begin (the store
    is down) each step runs on its own and fails fast, marking its view stale. When it
    began and was rolled back (a step failed, or the COMMIT did), each ``on_rollback``
    is told why (it logs it): what the steps wrote was not kept.
    """
    if not store.shared:
        for step in steps:
            step()
        return
    began = False
    try:
        with store.batch(write=True):
            began = True
            for step in steps:
                step()
    except StoreError as exc:
        if not began:
            for step in steps:
                step()
            return
        log.debug("the fleet sync's transaction was rolled back: %s", exc)
        for undo in on_rollback:
            undo(str(exc))
