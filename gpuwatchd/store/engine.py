"""What differs between the store's databases: connecting, transactions, versions, DDL types.

:class:`~gpuwatchd.store.store.SqlStore` holds every query and writes them once, in
SQLite's spelling with ``?`` placeholders; an :class:`Engine` runs them on its database
through a :class:`Conn`, which translates what must be translated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from gpuwatchd.store.conn import Conn
from gpuwatchd.store.errors import StoreBusy, StoreError, StoreUnavailable
from gpuwatchd.store.schema import Migration, check_migrations, latest_version, record_min_writer


class Engine(ABC):
    """One kind of database behind the store. ``where`` names it in messages (no secrets)."""

    #: The driver's base exception: what a failed statement raises.
    error: type[Exception] = Exception
    where: str = ""
    #: Shared by several hosts: a PID means something only on the host that wrote it.
    shared: bool = False

    @abstractmethod
    def open(self, migrations: Sequence[Migration], *, readonly: bool) -> Conn:
        """The first connection: checked, migrated (read-write) or version-checked (read-only)."""

    @abstractmethod
    def connect(self, *, readonly: bool) -> Conn:
        """Another connection to a database :meth:`open` has already checked."""

    @abstractmethod
    def begin(self, conn: Conn, *, write: bool) -> int | None:
        """Start a transaction (a write one where the database's writers take turns, or
        at row level: see :meth:`lock_winners`). Returns the schema version when it was
        read in the same round trip (a write's check costs no statement of its own),
        else None (the caller asks :meth:`version`)."""

    def median_sql(self, column: str) -> str | None:
        """The SQL aggregate of ``column``'s median, or None where the database has none
        (the caller computes it from the rows)."""
        return None

    @abstractmethod
    def lock_winners(self, conn: Conn, groups: Sequence[tuple[str, str]]) -> None:
        """Inside a write transaction: wait until no other transaction commits winners
        of these (GPU model, versions key) groups, given sorted."""

    @abstractmethod
    def begin_migration(self, conn: Conn) -> None:
        """Start a migration step's transaction, exclusive of every other migrating process."""

    @abstractmethod
    def version(self, conn: Conn) -> int:
        """The schema version the database is at (0: no gpuwatchd schema yet)."""

    @abstractmethod
    def set_version(self, conn: Conn, version: int) -> None:
        """Record the version reached, inside the migration's transaction."""

    @contextmanager
    def bounded(self, conn: Conn) -> Iterator[None]:
        """Bound one call's wait on ``conn``. Unbounded here: a local file answers or
        fails by itself (its lock waits are bounded by the busy timeout)."""
        yield

    def describe(self, e: Exception) -> str:
        """The driver's message for ``e`` in one line."""
        return " ".join(str(e).split())

    def transient(self, e: Exception) -> bool:
        """``e`` says the database could not be reached or cut the operation off: the
        same call may work seconds later (a server restart, a lost connection)."""
        return False

    def lost(self, e: Exception) -> bool:
        """``e`` says the connection to the database is gone or could not be made (not a
        timeout on a server that answers): the store is down until a call reaches it."""
        return False

    def busy(self, e: Exception) -> bool:
        """``e`` says the database answered but a lock wait, the statement timeout or a
        serialization conflict cut the operation off: retried after a backoff, and the
        store is not down (:class:`StoreBusy`)."""
        return False

    def fail(self, what: str, e: Exception) -> StoreError:
        kind: type[StoreError] = (
            StoreBusy if self.busy(e) else StoreUnavailable if self.transient(e) else StoreError
        )
        return kind(f"store {self.where}: cannot {what}: {self.describe(e)}")


def migrate(engine: Engine, conn: Conn, migrations: Sequence[Migration]) -> int:
    """Apply every migration past the database's version; returns the version reached.

    Each step runs in its own exclusive transaction (:meth:`Engine.begin_migration`) and
    re-reads the version inside it, so two processes opening the same new database do
    not both apply a step. A database a newer gpuwatchd migrated is left as it is (the
    caller judges whether this one may write it: :class:`~gpuwatchd.store.schema.
    SchemaState`).
    """
    where = engine.where
    check_migrations(migrations)
    if engine.version(conn) >= latest_version(migrations):
        return engine.version(conn)
    for m in migrations:
        engine.begin_migration(conn)
        try:
            current = engine.version(conn)
            if current >= m.version:
                conn.execute("COMMIT")
                continue
            m.apply(conn)
            record_min_writer(conn, m)
            engine.set_version(conn, m.version)
            conn.execute("COMMIT")
        except BaseException as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(e, engine.error):
                raise StoreError(
                    f"store {where}: migration {m.version} ({m.name}) failed: {engine.describe(e)}"
                ) from e
            raise
    return engine.version(conn)
