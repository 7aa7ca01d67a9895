"""Store faults the suite injects: SIGKILL during writes, a full disk, a read-only mount.

Shared by ``tests/test_faults_store.py`` (a few kills) and ``bench/faults_store.py``
(50 and more). Size-limited and read-only file systems are tmpfs mounts: that needs
root and a kernel that lets this process mount; :func:`tmpfs` raises
:class:`MountUnavailable` with the reason otherwise, and the callers skip.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fault_cases import child_env, writer_command

from gpuwatchd.store import open_store
from gpuwatchd.tuning.types import SessionStatus


class MountUnavailable(Exception):
    """A tmpfs cannot be mounted here (not root, no CAP_SYS_ADMIN, a locked-down CI)."""


@contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    """A size-limited tmpfs mounted on ``path`` for the duration; always unmounted."""
    if os.geteuid() != 0:
        raise MountUnavailable("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise MountUnavailable(f"mount -t tmpfs failed: {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs at ``path`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


@dataclass
class KillReport:
    """What a run of kills found: counts, and every problem as one line."""

    kills: int = 0
    committed: int = 0
    abandoned: int = 0
    problems: list[str] = field(default_factory=list)


def _committed_ids(out: str) -> list[int]:
    return [int(line) for line in out.split() if line.isdigit()]


def kill_writer_once(path: Path | str, delay_s: float) -> tuple[list[int], int]:
    """Start the store writer, SIGKILL it ``delay_s`` after it is ready; its committed ids."""
    proc = subprocess.Popen(
        writer_command(path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline().strip()
    if ready != "ready":
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"store writer did not start: {ready!r} {err.strip()[-300:]}")
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()  # reaps it: a zombie would still count as alive
    return _committed_ids(out), proc.pid


def kill_holder(path: Path) -> int:
    """Start a session at ``path`` in a child process, SIGKILL it; the session's id."""
    proc = subprocess.Popen(
        writer_command(path, "store_holder_main"),
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    sid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    return sid


def check_after_kill(path: Path | str, committed: list[int], report: KillReport) -> None:
    """The store opens, nothing was moved aside, every committed session is there whole."""
    try:
        store = open_store(path)
    except Exception as exc:  # any failure to open is the finding
        report.problems.append(f"kill {report.kills}: store does not open: {exc}")
        return
    with store:
        files = path.parent.iterdir() if isinstance(path, Path) else ()
        corrupt = [p.name for p in files if ".corrupt-" in p.name]
        if corrupt:
            report.problems.append(f"kill {report.kills}: store moved aside: {corrupt}")
        for sid in committed:
            row = store.session(sid)
            if row is None or row.status is not SessionStatus.COMPLETED:
                report.problems.append(f"kill {report.kills}: session {sid} lost or not completed")
            elif len(store.results(sid)) != 2:
                report.problems.append(f"kill {report.kills}: session {sid} lost results")
        report.abandoned += store.abandon_running()
        if store.running_count():
            report.problems.append(f"kill {report.kills}: sessions still running after abandon")


def kill_writers(path: Path | str, kills: int, seed: int = 0) -> KillReport:
    """SIGKILL the store writer ``kills`` times at random moments; check after each kill."""
    rng = random.Random(seed)
    report = KillReport()
    for _ in range(kills):
        committed, _pid = kill_writer_once(path, rng.uniform(0.02, 0.4))
        report.kills += 1
        report.committed += len(committed)
        check_after_kill(path, committed, report)
    with open_store(path) as store:
        totals = store.session_totals()
        done = totals[SessionStatus.COMPLETED]
        if done < report.committed:
            report.problems.append(f"{done} completed in the totals, {report.committed} printed")
        if totals[SessionStatus.FAILED] != report.abandoned:
            report.problems.append(
                f"failed total {totals[SessionStatus.FAILED]} != {report.abandoned} abandoned"
            )
    return report
