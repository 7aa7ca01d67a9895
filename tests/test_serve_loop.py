"""The HTTP server and the control socket on one event loop: shared, held, let go in order."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, full_h200, wait_until

from gpuwatchd.control.wire import MAX_CLIENTS_PER_PEER
from gpuwatchd.exporter import build_registry
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.control import ControlServer, PeerCred
from gpuwatchd.serve.loop import ServeLoop


def answer(doc: dict[str, Any], peer: PeerCred) -> dict[str, Any]:
    return {"ok": True, "op": doc.get("op"), "uid": peer.uid}


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gws-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def ask(path: Path, line: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError):  # a busy server answers before it reads
            s.sendall(line)
        reply: dict[str, Any] = json.loads(s.makefile("rb").readline())
        return reply


def loop_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_both_servers_share_one_loop_thread_and_idle_clients_hold_no_thread(
    sockdir: Path,
) -> None:
    serve_loop = ServeLoop("gpuwatchd-serve-test")
    board = board_of(full_h200())
    http = HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), serve_loop=serve_loop
    )
    control = ControlServer(sockdir / "c.sock", answer, serve_loop=serve_loop)
    http.start()
    control.start()
    idle: list[socket.socket] = []
    try:
        assert len(loop_threads("gpuwatchd-serve-test")) == 1
        assert ask(sockdir / "c.sock", b'{"op": "status"}\n')["ok"] is True
        before = set(threading.enumerate())
        for _ in range(MAX_CLIENTS_PER_PEER):  # silent clients: each holds a slot, no thread
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sockdir / "c.sock"))
            idle.append(s)
        busy = ask(sockdir / "c.sock", b'{"op": "status"}\n')
        assert busy["ok"] is False and busy["error"].startswith("busy")
        assert set(threading.enumerate()) - before == set()  # no thread started for them
        with urllib.request.urlopen(http.url + "/healthz", timeout=5) as response:
            assert response.read() == b"ok\n"
    finally:
        for s in idle:
            s.close()
        control.stop()
        # The control socket stopped first (the daemon's order): HTTP still serves.
        with urllib.request.urlopen(http.url + "/healthz", timeout=5) as response:
            assert response.read() == b"ok\n"
        assert len(loop_threads("gpuwatchd-serve-test")) == 1
        http.stop()
    wait_until(lambda: not loop_threads("gpuwatchd-serve-test"), timeout=5)
    assert not (sockdir / "c.sock").exists()


def test_a_server_built_alone_gets_a_loop_of_its_own(sockdir: Path) -> None:
    control = ControlServer(sockdir / "c.sock", answer)
    control.start()
    try:
        assert ask(sockdir / "c.sock", b'{"op": "x"}\n') == {
            "ok": True,
            "op": "x",
            "uid": os.geteuid(),
        }
    finally:
        control.stop()
    control.start()  # stopped, it can start again with a fresh loop
    try:
        assert ask(sockdir / "c.sock", b'{"op": "y"}\n')["op"] == "y"
    finally:
        control.stop()


def test_a_scrape_of_in_memory_collectors_is_rendered_on_the_loop() -> None:
    """A changed board is rendered on the event loop: no route thread is started for it."""
    board = board_of(full_h200())
    with HttpServer(
        board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0), metrics_max_age_s=0
    ) as http:
        for energy in (1.0, 2.0, 3.0):
            board.put(dataclasses.replace(full_h200(), energy_j=energy))
            with urllib.request.urlopen(http.url + "/metrics", timeout=5) as response:
                assert f"{energy:g}".encode() in response.read()
        assert [t.name for t in threading.enumerate() if t.name.startswith("gpuwatchd-http_")] == []


def test_many_pipelined_requests_answered_on_the_loop_all_come_back() -> None:
    """Requests answered at once (no task) go on one by one, without recursing: a client
    pipelining more requests than the interpreter's recursion limit gets every answer."""
    board = board_of(full_h200())
    count = 1500
    with (
        HttpServer(board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0)) as http,
        socket.create_connection(http.address, timeout=10) as conn,
    ):
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        sender = threading.Thread(target=conn.sendall, args=(request * count,))
        sender.start()
        received = b""
        while received.count(b"ok\n") < count:
            chunk = conn.recv(65536)
            assert chunk, f"closed after {received.count(b'ok')} answers"
            received += chunk
        sender.join(10)
    assert received.count(b"HTTP/1.1 200 OK") == count


def test_a_handler_that_raises_runtime_error_gets_a_one_line_internal_error(
    sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(doc: dict[str, Any], peer: PeerCred) -> dict[str, Any]:
        raise NotImplementedError("no such thing")  # a RuntimeError

    control = ControlServer(sockdir / "c.sock", broken)
    control.start()
    try:
        with caplog.at_level("ERROR", "gpuwatchd.serve.control"):
            got = ask(sockdir / "c.sock", b'{"op": "status"}\n')
    finally:
        control.stop()
    assert got == {"ok": False, "error": "internal error: NotImplementedError: no such thing"}
    assert any("request handler failed" in r.getMessage() for r in caplog.records)


OP_STILL_RUNNING_AT_STOP = """
import socket, sys, threading
from pathlib import Path
from gpuwatchd.serve.control import ControlServer

path = Path(sys.argv[1])
started = threading.Event()

def never_ends(doc, peer):
    started.set()
    threading.Event().wait()  # a stuck op (a store that never answers, say)

server = ControlServer(path, never_ends)
server.start()
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(str(path))
client.sendall(b'{"op": "status"}\\n')
assert started.wait(10)
server.stop()
print("stopped", flush=True)
"""


def test_an_op_still_running_at_stop_does_not_hold_up_the_process_exit(sockdir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", OP_STILL_RUNNING_AT_STOP, str(sockdir / "c.sock")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr


def test_stop_closes_every_connection_even_one_accepted_in_its_last_turn(sockdir: Path) -> None:
    """A client's task cancelled before it first ran never reaches its own cleanup."""
    left_open = 0
    for _ in range(40):
        server = ControlServer(sockdir / "c.sock", answer, client_timeout_s=0.5)
        server.start()
        clients = []
        for _ in range(3):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(sockdir / "c.sock"))
            clients.append(c)
        server.stop()
        left_open += len(server._active) + sum(server._per_peer.values())
        for c in clients:
            c.close()
    assert left_open == 0
