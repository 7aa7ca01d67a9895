"""Fault injection on the control socket: crowds, idle connections, long answers, huge work.

A burst of jobs must not lose anybody's work (each request is answered or spooled),
one user's idle connections must not lock everybody else out, a listing longer than
one line must still come back whole, and added or configured workloads that could never
run (sizes past any memory, unknown dtypes, more than the cap) are refused in one line.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_fakes import ControlServer as FakeServer
from control_fakes import ask_line

from gpuwatchd.cli.main import main
from gpuwatchd.client.own_gate import _DaemonJobGate
from gpuwatchd.config import Config, ConfigError, parse_config
from gpuwatchd.control import wire
from gpuwatchd.daemon.added_workloads import FILE_NAME, AddedWorkloads
from gpuwatchd.daemon.ops import Op, OpTable
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.daemon.user_ops import parse_list
from gpuwatchd.jobside.requests import Submission
from gpuwatchd.jobside.workload_submit import submit_workloads
from gpuwatchd.serve.control import ControlServer, PeerCred, RequestError
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.tuning.intake.spool import SUBDIR
from gpuwatchd.tuning.intake.workload_requests import parse_add_request
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workloads import parse_workloads

ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
NOBODY = 65534


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: AF_UNIX paths are limited to 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="gwk-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def gemm(name: str, m: int = 64, dtype: str = "float16", family: str = "torch.matmul") -> Workload:
    return Workload(name, "matmul", {"m": m, "n": 64, "k": 64}, dtype, (family,))


# -- a burst of clients ----------------------------------------------------------------


def test_a_burst_of_64_clients_loses_no_work(short_dir: Path) -> None:
    """Every submission is taken by the daemon or spooled; none is dropped as busy."""
    taken: list[str] = []
    lock = threading.Lock()

    def add(request: dict[str, Any], _peer: PeerCred) -> dict[str, Any]:
        time.sleep(0.02)  # a slow store: connections pile up
        names = [w["name"] for w in request["workloads"]]
        with lock:
            taken.extend(names)
        return {"ok": True, "added": names, "replaced": []}

    server = ControlServer(short_dir / "c.sock", OpTable([Op(wire.ADD_WORKLOADS, add)]))
    server.start()
    spool = short_dir / "spool"
    results: list[Submission] = []

    def job(i: int) -> None:
        got = submit_workloads([gemm(f"job{i}.gemm")], socket_path=server.path, spool_dir=spool)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(64)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.stop()
    assert len(results) == 64
    assert {r.how for r in results} <= {"daemon", "spool"}, [r.detail for r in results]
    spooled = list((spool / SUBDIR).glob("*.json")) if (spool / SUBDIR).exists() else []
    assert len(taken) + len(spooled) == 64


def test_a_daemon_that_stays_busy_gets_the_work_spooled(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuwatchd.client.control.BUSY_PATIENCE_S", 0.2)
    fake = FakeServer(short_dir / "c.sock", wire.busy_answer("too many control connections"))
    try:
        got = submit_workloads([gemm("a.gemm")], socket_path=short_dir / "c.sock",
                               spool_dir=short_dir / "spool")  # fmt: skip
    finally:
        fake.close()
    assert got.how == "spool" and "stayed busy" in got.detail, got
    assert len(fake.requests) > 1, "busy was not asked again"
    assert len(list((short_dir / "spool" / SUBDIR).glob("*.json"))) == 1


def test_a_busy_gate_wait_asks_the_daemon_again(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Busy is no reason to stop asking the daemon to judge the GPU for the job."""
    monkeypatch.setattr("gpuwatchd.client.control.BUSY_PATIENCE_S", 0.1)
    fake = FakeServer(short_dir / "c.sock", wire.busy_answer("too many control connections"))
    try:
        gate = _DaemonJobGate(short_dir / "c.sock", timeout=0.2)
        assert gate.judge(0) is None and gate.busy
        fake.answer = {"ok": False, "error": "op: unknown operation 'job_gate'"}
        assert gate.judge(0) is None and not gate.busy
    finally:
        fake.close()


def test_one_users_idle_connections_leave_room_for_others(short_dir: Path) -> None:
    """Eight idle connections from one user held every slot; another user was turned away."""
    short_dir.chmod(0o755)  # the other user reaches the socket through it
    run = short_dir / "run"
    run.mkdir(mode=0o755)
    server = ControlServer(
        run / "c.sock", OpTable([Op(wire.STATUS, lambda _r, _p: {"ok": True})]),
        allowed=lambda _peer: True, client_timeout_s=30.0,
    )  # fmt: skip
    server.start()
    os.chmod(server.path, 0o666)
    ready, tell = os.pipe()
    hog = os.fork()
    if hog == 0:  # the other user: a process of uid nobody holding eight idle connections
        try:
            os.setuid(NOBODY)
            held = []
            for _ in range(8):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(str(server.path))
                held.append(c)
            os.write(tell, b"1")
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(tell)
    try:
        assert os.read(ready, 1) == b"1", "the other user could not connect"
        time.sleep(0.2)  # the server accepts all eight
        answer = ask_line(server.path, json.dumps({"op": wire.STATUS}))
    finally:
        os.kill(hog, 9)
        os.waitpid(hog, 0)
        os.close(ready)
        server.stop()
    assert answer == {"ok": True}


# -- answers longer than one line, and the cap on added workloads ----------------------


def make_daemon(state: Path, **tuning: Any) -> Daemon:
    cfg = parse_config(
        {
            "daemon": {"backend": "sim", "state_dir": str(state), "listen": "127.0.0.1:0",
                       "control_socket": str(state / "ctl.sock")},
            "tuning": tuning,
            "drift": {"enabled": False},
        }
    )  # fmt: skip
    backend = open_backend(cfg.backend_spec())
    backend.name = "nvml"  # type: ignore[misc]  # a CUDA host: torch families run here
    return Daemon(cfg, backend=backend)


def _add(d: Daemon, names: list[str]) -> dict[str, Any]:
    return _call(d, {"op": wire.ADD_WORKLOADS, "workloads": [gemm(n).to_json() for n in names],
           "source": {"kind": "test", "note": "x" * 200}})  # fmt: skip


def _call(d: Daemon, doc: dict[str, Any]) -> dict[str, Any]:
    """The daemon's answer to ``doc``, a refusal as the socket sends it."""
    try:
        return d.control_ops(doc, ME)
    except RequestError as e:
        return wire.error_answer(str(e))


def test_workloads_list_comes_back_whole_past_one_line(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_daemon(short_dir, max_added_workloads=2000)
    try:
        names = [f"model{i:04d}.gemm.float16.with.a.rather.long.name" for i in range(1200)]
        for i in range(0, len(names), 400):
            assert _add(d, names[i : i + 400])["ok"] is True
        first = _call(d, {"op": wire.LIST_WORKLOADS})
        line = json.dumps(first, separators=(",", ":"))  # as the server writes it
        assert len(line) < wire.MAX_LINE and isinstance(first["next"], int)
        d.control.start()
        try:
            status = main(["workloads", "--socket", str(d.control.path), "list"])
            out = capsys.readouterr().out
        finally:
            d.control.stop()
    finally:
        d.store.close()
    assert status == 0
    listed = {line.split()[0] for line in out.splitlines()[1:]}
    assert set(names) <= listed


def test_added_workloads_are_capped_with_a_clear_error(short_dir: Path) -> None:
    d = make_daemon(short_dir, max_added_workloads=3)
    try:
        assert _add(d, ["a.gemm", "b.gemm"])["ok"] is True
        assert _add(d, ["b.gemm", "c.gemm"])["ok"] is True  # b replaced: 3 in all
        refused = _add(d, ["d.gemm"])
        assert _add(d, ["a.gemm"])["ok"] is True  # replacing stays possible at the cap
    finally:
        d.store.close()
    assert refused["ok"] is False and "max_added_workloads = 3" in refused["error"]
    assert "\n" not in refused["error"]


def test_the_cap_is_a_checked_config_key() -> None:
    assert Config().tuning.max_added_workloads == 1024
    with pytest.raises(ConfigError, match=r"tuning\.max_added_workloads"):
        parse_config({"tuning": {"max_added_workloads": 0}})


def test_list_requests_take_only_sane_cursors() -> None:
    table = OpTable([Op(wire.LIST_WORKLOADS, lambda r, _p: {"ok": True, **r}, parse_list)])
    assert table({"op": wire.LIST_WORKLOADS}, ME) == {
        "ok": True, "op": wire.LIST_WORKLOADS, "cursor": 0, "limit": wire.LIST_PAGE_MAX,
    }  # fmt: skip
    for bad in ({"cursor": -1}, {"cursor": "0"}, {"limit": 0}, {"limit": 10**6}):
        with pytest.raises(RequestError, match=r"cursor|limit"):
            table({"op": wire.LIST_WORKLOADS, **bad}, ME)


# -- workloads that could never run ----------------------------------------------------


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (gemm("huge-m", m=2**70).to_json(), "shape.m: expected an integer <="),
        (
            Workload(
                "cpu-40g",
                "matmul",
                {"m": 100_000, "n": 100_000, "k": 100_000},
                "float32",
                ("cpu.matmul",),
            ).to_json(),
            "over the 2 GiB a cpu workload may take",
        ),
        (
            Workload(
                "conv-big",
                "conv2d",
                {"input": [4096, 256, 512, 512], "weight": [256, 256, 3, 3], "padding": 1},
                "float16",
                ("torch.conv2d",),
            ).to_json(),
            "over the 16 GiB a gpu workload may take",
        ),
        (gemm("odd-dtype", dtype="float1024").to_json(), "dtype: expected one of bfloat16"),
        (
            gemm("bmm", family="torch.gemm").to_json()
            | {"op": "bmm", "shape": {"batch": 2**20, "m": 4096, "n": 4096, "k": 4096}},
            "over the 16 GiB",
        ),
    ],
    ids=["m-2**70", "cpu-3x40GB", "conv-too-big", "float1024", "bmm-too-big"],
)
def test_impossible_workloads_are_refused_everywhere(
    table: dict[str, Any], needle: str, short_dir: Path
) -> None:
    """The same check for configured, added and spooled workloads."""
    with pytest.raises(ValueError, match=needle.replace("*", r"\*")):
        parse_workloads([table])
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        parse_config({"workload": [table]})
    with pytest.raises(ValueError, match=needle.replace("*", r"\*")):
        parse_add_request({"op": wire.ADD_WORKLOADS, "workloads": [table]})


def test_the_shipped_workloads_pass_the_size_check() -> None:
    cfg = Config()
    assert parse_workloads([w.to_json() for w in cfg.workloads])


def test_an_add_appends_instead_of_rewriting_a_long_list(tmp_path: Path) -> None:
    """At thousands of workloads an add writes what it adds, not the whole list."""
    kept = AddedWorkloads(tmp_path / FILE_NAME)
    kept.load()
    kept.add([gemm(f"w{i}.gemm") for i in range(2000)], {"kind": "test"})
    before = os.stat(kept.path)
    for i in range(20):
        kept.add([gemm(f"late{i}.gemm")], {"kind": "test"})
    kept.remove(["w0.gemm", "late3.gemm"])
    after = os.stat(kept.path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    again = AddedWorkloads(kept.path)
    again.load()
    assert again.names() == kept.names() and len(again) == 2018


def test_a_torn_last_change_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    kept = AddedWorkloads(tmp_path / FILE_NAME)
    kept.load()
    kept.add([gemm(f"w{i}.gemm") for i in range(50)], {})
    kept.add([gemm("one.gemm")], {})
    kept.remove(["w1.gemm"])
    with open(kept.log_path, "ab") as f:
        f.write(b'{"add": [{"name": "torn.gemm", "op"')  # the daemon died mid-append
    again = AddedWorkloads(kept.path)
    again.load()
    assert "one.gemm" in again and "w1.gemm" not in again and "torn.gemm" not in again
    assert len(again) == 50


# -- the wire declared once ------------------------------------------------------------


def _wire_spellings(tree: ast.Module) -> Iterator[str]:
    """Op names and wire limits a module spells out instead of importing them."""
    ops = set(wire.OPS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "op"
                    and isinstance(value, ast.Constant)
                    and value.value in ops
                ):
                    yield f'{{"op": {value.value!r}}}'
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = node.args[0] if node.args else None
            if name == "Op" and isinstance(first, ast.Constant) and first.value in ops:
                yield f"Op({first.value!r})"
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if isinstance(value, ast.Constant) and value.value in ops:
                yield f"{names} = {value.value!r}"
            for limit in ("MAX_LINE", "CLIENT_TIMEOUT_S", "MAX_CLIENTS"):
                if limit in names and not isinstance(value, ast.Name):
                    yield f"{limit} = ..."


def test_op_names_and_limits_are_declared_only_in_the_wire_module() -> None:
    pkg = Path(wire.__file__).resolve().parent.parent
    offenders = [
        f"{path.relative_to(pkg)}: {spelling}"
        for path in sorted(pkg.rglob("*.py"))
        if path != Path(wire.__file__).resolve()
        for spelling in _wire_spellings(ast.parse(path.read_text()))
    ]
    assert offenders == [], "\n".join(offenders)


def test_every_op_the_daemon_serves_is_declared_on_the_wire(short_dir: Path) -> None:
    d = make_daemon(short_dir)
    try:
        assert set(d.control_ops.names) == set(wire.OPS)
    finally:
        d.store.close()


def test_a_busy_answer_sent_before_the_request_was_read_still_reaches_the_client(
    short_dir: Path,
) -> None:
    """The server turns a client away at accept and closes: the client's send then fails
    (EPIPE), and the busy line already in its receive buffer is still its answer."""
    from gpuwatchd.client.control import ask

    path = short_dir / "c.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    closed = threading.Event()

    def turn_away() -> None:
        conn, _ = listener.accept()
        conn.sendall((json.dumps(wire.busy_answer("too many control connections")) + "\n").encode())
        conn.close()
        closed.set()

    server = threading.Thread(target=turn_away)
    server.start()
    real_connect = socket.socket.connect

    def connect_then_wait(self: socket.socket, address: Any) -> None:
        real_connect(self, address)
        assert closed.wait(5)  # the server has answered and closed before we send

    try:
        socket.socket.connect = connect_then_wait  # type: ignore[method-assign]
        answer = ask(path, '{"op":"status"}', timeout=5.0, patience_s=0)
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        server.join(5)
        listener.close()
    assert answer["ok"] is False and wire.is_busy(answer)
