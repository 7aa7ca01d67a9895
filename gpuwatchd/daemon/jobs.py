"""Jobs that registered over the control socket, and the host PIDs that belong to each.

A job inside a container sees its own PID namespace, and NVML reports PIDs of the
host's: the job cannot name itself. It does not have to: the kernel translates the
caller's PID into the daemon's namespace for SO_PEERCRED, so ``register_job`` records
that PID. The job's processes are then that process, its descendants (DataLoader
workers, compilers) and the members of its process group run by the same user, read
from ``/proc`` when asked (cached for a second). A registration ends when its process
does; the process's start time guards against a recycled PID.

The daemon's own tuning still treats a registered job as foreign (production jobs come
first); only a judgement asked for that job (``job_gate``) leaves its processes out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The most jobs registered at once; a further one is refused until one ends.
MAX_JOBS = 256
#: How long a job's resolved PID set is reused before ``/proc`` is read again.
PIDS_TTL_S = 1.0


class JobError(ValueError):
    """A registration is refused or unknown (one line)."""


@dataclass(frozen=True, slots=True)
class ProcStat:
    """What ``/proc/PID/stat`` and ``status`` say about a process."""

    pid: int
    ppid: int
    pgid: int
    start: int  # clock ticks after boot: with the PID, identifies the process
    uid: int | None


class ProcFs:
    """Reads processes from a ``/proc`` (a fake one in tests)."""

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = Path(root)

    def stat(self, pid: int) -> ProcStat | None:
        """The process ``pid``, or None when it is gone (or unreadable)."""
        base = self.root / str(pid)
        try:
            raw = (base / "stat").read_text()
        except OSError:
            return None
        # "pid (comm) state ppid pgrp session tty tpgid flags ... starttime(22) ..."
        rest = raw[raw.rfind(")") + 2 :].split()
        try:
            ppid, pgid, start = int(rest[1]), int(rest[2]), int(rest[19])
        except (IndexError, ValueError):
            return None
        return ProcStat(pid, ppid, pgid, start, self._uid(base))

    @staticmethod
    def _uid(base: Path) -> int | None:
        try:
            for line in (base / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return None

    def pids(self) -> list[int]:
        try:
            return [int(n) for n in os.listdir(self.root) if n.isdigit()]
        except OSError:
            return []


@dataclass(frozen=True, slots=True)
class Job:
    """One registered job: its process as the daemon's namespace sees it."""

    id: str
    pid: int
    uid: int
    start: int
    registered_unix: float


class JobRegistry:
    """Registered jobs and their processes. Thread-safe."""

    def __init__(
        self,
        proc: ProcFs | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_jobs: int = MAX_JOBS,
    ) -> None:
        self._proc = proc if proc is not None else ProcFs()
        self._clock = clock
        self._max_jobs = max_jobs
        self._jobs: dict[str, Job] = {}
        self._pids: dict[str, tuple[float, frozenset[int]]] = {}
        self._lock = threading.Lock()

    def register(self, pid: int, uid: int) -> Job:
        """Register the process ``pid`` (the caller, by SO_PEERCRED); the same process
        registering again gets the same job."""
        st = self._proc.stat(pid)
        if st is None or pid <= 0:
            raise JobError(
                f"pid {pid}: not visible to the daemon (is it in another PID namespace "
                "without the host's /proc?)"
            )
        job_id = f"{pid}-{st.start}"
        with self._lock:
            self._prune()
            if job_id in self._jobs:
                return self._jobs[job_id]
            if len(self._jobs) >= self._max_jobs:
                raise JobError(f"too many registered jobs ({self._max_jobs}); try again later")
            job = Job(job_id, pid, uid, st.start, time.time())
            self._jobs[job_id] = job
            return job

    def get(self, job_id: str) -> Job:
        """The live job ``job_id``; JobError when unknown or ended."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and not self._alive(job):
                self._forget(job_id)
                job = None
        if job is None:
            raise JobError(f"job: no registered job {job_id!r} (ended? register again)")
        return job

    def find(self, pid: int) -> Job | None:
        """The live job whose process is ``pid``, if it registered."""
        st = self._proc.stat(pid)
        if st is None:
            return None
        with self._lock:
            return self._jobs.get(f"{pid}-{st.start}")

    def jobs(self) -> tuple[Job, ...]:
        with self._lock:
            self._prune()
            return tuple(self._jobs.values())

    def pids(self, job: Job) -> frozenset[int]:
        """The job's processes now: itself, its descendants, its same-user group members."""
        now = self._clock()
        with self._lock:
            cached = self._pids.get(job.id)
        if cached is not None and now - cached[0] < PIDS_TTL_S:
            return cached[1]
        pids = self._resolve(job)
        with self._lock:
            if job.id in self._jobs:
                self._pids[job.id] = (now, pids)
        return pids

    # -- internals -----------------------------------------------------------------------

    def _resolve(self, job: Job) -> frozenset[int]:
        root = self._proc.stat(job.pid)
        if root is None or root.start != job.start:
            return frozenset()
        table = [st for st in map(self._proc.stat, self._proc.pids()) if st is not None]
        children: dict[int, list[int]] = {}
        for st in table:
            children.setdefault(st.ppid, []).append(st.pid)
        mine = {job.pid}
        todo = [job.pid]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in mine:
                    mine.add(child)
                    todo.append(child)
        mine.update(
            st.pid
            for st in table
            if st.pgid == root.pgid and st.uid == job.uid and st.pgid != os.getpgid(0)
        )
        return frozenset(mine)

    def _alive(self, job: Job) -> bool:
        st = self._proc.stat(job.pid)
        return st is not None and st.start == job.start

    def _prune(self) -> None:
        for job_id in [j.id for j in self._jobs.values() if not self._alive(j)]:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._pids.pop(job_id, None)
