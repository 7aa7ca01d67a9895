"""Fault injection: malformed traces (the suite's trace faults).

Every generated trace is refused by the replay reader with one :class:`TraceError` line
naming the file (and the line where there is one); a sample goes through ``gpuwatchd run
--trace F``, which must exit 2 with that line and nothing else. ``bench/faults_trace.py``
runs every case through the real command line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_cases import bad_traces, run_daemon_on, write_case

from gpuwatchd.telemetry.replay import ReplayBackend
from gpuwatchd.telemetry.trace import TraceError, load_trace

CASES = dict(bad_traces())


def test_at_least_30_distinct_malformed_traces_are_refused_in_one_line(tmp_path: Path) -> None:
    assert len(CASES) >= 30
    for name, content in CASES.items():
        path = write_case(tmp_path, name, content, ".jsonl")
        with pytest.raises(TraceError) as exc:
            load_trace(path)
        text = str(exc.value)
        assert text.startswith(str(path)) and "\n" not in text and len(text) < 400, (name, text)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("sample-nested-100k", ":2: not valid JSON (nested too deeply)"),
        ("sample-nested-objects", ":2: not valid JSON (nested too deeply)"),
        ("sample-int-5000-digits", ":2: not valid JSON (Exceeds the limit"),
        ("not-utf8", ": not UTF-8 text"),
        ("sample-procs-huge", ":2: field 'procs': must be <= 4096"),
    ],
)
def test_item_7_and_its_kin_name_the_line(name: str, needle: str, tmp_path: Path) -> None:
    with pytest.raises(TraceError) as exc:
        ReplayBackend(write_case(tmp_path, name, CASES[name], ".jsonl"))
    assert needle in str(exc.value)


def test_a_directory_or_a_missing_file_is_one_line(tmp_path: Path) -> None:
    for path, needle in ((tmp_path, "Is a directory"), (tmp_path / "nope", "No such file")):
        with pytest.raises(TraceError, match=needle) as exc:
            load_trace(path)
        assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "name", ["empty", "sample-nested-100k", "sample-int-5000-digits", "random-bytes", "header-only"]
)
def test_gpuwatchd_run_with_a_malformed_trace_exits_2_in_one_line(
    name: str, tmp_path: Path
) -> None:
    path = write_case(tmp_path, name, CASES[name], ".jsonl")
    res = run_daemon_on(["--trace", str(path)], tmp_path / "s", tmp_path / "c.sock", timeout=60)
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"gpuwatchd: {path}")
