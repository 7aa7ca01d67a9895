"""The store's back ends as the parametrized tests see them: open a store, run raw SQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pg_server import PostgresServer

from gpuwatchd.store import SqlStore, sqlite_store

KINDS = ("sqlite", "postgres")

#: What schema migrations 3 (the fleet) and later added, undone to make a version-2
#: store; migration 7's per-GPU session counts folded back into version 2's table.
FLEET_OBJECTS = (
    """INSERT INTO session_totals (status, n)
       SELECT status, SUM(n) FROM gpu_session_totals WHERE true GROUP BY status
       ON CONFLICT (status) DO UPDATE SET n = session_totals.n + excluded.n""",
    "DROP TABLE gpu_session_totals",
    "DROP TABLE clock_medians",
    "DROP TABLE disagreement_totals",
    "DROP INDEX sessions_running_since",
    "DROP INDEX sessions_by_gpu",  # migration 4's on version 2's tables
    "DROP INDEX sessions_by_host",
    "DROP TABLE host_winners",
    "DROP TABLE disagreements",
    "DROP TABLE claims",
    "DROP TABLE host_clocks",
    "DROP TABLE schema_compat",  # migration 5's
)


class SqliteBackend:
    kind = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)

    def open(self, **kw: Any) -> SqlStore:
        return sqlite_store(self.path, **kw)

    def execute(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        con = sqlite3.connect(self.path, isolation_level=None)
        try:
            return [tuple(r) for r in con.execute(sql, args).fetchall()]
        finally:
            con.close()

    def downgrade_to_2(self) -> None:
        """Turn a current store into what schema version 2 wrote, rows kept."""
        for statement in FLEET_OBJECTS:
            self.execute(statement)
        self.execute("PRAGMA user_version = 2")


class PostgresBackend:
    kind = "postgres"

    def __init__(self, server: PostgresServer, db: str) -> None:
        self.server = server
        self.db = db
        self.location = server.url(db)

    def open(self, **kw: Any) -> SqlStore:
        from gpuwatchd.store.postgres import postgres_store

        return postgres_store(self.location, **kw)

    def execute(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return self.server.sql(self.db, sql.replace("?", "%s"), args)

    def downgrade_to_2(self) -> None:
        """Turn a current store into what schema version 2 wrote, rows kept."""
        from gpuwatchd.store.postgres import VERSION_TABLE

        for statement in FLEET_OBJECTS:
            self.execute(statement)
        self.execute(f"UPDATE {VERSION_TABLE} SET version = 2")


Backend = SqliteBackend | PostgresBackend


def make_backend(request: pytest.FixtureRequest, path: Path) -> Backend:
    """The back end a ``params=KINDS`` fixture asks for; PostgreSQL gets a fresh database."""
    if request.param == "sqlite":
        return SqliteBackend(path)
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return PostgresBackend(server, server.new_database())
