"""The ``[store]`` section: where the tuning store lives, and the password to reach it.

``url`` is empty (the SQLite file in the state directory), an absolute SQLite file path,
or a PostgreSQL connection string (a ``postgresql://`` URL or a libpq key=value string)
without a password: the password comes from ``password_file`` or libpq's environment
(``PGPASSWORD``), as :mod:`gpuwatchd.store.postgres` demands. Which is which is
:func:`gpuwatchd.store.urls.store_target`'s rule, the one every command and the client
follow. A connection string is only ever shown redacted, in errors as in logs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.store.deadline import CALL_TIMEOUT_S
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.urls import (
    STORE_KINDS,
    is_postgres_url,
    redact_url,
    store_target,
    url_has_password,
)
from gpuwatchd.validate import check, from_table, one_line, show


def shown_url(url: str) -> str:
    """``url`` as an error may show it: redacted, and cut like any shown value."""
    return show(redact_url(url))


def _valid_url(url: str) -> bool:
    """Empty, a password-free PostgreSQL connection string, or an absolute path; else
    ValueError."""
    if not url:
        return True
    try:
        target = store_target(url)
    except StoreError:
        raise ValueError(f"store.url: expected {STORE_KINDS}, got {shown_url(url)}") from None
    if isinstance(target, str):
        try:
            holds_password = url_has_password(url)
        except ValueError:
            raise ValueError(
                f"store.url: not a valid key=value connection string, got {shown_url(url)}"
            ) from None
        if holds_password:
            raise ValueError(
                "store.url: the URL holds a password; put it in [store] password_file or the"
                f" environment (PGPASSWORD) instead, got {shown_url(url)}"
            )
        return True
    if not target.is_absolute():
        raise ValueError(f"store.url: a SQLite file must be an absolute path, got {show(url)}")
    return True


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where the daemon keeps sessions and winners (the CLI's ``--store`` takes the same forms)."""

    #: "" = gpuwatchd.db in the state directory; else an absolute SQLite file path, or a
    #: PostgreSQL URL or key=value string (the fleet's shared store) holding no password.
    url: str = field(default="", metadata=check(_valid_url, ""))
    #: The PostgreSQL password (one line). "" = libpq's environment (PGPASSWORD, ~/.pgpass).
    password_file: str = field(
        default="",
        metadata=check(lambda v: not v or Path(v).is_absolute(), "must be an absolute path"),
    )
    #: The longest one call to a PostgreSQL store may wait for the server (seconds); a
    #: stopped or unreachable server fails each call after this, with one WARNING.
    call_timeout_s: float = field(
        default=CALL_TIMEOUT_S,
        metadata=check(lambda v: 0 < v <= 3600, "must be in (0, 3600]"),
    )
    #: Retention: finished sessions older than this are deleted (never a session a
    #: winner points at, nor each GPU's latest completed one), by the daemon every
    #: ``prune_interval_s`` and by ``gpuwatchd store prune``.
    keep_sessions_s: float = field(
        default=90 * 86400.0, metadata=check(lambda v: v > 0, "must be > 0")
    )
    #: A GPU's sustained clock not reported for this long is deleted: its host left the
    #: fleet (the fleet views already leave it out after ``drift``'s clock max age).
    keep_clocks_s: float = field(
        default=7 * 86400.0, metadata=check(lambda v: v > 0, "must be > 0")
    )
    #: How often the fleet prunes: one host per interval, under a lease in the store.
    #: 0 = the daemon never prunes (``gpuwatchd store prune`` still does).
    prune_interval_s: float = field(
        default=86400.0, metadata=check(lambda v: v >= 0, "must be >= 0")
    )

    @property
    def is_postgres(self) -> bool:
        return is_postgres_url(self.url)

    def check_consistent(self) -> StoreConfig:
        """Itself, unless it names a password file no store would read (ValueError)."""
        if self.password_file and not self.is_postgres:
            raise ValueError(
                "store.password_file: only a postgresql:// store.url reads a password,"
                f" got {show(self.password_file)}"
            )
        return self

    def check_host(self) -> None:
        """What only this host can tell (check-config and run ask): psycopg is installed for
        a PostgreSQL store, libpq can parse its connection string, and the password file is
        readable and not empty. ValueError."""
        if self.is_postgres and importlib.util.find_spec("psycopg") is None:
            raise ValueError(
                "store.url: a postgresql:// store needs psycopg 3:"
                " pip install 'gpuwatchd[postgres]'"
            )
        if self.is_postgres:
            from gpuwatchd.store.postgres import check_conninfo

            try:
                check_conninfo(self.url, redact_url(self.url))
            except StoreError as exc:
                raise ValueError(f"store.url: {exc}") from None
        if not self.password_file:
            return
        try:
            text = Path(self.password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(
                f"store.password_file: cannot read {self.password_file}: {one_line(why)}"
            ) from None
        if not text.rstrip("\r\n"):
            raise ValueError(f"store.password_file: {self.password_file} is empty")


def parse_store(table: Mapping[str, Any]) -> StoreConfig:
    """The ``[store]`` table, every key checked (``with_overrides`` passes a dict too)."""
    return from_table(StoreConfig, table, "store").check_consistent()
