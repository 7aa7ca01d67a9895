"""``gpuwatchd workloads add|list|remove``: the request sent, the output, the exit codes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from control_fakes import ControlServer

from gpuwatchd.cli import workloads as command
from gpuwatchd.cli.common import CliError
from gpuwatchd.tuning.intake.workload_requests import workloads_toml
from gpuwatchd.tuning.submitted.captured import CapturedCall, CapturedSet


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuwatchd")
    sub = parser.add_subparsers(dest="command", required=True)
    command.add_parser(sub)
    args = parser.parse_args(["workloads", *argv])
    return int(args.func(args))


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    call = CapturedCall(
        "gemm", "mm", "forward", "bfloat16", {"batch": 1, "m": 64, "n": 32, "k": 16}, "nt",
        False, False, 3, 0.001, 0.5,
    )  # fmt: skip
    path = tmp_path / "w.toml"
    path.write_text(workloads_toml(CapturedSet((call,), "cuda", 0.002).workloads()))
    return path


@pytest.fixture
def server(tmp_path: Path) -> Any:
    srv = ControlServer(tmp_path / "c.sock", {"ok": True})
    yield srv
    srv.close()


def test_add_sends_the_files_workloads(
    server: ControlServer, toml_file: Path, tmp_path: Path, capsys: Any
) -> None:
    server.answer = {"ok": True, "added": ["model.gemm.bf16.64x32x16.nt"], "replaced": []}
    assert run(["--socket", str(tmp_path / "c.sock"), "add", str(toml_file)]) == 0
    (req,) = server.requests
    assert req["op"] == "add_workloads" and req["source"] == {"kind": "cli"}
    assert [w["name"] for w in req["workloads"]] == ["model.gemm.bf16.64x32x16.nt"]
    assert req["workloads"][0]["families"] == ["torch.gemm"]
    assert capsys.readouterr().out == "added model.gemm.bf16.64x32x16.nt\n"


def test_list_prints_an_aligned_table(server: ControlServer, tmp_path: Path, capsys: Any) -> None:
    server.answer = {
        "ok": True,
        "workloads": [
            {"name": "model.gemm.a", "op": "matmul", "dtype": "bfloat16",
             "families": ["torch.gemm"], "origin": "added"},
            {"name": "conv-l4-report", "op": "conv2d", "dtype": "float32",
             "families": ["torch.conv2d"], "origin": "config"},
        ],
    }  # fmt: skip
    assert run(["--socket", str(tmp_path / "c.sock"), "list"]) == 0
    assert server.requests == [{"op": "list_workloads"}]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "OP", "DTYPE", "FAMILIES", "ORIGIN"]
    assert lines[1].split() == ["model.gemm.a", "matmul", "bfloat16", "torch.gemm", "added"]
    assert lines[0].index("OP") == lines[2].index("conv2d")


def test_remove_sends_names(server: ControlServer, tmp_path: Path, capsys: Any) -> None:
    server.answer = {"ok": True, "removed": ["a.b"]}
    assert run(["--socket", str(tmp_path / "c.sock"), "remove", "a.b", "c.d"]) == 0
    assert server.requests == [{"op": "remove_workloads", "names": ["a.b", "c.d"]}]
    assert capsys.readouterr().out == "removed a.b\n"


def test_json_prints_the_daemons_answer(server: ControlServer, tmp_path: Path, capsys: Any) -> None:
    server.answer = {"ok": True, "workloads": []}
    assert run(["--socket", str(tmp_path / "c.sock"), "--json", "list"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "workloads": []}


def test_a_bad_file_is_exit_2_before_any_request(server: ControlServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[workload]]\nname = 'x'\n")
    with pytest.raises(CliError) as e:
        run(["--socket", str(tmp_path / "c.sock"), "add", str(bad)])
    assert e.value.code == 2 and str(bad) in str(e.value) and "workload[0].op" in str(e.value)
    assert server.requests == []


def test_a_bad_name_is_exit_2(server: ControlServer, tmp_path: Path) -> None:
    with pytest.raises(CliError) as e:
        run(["--socket", str(tmp_path / "c.sock"), "remove", "two words"])
    assert e.value.code == 2 and "NAME 1" in str(e.value)


def test_no_daemon_is_exit_1(toml_file: Path, tmp_path: Path) -> None:
    with pytest.raises(CliError) as e:
        run(["--socket", str(tmp_path / "none.sock"), "add", str(toml_file)])
    assert e.value.code == 1 and "cannot reach gpuwatchd" in str(e.value)


def test_a_refusal_is_exit_2(server: ControlServer, tmp_path: Path) -> None:
    server.answer = {"ok": False, "error": "workloads[0].families: unknown family 'x'"}
    with pytest.raises(CliError) as e:
        run(["--socket", str(tmp_path / "c.sock"), "remove", "a"])
    assert e.value.code == 2 and "request rejected: workloads[0].families" in str(e.value)


def test_a_daemon_without_the_operation_is_exit_1(server: ControlServer, tmp_path: Path) -> None:
    server.answer = {"ok": False, "error": "op: unknown operation 'list_workloads' (known: retune)"}
    with pytest.raises(CliError) as e:
        run(["--socket", str(tmp_path / "c.sock"), "list"])
    assert e.value.code == 1 and "does not support list_workloads" in str(e.value)
