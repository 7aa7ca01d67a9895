"""The tuning store's logic: sessions, per-candidate statistics, results and winners.

Written once for every back end (:mod:`gpuwatchd.store.sqlite`, the embedded default,
and :mod:`gpuwatchd.store.postgres`, the fleet's shared store); an
:class:`~gpuwatchd.store.engine.Engine` supplies what differs, and
:class:`~gpuwatchd.store.core.StoreCore` the connections and transactions. Every write
is one transaction; a failure mid-write rolls back and loses nothing already stored.
Reads skip rows they cannot parse, with a warning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from gpuwatchd.store import claims as claim_sql
from gpuwatchd.store import codec
from gpuwatchd.store.commit import Found, commit_winners
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.core import enum_value, filters, log
from gpuwatchd.store.disagreement import DEFAULT_KEEP_INCUMBENT_S
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.fleet import FleetStore
from gpuwatchd.store.owner import Alive, orphaned, pid_alive
from gpuwatchd.store.result_rows import insert_result
from gpuwatchd.store.rows import (
    SessionMeta,
    SessionRow,
    StoredResult,
    WinnerRow,
    host_name,
)
from gpuwatchd.store.winner_sql import FLEET, PREFERRING_HOST
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions
from gpuwatchd.tuning.winners import clear_winner, winners_differ
from gpuwatchd.validate import need_number

#: Statuses a session can end in; ``gpuwatchd_tune_sessions_total`` has one series each.
FINAL_STATUSES = tuple(s for s in SessionStatus if s is not SessionStatus.RUNNING)

_VERSION_COLUMNS = ("driver", "cuda", "torch", "triton", "cudnn")

#: Why :meth:`SqlStore.abandon_running` fails a session whose process is gone.
ABANDONED_WHY = "abandoned: the process running it ended without finishing it"
#: :meth:`SqlStore.prune` keeps disagreements at most this long (30 days): the fleet's
#: alert looks at the last day, and a person comparing hosts at the last few weeks.
DISAGREEMENT_RETENTION_S = 30 * 86400.0


class SqlStore(FleetStore):
    """The store over one engine. ``readonly=True`` (the client API, ``gpuwatchd report``)
    needs the database at the current schema version and never creates or migrates it.

    :attr:`keep_incumbent_for_s` is how long a fleet winner another host disputes stays
    the fleet's: the daemon sets it to ``[fleet] max_winner_age_s``.
    """

    _keep_incumbent_for_s: float = DEFAULT_KEEP_INCUMBENT_S

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
        with self._write("finish a session") as conn:
            self._require_running(conn, session_id, "finish it")
            conn.execute(
                "UPDATE sessions SET status = ?, why = ?, ended_at = ? WHERE id = ?",
                (status.value, why, end, session_id),
            )
            _bump_total(conn, status)
            found = []
            if status is SessionStatus.COMPLETED:
                found = self._commit_winners(conn, session_id)
        for f in found:
            d = f.disagreement
            log.warning(
                "store %s: host %s measured the fleet's %s winner for %s on %s (%s, from %s)"
                " %.1f%% slower than its own pick %s; %s, recorded the disagreement",
                self.where,
                d.new_host,
                d.regime.value,
                d.workload,
                d.gpu_model,
                d.kept_candidate,
                d.kept_host,
                100 * d.gap,
                d.new_candidate,
                "replaced the fleet's, older than the fleet's max winner age"
                if f.replaced
                else "kept the fleet's",
            )

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
        where, args = filters(
            status=SessionStatus.RUNNING.value,
            host=host_name() if self._engine.shared else None,
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
        where, args = filters(status=enum_value(status), gpu_uuid=gpu_uuid)
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
        where, args = filters(status=SessionStatus.COMPLETED.value, gpu_uuid=gpu_uuid)
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
            insert_result(conn, session_id, result, self._now())

    def session_results(self, session_ids: Sequence[int]) -> dict[int, list[StoredResult]]:
        """Every result of each session, in the order recorded: one read for them all."""
        ids = sorted({int(i) for i in session_ids})
        out: dict[int, list[StoredResult]] = {i: [] for i in ids}
        with self._read("read results") as conn:
            rows: list[Any] = []
            for chunk in _chunks(ids):
                marks = ", ".join("?" for _ in chunk)
                rows += conn.execute(
                    f"{_RESULT_SELECT} WHERE r.session_id IN ({marks}) ORDER BY r.id", chunk
                ).fetchall()
            for stored in self._load_results(conn, rows):
                out[stored.session_id].append(stored)
        return out

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
        where, args = filters(
            **{"s.gpu_model": gpu_model, "r.workload": workload, "r.regime": enum_value(regime)}
        )
        marks = ", ".join("?" for _ in statuses)
        where = f"{where} {'AND' if where else 'WHERE'} s.status IN ({marks})"
        args = (*args, *(enum_value(s) for s in statuses))
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
        """Results with their candidates and row ids; unparsable rows skipped with a warning.
        The candidates of all of them are read in one query per :data:`IN_CHUNK` results."""
        out: list[tuple[int, StoredResult]] = []
        by_result = _candidate_rows(conn, [row["id"] for row in rows])
        for row in rows:
            try:
                regime = codec.result_regime(row)
            except ValueError as e:
                self._skip("results", row["id"], e)
                continue
            candidates = []
            for c in by_result.get(row["id"], ()):
                try:
                    candidates.append(codec.candidate_from_row(c, regime))
                except (ValueError, TypeError) as e:
                    self._skip("candidate_stats", c["id"], e)
            try:
                out.append((int(row["id"]), codec.result_from_rows(row, tuple(candidates))))
            except (ValueError, TypeError) as e:
                self._skip("results", row["id"], e)
        return out

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
        wanted = _pairs(pairs)
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
        marks = ", ".join("?" for _ in names)
        with self._read("read resumable results") as conn:
            rows = conn.execute(
                f"""SELECT * FROM (
                        SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json,
                            ROW_NUMBER() OVER (
                                PARTITION BY r.workload, r.regime
                                ORDER BY r.recorded_at DESC, r.id DESC) AS rn
                        FROM results r JOIN sessions s ON s.id = r.session_id {where}
                            AND r.recorded_at >= ? AND r.workload IN ({marks})) AS newest
                    WHERE rn = 1""",
                (*args, since, *names),
            ).fetchall()
            found = self._load_results(conn, rows)
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
        with self._write("carry results into a session") as conn:
            self._require_running(conn, to_session_id, "carry results into it")
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
        rows = conn.execute(f"{_RESULT_SELECT} WHERE r.session_id = ?", (session_id,)).fetchall()
        results = self._parse_results(conn, rows)
        # Hosts committing the same keys take turns (the incumbent read, then written).
        groups = {(r.gpu_model, r.versions.key()) for _, r in results}
        self._engine.lock_winners(conn, sorted(groups))
        return commit_winners(
            conn, str(host[0]), results, self._now(), self._skip, self.keep_incumbent_for_s
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
        with self._read("read winners") as conn:
            rows = conn.execute(
                f"""SELECT * FROM (
                        SELECT *, ROW_NUMBER() OVER (
                            PARTITION BY gpu_model, workload, regime
                            ORDER BY measured_at DESC, session_id DESC) AS rn
                        FROM ({source}) AS src {where}) AS picks
                    {"WHERE rn = 1" if latest else ""}
                    ORDER BY gpu_model, workload, regime, measured_at DESC""",
                (*source_args, *args),
            ).fetchall()
        return self._winner_rows(rows)

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

        Never deletes a session a winner (the fleet's or a host's) points at, nor the
        latest completed session of each GPU; session totals are kept. Expired claims
        go too, and disagreements older than this or :data:`DISAGREEMENT_RETENTION_S`,
        whichever is shorter. Returns how many sessions were deleted.
        """
        codec.check_number(older_than_s, "older_than_s")
        cutoff = self._now() - older_than_s
        disagreements_cutoff = self._now() - min(older_than_s, DISAGREEMENT_RETENTION_S)
        with self._write("prune old sessions") as conn:
            cur = conn.execute(
                """DELETE FROM sessions
                   WHERE status != ? AND COALESCE(ended_at, started_at) < ?
                     AND id NOT IN (SELECT session_id FROM winners)
                     AND id NOT IN (SELECT session_id FROM host_winners)
                     AND id NOT IN (
                         SELECT id FROM (
                             SELECT id, ROW_NUMBER() OVER (
                                 PARTITION BY gpu_uuid ORDER BY ended_at DESC, id DESC) AS rn
                             FROM sessions WHERE status = ?) AS newest
                         WHERE rn = 1)""",
                (SessionStatus.RUNNING.value, cutoff, SessionStatus.COMPLETED.value),
            )
            pruned = int(cur.rowcount)
            claim_sql.drop_expired(conn, self._now())
            conn.execute("DELETE FROM disagreements WHERE recorded_at < ?", (disagreements_cutoff,))
            return pruned


_RESULT_SELECT = """SELECT r.*, s.gpu_model, s.gpu_uuid, s.versions_json
    FROM results r JOIN sessions s ON s.id = r.session_id"""


#: How many ids one ``IN (...)`` list holds (SQLite allows 32766 parameters).
IN_CHUNK = 500


def _chunks(ids: Sequence[Any]) -> list[Sequence[Any]]:
    return [ids[i : i + IN_CHUNK] for i in range(0, len(ids), IN_CHUNK)]


def _candidate_rows(conn: Conn, result_ids: Sequence[Any]) -> dict[Any, list[Any]]:
    """The candidate rows of each result, in the order recorded."""
    out: dict[Any, list[Any]] = {}
    for chunk in _chunks(list(dict.fromkeys(result_ids))):
        marks = ", ".join("?" for _ in chunk)
        for c in conn.execute(
            f"SELECT * FROM candidate_stats WHERE result_id IN ({marks}) ORDER BY result_id, id",
            chunk,
        ):
            out.setdefault(c["result_id"], []).append(c)
    return out


def _bump_total(conn: Conn, status: SessionStatus, by: int = 1) -> None:
    conn.execute(
        """INSERT INTO session_totals (status, n) VALUES (?, ?)
           ON CONFLICT (status) DO UPDATE SET n = session_totals.n + excluded.n""",
        (status.value, by),
    )


def _pairs(pairs: Sequence[tuple[str, Regime]]) -> set[tuple[str, Regime]]:
    """(workload, regime) pairs, checked; StoreError naming the first bad one."""
    out = set()
    for i, pair in enumerate(pairs):
        ok = (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and bool(pair[0])
            and isinstance(pair[1], Regime)
        )
        if not ok:
            raise StoreError(f"pairs[{i}]: expected a (workload, Regime) tuple, got {pair!r}")
        out.add(pair)
    return out


def _pid(value: object) -> int | None:
    """A stored owner PID; anything but a positive integer is no owner to ask."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None
