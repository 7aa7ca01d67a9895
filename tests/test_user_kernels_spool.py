"""The spool: atomic writes, concurrent writers, bad files moved aside, nothing good lost."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from spool_helpers import scan_all
from user_kernels_fakes import sample_request

from gpuwatchd.tuning.intake.spool import (
    KERNEL,
    REJECTED_DIR,
    STALE_TMP_S,
    SUBDIR,
    TMP_PREFIX,
    Spool,
    SpoolEntry,
    spool_file_name,
    write_request,
)
from gpuwatchd.tuning.submitted.kernels import KernelRequest


def _key(n: int) -> KernelRequest:
    return sample_request(key_values={"n_cols": n})


def test_write_then_read_round_trips_and_leaves_no_temporary(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    path = write_request(spool, _key(1))
    assert path.name == spool_file_name(_key(1)) and path.parent == spool
    assert sorted(os.listdir(spool)) == [path.name]
    scan = scan_all(spool)
    assert sorted(os.listdir(spool)) == [path.name, REJECTED_DIR, SUBDIR]  # the daemon's own
    assert [e.request for e in scan.entries] == [_key(1)] and scan.rejected == []


def test_the_same_request_twice_is_one_file(tmp_path: Path) -> None:
    write_request(tmp_path, _key(1))
    write_request(tmp_path, _key(1))
    write_request(tmp_path, _key(2))
    assert len(scan_all(tmp_path).entries) == 2


def test_a_missing_spool_is_empty(tmp_path: Path) -> None:
    scan = scan_all(tmp_path / "never-made")
    assert scan.entries == [] and scan.rejected == []


def test_concurrent_writers_lose_nothing_and_readers_never_see_half_a_file(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    errors: list[str] = []
    stop = threading.Event()

    def writer(first: int) -> None:
        for n in range(first, first + 40):
            write_request(spool, _key(n % 60))  # keys 0..59, many written by several threads

    def reader() -> None:
        while not stop.is_set():
            scan = scan_all(spool)
            errors.extend(r.reason for r in scan.rejected)

    threads = [threading.Thread(target=writer, args=(i * 20,)) for i in range(4)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert errors == []
    scan = scan_all(spool)
    assert sorted(e.request.key_values["n_cols"] for e in scan.entries) == list(range(60))
    assert not [n for n in os.listdir(spool) if n.startswith(TMP_PREFIX)]


def test_bad_files_are_moved_aside_with_their_reason(tmp_path: Path) -> None:
    good = write_request(tmp_path, _key(1))
    doc = json.loads(_key(2).dumps())
    doc["kernel"]["module"] = "../../etc"
    (tmp_path / "bad-field.json").write_text(json.dumps(doc))
    (tmp_path / "not-json.json").write_text("{")
    (tmp_path / "huge.json").write_bytes(b" " * 300_000)
    (tmp_path / "notes.txt").write_text("not a request: ignored")
    scan = scan_all(tmp_path)
    assert [tmp_path / e.name for e in scan.entries] == [good]
    reasons = {r.name: r.reason for r in scan.rejected}
    assert set(reasons) == {"bad-field.json", "not-json.json", "huge.json"}
    assert "request.kernel.module" in reasons["bad-field.json"]
    assert "not valid JSON" in reasons["not-json.json"]
    assert "larger than" in reasons["huge.json"]
    aside = tmp_path / REJECTED_DIR
    assert (aside / "bad-field.json").is_file()
    assert "request.kernel.module" in (aside / "bad-field.json.reason").read_text()
    assert all("\n" not in r for r in reasons.values())
    assert good.is_file() and (tmp_path / "notes.txt").is_file()
    assert [e.name for e in scan_all(tmp_path).entries] == [good.name]  # rejected ones stay out


def test_a_rejection_racing_a_new_write_keeps_the_new_request(tmp_path: Path) -> None:
    name = spool_file_name(_key(1))
    (tmp_path / name).write_text("{")
    stale_inode = os.stat(tmp_path / name).st_ino
    write_request(tmp_path, _key(1))  # a writer replaced the bad file after it was read
    spool = Spool(tmp_path)
    rejected = spool.reject(SpoolEntry(KERNEL, name, _key(1), stale_inode, 0), "not valid JSON")
    spool.close()
    assert rejected.moved_to is None and "newer write was kept" in rejected.reason
    assert [e.request for e in scan_all(tmp_path).entries] == [_key(1)]


def test_remove_entry_only_removes_the_file_that_was_read(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    write_request(tmp_path, _key(1))
    (entry,) = scan_all(tmp_path).entries
    write_request(tmp_path, _key(1))  # a newer write of the same request
    assert spool.remove(entry) is False
    (entry,) = scan_all(tmp_path).entries
    assert spool.remove(entry) is True
    assert scan_all(tmp_path).entries == []
    assert sorted(os.listdir(tmp_path)) == [REJECTED_DIR, SUBDIR]
    assert spool.remove(entry) is False
    spool.close()


def test_stale_temporaries_are_cleaned_and_fresh_ones_left(tmp_path: Path) -> None:
    stale = tmp_path / f"{TMP_PREFIX}1-dead.json"
    fresh = tmp_path / f"{TMP_PREFIX}2-live.json"
    stale.write_text("{")
    fresh.write_text("{")
    old = time.time() - STALE_TMP_S - 10
    os.utime(stale, (old, old))
    scan = scan_all(tmp_path)
    assert scan.entries == [] and scan.rejected == []
    assert not stale.exists() and fresh.exists()


def test_max_files_leaves_the_rest_for_later(tmp_path: Path) -> None:
    for n in range(5):
        write_request(tmp_path, _key(n))
    scan = scan_all(tmp_path, max_files=3)
    assert len(scan.entries) == 3 and scan.left == 2
