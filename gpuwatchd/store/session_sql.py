"""The ``sessions`` table and its counts, in SQL: start, finish, abandon, totals.

Finished sessions are counted per (GPU, status) in ``gpu_session_totals``, bumped in the
transaction that finishes one: each GPU runs one session at a time, so no two hosts
ever wait on the same counter row (a single fleet-wide row per status made every host
finishing in the window of a stalled one time out). The counts of stores older than
that table stay in ``session_totals`` (no longer written) and are added on read. The
store runs each function inside its transaction and validates the arguments first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuwatchd.store import columns
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.errors import StoreError
from gpuwatchd.tuning.types import SessionStatus

INSERT = columns.insert("sessions", columns.SESSION_COLUMNS, "RETURNING id")
SET_VERSIONS = "UPDATE sessions SET versions_json = ?, {} WHERE id = ?".format(
    ", ".join(f"{c} = ?" for c in columns.VERSION_COLUMNS)
)
_END = "UPDATE sessions SET status = ?, why = ?, ended_at = ? WHERE id = ? AND status = ?"
_BUMP = """INSERT INTO gpu_session_totals (gpu_uuid, status, n) VALUES (?, ?, ?)
    ON CONFLICT (gpu_uuid, status) DO UPDATE SET n = gpu_session_totals.n + excluded.n"""
#: Every count: the per-GPU ones and the fleet-wide ones stores kept before them.
TOTALS = """SELECT status, CAST(SUM(n) AS BIGINT) AS n FROM (
        SELECT status, n FROM session_totals
        UNION ALL SELECT status, n FROM gpu_session_totals) AS counted
    GROUP BY status"""

Skip = Callable[[str, object, Exception], None]


def require_running(conn: Conn, session_id: int, what: str) -> str:
    """The running session's GPU UUID; StoreError when it is missing or not running."""
    if isinstance(session_id, bool) or not isinstance(session_id, int):
        raise StoreError(f"session_id must be an integer, got {session_id!r}")
    row = conn.execute(
        "SELECT status, gpu_uuid FROM sessions WHERE id = ?", (session_id,)
    ).fetchone()
    if row is None:
        raise StoreError(f"session {session_id} does not exist")
    if row["status"] != SessionStatus.RUNNING.value:
        raise StoreError(f"session {session_id} is {row['status']}, not running; cannot {what}")
    return str(row["gpu_uuid"])


def end(conn: Conn, ended: Sequence[tuple[int, str]], status: SessionStatus, why: str | None,
        at: float) -> int:  # fmt: skip
    """End the running sessions ``ended`` ((id, GPU UUID) pairs) with ``status`` and count
    them on their GPUs; returns how many were still running (and so ended now)."""
    done: dict[str, int] = {}
    for sid, gpu_uuid in ended:
        cur = conn.execute(_END, (status.value, why, at, sid, SessionStatus.RUNNING.value))
        if cur.rowcount:
            done[gpu_uuid] = done.get(gpu_uuid, 0) + 1
    for gpu_uuid, n in sorted(done.items()):  # sorted: two writers never wait on each other
        conn.execute(_BUMP, (gpu_uuid, status.value, n))
    return sum(done.values())


def running(conn: Conn, where: str, args: Sequence[object]) -> list[tuple[int, str, object]]:
    """(id, GPU UUID, owner PID) of the running sessions matching ``where`` (an ``AND``
    clause on ``sessions``)."""
    rows = conn.execute(
        f"SELECT id, gpu_uuid, owner_pid FROM sessions WHERE status = ? {where} ORDER BY id",
        (SessionStatus.RUNNING.value, *args),
    ).fetchall()
    return [(int(r["id"]), str(r["gpu_uuid"]), r["owner_pid"]) for r in rows]


def totals(conn: Conn, final: Sequence[SessionStatus], skip: Skip) -> dict[SessionStatus, int]:
    """Finished sessions per final status, every status in ``final`` present (0 if none);
    a row that cannot be read is skipped through ``skip``."""
    out: dict[SessionStatus, int] = dict.fromkeys(final, 0)
    for row in conn.execute(TOTALS).fetchall():
        try:
            status = SessionStatus(row["status"])
            n = row["n"]
            if status is SessionStatus.RUNNING or not isinstance(n, int) or n < 0:
                raise ValueError(f"bad count {n!r}")
        except ValueError as e:
            skip("session_totals", row["status"], e)
            continue
        out[status] = n
    return out
