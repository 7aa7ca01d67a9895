"""Where the store lives: a file path (SQLite) or a ``postgresql://`` URL.

psycopg is imported only when a URL asks for PostgreSQL, so a host on the embedded
store never needs it.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from gpuwatchd.store.base import TuningStore
from gpuwatchd.store.urls import is_postgres_url


def open_store(
    location: str | PathLike[str],
    *,
    readonly: bool = False,
    password_file: str | PathLike[str] | None = None,
    **kwargs: Any,
) -> TuningStore:
    """Open the store at a path or a PostgreSQL URL (``[store] url``)."""
    if is_postgres_url(location):
        from gpuwatchd.store.postgres import PostgresStore

        pw = Path(password_file) if password_file else None
        return PostgresStore(str(location), readonly=readonly, password_file=pw, **kwargs)
    from gpuwatchd.store.sqlite import Store

    return Store(location, readonly=readonly, **kwargs)
