"""The daemon as users and systemd see it: a real process, signals, HTTP, sd_notify."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from builders import free_port, wait_until
from daemon_helpers import NotifySocket, http_get, start_daemon, wait_http
from fakes_backend import FakeBackend
from pg_server import PASSWORD, PostgresServer

from gpuwatchd.config import Config, DaemonConfig
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.telemetry.types import DeviceInfo


def gpuwatchd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sim_daemon_serves_status_and_stops_cleanly_on_sigterm(tmp_path: Path):
    notify = NotifySocket(tmp_path)
    port = free_port()
    proc = start_daemon(
        [
            "--backend",
            "sim",
            "--gpus",
            "2",
            "--listen",
            f"127.0.0.1:{port}",
            "--poll-interval",
            "0.1",
        ],
        env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"},
    )
    try:
        assert notify.wait_for("READY=1"), notify.messages
        metrics = wait_http(f"http://127.0.0.1:{port}/metrics")
        assert 'gpuwatchd_gpu_temperature_celsius{gpu="1"' in metrics
        xid_zero = [f'gpuwatchd_gpu_xid_events_total{{gpu="{g}"' for g in (0, 1)]

        def xids_at_zero() -> bool:
            text = http_get(f"http://127.0.0.1:{port}/metrics")
            lines = [ln for ln in text.splitlines() if ln.startswith(tuple(xid_zero))]
            return len(lines) == 2 and all(ln.endswith(" 0.0") for ln in lines)

        assert wait_until(xids_at_zero, 10), "no XID total at 0 per GPU before any XID"
        assert notify.wait_for("WATCHDOG=1", timeout=3)
        status = gpuwatchd("status", "--url", f"http://127.0.0.1:{port}")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[1].split()[:2] == ["GPU", "NAME"]
        rows = [ln for ln in lines[2:] if not ln.startswith(" ")]  # WHY lines are indented
        assert len(rows) == 3  # two GPUs, tuning (under the banner and the header)
        assert rows[2].startswith("tuning: ")
        assert "NVIDIA H200 (simulated)" in rows[0] and rows[1].startswith("1 ")
        assert lines[3].startswith("     why: ")
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=5)
        assert time.monotonic() - stopped_at < 5
        assert proc.returncode == 0, out
        assert notify.wait_for("STOPPING=1", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_sighup_rejects_a_bad_config_and_keeps_running(tmp_path: Path):
    port = free_port()
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
    )
    proc = start_daemon(["--config", str(cfg)])
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        cfg.write_text(cfg.read_text() + "\n[gate]\nsettle_seconds = 3\n")  # a typo'd key
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, "a bad config on SIGHUP must not stop the daemon"
        assert "gpuwatchd_gate_open" in http_get(f"http://127.0.0.1:{port}/metrics")
        cfg.write_text(
            f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
            "[gate]\nsettle_s = 3.0\n"
        )
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rejected = [line for line in out.splitlines() if "reload rejected" in line]
    assert len(rejected) == 1 and "gate.settle_seconds" in rejected[0], out
    assert "config reloaded" in out


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[daemon]\npoll_intervall_s = 1\n", "daemon.poll_intervall_s: unknown key"),
        ("[daemon]\npoll_interval_s = 5\n", "daemon.poll_interval_s: must be in [0.01, 1.0]"),
        ("[daemon]\nbackend = 'cuda'\n", "daemon.backend: must be one of"),
        ("[sim]\ngpus = 'two'\n", "sim.gpus: expected an integer"),
        ("[gate]\ntemp_margin_c = -1\n", "gate.temp_margin_c"),
        ("[deamon]\n", "[deamon]: unknown section"),
        ("[daemon\n", "invalid TOML"),
    ],
)
def test_bad_config_is_one_line_naming_the_key_with_exit_2(tmp_path: Path, text: str, needle: str):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    for cmd in (["check-config"], ["run", "--backend", "sim"]):
        res = gpuwatchd(*cmd, "--config", str(cfg))
        assert res.returncode == 2, res
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and needle in err[0], res.stderr
        assert str(cfg) in err[0]


def test_bad_cli_values_exit_2():
    res = gpuwatchd("run", "--backend", "sim", "--scenario", "nope")
    assert res.returncode == 2 and "sim.scenario: unknown 'nope'" in res.stderr
    res = gpuwatchd("status", "--url", "notaurl")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--url notaurl" in res.stderr
    res = gpuwatchd("run", "--backend", "sim", "--gpus", "0")
    assert res.returncode == 2 and "sim.gpus" in res.stderr
    res = gpuwatchd("run", "--backend", "sim", "--listen", "nonsense")
    assert res.returncode == 2 and "listen" in res.stderr.lower()


def test_missing_config_file_is_a_clear_error():
    res = gpuwatchd("check-config", "--config", "/nonexistent/gpuwatchd.toml")
    assert res.returncode == 2
    assert "/nonexistent/gpuwatchd.toml: cannot read config file" in res.stderr


def _nvml_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_present(), reason="this host has a working NVML")
def test_no_nvml_suggests_the_sim_backend():
    res = gpuwatchd("run", "--listen", "127.0.0.1:0")
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "--backend sim" in err[0], res.stderr


def test_status_without_a_daemon_is_one_line():
    res = gpuwatchd("status", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "1")
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1 and "cannot reach gpuwatchd" in res.stderr


def _thread_daemon(
    backend: FakeBackend, tmp: Path, **daemon_kw: float
) -> tuple[Daemon, threading.Thread]:
    cfg = Config(
        daemon=DaemonConfig(
            listen="127.0.0.1:0",
            poll_interval_s=0.05,
            state_dir=str(tmp),
            control_socket=str(tmp / "control.sock"),
            **daemon_kw,
        )
    )
    daemon = Daemon(cfg, backend=backend)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    wait_until(lambda: daemon.board.get(len(backend.devices()) - 1) is not None, 5)
    return daemon, thread


def test_hanging_read_shows_in_metrics_while_other_gpus_keep_working(tmp_path: Path):
    backend = FakeBackend(gpus=2)
    daemon, thread = _thread_daemon(backend, tmp_path)
    try:
        backend.hang(1)
        time.sleep(0.4)  # > 2 periods plus a main-loop tick
        host, port = daemon.http.address
        started = time.monotonic()
        metrics = http_get(f"http://{host}:{port}/metrics")
        assert time.monotonic() - started < 1.0, "a scrape must not wait behind a hung read"
        assert 'gpuwatchd_poll_stalled{gpu="1",uuid="GPU-fake-1"} 1.0' in metrics
        assert 'gpuwatchd_poll_success{gpu="1",uuid="GPU-fake-1"} 0.0' in metrics
        assert 'gpuwatchd_poll_success{gpu="0",uuid="GPU-fake-0"} 1.0' in metrics
        assert 'gpuwatchd_gpu_temperature_celsius{gpu="0",uuid="GPU-fake-0"} 40.0' in metrics
        assert 'gpuwatchd_gpu_temperature_celsius{gpu="1"' not in metrics
    finally:
        backend.unhang(1)
        daemon.request_stop()
        thread.join(5)
    assert not thread.is_alive()
    assert backend.closed


def test_watchdog_pings_stop_while_the_poller_is_stuck(tmp_path: Path, monkeypatch):
    notify = NotifySocket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    backend = FakeBackend(gpus=1)
    daemon, thread = _thread_daemon(backend, tmp_path, watchdog_stall_s=0.3)
    try:
        assert notify.wait_for("WATCHDOG=1", timeout=3)
        backend.hang(0)
        time.sleep(0.6)  # stuck past watchdog_stall_s: pings must have stopped by now
        notify.drain()
        notify.messages.clear()
        notify.drain(0.6)
        assert "WATCHDOG=1" not in notify.messages
        backend.unhang(0)
        assert notify.wait_for("WATCHDOG=1", timeout=3), "pings resume once the read returns"
    finally:
        backend.unhang(0)
        daemon.request_stop()
        thread.join(5)
        notify.close()


def test_web_config_basic_auth_protects_the_endpoints(tmp_path: Path):
    import base64
    import urllib.error
    import urllib.request

    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prom: {hashed}\n")
    port = free_port()
    proc = start_daemon(
        ["--backend", "sim", "--listen", f"127.0.0.1:{port}", "--web-config", str(web)]
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(url, timeout=1)
                raise AssertionError("served /metrics without credentials")
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
                break
            except OSError:
                assert time.monotonic() < deadline, "daemon never answered"
                time.sleep(0.1)
        req = urllib.request.Request(url)
        token = base64.b64encode(b"prom:s3cret").decode()
        req.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(req, timeout=2) as resp:
            assert b"gpuwatchd_gate_open" in resp.read()
        base = f"http://127.0.0.1:{port}"
        denied = gpuwatchd("status", "--url", base)
        assert denied.returncode == 1 and "HTTP 401" in denied.stderr
        env = {**os.environ, "GPUWATCHD_PASSWORD": "s3cret"}
        ok = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "status", "--url", base, "--user", "prom"],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
        assert ok.returncode == 0 and "NVIDIA H200 (simulated)" in ok.stdout, ok.stderr
    finally:
        proc.terminate()
        proc.wait(5)


def test_a_bad_web_config_is_a_config_error(tmp_path: Path):
    web = tmp_path / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: /nonexistent.pem\n  key_file: /nonexistent.key\n"
    )
    for cmd in (["check-config", "--config", "/dev/null"], ["run", "--backend", "sim"]):
        res = gpuwatchd(*cmd, "--web-config", str(web))
        assert res.returncode == 2, res
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and "cert_file" in err[0] and "/nonexistent.pem" in err[0]


def test_warns_when_fast_simulated_time_starves_the_gate(tmp_path: Path, caplog):
    from gpuwatchd.config import SimConfig

    def daemon(speed: float) -> Daemon:
        cfg = Config(
            daemon=DaemonConfig(
                backend="sim", listen="127.0.0.1:0", poll_interval_s=0.5,
                state_dir=str(tmp_path), control_socket=str(tmp_path / "c.sock"),
            ),
            sim=SimConfig(speed=speed),
        )  # fmt: skip
        return Daemon(cfg)

    caplog.set_level("WARNING", logger="gpuwatchd")
    daemon(1.0)._check_sampling()
    assert not [r for r in caplog.records if "never open" in r.message]
    daemon(10.0)._check_sampling()  # one sample per 5 simulated s, 5 needed in a 5 s window
    assert [r for r in caplog.records if "never open" in r.message]


# -- [store] url: the fleet's PostgreSQL store -----------------------------------------------


def test_check_config_takes_a_store_url_with_a_password_file_never_one_holding_it(
    tmp_path: Path,
):
    pw = tmp_path / "password"
    pw.write_text("hunter2\n")
    cfg = tmp_path / "c.toml"
    url = "postgresql://gpuwatchd@db.example:5432/gpuwatchd?sslmode=verify-full"
    cfg.write_text(f'[store]\nurl = "{url}"\npassword_file = "{pw}"\n')
    ok = gpuwatchd("check-config", "--config", str(cfg))
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == f"{cfg}: OK", ok
    pw.unlink()
    gone = gpuwatchd("check-config", "--config", str(cfg))
    assert gone.returncode == 2 and f"store.password_file: cannot read {pw}" in gone.stderr
    cfg.write_text('[store]\nurl = "postgresql://gpuwatchd:hunter2@db.example/gpuwatchd"\n')
    for cmd in (["check-config"], ["run", "--backend", "sim"]):
        res = gpuwatchd(*cmd, "--config", str(cfg))
        assert res.returncode == 2, res
        (err,) = res.stderr.strip().splitlines()
        assert f"{cfg}: store.url: the URL holds a password" in err
        assert "gpuwatchd:***@db.example" in err and "hunter2" not in err


def test_the_daemon_records_a_sim_tuning_session_in_postgresql(
    tmp_path: Path, postgres_server: PostgresServer
):
    db = postgres_server.new_database()
    pw = tmp_path / "password"
    pw.write_text(PASSWORD + "\n")
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
        f'state_dir = "{tmp_path / "state"}"\ncontrol_socket = "{tmp_path / "c.sock"}"\n'
        "[sim]\nspeed = 30.0\n[gate]\nwindow_s = 20.0\n"  # the gate opens within a second
        '[tuning]\ncheck_interval_s = 0.5\nworkloads = ["sim-gemm"]\n'
        f'[store]\nurl = "{postgres_server.tcp_url(db)}"\npassword_file = "{pw}"\n'
    )

    def completed() -> list[tuple[object, ...]]:
        import psycopg

        try:
            return postgres_server.sql(db, "SELECT id FROM sessions WHERE status = 'completed'")
        except psycopg.errors.UndefinedTable:  # the daemon has not created the schema yet
            return []

    proc = start_daemon(["--config", str(cfg)])
    try:
        done = wait_until(completed, timeout=60, interval=0.5)
        assert done, "no completed session in PostgreSQL"
        winners = postgres_server.sql(db, "SELECT DISTINCT workload FROM winners")
        assert winners == [("sim-gemm",)]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert f"tuning store: postgresql://fleet@127.0.0.1:{postgres_server.port}/{db}" in out
    assert not (tmp_path / "state" / "gpuwatchd.db").exists()  # nothing went to SQLite


class _FactsHang(FakeBackend):
    """A FakeBackend whose static-facts read blocks while ``facts`` is clear."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus)
        self.facts = threading.Event()
        self.facts.set()

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        self.facts.wait(30.0)
        return super().device_info(gpu, refresh)


def test_watchdog_pings_stop_while_a_static_facts_read_is_stuck(tmp_path: Path, monkeypatch):
    notify = NotifySocket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    backend = _FactsHang(gpus=1)
    backend.lost.add(0)
    daemon, thread = _thread_daemon(backend, tmp_path, watchdog_stall_s=0.3)
    try:
        assert notify.wait_for("WATCHDOG=1", timeout=3)
        backend.facts.clear()
        backend.lost.clear()  # answers again: the poll re-reads its static facts, which hang
        time.sleep(0.6)  # stuck past watchdog_stall_s: pings must have stopped by now
        notify.drain()
        notify.messages.clear()
        notify.drain(0.6)
        assert "WATCHDOG=1" not in notify.messages
        snap = daemon.board.get(0)
        assert snap is not None and snap.health.stalled  # reported within stall_periods
        backend.facts.set()
        assert notify.wait_for("WATCHDOG=1", timeout=3), "pings resume once the read returns"
    finally:
        backend.facts.set()
        daemon.request_stop()
        thread.join(5)
        notify.close()
