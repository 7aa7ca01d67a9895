"""``gpuwatchd tune`` and ``gpuwatchd report`` as a user runs them."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from builders import capped, h200, idle, judged

from gpuwatchd.cli.common import CliError
from gpuwatchd.cli.main import build_parser
from gpuwatchd.cli.tune import SHIPPED_WORKLOADS, GateWatch
from gpuwatchd.gate import GateConfig, GateDecision, GateState
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS


def gpuwatchd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sim_power_cap_tune_finds_the_regime_flip_in_under_a_minute(tmp_path: Path):
    store = tmp_path / "g.db"
    started = time.monotonic()
    res = gpuwatchd(
        "tune", "--backend", "sim", "--scenario", "power-cap", "--workload", "sim-gemm",
        "--store", str(store),
    )  # fmt: skip
    took = time.monotonic() - started
    assert res.returncode == 0, res.stdout + res.stderr
    assert took < 60
    # It had to wait, and said why: the scenario's foreign matmul job holds the GPU first.
    assert "GPU 0 waiting for the gate: busy: 1 foreign compute process(es)" in res.stdout
    assert re.search(r"GPU 0: gate open after \d+:\d\d", res.stdout)
    # Piped: a line per step, counted from 1, with round, budget and telemetry.
    assert "step 1/2 unthrottled sim-gemm (5 candidates, budget " in res.stdout
    assert "step 2/2 sustained sim-gemm" in res.stdout
    assert re.search(r"  round \d+ · budget \d+/\d+ s · .*SM \d+ MHz", res.stdout)
    assert "0/2" not in res.stdout
    assert "WINNERS DIFFER" in res.stdout
    _check_table(res.stdout)

    rep = gpuwatchd("report", "--store", str(store), "--format", "json")
    assert rep.returncode == 0, rep.stderr
    doc = json.loads(rep.stdout)
    by_regime = {r["regime"]: r for r in doc["results"] if r["workload"] == "sim-gemm"}
    assert set(by_regime) == {"unthrottled", "sustained"}
    assert doc["winners_differ"] == {"sim-gemm": True}
    cool, hot = by_regime["unthrottled"], by_regime["sustained"]
    assert cool["winner"] != hot["winner"] and not cool["tie"] and not hot["tie"]
    for r in (cool, hot):
        for c in r["candidates"]:
            assert {"name", "median_s", "sm_clock_hz", "samples", "rejected"} <= c.keys()
    # The sustained regime really ran power-capped; the unthrottled one at full clock.
    hot_best = hot["candidates"][0]
    assert hot_best["sm_clock_hz"] < 0.85 * 1980e6
    assert "sw_power_cap" in hot_best["throttle_reasons"]
    assert cool["candidates"][0]["sm_clock_hz"] > 0.95 * 1980e6

    table = gpuwatchd("report", "--store", str(store))
    assert table.returncode == 0
    assert "sim-gemm" in table.stdout and "WINNERS DIFFER" in table.stdout
    _check_table(table.stdout)
    assert table.stdout.strip() in res.stdout  # tune prints what report prints


def _check_table(text: str) -> None:
    """Unthrottled before sustained, everywhere; 100 columns at most."""
    rows = [line.split()[0] for line in text.splitlines() if line.startswith(("unth", "sust"))]
    assert rows == ["unthrottled", "sustained"], text
    table = text[text.index("REGIME") :]
    assert max(len(line) for line in table.splitlines()) <= 100, table


def test_cpu_family_end_to_end(tmp_path: Path):
    store = tmp_path / "g.db"
    res = gpuwatchd(
        "tune", "--backend", "sim", "--workload", "cpu-matmul", "--regime", "unthrottled",
        "--budget", "4", "--store", str(store),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(gpuwatchd("report", "--store", str(store), "--format", "json").stdout)
    (result,) = doc["results"]
    assert result["workload"] == "cpu-matmul" and result["regime"] == "unthrottled"
    # On a loaded machine a candidate may have every batch rejected as noise (no median):
    # the winner and its runner-up were measured all the same.
    measured = [c for c in result["candidates"] if c["median_s"] is not None]
    assert len(measured) >= 2
    assert all(c["median_s"] > 0 and c["samples"] > 0 for c in measured)


def test_no_wait_fails_fast_when_the_gate_is_shut(tmp_path: Path):
    res = gpuwatchd(
        "tune", "--backend", "sim", "--scenario", "heat-soak", "--workload", "sim-gemm",
        "--no-wait", "--store", str(tmp_path / "g.db"),
    )  # fmt: skip
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "gate is shut (busy" in err[0]


class _ScriptedPoller:
    """A poller whose gate says what the test scripts, one snapshot per poll."""

    def __init__(self, snaps: list[GpuSnapshot]) -> None:
        self.snaps = snaps
        self.polls = 0
        self.period_s = 0.01
        self.gate_cfg = GateConfig()
        self.backend = SimpleNamespace(clock=ManualClock())

    def poll(self, gpu: int) -> GpuSnapshot:
        self.polls += 1
        self.backend.clock.advance(self.period_s)
        return self.snaps[min(self.polls, len(self.snaps)) - 1]


def test_no_wait_gives_up_at_the_first_poll_that_sees_the_gpu_in_use():
    """A GPU a job holds is busy now: --no-wait does not gather the gate's 15 s of evidence
    first (it used to, so `tune --no-wait` on a busy GPU took 15 s to fail)."""
    busy = judged(0, h200(), capped(t=0.5), GateState.BUSY, ("1 foreign compute process(es)",))
    poller = _ScriptedPoller([busy])
    watch = GateWatch(poller, 0, io.StringIO(), None)  # type: ignore[arg-type]
    with pytest.raises(CliError) as err:
        watch.wait_open(no_wait=True, timeout_s=None)
    assert err.value.code == 3 and poller.polls == 1


def test_no_wait_gathers_evidence_on_an_idle_gpu_before_judging_it():
    settling = dataclasses.replace(
        judged(0, h200(), idle(0.5), GateState.WARMING, ("settling: 0.5s",)),
        gate=GateDecision(GateState.WARMING, ("settling: 0.5s",), t=0.5, since=0.5,
                          disturbed_at=0.5),
    )  # fmt: skip
    opened = judged(0, h200(), idle(16.0), GateState.COOL_STABLE, ("quiet",))
    poller = _ScriptedPoller([settling, settling, opened])
    watch = GateWatch(poller, 0, io.StringIO(), None)  # type: ignore[arg-type]
    assert watch.wait_open(no_wait=True, timeout_s=None) is opened


def test_a_gate_that_never_opens_is_shown_live_without_spinning(tmp_path: Path):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    res = gpuwatchd(
        "tune", "--backend", "sim", "--scenario", "heat-soak", "--workload", "sim-gemm",
        "--wait-timeout", "4", "--store", str(tmp_path / "g.db"),
    )  # fmt: skip
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert res.returncode == 1 and "gate still shut after 4 s (busy" in res.stderr
    assert "GPU 0 waiting for the gate: busy" in res.stdout  # said what it waits for
    # Python's start-up is most of it; fast-forwarding a simulated gate must not spin.
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s"


def test_bad_workloads_are_one_line_exit_2(tmp_path: Path):
    store = str(tmp_path / "g.db")
    res = gpuwatchd("tune", "--backend", "sim", "--workload", "nope", "--store", store)
    assert res.returncode == 2 and "unknown workload 'nope'" in res.stderr
    res = gpuwatchd("tune", "--backend", "sim", "--workload", "gemm-bf16-8192", "--store", store)
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not Path(store).exists(), "nothing is created for a command that cannot run"


def test_report_without_a_store_is_one_line(tmp_path: Path):
    res = gpuwatchd("report", "--store", str(tmp_path / "missing.db"))
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "missing.db").exists()


def test_report_on_an_empty_store_says_so(tmp_path: Path):
    from gpuwatchd.store import sqlite_store

    sqlite_store(tmp_path / "g.db").close()
    res = gpuwatchd("report", "--store", str(tmp_path / "g.db"))
    assert res.returncode == 0 and "no tuning results yet" in res.stdout


# -- --help ---------------------------------------------------------------------------


def _print_help(*argv: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])


def test_every_command_has_a_summary_a_description_and_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    summaries = {a.dest: a.help for a in sub._choices_actions}
    assert set(summaries) == set(sub.choices) and all(summaries.values())
    for name, command in sub.choices.items():
        assert command.description, name
        assert command.epilog and command.epilog.startswith("examples:\n  gpuwatchd "), name
        _print_help(name)
        out = capsys.readouterr().out
        assert command.description.splitlines()[0] in out  # line breaks kept
        assert out.rstrip().endswith(command.epilog.splitlines()[-1].strip())


def test_tune_help_lists_workloads_defaults_and_groups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _print_help("tune")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    shipped = [n for names in SHIPPED_WORKLOADS.values() for n in names]
    assert sorted(shipped) == sorted(w.name for w in DEFAULT_WORKLOADS)
    for name in shipped:
        assert name in text.replace("- ", "-")  # argparse may break a name at its dash
    assert "thermal regime(s) to measure (default both)" in text
    assert "GPU index (default 0)" in text
    assert "examples: gpuwatchd tune --backend sim" in text
    options, backend = text.split("telemetry backend:")
    assert "--config FILE" in options and "--config" not in backend
