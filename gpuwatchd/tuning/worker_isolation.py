"""How the tuning worker is started apart from the daemon: path, directory, environment, user.

The worker imports users' kernels, so it gets only what tuning needs:

- ``python -P``: no directory of the daemon's choosing (the working directory, a
  script's folder) goes first on ``sys.path``, so a ``json.py`` left in a writable
  working directory is never imported. ``-I`` would also drop ``PYTHONPATH``, which is
  how the worker finds this very package and the jobs' kernel modules, so it is not used;
- working directory ``/`` (:data:`WORKER_CWD`), which only root can write to;
- a minimal environment (:func:`worker_environment`): the search path, locale, home and
  temporary directory, and the CUDA, NVIDIA, Triton, Inductor and torch settings; the
  daemon's other variables (a store password in ``PGPASSWORD``, ``NOTIFY_SOCKET``,
  proxies, ``PYTHONSTARTUP``...) stay with the daemon. ``PYTHONPATH`` keeps its absolute
  entries only (an empty or relative entry means the working directory);
- optionally another user (:func:`resolve_worker_user`, ``[tuning] worker_user``): a
  daemon running as root starts the worker as that user, with its groups and home.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass

#: The worker's working directory: not writable by job users.
WORKER_CWD = "/"
#: Interpreter options of the worker: no unsafe first entry on sys.path (Python 3.11+).
PYTHON_FLAGS = ("-P",)
#: Variables passed to the worker by exact name.
KEPT_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH"}
)
#: Variables passed to the worker by prefix: locale, GPU stack and compiler caches.
KEPT_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "TRITON_",
    "TORCHINDUCTOR_",
    "TORCH_",
    "PYTORCH_",
    "CUBLAS_",
    "CUBLASLT_",
    "CUDNN_",
    "OMP_",
)


def kept(name: str) -> bool:
    """Whether the daemon's variable ``name`` is passed on to the worker."""
    return name in KEPT_NAMES or name.startswith(KEPT_PREFIXES)


def absolute_entries(path: str) -> list[str]:
    """``PYTHONPATH``'s absolute entries: an empty or relative one means the cwd."""
    return [p for p in path.split(os.pathsep) if os.path.isabs(p)]


@dataclass(frozen=True, slots=True)
class WorkerUser:
    """Who the worker runs as, when not the daemon's own user."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def resolve_worker_user(name: str, where: str = "tuning.worker_user") -> WorkerUser | None:
    """``[tuning] worker_user`` on this host: None for "" (the daemon's user).

    ValueError naming the setting when no such user exists.
    """
    if not name:
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise ValueError(f"{where}: no user {name!r} on this host") from None
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return WorkerUser(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def switch_user(user: WorkerUser | None) -> WorkerUser | None:
    """The user to switch to: ``user`` when this process is root and is not that user
    already (only root can switch; anyone else already runs unprivileged)."""
    if user is None or os.geteuid() != 0 or user.uid == 0:
        return None
    return user


def worker_environment(
    source: Mapping[str, str], package_root: str, user: WorkerUser | None = None
) -> dict[str, str]:
    """The worker's environment from the daemon's ``source``: the kept variables, a
    ``PYTHONPATH`` of ``package_root`` and ``source``'s absolute entries, and the
    switched-to user's identity and home."""
    env = {k: v for k, v in source.items() if kept(k)}
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root, *absolute_entries(source.get("PYTHONPATH", ""))]
    )
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    return env
