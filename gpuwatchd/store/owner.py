"""Which process owns a running session, and whether that process is still alive.

A session is ``running`` in the store only while the process that started it lives: a
process killed mid-session (SIGKILL, OOM, power loss) cannot finish its rows, so the
next process to open the store for tuning marks them failed. Liveness is judged on
this host by PID, and the caller's own PID counts as gone: a process that has just
started owns no session yet, so a row carrying its PID was left by an earlier
process that had the same PID (a container's daemon is often PID 1 every time).

PIDs mean something only on their host, so on a shared store each host holds its name
under a lease (:func:`take_host`) naming its machine, boot and process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatchd.store import claims
from gpuwatchd.store.columns import HOST_LEASE_COLUMNS
from gpuwatchd.store.conn import Conn

#: How a caller asks whether a PID is alive (tests inject their own).
Alive = Callable[[int], bool]


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (another user's counts too)."""
    if pid <= 0:  # 0 and negative PIDs name process groups, never one process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, OSError):
        return False
    return True


def orphaned(owner_pid: int | None, alive: Alive = pid_alive) -> bool:
    """Whether a running session with this owner was left behind by a process that is gone.

    A session from before owners were recorded (``None``) has no process to ask: gone.
    """
    if owner_pid is None or owner_pid == os.getpid():
        return True
    return not alive(owner_pid)


# -- the host name's lease ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a host name's lease: the machine (its id), its boot and the process (a
    random nonce per process)."""

    machine: str
    boot_id: str
    nonce: str


@dataclass(frozen=True, slots=True)
class HostLease:
    """The answer to a try at the lease: ``held`` by us, else who holds it and until when."""

    held: bool
    holder: Holder | None = None
    expires_at: float = 0.0


# Taken when free, lapsed, or held by this machine in this boot (a restart, or us), or by
# a daemon that names no boot (one older than the boot column): never from a live process
# of another boot under the same machine id, which is a cloned image or a reboot whose
# lease has not lapsed yet.
_TAKE_HOST = claims.take_sql(
    HOST_LEASE_COLUMNS,
    """
           AND (claims.boot_id IS NULL OR claims.boot_id = excluded.boot_id
                OR claims.nonce = excluded.nonce)""",
)


def take_host(
    conn: Conn, key: str, host: str, me: Holder, now: float, ttl_s: float, *, names_boot: bool
) -> HostLease:
    """Take or renew the lease on host name ``host`` (claim ``key``) for ``ttl_s``;
    ``names_boot``: this gpuwatchd's schema has the lease's boot and nonce columns (else
    it is taken as a work claim, by machine id alone)."""
    pid = os.getpid()
    if not names_boot:
        if claims.take(conn, key, host, me.machine, pid, now, ttl_s):
            return HostLease(True)
        row = conn.execute("SELECT gpu_uuid FROM claims WHERE claim_key = ?", (key,))
        return HostLease(False, Holder(str(row.fetchone()["gpu_uuid"]), "", ""))
    args = (key, host, me.machine, pid, now, now + ttl_s, me.boot_id, me.nonce)
    if conn.execute(_TAKE_HOST, args).fetchone() is not None:
        return HostLease(True)
    row = conn.execute(
        "SELECT gpu_uuid, boot_id, nonce, expires_at FROM claims WHERE claim_key = ?", (key,)
    ).fetchone()
    holder = Holder(str(row["gpu_uuid"]), str(row["boot_id"] or ""), str(row["nonce"] or ""))
    return HostLease(False, holder, float(row["expires_at"]))
