"""The daemon's fleet wiring: the fleet sync job, the ``fleet`` collector, winners served
with this host's own first. On SQLite here (one host); tests/test_fleet_e2e.py runs four
daemons on a shared PostgreSQL."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from builders import U, candidate, seed_session, session_meta, wait_until
from daemon_helpers import http_get, quiet_config
from fakes_backend import FakeBackend

from gpuwatchd.config import STORE_NAME, Config, DaemonConfig, SimConfig, TuningConfig, load_config
from gpuwatchd.daemon.process import FLEET_SYNC_JOB, Daemon
from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.drift.fleet import clock_max_age_s
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store import sqlite_store
from gpuwatchd.tuning.types import RegimeResult

HOST = "host-under-test"
MODEL = "NVIDIA H200 (simulated)"
#: power-cap's burst runs from 5 to 65 simulated seconds; at this speed the learned clock
#: (settle 10 s + 20 s of load) is there 0.7 s after start, long before the first sync.
SPEED = 50.0
FAST_DRIFT = DriftConfig(settle_s=10.0, min_load_s=20.0, min_samples=5, check_interval_s=0.5)


def _sim_config(tmp: Path, fleet: FleetConfig) -> Config:
    return Config(
        daemon=DaemonConfig(
            backend="sim",
            listen="127.0.0.1:0",
            poll_interval_s=0.05,
            state_dir=str(tmp),
            control_socket=str(tmp / "control.sock"),
        ),
        sim=SimConfig(scenario="power-cap", speed=SPEED),
        tuning=TuningConfig(enabled=False),  # no worker processes: only the fleet wiring
        drift=FAST_DRIFT,
        fleet=fleet,
    )


def _run(daemon: Daemon) -> threading.Thread:
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    wait_until(lambda: daemon.scheduler.running, 15, "the daemon's scheduler running")
    return thread


def _stop(daemon: Daemon, thread: threading.Thread) -> None:
    daemon.request_stop()
    thread.join(10)
    assert not thread.is_alive()


def _metrics(daemon: Daemon) -> str:
    host, port = daemon.http.address
    return http_get(f"http://{host}:{port}/metrics")


def _sample(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for m in re.finditer(rf"^{name}(?:\{{(.*?)\}})? (\S+)$", text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        out.append((labels, float(m.group(2))))
    return out


def test_a_sqlite_daemon_syncs_its_learned_clock_and_exports_the_fleet_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    daemon = Daemon(_sim_config(tmp_path, FleetConfig(sync_interval_s=1.0)))
    assert daemon.host == HOST and daemon.fleet_sync.host == HOST
    assert daemon.fleet_sync.interval_s == 1.0
    assert (
        daemon.fleet_sync.max_age_s
        == clock_max_age_s(daemon.cfg.drift, daemon.cfg.fleet)
        == 3 * 600.0
    )
    info = daemon.backend.device_info(0)
    thread = _run(daemon)
    try:
        assert daemon.scheduler.interval_s(FLEET_SYNC_JOB) == 1.0
        before = _metrics(daemon)
        assert _sample(before, "gpuwatchd_fleet_sustained_clock_hertz") == []  # no sync yet
        clocks = wait_until(
            lambda: _sample(_metrics(daemon), "gpuwatchd_fleet_sustained_clock_hertz"),
            15,
            "the learned clock in the fleet metrics",
        )
        text = _metrics(daemon)
    finally:
        _stop(daemon, thread)
    ((labels, own),) = clocks
    assert labels == {
        "gpu": "0",
        "uuid": info.uuid,
        "gpu_model": MODEL,
        "power_limit_watts": "700",
    }
    assert 1.35e9 < own < 1.55e9  # the power-capped burst's ~1440 MHz
    ((median_labels, median),) = _sample(text, "gpuwatchd_fleet_median_sustained_clock_hertz")
    assert median_labels == labels and median == pytest.approx(own, rel=0.01)  # one host
    assert _sample(text, "gpuwatchd_fleet_peers") == [
        ({"gpu_model": MODEL, "power_limit_watts": "700"}, 1.0)
    ]
    assert _sample(text, "gpuwatchd_fleet_sync_success") == [({}, 1.0)]
    ((_, age),) = _sample(text, "gpuwatchd_fleet_sync_age_seconds")
    assert 0 <= age < 5
    assert ({"reason": "fresh_fleet_winner"}, 0.0) in _sample(
        text, "gpuwatchd_fleet_work_skipped_total"
    )
    # What the sync wrote: this host's row in the store the daemon uses.
    with sqlite_store(tmp_path / STORE_NAME) as store:
        (row,) = store.host_clocks()
    assert (row.host, row.gpu_uuid, row.gpu_model, row.power_limit_w) == (
        HOST,
        info.uuid,
        MODEL,
        700.0,
    )
    assert row.sustained_clock_hz == pytest.approx(own, rel=0.01)


def test_fleet_disabled_writes_nothing_and_exports_no_clocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    daemon = Daemon(_sim_config(tmp_path, FleetConfig(enabled=False, sync_interval_s=1.0)))
    thread = _run(daemon)
    try:
        wait_until(
            lambda: any(v.learned_clock_hz for v in daemon.drift.view().values()),
            10,
            "a learned clock",
        )
        daemon.fleet_tick()  # what the job runs: nothing while the fleet is off
        with sqlite_store(tmp_path / STORE_NAME) as store:
            assert store.host_clocks() == []
        daemon.fleet_sync()  # the sync itself would have had a clock to write ...
        with sqlite_store(tmp_path / STORE_NAME) as store:
            assert len(store.host_clocks()) == 1
        text = _metrics(daemon)  # ... yet the fleet views stay empty while it is off
    finally:
        _stop(daemon, thread)
    assert _sample(text, "gpuwatchd_fleet_sustained_clock_hertz") == []
    assert _sample(text, "gpuwatchd_fleet_sync_success") == []


def test_a_reload_reschedules_the_fleet_sync(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    base = (
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:0"\nstate_dir = "{tmp_path}"\n'
        f'control_socket = "{tmp_path / "c.sock"}"\n[tuning]\nenabled = false\n'
    )
    path.write_text(base + "[fleet]\nsync_interval_s = 2.0\n")
    daemon = Daemon(load_config(str(path)), config_path=str(path))
    thread = _run(daemon)
    try:
        assert daemon.scheduler.interval_s(FLEET_SYNC_JOB) == 2.0
        path.write_text(base + "[fleet]\nsync_interval_s = 7.5\nmax_winner_age_s = 3600\n")
        assert daemon.reload()
        assert daemon.scheduler.interval_s(FLEET_SYNC_JOB) == 7.5
        assert daemon.fleet_sync.interval_s == 7.5
        assert daemon.fleet_sync.winner_max_age_s == 3600.0
        path.write_text(base + "[fleet]\nsync_interval_s = 0.5\n")
        assert not daemon.reload()  # below the 1 s minimum: rejected, the old one kept
        assert daemon.fleet_sync.interval_s == 7.5
    finally:
        _stop(daemon, thread)


def test_winners_api_serves_this_hosts_own_winner_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's winner stays the fleet's (this host disagreed beyond noise), yet this
    host's jobs get the winner this host measured; keys it never measured: the fleet's.
    Only its own GPU model's: another model's winners are not its to serve (nor read)."""
    model = "Fake GPU"  # the fake backend's
    gemm = session_meta(host="peer", gpu_model=model, regimes=(U,))
    with sqlite_store(tmp_path / STORE_NAME) as store:
        seed_session(store, gemm, [_result("gemm", fast="tile-a", slow="tile-b")])
        seed_session(store, gemm, [_result("conv", fast="algo-1", slow="algo-2")])
        other = session_meta(host="peer", gpu_uuid="GPU-other", regimes=(U,))  # an H200
        seed_session(store, other, [_result("attn", fast="flash", slow="math")])
        mine = session_meta(host=HOST, gpu_uuid="GPU-mine", gpu_model=model, regimes=(U,))
        seed_session(store, mine, [_result("gemm", fast="tile-b", slow="tile-a")])
        fleet = {w.workload: (w.candidate, w.host) for w in store.winners(latest=True)}
    assert fleet["gemm"] == ("tile-a", "peer"), "the peer's winner should stay the fleet's"
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    daemon = Daemon(quiet_config(tmp_path), backend=FakeBackend(gpus=1))
    thread = _run(daemon)
    try:
        host, port = daemon.http.address
        doc = json.loads(http_get(f"http://{host}:{port}/api/v1/winners?regime=unthrottled"))
    finally:
        _stop(daemon, thread)
    served = {w["workload"]: (w["candidate"], w["host"]) for w in doc["winners"]}
    assert served == {"gemm": ("tile-b", HOST), "conv": ("algo-1", "peer")}


def _result(workload: str, *, fast: str, slow: str) -> RegimeResult:
    """An unthrottled result where ``fast`` beats ``slow`` by 20% (far beyond noise)."""
    return RegimeResult(
        workload,
        U,
        (candidate(fast, U, 1.0e-3), candidate(slow, U, 1.2e-3)),
        fast,
        False,
        0.2,
        0.01,
    )


def test_per_host_series_show_this_hosts_own_winners_and_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """winner_info is the pick this host serves (its own over the fleet's), only for its
    GPUs' models; last_tune_timestamp is its own GPU's last session, not the fleet's."""
    fake = "Fake GPU"
    peer = session_meta(host="peer", gpu_model=fake, gpu_uuid="GPU-peer", regimes=(U,))
    with sqlite_store(tmp_path / STORE_NAME) as store:
        seed_session(store, peer, [_result("gemm", fast="tile-a", slow="tile-b")])
        other_model = session_meta(host="peer", gpu_model="NVIDIA L4", regimes=(U,))
        seed_session(store, other_model, [_result("conv", fast="algo-1", slow="algo-2")])
        mine = session_meta(host=HOST, gpu_model=fake, gpu_uuid="GPU-fake-0", regimes=(U,))
        seed_session(store, mine, [_result("gemm", fast="tile-b", slow="tile-a")])
        own_ended = store.last_completed_at("GPU-fake-0")
        seed_session(store, peer, [_result("conv", fast="algo-1", slow="algo-2")])  # later
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    daemon = Daemon(
        quiet_config(tmp_path, fleet=FleetConfig(sync_interval_s=1.0)), backend=FakeBackend(gpus=1)
    )
    thread = _run(daemon)
    try:
        wait_until(
            lambda: _sample(_metrics(daemon), "gpuwatchd_last_tune_timestamp_seconds"),
            10,
            "this GPU's last tune exported",
        )
        text = _metrics(daemon)
    finally:
        _stop(daemon, thread)
    info = {(d["gpu_model"], d["workload"], d["candidate"]) for d, _ in
            _sample(text, "gpuwatchd_winner_info")}  # fmt: skip
    assert info == {(fake, "gemm", "tile-b"), (fake, "conv", "algo-1")}
    ((labels, ended),) = _sample(text, "gpuwatchd_last_tune_timestamp_seconds")
    assert labels["uuid"] == "GPU-fake-0" and ended == own_ended
