"""A PostgreSQL outage costs nothing lasting: a restart's dead connections are replaced,
the daemon starts, serves and tunes on without its store, and what an outage cut off is
recorded once the store is back.

Most tests stop and restart a server of their own (``outage_server``), so the shared
one the other store tests use never goes away.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import judged, session_meta, wait_until
from daemon_helpers import http_get, quiet_config
from fakes_backend import FakeBackend
from pg_server import PostgresServer, start_server

from gpuwatchd.config import Config, StoreConfig, TuningConfig
from gpuwatchd.daemon.host_identity import HostNameTaken
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.sessions.events import SessionFinished, SessionListener
from gpuwatchd.sessions.fleet_choice import STORE_RETRY_S
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.sessions.runner import SessionOutcome, TuneRunner
from gpuwatchd.sessions.scheduler import TuneScheduler
from gpuwatchd.store import MIGRATIONS, StoreError
from gpuwatchd.store.errors import StoreUnavailable
from gpuwatchd.store.postgres import postgres_store
from gpuwatchd.store.rows import HOST_ENV, MACHINE_ID_ENV
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.session_spec import SessionSpec
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS

SIM_GEMM = next(w for w in DEFAULT_WORKLOADS if w.name == "sim-gemm")
#: The daemon must be working again within this long of the store's return.
BACK_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def outage_server() -> Iterator[PostgresServer]:
    """A server of this module's own, stopped and started by its tests."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture
def outage_db(outage_server: PostgresServer) -> Iterator[str]:
    db = outage_server.new_database()
    yield outage_server.url(db)
    if not _answers(outage_server):
        outage_server.resume()  # a failed test must not leave the next one without it


def _answers(server: PostgresServer) -> bool:
    try:
        server.sql("postgres", "SELECT 1")
    except Exception:
        return False
    return True


# -- the store -------------------------------------------------------------------------------


def test_pooled_connections_a_restart_killed_are_replaced_on_the_next_call(
    postgres_server: PostgresServer,
) -> None:
    db = postgres_server.new_database()
    store = postgres_store(postgres_server.url(db))
    try:
        sid = store.start_session(session_meta())
        killed = postgres_server.sql(
            "postgres",
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (db,),
        )
        assert killed, "the store's pooled connection should have been there to kill"
        store.finish_session(sid, SessionStatus.COMPLETED)  # no error: retried once
        assert store.up
        assert store.session(sid).status is SessionStatus.COMPLETED  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_store_opened_while_the_server_is_down_is_opened_once_it_is_back(
    outage_server: PostgresServer, outage_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    outage_server.halt()
    store = postgres_store(outage_db, connect_now=False)  # no error: opened later
    try:
        assert not store.up
        with pytest.raises(StoreUnavailable) as first:
            store.probe()
        assert "\n" not in str(first.value)
        # Until a retry is due, calls fail at once, with the same one line.
        with pytest.raises(StoreUnavailable, match="is unreachable"):
            store.sessions()
        outage_server.resume()
        store.probe()
        assert store.up
        assert store.schema_version() == len(MIGRATIONS)  # created and migrated
    finally:
        store.close()
    downs = [r for r in caplog.records if "working without it" in r.getMessage()]
    assert len(downs) == 1, "one warning per outage, not one per call"
    assert any("reachable again" in r.getMessage() for r in caplog.records)


# -- a session the outage cut off ------------------------------------------------------------

WL = Workload("mm", "matmul", {"m": 64, "n": 64, "k": 64}, "fp32", ("cpu.matmul",))
INFO = DeviceInfo(index=0, uuid="cpu-0", name="test cpu")
SPEC = SessionSpec(0, "cpu-0", "cpu", (WL,), (Regime.SUSTAINED,))
#: A fake worker: says hello, waits for the file named in GO, then reports a result.
WORKER = """
import json, os, sys, time
json.loads(sys.stdin.read())
def send(d):
    sys.stdout.write(json.dumps(d) + "\\n"); sys.stdout.flush()
send({"type": "hello", "pid": os.getpid(), "versions": {"torch": "fake-1.0"}})
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.01)
c = {"name": "a", "family": "fam", "regime": "sustained", "median_s": 1e-3, "spread": 0.01,
     "samples": 7, "warmup": 1, "sm_clock_hz": 1.4e9, "power_w": 690.0, "temp_c": 61.0,
     "throttle_fraction": 0.5, "reps": 4, "meta": {}}
send({"type": "result", "result": {"workload": "mm", "regime": "sustained", "candidates": [c],
      "winner": "a", "tie": False, "gap": 0.04, "noise": 0.01}})
"""


def test_a_session_an_outage_cut_off_is_recorded_failed_once_the_store_is_back(
    outage_server: PostgresServer, outage_db: str, tmp_path: Path
) -> None:
    store = postgres_store(outage_db)
    ended: list[SessionFinished] = []
    go = tmp_path / "go"
    runner = TuneRunner(
        store,
        env={"GO": str(go), "PATH": "/usr/bin:/bin"},
        worker_cmd=[sys.executable, "-c", WORKER],
        on_finished=ended.append,
    )
    outcome: list[SessionOutcome] = []
    session = threading.Thread(
        target=lambda: outcome.append(runner.run_session(SPEC, INFO, "sim", lambda: None, None, 60))
    )
    try:
        session.start()
        wait_until(lambda: store.running_count() == 1, 10, "the session running")
        outage_server.halt()
        go.touch()  # the worker's result finds the store gone
        session.join(30)
        (out,) = outcome
        assert out.status is SessionStatus.FAILED and out.store_cut
        assert ended == [], "nothing is counted before the store holds it"
        assert runner.record_endings() == 1, "still waiting for the store"
        outage_server.resume()
        store.probe()  # as the daemon's store link does every second
        assert runner.record_endings() == 0
        row = store.session(out.session_id)
        assert row is not None and row.status is SessionStatus.FAILED
        assert [e.status for e in ended] == [SessionStatus.FAILED]
    finally:
        go.touch()
        session.join(30)
        store.close()


def test_the_scheduler_starts_nothing_before_the_store_answered_once() -> None:
    board = StateBoard()
    info = DeviceInfo(index=0, uuid="GPU-0", name="Test GPU")
    board.put(judged(0, info, None, GateState.COOL_STABLE, (), t=0.0, since=0.0,
                     health=PollHealth(True, 0.001)))  # fmt: skip
    never_up = _DownStore()
    never_up.abandon_running = never_up.__getattr__("abandon_running")  # type: ignore[method-assign]
    sched = TuneScheduler(
        TuningSetup(), board, never_up, "sim",  # type: ignore[arg-type]
        runner_factory=_OutageRunner,  # type: ignore[arg-type]
    )  # fmt: skip
    sched.request(0, [SIM_GEMM], "manual")
    sched.tick()
    assert not sched.snapshot.running
    assert sched.snapshot.deferred_total == {"store_unavailable": 1}


class _OutageRunner:
    """The store is unreachable for this runner's first session, and cuts its second."""

    calls = 0

    def __init__(self, store: Any, *, on_finished: SessionListener) -> None:
        self.store = store

    def pids(self) -> frozenset[int]:
        return frozenset()

    def cancel(self, reason: str) -> bool:
        return False

    def record_endings(self) -> int:
        return 0

    def run_session(self, spec: SessionSpec, *args: Any, **kw: Any) -> SessionOutcome:
        type(self).calls += 1
        if type(self).calls == 1:
            raise StoreUnavailable("store db: cannot start a session: connection refused")
        return SessionOutcome(SessionStatus.FAILED, "store error: gone", 7, (), {}, True)


class _DownStore:
    """A store that answered at start, then went away: every call raises
    StoreUnavailable."""

    where = "db"
    up = False

    def abandon_running(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        def unreachable(*_args: Any, **_kw: Any) -> Any:
            raise StoreUnavailable("store db is unreachable: connection refused")

        return unreachable


def test_an_unreachable_store_holds_the_gpu_back_seconds_not_retry_failed_after_s() -> None:
    clock = [1000.0]
    board = StateBoard()
    info = DeviceInfo(index=0, uuid="GPU-0", name="Test GPU")
    board.put(judged(0, info, None, GateState.COOL_STABLE, (), t=0.0, since=0.0,
                     health=PollHealth(True, 0.001)))  # fmt: skip
    setup = TuningSetup(tuning=TuningConfig(retry_failed_after_s=3600.0))
    sched = TuneScheduler(
        setup, board, _DownStore(), "sim",  # type: ignore[arg-type]
        runner_factory=_OutageRunner, now=lambda: clock[0],  # type: ignore[arg-type]
    )  # fmt: skip
    sched.request(0, [SIM_GEMM], "manual")
    for _session in range(2):  # not started (store down), then cut off (store gone)
        sched.tick()
        wait_until(lambda: not sched.snapshot.running, 15, "the session over")
        pending = sched._pending[0]
        assert pending.not_before <= clock[0] + STORE_RETRY_S
        clock[0] += STORE_RETRY_S
    assert _OutageRunner.calls == 2
    sched.store_back()  # nothing recorded yet, nothing raised
    assert sched._pending[0].not_before == 0.0


# -- the daemon ------------------------------------------------------------------------------


def _daemon_config(tmp: Path, url: str) -> Config:
    return quiet_config(  # type: ignore[no-any-return]
        tmp, store=StoreConfig(url=url), fleet=FleetConfig(sync_interval_s=1.0)
    )


def _get(daemon: Daemon, path: str) -> tuple[int, str]:
    host, port = daemon.http.address
    try:
        return 200, http_get(f"http://{host}:{port}{path}")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _store_up(daemon: Daemon) -> float | None:
    status, text = _get(daemon, "/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith("gpuwatchd_store_up "):
            return float(line.split()[1])
    return None


def test_the_daemon_starts_serves_and_reconnects_without_its_store(
    outage_server: PostgresServer,
    outage_db: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    outage_server.halt()
    daemon = Daemon(_daemon_config(tmp_path, outage_db), backend=FakeBackend(gpus=1))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: daemon.scheduler.running, 15, "the daemon running")
        assert _store_up(daemon) == 0.0
        assert _get(daemon, "/metrics")[1].count("gpuwatchd_gpu_temperature_celsius{") == 1
        status, body = _get(daemon, "/api/v1/winners")
        assert status == 503 and json.loads(body)["error"] == "store unavailable"
        _get(daemon, "/api/v1/winners")  # asked again: no new log line

        outage_server.resume()
        wait_until(lambda: _store_up(daemon) == 1.0, BACK_WITHIN_S, "the store back")
        status, body = _get(daemon, "/api/v1/winners")
        assert status == 200 and json.loads(body)["stale"] is False
        db = outage_db.split("?")[0].rsplit("/", 1)[1]
        held = outage_server.sql(
            "postgres", "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (db,)
        )
        assert held[0][0] <= 1, "one pooled connection per daemon at rest"

        outage_server.halt()  # down again: the last winners read are served, marked stale
        wait_until(lambda: _store_up(daemon) == 0.0, BACK_WITHIN_S, "the outage seen")
        status, body = _get(daemon, "/api/v1/winners")
        doc = json.loads(body)
        assert status == 200 and doc["stale"] is True and doc["age_s"] >= 0
        outage_server.resume()
        wait_until(lambda: _store_up(daemon) == 1.0, BACK_WITHIN_S, "the store back again")
    finally:
        daemon.request_stop()
        thread.join(10)
    text = caplog.text
    assert "Traceback" not in text and not any(r.exc_info for r in caplog.records)
    downs = [r for r in caplog.records if "working without it" in r.getMessage()]
    assert len(downs) == 2, "one line per outage, whatever was asked meanwhile"


def test_a_store_that_answers_but_is_refused_still_stops_the_daemon_at_start(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    db = postgres_server.new_database()
    postgres_server.sql(db, "CREATE TABLE sessions (id INTEGER)")  # not gpuwatchd's
    with pytest.raises(StoreError, match="no gpuwatchd schema version"):
        Daemon(_daemon_config(tmp_path, postgres_server.url(db)), backend=FakeBackend(gpus=1))


# -- two machines, one name --------------------------------------------------------------------


def test_a_second_live_machine_under_the_same_name_is_refused_naming_both(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = postgres_server.new_database()
    url = postgres_server.url(db)
    monkeypatch.setenv(HOST_ENV, "twin")
    ids = {}
    for name in ("first", "second"):
        ids[name] = tmp_path / f"{name}-machine-id"
        ids[name].write_text(f"{name}0000000000000000000000000000\n")
    monkeypatch.setenv(MACHINE_ID_ENV, str(ids["first"]))
    first = Daemon(_daemon_config(tmp_path / "a", url), backend=FakeBackend(gpus=1))
    # The first machine's session, running under a PID this machine does not have.
    with postgres_store(url) as store:
        sid = store.start_session(session_meta(host="twin"))
    postgres_server.sql(db, "UPDATE sessions SET owner_pid = 4194000 WHERE id = %s", (sid,))
    monkeypatch.setenv(MACHINE_ID_ENV, str(ids["second"]))
    with pytest.raises(HostNameTaken) as refused:
        Daemon(_daemon_config(tmp_path / "b", url), backend=FakeBackend(gpus=1))
    message = str(refused.value)
    assert "\n" not in message and "'twin'" in message
    assert "first0000" in message and "second0000" in message
    with postgres_store(url) as store:
        row = store.session(sid)
        assert row is not None and row.status is SessionStatus.RUNNING, "the twin's session"
    first.identity.release()  # type: ignore[union-attr]  # a clean stop gives the name back
    first.store.close()
    second = Daemon(_daemon_config(tmp_path / "b", url), backend=FakeBackend(gpus=1))
    second.store.close()
