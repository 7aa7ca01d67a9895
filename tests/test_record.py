"""``gpuwatchd record``: a trace that the replay backend and plot-timeline read back."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

from gpuwatchd.telemetry.trace import T0_UNIX_KEY, load_trace


def gpuwatchd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args], capture_output=True, text=True, timeout=60
    )


def test_record_writes_a_trace_that_loads_with_its_wall_clock_origin(tmp_path: Path):
    out = tmp_path / "busy.jsonl"
    before = time.time()
    res = gpuwatchd("record", "--backend", "sim", "--scenario", "busy", "--gpus", "2",
                    "--duration", "0.6", "--interval", "0.1", "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    trace = load_trace(out)
    assert sorted(trace.devices) == [0, 1]
    for gpu in (0, 1):
        samples = trace.samples[gpu]
        assert len(samples) >= 4 and samples[0].t >= 0.0
        assert all(b.t > a.t for a, b in itertools.pairwise(samples))
    t0 = json.loads(out.read_text().splitlines()[0])[T0_UNIX_KEY]
    assert before <= t0 <= time.time()
    plot = tmp_path / "t.png"
    drawn = gpuwatchd("plot-timeline", "--trace", str(out), "--gpu", "1", "--out", str(plot))
    assert drawn.returncode == 0 and plot.stat().st_size > 10_000, drawn.stderr


def test_record_rejects_bad_arguments_in_one_line(tmp_path: Path):
    res = gpuwatchd("record", "--backend", "sim", "--duration", "0", "--out", str(tmp_path / "x"))
    assert (
        res.returncode == 2 and res.stderr.strip() == "gpuwatchd: --duration: must be > 0, got 0.0"
    )
    (tmp_path / "file").write_text("")  # a parent that is a file is no directory
    res = gpuwatchd(
        "record", "--backend", "sim", "--duration", "1", "--out", str(tmp_path / "file" / "x")
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
