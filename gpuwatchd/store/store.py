"""The tuning store's logic: sessions, per-candidate statistics, results and winners.

Written once for every back end (:mod:`gpuwatchd.store.sqlite`, the embedded default,
and :mod:`gpuwatchd.store.postgres`, the fleet's shared store); an
:class:`~gpuwatchd.store.engine.Engine` supplies what differs. Thread-safe: each call
borrows a connection from a small pool, so the scheduler thread can write while HTTP
threads read. Every write is one transaction; a failure mid-write rolls back and loses
nothing already stored. Reads skip rows they cannot parse, with a warning.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

from gpuwatchd.store import codec
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.engine import Engine
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.owner import Alive, orphaned, pid_alive
from gpuwatchd.store.rows import SessionMeta, SessionRow, StoredResult, WinnerRow
from gpuwatchd.store.schema import MIGRATIONS, Migration, check_migrations, latest_version
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions
from gpuwatchd.tuning.winners import clear_winner, pick_winner, winners_differ

log = logging.getLogger("gpuwatchd.store")

#: Statuses a session can end in; ``gpuwatchd_tune_sessions_total`` has one series each.
FINAL_STATUSES = tuple(s for s in SessionStatus if s is not SessionStatus.RUNNING)

_VERSION_COLUMNS = ("driver", "cuda", "torch", "triton", "cudnn")

#: Why :meth:`SqlStore.abandon_running` fails a session whose process is gone.
ABANDONED_WHY = "abandoned: the process running it ended without finishing it"


class SqlStore:
    """The store over one engine. ``readonly=True`` (the client API, ``gpuwatchd report``)
    needs the database at the current schema version and never creates or migrates it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        readonly: bool = False,
        migrations: Sequence[Migration] = MIGRATIONS,
        now: Callable[[], float] = time.time,
        keep_connections: int = 4,
    ) -> None:
        self.readonly = readonly
        self._engine = engine
        self._migrations = tuple(migrations)
        self._now = now
        self._keep = keep_connections
        self._lock = threading.Lock()
        self._idle: list[Conn] = []
        self._closed = False
        self._warned: set[str] = set()
        check_migrations(self._migrations)
        self._idle.append(engine.open(self._migrations, readonly=readonly))

    @property
    def where(self) -> str:
        """The store as messages name it: a file's path, or a URL without its password."""
        return self._engine.where

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections; ones in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- connections and transactions ------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Conn]:
        with self._lock:
            if self._closed:
                raise StoreError(f"store {self.where} is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._engine.connect(readonly=self.readonly)
        broken = False
        try:
            yield conn
        except self._engine.error:
            broken = True
            raise
        finally:
            with self._lock:
                keep = not broken and not self._closed and len(self._idle) < self._keep
                if keep:
                    self._idle.append(conn)
            if not keep:
                with suppress(Exception):
                    conn.close()

    @contextmanager
    def _transaction(self, write: bool, what: str) -> Iterator[Conn]:
        engine = self._engine
        try:
            with self._connection() as conn:
                try:
                    engine.begin(conn, write=write)
                    if write:
                        self._refuse_newer_schema(conn, what)
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with suppress(engine.error):
                            conn.execute("ROLLBACK")
                    raise
        except engine.error as e:
            raise engine.fail(what, e) from e

    def _refuse_newer_schema(self, conn: Conn, what: str) -> None:
        """A newer gpuwatchd migrated the database since it was opened: stop writing."""
        version = self._engine.version(conn)
        latest = latest_version(self._migrations)
        if version > latest:
            raise StoreError(
                f"store {self.where} has schema version {version}, newer than this gpuwatchd"
                f" knows ({latest}); this host refuses to {what} until gpuwatchd is upgraded"
            )

    def _write(self, what: str) -> AbstractContextManager[Conn]:
        """A write transaction, serialised with every other writer (no upgrade deadlocks)."""
        if self.readonly:
            raise StoreError(f"store {self.where} is open read-only; cannot {what}")
        return self._transaction(True, what)

    def _read(self, what: str) -> AbstractContextManager[Conn]:
        """A read transaction: every query inside sees one snapshot."""
        return self._transaction(False, what)

    def _skip(self, table: str, key: object, err: Exception) -> None:
        """Warn (once per row and problem) about a stored row that cannot be parsed."""
        msg = f"{table} row {key}: {err}"
        with self._lock:
            if msg in self._warned:
                return
            self._warned.add(msg)
        log.warning("store %s: skipping unreadable %s", self.where, msg)

    def schema_version(self) -> int:
        with self._read("read the schema version") as conn:
            return self._engine.version(conn)

    # -- sessions --------------------------------------------------------------------------

    def start_session(self, meta: SessionMeta) -> int:
        """Record a session as running; returns its id."""
        codec.check_meta(meta)
        started = meta.started_at if meta.started_at is not None else self._now()
        v = meta.versions
        with self._write("start a session") as conn:
            cur = conn.execute(
                """INSERT INTO sessions (gpu_uuid, gpu_index, gpu_model, host, backend,
                       versions_json, driver_version, cuda_version, torch_version,
                       triton_version, cudnn_version, workloads_json, regimes_json,
                       started_at, status, max_sm_clock_hz, power_limit_w,
                       sm_clock_at_start_hz, temp_at_start_c, power_at_start_w, extra_json,
                       owner_pid)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   RETURNING id""",
                (
                    meta.gpu_uuid,
                    meta.gpu_index,
                    meta.gpu_model,
                    meta.host,
                    meta.backend,
                    v.key(),
                    *(getattr(v, c) for c in _VERSION_COLUMNS),
                    codec.dumps([w.to_json() for w in meta.workloads], "meta.workloads"),
                    codec.dumps([str(r) for r in meta.regimes], "meta.regimes"),
                    started,
                    SessionStatus.RUNNING.value,
                    meta.max_sm_clock_hz,
                    meta.power_limit_w,
                    meta.sm_clock_at_start_hz,
                    meta.temp_at_start_c,
                    meta.power_at_start_w,
                    codec.dumps(meta.extra, "meta.extra"),
                    os.getpid(),
                ),
            )
            return int(cur.fetchone()[0])

    def set_session_versions(self, session_id: int, versions: Versions) -> None:
        """Replace a running session's versions (the worker reports torch/Triton/cuDNN)."""
        if not isinstance(versions, Versions):
            raise StoreError(f"versions must be Versions, got {type(versions).__name__}")
        with self._write("set session versions") as conn:
            self._require_running(conn, session_id, "set its versions")
            conn.execute(
                """UPDATE sessions SET versions_json = ?, driver_version = ?, cuda_version = ?,
                       torch_version = ?, triton_version = ?, cudnn_version = ?
                   WHERE id = ?""",
                (versions.key(), *(getattr(versions, c) for c in _VERSION_COLUMNS), session_id),
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

        A winner is replaced only by a result measured at the same time or later, so
        finishing an older session late does not overwrite a newer pick.
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
        with self._write("finish a session") as conn:
            self._require_running(conn, session_id, "finish it")
            conn.execute(
                "UPDATE sessions SET status = ?, why = ?, ended_at = ? WHERE id = ?",
                (status.value, why, end, session_id),
            )
            _bump_total(conn, status)
            if status is SessionStatus.COMPLETED:
                self._commit_winners(conn, session_id)

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
        where, args = _filters(
            status=SessionStatus.RUNNING.value,
            host=socket.gethostname() if self._engine.shared else None,
        )
        with self._write("abandon running sessions") as conn:
            rows = conn.execute(f"SELECT id, owner_pid FROM sessions {where}", args).fetchall()
            gone = [int(r["id"]) for r in rows if orphaned(_pid(r["owner_pid"]), alive)]
            now = self._now()
            conn.executemany(
                "UPDATE sessions SET status = ?, why = ?, ended_at = ? WHERE id = ?",
                [(SessionStatus.FAILED.value, why, now, sid) for sid in gone],
            )
            if gone:
                _bump_total(conn, SessionStatus.FAILED, len(gone))
        if gone:
            shown = ", ".join(map(str, gone[:10])) + (", ..." if len(gone) > 10 else "")
            log.warning(
                "store %s: %d session(s) left running by a process that is gone marked failed (%s)",
                self.where,
                len(gone),
                shown,
            )
        return len(gone)

    def _require_running(self, conn: Conn, session_id: int, what: str) -> None:
        if isinstance(session_id, bool) or not isinstance(session_id, int):
            raise StoreError(f"session_id must be an integer, got {session_id!r}")
        row = conn.execute("SELECT status FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise StoreError(f"session {session_id} does not exist")
        if row["status"] != SessionStatus.RUNNING.value:
            raise StoreError(f"session {session_id} is {row['status']}, not running; cannot {what}")

    def session(self, session_id: int) -> SessionRow | None:
        """One session, or None if it does not exist (or cannot be parsed)."""
        with self._read("read a session") as conn:
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
        where, args = _filters(status=_value(status), gpu_uuid=gpu_uuid)
        with self._read("list sessions") as conn:
            rows = conn.execute(
                f"SELECT * FROM sessions {where} ORDER BY started_at DESC, id DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [s for s in map(self._parse_session, rows) if s is not None]

    def _parse_session(self, row: Any) -> SessionRow | None:
        try:
            return codec.session_from_row(row)
        except (ValueError, TypeError) as e:
            self._skip("sessions", row["id"], e)
            return None

    def session_totals(self) -> dict[SessionStatus, int]:
        """Finished sessions per final status since the store was created.

        Kept in its own table so the count survives restarts and :meth:`prune`.
        """
        totals: dict[SessionStatus, int] = dict.fromkeys(FINAL_STATUSES, 0)
        with self._read("count sessions") as conn:
            rows = conn.execute("SELECT status, n FROM session_totals").fetchall()
        for row in rows:
            try:
                status = SessionStatus(row["status"])
                n = row["n"]
                if status is SessionStatus.RUNNING or not isinstance(n, int) or n < 0:
                    raise ValueError(f"bad count {n!r}")
            except ValueError as e:
                self._skip("session_totals", row["status"], e)
                continue
            totals[status] = n
        return totals

    def running_count(self) -> int:
        """Sessions currently marked running."""
        with self._read("count running sessions") as conn:
            row = conn.execute(
                "SELECT COUNT(*) FROM sessions WHERE status = ?", (SessionStatus.RUNNING.value,)
            ).fetchone()
        return int(row[0])

    def last_completed_at(self, gpu_uuid: str | None = None) -> float | None:
        """When the most recent completed session ended (unix seconds), or None."""
        where, args = _filters(status=SessionStatus.COMPLETED.value, gpu_uuid=gpu_uuid)
        with self._read("read the last completed session") as conn:
            row = conn.execute(f"SELECT MAX(ended_at) FROM sessions {where}", args).fetchone()
        value = row[0]
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    # -- results ---------------------------------------------------------------------------

    def record_result(self, session_id: int, result: RegimeResult) -> None:
        """Store one regime's outcome and its candidates' statistics for a running session.

        Recording the same (workload, regime) again in one session replaces it.
        Winners are updated when the session finishes completed.
        """
        codec.check_result(result)
        with self._write("record a result") as conn:
            self._require_running(conn, session_id, "record a result")
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
                    self._now(),
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

    def results(self, session_id: int) -> list[StoredResult]:
        """Every result of one session, in the order recorded."""
        with self._read("read results") as conn:
            rows = conn.execute(
                f"{_RESULT_SELECT} WHERE r.session_id = ? ORDER BY r.id", (session_id,)
            ).fetchall()
            return self._load_results(conn, rows)

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
        where, args = _filters(
            **{"s.gpu_model": gpu_model, "r.workload": workload, "r.regime": _value(regime)}
        )
        marks = ", ".join("?" for _ in statuses)
        where = f"{where} {'AND' if where else 'WHERE'} s.status IN ({marks})"
        args = (*args, *(_value(s) for s in statuses))
        with self._read("read the latest results") as conn:
            rows = conn.execute(
                f"""SELECT * FROM (
                        SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json,
                            ROW_NUMBER() OVER (
                                PARTITION BY s.gpu_model, r.workload, r.regime
                                ORDER BY r.recorded_at DESC, r.id DESC) AS rn
                        FROM results r JOIN sessions s ON s.id = r.session_id {where}) AS latest
                    WHERE rn = 1 ORDER BY gpu_model, workload, regime""",
                args,
            ).fetchall()
            return self._load_results(conn, rows)

    def _load_results(self, conn: Conn, rows: list[Any]) -> list[StoredResult]:
        return [stored for _, stored in self._parse_results(conn, rows)]

    def _parse_results(self, conn: Conn, rows: list[Any]) -> list[tuple[int, StoredResult]]:
        """Results with their candidates and row ids; unparsable rows skipped with a warning."""
        out: list[tuple[int, StoredResult]] = []
        for row in rows:
            try:
                regime = codec.result_regime(row)
            except ValueError as e:
                self._skip("results", row["id"], e)
                continue
            candidates = []
            for c in conn.execute(
                "SELECT * FROM candidate_stats WHERE result_id = ? ORDER BY id", (row["id"],)
            ):
                try:
                    candidates.append(codec.candidate_from_row(c, regime))
                except (ValueError, TypeError) as e:
                    self._skip("candidate_stats", c["id"], e)
            try:
                out.append((int(row["id"]), codec.result_from_rows(row, tuple(candidates))))
            except (ValueError, TypeError) as e:
                self._skip("results", row["id"], e)
        return out

    # -- winners ---------------------------------------------------------------------------

    def _commit_winners(self, conn: Conn, session_id: int) -> None:
        rows = conn.execute(f"{_RESULT_SELECT} WHERE r.session_id = ?", (session_id,)).fetchall()
        for result_id, stored in self._parse_results(conn, rows):
            res = stored.result
            pick = pick_winner(res)
            if pick is None:
                continue
            v = stored.versions
            conn.execute(
                """INSERT INTO winners (gpu_model, versions_key, driver_version, cuda_version,
                       torch_version, triton_version, cudnn_version, workload, regime,
                       candidate, family, median_s, sm_clock_hz, margin, tie, session_id,
                       result_id, gpu_uuid, measured_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (gpu_model, versions_key, workload, regime) DO UPDATE SET
                       candidate = excluded.candidate, family = excluded.family,
                       median_s = excluded.median_s, sm_clock_hz = excluded.sm_clock_hz,
                       margin = excluded.margin, tie = excluded.tie,
                       session_id = excluded.session_id, result_id = excluded.result_id,
                       gpu_uuid = excluded.gpu_uuid, measured_at = excluded.measured_at
                   WHERE excluded.measured_at >= winners.measured_at""",
                (
                    stored.gpu_model,
                    v.key(),
                    *(getattr(v, c) for c in _VERSION_COLUMNS),
                    res.workload,
                    res.regime.value,
                    pick.name,
                    pick.family,
                    pick.median_s,
                    pick.sm_clock_hz,
                    res.margin,
                    int(res.tie),
                    session_id,
                    result_id,
                    stored.gpu_uuid,
                    stored.recorded_at,
                ),
            )

    def winners(
        self,
        gpu_model: str | None = None,
        workload: str | None = None,
        regime: Regime | None = None,
        versions: Versions | None = None,
        *,
        latest: bool = False,
    ) -> list[WinnerRow]:
        """Winner rows, ordered by GPU model, workload, regime, newest first.

        ``latest=True`` keeps only the newest row per (GPU model, workload, regime),
        whatever its versions: the pick for the stack that was tuned last.
        """
        where, args = _filters(
            gpu_model=gpu_model,
            workload=workload,
            regime=_value(regime),
            versions_key=versions.key() if versions is not None else None,
        )
        with self._read("read winners") as conn:
            rows = conn.execute(
                f"""SELECT * FROM (
                        SELECT *, ROW_NUMBER() OVER (
                            PARTITION BY gpu_model, workload, regime
                            ORDER BY measured_at DESC, session_id DESC) AS rn
                        FROM winners {where}) AS picks
                    {"WHERE rn = 1" if latest else ""}
                    ORDER BY gpu_model, workload, regime, measured_at DESC""",
                args,
            ).fetchall()
        out = []
        for row in rows:
            try:
                out.append(codec.winner_from_row(row))
            except (ValueError, TypeError) as e:
                self._skip("winners", (row["gpu_model"], row["workload"], row["regime"]), e)
        return out

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

    # -- retention -------------------------------------------------------------------------

    def prune(self, older_than_s: float) -> int:
        """Delete finished sessions (with their results and statistics) older than this.

        Never deletes a session a winner points at, nor the latest completed session
        of each GPU; session totals are kept. Returns how many sessions were deleted.
        """
        codec.check_number(older_than_s, "older_than_s")
        cutoff = self._now() - older_than_s
        with self._write("prune old sessions") as conn:
            cur = conn.execute(
                """DELETE FROM sessions
                   WHERE status != ? AND COALESCE(ended_at, started_at) < ?
                     AND id NOT IN (SELECT session_id FROM winners)
                     AND id NOT IN (
                         SELECT id FROM (
                             SELECT id, ROW_NUMBER() OVER (
                                 PARTITION BY gpu_uuid ORDER BY ended_at DESC, id DESC) AS rn
                             FROM sessions WHERE status = ?) AS newest
                         WHERE rn = 1)""",
                (SessionStatus.RUNNING.value, cutoff, SessionStatus.COMPLETED.value),
            )
            return int(cur.rowcount)


_RESULT_SELECT = """SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json
    FROM results r JOIN sessions s ON s.id = r.session_id"""


def _bump_total(conn: Conn, status: SessionStatus, by: int = 1) -> None:
    conn.execute(
        """INSERT INTO session_totals (status, n) VALUES (?, ?)
           ON CONFLICT (status) DO UPDATE SET n = session_totals.n + excluded.n""",
        (status.value, by),
    )


def _pid(value: object) -> int | None:
    """A stored owner PID; anything but a positive integer is no owner to ask."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _value(v: Regime | SessionStatus | None) -> str | None:
    """An enum filter's stored text; anything but the enum is refused with a clear error."""
    if v is None:
        return None
    if not isinstance(v, Regime | SessionStatus):
        raise StoreError(f"expected a Regime or SessionStatus, got {v!r}")
    return v.value


def _filters(**columns: object) -> tuple[str, tuple[object, ...]]:
    """``WHERE a = ? AND b = ?`` for the columns whose value is not None."""
    used = {k: v for k, v in columns.items() if v is not None}
    if not used:
        return "", ()
    return "WHERE " + " AND ".join(f"{k} = ?" for k in used), tuple(used.values())
