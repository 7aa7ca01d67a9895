"""The store's transactions on one engine: a small connection pool, outages, warnings.

:class:`Transactions` lends each call a connection from a small pool (so the scheduler
thread can write while HTTP threads read), runs it in one transaction that rolls back
on any failure, within the engine's bound on the wait (:meth:`Engine.bounded`), refuses
writes while the database's schema is newer than this gpuwatchd and not compatible
with it (:class:`~gpuwatchd.store.schema.SchemaState`, one line each time that
changes) or while the host's lease is refused (:meth:`Transactions.refuse_writes`), and
warns once per unreadable row. :class:`~gpuwatchd.store.store.SqlStore` holds one and
runs its queries in it.
The pool is the store's own, not psycopg_pool: it serves SQLite too, costs no extra
round trip per call and starts no threads (bench/RESULTS.md, "The store's pool against
psycopg_pool").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress

from gpuwatchd.store.backoff import CAP_S, Backoff
from gpuwatchd.store.conn import Conn
from gpuwatchd.store.engine import Engine
from gpuwatchd.store.errors import StoreError, StoreUnavailable, WritesRefused
from gpuwatchd.store.schema import (
    MIGRATIONS,
    Migration,
    SchemaState,
    check_migrations,
    read_state,
)
from gpuwatchd.validate import one_line

log = logging.getLogger("gpuwatchd.store")


#: While the store is unreachable, calls fail at once for at least this long after a
#: failed try (one call then tries again), longer after each failure (:class:`Backoff`):
#: threads never queue up on a dead server's timeouts, a fleet never knocks in step.
RETRY_UNREACHABLE_S = 2.0
#: Distinct unreadable rows warned about, each once; then one line says more are quiet.
MAX_SKIP_WARNINGS = 200
#: The longest warning about one unreadable row (a stored value is shown cut).
SKIP_LINE_MAX = 300


class Transactions:
    """One engine's connections and transactions. ``readonly=True`` (the client API,
    ``gpuwatchd report``) needs the database at the current schema version and never
    creates or migrates it. ``connect_now=False`` opens (and migrates) the database at
    the first call instead of here, so a process can start while the store is down.

    A pooled connection a server restart killed fails at its first statement; the call
    then drops the pool and tries once more on a fresh connection. A call that finds the
    store unreachable raises :class:`StoreUnavailable` and marks it down (one warning per
    outage); until a call succeeds, others fail at once except one after
    :data:`RETRY_UNREACHABLE_S`, then after waits that double with jitter up to a minute
    (:class:`~gpuwatchd.store.backoff.Backoff`; :meth:`probe` always tries).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        readonly: bool = False,
        migrations: Sequence[Migration] = MIGRATIONS,
        keep_connections: int = 4,
        connect_now: bool = True,
    ) -> None:
        self.readonly = readonly
        self._engine = engine
        self._migrations = tuple(migrations)
        self._keep = keep_connections
        self._lock = threading.Lock()
        self._batch = threading.local()  # this thread's open batch (see batch())
        self._open_lock = threading.Lock()
        self._idle: list[Conn] = []
        self._opened = False
        self._closed = False
        self._warned: set[str] = set()
        self._down_since: float | None = None  # monotonic; None while reachable
        self._down_why = ""
        self._next_try = 0.0
        self._backoff = Backoff(first_s=RETRY_UNREACHABLE_S)
        self.schema: SchemaState | None = None  # known once opened
        self._refused: str | None = None  # why writes are refused besides the schema
        check_migrations(self._migrations)
        if connect_now:
            self._idle.append(self._open())

    @property
    def up(self) -> bool:
        """The store is open and its last call reached it."""
        return self._opened and self._down_since is None

    def close(self) -> None:
        """Close idle connections; ones in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def probe(self) -> None:
        """Reach the store now (opening it first if it never was): returns once it
        answers, else raises :class:`StoreError` (:class:`StoreUnavailable` while it
        cannot be reached)."""
        with self.transaction(False, "reach the store", probe=True) as conn:
            conn.execute("SELECT 1")

    # -- connections and transactions ------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether a write would be tried now (not read-only, not refused, the schema
        as far as it is known lets this gpuwatchd write)."""
        schema = self.schema
        ok_schema = schema is None or schema.writable
        return not self.readonly and self._refused is None and ok_schema

    def refuse_writes(self, why: str | None) -> None:
        """Refuse every write but the host lease's with ``why`` (None: allow them again)."""
        self._refused = why

    def _open(self) -> Conn:
        """The first connection: the database checked and migrated (:meth:`Engine.open`),
        its schema state read."""
        engine = self._engine
        conn = engine.open(self._migrations, readonly=self.readonly)
        try:
            with engine.bounded(conn):
                self._set_schema(read_state(conn, engine.version(conn), self._migrations))
        except BaseException:
            conn.close()
            raise
        self._opened = True
        return conn

    def _set_schema(self, state: SchemaState) -> None:
        """Keep the schema state; a change of skew is said in one line."""
        before, self.schema = self.schema, state
        if before == state or (before is None and state.skew <= 0):
            return
        if state.skew > 0:
            log.warning("%s", state.describe(self._engine.where))
        else:
            log.info("store %s: schema version %d, as this gpuwatchd's", self._engine.where,
                     state.database)  # fmt: skip

    def _lend(self) -> tuple[Conn, bool]:
        """A connection and whether it came from the pool (it may have died there)."""
        with self._lock:
            if self._closed:
                raise StoreError(f"store {self._engine.where} is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            return conn, True
        if not self._opened:
            with self._open_lock:
                if not self._opened:
                    return self._open(), False
        return self._engine.connect(readonly=self.readonly), False

    def _give_back(self, conn: Conn, broken: bool) -> None:
        with self._lock:
            keep = (
                not broken and not conn.broken and not self._closed and len(self._idle) < self._keep
            )
            if keep:
                self._idle.append(conn)
        if not keep:
            with suppress(Exception):
                conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            with suppress(Exception):
                conn.close()

    def _begin(self, write: bool) -> tuple[Conn, int | None]:
        """A connection inside a new transaction, and the schema version if beginning it
        read that (:meth:`Engine.begin`). A pooled one that fails to begin with a
        transient error (killed by a server restart) is replaced, once, by a fresh one."""
        engine = self._engine
        conn, pooled = self._lend()
        try:
            with engine.bounded(conn):
                return conn, engine.begin(conn, write=write)
        except engine.error as e:
            self._give_back(conn, broken=True)
            if not (pooled and engine.transient(e)):
                raise
        self._drop_idle()  # the server that killed this one killed its siblings too
        conn, _ = self._lend()
        try:
            with engine.bounded(conn):
                return conn, engine.begin(conn, write=write)
        except BaseException:
            self._give_back(conn, broken=True)
            raise

    def _may_try(self, probe: bool) -> None:
        """While the store is down, fail at once unless a retry is due (or ``probe``)."""
        with self._lock:
            if self._down_since is None:
                return
            now = time.monotonic()
            if not probe and now < self._next_try:
                raise StoreUnavailable(
                    f"store {self._engine.where} is unreachable: {self._down_why}"
                )
            self._next_try = max(self._next_try, now + RETRY_UNREACHABLE_S)

    def _note(self, error: StoreError, *, lost: bool = True) -> None:
        """A call failed with ``error``: a store it could not reach (``lost``: not a
        timeout on a server that answers) is marked down, logged once per outage."""
        if not (lost and isinstance(error, StoreUnavailable)):
            return
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self._down_why = str(error)
            self._next_try = time.monotonic() + self._backoff.failed()
        if first:
            log.warning("%s; working without it, retried after %g s, then backing off up"
                        " to %g s", error, RETRY_UNREACHABLE_S, CAP_S)  # fmt: skip

    def _reached(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
            self._backoff.reset()
        if since is not None:
            log.warning("store %s reachable again after %.0f s", self._engine.where,
                        time.monotonic() - since)  # fmt: skip

    @contextmanager
    def batch(self, *, write: bool = False) -> Iterator[None]:
        """Run this thread's calls inside as one transaction (one BEGIN and COMMIT for a
        group of small calls, as the fleet sync makes): a call that fails makes the later
        ones fail at once, and the batch raises its StoreError when it ends (all rolled
        back). Inside a read batch a write is refused; a nested batch joins."""
        if getattr(self._batch, "conn", None) is not None:
            yield
            return
        if write and self.readonly:
            raise StoreError(f"store {self._engine.where} is open read-only; cannot write a batch")
        if write:
            self._refuse_if_refused("write a batch")
        with self.transaction(write, "run a batch of calls", each_call_bounded=True) as conn:
            self._batch.conn, self._batch.write, self._batch.failed = conn, write, None
            try:
                yield
            finally:
                failed, self._batch.conn, self._batch.failed = self._batch.failed, None, None
            if failed is not None:
                raise failed

    def _joined(self, write: bool, what: str) -> Iterator[Conn]:
        """A call inside this thread's batch: its transaction, errors as StoreError."""
        b, where = self._batch, self._engine.where
        if b.failed is not None:
            raise StoreError(f"store {where}: cannot {what}: an earlier call failed")
        if write and not b.write:
            b.failed = StoreError(f"store {where}: cannot {what} inside a read-only batch")
            raise b.failed
        try:
            with self._engine.bounded(b.conn):  # each call its own bound, as outside a batch
                yield b.conn
        except self._engine.error as e:
            b.failed = self._engine.fail(what, e)
            raise b.failed from e
        except BaseException as e:  # the call's statements so far stay: none may commit
            b.failed = e if isinstance(e, StoreError) else StoreError(f"cannot {what}: {e!r}")
            raise

    @contextmanager
    def transaction(
        self, write: bool, what: str, *, probe: bool = False, each_call_bounded: bool = False
    ) -> Iterator[Conn]:
        """One transaction on a pooled connection (see the class docstring); ``probe``
        tries even while the store is marked down. Inside this thread's :meth:`batch`,
        the batch's. The call bound covers the whole body, or with ``each_call_bounded``
        (a batch: its calls bound themselves) the schema check and the COMMIT alone."""
        if getattr(self._batch, "conn", None) is not None:
            yield from self._joined(write, what)
            return
        engine = self._engine
        self._may_try(probe)
        try:
            conn, version = self._begin(write)
        except StoreError as e:
            self._note(e)
            raise
        except engine.error as e:
            err = engine.fail(what, e)
            self._note(err, lost=engine.lost(e))
            raise err from e

        # The bound around the whole body, or (a batch) around each statement of our own.
        def bounded_alone() -> AbstractContextManager[None]:
            return engine.bounded(conn) if each_call_bounded else nullcontext()

        broken = False
        try:
            with nullcontext() if each_call_bounded else engine.bounded(conn):
                if write:
                    with bounded_alone():
                        self._check_schema(conn, what, version)
                yield conn
                with bounded_alone():
                    conn.execute("COMMIT")
        except BaseException as e:
            # a batch raises its first failure as a StoreError; the driver's error is its cause
            cause = e.__cause__ if isinstance(e, StoreError) else e
            broken = isinstance(cause, engine.error)
            if conn.in_transaction:
                with suppress(engine.error):
                    conn.execute("ROLLBACK")
            if isinstance(e, engine.error):
                err = engine.fail(what, e)
                self._note(err, lost=engine.lost(e))
                raise err from e
            if isinstance(e, StoreError) and isinstance(cause, engine.error):
                self._note(e, lost=engine.lost(cause))
            raise
        finally:
            self._give_back(conn, broken)
        self._reached()

    def _check_schema(self, conn: Conn, what: str, version: int | None) -> None:
        """Inside a write: refuse it when a newer gpuwatchd migrated the database to a
        schema this one may not write. The version is read in every write (it may have
        changed; ``version``: read as the transaction began), the rest only when it did."""
        if version is None:
            version = self._engine.version(conn)
        state = self.schema
        if state is None or state.database != version:
            state = read_state(conn, version, self._migrations)
            self._set_schema(state)
        if not state.writable:
            raise WritesRefused(
                f"store {self._engine.where} has schema version {state.database}, newer than"
                f" this gpuwatchd's {state.own} and not compatible; this host refuses to"
                f" {what} until gpuwatchd is upgraded"
            )

    def _refuse_if_refused(self, what: str) -> None:
        why = self._refused
        if why is not None:
            raise WritesRefused(f"store {self._engine.where}: this host refuses to {what}: {why}")

    def write(self, what: str, *, lease: bool = False) -> AbstractContextManager[Conn]:
        """A write transaction, serialised with every other writer (no upgrade deadlocks).
        ``lease``: the host lease's own write, tried even while writes are refused."""
        if self.readonly:
            raise StoreError(f"store {self._engine.where} is open read-only; cannot {what}")
        if not lease:
            self._refuse_if_refused(what)
        return self.transaction(True, what)

    def read(self, what: str) -> AbstractContextManager[Conn]:
        """A read transaction: every query inside sees one snapshot."""
        return self.transaction(False, what)

    def skip(self, table: str, key: object, err: Exception) -> None:
        """Warn (once per row and problem) about a stored row that cannot be parsed."""
        text = one_line(f"{table} row {key}: {err}", SKIP_LINE_MAX)
        msg = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
        with self._lock:
            if msg in self._warned or len(self._warned) > MAX_SKIP_WARNINGS:
                return
            self._warned.add(msg)
            last = len(self._warned) > MAX_SKIP_WARNINGS
        log.warning("store %s: skipping unreadable %s", self._engine.where, msg)
        if last:
            log.warning(
                "store %s: more unreadable rows are skipped without a warning", self._engine.where
            )
