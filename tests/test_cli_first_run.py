"""What a first-time user runs: help examples that work as written, one-line errors,
and output piped into ``head`` that ends quietly."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from builders import free_port, wait_until
from daemon_helpers import http_get, start_daemon

from gpuwatchd.cli.common import EXIT_BROKEN_PIPE
from gpuwatchd.cli.main import build_parser
from gpuwatchd.store import SqlStore

#: Slow end to end: the README's test command runs these in its second step.
pytestmark = pytest.mark.slow


def _gpuwatchd(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


def _examples(command: str) -> list[list[str]]:
    """The examples a command's ``--help`` lists, as argument lists after ``gpuwatchd``."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    epilog = sub.choices[command].epilog or ""  # type: ignore[union-attr]
    lines = [line.strip() for line in epilog.splitlines()[1:]]
    return [shlex.split(line)[1:] for line in lines if line.startswith("gpuwatchd ")]


def test_a_reader_that_leaves_early_gets_no_traceback(store: SqlStore, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "report",
            "--format",
            "json",
            "--store",
            str(tmp_path / "tune.db"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # `| head` that has read all it wanted: every write fails
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_port_in_use_is_named_once(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = _gpuwatchd(
            "run",
            "--backend",
            "sim",
            "--listen",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(tmp_path),
            "--control-socket",
            str(tmp_path / "c.sock"),
        )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1
    assert last.startswith(f"gpuwatchd: cannot listen on 127.0.0.1:{port}: ")
    assert last.count("cannot listen") == 1


def test_an_unresolvable_listen_host_is_one_line(tmp_path: Path) -> None:
    res = _gpuwatchd(
        "run",
        "--backend",
        "sim",
        "--listen",
        "no-such-host.invalid:9844",
        "--state-dir",
        str(tmp_path),
        "--control-socket",
        str(tmp_path / "c.sock"),
    )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert last.startswith("gpuwatchd: listen address 'no-such-host.invalid': cannot resolve")


def _every_gate_opens(port: int, what: str) -> None:
    """Wait until each GPU's gate has been seen open at least once."""
    url = f"http://127.0.0.1:{port}/api/v1/state"
    seen: set[int] = set()

    def all_seen() -> bool:
        try:
            doc = json.loads(http_get(url))
        except OSError:
            return False
        seen.update(g["gpu"] for g in doc["gpus"] if (g.get("gate") or {}).get("open"))
        return len(seen) == len(doc["gpus"])

    wait_until(all_seen, 30, what=what, interval=0.2)


def test_every_run_example_on_the_simulated_gpu_opens_its_gate() -> None:
    sim = [ex for ex in _examples("run") if "sim" in ex]
    assert sim, "run --help shows no simulated example"
    for example in sim:
        assert example[0] == "run"
        port = free_port()
        proc = start_daemon([*example[1:], "--listen", f"127.0.0.1:{port}"])
        try:
            _every_gate_opens(port, f"an open gate with {shlex.join(example)}")
        finally:
            proc.terminate()
            proc.communicate(timeout=10)


def test_the_scenario_help_names_every_scenario() -> None:
    from gpuwatchd.telemetry.sim.scenarios import SCENARIOS

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    run_parser = sub.choices["run"]  # type: ignore[index]
    (scenario,) = [a for a in run_parser._actions if "--scenario" in a.option_strings]
    named = {s.strip().removesuffix(" (default)") for s in scenario.help.split(":")[1].split(",")}
    assert named == set(SCENARIOS)
