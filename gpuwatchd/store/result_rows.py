"""Writing one regime result and its candidates' statistics, inside a caller's transaction.

Shared by recording a fresh result and by carrying a preempted session's results into
the session that resumes it, so both write exactly the same rows.
"""

from __future__ import annotations

from gpuwatchd.store import codec
from gpuwatchd.store.conn import Conn
from gpuwatchd.tuning.types import RegimeResult


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
        """INSERT INTO results (session_id, workload, regime, winner, tie, margin,
               noise, recorded_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?)
           RETURNING id""",
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
    result_id = int(cur.fetchone()[0])
    conn.executemany(
        """INSERT INTO candidate_stats (result_id, candidate, family, median_s, spread,
               samples, rejected, sm_clock_hz, power_w, temp_c, energy_j_per_call,
               reasons, meta_json)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
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
