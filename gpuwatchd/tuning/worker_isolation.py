"""How the tuning worker is started apart from the daemon: path, directory, environment, user.

The worker imports users' kernels, so it gets only what tuning needs:

- ``python -P -s``: no directory of the daemon's choosing (the working directory, a
  script's folder) goes first on ``sys.path``, so a ``json.py`` left in a writable
  working directory is never imported, and no user-site folder is on it, so a ``.pth``
  in the worker user's ``~/.local`` never runs. ``-I`` (or ``-E``) would also drop
  ``PYTHONPATH``, which is how the worker finds this very package and the jobs' kernel
  modules, so it is not used;
- working directory ``/`` (:data:`WORKER_CWD`), which only root can write to;
- private folders (:data:`PRIVATE_DIRS`): Triton's and Inductor's compile caches, the
  CUDA JIT cache and the temporary folder point into ``worker-<uid>`` under the cache
  directory, each 0700 and the worker's own (:func:`ensure_private_dirs` refuses one
  owned by someone else or writable by others). Inductor's default,
  ``/tmp/torchinductor_<user>``, is a folder any local user could create first and
  seed with the module Inductor is about to generate;
- a minimal environment (:func:`worker_environment`): the search path, locale, home,
  and the CUDA, NVIDIA, Triton, Inductor and torch settings; the
  daemon's other variables (a store password in ``PGPASSWORD``, ``NOTIFY_SOCKET``,
  proxies, ``PYTHONSTARTUP``...) stay with the daemon. ``PYTHONPATH`` keeps its absolute
  entries only (an empty or relative entry means the working directory);
- optionally another user (:func:`resolve_worker_user`, ``[tuning] worker_user``): a
  daemon running as root starts the worker as that user, with its groups and home.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: The worker's working directory: not writable by job users.
WORKER_CWD = "/"
#: Interpreter options of the worker: no unsafe first entry on sys.path (Python 3.11+).
PYTHON_FLAGS = ("-P", "-s")
#: Variables passed to the worker by exact name.
KEPT_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH"}
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
    root = private_root(source, os.geteuid() if user is None else user.uid)
    if user is not None:
        make_private_root(root, user)
    env.update({name: str(root / sub) for name, sub in PRIVATE_DIRS.items()})
    return env


# -- the worker's private folders ------------------------------------------------------------

#: The worker's private folders, by the variable that points its tools there: Triton's
#: home (its dump and override folders) and compile cache, Inductor's compile cache, the
#: CUDA JIT cache, the XDG cache (torch's hub and kernels) and temporary files.
PRIVATE_DIRS = {
    "TRITON_HOME": "triton-home",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUDA_CACHE_PATH": "nv",
    "XDG_CACHE_HOME": "cache",
    "TMPDIR": "tmp",
}


class PrivateDirError(RuntimeError):
    """A private folder of the worker that is not private: one line naming it."""


def cache_dir(source: Mapping[str, str]) -> Path:
    """gpuwatchd's cache directory: systemd's ``$CACHE_DIRECTORY``, else
    ``/var/cache/gpuwatchd`` for root, else ``$XDG_CACHE_HOME/gpuwatchd`` (``~/.cache``)."""
    systemd = source.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/cache/gpuwatchd")
    xdg = source.get("XDG_CACHE_HOME")
    return Path(xdg if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "gpuwatchd"


def private_root(source: Mapping[str, str], uid: int) -> Path:
    """The folder holding the private folders of a worker running as ``uid``."""
    return cache_dir(source) / f"worker-{uid}"


def make_private_root(root: Path, user: WorkerUser) -> None:
    """As root, before starting the worker as ``user``: ``root`` made 0700 and ``user``'s,
    its parent searchable (not listable) by ``user``."""
    root.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    parent = os.lstat(root.parent)
    if parent.st_uid == 0 and not parent.st_mode & stat.S_IXOTH:
        os.chmod(root.parent, stat.S_IMODE(parent.st_mode) | 0o011)
    try:
        os.mkdir(root, 0o700)
        os.chown(root, user.uid, user.gid, follow_symlinks=False)
    except FileExistsError:
        pass
    _check_private(root, user.uid)


def _check_private(path: Path, uid: int) -> None:
    """PrivateDirError unless ``path`` is a folder (not a link) of ``uid`` that no one
    else may write to."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"worker folder {path}: not a folder; refusing to use it")
    if st.st_uid != uid:
        raise PrivateDirError(
            f"worker folder {path}: owned by uid {st.st_uid}, not the worker's uid {uid}; "
            "refusing to use it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PrivateDirError(
            f"worker folder {path}: writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "refusing to use it"
        )


def ensure_private_dirs(environ: Mapping[str, str]) -> None:
    """In the worker, before torch or Triton is imported: every folder of
    :data:`PRIVATE_DIRS` that ``environ`` names, and the folder holding it, exists 0700
    and is this process's own; PrivateDirError (one line) otherwise."""
    uid = os.geteuid()
    for name in PRIVATE_DIRS:
        value = environ.get(name)
        if not value:
            continue
        path = Path(value)
        if not path.is_absolute():
            raise PrivateDirError(f"worker folder {name}={value!r}: not an absolute path")
        for folder in (path.parent, path):
            try:
                folder.mkdir(mode=0o700, parents=folder == path.parent)
            except FileExistsError:
                pass
            except OSError as e:
                raise PrivateDirError(f"worker folder {folder}: {e.strerror or e}") from None
            _check_private(folder, uid)
