"""The tuning store: sessions, candidate statistics and per-regime winners.

SQLite (one file, WAL) is the embedded default; PostgreSQL is the fleet's shared store,
imported only when a connection string (a ``postgresql://`` URL or a libpq key=value
string) asks for it (:func:`open_store`).

One SQL rule: :class:`SqlStore` (``store.py``) is the transaction facade, checking each
call's arguments and running it as one transaction; the SQL of each table lives in its
query module (``session_sql``, ``result_rows`` and ``result_sql``, ``winner_sql`` and
``commit``, ``claims``, ``clocks``, ``prune_sql``), written once in SQLite's spelling
with ``?`` placeholders; what differs between databases is the engine's
(``sqlite.py``, ``postgres.py``). Nothing outside this package writes SQL.
"""

from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.location import find_store_file, open_store
from gpuwatchd.store.rows import (
    Claim,
    Disagreement,
    HostClock,
    SessionMeta,
    SessionRow,
    StoredResult,
    WinnerRow,
    host_name,
)
from gpuwatchd.store.schema import MIGRATIONS, Migration, sql_migration
from gpuwatchd.store.sqlite import sqlite_store
from gpuwatchd.store.store import FINAL_STATUSES, SqlStore
from gpuwatchd.store.urls import is_postgres_url, redact_url

__all__ = [
    "FINAL_STATUSES",
    "MIGRATIONS",
    "Claim",
    "Disagreement",
    "HostClock",
    "Migration",
    "SessionMeta",
    "SessionRow",
    "SqlStore",
    "StoreError",
    "StoredResult",
    "WinnerRow",
    "find_store_file",
    "host_name",
    "is_postgres_url",
    "open_store",
    "redact_url",
    "sql_migration",
    "sqlite_store",
]
