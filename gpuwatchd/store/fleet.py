"""What hosts sharing one store ask of it: fresh fleet winners, leases, disagreements, clocks.

On an embedded (SQLite) store the fleet is the one host, and every query still answers
correctly: a host's own winners are the fleet's and claims never contend.
"""

from __future__ import annotations

import os
from typing import Any

from gpuwatchd.store import claims as claim_sql
from gpuwatchd.store import codec
from gpuwatchd.store.claims import HOST_CLAIM_PREFIX
from gpuwatchd.store.core import StoreCore
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.rows import (
    WHOLE_WATTS_SQL,
    Claim,
    ClockMedian,
    Disagreement,
    HostClock,
    WinnerRow,
    whole_watts,
)
from gpuwatchd.store.winner_sql import FLEET
from gpuwatchd.tuning.types import Versions
from gpuwatchd.validate import need_int, need_number


class FleetStore(StoreCore):
    """The fleet's queries, on the machinery of :class:`StoreCore`."""

    # -- winners ---------------------------------------------------------------------------

    def fleet_winners(
        self,
        gpu_model: str,
        max_age_s: float,
        *,
        versions: Versions | None = None,
        exclude_host: str | None = None,
    ) -> list[WinnerRow]:
        """The fleet's winners for a GPU model measured in the last ``max_age_s`` (store clock).

        Optionally only those of one versions stack, or not measured by ``exclude_host``
        (what other hosts did). Ordered by workload, regime.
        """
        codec.check_text(gpu_model, "gpu_model")
        need_number(max_age_s, "max_age_s", minimum=0, error=StoreError)
        if versions is not None and not isinstance(versions, Versions):
            raise StoreError(f"versions must be Versions, got {type(versions).__name__}")
        if exclude_host is not None:
            codec.check_text(exclude_host, "exclude_host")
        sql = f"SELECT * FROM ({FLEET}) AS src WHERE gpu_model = ? AND measured_at >= ?"
        args: list[object] = [gpu_model, self._now() - max_age_s]
        if versions is not None:
            sql += " AND versions_key = ?"
            args.append(versions.key())
        if exclude_host is not None:
            sql += " AND host <> ?"
            args.append(exclude_host)
        with self._read("read fleet winners") as conn:
            rows = conn.execute(f"{sql} ORDER BY workload, regime, measured_at DESC", args)
            return self._winner_rows(rows.fetchall())

    def _winner_rows(self, rows: list[Any]) -> list[WinnerRow]:
        out = []
        for row in rows:
            try:
                out.append(codec.winner_from_row(row))
            except (ValueError, TypeError) as e:
                self._skip("winners", (row["gpu_model"], row["workload"], row["regime"]), e)
        return out

    # -- claims ----------------------------------------------------------------------------

    def claim(self, key: str, host: str, gpu_uuid: str, ttl_s: float) -> bool:
        """Take the lease on ``key`` for ``ttl_s`` seconds; False when another holds it.

        Succeeds when the key is free, its lease expired, or this (host, GPU) holds it
        already (a renewal). Atomic: of hosts racing for one key, exactly one wins.
        """
        for name, value in (("key", key), ("host", host), ("gpu_uuid", gpu_uuid)):
            codec.check_text(value, name)
        need_number(ttl_s, "ttl_s", minimum=0, error=StoreError)
        if ttl_s <= 0:
            raise StoreError(f"ttl_s: expected a positive number of seconds, got {ttl_s!r}")
        with self._write("claim work") as conn:
            return claim_sql.take(conn, key, host, gpu_uuid, os.getpid(), self._now(), ttl_s)

    def release(self, key: str, host: str, gpu_uuid: str) -> None:
        """Give a lease back before it expires; only the holder's own claim is removed."""
        for name, value in (("key", key), ("host", host), ("gpu_uuid", gpu_uuid)):
            codec.check_text(value, name)
        with self._write("release a claim") as conn:
            claim_sql.release(conn, key, host, gpu_uuid)

    def claim_host(self, host: str, machine: str, ttl_s: float) -> str | None:
        """Hold the name ``host`` for the machine ``machine`` for ``ttl_s`` seconds (a
        lease like a work claim, renewed the same way). Returns None when this machine
        holds it now, else the id of the other live machine that holds it."""
        for name, value in (("host", host), ("machine", machine)):
            codec.check_text(value, name)
        need_number(ttl_s, "ttl_s", minimum=0, error=StoreError)
        key = HOST_CLAIM_PREFIX + host
        with self._write("claim the host name") as conn:
            now = self._now()
            if claim_sql.take(conn, key, host, machine, os.getpid(), now, ttl_s):
                return None
            row = conn.execute("SELECT gpu_uuid FROM claims WHERE claim_key = ?", (key,))
            return str(row.fetchone()[0])

    def release_host(self, host: str, machine: str) -> None:
        """Give the name back (a clean stop): another machine may take it at once."""
        self.release(HOST_CLAIM_PREFIX + host, host, machine)

    def claims(self) -> list[Claim]:
        """The leases not yet expired, by key."""
        with self._read("read claims") as conn:
            rows = conn.execute(
                "SELECT * FROM claims WHERE expires_at > ? ORDER BY claim_key", (self._now(),)
            ).fetchall()
        out = []
        for row in rows:
            try:
                out.append(codec.claim_from_row(row))
            except (ValueError, TypeError) as e:
                self._skip("claims", row["claim_key"], e)
        return out

    # -- disagreements ---------------------------------------------------------------------

    def disagreements(self, limit: int = 100) -> list[Disagreement]:
        """Recorded disagreements between hosts, newest first."""
        need_int(limit, "limit", minimum=1, error=StoreError)
        with self._read("read disagreements") as conn:
            rows = conn.execute(
                "SELECT * FROM disagreements ORDER BY recorded_at DESC, id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        out = []
        for row in rows:
            try:
                out.append(codec.disagreement_from_row(row))
            except (ValueError, TypeError) as e:
                self._skip("disagreements", row["id"], e)
        return out

    def disagreement_counts(self, since: float | None = None) -> dict[tuple[str, str, str], int]:
        """Disagreements per (GPU model, workload, regime): every one kept, or only those
        recorded at or after ``since`` (unix seconds, the store's clock)."""
        where = ""
        args: tuple[float, ...] = ()
        if since is not None:
            need_number(since, "since", error=StoreError)
            where, args = "WHERE recorded_at >= ?", (since,)
        with self._read("count disagreements") as conn:
            rows = conn.execute(
                f"""SELECT gpu_model, workload, regime, COUNT(*) AS n FROM disagreements {where}
                    GROUP BY gpu_model, workload, regime ORDER BY gpu_model, workload, regime""",
                args,
            ).fetchall()
        return {(r["gpu_model"], r["workload"], r["regime"]): int(r["n"]) for r in rows}

    # -- host clocks -----------------------------------------------------------------------

    def report_host_clock(self, clock: HostClock) -> None:
        """Record a GPU's learned sustained clock; an older report never replaces a newer one."""
        codec.check_host_clock(clock)
        with self._write("report a host clock") as conn:
            conn.execute(
                """INSERT INTO host_clocks (host, gpu_uuid, gpu_model, power_limit_w,
                       sustained_clock_hz, updated_at)
                   VALUES (?, ?, ?, ?, ?, ?)
                   ON CONFLICT (host, gpu_uuid) DO UPDATE SET
                       gpu_model = excluded.gpu_model,
                       power_limit_w = excluded.power_limit_w,
                       sustained_clock_hz = excluded.sustained_clock_hz,
                       updated_at = excluded.updated_at
                   WHERE excluded.updated_at >= host_clocks.updated_at""",
                (
                    clock.host,
                    clock.gpu_uuid,
                    clock.gpu_model,
                    clock.power_limit_w,
                    clock.sustained_clock_hz,
                    clock.updated_at,
                ),
            )

    def clock_medians(self, max_age_s: float) -> list[ClockMedian]:
        """Per group of GPUs (model, whole watts) the median of the clocks reported in the
        last ``max_age_s`` and how many there are: one row per group, computed by the
        database where it can (PostgreSQL), so a host never reads every host's clocks."""
        need_number(max_age_s, "max_age_s", minimum=0, error=StoreError)
        since = self._now() - max_age_s
        median = self._engine.median_sql("sustained_clock_hz")
        if median is None:  # SQLite: one host's own clocks, medians in Python
            return _medians(self.host_clocks(max_age_s=max_age_s))
        with self._read("read the fleet's clock medians") as conn:
            rows = conn.execute(
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
            for r in rows
        ]

    def prune_clocks(self, older_than_s: float) -> int:
        """Delete GPUs' clocks not reported for ``older_than_s`` (their hosts left the
        fleet). Returns how many."""
        need_number(older_than_s, "older_than_s", minimum=0, error=StoreError)
        with self._write("prune old host clocks") as conn:
            cur = conn.execute(
                "DELETE FROM host_clocks WHERE updated_at < ?", (self._now() - older_than_s,)
            )
            return int(cur.rowcount)

    def host_clocks(self, max_age_s: float | None = None) -> list[HostClock]:
        """Every GPU's reported clock (only those reported in the last ``max_age_s``).

        Ordered by GPU model, host, GPU UUID.
        """
        where = ""
        args: tuple[float, ...] = ()
        if max_age_s is not None:
            need_number(max_age_s, "max_age_s", minimum=0, error=StoreError)
            where = "WHERE updated_at >= ?"
            args = (self._now() - max_age_s,)
        with self._read("read host clocks") as conn:
            rows = conn.execute(
                f"SELECT * FROM host_clocks {where} ORDER BY gpu_model, host, gpu_uuid", args
            ).fetchall()
        out = []
        for row in rows:
            try:
                out.append(codec.host_clock_from_row(row))
            except (ValueError, TypeError) as e:
                self._skip("host_clocks", (row["host"], row["gpu_uuid"]), e)
        return out


def _medians(clocks: list[HostClock]) -> list[ClockMedian]:
    """:meth:`FleetStore.clock_medians` computed here, for a database without medians."""
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
