"""Which recorded winner a job applies to each captured shape (no torch, no GPU): the cuDNN
pick per convolution in the job's own layouts, the whole model's memory format, the BLAS
library for the GEMMs; the job's default stays unless a choice beats it beyond the noise."""

from __future__ import annotations

from pathlib import Path

import pytest
from capture_fakes import GPU_MODEL, client_with, result, stats

from gpuwatchd.jobside.winner_plan import latest_by_workload, measured_layouts, plan_winners
from gpuwatchd.tuning.submitted.captured import CapturedCall, workload_for
from gpuwatchd.tuning.types import Regime

CONV_SHAPE = {
    "input": [64, 64, 56, 56],
    "weight": [64, 64, 3, 3],
    "stride": [1, 1],
    "padding": [1, 1],
    "dilation": [1, 1],
    "groups": 1,
}


def conv(
    layout: str = "contiguous",
    share: float = 0.3,
    weight_layout: str | None = None,
    channels: int = 64,
) -> CapturedCall:
    shape = dict(CONV_SHAPE, input=[64, channels, 56, 56], weight=[64, channels, 3, 3])
    return CapturedCall(
        "conv2d", "convolution", "forward", "float16", shape, layout, False, False, 4,
        share * 0.01, share, weight_layout,
    )  # fmt: skip


def gemm(m: int, layout: str = "nt", calls: int = 10) -> CapturedCall:
    return CapturedCall(
        "gemm", "mm", "forward", "bfloat16", {"batch": 1, "m": m, "n": 1024, "k": 1024}, layout,
        False, False, calls, 0.001, 0.1,
    )  # fmt: skip


def cudnn(
    pick: str,
    fmt: str,
    median: float | None,
    beats: bool | None = None,
    noise: float = 0.01,
    weight_fmt: str | None = None,
) -> object:
    """A ``torch.conv2d`` candidate; ``beats``: the worker's verdict against the default
    (None: the default itself, or a row recorded without one)."""
    w_fmt = weight_fmt or fmt
    meta: dict[str, object] = {
        "pick": pick,
        "memory_format": fmt if fmt == w_fmt else "mixed",
        "input_layout": fmt,
        "weight_layout": w_fmt,
    }
    if beats is not None:
        meta["vs_default"] = {"margin": 0.1 if beats else 0.0, "noise": noise, "beats": beats}
    label = fmt if fmt == w_fmt else f"x:{fmt}+w:{w_fmt}"
    return stats(f"cudnn[{pick},{label}]", "torch.conv2d", median, meta)


def blas(name: str, median: float, beats: bool | None = None, noise: float = 0.01) -> object:
    meta: dict[str, object] = {"job_default": name == "cublas"}
    if beats is not None:
        meta["vs_default"] = {"margin": 0.1 if beats else 0.0, "noise": noise, "beats": beats}
    return stats(name, "torch.gemm", median, meta)


def plan_for(tmp_path: Path, calls: list[CapturedCall], results: dict, fmt: str = "keep"):
    rows = [result(name, cands) for name, cands in results.items()]
    client = client_with(tmp_path, rows)
    won = latest_by_workload(client.winners(regime=Regime.SUSTAINED, gpu_model=GPU_MODEL))
    return plan_winners(calls, won, fmt)


@pytest.fixture
def winners(tmp_path: Path) -> dict[str, object]:
    conv_name = workload_for(conv()).name
    results = [
        result(
            conv_name,
            [
                cudnn("benchmark", "channels_last", 0.50e-3, beats=True),  # model-wide only
                cudnn("heuristic", "contiguous", 0.70e-3),  # the job's default
                cudnn("benchmark", "contiguous", 0.69e-3, beats=False),  # within the noise
                cudnn("heuristic", "channels_last", None),  # failed: never measured
            ],
        ),
        # 10 calls: cublas 1.0 ms, cublaslt 1.1 ms
        result(
            workload_for(gemm(8192)).name,
            [blas("cublas", 1.0e-4), blas("cublaslt", 1.1e-4, beats=False)],
        ),
        # 10 calls: cublaslt wins by far more
        result(
            workload_for(gemm(4096)).name,
            [blas("cublas", 3.0e-4), blas("cublaslt", 2.0e-4, beats=True)],
        ),
    ]
    client = client_with(tmp_path, results)
    return latest_by_workload(client.winners(regime=Regime.SUSTAINED, gpu_model=GPU_MODEL))


def test_keep_keeps_the_default_when_nothing_beats_it_beyond_the_noise(winners: dict) -> None:
    plan = plan_winners([conv()], winners, "keep")
    (choice,) = plan.convs
    assert (choice.pick, choice.layouts, choice.kept_default) == (
        "heuristic",
        ("contiguous", "contiguous"),
        True,
    )
    assert not choice.acts and choice.median_s == pytest.approx(0.70e-3)
    assert plan.model_format is None
    assert "default kept" in plan.describe()


def test_keep_takes_a_pick_that_beats_the_default_in_the_jobs_own_layouts(
    tmp_path: Path,
) -> None:
    name = workload_for(conv()).name
    cands = [
        cudnn("heuristic", "contiguous", 0.70e-3),
        cudnn("benchmark", "contiguous", 0.60e-3, beats=True),
    ]
    (choice,) = plan_for(tmp_path, [conv()], {name: cands}).convs
    assert (choice.pick, choice.kept_default, choice.acts) == ("benchmark", False, True)


def test_a_benchmark_pick_that_is_not_reproducible_is_never_applied(tmp_path: Path) -> None:
    name = workload_for(conv()).name
    flaky = cudnn("benchmark", "contiguous", 0.50e-3, beats=True)
    flaky.meta["reproducible"] = False  # made again, cuDNN landed on other kernels
    steady = cudnn("benchmark", "contiguous", 0.60e-3, beats=True)
    steady.meta["kernels"] = ["k_steady"]
    default = cudnn("heuristic", "contiguous", 0.70e-3)
    (choice,) = plan_for(tmp_path, [conv()], {name: [flaky, default]}).convs
    assert choice.kept_default
    (choice,) = plan_for(tmp_path / "b", [conv()], {name: [steady, default]}).convs
    assert (choice.pick, choice.kernels) == ("benchmark", ("k_steady",))


def test_a_recorded_pick_without_a_verdict_against_the_default_never_replaces_it(
    tmp_path: Path,
) -> None:
    name = workload_for(conv()).name
    cands = [cudnn("heuristic", "contiguous", 0.70e-3), cudnn("benchmark", "contiguous", 0.5e-3)]
    (choice,) = plan_for(tmp_path, [conv()], {name: cands}).convs
    assert choice.kept_default and choice.pick == "heuristic"


def test_a_channels_last_job_is_planned_in_channels_last(tmp_path: Path) -> None:
    call = conv("channels_last")
    cands = [
        cudnn("heuristic", "channels_last", 0.50e-3),
        cudnn("benchmark", "channels_last", 0.40e-3, beats=True),
        cudnn("benchmark", "contiguous", 0.30e-3, beats=True),  # model-wide only
    ]
    (choice,) = plan_for(tmp_path, [call], {workload_for(call).name: cands}).convs
    assert (choice.pick, choice.layouts) == ("benchmark", ("channels_last", "channels_last"))


def test_a_mixed_layout_job_is_measured_and_planned_as_it_runs(tmp_path: Path) -> None:
    """NCHW activations into a channels_last weight: the job's own pair, conversion included."""
    call = conv(weight_layout="channels_last")
    assert call.layouts == ("contiguous", "channels_last")
    w = workload_for(call)
    assert w.params["input_layout"] == "contiguous"
    assert w.params["weight_layout"] == "channels_last"
    assert w.name != workload_for(conv()).name
    cands = [
        cudnn("heuristic", "contiguous", 0.70e-3, weight_fmt="channels_last"),
        cudnn("heuristic", "channels_last", 0.30e-3, beats=True),  # model-wide only
    ]
    plan = plan_for(tmp_path, [call], {w.name: cands})
    (choice,) = plan.convs
    assert choice.layouts == ("contiguous", "channels_last") and choice.kept_default


def test_winner_converts_the_whole_model_when_the_summed_convs_beat_the_noise(
    winners: dict,
) -> None:
    plan = plan_winners([conv()], winners, "winner")
    assert plan.model_format == "channels_last"
    (choice,) = plan.convs
    assert choice.candidate == "cudnn[benchmark,channels_last]" and choice.acts
    assert "model and input: channels_last" in plan.describe()


def test_winner_never_converts_when_one_shape_lacks_the_format(tmp_path: Path) -> None:
    other = conv(share=0.2, channels=128)
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 0.70e-3),
            cudnn("heuristic", "channels_last", 0.30e-3, beats=True),
        ],
        workload_for(other).name: [cudnn("heuristic", "contiguous", 0.70e-3)],
    }
    plan = plan_for(tmp_path, [conv(), other], results, "winner")
    assert plan.model_format is None
    assert all(c.layouts == ("contiguous", "contiguous") for c in plan.convs)
    assert "not measured in channels_last" in plan.model_format_reason


def test_winner_keeps_the_format_when_the_gain_is_within_the_noise(tmp_path: Path) -> None:
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 0.70e-3),
            cudnn("heuristic", "channels_last", 0.69e-3, beats=False, noise=0.05),
        ]
    }
    plan = plan_for(tmp_path, [conv()], results, "winner")
    assert plan.model_format is None and plan.convs[0].kept_default


def test_a_small_noisy_shape_does_not_veto_a_large_summed_gain(tmp_path: Path) -> None:
    """The noise is weighed by each shape's time: a shape that is 2% of the conv time with
    a 150% noise adds 3%, against a 40% gain."""
    small = conv(share=0.02, channels=128)
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 1.00e-3),
            cudnn("heuristic", "channels_last", 0.55e-3, beats=True, noise=0.01),
        ],
        workload_for(small).name: [
            cudnn("heuristic", "contiguous", 0.02e-3),
            cudnn("heuristic", "channels_last", 0.02e-3, beats=False, noise=1.5),
        ],
    }
    plan = plan_for(tmp_path, [conv(), small], results, "winner")
    assert plan.model_format == "channels_last", plan.model_format_reason
    assert all(c.layouts == ("channels_last", "channels_last") for c in plan.convs)


def test_a_gain_within_the_time_weighted_noise_keeps_the_format(tmp_path: Path) -> None:
    other = conv(share=0.2, channels=128)
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 1.00e-3),
            cudnn("heuristic", "channels_last", 0.90e-3, beats=True, noise=0.12),
        ],
        workload_for(other).name: [
            cudnn("heuristic", "contiguous", 1.00e-3),
            cudnn("heuristic", "channels_last", 0.90e-3, beats=True, noise=0.12),
        ],
    }
    plan = plan_for(tmp_path, [conv(), other], results, "winner")
    assert plan.model_format is None
    assert "does not beat the kept choices beyond the noise 12.0%" in plan.model_format_reason


@pytest.mark.parametrize("noise", [-1e9, True, "0.01"])
def test_a_stored_noise_that_is_not_a_fraction_never_switches_the_model(
    tmp_path: Path, noise: object
) -> None:
    """Stored rows are untrusted: a negative noise must not make a slower format win."""
    small = conv(share=0.02, channels=128)
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 1.00e-3),
            cudnn("heuristic", "channels_last", 1.40e-3, beats=False, noise=0.01),
        ],
        workload_for(small).name: [
            cudnn("heuristic", "contiguous", 0.02e-3),
            cudnn("heuristic", "channels_last", 0.02e-3, beats=False, noise=noise),  # type: ignore[arg-type]
        ],
    }
    plan = plan_for(tmp_path, [conv(), small], results, "winner")
    assert plan.model_format is None
    assert "no noise recorded" in plan.model_format_reason


def test_a_shape_without_its_own_default_blocks_the_model_format(tmp_path: Path) -> None:
    """A shape the plan could not weigh (no default measured) is never switched unseen."""
    other = conv(share=0.2, channels=128)
    results = {
        workload_for(conv()).name: [
            cudnn("heuristic", "contiguous", 1.00e-3),
            cudnn("heuristic", "channels_last", 0.50e-3, beats=True),
        ],
        workload_for(other).name: [cudnn("heuristic", "channels_last", 0.50e-3, beats=True)],
    }
    plan = plan_for(tmp_path, [conv(), other], results, "winner")
    assert plan.model_format is None
    assert "default was not measured" in plan.model_format_reason


def test_a_shape_whose_default_was_never_measured_is_skipped(tmp_path: Path) -> None:
    results = {workload_for(conv()).name: [cudnn("benchmark", "contiguous", 0.5e-3, beats=True)]}
    plan = plan_for(tmp_path, [conv()], results)
    assert plan.convs == ()
    assert "default was not measured" in plan.describe()


def test_blas_library_changes_only_when_it_beats_the_default_beyond_the_noise(
    winners: dict,
) -> None:
    plan = plan_winners([gemm(8192), gemm(4096)], winners)
    assert plan.blas.library == "cublaslt" and plan.blas.shapes == 2
    assert plan.blas.estimated_s["cublas"] == pytest.approx(10 * 1.0e-4 + 10 * 3.0e-4)
    assert plan.blas.estimated_s["cublaslt"] == pytest.approx(10 * 1.1e-4 + 10 * 2.0e-4)
    # the 8192 shape's own best is the default; the process-wide choice gives up 10% there
    ((name, best, loss),) = plan.blas.given_up
    assert (name, best) == (workload_for(gemm(8192)).name, "cublas")
    assert loss == pytest.approx(0.10)
    assert "10.0% slower with cublaslt" in plan.describe()


def test_call_counts_weigh_the_blas_choice_and_the_default_stays(winners: dict) -> None:
    plan = plan_winners([gemm(8192, calls=100), gemm(4096, calls=1)], winners)
    assert plan.blas.library is None and plan.blas.default == "cublas"
    assert "default kept" in plan.describe()


def test_a_blas_gain_within_the_noise_keeps_the_default(tmp_path: Path) -> None:
    results = {
        workload_for(gemm(4096)).name: [
            blas("cublas", 1.00e-4),
            blas("cublaslt", 0.99e-4, beats=False, noise=0.02),
        ]
    }
    plan = plan_for(tmp_path, [gemm(4096)], results)
    assert plan.blas.library is None
    assert "does not beat cublas beyond the noise" in plan.blas.reason


def test_shapes_without_winners_are_skipped_and_said(winners: dict) -> None:
    plan = plan_winners([gemm(2048), conv()], winners)
    assert plan.blas.library is None and plan.blas.estimated_s == {}
    assert [name for name, _ in plan.skipped] == [workload_for(gemm(2048)).name]
    assert "no winner recorded" in plan.describe()


def test_a_bad_memory_format_option_is_refused(winners: dict) -> None:
    with pytest.raises(ValueError, match="memory_format"):
        plan_winners([conv()], winners, "nhwc")


def test_measured_layouts_leave_out_a_candidate_that_was_never_measured(
    tmp_path: Path,
) -> None:
    name = workload_for(conv()).name
    cands = [cudnn("heuristic", "contiguous", 0.70e-3), cudnn("heuristic", "channels_last", None)]
    client = client_with(tmp_path, [result(name, cands)])
    won = latest_by_workload(client.winners(regime=Regime.SUSTAINED, gpu_model=GPU_MODEL))
    assert measured_layouts(won[name]) == {("contiguous", "contiguous")}
