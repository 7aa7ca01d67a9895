"""``gpuwatchd status --watch`` and the per-process rows behind it.

The state document lists each GPU's compute processes (user from /proc, memory from the
slow reading, pod where known); the live view draws GPUs and processes within 100
columns. The end-to-end test runs the view in a tmux pane of 100 columns against a
simulated daemon and reads the screen.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import board_of, free_port, h200, judged, wait_until
from daemon_helpers import start_daemon, wait_http
from rich.console import Console

from gpuwatchd.api.state import ProcessLookup, build_state_json, parse_state
from gpuwatchd.cli.status_watch import SHORT_REASONS, WIDTH, render
from gpuwatchd.exporter import DaemonInfo
from gpuwatchd.gate import GateState
from gpuwatchd.telemetry.proc_owner import process_user
from gpuwatchd.telemetry.types import (
    PodRef,
    ProcessMemory,
    Sample,
    SlowReading,
    ThrottleReason,
)

GIB = 2**30


def _doc(lookup: ProcessLookup | None = None) -> dict[str, Any]:
    slow = SlowReading(t=1.0, processes=(ProcessMemory(77, 30 * GIB), ProcessMemory(12, GIB)))
    sample = Sample(
        0, t=1.0, temp_c=61.0, power_w=694.0, sm_clock_mhz=1440.0, util_gpu=0.97,
        reasons=ThrottleReason.SW_POWER_CAP | ThrottleReason.SW_THERMAL_SLOWDOWN,
        procs=(12, 77, 5), slow=slow,
    )  # fmt: skip
    board = board_of(
        judged(0, h200(uuid="GPU-a"), sample, GateState.BUSY, ("3 foreign processes " * 9,))
    )
    built = build_state_json(board, DaemonInfo("1.2", "sim", "3"), lookup=lookup)
    return json.loads(json.dumps(built))


def test_processes_in_the_state_largest_first_with_user_and_pod() -> None:
    pods = {"GPU-a": PodRef("ml", "trainer-0", "pytorch")}
    doc = _doc(ProcessLookup(user=lambda pid: f"u{pid}", pod=pods.get))
    procs = doc["gpus"][0]["processes"]
    assert [(p["pid"], p["used_memory_bytes"], p["user"]) for p in procs] == [
        (77, 30 * GIB, "u77"),
        (12, GIB, "u12"),
        (5, None, "u5"),  # NVML listed it, the slow reading had no memory for it
    ]
    assert {(p["namespace"], p["pod"], p["container"]) for p in procs} == {
        ("ml", "trainer-0", "pytorch")
    }
    (gpu,) = parse_state(doc).gpus
    assert gpu.processes[0].pid == 77 and gpu.processes[0].pod == "trainer-0"


def test_without_a_lookup_processes_have_no_user_or_pod() -> None:
    procs = _doc()["gpus"][0]["processes"]
    assert {(p["user"], p["pod"]) for p in procs} == {(None, None)}


def test_process_user_reads_the_real_uid_from_proc(tmp_path: Path) -> None:
    for pid, uid in ((100, 0), (200, 4_000_000)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(
            f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
        )
    assert process_user(100, str(tmp_path)) == "root"
    assert process_user(200, str(tmp_path)) == "4000000"  # no passwd entry: the uid
    assert process_user(300, str(tmp_path)) is None  # gone


def test_the_view_fits_100_columns_with_gpu_and_process_rows() -> None:
    pods = {"GPU-a": PodRef("a-long-namespace", "a-long-pod-name-" + "x" * 40, "container")}
    state = parse_state(_doc(ProcessLookup(user=lambda pid: "alice", pod=pods.get)))
    console = Console(width=160, record=True, color_system=None)
    console.print(render(state, None, 2.0, dt.datetime(2026, 11, 27, 5, 0)))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    text = "\n".join(lines)
    assert "pwr-cap,sw-therm" in text and "97%" in text and "1440" in text
    assert "GPU 0 busy: 3 foreign" in text and text.count("…") >= 2  # long cells cut
    (row,) = [r for r in (line.split() for line in lines) if r[:2] == ["0", "77"]]
    assert row[2:5] == ["alice", "30.0", "GiB"]
    assert row[5].startswith("a-long-namespace/a-long-pod-name-") and row[5].endswith("…")


def test_every_throttle_reason_has_a_short_name() -> None:
    assert set(SHORT_REASONS) == {r.label for r in ThrottleReason}
    assert len(set(SHORT_REASONS.values())) == len(SHORT_REASONS)


def test_the_widest_gpu_row_still_fits() -> None:
    doc = _doc()
    gpu = doc["gpus"][0]
    gpu["info"]["name"] = "NVIDIA H200 NVL with a very long marketing name"
    gpu["sample"]["throttle_reasons"] = [r.label for r in ThrottleReason]
    gpu["poll"]["stalled"] = True
    console = Console(width=WIDTH, record=True, color_system=None)
    console.print(render(parse_state(doc), "cannot reach gpuwatchd", 2.0, dt.datetime.now()))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert any(line.split()[:1] == ["0"] and "(STALLED)" in line for line in lines)


def test_a_bad_interval_is_one_line_exit_2() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "status", "--watch", "--interval", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["gpuwatchd: --interval 0.0: must be >= 0.1"]


class Pane:
    """A detached tmux session of ``width`` columns on its own server socket."""

    def __init__(self, tmp: Path, width: int = WIDTH, height: int = 40) -> None:
        self.tmux = ["tmux", "-S", str(tmp / "tmux.sock")]
        self.width, self.height = width, height

    def start(self, command: str) -> None:
        size = ["-x", str(self.width), "-y", str(self.height)]
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "w", *size, command], check=True)

    def screen(self) -> list[str]:
        out = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", "w"], capture_output=True, text=True
        )
        return out.stdout.splitlines()

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "w", *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.fixture
def sim_daemon(tmp_path: Path):
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(  # foreign load on both GPUs from t = 10 s, memory read every 0.5 s
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
        f'energy_interval_s = 0.5\nstate_dir = "{tmp_path / "state"}"\n'
        f'control_socket = "{tmp_path / "c.sock"}"\n'
        '[sim]\nscenario = "heat-soak"\ngpus = 2\nspeed = 30.0\n[tuning]\nenabled = false\n'
    )
    proc = start_daemon(["--config", str(cfg)])
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("quit_key", ["q", "C-c"])
def test_watch_in_a_100_column_tmux_pane(tmp_path: Path, sim_daemon: str, quit_key: str) -> None:
    pane = Pane(tmp_path)
    rc_file = tmp_path / "rc"
    watch = shlex.join(
        [sys.executable, "-m", "gpuwatchd", "status", "--watch", "--url", sim_daemon,
         "--interval", "0.3"]
    )  # fmt: skip
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))}"
    pane.start(f"env {env} {watch}; echo $? > {rc_file}; sleep 30")
    try:

        def whole_view(screen: list[str]) -> bool:
            """The view drawn in full: a capture taken mid-redraw misses lines, so the
            test looks again until one capture shows every row (tmux has no 'drawn')."""
            rows = [line.split() for line in screen]
            header = ["GPU", "NAME", "GATE", "TEMP", "POWER", "SM", "MHz", "UTIL", "THROTTLE"]
            gpu_rows = [r for r in rows if r[:2] in (["0", "NVIDIA"], ["1", "NVIDIA"])]
            return (
                max(len(line) for line in screen) <= WIDTH
                and header in rows
                and len(gpu_rows) == 2
                and all(r[-1] in ("pwr-cap", "sw-therm") for r in gpu_rows)
                and any(r[:2] == ["0", "4242"] and "GiB" in r for r in rows)
                and any(r[:2] == ["1", "4243"] and "GiB" in r for r in rows)
            )

        seen: list[list[str]] = [[]]

        def drawn() -> bool:
            seen[0] = pane.screen()
            return bool(seen[0]) and whole_view(seen[0])

        assert wait_until(drawn, 60), "\n".join(seen[0])
        pane.keys(quit_key)
        assert wait_until(lambda: rc_file.exists() and rc_file.read_text().strip(), 30), "\n".join(
            pane.screen()
        )
        assert rc_file.read_text().strip() == "0"
    finally:
        pane.close()
