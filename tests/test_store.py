"""The tuning store: round trips, winners per versions, migrations, damage handling, threads."""

from __future__ import annotations

import logging
import socket
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from builders import SettableClock as Clock
from builders import candidate, seed_session, session_meta
from store_backends import KINDS, Backend, SqliteBackend, make_backend

from gpuwatchd.store import (
    MIGRATIONS,
    SessionMeta,
    SqlStore,
    StoreError,
    sql_migration,
    sqlite_store,
)
from gpuwatchd.store.errors import WritesRefused
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
GEMM = Workload("gemm", "matmul", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("triton.matmul",))
OLD = Versions(driver="580.159.04", cuda="12.8", torch="2.11.0", triton="3.5.0", cudnn="9.19")
NEW_DRIVER = replace(OLD, driver="590.10")


def meta(**kw: object) -> SessionMeta:
    return session_meta(**{"gpu_uuid": "GPU-1", "backend": "sim", "versions": OLD, **kw})


def cand(name: str, median: float | None, regime: Regime, **kw: object) -> CandidateStats:
    """A candidate as an H200 measures it: full clock when cool, at the power cap when hot."""
    hot = regime is not U
    measured: dict[str, object] = {
        "rejected": 1,
        "sm_clock_hz": 1.44e9 if hot else 1.98e9,
        "temp_c": 55.5,
        "reasons": 0x4 if hot else 0,
        "meta": {"config": [128, 256, 64], "kernels": ["sm90_xmma"]},
    }
    return candidate(name, regime, median, **{**measured, **kw})


def result(
    regime: Regime,
    winner: str | None,
    times: dict[str, float | None],
    *,
    tie: bool = False,
    workload: str = "gemm",
) -> RegimeResult:
    return RegimeResult(
        workload=workload,
        regime=regime,
        candidates=tuple(cand(n, t, regime) for n, t in times.items()),
        winner=winner,
        tie=tie,
        margin=None if tie else 0.02,
        noise=0.005,
    )


FLIP = {
    U: result(U, "triton[128x256]", {"triton[128x256]": 1.00e-3, "cublas": 1.02e-3}),
    S: result(S, "cublas", {"triton[128x256]": 1.40e-3, "cublas": 1.33e-3}),
}


def tuned(store: SqlStore, clock: Clock, results: list[RegimeResult], **kw: object) -> int:
    """A session that records ``results`` a second apart and completes; returns its id."""
    return seed_session(store, meta(**kw), results, tick=lambda: clock.advance(1))


@pytest.fixture
def clock() -> Clock:
    return Clock(1_700_000_000.0)


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Each back end in turn: an SQLite file, then a fresh PostgreSQL database."""
    return make_backend(request, tmp_path / "state" / "tune.db")


@pytest.fixture
def store(backend: Backend, clock: Clock) -> Iterator[SqlStore]:
    s = backend.open(now=clock)
    yield s
    s.close()


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# -- round trips ----------------------------------------------------------------------------


def test_session_results_and_winners_round_trip(
    store: SqlStore, backend: Backend, clock: Clock
) -> None:
    started = clock.t
    sid = store.start_session(meta(versions=Versions(driver=OLD.driver)))
    store.set_session_versions(sid, Versions(driver=OLD.driver).merge(replace(OLD, driver=None)))
    assert store.running_count() == 1
    for r in FLIP.values():
        clock.t += 5
        store.record_result(sid, r)
    assert store.winners() == []  # not before the session completes
    clock.t += 5
    store.finish_session(sid, SessionStatus.COMPLETED, "ok")

    (row,) = store.sessions()
    assert row.id == sid and row.status is SessionStatus.COMPLETED and row.why == "ok"
    assert row.started_at == started and row.ended_at == clock.t
    assert row.meta == meta(started_at=started)  # versions merged to the full stack
    assert [s.result for s in store.results(sid)] == [FLIP[U], FLIP[S]]

    wins = {w.regime: w for w in store.winners()}
    assert wins[U].candidate == "triton[128x256]" and wins[U].family == "triton.matmul"
    assert wins[U].median_s == 1.00e-3 and wins[U].sm_clock_hz == 1.98e9
    assert wins[S].candidate == "cublas" and wins[S].sm_clock_hz == 1.44e9
    assert wins[S].versions == OLD and wins[S].session_id == sid and not wins[S].tie
    assert store.winners_differ("gemm") is True
    assert store.winners_differ("no-such-workload") is None
    assert store.last_completed_at() == clock.t
    assert store.session_totals()[SessionStatus.COMPLETED] == 1

    reopened = backend.open(readonly=True)
    assert [s.result for s in reopened.latest_results()] == [FLIP[S], FLIP[U]]  # sorted by regime
    assert reopened.winners() == store.winners()
    reopened.close()


def test_session_meta_from_telemetry_converts_mhz_to_hz() -> None:
    info = DeviceInfo(0, "GPU-x", "NVIDIA H200", driver_version="580", max_sm_clock_mhz=1980.0)
    sample = Sample(gpu=0, t=1.0, temp_c=40.0, power_w=125.0, sm_clock_mhz=1980.0)
    m = SessionMeta.for_device(
        info, backend="nvml", workloads=(GEMM,), regimes=(U,), sample=sample,
        versions=Versions(torch="2.13"),
    )  # fmt: skip
    assert m.max_sm_clock_hz == 1.98e9 and m.sm_clock_at_start_hz == 1.98e9
    assert m.versions == Versions(driver="580", torch="2.13") and m.gpu_model == "NVIDIA H200"


def test_winners_are_keyed_by_versions_and_latest_completed_wins(
    store: SqlStore, clock: Clock
) -> None:
    tuned(store, clock, list(FLIP.values()))
    other = {U: result(U, "cublas", {"triton[128x256]": 1.1e-3, "cublas": 1.0e-3}), S: FLIP[S]}
    tuned(store, clock, list(other.values()), versions=NEW_DRIVER)

    rows = store.winners(regime=U)
    assert {(w.versions.driver, w.candidate) for w in rows} == {
        (OLD.driver, "triton[128x256]"),
        (NEW_DRIVER.driver, "cublas"),
    }
    assert [w.candidate for w in store.winners(regime=U, versions=OLD)] == ["triton[128x256]"]
    latest = store.winners(latest=True)
    assert {(w.regime, w.versions.driver) for w in latest} == {(U, "590.10"), (S, "590.10")}
    assert store.winners_differ("gemm") is False  # the newest stack: cublas in both

    # Same stack again: the row is replaced, not duplicated.
    again = result(U, "triton[64x64]", {"triton[64x64]": 0.9e-3, "cublas": 1.0e-3})
    sid = tuned(store, clock, [again])
    (row,) = store.winners(regime=U, versions=OLD)
    assert row.candidate == "triton[64x64]" and row.session_id == sid


def test_older_result_finishing_late_does_not_replace_a_newer_winner(
    store: SqlStore, clock: Clock
) -> None:
    early = store.start_session(meta())
    store.record_result(early, FLIP[U])
    clock.t += 10
    tuned(store, clock, [result(U, "cublas", {"cublas": 1e-3, "triton[128x256]": 2e-3})])
    clock.t += 10
    store.finish_session(early, SessionStatus.COMPLETED)
    assert [w.candidate for w in store.winners(regime=U)] == ["cublas"]


def test_tie_is_stored_with_the_fastest_as_nominal_candidate(store: SqlStore, clock: Clock) -> None:
    tie = result(U, None, {"a": 1.001e-3, "b": 1.000e-3, "c": None}, tie=True)
    sid = tuned(store, clock, [tie, FLIP[S]])
    (stored,) = [r.result for r in store.results(sid) if r.result.regime is U]
    assert stored.tie and stored.winner is None and stored.candidates[2].median_s is None
    (w,) = store.winners(regime=U)
    assert w.tie and w.candidate == "b" and w.margin is None
    assert store.winners_differ("gemm") is False  # a tie is no evidence of a flip


def test_only_completed_sessions_update_winners(store: SqlStore, clock: Clock) -> None:
    for status in (SessionStatus.FAILED, SessionStatus.PREEMPTED):
        sid = store.start_session(meta())
        store.record_result(sid, FLIP[U])
        store.finish_session(sid, status, "worker crashed")
    assert store.winners() == []
    assert store.latest_results() == []
    assert len(store.latest_results(statuses=(SessionStatus.PREEMPTED,))) == 1
    totals = store.session_totals()
    assert totals[SessionStatus.FAILED] == 1 and totals[SessionStatus.PREEMPTED] == 1
    assert SessionStatus.RUNNING not in totals
    assert store.last_completed_at() is None


def test_all_rejected_result_leaves_the_previous_winner(store: SqlStore, clock: Clock) -> None:
    tuned(store, clock, [FLIP[U]])
    tuned(store, clock, [result(U, None, {"cublas": None, "triton[128x256]": None})])
    assert [w.candidate for w in store.winners(regime=U)] == ["triton[128x256]"]


def test_re_recording_a_regime_replaces_it(store: SqlStore, clock: Clock) -> None:
    sid = store.start_session(meta())
    store.record_result(sid, FLIP[U])
    retry = result(U, "cublas", {"cublas": 0.9e-3})
    store.record_result(sid, retry)
    assert [r.result for r in store.results(sid)] == [retry]


# -- bad input and atomicity ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (replace(FLIP[U], winner="nope"), "result.winner"),
        (replace(FLIP[U], candidates=(cand("x", float("nan"), U),)), "candidates[0].median_s"),
        (replace(FLIP[U], candidates=(cand("x", 1e-3, U), cand("x", 2e-3, U))), "appears twice"),
        (replace(FLIP[U], candidates=(cand("x", 1e-3, S),)), "candidates[0].regime"),
        (replace(FLIP[U], candidates=(cand("x", 1e-3, U, samples=-1),)), "samples"),
        (replace(FLIP[U], candidates=(cand("x", 1e-3, U, meta={"f": object()}),)), ".meta"),
        (replace(FLIP[U], regime="cool"), "result.regime"),  # type: ignore[arg-type]
    ],
)
def test_bad_results_are_refused_naming_the_field(
    store: SqlStore, bad: RegimeResult, field: str
) -> None:
    sid = store.start_session(meta())
    with pytest.raises(StoreError, match=field.replace("[", r"\[").replace("]", r"\]")) as e:
        store.record_result(sid, bad)
    assert "\n" not in str(e.value)
    assert store.results(sid) == []


def test_bad_input_reads_where_what_got_value(store: SqlStore) -> None:
    sid = store.start_session(meta())
    with pytest.raises(StoreError) as e:
        store.record_result(sid, replace(FLIP[U], winner="nope"))
    assert str(e.value) == "result.winner: expected null or one of its candidates, got 'nope'"
    with pytest.raises(StoreError) as e:
        store.start_session(meta(gpu_uuid=" "))
    assert str(e.value) == "meta.gpu_uuid: expected a non-empty string, got ' '"


def test_writes_to_a_finished_or_missing_session_are_refused(store: SqlStore, clock: Clock) -> None:
    sid = tuned(store, clock, [FLIP[U]])
    with pytest.raises(StoreError, match=f"session {sid} is completed, not running"):
        store.record_result(sid, FLIP[S])
    with pytest.raises(StoreError, match="not running"):
        store.finish_session(sid, SessionStatus.FAILED)
    with pytest.raises(StoreError, match="session 999 does not exist"):
        store.record_result(999, FLIP[S])
    with pytest.raises(StoreError, match="status must be one of"):
        store.finish_session(store.start_session(meta()), SessionStatus.RUNNING)
    with pytest.raises(StoreError, match=r"meta\.gpu_uuid"):
        store.start_session(meta(gpu_uuid=""))
    assert store.session_totals()[SessionStatus.COMPLETED] == 1


BOOM = {
    "sqlite": [
        "CREATE TRIGGER boom BEFORE INSERT ON candidate_stats WHEN NEW.candidate = 'boom'"
        " BEGIN SELECT RAISE(ABORT, 'disk on fire'); END"
    ],
    "postgres": [
        "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF NEW.candidate = 'boom' THEN RAISE EXCEPTION 'disk on fire'; END IF;"
        " RETURN NEW; END $$",
        "CREATE TRIGGER boom BEFORE INSERT ON candidate_stats FOR EACH ROW EXECUTE FUNCTION boom()",
    ],
}


def test_a_failure_mid_write_rolls_back_and_loses_nothing(
    store: SqlStore, backend: Backend, clock: Clock
) -> None:
    sid = store.start_session(meta())
    store.record_result(sid, FLIP[U])
    for statement in BOOM[backend.kind]:
        backend.execute(statement)
    doomed = result(S, "cublas", {"cublas": 1e-3, "boom": 2e-3})
    with pytest.raises(StoreError, match="disk on fire"):
        store.record_result(sid, doomed)
    assert [r.result for r in store.results(sid)] == [FLIP[U]]  # no half-written sustained
    store.finish_session(sid, SessionStatus.COMPLETED)
    assert [w.regime for w in store.winners()] == [U]


# -- schema and migrations ------------------------------------------------------------------


LATEST = len(MIGRATIONS)


def test_a_current_store_is_migrated_by_an_added_migration(backend: Backend) -> None:
    with backend.open() as s:
        assert s.schema_version() == LATEST
        sid = s.start_session(meta())
    step = sql_migration(
        LATEST + 1,
        "session notes",
        "ALTER TABLE sessions ADD COLUMN note TEXT",
        "UPDATE sessions SET note = 'migrated'",
    )
    with backend.open(migrations=(*MIGRATIONS, step)) as s:
        assert s.schema_version() == LATEST + 1
        assert [r.id for r in s.sessions()] == [sid]
    assert backend.execute("SELECT note FROM sessions") == [("migrated",)]


def test_a_failing_migration_leaves_the_store_at_its_old_version(backend: Backend) -> None:
    backend.open().close()
    broken = sql_migration(LATEST + 1, "broken", "CREATE TABLE extra (x TEXT)", "SELEC oops")
    with pytest.raises(StoreError, match=rf"migration {LATEST + 1} \(broken\) failed") as e:
        backend.open(migrations=(*MIGRATIONS, broken))
    assert "\n" not in str(e.value)
    with backend.open() as s:
        assert s.schema_version() == LATEST
    with pytest.raises(Exception, match="extra"):
        backend.execute("SELECT COUNT(*) FROM extra")


def test_misnumbered_migrations_are_refused(backend: Backend) -> None:
    gap = sql_migration(LATEST + 2, "gap", "SELECT 1")
    with pytest.raises(StoreError, match=f"has version {LATEST + 2}, expected {LATEST + 1}"):
        backend.open(migrations=(*MIGRATIONS, gap))


def test_a_store_from_a_newer_incompatible_gpuwatchd_is_read_untouched_never_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tune.db"
    sqlite_store(path).close()
    con = raw(path)
    con.execute("PRAGMA journal_mode = DELETE")
    con.execute("PRAGMA user_version = 99")
    con.execute("UPDATE schema_compat SET min_writer = 99")  # a step that is not additive
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="schema version 99, newer") as e:
        sqlite_store(path, readonly=True)
    assert "\n" not in str(e.value)
    with sqlite_store(path) as s:  # a daemon: opened to read, every write refused
        assert s.sessions() == [] and not s.writable
        assert s.schema is not None and s.schema.skew == 99 - LATEST
        with pytest.raises(WritesRefused, match="schema version 99, newer") as e:
            s.start_session(session_meta())
        assert "\n" not in str(e.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tune.db"]


def test_a_store_from_a_newer_additive_gpuwatchd_is_written_as_before(tmp_path: Path) -> None:
    path = tmp_path / "tune.db"
    newer = sql_migration(LATEST + 1, "an added table", "CREATE TABLE extra (x INTEGER)")
    sqlite_store(path, migrations=(*MIGRATIONS, newer)).close()  # the upgraded daemon
    with sqlite_store(path) as s:  # the one rolled back
        assert s.writable and s.schema is not None and s.schema.skew == 1
        sid = s.start_session(session_meta())
        assert s.session(sid) is not None
    with sqlite_store(path, readonly=True) as s:  # a reader of the older schema too
        assert [r.id for r in s.sessions()] == [sid]


def test_a_foreign_sqlite_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "someone-elses.db"
    con = raw(path)
    con.execute("CREATE TABLE accounts (id INTEGER)")
    con.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a gpuwatchd store"):
        sqlite_store(path)
    assert path.read_bytes() == before


def test_wal_mode_is_on(tmp_path: Path) -> None:
    sqlite_store(tmp_path / "tune.db").close()
    con = raw(tmp_path / "tune.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


# -- damaged files --------------------------------------------------------------------------


def _assert_moved_aside(
    path: Path, original: bytes, clock: Clock, caplog: pytest.LogCaptureFixture
) -> Path:
    (aside,) = [p for p in path.parent.iterdir() if ".corrupt-" in p.name and p.name[-4] != "-"]
    assert aside.name == "tune.db.corrupt-20231114T221320Z"  # UTC of the injected clock
    assert aside.read_bytes() == original
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning.getMessage() and str(aside) in warning.getMessage()
    return aside


def test_a_garbage_file_is_moved_aside_and_a_fresh_store_created(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tune.db"
    garbage = b"\x00not a database\xff" * 512
    path.write_bytes(garbage)
    Path(f"{path}-wal").write_bytes(b"stale wal")
    with (
        caplog.at_level(logging.WARNING, logger="gpuwatchd.store"),
        sqlite_store(path, now=clock) as s,
    ):
        assert s.sessions() == [] and s.schema_version() == LATEST
        s.start_session(meta())
    aside = _assert_moved_aside(path, garbage, clock, caplog)
    assert Path(f"{aside}-wal").read_bytes() == b"stale wal"

    # A second damaged file in the same second gets its own name: nothing is overwritten.
    path.write_bytes(garbage)
    Path(f"{path}-wal").unlink(missing_ok=True)
    sqlite_store(path, now=clock).close()
    assert Path(f"{aside}.1").read_bytes() == garbage


def test_a_truncated_store_is_moved_aside_with_its_wal(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tune.db"
    with sqlite_store(path, now=clock) as s:
        for i in range(40):
            sid = s.start_session(meta(extra={"pad": "x" * 2000, "i": i}))
            s.record_result(sid, FLIP[U])
    # A crash image: the main file plus a WAL with frames not yet checkpointed.
    con = raw(path)
    con.execute("PRAGMA wal_autocheckpoint = 0")
    con.execute("UPDATE sessions SET why = 'in the wal only'")
    data, wal = path.read_bytes(), Path(f"{path}-wal").read_bytes()
    con.close()
    assert len(data) > 64 * 1024 and len(wal) > 4096
    path.write_bytes(data[: len(data) // 2])
    Path(f"{path}-wal").write_bytes(wal)
    with (
        caplog.at_level(logging.WARNING, logger="gpuwatchd.store"),
        sqlite_store(path, now=clock) as s,
    ):
        assert s.sessions() == []
    aside = _assert_moved_aside(path, data[: len(data) // 2], clock, caplog)
    assert Path(f"{aside}-wal").read_bytes() == wal  # the check neither checkpointed nor deleted it


def test_unparsable_rows_are_skipped_with_a_warning(
    store: SqlStore, backend: Backend, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    good = tuned(store, clock, list(FLIP.values()))
    bad = tuned(store, clock, [FLIP[U]], gpu_model="NVIDIA L4")
    backend.execute("UPDATE sessions SET status = 'exploded' WHERE id = ?", (bad,))
    backend.execute(
        "UPDATE candidate_stats SET meta_json = '{broken' WHERE candidate = 'cublas'"
        " AND result_id = (SELECT MIN(id) FROM results)"
    )
    backend.execute("UPDATE winners SET regime = 'lukewarm' WHERE gpu_model = 'NVIDIA L4'")
    backend.execute("INSERT INTO session_totals VALUES ('vanished', 3)")
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        assert [s.id for s in store.sessions()] == [good]
        first = store.results(good)[0].result
        assert [c.name for c in first.candidates] == ["triton[128x256]"]
        assert {w.gpu_model for w in store.winners()} == {"NVIDIA H200"}
        assert store.session_totals()[SessionStatus.COMPLETED] == 2
        store.sessions()  # the same bad row again: warned once only
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert any("'exploded'" in w for w in warnings) and any("lukewarm" in w for w in warnings)


# -- read-only mode -------------------------------------------------------------------------


def test_readonly_never_creates_a_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "tune.db"
    with pytest.raises(StoreError, match="does not exist") as e:
        sqlite_store(missing, readonly=True)
    assert "\n" not in str(e.value)
    assert not missing.parent.exists()


def test_readonly_reads_and_refuses_writes(store: SqlStore, backend: Backend, clock: Clock) -> None:
    tuned(store, clock, list(FLIP.values()))
    with backend.open(readonly=True) as ro:
        assert len(ro.winners()) == 2 and ro.winners_differ("gemm") is True
        with pytest.raises(StoreError, match="read-only"):
            ro.start_session(meta())
    assert len(store.sessions()) == 1


def test_readonly_refuses_a_damaged_file_and_reads_an_empty_one_as_empty(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"junk" * 1000)
    with pytest.raises(StoreError, match="is damaged"):
        sqlite_store(garbage, readonly=True)
    assert garbage.read_bytes() == b"junk" * 1000
    empty = tmp_path / "empty.db"
    empty.touch()
    with sqlite_store(empty, readonly=True) as ro:  # created, nothing written yet: nothing to show
        assert ro.sessions() == [] and ro.winners() == []
    assert empty.read_bytes() == b""  # and a reader never writes


# -- concurrency and retention --------------------------------------------------------------


def test_concurrent_writers_from_two_threads(store: SqlStore, backend: Backend) -> None:
    other = backend.open()  # a second handle: another process's connection
    errors: list[BaseException] = []

    def work(s: SqlStore, gpu: str) -> None:
        try:
            for _ in range(15):
                sid = s.start_session(meta(gpu_uuid=gpu))
                s.record_result(sid, FLIP[U])
                s.record_result(sid, FLIP[S])
                s.finish_session(sid, SessionStatus.COMPLETED)
                s.winners_differ("gemm")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=(store, "GPU-a")),
        threading.Thread(target=work, args=(store, "GPU-b")),
        threading.Thread(target=work, args=(other, "GPU-c")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.close()
    assert errors == []
    assert len(store.sessions(limit=100)) == 45
    assert store.session_totals()[SessionStatus.COMPLETED] == 45
    assert all(len(store.results(s.id)) == 2 for s in store.sessions(limit=100))


def test_prune_keeps_winners_and_totals(store: SqlStore, clock: Clock) -> None:
    old_win = tuned(store, clock, [FLIP[U]])
    failed = store.start_session(meta())
    store.record_result(failed, FLIP[S])
    store.finish_session(failed, SessionStatus.FAILED, "hang")
    running = store.start_session(meta())
    other_gpu = tuned(store, clock, [], gpu_uuid="GPU-2")  # latest completed of its GPU
    clock.t += 10_000

    assert store.prune(older_than_s=3600) == 1
    assert {s.id for s in store.sessions()} == {old_win, running, other_gpu}
    assert store.winners()[0].session_id == old_win
    assert store.results(old_win) != []

    newer = tuned(store, clock, [FLIP[U]])  # supersedes old_win's winner
    clock.t += 10_000
    assert store.prune(older_than_s=3600) == 1
    assert {s.id for s in store.sessions()} == {running, other_gpu, newer}
    totals = store.session_totals()
    assert totals[SessionStatus.COMPLETED] == 3 and totals[SessionStatus.FAILED] == 1
    with pytest.raises(StoreError, match="older_than_s"):
        store.prune(-1)


def _set_owner(backend: Backend, sid: int, pid: int | None) -> None:
    backend.execute("UPDATE sessions SET owner_pid = ? WHERE id = ?", (pid, sid))


def test_abandon_running_fails_only_sessions_whose_process_is_gone(
    store: SqlStore, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    here = meta(host=socket.gethostname())
    dead, live, legacy, mine = (store.start_session(here) for _ in range(4))
    elsewhere = store.start_session(meta(host="other-host"))
    _set_owner(backend, elsewhere, 4_000_003)
    _set_owner(backend, dead, 4_000_001)
    _set_owner(backend, live, 4_000_002)
    _set_owner(backend, legacy, None)  # written before owners were recorded
    done = store.start_session(meta())
    store.finish_session(done, SessionStatus.COMPLETED)
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        n = store.abandon_running(alive=lambda pid: pid == 4_000_002)
    # A shared store's other hosts own PIDs this host cannot ask about: left alone there.
    shared = backend.kind == "postgres"
    assert n == (3 if shared else 4)
    status = {sid: store.session(sid).status for sid in (dead, live, legacy, mine, done)}  # type: ignore[union-attr]
    assert status == {
        dead: SessionStatus.FAILED,
        live: SessionStatus.RUNNING,  # another live process is still running it
        legacy: SessionStatus.FAILED,
        mine: SessionStatus.FAILED,  # our own PID: left by an earlier process with that PID
        done: SessionStatus.COMPLETED,
    }
    assert store.session(elsewhere).status is (  # type: ignore[union-attr]
        SessionStatus.RUNNING if shared else SessionStatus.FAILED
    )
    assert store.session(dead).why.startswith("abandoned")  # type: ignore[union-attr]
    failed = 3 if shared else 4
    assert store.session_totals()[SessionStatus.FAILED] == failed
    (warning,) = caplog.records
    assert f"{failed} session(s) left running" in warning.getMessage()
    assert store.abandon_running(alive=lambda pid: pid == 4_000_002) == 0  # counted once
    assert store.session_totals()[SessionStatus.FAILED] == failed


def test_a_version_1_store_gains_owners_and_its_leftovers_are_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "tune.db"
    with sqlite_store(path) as current:
        sid = current.start_session(meta())
    SqliteBackend(path).downgrade_to_2()
    con = raw(path)  # back to what version 1 wrote: no owner column
    con.execute("ALTER TABLE sessions DROP COLUMN owner_pid")
    con.execute("PRAGMA user_version = 1")
    con.close()
    with sqlite_store(path) as s:
        assert s.schema_version() == LATEST
        assert s.abandon_running() == 1
        assert s.session(sid).status is SessionStatus.FAILED  # type: ignore[union-attr]
