"""Two machines from one image: same host name, same machine id, another boot.

The lease on a host name names the boot and the process holding it. A daemon that finds
its name and machine id held by another boot waits (monitoring, no writes) to tell a
reboot (the old lease lapses: taken) from a clone (the other renews it: refused in one
line, writes stay refused). Two daemons on one PostgreSQL, constructed as ``gpuwatchd
run`` constructs them, their fleet syncs driven by hand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import session_meta
from daemon_helpers import quiet_config
from fakes_backend import FakeBackend
from pg_server import PostgresServer

from gpuwatchd.config import Config, StoreConfig
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.exporter.collectors.store import StoreCollector
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store.errors import WritesRefused
from gpuwatchd.store.postgres import postgres_store
from gpuwatchd.store.rows import BOOT_ID_ENV, HOST_ENV, MACHINE_ID_ENV
from gpuwatchd.tuning.types import SessionStatus


def _config(tmp: Path, url: str) -> Config:
    return quiet_config(  # type: ignore[no-any-return]
        tmp, store=StoreConfig(url=url), fleet=FleetConfig(sync_interval_s=1.0)
    )


@pytest.fixture
def url(postgres_server: PostgresServer) -> str:
    return postgres_server.url(postgres_server.new_database())


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One host name and one machine id for every daemon of the test (a cloned image)."""
    path = tmp_path / "machine-id"
    path.write_text("c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1\n")
    monkeypatch.setenv(MACHINE_ID_ENV, str(path))
    monkeypatch.setenv(HOST_ENV, "twin")
    yield


def _booted(tmp: Path, monkeypatch: pytest.MonkeyPatch, boot: str, url: str) -> Daemon:
    path = tmp / f"boot-{boot}"
    path.write_text(f"{boot}\n")
    monkeypatch.setenv(BOOT_ID_ENV, str(path))
    return Daemon(_config(tmp / boot, url), backend=FakeBackend(gpus=1))


def _stop(daemon: Daemon) -> None:
    """A clean stop of a daemon never run: the name given back, the store closed."""
    if daemon.identity is not None:
        daemon.identity.release()
    daemon.store.close()


def _writable(daemon: Daemon) -> float:
    (_, writable, *_) = StoreCollector(daemon.store).collect()
    return float(writable.samples[0].value)


def test_a_cloned_machine_is_refused_in_one_line_and_keeps_monitoring(
    url: str,
    machine: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    first = _booted(tmp_path, monkeypatch, "boot-one", url)
    assert first.store.writable and _writable(first) == 1.0
    sid = first.store.start_session(session_meta(host="twin"))  # the first one's session
    second = _booted(tmp_path, monkeypatch, "boot-two", url)  # starts: no exit
    try:
        assert not second.store.writable and _writable(second) == 0.0
        with pytest.raises(WritesRefused, match="held by boot boot-one"):
            second.store.start_session(session_meta(host="twin"))
        first._hold_host_name()  # the first renews: a live twin, not a reboot
        second._hold_host_name()
        second._hold_host_name()  # asked again: no second line
        clones = [r for r in caplog.records if "in use by another live" in r.getMessage()]
        assert len(clones) == 1 and clones[0].levelno == logging.ERROR
        line = clones[0].getMessage()
        assert "\n" not in line and "'twin'" in line and "boot-one" in line
        assert "boot-two" in line and "store writes refused, monitoring goes on" in line
        assert not second.store.writable and second._fatal is None
        with postgres_store(url) as store:  # the twin failed nothing of the first's
            row = store.session(sid)
            assert row is not None and row.status is SessionStatus.RUNNING
        _stop(first)  # a clean stop gives the name back: the second may take it
        second._hold_host_name()
        assert second.store.writable and _writable(second) == 1.0
    finally:
        _stop(second)


def test_a_reboot_before_the_lease_lapsed_waits_for_it_then_writes(
    url: str,
    postgres_server: PostgresServer,
    machine: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _booted(tmp_path, monkeypatch, "boot-before", url)
    before.store.close()  # power lost: the lease stays until it lapses
    after = _booted(tmp_path, monkeypatch, "boot-after", url)
    try:
        assert not after.store.writable  # a reboot or a clone: not known yet
        after._hold_host_name()  # not renewed meanwhile: no clone said
        assert not after.store.writable and after.identity.clone is None  # type: ignore[union-attr]
        db = url.split("?")[0].rsplit("/", 1)[1]
        postgres_server.sql(db, "UPDATE claims SET expires_at = 0 WHERE claim_key = 'host:twin'")
        after._hold_host_name()  # lapsed: taken, and the tuner records what waited
        assert after.store.writable and after.tuner._abandoned
    finally:
        _stop(after)


def test_a_restart_on_the_same_boot_takes_its_own_lease_at_once(
    url: str, machine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = _booted(tmp_path, monkeypatch, "boot-same", url)
    killed.store.close()  # SIGKILL: no release
    restarted = _booted(tmp_path, monkeypatch, "boot-same", url)
    try:
        assert restarted.store.writable
    finally:
        _stop(restarted)


def test_a_stop_waits_for_the_name_given_back_only_briefly_whatever_the_store_does(
    url: str, machine: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DaemonSet's grace period must cover a stop: a hung store cannot stretch it."""
    daemon = _booted(tmp_path, monkeypatch, "boot-one", url)
    hung = threading.Event()
    calls: list[str] = []

    def hang(host: str, machine_id: str) -> None:
        calls.append(threading.current_thread().name)
        hung.wait(60)

    monkeypatch.setattr(daemon.store, "release_host", hang)
    began = time.monotonic()
    daemon.identity.release(wait_s=0.2)  # type: ignore[union-attr]
    took = time.monotonic() - began
    hung.set()  # the store answers at last: the release's thread ends
    assert calls == ["gpuwatchd-release-host"] and took < 30.0  # not the 60 s hang
    daemon.store.close()
