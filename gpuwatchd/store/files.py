"""The store's file on disk: connecting, checking integrity, moving a damaged file aside.

A damaged store is renamed, never overwritten or deleted, so whatever it still holds
can be recovered by hand; the daemon then starts a fresh one.
"""

from __future__ import annotations

import logging
import sqlite3
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path

from gpuwatchd.store.errors import StoreError

#: SQLite's own files next to a database: the write-ahead log and its shared-memory index.
SIDECARS = ("-wal", "-shm")
_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def connect(path: Path, *, readonly: bool, busy_timeout_s: float) -> sqlite3.Connection:
    """Open a connection in autocommit mode with the per-connection pragmas set.

    Transactions are explicit (``BEGIN``/``BEGIN IMMEDIATE``); the connection may be
    handed between threads, one user at a time.
    """
    try:
        conn = sqlite3.connect(
            _uri(path, readonly),
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout_s,
        )
    except sqlite3.Error as e:
        raise StoreError(f"cannot open store {path}: {e}") from e
    conn.row_factory = sqlite3.Row
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            conn.execute("PRAGMA synchronous = NORMAL")
    except sqlite3.Error as e:
        conn.close()
        state = "is damaged" if is_damage(e) else "cannot be opened"
        raise StoreError(f"store {path} {state}: {e}") from e
    return conn


def _uri(path: Path, readonly: bool) -> str:
    """A ``file:`` URI, so names with ``?`` or ``#`` work and ``mode=ro`` can be asked for."""
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}"
    return uri + "?mode=ro" if readonly else uri


def is_damage(e: sqlite3.Error) -> bool:
    """True for "not a database" and "malformed" errors; False for locks, permissions, ..."""
    return getattr(e, "sqlite_errorcode", None) in _DAMAGED


def find_damage(path: Path, busy_timeout_s: float) -> str | None:
    """Run ``PRAGMA integrity_check`` on an existing file: None if sound, else what is wrong.

    The check reads through a ``mode=ro`` connection: a read-write one would, on
    close, checkpoint the WAL into a damaged file and delete the WAL, destroying
    exactly what the move aside is meant to keep. Only a hot rollback journal (which
    a reader cannot roll back) is checked read-write, since rolling it back is the
    recovery. Errors that are not damage (locked, unreadable) raise
    :class:`StoreError`: a file we cannot judge is left alone.
    """
    try:
        return _integrity(path, readonly=True, busy_timeout_s=busy_timeout_s)
    except sqlite3.Error as e:
        if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_READONLY:
            raise StoreError(f"cannot check store {path}: {e}") from e
    try:
        return _integrity(path, readonly=False, busy_timeout_s=busy_timeout_s)
    except sqlite3.Error as e:
        raise StoreError(f"cannot check store {path}: {e}") from e


def _integrity(path: Path, *, readonly: bool, busy_timeout_s: float) -> str | None:
    conn = sqlite3.connect(
        _uri(path, readonly), uri=True, isolation_level=None, timeout=busy_timeout_s
    )
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.Error as e:
        if is_damage(e):
            return str(e)
        raise
    finally:
        conn.close()
    if rows == ["ok"]:
        return None
    shown = "; ".join(rows[:3])
    return shown + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")


def move_aside(path: Path, now: float) -> Path:
    """Rename ``path`` and its sidecars to ``<name>.corrupt-<UTC time>[.N]``; returns the new path.

    The sidecars keep their suffix after the new name (``...corrupt-<t>-wal``) so
    SQLite can still open the set together. An existing name is never overwritten.
    """
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    base = path.with_name(f"{path.name}.corrupt-{stamp}")
    aside = base
    n = 1
    while any(Path(f"{aside}{s}").exists() for s in ("", *SIDECARS)):
        aside = base.with_name(f"{base.name}.{n}")
        n += 1
    try:
        for s in SIDECARS:
            side = Path(f"{path}{s}")
            if side.exists():
                side.rename(f"{aside}{s}")
        path.rename(aside)
    except OSError as e:
        raise StoreError(f"store {path} is damaged and cannot be moved aside: {e}") from e
    return aside


def quarantine_if_damaged(
    path: Path, now: float, busy_timeout_s: float, log: logging.Logger
) -> None:
    """Check an existing store file and move it aside (with a WARNING) if it is damaged."""
    if not path.exists():
        return
    problem = find_damage(path, busy_timeout_s)
    if problem is None:
        return
    aside = move_aside(path, now)
    log.warning(
        "store %s is damaged (%s); moved it aside to %s and starting a fresh store",
        path,
        problem,
        aside,
    )
