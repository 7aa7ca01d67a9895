"""Where the store lives: a SQLite file, or a PostgreSQL connection string.

:func:`gpuwatchd.store.urls.store_target` tells which; psycopg is imported only when a
connection string asks for PostgreSQL, so a host on the embedded store never needs it.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from gpuwatchd.store.deadline import CALL_TIMEOUT_S
from gpuwatchd.store.store import SqlStore
from gpuwatchd.store.urls import store_target


def open_store(
    location: str | PathLike[str],
    *,
    readonly: bool = False,
    password_file: str | PathLike[str] | None = None,
    call_timeout_s: float = CALL_TIMEOUT_S,
    **kwargs: Any,
) -> SqlStore:
    """Open the store at a path or a PostgreSQL connection string (``[store] url``).

    ``call_timeout_s`` bounds each call to a PostgreSQL store (a local file needs none).
    Any other URL scheme raises :class:`~gpuwatchd.store.errors.StoreError`.
    """
    target = store_target(location)
    if isinstance(target, str):
        from gpuwatchd.store.postgres import postgres_store

        pw = Path(password_file) if password_file else None
        return postgres_store(
            target, readonly=readonly, password_file=pw, call_timeout_s=call_timeout_s, **kwargs
        )
    from gpuwatchd.store.sqlite import sqlite_store

    return sqlite_store(target, readonly=readonly, **kwargs)
