"""A session's end is never lost to a lock: no fleet-wide row on the finish path, a busy
store is retried with backoff, and what the store cannot take waits on disk.

Real PostgreSQL: another connection holds the rows or locks a stalled host would hold
(its transaction open mid-finish) while this host finishes.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from builders import GEMM_8192, S, candidate, session_meta
from pg_server import PostgresServer

from gpuwatchd.exporter.collectors.store import PendingCounts, StoreCollector
from gpuwatchd.sessions.events import SessionFinished
from gpuwatchd.sessions.pending_ends import (
    PendingEnd,
    PendingEnds,
    record,
    record_waiting,
)
from gpuwatchd.store import SqlStore, sqlite_store
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable
from gpuwatchd.store.postgres import postgres_store, winners_lock_key
from gpuwatchd.store.retry import retrying
from gpuwatchd.tuning.types import RegimeResult, SessionStatus

LOCK_S = 0.3  # the store's lock timeout in these tests: a held lock fails fast


def _result() -> RegimeResult:
    return RegimeResult(
        workload=GEMM_8192.name,
        regime=S,
        candidates=(candidate("a", S, 1.0e-3), candidate("b", S, 1.2e-3)),
        winner="a",
        tie=False,
        margin=0.2,
        noise=0.01,
    )


@pytest.fixture
def db(postgres_server: PostgresServer) -> Iterator[str]:
    yield postgres_server.url(postgres_server.new_database())


@pytest.fixture
def store(db: str) -> Iterator[SqlStore]:
    s = postgres_store(db, lock_timeout_s=LOCK_S)
    yield s
    s.close()


def _end(sid: int, results: tuple[RegimeResult, ...] = ()) -> PendingEnd:
    return PendingEnd(
        sid, 1, "GPU-bbbb", "NVIDIA H200", SessionStatus.COMPLETED, None, 1.7e9,
        (GEMM_8192.name,), results,
    )  # fmt: skip


def test_a_host_stalled_mid_finish_holding_the_session_counts_holds_up_no_other_host(
    db: str, store: SqlStore
) -> None:
    """Host a's transaction stalls holding what finishing a session bumps (the counts of
    its status, as a daemon one version older bumps the fleet-wide row): host b's
    session still ends completed, its winner recorded, counted."""
    a = store.start_session(session_meta(host="node-a", gpu_uuid="GPU-aaaa"))
    b = store.start_session(session_meta(host="node-b", gpu_uuid="GPU-bbbb", gpu_index=1))
    store.record_result(b, _result())
    with psycopg.connect(db, autocommit=True) as stalled:
        stalled.execute("BEGIN")
        stalled.execute("UPDATE sessions SET why = 'finishing' WHERE id = %s", (a,))
        stalled.execute(
            "INSERT INTO session_totals (status, n) VALUES ('completed', 1) ON CONFLICT (status)"
            " DO UPDATE SET n = session_totals.n + 1"
        )
        stalled.execute(
            "INSERT INTO gpu_session_totals (gpu_uuid, status, n) VALUES ('GPU-aaaa',"
            " 'completed', 1)"
        )
        store.finish_session(b, SessionStatus.COMPLETED)  # waits on none of it
        stalled.execute("ROLLBACK")
    row = store.session(b)
    assert row is not None and row.status is SessionStatus.COMPLETED
    assert [(w.workload, w.candidate, w.session_id) for w in store.winners()] == [
        (GEMM_8192.name, "a", b)
    ]
    assert store.session_totals()[SessionStatus.COMPLETED] == 1


def test_a_lock_held_past_the_lock_timeout_is_busy_not_unreachable_and_retried(
    db: str, store: SqlStore
) -> None:
    """Another host holds the winners lock of the same key (stalled mid-commit): the
    finish fails with StoreBusy (the store stays up), and the end is tried again after
    a backoff, recorded once the holder lets go."""
    b = store.start_session(session_meta(host="node-b", gpu_uuid="GPU-bbbb", gpu_index=1))
    store.record_result(b, _result())
    key = winners_lock_key("NVIDIA H200", session_meta().versions.key())
    holder = psycopg.connect(db, autocommit=True)
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the backoff: the stalled host lets go meanwhile
        waits.append(seconds)
        if len(waits) == 2:
            holder.execute("ROLLBACK")

    try:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        with pytest.raises(StoreBusy, match=f"waited over {LOCK_S:g} s for a lock") as err:
            store.finish_session(b, SessionStatus.COMPLETED)
        assert not isinstance(err.value, StoreUnavailable)
        assert store.up, "a lock timeout is not an outage"
        assert record(store, _end(b), sleep=sleep) is True
    finally:
        holder.close()
    assert len(waits) == 2 and waits[1] > waits[0]
    row = store.session(b)
    assert row is not None and row.status is SessionStatus.COMPLETED
    assert [w.session_id for w in store.winners()] == [b]


def test_an_end_the_store_cannot_take_waits_on_disk_and_is_recorded_later(
    db: str, store: SqlStore, tmp_path: Path
) -> None:
    """The lock outlasts every retry: the end (with a result the store never took) is
    kept in the state directory, survives a restart, and is recorded, counted and told
    to the listeners once the store takes it."""
    b = store.start_session(session_meta(host="node-b", gpu_uuid="GPU-bbbb", gpu_index=1))
    path = tmp_path / "pending-session-ends.json"
    pending = PendingEnds(path)
    key = winners_lock_key("NVIDIA H200", session_meta().versions.key())
    with psycopg.connect(db, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        end = _end(b, (_result(),))
        assert record(store, end, backoff_s=(0.0, 0.0), sleep=lambda s: None) is False
        pending.add(end)
        told: list[SessionFinished] = []
        assert record_waiting(store, pending, lambda e: told.append(e.finished())) == 1
        holder.execute("ROLLBACK")
    assert json.loads(path.read_text())[0]["session_id"] == b
    again = PendingEnds(path)  # the daemon restarted meanwhile
    assert again.take() == [end]
    assert record_waiting(store, again, lambda e: told.append(e.finished())) == 0
    assert not path.exists()
    assert (again.recorded_late, again.dropped) == (1, 0)
    assert [(e.session_id, e.status) for e in told] == [(b, SessionStatus.COMPLETED)]
    row = store.session(b)
    assert row is not None and row.status is SessionStatus.COMPLETED
    assert row.ended_at == end.ended_at, "recorded as ended when it ended, not now"
    assert [r.result.winner for r in store.results(b)] == ["a"]
    assert [w.session_id for w in store.winners()] == [b]
    text = list(StoreCollector(store, lambda: PendingCounts(0, 1, 0)).collect())
    assert {m.name: [s.value for s in m.samples] for m in text}["gpuwatchd_store_late_results"] == [
        1.0,
        0.0,
    ]


def test_the_pending_ends_are_bounded_and_a_bad_file_loses_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pending.json"
    pending = PendingEnds(path, limit=2)
    with caplog.at_level(logging.WARNING):
        for sid in (1, 2, 3):
            pending.add(_end(sid))
    assert [e.session_id for e in pending.take()] == [2, 3] and pending.dropped == 1
    assert "tuning session 1's end (completed) is dropped unrecorded" in caplog.text
    data = json.loads(path.read_text())
    data.insert(0, {"session_id": "x"})  # an entry that is not one: skipped, not the rest
    path.write_text(json.dumps(data))
    assert [e.session_id for e in PendingEnds(path).take()] == [2, 3]
    path.write_text("{not json")
    assert PendingEnds(path).take() == []


def test_retrying_gives_up_after_its_backoff_and_passes_other_errors_at_once() -> None:
    calls: list[int] = []

    def busy() -> None:
        calls.append(1)
        raise StoreBusy("busy")

    with pytest.raises(StoreBusy):
        retrying(busy, "x", backoff_s=(0.0, 0.0), sleep=lambda s: None)
    assert len(calls) == 3

    def down() -> None:
        calls.append(1)
        raise StoreUnavailable("down")

    calls.clear()
    with pytest.raises(StoreUnavailable):
        retrying(down, "x", backoff_s=(0.0, 0.0), sleep=lambda s: None)
    assert len(calls) == 1


def test_a_statement_that_runs_long_on_a_live_server_says_so_not_server_stopped(db: str) -> None:
    """The server cancels a long statement before the client's call bound hangs up on it:
    the error is the statement timeout (StoreBusy, the store up), never "no answer: the
    server is stopped" (what a grown store's prune said while its server was fine)."""
    store = postgres_store(db, call_timeout_s=3.0)
    try:
        with pytest.raises(StoreBusy) as err, store._tx.read("run a long statement") as conn:
            conn.execute("SELECT pg_sleep(30)")
        msg = str(err.value)
        assert "cancelled by the server" in msg and "stopped" not in msg, msg
        assert store.up
    finally:
        store.close()


class _BusyAtFinish:
    """The real store, except that finishing a session finds a lock held while ``busy``."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.busy = True

    def finish_session(self, *args: Any, **kw: Any) -> None:
        if self.busy:
            raise StoreBusy("store x: cannot finish a session: waited over 10 s for a lock")
        self.store.finish_session(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_the_runner_keeps_a_session_end_a_held_lock_refused_and_records_it_later(
    tmp_path: Path,
) -> None:
    """Through the runner: a completed session whose end the store keeps refusing (a lock
    held past every retry) waits in the state directory, counted nowhere yet; once the
    lock is gone it is recorded, completed with its winner, and the listeners hear of it."""
    from test_store_outage import INFO, SPEC

    from gpuwatchd.tuning.session_spec import result_to_json

    res = RegimeResult(
        "mm", S, (candidate("a", S, 1e-3), candidate("b", S, 1.2e-3)), "a", False, 0.2, 0.01
    )
    lines = [
        {"type": "hello", "pid": 1, "versions": {"torch": "fake-1.0"}},
        {"type": "result", "result": result_to_json(res)},
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    worker = f"import sys; sys.stdin.read(); print({text!r}, flush=True)"
    from gpuwatchd.sessions.runner import TuneRunner

    with sqlite_store(tmp_path / "tune.db") as real:
        store = _BusyAtFinish(real)
        ended: list[SessionFinished] = []
        pending = PendingEnds(tmp_path / "pending-session-ends.json")
        waits: list[float] = []
        runner = TuneRunner(
            store,  # type: ignore[arg-type]
            env={"PATH": "/usr/bin:/bin"},
            worker_cmd=[sys.executable, "-c", worker],
            on_finished=ended.append,
            pending=pending,
            sleep=waits.append,
        )
        out = runner.run_session(SPEC, INFO, "sim", lambda: None, None, 60)
        assert out.status is SessionStatus.COMPLETED
        assert len(waits) == 3, "tried again after each backoff"
        assert ended == [] and len(pending) == 1
        assert real.session(out.session_id).status is SessionStatus.RUNNING  # type: ignore[union-attr]
        store.busy = False
        assert runner.record_endings() == 0
        row = real.session(out.session_id)
        assert row is not None and row.status is SessionStatus.COMPLETED
        assert [e.session_id for e in ended] == [out.session_id]
        assert [w.session_id for w in real.winners()] == [out.session_id]
        assert pending.recorded_late == 1
