"""``gpuwatchd report`` formatting, on the raw report JSON kept from real H200 runs."""

from __future__ import annotations

import json
from pathlib import Path

from gpuwatchd.report.text import format_report

DATA = Path(__file__).parent.parent / "bench" / "data"


def test_h200_gemm_report_fixture_reads_as_ties_with_cublas_first():
    doc = json.loads((DATA / "h200-gemm-report.json").read_text())
    assert doc["winners_differ"] == {
        "gemm-bf16-8192": False,
        "gemm-bf16-4096x4096x16384": False,
    }
    rows = {(r["workload"], r["regime"]): r for r in doc["results"]}
    hot = rows[("gemm-bf16-8192", "sustained")]
    assert hot["tie"] and hot["winner"] is None
    assert all(c["sm_clock_hz"] < 0.8 * 1980e6 for c in hot["candidates"])
    assert all("sw_power_cap" in c["throttle_reasons"] for c in hot["candidates"])
    cool = rows[("gemm-bf16-8192", "unthrottled")]
    assert all(c["sm_clock_hz"] == 1980e6 for c in cool["candidates"])
    assert len([c for c in cool["candidates"] if c["family"] == "triton.matmul"]) >= 6
    text = format_report(doc)
    assert "tie: cublas " in text and "cublaslt" in text
    assert "WINNERS DIFFER" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_h200_conv_report_fixture_records_the_kernels_each_pick_launched():
    doc = json.loads((DATA / "h200-conv-report.json").read_text())
    for r in doc["results"]:
        for c in r["candidates"]:
            assert c["meta"]["kernels"], c["name"]
    l4 = {(r["regime"]): r for r in doc["results"] if r["workload"] == "conv-l4-report"}
    best = l4["unthrottled"]["candidates"][0]
    assert "channels_last" in best["name"]
    assert any("tf32" in k for k in best["meta"]["kernels"])
    assert "conv-l4-report" in format_report(doc)


def test_unthrottled_comes_first_in_the_json_and_the_table():
    """The store may hand back sustained first; every output lists unthrottled first."""
    from gpuwatchd.report.text import report_from
    from gpuwatchd.store.rows import StoredResult, Versions
    from gpuwatchd.tuning.types import CandidateStats, Regime, RegimeResult

    def result(workload: str, regime: Regime) -> StoredResult:
        cand = CandidateStats("k", "f", regime, 1e-3, 0.01, 5, 0, 1.98e9, 300.0, 50.0, None, 0)
        r = RegimeResult(workload, regime, (cand,), "k", False, 0.02, 0.005)
        return StoredResult(1, "GPU", "GPU-1", Versions(), 0.0, r)

    stored = [
        result("b", Regime.SUSTAINED),
        result("a", Regime.SUSTAINED),
        result("b", Regime.UNTHROTTLED),
        result("a", Regime.UNTHROTTLED),
    ]
    doc = report_from(stored)
    assert [(r["workload"], r["regime"]) for r in doc["results"]] == [
        ("b", "unthrottled"), ("b", "sustained"), ("a", "unthrottled"), ("a", "sustained"),
    ]  # fmt: skip
    text = format_report(doc).splitlines()
    rows = [line.split()[0] for line in text if line.startswith(("unthrottled", "sustained"))]
    assert rows == ["unthrottled", "sustained"] * 2
