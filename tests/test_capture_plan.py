"""Which recorded winner a job applies to each captured shape (no torch, no GPU): the cuDNN
pick and memory format per convolution, the BLAS library for the GEMMs."""

from __future__ import annotations

from pathlib import Path

import pytest
from capture_fakes import GPU_MODEL, client_with, result, stats

from gpuwatchd.jobside.winner_plan import latest_by_workload, plan_winners
from gpuwatchd.tuning.captured import CapturedCall, workload_for
from gpuwatchd.tuning.types import Regime

CONV_SHAPE = {
    "input": [64, 64, 56, 56],
    "weight": [64, 64, 3, 3],
    "stride": [1, 1],
    "padding": [1, 1],
    "dilation": [1, 1],
    "groups": 1,
}


def conv(layout: str = "contiguous", share: float = 0.3) -> CapturedCall:
    return CapturedCall(
        "conv2d", "convolution", "forward", "float16", CONV_SHAPE, layout, False, False, 4,
        share * 0.01, share,
    )  # fmt: skip


def gemm(m: int, layout: str = "nt", calls: int = 10) -> CapturedCall:
    return CapturedCall(
        "gemm", "mm", "forward", "bfloat16", {"batch": 1, "m": m, "n": 1024, "k": 1024}, layout,
        False, False, calls, 0.001, 0.1,
    )  # fmt: skip


def cudnn(pick: str, fmt: str, median: float) -> object:
    meta = {"pick": pick, "memory_format": fmt}
    return stats(f"cudnn[{pick},{fmt}]", "torch.conv2d", median, meta)


@pytest.fixture
def winners(tmp_path: Path) -> dict[str, object]:
    conv_name = workload_for(conv()).name
    results = [
        result(
            conv_name,
            [
                cudnn("benchmark", "channels_last", 0.50e-3),  # the overall winner
                cudnn("heuristic", "contiguous", 0.70e-3),  # fastest in NCHW
                cudnn("benchmark", "contiguous", 0.80e-3),
                cudnn("heuristic", "channels_last", None),  # failed: never measured
            ],
        ),
        # 10 calls: cublas 1.0 ms, cublaslt 1.1 ms
        result(
            workload_for(gemm(8192)).name,
            [stats("cublas", "torch.gemm", 1.0e-4), stats("cublaslt", "torch.gemm", 1.1e-4)],
        ),
        # 10 calls: cublaslt wins by far more
        result(
            workload_for(gemm(4096)).name,
            [stats("cublas", "torch.gemm", 3.0e-4), stats("cublaslt", "torch.gemm", 2.0e-4)],
        ),
    ]
    client = client_with(tmp_path, results)
    return latest_by_workload(client.winners(regime=Regime.SUSTAINED, gpu_model=GPU_MODEL))


def test_keep_takes_the_fastest_choice_in_the_models_own_format(winners: dict) -> None:
    plan = plan_winners([conv()], winners, "keep")
    (choice,) = plan.convs
    assert (choice.pick, choice.memory_format, choice.converts) == (
        "heuristic",
        "contiguous",
        False,
    )
    assert choice.median_s == pytest.approx(0.70e-3)


def test_keep_with_a_channels_last_model_skips_the_unmeasured_choice(winners: dict) -> None:
    (choice,) = plan_winners([conv("channels_last")], winners, "keep").convs
    assert (choice.pick, choice.memory_format) == ("benchmark", "channels_last")


def test_winner_takes_the_overall_winner_and_says_it_converts(winners: dict) -> None:
    (choice,) = plan_winners([conv()], winners, "winner").convs
    assert choice.candidate == "cudnn[benchmark,channels_last]" and choice.converts


def test_blas_library_minimises_the_estimated_gemm_time(winners: dict) -> None:
    plan = plan_winners([gemm(8192), gemm(4096)], winners)
    assert plan.blas.library == "cublaslt" and plan.blas.shapes == 2
    assert plan.blas.estimated_s["cublas"] == pytest.approx(10 * 1.0e-4 + 10 * 3.0e-4)
    assert plan.blas.estimated_s["cublaslt"] == pytest.approx(10 * 1.1e-4 + 10 * 2.0e-4)


def test_call_counts_weigh_the_blas_choice(winners: dict) -> None:
    plan = plan_winners([gemm(8192, calls=100), gemm(4096, calls=1)], winners)
    assert plan.blas.library == "cublas"


def test_shapes_without_winners_are_skipped_and_said(winners: dict) -> None:
    plan = plan_winners([gemm(2048), conv()], winners)
    assert plan.blas.library is None
    assert [name for name, _ in plan.skipped] == [workload_for(gemm(2048)).name]
    assert "no winner recorded" in plan.describe()


def test_a_bad_memory_format_option_is_refused(winners: dict) -> None:
    with pytest.raises(ValueError, match="memory_format"):
        plan_winners([conv()], winners, "nhwc")
