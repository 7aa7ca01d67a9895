"""The tune progress display: a live line on a terminal, rate-limited lines elsewhere."""

from __future__ import annotations

import io
from typing import Any

import pytest

from gpuwatchd.cli.progress import LineProgress, TtyProgress, _Fields, fit_line, make_progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


class AsciiTty(FakeTty):
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
        "regime": "sustained",
        "candidate": "cublaslt",
        "done": 1,
        "total": 4,
        "batches": 12,
        "sm_clock_mhz": 1470.0,
        "temp_c": 61.0,
        "power_w": 693.4,
    }
    base.update(kw)
    return base


def frames(text: str) -> list[str]:
    """What each redraw left on screen (the text after each carriage return)."""
    return [f.replace("\x1b[K", "") for f in text.split("\r")[1:]]


def test_tty_rewrites_one_line_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TERM", "xterm")
    out, clock = FakeTty(), Clock()
    show = make_progress(out, clock=clock)
    assert isinstance(show, TtyProgress)
    show(msg(regime="unthrottled", done=0, candidate="triton[128x128x64,s3,w8,g8]"))
    clock.t += 42
    show(msg())
    text = out.getvalue()
    assert "\n" not in text  # still one line
    assert text.count("\r") == 2 and text.count("\x1b[K") == 2
    first, last = frames(text)
    assert first == "[0/4] unthrottled gemm-bf16-8192: triton[128x128x64,s3,w8,g8]" + (
        "  SM 1470 MHz  61°C  693 W  0:00"
    )
    assert last == "[1/4] sustained gemm-bf16-8192: cublaslt  SM 1470 MHz  61°C  693 W  0:42"
    show.finish()
    show.finish()  # idempotent: one newline ends the line
    assert out.getvalue().endswith("0:42\x1b[K\n") and out.getvalue().count("\n") == 1
    show(msg(done=2))  # a later session starts a fresh status line
    assert frames(out.getvalue())[-1].startswith("[2/4] sustained")


def test_tty_line_fits_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    out = FakeTty()
    show = make_progress(out, clock=Clock())
    show(msg(workload="conv-fp16-channels-last-very-long-name", candidate="triton[128x256x64,s4]"))
    (frame,) = frames(out.getvalue())
    assert len(frame) == 59  # one spare column: no wrap at the edge
    # The candidate went down to MIN_NAME_CHARS first, then the workload; the step,
    # regime and telemetry survive.
    assert frame.startswith("[1/4] sustained ")
    assert "triton[…" in frame and "SM 1470 MHz" in frame


def test_fit_line_order_of_sacrifice() -> None:
    f = _Fields(msg(workload="w" * 30, candidate="c" * 30), 5.0, "°")
    full = fit_line(f, 500)
    assert full == f"[1/4] sustained {'w' * 30}: {'c' * 30}  SM 1470 MHz  61°C  693 W  0:05"
    a = fit_line(f, len(full) - 10)
    assert f"{'w' * 30}: {'c' * 19}…  SM" in a and len(a) == len(full) - 10
    b = fit_line(f, len(full) - 40)  # candidate at 8, then the workload shrinks
    assert f": {'c' * 7}…  SM" in b and "w" * 30 not in b and len(b) == len(full) - 40
    c = fit_line(f, 30)  # names at their minimum: the end is cut
    assert c.startswith("[1/4] sustained w") and c.endswith("…") and len(c) == 30


def test_tty_without_ansi_pads_over_a_longer_old_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TERM", "dumb")
    out = FakeTty()
    show = make_progress(out, clock=Clock())
    show(msg(candidate="a-long-candidate-name"))
    show(msg(candidate="short"))
    assert "\x1b" not in out.getvalue()
    first, second = out.getvalue().split("\r")[1:]
    assert len(second) == len(first) and second.endswith(" " * 16)


def test_ascii_terminal_gets_no_unicode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "70")
    out = AsciiTty()
    show = make_progress(out, clock=Clock())
    show(msg(candidate="triton[128x256x64,s4,w8,g8]"))
    show(msg(candidate="x"))
    long, short = frames(out.getvalue())
    out.getvalue().encode("ascii")  # no degree sign, no ellipsis character
    assert ": trito...  SM 1470 MHz  61C" in long and len(long) == 69
    assert short == "[1/4] sustained gemm-bf16-8192: x  SM 1470 MHz  61C  693 W  0:00"


def test_plain_lines_when_not_a_tty_are_rate_limited() -> None:
    out, clock = io.StringIO(), Clock()
    show = make_progress(out, interval_s=5.0, clock=clock)
    assert isinstance(show, LineProgress)
    names = ["cublas", "cublaslt", "triton[a]", "triton[b]"]
    for i in range(20):  # 4 Hz, alternating candidates, same step: one line per 5 s
        show(msg(regime="unthrottled", done=0, candidate=names[i % 4], sm_clock_mhz=1980 - i))
        clock.t += 0.25
    show(msg(regime="unthrottled", done=0, candidate="cublas"))  # t = +5 s
    show(msg(done=1, candidate="cublaslt"))  # a new step prints at once
    show(msg(done=1, candidate="cublas"))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines == [
        "[0/4] unthrottled gemm-bf16-8192: cublas  SM 1980 MHz  61°C  693 W  0:00",
        "[0/4] unthrottled gemm-bf16-8192: cublas  SM 1470 MHz  61°C  693 W  0:05",
        "[1/4] sustained gemm-bf16-8192: cublaslt  SM 1470 MHz  61°C  693 W  0:05",
    ]
    show.finish()  # the next message prints even within the interval
    show(msg(done=1, candidate="triton[a]"))
    assert out.getvalue().splitlines()[-1].startswith("[1/4] sustained gemm-bf16-8192: triton[a]")


def test_new_session_same_step_prints_at_once() -> None:
    out = io.StringIO()
    show = make_progress(out, clock=Clock())
    show(msg())
    show(msg(session_id=8))  # a preempted session retried: same step, new session
    assert len(out.getvalue().splitlines()) == 2


@pytest.mark.parametrize("make_out", [io.StringIO, FakeTty])
def test_odd_messages_never_raise(make_out: type[io.StringIO]) -> None:
    out = make_out()
    show = make_progress(out, clock=Clock())
    show({})
    show(msg(sm_clock_mhz=None, temp_c=float("nan"), power_w="hot", done="1", candidate=" "))
    text = out.getvalue()
    assert "[?/?] ? ?: ?  0:00" in text
    assert "[?/?] sustained gemm-bf16-8192: ?  0:00" in text  # telemetry left out


def test_elapsed_over_an_hour_and_stream_without_isatty() -> None:
    assert _Fields(msg(), 3725.0, "°").elapsed == "1:02:05"

    class NoIsatty:
        encoding = "utf-8"

        def __init__(self) -> None:
            self.buf = io.StringIO()

        def write(self, s: str) -> int:
            return self.buf.write(s)

        def flush(self) -> None:
            pass

    stream = NoIsatty()
    assert isinstance(make_progress(stream), LineProgress)  # type: ignore[arg-type]
    closed = io.StringIO()
    closed.close()
    assert isinstance(make_progress(closed), LineProgress)


def test_bad_interval_names_the_field() -> None:
    with pytest.raises(ValueError, match="interval_s: must be > 0"):
        make_progress(io.StringIO(), interval_s=0)


def test_candidates_done_of_total_are_shown() -> None:
    out = io.StringIO()
    show = make_progress(out)
    show(
        {
            "type": "progress",
            "workload": "gemm",
            "regime": "sustained",
            "candidate": "cublas",
            "done": 1,
            "total": 2,
            "candidates_done": 7,
            "candidates_total": 12,
        }
    )
    show.finish()
    assert "[1/2] 7/12 candidates sustained gemm: cublas" in out.getvalue()


def test_worker_counts_a_candidate_done_once_it_has_its_minimum_of_accepted_batches() -> None:
    from gpuwatchd.tuning.jobspec import Progress
    from gpuwatchd.tuning.types import BatchRecord, Regime, Workload
    from gpuwatchd.tuning.worker.main import ProgressReporter

    sent: list[Progress] = []

    class Channel:
        def send(self, msg: Progress) -> None:
            sent.append(msg)

    wl = Workload("w", "matmul", {"m": 1}, "float32", ("cpu.matmul",))
    rep = ProgressReporter(Channel(), wl, (Regime.UNTHROTTLED,), 0, 1, interval_s=0.0,  # type: ignore[arg-type]
                           candidates=3, min_batches=2)  # fmt: skip

    def batch(name: str, rejected: bool = False) -> BatchRecord:
        return BatchRecord(name, Regime.UNTHROTTLED, 1e-3, 10, 1980.0, 300.0, 40.0, 0, rejected)

    for rec in (batch("a"), batch("b"), batch("a"), batch("b", rejected=True), batch("c")):
        rep(rec)
    assert [m.candidates_done for m in sent] == [0, 0, 1, 1, 1]
    assert all(m.candidates_total == 3 for m in sent)
