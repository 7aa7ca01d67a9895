"""The store's machinery, whichever database holds it: connections, transactions, warnings.

:class:`StoreCore` lends each call a connection from a small pool (so the scheduler
thread can write while HTTP threads read), runs it in one transaction that rolls back
on any failure, within the engine's bound on the wait (:meth:`Engine.bounded`), refuses
writes once a newer gpuwatchd has migrated the database, and warns once per unreadable
row. The queries live in the classes built on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

from gpuwatchd.store.conn import Conn
from gpuwatchd.store.engine import Engine
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.schema import MIGRATIONS, Migration, check_migrations, latest_version
from gpuwatchd.tuning.types import Regime, SessionStatus

log = logging.getLogger("gpuwatchd.store")


class StoreCore:
    """One engine's connections and transactions. ``readonly=True`` (the client API,
    ``gpuwatchd report``) needs the database at the current schema version and never
    creates or migrates it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        readonly: bool = False,
        migrations: Sequence[Migration] = MIGRATIONS,
        now: Callable[[], float] = time.time,
        keep_connections: int = 4,
    ) -> None:
        self.readonly = readonly
        self._engine = engine
        self._migrations = tuple(migrations)
        self._now = now
        self._keep = keep_connections
        self._lock = threading.Lock()
        self._idle: list[Conn] = []
        self._closed = False
        self._warned: set[str] = set()
        check_migrations(self._migrations)
        self._idle.append(engine.open(self._migrations, readonly=readonly))

    @property
    def where(self) -> str:
        """The store as messages name it: a file's path, or a URL without its password."""
        return self._engine.where

    @property
    def shared(self) -> bool:
        """Several hosts use this store (PostgreSQL): the fleet's winners and claims."""
        return self._engine.shared

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections; ones in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- connections and transactions ------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Conn]:
        with self._lock:
            if self._closed:
                raise StoreError(f"store {self.where} is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._engine.connect(readonly=self.readonly)
        broken = False
        try:
            yield conn
        except self._engine.error:
            broken = True
            raise
        finally:
            with self._lock:
                keep = (
                    not broken
                    and not conn.broken
                    and not self._closed
                    and len(self._idle) < self._keep
                )
                if keep:
                    self._idle.append(conn)
            if not keep:
                with suppress(Exception):
                    conn.close()

    @contextmanager
    def _transaction(self, write: bool, what: str) -> Iterator[Conn]:
        engine = self._engine
        try:
            with self._connection() as conn, engine.bounded(conn):
                try:
                    engine.begin(conn, write=write)
                    if write:
                        self._refuse_newer_schema(conn, what)
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with suppress(engine.error):
                            conn.execute("ROLLBACK")
                    raise
        except engine.error as e:
            raise engine.fail(what, e) from e

    def _refuse_newer_schema(self, conn: Conn, what: str) -> None:
        """A newer gpuwatchd migrated the database since it was opened: stop writing."""
        version = self._engine.version(conn)
        latest = latest_version(self._migrations)
        if version > latest:
            raise StoreError(
                f"store {self.where} has schema version {version}, newer than this gpuwatchd"
                f" knows ({latest}); this host refuses to {what} until gpuwatchd is upgraded"
            )

    def _write(self, what: str) -> AbstractContextManager[Conn]:
        """A write transaction, serialised with every other writer (no upgrade deadlocks)."""
        if self.readonly:
            raise StoreError(f"store {self.where} is open read-only; cannot {what}")
        return self._transaction(True, what)

    def _read(self, what: str) -> AbstractContextManager[Conn]:
        """A read transaction: every query inside sees one snapshot."""
        return self._transaction(False, what)

    def _skip(self, table: str, key: object, err: Exception) -> None:
        """Warn (once per row and problem) about a stored row that cannot be parsed."""
        msg = f"{table} row {key}: {err}"
        with self._lock:
            if msg in self._warned:
                return
            self._warned.add(msg)
        log.warning("store %s: skipping unreadable %s", self.where, msg)

    def schema_version(self) -> int:
        with self._read("read the schema version") as conn:
            return self._engine.version(conn)


def enum_value(v: Regime | SessionStatus | None) -> str | None:
    """An enum filter's stored text; anything but the enum is refused with a clear error."""
    if v is None:
        return None
    if not isinstance(v, Regime | SessionStatus):
        raise StoreError(f"expected a Regime or SessionStatus, got {v!r}")
    return v.value


def filters(**columns: object) -> tuple[str, tuple[object, ...]]:
    """``WHERE a = ? AND b = ?`` for the columns whose value is not None."""
    used = {k: v for k, v in columns.items() if v is not None}
    if not used:
        return "", ()
    return "WHERE " + " AND ".join(f"{k} = ?" for k in used), tuple(used.values())
