"""The fleet's learned sustained clocks in the store, one row per (host, GPU), in SQL.

A host reports each GPU's clock; the fleet's medians per group of GPUs (GPU model,
whole watts) are computed by the database where it can (PostgreSQL's
``percentile_cont``), else here from the rows (SQLite: one host's own clocks). The
store runs each function inside its transaction and validates the arguments first.
"""

from __future__ import annotations

from typing import Any

from gpuwatchd.store.columns import HOST_CLOCK_COLUMNS, insert
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.rows import WHOLE_WATTS_SQL, ClockMedian, HostClock, whole_watts

_KEY = ("host", "gpu_uuid")
#: A report replaces the one its GPU sent before, never a newer one.
_REPORT = insert(
    "host_clocks",
    HOST_CLOCK_COLUMNS,
    f"ON CONFLICT ({', '.join(_KEY)}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in HOST_CLOCK_COLUMNS if c not in _KEY)
    + " WHERE excluded.updated_at >= host_clocks.updated_at",
)


def report(conn: Conn, clock: HostClock) -> None:
    """Record ``clock`` (validated by the caller)."""
    conn.execute(_REPORT, [getattr(clock, c) for c in HOST_CLOCK_COLUMNS])


def rows(conn: Conn, since: float | None) -> list[Any]:
    """The clock rows reported at or after ``since`` (every one when None), ordered by
    GPU model, host, GPU UUID."""
    where, args = ("WHERE updated_at >= ?", (since,)) if since is not None else ("", ())
    return conn.execute(
        f"SELECT * FROM host_clocks {where} ORDER BY gpu_model, host, gpu_uuid", args
    ).fetchall()


def medians_in_sql(conn: Conn, since: float, median: str) -> list[ClockMedian]:
    """Per group the median (the SQL aggregate ``median``) of the clocks reported at or
    after ``since``, and how many there are; ordered by GPU model, then watts."""
    found = conn.execute(
        f"""SELECT gpu_model, {WHOLE_WATTS_SQL} AS watts, {median} AS median_hz,
                COUNT(*) AS peers
            FROM host_clocks WHERE updated_at >= ?
            GROUP BY gpu_model, {WHOLE_WATTS_SQL} ORDER BY gpu_model, watts""",
        (since,),
    ).fetchall()
    return [
        ClockMedian(
            str(r["gpu_model"]),
            None if r["watts"] is None else int(r["watts"]),
            float(r["median_hz"]),
            int(r["peers"]),
        )
        for r in found
    ]


def medians_in_python(clocks: list[HostClock]) -> list[ClockMedian]:
    """:func:`medians_in_sql` computed from the clocks, for a database without medians."""
    groups: dict[tuple[str, int | None], list[float]] = {}
    for c in clocks:
        groups.setdefault((c.gpu_model, whole_watts(c.power_limit_w)), []).append(
            c.sustained_clock_hz
        )
    if not groups:
        return []
    import statistics  # loaded once a fleet shows clocks (a lone host never pays its memory)

    # ordered as PostgreSQL orders them: by model, then watts, an unknown limit last
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0))
    return [
        ClockMedian(model, watts, statistics.median(values), len(values))
        for (model, watts), values in ordered
    ]


def prune(conn: Conn, before: float) -> int:
    """Delete the clocks last reported before ``before``; returns how many."""
    return int(conn.execute("DELETE FROM host_clocks WHERE updated_at < ?", (before,)).rowcount)
