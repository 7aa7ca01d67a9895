"""``gpuwatchd tune`` and ``gpuwatchd report`` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


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
    # It had to wait: the scenario's foreign matmul job holds the GPU first.
    assert "waiting for the gate (busy" in res.stdout
    assert "WINNERS DIFFER" in res.stdout

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
    assert len(result["candidates"]) >= 2
    assert all(c["median_s"] > 0 and c["samples"] > 0 for c in result["candidates"])


def test_no_wait_fails_fast_when_the_gate_is_shut(tmp_path: Path):
    res = gpuwatchd(
        "tune", "--backend", "sim", "--scenario", "heat-soak", "--workload", "sim-gemm",
        "--no-wait", "--store", str(tmp_path / "g.db"),
    )  # fmt: skip
    assert res.returncode == 3, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "gate is shut (busy" in err[0]


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
    from gpuwatchd.store import Store

    Store(tmp_path / "g.db").close()
    res = gpuwatchd("report", "--store", str(tmp_path / "g.db"))
    assert res.returncode == 0 and "no tuning results yet" in res.stdout
