"""The daemon's side of users' work: tune_kernel and the workloads ops, kept across restarts.

The daemon here runs on the simulated GPU posing as an NVML host (a user kernel needs
a CUDA backend: on the real sim backend it is refused, as tested too). Nothing is tuned:
what is checked is what gets refused (one line), kept (the spool, the added-workloads
file), queued (the scheduler's pending lists) and handed to the runner (worker_python).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from user_kernels_fakes import sample_request

from gpuwatchd.config import Config, ConfigError, parse_config, spool_path
from gpuwatchd.daemon.added_workloads import FILE_NAME, AddedWorkloads
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.daemon.user_work import MAX_FAILURES, UserWork
from gpuwatchd.jobside.requests import Submitter
from gpuwatchd.serve.control import ControlServer, PeerCred, RequestError
from gpuwatchd.sessions.events import SessionFinished, WorkSkipped
from gpuwatchd.sessions.fleet import SKIP_REASON
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.tuning.intake.spool import (
    REJECTED_DIR,
    SUBDIR,
    write_request,
    write_workload_request,
)
from gpuwatchd.tuning.intake.workload_requests import add_request, parse_add_request
from gpuwatchd.tuning.settings import TuningConfig
from gpuwatchd.tuning.submitted.kernels import KernelRequest
from gpuwatchd.tuning.types import SessionStatus, Workload

ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
SIM_MODEL = "NVIDIA H200 (simulated)"
GEMM = Workload(
    "model.gemm.float16.64x64x64.nn", "matmul", {"m": 64, "n": 64, "k": 64}, "float16",
    ("torch.matmul",),
)  # fmt: skip


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: AF_UNIX paths are limited to 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="gwu-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_config(state: Path, **tuning: Any) -> Config:
    table = {"allowed_modules": ["user_kernels"], **tuning}
    return parse_config(
        {
            "daemon": {"backend": "sim", "state_dir": str(state), "listen": "127.0.0.1:0",
                       "control_socket": str(state / "ctl.sock")},
            "tuning": table,
            "drift": {"enabled": False},
        }
    )  # fmt: skip


def make_daemon(cfg: Config, backend_name: str = "nvml") -> Daemon:
    """A daemon on the simulated GPU; ``backend_name="nvml"`` makes it a CUDA host."""
    backend = open_backend(cfg.backend_spec())
    backend.name = backend_name  # type: ignore[misc]
    return Daemon(cfg, backend=backend)


@pytest.fixture
def daemon(short_dir: Path) -> Iterator[Daemon]:
    d = make_daemon(make_config(short_dir))
    yield d
    d.store.close()


def kernel_request(**changes: Any) -> KernelRequest:
    return sample_request(**{"gpu_model": SIM_MODEL, **changes})


def call(d: Daemon, doc: dict[str, Any], peer: PeerCred = ME) -> dict[str, Any]:
    return d.control_ops(doc, peer)


# -- configuration -------------------------------------------------------------------------


def test_new_tuning_keys_default_to_the_daemons_python_nothing_allowed_and_the_state_spool(
    tmp_path: Path,
) -> None:
    cfg = Config()
    assert cfg.tuning.worker_python == "" and cfg.tuning.worker_executable == sys.executable
    assert cfg.tuning.allowed_modules == ()
    assert spool_path("", str(tmp_path)) == tmp_path / "spool"
    assert spool_path("/srv/spool", str(tmp_path)) == Path("/srv/spool")


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("/nonexistent/python3", "tuning.worker_python: /nonexistent/python3: no such file"),
        ("NOT_EXECUTABLE", "not an executable file"),
    ],
)
def test_worker_python_must_be_an_executable_file(tmp_path: Path, value: str, needle: str) -> None:
    plain = tmp_path / "python"
    plain.write_text("")
    value = str(plain) if value == "NOT_EXECUTABLE" else value
    with pytest.raises(ConfigError) as err:
        parse_config({"tuning": {"worker_python": value}})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_allowed_modules_name_the_bad_entry() -> None:
    with pytest.raises(ConfigError, match=r"tuning\.allowed_modules\[1\]: expected a dotted"):
        parse_config({"tuning": {"allowed_modules": ["ok.mod", "not a module"]}})


def test_the_runner_gets_worker_python(short_dir: Path) -> None:
    python = short_dir / "python3"
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    d = make_daemon(make_config(short_dir, worker_python=str(python)))
    try:
        runner = d.tuner._runner_factory(d.store, on_finished=lambda e: None)
        assert isinstance(runner, TuneRunner)
        assert runner.python == str(python) and runner._cmd[0] == str(python)
    finally:
        d.store.close()


# -- tune_kernel -----------------------------------------------------------------------------


def test_tune_kernel_is_queued_for_the_matching_gpu_and_kept_in_the_spool(daemon: Daemon) -> None:
    req = kernel_request()
    answer = call(daemon, {"op": "tune_kernel", "request": req.to_json()})
    assert answer == {
        "ok": True,
        "workload": req.workload_name,
        "queued": {"0": [req.workload_name]},
        "persisted": True,
    }
    assert daemon.tuner.pending() == {0: (req.workload_name,)}
    spool = daemon.user_work.spool_dir
    assert [p.name for p in spool.glob("*.json")] != []
    assert req.workload_name.startswith("triton.user:user_kernels.softmax.softmax_kernel@")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"module": "evil.kernels"}, "module 'evil.kernels' is not under [tuning] allowed_modules"),
        ({"args_factory": "os:system"}, "request.args_factory: module 'os' is not under"),
        ({"gpu_model": "NVIDIA B200"}, "request.gpu_model: no 'NVIDIA B200' GPU on this host"),
    ],
)
def test_tune_kernel_refusals_are_one_line(
    daemon: Daemon, change: dict[str, Any], needle: str
) -> None:
    with pytest.raises(RequestError) as err:
        call(daemon, {"op": "tune_kernel", "request": kernel_request(**change).to_json()})
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert daemon.tuner.pending() == {}
    assert not list(daemon.user_work.spool_dir.glob("*.json"))


def test_tune_kernel_with_a_bad_field_names_it(daemon: Daemon) -> None:
    doc = kernel_request().to_json()
    doc["configs"] = []
    with pytest.raises(RequestError, match=r"^request\.configs: expected at least one config"):
        call(daemon, {"op": "tune_kernel", "request": doc})
    with pytest.raises(RequestError, match=r"^request: missing"):
        call(daemon, {"op": "tune_kernel"})


def test_tune_kernel_needs_a_cuda_backend_and_tuning_enabled(short_dir: Path) -> None:
    sim = make_daemon(make_config(short_dir), backend_name="sim")
    try:
        with pytest.raises(RequestError, match="needs a CUDA GPU"):
            call(sim, {"op": "tune_kernel", "request": kernel_request().to_json()})
    finally:
        sim.store.close()
    off = make_daemon(make_config(short_dir, enabled=False))
    try:
        with pytest.raises(RequestError, match=r"tuning is disabled"):
            call(off, {"op": "tune_kernel", "request": kernel_request().to_json()})
    finally:
        off.store.close()


def test_nothing_is_allowed_until_the_admin_lists_a_module(short_dir: Path) -> None:
    d = make_daemon(make_config(short_dir, allowed_modules=[]))
    try:
        with pytest.raises(RequestError, match="nothing is imported until set"):
            call(d, {"op": "tune_kernel", "request": kernel_request().to_json()})
    finally:
        d.store.close()


def test_over_the_socket_a_job_is_queued_bad_json_and_strangers_get_one_line(
    daemon: Daemon, short_dir: Path
) -> None:
    daemon.control.start()
    try:
        got = Submitter(daemon.control.path, short_dir / "jobspool").submit(kernel_request())
        assert got.how == "daemon", got.detail
        refused = Submitter(daemon.control.path, short_dir / "jobspool").submit(
            kernel_request(module="evil.kernels")
        )
        assert refused.how == "rejected" and "allowed_modules" in refused.detail
        assert not (short_dir / "jobspool").exists()  # a refusal is final: nothing spooled
        from gpuwatchd.client.control import ask

        bad = ask(daemon.control.path, '{"op": "tune_kernel", "request": ', 2.0)
        assert bad["ok"] is False and bad["error"].startswith("request: not valid JSON")
    finally:
        daemon.control.stop()
    stranger = ControlServer(
        short_dir / "other" / "ctl.sock", daemon.control_ops, allowed=lambda peer: False
    )
    stranger.start()
    try:  # the refusal comes before the request is read: listen for it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(stranger.path))
            answer = json.loads(s.makefile().readline())
        assert answer["ok"] is False and answer["error"].startswith("permission denied for uid")
    finally:
        stranger.stop()
    assert daemon.tuner.pending() == {0: (kernel_request().workload_name,)}


# -- added workloads -------------------------------------------------------------------------


def test_add_list_remove_workloads(daemon: Daemon) -> None:
    added = call(daemon, add_request([GEMM], {"kind": "capture", "pid": 7}))
    assert added == {"ok": True, "added": [GEMM.name], "replaced": []}
    assert call(daemon, add_request([GEMM]))["replaced"] == [GEMM.name]
    assert daemon.tuner.pending() == {0: (GEMM.name,)}
    assert GEMM in daemon.runnable()  # drift and retune see it like a configured one
    call(daemon, {"op": "tune_kernel", "request": kernel_request().to_json()})
    listed = call(daemon, {"op": "list_workloads"})["workloads"]
    origins = {w["name"]: w["origin"] for w in listed}
    assert origins[GEMM.name] == "added"
    assert origins[kernel_request().workload_name] == "kernel"
    assert {"config"} == {o for n, o in origins.items() if n.startswith("gemm-bf16")}
    removed = call(
        daemon, {"op": "remove_workloads", "names": [GEMM.name, kernel_request().workload_name]}
    )
    assert sorted(removed["removed"]) == sorted([GEMM.name, kernel_request().workload_name])
    assert daemon.tuner.pending() == {}
    assert not list(daemon.user_work.spool_dir.glob("*.json"))


def test_workload_refusals_are_one_line(daemon: Daemon) -> None:
    shipped = Workload("gemm-bf16-8192", "matmul", {"m": 1, "n": 1, "k": 1}, "bfloat16",
                       ("torch.matmul",))  # fmt: skip
    with pytest.raises(RequestError, match=r"workloads\[0\]\.name: 'gemm-bf16-8192' is a conf"):
        call(daemon, add_request([shipped]))
    sim_only = Workload("model.sim", "matmul", {"m": 1, "n": 1, "k": 1}, "bfloat16", ("sim",))
    with pytest.raises(RequestError, match=r"workloads\[0\]: 'model.sim' needs the sim backend"):
        call(daemon, add_request([sim_only]))
    with pytest.raises(RequestError, match=r"names\[0\]: 'gemm-bf16-8192' is a configured"):
        call(daemon, {"op": "remove_workloads", "names": ["gemm-bf16-8192"]})
    with pytest.raises(RequestError, match=r"names\[0\]: no added workload or kernel request"):
        call(daemon, {"op": "remove_workloads", "names": ["model.nothing"]})
    with pytest.raises(RequestError, match=r"^workloads: expected a non-empty list"):
        call(daemon, {"op": "add_workloads", "workloads": []})


# -- restarts and the spool ----------------------------------------------------------------


def test_accepted_work_survives_a_restart(short_dir: Path) -> None:
    cfg = make_config(short_dir)
    first = make_daemon(cfg)
    call(first, {"op": "tune_kernel", "request": kernel_request().to_json()})
    call(first, add_request([GEMM]))
    first.store.close()
    second = make_daemon(cfg)
    try:
        assert second.tuner.pending() == {}
        second.user_work.load()
        assert set(second.tuner.pending()[0]) == {GEMM.name, kernel_request().workload_name}
        assert GEMM in second.runnable()
    finally:
        second.store.close()


def test_what_jobs_spooled_without_a_daemon_is_queued_at_start(short_dir: Path) -> None:
    cfg = make_config(short_dir)
    spool = spool_path(cfg.tuning.spool_dir, cfg.daemon.state_dir)
    write_request(spool, kernel_request())
    write_request(spool, kernel_request(module="evil.kernels"))  # stays: the admin may allow it
    (spool / "garbage.json").write_text("{not json")
    write_workload_request(spool, add_request([GEMM], {"kind": "capture"}))
    d = make_daemon(cfg)
    try:
        d.user_work.load()
        assert set(d.tuner.pending()[0]) == {GEMM.name, kernel_request().workload_name}
        assert (spool / REJECTED_DIR / "garbage.json").exists()
        assert not list((spool / SUBDIR).glob("*.json"))  # taken into the added list
        kept = json.loads((short_dir / FILE_NAME).read_text())
        assert [w["name"] for w in kept["workloads"]] == [GEMM.name]
        assert len(list(spool.glob("*.json"))) == 2  # the good one until tuned, the refused one
    finally:
        d.store.close()


# -- sessions ending -------------------------------------------------------------------------


class FakeQueue:
    def __init__(self) -> None:
        self.requests: list[tuple[int, str, str]] = []
        self.withdrawn: list[tuple[tuple[str, ...], tuple[int, ...] | None]] = []

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None:
        self.requests += [(gpu, w.name, reason) for w in workloads]

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None:
        self.withdrawn.append((tuple(names), None if gpus is None else tuple(gpus)))


def two_gpu_work(tmp_path: Path, tuned: set[str]) -> tuple[UserWork, FakeQueue]:
    queue = FakeQueue()
    work = UserWork(
        queue,
        models=lambda: {0: SIM_MODEL, 1: SIM_MODEL},
        devices=lambda: ("cuda", "cpu"),
        tuning=lambda: TuningConfig(allowed_modules=("user_kernels",)),
        configured=lambda: (),
        spool_dir=tmp_path / "spool",
        added=AddedWorkloads(tmp_path / FILE_NAME),
        tuned=lambda model: tuned,
    )
    return work, queue


def finished(status: SessionStatus, names: Sequence[str], gpu: int = 0) -> SessionFinished:
    return SessionFinished(1, gpu, f"GPU-{gpu}", SIM_MODEL, status, None, tuple(names))


def test_a_tuned_request_leaves_the_spool_and_the_other_gpus_of_its_model(tmp_path: Path) -> None:
    name = kernel_request().workload_name
    work, queue = two_gpu_work(tmp_path, tuned={name})
    assert work.tune_kernel(kernel_request())["queued"] == {"0": [name], "1": [name]}
    work.session_finished(finished(SessionStatus.COMPLETED, [name], gpu=1))
    assert not list((tmp_path / "spool").glob("*.json"))
    assert queue.withdrawn == [((name,), (0,))]
    assert work.listing(()) == []


def test_a_request_left_without_a_winner_is_tried_again_then_set_aside(tmp_path: Path) -> None:
    name = kernel_request().workload_name
    work, queue = two_gpu_work(tmp_path, tuned=set())
    work.tune_kernel(kernel_request())
    for _ in range(MAX_FAILURES - 1):
        work.session_finished(finished(SessionStatus.COMPLETED, [name]))
    assert [r for r in queue.requests if r[2].endswith("no winner yet")] == [
        (0, name, "user kernel request, no winner yet")
    ] * (MAX_FAILURES - 1)
    work.session_finished(finished(SessionStatus.FAILED, [name]))
    assert queue.withdrawn[-1] == ((name,), None)
    assert not list((tmp_path / "spool").glob("*.json"))
    reasons = list((tmp_path / "spool" / REJECTED_DIR).glob("*.reason"))
    assert len(reasons) == 1 and "tuning sessions failed" in reasons[0].read_text()


def test_a_preempted_session_changes_nothing(tmp_path: Path) -> None:
    name = kernel_request().workload_name
    work, queue = two_gpu_work(tmp_path, tuned={name})
    work.tune_kernel(kernel_request())
    work.session_finished(finished(SessionStatus.PREEMPTED, [name]))
    assert queue.withdrawn == [] and len(list((tmp_path / "spool").glob("*.json"))) == 1


def skipped(names: Sequence[str], gpu: int = 0, model: str = SIM_MODEL) -> WorkSkipped:
    return WorkSkipped(gpu, f"GPU-{gpu}", model, tuple(names), SKIP_REASON)


def test_a_request_the_fleet_answered_is_done_as_if_tuned_here(tmp_path: Path) -> None:
    """The scheduler skipped it (fresh winners from identical hosts, in the shared store):
    no session ends here, yet the spool entry goes and the other GPUs stop waiting."""
    name = kernel_request().workload_name
    work, queue = two_gpu_work(tmp_path, tuned=set())
    work.tune_kernel(kernel_request())
    work.work_skipped(skipped(["someone.elses"], gpu=1))
    assert len(list((tmp_path / "spool").glob("*.json"))) == 1 and queue.withdrawn == []
    work.work_skipped(skipped([name], gpu=1))
    assert not list((tmp_path / "spool").glob("*.json"))
    assert not list((tmp_path / "spool").glob(f"{REJECTED_DIR}/*"))
    assert queue.withdrawn == [((name,), (0,))]
    assert work.listing(()) == []
    assert [r for r in queue.requests if r[2] != "user kernel request"] == []  # no retry


def test_an_added_workload_the_fleet_answered_leaves_the_other_gpus(tmp_path: Path) -> None:
    work, queue = two_gpu_work(tmp_path, tuned=set())
    work.add(parse_add_request(add_request([GEMM])))
    work.work_skipped(skipped([GEMM.name], gpu=0))
    assert queue.withdrawn == [((GEMM.name,), (1,))]
    assert work.added_names() == {GEMM.name}  # still tuned on drift, like configured ones


def test_the_daemon_tells_its_user_work_of_work_the_fleet_answered(daemon: Daemon) -> None:
    req = kernel_request()
    call(daemon, {"op": "tune_kernel", "request": req.to_json()})
    spool = daemon.user_work.spool_dir
    assert len(list(spool.glob("*.json"))) == 1
    info = daemon.backend.device_info(0)
    daemon.tuner.events.notify_skipped(skipped([req.workload_name], model=info.name))
    assert not list(spool.glob("*.json"))
    listed = call(daemon, {"op": "list_workloads"})
    assert req.workload_name not in json.dumps(listed)


def test_the_added_list_survives_a_corrupt_file_by_setting_it_aside(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    path.write_text('{"format": "something else"}')
    added = AddedWorkloads(path)
    added.load()
    assert added.workloads() == () and (tmp_path / (FILE_NAME + ".bad")).exists()
    added.add([GEMM], {"pid": 1})
    again = AddedWorkloads(path)
    again.load()
    assert again.workloads() == (GEMM,) and again.get(GEMM.name).source == {"pid": 1}  # type: ignore[union-attr]


def test_the_workloads_command_against_the_daemon(
    daemon: Daemon, short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatchd.cli.main import main
    from gpuwatchd.tuning.intake.workload_requests import workloads_toml

    file = short_dir / "captured.toml"
    file.write_text(workloads_toml([GEMM]))
    sock = str(daemon.control.path)
    daemon.control.start()
    try:
        assert main(["workloads", "--socket", sock, "add", str(file)]) == 0
        assert main(["workloads", "--socket", sock, "list"]) == 0
        assert main(["workloads", "--socket", sock, "remove", GEMM.name]) == 0
        assert main(["workloads", "--socket", sock, "remove", "gemm-bf16-8192"]) == 2
    finally:
        daemon.control.stop()
    out = capsys.readouterr()
    assert f"added {GEMM.name}" in out.out and f"removed {GEMM.name}" in out.out
    listed = [line.split() for line in out.out.splitlines() if line.startswith(GEMM.name)]
    assert listed and listed[0][-1] == "added"
    assert "is a configured workload" in out.err


def test_requests_spooled_while_the_daemon_runs_are_taken_by_a_rescan(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuwatchd.daemon.user_work")
    daemon.user_work.load()
    spool = daemon.user_work.spool_dir
    longer = kernel_request(key_values={"n_cols": 8192})
    write_request(spool, longer)
    write_request(spool, kernel_request(module="evil.kernels"))
    daemon.user_work.rescan()
    daemon.user_work.rescan()
    assert daemon.tuner.pending() == {0: (longer.workload_name,)}
    refused = [r for r in caplog.records if "left in the spool" in r.getMessage()]
    assert len(refused) == 1  # said once, the file kept for the admin
    assert len([r for r in caplog.records if "took 1 kernel request" in r.getMessage()]) == 1


def test_added_names_are_read_without_waiting_for_the_lock(tmp_path: Path) -> None:
    """A scrape reads them on the servers' event loop: a writer holding the lock (a slow
    disk under the added list) must not stall it; what it reads is the last published set."""
    import threading

    work, _ = two_gpu_work(tmp_path, tuned=set())
    work.add(parse_add_request(add_request([GEMM])))
    got: list[frozenset[str]] = []
    with work._lock:  # a writer in the middle of a change
        reader = threading.Thread(target=lambda: got.append(work.added_names()), daemon=True)
        reader.start()
        reader.join(2.0)
    assert got == [frozenset({GEMM.name})]
    work.remove([GEMM.name])
    assert work.added_names() == frozenset()
