"""A job's own processes never keep its gate shut, and its wait keeps the daemon's history.

A scripted GPU is polled by the real poller: idle and quiet, then the job (PID 4242 on
the host, with a DataLoader child 4250) opens a CUDA context and stays on the GPU. The
daemon's own gate calls that ``busy`` (the job is foreign to the daemon's tuning);
judged for the job (``register_job`` + ``job_gate``, PIDs from a fake ``/proc``) the GPU
is open at once, since it was quiet long before, and a real foreign process still
shuts it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from builders import h200, idle

from gpuwatchd.api.state import parse_gpu_state
from gpuwatchd.client import Client
from gpuwatchd.daemon.history import SampleHistory, horizon
from gpuwatchd.daemon.job_gate import JUDGED_BY, JobGates, job_ops
from gpuwatchd.daemon.jobs import JobError, JobRegistry, ProcFs
from gpuwatchd.daemon.ops import OpTable
from gpuwatchd.exporter import DaemonInfo, build_registry
from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.control import ControlServer, PeerCred, RequestError
from gpuwatchd.telemetry.types import DeviceInfo, Sample

JOB, CHILD, STRANGER, OTHER_USER = 4242, 4250, 999, 4260
CFG = GateConfig(settle_s=10.0, window_s=5.0, min_samples=5)


class ScriptedGpu:
    """One idle H200, read every 0.5 s of its clock; ``procs`` is who is on it now."""

    name = "replay"

    def __init__(self) -> None:
        self.t = 0.0
        self.procs: tuple[int, ...] = ()
        self.clock = self

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def devices(self) -> list[int]:
        return [0]

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        return h200(uuid="GPU-0000-job")

    def read(self, gpu: int) -> Sample:
        self.t += 0.5
        return replace(idle(self.t), procs=self.procs, util_gpu=0.0)

    def read_energy(self, gpu: int) -> float | None:
        return None

    def close(self) -> None:
        pass


def fake_proc(root: Path, pid: int, ppid: int, pgid: int, uid: int = 1000) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    fields = ["S", str(ppid), str(pgid), "0", "0", "0", "0"] + ["0"] * 12 + [str(pid * 10)]
    (d / "stat").write_text(f"{pid} (python3 x) " + " ".join(fields) + " 0 0\n")
    (d / "status").write_text(f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


@pytest.fixture
def proc(tmp_path: Path) -> ProcFs:
    root = tmp_path / "proc"
    fake_proc(root, 1, 0, 1, uid=0)
    fake_proc(root, JOB, 1, JOB)
    fake_proc(root, CHILD, JOB, JOB)  # a DataLoader worker
    fake_proc(root, OTHER_USER, 1, JOB, uid=2000)  # same group, another user: not the job's
    fake_proc(root, STRANGER, 1, STRANGER)
    return ProcFs(root)


class Host:
    """The daemon's parts that judge gates: poller, board, history, jobs."""

    def __init__(self, proc: ProcFs) -> None:
        self.gpu = ScriptedGpu()
        self.board = StateBoard()
        self.poller = Poller(self.gpu, self.board, CFG)
        self.history = SampleHistory(lambda: CFG)
        self.poller.add_listener(self.history.observe)
        self.registry = JobRegistry(proc, clock=self.gpu.now)
        self.gates = JobGates(self.registry, self.history, self.board, lambda: CFG)
        self.ops = OpTable(job_ops(self.gates))

    def poll(self, seconds: float) -> None:
        for _ in range(int(seconds / 0.5)):
            self.poller.poll(0)

    def ask(self, doc: dict[str, object], pid: int = JOB) -> dict[str, object]:
        return self.ops(doc, PeerCred(pid=pid, uid=1000, gid=1000))


@pytest.fixture
def host(proc: ProcFs) -> Host:
    return Host(proc)


def test_the_job_registers_with_its_host_pid_children_and_same_user_group(host: Host) -> None:
    answer = host.ask({"op": "register_job"})
    assert answer == {"ok": True, "job": f"{JOB}-{JOB * 10}", "pid": JOB, "pids": [JOB, CHILD]}
    assert host.ask({"op": "register_job"})["job"] == answer["job"]  # the same job again


def test_a_gpu_quiet_before_the_job_opens_for_it_at_once(host: Host) -> None:
    host.poll(30)  # quiet for 30 s before the job starts
    host.gpu.procs = (JOB, CHILD)
    host.poll(2)
    own = host.board.get(0)
    assert own is not None and own.gate is not None
    assert own.gate.state is GateState.BUSY  # the daemon's tuning still yields to the job
    job = host.ask({"op": "register_job"})["job"]
    answer = host.ask({"op": "job_gate", "gpu": 0, "job": job})
    st = parse_gpu_state(answer["gpu"])
    assert answer["judged_by"] == JUDGED_BY and answer["excluded_pids"] == [JOB, CHILD]
    assert st.open and st.state == "cool_stable" and st.compute_pids == (JOB, CHILD)
    by_uuid = host.ask({"op": "job_gate", "gpu": "GPU-0000-job"}, pid=JOB)  # registers itself
    assert parse_gpu_state(by_uuid["gpu"]).open


def test_a_foreign_process_still_shuts_the_jobs_gate_and_restarts_its_settle(host: Host) -> None:
    host.poll(30)
    host.gpu.procs = (JOB, STRANGER)
    host.poll(2)
    job = host.ask({"op": "register_job"})["job"]
    st = parse_gpu_state(host.ask({"op": "job_gate", "gpu": 0, "job": job})["gpu"])
    assert st.state == "busy" and "pid 999" in st.reasons[0]
    host.gpu.procs = (JOB,)
    host.poll(5)
    st = parse_gpu_state(host.ask({"op": "job_gate", "gpu": 0, "job": job})["gpu"])
    assert not st.open and "settling" in st.reasons[0]
    host.poll(CFG.settle_s)
    assert parse_gpu_state(host.ask({"op": "job_gate", "gpu": 0, "job": job})["gpu"]).open


def test_a_process_of_another_user_in_the_jobs_group_is_foreign(host: Host) -> None:
    host.poll(30)
    host.gpu.procs = (JOB, OTHER_USER)
    host.poll(1)
    job = host.ask({"op": "register_job"})["job"]
    assert not parse_gpu_state(host.ask({"op": "job_gate", "gpu": 0, "job": job})["gpu"]).open


def test_a_job_that_ended_is_unknown_and_bad_requests_name_the_field(
    host: Host, proc: ProcFs
) -> None:
    host.poll(10)
    job = host.ask({"op": "register_job"})["job"]
    for name in ("stat", "status"):
        (proc.root / str(JOB) / name).unlink()
    with pytest.raises(RequestError, match=r"^job: no registered job"):
        host.ask({"op": "job_gate", "gpu": 0, "job": job})
    with pytest.raises(RequestError, match=r"^gpu: expected a GPU index"):
        host.ask({"op": "job_gate", "gpu": True})
    with pytest.raises(RequestError, match=r"^gpu: no GPU 3 watched"):
        host.ask({"op": "job_gate", "gpu": 3, "job": None}, pid=STRANGER)
    with pytest.raises(RequestError, match=r"pid 77: not visible to the daemon"):
        host.ask({"op": "register_job"}, pid=77)


def test_the_registry_is_bounded(proc: ProcFs) -> None:
    registry = JobRegistry(proc, max_jobs=1)
    registry.register(JOB, 1000)
    with pytest.raises(JobError, match="too many registered jobs"):
        registry.register(STRANGER, 1000)


def test_history_keeps_window_plus_settle_twice_and_ignores_repeats(host: Host) -> None:
    host.poll(200)
    samples = host.history.samples(0)
    span = samples[-1].t - samples[0].t
    assert horizon(CFG) - 0.5 <= span <= horizon(CFG)
    snap = host.board.get(0)
    assert snap is not None
    host.history.observe(snap)  # the same reading again
    assert len(host.history.samples(0)) == len(samples)
    assert host.history.samples(0, after=samples[-2].t) == [samples[-1]]


def test_the_real_proc_knows_this_process() -> None:
    st = ProcFs().stat(os.getpid())
    assert st is not None and st.pid == os.getpid() and st.uid == os.getuid()


# -- the job's client ------------------------------------------------------------------------


def test_the_client_waits_for_the_daemons_judgement_for_this_job(proc: ProcFs) -> None:
    """The job holds a context on a GPU quiet for 30 s: judged by the daemon it is open at
    once; re-judged in the job (no control socket) it first waits a whole settle_s."""
    fake_proc(proc.root, os.getpid(), 1, os.getpid(), uid=os.getuid())
    host = Host(proc)
    host.poll(30)
    host.gpu.procs = (os.getpid(),)
    host.poll(1)
    sock_dir = Path(tempfile.mkdtemp(prefix="gwj-", dir="/tmp"))
    control = ControlServer(sock_dir / "ctl.sock", host.ops)
    registry = build_registry(host.board, DaemonInfo("9.9.9", "replay", "3.11"))
    with HttpServer(host.board, registry, ("127.0.0.1", 0)) as http:
        control.start()
        try:
            waited: dict[str, float] = {}
            for sock in (control.path, False):
                start = host.gpu.t
                client = Client(http.url, clock=host.gpu.now, sleep=host.poll, control_socket=sock)
                st = client.wait_until_stable(0, timeout=60, poll_s=0.5)
                assert st.open
                waited[st.judged_by] = host.gpu.t - start
        finally:
            control.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)
    assert waited[JUDGED_BY] == 0.0
    assert waited["client"] >= CFG.settle_s
