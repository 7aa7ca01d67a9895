"""The control socket: permissions, stale/live sockets, framing, op table, retune ops, CLI."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import grp
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from builders import wait_until

from gpuwatchd.cli.common import CliError
from gpuwatchd.cli.retune import add_retune_args, format_cancelled
from gpuwatchd.cli.retune import run as run_retune
from gpuwatchd.config import Config
from gpuwatchd.config.loader import TuningConfig
from gpuwatchd.daemon.ops import Op, OpTable
from gpuwatchd.daemon.retune import MANUAL_REASON, parse_retune, retune_ops
from gpuwatchd.serve.control import (
    MAX_LINE,
    ControlError,
    ControlServer,
    PeerCred,
    PeerPolicy,
    RequestError,
    decode_request,
    default_socket_path,
)
from gpuwatchd.tuning.types import Workload

CFG = Config()
SIM = tuple(w for w in CFG.workloads if w.name == "sim-gemm")
ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())


class FakeScheduler:
    """Records requests the way TuneScheduler merges them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[str], str]] = []
        self._pending: dict[int, list[str]] = {}
        self.running: dict[int, frozenset[str]] = {}  # per GPU: its session's workloads

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None:
        names = [w.name for w in workloads]
        self.calls.append((gpu, names, reason))
        have = self._pending.setdefault(gpu, [])
        have.extend(n for n in names if n not in have)

    def pending(self) -> dict[int, tuple[str, ...]]:
        return {g: tuple(w) for g, w in self._pending.items() if w}

    def in_session(self) -> dict[int, frozenset[str]]:
        return dict(self.running)

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None:
        for gpu, have in self._pending.items():
            if gpus is None or gpu in gpus:
                have[:] = [n for n in have if n not in names]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory (AF_UNIX paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="gwc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sched() -> FakeScheduler:
    return FakeScheduler()


def handler_for(sched: FakeScheduler, cfg: Config = CFG, gpus: tuple[int, ...] = (0, 1)) -> OpTable:
    return OpTable(retune_ops(sched, cfg, lambda: list(gpus), lambda: SIM))


@pytest.fixture
def server(sockdir: Path, sched: FakeScheduler) -> Iterator[ControlServer]:
    srv = ControlServer(sockdir / "run" / "control.sock", handler_for(sched))
    srv.start()
    yield srv
    srv.stop()


def ask(path: Path, payload: bytes, timeout: float = 3.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        # the server may answer and close before taking it all
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(payload)
            if not payload.endswith(b"\n"):
                s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\n" not in buf:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    return json.loads(buf.split(b"\n")[0])


def ask_json(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    return ask(path, json.dumps(doc).encode() + b"\n")


# -- requests reaching the scheduler ----------------------------------------------------


def test_retune_request_reaches_scheduler(server: ControlServer, sched: FakeScheduler) -> None:
    resp = ask_json(server.path, {"op": "retune", "gpu": 1, "workloads": ["sim-gemm"]})
    assert resp == {"ok": True, "queued": {"1": ["sim-gemm"]}}
    assert sched.calls == [(1, ["sim-gemm"], MANUAL_REASON)]


def test_defaults_mean_every_gpu_and_the_runnable_set(
    server: ControlServer, sched: FakeScheduler
) -> None:
    resp = ask_json(server.path, {"op": "retune"})
    assert resp == {"ok": True, "queued": {"0": ["sim-gemm"], "1": ["sim-gemm"]}}
    assert [c[0] for c in sched.calls] == [0, 1]
    assert ask_json(server.path, {"op": "status"}) == {
        "ok": True,
        "pending": {"0": ["sim-gemm"], "1": ["sim-gemm"]},
    }


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"op": "retune", "workloads": ["nope"]}, "unknown workload 'nope' (known: sim-gemm)"),
        ({"op": "retune", "workloads": ["cpu-matmul"]}, "'cpu-matmul' is not tuned by this daemon"),
        ({"op": "retune", "gpu": 7}, "gpu: no GPU 7 on this host (GPUs: 0, 1)"),
        ({"op": "retune", "gpu": -1}, "gpu: must be a GPU index >= 0"),
        ({"op": "retune", "gpu": "0"}, "gpu: must be a GPU index"),
        ({"op": "retune", "gpu": True}, "gpu: must be a GPU index"),
        ({"op": "retune", "workloads": "sim-gemm"}, "workloads: must be a non-empty list"),
        ({"op": "retune", "workloads": []}, "workloads: must be a non-empty list"),
        ({"op": "retune", "workloads": [3]}, "workloads: every entry must be a non-empty string"),
        ({"op": "retune", "gpus": 0}, "gpus: unknown key for op 'retune'"),
        ({"op": "status", "gpu": 0}, "gpu: unknown key for op 'status'"),
        ({"op": "launch"}, "op: unknown operation 'launch' (known: retune, status, cancel_retune)"),
        ({"gpu": 0}, "op: missing"),
    ],
)
def test_bad_requests_get_one_line_errors(
    server: ControlServer, sched: FakeScheduler, doc: dict[str, Any], needle: str
) -> None:
    resp = ask_json(server.path, doc)
    assert resp["ok"] is False
    assert needle in resp["error"]
    assert "\n" not in resp["error"]
    assert sched.calls == []


def test_tuning_disabled_rejects_and_reloaded_config_is_seen(sched: FakeScheduler) -> None:
    current = [dataclasses.replace(CFG, tuning=TuningConfig(enabled=False))]
    handle = OpTable(retune_ops(sched, lambda: current[0], lambda: [0], lambda: SIM))
    req = decode_request(b'{"op":"retune"}')
    with pytest.raises(RequestError, match="tuning is disabled"):
        handle(req, ME)
    current[0] = CFG  # SIGHUP turned it back on
    assert handle(req, ME)["ok"] is True
    assert sched.calls == [(0, ["sim-gemm"], MANUAL_REASON)]


def test_no_gpus_known_yet(sched: FakeScheduler) -> None:
    handle = handler_for(sched, gpus=())
    with pytest.raises(RequestError, match="knows no GPUs yet"):
        handle({"op": "retune"}, ME)


def test_handler_exception_is_an_error_response_not_a_dead_server(sockdir: Path) -> None:
    def broken(_req: dict[str, Any], _peer: PeerCred) -> dict[str, Any]:
        raise KeyError("boom")

    srv = ControlServer(sockdir / "c.sock", broken)
    srv.start()
    try:
        for _ in range(2):
            resp = ask(srv.path, b'{"op":"status"}\n')
            assert resp == {"ok": False, "error": "internal error: KeyError: 'boom'"}
    finally:
        srv.stop()


# -- the op table: new operations without touching the server ----------------------------


def test_a_registered_op_is_served_with_the_callers_credentials(
    sockdir: Path, sched: FakeScheduler
) -> None:
    table = handler_for(sched)

    def whoami(request: dict[str, Any], peer: PeerCred) -> dict[str, Any]:
        return {"ok": True, "uid": peer.uid, "pid": peer.pid, "job": request["job"]}

    table.register(Op("whoami", whoami, keys=frozenset({"job", "tag"})))
    srv = ControlServer(sockdir / "c.sock", table)
    srv.start()
    try:
        resp = ask_json(srv.path, {"op": "whoami", "job": "train-7"})
        assert resp == {"ok": True, "uid": os.geteuid(), "pid": os.getpid(), "job": "train-7"}
        bad = ask_json(srv.path, {"op": "launch"})
        assert bad["error"] == (
            "op: unknown operation 'launch' (known: retune, status, cancel_retune, whoami)"
        )
        extra = ask_json(srv.path, {"op": "whoami", "gpu": 0})
        assert extra["error"] == "gpu: unknown key for op 'whoami' (allowed: job, op, tag)"
    finally:
        srv.stop()
    assert table.names == ("retune", "status", "cancel_retune", "whoami")


def test_an_op_without_a_parser_gets_every_key_missing_ones_as_none() -> None:
    got: list[dict[str, Any]] = []

    def note(request: dict[str, Any], _peer: PeerCred) -> dict[str, Any]:
        got.append(request)
        return {"ok": True}

    table = OpTable([Op("note", note, keys=frozenset({"a", "b"}))])
    assert table({"op": "note", "a": 1}, ME) == {"ok": True}
    assert got == [{"op": "note", "a": 1, "b": None}]


def test_an_op_name_registered_twice_is_refused(sched: FakeScheduler) -> None:
    table = handler_for(sched)
    with pytest.raises(ValueError, match="control op 'status' is registered twice"):
        table.register(Op("status", lambda _req, _peer: {"ok": True}))


def test_retune_parser_drops_repeated_workloads_keeping_order() -> None:
    req = parse_retune({"op": "retune", "workloads": ["b", "a", "b"]})
    assert req == {"op": "retune", "gpu": None, "workloads": ["b", "a"]}


# -- the socket file ----------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_socket_is_0660_in_a_0750_directory_whatever_the_umask(
    sockdir: Path, sched: FakeScheduler, umask: int
) -> None:
    old = os.umask(umask)
    try:
        srv = ControlServer(sockdir / "run" / "control.sock", handler_for(sched))
        srv.start()
    finally:
        os.umask(old)
    try:
        st = os.lstat(srv.path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(srv.path.parent).st_mode) == 0o750
    finally:
        srv.stop()
    assert not srv.path.exists()


def test_stale_socket_is_replaced(sockdir: Path, sched: FakeScheduler) -> None:
    path = sockdir / "control.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a crashed daemon leaves the file behind
    assert path.exists()
    srv = ControlServer(path, handler_for(sched))
    srv.start()
    try:
        assert ask_json(path, {"op": "status"})["ok"] is True
    finally:
        srv.stop()


def test_live_socket_is_an_error_and_keeps_serving(
    server: ControlServer, sched: FakeScheduler
) -> None:
    second = ControlServer(server.path, handler_for(sched))
    with pytest.raises(ControlError, match="another gpuwatchd is already listening"):
        second.start()
    second.stop()  # never started: a no-op that must not remove the first one's socket
    assert ask_json(server.path, {"op": "status"})["ok"] is True


def test_stop_leaves_a_successors_socket_alone(sockdir: Path, sched: FakeScheduler) -> None:
    path = sockdir / "control.sock"
    first = ControlServer(path, handler_for(sched))
    first.start()
    os.unlink(path)  # e.g. removed by hand, then a new daemon took the path
    second = ControlServer(path, handler_for(sched))
    second.start()
    try:
        first.stop()
        assert ask_json(path, {"op": "status"})["ok"] is True
    finally:
        second.stop()


def test_a_file_that_is_not_a_socket_is_refused(sockdir: Path, sched: FakeScheduler) -> None:
    path = sockdir / "control.sock"
    path.write_text("not a socket")
    with pytest.raises(ControlError, match="exists and is not a socket"):
        ControlServer(path, handler_for(sched)).start()
    assert path.read_text() == "not a socket"


def test_group_writable_directory_is_refused(sockdir: Path, sched: FakeScheduler) -> None:
    d = sockdir / "shared"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(ControlError, match="writable by group or others"):
        ControlServer(d / "control.sock", handler_for(sched)).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown the directory")
def test_directory_owned_by_someone_else_is_refused(sockdir: Path, sched: FakeScheduler) -> None:
    d = sockdir / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, -1)
    with pytest.raises(ControlError, match="owned by uid 65534"):
        ControlServer(d / "control.sock", handler_for(sched)).start()


def test_control_group_owns_socket_and_directory(sockdir: Path, sched: FakeScheduler) -> None:
    group = grp.getgrgid(os.getegid()).gr_name  # a group this process may always chgrp to
    srv = ControlServer(sockdir / "run" / "control.sock", handler_for(sched), allowed_group=group)
    srv.start()
    try:
        assert os.lstat(srv.path).st_gid == os.getegid()
        assert os.stat(srv.path.parent).st_gid == os.getegid()
    finally:
        srv.stop()


def test_unknown_control_group_is_a_one_line_error(sockdir: Path, sched: FakeScheduler) -> None:
    with pytest.raises(ControlError, match="control_group: no group named 'no-such-grp-x'"):
        ControlServer(sockdir / "c.sock", handler_for(sched), allowed_group="no-such-grp-x")


def test_default_socket_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/gpuwatchd:/run/other")
    assert default_socket_path() == Path("/run/gpuwatchd/control.sock")
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_socket_path() == Path("/run/gpuwatchd/control.sock")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == Path("/run/user/1000/gpuwatchd/control.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == Path("/tmp/gpuwatchd-1000/control.sock")


# -- bad clients ---------------------------------------------------------------------------


def test_garbage_and_oversized_lines_are_rejected(server: ControlServer) -> None:
    assert ask(server.path, b"\xff\xfe\n")["error"] == "request is not UTF-8 text"
    assert "not valid JSON" in ask(server.path, b"{op: retune}\n")["error"]
    assert ask(server.path, b"[1, 2]\n")["error"] == "request must be a JSON object"
    assert ask(server.path, b"\n")["error"] == "empty request line"
    huge = b'{"op":"status","pad":"' + b"x" * (MAX_LINE + 10) + b'"}\n'
    assert ask(server.path, huge)["error"] == f"request line longer than {MAX_LINE} bytes"
    # a request terminated by EOF instead of a newline still counts
    assert ask(server.path, b'{"op":"status"}')["ok"] is True


def test_slow_client_times_out_without_blocking_others(sockdir: Path, sched: FakeScheduler) -> None:
    srv = ControlServer(sockdir / "c.sock", handler_for(sched), client_timeout_s=0.6)
    srv.start()
    try:
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.settimeout(3.0)
        slow.connect(str(srv.path))
        slow.sendall(b'{"op": "sta')  # and then nothing
        t0 = time.monotonic()
        assert ask_json(srv.path, {"op": "retune", "gpu": 0})["ok"] is True
        assert time.monotonic() - t0 < 0.3
        reply = json.loads(slow.recv(4096).split(b"\n")[0])
        assert reply == {"ok": False, "error": "no complete request line within 0.6 s"}
        assert time.monotonic() - t0 < 1.5
        slow.close()
    finally:
        srv.stop()


def test_trickling_client_cannot_extend_its_deadline(sockdir: Path, sched: FakeScheduler) -> None:
    srv = ControlServer(sockdir / "c.sock", handler_for(sched), client_timeout_s=0.5)
    srv.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(3.0)
            s.connect(str(srv.path))
            t0 = time.monotonic()
            s.setblocking(False)
            got = b""
            while b"\n" not in got and time.monotonic() - t0 < 2.0:
                with contextlib.suppress(OSError):
                    s.send(b" ")  # one byte every 50 ms keeps each recv() under its timeout
                time.sleep(0.05)
                with contextlib.suppress(BlockingIOError):
                    got += s.recv(4096)
            assert b"no complete request line within 0.5 s" in got
            assert time.monotonic() - t0 < 1.0
    finally:
        srv.stop()


def test_connection_cap_turns_away_extra_clients(sockdir: Path, sched: FakeScheduler) -> None:
    srv = ControlServer(sockdir / "c.sock", handler_for(sched), max_clients=2)
    srv.start()
    idle = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(srv.path))
            idle.append(s)
        time.sleep(0.1)  # let the server accept both
        resp = ask_json(srv.path, {"op": "status"})
        assert resp == {"ok": False, "error": "busy: too many control connections, try again"}
        for s in idle:
            s.close()
        # Slots come back once the idlers are gone.
        released = wait_until(
            lambda: ask_json(srv.path, {"op": "status"})["ok"], 15.0, interval=0.05
        )
        assert released, "connection slots were not released"
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_stop_is_prompt_with_a_client_connected(sockdir: Path, sched: FakeScheduler) -> None:
    srv = ControlServer(sockdir / "c.sock", handler_for(sched))
    srv.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(str(srv.path))
        t0 = time.monotonic()
        srv.stop()
        assert time.monotonic() - t0 < 0.5
    assert not (sockdir / "c.sock").exists()
    with pytest.raises(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sockdir / "c.sock"))


# -- who may connect -------------------------------------------------------------------


def test_peer_refused_gets_an_error_and_a_log_line(
    sockdir: Path, sched: FakeScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[PeerCred] = []

    def nobody(peer: PeerCred) -> bool:
        seen.append(peer)
        return False

    srv = ControlServer(sockdir / "c.sock", handler_for(sched), allowed=nobody)
    srv.start()
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatchd.serve.control"):
            resp = ask_json(srv.path, {"op": "retune", "gpu": 0})
    finally:
        srv.stop()
    assert resp == {"ok": False, "error": f"permission denied for uid {os.geteuid()}"}
    assert sched.calls == []
    assert seen and seen[0].uid == os.geteuid() and seen[0].pid == os.getpid()
    assert any(f"refused uid {os.geteuid()}" in r.getMessage() for r in caplog.records)


def test_a_permission_check_that_hangs_refuses_the_peer_at_its_deadline(
    sockdir: Path, sched: FakeScheduler
) -> None:
    """A name service that never answers costs the peer its connection, not the server."""
    released = threading.Event()
    calls: list[int] = []

    def hangs_first(peer: PeerCred) -> bool:
        calls.append(peer.uid)
        if len(calls) == 1:
            released.wait(30)
        return True

    srv = ControlServer(
        sockdir / "c.sock", handler_for(sched), allowed=hangs_first, client_timeout_s=0.5
    )
    srv.start()
    try:
        first = ask_json(srv.path, {"op": "retune", "gpu": 0})
        second = ask_json(srv.path, {"op": "retune", "gpu": 0})
    finally:
        released.set()
        srv.stop()
    assert first["ok"] is False and first["error"].startswith("permission denied")
    assert second["ok"] is True and len(calls) == 2


def test_a_peers_connections_share_one_group_lookup_in_flight(
    sockdir: Path, sched: FakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the group database hangs, more connections of the same uid start no lookup."""
    group = grp.getgrgid(os.getegid()).gr_name
    released = threading.Event()
    asked: list[int] = []

    def slow_getpwuid(uid: int) -> Any:
        asked.append(uid)
        released.wait(30)
        raise KeyError(uid)

    monkeypatch.setattr("gpuwatchd.serve.control.pwd.getpwuid", slow_getpwuid)
    srv = ControlServer(sockdir / "c.sock", handler_for(sched), allowed_group=group)
    srv.start()
    stranger = PeerCred(pid=1, uid=4242, gid=4242)  # not root, not us, not in the group
    try:
        loop = srv._loop()
        deadline = loop.time() + 0.5
        verdicts = [
            asyncio.run_coroutine_threadsafe(srv._permitted(stranger, deadline), loop)
            for _ in range(3)
        ]
        assert [v.result(10) for v in verdicts] == [False, False, False]
        assert asked == [4242]
    finally:
        released.set()
        srv.stop()


def test_a_lookup_older_than_a_connection_is_not_shared_and_a_recovered_service_admits(
    sockdir: Path, sched: FakeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = grp.getgrgid(os.getegid()).gr_name
    released = threading.Event()
    asked: list[int] = []

    def getpwuid(uid: int) -> Any:
        asked.append(uid)
        if len(asked) == 1:  # the name service hangs once, then answers
            released.wait(30)
        return argparse.Namespace(pw_name="someone")

    monkeypatch.setattr("gpuwatchd.serve.control.pwd.getpwuid", getpwuid)
    monkeypatch.setattr(
        "gpuwatchd.serve.control.grp.getgrgid", lambda gid: argparse.Namespace(gr_mem=["someone"])
    )
    srv = ControlServer(
        sockdir / "c.sock", handler_for(sched), allowed_group=group, client_timeout_s=0.3
    )
    srv.start()
    stranger = PeerCred(pid=1, uid=4242, gid=4242)
    try:
        loop = srv._loop()

        def permitted(seconds: float) -> bool:
            check = srv._permitted(stranger, loop.time() + seconds)
            return bool(asyncio.run_coroutine_threadsafe(check, loop).result(10))

        assert permitted(0.3) is False  # the hung lookup
        time.sleep(0.35)  # older than a connection's limit: the next one starts afresh
        assert permitted(2.0) is True
        assert asked == [4242, 4242]
    finally:
        released.set()
        srv.stop()


def test_hung_permission_checks_are_bounded_by_max_clients(
    sockdir: Path, sched: FakeScheduler
) -> None:
    released = threading.Event()
    calls: list[int] = []

    def hangs(peer: PeerCred) -> bool:
        calls.append(peer.uid)
        released.wait(30)
        return True

    srv = ControlServer(
        sockdir / "c.sock", handler_for(sched), allowed=hangs, max_clients=2, client_timeout_s=0.3
    )
    srv.start()
    try:
        loop = srv._loop()
        checks = [
            asyncio.run_coroutine_threadsafe(
                srv._permitted(PeerCred(pid=1, uid=5000 + i, gid=5000), loop.time() + 0.3), loop
            )
            for i in range(5)
        ]
        assert [c.result(10) for c in checks] == [False] * 5
        assert len(calls) == 2  # two threads wait on the hung check; the rest were refused
    finally:
        released.set()
        srv.stop()


def test_peer_policy() -> None:
    me = os.getegid()
    group = grp.getgrgid(me).gr_name
    plain = PeerPolicy(own_uid=999)
    assert plain(PeerCred(pid=1, uid=0, gid=0))
    assert plain(PeerCred(pid=1, uid=999, gid=999))
    assert not plain(PeerCred(pid=1, uid=4242, gid=me, groups=frozenset({me})))
    grouped = PeerPolicy(group, own_uid=999)
    assert grouped(PeerCred(pid=1, uid=4242, gid=me))  # primary group
    assert grouped(PeerCred(pid=1, uid=4242, gid=4242, groups=frozenset({me})))  # supplementary
    assert not grouped(PeerCred(pid=1, uid=4242, gid=4242, groups=frozenset({me + 1})))
    assert str(grouped) == f"root, uid 999, members of group {group}"


# -- the CLI --------------------------------------------------------------------------------


def cli_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_retune_args(p)
    return p.parse_args(list(argv))


def test_cli_queues_and_prints(
    server: ControlServer, sched: FakeScheduler, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = run_retune(cli_args("--socket", str(server.path), "--gpu", "0", "--workload", "sim-gemm"))
    assert rc == 0
    assert capsys.readouterr().out == "queued sim-gemm on GPU 0\n"
    assert sched.calls == [(0, ["sim-gemm"], MANUAL_REASON)]
    assert run_retune(cli_args("--socket", str(server.path), "--pending")) == 0
    assert capsys.readouterr().out == "GPU 0: sim-gemm\n"


def test_cli_cancels_waiting_work_and_prints(
    server: ControlServer, sched: FakeScheduler, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(server.path)
    assert run_retune(cli_args("--socket", path, "--workload", "sim-gemm")) == 0
    kernel = Workload("triton.user:m.k@1a2b3c4d/n=1", "triton", {"n": 1}, "float16", ("t",))
    sched.request(1, [kernel], "user kernel request")  # a job's: not the CLI's to cancel
    capsys.readouterr()
    assert run_retune(cli_args("--socket", path, "--cancel", "--gpu", "0")) == 0
    assert capsys.readouterr().out == "cancelled sim-gemm on GPU 0\n"
    assert sched.pending() == {1: ("sim-gemm", kernel.name)}
    assert run_retune(cli_args("--socket", path, "--cancel", "--workload", "other")) == 0
    assert capsys.readouterr().out == "nothing waiting to cancel\n"
    assert run_retune(cli_args("--socket", path, "--cancel", "--json")) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "cancelled": {"1": ["sim-gemm"]}}
    assert sched.pending() == {1: (kernel.name,)}


def test_cancel_leaves_the_running_sessions_workloads_alone(
    server: ControlServer, sched: FakeScheduler
) -> None:
    assert ask_json(server.path, {"op": "retune", "gpu": 0, "workloads": None})["ok"]
    sched.running[0] = frozenset({"sim-gemm"})  # GPU 0 is measuring it now
    answer = ask_json(server.path, {"op": "cancel_retune", "gpu": None, "workloads": None})
    assert answer == {"ok": True, "cancelled": {}}
    assert sched.pending() == {0: ("sim-gemm",)}


def test_a_cancel_of_thousands_of_workloads_answers_within_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    many = tuple(
        Workload(f"gemm-{i:04d}-{'x' * 48}", "matmul", {"m": 8, "n": 8, "k": 8}, "float16",
                 ("torch.gemm",))
        for i in range(2400)
    )  # fmt: skip
    sched = FakeScheduler()
    for gpu in range(8):
        sched.request(gpu, many[gpu * 300 : (gpu + 1) * 300], "manual request")
    table = OpTable(retune_ops(sched, CFG, lambda: list(range(8)), lambda: many))
    answer = table({"op": "cancel_retune", "gpu": None, "workloads": None}, ME)
    assert len(json.dumps(answer)) < MAX_LINE
    named = sum(len(v) for v in answer["cancelled"].values())
    assert named + sum(answer["omitted"].values()) == 2400 and sched.pending() == {}
    lines = format_cancelled(answer["cancelled"], answer["omitted"]).splitlines()
    assert len(lines) == named + len(answer["omitted"])
    assert lines[-1].startswith("cancelled ") and lines[-1].endswith(" more on GPU 7")


def test_cancel_names_a_bad_gpu_and_is_not_pending_at_once(
    server: ControlServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CliError) as err:
        run_retune(cli_args("--socket", str(server.path), "--cancel", "--gpu", "5"))
    assert (err.value.code, str(err.value)) == (
        2,
        "request rejected: gpu: no GPU 5 on this host (GPUs: 0, 1)",
    )
    assert ask_json(server.path, {"op": "cancel_retune", "gpu": True}) == {
        "ok": False,
        "error": "gpu: must be a GPU index >= 0 or null, got True",
    }
    with pytest.raises(SystemExit):
        cli_args("--pending", "--cancel")
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_json_output(server: ControlServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_retune(cli_args("--socket", str(server.path), "--json")) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True,
        "queued": {"0": ["sim-gemm"], "1": ["sim-gemm"]},
    }
    assert run_retune(cli_args("--socket", str(server.path), "--json", "--gpu", "5")) == 2
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_cli_rejected_request_exits_2(server: ControlServer, sched: FakeScheduler) -> None:
    with pytest.raises(CliError) as err:
        run_retune(cli_args("--socket", str(server.path), "--workload", "bogus"))
    assert err.value.code == 2
    assert str(err.value) == (
        "request rejected: workloads: unknown workload 'bogus' (known: sim-gemm)"
    )
    assert sched.calls == []


def test_cli_unreachable_exits_1(sockdir: Path) -> None:
    path = sockdir / "absent.sock"
    with pytest.raises(CliError) as err:
        run_retune(cli_args("--socket", str(path)))
    assert err.value.code == 1
    assert str(err.value) == (
        f"cannot reach gpuwatchd at {path}: No such file or directory (is the daemon running?)"
    )


def test_cli_against_a_stale_socket_exits_1(sockdir: Path) -> None:
    path = sockdir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    with pytest.raises(CliError, match=r"Connection refused \(is the daemon running\?\)") as err:
        run_retune(cli_args("--socket", str(path)))
    assert err.value.code == 1


def test_cli_requests_from_many_threads_all_land(
    server: ControlServer, sched: FakeScheduler
) -> None:
    results: list[int] = []

    def one(gpu: int) -> None:
        results.append(run_retune(cli_args("--socket", str(server.path), "--gpu", str(gpu))))

    threads = [threading.Thread(target=one, args=(i % 2,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert results == [0] * 6
    assert sorted(c[0] for c in sched.calls) == [0, 0, 0, 1, 1, 1]
