"""The spool as a writer in the jobs' group attacks it: folders swapped for links, files
swapped after they were read, hard links, huge and refused files, a spool full of them.

Nothing outside the spool is ever deleted, moved or created; start-up never fails; a scan
holds one file at a time within its budget; a refused file is set aside once, not read
again at every scan; each spooled request is queued once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spool_helpers import scan_all
from user_kernels_fakes import sample_request

from gpuwatchd.daemon.added_workloads import AddedWorkloads
from gpuwatchd.daemon.user_work import UserWork
from gpuwatchd.tuning.intake import spool as spool_module
from gpuwatchd.tuning.intake.spool import (
    KERNEL,
    REJECTED_DIR,
    SUBDIR,
    WORKLOADS,
    Kind,
    Spool,
    SpoolEntry,
    workloads_file_name,
    write_request,
    write_workload_request,
)
from gpuwatchd.tuning.intake.workload_requests import AddRequest, add_request
from gpuwatchd.tuning.settings import TuningConfig
from gpuwatchd.tuning.submitted.kernels import KernelRequest
from gpuwatchd.tuning.types import Workload

MODEL = "NVIDIA H200"


def gemm(name: str) -> Workload:
    return Workload(name, "matmul", {"m": 64, "n": 64, "k": 64}, "float16", ("torch.matmul",))


class FakeQueue:
    def __init__(self) -> None:
        self.requests: list[tuple[int, str, str]] = []

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None:
        self.requests += [(gpu, w.name, reason) for w in workloads]

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None:
        pass


def user_work(
    root: Path,
    *,
    devices: Collection[str] = ("cuda", "cpu"),
    tuning: TuningConfig | None = None,
    configured: Callable[[], Sequence[Workload]] = lambda: (),
    queue: FakeQueue | None = None,
) -> UserWork:
    cfg = tuning or TuningConfig(allowed_modules=("user_kernels",))
    return UserWork(
        queue or FakeQueue(),
        models=lambda: {0: MODEL, 1: MODEL},
        devices=lambda: devices,
        tuning=lambda: cfg,
        configured=configured,
        spool_dir=root / "spool",
        added=AddedWorkloads(root / "added-workloads.json"),
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the spool holding a precious file a root daemon must never touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious.json").write_text('{"root": "owned"}')
    os.chmod(d / "precious.json", 0o600)
    return d


def swap_for_link(folder: Path, target: Path, moved: str = ".moved") -> None:
    """What the attacker does: the folder moved away, a link to ``target`` in its place."""
    with contextlib.suppress(FileNotFoundError):
        folder.rename(folder.with_name(folder.name + moved))
    folder.symlink_to(target, target_is_directory=True)


# -- finding 1: every path resolved once ------------------------------------------------


def test_a_workloads_folder_swapped_for_a_link_after_the_read_deletes_nothing_outside(
    tmp_path: Path, outside: Path
) -> None:
    """Fails on main: the daemon took the request, then unlinked ``workloads/NAME`` again
    by path, through the link: the outside file of that name was deleted."""
    doc = add_request([gemm("job.gemm")])
    spool = tmp_path / "spool"
    path = write_workload_request(spool, doc)
    (outside / path.name).write_text("precious too")
    before = snapshot(outside)

    def configured() -> Sequence[Workload]:  # asked between the read and the removal
        if not (spool / SUBDIR).is_symlink():
            swap_for_link(spool / SUBDIR, outside)
        return ()

    work = user_work(tmp_path, configured=configured)
    work.load()
    work.close()
    assert snapshot(outside) == before
    assert work.added_names() == {"job.gemm"}


def test_a_file_swapped_for_a_dangling_link_after_the_read_never_stops_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails on main: the rejection stat'ed the moved file outside its ``try`` and
    followed the link: FileNotFoundError out of start-up."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "bad.json").write_text("{")
    real = spool_module.read_regular

    def read_then_swap(path: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(path, *args, **kwargs)
        dir_fd = kwargs.get("dir_fd")
        name = os.path.basename(path)
        with contextlib.suppress(OSError):
            os.unlink(path, dir_fd=dir_fd)
            os.symlink("/nonexistent/target", path, dir_fd=dir_fd)
        assert name == "bad.json"
        return out

    monkeypatch.setattr(spool_module, "read_regular", read_then_swap)
    work = user_work(tmp_path)
    work.load()  # does not raise
    monkeypatch.undo()
    work.rescan()
    work.close()
    assert not os.path.lexists(spool / "bad.json")  # the link set aside at the next scan
    assert os.path.islink(spool / REJECTED_DIR / "bad.json")


def test_a_rejected_folder_that_is_a_link_is_replaced_not_followed(
    tmp_path: Path, outside: Path
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    swap_for_link(spool / REJECTED_DIR, outside)
    (spool / "bad.json").write_text("{")
    before = snapshot(outside)
    (bad,) = scan_all(spool).rejected
    assert snapshot(outside) == before
    assert bad.moved_to == spool / REJECTED_DIR / "bad.json"
    aside = spool / REJECTED_DIR
    assert aside.is_dir() and not aside.is_symlink()
    assert aside.stat().st_uid == os.geteuid() and not aside.stat().st_mode & 0o022
    assert (aside / "bad.json.reason").read_text().startswith("request: not valid JSON")


def test_a_rejected_folder_others_may_write_is_replaced(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    (spool / REJECTED_DIR).mkdir(parents=True)
    os.chmod(spool / REJECTED_DIR, 0o777)
    (spool / REJECTED_DIR / "planted").write_text("x")
    (spool / "bad.json").write_text("{")
    (bad,) = scan_all(spool).rejected
    assert bad.moved_to is not None and not (spool / REJECTED_DIR).stat().st_mode & 0o022
    assert not (spool / REJECTED_DIR / "planted").exists()  # that folder was moved aside
    (old,) = [p for p in spool.iterdir() if p.name.startswith(f".{REJECTED_DIR}-foreign-")]
    assert (old / "planted").exists()


def test_a_spool_that_is_a_link_is_not_used(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "spool").symlink_to(outside)
    before = snapshot(outside)
    scan = scan_all(tmp_path / "spool")
    assert scan.entries == [] and len(scan.rejected) == 1
    assert "a link or a file" in scan.rejected[0].reason and snapshot(outside) == before


def test_a_hard_link_is_never_read(tmp_path: Path, outside: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    os.link(outside / "precious.json", spool / "x.json")
    (bad,) = scan_all(spool).rejected
    assert bad.reason == "a hard link, not read"
    assert (outside / "precious.json").read_text() == '{"root": "owned"}'
    assert "root" not in (spool / REJECTED_DIR / "x.json.reason").read_text()


def test_sub_folders_are_made_by_the_daemon_with_the_spools_audience(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    os.chmod(spool, 0o2775)
    s = Spool(spool)
    s.scan(KERNEL)
    s.close()
    assert (spool / SUBDIR).stat().st_mode & 0o7777 == 0o2775
    assert (spool / REJECTED_DIR).stat().st_mode & 0o777 == 0o750


# -- finding 4: one file at a time, within a budget; refused files set aside ------------


def many_workloads(tag: str, n: int = 512) -> list[Workload]:
    return [gemm(f"{tag}.gemm.{i}") for i in range(n)]


@pytest.mark.slow
def test_a_scan_holds_one_file_at_a_time(tmp_path: Path) -> None:
    """Fails on main: every file was parsed before any was taken (30 files: 3x one)."""

    def peak(files: int, tag: str) -> int:
        root = tmp_path / tag
        for f in range(files):
            write_workload_request(root / "spool", add_request(many_workloads(f"m{f}")))
        work = user_work(root, devices=("cpu",))  # refused: CUDA workloads, nothing kept
        tracemalloc.start()
        try:
            work.load()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            work.close()

    peak(1, "warm-up")  # first-time imports and caches out of the way
    one, many = peak(1, "one"), peak(30, "many")
    assert many < 2 * one, (one, many)


def test_refused_spooled_workloads_are_set_aside_not_read_at_every_scan(tmp_path: Path) -> None:
    """Fails on main: a request over the cap stayed in workloads/, read every 60 s."""
    spool = tmp_path / "spool"
    path = write_workload_request(spool, add_request(many_workloads("big", 3)))
    work = user_work(tmp_path, tuning=TuningConfig(max_added_workloads=2))
    work.load()
    work.close()
    assert not path.exists()
    reason = (spool / REJECTED_DIR / (path.name + ".reason")).read_text()
    assert "max_added_workloads = 2" in reason and reason.count("\n") == 1


def test_files_beyond_the_budget_wait_for_the_next_scan(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    for n in range(5):
        write_request(spool, sample_request(key_values={"n_cols": n}))
    size = max(p.stat().st_size for p in spool.glob("*.json"))
    s = Spool(spool, max_bytes=2 * size)
    seen: list[str] = []
    for _ in range(3):
        scan = s.scan(KERNEL)
        assert len(scan.names) <= 2
        for item in scan:
            assert isinstance(item, SpoolEntry)
            seen.append(item.name)
            s.hold(item)
    assert sorted(seen) == sorted(p.name for p in spool.glob("*.json"))
    assert s.scan(KERNEL).names == []  # held: not read again
    os.utime(spool / seen[0])  # changed: read again
    assert s.scan(KERNEL).names == [seen[0]]
    s.close()
    files = scan_all(spool, max_files=3)
    assert len(files.entries) == 3 and files.left == 2


def test_an_oversized_file_is_set_aside_unread_without_using_the_budget(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    good = write_request(spool, sample_request())
    with open(spool / "huge.json", "wb") as f:
        f.truncate(2**30)  # sparse
    scan = scan_all(spool, max_bytes=good.stat().st_size)
    assert [e.name for e in scan.entries] == [good.name]
    assert [r.name for r in scan.rejected] == ["huge.json"] and scan.left == 0


def test_a_kernel_request_refused_for_now_is_read_again_only_when_the_rules_change(
    tmp_path: Path,
) -> None:
    cfg = {"now": TuningConfig(allowed_modules=("someone_else",))}
    spool = tmp_path / "spool"
    write_request(spool, sample_request(gpu_model=MODEL))
    queue = FakeQueue()
    work = UserWork(
        queue,
        models=lambda: {0: MODEL},
        devices=lambda: ("cuda",),
        tuning=lambda: cfg["now"],
        configured=lambda: (),
        spool_dir=spool,
        added=AddedWorkloads(tmp_path / "added.json"),
    )
    work.load()
    assert queue.requests == []
    assert work._spool.scan(KERNEL).names == []  # held: a rescan does not read it
    cfg["now"] = TuningConfig(allowed_modules=("user_kernels",))
    work.rescan()
    work.close()
    assert [r[1] for r in queue.requests] == [sample_request(gpu_model=MODEL).workload_name]


# -- "tuning requested" once per spooled file ------------------------------------------------


def test_a_spooled_workload_is_queued_once_per_gpu_at_start(tmp_path: Path) -> None:
    """Fails on main: taken (queued) and then queued again as not tuned yet."""
    write_workload_request(tmp_path / "spool", add_request([gemm("job.gemm")]))
    queue = FakeQueue()
    work = user_work(tmp_path, queue=queue)
    work.load()
    work.rescan()
    work.close()
    assert sorted(queue.requests) == [(0, "job.gemm", "added workloads"),
                                      (1, "job.gemm", "added workloads")]  # fmt: skip


# -- the race, for real ------------------------------------------------------------------


@pytest.mark.slow
def test_swapping_spool_folders_for_links_while_the_daemon_scans(
    tmp_path: Path, outside: Path
) -> None:
    """For 10 s a writer swaps ``workloads/`` and ``rejected/`` for links to a folder
    outside, and files good and bad requests, while daemons start and rescan. Fails on
    main: outside files deleted or created, start-ups that raise."""
    spool = tmp_path / "spool"
    docs = [add_request([gemm(f"job{i}.gemm")]) for i in range(4)]
    for doc in docs:
        (outside / workloads_file_name(doc)).write_text("precious, named like a request")
    for i in range(4):
        (outside / f"bad{i}.json").write_text("precious, named like a bad file")
    before = snapshot(outside)
    stop = threading.Event()
    errors: list[BaseException] = []

    swaps = [0]

    def swapper() -> None:
        while not stop.is_set():
            for sub in (SUBDIR, REJECTED_DIR):
                swaps[0] += 1
                folder, moved = spool / sub, spool / f"{sub}.moved{swaps[0]}"
                with contextlib.suppress(OSError):
                    swap_for_link(folder, outside, moved.name[len(sub) :])
                time.sleep(0.0005)
                with contextlib.suppress(OSError):
                    if folder.is_symlink():
                        folder.unlink()
                        moved.rename(folder)  # fails if the daemon made a new one meanwhile

    def put(folder: Path, name: str, data: bytes) -> None:
        """The attacker's own writes go into real spool folders only (the precious
        folder is root's: only the root daemon could write or delete there)."""
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                tmp = f".tmp-attacker-{name}"
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd)
                os.write(out, data)
                os.close(out)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            finally:
                os.close(fd)

    def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            doc = docs[n % len(docs)]
            put(spool / SUBDIR, workloads_file_name(doc), json.dumps(doc).encode())
            put(spool / SUBDIR, f"bad{n % 4}.json", b"{")
            put(spool, f"bad{n % 4}.json", b"{")

    spool.mkdir()
    threads = [threading.Thread(target=swapper), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    starts = 0
    try:
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            work = user_work(tmp_path)
            try:
                work.load()  # start-up: never raises
                work.rescan()
            except BaseException as e:
                errors.append(e)
                break
            finally:
                work.close()
            starts += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert starts > 10 and swaps[0] > 100
    assert snapshot(outside) == before  # nothing outside deleted, changed or created


# -- fuzz: whatever a spool file holds ------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALID: dict[str, dict[str, Any]] = {
    "kernel": json.loads(sample_request(gpu_model=MODEL).dumps()),
    "workloads": add_request([gemm("job.gemm")], {"kind": "capture"}),
}


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _mutated(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = json.loads(json.dumps(doc))
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return out


def _documents(kind: str) -> st.SearchStrategy[bytes]:
    base = VALID[kind]
    mutations = st.tuples(st.sampled_from(list(_paths(base))), JSON).map(
        lambda pv: json.dumps(_mutated(base, *pv), allow_nan=True).encode()
    )
    return st.one_of(st.binary(max_size=512), JSON.map(lambda v: json.dumps(v).encode()),
                     mutations)  # fmt: skip


def _check_one_file(kind: Kind[Any], data: bytes, parsed: type) -> None:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / kind.folder
        folder.mkdir(exist_ok=True)
        (folder / "x.json").write_bytes(data)
        scan = scan_all(d, kind)
        assert scan.left == 0 and len(scan.entries) + len(scan.rejected) == 1
        if scan.entries:
            assert isinstance(scan.entries[0].request, parsed)
            assert (folder / "x.json").exists()
        else:
            (bad,) = scan.rejected
            assert bad.moved_to == Path(d) / REJECTED_DIR / "x.json"
            assert "\n" not in bad.reason and bad.reason
            assert not (folder / "x.json").exists()
        shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=150, deadline=None)
@given(_documents("kernel"))
def test_fuzz_a_kernel_request_file_is_taken_or_set_aside_with_one_line(data: bytes) -> None:
    _check_one_file(KERNEL, data, KernelRequest)


@settings(max_examples=150, deadline=None)
@given(_documents("workloads"))
def test_fuzz_a_workloads_file_is_taken_or_set_aside_with_one_line(data: bytes) -> None:
    _check_one_file(WORKLOADS, data, AddRequest)


def test_the_valid_fuzz_seeds_are_taken() -> None:
    _check_one_file(KERNEL, json.dumps(VALID["kernel"]).encode(), KernelRequest)
    _check_one_file(WORKLOADS, json.dumps(VALID["workloads"]).encode(), AddRequest)
