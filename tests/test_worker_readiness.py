"""The tuning worker's Python checked at start: torch (and Triton) importable or not.

A worker interpreter without torch (the fake below: a ``torch.py`` first on its path
that raises ImportError) gets one WARNING with the fix, ``gpuwatchd_tuning_ready`` 0
with its reason, and no session that would fail; the sim family needs no torch and
keeps tuning.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import free_port, wait_until
from daemon_helpers import http_get, start_daemon
from prometheus_client import CollectorRegistry, generate_latest
from test_scheduler import FakeRunner, put

from gpuwatchd.config import Config
from gpuwatchd.config.loader import TuningConfig
from gpuwatchd.exporter.collectors.tuning import TuningCollector
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.readiness import (
    FIX,
    ProbeResult,
    WorkerProbe,
    allows,
    blocking_module,
    probe,
    readiness,
)
from gpuwatchd.sessions.scheduler import WORKER_NOT_READY, TuneScheduler
from gpuwatchd.store import SqlStore, sqlite_store
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS

WORKLOADS = {w.name: w for w in DEFAULT_WORKLOADS}
SIM, CPU, GEMM = WORKLOADS["sim-gemm"], WORKLOADS["cpu-matmul"], WORKLOADS["gemm-bf16-8192"]
NO_TORCH = ProbeResult("py", missing={"torch": "ImportError: x", "triton": "ImportError: y"})
NO_TRITON = ProbeResult("py", missing={"triton": "ModuleNotFoundError: triton"})


def fake_python_without_torch(tmp: Path) -> Path:
    """An interpreter whose ``import torch`` raises ImportError, the rest as usual."""
    mods = tmp / "no-torch"
    mods.mkdir()
    (mods / "torch.py").write_text("raise ImportError('No module named torch (test)')\n")
    script = tmp / "python-without-torch"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH={mods}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


def test_what_blocks_a_workload() -> None:
    assert blocking_module(SIM, {"torch", "triton"}) is None  # the sim family needs nothing
    assert blocking_module(CPU, {"torch"}) == "torch"  # the cpu device imports torch
    assert blocking_module(GEMM, {"triton"}) is None  # torch.matmul's candidates still run
    assert blocking_module(GEMM, {"torch"}) == "torch"
    assert allows(None, SIM) and not allows(None, CPU)  # before the probe answers
    assert allows(NO_TORCH, SIM) and not allows(NO_TORCH, CPU)
    assert allows(ProbeResult("py", failed="timeout"), CPU)  # unknown: not blocked


def test_readiness_reasons() -> None:
    assert readiness(NO_TORCH, [SIM, CPU], enabled=False) == (False, "disabled")
    assert readiness(None, [SIM]) == (True, "ok")
    assert readiness(None, [CPU]) == (False, "checking")
    assert readiness(NO_TORCH, [SIM, CPU]) == (False, "no_torch")
    assert readiness(NO_TRITON, [GEMM]) == (True, "ok")
    assert readiness(NO_TRITON, [WORKLOADS["gemm-bf16-8192"], CPU]) == (True, "ok")
    assert readiness(ProbeResult("py", failed="boom"), [CPU]) == (False, "probe_failed")


def test_probe_of_an_interpreter_without_torch(tmp_path: Path) -> None:
    result = probe(str(fake_python_without_torch(tmp_path)), ("torch", "json"))
    assert result.failed is None
    assert set(result.missing) == {"torch"}
    assert "No module named torch (test)" in result.missing["torch"]
    assert "cannot import torch" in result.describe() and FIX in result.describe()


def test_the_probe_runs_the_interpreter_as_the_worker_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "json.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.chdir(cwd)
    spy = tmp_path / "spy-python"
    spy.write_text(f'#!/bin/sh\npwd > {tmp_path}/cwd.txt\nexec {sys.executable} "$@"\n')
    spy.chmod(0o755)
    result = probe(str(spy), ("json",))
    assert result.failed is None and result.missing == {}
    assert (tmp_path / "cwd.txt").read_text().strip() == "/"
    assert not (tmp_path / "ran").exists()  # -P: the working directory's json.py is not it


def test_probe_that_cannot_answer_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    assert probe(str(tmp_path / "no-such-python")).failed is not None
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\necho 'fatal: broken interpreter' >&2\nexit 3\n")
    crash.chmod(0o755)
    result = probe(str(crash))
    assert result.failed == "exit status 3: fatal: broken interpreter"
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    assert "took over 0.2 s" in str(probe(str(hang), timeout_s=0.2).failed)


def _scheduler(tmp_path: Path, result: ProbeResult) -> tuple[TuneScheduler, StateBoard, SqlStore]:
    FakeRunner.instances = []
    board = StateBoard()
    store = sqlite_store(tmp_path / "g.db")
    worker_probe = WorkerProbe("py", run=lambda _python: result)
    cfg = Config(tuning=TuningConfig(check_interval_s=1.0, workloads=("sim-gemm", "cpu-matmul")))
    sched = TuneScheduler(
        cfg.tuning_setup(), board, store, "sim", runner_factory=FakeRunner,
        worker_probe=worker_probe,
    )  # fmt: skip
    worker_probe.start()
    assert worker_probe.wait(5) is result
    return sched, board, store


def test_the_scheduler_starts_only_what_the_worker_can_import(tmp_path: Path, caplog) -> None:
    sched, board, store = _scheduler(tmp_path, NO_TORCH)
    try:
        put(board, 0, GateState.COOL_STABLE)
        sched.request(0, [CPU], "manual")
        sched.tick()
        assert not FakeRunner.instances  # a cpu session would fail: not started
        assert sched.snapshot.deferred_total == {WORKER_NOT_READY: 1}
        assert sched.snapshot.ready == (False, "no_torch")
        sched.request(0, [SIM], "manual")
        sched.tick()
        (runner,) = FakeRunner.instances
        assert runner.started.wait(2)
        assert runner.spec.workloads == (SIM,)
        runner.release.set()
        assert wait_until(lambda: sched.pending() == {0: ("cpu-matmul",)})
    finally:
        sched.shutdown()
        store.close()


def test_the_warning_says_the_fix_once(tmp_path: Path, caplog) -> None:
    with caplog.at_level("INFO", logger="gpuwatchd.sessions.scheduler"):
        sched, _, store = _scheduler(tmp_path, NO_TORCH)
    store.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "tuning not ready (no_torch)" in warnings[0] and FIX in warnings[0]
    assert sched.snapshot.ready == (False, "no_torch")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_ready_metric_passes_promtool(tmp_path: Path) -> None:
    sched, board, store = _scheduler(tmp_path, NO_TORCH)
    store.close()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(TuningCollector(board, lambda: sched.snapshot))
    text = generate_latest(registry).decode()
    assert 'gpuwatchd_tuning_ready{reason="no_torch"} 0.0' in text
    assert f'gpuwatchd_tune_deferred_total{{reason="{WORKER_NOT_READY}"}} 0.0' in text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_check_config_says_so_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[daemon]\nbackend = "sim"\n'
        f'[tuning]\nworker_python = "{fake_python_without_torch(tmp_path)}"\n'
        'workloads = ["sim-gemm", "cpu-matmul"]\n'
    )
    res = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "check-config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    ok, line = res.stdout.strip().splitlines()
    assert ok == f"{cfg}: OK"
    assert line.startswith("tuning: NOT READY (no_torch): ") and FIX in line


def test_a_daemon_whose_worker_lacks_torch_warns_and_fails_no_session(tmp_path: Path) -> None:
    port = free_port()
    python = fake_python_without_torch(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
        f'state_dir = "{tmp_path / "state"}"\ncontrol_socket = "{tmp_path / "c.sock"}"\n'
        "[sim]\nspeed = 30.0\n[gate]\nwindow_s = 20.0\n"  # the gate opens within a second
        f'[tuning]\ncheck_interval_s = 0.5\nworker_python = "{python}"\n'
        'workloads = ["sim-gemm", "cpu-matmul"]\n'
    )
    proc = start_daemon(["--config", str(cfg)])
    url = f"http://127.0.0.1:{port}/metrics"

    def metrics() -> str:
        try:
            return http_get(url)
        except OSError:
            return ""

    try:
        assert wait_until(lambda: 'gpuwatchd_tuning_ready{reason="no_torch"} 0.0' in metrics(), 30)
        assert wait_until(
            lambda: 'gpuwatchd_tune_sessions_total{status="completed"} 1.0' in metrics(), 60
        ), metrics()
        text = metrics()
        assert 'gpuwatchd_tune_sessions_total{status="failed"} 0.0' in text
        assert f'gpuwatchd_tune_deferred_total{{reason="{WORKER_NOT_READY}"}}' in text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    warnings = [ln for ln in out.splitlines() if "WARNING" in ln and "not ready" in ln]
    assert len(warnings) == 1, out
    assert "cannot import torch" in warnings[0] and FIX in warnings[0]


def test_the_probe_runs_only_once_work_needs_a_module(tmp_path: Path) -> None:
    calls: list[str] = []
    worker_probe = WorkerProbe("py", run=lambda python: calls.append(python) or NO_TORCH)
    store = sqlite_store(tmp_path / "g.db")
    cfg = Config(tuning=TuningConfig(check_interval_s=1.0))
    sched = TuneScheduler(cfg.tuning_setup(), StateBoard(), store, "sim", worker_probe=worker_probe)
    try:
        sched.check_worker([SIM])  # a sim-only daemon never imports torch to find out
        assert not worker_probe.started and sched.snapshot.ready == (True, "ok")
        sched.request(0, [CPU], "manual")
        assert worker_probe.wait(5) is NO_TORCH
        sched.request(0, [CPU], "manual")
        assert calls == ["py"]
    finally:
        sched.shutdown()
        store.close()
