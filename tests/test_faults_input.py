"""Fault injection: hostile spool entries and deeply nested documents.

Whoever can write the spool (the jobs' group) or reach the control socket may leave a
FIFO, a directory, a symbolic link, a huge file or a document nested a million levels
deep. Each is one line, set aside or refused; the daemon neither blocks, nor stops,
nor logs a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from control_fakes import ask_line
from daemon_helpers import start_daemon
from spool_helpers import scan_all

from gpuwatchd.cli.main import main
from gpuwatchd.control import wire
from gpuwatchd.daemon.ops import OpTable
from gpuwatchd.serve.control import ControlServer
from gpuwatchd.tuning.intake.spool import REJECTED_DIR, SUBDIR, WORKLOADS
from gpuwatchd.validate import MAX_DEPTH, load_json, load_toml

DEEP = 100_000


def _plant_bad_entries(folder: Path) -> dict[str, str]:
    """Every kind of bad entry, named ``*.json``; name -> a word its reason holds."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "fifo.json")
    (folder / "dir.json").mkdir()
    (folder / "target").write_text("{}")
    (folder / "link.json").symlink_to(folder / "target")
    with open(folder / "huge.json", "wb") as f:
        f.truncate(64 * 2**20)  # sparse: big to read, nothing on disk
    (folder / "deep.json").write_text("[" * DEEP + "]" * DEEP)
    (folder / "deep-small.json").write_text('{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1))
    return {
        "fifo.json": "FIFO",
        "dir.json": "directory",
        "link.json": "symbolic link",
        "huge.json": "larger than",
        "deep.json": "nested deeper",
        "deep-small.json": "nested deeper",
    }


def _in_time(fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``fn()`` in a thread; fails (instead of hanging) when it blocks."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked reading the spool"
    return out[0]


def test_bad_kernel_spool_entries_are_set_aside_without_blocking(tmp_path: Path) -> None:
    expected = _plant_bad_entries(tmp_path)
    scan = _in_time(lambda: scan_all(tmp_path))
    reasons = {r.name: r.reason for r in scan.rejected}
    assert scan.entries == []
    for name, word in expected.items():
        assert word in reasons[name], (name, reasons[name])
        assert "\n" not in reasons[name]
        assert (tmp_path / REJECTED_DIR / name).exists() or (
            tmp_path / REJECTED_DIR / name
        ).is_symlink()
        assert not os.path.lexists(tmp_path / name)
    assert (tmp_path / "target").read_text() == "{}"  # a link's target is never touched


def test_bad_workload_spool_entries_are_set_aside_without_blocking(tmp_path: Path) -> None:
    expected = _plant_bad_entries(tmp_path / SUBDIR)
    scan = _in_time(lambda: scan_all(tmp_path, WORKLOADS))
    reasons = {r.name: r.reason for r in scan.rejected}
    assert scan.entries == []
    for name, word in expected.items():
        assert word in reasons[name], (name, reasons[name])
        assert not os.path.lexists(tmp_path / SUBDIR / name)


def test_a_second_rejection_of_the_same_name_is_kept_too(tmp_path: Path) -> None:
    (tmp_path / "x.json").mkdir()
    scan_all(tmp_path)
    (tmp_path / "x.json").write_text("not json")
    scan = scan_all(tmp_path)
    assert [r.moved_to is not None for r in scan.rejected] == [True]
    assert len([p for p in (tmp_path / REJECTED_DIR).iterdir() if p.suffix == ".reason"]) == 2


def test_a_spool_folder_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim.json").write_text("not a request")
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / SUBDIR).symlink_to(elsewhere)
    scan = scan_all(spool, WORKLOADS)
    assert scan.entries == scan.rejected == []
    assert (elsewhere / "victim.json").exists()  # nothing moved out of the linked folder
    assert (spool / SUBDIR).is_dir() and not (spool / SUBDIR).is_symlink()  # the daemon's own
    (aside,) = [p for p in spool.iterdir() if p.name.startswith(f".{SUBDIR}-foreign-")]
    assert aside.is_symlink()  # the link moved aside, never followed


@pytest.fixture
def state_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gwf-", dir="/tmp"))  # short: the socket lives here
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_daemon_starts_serves_and_stops_with_bad_spool_entries(state_dir: Path) -> None:
    """A FIFO blocked the start and SIGTERM; a directory named x.json stopped it."""
    _plant_bad_entries(state_dir / "spool")
    _plant_bad_entries(state_dir / "spool" / SUBDIR)
    sock = state_dir / "c.sock"
    proc = start_daemon(
        [
            "--backend",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(state_dir),
            "--control-socket",
            str(sock),
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sock.exists(), "the control socket never came up"
        assert ask_line(sock, json.dumps({"op": wire.STATUS}))["ok"] is True
        os.mkfifo(state_dir / "spool" / "late.json")  # while running: the rescan's path
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "set aside" in out, out


def test_a_fifo_spooled_while_running_is_set_aside(tmp_path: Path) -> None:
    scan_all(tmp_path)
    os.mkfifo(tmp_path / "late.json")
    scan = _in_time(lambda: scan_all(tmp_path))
    assert [r.name for r in scan.rejected] == ["late.json"]


# -- deep nesting ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["[" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)],
)
def test_deep_json_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="nested deeper than") as e:
        load_json(text, "doc")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text",
    ["a = " + "[" * DEEP + "]" * DEEP, "a = " + "{b = " * DEEP + "1" + "}" * DEEP],
    ids=["arrays", "tables"],
)
def test_deep_toml_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match=r"nested deeper than|invalid TOML") as e:
        load_toml(text, "doc")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", '{"workloads": ' + "[" * DEEP + "]" * DEEP + "}"),
        ("deep.toml", "[[workload]]\nname = 'x'\nshape = " + "[" * DEEP + "]" * DEEP + "\n"),
        ("fifo.json", None),
    ],
    ids=["json", "toml", "fifo"],
)
def test_workloads_add_refuses_deep_files_and_fifos_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str | None
) -> None:
    path = tmp_path / name
    if text is None:
        os.mkfifo(path)
    else:
        path.write_text(text)
    status = _in_time(
        lambda: main(["workloads", "--socket", str(tmp_path / "s"), "add", str(path)])
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_control_socket_answers_deep_requests_in_one_line(
    state_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ControlServer(state_dir / "c.sock", OpTable())
    server.start()
    try:
        with caplog.at_level(logging.DEBUG):
            for line in ("[" * 60_000, '{"op":' * 5_000 + "1" + "}" * 5_000):
                answer = ask_line(server.path, line)
                assert answer["ok"] is False and "nested deeper" in answer["error"], answer
    finally:
        server.stop()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
