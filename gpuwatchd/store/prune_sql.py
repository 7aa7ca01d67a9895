"""Retention in SQL: old sessions deleted a bounded batch at a time, stale ones ended.

One batch is one transaction of at most ``limit`` sessions: their results and candidate
statistics go with them (``ON DELETE CASCADE``), each foreign-key check an index lookup
(migration 7 indexes ``host_winners(result_id)``), so a batch takes well under a call's
bound however large the store grew. Never deleted: a running session, one a winner (the
fleet's or a host's) points at, and each GPU's latest completed one. The store runs
each function inside its transaction and validates the arguments first.
"""

from __future__ import annotations

from gpuwatchd.store.claims import HOST_CLAIM_PREFIX
from gpuwatchd.store.commit import COUNT_DISAGREEMENTS
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.result_rows import chunks
from gpuwatchd.tuning.types import SessionStatus

_RUNNING = SessionStatus.RUNNING.value
_COMPLETED = SessionStatus.COMPLETED.value

#: The oldest ``limit`` sessions that may go (arguments: cutoff, limit).
_DELETABLE = f"""SELECT s.id FROM sessions s
    WHERE s.status <> '{_RUNNING}' AND COALESCE(s.ended_at, s.started_at) < ?
      AND NOT EXISTS (SELECT 1 FROM winners w WHERE w.session_id = s.id)
      AND NOT EXISTS (SELECT 1 FROM host_winners h WHERE h.session_id = s.id)
      AND (s.status <> '{_COMPLETED}' OR EXISTS (
          SELECT 1 FROM sessions n
          WHERE n.gpu_uuid = s.gpu_uuid AND n.status = '{_COMPLETED}'
            AND (n.ended_at > s.ended_at OR (n.ended_at = s.ended_at AND n.id > s.id))))
    ORDER BY s.id LIMIT ?"""

#: Sessions still marked running that started before a bound, on a host that holds no
#: live lease on its name (arguments: started before, now): its daemon is gone.
_STALE = f"""SELECT s.id, s.gpu_uuid FROM sessions s
    WHERE s.status = '{_RUNNING}' AND s.started_at < ?
      AND NOT EXISTS (SELECT 1 FROM claims c
                      WHERE c.claim_key = '{HOST_CLAIM_PREFIX}' || s.host AND c.expires_at > ?)
    ORDER BY s.id"""


def delete_batch(conn: Conn, cutoff: float, limit: int) -> int:
    """Delete up to ``limit`` of the sessions that ended before ``cutoff`` and may go;
    returns how many were deleted (fewer than ``limit``: none is left)."""
    ids = [int(r["id"]) for r in conn.execute(_DELETABLE, (cutoff, limit)).fetchall()]
    deleted = 0
    for chunk in chunks(ids):
        marks = ", ".join("?" for _ in chunk)
        deleted += int(conn.execute(f"DELETE FROM sessions WHERE id IN ({marks})", chunk).rowcount)
    return deleted


def stale_running(conn: Conn, started_before: float, now: float) -> list[tuple[int, str]]:
    """(id, GPU UUID) of the running sessions whose host is gone (see :data:`_STALE`)."""
    rows = conn.execute(_STALE, (started_before, now)).fetchall()
    return [(int(r["id"]), str(r["gpu_uuid"])) for r in rows]


def drop_disagreements(conn: Conn, before: float) -> int:
    """Delete the disagreements recorded before ``before``, and take them off the counts
    kept per key; returns how many."""
    gone = conn.execute(
        """SELECT gpu_model, workload, regime, COUNT(*) AS n FROM disagreements
           WHERE recorded_at < ? GROUP BY gpu_model, workload, regime
           ORDER BY gpu_model, workload, regime""",
        (before,),
    ).fetchall()
    for r in gone:
        conn.execute(
            COUNT_DISAGREEMENTS, (r["gpu_model"], r["workload"], r["regime"], -int(r["n"]))
        )
    conn.execute("DELETE FROM disagreement_totals WHERE n <= 0")
    return int(conn.execute("DELETE FROM disagreements WHERE recorded_at < ?", (before,)).rowcount)
