"""The tune and record progress displays: live (rich) on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import pytest

from gpuwatchd.cli.progress import (
    EtaEstimate,
    GateWait,
    LineProgress,
    LiveProgress,
    Step,
    clock_text,
    make_progress,
)
from gpuwatchd.cli.record_progress import RecordProgress
from gpuwatchd.telemetry.types import Sample


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


class AsciiOut(io.StringIO):
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "ascii"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def msg(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "progress",
        "session_id": 7,
        "workload": "gemm-bf16-8192",
        "regime": "unthrottled",
        "candidate": "cublaslt",
        "done": 0,
        "total": 2,
        "batches": 12,
        "round": 3,
        "candidates_done": 2,
        "candidates_total": 5,
        "elapsed_s": 12.0,
        "budget_s": 60.0,
        "sm_clock_mhz": 1980.0,
        "temp_c": 45.0,
        "power_w": 300.4,
    }
    base.update(kw)
    return base


BUSY = GateWait(0, "busy", ("1 foreign compute process(es) (pid 4242)",), 1440.0, 59.0, 699.0, 5.0)


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


# -- what a step says ---------------------------------------------------------------------


def test_step_counts_from_one_and_says_round_budget_eta_and_telemetry() -> None:
    step = Step.of(msg())
    assert step.title() == "step 1/2 unthrottled gemm-bf16-8192"  # not "0/2"
    assert step.detail(eta_s=95.0) == (
        "round 3 · budget 12/60 s · ETA ≤1:35 · SM 1980 MHz 45°C 300 W · 2/5 candidates measured"
    )
    last = Step.of(msg(done=1, regime="sustained", elapsed_s=75.0))
    assert last.title().startswith("step 2/2 sustained")
    assert "budget 60/60 s" in last.detail()  # never more than the budget
    assert last.budget_used() == 120.0 and last.budget_total() == 120.0


def test_odd_messages_show_question_marks_and_never_raise() -> None:
    for odd in ({}, {"done": "x", "round": True, "temp_c": float("nan"), "workload": 3}):
        step = Step.of(odd)
        assert step.title() == "step ?/? ? ?"
        assert step.detail() == ""
        assert step.budget_used() is None


def test_eta_converts_device_seconds_to_wall_seconds() -> None:
    clock = Clock()
    eta = EtaEstimate(clock)
    assert eta(Step.of(msg(elapsed_s=0.0))) is None  # no rate yet
    clock.t += 1.0  # a simulated device: 30 device seconds per wall second
    assert eta(Step.of(msg(elapsed_s=30.0))) == pytest.approx((120 - 30) / 30)
    assert eta(Step.of(msg(session_id=8, elapsed_s=30.0))) is None  # a new session
    assert eta(Step.of(msg(budget_s=None))) is None


def test_clock_text() -> None:
    assert [clock_text(s) for s in (0, 59.9, 61, 3725)] == ["0:00", "0:59", "1:01", "1:02:05"]


# -- plain lines ----------------------------------------------------------------------------


def test_plain_lines_show_each_step_and_how_it_ended() -> None:
    out, clock = io.StringIO(), Clock()
    show = make_progress(out, clock=clock)
    assert isinstance(show, LineProgress)
    show(msg(round=1, elapsed_s=0.5))
    clock.t += 1
    show(msg(round=4, elapsed_s=30.0))  # rate-limited, but not lost:
    show(msg(done=1, regime="sustained", round=1, elapsed_s=1.0))
    clock.t += 6
    show(msg(done=1, regime="sustained", round=2, elapsed_s=20.0))  # after interval_s
    show(msg(done=1, regime="sustained", round=7, elapsed_s=60.0))
    show.finish()
    got = lines(out)
    assert got[0] == "step 1/2 unthrottled gemm-bf16-8192 (5 candidates, budget 60 s)"
    assert got[1].startswith("  round 1 · budget 0/60 s · SM 1980 MHz")
    assert got[2].startswith("  round 4 · budget 30/60 s")  # printed when the step changed
    assert got[3] == "step 2/2 sustained gemm-bf16-8192 (5 candidates, budget 60 s)"
    assert got[4].startswith("  round 1 · budget 1/60 s")
    assert got[5].startswith("  round 2 · budget 20/60 s")
    assert got[6].startswith("  round 7 · budget 60/60 s")  # printed by finish
    assert len(got) == 7


def test_plain_waiting_lines_on_each_new_state_and_now_and_then() -> None:
    out, clock = io.StringIO(), Clock()
    show = LineProgress(out, clock=clock, interval_s=5.0, still_waiting_s=30.0)
    show.waiting(GateWait(0, None, ()))
    show.waiting(BUSY)
    clock.t += 1
    show.waiting(BUSY)  # same state: quiet
    clock.t += 31
    show.waiting(BUSY)  # still waiting, said again
    show.gate_open(GateWait(0, "cool_stable", ("temp 40C",), 1980.0, 40.0, 125.0, 80.0))
    got = lines(out)
    assert got[0] == "GPU 0 waiting for the gate: no reading yet · waited 0:00"
    assert got[1] == (
        "GPU 0 waiting for the gate: busy: 1 foreign compute process(es) (pid 4242) · "
        "SM 1440 MHz 59°C 699 W · waited 0:05"
    )
    assert got[2] == got[1]
    assert got[3] == "GPU 0: gate open after 1:20 (temp 40C) · SM 1980 MHz 40°C 125 W"
    assert len(got) == 4


def test_a_gate_open_at_once_prints_nothing() -> None:
    out = io.StringIO()
    show = LineProgress(out)
    show.gate_open(GateWait(0, "cool_stable", ()))
    assert out.getvalue() == ""


def test_ascii_output_gets_no_degree_sign() -> None:
    out = AsciiOut()
    show = LineProgress(out)
    show(msg())
    show.waiting(BUSY)
    assert "°" not in out.getvalue() and "≤" not in out.getvalue()
    assert "45C" in out.getvalue()


def test_bad_interval_names_the_field() -> None:
    with pytest.raises(ValueError, match="interval_s: must be > 0"):
        make_progress(io.StringIO(), interval_s=0)


# -- a terminal -----------------------------------------------------------------------------


def test_terminal_gets_a_live_display_with_the_same_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    out = FakeTty()
    show = make_progress(out)
    assert isinstance(show, LiveProgress)
    show.waiting(BUSY)
    show.gate_open(GateWait(0, "cool_stable", (), waited_s=12.0))
    show(msg())
    show(msg(round=4, elapsed_s=40.0))
    show.finish()
    show.finish()  # idempotent
    text = out.getvalue()
    assert "GPU 0 waiting for the gate" in text and "busy: 1 foreign compute" in text
    assert "GPU 0: gate open after 0:12" in text
    assert "step 1/2 unthrottled gemm-bf16-8192" in text
    assert "round 4 · budget 40/60 s" in text
    assert "\r" in text  # redrawn in place ...
    assert text.rstrip("\x1b[?25h").endswith("\n")  # ... and ended by a newline


# -- record -------------------------------------------------------------------------------


def test_record_prints_while_it_records() -> None:
    out, clock = io.StringIO(), Clock()
    show = RecordProgress(out, 60.0, interval_s=5.0, clock=clock, live=False)
    sample = Sample(gpu=0, t=0.0, temp_c=40.0, power_w=125.0, sm_clock_mhz=1980.0)
    show(sample)
    clock.t += 2
    show(sample)  # quiet
    clock.t += 4
    show(sample)
    show.finish()
    assert lines(out) == [
        "recording: 0:00 of 1:00 · 1 samples · GPU 0: SM 1980 MHz 40°C 125 W",
        "recording: 0:06 of 1:00 · 3 samples · GPU 0: SM 1980 MHz 40°C 125 W",
    ]


# -- the worker side of the messages ------------------------------------------------------


def test_worker_reports_candidates_round_and_budget() -> None:
    from gpuwatchd.tuning.session_spec import Progress, decode_message, encode_message
    from gpuwatchd.tuning.types import BatchRecord, Regime, Workload
    from gpuwatchd.tuning.worker.main import ProgressReporter

    sent: list[Progress] = []

    class Channel:
        def send(self, m: Progress) -> None:
            sent.append(m)

    device = Clock()
    wl = Workload("w", "matmul", {"m": 1}, "float32", ("cpu.matmul",))
    rep = ProgressReporter(
        Channel(),  # type: ignore[arg-type]
        wl,
        (Regime.UNTHROTTLED, Regime.SUSTAINED),
        0,
        2,
        interval_s=0.0,
        candidates=3,
        min_batches=2,
        budget_s=60.0,
        now=device,
    )

    def batch(name: str, regime: Regime = Regime.UNTHROTTLED, rejected: bool = False) -> None:
        device.t += 1.0  # the batch took a second of device time
        rep(BatchRecord(name, regime, 1e-3, 10, 1980.0, 300.0, 40.0, 0, rejected))

    for name, rejected in (("a", False), ("b", False), ("a", False), ("b", True), ("c", False)):
        batch(name, rejected=rejected)
    assert [m.candidates_done for m in sent] == [0, 0, 1, 1, 1]
    assert [m.round for m in sent] == [1, 1, 2, 2, 2]
    assert [m.elapsed_s for m in sent] == [1.0, 2.0, 3.0, 4.0, 5.0]
    batch("a", Regime.SUSTAINED)  # the next regime: its own round and clock
    assert (sent[-1].done, sent[-1].round, sent[-1].elapsed_s) == (1, 1, 1.0)
    assert all(m.budget_s == 60.0 and m.candidates_total == 3 for m in sent)
    wire = sent[2].to_json()
    assert (wire["round"], wire["elapsed_s"], wire["budget_s"]) == (2, 3.0, 60.0)
    assert decode_message(encode_message(sent[2])) == sent[2]


def test_the_daemon_never_imports_rich() -> None:
    code = (
        "import sys, gpuwatchd.daemon.process, gpuwatchd.cli.main; "
        "sys.exit(1 if 'rich' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
