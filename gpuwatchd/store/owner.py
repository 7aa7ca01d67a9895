"""Which process owns a running session, and whether that process is still alive.

A session is ``running`` in the store only while the process that started it lives: a
process killed mid-session (SIGKILL, OOM, power loss) cannot finish its rows, so the
next process to open the store for tuning marks them failed. Liveness is judged on
this host by PID, and the caller's own PID counts as gone: a process that has just
started owns no session yet, so a row carrying its PID was left by an earlier
process that had the same PID (a container's daemon is often PID 1 every time).
"""

from __future__ import annotations

import os
from collections.abc import Callable

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
