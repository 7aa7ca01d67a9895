"""Rolling upgrades and rollbacks: daemons of two schema versions on one PostgreSQL.

The older daemon ("N-1") is this code pinned to the schema before the newest migration
(its migration list without the last step), as the previous release targets it; the
newer ("N") targets every migration. Each daemon runs in a thread with its own host
name, and a scraper reads every running daemon's /metrics throughout: telemetry must
never stop, whatever the skew, and no daemon may fail to start because of it.
"""

from __future__ import annotations

import functools
import logging
import threading
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from builders import session_meta, wait_until
from daemon_helpers import http_get, quiet_config
from fakes_backend import FakeBackend
from pg_server import PostgresServer

from gpuwatchd.config import Config, StoreConfig
from gpuwatchd.daemon import process
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store import MIGRATIONS, Migration, open_store, sql_migration
from gpuwatchd.store.postgres import postgres_store
from gpuwatchd.store.rows import BOOT_ID_ENV, HOST_ENV, MACHINE_ID_ENV
from gpuwatchd.tuning.types import SessionStatus

N = len(MIGRATIONS)
PREVIOUS = MIGRATIONS[:-1]  # what the previous release targets (N-1)
#: A step older daemons must not follow (a meaning changed), as a later release may ship.
INCOMPATIBLE = sql_migration(N + 1, "not additive", "CREATE TABLE t (x INTEGER)", min_writer=N + 1)
#: How long a change of the store may take to show in a daemon's metrics (it syncs each
#: second; generous for a loaded machine).
SEEN_WITHIN_S = 30.0


def _config(tmp: Path, url: str) -> Config:
    return quiet_config(  # type: ignore[no-any-return]
        tmp, store=StoreConfig(url=url), fleet=FleetConfig(sync_interval_s=1.0)
    )


def _metrics(daemon: Daemon) -> str:
    host, port = daemon.http.address
    return http_get(f"http://{host}:{port}/metrics")


def _gauge(daemon: Daemon, name: str) -> float | None:
    for line in _metrics(daemon).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@dataclass
class Fleet:
    """Daemons in threads, and a scraper reading each running one's /metrics."""

    tmp: Path
    url: str
    monkeypatch: pytest.MonkeyPatch
    running: dict[str, tuple[Daemon, threading.Thread]] = field(default_factory=dict)
    scrapes: int = 0
    gaps: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, name: str, host: str, migrations: Sequence[Migration]) -> Daemon:
        """A daemon as ``host`` (machine and boot of its own) targeting ``migrations``;
        its constructor raising is what exits 1 at start."""
        mp = self.monkeypatch
        for env, kind in ((MACHINE_ID_ENV, "machine"), (BOOT_ID_ENV, "boot")):
            path = self.tmp / f"{host}.{kind}"
            path.write_text(f"{kind}-{host}-0000000000000000\n")
            mp.setenv(env, str(path))
        mp.setenv(HOST_ENV, host)
        mp.setattr(process, "open_store", functools.partial(open_store, migrations=migrations))
        daemon = Daemon(_config(self.tmp / name, self.url), backend=FakeBackend(gpus=1))
        thread = threading.Thread(target=daemon.run, name=f"daemon-{name}", daemon=True)
        thread.start()
        wait_until(lambda: daemon.scheduler.running, 15, f"{name} running")
        with self._lock:
            self.running[name] = (daemon, thread)
        return daemon

    def stop(self, name: str) -> None:
        with self._lock:
            daemon, thread = self.running.pop(name)
        daemon.request_stop()
        thread.join(15)
        assert not thread.is_alive(), f"{name} did not stop"

    def scrape(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                daemons = list(self.running.items())
            for name, (daemon, _) in daemons:
                try:
                    text = _metrics(daemon)
                except (OSError, urllib.error.URLError) as e:
                    with self._lock:
                        if name in self.running:  # not one being stopped
                            self.gaps.append(f"{name}: {e}")
                    continue
                if "gpuwatchd_gpu_temperature_celsius{" not in text:
                    self.gaps.append(f"{name}: no telemetry in /metrics")
                self.scrapes += 1

    def close(self) -> None:
        self._stop.set()
        for name in list(self.running):
            self.stop(name)


@pytest.fixture
def fleet(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Fleet]:
    f = Fleet(tmp_path, postgres_server.url(postgres_server.new_database()), monkeypatch)
    scraper = threading.Thread(target=f.scrape, name="scraper", daemon=True)
    scraper.start()
    try:
        yield f
    finally:
        f.close()
        scraper.join(10)


def _lease_expiry(url: str, host: str) -> float:
    with postgres_store(url, readonly=True) as s:
        (lease,) = [c for c in s.claims() if c.key == f"host:{host}"]
        return lease.expires_at


def test_an_upgrade_then_a_rollback_never_stops_telemetry_nor_a_daemon(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    old_a = fleet.start("a", "node-a", PREVIOUS)
    assert _gauge(old_a, "gpuwatchd_store_schema_skew") == 0.0

    # Upgrade: node-b restarts on the new release, which migrates the store (additively).
    new_b = fleet.start("b", "node-b", MIGRATIONS)
    assert _gauge(new_b, "gpuwatchd_store_schema_skew") == 0.0
    wait_until(lambda: _gauge(old_a, "gpuwatchd_store_schema_skew") == 1.0, SEEN_WITHIN_S,
               "node-a seeing the newer schema")  # fmt: skip
    assert _gauge(old_a, "gpuwatchd_store_writable") == 1.0
    # The older daemon goes on writing: it renews its host name and syncs in one batch.
    renewed = _lease_expiry(fleet.url, "node-a")
    wait_until(lambda: _lease_expiry(fleet.url, "node-a") > renewed, SEEN_WITHIN_S,
               "node-a renewing its host name")  # fmt: skip
    assert _gauge(old_a, "gpuwatchd_fleet_sync_success") == 1.0
    sid = old_a.store.start_session(session_meta(host="node-a"))
    old_a.store.finish_session(sid, SessionStatus.COMPLETED)

    # Rollback: node-b goes back to the previous release, on the store the new one migrated.
    fleet.stop("b")
    old_b = fleet.start("b-again", "node-b", PREVIOUS)
    assert _gauge(old_b, "gpuwatchd_store_schema_skew") == 1.0
    assert _gauge(old_b, "gpuwatchd_store_writable") == 1.0
    wait_until(lambda: _lease_expiry(fleet.url, "node-b") > 0, SEEN_WITHIN_S, "node-b's lease")

    # A later release with a step older daemons cannot follow: they stop writing, not
    # monitoring, and one restarted then still starts.
    postgres_store(fleet.url, migrations=(*MIGRATIONS, INCOMPATIBLE)).close()
    for daemon in (old_a, old_b):
        wait_until(lambda d=daemon: _gauge(d, "gpuwatchd_store_writable") == 0.0,  # type: ignore[misc]
                   SEEN_WITHIN_S, "writes refused")  # fmt: skip
        assert _gauge(daemon, "gpuwatchd_store_schema_skew") == 2.0
    fleet.stop("a")
    old_a = fleet.start("a-again", "node-a", PREVIOUS)
    assert _gauge(old_a, "gpuwatchd_store_writable") == 0.0
    assert _gauge(old_a, "gpuwatchd_store_up") == 1.0

    assert fleet.gaps == [] and fleet.scrapes > 20
    messages = [r.getMessage() for r in caplog.records]
    skew_lines = [m for m in messages if "newer than this gpuwatchd's" in m]
    # one line per daemon and change of skew: a-additive, b-again-additive, a and b-again
    # incompatible, a-again incompatible; never one per write
    assert len(skew_lines) == 5, skew_lines
    assert all("\n" not in line for line in skew_lines)
    assert sum("monitoring and reads go on" in line for line in skew_lines) == 3
