"""Where the store lives: a SQLite file, or a PostgreSQL connection string.

:func:`gpuwatchd.store.urls.store_target` tells which; psycopg is imported only when a
connection string asks for PostgreSQL, so a host on the embedded store never needs it.
A reader that was not told where the store is (the job client, ``gpuwatchd report``) takes
the first existing file of the candidates :func:`gpuwatchd.client.discovery.default_store_paths`
lists, by :func:`find_store_file`. A simulated or replayed daemon keeps its store and
control socket in :func:`sim_state_dir`, never in the system's directories.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import tempfile
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

from gpuwatchd.store.deadline import CALL_TIMEOUT_S
from gpuwatchd.store.errors import StoreError
from gpuwatchd.store.store import SqlStore
from gpuwatchd.store.urls import store_target

#: What a reader not told where the store is may be pointed at instead.
STORE_HINT = "set $GPUWATCHD_STORE (or --store)"


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


def find_store_file(candidates: Sequence[Path], winners_url: str) -> Path:
    """The first of ``candidates`` that is a file; else StoreError naming every place
    looked and where a running daemon serves its winners instead."""
    for path in candidates:
        if path.is_file():
            return path
    looked = " or ".join(map(str, dict.fromkeys(candidates)))
    raise StoreError(
        f"no store file at {looked}; {STORE_HINT}, or read a running daemon's winners "
        f"at {winners_url}"
    )


def sim_state_dir() -> Path:
    """Where a daemon on a simulated or replayed GPU keeps its store and control socket
    unless told: ``$XDG_RUNTIME_DIR/gpuwatchd-sim`` (gone at logout or reboot), else
    ``gpuwatchd-sim-UID`` in the temporary directory. Its winners were never measured on
    a real GPU, so they never go where the system daemon's and the jobs' are."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "gpuwatchd-sim"
    return Path(tempfile.gettempdir()) / f"gpuwatchd-sim-{os.geteuid()}"


def sim_state_dirs() -> list[Path]:
    """Where a reader looks for a simulated daemon: :func:`sim_state_dir`, and for root
    also the directories of the users a demo started as root becomes (``gpuwatchd``, else
    ``nobody``: :mod:`gpuwatchd.daemon.privileges`)."""
    found = [sim_state_dir()]
    if os.geteuid() == 0:
        for name in ("gpuwatchd", "nobody"):
            with contextlib.suppress(KeyError):
                uid = pwd.getpwnam(name).pw_uid
                found.append(Path(tempfile.gettempdir()) / f"gpuwatchd-sim-{uid}")
    return found


def make_private_dir(path: Path) -> Path:
    """``path`` as a directory of this user's that nobody else may enter (created 0700);
    StoreError when something else is there (another user's, a link, open to others)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise StoreError(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise StoreError(
            f"{path}: not a private directory of uid {os.geteuid()} (mode 0700); "
            "remove it, or pass --state-dir"
        )
    return path
