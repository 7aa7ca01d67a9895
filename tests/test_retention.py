"""Retention: the daemon prunes on a schedule, one host of a fleet per interval, and
``gpuwatchd store prune`` does the same now; departed hosts' clocks go too."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from builders import session_meta, wait_until
from daemon_helpers import quiet_config
from fakes_backend import FakeBackend

from gpuwatchd.cli.main import main
from gpuwatchd.config import STORE_NAME, StoreConfig
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.store import HostClock, SqlStore, sqlite_store
from gpuwatchd.store.retention import Pruner
from gpuwatchd.tuning.types import SessionStatus

DAY = 86400.0
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _clock(host: str, t: float) -> HostClock:
    return HostClock(host, f"GPU-{host}", "NVIDIA H200", 700.0, 1.7e9, t)


def _seed_old_failed_session(store: SqlStore) -> int:
    sid = store.start_session(session_meta())
    store.finish_session(sid, SessionStatus.FAILED, "hang")
    return sid


def test_one_host_per_interval_prunes_old_sessions_and_departed_hosts_clocks(
    tmp_path: Path,
) -> None:
    clock = Clock(T0)
    with sqlite_store(tmp_path / "tune.db", now=clock) as store:
        old = _seed_old_failed_session(store)
        store.report_host_clock(_clock("gone", T0))
        clock.t += 30 * DAY
        store.report_host_clock(_clock("here", clock.t))
        kw = {"keep_sessions_s": 7 * DAY, "keep_clocks_s": 7 * DAY, "interval_s": DAY}
        a = Pruner(store, host="a", machine="m-a", **kw)  # type: ignore[arg-type]
        b = Pruner(store, host="b", machine="m-b", **kw)  # type: ignore[arg-type]

        done = a()
        assert done is not None and (done.sessions, done.clocks) == (1, 1)
        assert store.session(old) is None
        assert [c.host for c in store.host_clocks()] == ["here"]
        assert b() is None, "a held the lease: one host per interval"
        clock.t += DAY + 1
        assert b() is not None, "the lease lapsed: another host may prune"


def test_store_prune_applies_the_configured_ages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite_store(state / STORE_NAME, now=lambda: T0) as store:
        _seed_old_failed_session(store)
        store.report_host_clock(_clock("gone", T0))
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{state}"\n[store]\nkeep_sessions_s = 60.0\nkeep_clocks_s = 60.0\n'
    )
    assert main(["store", "prune", "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith("pruned 1 session(s) and 1 host clock(s) from ")
    with sqlite_store(state / STORE_NAME) as store:
        assert store.sessions() == [] and store.host_clocks() == []


def test_store_prune_refuses_a_bad_age_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path}"\n[store]\nkeep_sessions_s = -1\n')
    assert main(["store", "prune", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "keep_sessions_s" in err


def test_the_daemon_prunes_on_its_schedule(tmp_path: Path) -> None:
    with sqlite_store(tmp_path / STORE_NAME, now=lambda: T0) as store:
        old = _seed_old_failed_session(store)
    store = StoreConfig(keep_sessions_s=DAY, prune_interval_s=0.5)
    daemon = Daemon(quiet_config(tmp_path, store=store), backend=FakeBackend(gpus=1))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: daemon.store.session(old) is None, 10, "the old session pruned")
    finally:
        daemon.request_stop()
        thread.join(10)
