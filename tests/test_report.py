"""``gpuwatchd report`` formatting, on the raw report JSON kept from real H200 runs, and
``report --fleet`` on a real SQLite store filled through the store API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import session_meta

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


# -- report --fleet: a real SQLite store filled through the store API ---------------------


def _fleet_store(path: Path) -> None:
    """Four H200 hosts at 700 W (one 8% under the rest), one H100 host; winners of two
    stacks; one disagreement between two H200 hosts."""
    import time

    from builders import candidate

    from gpuwatchd.store import sqlite_store
    from gpuwatchd.store.rows import HostClock, SessionMeta
    from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions, Workload

    now = time.time()
    stack = Versions(driver="580.159.04", cuda="12.8")
    with sqlite_store(path) as store:
        for host, mhz in (("node-a", 1440), ("node-b", 1450), ("node-c", 1430), ("node-d", 1325)):
            store.report_host_clock(
                HostClock(host, f"GPU-{host}", "NVIDIA H200", 700.0, mhz * 1e6, now)
            )
        store.report_host_clock(
            HostClock("node-h", "GPU-node-h", "NVIDIA H100 80GB HBM3", 700.0, 1.3e9, now)
        )
        store.report_host_clock(  # reported long ago: left out
            HostClock("node-old", "GPU-old", "NVIDIA H200", 700.0, 0.9e9, now - 86400)
        )

        def session(host: str, workload: str, times: dict[str, float], versions: Versions) -> None:
            regime = Regime.SUSTAINED
            work = Workload(workload, "matmul", {"m": 64, "n": 64, "k": 64}, "bf16", ("f",))
            meta = SessionMeta(
                f"GPU-{host}", 0, "NVIDIA H200", "sim", (work,), (regime,), versions, host=host
            )
            cands = tuple(
                candidate(n, regime, t) for n, t in sorted(times.items(), key=lambda kv: kv[1])
            )
            sid = store.start_session(meta)
            store.record_result(
                sid, RegimeResult(workload, regime, cands, cands[0].name, False, 0.2, 0.01)
            )
            store.finish_session(sid, SessionStatus.COMPLETED)

        session("node-a", "gemm", {"cublas": 1e-3, "triton": 2e-3}, stack)
        session("node-b", "gemm", {"cublas": 1.1e-3, "triton": 1e-3}, stack)  # disagrees
        session("node-a", "conv", {"cudnn": 1e-3}, stack)
        session("node-c", "gemm", {"cublas": 1e-3}, Versions(driver="575.57"))


def test_fleet_report_marks_the_slow_host_and_lists_disagreements_and_coverage(
    tmp_path: Path,
) -> None:
    from gpuwatchd.report.fleet import build_fleet_report, format_fleet_report
    from gpuwatchd.store import sqlite_store

    _fleet_store(tmp_path / "fleet.db")
    with sqlite_store(tmp_path / "fleet.db", readonly=True) as store:
        doc = build_fleet_report(store)
    h200, h100 = sorted(doc["groups"], key=lambda g: g["gpu_model"], reverse=True)
    assert h200["gpu_model"] == "NVIDIA H200" and h200["power_limit_w"] == "700"
    assert h200["peers"] == 4 and h200["median_sustained_clock_hz"] == 1435e6
    flagged = {g["host"]: g["outlier"] for g in h200["gpus"]}
    assert flagged == {"node-a": False, "node-b": False, "node-c": False, "node-d": True}
    assert h100["peers"] == 1 and not h100["gpus"][0]["outlier"]
    assert doc["disagreements"] == [
        {"gpu_model": "NVIDIA H200", "workload": "gemm", "regime": "sustained", "count": 1}
    ]
    (latest,) = doc["recent_disagreements"]
    assert (latest["kept_host"], latest["new_host"]) == ("node-a", "node-b")
    assert doc["coverage"] == [
        {"gpu_model": "NVIDIA H200", "versions": "driver=575.57", "workloads": 1},
        {"gpu_model": "NVIDIA H200", "versions": "driver=580.159.04,cuda=12.8", "workloads": 2},
    ]
    text = format_fleet_report(doc, all_gpus=True)
    (slow,) = [line for line in text.splitlines() if "node-d" in line]
    assert "1325" in slow and "-7.7%" in slow and "<< OUTLIER" in slow
    assert text.count("<< OUTLIER") == 2  # the legend and node-d
    assert "NVIDIA H200, 700 W: median 1435 MHz over 4 GPU(s)" in text
    assert "over 1 GPU(s); outliers need 3+" in text
    h200_lines = [line for line in text.splitlines() if line.startswith("node-")]
    assert h200_lines[0].startswith("node-d"), "outliers first"
    assert "cublas (node-a)" in text and "triton (node-b)" in text and "+10.0%" in text
    assert "node-old" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_fleet_report_summarises_groups_and_lists_only_the_outliers(tmp_path: Path) -> None:
    from gpuwatchd.report.fleet import build_fleet_report, format_fleet_report
    from gpuwatchd.store import sqlite_store

    _fleet_store(tmp_path / "fleet.db")
    with sqlite_store(tmp_path / "fleet.db", readonly=True) as store:
        text = format_fleet_report(build_fleet_report(store))
    lines = text.splitlines()
    groups = [line for line in lines if line.startswith("NVIDIA")][:2]
    assert groups[0].split()[:5] == ["NVIDIA", "H200,", "700", "W", "4"], "outliers first"
    assert groups[0].split()[-1] == "1" and "- (needs 3+)" in groups[1]
    hosts = [line for line in lines if line.startswith("node-")]
    assert len(hosts) == 1 and hosts[0].startswith("node-d") and "-7.7%" in hosts[0]
    assert "Outliers (1 of 5 GPUs), slowest first:" in text
    assert "(report --fleet --all lists every GPU)" in text


def test_report_fleet_command_table_json_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatchd.cli.main import main

    path = tmp_path / "fleet.db"
    _fleet_store(path)
    assert main(["report", "--fleet", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Sustained SM clocks") and "Tuning coverage" in out
    assert main(["report", "--fleet", "--store", str(path), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "gpuwatchd-fleet-report/1"
    arg = ["report", "--fleet", "--format", "json", "--gpu-model", "NVIDIA H100 80GB HBM3"]
    assert main([*arg, "--store", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["gpu_model"] for g in doc["groups"]] == ["NVIDIA H100 80GB HBM3"]
    assert doc["disagreements"] == [] and doc["coverage"] == []

    assert main(["report", "--fleet", "--store", str(tmp_path / "none.db")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"gpuwatchd: store {tmp_path / 'none.db'} does not exist"
    url = "postgresql://gpuwatchd:secret@127.0.0.1:1/gpuwatchd"
    assert main(["report", "--fleet", "--store", url]) == 1
    err = capsys.readouterr().err
    assert "holds a password" in err and "secret" not in err and len(err.splitlines()) == 1
    assert main(["report", "--fleet", "--plot", "x.png", "--store", str(path)]) == 2
    assert "--plot" in capsys.readouterr().err


def test_report_fleet_on_a_store_older_than_the_fleet_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatchd.cli.main import main
    from gpuwatchd.store import MIGRATIONS, sqlite_store

    with sqlite_store(tmp_path / "old.db", migrations=MIGRATIONS[:2]) as old:
        old.start_session(session_meta())  # a store holding nothing would read as empty
    assert main(["report", "--fleet", "--store", str(tmp_path / "old.db")]) == 1
    err = capsys.readouterr().err
    assert "schema version 2" in err and len(err.splitlines()) == 1


def test_report_fleet_on_an_empty_store_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatchd.cli.main import main
    from gpuwatchd.store import sqlite_store

    sqlite_store(tmp_path / "empty.db").close()
    assert main(["report", "--fleet", "--store", str(tmp_path / "empty.db")]) == 0
    out = capsys.readouterr().out
    assert "no host reported a learned sustained clock in the last 1800 s" in out
    assert "none recorded" in out and "no fresh winners" in out
