"""``gpuwatchd run`` started as root gives root up before it reads anything from outside.

The daemon takes job input (the control socket, the spool, added workloads) and needs no
privilege for its work: NVML reads and CUDA need only the device nodes, which NVIDIA
makes 0666 (or group ``video``). So a root start becomes ``[daemon] user`` for good
(uid, primary and supplementary groups) right after reading the config, or refuses in
one line when that user does not exist or is root. Like systemd's ``StateDirectory=``,
``RuntimeDirectory=`` and ``CacheDirectory=``, it first makes the folders it would have
used as root (``/var/lib/gpuwatchd``, ``/run/gpuwatchd``, ``/var/cache/gpuwatchd``) that
user's and points the daemon at them; one that already belongs to someone else is
refused rather than taken over.

A simulated or replayed daemon (the README's demo) touches none of those folders: run as
root it becomes ``[daemon] user``, or ``nobody`` where that user does not exist, and keeps
its store, socket and caches in that user's private throwaway directory.

``GPUWATCHD_ALLOW_ROOT=1`` in root's own environment keeps root (a test suite run as
root, a throwaway container), with a warning; no job can set it.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.config import Config

log = logging.getLogger(__name__)

#: Backends whose GPUs are not this host's (the demo): no system folder is made for them.
SIMULATED = ("sim", "replay")
#: Whom a simulated daemon started as root becomes when ``[daemon] user`` does not exist.
FALLBACK_USER = "nobody"
#: Root's own opt-out: keep running as root (with a warning).
ALLOW_ROOT = "GPUWATCHD_ALLOW_ROOT"


class PrivilegeError(RuntimeError):
    """A root start that cannot give root up: one line saying why and what to do."""


@dataclass(frozen=True, slots=True)
class SystemDir:
    """A folder a root start prepares: the variable naming it, its path and mode."""

    variable: str
    path: Path
    mode: int


#: What systemd's unit gets from StateDirectory=, RuntimeDirectory= (0750: the daemon
#: gives it to ``control_group``, whose members reach the socket) and CacheDirectory=.
SYSTEM_DIRS = (
    SystemDir("STATE_DIRECTORY", Path("/var/lib/gpuwatchd"), 0o700),
    SystemDir("RUNTIME_DIRECTORY", Path("/run/gpuwatchd"), 0o750),
    SystemDir("CACHE_DIRECTORY", Path("/var/cache/gpuwatchd"), 0o700),
)


def _refuse(why: str) -> PrivilegeError:
    return PrivilegeError(
        f"gpuwatchd run: started as root; {why} (the daemon takes job input and never "
        "runs as root: create the user, or start gpuwatchd as an unprivileged user)"
    )


def _user(name: str) -> pwd.struct_passwd:
    if not name:
        raise _refuse("[daemon] user is empty")
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise _refuse(f"[daemon] user {name!r} does not exist on this host") from None
    if entry.pw_uid == 0:
        raise _refuse(f"[daemon] user {name!r} is root")
    return entry


def _sim_user(name: str) -> pwd.struct_passwd:
    """A simulated daemon's user: ``[daemon] user`` where it exists, else ``nobody``."""
    try:
        return _user(name)
    except PrivilegeError:
        return _user(FALLBACK_USER)


def install_paths() -> tuple[Path, ...]:
    """What the daemon and its worker read after root is given up: the interpreter and
    gpuwatchd's own package (modules load lazily, long after the start)."""
    import gpuwatchd

    return (Path(os.path.realpath(sys.executable)), Path(gpuwatchd.__file__).resolve().parent)


def unreadable(user: pwd.struct_passwd, paths: tuple[Path, ...]) -> Path | None:
    """The first of ``paths`` that ``user`` cannot use (run a file: execute permission;
    a folder: read and enter), checked in a forked child that has become ``user``; None
    when it can use them all."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status only
        code = 0
        try:
            os.setgroups(os.getgrouplist(user.pw_name, user.pw_gid))
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            code = next((i + 1 for i, p in enumerate(paths) if not os.access(p, _needs(p))), 0)
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    return paths[code - 1] if 0 < code <= len(paths) else paths[0]


def _needs(path: Path) -> int:
    return os.R_OK | os.X_OK if path.is_dir() else os.X_OK


def _own_dir(d: SystemDir, uid: int, gid: int) -> None:
    """``d`` exists as a folder (not a link) of ``uid``; created with ``gid`` and its mode."""
    try:
        os.mkdir(d.path, d.mode)
        os.chown(d.path, uid, gid, follow_symlinks=False)
        os.chmod(d.path, d.mode, follow_symlinks=False)
    except FileExistsError:
        pass
    st = os.lstat(d.path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise PrivilegeError(
            f"gpuwatchd run: {d.path} belongs to uid {st.st_uid}, not the daemon's user "
            f"(uid {uid}); hand it over (chown -R {uid}: {d.path}) or remove it"
        )


def drop_root(
    cfg: Config, environ: MutableMapping[str, str] = os.environ
) -> pwd.struct_passwd | None:
    """As root: become ``cfg.daemon.user`` for good and return its entry; None (nothing
    done) when not started as root. PrivilegeError (one line) when it cannot."""
    if os.geteuid() != 0 and os.getuid() != 0:
        return None
    if environ.get(ALLOW_ROOT) == "1":
        return None  # `gpuwatchd run` warns once the daemon is up (warn_if_root)
    simulated = cfg.daemon.backend in SIMULATED
    user = _sim_user(cfg.daemon.user) if simulated else _user(cfg.daemon.user)
    blocked = unreadable(user, install_paths())
    if blocked is not None and simulated:
        # Its socket and spool sit in root's private 0700 folder: only root can hand it work.
        log.warning(
            "started as root: %s cannot read %s, so this simulated daemon keeps root (only "
            "root reaches its private folder); install gpuwatchd where %s can read it to "
            "run it as that user",
            user.pw_name,
            blocked,
            user.pw_name,
        )
        return None
    if blocked is not None:
        raise _refuse(
            f"[daemon] user {user.pw_name!r} cannot read {blocked} (install gpuwatchd "
            "where that user can read it, e.g. in /opt)"
        )
    configured = {
        "STATE_DIRECTORY": cfg.daemon.state_dir,
        "RUNTIME_DIRECTORY": cfg.daemon.control_socket,
    }
    for d in () if simulated else SYSTEM_DIRS:
        if configured.get(d.variable) or environ.get(d.variable):
            continue  # the admin's choice: theirs to give the user
        _own_dir(d, user.pw_uid, user.pw_gid)
        environ[d.variable] = str(d.path)
    os.setgroups(os.getgrouplist(user.pw_name, user.pw_gid))
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:  # pragma: no cover - the kernel let us back: never carry on as root
        raise PrivilegeError("gpuwatchd run: could not give root up (setuid(0) still works)")
    environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    if simulated:  # root's runtime and cache folders are not this user's
        from gpuwatchd.store.location import sim_state_dir

        environ.pop("XDG_RUNTIME_DIR", None)
        environ["CACHE_DIRECTORY"] = str(sim_state_dir())
    return user


def warn_if_root() -> None:
    """One warning from a daemon that kept root (``GPUWATCHD_ALLOW_ROOT=1``), once it is up."""
    if os.geteuid() == 0 and os.environ.get(ALLOW_ROOT) == "1":
        log.warning("running as root (%s=1): job input is handled with root's power", ALLOW_ROOT)
