"""The ResNet-50 A/B bench's figures without a GPU: the Williams order of the arms,
per-round ratios with a CI of their median, verdicts, the profiler segments that prove
which kernels each arm ran, the table of a run (median-only data files included), and what
the tune stage still lacks in the store."""

from __future__ import annotations

import itertools
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from capture_fakes import GPU_MODEL, client_with, result
from resnet_ab_stats import (
    AA,
    ARMS,
    BASE,
    GW,
    load_runs,
    ratio_cell,
    split_segments,
    summarise,
    verdict,
    williams_orders,
)
from resnet_tune_coverage import coverage_gaps
from test_capture_plan import conv, cudnn

from gpuwatchd.jobside.winner_plan import latest_by_workload
from gpuwatchd.tuning.submitted.captured import workload_for
from gpuwatchd.tuning.types import Regime
from gpuwatchd.tuning.worker.cuda_session import KernelLaunch, kernel_launches_in


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_williams_orders_balance_positions_and_the_arm_timed_before(n: int) -> None:
    orders = williams_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    per_position = {(pos, arm) for o in orders for pos, arm in enumerate(o)}
    assert len(per_position) == n * n
    positions = [sum(o[pos] == arm for o in orders) for pos in range(n) for arm in range(n)]
    assert len(set(positions)) == 1
    pairs = [(a, b) for o in orders for a, b in itertools.pairwise(o)]
    counts = {p: pairs.count(p) for p in itertools.permutations(range(n), 2)}
    assert len(set(counts.values())) == 1 and min(counts.values()) >= 1


def test_williams_orders_refuse_no_arms() -> None:
    with pytest.raises(ValueError, match="at least one arm"):
        williams_orders(0)


def test_per_round_ratios_cancel_drift_that_moves_every_arm_of_a_round() -> None:
    drift = [1.0, 1.3, 0.8, 1.1, 0.95, 1.2, 1.05, 0.9]
    times = {
        BASE: [1e-4 * d for d in drift],
        AA: [1e-4 * d for d in drift],
        GW: [1.02e-4 * d for d in drift],
    }
    cell = ratio_cell(times)
    assert cell[AA]["ratio"] == pytest.approx(1.0)
    assert cell[AA]["ci"] == pytest.approx([1.0, 1.0])
    assert cell[GW]["ratio"] == pytest.approx(1.02)
    assert cell[GW]["rounds"] == len(drift)
    assert verdict(cell[GW]) == "slower"
    assert verdict(cell[AA]) == "within"


def test_ratio_cell_refuses_arms_with_different_round_counts() -> None:
    with pytest.raises(ValueError, match="rounds"):
        ratio_cell({BASE: [1.0, 1.0], GW: [1.0]})


@pytest.mark.parametrize(
    ("ci", "expected"),
    [
        ([0.97, 0.99], "faster"),
        ([0.99, 1.01], "within"),
        ([1.011, 1.03], "slower"),
        ([0.995, 1.02], "unresolved"),
        (None, "no CI"),
    ],
)
def test_verdict_reads_the_ci_against_the_limit(ci: list[float] | None, expected: str) -> None:
    cell = {"ratio": 1.0, **({"ci": ci} if ci else {})}
    assert verdict(cell) == expected


def launch(name: str, grid: tuple[int, ...] = (1, 1, 1)) -> KernelLaunch:
    return KernelLaunch(name, grid, (128, 1, 1))


def test_profiler_segments_are_cut_at_the_marker_kernels() -> None:
    marker = launch("at::cuda::(anonymous namespace)::spin_kernel(long)")
    seq = [
        marker, launch("conv_a"), launch("conv_a"), launch("nchwToNhwc"),
        marker, launch("conv_a", (2, 1, 1)),
        marker,
    ]  # fmt: skip
    parts = split_segments(seq, 3)
    assert parts == [
        [launch("conv_a"), launch("nchwToNhwc")],
        [launch("conv_a", (2, 1, 1))],
        [],
    ]
    assert parts[0][0] != parts[1][0]  # same name, another grid: not the same launch
    with pytest.raises(ValueError, match="2 marked segments for 3"):
        split_segments(seq[:6], 3)


def test_kernel_launches_are_read_from_a_chrome_trace_with_their_grid_and_block() -> None:
    def kernel(name: str, ts: int, grid: object, block: object = None) -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "args": {"grid": grid, "block": block}}

    trace = {
        "traceEvents": [
            kernel("k2", 20, [4, 1, 1], [256, 1, 1]),
            kernel("k1", 10, [8, 2, 1], [128, 1, 1]),
            kernel("k1", 30, [8, 2, 1], [128, 1, 1]),
            kernel("k3", 40, "bad", None),
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 6},
        ]
    }
    distinct = kernel_launches_in(trace)
    assert [k.describe() for k in distinct] == [
        "k1 <<<8x2x1, 128x1x1>>>",
        "k2 <<<4x1x1, 256x1x1>>>",
        "k3 <<<?, ?>>>",
    ]
    assert [k.name for k in kernel_launches_in(trace, distinct=False)] == ["k1", "k2", "k1", "k3"]
    assert kernel_launches_in({"traceEvents": "junk"}) == []


def _cell(ratio: float, lo: float, hi: float) -> dict[str, object]:
    return {"ratio": ratio, "ci": [lo, hi], "rounds": 20, "median_s": 1e-4}


def new_doc() -> dict[str, object]:
    """One variant as the ab stage writes it: two layers, one where nothing was applied
    but the gpuwatchd arm launched other kernels than the default."""
    arms = {a: _cell(1.0, 0.998, 1.002) for a in ARMS}
    return {
        "variant": "nchw-fp16",
        "layers": {
            "model.conv.a": {
                "choice": "cudnn[heuristic,contiguous]", "applied": False, "share": 0.01,
                "arms": {**arms, GW: _cell(1.004, 0.999, 1.006)},
                "same_launches": {a: True for a in ARMS},
            },
            "model.conv.b": {
                "choice": "cudnn[heuristic,contiguous]", "applied": False, "share": 0.01,
                "arms": {**arms, GW: _cell(0.97, 0.965, 0.975)},
                "same_launches": {**{a: True for a in ARMS}, GW: False},
            },
        },
        "step": {a: _cell(1.0, 0.999, 1.001) for a in ARMS},
    }  # fmt: skip


def test_summary_gives_verdicts_and_names_a_layer_that_ran_other_kernels_unapplied() -> None:
    out = summarise({"nchw-fp16": new_doc()})
    c = out["counts"]
    assert c["layers"] == 2
    assert c["gw_verdicts"] == {"within": 1, "faster": 1}
    assert c["aa_verdicts"] == {"within": 2}
    assert c["not_applied_other_kernels"] == ["nchw-fp16 model.conv.b"]
    assert c["not_applied_unprofiled"] == 0
    assert c["faster"] == [
        {"variant": "nchw-fp16", "layer": "model.conv.b", "by": pytest.approx(0.03)}
    ]
    assert "| nchw-fp16 | model.conv.b | cudnn[heuristic,contiguous] | no | NO |" in out["table"]
    assert "1.0040 [0.9990, 1.0060]" in out["table"]
    assert c["step"] == {"nchw-fp16": {"ratio": 1.0, "verdict": "within"}}


def old_doc() -> dict[str, object]:
    """A median-only variant: bare median ratios per layer, quartiles per step."""
    return {
        "layers": {
            "model.conv.a": {"choice": "c", "applied": False, "share": 0.01,
                             GW: 1.037, AA: 0.99, "bench_cool": 1.2, "bench_loaded": 1.1},
            "model.conv.b": {"choice": "c", "applied": True, "share": 0.01,
                             GW: 1.011, AA: 1.001, "bench_cool": 1.0, "bench_loaded": 1.0},
        },
        "step": {a: {"median_s": 0.01, "ratio_to_default": 1.001, "ratio_q1": 0.99,
                     "ratio_q3": 1.01} for a in ARMS},
    }  # fmt: skip


def test_a_median_only_data_file_is_summarised_without_a_ci(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"machine": "m", "date": "d", "final": {"nchw-fp16": old_doc()}}))
    runs = load_runs(path)
    assert list(runs) == ["final"]
    c = summarise(runs["final"])["counts"]
    assert c["gw_verdicts"] == {"no CI": 2}
    assert (c["gw_median_over_limit"], c["gw_median_over_limit_not_applied"]) == (2, 1)
    assert c["aa_largest_deviation"] == pytest.approx(0.01)
    assert c["not_applied_unprofiled"] == 1  # no kernels recorded per arm


def test_runs_load_from_the_ab_archive_and_from_one_variant_file(tmp_path: Path) -> None:
    one = tmp_path / "ab-nchw-fp16.json"
    one.write_text(json.dumps(new_doc()))
    with tarfile.open(tmp_path / "ab.tar.gz", "w:gz") as tar:
        tar.add(one, arcname=one.name)
    assert list(load_runs(tmp_path / "ab.tar.gz")["ab.tar.gz"]) == ["nchw-fp16"]
    assert list(load_runs(one)["ab-nchw-fp16.json"]) == ["nchw-fp16"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"machine": "m"}))
    with pytest.raises(ValueError, match="no A/B run"):
        load_runs(bad)


def test_tune_coverage_names_shapes_without_a_winner_or_the_other_format(
    tmp_path: Path,
) -> None:
    stem = conv(share=0.3, channels=3)
    body = conv(share=0.2, channels=64)
    tail = conv(share=0.1, channels=128)
    rows = [
        result(
            workload_for(body).name,
            [cudnn("heuristic", "contiguous", 0.7e-3), cudnn("heuristic", "channels_last", 0.6e-3)],
        ),
        result(workload_for(tail).name, [cudnn("heuristic", "contiguous", 0.7e-3)]),
    ]
    client = client_with(tmp_path, rows)
    winners = latest_by_workload(client.winners(regime=Regime.SUSTAINED, gpu_model=GPU_MODEL))
    names = {workload_for(c).name for c in (stem, body, tail)}
    calls = [stem, body, tail]
    assert coverage_gaps(calls, names, winners, every_shape=True) == {
        workload_for(stem).name: "no winner recorded",
        workload_for(tail).name: "not measured in channels_last",
    }
    # only the top shapes tuned: the model-wide format is never weighed, so no format gap
    assert coverage_gaps(calls, names, winners, every_shape=False) == {
        workload_for(stem).name: "no winner recorded"
    }
    # a shape nobody submitted is no gap of this run
    assert coverage_gaps(calls, {workload_for(body).name}, winners, every_shape=True) == {}
