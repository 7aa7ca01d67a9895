"""A regime result's rows, written and read inside a caller's transaction.

Writing is shared by recording a fresh result and by carrying a preempted session's
results into the session that resumes it, so both write exactly the same rows. Reading
joins each result with its session and loads the candidates of many results at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuwatchd.store import codec
from gpuwatchd.store.codec import Skip
from gpuwatchd.store.columns import CANDIDATE_COLUMNS, RESULT_COLUMNS, insert
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.rows import StoredResult
from gpuwatchd.tuning.types import RegimeResult

#: Result rows with what :func:`codec.result_from_rows` needs of their session; callers
#: add ``WHERE`` and ``ORDER BY``.
RESULT_SELECT = """SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json
    FROM results r JOIN sessions s ON s.id = r.session_id"""

_INSERT_RESULT = insert("results", RESULT_COLUMNS, "RETURNING id")
_INSERT_CANDIDATE = insert("candidate_stats", CANDIDATE_COLUMNS)

#: How many ids one ``IN (...)`` list holds (SQLite allows 32766 parameters).
IN_CHUNK = 500


def chunks(ids: Sequence[Any]) -> list[Sequence[Any]]:
    """``ids`` cut into lists of at most :data:`IN_CHUNK`."""
    return [ids[i : i + IN_CHUNK] for i in range(0, len(ids), IN_CHUNK)]


def _candidate_rows(conn: Conn, result_ids: Sequence[Any]) -> dict[Any, list[Any]]:
    """The candidate rows of each result, in the order recorded."""
    out: dict[Any, list[Any]] = {}
    for chunk in chunks(list(dict.fromkeys(result_ids))):
        marks = ", ".join("?" for _ in chunk)
        for c in conn.execute(
            f"SELECT * FROM candidate_stats WHERE result_id IN ({marks}) ORDER BY result_id, id",
            chunk,
        ):
            out.setdefault(c["result_id"], []).append(c)
    return out


def parse_results(conn: Conn, rows: list[Any], skip: Skip) -> list[tuple[int, StoredResult]]:
    """Results (rows of :data:`RESULT_SELECT`) with their candidates and row ids;
    unparsable rows are given to ``skip``. The candidates of all of them are read in
    one query per :data:`IN_CHUNK` results."""
    out: list[tuple[int, StoredResult]] = []
    by_result = _candidate_rows(conn, [row["id"] for row in rows])
    for row in rows:
        try:
            regime = codec.result_regime(row)
        except ValueError as e:
            skip("results", row["id"], e)
            continue
        candidates = []
        for c in by_result.get(row["id"], ()):
            try:
                candidates.append(codec.candidate_from_row(c, regime))
            except (ValueError, TypeError) as e:
                skip("candidate_stats", c["id"], e)
        try:
            stored = codec.result_from_rows(row, tuple(candidates))
            winner = stored.result.winner
            if winner is not None and all(c.name != winner for c in candidates):
                raise ValueError(f"winner {winner!r} has no readable candidate row")
            out.append((int(row["id"]), stored))
        except (ValueError, TypeError) as e:
            skip("results", row["id"], e)
    return out


def load_results(conn: Conn, rows: list[Any], skip: Skip) -> list[StoredResult]:
    """:func:`parse_results` without the row ids."""
    return [stored for _, stored in parse_results(conn, rows, skip)]


def insert_result(conn: Conn, session_id: int, result: RegimeResult, recorded_at: float) -> int:
    """Store ``result`` for the session, replacing its row for the same (workload, regime).

    The caller validated ``result`` (:func:`codec.check_result`) and holds a write
    transaction. Returns the result row's id.
    """
    conn.execute(
        "DELETE FROM results WHERE session_id = ? AND workload = ? AND regime = ?",
        (session_id, result.workload, result.regime.value),
    )
    cur = conn.execute(
        _INSERT_RESULT,
        (
            session_id,
            result.workload,
            result.regime.value,
            result.winner,
            int(result.tie),
            result.margin,
            result.noise,
            recorded_at,
        ),
    )
    result_id = int(cur.fetchone()["id"])
    conn.executemany(
        _INSERT_CANDIDATE,
        [
            (
                result_id,
                c.name,
                c.family,
                c.median_s,
                c.spread,
                c.samples,
                c.rejected,
                c.sm_clock_hz,
                c.power_w,
                c.temp_c,
                c.energy_j_per_call,
                c.reasons,
                codec.dumps(c.meta, "candidate meta"),
            )
            for c in result.candidates
        ],
    )
    return result_id
