"""One database connection as the store uses it, whichever driver is under it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol


class Cursor(Protocol):
    """The part of a DB-API cursor the store uses."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Any: ...


class Conn:
    """One database connection in autocommit mode; transactions are explicit statements.

    ``translate`` turns the store's SQL (``?`` placeholders) into the driver's; ``ddl``
    turns a migration's SQLite column types into the database's. ``broken`` is set when
    the connection was hung up on (a call overran its bound): it is not used again.
    """

    def __init__(
        self,
        raw: Any,
        *,
        translate: Callable[[str], str],
        ddl: Callable[[str], str],
        in_transaction: Callable[[Any], bool],
    ) -> None:
        self.raw = raw
        self._translate = translate
        self._ddl = ddl
        self._in_transaction = in_transaction
        self.broken = False

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        cur: Cursor = self.raw.execute(self._translate(sql), tuple(args))
        return cur

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        batch = [tuple(r) for r in rows]
        if not batch:
            return
        sql = self._translate(sql)
        if hasattr(self.raw, "executemany"):
            self.raw.executemany(sql, batch)
        else:
            with self.raw.cursor() as cur:
                cur.executemany(sql, batch)

    def ddl(self, statement: str) -> str:
        """A migration statement in this database's types."""
        return self._ddl(statement)

    @property
    def in_transaction(self) -> bool:
        return self._in_transaction(self.raw)

    def close(self) -> None:
        self.raw.close()
