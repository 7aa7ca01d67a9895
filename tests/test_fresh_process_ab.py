"""bench/gpu_fresh_process_ab.py on CPU: the verdict per cell from every process's chunks,
what a process left behind, and a dry run end to end (forked processes, a tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from gpu_fresh_process_ab import left_behind, markdown, summarise  # noqa: E402

ARMS = ["plain", "gpuwatchd", "plain_again"]


def proc(arm: str, chunks: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "cell": "c",
        "arm": arm,
        "chunks_ms": chunks,
        "median_ms": sorted(chunks)[1],
        "worst_ms": max(chunks),
        **extra,
    }


def test_gpuwatchd_within_the_plain_spread_passes_and_a_slow_burst_does_not() -> None:
    plain = [proc("plain", [6.5, 6.5, 6.6]), proc("plain", [6.4, 6.5, 6.7])]
    again = [proc("plain_again", [6.5, 6.6, 6.6]), proc("plain_again", [6.5, 6.5, 6.9])]
    ok = summarise([*plain, *again, proc("gpuwatchd", [6.4, 6.5, 6.8])], ["c"], ARMS)
    gw = ok["c"]["arms"]["gpuwatchd"]
    assert gw["median_within"] and gw["worst_within"]
    assert ok["c"]["plain_range_ms"] == [6.5, 6.6] and ok["c"]["plain_worst_ms"] == 6.9
    burst = summarise([*plain, *again, proc("gpuwatchd", [6.5, 6.5, 11.4])], ["c"], ARMS)
    gw = burst["c"]["arms"]["gpuwatchd"]
    assert gw["median_within"] and not gw["worst_within"]
    assert gw["ratio_worst"] == pytest.approx(11.4 / 6.7)
    slow = summarise([*plain, *again, proc("gpuwatchd", [9.5, 9.5, 9.6])], ["c"], ARMS)
    assert not slow["c"]["arms"]["gpuwatchd"]["median_within"]
    assert "MEDIAN ABOVE, WORST ABOVE" in markdown(slow, ["c"], ARMS)


def test_a_failed_process_is_counted_not_timed() -> None:
    out = summarise(
        [proc("plain", [1.0, 1.0, 1.0]), {"cell": "c", "arm": "plain", "error": "exit 1"}],
        ["c"],
        ["plain"],
    )
    assert out["c"]["arms"]["plain"]["processes"] == 1
    assert out["c"]["arms"]["plain"]["failed"] == 1


def test_left_behind_names_every_change_but_the_applied_blas_library() -> None:
    before = {
        "threads": 1,
        "profiler_enabled": False,
        "profiler_flag": False,
        "cudnn.benchmark": False,
        "preferred_blas_library": "cublas",
    }
    after = dict(before, threads=2, preferred_blas_library="cublaslt")
    assert left_behind(before, after, "cublaslt") == ["threads: 1 -> 2"]
    assert left_behind(before, after, None) == [
        "threads: 1 -> 2",
        "preferred_blas_library: 'cublas' -> 'cublaslt'",
    ]
    on = dict(before, profiler_enabled=True)
    assert "a profiler is enabled" in left_behind(before, on, None)


def test_a_dry_run_forks_every_arm_and_writes_its_table(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cmd = [
        sys.executable,
        str(BENCH / "gpu_fresh_process_ab.py"),
        "ab",
        "--dry-run",
        "--out",
        str(tmp_path),
        "--max-rounds",
        "1",
    ]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    doc = json.loads((tmp_path / "fresh_ab.json").read_text())
    assert doc["rounds"] == 1 and doc["start"] == "fork"
    assert sorted(p["arm"] for p in doc["processes"]) == sorted(ARMS)
    assert len({p["pid"] for p in doc["processes"]}) == 3  # a process each
    for p in doc["processes"]:
        assert len(p["chunks_ms"]) == doc["cfg"]["chunks"] and p["worst_ms"] >= p["median_ms"]
    gw = next(p for p in doc["processes"] if p["arm"] == "gpuwatchd")
    assert gw["left_behind"] == []  # the dry run's capture() left nothing
    assert "tiny-nchw-fp32" in (tmp_path / "fresh_ab.md").read_text()
