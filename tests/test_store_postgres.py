"""What only the shared PostgreSQL store has: URLs, credentials, concurrent migrations.

The store's behaviour on both back ends is in ``test_store.py``; these tests start the
same throwaway server (``pg_server.py``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from builders import session_meta
from pg_server import PASSWORD, PostgresServer

from gpuwatchd.store import MIGRATIONS, StoreError, open_store, redact_url, sql_migration
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.errors import WritesRefused
from gpuwatchd.store.postgres import VERSION_TABLE, PostgresEngine, postgres_store
from gpuwatchd.tuning.types import SessionStatus

LATEST = len(MIGRATIONS)


@pytest.fixture
def db(postgres_server: PostgresServer) -> str:
    return postgres_server.new_database()


def test_redact_url_hides_passwords_wherever_they_are() -> None:
    url = "postgresql://fleet:hunter2@db.example:5432/gpu?sslmode=require&password=hunter2"
    shown = redact_url(url)
    assert "hunter2" not in shown
    assert shown.startswith("postgresql://fleet:***@db.example:5432/gpu?")
    assert "sslmode=require" in shown


def test_a_url_holding_a_password_is_refused_and_never_shown(
    postgres_server: PostgresServer, db: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"postgresql://fleet:{PASSWORD}@127.0.0.1:{postgres_server.port}/{db}"
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreError, match="password_file") as e:
        open_store(url)
    assert PASSWORD not in str(e.value) and "fleet:***@" in str(e.value)
    assert all(PASSWORD not in r.getMessage() for r in caplog.records)


def test_password_file_and_pgpassword_authenticate(
    postgres_server: PostgresServer, db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres_server.tcp_url(db)
    with pytest.raises(StoreError, match="cannot open store") as e:
        open_store(url)  # scram over TCP: no password, no entry
    assert "\n" not in str(e.value)
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    with open_store(url, password_file=secret) as s:
        assert s.schema_version() == LATEST
        assert s.where == url  # nothing to redact: the password never was in it
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    with open_store(url) as s:
        assert s.sessions() == []
    secret.write_text("wrong\n")
    with pytest.raises(StoreError, match="authentication failed") as e:
        open_store(url, password_file=secret)
    assert "wrong" not in str(e.value)


def test_a_missing_password_file_is_one_line(postgres_server: PostgresServer, db: str) -> None:
    with pytest.raises(StoreError, match="cannot read the store's password_file"):
        open_store(postgres_server.tcp_url(db), password_file="/nonexistent/pw")


def test_open_store_picks_the_back_end_by_location(
    postgres_server: PostgresServer, db: str, tmp_path: Path
) -> None:
    with open_store(postgres_server.url(db)) as pg:
        assert pg.shared
    with open_store(tmp_path / "tune.db") as lite:
        assert not lite.shared and lite.where == str(tmp_path / "tune.db")


def test_two_daemons_migrating_at_once_apply_each_step_once(
    postgres_server: PostgresServer, db: str
) -> None:
    """Eight openers race on an empty database; the advisory lock lets one migrate."""
    url = postgres_server.url(db)
    counted = sql_migration(
        LATEST + 1,
        "count the runs",
        "CREATE TABLE runs (n INTEGER)",
        "INSERT INTO runs (n) VALUES (1)",
    )
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def opener() -> None:
        try:
            start.wait()
            with postgres_store(url, migrations=(*MIGRATIONS, counted)) as s:
                s.start_session(session_meta())
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=opener) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert postgres_server.sql(db, "SELECT COUNT(*) FROM runs") == [(1,)]
    assert postgres_server.sql(db, f"SELECT version FROM {VERSION_TABLE}") == [(LATEST + 1,)]
    assert postgres_server.sql(db, "SELECT COUNT(*) FROM sessions") == [(8,)]


def test_a_host_older_than_an_additive_schema_keeps_writing(
    postgres_server: PostgresServer, db: str
) -> None:
    url = postgres_server.url(db)
    old = postgres_store(url)
    sid = old.start_session(session_meta())
    newer = sql_migration(LATEST + 1, "newer", "ALTER TABLE sessions ADD COLUMN note TEXT")
    postgres_store(url, migrations=(*MIGRATIONS, newer)).close()  # another host upgraded
    old.finish_session(sid, SessionStatus.COMPLETED)
    assert old.schema is not None and old.schema.skew == 1 and old.writable
    old.close()
    with postgres_store(url) as restarted, postgres_store(url, readonly=True) as reader:
        assert restarted.writable and restarted.schema.skew == 1  # type: ignore[union-attr]
        assert reader.session(sid).status is SessionStatus.COMPLETED  # type: ignore[union-attr]


def test_a_host_older_than_an_incompatible_schema_refuses_to_write_in_one_line(
    postgres_server: PostgresServer, db: str
) -> None:
    url = postgres_server.url(db)
    old = postgres_store(url)
    sid = old.start_session(session_meta())
    # a step older writers must not follow (a meaning changed): it says so
    newer = sql_migration(LATEST + 1, "newer", "CREATE TABLE t (x INTEGER)", min_writer=LATEST + 1)
    postgres_store(url, migrations=(*MIGRATIONS, newer)).close()  # another host upgraded
    with pytest.raises(WritesRefused, match=f"schema version {LATEST + 1}, newer") as e:
        old.finish_session(sid, SessionStatus.COMPLETED)
    assert "\n" not in str(e.value) and "refuses to finish a session" in str(e.value)
    assert not old.writable
    old.close()
    with postgres_store(url) as restarted:  # starts, reads, writes nothing
        assert not restarted.writable
        assert restarted.session(sid).status is SessionStatus.RUNNING  # type: ignore[union-attr]
    with pytest.raises(StoreError, match="newer than this gpuwatchd knows"):
        postgres_store(url, readonly=True)


def test_a_write_checks_the_schema_in_the_statement_that_begins_it(
    postgres_server: PostgresServer, db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres_server.url(db)
    store = postgres_store(url)
    asked: list[int] = []
    version = PostgresEngine.version
    monkeypatch.setattr(
        PostgresEngine, "version", lambda self, conn: asked.append(1) or version(self, conn)
    )
    sid = store.start_session(session_meta())
    store.finish_session(sid, SessionStatus.COMPLETED)
    assert asked == [], "a write's schema check read the version in statements of its own"
    # still read at every write: a newer, incompatible schema stops the next one
    newer = sql_migration(LATEST + 1, "newer", "CREATE TABLE t (x INTEGER)", min_writer=LATEST + 1)
    postgres_store(url, migrations=(*MIGRATIONS, newer)).close()
    with pytest.raises(WritesRefused, match=f"schema version {LATEST + 1}, newer"):
        store.start_session(session_meta())
    store.close()


def test_a_foreign_database_is_refused_untouched(postgres_server: PostgresServer, db: str) -> None:
    postgres_server.sql(db, "CREATE TABLE sessions (id INTEGER)")
    with pytest.raises(StoreError, match="no gpuwatchd schema version"):
        postgres_store(postgres_server.url(db))
    assert postgres_server.sql(db, f"SELECT to_regclass('{VERSION_TABLE}')") == [(None,)]


def test_a_store_opened_while_another_host_migrates_it_is_not_taken_for_a_foreign_one(
    postgres_server: PostgresServer, db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's first start on an empty database: one daemon's first migration commits
    its tables and version between another daemon's two reads of them."""
    url = postgres_server.url(db)
    postgres_store(url).close()  # the other daemon's migration, committed
    real = PostgresEngine.version
    stale = [0]  # the version as read just before that commit

    def version(self: PostgresEngine, conn: Conn) -> int:
        return stale.pop() if stale else real(self, conn)

    monkeypatch.setattr(PostgresEngine, "version", version)
    with postgres_store(url) as store:
        assert store.schema_version() == LATEST


def test_readonly_needs_a_migrated_database(postgres_server: PostgresServer, db: str) -> None:
    with pytest.raises(StoreError, match="not a gpuwatchd store"):
        postgres_store(postgres_server.url(db), readonly=True)


def test_no_server_side_prepared_statements_so_a_transaction_pooler_works(
    postgres_server: PostgresServer, db: str
) -> None:
    """Behind PgBouncer in transaction mode the next transaction may run on another server
    connection: nothing prepared may outlive a transaction."""
    with postgres_store(postgres_server.url(db)) as store:
        for _ in range(8):  # psycopg prepares a query after 5 runs by default
            store.sessions()
        (conn,) = store._tx._idle
        assert conn.raw.prepare_threshold is None
        prepared = conn.raw.execute("SELECT count(*) AS n FROM pg_prepared_statements").fetchone()
        assert prepared["n"] == 0


def test_no_setting_outlives_a_transaction_so_a_transaction_pooler_works(
    postgres_server: PostgresServer, db: str
) -> None:
    """Behind PgBouncer in transaction mode a session-level setting would stay on a server
    connection other clients borrow, and be missing from this client's next one."""
    with postgres_store(postgres_server.url(db)) as store:
        store.sessions()
        with store._tx.transaction(True, "read the settings") as conn:
            inside = conn.execute(
                "SELECT current_setting('idle_in_transaction_session_timeout') AS s"
            ).fetchone()["s"]
        (conn,) = store._tx._idle
        outside = conn.raw.execute(
            "SELECT current_setting('idle_in_transaction_session_timeout') AS idle,"
            " current_setting('lock_timeout') AS lock,"
            " current_setting('statement_timeout') AS statement"
        ).fetchone()
    assert inside == "1min"
    assert (outside["idle"], outside["lock"], outside["statement"]) == ("0", "0", "0")
