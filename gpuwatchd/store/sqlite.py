"""The embedded back end: one SQLite file in WAL mode, no set-up.

Opening checks the file before anything writes to it: a damaged file is moved aside, a
newer or foreign one is refused untouched, and a file SQLite would quietly open
read-only is named as not writable. A file that holds no row yet (empty, or its creation
was killed before the schema was complete) is finished by the next read-write open and
read as an empty store by read-only ones, which never write.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from os import PathLike
from pathlib import Path

from gpuwatchd.store.conn import Conn
from gpuwatchd.store.engine import Engine, migrate
from gpuwatchd.store.errors import StoreBusy, StoreError
from gpuwatchd.store.files import (
    check_writable,
    connect,
    is_damage,
    make_parent,
    quarantine_if_damaged,
    refuse_directory,
)
from gpuwatchd.store.schema import MIGRATIONS, Migration, latest_version, read_state, refuse_newer
from gpuwatchd.store.store import SqlStore

log = logging.getLogger("gpuwatchd.store")


def _wrap(raw: sqlite3.Connection) -> Conn:
    return Conn(
        raw,
        translate=lambda sql: sql,
        ddl=lambda stmt: stmt,
        in_transaction=lambda c: bool(c.in_transaction),
    )


class SqliteEngine(Engine):
    """One store file; writers serialise on SQLite's write lock (``BEGIN IMMEDIATE``)."""

    error = sqlite3.Error

    def __init__(self, path: Path, *, now: Callable[[], float], busy_timeout_s: float) -> None:
        self.path = path
        self.where = str(path)
        self._now = now
        self._busy_timeout_s = busy_timeout_s
        #: Set when a read-only open found the file holding nothing (see :meth:`_empty_store`).
        self._empty_schema: tuple[Migration, ...] | None = None

    def connect(self, *, readonly: bool) -> Conn:
        if self._empty_schema is not None:
            return self._empty_store(self._empty_schema)
        return _wrap(connect(self.path, readonly=readonly, busy_timeout_s=self._busy_timeout_s))

    def _empty_store(self, migrations: Sequence[Migration]) -> Conn:
        """An empty store at the current schema, in memory: what a read-only reader sees
        of a file that holds no row yet (read-only, it may not finish creating it)."""
        raw = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        raw.row_factory = sqlite3.Row
        conn = _wrap(raw)
        migrate(self, conn, migrations)
        return conn

    def begin(self, conn: Conn, *, write: bool) -> int | None:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        return None  # the version is a pragma on the local file: read when asked

    def lock_winners(self, conn: Conn, groups: Sequence[tuple[str, str]]) -> None:
        """Nothing to do: SQLite's writers take turns on the file lock already."""

    def begin_migration(self, conn: Conn) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def version(self, conn: Conn) -> int:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])

    def set_version(self, conn: Conn, version: int) -> None:
        conn.execute(f"PRAGMA user_version = {int(version)}")

    def open(self, migrations: Sequence[Migration], *, readonly: bool) -> Conn:
        return self._open_readonly(migrations) if readonly else self._open_readwrite(migrations)

    def _open_readwrite(self, migrations: Sequence[Migration]) -> Conn:
        refuse_directory(self.path)
        make_parent(self.path, log)
        quarantine_if_damaged(self.path, self._now(), self._busy_timeout_s, log)
        conn = self.connect(readonly=False)
        try:
            # Before anything writes: a foreign file must be left exactly as it is (a
            # newer gpuwatchd's is opened unmigrated: the store judges what it may write).
            version = self.version(conn)
            count = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
            if version == 0 and count:
                raise StoreError(
                    f"store {self.path} is an SQLite database but not a gpuwatchd store"
                    " (schema version 0 with tables); point --store elsewhere"
                )
            if not read_state(conn, version, migrations).writable:
                return conn  # left as it is: the store refuses every write
            mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            if mode.lower() != "wal":
                raise StoreError(f"store {self.path} cannot use WAL mode (journal_mode={mode})")
            migrate(self, conn, migrations)
            check_writable(conn.raw, self.path)
        except sqlite3.Error as e:
            conn.close()
            raise StoreError(f"cannot open store {self.path}: {e}") from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _open_readonly(self, migrations: Sequence[Migration]) -> Conn:
        refuse_directory(self.path)
        if not self.path.is_file():
            raise StoreError(f"store {self.path} does not exist")
        conn = self.connect(readonly=True)
        try:
            version = self.version(conn)
            latest = latest_version(migrations)
            refuse_newer(read_state(conn, version, migrations), self.where)
            if _holds_nothing(conn, version, latest):
                conn.close()
                log.info(
                    "store %s holds nothing yet (schema version %d of %d: created, or its"
                    " creation was cut short); reading it as empty",
                    self.path,
                    version,
                    latest,
                )
                self._empty_schema = tuple(migrations)
                return self._empty_store(migrations)
            if version == 0:
                raise StoreError(f"store {self.path} is not a gpuwatchd store (schema version 0)")
            if version < latest:
                raise StoreError(
                    f"store {self.path} has schema version {version}, older than {latest};"
                    " open it read-write once (start the daemon) to migrate it"
                )
        except sqlite3.Error as e:
            conn.close()
            state = "is damaged" if is_damage(e) else "cannot be read"
            raise StoreError(f"store {self.path} {state}: {e}") from e
        except BaseException:
            conn.close()
            raise
        return conn

    def busy(self, e: Exception) -> bool:
        """Another writer held the file's lock past the busy timeout."""
        return isinstance(e, sqlite3.OperationalError) and "locked" in str(e)

    def fail(self, what: str, e: Exception) -> StoreError:
        kind = StoreBusy if self.busy(e) else StoreError
        return kind(f"store {self.path}: cannot {what}: {e}")


def _holds_nothing(conn: Conn, version: int, latest: int) -> bool:
    """Whether a file below the current schema holds nothing: no table at all at version
    0 (a file with tables but no version is foreign), no row in any table above it."""
    if version >= latest:
        return False
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    tables = [str(r[0]) for r in rows]
    if version == 0:
        return not tables
    return not any(
        conn.execute(f"SELECT EXISTS (SELECT 1 FROM {_quoted(t)})").fetchone()[0] for t in tables
    )


def _quoted(name: str) -> str:
    """A table name read from the file, quoted as an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def sqlite_store(
    path: str | PathLike[str],
    *,
    readonly: bool = False,
    migrations: Sequence[Migration] = MIGRATIONS,
    now: Callable[[], float] = time.time,
    busy_timeout_s: float = 10.0,
    keep_connections: int = 4,
) -> SqlStore:
    """The store in one file, opened (created and migrated) read-write.

    ``readonly=True`` opens with SQLite's ``mode=ro``: the file must exist at the
    current schema version and is never created, migrated or moved aside.
    """
    engine = SqliteEngine(Path(path), now=now, busy_timeout_s=busy_timeout_s)
    return SqlStore(
        engine,
        readonly=readonly,
        migrations=migrations,
        now=now,
        keep_connections=keep_connections,
    )
