"""The tuning worker and the daemon-side runner: wire format, real workers, failure modes.

Real workers run on the ``cpu`` device (real torch CPU ops) and on ``sim``; crashes,
hangs, garbage and preemption use small fake workers injected as ``worker_cmd``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.sessions.runner import RunnerBusy, TuneRunner
from gpuwatchd.store import SqlStore
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.session_spec import (
    ErrorMessage,
    Hello,
    Progress,
    ResultMessage,
    SessionSpec,
    SessionSpecError,
    SimSpec,
    decode_message,
    encode_message,
)
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import CandidateStats, Regime, RegimeResult, SessionStatus, Workload
from gpuwatchd.tuning.worker_isolation import PRIVATE_DIRS

REPO = Path(__file__).resolve().parent.parent
BOTH = (Regime.UNTHROTTLED, Regime.SUSTAINED)
CPU_INFO = DeviceInfo(index=0, uuid="cpu-0", name="test cpu")
WL = Workload("mm", "matmul", {"m": 64, "n": 64, "k": 64}, "fp32", ("cpu.matmul",))
FAKE_JOB = SessionSpec(0, "cpu-0", "cpu", (WL,), BOTH)


def never() -> str | None:
    return None


def gone(pid: int, within_s: float = 1.0) -> bool:
    """True once the process is dead: absent, or a zombie its parent has yet to reap
    (a worker's orphaned grandchild is reaped by init, a moment later)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X") or time.monotonic() >= deadline:
            return state in ("Z", "X")
        time.sleep(0.01)


def reaped(pid: int) -> bool:
    """No such process at all: not even a zombie waiting for the runner to reap it."""
    return not Path(f"/proc/{pid}").exists()


# -- the wire format -------------------------------------------------------------------------


def test_runner_and_session_spec_never_import_torch() -> None:
    code = (
        "import sys, gpuwatchd.sessions.runner, gpuwatchd.tuning.session_spec\n"
        "bad = [m for m in ('torch', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


def _result(regime: Regime = Regime.SUSTAINED) -> RegimeResult:
    def cand(name: str, median: float | None) -> CandidateStats:
        return CandidateStats(
            name, "fam", regime, median, 0.01, 7, 1, 1.44e9, 690.0, 61.0, 0.5, 4, {"k": [1, 2]}
        )

    return RegimeResult("mm", regime, (cand("a", 1e-3), cand("b", None)), "a", False, 0.04, 0.01)


def test_job_and_messages_round_trip() -> None:
    spec = SessionSpec(
        2,
        "GPU-sim-x",
        "sim",
        (WL,),
        BOTH,
        ProtocolConfig(time_budget_s=5.0, seed=3),
        30.0,
        SimSpec("power-cap", 7, 4, start_t=12.5),
    )
    assert SessionSpec.loads(spec.dumps()) == spec
    for msg in (
        Hello(12, decode_message(encode_message(Hello(12, _hello_versions()))).versions),
        Progress("mm", Regime.UNTHROTTLED, "a", 0, 2, 5, 1980.0, None, 41.0),
        ResultMessage(_result()),
        ErrorMessage("CUDA out of memory"),
    ):
        line = encode_message(msg)
        assert "\n" not in line
        assert decode_message(line) == msg


def _hello_versions() -> Any:
    from gpuwatchd.tuning.types import Versions

    return Versions(torch="2.13", cudnn="91900", driver="580.1")


def test_non_finite_meta_is_sent_as_null() -> None:
    r = _result()
    bad = RegimeResult(
        r.workload,
        r.regime,
        (
            CandidateStats(
                "a",
                "f",
                r.regime,
                1.0,
                None,
                1,
                0,
                None,
                None,
                None,
                None,
                0,
                {"x": math.inf, "t": (1, 2)},
            ),
        ),
        None,
        False,
        math.inf,
        None,
    )
    back = decode_message(encode_message(ResultMessage(bad)))
    assert isinstance(back, ResultMessage)
    assert back.result.candidates[0].meta == {"x": None, "t": [1, 2]}
    assert back.result.margin is None


_GOOD_JOB = SessionSpec(0, "cpu-0", "cpu", (WL,), BOTH).to_json()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"gpu_index": -1}, "spec.gpu_index: expected an integer >= 0, got -1"),
        ({"gpu_index": True}, "spec.gpu_index"),
        ({"device": "tpu"}, "spec.device: expected one of cuda, cpu, sim"),
        ({"regimes": ["cool"]}, "spec.regimes[0]: expected one of unthrottled, sustained"),
        ({"regimes": ["sustained", "sustained"]}, "spec.regimes: expected each regime once"),
        ({"workloads": []}, "spec.workloads: expected a non-empty list"),
        ({"workloads": [{**WL.to_json(), "shape": [64]}]}, "spec.workloads[0].shape"),
        ({"workloads": [WL.to_json(), WL.to_json()]}, "spec.workloads[1].name: duplicate"),
        ({"protocol": {"pause_s": -1}}, "spec.protocol.pause_s: must be >= 0"),
        ({"protocol": {"nope": 1}}, "spec.protocol.nope: unknown setting"),
        ({"time_budget_s": 0}, "spec.time_budget_s: expected a number > 0"),
        ({"sim": {"scenario": "idle"}}, "spec.sim: only for device sim"),
        ({"device": "sim"}, "spec.sim: required for device sim"),
        ({"extra": 1}, "spec.extra: unknown key"),
    ],
)
def test_bad_job_specs_name_the_field(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(SessionSpecError) as err:
        SessionSpec.loads(json.dumps({**_GOOD_JOB, **change}))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def _result_json(**change: Any) -> str:
    d = json.loads(encode_message(ResultMessage(_result())))
    d["result"].update(change)
    return json.dumps(d)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "message: not valid JSON"),
        ("[1, 2]", "message: expected an object"),
        ('{"type": "hello", "pid": 1, "versions": {"torch": 2}}', "hello.versions.torch"),
        ('{"type": "hello", "pid": 0, "versions": {}}', "hello.pid"),
        ('{"type": "wat"}', "message.type"),
        (
            '{"type": "progress", "workload": "mm", "regime": "sustained", "candidate": "a",'
            ' "done": 3, "total": 2}',
            "progress.done: expected at most total",
        ),
        (_result_json(winner="zzz"), "result.winner: expected null or one of its candidates"),
        (_result_json(tie=True), "result.winner: expected null on a tie"),
        (_result_json(margin="big"), "result.margin: expected a finite number"),
        (_result_json(regime="unthrottled"), "result.candidates[0].regime"),
        (_result_json().replace("0.04", "NaN"), "message: NaN is not allowed"),
        (_result_json().replace('"samples": 7', '"samples": -7'), "result.candidates[0].samples"),
    ],
)
def test_bad_messages_name_the_field(line: str, needle: str) -> None:
    with pytest.raises(SessionSpecError) as err:
        decode_message(line)
    assert needle in str(err.value)


# -- real workers ----------------------------------------------------------------------------


def test_real_cpu_worker_completes_and_records(store: SqlStore) -> None:
    cfg = ProtocolConfig(
        batch_target_s=0.002,
        warmup_s=0.005,
        pause_s=0.0,
        cool_pause_s=0.0,
        min_rounds=3,
        max_rounds=6,
        time_budget_s=0.6,
        settle_window_s=0.02,
        settle_timeout_s=0.05,
    )
    spec = SessionSpec(0, "cpu-0", "cpu", (WL,), BOTH, cfg, time_budget_s=1.2)
    progress: list[dict[str, Any]] = []
    out = TuneRunner(store).run_session(spec, CPU_INFO, "sim", never, progress.append, 60)
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert {r.regime for r in out.results} == set(BOTH)
    row = store.session(out.session_id)
    assert row is not None and row.status is SessionStatus.COMPLETED
    assert row.meta.versions.torch == version("torch")
    assert row.meta.extra["device"] == "cpu"
    stored = store.results(out.session_id)
    assert [(s.result.workload, s.result.regime) for s in stored] == [("mm", r) for r in BOTH]
    names = {c.name for c in stored[0].result.candidates}
    assert "torch.matmul" in names and len(names) >= 4
    assert any(c.samples > 0 and c.median_s for c in stored[0].result.candidates)
    assert progress and progress[0]["session_id"] == out.session_id
    assert progress[0]["workload"] == "mm" and progress[0]["total"] == 2


SIM_GEMM = Workload("sim-gemm", "gemm", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("sim",))


def power_capped_sim_spec(
    gpus: int, gpu: int, seed: int, budget_s: float
) -> tuple[DeviceInfo, SessionSpec]:
    """GPU ``gpu`` of a simulated machine at its power cap, and a ``sim-gemm`` job for it
    measuring each regime for ``budget_s`` (the session gets twice that)."""
    info = SimBackend(gpus=gpus, scenario="power-cap", seed=seed).device_info(gpu)
    protocol = ProtocolConfig(time_budget_s=budget_s)
    sim = SimSpec("power-cap", seed, gpus)
    spec = SessionSpec(gpu, info.uuid, "sim", (SIM_GEMM,), BOTH, protocol, 2 * budget_s, sim)
    return info, spec


def test_real_sim_worker_tunes_sim_gemm(store: SqlStore) -> None:
    info, spec = power_capped_sim_spec(gpus=2, gpu=1, seed=5, budget_s=20.0)
    out = TuneRunner(store).run_session(spec, info, "sim", never, None, 60)
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    sustained = next(r for r in out.results if r.regime is Regime.SUSTAINED)
    assert sustained.winner == "sim.cublas-like"  # the power-capped regime's winner
    row = store.session(out.session_id)
    assert row is not None and row.meta.versions.driver == "sim"
    assert row.meta.gpu_uuid == info.uuid and row.meta.gpu_index == 1
    assert len(store.results(out.session_id)) == 2


def test_sim_worker_starts_at_the_daemons_point_of_the_scenario(store: SqlStore) -> None:
    info = SimBackend(gpus=1, scenario="gpu-lost", seed=0).device_info(0)
    # The scenario's GPU is off the bus from t = 20 s to 50 s: a job starting at 25 s hits it.
    spec = SessionSpec(0, info.uuid, "sim", (SIM_GEMM,), BOTH, sim=SimSpec("gpu-lost", 0, 1, 25.0))
    out = TuneRunner(store).run_session(spec, info, "sim", never, None, 30)
    assert out.status is SessionStatus.FAILED
    assert out.why == "worker error: GpuLost: GPU 0 is lost: simulated: off the bus since t=20s"


def test_worker_on_the_wrong_gpu_fails_clearly(store: SqlStore) -> None:
    info = SimBackend(gpus=1, scenario="idle", seed=1).device_info(0)
    spec = SessionSpec(0, info.uuid, "sim", (WL,), BOTH, sim=SimSpec("idle", 2, 1))  # seed differs
    out = TuneRunner(store).run_session(spec, info, "sim", never, None, 30)
    assert out.status is SessionStatus.FAILED
    assert out.why is not None and out.why.startswith("worker error: spec.gpu_uuid is GPU-sim-")


# -- fake workers ----------------------------------------------------------------------------

PRELUDE = """
import json, os, signal, subprocess, sys, time
job = json.loads(sys.stdin.read())
def send(d):
    sys.stdout.write(json.dumps(d) + "\\n"); sys.stdout.flush()
send({"type": "hello", "pid": os.getpid(), "versions": {"torch": "fake-1.0"}})
"""


@pytest.fixture
def runner_for(store: SqlStore) -> Any:
    def make(body: str, **kw: Any) -> TuneRunner:
        return TuneRunner(store, worker_cmd=[sys.executable, "-c", PRELUDE + body], **kw)

    return make


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("os.kill(os.getpid(), signal.SIGSEGV)", "worker crashed: exit 139 (SIGSEGV)"),
        ("os.abort()", "worker crashed: exit 134 (SIGABRT)"),
        (
            "print('boom: it exploded', file=sys.stderr); sys.exit(3)",
            "worker crashed: exit 3: boom: it exploded",
        ),
        (
            "send({'type': 'error', 'message': 'CUDA out of memory'}); sys.exit(1)",
            "worker error: CUDA out of memory",
        ),
        ("sys.exit(0)", "worker finished without a result for mm (unthrottled), mm (sustained)"),
    ],
)
def test_worker_crash_fails_the_session(
    store: SqlStore, runner_for: Any, body: str, why: str
) -> None:
    runner = runner_for(body)
    out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
    assert (out.status, out.why) == (SessionStatus.FAILED, why)
    row = store.session(out.session_id)
    assert row is not None and (row.status, row.why) == (SessionStatus.FAILED, why)
    assert row.ended_at is not None and row.meta.versions.torch == "fake-1.0"
    assert runner.pids() == frozenset()


def test_hung_worker_times_out_and_is_killed(store: SqlStore, runner_for: Any) -> None:
    pids: list[frozenset[int]] = []
    runner = runner_for("time.sleep(60)")

    def watch() -> None:
        pids.append(runner.pids())

    t0 = time.monotonic()
    out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", lambda: watch(), None, 1)
    assert time.monotonic() - t0 < 3.0  # killed at 1 s, not left to sleep 60
    assert (out.status, out.why) == (SessionStatus.FAILED, "worker timed out after 1 s")
    (pid,) = pids[-1]
    assert reaped(pid)
    assert store.session_totals()[SessionStatus.FAILED] == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("print('this is not json'); time.sleep(60)", "message: not valid JSON"),
        (
            "send({'type': 'result', 'result': {'workload': 'other'}}); time.sleep(60)",
            "result.regime: missing",
        ),
        (
            "send({'type': 'progress', 'workload': 'nope', 'regime': 'sustained',"
            " 'candidate': 'a', 'done': 0, 'total': 2}); time.sleep(60)",
            "progress for nope (sustained), which is not in the spec",
        ),
    ],
)
def test_garbage_output_fails_and_kills(runner_for: Any, body: str, needle: str) -> None:
    t0 = time.monotonic()
    out = runner_for(body).run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
    assert time.monotonic() - t0 < 3.0  # killed at once, not left to sleep 60
    assert out.status is SessionStatus.FAILED
    assert out.why is not None and out.why.startswith("worker sent invalid output: ")
    assert needle in out.why


def test_fake_worker_results_are_recorded_and_the_runner_is_reusable(
    store: SqlStore, runner_for: Any
) -> None:
    crash = runner_for("sys.exit(3)").run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
    assert crash.status is SessionStatus.FAILED
    results = [json.loads(encode_message(ResultMessage(_result(r)))) for r in BOTH]
    body = f"for m in {results!r}: send(m)\n"
    runner = runner_for(body)
    for _ in range(2):
        out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
        assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
        assert [r.regime for r in out.results] == list(BOTH)
    assert {w.regime for w in store.winners()} == set(BOTH)


SPIN = """
open(os.environ["GRANDCHILD_FILE"], "w").write(str(subprocess.Popen(["sleep", "60"]).pid))
{ignore}
send({{"type": "progress", "workload": "mm", "regime": "sustained", "candidate": "a",
      "done": 1, "total": 2}})
while True:
    time.sleep(0.01)
"""


@pytest.mark.parametrize("ignore_term", [False, True])
def test_preemption_stops_the_worker_within_a_second(
    store: SqlStore, tmp_path: Path, ignore_term: bool
) -> None:
    grandchild_file = tmp_path / "grandchild"
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else ""
    runner = TuneRunner(
        store,
        env={**os.environ, "GRANDCHILD_FILE": str(grandchild_file)},
        worker_cmd=[sys.executable, "-c", PRELUDE + SPIN.format(ignore=ignore)],
    )
    seen: list[dict[str, Any]] = []
    worker_pids: list[int] = []
    reason_at: list[float] = []
    busy: list[str] = []

    def should_preempt() -> str | None:
        if not seen:
            return None
        if not reason_at:
            worker_pids.extend(runner.pids())
            with pytest.raises(RunnerBusy) as err:  # one session at a time
                runner.run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 5)
            busy.append(str(err.value))
            reason_at.append(time.monotonic())
            watcher.start()
        return "foreign process 4242 on GPU 0"

    died_at: list[float] = []

    def watch_worker() -> None:
        if gone(worker_pids[0], within_s=5.0):  # dead (zombie or reaped), not just killed
            died_at.append(time.monotonic())

    watcher = threading.Thread(target=watch_worker)
    out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", should_preempt, seen.append, 20)
    returned_in = time.monotonic() - reason_at[0]
    watcher.join(5.0)
    assert died_at and died_at[0] - reason_at[0] < 1.0
    assert returned_in < 3.0
    assert (out.status, out.why) == (SessionStatus.PREEMPTED, "foreign process 4242 on GPU 0")
    assert busy and len(worker_pids) == 1
    assert reaped(worker_pids[0])
    assert gone(int(grandchild_file.read_text()))  # the whole process group went
    row = store.session(out.session_id)
    assert row is not None and row.status is SessionStatus.PREEMPTED
    assert runner.pids() == frozenset()
    assert len(store.sessions()) == 1  # the refused nested call started nothing


def test_cancel_stops_a_running_session(store: SqlStore, tmp_path: Path) -> None:
    runner = TuneRunner(
        store,
        env={**os.environ, "GRANDCHILD_FILE": str(tmp_path / "g")},
        worker_cmd=[sys.executable, "-c", PRELUDE + SPIN.format(ignore="")],
    )
    assert runner.cancel("nothing to cancel") is False
    timer = threading.Timer(0.5, runner.cancel, ["daemon shutting down"])
    timer.start()
    try:
        out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
    finally:
        timer.cancel()
    assert (out.status, out.why) == (SessionStatus.PREEMPTED, "cancelled: daemon shutting down")


def test_sigterm_stops_a_real_worker_at_a_batch_boundary(tmp_path: Path) -> None:
    # A long budget so the worker is still measuring when it is told to stop.
    _, spec = power_capped_sim_spec(gpus=1, gpu=0, seed=0, budget_s=1e5)
    # Without the daemon's runner, so without its private folders: not the ones an
    # in-process torch.compile of an earlier test pointed os.environ at (/tmp/torchinductor_*),
    # which the worker rightly refuses.
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_DIRS}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd.tuning.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
    )
    assert proc.stdin and proc.stdout
    proc.stdin.write(spec.dumps().encode())
    proc.stdin.close()
    try:
        assert decode_message(proc.stdout.readline()).__class__ is Hello
        assert isinstance(decode_message(proc.stdout.readline()), Progress)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 143
        assert time.monotonic() - t0 < 1.5
    finally:
        proc.kill()
        proc.wait()


def test_an_escaped_grandchild_holding_stdout_does_not_block(
    store: SqlStore, tmp_path: Path
) -> None:
    pid_file = tmp_path / "escaped"
    results = [json.loads(encode_message(ResultMessage(_result(r)))) for r in BOTH]
    body = (
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"  # keeps our stdout
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        f"for m in {results!r}: send(m)\n"
    )
    runner = TuneRunner(store, worker_cmd=[sys.executable, "-c", PRELUDE + body], exit_wait_s=0.2)
    t0 = time.monotonic()
    try:
        out = runner.run_session(FAKE_JOB, CPU_INFO, "sim", never, None, 20)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert time.monotonic() - t0 < 3.0
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)


def test_an_interrupted_runner_kills_the_worker_and_fails_the_session(
    store: SqlStore, runner_for: Any
) -> None:
    runner = runner_for("time.sleep(60)")
    pids: list[int] = []

    def interrupt() -> str | None:
        pids.extend(runner.pids())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run_session(FAKE_JOB, CPU_INFO, "sim", interrupt, None, 20)
    assert pids and reaped(pids[0])
    (row,) = store.sessions()
    assert (row.status, row.why) == (SessionStatus.FAILED, "runner interrupted: KeyboardInterrupt")
