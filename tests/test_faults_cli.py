"""Fault injection: bad command-line arguments.

Each is refused before anything starts: one ``gpuwatchd: ...`` line and exit 2 for a bad
value, argparse's usage and ``error:`` line (exit 2) for a malformed command line, exit 1
and one line for a file that is missing at run time. Never a traceback. The commands run
in-process with their work replaced by a tripwire, so an argument wrongly accepted fails
the test instead of starting a daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.cli.main import main

RUN = ["run", "--backend", "sim", "--listen", "127.0.0.1:0"]
TUNE = ["tune", "--backend", "sim", "--workload", "sim-gemm"]
RECORD = ["record", "--backend", "sim", "--out", "{tmp}/t.jsonl"]

#: (arguments, exit status, text of the one line). Status 2 from argparse has no one line.
CASES: list[tuple[list[str], int, str]] = [
    ([*RUN, "--poll-interval", "inf"], 2, "daemon.poll_interval_s: expected a finite number"),
    ([*RUN, "--poll-interval", "nan"], 2, "daemon.poll_interval_s: expected a finite number"),
    ([*RUN, "--poll-interval", "0"], 2, "daemon.poll_interval_s: must be in [0.01, 1.0]"),
    ([*RUN, "--poll-interval", "-1"], 2, "daemon.poll_interval_s: must be in [0.01, 1.0]"),
    ([*RUN, "--speed", "1e15"], 2, "sim.speed: must be in (0, 1000]"),
    ([*RUN, "--speed", "nan"], 2, "sim.speed: expected a finite number"),
    ([*RUN, "--speed", "0"], 2, "sim.speed: must be in (0, 1000]"),
    ([*RUN, "--gpus", "0"], 2, "sim.gpus: must be in [1, 1024]"),
    ([*RUN, "--gpus", "100000"], 2, "sim.gpus: must be in [1, 1024]"),
    ([*RUN, "--scenario", "nosuch"], 2, "sim.scenario: unknown 'nosuch'"),
    (["run", "--listen", "nohost"], 2, "--listen: listen address 'nohost': expected HOST:PORT"),
    (["run", "--listen", "127.0.0.1:99999"], 2, "port 99999 is out of range 0-65535"),
    (["run", "--trace", "{tmp}/missing.jsonl"], 2, "missing.jsonl: cannot read"),
    (["run", "--trace", "{tmp}"], 2, ": cannot read: Is a directory"),
    (["run", "--config", "{tmp}/missing.toml"], 2, "cannot read config file"),
    (["run", "--config", "{tmp}"], 2, "cannot read config file"),
    ([*RUN, "--web-config", "{tmp}/missing.yml"], 2, "missing.yml"),
    ([*TUNE, "--budget", "inf"], 2, "--budget: expected seconds from 0 to 366 days, got inf"),
    ([*TUNE, "--budget", "nan"], 2, "--budget: expected seconds from 0 to 366 days, got nan"),
    ([*TUNE, "--budget", "-1"], 2, "--budget: expected seconds from 0 to 366 days, got -1.0"),
    ([*TUNE, "--budget", "1e15"], 2, "--budget: expected seconds from 0 to 366 days"),
    ([*TUNE, "--wait-timeout", "nan"], 2, "--wait-timeout: expected seconds from 0 to"),
    ([*TUNE, "--wait-timeout", "-5"], 2, "--wait-timeout: expected seconds from 0 to"),
    (["tune", "--backend", "sim", "--workload", "nosuch"], 2, "nosuch"),
    ([*RECORD, "--duration", "inf"], 2, "--duration: expected seconds from 0 to 366 days"),
    ([*RECORD, "--duration", "nan"], 2, "--duration: expected seconds from 0 to 366 days"),
    ([*RECORD, "--duration", "0"], 2, "--duration: must be > 0, got 0.0"),
    ([*RECORD, "--duration", "1", "--interval", "0"], 2, "--interval: expected seconds from"),
    ([*RECORD, "--duration", "1", "--interval", "1e-9"], 2, "--interval: expected seconds"),
    (["check-config", "--config", "{tmp}/missing.toml"], 2, "cannot read config file"),
    (["check-config", "--web-config", "{tmp}/missing.yml"], 2, "missing.yml"),
    (["report", "--store", "{tmp}/missing.db"], 1, "missing.db does not exist"),
    (["report", "--store", "{tmp}"], 1, "is a directory; give the store's file"),
    (["nosuch-command"], 2, ""),
    (["run", "--backend", "cuda"], 2, ""),
    (["run", "--poll-interval", "fast"], 2, ""),
    (["run", "--gpus", "two"], 2, ""),
    (["tune", "--regime", "hot"], 2, ""),
    (["record", "--backend", "sim", "--duration", "1"], 2, ""),
    (["run", "--log-level", "loud"], 2, ""),
]


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if a command gets past its arguments and starts real work."""

    def tripped(*_args: object, **_kw: object) -> None:
        raise AssertionError("a bad argument was accepted: the command started its work")

    monkeypatch.setattr("gpuwatchd.daemon.process.Daemon.run", tripped)
    monkeypatch.setattr("gpuwatchd.cli.tune._tune", tripped)
    monkeypatch.setattr("gpuwatchd.telemetry.record.record_trace", tripped)


@pytest.mark.usefixtures("tripwires")
@pytest.mark.parametrize(("argv", "status", "needle"), CASES, ids=lambda v: str(v)[:60])
def test_a_bad_argument_is_refused_without_a_traceback(
    argv: list[str], status: int, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "run":
        argv += ["--state-dir", str(tmp_path / "s"), "--control-socket", str(tmp_path / "c")]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: usage and one error line
        rc = exc.code
        err = capsys.readouterr().err
        assert rc == status == 2 and not needle
        assert err.startswith("usage: ") and ": error: " in err.splitlines()[-1]
        return
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert rc == status and len(lines) == 1 and lines[0].startswith("gpuwatchd: "), err
    assert needle in lines[0] and not out
