"""The fleet's learned sustained clocks in the store, one row per (host, GPU), in SQL.

A host reports each GPU's clock; the fleet's medians per group of GPUs (GPU model,
whole watts) are computed by the database where it can (PostgreSQL's
``percentile_cont``), else here from the rows (SQLite: one host's own clocks). On a
fleet the medians are kept in ``clock_medians`` (:func:`kept_medians`): one host per
interval recomputes them, the others read a row per group of their own GPU models,
so a sync's cost does not grow with the fleet. The store runs each function inside its
transaction and validates the arguments first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuwatchd.store.columns import HOST_CLOCK_COLUMNS, insert
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.rows import WHOLE_WATTS_SQL, ClockMedian, HostClock, whole_watts
from gpuwatchd.store.sql_args import in_list

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


def _grouped(median: str, models: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    """The medians' query over the clocks reported at or after its first argument."""
    where, args = ("", ()) if models is None else in_list("gpu_model", models)
    return (
        f"""SELECT gpu_model, {WHOLE_WATTS_SQL} AS watts, {median} AS median_hz,
                COUNT(*) AS peers
            FROM host_clocks WHERE updated_at >= ? {where}
            GROUP BY gpu_model, {WHOLE_WATTS_SQL}""",
        args,
    )


def medians_in_sql(
    conn: Conn, since: float, median: str, models: Sequence[str] | None = None
) -> list[ClockMedian]:
    """Per group (of ``models``' GPUs, or all) the median (the SQL aggregate ``median``)
    of the clocks reported at or after ``since``, and how many there are; ordered by
    GPU model, then watts."""
    sql, args = _grouped(median, models)
    found = conn.execute(f"{sql} ORDER BY gpu_model, watts", (since, *args)).fetchall()
    return _medians(found)


#: Only one host at a time recomputes the kept medians (a transaction-scoped try-lock).
MEDIANS_LOCK = 0x67707577_0002


def kept_medians(
    conn: Conn, now: float, since: float, median: str, models: Sequence[str], fresh_s: float
) -> list[ClockMedian]:
    """The kept medians of ``models``' groups. When the table was computed over
    ``fresh_s`` ago (or never), this host recomputes every group's from the clocks
    reported at or after ``since`` (its own max age: the fleet's hosts share one), unless
    another host does so now (then it reads the older rows). Inside a write transaction."""
    newest = conn.execute("SELECT MAX(computed_at) AS t FROM clock_medians").fetchone()["t"]
    if newest is None or float(newest) < now - fresh_s:
        got = conn.execute("SELECT pg_try_advisory_xact_lock(?) AS got", (MEDIANS_LOCK,))
        if got.fetchone()["got"]:
            sql, _ = _grouped(median, None)
            conn.execute("DELETE FROM clock_medians")
            conn.execute(
                "INSERT INTO clock_medians (gpu_model, watts, median_hz, peers, computed_at)"
                f" SELECT gpu_model, watts, median_hz, peers, ? FROM ({sql}) AS fresh",
                (now, since),
            )
    where, args = in_list("gpu_model", models)
    rows = conn.execute(
        f"""SELECT gpu_model, watts, median_hz, peers FROM clock_medians
            WHERE 1 = 1 {where} ORDER BY gpu_model, watts""",
        args,
    ).fetchall()
    return _medians(rows)


def _medians(found: list[Any]) -> list[ClockMedian]:
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
