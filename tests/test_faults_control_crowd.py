"""A crowd on the control socket: every job of a burst reaches the daemon, and a connect
flood costs the log a bounded number of lines.

Issue 26: 35 of 64 simultaneous job processes got "cannot reach gpuwatchd" (a connect
refused with EAGAIN by a full listen backlog was not tried again), and every connection
turned away busy was one WARNING (5,584 lines in 15 s).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatchd.client.control import ask
from gpuwatchd.control import wire
from gpuwatchd.daemon.ops import Op, OpTable
from gpuwatchd.exporter.collectors.control import ControlCollector
from gpuwatchd.serve import control
from gpuwatchd.serve.control import ControlServer, PeerCred


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: AF_UNIX paths are limited to 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="gwd-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _status(_request: dict[str, Any], _peer: PeerCred) -> dict[str, Any]:
    return {"ok": True}


def test_a_full_listen_backlog_is_waited_out_not_reported_unreachable(short_dir: Path) -> None:
    """A listener with a backlog of 1 that starts accepting late: all 64 clients get in."""
    path = short_dir / "c.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    clients = 64
    go = threading.Event()

    def serve() -> None:
        go.wait(30)
        listener.settimeout(30)
        for _ in range(clients):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b'{"ok":true}\n')

    answers: list[dict[str, Any] | str] = []
    lock = threading.Lock()

    def job() -> None:
        try:
            got: dict[str, Any] | str = ask(path, '{"op":"status"}', timeout=60)
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        with lock:
            answers.append(got)

    server = threading.Thread(target=serve)
    threads = [threading.Thread(target=job) for _ in range(clients)]
    server.start()
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)  # the backlog is full and the rest are refused with EAGAIN
        go.set()
        for t in threads:
            t.join(90)
    finally:
        go.set()
        server.join(90)
        listener.close()
    assert answers == [{"ok": True}] * clients, [a for a in answers if a != {"ok": True}]


def test_96_jobs_at_once_all_reach_the_daemon(short_dir: Path) -> None:
    """The real server, its slots full and its backlog crowded: busy answers and a full
    backlog are both asked again, so every job gets its answer."""

    def slow_status(request: dict[str, Any], peer: PeerCred) -> dict[str, Any]:
        time.sleep(0.01)  # connections pile up behind the slots
        return {"ok": True}

    server = ControlServer(short_dir / "c.sock", OpTable([Op(wire.STATUS, slow_status)]))
    server.start()
    answers: list[Any] = []
    lock = threading.Lock()

    def job() -> None:
        try:
            got: Any = ask(server.path, '{"op":"status"}', timeout=60)
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        with lock:
            answers.append(got)

    threads = [threading.Thread(target=job) for _ in range(96)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        server.stop()
    assert answers == [{"ok": True}] * 96, [a for a in answers if a != {"ok": True}]


def test_a_connect_flood_is_a_bounded_number_of_log_lines(
    short_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot, held; 200 more connections are turned away busy: one line at once and one
    with the count when the server stops, not one per connection."""
    monkeypatch.setattr(control, "TURNED_AWAY_LOG_S", 3600.0, raising=False)  # no tick
    release = threading.Event()
    entered = threading.Event()

    def hold(request: dict[str, Any], peer: PeerCred) -> dict[str, Any]:
        entered.set()
        release.wait(30)
        return {"ok": True}

    server = ControlServer(
        short_dir / "c.sock", OpTable([Op(wire.STATUS, hold)]), max_clients=1, max_per_peer=1
    )
    server.start()
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy = 0
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatchd.serve.control"):
            holder.settimeout(30)
            holder.connect(str(server.path))
            holder.sendall(b'{"op":"status"}\n')
            assert entered.wait(30)
            for _ in range(200):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(30)
                    s.connect(str(server.path))
                    answer = json.loads(s.makefile("rb").readline())
                    busy += wire.is_busy(answer)
            release.set()
            assert json.loads(holder.makefile("rb").readline()) == {"ok": True}
            turned_away = server.turned_away
            during = [r.getMessage() for r in caplog.records]
            server.stop()
    finally:
        release.set()
        holder.close()
        server.stop()
    assert busy == 200
    assert len(during) == 1 and "turning uid" in during[0], during
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "turned away 199 more connections" in lines[1], lines
    assert turned_away == 200
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlCollector(lambda: server.turned_away))
    assert "gpuwatchd_control_turned_away_total 200.0" in generate_latest(registry).decode()
