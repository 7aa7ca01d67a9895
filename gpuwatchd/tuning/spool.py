"""The spool: tuning requests that jobs leave for a daemon that is not running.

A job writes each request atomically (a hidden temporary file in the same directory,
fsync, then ``os.replace`` onto its final name), so a reader never sees half a file. The
file name is derived from the request's workload, so the same kernel and key filed by
many jobs is one file, replaced in place. The daemon reads the directory at start
(:func:`read_spool`): every good request is returned, every bad file is moved into
``rejected/`` beside a ``.reason`` file holding the one-line why. A file is only taken
away (:func:`remove_entry`) once the daemon has the request, and only if it is still the
file that was read: a newer write of the same request is never lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatchd.tuning.kernels import MAX_REQUEST_BYTES, KernelRequest, KernelRequestError
from gpuwatchd.tuning.regular_file import NotReadable, read_regular
from gpuwatchd.validate import one_line

#: Overrides where jobs spool and the daemon reads.
SPOOL_ENV = "GPUWATCHD_SPOOL"
#: The spool's folder name inside the daemon's state directory.
SPOOL_NAME = "spool"
REJECTED_DIR = "rejected"
SUFFIX = ".json"
TMP_PREFIX = ".tmp-"
#: Temporary files older than this were left by a writer that died; the reader removes them.
STALE_TMP_S = 3600.0
#: The most request files one scan reads; the rest wait for the next scan.
MAX_FILES = 10_000


def spool_file_name(request: KernelRequest) -> str:
    """One file per (kernel identity, key): ``<identity16>-<workload hash16>.json``."""
    digest = hashlib.sha256(request.workload_name.encode("utf-8")).hexdigest()
    return f"{request.identity[:16]}-{digest[:16]}{SUFFIX}"


def write_request(directory: str | os.PathLike[str], request: KernelRequest) -> Path:
    """Write ``request`` into the spool atomically and durably; returns its path.

    Creates the directory (mode 0o770 less the umask) when missing. OSError when it
    cannot be written.
    """
    data = (request.dumps() + "\n").encode("utf-8")
    return write_atomically(Path(directory), spool_file_name(request), data)


def write_atomically(folder: Path, name: str, data: bytes) -> Path:
    """Write ``folder/name`` so that a reader sees the old file or the whole new one.

    A hidden temporary file in ``folder`` (created mode 0o770 less the umask when
    missing), fsync, ``os.replace``, fsync of the folder. OSError when it cannot.
    """
    folder.mkdir(mode=0o770, parents=True, exist_ok=True)
    final = folder / name
    tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(folder)
    return final


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """A good request read from the spool, and which file (inode) it came from."""

    path: Path
    request: KernelRequest
    inode: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A spool file that was not a good request: where it went, and why (one line)."""

    name: str
    reason: str
    moved_to: Path | None  # None when it could not be moved (it stays where it was)


@dataclass(slots=True)
class SpoolScan:
    """What one scan of the spool found."""

    entries: list[SpoolEntry] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    left: int = 0  # request files beyond ``max_files``, left for a later scan


def read_spool(
    directory: str | os.PathLike[str],
    *,
    max_files: int = MAX_FILES,
    now: float | None = None,
) -> SpoolScan:
    """Every request file of the spool: good ones returned, bad ones moved aside.

    Oldest files first. A missing directory is an empty spool. Hidden files are
    writers' temporaries: left alone, or removed once older than :data:`STALE_TMP_S`.
    """
    folder = Path(directory)
    scan = SpoolScan()
    try:
        names = request_files(folder, time.time() if now is None else now)
    except (NotReadable, OSError) as e:
        reason = e.reason if isinstance(e, NotReadable) else one_line(e)
        scan.rejected.append(Rejected(folder.name, reason, None))
        return scan
    scan.left = max(0, len(names) - max_files)
    for name in names[:max_files]:
        _read_one(folder, name, scan)
    return scan


def request_files(folder: Path, now: float) -> list[str]:
    """The ``*.json`` files directly in ``folder``, oldest first (none: no folder).
    NotReadable when ``folder`` is there but not a directory of its own.

    Hidden files are writers' temporaries: left alone, or removed once older than
    :data:`STALE_TMP_S`.
    """
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):  # a link could send the reader into any folder
        raise NotReadable(folder, "not a directory (a link or a special file); not read")
    names = sorted(os.listdir(folder))
    files: list[tuple[float, str]] = []
    for name in names:
        path = folder / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if name.startswith(TMP_PREFIX):
            if now - st.st_mtime > STALE_TMP_S:
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        if name.startswith(".") or not name.endswith(SUFFIX):
            continue
        files.append((st.st_mtime, name))
    files.sort()
    return [name for _, name in files]


def _read_one(folder: Path, name: str, scan: SpoolScan) -> None:
    path = folder / name
    try:
        data, inode = read_regular(path, MAX_REQUEST_BYTES, follow_symlinks=False)
        request = KernelRequest.loads(data)
    except FileNotFoundError:
        return  # taken by another reader
    except NotReadable as e:
        scan.rejected.append(reject_file(folder, name, None, e.reason))
        return
    except KernelRequestError as e:
        scan.rejected.append(reject_file(folder, name, inode, one_line(e)))
        return
    scan.entries.append(SpoolEntry(path, request, inode))


def reject_file(folder: Path, name: str, inode: int | None, reason: str) -> Rejected:
    """Move a bad file into ``rejected/`` with its reason; undo if a writer got in between."""
    aside = folder / REJECTED_DIR
    target = aside / name
    try:
        aside.mkdir(mode=0o770, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(aside).st_mode):  # a planted link must not steer moves
            return Rejected(name, reason, None)
        if os.path.lexists(target):  # an earlier rejection of the same name, perhaps a folder
            target = aside / f"{name}.{os.urandom(4).hex()}"
        os.replace(folder / name, target)
    except OSError:
        return Rejected(name, reason, None)
    if inode is not None and os.stat(target).st_ino != inode:
        # A writer replaced the bad file with a new request before the move: put it back
        # unless an even newer write is already there (same request, so nothing is lost).
        with contextlib.suppress(OSError):
            os.link(target, folder / name)
        with contextlib.suppress(OSError):
            target.unlink()
        return Rejected(name, reason + " (a newer write was kept)", None)
    reason_file = aside / (target.name + ".reason")
    with contextlib.suppress(OSError):
        tmp = aside / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        tmp.write_text(reason + "\n", encoding="utf-8")
        os.replace(tmp, reason_file)
    return Rejected(name, reason, target)


def remove_entry(entry: SpoolEntry) -> bool:
    """Delete an entry's file once the daemon holds its request.

    Only when the file is still the one that was read (same inode): a newer write of the
    same request stays for the next scan. Returns whether a file was removed.
    """
    folder = entry.path.parent
    taken = folder / f"{TMP_PREFIX}taken-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.replace(entry.path, taken)
    except FileNotFoundError:
        return False
    if os.stat(taken).st_ino != entry.inode:
        with contextlib.suppress(OSError):  # a newer write: put it back unless newer still
            os.link(taken, entry.path)
        taken.unlink()
        return False
    taken.unlink()
    return True
