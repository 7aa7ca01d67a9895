"""How a completed session's results become winners, inside its finishing transaction.

Each result's pick always becomes its host's own winner (``host_winners``). It becomes
the fleet's (``winners``) too, unless another host's incumbent disagrees with it beyond
noise (:mod:`gpuwatchd.store.disagreement`): then the disagreement is recorded, and the
incumbent stays while it is younger than ``keep_incumbent_for_s`` (an older one is
replaced). Either way a winner is replaced only by a result measured at the same time
or later, so a session finishing late does not overwrite a newer pick.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuwatchd.store import codec
from gpuwatchd.store.codec import Skip
from gpuwatchd.store.columns import (
    DISAGREEMENT_COLUMNS,
    VERSION_COLUMNS,
    WINNER_COLUMNS,
    WINNER_KEY,
    insert,
    version_values,
)
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.disagreement import Incumbent, disagreement_gap, keeps_incumbent
from gpuwatchd.store.rows import Disagreement, StoredResult
from gpuwatchd.tuning.types import CandidateStats
from gpuwatchd.tuning.winners import pick_winner

log = logging.getLogger("gpuwatchd.store")

#: What a newer pick replaces; the key and the versions it implies stay.
_REPLACED = tuple(c for c in WINNER_COLUMNS if c not in WINNER_KEY and c not in VERSION_COLUMNS)


@dataclass(frozen=True, slots=True)
class Found:
    """A disagreement recorded while committing; ``replaced``: the incumbent was stale and
    the new pick became the fleet's winner (else the incumbent was kept)."""

    disagreement: Disagreement
    replaced: bool


def _upsert(table: str, *extra: str) -> str:
    """Insert a winner (``extra`` columns first) or replace an older one for its key."""
    updates = ", ".join(f"{c} = excluded.{c}" for c in _REPLACED)
    return insert(
        table,
        (*extra, *WINNER_COLUMNS),
        f"""ON CONFLICT ({", ".join((*extra, *WINNER_KEY))}) DO UPDATE SET {updates}
        WHERE excluded.measured_at >= {table}.measured_at""",
    )


_UPSERT_FLEET = _upsert("winners")
_UPSERT_HOST = _upsert("host_winners", "host")
_INCUMBENT = """SELECT w.candidate, w.median_s, w.gpu_uuid, w.measured_at, s.host
    FROM winners w JOIN sessions s ON s.id = w.session_id
    WHERE w.gpu_model = ? AND w.versions_key = ? AND w.workload = ? AND w.regime = ?"""
_RECORD_DISAGREEMENT = insert("disagreements", DISAGREEMENT_COLUMNS)
#: Its count per (GPU model, workload, regime), kept beside it (what a sync reads).
COUNT_DISAGREEMENTS = """INSERT INTO disagreement_totals (gpu_model, workload, regime, n)
    VALUES (?, ?, ?, ?) ON CONFLICT (gpu_model, workload, regime)
    DO UPDATE SET n = disagreement_totals.n + excluded.n"""
#: A disagreement's columns after the winner's key: :class:`Disagreement`'s fields.
_DISAGREEMENT_TAIL = DISAGREEMENT_COLUMNS[len(WINNER_KEY) :]


def _values(stored: StoredResult, result_id: int, pick: CandidateStats) -> tuple[object, ...]:
    res, v = stored.result, stored.versions
    row = {
        "gpu_model": stored.gpu_model,
        "versions_key": v.key(),
        **version_values(v),
        "workload": res.workload,
        "regime": res.regime.value,
        "candidate": pick.name,
        "family": pick.family,
        "median_s": pick.median_s,
        "sm_clock_hz": pick.sm_clock_hz,
        "margin": res.margin,
        "tie": int(res.tie),
        "session_id": stored.session_id,
        "result_id": result_id,
        "gpu_uuid": stored.gpu_uuid,
        "measured_at": stored.recorded_at,
    }
    return tuple(row[c] for c in WINNER_COLUMNS)


def _incumbent(conn: Conn, key: tuple[object, ...], skip: Skip) -> Incumbent | None:
    row = conn.execute(_INCUMBENT, key).fetchone()
    if row is None:
        return None
    try:
        incumbent = codec.incumbent_from_row(row)
    except (ValueError, TypeError) as e:  # a damaged incumbent cannot be defended
        skip("winners", key, e)
        return None
    measured = row["measured_at"]
    ok = isinstance(measured, int | float) and not isinstance(measured, bool)
    return replace(
        incumbent, measured_at=float(measured) if ok and math.isfinite(measured) else None
    )


def commit_winners(
    conn: Conn,
    host: str,
    results: Sequence[tuple[int, StoredResult]],
    now: float,
    skip: Skip,
    keep_incumbent_for_s: float,
) -> list[Found]:
    """Write the winners of one session's ``(result_id, result)`` pairs measured on ``host``.

    Returns the disagreements recorded: for each, the fleet kept its incumbent unless it
    was measured more than ``keep_incumbent_for_s`` before ``now``.
    """
    found: list[Found] = []
    for result_id, stored in results:
        res = stored.result
        pick = pick_winner(res)
        if pick is None:
            continue
        values = _values(stored, result_id, pick)
        conn.execute(_UPSERT_HOST, (host, *values))
        key = (stored.gpu_model, stored.versions.key(), res.workload, res.regime.value)
        incumbent = _incumbent(conn, key, skip)
        gap = disagreement_gap(incumbent, host, res) if incumbent is not None else None
        if incumbent is None or gap is None:
            conn.execute(_UPSERT_FLEET, values)
            continue
        stale = not keeps_incumbent(incumbent, now, keep_incumbent_for_s)
        if stale:
            conn.execute(_UPSERT_FLEET, values)
        d = _disagreement(stored, incumbent, host, pick, gap, now)
        found.append(Found(d, replaced=stale))
        conn.execute(_RECORD_DISAGREEMENT, (*key, *_disagreement_tail(d)))
        conn.execute(COUNT_DISAGREEMENTS, (key[0], key[2], key[3], 1))
    return found


def _disagreement(
    stored: StoredResult,
    incumbent: Incumbent,
    host: str,
    pick: CandidateStats,
    gap: float,
    now: float,
) -> Disagreement:
    """The fleet's ``incumbent`` against ``host``'s ``pick`` in ``stored``, as recorded."""
    res = stored.result
    return Disagreement(
        gpu_model=stored.gpu_model,
        versions=stored.versions,
        workload=res.workload,
        regime=res.regime,
        kept_candidate=incumbent.candidate,
        kept_host=incumbent.host,
        kept_gpu_uuid=incumbent.gpu_uuid,
        kept_median_s=incumbent.median_s,
        new_candidate=pick.name,
        new_host=host,
        new_gpu_uuid=stored.gpu_uuid,
        new_median_s=pick.median_s,
        gap=gap,
        noise=res.noise,
        recorded_at=now,
    )


def _disagreement_tail(d: Disagreement) -> tuple[object, ...]:
    return tuple(getattr(d, c) for c in _DISAGREEMENT_TAIL)


def log_found(where: str, found: Found) -> None:
    """One WARNING for a disagreement a session's commit recorded in store ``where``."""
    d = found.disagreement
    log.warning(
        "store %s: host %s measured the fleet's %s winner for %s on %s (%s, from %s)"
        " %.1f%% slower than its own pick %s; %s, recorded the disagreement",
        where,
        d.new_host,
        d.regime.value,
        d.workload,
        d.gpu_model,
        d.kept_candidate,
        d.kept_host,
        100 * d.gap,
        d.new_candidate,
        "replaced the fleet's, older than the fleet's max winner age"
        if found.replaced
        else "kept the fleet's",
    )
