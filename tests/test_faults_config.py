"""Fault injection: generated bad configs, and config faults found by fault testing.

Every generated config (a key of every section times the values it must refuse, broken
TOML, bad ``[[workload]]`` tables) either gives one line on stderr and exit 2 from
``gpuwatchd check-config``, or is a valid config. They run in-process for speed; a sample
goes through the real command line, and ``gpuwatchd run`` must refuse the item-1 and
item-4 configs the same way, before it serves anything. ``bench/faults_config.py``
runs every case through the real command line and starts the daemon on the valid ones.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from builders import free_port
from daemon_helpers import http_get, start_daemon, wait_http
from fault_cases import bad_configs, run_daemon_on, run_gpuwatchd, write_case

from gpuwatchd.cli.main import main
from gpuwatchd.config import Config, ConfigError, DaemonConfig, load_config, parse_config
from gpuwatchd.validate import MAX_DURATION_S

CASES = dict(bad_configs())
NO_GROUP = '"nosuchgroup-gpuwatchd"'
_HUGE = "123456789012345678901234567890"
#: Generated configs that are valid after all: seeds, counts and ratios without an upper
#: bound, a replay speed (the replay indexes its trace, it never steps). They run:
#: bench/faults_config.py starts the daemon on each.
VALID = {
    "sim.seed=-1",
    f"sim.seed={_HUGE}",
    "replay.speed=1e15",
    f"replay.speed={_HUGE}",
    f"tuning.max_concurrent={_HUGE}",
    *(f"tuning.protocol.{k}={_HUGE}" for k in ("max_calls", "max_retries", "max_rounds")),
    *(f"tuning.protocol.{k}={_HUGE}" for k in ("l2_bytes", "seed", "contender_rounds")),
    f"tuning.protocol.queue_workloads={_HUGE}",
    *(
        f"tuning.protocol.{k}={v}"
        for k in ("spread_target", "settle_clock_rel", "settle_power_rel", "noise_k", "min_margin")
        for v in ("1e15", _HUGE)
    ),
    "tuning.protocol.seed=-1",
    f"drift.min_samples={_HUGE}",
}


#: These cases are about parsing: check-config's worker probe must not import torch each time.
pytestmark = pytest.mark.usefixtures("worker_has_everything")


def check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["check-config", "--config", str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_at_least_100_distinct_generated_configs_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused, accepted = [], []
    for name, content in CASES.items():
        rc, out, err = check_config(write_case(tmp_path, name, content, ".toml"), capsys)
        if rc == 0:
            assert out.splitlines()[0].endswith(": OK") and not err, name
            accepted.append(name)
            continue
        lines = err.splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("gpuwatchd: "), (name, err)
        assert "Traceback" not in err and not out, name
        refused.append(name)
    assert len(refused) >= 100 and len(set(refused)) == len(refused)
    assert set(accepted) == VALID


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("daemon.energy_interval_s=inf", "daemon.energy_interval_s: expected a finite number"),
        ("daemon.energy_interval_s=1e15", "daemon.energy_interval_s: must be in [0.1, 3600]"),
        ("tuning.check_interval_s=inf", "tuning.check_interval_s: expected a finite number"),
        ("tuning.check_interval_s=1e15", "tuning.check_interval_s: expected seconds from 0 to"),
        ("daemon.watchdog_stall_s=inf", "daemon.watchdog_stall_s: expected a finite number"),
        ("tuning.protocol.pause_s=1e15", "tuning.protocol.pause_s: expected seconds from 0"),
        ("drift.cooldown_s=1e15", "drift.cooldown_s: expected seconds from 0 to 366 days"),
        ("gate.settle_s=1e15", "gate.settle_s: expected seconds from 0 to 366 days"),
        ("sim.speed=1e15", "sim.speed: must be in (0, 1000]"),
        ("toml-nested-500-arrays", "invalid TOML: arrays or tables nested too deeply"),
        ("workload:op-fft", "workload[0].op: family cpu.matmul runs matmul, gemm, got 'fft'"),
        ("workload:shape-negative-m", "workload[0].shape.m: expected an integer >= 1, got -1"),
        ("workload:families-unknown", "workload[0].families[0]: unknown family"),
        (f"daemon.control_group={NO_GROUP}", "no group named 'nosuchgroup-gpuwatchd'"),
    ],
)
def test_issue_11_config_faults_are_refused_by_check_config(
    name: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = check_config(write_case(tmp_path, "c", CASES[name], ".toml"), capsys)
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_every_duration_key_of_every_section_has_the_finite_sane_range() -> None:
    keys = [name.split("=")[0] for name in CASES if name.endswith("=1e15")]
    durations = [k for k in keys if k.endswith("_s")]
    assert len(durations) >= 25  # daemon, gate, tuning, protocol, drift
    for key in durations:
        *section, field = key.split(".")
        table: dict[str, object] = {field: MAX_DURATION_S * 2}
        for part in reversed(section):
            table = {part: table}
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: "):
            parse_config(table)


@pytest.mark.parametrize(
    "name",
    [
        "daemon.energy_interval_s=1e15",
        "tuning.check_interval_s=inf",
        "daemon.watchdog_stall_s=inf",
        f"daemon.control_group={NO_GROUP}",
        'daemon.web_config="/nonexistent/web-config.yml"',
        'tuning.workloads=["nosuch-x"]',
        "toml-nested-500-arrays",
        "toml-not-utf8",
        "workload:op-fft",
    ],
)
def test_run_refuses_what_check_config_refuses_before_serving(name: str, tmp_path: Path) -> None:
    path = write_case(tmp_path, "c", CASES[name], ".toml")
    checked = run_gpuwatchd(["check-config", "--config", str(path)])
    assert checked.returncode == 2 and len(checked.stderr.splitlines()) == 1, checked.stderr
    ran = run_daemon_on(
        ["--config", str(path), "--backend", "sim"], tmp_path / "state", tmp_path / "c.sock"
    )
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.splitlines() == checked.stderr.splitlines()
    assert not (tmp_path / "state").exists()  # refused before the store, HTTP or socket


def test_a_reload_never_stops_the_daemon_whatever_the_file_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fakes_backend import FakeBackend

    from gpuwatchd.daemon.process import Daemon

    path = tmp_path / "config.toml"
    path.write_text("[gate]\nsettle_s = 3\n")
    cfg = Config(
        daemon=DaemonConfig(
            listen="127.0.0.1:0",
            state_dir=str(tmp_path / "state"),
            control_socket=str(tmp_path / "c.sock"),
        )
    ).with_overrides(gate={"settle_s": 3.0})
    daemon = Daemon(cfg, config_path=str(path), backend=FakeBackend(gpus=1))
    try:
        for name in ("toml-nested-500-arrays", "toml-nested-5000-arrays", "toml-not-utf8"):
            write_case(tmp_path, "config", CASES[name], ".toml")
            assert daemon.reload() is False
            assert daemon.cfg is cfg
        for exc in (RecursionError("deep"), MemoryError(), RuntimeError("bug")):

            def broken(_path: object, exc: BaseException = exc) -> Config:
                raise exc

            monkeypatch.setattr("gpuwatchd.daemon.process.load_config", broken)
            assert daemon.reload() is False and daemon.cfg is cfg
        monkeypatch.setattr("gpuwatchd.daemon.process.load_config", load_config)
        path.write_text("[gate]\nsettle_s = 4\n")
        assert daemon.reload() is True and daemon.cfg.gate.settle_s == 4.0
    finally:
        daemon.store.close()
        daemon.backend.close()


def test_sighup_with_a_500_deep_toml_keeps_the_daemon_running(tmp_path: Path) -> None:
    port = free_port()
    good = f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
    cfg = tmp_path / "config.toml"
    cfg.write_text(good + "[tuning]\nenabled = false\n")
    proc = start_daemon(["--config", str(cfg), "--state-dir", str(tmp_path / "state")])
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        cfg.write_text(CASES["toml-nested-500-arrays"])
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, "a reload must never stop the daemon"
        assert "gpuwatchd_gate_open" in http_get(f"http://127.0.0.1:{port}/metrics")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    rejected = [line for line in out.splitlines() if "reload rejected" in line]
    assert len(rejected) == 1 and "nested too deeply" in rejected[0], out
    assert "Traceback" not in out
