"""The tuning store's facade: :class:`SqlStore` checks each call's arguments and runs it
as one transaction (:class:`~gpuwatchd.store.transactions.Transactions`) on an
:class:`~gpuwatchd.store.engine.Engine` (SQLite, the embedded default, or PostgreSQL,
the fleet's shared store). Its SQL is written once, in SQLite's spelling, here for the
small reads and in one query module per table for the rest (``session_sql``,
``result_rows``/``result_sql``, ``winner_sql``/``commit``, ``claims``, ``clocks``,
``prune_sql``). A failure mid-write rolls back and loses nothing already stored; reads
skip rows they cannot parse, with a warning.

The SQL layer is hand-written, not SQLAlchemy Core: Core alone takes several times
this whole store's memory, in a daemon held to 32 MiB of RSS (bench/RESULTS.md, "The store's
SQL layer against SQLAlchemy Core").
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from gpuwatchd.store import claims as claim_sql
from gpuwatchd.store import clocks, codec, columns, prune_sql, result_sql, session_sql
from gpuwatchd.store.claims import HOST_CLAIM_PREFIX
from gpuwatchd.store.commit import Found, commit_winners, log_found
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.disagreement import DEFAULT_KEEP_INCUMBENT_S
from gpuwatchd.store.engine import Engine
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.owner import Alive, Holder, HostLease, orphaned, pid_alive, take_host
from gpuwatchd.store.result_rows import (
    RESULT_SELECT,
    chunks,
    insert_result,
    load_results,
    parse_results,
)
from gpuwatchd.store.rows import (
    Claim,
    ClockMedian,
    Disagreement,
    HostClock,
    SessionMeta,
    SessionRow,
    StoredResult,
    WinnerRow,
    host_name,
)
from gpuwatchd.store.schema import LEASE_HOLDER_VERSION, MIGRATIONS, Migration, SchemaState
from gpuwatchd.store.sql_args import (
    checked_models,
    checked_pairs,
    enum_value,
    filters,
    models_clause,
)
from gpuwatchd.store.transactions import Transactions, log
from gpuwatchd.store.winner_sql import FLEET, PREFERRING_HOST, newest_first
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions
from gpuwatchd.tuning.winners import clear_winner, winners_differ
from gpuwatchd.validate import need_int, need_number

#: Statuses a session can end in; ``gpuwatchd_tune_sessions_total`` has one series each.
FINAL_STATUSES = tuple(s for s in SessionStatus if s is not SessionStatus.RUNNING)

#: Why :meth:`SqlStore.abandon_running` fails a session whose process is gone.
ABANDONED_WHY = "abandoned: the process running it ended without finishing it"
#: Why :meth:`SqlStore.sweep_stale_running` fails a session whose host is gone.
STALE_WHY = "abandoned: its host stopped renewing its name and never ended it"
#: Sessions one pruning transaction deletes at most: well under a call's bound.
PRUNE_BATCH = 1000
#: :meth:`SqlStore.prune` keeps disagreements at most this long (30 days): the fleet's
#: alert looks at the last day, and a person comparing hosts at the last few weeks.
DISAGREEMENT_RETENTION_S = 30 * 86400.0

_T = TypeVar("_T")


class SqlStore:
    """The store on one engine; open one with :func:`gpuwatchd.store.open_store`.

    ``readonly=True`` (the client API, ``gpuwatchd report``) needs the database at the
    current schema version and never creates or migrates it. ``connect_now=False`` opens
    (and migrates) it at the first call instead, so a process can start while it is down.
    :attr:`keep_incumbent_for_s` is how long a fleet winner another host disputes stays
    the fleet's: the daemon sets it to ``[fleet] max_winner_age_s``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        readonly: bool = False,
        migrations: Sequence[Migration] = MIGRATIONS,
        now: Callable[[], float] = time.time,
        keep_connections: int = 4,
        connect_now: bool = True,
    ) -> None:
        self._engine = engine
        self._now = now
        self._keep_incumbent_for_s = DEFAULT_KEEP_INCUMBENT_S
        self._tx = Transactions(
            engine,
            readonly=readonly,
            migrations=migrations,
            keep_connections=keep_connections,
            connect_now=connect_now,
        )

    @property
    def readonly(self) -> bool:
        """Opened read-only: every write is refused."""
        return self._tx.readonly

    @property
    def where(self) -> str:
        """The store as messages name it: a file's path, or a URL without its password."""
        return self._engine.where

    @property
    def shared(self) -> bool:
        """Several hosts use this store (PostgreSQL): the fleet's winners and claims."""
        return self._engine.shared

    @property
    def up(self) -> bool:
        """The store is open and its last call reached it (see :meth:`probe`)."""
        return self._tx.up

    @property
    def schema(self) -> SchemaState | None:
        """The database's schema against this gpuwatchd's (None until opened)."""
        return self._tx.schema

    @property
    def writable(self) -> bool:
        """Whether writes are tried now (not read-only, refused, nor a newer schema's)."""
        return self._tx.writable

    def refuse_writes(self, why: str | None) -> None:
        """Refuse every write but the host lease's, saying ``why`` (None: allow again)."""
        self._tx.refuse_writes(why)

    def probe(self) -> None:
        """Reach the store now, opening it if it never was; StoreError if it cannot
        (:class:`~gpuwatchd.store.errors.StoreUnavailable` while it cannot be reached)."""
        self._tx.probe()

    def close(self) -> None:
        """Close idle connections; ones in use close when their call returns."""
        self._tx.close()

    def batch(self, *, write: bool = False) -> AbstractContextManager[None]:
        """The calls made inside, on this thread, as one transaction (:meth:`Transactions.
        batch <gpuwatchd.store.transactions.Transactions.batch>`)."""
        return self._tx.batch(write=write)

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schema_version(self) -> int:
        """The schema version the database is at."""
        with self._tx.read("read the schema version") as conn:
            return self._engine.version(conn)

    def _parsed(
        self, table: str, rows: list[Any], parse: Callable[[Any], _T], key: Callable[[Any], object]
    ) -> list[_T]:
        """``rows`` parsed; one that cannot be is skipped with a warning naming ``key(row)``."""
        out = []
        for row in rows:
            try:
                out.append(parse(row))
            except (ValueError, TypeError) as e:
                self._tx.skip(table, key(row), e)
        return out

    def _winners(self, rows: list[Any]) -> list[WinnerRow]:
        return self._parsed(
            "winners",
            rows,
            codec.winner_from_row,
            lambda row: (row["gpu_model"], row["workload"], row["regime"]),
        )

    @property
    def keep_incumbent_for_s(self) -> float:
        """Seconds a disputed fleet winner is kept after it was measured; older, it is
        replaced by the disputing host's pick (the disagreement is recorded either way)."""
        return self._keep_incumbent_for_s

    @keep_incumbent_for_s.setter
    def keep_incumbent_for_s(self, seconds: float) -> None:
        need_number(seconds, "keep_incumbent_for_s", minimum=0, error=StoreError)
        self._keep_incumbent_for_s = float(seconds)

    # -- sessions --------------------------------------------------------------------------

    def start_session(self, meta: SessionMeta) -> int:
        """Record a session as running; returns its id."""
        codec.check_meta(meta)
        started = meta.started_at if meta.started_at is not None else self._now()
        v = meta.versions
        row = {
            "gpu_uuid": meta.gpu_uuid,
            "gpu_index": meta.gpu_index,
            "gpu_model": meta.gpu_model,
            "host": meta.host,
            "backend": meta.backend,
            "versions_json": v.key(),
            **columns.version_values(v),
            "workloads_json": codec.dumps([w.to_json() for w in meta.workloads], "meta.workloads"),
            "regimes_json": codec.dumps([str(r) for r in meta.regimes], "meta.regimes"),
            "started_at": started,
            "status": SessionStatus.RUNNING.value,
            "max_sm_clock_hz": meta.max_sm_clock_hz,
            "power_limit_w": meta.power_limit_w,
            "sm_clock_at_start_hz": meta.sm_clock_at_start_hz,
            "temp_at_start_c": meta.temp_at_start_c,
            "power_at_start_w": meta.power_at_start_w,
            "extra_json": codec.dumps(meta.extra, "meta.extra"),
            "owner_pid": os.getpid(),
        }
        with self._tx.write("start a session") as conn:
            cur = conn.execute(session_sql.INSERT, [row[c] for c in columns.SESSION_COLUMNS])
            return int(cur.fetchone()["id"])

    def set_session_versions(self, session_id: int, versions: Versions) -> None:
        """Replace a running session's versions (the worker reports torch/Triton/cuDNN)."""
        if not isinstance(versions, Versions):
            raise StoreError(f"versions must be Versions, got {type(versions).__name__}")
        with self._tx.write("set session versions") as conn:
            session_sql.require_running(conn, session_id, "set its versions")
            conn.execute(
                session_sql.SET_VERSIONS,
                (versions.key(), *columns.version_values(versions).values(), session_id),
            )

    def finish_session(
        self,
        session_id: int,
        status: SessionStatus,
        why: str | None = None,
        *,
        ended_at: float | None = None,
    ) -> None:
        """End a running session. A completed one's results become the winners, atomically.

        Each result becomes its host's own winner, and the fleet's unless another host's
        fresh fleet winner disagrees beyond noise (then the disagreement is recorded; see
        :mod:`gpuwatchd.store.commit`). A winner is replaced only by a result measured at
        the same time or later, so finishing an older session late does not overwrite a
        newer pick.
        """
        if not isinstance(status, SessionStatus) or status is SessionStatus.RUNNING:
            raise StoreError(
                f"status must be one of {[s.value for s in FINAL_STATUSES]}, got {status!r}"
            )
        if why is not None and not isinstance(why, str):
            raise StoreError(f"why must be a string or None, got {why!r}")
        if ended_at is not None:
            codec.check_number(ended_at, "ended_at")
        end = ended_at if ended_at is not None else self._now()
        with self._tx.write("finish a session") as conn:
            gpu_uuid = session_sql.require_running(conn, session_id, "finish it")
            session_sql.end(conn, [(session_id, gpu_uuid)], status, why, end)
            found = []
            if status is SessionStatus.COMPLETED:
                found = self._commit_winners(conn, session_id)
        for f in found:
            log_found(self.where, f)

    def abandon_running(self, why: str = ABANDONED_WHY, *, alive: Alive = pid_alive) -> int:
        """Mark failed every running session whose process is gone (killed, crashed).

        Call when a process starts tuning with this store (the daemon, ``gpuwatchd
        tune``), before it starts a session of its own: sessions another live process
        is running are left alone (see :mod:`gpuwatchd.store.owner`), and so, on a
        shared store, are other hosts' sessions. They count in
        :meth:`session_totals` as failed. Returns how many were marked, with a WARNING.
        """
        codec.check_text(why, "why")
        # On a store shared by hosts only this host's sessions have PIDs it can ask about.
        where, args = ("AND host = ?", (host_name(),)) if self._engine.shared else ("", ())
        with self._tx.write("abandon running sessions") as conn:
            rows = session_sql.running(conn, where, args)
            ended = [(sid, gpu) for sid, gpu, pid in rows if orphaned(_pid(pid), alive)]
            session_sql.end(conn, ended, SessionStatus.FAILED, why, self._now())
        gone = [sid for sid, _ in ended]
        if gone:
            shown = ", ".join(map(str, gone[:10])) + (", ..." if len(gone) > 10 else "")
            log.warning(
                "store %s: %d session(s) left running by a process that is gone marked failed (%s)",
                self.where,
                len(gone),
                shown,
            )
        return len(gone)

    def session(self, session_id: int) -> SessionRow | None:
        """One session, or None if it does not exist (or cannot be parsed)."""
        with self._tx.read("read a session") as conn:
            row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return None if row is None else self._parse_session(row)

    def sessions(
        self,
        limit: int = 50,
        status: SessionStatus | None = None,
        gpu_uuid: str | None = None,
    ) -> list[SessionRow]:
        """The most recent sessions first, optionally of one status or one GPU."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise StoreError(f"limit must be a positive integer, got {limit!r}")
        where, args = filters(status=enum_value(status), gpu_uuid=gpu_uuid)
        with self._tx.read("list sessions") as conn:
            rows = conn.execute(
                f"SELECT * FROM sessions {where} ORDER BY started_at DESC, id DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [s for s in map(self._parse_session, rows) if s is not None]

    def _parse_session(self, row: Any) -> SessionRow | None:
        try:
            return codec.session_from_row(row)
        except (ValueError, TypeError) as e:
            self._tx.skip("sessions", row["id"], e)
            return None

    def session_totals(self) -> dict[SessionStatus, int]:
        """Finished sessions per final status since the store was created (every
        host's, counted per GPU: :mod:`gpuwatchd.store.session_sql`); the counts survive
        restarts and :meth:`prune`."""
        with self._tx.read("count sessions") as conn:
            return session_sql.totals(conn, FINAL_STATUSES, self._tx.skip)

    def running_count(self) -> int:
        """Sessions currently marked running."""
        with self._tx.read("count running sessions") as conn:
            row = conn.execute(
                "SELECT COUNT(*) AS n FROM sessions WHERE status = ?",
                (SessionStatus.RUNNING.value,),
            ).fetchone()
        return int(row["n"])

    def last_completed_at(self, gpu_uuid: str | None = None) -> float | None:
        """When the most recent completed session ended (unix seconds), or None."""
        where, args = filters(status=SessionStatus.COMPLETED.value, gpu_uuid=gpu_uuid)
        with self._tx.read("read the last completed session") as conn:
            row = conn.execute(
                f"SELECT MAX(ended_at) AS ended_at FROM sessions {where}", args
            ).fetchone()
        value = row["ended_at"]
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    # -- results ---------------------------------------------------------------------------

    def record_result(self, session_id: int, result: RegimeResult) -> None:
        """Store one regime's outcome and its candidates' statistics for a running session.

        Recording the same (workload, regime) again in one session replaces it.
        Winners are updated when the session finishes completed.
        """
        codec.check_result(result)
        with self._tx.write("record a result") as conn:
            session_sql.require_running(conn, session_id, "record a result")
            insert_result(conn, session_id, result, self._now())

    def session_results(self, session_ids: Sequence[int]) -> dict[int, list[StoredResult]]:
        """Every result of each session, in the order recorded: one read for them all."""
        ids = sorted({int(i) for i in session_ids})
        out: dict[int, list[StoredResult]] = {i: [] for i in ids}
        with self._tx.read("read results") as conn:
            rows: list[Any] = []
            for chunk in chunks(ids):
                marks = ", ".join("?" for _ in chunk)
                rows += conn.execute(
                    f"{RESULT_SELECT} WHERE r.session_id IN ({marks}) ORDER BY r.id", chunk
                ).fetchall()
            for stored in load_results(conn, rows, self._tx.skip):
                out[stored.session_id].append(stored)
        return out

    def results(self, session_id: int) -> list[StoredResult]:
        """Every result of one session, in the order recorded."""
        with self._tx.read("read results") as conn:
            rows = conn.execute(
                f"{RESULT_SELECT} WHERE r.session_id = ? ORDER BY r.id", (session_id,)
            ).fetchall()
            return load_results(conn, rows, self._tx.skip)

    def latest_results(
        self,
        gpu_model: str | None = None,
        workload: str | None = None,
        regime: Regime | None = None,
        statuses: Sequence[SessionStatus] = (SessionStatus.COMPLETED,),
    ) -> list[StoredResult]:
        """Per (GPU model, workload, regime) the most recent result of a session in ``statuses``.

        Ordered by GPU model, workload, regime: what ``gpuwatchd report`` prints.
        """
        if not statuses:
            raise StoreError("statuses must name at least one session status")
        where, args = filters(
            **{"s.gpu_model": gpu_model, "r.workload": workload, "r.regime": enum_value(regime)}
        )
        marks = ", ".join("?" for _ in statuses)
        where = f"{where} {'AND' if where else 'WHERE'} s.status IN ({marks})"
        args = (*args, *(enum_value(s) for s in statuses))
        with self._tx.read("read the latest results") as conn:
            rows = conn.execute(result_sql.latest(where), args).fetchall()
            return load_results(conn, rows, self._tx.skip)

    # -- resuming a preempted session ------------------------------------------------------

    def resumable_results(
        self,
        gpu_uuid: str,
        pairs: Sequence[tuple[str, Regime]],
        *,
        since: float,
        versions: Versions | None = None,
    ) -> dict[tuple[str, Regime], StoredResult]:
        """What preempted sessions on this GPU already finished, to resume instead of redo.

        Per (workload, regime) pair, the newest result recorded at or after ``since`` by
        a preempted session on ``gpu_uuid`` (with these versions, when given). Pairs
        with no such result are absent.
        """
        codec.check_text(gpu_uuid, "gpu_uuid")
        need_number(since, "since", error=StoreError)
        wanted = checked_pairs(pairs)
        if versions is not None and not isinstance(versions, Versions):
            raise StoreError(f"versions must be Versions, got {type(versions).__name__}")
        if not wanted:
            return {}
        where, args = filters(
            **{
                "s.gpu_uuid": gpu_uuid,
                "s.status": SessionStatus.PREEMPTED.value,
                "s.versions_json": versions.key() if versions is not None else None,
            }
        )
        names = sorted({w for w, _ in wanted})
        with self._tx.read("read resumable results") as conn:
            rows = conn.execute(
                result_sql.resumable(where, len(names)), (*args, since, *names)
            ).fetchall()
            found = load_results(conn, rows, self._tx.skip)
        return {
            key: stored
            for stored in found
            if (key := (stored.result.workload, stored.result.regime)) in wanted
        }

    def carry_results(self, to_session_id: int, results: Sequence[StoredResult]) -> int:
        """Copy earlier results (their candidates too) into a running session, at once.

        Each keeps its original ``recorded_at``, so its age still counts from when it was
        measured. All must come from the session's own GPU. Returns how many were copied.
        """
        items = list(results)
        seen: set[tuple[str, Regime]] = set()
        for i, stored in enumerate(items):
            codec.check_stored(stored, f"results[{i}]")
            key = (stored.result.workload, stored.result.regime)
            if key in seen:
                raise StoreError(f"results[{i}]: {key[0]}/{key[1].value} appears twice")
            seen.add(key)
        with self._tx.write("carry results into a session") as conn:
            session_sql.require_running(conn, to_session_id, "carry results into it")
            row = conn.execute(
                "SELECT gpu_uuid FROM sessions WHERE id = ?", (to_session_id,)
            ).fetchone()
            for i, stored in enumerate(items):
                if stored.gpu_uuid != row["gpu_uuid"]:
                    raise StoreError(
                        f"results[{i}].gpu_uuid: measured on {stored.gpu_uuid}, but session"
                        f" {to_session_id} runs on {row['gpu_uuid']}"
                    )
                insert_result(conn, to_session_id, stored.result, stored.recorded_at)
        return len(items)

    # -- winners ---------------------------------------------------------------------------

    def _commit_winners(self, conn: Conn, session_id: int) -> list[Found]:
        host = conn.execute("SELECT host FROM sessions WHERE id = ?", (session_id,)).fetchone()
        rows = conn.execute(f"{RESULT_SELECT} WHERE r.session_id = ?", (session_id,)).fetchall()
        results = parse_results(conn, rows, self._tx.skip)
        # Hosts committing the same keys take turns (the incumbent read, then written).
        groups = {(r.gpu_model, r.versions.key()) for _, r in results}
        self._engine.lock_winners(conn, sorted(groups))
        return commit_winners(
            conn, str(host["host"]), results, self._now(), self._tx.skip, self.keep_incumbent_for_s
        )

    def winners(
        self,
        gpu_model: str | None = None,
        workload: str | None = None,
        regime: Regime | None = None,
        versions: Versions | None = None,
        *,
        latest: bool = False,
        prefer_host: str | None = None,
    ) -> list[WinnerRow]:
        """The fleet's winner rows, ordered by GPU model, workload, regime, newest first.

        ``latest=True`` keeps only the newest row per (GPU model, workload, regime),
        whatever its versions: the pick for the stack that was tuned last.
        ``prefer_host`` takes, per key, that host's own winner where it has one and the
        fleet's otherwise: a host with no local winners uses the fleet's.
        """
        source: str = FLEET
        source_args: tuple[str, ...] = ()
        if prefer_host is not None:
            codec.check_text(prefer_host, "prefer_host")
            source, source_args = PREFERRING_HOST, (prefer_host, prefer_host)
        where, args = filters(
            gpu_model=gpu_model,
            workload=workload,
            regime=enum_value(regime),
            versions_key=versions.key() if versions is not None else None,
        )
        with self._tx.read("read winners") as conn:
            rows = conn.execute(
                newest_first(source, where, latest=latest), (*source_args, *args)
            ).fetchall()
        return self._winners(rows)

    def winners_differ(self, workload: str, gpu_model: str | None = None) -> bool | None:
        """Whether the unthrottled and sustained winners are different kernels.

        Judged on the most recently tuned (GPU model, versions) of the workload. True
        only when both regimes have a clear winner and they differ; False when they
        are the same or either regime is a tie (no evidence they differ); None when
        a regime has no winner yet.
        """
        rows = self.winners(gpu_model=gpu_model, workload=workload)
        if not rows:
            return None
        newest = max(rows, key=lambda r: r.measured_at)
        same_stack = {
            r.regime: r
            for r in rows
            if r.gpu_model == newest.gpu_model and r.versions == newest.versions
        }
        cool = same_stack.get(Regime.UNTHROTTLED)
        hot = same_stack.get(Regime.SUSTAINED)
        if cool is None or hot is None:
            return None
        return winners_differ(
            clear_winner(cool.candidate, cool.tie), clear_winner(hot.candidate, hot.tie)
        )

    # -- the fleet's winners --------------------------------------------------------------

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
        with self._tx.read("read fleet winners") as conn:
            rows = conn.execute(f"{sql} ORDER BY workload, regime, measured_at DESC", args)
            return self._winners(rows.fetchall())

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
        with self._tx.write("claim work") as conn:
            return claim_sql.take(conn, key, host, gpu_uuid, os.getpid(), self._now(), ttl_s)

    def release(self, key: str, host: str, gpu_uuid: str) -> None:
        """Give a lease back before it expires; only the holder's own claim is removed."""
        for name, value in (("key", key), ("host", host), ("gpu_uuid", gpu_uuid)):
            codec.check_text(value, name)
        with self._tx.write("release a claim") as conn:
            claim_sql.release(conn, key, host, gpu_uuid)

    def claim_host(self, host: str, me: Holder, ttl_s: float) -> HostLease:
        """Hold the name ``host`` for ``me`` for ``ttl_s`` seconds (a lease like a work
        claim, renewed the same way), even while other writes are refused: whether it
        is held now, else who holds it (:func:`~gpuwatchd.store.owner.take_host`)."""
        for name, value in (("host", host), ("machine", me.machine)):
            codec.check_text(value, name)
        need_number(ttl_s, "ttl_s", minimum=0, error=StoreError)
        key = HOST_CLAIM_PREFIX + host
        with self._tx.write("claim the host name", lease=True) as conn:
            boot = self._tx.schema is not None and self._tx.schema.own >= LEASE_HOLDER_VERSION
            return take_host(conn, key, host, me, self._now(), ttl_s, names_boot=boot)

    def release_host(self, host: str, machine: str) -> None:
        """Give the name back (a clean stop): another machine may take it at once."""
        self.release(HOST_CLAIM_PREFIX + host, host, machine)

    def claim_holder(self, key: str) -> Claim | None:
        """Who holds the lease on ``key`` now, or None when it is free (or expired)."""
        codec.check_text(key, "key")
        with self._tx.read("read a claim") as conn:
            rows = claim_sql.live(conn, self._now(), key)
        found = self._parsed("claims", rows, codec.claim_from_row, lambda row: row["claim_key"])
        return found[0] if found else None

    def claims(self) -> list[Claim]:
        """The leases not yet expired, by key."""
        with self._tx.read("read claims") as conn:
            rows = claim_sql.live(conn, self._now())
        return self._parsed("claims", rows, codec.claim_from_row, lambda row: row["claim_key"])

    # -- disagreements ---------------------------------------------------------------------

    def disagreements(self, limit: int = 100) -> list[Disagreement]:
        """Recorded disagreements between hosts, newest first."""
        need_int(limit, "limit", minimum=1, error=StoreError)
        with self._tx.read("read disagreements") as conn:
            rows = conn.execute(
                "SELECT * FROM disagreements ORDER BY recorded_at DESC, id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return self._parsed(
            "disagreements", rows, codec.disagreement_from_row, lambda row: row["id"]
        )

    def disagreement_counts(
        self, since: float | None = None, *, gpu_models: Sequence[str] | None = None
    ) -> dict[tuple[str, str, str], int]:
        """Disagreements per (GPU model, workload, regime): every one kept (the counts
        kept beside them: one row per key), or only those recorded at or after ``since``
        (unix seconds, the store's clock); only those of ``gpu_models`` when given (a
        host's own: its sync costs the same in any fleet)."""
        where, models = models_clause(gpu_models)
        args: tuple[object, ...] = models
        table, count = "disagreement_totals", "SUM(n)"
        if since is not None:
            need_number(since, "since", error=StoreError)
            where, args = f"{where} AND recorded_at >= ?", (*args, since)
            table, count = "disagreements", "COUNT(*)"
        with self._tx.read("count disagreements") as conn:
            rows = conn.execute(
                f"""SELECT gpu_model, workload, regime, CAST({count} AS BIGINT) AS n
                    FROM {table} WHERE 1 = 1 {where}
                    GROUP BY gpu_model, workload, regime ORDER BY gpu_model, workload, regime""",
                args,
            ).fetchall()
        return {(r["gpu_model"], r["workload"], r["regime"]): int(r["n"]) for r in rows}

    # -- host clocks -----------------------------------------------------------------------

    def report_host_clock(self, clock: HostClock) -> None:
        """Record a GPU's learned sustained clock; an older report never replaces a newer one."""
        codec.check_host_clock(clock)
        with self._tx.write("report a host clock") as conn:
            clocks.report(conn, clock)

    def clock_medians(
        self,
        max_age_s: float,
        *,
        gpu_models: Sequence[str] | None = None,
        kept_for_s: float | None = None,
    ) -> list[ClockMedian]:
        """Per group of GPUs (model, whole watts; only ``gpu_models``' when given) the
        median of the clocks reported in the last ``max_age_s`` and how many there are:
        one row per group, computed by the database where it can (PostgreSQL), so a host
        never reads every host's clocks. ``kept_for_s`` (a fleet's sync) reads the medians
        the fleet keeps, recomputed by one host once they are that old
        (:func:`~gpuwatchd.store.clocks.kept_medians`), instead of computing them."""
        need_number(max_age_s, "max_age_s", minimum=0, error=StoreError)
        models = None if gpu_models is None else sorted(set(checked_models(gpu_models)))
        median = self._engine.median_sql("sustained_clock_hz")
        if median is None:  # SQLite: one host's own clocks, medians in Python
            found = clocks.medians_in_python(self.host_clocks(max_age_s=max_age_s))
            return [m for m in found if models is None or m.gpu_model in models]
        if kept_for_s is not None and models is not None and self.writable:
            need_number(kept_for_s, "kept_for_s", minimum=0, error=StoreError)
            with self._tx.write("read the fleet's kept clock medians") as conn:
                now = self._now()
                return clocks.kept_medians(conn, now, now - max_age_s, median, models, kept_for_s)
        with self._tx.read("read the fleet's clock medians") as conn:
            return clocks.medians_in_sql(conn, self._now() - max_age_s, median, models)

    def prune_clocks(self, older_than_s: float) -> int:
        """Delete GPUs' clocks not reported for ``older_than_s`` (their hosts left the
        fleet). Returns how many."""
        need_number(older_than_s, "older_than_s", minimum=0, error=StoreError)
        with self._tx.write("prune old host clocks") as conn:
            return clocks.prune(conn, self._now() - older_than_s)

    def host_clocks(self, max_age_s: float | None = None) -> list[HostClock]:
        """Every GPU's reported clock (only those reported in the last ``max_age_s``).

        Ordered by GPU model, host, GPU UUID.
        """
        if max_age_s is not None:
            need_number(max_age_s, "max_age_s", minimum=0, error=StoreError)
        since = None if max_age_s is None else self._now() - max_age_s
        with self._tx.read("read host clocks") as conn:
            found = clocks.rows(conn, since)
        return self._parsed(
            "host_clocks",
            found,
            codec.host_clock_from_row,
            lambda row: (row["host"], row["gpu_uuid"]),
        )

    # -- retention -------------------------------------------------------------------------

    def prune(self, older_than_s: float, *, batch: int = PRUNE_BATCH) -> int:
        """Delete finished sessions (with their results and statistics) older than this,
        ``batch`` at a time (:meth:`prune_batch`), then :meth:`prune_rest`. Returns how
        many sessions were deleted."""
        pruned = 0
        while (n := self.prune_batch(older_than_s, batch)) == batch:
            pruned += n
        self.prune_rest(older_than_s)
        return pruned + n

    def prune_batch(self, older_than_s: float, limit: int = PRUNE_BATCH) -> int:
        """Delete up to ``limit`` finished sessions older than ``older_than_s``, in one
        transaction of bounded size (:mod:`gpuwatchd.store.prune_sql`).

        Never deletes a session a winner (the fleet's or a host's) points at, nor the
        latest completed session of each GPU; session totals are kept. Returns how many
        were deleted: fewer than ``limit`` when no more may go.
        """
        codec.check_number(older_than_s, "older_than_s")
        need_int(limit, "limit", minimum=1, error=StoreError)
        with self._tx.write("prune old sessions") as conn:
            return prune_sql.delete_batch(conn, self._now() - older_than_s, limit)

    def prune_rest(self, older_than_s: float) -> None:
        """Delete expired claims, and disagreements older than this or
        :data:`DISAGREEMENT_RETENTION_S`, whichever is shorter."""
        codec.check_number(older_than_s, "older_than_s")
        with self._tx.write("prune old claims and disagreements") as conn:
            now = self._now()
            claim_sql.drop_expired(conn, now)
            prune_sql.drop_disagreements(conn, now - min(older_than_s, DISAGREEMENT_RETENTION_S))

    def sweep_stale_running(self, older_than_s: float, why: str = STALE_WHY) -> int:
        """Mark failed the sessions still running that started over ``older_than_s`` ago
        on a host that holds no live lease on its name (its daemon never came back to
        end them); they count in :meth:`session_totals`. Returns how many."""
        need_number(older_than_s, "older_than_s", minimum=0, error=StoreError)
        codec.check_text(why, "why")
        with self._tx.write("end stale running sessions") as conn:
            now = self._now()
            stale = prune_sql.stale_running(conn, now - older_than_s, now)
            n = session_sql.end(conn, stale, SessionStatus.FAILED, why, now)
        if n:
            log.warning("store %s: %d session(s) left running over %g h by a host that is"
                        " gone marked failed", self.where, n, older_than_s / 3600)  # fmt: skip
        return n


def _pid(value: object) -> int | None:
    """A stored owner PID; anything but a positive integer is no owner to ask."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None
