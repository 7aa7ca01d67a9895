"""Who runs a GPU process: the user name behind a PID, read from ``/proc/<pid>/status``.

NVML names the compute processes on a GPU by PID only; ``gpuwatchd status`` shows whose
they are. The real uid (``Uid:``'s first field) is mapped to a name through the
password database (the uid itself where it has none, as in a container). ``proc_root``
is injectable so tests need no real process. A process that is gone reads as None.
"""

from __future__ import annotations

import pwd


def process_uid(pid: int, proc_root: str = "/proc") -> int | None:
    """The real uid of ``pid``, or None when the process is gone or unreadable."""
    try:
        with open(f"{proc_root}/{int(pid)}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_user(pid: int, proc_root: str = "/proc") -> str | None:
    """The user name ``pid`` runs as (its uid as text without one), or None."""
    uid = process_uid(pid, proc_root)
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
