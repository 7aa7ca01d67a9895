"""The store's file on disk: connecting, checking integrity, moving a damaged file aside.

A damaged store is renamed, never overwritten or deleted, so whatever it still holds
can be recovered by hand; the daemon then starts a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
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
    handed between threads, one user at a time. A read-only one is readable when this
    returns (see :func:`_readable`).
    """
    conn = _connect(path, readonly=readonly, busy_timeout_s=busy_timeout_s)
    return _readable(conn, path, busy_timeout_s) if readonly else conn


def _readable(conn: sqlite3.Connection, path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """A read-only connection that can read, for a user who may not write the store.

    A WAL store's first read needs its ``-shm`` index, which SQLite creates beside the
    file: a user who may not write that directory (a job reading the daemon's store)
    cannot, once the daemon has closed the store and its ``-shm`` is gone. Then the
    whole store is in the file itself, and it is read with ``immutable=1`` (no locks, no
    index). Where a ``-wal`` still holds changes only a writer can fold in, immutable
    would read stale data: one line says why it cannot be read.
    """
    try:
        conn.execute("PRAGMA user_version").fetchone()
        return conn
    except sqlite3.Error as e:
        conn.close()
        code = getattr(e, "sqlite_errorcode", 0) & 0xFF
        if code not in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
            state = "is damaged" if is_damage(e) else "cannot be read"
            raise StoreError(f"store {path} {state}: {explain(e, path)}") from e
        if not _all_in_the_file(path):
            raise StoreError(
                f"store {path} cannot be read by {_user()}: its write-ahead log"
                f" {path.name}-wal holds changes and SQLite may not create its index"
                f" {path.name}-shm in {path.parent}; read it as the store's owner, or while"
                " the daemon has it open"
            ) from None
    return _connect(path, readonly=True, busy_timeout_s=busy_timeout_s, immutable=True)


def _all_in_the_file(path: Path) -> bool:
    """Whether every committed change is in the store file itself: no ``-wal`` with
    frames (or one beside an index a writer may still use), no rollback journal."""
    if Path(f"{path}-journal").exists():
        return False
    try:
        wal_size = Path(f"{path}-wal").stat().st_size
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return wal_size == 0 and not Path(f"{path}-shm").exists()


def _user() -> str:
    uid = os.geteuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _connect(
    path: Path, *, readonly: bool, busy_timeout_s: float, immutable: bool = False
) -> sqlite3.Connection:
    if readonly and not os.access(path, os.R_OK) and path.exists():
        raise StoreError(f"store {path} cannot be read by {_user()}: permission denied")
    try:
        conn = sqlite3.connect(
            _uri(path, readonly, immutable=immutable),
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout_s,
        )
    except sqlite3.Error as e:
        raise StoreError(f"cannot open store {path}: {explain(e, path)}") from e
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


def explain(e: sqlite3.Error, path: Path) -> str:
    """SQLite's message, plus the cause it leaves out: a full file system reads "disk I/O"."""
    text = str(e)
    try:
        full = shutil.disk_usage(path.parent).free == 0
    except OSError:
        full = False
    return f"{text} (no space left on the file system holding {path.parent})" if full else text


def refuse_directory(path: Path) -> None:
    """A directory where the store file should be: say so, not "disk I/O error"."""
    if path.is_dir():
        raise StoreError(
            f"store {path} is a directory; give the store's file, e.g. {path / 'gpuwatchd.db'}"
        )


def make_parent(path: Path, log: logging.Logger) -> None:
    """Create the store's missing directory (and its parents), saying so in one WARNING.

    gpuwatchd creates a missing parent directory of every file it writes (the store, a
    recorded trace, the control socket) and logs that it did: a mistyped path then shows
    up in the log instead of silently growing a new tree.
    """
    parent = path.parent
    if parent.is_dir():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(
            f"cannot create {parent} for store {path.name}: {e.strerror or e}"
        ) from None
    log.warning("created the missing directory %s for store %s", parent, path.name)


def check_writable(conn: sqlite3.Connection, path: Path) -> None:
    """Fail at open, in one line, when the store cannot be written.

    SQLite quietly opens a file it may not write (a read-only file system, a read-only
    copy left with its -wal/-shm) read-only, and the first session would then fail.
    A write begun and rolled back asks it now.
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TABLE gpuwatchd_write_probe (x)")
    except sqlite3.Error as e:
        raise StoreError(f"store {path} is not writable: {explain(e, path)}") from None
    finally:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")


def _uri(path: Path, readonly: bool, *, immutable: bool = False) -> str:
    """A ``file:`` URI, so names with ``?`` or ``#`` work and ``mode=ro`` (and
    ``immutable=1``) can be asked for."""
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}"
    if immutable:
        return uri + "?mode=ro&immutable=1"
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
            raise StoreError(f"cannot check store {path}: {explain(e, path)}") from e
    try:
        return _integrity(path, readonly=False, busy_timeout_s=busy_timeout_s)
    except sqlite3.Error as e:
        raise StoreError(f"cannot check store {path}: {explain(e, path)}") from e


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
