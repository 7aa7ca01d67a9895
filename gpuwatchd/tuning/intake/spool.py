"""The spool: requests that jobs leave for the daemon, of two kinds, in one folder.

Layout of the spool directory (``[tuning] spool_dir``)::

    *.json            kernel tuning requests, one file per (kernel identity, key)
    workloads/*.json  ``add_workloads`` requests, one file per set of workload names
    rejected/         files the daemon refused, each beside ``NAME.reason`` (one line)

A writer (a job) writes each file atomically: a hidden temporary file in the same folder,
fsync, rename onto its final name, so a reader never sees half a file, and the same
request filed again replaces its file in place.

The daemon reads it through :class:`Spool`, which never resolves a path inside the spool
twice: it opens the spool directory once (``O_DIRECTORY | O_NOFOLLOW``) and holds it;
every sub-folder is created by the daemon and opened relative to that descriptor with
``O_NOFOLLOW``, and every read, move and removal is relative to an open folder
descriptor. A writer who swaps a sub-folder for a link, or for a folder of its own,
changes where the daemon reads at most, never where it deletes or writes outside the
spool. ``rejected/`` is the daemon's own (checked: owned by it, writable by nobody else).

A scan picks the oldest files within a per-scan file and byte budget and parses one at a
time, so memory holds one file; the rest wait for the next scan. A file is read (open,
``fstat``: a regular file of at most one link within its kind's size cap) and parsed
once into its typed request; a bad one is moved into ``rejected/`` then and there. A
file the daemon keeps (:meth:`Spool.hold`) is not read again until it changes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import json
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpuwatchd.tuning.submitted.kernels import MAX_REQUEST_BYTES, KernelRequest
from gpuwatchd.tuning.submitted.regular_file import MAX_FILE_BYTES, NotReadable, read_regular
from gpuwatchd.validate import load_json, one_line

if TYPE_CHECKING:  # parsed where read: a job that only writes kernel requests skips them
    from gpuwatchd.tuning.intake.workload_requests import AddRequest

log = logging.getLogger(__name__)
R = TypeVar("R")

REJECTED_DIR = "rejected"
SUFFIX = ".json"
TMP_PREFIX = ".tmp-"
#: Temporary files older than this were left by a writer that died; the reader removes them.
STALE_TMP_S = 3600.0
#: The most request files one scan reads; the rest wait for the next scan.
MAX_FILES = 256
#: The most bytes one scan reads (each file is read and parsed alone).
MAX_SCAN_BYTES = 32 * 2**20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Kind(Generic[R]):
    """One kind of request: the sub-folder it lives in ("" for the top), its size cap,
    its parser (bytes -> typed request, ValueError naming the bad field) and what logs
    call it."""

    folder: str
    max_bytes: int
    parse: Callable[[bytes], R]
    what: str


def _parse_add(data: bytes) -> AddRequest:
    from gpuwatchd.tuning.intake.workload_requests import parse_add_request

    return parse_add_request(load_json(data, "request"))  # capped as read: MAX_FILE_BYTES


KERNEL: Kind[KernelRequest] = Kind("", MAX_REQUEST_BYTES, KernelRequest.loads, "kernel request")
WORKLOADS: Kind[AddRequest] = Kind("workloads", MAX_FILE_BYTES, _parse_add, "workloads")
#: The sub-folder of ``add_workloads`` requests.
SUBDIR = WORKLOADS.folder
#: The sub-folders the daemon makes (``rejected/`` private to it).
_FOLDERS = (SUBDIR, REJECTED_DIR)


class SpoolError(OSError):
    """The spool (or one of its folders) cannot be used: one line saying why."""


@dataclass(frozen=True, slots=True)
class SpoolEntry(Generic[R]):
    """A good request read from the spool, and which file (name, inode) it came from."""

    kind: Kind[R]
    name: str
    request: R
    inode: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A spool file (or folder) that was not a good request: where it went, and why."""

    name: str
    reason: str
    moved_to: Path | None  # None when it could not be moved (it stays where it was)


# -- writing (jobs, and the daemon for requests it was handed) ----------------------------


def spool_file_name(request: KernelRequest) -> str:
    """One file per (kernel identity, key): ``<identity16>-<workload hash16>.json``."""
    digest = hashlib.sha256(request.workload_name.encode("utf-8")).hexdigest()
    return f"{request.identity[:16]}-{digest[:16]}{SUFFIX}"


def workloads_file_name(doc: dict[str, Any]) -> str:
    """``<hash of the sorted workload names>.json``: one file per set of workloads."""
    names = sorted(str(w.get("name")) for w in doc.get("workloads", []) if isinstance(w, dict))
    digest = hashlib.sha256("\n".join(names).encode("utf-8")).hexdigest()
    return f"{digest[:24]}{SUFFIX}"


def write_request(directory: str | os.PathLike[str], request: KernelRequest) -> Path:
    """Write a kernel request into the spool ``directory`` atomically; its path. OSError."""
    data = (request.dumps() + "\n").encode("utf-8")
    return write_atomically(Path(directory), spool_file_name(request), data)


def write_workload_request(spool_dir: str | os.PathLike[str], doc: dict[str, Any]) -> Path:
    """Validate ``doc`` (an ``add_workloads`` request) and write it into the spool's
    ``workloads/`` atomically; its path. ValueError for a bad request, OSError."""
    from gpuwatchd.tuning.intake.workload_requests import parse_add_request

    parse_add_request(doc)
    data = (json.dumps(doc) + "\n").encode("utf-8")
    return write_atomically(Path(spool_dir) / SUBDIR, workloads_file_name(doc), data)


def write_atomically(folder: Path, name: str, data: bytes) -> Path:
    """Write ``folder/name`` so that a reader sees the old file or the whole new one.

    Creates ``folder`` (mode 0o770 less the umask) when missing. OSError when it cannot
    be written.
    """
    folder.mkdir(mode=0o770, parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_at(fd, name, data)
    finally:
        os.close(fd)
    return folder / name


def _write_at(dir_fd: int, name: str, data: bytes) -> os.stat_result:
    """Write ``name`` in the open folder atomically and durably; the file's ``fstat``."""
    tmp = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o660, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)
    return st


# -- reading (the daemon) -----------------------------------------------------------------


@dataclass(slots=True)
class Scan(Generic[R]):
    """One scan of a kind's folder: the files picked (oldest first, within the budget),
    read and parsed one at a time as the scan is iterated, and how many wait."""

    spool: Spool
    kind: Kind[R]
    names: list[str] = field(default_factory=list)
    left: int = 0  # request files beyond the budget, left for a later scan
    problem: Rejected | None = None  # the folder itself could not be read

    def __iter__(self) -> Iterator[SpoolEntry[R] | Rejected]:
        if self.problem is not None:
            yield self.problem
        for name in self.names:
            item = self.spool.read(self.kind, name)
            if item is not None:
                yield item


class Spool:
    """The daemon's handle on the spool directory ``path``. Thread-safe.

    The directory is created (0o770 less the umask) and opened at first use, then held
    until :meth:`close` (each use works on a duplicate, so closing never pulls it from
    under a scan); a failure is a :class:`SpoolError` (one line), tried again at the
    next use.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_files: int = MAX_FILES,
        max_bytes: int = MAX_SCAN_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._clock = clock
        self._fd: int | None = None
        self._closed = False
        self._closer: weakref.finalize[[int], Spool] | None = None  # closes a dropped one
        self._lock = threading.Lock()
        #: Files the daemon keeps, by (folder, name): (inode, mtime_ns). Not read again.
        self._held: dict[tuple[str, str], tuple[int, int]] = {}

    def close(self) -> None:
        with self._lock:
            closer, self._fd, self._closer = self._closer, None, None
            self._closed = True
        if closer is not None:
            closer()

    # -- folders ---------------------------------------------------------------------

    def _spool_fd(self) -> int:
        """A duplicate of the held spool descriptor (the caller closes it)."""
        with self._lock:
            if self._closed:
                raise SpoolError(f"{self.path}: closed")
            if self._fd is None:
                try:
                    self.path.mkdir(mode=0o770, parents=True, exist_ok=True)
                    self._fd = os.open(self.path, _DIR_FLAGS)
                except OSError as e:
                    raise SpoolError(f"{self.path}: {_why(e)}") from None
                self._closer = weakref.finalize(self, os.close, self._fd)
                for name in _FOLDERS:  # the daemon's before a writer makes one
                    with contextlib.suppress(OSError):
                        os.close(self._subfolder(self._fd, name))
            return os.dup(self._fd)

    @contextlib.contextmanager
    def _folder(self, folder: str) -> Iterator[int]:
        """An open descriptor of a folder of the spool ("" is the spool itself)."""
        top = self._spool_fd()
        try:
            fd = self._subfolder(top, folder) if folder else top
            try:
                yield fd
            finally:
                if fd != top:
                    os.close(fd)
        finally:
            os.close(top)

    def _subfolder(self, top: int, name: str) -> int:
        """Open (creating it) the sub-folder ``name`` relative to the spool's descriptor.

        Created by the daemon with the spool's group and permissions (the audience the
        admin gave the spool), less write for others than the daemon when ``private``.
        Anything else found under that name (a link, a file; for a private folder one
        the daemon does not own or others may write) is renamed aside to a hidden name
        in the spool and replaced by a new folder. SpoolError when that fails.
        """
        private = name == REJECTED_DIR
        for attempt in range(2):
            created = _mkdir_at(top, name)
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=top)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR) or attempt:
                    raise SpoolError(f"{self.path / name}: {_why(e)}") from None
                self._move_aside(top, name)
                continue
            if created:
                _adopt(fd, os.fstat(top), private)
            st = os.fstat(fd)
            if private and (st.st_uid != os.geteuid() or st.st_mode & 0o022):
                os.close(fd)
                if attempt:
                    raise SpoolError(f"{self.path / name}: not the daemon's own folder")
                self._move_aside(top, name)
                continue
            return fd
        raise AssertionError("unreachable")  # pragma: no cover

    def _move_aside(self, top: int, name: str) -> None:
        aside = f".{name}-foreign-{os.urandom(4).hex()}"
        try:
            os.rename(name, aside, src_dir_fd=top, dst_dir_fd=top)
        except OSError:  # gone meanwhile, or cannot: the next attempt says why
            return
        log.warning("%s was not the daemon's folder: moved aside to %s, a new one made",
                    self.path / name, aside)  # fmt: skip

    # -- scanning and reading ----------------------------------------------------------

    def scan(self, kind: Kind[R]) -> Scan[R]:
        """The kind's files to read now: oldest first, at most ``max_files`` and
        ``max_bytes`` (at least one file); held files are not read again. Writers'
        temporaries older than :data:`STALE_TMP_S` are removed."""
        scan = Scan(self, kind)
        try:
            with self._folder(kind.folder) as fd:
                picked, total = self._pick(fd, kind)
        except OSError as e:
            where = kind.folder or self.path.name
            scan.problem = Rejected(where, _why(e), None)
            return scan
        budget = self.max_bytes
        for size, name in picked:
            if size > kind.max_bytes:  # refused unread: costs no budget
                scan.names.append(name)
                continue
            if size > budget and scan.names:
                break
            budget -= size
            scan.names.append(name)
        scan.left = total - len(scan.names)
        return scan

    def _pick(self, fd: int, kind: Kind[Any]) -> tuple[list[tuple[int, str]], int]:
        """(size, name) of the oldest unheld request files, and how many there are."""
        now = self._clock()
        held: dict[tuple[str, str], tuple[int, int]] = {}
        candidates: list[tuple[int, str, int]] = []
        with os.scandir(fd) as it:
            for e in it:
                name = e.name
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_S and not stat.S_ISDIR(st.st_mode):
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=fd)
                    continue
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue
                key = (kind.folder, name)
                with self._lock:
                    known = self._held.get(key)
                if known == (st.st_ino, st.st_mtime_ns):
                    held[key] = known
                    continue
                candidates.append((st.st_mtime_ns, name, st.st_size))
        with self._lock:  # forget held files that are gone or changed
            for key in [k for k in self._held if k[0] == kind.folder and k not in held]:
                del self._held[key]
        oldest = heapq.nsmallest(self.max_files, candidates)
        return [(size, name) for _, name, size in oldest], len(candidates)

    def read(self, kind: Kind[R], name: str) -> SpoolEntry[R] | Rejected | None:
        """Read and parse one file: its entry, or where it was set aside and why (None:
        gone meanwhile). A file that is not a regular file of at most one link (none:
        replaced since it was opened, read whole all the same) within the kind's cap, or
        does not parse, is moved into ``rejected/``."""
        try:
            with self._folder(kind.folder) as fd:
                try:
                    data, st = read_regular(name, kind.max_bytes, follow_symlinks=False,
                                            dir_fd=fd)  # fmt: skip
                except FileNotFoundError:
                    return None  # taken by another reader
                except NotReadable as e:
                    return self._reject_at(fd, name, None, e.reason)
                if st.st_nlink > 1:  # a link to a file elsewhere: never echo its content
                    return self._reject_at(fd, name, st.st_ino, "a hard link, not read")
                try:
                    request = kind.parse(data)
                except Exception as e:  # any bad file is set aside; start-up goes on
                    why = one_line(e) if isinstance(e, ValueError) else type(e).__name__
                    return self._reject_at(fd, name, st.st_ino, why)
                finally:
                    del data
                return SpoolEntry(kind, name, request, st.st_ino, st.st_mtime_ns)
        except OSError as e:
            return Rejected(name, _why(e), None)

    # -- keeping, removing, setting aside ---------------------------------------------

    def keep(self, request: KernelRequest) -> SpoolEntry[KernelRequest]:
        """Write a kernel request the daemon was handed into the spool, held; OSError."""
        name = spool_file_name(request)
        with self._folder(KERNEL.folder) as fd:
            st = _write_at(fd, name, (request.dumps() + "\n").encode("utf-8"))
        entry = SpoolEntry(KERNEL, name, request, st.st_ino, st.st_mtime_ns)
        self.hold(entry)
        return entry

    def hold(self, entry: SpoolEntry[Any]) -> None:
        """The daemon keeps this file (queued, or refused for now): scans skip it until
        it changes or :meth:`release_all` (forgotten once gone)."""
        with self._lock:
            self._held[(entry.kind.folder, entry.name)] = (entry.inode, entry.mtime_ns)

    def release_all(self) -> None:
        """Read every file again at the next scan (the rules that refused some changed)."""
        with self._lock:
            self._held.clear()

    def remove(self, entry: SpoolEntry[Any]) -> bool:
        """Delete an entry's file once the daemon is done with it; whether one was removed.

        Only when the file is still the one that was read (same inode): a newer write of
        the same request stays for the next scan.
        """
        try:
            with self._folder(entry.kind.folder) as fd:
                taken = f"{TMP_PREFIX}taken-{os.getpid()}-{os.urandom(4).hex()}"
                os.rename(entry.name, taken, src_dir_fd=fd, dst_dir_fd=fd)
                same = os.stat(taken, dir_fd=fd, follow_symlinks=False).st_ino == entry.inode
                if not same:  # a newer write: put it back unless newer still
                    with contextlib.suppress(OSError):
                        os.link(taken, entry.name, src_dir_fd=fd, dst_dir_fd=fd,
                                follow_symlinks=False)  # fmt: skip
                os.unlink(taken, dir_fd=fd)
                return same
        except OSError:  # gone already (another reader took it), or no spool to work in
            return False

    def reject(self, entry: SpoolEntry[Any], reason: str) -> Rejected:
        """Move an entry's file into ``rejected/`` beside its reason (if still that file)."""
        try:
            with self._folder(entry.kind.folder) as fd:
                return self._reject_at(fd, entry.name, entry.inode, reason)
        except OSError:
            return Rejected(entry.name, reason, None)

    def _reject_at(self, fd: int, name: str, inode: int | None, reason: str) -> Rejected:
        """Move ``name`` from the open folder ``fd`` into ``rejected/`` with its reason;
        undone if a writer replaced it in between. Never raises: a file that cannot be
        moved stays, and the answer says so."""
        try:
            with self._folder(REJECTED_DIR) as aside:
                target = name
                with contextlib.suppress(FileNotFoundError):
                    os.stat(target, dir_fd=aside, follow_symlinks=False)
                    target = f"{name}.{os.urandom(4).hex()}"  # an earlier one of that name
                os.rename(name, target, src_dir_fd=fd, dst_dir_fd=aside)
                moved = os.stat(target, dir_fd=aside, follow_symlinks=False)
                if inode is not None and moved.st_ino != inode:
                    # A writer replaced the bad file with a new request before the move:
                    # put it back unless an even newer write is there (nothing is lost).
                    with contextlib.suppress(OSError):
                        os.link(target, name, src_dir_fd=aside, dst_dir_fd=fd,
                                follow_symlinks=False)  # fmt: skip
                    with contextlib.suppress(OSError):
                        os.unlink(target, dir_fd=aside)
                    return Rejected(name, reason + " (a newer write was kept)", None)
                with contextlib.suppress(OSError):
                    _write_at(aside, target + ".reason", (reason + "\n").encode("utf-8"))
        except OSError:
            return Rejected(name, reason, None)
        return Rejected(name, reason, self.path / REJECTED_DIR / target)


def _mkdir_at(top: int, name: str) -> bool:
    """Create the folder ``name`` in the open folder ``top``: whether it was created
    (not: there already, or it cannot be; the open that follows says why)."""
    try:
        os.mkdir(name, 0o700, dir_fd=top)
    except OSError:
        return False
    return True


def _adopt(fd: int, spool: os.stat_result, private: bool) -> None:
    """A folder the daemon just made takes the spool's group and permissions; a private
    one is not writable by others than the daemon."""
    mode = stat.S_IMODE(spool.st_mode) & (0o750 if private else 0o3777) | 0o700
    with contextlib.suppress(OSError):  # not a group of the daemon's: its own stays
        os.fchown(fd, -1, spool.st_gid)
    with contextlib.suppress(OSError):  # not the daemon's (a writer swapped it): checked next
        os.fchmod(fd, mode)


def _why(e: OSError) -> str:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "not a directory (a link or a file), not used"
    return e.strerror or str(e)
