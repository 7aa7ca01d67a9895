"""Fault injection on the store: kills during writes, a full disk, a read-only store.

Sessions of a killed process must not stay ``running``; ``gpuwatchd tune`` on a full disk
or a read-only store is one line, not a traceback; a directory as ``--store`` is refused,
and missing parent directories are created and said so in one line.
``bench/faults_store.py`` repeats the kills 50+ times.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes_backend import FakeBackend
from fault_cases import child_env, kill_meta, writer_command
from pg_server import PostgresServer
from store_faults import (
    KillReport,
    MountUnavailable,
    check_after_kill,
    kill_holder,
    kill_writer_once,
    kill_writers,
    remount,
    tmpfs,
)

from gpuwatchd.config import Config, DaemonConfig
from gpuwatchd.store import MIGRATIONS, StoreError, sqlite_store
from gpuwatchd.tuning.types import SessionStatus


def _gpuwatchd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in res.stderr.splitlines() if line.startswith("gpuwatchd: ")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    try:
        with tmpfs(tmp_path / "fs", "8m") as mnt:
            yield mnt
    except MountUnavailable as exc:
        pytest.skip(f"no size-limited file system to fill: {exc}")


# -- kills ------------------------------------------------------------------------------------


def test_ten_sigkills_during_writes_lose_no_committed_session(tmp_path: Path) -> None:
    report = kill_writers(tmp_path / "kill.db", kills=10, seed=11)
    assert report.problems == []
    assert report.kills == 10 and report.committed > 0


def test_sigkills_during_postgres_writes_lose_no_committed_session(
    postgres_server: PostgresServer,
) -> None:
    """The same kills against the shared store: a killed client's open transaction rolls back."""
    url = postgres_server.url(postgres_server.new_database())
    report = kill_writers(url, kills=6, seed=12)
    assert report.problems == []
    assert report.kills == 6 and report.committed > 0


def test_the_daemon_fails_sessions_a_killed_process_left_and_counts_them(tmp_path: Path) -> None:
    from gpuwatchd.daemon.process import Daemon

    state = tmp_path / "state"
    state.mkdir()
    left = kill_holder(state / "gpuwatchd.db")
    cfg = Config(
        daemon=DaemonConfig(
            listen="127.0.0.1:0", state_dir=str(state), control_socket=str(tmp_path / "c.sock")
        )
    )
    daemon = Daemon(cfg, backend=FakeBackend(gpus=1))
    try:
        assert daemon.store.session(left).status is SessionStatus.FAILED  # type: ignore[union-attr]
        assert daemon.tuner.snapshot.sessions_total["failed"] == 1
        assert daemon.tuner.snapshot.sessions_total["completed"] == 0  # not this daemon's
    finally:
        daemon.store.close()
        daemon.backend.close()


def test_tune_fails_sessions_a_killed_process_left(tmp_path: Path) -> None:
    path = tmp_path / "tune.db"
    kill_holder(path)
    res = _gpuwatchd("tune", "--backend", "sim", "--wait-timeout", "0.01",
                     "--store", str(path), "--workload", "sim-gemm")  # fmt: skip
    assert res.returncode == 1 and "gate still shut" in _one_line(res)  # cleaned up first
    assert "1 session(s) left running by a process that is gone marked failed" in res.stderr
    with sqlite_store(path) as store:
        assert store.running_count() == 0
        assert store.session_totals()[SessionStatus.FAILED] == 1


def test_a_live_process_keeps_its_running_session(tmp_path: Path) -> None:
    path = tmp_path / "tune.db"
    holder = subprocess.Popen(
        writer_command(path, "store_holder_main"),
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert holder.stdout is not None
        sid = int(holder.stdout.readline())
        with sqlite_store(path) as store:  # a daemon starting while `tune` runs a session
            assert store.abandon_running() == 0
            assert store.session(sid).status is SessionStatus.RUNNING  # type: ignore[union-attr]
    finally:
        holder.kill()
        holder.wait()
    with sqlite_store(path) as store:  # and once that process is gone, the next start fails it
        assert store.abandon_running() == 1


# -- directories ------------------------------------------------------------------------------


def test_a_directory_as_store_is_named_as_such(tmp_path: Path) -> None:
    for readonly in (False, True):
        with pytest.raises(StoreError, match=r"is a directory; give the store's file"):
            sqlite_store(tmp_path, readonly=readonly)
    res = _gpuwatchd("report", "--store", str(tmp_path))
    assert res.returncode == 1 and "is a directory" in _one_line(res)


def test_a_missing_store_directory_is_created_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a" / "b" / "tune.db"
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"), sqlite_store(path):
        pass
    (record,) = caplog.records
    assert record.getMessage() == f"created the missing directory {path.parent} for store tune.db"
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match=r"cannot create .*file.* for store tune.db"):
        sqlite_store(tmp_path / "file" / "tune.db")


# -- a full disk ------------------------------------------------------------------------------


def _fill(directory: Path, leave_bytes: int) -> Path:
    """A file that takes all but about ``leave_bytes`` of the file system's free space."""
    filler = directory / "filler"
    free = shutil.disk_usage(directory).free
    with filler.open("wb") as fh:
        fh.write(b"\0" * max(0, free - leave_bytes))
    return filler


def test_a_full_disk_is_one_line_and_loses_nothing_committed(small_fs: Path) -> None:
    path = small_fs / "tune.db"
    store = sqlite_store(path)
    filler = _fill(small_fs, 400_000)
    committed: list[int] = []
    with pytest.raises(StoreError) as exc:
        for _ in range(10_000):
            sid = store.start_session(kill_meta())
            store.finish_session(sid, SessionStatus.FAILED, "x" * 1000)
            committed.append(sid)
    assert "database or disk is full" in str(exc.value) and "\n" not in str(exc.value)
    assert len(committed) > 5
    store.close()

    res = _gpuwatchd("tune", "--backend", "sim", "--no-wait", "--store", str(path),
                     "--workload", "sim-gemm")  # fmt: skip
    assert res.returncode == 1 and str(path) in _one_line(res)

    filler.unlink()
    with sqlite_store(path) as reopened:
        assert not list(small_fs.glob("*.corrupt-*"))
        found = {s.id: s.status for s in reopened.sessions(limit=100_000)}
        assert all(found.get(sid) is SessionStatus.FAILED for sid in committed)
        assert reopened.abandon_running() <= 1  # the one cut off by the full disk, if any


def test_tune_on_a_full_disk_exits_1_in_one_line(small_fs: Path) -> None:
    sqlite_store(small_fs / "tune.db").close()
    _fill(small_fs, 0)
    res = _gpuwatchd("tune", "--backend", "sim", "--no-wait", "--store",
                     str(small_fs / "tune.db"), "--workload", "sim-gemm")  # fmt: skip
    assert res.returncode == 1
    assert "no space left" in _one_line(res) or "disk is full" in _one_line(res)


# -- a read-only store left with its -wal/-shm --------------------------------------------------


def test_a_read_only_store_with_wal_and_shm_is_one_line_and_still_readable(
    small_fs: Path,
) -> None:
    path = small_fs / "tune.db"
    report_before = kill_writer_once(path, 0.2)[0]
    assert Path(f"{path}-wal").exists() and Path(f"{path}-shm").exists()
    remount(small_fs, "ro")
    try:
        with pytest.raises(StoreError, match="is not writable: attempt to write a readonly"):
            sqlite_store(path)
        res = _gpuwatchd("tune", "--backend", "sim", "--no-wait", "--store", str(path),
                         "--workload", "sim-gemm")  # fmt: skip
        assert res.returncode == 1 and "is not writable" in _one_line(res)
        with sqlite_store(path, readonly=True) as ro:
            assert {s.id for s in ro.sessions(limit=100_000)} >= set(report_before)
    finally:
        remount(small_fs, "rw")
    after = KillReport()
    check_after_kill(path, report_before, after)  # writable again: all there, leftovers failed
    assert after.problems == [] and after.abandoned <= 1


# -- a store whose creation was killed --------------------------------------------------------

_KILLED_CREATION = """
import os, signal, sys
from gpuwatchd.store import MIGRATIONS, Migration, sqlite_store

step = int(sys.argv[2])
old = MIGRATIONS[step - 1]

def apply_then_die(conn):
    old.apply(conn)
    os.kill(os.getpid(), signal.SIGKILL)  # inside the step's transaction

migrations = list(MIGRATIONS)
migrations[step - 1] = Migration(old.version, old.name, apply_then_die)
sqlite_store(sys.argv[1], migrations=migrations)
"""


def _kill_creation(path: Path, step: int) -> None:
    """Create a store at ``path`` in a child killed inside migration ``step``."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_CREATION, str(path), str(step)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == -9, proc.stderr
    assert path.exists()


@pytest.mark.parametrize("how", ["killed in the first step", "killed in the second", "empty"])
def test_a_store_whose_creation_was_cut_short_reads_as_empty_and_is_finished(
    tmp_path: Path, how: str
) -> None:
    from gpuwatchd.client import Client

    path = tmp_path / "tune.db"
    if how == "empty":
        path.touch()  # created, nothing written
    else:
        _kill_creation(path, 1 if "first" in how else 2)
    res = _gpuwatchd("report", "--store", str(path))
    assert res.returncode == 0 and "no tuning results yet" in res.stdout, res.stderr
    client = Client(url="http://127.0.0.1:1", store=path, timeout=0.2, control_socket=False)
    assert client.winners() == []
    with sqlite_store(path, readonly=True) as ro:
        assert ro.sessions() == [] and ro.schema_version() == len(MIGRATIONS)
    with sqlite_store(path) as rw:  # the next read-write open finishes creating it
        assert rw.schema_version() == len(MIGRATIONS)
        rw.start_session(kill_meta())
    with sqlite_store(path, readonly=True) as ro:
        assert len(ro.sessions()) == 1


def test_an_old_store_holding_rows_is_not_read_as_empty(tmp_path: Path) -> None:
    """Only a store holding nothing is read as empty: one at an older schema with rows is
    left untouched, and says it needs migrating."""
    path = tmp_path / "tune.db"
    sqlite_store(path, migrations=MIGRATIONS[:1]).close()
    con = sqlite3.connect(path, isolation_level=None)
    con.execute(
        "INSERT INTO sessions (gpu_uuid, gpu_index, gpu_model, host, backend, versions_json,"
        " workloads_json, regimes_json, started_at, status)"
        " VALUES ('GPU-1', 0, 'm', 'h', 'sim', '{}', '[]', '[]', 1.0, 'completed')"
    )
    con.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="has schema version 1, older than"):
        sqlite_store(path, readonly=True)
    assert path.read_bytes() == before


def test_a_foreign_database_is_still_refused_read_only(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE notes (x)")
    con.close()
    with pytest.raises(StoreError, match="not a gpuwatchd store"):
        sqlite_store(path, readonly=True)


# -- a WAL store read by a user who may not write it ------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may read but only root may write, like /var/lib/gpuwatchd."""
    if os.geteuid() != 0:
        pytest.skip("dropping privileges to another user needs root")
    path = Path(tempfile.mkdtemp(prefix="gpuwatchd-ro-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=child_env(), user="nobody", cwd="/"
    )


def _python_for_nobody() -> str:
    """An interpreter user nobody can run that imports gpuwatchd (this one may live in a
    directory only root may enter, e.g. ~root/.pyenv)."""
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        try:
            if _as_nobody(python, "-c", "import gpuwatchd.cli.main").returncode == 0:
                return python
        except OSError:
            continue
    pytest.skip("no Python interpreter that user nobody may run imports gpuwatchd")


def _report_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
    python = _python_for_nobody()  # JSON: the table needs `rich`, maybe not installed there
    return _as_nobody(python, "-m", "gpuwatchd", "report", "--format", "json", "--store", str(path))


def test_a_closed_wal_store_is_readable_by_a_user_who_may_not_write_it(shared_dir: Path) -> None:
    path = shared_dir / "gpuwatchd.db"
    tuned = _gpuwatchd("tune", "--backend", "sim", "--workload", "sim-gemm",
                       "--regime", "unthrottled", "--store", str(path))  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    assert not Path(f"{path}-wal").exists() and not Path(f"{path}-shm").exists()
    before = path.read_bytes()
    res = _report_as_nobody(path)
    assert res.returncode == 0, res.stderr
    assert "sim-gemm" in res.stdout and "unthrottled" in res.stdout
    assert path.read_bytes() == before and sorted(p.name for p in shared_dir.iterdir()) == [
        "gpuwatchd.db"
    ]


def test_a_wal_holding_changes_unreadable_for_a_non_owner_is_one_line(shared_dir: Path) -> None:
    """Changes only a writer can fold in (a killed writer's WAL, its index gone): the
    non-owner is told why in one line; the owner still reads everything."""
    path = shared_dir / "gpuwatchd.db"
    sid = kill_holder(path)
    Path(f"{path}-shm").unlink()
    assert Path(f"{path}-wal").stat().st_size > 0
    res = _report_as_nobody(path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    line = _one_line(res)
    assert "cannot be read by user nobody" in line and "gpuwatchd.db-wal holds changes" in line
    with sqlite_store(path, readonly=True) as ro:  # nothing lost
        assert ro.session(sid) is not None
