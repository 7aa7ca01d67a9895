"""The spool's housekeeping: what the daemon writes and how, its defaults, its descriptors.

Written files are durable (file and folder fsynced) with the modes the docs give; the
daemon's own requests are held, not read back; the per-scan defaults are the documented
256 files and 32 MiB; no descriptor outlives a call, nor a closed spool.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from spool_helpers import scan_all
from user_kernels_fakes import sample_request

from gpuwatchd.tuning.intake import spool as spool_module
from gpuwatchd.tuning.intake.spool import (
    KERNEL,
    REJECTED_DIR,
    STALE_TMP_S,
    SUBDIR,
    TMP_PREFIX,
    WORKLOADS,
    Kind,
    Rejected,
    Spool,
    SpoolEntry,
    spool_file_name,
    write_request,
)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_no_descriptor_outlives_a_call_or_a_closed_spool(tmp_path: Path) -> None:
    before = open_fds()
    write_request(tmp_path, sample_request())
    (tmp_path / "bad.json").write_text("{")
    s = Spool(tmp_path)
    (entry,) = [e for e in s.scan(KERNEL) if isinstance(e, SpoolEntry)]
    assert s.remove(entry)
    s.keep(sample_request())
    assert open_fds() == before + 1  # the held spool directory
    s.close()
    assert open_fds() == before
    assert [e.request for e in scan_all(tmp_path).entries] == [sample_request()]  # kept
    (problem,) = list(s.scan(KERNEL))
    assert problem.reason.endswith(": closed") and s.scan(KERNEL).left == 0


def test_the_daemons_own_request_is_written_durably_and_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_022: None
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    s = Spool(tmp_path)
    req = sample_request()
    entry = s.keep(req)
    assert synced == ["file", "dir"]
    path = tmp_path / spool_file_name(req)
    st = path.stat()
    assert entry == SpoolEntry(KERNEL, path.name, req, st.st_ino, st.st_mtime_ns)
    assert stat.S_IMODE(st.st_mode) == 0o640  # 0o660 less the umask
    assert s.scan(KERNEL).names == []  # held: not read back
    assert [e.request for e in scan_all(tmp_path).entries] == [req]
    s.close()


def test_a_job_makes_a_missing_spool_for_its_group(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_request(tmp_path / "spool", sample_request())
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o770


def test_a_write_that_cannot_land_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / spool_file_name(sample_request())).mkdir()  # renaming onto it fails
    with pytest.raises(IsADirectoryError):
        write_request(tmp_path, sample_request())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []

    def unlink_fails(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "unlink", unlink_fails)
    with pytest.raises(IsADirectoryError):  # the write's own error, not the cleanup's
        write_request(tmp_path, sample_request())


def test_a_folder_that_cannot_be_fsynced_still_takes_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def no_dir_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")  # some filesystems refuse it
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_dir_fsync)
    assert write_request(tmp_path, sample_request()).is_file()


def test_the_per_scan_file_budget_is_256(tmp_path: Path) -> None:
    for n in range(257):
        (tmp_path / f"{n:04d}.json").write_text("{")
    assert scan_all(tmp_path).left == 1


def test_the_per_scan_byte_budget_is_32_mib(tmp_path: Path) -> None:
    folder = tmp_path / SUBDIR
    folder.mkdir()
    for n in range(8):  # 8 x 4 MiB (the workloads cap) = 32 MiB, oldest first
        with open(folder / f"{n}.json", "wb") as f:
            f.truncate(WORKLOADS.max_bytes)
        os.utime(folder / f"{n}.json", ns=(n, n))
    (folder / "last.json").write_text("{")
    scan = scan_all(tmp_path, WORKLOADS)
    assert len(scan.rejected) == 8 and scan.left == 1


def test_writers_temporaries_go_after_an_hour(tmp_path: Path) -> None:
    tmp = tmp_path / f"{TMP_PREFIX}1-x.json"
    tmp.write_text("{")
    mtime = tmp.stat().st_mtime
    assert STALE_TMP_S == 3600
    Spool(tmp_path, clock=lambda: mtime + 3599.5).scan(KERNEL)
    assert tmp.exists()
    Spool(tmp_path, clock=lambda: mtime + 3600.5).scan(KERNEL)
    assert not tmp.exists()


def test_a_file_where_a_folder_belongs_is_moved_aside_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / SUBDIR).write_text("not a folder")
    with caplog.at_level(logging.WARNING, "gpuwatchd.tuning.intake.spool"):
        scan = scan_all(tmp_path, WORKLOADS)
    assert scan.rejected == [] and (tmp_path / SUBDIR).is_dir()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(f".{SUBDIR}-foreign-")]
    assert aside.read_text() == "not a folder"
    (said,) = [r.getMessage() for r in caplog.records if r.name == "gpuwatchd.tuning.intake.spool"]
    assert "was not the daemon's folder" in said and aside.name in said


def test_a_spool_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    scan = scan_all(tmp_path / ("x" * 300))
    (problem,) = scan.rejected
    assert problem.name == "x" * 300
    assert problem.reason.endswith(": File name too long") and "[Errno" not in problem.reason
    assert scan.left == 0


def test_sub_folders_take_the_spools_group(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        gid = 4242
    else:
        gid = next((g for g in os.getgroups() if g != os.getegid()), -1)
        if gid < 0:
            pytest.skip("needs a second group")
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chown(spool, -1, gid)
    scan_all(spool)
    assert (spool / SUBDIR).stat().st_gid == gid == (spool / REJECTED_DIR).stat().st_gid


def test_sub_folders_are_made_when_their_group_or_mode_cannot_be_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_022: None
) -> None:
    def refuse(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    monkeypatch.setattr(os, "fchmod", refuse)
    (tmp_path / "bad.json").write_text("{")
    (bad,) = scan_all(tmp_path).rejected
    assert bad.moved_to == tmp_path / REJECTED_DIR / "bad.json"
    assert stat.S_IMODE((tmp_path / REJECTED_DIR).stat().st_mode) == 0o700  # private anyway


def test_a_rejected_folder_others_may_write_costs_no_descriptor(tmp_path: Path) -> None:
    (tmp_path / REJECTED_DIR).mkdir()
    os.chmod(tmp_path / REJECTED_DIR, 0o777)
    (tmp_path / "bad.json").write_text("{")
    before = open_fds()
    s = Spool(tmp_path)
    (bad,) = s.scan(KERNEL)
    s.close()
    assert open_fds() == before and isinstance(bad, Rejected) and bad.moved_to is not None


def test_a_spool_closed_mid_scan_answers_in_one_line(tmp_path: Path) -> None:
    write_request(tmp_path, sample_request())
    s = Spool(tmp_path)
    scan = s.scan(KERNEL)
    (entry,) = [e for e in Spool(tmp_path).scan(KERNEL) if isinstance(e, SpoolEntry)]
    s.close()
    (item,) = list(scan)
    assert item == Rejected(entry.name, f"{tmp_path}: closed", None)
    assert s.remove(entry) is False
    assert s.reject(entry, "why") == Rejected(entry.name, "why", None)
    assert (tmp_path / entry.name).exists()


def test_rejecting_a_file_gone_meanwhile_says_so(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    gone = SpoolEntry(KERNEL, "gone.json", sample_request(), 1, 0)
    assert s.reject(gone, "why") == Rejected("gone.json", "why", None)
    assert s.remove(gone) is False
    s.close()


def test_a_private_folder_that_stays_foreign_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # every rejected/ is someone else's
    (tmp_path / "bad.json").write_text("{")
    (bad,) = scan_all(tmp_path).rejected
    assert bad.moved_to is None and (tmp_path / "bad.json").exists()
    assert bad.reason.startswith("request: not valid JSON")


def test_a_sub_folder_that_cannot_be_opened_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_rejected(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if path in (REJECTED_DIR, SUBDIR) and kwargs.get("dir_fd") is not None:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    (tmp_path / REJECTED_DIR).mkdir()
    (tmp_path / SUBDIR).mkdir()
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setattr(os, "open", no_rejected)
    (bad,) = scan_all(tmp_path).rejected
    assert bad.moved_to is None and (tmp_path / "bad.json").exists()
    assert not [p for p in tmp_path.iterdir() if "foreign" in p.name]  # nothing moved aside
    (problem,) = scan_all(tmp_path, WORKLOADS).rejected
    assert problem == Rejected(SUBDIR, f"{tmp_path / SUBDIR}: Permission denied", None)


def test_a_spool_is_made_with_its_missing_parents(tmp_path: Path, umask_022: None) -> None:
    assert scan_all(tmp_path / "a" / "b" / "spool").rejected == []
    assert stat.S_IMODE((tmp_path / "a" / "b" / "spool").stat().st_mode) == 0o750
    assert (tmp_path / "a" / "b" / "spool" / REJECTED_DIR).is_dir()


def test_a_private_folder_only_the_daemon_writes_is_kept(tmp_path: Path) -> None:
    (tmp_path / REJECTED_DIR).mkdir(mode=0o711)
    os.chmod(tmp_path / REJECTED_DIR, 0o711)
    (tmp_path / "bad.json").write_text("{")
    (bad,) = scan_all(tmp_path).rejected
    assert bad.moved_to == tmp_path / REJECTED_DIR / "bad.json"
    assert not [p for p in tmp_path.iterdir() if "foreign" in p.name]


def test_dangling_links_are_set_aside_and_never_replace_an_earlier_rejection(
    tmp_path: Path,
) -> None:
    (tmp_path / "x.json").symlink_to(tmp_path / "nowhere")
    (first,) = scan_all(tmp_path).rejected
    assert first.moved_to == tmp_path / REJECTED_DIR / "x.json"
    (tmp_path / "x.json").write_text("{")
    (second,) = scan_all(tmp_path).rejected
    assert second.moved_to is not None and second.moved_to.name.startswith("x.json.")
    assert os.path.islink(tmp_path / REJECTED_DIR / "x.json")


def test_a_file_swapped_for_a_dangling_link_before_its_rejection_is_put_back(
    tmp_path: Path,
) -> None:
    (tmp_path / "x.json").write_text("{}")
    s = Spool(tmp_path)
    stale = SpoolEntry(KERNEL, "x.json", sample_request(), (tmp_path / "x.json").stat().st_ino, 0)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    os.replace(tmp_path / "link", tmp_path / "x.json")  # a new inode, not a reused one
    bad = s.reject(stale, "why")
    s.close()
    assert bad == Rejected("x.json", "why (a newer write was kept)", None)
    assert os.path.islink(tmp_path / "x.json")
    assert not os.path.lexists(tmp_path / REJECTED_DIR / "x.json")


def test_set_aside_without_its_reason_file_when_that_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = spool_module._write_at

    def no_reason(dir_fd: int, name: str, data: bytes) -> os.stat_result:
        if name.endswith(".reason"):
            raise OSError(28, "No space left on device")
        return real(dir_fd, name, data)

    monkeypatch.setattr(spool_module, "_write_at", no_reason)
    (tmp_path / "bad.json").write_text("{")
    (bad,) = scan_all(tmp_path).rejected
    assert bad.moved_to == tmp_path / REJECTED_DIR / "bad.json"
    assert not (tmp_path / REJECTED_DIR / "bad.json.reason").exists()


def test_a_newer_write_is_kept_when_putting_it_back_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_request(tmp_path, sample_request())
    (entry,) = scan_all(tmp_path).entries
    write_request(tmp_path, sample_request())  # newer
    (tmp_path / "bad.json").write_text("{")
    (stale_bad,) = [SpoolEntry(KERNEL, "bad.json", sample_request(), 1, 0)]

    def link_fails(*_args: object, **_kwargs: object) -> None:
        raise FileExistsError(17, "File exists")  # an even newer write got there first

    monkeypatch.setattr(os, "link", link_fails)
    s = Spool(tmp_path)
    assert s.remove(entry) is False
    assert s.reject(stale_bad, "why").moved_to is None
    s.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []
    assert [p.name for p in (tmp_path / REJECTED_DIR).iterdir()] == []


def test_a_temporary_gone_before_its_cleanup_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = tmp_path / f"{TMP_PREFIX}1-x.json"
    tmp.write_text("{")
    old = tmp.stat().st_mtime - STALE_TMP_S - 10
    os.utime(tmp, (old, old))
    real_unlink = os.unlink

    def raced(path: object, *args: object, **kwargs: object) -> None:
        if str(path).startswith(TMP_PREFIX):
            raise FileNotFoundError(2, "No such file or directory")
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", raced)
    assert scan_all(tmp_path).rejected == []


def test_files_held_for_one_kind_stay_held_when_another_kind_is_scanned(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    s.keep(sample_request())
    s.scan(WORKLOADS)
    assert s.scan(KERNEL).names == []
    s.close()


def test_a_request_swapped_for_a_link_before_its_removal_is_put_back(tmp_path: Path) -> None:
    write_request(tmp_path, sample_request())
    (entry,) = scan_all(tmp_path).entries
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    os.replace(tmp_path / "link", tmp_path / entry.name)
    s = Spool(tmp_path)
    assert s.remove(entry) is False
    s.close()
    assert os.path.islink(tmp_path / entry.name)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_a_parser_that_fails_oddly_sets_the_file_aside_naming_the_error(tmp_path: Path) -> None:
    odd = Kind("", 100, lambda data: 1 // 0, "odd")
    (tmp_path / "x.json").write_text("{}")
    (bad,) = scan_all(tmp_path, odd).rejected
    assert bad.reason == "ZeroDivisionError" and bad.moved_to is not None


def test_held_files_that_are_gone_are_forgotten(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    entry = s.keep(sample_request())
    (tmp_path / entry.name).unlink()
    s.scan(KERNEL)
    assert s._held == {}
    s.close()


def test_a_folder_swapped_in_before_a_rejection_is_left_in_rejected(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{")
    stale = SpoolEntry(KERNEL, "x.json", sample_request(), (tmp_path / "x.json").stat().st_ino, 0)
    (tmp_path / "d").mkdir()  # made while the file still holds its inode: a new one
    (tmp_path / "x.json").unlink()
    (tmp_path / "d").rename(tmp_path / "x.json")
    s = Spool(tmp_path)
    assert s.reject(stale, "why") == Rejected("x.json", "why (a newer write was kept)", None)
    s.close()
    assert (tmp_path / REJECTED_DIR / "x.json").is_dir()  # a folder cannot be put back
