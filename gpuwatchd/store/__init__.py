"""The tuning store: SQLite (WAL) holding sessions, candidate statistics and per-regime winners."""

from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.rows import SessionMeta, SessionRow, StoredResult, WinnerRow
from gpuwatchd.store.schema import MIGRATIONS, Migration, sql_migration
from gpuwatchd.store.store import FINAL_STATUSES, Store

__all__ = [
    "FINAL_STATUSES",
    "MIGRATIONS",
    "Migration",
    "SessionMeta",
    "SessionRow",
    "Store",
    "StoreError",
    "StoredResult",
    "WinnerRow",
    "sql_migration",
]
